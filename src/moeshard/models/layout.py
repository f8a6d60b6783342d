"""Needs: which box of which checkpoint tensor every rank must hold, and where.

Derived from the model itself, for *every* rank, without communication: a DTensor's
placements and device mesh say what each mesh coordinate holds (torch's rule for local
shapes and offsets, done with numpy: :func:`shard_boxes`), and the
:class:`~moeshard.placement.Placement` says which logical expert each physical slot of an
expert parameter holds. Every rank computes the same
needs, so the planner gives the same plan everywhere.

Two halves: :func:`describe_model` turns a model into plain :class:`ParamDesc` records (the
only part that looks at torch modules); :func:`need_table` (arrays, one row per need) and
:func:`compute_needs` (the same rows as :class:`Need` tuples) are pure and work for any
world size. Importing this module does not import torch (``moeshard plan`` plans without it);
the functions that look at a model import it when called.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from ..box import Box, full_box
from ..dtypes import TORCH_NAMES, cast_refusal
from ..io.checkpoint import CheckpointIndex
from ..io.formats import layer_of, parse_expert_key, scale_keys, scaled_weight
from ..io.fp8 import scale_of
from ..placement import Placement
from ..plan.arrays import expand_runs, row_prod, unique_rows
from ..plan.needs import NeedTable, SharedKeysLeftOut
from .adapters import DEFAULT_SPECS, ExpertParam, ExpertsSpec, checkpoint_names, expert_parts, specs_for, with_scales
from .hf_names import HFNames, hf_names

if TYPE_CHECKING:  # torch only where a model is looked at: need_table and its helpers run without it
    import torch
    from torch import nn

__all__ = ["ExpertRef", "ParamDesc", "Need", "describe_model", "need_table", "compute_needs", "shard_boxes",
           "param_boxes", "rank_boxes", "local_tensor", "expert_layers", "inputs_digest",
           "base_names", "is_adapter_param", "cast_refusal", "check_cast", "UnusedKeys", "unused_keys",
           "ignored_patterns", "tensor_names"]


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
        dtype: the model's dtype (checkpoint values are cast to it): a torch dtype, or its
            safetensors name (``"BF16"``; torch-free descriptions, e.g. ``moeshard plan``'s).
        mesh: ``int[*mesh_shape]`` global ranks of the DTensor's mesh, or None for a plain
            tensor held in full by every rank.
        placements: the DTensor's placements (one per mesh dim); empty for a plain tensor.
            Torch's ``Shard(dim)`` / ``Replicate()``, or torch-free: the int ``dim`` a Shard
            splits, None for Replicate.
        keys: checkpoint keys the tensor may be stored under (own name first, then tied
            aliases); unused for expert parameters.
        expert: set for expert parameters.
    """

    name: str
    shape: tuple[int, ...]
    dtype: "torch.dtype | str"
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


class _Tree(NamedTuple):
    """One walk of a model's module tree (what describing it looks at, gathered once).

    ``modules``: each module once, under its first name (``named_modules()``); ``params``:
    ``named_parameters(remove_duplicate=False)`` (a tied parameter under each of its names);
    ``buffers``: the persistent buffers, each module's once; ``peft``: whether peft wrapped
    some module (a ``base_layer`` beside ``lora_A``)."""

    modules: list[tuple[str, nn.Module]]
    params: list[tuple[str, torch.Tensor]]
    buffers: list[tuple[str, torch.Tensor]]
    peft: bool

    @property
    def base(self) -> Callable[[str], str]:
        """``name -> name in the base model`` (:func:`base_names`)."""
        return _strip_peft if self.peft else _same_name


def _walk(model: nn.Module) -> _Tree:
    # torch's named_modules / named_parameters / named_buffers each walk the tree again (a
    # generator per module and depth); one walk with their rules costs a fifth of four.
    seen: set[int] = set()
    modules, params, buffers = [], [], []
    peft = False
    for name, mod in _preorder(model):
        dot = f"{name}." if name else ""
        params.extend((dot + k, p) for k, p in mod._parameters.items() if p is not None)
        if id(mod) in seen:  # named_modules() lists a shared module (and its subtree) once
            continue
        seen.add(id(mod))
        modules.append((name, mod))
        peft = peft or _wraps_lora(mod)
        listed: set[int] = set()
        for k, b in mod._buffers.items():
            if b is not None and id(b) not in listed and k not in mod._non_persistent_buffers_set:
                listed.add(id(b))
                buffers.append((dot + k, b))
    return _Tree(modules, params, buffers, peft)


def _preorder(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules(remove_duplicate=False)``: every module under every name, parents
    first, children in order; one loop rather than a generator per module and depth."""
    stack = [("", model)]
    while stack:
        name, mod = stack.pop()
        yield name, mod
        dot = f"{name}." if name else ""
        stack.extend(reversed([(dot + k, m) for k, m in mod._modules.items() if m is not None]))


def _wraps_lora(mod: nn.Module) -> bool:
    return _has(mod, "lora_A") and _has(mod, "base_layer")


def _has(mod: nn.Module, name: str) -> bool:
    """``hasattr(mod, name)`` without the AttributeError that ``Module.__getattr__`` raises
    (and hasattr catches) for a missing name: most modules have neither peft attribute."""
    return (name in mod._modules or name in mod.__dict__ or name in mod._parameters or name in mod._buffers
            or hasattr(type(mod), name))


def _is_peft(model: nn.Module) -> bool:
    return any(map(_wraps_lora, model.modules()))


def _same_name(name: str) -> str:
    return name


def _strip_peft(name: str) -> str:
    name = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
    return _BASE_LAYER.sub("", name)


def base_names(model: nn.Module):
    """``name -> name in the base model``: identity, or for a peft model the name without
    peft's ``base_model.model.`` prefix and ``.base_layer`` segments."""
    return _strip_peft if _is_peft(model) else _same_name


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name is a peft LoRA adapter weight (not in the base checkpoint)."""
    return _ADAPTER_SEGMENTS.search(name) is not None


def expert_layers(model: nn.Module, specs: Sequence[ExpertsSpec] = DEFAULT_SPECS) -> list[tuple[str, nn.Module, ExpertsSpec]]:
    """Experts modules of ``model`` in module order (their index is the MoE layer). In a peft
    model the experts module is the innermost one (under its ``ParamWrapper`` chain)."""
    out = []
    tree = _walk(model)
    base = tree.base
    for name, mod in tree.modules:
        names = {n for n, p in mod._parameters.items() if p is not None}
        for spec in specs if names else ():  # an experts module has parameters
            if spec.matches(base(name), names):
                out.append((name, mod, with_scales(spec, names)))
                break
    return out


def _choose_spec(
    candidates: Sequence[ExpertsSpec], module: str, index: CheckpointIndex | None, renamed: bool,
    names: HFNames | None = None,
) -> tuple[ExpertsSpec, dict[str, str]]:
    """The spec of experts module ``module`` and the checkpoint key prefix of each of its
    parameters: the first spec whose per-expert keys the checkpoint has, else the experts fused
    on disk (:func:`_fused_spec`). Without a checkpoint, the model family's: ``names``,
    transformers' names for it (per expert where one of its converters stacks the module's
    experts, else fused under the names it renames them to); ``renamed``, the older family
    table's."""

    def prefixes(param: ExpertParam) -> list[str]:
        out = []
        if names is not None:
            try:
                out.append(names.checkpoint_module(module, param))
            except ValueError:  # renamed inside the per-expert key: only the model's own names
                pass
        return list(dict.fromkeys(out + list(checkpoint_names(module))))

    if index is not None:
        for spec in candidates:
            found = {}
            for p in spec.params:
                hit = next((pre for pre in prefixes(p) if all(k in index for k in p.keys(pre, 0))), None)
                if hit is None:
                    break
                found[p.name] = hit
            else:
                return spec, found

        def stored(full: str) -> str | None:  # transformers' name for it, then the model's own
            keys = ([names.checkpoint_name(full)] if names is not None else []) + list(checkpoint_names(full))
            return next((k for k in keys if k in index), None)

        fused = _fused_spec(candidates[0], module, stored)
        if fused is not None:
            return fused
        for p in candidates[0].params:  # say why, rather than "no tensor ...experts.0..." later
            refused = _refused(names, f"{module}.{p.name}")
            if refused is not None:
                raise ValueError(
                    f"parameter {module}.{p.name}: transformers reads {names.family} checkpoints into it with a "
                    f"converter moeshard cannot express as box reads ({refused})")
    spec = candidates[0]
    if names is not None and not any(s in names.specs for s in candidates) \
            and not any(_refused(names, f"{module}.{p.name}") for p in spec.params):
        # No converter of the family stacks this module's experts: transformers writes and reads
        # them fused on disk, under their (renamed) names.
        fused = _fused_spec(spec, module, names.checkpoint_name)
        assert fused is not None
        return fused
    if names is not None:
        return spec, {p.name: prefixes(p)[0] for p in spec.params}
    prefix = checkpoint_names(module)[-1] if renamed else module
    return spec, {p.name: prefix for p in spec.params}


