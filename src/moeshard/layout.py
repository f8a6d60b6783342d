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
           "base_names", "is_adapter_param"]


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
    that cannot be cast, or a placement inconsistent with the model's expert parameters.
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
            _check_dtype(d, key, info.dtype)
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


@functools.lru_cache(maxsize=256)
def _castable(ckpt_dtype: str, dtype: torch.dtype) -> bool:
    src = DTYPES[ckpt_dtype]
    return src.is_floating_point == dtype.is_floating_point and (src == torch.bool) == (dtype == torch.bool)


def _check_dtype(d: ParamDesc, key: str, ckpt_dtype: str) -> None:
    if not _castable(ckpt_dtype, d.dtype):
        raise ValueError(
            f"parameter {d.name}: checkpoint tensor {key!r} has dtype {ckpt_dtype}, which cannot be "
            f"cast to the model's {d.dtype}"
        )


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
        _check_dtype(d, key, info.dtype)
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
