"""The one recognizer of Mixture-of-Experts layouts on disk, from key names and header shapes.

A checkpoint stores the experts of a MoE layer under one *experts module* prefix: a module
named exactly ``experts`` (so DeepSeek's ``shared_experts`` and Qwen2-MoE's ``shared_expert``,
which are dense MLPs, are not taken for one). Its tensors are stored either

* per expert, ``<module>.<e>.<name>``: Hugging Face Qwen3-MoE and DeepSeek-V3
  (``model.layers.3.mlp.experts.17.gate_proj.weight``), Mixtral
  (``model.layers.3.block_sparse_moe.experts.17.w1.weight``); or
* fused, ``<module>.<name>``: one tensor ``[num_experts, ...]`` per name (transformers 5's
  ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``).

A quantized checkpoint keeps a scale beside each weight: ``<weight>_scale_inv`` (DeepSeek-V3's
FP8 release: ``gate_proj.weight_scale_inv``) or ``<weight>_scale`` (compressed-tensors,
FBGEMM). Such a scale is an expert tensor like the others, and :func:`recognize` pairs it with
its weight (:attr:`TensorGroup.scale_of`).

* :func:`recognize`: headers (key -> :class:`~moeshard.io.header.TensorInfo`) -> a
  frozen :class:`MoeFormat`, or None for a checkpoint without experts;
* :func:`check`: what is wrong with it, as :class:`Problem` records (``moeshard inspect``
  lists them; ``moeshard plan`` refuses the structural ones);
* the key grammar the load path uses to tell a stray expert, a layer the model lacks or a
  scale from a harmless extra key: :func:`parse_expert_key`, :func:`layer_of`,
  :func:`scaled_weight`, :func:`scale_keys`.

Pure and torch-free: it reads only names, shapes, dtype names and byte counts.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # only for annotations: the recognizer never imports torch
    from .header import TensorInfo

__all__ = [
    "SCALE_SUFFIXES",
    "MAX_LISTED",
    "ExpertKey",
    "TensorGroup",
    "MoeLayerFormat",
    "ExpertTensorInfo",
    "MoeFormat",
    "Problem",
    "recognize",
    "check",
    "parse_expert_key",
    "layer_of",
    "scaled_weight",
    "scale_keys",
    "natural_key",
    "id_ranges",
    "shape_str",
]

# Per-expert keys. The module must be exactly ``experts`` (a dot or the key's start before it).
_PER_EXPERT = re.compile(r"^(?P<module>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<name>.+)$")
# Fused keys: one segment right under the experts module that is not an expert id.
_FUSED = re.compile(r"^(?P<module>(?:.*\.)?experts)\.(?P<name>[^.\d][^.]*)$")
# Block N of a layer stack (``model.layers.3.``): the first such segment of a key.
_LAYER = re.compile(r"^(.*?(?:^|\.)layers)\.(\d+)\.")

# Scale tensors a quantized checkpoint stores beside weight ``w``: ``w + suffix``.
SCALE_SUFFIXES = ("_scale_inv", "_scale")
# A broken checkpoint can have 90,000 bad tensors: list the first few of each kind and count
# the rest, so a report stays readable.
MAX_LISTED = 20

_NO_MOE = (
    "no MoE layers found: no keys like <module>.experts.<e>.<name> (per-expert) or "
    "<module>.experts.<name> (fused, [num_experts, ...])"
)


# -- key grammar ------------------------------------------------------------------------------


class ExpertKey(NamedTuple):
    """A per-expert key ``<module>.<expert>.<name>``."""

    module: str
    expert: int
    name: str


def _may_be_expert(key: str) -> bool:
    # Most dense keys fail this substring test, which is far cheaper than the regexes.
    return ".experts." in key or key.startswith("experts.")


def parse_expert_key(key: str) -> ExpertKey | None:
    """``model.layers.3.mlp.experts.17.gate_proj.weight`` -> ``("model.layers.3.mlp.experts",
    17, "gate_proj.weight")``; None for any key that is not a per-expert key."""
    m = _PER_EXPERT.match(key) if _may_be_expert(key) else None
    return None if m is None else ExpertKey(m["module"], int(m["e"]), m["name"])


def layer_of(key: str) -> tuple[str, int] | None:
    """``model.layers.3.mlp.gate.weight`` -> ``("model.layers", 3)``: the layer stack and
    block number of the first ``layers.<N>.`` segment of ``key``; None when it has none."""
    m = _LAYER.match(key)
    return None if m is None else (m[1], int(m[2]))


def scaled_weight(name: str) -> str | None:
    """The weight whose scale ``name`` would be (``x.weight_scale_inv`` -> ``x.weight``), or
    None when ``name`` does not end like a scale."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def scale_keys(weight: str) -> tuple[str, ...]:
    """The keys a scale of ``weight`` may be stored under, the most common first."""
    return tuple(weight + s for s in SCALE_SUFFIXES)