def _refused(names: HFNames | None, full: str) -> str | None:
    """The converter of ``names`` (``"<target pattern>: <why>"``) that moeshard cannot express
    and that writes model tensor ``full``, or None."""
    for pattern, why in (names.refused if names is not None else ()):
        if any(re.search(t.strip(), full) for t in pattern.split(", ")):
            return f"{pattern}: {why}"
    return None


def _fused_spec(
    spec: ExpertsSpec, module: str, key_of: Callable[[str], str | None],
) -> tuple[ExpertsSpec, dict[str, str]] | None:
    """Experts module ``module`` read from tensors fused on disk, one per parameter holding
    every expert (``[num_logical, *slice_shape]``, as gpt-oss and Llama 4 ship them and as
    transformers keeps them in memory): each parameter of ``spec`` stored under checkpoint key
    ``key_of(<module>.<param>)`` becomes a one-part fused :class:`ExpertParam`. None when one
    has no key. The module's other parameters (gpt-oss's expert biases) stay whole tensors, as
    :func:`moeshard.parallelize` leaves them. Shapes are checked with the needs
    (:func:`_fused_rows`)."""
    params, prefixes = [], {}
    for p in spec.params:
        key = key_of(f"{module}.{p.name}")
        if key is None:
            return None
        prefix, _, leaf = key.rpartition(".")
        params.append(ExpertParam(p.name, (leaf,)))
        prefixes[p.name] = prefix
    return ExpertsSpec(module=spec.module, params=tuple(params)), prefixes


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
    hf = hf_names(model)
    if hf is not None:  # transformers' own names for the family: its converters' specs first
        ordered, renamed = (*hf.specs, *(s for s in specs if s not in hf.specs)), False
    else:
        ordered, renamed = specs_for(model, specs)
    tree = _walk(model)
    base = tree.base
    experts: dict[str, tuple[int, ExpertsSpec, dict[str, str]]] = {}
    layer = 0
    # A spec matches only a module with its parameters: most modules have no spec's first one.
    firsts = {s.params[0].name for s in ordered} if all(s.params for s in ordered) else None
    for name, mod in tree.modules:
        own = {n for n, p in mod._parameters.items() if p is not None}
        if not own or (firsts is not None and firsts.isdisjoint(own)):
            continue
        matching = [s for s in ordered if s.matches(base(name), own)]
        if matching:
            spec, prefixes = _choose_spec(matching, base(name), index, renamed, hf)
            scaled = with_scales(spec, own)
            for p in scaled.params[len(spec.params):]:  # an FP8 scale is stored where its weight is
                prefixes[p.name] = prefixes[scaled_weight(p.name)]
            experts[name] = (layer, scaled, prefixes)
            layer += 1
    aliases, tensors = _aliases(tree)
    descs = []
    meshes: dict[int, np.ndarray] = {}  # id(DeviceMesh) -> its ranks (computing it is not free)
    from .. import _dist  # here: the module's need table stays importable without torch

    members = _dist.group_ranks()  # the running operation's group, if not the default one
    for tid, aliases_of in aliases.items():
        t = tensors[tid]
        name = aliases_of[0]
        module, _, attr = name.rpartition(".")
        expert = None
        if module in experts:
            layer_idx, spec, prefixes = experts[module]
            for p in spec.params:
                if p.name == attr:
                    expert = ExpertRef(layer_idx, prefixes[p.name], p)
        if _is_dtensor(t):
            if any(p.is_partial() for p in t.placements):
                raise ValueError(f"parameter {name}: Partial DTensor placements cannot be loaded")
            dm = t.device_mesh
            mesh = meshes.get(id(dm))
            if mesh is None:
                mesh = meshes[id(dm)] = _group_mesh(dm.mesh.cpu().numpy(), members, name)
            placements = tuple(t.placements)
        else:
            mesh, placements = None, ()
        if hf is not None:  # the name transformers writes first, then the model's own
            keys = [k for n in aliases_of for k in (hf.checkpoint_name(base(n)), base(n))]
        else:
            keys = [k for n in aliases_of for k in checkpoint_names(base(n))]
            if renamed and index is None:  # the family's names first: they are what it writes
                keys = [k for n in aliases_of for k in reversed(checkpoint_names(base(n)))]
        descs.append(ParamDesc(name, tuple(t.shape), t.dtype, mesh, placements, tuple(dict.fromkeys(keys)), expert))
    return descs


def _group_mesh(mesh: np.ndarray, members: list[int] | None, name: str) -> np.ndarray:
    """``mesh`` (global ranks, as a DeviceMesh holds them) in ranks of the running operation's
    process group (``members``: its global ranks; None: the default group)."""
    if members is None:
        return mesh
    of = {g: r for r, g in enumerate(members)}
    outside = sorted({int(g) for g in mesh.reshape(-1).tolist()} - set(of))
    if outside:
        raise ValueError(f"parameter {name}: its device mesh has global ranks {outside[:8]} outside the process group "
                         f"the operation runs on (global ranks {members[:16]}{' ...' if len(members) > 16 else ''}); "
                         "pass a group that holds the model's whole mesh")
    return np.vectorize(of.__getitem__, otypes=[np.int64])(mesh)


def _aliases(tree: _Tree) -> tuple[dict[int, list[str]], dict[int, torch.Tensor]]:
    """Every parameter and persistent buffer of a model (its ``tree``) once: ``id -> [its
    names]`` (tied names together, in module order) and ``id -> tensor``; a peft adapter's
    weights left out."""
    aliases: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in tree.params + tree.buffers:
        if tree.peft and is_adapter_param(name):
            continue  # a peft adapter's weight: moeshard.lora loads and saves those
        aliases.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    return aliases, tensors


