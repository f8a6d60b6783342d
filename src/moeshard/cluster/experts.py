"""Checkpoint headers -> the MoE layout a model built from them has: experts modules (one per
MoE layer), their fused parameters (as the adapters fuse per-expert keys), dense keys."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..io.checkpoint import CheckpointIndex
from ..models.adapters import ExpertParam

__all__ = ["ExpertModule", "MoeLayout", "find_experts"]

_EXPERT_KEY = re.compile(r"^(?P<module>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<suffix>.+)$")
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")

@dataclass(frozen=True)
class ExpertModule:
    """One experts module (MoE ``layer`` index) and its fused parameters."""

    layer: int
    module: str
    params: tuple[ExpertParam, ...]


@dataclass(frozen=True)
class MoeLayout:
    """What the checkpoint holds: experts modules (in layer order), ``num_logical`` experts
    each, dense keys (file order), and keys skipped (layers the model does not have)."""

    experts: tuple[ExpertModule, ...]
    num_logical: int
    dense_keys: tuple[str, ...]
    skipped_keys: tuple[str, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.experts)


def _natural(s: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s))


# Per-expert checkpoint parts fused into one parameter, as HF_EXPERTS / MIXTRAL_EXPERTS do:
# (first part prefix, second part prefix, fused name); weights and their scales/biases alike.
_FUSED = (("gate_proj.", "up_proj.", "gate_up_proj"), ("w1.", "w3.", "gate_up_proj"))
_SINGLE = {"down_proj.": "down_proj", "w2.": "down_proj"}


def _expert_params(module: str, suffixes: list[str], index: CheckpointIndex) -> tuple[ExpertParam, ...]:
    """Fused parameters of one experts module from the suffixes of expert 0's keys."""
    info = {s: index.info(f"{module}.0.{s}") for s in suffixes}
    used: set[str] = set()
    params: list[ExpertParam] = []

    def name_of(base: str, rest: str) -> str:
        return base if rest == "weight" else f"{base}_{rest.replace('.', '_')}"

    for s in suffixes:
        if s in used:
            continue
        for first, second, fused in _FUSED:
            if s.startswith(first):
                rest = s[len(first):]
                other = second + rest
                a, b = info[s], info.get(other)
                # Parts concatenate along dim 0 of the slice: same dtype, same trailing dims.
                if b is not None and a.dtype == b.dtype and len(a.shape) >= 1 and a.shape[1:] == b.shape[1:] \
                        and len(a.shape) == len(b.shape):
                    params.append(ExpertParam(name_of(fused, rest), (f"{{e}}.{s}", f"{{e}}.{other}")))
                    used.update((s, other))
                break
        if s in used:
            continue
        base = next((v for k, v in _SINGLE.items() if s.startswith(k)), None)
        name = name_of(base, s.split(".", 1)[1]) if base else s.replace(".", "_")
        params.append(ExpertParam(name, (f"{{e}}.{s}",)))
        used.add(s)
    return tuple(params)


def find_experts(index: CheckpointIndex, num_hidden_layers: int | None = None) -> MoeLayout:
    """Experts modules of a checkpoint from its per-expert keys (``<module>.experts.<e>.<rest>``).

    ``num_hidden_layers`` (from the checkpoint's config.json): keys of decoder layers at or
    beyond it are skipped (DeepSeek-V3's multi-token-prediction layer 61, which transformers
    does not load). Raises ValueError for a checkpoint without experts (not MoE) or experts
    modules that disagree (expert ids not 0..E-1, a tensor missing for some expert).
    """
    modules: dict[str, dict[str, set[int]]] = {}
    dense: list[str] = []
    skipped: list[str] = []
    for key in index.tensors:
        if num_hidden_layers is not None:
            m = _LAYER_KEY.search(key)
            if m and int(m.group(1)) >= num_hidden_layers:
                skipped.append(key)
                continue
        m = _EXPERT_KEY.match(key)
        if m is None:
            dense.append(key)
            continue
        modules.setdefault(m.group("module"), {}).setdefault(m.group("suffix"), set()).add(int(m.group("e")))
    if not modules:
        raise ValueError(
            f"checkpoint {index.root} has no per-expert tensors (keys like '<module>.experts.<e>.gate_proj.weight'): "
            "not a MoE checkpoint"
        )
    num_logical = None
    experts = []
    for layer, module in enumerate(sorted(modules, key=_natural)):
        by_suffix = modules[module]
        for suffix, ids in sorted(by_suffix.items()):
            n = len(ids)
            if ids != set(range(n)):
                missing = sorted(set(range(max(ids) + 1)) - ids)[:8]
                raise ValueError(f"checkpoint {index.root}: {module}.<e>.{suffix} lacks experts {missing}")
            if num_logical is None:
                num_logical = n
            elif n != num_logical:
                raise ValueError(
                    f"checkpoint {index.root}: {module}.<e>.{suffix} has {n} experts, other experts tensors "
                    f"have {num_logical}"
                )
        suffixes = sorted(by_suffix, key=lambda s: (index.info(f"{module}.0.{s}").file, index.info(f"{module}.0.{s}").offset))
        experts.append(ExpertModule(layer, module, _expert_params(module, suffixes, index)))
    order = {k: (t.file, t.offset) for k, t in index.tensors.items()}
    dense.sort(key=order.__getitem__)
    assert num_logical is not None
    return MoeLayout(tuple(experts), num_logical, tuple(dense), tuple(skipped))
