"""Checkpoint headers -> the MoE layout a model built from them has: experts modules (one per
MoE layer), their fused parameters (as the adapters fuse per-expert keys), dense keys.

Which keys are experts is :mod:`moeshard.io.formats`' call (the recognizer ``moeshard
inspect`` and the load path use too); this module adds what ``moeshard plan`` needs on top:
layers the model does not load left out, and the model's parameter names."""

from __future__ import annotations

from dataclasses import dataclass

from ..io.formats import MoeFormat, check, layer_of, recognize
from ..io.index import CheckpointIndex
from ..models.adapters import ExpertParam, expert_params

__all__ = ["ExpertModule", "MoeLayout", "find_experts"]

# What makes a layout unusable for planning: experts or expert tensors some layer lacks, a
# layer both per-expert and fused. (Shapes that disagree are the load planner's to report,
# naming the parameter.)
_REFUSED = ("mixed_layout", "missing_experts", "missing_expert_tensors")


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


def find_experts(index: CheckpointIndex, num_hidden_layers: int | None = None) -> MoeLayout:
    """Experts modules of a checkpoint from its per-expert keys (``<module>.experts.<e>.<rest>``).

    ``num_hidden_layers`` (from the checkpoint's config.json): keys of decoder layers at or
    beyond it are skipped (DeepSeek-V3's multi-token-prediction layer 61, which transformers
    does not load). Raises ValueError for a checkpoint without experts (not MoE), experts
    stored fused (``<module>.experts.gate_up_proj``: not loadable yet) or experts modules that
    disagree (expert ids not 0..E-1, a tensor missing for some expert).
    """
    tensors, skipped = index.tensors, []
    if num_hidden_layers is not None:
        tensors = {}
        for key, t in index.tensors.items():
            block = layer_of(key)
            if block is not None and block[1] >= num_hidden_layers:
                skipped.append(key)
            else:
                tensors[key] = t
    fmt = recognize(tensors)
    _check_loadable(index.root, fmt)
    assert fmt is not None
    experts = []
    for layer, m in enumerate(fmt.modules):
        # Expert 0's tensors in checkpoint order (file, offset): the order of the parameters.
        first = sorted(((g.name, g.infos[0]) for g in m.tensors), key=lambda x: (x[1].file, x[1].offset))
        experts.append(ExpertModule(layer, m.module, expert_params(dict(first))))
    order = {k: (t.file, t.offset) for k, t in tensors.items()}
    dense = sorted(fmt.dense_keys, key=order.__getitem__)
    return MoeLayout(tuple(experts), fmt.num_experts, tuple(dense), tuple(skipped))


def _check_loadable(root: str, fmt: MoeFormat | None) -> None:
    """Raise ValueError, naming ``root`` and the first problem, unless ``fmt`` is a layout of
    per-expert keys whose layers all hold experts ``0 .. E-1`` with the same tensors."""
    if fmt is None:
        raise ValueError(f"checkpoint {root}: {check(None)[0].message}: not a MoE checkpoint")
    fused = [m.module for m in fmt.modules if m.fused or m.mixed]
    if fused:
        names = sorted({g.name for m in fmt.modules for g in m.tensors if g.fused})
        raise ValueError(
            f"checkpoint {root}: {fused[0]} stores its experts fused ({', '.join(names)}"
            f"{f'; {len(fused) - 1} more such layers' if len(fused) > 1 else ''}); moeshard reads experts "
            "stored per expert (<module>.experts.<e>.<name>)"
        )
    problems = [p for p in check(fmt) if p.kind in _REFUSED]
    if problems:
        more = f" (and {len(problems) - 1} more problems: `moeshard inspect` lists them)" if len(problems) > 1 else ""
        raise ValueError(f"checkpoint {root}: {problems[0].message}{more}")