def tensor_names(model: nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter and persistent buffer of ``model`` (tied names together),
    as the base model's checkpoint names them (a peft model's adapters left out)."""
    tree = _walk(model)
    base = tree.base
    aliases, _ = _aliases(tree)
    return [tuple(dict.fromkeys(base(n) for n in names)) for names in aliases.values()]


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return _walk(model).buffers


@functools.lru_cache(maxsize=1)
def _torch_classes() -> tuple[type, type]:
    """``(nn.Parameter, DTensor)``, imported on first use (this module is imported without
    torch by ``moeshard plan``)."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    return nn.Parameter, DTensor


def _is_dtensor(t: torch.Tensor) -> bool:
    return isinstance(t, _torch_classes()[1])


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor behind a parameter (DTensor or plain), writable in place."""
    parameter, dtensor = _torch_classes()
    t = t.data if isinstance(t, parameter) else t
    return t._local_tensor if isinstance(t, dtensor) else t


# -- DTensor shards -> boxes (pure, numpy) -------------------------------------------------


def _shard_dims(placements: Sequence, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`_parse_shard_dims`, cached (placements are hashable: torch's are frozen
    dataclasses; a model has a handful of distinct ones)."""
    try:
        return _cached_shard_dims(tuple(placements), ndim)
    except TypeError:  # an unhashable placement: parse it every time
        return _parse_shard_dims(placements, ndim)