def natural_key(s: str) -> tuple:
    """Sort key putting ``layers.10`` after ``layers.9`` (numbers compared as numbers)."""
    return tuple(int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", s)))


# -- the description --------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorGroup:
    """One tensor name of an experts module and where each expert's copy is stored.

    Args:
        name: relative to the expert (``gate_proj.weight``) or, when ``fused``, to the experts
            module (``gate_up_proj``, stored ``[num_experts, *slice]``).
        fused: whether one tensor holds every expert's slice.
        experts: the expert ids that have this tensor, ascending (fused: ``0 .. shape[0]-1``).
        infos: per expert in ``experts``, its tensor's header info; fused: the one tensor's.
        scale_of: the name of the weight (in the same module and layout) this tensor is the
            quantization scale of, or None.
    """

    name: str
    fused: bool
    experts: tuple[int, ...]
    infos: tuple[TensorInfo, ...]
    scale_of: str | None = None

    def key(self, module: str, expert: int | None = None) -> str:
        """The checkpoint key of ``expert``'s copy (fused: of the one tensor)."""
        return f"{module}.{self.name}" if self.fused else f"{module}.{expert}.{self.name}"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.infos)


@dataclass(frozen=True)
class MoeLayerFormat:
    """One experts module: its key prefix (``model.layers.3.mlp.experts``), its decoder layer
    (``3``, from the prefix's ``layers.<N>``; None when it has none), the expert ids present
    (of its per-expert tensors; for a fused module ``0 .. n-1``, ``n`` the leading dim its
    tensors agree on most), and its tensors, per-expert ones first, each in the order the
    headers list them. A well-formed module is all per-expert or all fused."""

    module: str
    layer: int | None
    experts: tuple[int, ...]
    tensors: tuple[TensorGroup, ...]

    @property
    def fused(self) -> bool:
        """Whether every tensor is fused (a module mixing both kinds is not)."""
        return all(g.fused for g in self.tensors)

    @property
    def mixed(self) -> bool:
        """Whether the module has both per-expert and fused tensors (a malformed checkpoint)."""
        return any(g.fused for g in self.tensors) and not self.fused

    @property
    def scales(self) -> dict[str, str]:
        """``{weight name: scale name}`` of the module's quantized tensors."""
        return {g.scale_of: g.name for g in self.tensors if g.scale_of is not None}

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.tensors)

    @property
    def extent(self) -> int:
        """How many experts the module's tensors span: the largest per-expert id + 1, or the
        fused tensors' expert count, whichever is larger (0 for an empty module)."""
        fused = [g.infos[0] for g in self.tensors if g.fused]
        per_expert = max((g.experts[-1] + 1 for g in self.tensors if not g.fused and g.experts), default=0)
        return max(per_expert, _fused_count(fused) if fused else 0)

    def group(self, name: str, fused: bool = False) -> TensorGroup | None:
        """The tensor ``name`` (per-expert, or fused), or None when the module lacks it."""
        return next((g for g in self.tensors if g.name == name and g.fused == fused), None)


