"""Needs: which box of which checkpoint tensor every rank must hold, and where.

Derived from the model itself, for *every* rank, without communication: a DTensor's
placements and device mesh say what each mesh coordinate holds (torch's own
local-shape/offset computation), and the :class:`~moeshard.placement.Placement` says which
logical expert each physical slot of an expert parameter holds. Every rank computes the same
needs, so the planner gives the same plan everywhere.

Two halves: :func:`describe_model` turns a model into plain :class:`ParamDesc` records (the
only part that looks at torch modules); :func:`compute_needs` is pure and works for any
world size.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from .adapters import DEFAULT_SPECS, ExpertParam, ExpertsSpec, checkpoint_names, expert_parts, specs_for
from .box import Box, full_box
from .checkpoint import CheckpointIndex, DTYPES
from .placement import Placement

__all__ = ["ExpertRef", "ParamDesc", "Need", "describe_model", "compute_needs", "rank_boxes", "local_tensor", "expert_layers",
           "base_names", "is_adapter_param", "cast_refusal", "check_cast", "UnusedKeys", "unused_keys",
           "ignored_patterns"]


@dataclass(frozen=True)
class ExpertRef:
    """An expert parameter: MoE ``layer`` index, the checkpoint key prefix of its experts
    module (the module's name, or the name its checkpoint uses, e.g. ``block_sparse_moe``),
    and its spec."""

    layer: int
    module: str
    param: ExpertParam


@dataclass(frozen=True, eq=False)
class ParamDesc:
    """What one parameter (or persistent buffer) of the model is, as the planner sees it.

    Args:
        name: qualified name in the model.
        shape: global shape. For an expert parameter: ``[num_physical, *slice_shape]``.
        dtype: the model's dtype (checkpoint values are cast to it).
        mesh: ``int[*mesh_shape]`` global ranks of the DTensor's mesh, or None for a plain
            tensor held in full by every rank.
        placements: the DTensor's placements (one per mesh dim); empty for a plain tensor.
        keys: checkpoint keys the tensor may be stored under (own name first, then tied
            aliases); unused for expert parameters.
        expert: set for expert parameters.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mesh: np.ndarray | None
    placements: tuple = ()
    keys: tuple[str, ...] = ()
    expert: ExpertRef | None = None


class Need(NamedTuple):
    """Rank ``rank`` must hold box ``src`` of checkpoint tensor ``key`` at box ``dest`` of
    the local tensor of parameter number ``param``."""

    rank: int
    param: int
    dest: Box
    key: str
    src: Box


# -- model -> ParamDesc -------------------------------------------------------------------


# A peft (LoRA) model: ``get_peft_model`` prefixes every name with ``base_model.model.`` and
# a wrapped module's own parameters move under ``<module>.base_layer``; adapter weights live in
# ``lora_A`` / ``lora_B`` containers of the wrapper. Checkpoints of the base model use
# the names without peft's segments.
_PEFT_PREFIX = "base_model.model."
_BASE_LAYER = re.compile(r"\.base_layer(?=\.|$)")
_ADAPTER_SEGMENTS = re.compile(r"(^|\.)(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.")


def _is_peft(model: nn.Module) -> bool:
    return any(hasattr(m, "base_layer") and hasattr(m, "lora_A") for m in model.modules())


def _strip_peft(name: str) -> str:
    name = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
    return _BASE_LAYER.sub("", name)


def base_names(model: nn.Module):
    """``name -> name in the base model``: identity, or for a peft model the name without
    peft's ``base_model.model.`` prefix and ``.base_layer`` segments."""
    return _strip_peft if _is_peft(model) else (lambda name: name)


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name is a peft LoRA adapter weight (not in the base checkpoint)."""
    return _ADAPTER_SEGMENTS.search(name) is not None


def expert_layers(model: nn.Module, specs: Sequence[ExpertsSpec] = DEFAULT_SPECS) -> list[tuple[str, nn.Module, ExpertsSpec]]:
    """Experts modules of ``model`` in module order (their index is the MoE layer). In a peft
    model the experts module is the innermost one (under its ``ParamWrapper`` chain)."""
    out = []
    base = base_names(model)
    for name, mod in model.named_modules():
        names = {n for n, _ in mod.named_parameters(recurse=False)}
        for spec in specs:
            if spec.matches(base(name), names):
                out.append((name, mod, spec))
                break
    return out


def _choose_spec(
    candidates: Sequence[ExpertsSpec], module: str, index: CheckpointIndex | None, renamed: bool
) -> tuple[ExpertsSpec, str]:
    """The spec and checkpoint key prefix of experts module ``module``: the first whose keys
    the checkpoint has; without a checkpoint, the model family's (``renamed``: its names)."""
    prefixes = checkpoint_names(module)
    if index is not None:
        for spec in candidates:
            for prefix in prefixes:
                if all(k in index for p in spec.params for k in p.keys(prefix, 0)):
                    return spec, prefix
    return candidates[0], prefixes[-1] if renamed else module


def describe_model(
    model: nn.Module,
    index: CheckpointIndex | None = None,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
) -> list[ParamDesc]:
    """Describe every parameter and persistent buffer of ``model`` (deduplicated; tied
    parameters list all their names as checkpoint keys, then the names a checkpoint of the
    model's family may use instead, :func:`~moeshard.adapters.checkpoint_names`).

    Without ``index`` the names are those the model's family writes (``config.model_type``).
    A peft model is described as its base model (checkpoint names without peft's segments;
    adapter weights left out, see :mod:`moeshard.lora`).
    """
    ordered, renamed = specs_for(model, specs)
    base, peft = base_names(model), _is_peft(model)
    experts: dict[str, tuple[int, ExpertsSpec, str]] = {}
    layer = 0
    for name, mod in model.named_modules():
        names = {n for n, _ in mod.named_parameters(recurse=False)}
        matching = [s for s in ordered if s.matches(base(name), names)]
        if matching:
            experts[name] = (layer, *_choose_spec(matching, base(name), index, renamed))
            layer += 1
    aliases: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + _persistent_buffers(model):
        if peft and is_adapter_param(name):
            continue  # a peft adapter's weight: moeshard.lora loads and saves those
        aliases.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    descs = []
    meshes: dict[int, np.ndarray] = {}  # id(DeviceMesh) -> its ranks (computing it is not free)
    for tid, names in aliases.items():
        t = tensors[tid]
        name = names[0]
        module, _, attr = name.rpartition(".")
        expert = None
        if module in experts:
            layer_idx, spec, prefix = experts[module]
            for p in spec.params:
                if p.name == attr:
                    expert = ExpertRef(layer_idx, prefix, p)
        if _is_dtensor(t):
            if any(p.is_partial() for p in t.placements):
                raise ValueError(f"parameter {name}: Partial DTensor placements cannot be loaded")
            dm = t.device_mesh
            mesh = meshes.get(id(dm))
            if mesh is None:
                mesh = meshes[id(dm)] = dm.mesh.cpu().numpy()
            placements = tuple(t.placements)
        else:
            mesh, placements = None, ()
        keys = [k for n in names for k in checkpoint_names(base(n))]
        if renamed and index is None:  # the family's names first: they are what it writes
            keys = [k for n in names for k in reversed(checkpoint_names(base(n)))]
        descs.append(ParamDesc(name, tuple(t.shape), t.dtype, mesh, placements, tuple(dict.fromkeys(keys)), expert))
    return descs


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for mod_name, mod in model.named_modules():
        for b_name, b in mod.named_buffers(recurse=False):
            if b_name not in mod._non_persistent_buffers_set:
                out.append((f"{mod_name}.{b_name}" if mod_name else b_name, b))
    return out


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a parameter (DTensor or plain), writable in place."""
    t = t.data if isinstance(t, nn.Parameter) else t
    return t._local_tensor if _is_dtensor(t) else t


# -- ParamDesc -> needs (pure) ------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _local_boxes(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple) -> tuple[Box, ...]:
    """Local box (in global coordinates) of every mesh coordinate, in row-major order."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Replicate, Shard

    for p in placements:
        if not isinstance(p, (Shard, Replicate)) or type(p).__name__ == "_StridedShard":
            raise ValueError(
                f"placement {p} is not supported (Shard and Replicate are); "
                "shard expert parameters with Shard(1) on the expert-FSDP axis"
            )
    boxes = []
    for coord in np.ndindex(*mesh_shape):
        lshape, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        boxes.append(tuple(zip(offset, lshape)))
    return tuple(boxes)


def rank_boxes(d: ParamDesc, world_size: int) -> list[tuple[int, Box]]:
    """``[(rank, box)]``: the box (global coordinates) of ``d`` each rank holds; a plain tensor
    is held in full by every rank. Raises ValueError for a mesh naming a rank >= world_size."""
    if d.mesh is None:
        return [(r, full_box(d.shape)) for r in range(world_size)]
    out = []
    for rank, box in zip(d.mesh.reshape(-1).tolist(), _local_boxes(d.shape, d.mesh.shape, d.placements)):
        if rank >= world_size:
            raise ValueError(f"parameter {d.name}: its mesh names rank {rank} >= world size {world_size}")
        out.append((rank, box))
    return out


def compute_needs(
    descs: Sequence[ParamDesc],
    index: CheckpointIndex,
    placement: Placement | None,
    world_size: int,
) -> list[Need]:
    """Every rank's needs, from parameter descriptions (pure; any world size).

    Raises ValueError for a key missing from the checkpoint, a shape that disagrees, a dtype
    the cast rule refuses (:func:`cast_refusal`: e.g. FP8 into bf16), or a placement
    inconsistent with the model's expert parameters.
    """
    needs: list[Need] = []
    num_layers = 1 + max((d.expert.layer for d in descs if d.expert), default=-1)
    if placement is not None and num_layers:
        placement.check_layers(num_layers)
    for i, d in enumerate(descs):
        per_rank = [(rank, box, tuple(o for o, _ in box)) for rank, box in rank_boxes(d, world_size)]
        if d.expert is None:
            key = _find_key(d, index)
            info = index.info(key)
            check_cast(f"parameter {d.name}", key, index, d.dtype)
            if tuple(info.shape) != d.shape:
                raise ValueError(
                    f"parameter {d.name}: checkpoint tensor {key!r} has shape {list(info.shape)}, "
                    f"the model expects {list(d.shape)}"
                )
            for rank, box, origin in per_rank:
                if all(n for _, n in box):
                    needs.append(Need(rank, i, _shift(box, origin), key, box))
        else:
            _expert_needs(i, d, index, placement, per_rank, needs)
    return needs


def _shift(box: Box, origin: Sequence[int]) -> Box:
    return tuple((off - o, n) for (off, n), o in zip(box, origin))


def _find_key(d: ParamDesc, index: CheckpointIndex) -> str:
    for key in d.keys:
        if key in index:
            return key
    also = f" (nor under its other names {list(d.keys[1:])})" if len(d.keys) > 1 else ""
    raise ValueError(f"parameter {d.name}: checkpoint {index.root} has no tensor {d.keys[0]!r}{also}")


def _is_float8(dtype: torch.dtype) -> bool:
    # One-byte floats (float8_e4m3fn, float8_e5m2, their fnuz variants): block-quantized
    # checkpoints store them scaled, so a value means something only with its scale.
    return dtype.is_floating_point and dtype.itemsize == 1


# Scale tensors a quantized checkpoint stores beside weight ``key`` (DeepSeek-V3:
# ``<key>_scale_inv`` = ``<module>.weight_scale_inv``; compressed-tensors / FBGEMM: ``_scale``).
SCALE_SUFFIXES = ("_scale_inv", "_scale")


@functools.lru_cache(maxsize=256)
def cast_refusal(ckpt_dtype: str, dtype: torch.dtype) -> str | None:
    """The one cast rule for checkpoint data: None when values of safetensors dtype
    ``ckpt_dtype`` may be cast to a model tensor of ``dtype``, else why not ("kind",
    "from_fp8", "to_fp8", "fp8_formats").

    Allowed: the same dtype (FP8 -> the same FP8 included: a model keeping FP8 parameters),
    float <-> float and int <-> int. Refused: int/bool <-> float, bool <-> int, and every cast
    from or to a one-byte float: FP8 values are meaningful only with their scale (DESIGN.md),
    a cast to FP8 is a quantization that needs a scale, and e4m3 <-> e5m2 loses precision or
    overflows. Every path that reads checkpoint data into a tensor checks it before any data
    moves: load (dense and expert needs), verify (through load's plan), relocate's disk reads
    and LoRA adapters (:func:`check_cast`).
    """
    src = DTYPES[ckpt_dtype]
    if src == dtype:
        return None
    if _is_float8(src) and _is_float8(dtype):
        return "fp8_formats"
    if _is_float8(src):
        return "from_fp8"
    if _is_float8(dtype):
        return "to_fp8"
    if src.is_floating_point != dtype.is_floating_point or (src == torch.bool) != (dtype == torch.bool):
        return "kind"
    return None


def check_cast(what: str, key: str, index: CheckpointIndex, dtype: torch.dtype) -> None:
    """Raise ValueError when checkpoint tensor ``key`` may not be cast to ``dtype``
    (:func:`cast_refusal`); ``what`` names the destination ("parameter x"). Pure; every rank
    that plans a read calls it."""
    ckpt_dtype = index.info(key).dtype
    why = cast_refusal(ckpt_dtype, dtype)
    if why is None:
        return
    src = DTYPES[ckpt_dtype]
    head = f"{what}: checkpoint tensor {key!r} has dtype {ckpt_dtype}"
    if why == "kind":
        raise ValueError(f"{head}, which cannot be cast to the model's {dtype}")
    if why == "to_fp8":
        raise ValueError(
            f"{head}, the model's tensor is {dtype}: casting to FP8 is a quantization that needs a scale, "
            "which moeshard does not do; quantize the checkpoint (with its scales) or keep this tensor "
            f"in a wider dtype")
    keep = f"load it into a model that keeps this tensor in {src}"
    if why == "fp8_formats":
        raise ValueError(
            f"{head}, the model's tensor is {dtype}: converting between FP8 formats without rescaling "
            f"loses precision or overflows (float8_e4m3fn's largest value is 448, float8_e5m2 has 2 "
            f"mantissa bits); {keep}")
    scales = [key + s for s in SCALE_SUFFIXES if key + s in index]
    if scales:
        info = index.info(scales[0])
        scale = (f"its scale tensor {scales[0]!r} ({info.dtype} {list(info.shape)}) would be dropped and "
                 f"the raw FP8 values loaded unscaled")
    else:
        scale = (f"the checkpoint has no scale tensor for it (no {key + SCALE_SUFFIXES[0]!r}), and its raw FP8 "
                 f"values would be meaningless as {dtype}")
    raise ValueError(
        f"{head} (FP8), the model's tensor is {dtype}: {scale}. moeshard does not dequantize FP8 "
        f"checkpoints yet: use a dequantized checkpoint, or {keep}")


def _expert_needs(
    i: int,
    d: ParamDesc,
    index: CheckpointIndex,
    placement: Placement | None,
    per_rank: list[tuple[int, Box, tuple[int, ...]]],
    needs: list[Need],
) -> None:
    ref = d.expert
    assert ref is not None
    num_physical, slice_shape = d.shape[0], d.shape[1:]
    if placement is None:
        phy2log = np.arange(num_physical)
        num_logical = num_physical
    else:
        if placement.num_physical != num_physical:
            raise ValueError(
                f"parameter {d.name} has {num_physical} expert slots per layer, the placement has "
                f"{placement.num_physical} physical slots"
            )
        phy2log = placement.phy2log[ref.layer]
        num_logical = placement.num_logical
    if d.mesh is not None and placement is not None and placement.num_ranks is not None:
        spr = num_physical // placement.num_ranks
        for _, box, _ in per_rank:
            if box[0][1] and (box[0][0] // spr != (box[0][0] + box[0][1] - 1) // spr):
                raise ValueError(f"parameter {d.name}: local box {list(box)} spans several EP ranks' slots")
    # The parts of expert 0 give the part sizes; every expert must agree.
    part_sizes = _part_sizes(d, index, 0, slice_shape)
    extra = ref.param.keys(ref.module, num_logical)
    if extra[0] in index:
        raise ValueError(
            f"parameter {d.name}: the checkpoint has expert {num_logical} ({extra[0]!r}) but the "
            f"placement has only {num_logical} logical experts"
        )
    checked: set[int] = {0}
    keys_of: dict[int, tuple[str, ...]] = {}
    for rank, box, origin in per_rank:
        (s0, ns), rest = box[0], box[1:]
        if not ns or not all(n for _, n in rest):
            continue
        # The same parts for every slot of this box: (part index, part box, dest box tail).
        parts = [(j, part_box, _shift(sub, origin[1:])) for j, part_box, sub in expert_parts(rest, part_sizes, ref.param.dim)]
        for slot in range(s0, s0 + ns):
            expert = int(phy2log[slot])
            if expert < 0:
                continue  # an empty slot (dead or not-yet-joined rank): nothing to load
            if expert not in checked:
                if _part_sizes(d, index, expert, slice_shape) != part_sizes:
                    raise ValueError(
                        f"parameter {d.name}: checkpoint tensors {list(ref.param.keys(ref.module, expert))} of "
                        f"logical expert {expert} differ in shape from expert 0's"
                    )
                checked.add(expert)
            keys = keys_of.get(expert)
            if keys is None:
                keys = keys_of[expert] = ref.param.keys(ref.module, expert)
            lead = ((slot - origin[0], 1),)
            for j, part_box, tail in parts:
                needs.append(Need(rank, i, lead + tail, keys[j], part_box))


def _part_sizes(d: ParamDesc, index: CheckpointIndex, expert: int, slice_shape: tuple[int, ...]) -> tuple[int, ...]:
    ref = d.expert
    assert ref is not None
    sizes = []
    for key in ref.param.keys(ref.module, expert):
        if key not in index:
            raise ValueError(f"parameter {d.name}: checkpoint {index.root} has no tensor {key!r} (logical expert {expert})")
        info = index.info(key)
        check_cast(f"parameter {d.name}", key, index, d.dtype)
        shape = list(info.shape)
        want = list(slice_shape)
        dim = ref.param.dim
        if len(shape) != len(want) or any(a != b for k, (a, b) in enumerate(zip(shape, want)) if k != dim):
            raise ValueError(
                f"parameter {d.name}: checkpoint tensor {key!r} has shape {shape}, which does not fit "
                f"an expert slice of shape {want} (parts concatenated along dim {dim})"
            )
        sizes.append(shape[dim])
    if sum(sizes) != slice_shape[ref.param.dim]:
        raise ValueError(
            f"parameter {d.name}: checkpoint tensors {list(ref.param.keys(ref.module, expert))} of logical "
            f"expert {expert} have sizes {sizes} along dim {ref.param.dim}, summing to {sum(sizes)}, "
            f"not {slice_shape[ref.param.dim]}"
        )
    return tuple(sizes)


# -- checkpoint keys that no parameter reads (pure) -----------------------------------------

# A per-expert key whatever the experts module's name; a key of block N of a layer stack.
_EXPERT_KEY = re.compile(r"(^|\.)experts\.\d+\.")
_LAYER_KEY = re.compile(r"^(.*?(?:^|\.)layers)\.(\d+)\.")
_EXPERTS_REASON = "name experts or expert tensors the model does not have"
_SCALES_REASON = "are scales of weights the model loads, which no parameter holds"


@dataclass(frozen=True)
class UnusedKeys:
    """Checkpoint keys that no parameter or buffer of the model reads.

    Args:
        keys: all of them, sorted.
        suspicious: ``{reason: sorted keys}``, those that say the checkpoint does not fit the
            model: a key under an experts module's prefix or like ``experts.<N>.`` (an expert
            the model does not have, or an expert tensor its spec does not declare), a key of a
            layer beyond the model's layers under the same prefix, the scale of a weight the
            model loads. The others (a stored rotary ``inv_freq``, the tied alias not read,
            keys the model's ``_keys_to_ignore_on_load_unexpected`` matches) are harmless.
    """

    keys: tuple[str, ...]
    suspicious: dict[str, tuple[str, ...]]

    def problem(self, root: str, limit: int = 5) -> str | None:
        """One line naming the suspicious keys (the first ``limit`` of each kind, and how
        many), or None when there are none."""
        if not self.suspicious:
            return None
        parts = []
        for reason, keys in self.suspicious.items():
            more = f" ... ({len(keys)} in all)" if len(keys) > limit else ""
            parts.append(f"{len(keys)} {reason}: {list(keys[:limit])}{more}")
        n = sum(len(k) for k in self.suspicious.values())
        return f"checkpoint {root} has {n} key(s) that no parameter or buffer of the model reads: " + "; ".join(parts)


def ignored_patterns(model: nn.Module) -> tuple[str, ...]:
    """Regexes of checkpoint keys the model expects to leave unread: transformers'
    ``_keys_to_ignore_on_load_unexpected`` of every module (transformers gathers the
    children's too; e.g. DeepSeek-V3's ``model\\.layers\\.61.*``, its MTP layer)."""
    out: dict[str, None] = {}
    for m in model.modules():
        for pattern in getattr(m, "_keys_to_ignore_on_load_unexpected", None) or ():
            out[pattern] = None
    return tuple(sorted(out))


def unused_keys(
    descs: Sequence[ParamDesc],
    index: CheckpointIndex,
    placement: Placement | None,
    ignore: Sequence[str] = (),
) -> UnusedKeys:
    """Checkpoint keys that no parameter or buffer of ``descs`` reads (pure, no communication:
    every rank computes the same). Call it after :func:`compute_needs`, which raises for
    missing keys.

    A key is consumed when some parameter reads it given the model, whatever the placement:
    a dense parameter's first key present in the checkpoint (the tied aliases after it are
    unused but harmless), and every part of every logical expert ``0 .. num_logical - 1`` of
    an expert parameter (an expert no slot holds, e.g. on a dead rank, is still the model's).
    ``ignore``: regexes (``re.search``) of keys never suspicious (:func:`ignored_patterns`).
    Cost: set operations over the index's keys, plus a regex per unused key.
    """
    consumed: set[str] = set()
    dense: list[str] = []
    aliases: set[str] = set()
    prefixes: dict[str, None] = {}
    for d in descs:
        if d.expert is None:
            present = [k for k in d.keys if k in index]
            dense.extend(present[:1])
            aliases.update(present[1:])
        else:
            num_logical = placement.num_logical if placement is not None else d.shape[0]
            prefixes[f"{d.expert.module}."] = None
            consumed.update(_expert_keys(d.expert, num_logical))
    consumed.update(dense)
    unused = sorted(index.tensors.keys() - consumed)
    counts = _layer_counts(dense + list(prefixes))
    ignored = re.compile("|".join(f"(?:{p})" for p in ignore)) if ignore else None
    experts = tuple(prefixes)
    suspicious: dict[str, list[str]] = {}
    for key in unused:
        if key in aliases or (ignored is not None and ignored.search(key)):
            continue
        reason = None
        layer = _LAYER_KEY.match(key)
        if layer is not None and layer[1] in counts and int(layer[2]) >= counts[layer[1]]:
            reason = f"are in layers beyond the model's {counts[layer[1]]} under {layer[1]!r}"
        elif key.startswith(experts) or _EXPERT_KEY.search(key):
            reason = _EXPERTS_REASON
        elif _scaled_weight(key) in consumed:
            reason = _SCALES_REASON
        if reason is not None:
            suspicious.setdefault(reason, []).append(key)
    return UnusedKeys(tuple(unused), {r: tuple(k) for r, k in suspicious.items()})


def _expert_keys(ref: ExpertRef, num_logical: int) -> list[str]:
    """Every checkpoint key of logical experts ``0 .. num_logical - 1`` of ``ref``. DeepSeek-V3
    has ~45,000: each is one string concatenation (head + id + tail of the key template), not
    a ``str.format`` call."""
    ids = [str(e) for e in range(num_logical)]
    out: list[str] = []
    try:
        templates = ref.param.keys(ref.module, "{e}")  # the keys with their expert id left as "{e}"
    except ValueError:  # a template with a format spec (e.g. "{e:03d}"): one format per key
        return [k for e in range(num_logical) for k in ref.param.keys(ref.module, e)]
    for j, template in enumerate(templates):
        head, _, tail = template.partition("{e}")
        if "{e}" in tail or head == template:  # the id not exactly once: one format per key
            out.extend(ref.param.keys(ref.module, e)[j] for e in range(num_logical))
        else:
            out.extend([head + i + tail for i in ids])
    return out


def _scaled_weight(key: str) -> str | None:
    """The weight whose scale ``key`` would be (``x.weight_scale_inv`` -> ``x.weight``), or None."""
    for suffix in SCALE_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return None


def _layer_counts(keys: Sequence[str]) -> dict[str, int]:
    """``{layer stack prefix: number of layers}`` from keys the model reads (the stack is the
    first ``...layers.<N>.`` of a key)."""
    counts: dict[str, int] = {}
    for key in keys:
        m = _LAYER_KEY.match(key)
        if m is not None:
            counts[m[1]] = max(counts.get(m[1], 0), int(m[2]) + 1)
    return counts