@functools.lru_cache(maxsize=1024)
def _cached_shard_dims(placements: tuple, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return _parse_shard_dims(placements, ndim)


def _parse_shard_dims(placements: Sequence, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(dims, order)``: per mesh dim, the tensor dim its ``Shard`` splits, or -1 for
    ``Replicate``; and the mesh dims in the order they split the tensor (mesh-dim order, except
    that a ``_StridedShard`` comes after the shard it strides over, see :func:`_strided_order`).
    A placement is torch's ``Shard`` / ``_StridedShard`` / ``Replicate`` or its torch-free
    spelling (an int dim, None). Raises ValueError for any other placement (``Partial``)."""
    dims = []
    strided: dict[int, int] = {}  # mesh dim -> split factor of its _StridedShard
    for p in placements:
        if p is None:
            dims.append(-1)
            continue
        if isinstance(p, int) and not isinstance(p, bool):
            dim = p
        else:
            # A torch placement: torch is already imported by whoever made it.
            from torch.distributed.tensor.placement_types import Replicate, Shard

            is_strided = type(p).__name__ == "_StridedShard"  # not a Shard subclass in every torch
            if not (is_strided or isinstance(p, (Shard, Replicate))):
                raise ValueError(f"placement {p} is not supported (Shard, _StridedShard and Replicate are)")
            if is_strided:
                strided[len(dims)] = int(p.split_factor)
            if not (is_strided or isinstance(p, Shard)):
                dims.append(-1)
                continue
            dim = p.dim
        norm = dim + ndim if dim < 0 else dim
        if not 0 <= norm < ndim:
            name = f"Shard({p})" if isinstance(p, int) else p
            raise ValueError(f"placement {name} shards dim {dim} of a {ndim}-dim tensor")
        dims.append(norm)
    return tuple(dims), _strided_order(tuple(dims), strided)


def _strided_order(dims: tuple[int, ...], strided: dict[int, int]) -> tuple[int, ...]:
    """The mesh dims in the order they split the tensor. FSDP2 over a tensor already sharded on
    the same dim by a later mesh dim (torchtitan's expert FSDP with ``Shard(0)``: EP's
    ``Shard(0)`` on the ``ep`` mesh dim, then FSDP's on ``efsdp``) writes the FSDP dim as
    ``_StridedShard(dim, split_factor=<that later mesh dim's size>)``: that mesh dim splits
    first, this one splits its chunks. Raises ValueError for a ``_StridedShard`` with no such
    later shard (torch's other uses of it are not supported)."""
    order = list(range(len(dims)))
    for i, sf in strided.items():
        later = [j for j in range(i + 1, len(dims)) if dims[j] == dims[i]]
        if len(later) != 1:
            raise ValueError(f"_StridedShard(dim={dims[i]}, split_factor={sf}) on mesh dim {i} is supported only "
                             "before exactly one Shard of the same tensor dim (FSDP2 over EP, torchtitan's layout)")
        order.remove(i)
        order.insert(order.index(later[0]) + 1, i)
    return tuple(order)


@functools.lru_cache(maxsize=4096)
def _shard_boxes(shape: tuple[int, ...], mesh_shape: tuple[int, ...], dims: tuple[int, ...],
                 order: tuple[int, ...] | None = None) -> np.ndarray:
    """:func:`shard_boxes` for placements given as :func:`_shard_dims` (read-only: cached)."""
    num = int(np.prod(mesh_shape, dtype=np.int64))
    coords = np.indices(mesh_shape, dtype=np.int64).reshape(len(mesh_shape), num)  # row-major
    off = np.zeros((num, len(shape)), dtype=np.int64)
    size = np.tile(np.asarray(shape, dtype=np.int64), (num, 1))
    for mesh_dim in (order if order is not None else range(len(dims))):
        dim = dims[mesh_dim]
        if dim < 0:
            continue
        # torch.chunk of what the earlier mesh dims left: chunks of ceil(size / n), the last
        # ones short or empty. Mesh dims sharding the same dim nest in mesh-dim order (a
        # _StridedShard after the shard it strides over: ``order``).
        cur, k = size[:, dim], coords[mesh_dim]
        chunk = -(-cur // mesh_shape[mesh_dim])
        start = np.minimum(chunk * k, cur)
        size[:, dim] = np.minimum(cur - start, chunk)
        off[:, dim] += start
    # torch gives an empty shard the dim's global size as its offset.
    for dim in {d for d in dims if d >= 0}:
        off[:, dim] = np.where(size[:, dim] == 0, shape[dim], off[:, dim])
    out = np.stack([off, size], axis=-1)
    out.setflags(write=False)
    return out


def shard_boxes(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence) -> np.ndarray:
    """Box (global coordinates) of every mesh coordinate of a DTensor of global ``shape``.

    ``placements``: one torch ``Shard(dim)`` / ``Replicate()`` per mesh dim (or the torch-free
    spelling, :class:`ParamDesc`), or FSDP2's ``_StridedShard`` over a later ``Shard`` of the same
    dim (torchtitan's expert FSDP, :func:`_strided_order`; even shards only). The rule is torch's
    (``_compute_local_shape_and_global_offset``) done with numpy, cached.

    Returns:
        ``int64[prod(mesh_shape), len(shape), 2]`` of ``(offset, length)``, mesh coordinates in
        row-major order; read-only.

    Raises ValueError for another placement (``Partial``) or an uneven ``_StridedShard``.
    """
    shape = tuple(int(n) for n in shape)
    mesh_shape = tuple(int(n) for n in mesh_shape)
    dims, order = _shard_dims(placements, len(shape))
    if order != tuple(range(len(dims))):
        # torch's strided layout is nested chunks only where the chunks divide evenly.
        for dim in {d for d in dims if d >= 0}:
            split = int(np.prod([m for m, d in zip(mesh_shape, dims) if d == dim]))
            if shape[dim] % split:
                raise ValueError(f"placements {list(placements)}: tensor dim {dim} of size {shape[dim]} does not "
                                 f"divide into {split} equal shards (uneven _StridedShard shards are not supported)")
    return _shard_boxes(shape, mesh_shape, dims, order)


@functools.lru_cache(maxsize=4096)
def _local_boxes(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple) -> tuple[Box, ...]:
    """Local box (in global coordinates) of every mesh coordinate, in row-major order."""
    return tuple(tuple(map(tuple, box)) for box in shard_boxes(shape, mesh_shape, placements).tolist())


def param_boxes(d: ParamDesc, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ranks, boxes)``: ``int64[M]`` ranks and ``int64[M, ndim, 2]`` the box (global
    coordinates) each holds, in mesh order (read-only); a plain tensor is held in full by
    ranks ``0 .. world_size - 1``. Raises ValueError for a mesh naming a rank >= world_size."""
    if d.mesh is None:
        full = np.stack([np.zeros(len(d.shape), np.int64), np.asarray(d.shape, np.int64)], axis=-1)
        return np.arange(world_size, dtype=np.int64), np.broadcast_to(full, (world_size, *full.shape))
    ranks = np.asarray(d.mesh, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero(ranks >= world_size)
    if bad.size:
        raise ValueError(f"parameter {d.name}: its mesh names rank {ranks[bad[0]]} >= world size {world_size}")
    return ranks, shard_boxes(d.shape, d.mesh.shape, d.placements)


def rank_boxes(d: ParamDesc, world_size: int) -> list[tuple[int, Box]]:
    """``[(rank, box)]``: the box (global coordinates) of ``d`` each rank holds; a plain tensor
    is held in full by every rank. Raises ValueError for a mesh naming a rank >= world_size."""
    ranks, _ = param_boxes(d, world_size)  # checks the mesh's ranks
    if d.mesh is None:
        boxes = (full_box(d.shape),) * world_size
    else:
        boxes = _local_boxes(d.shape, d.mesh.shape, d.placements)
    return list(zip(ranks.tolist(), boxes))


# -- ParamDesc -> needs (pure) ------------------------------------------------------------


def need_table(
    descs: Sequence[ParamDesc],
    index: CheckpointIndex,
    placement: Placement | None,
    world_size: int,
    dequantize: bool = False,
    keep_ranks: np.ndarray | None = None,
    _experts_whole: bool = False,
) -> NeedTable:
    """Every rank's needs as a :class:`~moeshard.plan.needs.NeedTable`, from parameter
    descriptions (pure; any world size). Rows: parameters in order; a parameter's rows in
    mesh order, then local slot, then checkpoint part.

    ``keep_ranks`` (``bool[world_size]``): a table for one rank's plan. Of the other ranks only
    the rows that are not alone are kept (the rest counted in ``omitted_bytes``): pass the
    planning rank and every rank that cannot read (its needs are all transfers). The table's
    ``digest`` (of the descriptions, the placement and the world size: what the rows are a
    pure function of, with the checkpoint index every rank shares) is the same either way.

    Raises ValueError for a key missing from the checkpoint, a shape that disagrees, a dtype
    the cast rule refuses (:func:`cast_refusal`: e.g. FP8 into bf16; with ``dequantize``, FP8
    weights with a block scale (:func:`moeshard.io.fp8.scale_of`) may go into float tensors: the
    load dequantizes them), or a placement inconsistent with the model's expert parameters.

    Cost: O(keys) Python (each check once per parameter and logical expert) plus numpy over
    the rows.
    """

    if keep_ranks is not None:
        keep_ranks = np.asarray(keep_ranks, dtype=bool)
        if keep_ranks.shape != (world_size,):
            raise ValueError(f"keep_ranks must be bool[{world_size}], got {len(keep_ranks)} entries")
    num_layers = 1 + max((d.expert.layer for d in descs if d.expert), default=-1)
    if placement is not None and num_layers:
        placement.check_layers(num_layers)
    parts: list[_DenseRows | _ExpertRows | NeedTable] = []
    layouts: dict = {}  # what parameters of one shape and sharding share: worked out once per call
    for i, d in enumerate(descs):
        if d.expert is None:
            parts.append(_dense_rows(i, d, index, _layout(d, world_size, layouts), dequantize))
        else:
            parts.append(_expert_table(i, d, index, placement, world_size, dequantize,
                                       None if _experts_whole else keep_ranks, layouts))
    try:
        table = NeedTable.concat(parts, keep_ranks, lambda keys: index.key_columns(keys)[0])
    except SharedKeysLeftOut:  # tied expert tensors (rare): build every row, concat leaves them out
        return need_table(descs, index, placement, world_size, dequantize, keep_ranks, _experts_whole=True)
    return dataclasses.replace(table, digest=inputs_digest(descs, placement, world_size, dequantize))


def inputs_digest(descs: Sequence[ParamDesc], placement: Placement | None, world_size: int,
                   dequantize: bool) -> bytes:
    """A digest of what :func:`need_table`'s rows are a function of (but the index): O(params)
    Python, each mesh's ranks hashed once."""
    h = hashlib.sha256(repr((world_size, dequantize)).encode())
    meshes: dict[int, int] = {}
    for d in descs:
        m = None
        if d.mesh is not None:
            m = meshes.get(id(d.mesh))
            if m is None:
                m = meshes[id(d.mesh)] = len(meshes)
                h.update(repr(d.mesh.shape).encode())
                h.update(np.ascontiguousarray(d.mesh, dtype=np.int64).tobytes())
        ex = d.expert
        h.update(repr((d.name, d.shape, m, tuple(map(str, d.placements)), d.keys,
                       None if ex is None else (ex.layer, ex.module, ex.param))).encode())
    if placement is not None:
        h.update(repr((placement.num_logical, placement.num_ranks, placement.phy2log.shape)).encode())
        h.update(np.ascontiguousarray(placement.phy2log, dtype=np.int64).tobytes())
    return h.digest()


def compute_needs(
    descs: Sequence[ParamDesc],
    index: CheckpointIndex,
    placement: Placement | None,
    world_size: int,
) -> list[Need]:
    """Every rank's needs as :class:`Need` tuples: :func:`need_table`'s rows (same checks).
    A Python object per need: planning at scale should use :func:`need_table`."""
    return need_table(descs, index, placement, world_size).to_needs()


class _Layout(NamedTuple):
    """What the parameters of one shape and sharding share (:func:`param_boxes` and what
    follows from it): ``ranks`` (``int64[M]``) and ``boxes`` (``int64[M, ndim, 2]``) in mesh
    order, ``keep`` (``bool[M]``: the box is not empty; None: none is), ``num`` non-empty boxes,
    and whether the holders' boxes are ``disjoint`` (:func:`_disjoint`)."""

    ranks: np.ndarray
    boxes: np.ndarray
    keep: np.ndarray | None
    num: int
    disjoint: bool


class _DenseRows(NamedTuple):
    """The rows of dense parameter number ``param`` until :meth:`NeedTable.concat` writes them:
    one per box of its ``shared`` layout (the :class:`_Layout` the parameters of its shape and
    sharding share, not a copy) that ``keep`` keeps (``bool[M]``, None for all; ``num`` of
    them), placed at the local tensor's origin."""

    param: int
    key_name: str
    shared: _Layout
    keep: np.ndarray | None
    num: int

    def __len__(self) -> int:
        return self.num

    @property
    def ranks(self) -> np.ndarray:
        return self.shared.ranks

    @property
    def boxes(self) -> np.ndarray:
        return self.shared.boxes

    @property
    def alone(self) -> bool:
        return self.shared.disjoint

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key_name,) if self.num else ()

    @property
    def ndim(self) -> np.ndarray:
        return np.asarray([self.boxes.shape[1]] if self.num else [], dtype=np.int8)

    @property
    def width(self) -> int:
        return self.boxes.shape[1]

    def _rows(self) -> tuple[np.ndarray, np.ndarray]:
        return (self.ranks, self.boxes) if self.keep is None else (self.ranks[self.keep], self.boxes[self.keep])

    @property
    def layout(self) -> int:
        """Equal for parameters of one layout (one :func:`need_table` call's :class:`_Layout`,
        alive while it runs; which boxes are empty follows from it)."""
        return id(self.shared)

    def row_ranks(self) -> np.ndarray:
        return self.ranks if self.keep is None else self.ranks[self.keep]

    def row_keys(self) -> np.ndarray:
        return np.zeros(self.num, dtype=np.int64)

    def row_numel(self) -> np.ndarray:
        numel = row_prod(self.boxes[:, :, 1])
        return numel if self.keep is None else numel[self.keep]

    def select(self, mask: np.ndarray) -> "_DenseRows":
        """These rows where ``mask`` (``bool[len(self)]``) is True."""
        keep = np.zeros(len(self.ranks), dtype=bool)
        keep[np.flatnonzero(self.keep) if self.keep is not None else slice(None)] = mask
        # Not _replace: it checks the fields' count with len(), which is the rows' here.
        return _DenseRows(self.param, self.key_name, self.shared, keep, int(keep.sum()))

    def fill(self, table: NeedTable, rows: slice, key_ids: np.ndarray) -> None:
        ranks, boxes = self._rows()
        table.rank[rows] = ranks
        table.param[rows] = self.param
        table.key[rows] = key_ids[0]
        table.slot[rows] = -1
        d = self.width
        table.src_off[rows, :d] = boxes[:, :, 0]
        table.src_len[rows, :d] = boxes[:, :, 1]
        table.dst_off[rows, :d] = 0
        if table.alone is not None:
            table.alone[rows] = self.alone


def _cached(cache: dict, key: tuple, make: Callable):
    """``cache[key]``, made by ``make()`` on first use (always made where ``key`` is not
    hashable: a placement of another library's)."""
    try:
        hit = cache.get(key)
    except TypeError:
        return make()
    if hit is None:
        hit = cache[key] = make()
    return hit


def _layout(d: ParamDesc, world_size: int, cache: dict) -> _Layout:
    """:class:`_Layout` of ``d``, from ``cache`` (one :func:`need_table` call's: the descriptions
    of one model share their mesh arrays)."""

    def make() -> _Layout:
        ranks, boxes = param_boxes(d, world_size)
        keep = (boxes[:, :, 1] > 0).all(axis=1)
        num = int(keep.sum())
        return _Layout(ranks, boxes, None if num == len(keep) else keep, num, _disjoint(d, len(ranks)))

    return _cached(cache, _layout_key(d), make)


def _layout_key(d: ParamDesc) -> tuple:
    """What :class:`_Layout` is a function of (with the world size, one per call)."""
    return d.shape, None if d.mesh is None else id(d.mesh), d.placements


def _dense_rows(i: int, d: ParamDesc, index: CheckpointIndex, layout: _Layout, dequantize: bool = False) -> _DenseRows:
    """The rows of dense parameter number ``i`` (checked against the checkpoint): one per
    non-empty box of its ``layout``."""

    key = _find_key(d, index)
    info = index.info(key)
    check_cast(f"parameter {d.name}", key, index, d.dtype, dequantize)
    if tuple(info.shape) != d.shape:
        raise ValueError(
            f"parameter {d.name}: checkpoint tensor {key!r} has shape {list(info.shape)}, "
            f"the model expects {list(d.shape)}"
        )
    return _DenseRows(i, key, layout, layout.keep, layout.num)


def _disjoint(d: ParamDesc, num_holders: int) -> bool:
    """Whether the non-empty boxes that the holders of ``d`` hold are pairwise different: no
    mesh dim of two or more ranks replicates it (a plain tensor: held whole by every rank)."""
    if d.mesh is None:
        return num_holders == 1
    dims, _ = _shard_dims(d.placements, len(d.shape))
    return all(n == 1 or dim >= 0 for n, dim in zip(d.mesh.shape, dims))


def _find_key(d: ParamDesc, index: CheckpointIndex) -> str:
    for key in d.keys:
        if key in index:
            return key
    also = f" (nor under its other names {list(d.keys[1:])})" if len(d.keys) > 1 else ""
    raise ValueError(f"parameter {d.name}: checkpoint {index.root} has no tensor {d.keys[0]!r}{also}")


def check_cast(what: str, key: str, index: CheckpointIndex, dtype: torch.dtype | str, dequantize: bool = False) -> None:
    """Raise ValueError when checkpoint tensor ``key`` may not be cast to ``dtype``
    (:func:`~moeshard.dtypes.cast_refusal`); ``what`` names the destination ("parameter x").
    ``dequantize``: an FP8 weight with a block scale that fits it (:func:`moeshard.io.fp8.scale_of`)
    may go into a float tensor of two or more bytes (the caller dequantizes it with that scale).
    Pure; every rank that plans a read calls it."""
    ckpt_dtype = index.info(key).dtype
    why = cast_refusal(ckpt_dtype, dtype)
    if why is None:
        return
    if why == "from_fp8" and dequantize and cast_refusal("F32", dtype) is None and scale_of(index, key) is not None:
        return
    src = f"torch.{TORCH_NAMES[ckpt_dtype]}"  # as a torch dtype prints
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
    # The scale tensors a quantized checkpoint stores beside weight ``key`` (io.formats).
    scales = [k for k in scale_keys(key) if k in index]
    if scales:
        info = index.info(scales[0])
        what_scale = f"its scale tensor {scales[0]!r} ({info.dtype} {list(info.shape)})"
        if dequantize:  # there is a scale, but no block quantization of this weight makes its shape
            raise ValueError(
                f"{head} (FP8), the model's tensor is {dtype}: {what_scale} is not a float block scale of a "
                f"weight of shape {list(index.info(key).shape)} (no power-of-two block gives that shape), "
                f"so it cannot be dequantized; {keep}")
        raise ValueError(
            f"{head} (FP8), the model's tensor is {dtype}: {what_scale} would be dropped and the raw FP8 "
            f"values loaded unscaled. moeshard.load dequantizes such weights (dequantize=True, its "
            f"default); this operation does not: {keep}")
    raise ValueError(
        f"{head} (FP8), the model's tensor is {dtype}: the checkpoint has no scale tensor for it (no "
        f"{scale_keys(key)[0]!r}), and its raw FP8 values would be meaningless as {dtype}; use a "
        f"dequantized checkpoint, or {keep}")


def _slot_experts(d: ParamDesc, placement: Placement | None) -> tuple[np.ndarray, int]:
    """``(phy2log, num_logical)`` for expert parameter ``d``: ``int64[num_physical]`` the logical
    expert of each slot of its layer (-1: empty); without a placement, slot p holds expert p."""
    assert d.expert is not None
    num_physical = d.shape[0]
    if placement is None:
        return np.arange(num_physical, dtype=np.int64), num_physical
    if placement.num_physical != num_physical:
        raise ValueError(
            f"parameter {d.name} has {num_physical} expert slots per layer, the placement has "
            f"{placement.num_physical} physical slots"
        )
    return np.asarray(placement.phy2log[d.expert.layer], dtype=np.int64), placement.num_logical


def _check_spans(d: ParamDesc, boxes: np.ndarray, slots_per_rank: int) -> None:
    """Raise ValueError when a non-empty box (``int64[M, ndim, 2]``) of expert parameter
    ``d`` covers slots of more than one EP rank (``slots_per_rank`` slots each)."""
    s0, ns = boxes[:, 0, 0], boxes[:, 0, 1]
    bad = np.flatnonzero((ns > 0) & (s0 // slots_per_rank != (s0 + ns - 1) // slots_per_rank))
    if bad.size:
        box = tuple(map(tuple, boxes[bad[0]].tolist()))
        raise ValueError(f"parameter {d.name}: local box {list(box)} spans several EP ranks' slots")


# need_table(keep_ranks=): an expert parameter with more held (box, slot) pairs than this does not
# build other ranks' alone rows; with fewer, building them all and leaving them out in
# NeedTable.concat costs less than counting them apart (~0.1 ms per parameter).
_UNBUILT_ABOVE = 4096


def _expert_table(
    i: int,
    d: ParamDesc,
    index: CheckpointIndex,
    placement: Placement | None,
    world_size: int,
    dequantize: bool,
    keep_ranks: np.ndarray | None,
    cache: dict,
) -> "_ExpertRows | NeedTable":
    """The rows of expert parameter number ``i``: for each rank holding a non-empty box of it
    (dim 0 = slots), each slot of its box holding a logical expert, each checkpoint part of
    that expert the box overlaps.

    ``keep_ranks`` (:func:`need_table`'s): the alone rows of the other ranks are not built but
    counted (``omitted_bytes``, ``full``), where there are many (``_UNBUILT_ABOVE``) and every
    part of every held expert has one item size (a slot's box then weighs its elements times
    that size); else they are built, for :meth:`NeedTable.concat` to leave out.

    ``cache`` (one :func:`need_table` call's): the rows of parameters of one layout, placement
    row and part sizes differ only in their keys (every MoE layer of a model alike), so they are
    worked out once; each parameter's keys are still checked against the checkpoint."""

    ref = d.expert
    assert ref is not None
    phy2log, num_logical = _slot_experts(d, placement)
    spans = d.shape[0] // placement.num_ranks \
        if d.mesh is not None and placement is not None and placement.num_ranks is not None else None
    where = (*_layout_key(d), phy2log.tobytes(), num_logical, spans)
    slots = _cached(cache, ("slots", *where), lambda: _held_slots(d, _layout(d, world_size, cache), phy2log,
                                                                     num_logical, spans))
    if ref.param.fused:
        return _fused_rows(i, d, index, phy2log, num_logical, slots, dequantize)
    part_sizes = _part_sizes(d, index, 0, d.shape[1:], dequantize)  # expert 0's: every expert must agree
    extra = ref.param.keys(ref.module, num_logical)
    if extra[0] in index:
        raise ValueError(
            f"parameter {d.name}: the checkpoint has expert {num_logical} ({extra[0]!r}) but the "
            f"placement has only {num_logical} logical experts"
        )
    keys = _held_expert_keys(d, index, slots.held.tolist(), part_sizes, dequantize)
    unit = None  # the one item size of the keys, where other ranks' alone rows go unbuilt
    if keep_ranks is not None and len(slots.owner) > _UNBUILT_ABOVE:
        itemsize = index.key_columns(keys)[0]
        if (itemsize == itemsize[0]).all():
            unit = int(itemsize[0])
    rows = _cached(cache, ("rows", *where, part_sizes, ref.param.dim, unit),
                   lambda: _expert_rows(slots, part_sizes, ref.param.dim, len(keys), keep_ranks, unit))
    return _ExpertRows(i, tuple(keys), rows)


class _ExpertRows(NamedTuple):
    """The rows of expert parameter number ``param`` until :meth:`NeedTable.concat` writes
    them: the read-only ``rows`` of its layout (:func:`_expert_rows`, shared by the parameters
    of one layout, placement row and part sizes), named by its own checkpoint ``keys``."""

    param: int
    keys: tuple[str, ...]
    rows: NeedTable

    def __len__(self) -> int:
        return len(self.rows)

    ndim = property(lambda self: self.rows.ndim)
    alone = property(lambda self: self.rows.alone)
    width = property(lambda self: self.rows.width)
    full = property(lambda self: self.rows.full)
    omitted_bytes = property(lambda self: self.rows.omitted_bytes)
    layout = None  # rows left out by key and rank, not by layout

    def row_ranks(self) -> np.ndarray:
        return self.rows.rank

    def row_keys(self) -> np.ndarray:
        return self.rows.key

    def row_numel(self) -> np.ndarray:
        return self.rows.row_numel()

    def select(self, mask: np.ndarray) -> "_ExpertRows":
        return _ExpertRows(self.param, self.keys, self.rows.take(mask))

    def fill(self, table: NeedTable, rows: slice, key_ids: np.ndarray) -> None:
        self.rows.fill(table, rows, key_ids)
        table.param[rows] = self.param  # over the shared rows' unset param


class _HeldSlots(NamedTuple):
    """The (box, slot) pairs of an expert parameter's layout that hold a logical expert:
    ``ranks`` (``int64[M']``) and ``boxes`` (``int64[M', ndim, 2]``) the non-empty boxes, then
    per pair (box order, then slot order) the box's index ``owner``, the global ``slot`` and
    its logical ``expert``; ``held``: the logical experts some slot holds (ascending);
    ``copies``: ``int64[num_logical]`` slots per logical expert; ``disjoint``: the layout's."""

    ranks: np.ndarray
    boxes: np.ndarray
    owner: np.ndarray
    slot: np.ndarray
    expert: np.ndarray
    held: np.ndarray
    copies: np.ndarray
    disjoint: bool


def _expert_rows(slots: _HeldSlots, part_sizes: tuple[int, ...], dim: int, num_keys: int,
                 keep_ranks: np.ndarray | None, unit: int | None) -> NeedTable:
    """:func:`_expert_table`'s rows for ``slots`` and checkpoint parts of ``part_sizes`` along
    ``dim``, the keys still unnamed (``num_keys`` of them: part by part, then held expert) and
    ``param`` unset; read-only (parameters of one layout share them). ``unit``: the item size
    where the alone rows of ranks not in ``keep_ranks`` go unbuilt, else None."""
    ranks, boxes, owner, slot, expert = slots.ranks, slots.boxes, slots.owner, slots.slot, slots.expert
    omitted = None
    if unit is not None:
        assert keep_ranks is not None
        drop = (slots.copies[expert] == 1) & slots.disjoint & ~keep_ranks[ranks[owner]]
        if drop.any():
            numel = row_prod(boxes[owner[drop], 1:, 1])  # the parts a box overlaps tile it
            omitted = np.bincount(ranks[owner[drop]], weights=numel * unit,
                                  minlength=len(keep_ranks)).astype(np.int64)
            owner, slot, expert = owner[~drop], slot[~drop], expert[~drop]
    # The parts a box overlaps depend only on its slice dims: computed once per distinct tail.
    used = np.unique(owner)
    tails, tail_of_used = unique_rows(boxes[used, 1:, :].reshape(len(used), 2 * (boxes.shape[1] - 1)))
    first, count, part, src_off, src_len, dst_off = _part_rows(tails.reshape(len(tails), boxes.shape[1] - 1, 2),
                                                               part_sizes, dim)
    tail = tail_of_used[np.searchsorted(used, owner)]
    row, prow = expand_runs(first[tail], count[tail])
    # Keys are part by part. Each is used (but for experts whose rows were left out): the
    # boxes of a held slot tile its slice, so they overlap every part.
    key = part[prow] * len(slots.held) + np.searchsorted(slots.held, expert[row])
    num = len(row)
    columns = dict(
        ndim=np.full(num_keys, boxes.shape[1] - 1, np.int8), rank=ranks[owner[row]].astype(np.int32),
        param=np.zeros(num, np.int32), key=key.astype(np.int32), slot=slot[row] - boxes[owner[row], 0, 0],
        src_off=src_off[prow], src_len=src_len[prow], dst_off=dst_off[prow],
        alone=(slots.copies[expert[row]] == 1) & slots.disjoint,
        full=None if omitted is None else np.asarray(keep_ranks, dtype=bool), omitted_bytes=omitted,
    )
    for a in columns.values():
        if a is not None:
            a.setflags(write=False)
    return NeedTable(keys=("",) * num_keys, **columns)


def _held_slots(d: ParamDesc, layout: _Layout, phy2log: np.ndarray, num_logical: int,
                spans: int | None) -> _HeldSlots:
    """:class:`_HeldSlots` of expert parameter ``d`` of ``layout`` (its slot ``p`` holds logical
    expert ``phy2log[p]``, -1 for none). ``spans``: the slots of one EP rank, where a box must
    not cover two ranks' (ValueError)."""
    ranks, boxes = layout.ranks, layout.boxes
    if layout.keep is not None:
        ranks, boxes = ranks[layout.keep], boxes[layout.keep]
    if spans is not None:
        _check_spans(d, boxes, spans)
    owner, slot = expand_runs(boxes[:, 0, 0], boxes[:, 0, 1])
    expert = phy2log[slot]
    live = expert >= 0  # -1: an empty slot (dead or not-yet-joined rank), nothing to load
    owner, slot, expert = owner[live], slot[live], expert[live]
    held = np.flatnonzero(np.bincount(expert, minlength=num_logical))
    # A slot's boxes are another rank's too only if its expert has several slots (or a mesh
    # dim replicates the parameter): the boxes of one slot are disjoint.
    copies = np.bincount(phy2log[phy2log >= 0], minlength=num_logical)
    return _HeldSlots(ranks, boxes, owner, slot, expert, held, copies, layout.disjoint)


def _fused_rows(
    i: int, d: ParamDesc, index: CheckpointIndex, phy2log: np.ndarray, num_logical: int, slots: _HeldSlots,
    dequantize: bool = False,
) -> NeedTable:
    """:func:`_expert_table`'s rows for an expert parameter fused on disk: one checkpoint tensor
    ``[num_logical, *slice_shape]``, row ``e`` logical expert ``e``. A rank's run of local slots
    holding consecutive experts is one row (a contiguous placement: one row per rank), read
    into the whole local tensor (``slot`` -1, the local slot as the first dst offset)."""
    key, shape = _fused_tensor(d, index, dequantize)
    want = [num_logical, *d.shape[1:]]
    if shape != want:
        raise ValueError(
            f"parameter {d.name}: checkpoint tensor {key!r} (every expert fused on disk) has shape {shape}, "
            f"the model expects {want} ({num_logical} logical experts of slice {want[1:]})"
        )
    ranks, boxes, owner, slot, expert = slots.ranks, slots.boxes, slots.owner, slots.slot, slots.expert
    # Runs: the same rank, the next slot, the next expert.
    start = np.ones(len(slot), dtype=bool)
    start[1:] = (owner[1:] != owner[:-1]) | (slot[1:] != slot[:-1] + 1) | (expert[1:] != expert[:-1] + 1)
    first = np.flatnonzero(start)
    length = np.diff(np.append(first, len(slot)))
    owner, slot, expert = owner[first], slot[first], expert[first]
    num, ndim = len(first), len(d.shape)
    tail_off, tail_len = boxes[owner, 1:, 0], boxes[owner, 1:, 1]
    src_off = np.concatenate([expert[:, None], tail_off], axis=1)
    src_len = np.concatenate([length[:, None], tail_len], axis=1)
    dst_off = np.zeros((num, ndim), np.int64)
    dst_off[:, 0] = slot - boxes[owner, 0, 0]
    # Runs of different ranks share a box only where an expert has several slots.
    alone = slots.disjoint and bool((slots.copies <= 1).all())
    return NeedTable(
        keys=(key,), ndim=np.full(1, ndim, np.int8), rank=ranks[owner].astype(np.int32),
        param=np.full(num, i, np.int32), key=np.zeros(num, np.int32), slot=np.full(num, -1, np.int64),
        src_off=src_off.astype(np.int64), src_len=src_len.astype(np.int64), dst_off=dst_off,
        alone=np.full(num, alone),
    )


def _fused_tensor(d: ParamDesc, index: CheckpointIndex, dequantize: bool) -> tuple[str, list[int]]:
    """``(key, shape)`` of the one checkpoint tensor of expert parameter ``d`` fused on disk;
    ValueError when the checkpoint lacks it or the cast rule refuses its dtype."""
    assert d.expert is not None
    (key,) = d.expert.param.keys(d.expert.module, 0)
    if key not in index:
        raise ValueError(f"parameter {d.name}: checkpoint {index.root} has no tensor {key!r}")
    check_cast(f"parameter {d.name}", key, index, d.dtype, dequantize)
    return key, list(index.info(key).shape)


def _held_expert_keys(d: ParamDesc, index: CheckpointIndex, held: Sequence[int], part_sizes: tuple[int, ...],
                      dequantize: bool = False) -> list[str]:
    """The checkpoint keys of logical experts ``held`` (ascending) of expert parameter ``d``,
    part by part (:func:`_keys_of_experts`). Raises ValueError for an expert whose parts do not
    fit the slice as expert 0's (``part_sizes``) do: checked once per expert."""
    ref = d.expert
    assert ref is not None
    keys = _keys_of_experts(ref, held)
    # An expert whose parts have expert 0's dtypes and shapes passes every check expert 0
    # passed; only the others go through the full check, for its error message.
    kinds = index.key_kinds(keys).reshape(len(ref.param.parts), len(held))
    want = index.key_kinds(ref.param.keys(ref.module, 0))
    suspect = np.asarray(held, dtype=np.int64)[(kinds != want[:, None]).any(axis=0)]
    for e in suspect.tolist():
        if _part_sizes(d, index, e, d.shape[1:], dequantize) != part_sizes:
            raise ValueError(
                f"parameter {d.name}: checkpoint tensors {list(ref.param.keys(ref.module, e))} of "
                f"logical expert {e} differ in shape from expert 0's"
            )
    return keys


def _part_rows(tails: np.ndarray, part_sizes: tuple[int, ...], dim: int) -> tuple[np.ndarray, ...]:
    """The checkpoint parts of each distinct slice box (``tails``: ``int64[T, ndim, 2]``,
    expert dim excluded), by :func:`~moeshard.adapters.expert_parts`.

    Returns ``(first, count, part, src_off, src_len, dst_off)``: tail ``t``'s parts are rows
    ``first[t] .. first[t] + count[t] - 1`` (``int64[T]``); per row (``P`` of them) the part
    index ``int64[P]``, the box in the part's tensor ``int64[P, ndim]`` (offsets, lengths) and
    where it lands relative to the tail's origin ``int64[P, ndim]``.
    """
    ndim = tails.shape[1]
    count = np.zeros(len(tails), np.int64)
    part, src, dst = [], [], []
    for t, tail in enumerate(tails.tolist()):
        box = tuple(map(tuple, tail))
        # A 0-dim slice (a per-expert scalar) is its one part, whole.
        pieces = expert_parts(box, part_sizes, dim) if ndim else [(0, (), ())]
        count[t] = len(pieces)
        for j, part_box, sub in pieces:
            part.append(j)
            src.append(part_box)
            dst.append([o - b for (o, _), (b, _) in zip(sub, box)])
    src_arr = np.asarray(src, np.int64).reshape(len(src), ndim, 2)
    return (np.cumsum(count) - count, count, np.asarray(part, np.int64), np.ascontiguousarray(src_arr[:, :, 0]),
            np.ascontiguousarray(src_arr[:, :, 1]), np.asarray(dst, np.int64).reshape(len(dst), ndim))


def _part_sizes(d: ParamDesc, index: CheckpointIndex, expert: int, slice_shape: tuple[int, ...],
                dequantize: bool = False) -> tuple[int, ...]:
    """Sizes along the concatenation dim of the checkpoint parts of logical ``expert``'s
    slice of expert parameter ``d`` (``(1,)`` for a 0-dim slice: one scalar part). Raises
    ValueError for a missing part, a dtype the cast rule refuses or parts that do not make up
    a slice of ``slice_shape``."""
    ref = d.expert
    assert ref is not None
    keys = ref.param.keys(ref.module, expert)
    dim = ref.param.dim
    if ref.param.fused:  # row ``expert`` of one tensor holding every expert
        key, shape = _fused_tensor(d, index, dequantize)
        if shape[1:] != list(slice_shape) or not shape or shape[0] <= expert:
            raise ValueError(f"parameter {d.name}: checkpoint tensor {key!r} (every expert fused on disk) has shape "
                             f"{shape}, which holds no logical expert {expert} of slice {list(slice_shape)}")
        return (slice_shape[dim] if slice_shape else 1,)
    sizes = []
    for key in keys:
        if key not in index:
            raise ValueError(f"parameter {d.name}: checkpoint {index.root} has no tensor {key!r} (logical expert {expert})")
        info = index.info(key)
        check_cast(f"parameter {d.name}", key, index, d.dtype, dequantize)
        shape = list(info.shape)
        want = list(slice_shape)
        if len(shape) != len(want) or any(a != b for k, (a, b) in enumerate(zip(shape, want)) if k != dim):
            raise ValueError(
                f"parameter {d.name}: checkpoint tensor {key!r} has shape {shape}, which does not fit "
                f"an expert slice of shape {want} (parts concatenated along dim {dim})"
            )
        sizes.append(shape[dim] if shape else 1)
    total = slice_shape[dim] if slice_shape else 1
    if sum(sizes) != total:
        raise ValueError(
            f"parameter {d.name}: checkpoint tensors {list(keys)} of logical "
            f"expert {expert} have sizes {sizes} along dim {dim}, summing to {sum(sizes)}, "
            f"not {total}"
        )
    return tuple(sizes)


# -- checkpoint keys that no parameter reads (pure) -----------------------------------------

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
    name = "_keys_to_ignore_on_load_unexpected"
    for _, m in _preorder(model):  # a module listed twice adds nothing
        # getattr(m, name, None) for a list that is no parameter, buffer or submodule, without
        # Module.__getattr__'s AttributeError on every module that lacks it.
        for pattern in (m.__dict__[name] if name in m.__dict__ else getattr(type(m), name, None)) or ():
            out[pattern] = None
    return tuple(sorted(out))


def unused_keys(
    descs: Sequence[ParamDesc],
    index: CheckpointIndex,
    placement: Placement | None,
    ignore: Sequence[str] = (),
    also_read: Sequence[str] = (),
) -> UnusedKeys:
    """Checkpoint keys that no parameter or buffer of ``descs`` reads (pure, no communication:
    every rank computes the same). Call it after :func:`compute_needs`, which raises for
    missing keys.

    A key is consumed when some parameter reads it given the model, whatever the placement:
    a dense parameter's first key present in the checkpoint (the tied aliases after it are
    unused but harmless), and every part of every logical expert ``0 .. num_logical - 1`` of
    an expert parameter (an expert no slot holds, e.g. on a dead rank, is still the model's).
    ``ignore``: regexes (``re.search``) of keys never suspicious (:func:`ignored_patterns`).
    ``also_read``: keys the caller reads besides the parameters' (the scales of dequantized FP8 weights).
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
    consumed.update(also_read)
    unused = sorted(index.tensors.keys() - consumed)
    counts = _layer_counts(dense + list(prefixes))
    ignored = re.compile("|".join(f"(?:{p})" for p in ignore)) if ignore else None
    experts = tuple(prefixes)
    suspicious: dict[str, list[str]] = {}
    for key in unused:
        if key in aliases or (ignored is not None and ignored.search(key)):
            continue
        reason = None
        layer = layer_of(key)
        if layer is not None and layer[0] in counts and layer[1] >= counts[layer[0]]:
            reason = f"are in layers beyond the model's {counts[layer[0]]} under {layer[0]!r}"
        elif key.startswith(experts) or parse_expert_key(key) is not None:
            reason = _EXPERTS_REASON
        elif scaled_weight(key) in consumed:
            reason = _SCALES_REASON
        if reason is not None:
            suspicious.setdefault(reason, []).append(key)
    return UnusedKeys(tuple(unused), {r: tuple(k) for r, k in suspicious.items()})


def _expert_keys(ref: ExpertRef, num_logical: int) -> list[str]:
    """Every checkpoint key of logical experts ``0 .. num_logical - 1`` of ``ref``
    (:func:`_keys_of_experts`; the one tensor of a parameter fused on disk)."""
    if ref.param.fused:
        return list(ref.param.keys(ref.module, 0))
    return _keys_of_experts(ref, range(num_logical))


def _keys_of_experts(ref: ExpertRef, experts: Sequence[int]) -> list[str]:
    """Every checkpoint key of logical ``experts`` of ``ref``, part by part: part 0 of each
    expert, then part 1... DeepSeek-V3 has ~45,000: a template's keys (head + id + tail) are
    one join and one split, not a ``str.format`` call or a concatenation per key."""
    ids = list(map(str, experts))
    out: list[str] = []
    try:
        templates = ref.param.keys(ref.module, "{e}")  # the keys with their expert id left as "{e}"
    except ValueError:  # a template with a format spec (e.g. "{e:03d}"): one format per key
        return [ref.param.keys(ref.module, e)[j] for j in range(len(ref.param.parts)) for e in experts]
    for j, template in enumerate(templates):
        head, _, tail = template.partition("{e}")
        if "{e}" in tail or head == template:  # the id not exactly once: one format per key
            out.extend(ref.param.keys(ref.module, e)[j] for e in experts)
        elif "\0" in template:
            out.extend([head + i + tail for i in ids])
        elif ids:  # one join and one split (C loops) rather than a concatenation per key
            out.extend((head + (tail + "\0" + head).join(ids) + tail).split("\0"))
    return out


def _layer_counts(keys: Sequence[str]) -> dict[str, int]:
    """``{layer stack prefix: number of layers}`` from keys the model reads (the stack is the
    first ``...layers.<N>.`` of a key)."""
    counts: dict[str, int] = {}
    for key in keys:
        layer = layer_of(key)
        if layer is not None:
            counts[layer[0]] = max(counts.get(layer[0], 0), layer[1] + 1)
    return counts