@dataclass(frozen=True)
class ExpertTensorInfo:
    """The expected slice of one tensor of one expert: ``name`` relative to the expert or,
    when ``fused``, to the experts module; ``shape``/``dtype``/``nbytes`` are one expert's
    (the most common over all experts of all layers: the odd ones out are problems)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    fused: bool


@dataclass(frozen=True)
class MoeFormat:
    """The MoE layout of a checkpoint: its experts modules (in natural order: ``layers.10``
    after ``layers.9``), the expected slice of each expert tensor (per-expert names first,
    then fused ones, each in the order first seen) and the keys outside every experts module
    (in the headers' order)."""

    modules: tuple[MoeLayerFormat, ...]
    expert_tensors: tuple[ExpertTensorInfo, ...]
    dense_keys: tuple[str, ...]

    @property
    def num_experts(self) -> int:
        """What every layer should have: the most experts (largest id + 1) of any layer."""
        return max((m.extent for m in self.modules), default=0)

    @property
    def expert_bytes(self) -> int:
        return sum(m.nbytes for m in self.modules)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint. ``kind`` is a stable identifier (for scripts and
    tests). :func:`check` reports no_moe, mixed_layout, missing_experts,
    missing_expert_tensors and expert_mismatch; ``moeshard inspect`` adds missing_files,
    unindexed_files, missing_keys, unindexed_keys and mixed_dtypes."""

    kind: str
    message: str


# -- recognition ------------------------------------------------------------------------------


def recognize(tensors: Mapping[str, TensorInfo]) -> MoeFormat | None:
    """The MoE layout of a checkpoint with these headers (key -> info, in the headers'
    order), or None when no key is an expert tensor (a dense checkpoint).

    Cost: one substring test per key, a regex per key under an experts module, and
    bookkeeping over those keys (a million per-expert keys: a few seconds)."""
    # module -> name -> {expert id: info}, and module -> name -> info: the keys, grouped.
    per_expert: dict[str, dict[str, dict[int, TensorInfo]]] = {}
    fused: dict[str, dict[str, TensorInfo]] = {}
    dense: list[str] = []
    # One str per distinct tensor name and one int per distinct expert id, not one per key:
    # a maximal header has a million per-expert keys and a handful of names.
    names: dict[str, str] = {}
    ids: dict[str, int] = {}
    match_expert, match_fused = _PER_EXPERT.match, _FUSED.match
    for key, t in tensors.items():
        if _may_be_expert(key):
            m = match_expert(key)
            if m is not None:
                module, e, name = m.group("module", "e", "name")
                eid = ids.get(e)
                if eid is None:
                    eid = ids[e] = int(e)
                by_name = per_expert.get(module)
                if by_name is None:
                    by_name = per_expert[module] = {}
                by_id = by_name.get(name)
                if by_id is None:
                    by_id = by_name[names.setdefault(name, name)] = {}
                by_id[eid] = t
                continue
            m = match_fused(key)
            if m is not None and t.shape:  # a scalar holds no experts: a dense tensor
                fused.setdefault(m["module"], {})[m["name"]] = t
                continue
        dense.append(key)
    if not per_expert and not fused:
        return None
    modules = tuple(
        _layer_format(module, per_expert.get(module, {}), fused.get(module, {}))
        for module in sorted(per_expert.keys() | fused.keys(), key=natural_key)
    )
    return MoeFormat(modules, _expert_tensors(modules), tuple(dense))


def _layer_format(
    module: str, per_expert: dict[str, dict[int, TensorInfo]], fused: dict[str, TensorInfo]
) -> MoeLayerFormat:
    groups: list[TensorGroup] = []
    for name, by_id in per_expert.items():
        experts = tuple(sorted(by_id))
        groups.append(TensorGroup(name, False, experts, tuple(by_id[e] for e in experts), _scale_of(name, per_expert)))
    for name, t in fused.items():
        groups.append(TensorGroup(name, True, tuple(range(t.shape[0])), (t,), _scale_of(name, fused)))
    if per_expert:
        present: set[int] = set()
        for by_id in per_expert.values():
            present.update(by_id)
        experts = tuple(sorted(present))
    else:
        experts = tuple(range(_fused_count(fused.values())))
    layer = layer_of(module + ".")
    return MoeLayerFormat(module, None if layer is None else layer[1], experts, tuple(groups))


def _scale_of(name: str, same_kind: Mapping[str, object]) -> str | None:
    weight = scaled_weight(name)
    return weight if weight in same_kind else None


def _fused_count(infos: Iterable[TensorInfo]) -> int:
    """Experts in a fused module: the leading dim its tensors agree on (the most common)."""
    return Counter(t.shape[0] for t in infos).most_common(1)[0][0]


def _expert_tensors(modules: tuple[MoeLayerFormat, ...]) -> tuple[ExpertTensorInfo, ...]:
    """The expected slice of each tensor name: its most common shape and dtype over all
    experts of all layers (so the odd one out is the one reported)."""
    seen: dict[tuple[str, bool], Counter] = {}
    itemsize: dict[str, int] = {}
    for m in modules:
        for g in m.tensors:
            counter = seen.setdefault((g.name, g.fused), Counter())
            for t in g.infos:
                counter[t.shape[1:] if g.fused else t.shape, t.dtype] += 1
                itemsize.setdefault(t.dtype, t.itemsize)
    refs = []
    for (name, is_fused), counter in seen.items():
        (shape, dtype), _ = counter.most_common(1)[0]
        refs.append(ExpertTensorInfo(name, shape, dtype, math.prod(shape) * itemsize[dtype], is_fused))
    # Per-expert tensors before fused ones; each kind in the order first seen (a stable sort).
    return tuple(sorted(refs, key=lambda r: r.fused))


# -- problems ---------------------------------------------------------------------------------


def check(fmt: MoeFormat | None) -> tuple[Problem, ...]:
    """Everything wrong with the layout ``fmt`` (:func:`recognize`'s result), in this order:
    no_moe (``fmt`` is None), mixed_layout (a module with per-expert and fused tensors),
    missing_experts (ids with gaps, or fewer than the largest layer's), missing_expert_tensors
    (an expert or fused module lacking a tensor the others have), expert_mismatch (a shape or
    dtype that differs from :attr:`MoeFormat.expert_tensors`). Each kind lists at most
    :data:`MAX_LISTED` problems and one more line counting the rest."""
    if fmt is None:
        return (Problem("no_moe", _NO_MOE),)
    problems = [
        Problem(
            "mixed_layout",
            f"{m.module}: both per-expert keys and fused tensors "
            f"({', '.join(sorted(g.name for g in m.tensors if g.fused))})",
        )
        for m in fmt.modules
        if m.mixed
    ]
    problems += _missing_experts(fmt)
    problems += _per_expert_problems(fmt)
    problems += _fused_problems(fmt)
    return tuple(problems)


def _missing_experts(fmt: MoeFormat) -> list[Problem]:
    """Layers whose expert ids have gaps or stop short of the largest layer's count."""
    n = fmt.num_experts
    out = []
    for m in fmt.modules:
        if any(not g.fused for g in m.tensors):
            present = set(m.experts)
            missing = [e for e in range(n) if e not in present]
            if missing:
                out.append(
                    Problem(
                        "missing_experts",
                        f"{m.module}: experts {id_ranges(missing)} missing ({len(present)} of {n} present)",
                    )
                )
    for m in fmt.modules:
        if m.fused and len(m.experts) < n:
            out.append(
                Problem("missing_experts", f"{m.module}: fused tensors hold {len(m.experts)} experts, other layers {n}")
            )
    return _capped(out)


def _per_expert_problems(fmt: MoeFormat) -> list[Problem]:
    """Experts lacking a tensor the others have, and tensors whose shape/dtype differs from
    the same tensor of the other experts (in any layer)."""
    refs = {r.name: r for r in fmt.expert_tensors if not r.fused}
    lacking, mismatch = [], []
    for m in fmt.modules:
        groups = {g.name: g for g in m.tensors if not g.fused}
        if not groups:
            continue
        for name in sorted(refs):
            g = groups.get(name)
            has = set(g.experts) if g is not None else set()
            absent = [e for e in m.experts if e not in has]
            if absent:
                lacking.append(
                    Problem("missing_expert_tensors", f"{m.module}: {name} missing for experts {id_ranges(absent)}")
                )
        # Listed expert by expert, each expert's tensors in the module's order.
        odd = []
        for j, g in enumerate(groups.values()):
            ref = refs[g.name]
            for e, t in zip(g.experts, g.infos):
                if t.shape != ref.shape or t.dtype != ref.dtype:
                    odd.append(
                        (
                            e,
                            j,
                            Problem(
                                "expert_mismatch",
                                f"{m.module}.{e}.{g.name}: {shape_str(t.shape)} "
                                f"{t.dtype}, other experts {shape_str(ref.shape)} {ref.dtype}",
                            ),
                        )
                    )
        mismatch += [p for _, _, p in sorted(odd, key=lambda x: x[:2])]
    return _capped(lacking) + _capped(mismatch)


def _fused_problems(fmt: MoeFormat) -> list[Problem]:
    refs = {r.name: r for r in fmt.expert_tensors if r.fused}
    out = []
    for m in fmt.modules:
        groups = {g.name: g for g in m.tensors if g.fused}
        if not groups:
            continue
        absent = [name for name in sorted(refs) if name not in groups]
        if absent:
            out.append(Problem("missing_expert_tensors", f"{m.module}: fused {', '.join(absent)} missing"))
        n = _fused_count(g.infos[0] for g in groups.values())
        for name, g in sorted(groups.items()):
            t, ref = g.infos[0], refs[name]
            if t.shape[1:] != ref.shape or t.dtype != ref.dtype or t.shape[0] != n:
                out.append(
                    Problem(
                        "expert_mismatch",
                        f"{m.module}.{name}: {shape_str(t.shape)} {t.dtype}, "
                        f"other layers {shape_str((n,) + ref.shape)} {ref.dtype}",
                    )
                )
    return _capped(out)


def _capped(problems: list[Problem]) -> list[Problem]:
    if len(problems) <= MAX_LISTED:
        return problems
    rest = len(problems) - MAX_LISTED
    return problems[:MAX_LISTED] + [Problem(problems[0].kind, f"... and {rest} more {problems[0].kind} problems")]


# -- message helpers --------------------------------------------------------------------------


def id_ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out, start = [], None
    for i, e in enumerate(ids):
        if start is None:
            start = e
        if i + 1 == len(ids) or ids[i + 1] != e + 1:
            out.append(str(start) if start == e else f"{start}-{e}")
            start = None
    return ", ".join(out)


def shape_str(shape: tuple[int, ...]) -> str:
    """(2, 3) -> '[2, 3]'."""
    return "[" + ", ".join(str(d) for d in shape) + "]"
