"""A model as the planners see it: one :class:`ParamDesc` per parameter and persistent buffer.

:func:`describe_model` is the only code that looks at a model's modules: their names (a peft
model's without peft's segments, adapter weights left out), which modules hold experts and
under which checkpoint names (per expert, or fused on disk; transformers' names for the family
where it has them), the tied aliases, and each DTensor's mesh (in ranks of the running
operation's group) and placements. Everything downstream (needs, shard boxes, unused keys,
the save's outputs) works on the records. Importing this module does not import torch
(``moeshard plan`` describes synthetic models without it); the functions that look at a model
import it when called.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..io.formats import scaled_weight
from ..io.index import CheckpointIndex
from .adapters import (
    DEFAULT_SPECS,
    PACKED_SPECS,
    ExpertParam,
    ExpertsSpec,
    checkpoint_names,
    class_names,
    expert_shape,
    identity_rows,
    routed_block,
    specs_for,
    with_scales,
)
from .hf_names import HFNames, hf_names

if TYPE_CHECKING:  # torch only where a model is looked at
    import torch
    from torch import nn

__all__ = [
    "ExpertRef",
    "ExpertsModule",
    "ParamDesc",
    "describe_model",
    "expert_layers",
    "KEEPS_PACKED",
    "keeps_packed",
    "layer_names",
    "tensor_names",
    "local_tensor",
    "base_names",
    "is_adapter_param",
    "preorder",
    "persistent_buffers",
]


@dataclass(frozen=True)
class ExpertRef:
    """An expert parameter: MoE ``layer`` index, the checkpoint key prefix of its experts
    module (the module's name, or the name its checkpoint uses, e.g. ``block_sparse_moe``),
    and its spec. ``identity``: rows for identity ("zero") experts the parameter keeps on disk
    after the logical experts' (experts ``num_logical .. num_logical + identity - 1``; no
    forward reads them: :data:`~moeshard.models.adapters.IDENTITY_EXPERTS`); an unsharded model
    holds them after its logical experts, an EP model does not."""

    layer: int
    module: str
    param: ExpertParam
    identity: int = 0


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
        parts: for a dense tensor, the checkpoint keys it is concatenated from along
            ``part_dim`` where none of ``keys`` is stored (transformers' ``Concatenate``
            converters: :meth:`~moeshard.models.hf_names.HFNames.checkpoint_parts`), in order;
            what a save writes. Empty: the tensor is stored whole.
        part_dim: the dim ``parts`` are concatenated along.
        refused: for a dense tensor the checkpoint stores under none of ``keys``, the reason when
            one of transformers' converters moeshard cannot express writes it (a ``Split`` of
            one checkpoint tensor into several model tensors): what a read of it raises.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | str
    mesh: np.ndarray | None
    placements: tuple = ()
    keys: tuple[str, ...] = ()
    expert: ExpertRef | None = None
    parts: tuple[str, ...] = ()
    part_dim: int = 0
    refused: str = ""


# -- model -> ParamDesc -------------------------------------------------------------------


# A peft (LoRA) model: ``get_peft_model`` prefixes every name with ``base_model.model.`` and
# a wrapped module's own parameters move under ``<module>.base_layer``; adapter weights live in
# ``lora_A`` / ``lora_B`` containers of the wrapper. Checkpoints of the base model use
# the names without peft's segments.
_PEFT_PREFIX = "base_model.model."
_BASE_LAYER = re.compile(r"\.base_layer(?=\.|$)")
_ADAPTER_SEGMENTS = re.compile(r"(^|\.)(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.")


class ModuleTree(NamedTuple):
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


def walk_modules(model: nn.Module) -> ModuleTree:
    """One walk of ``model``'s module tree: its modules, parameters and persistent buffers."""
    # torch's named_modules / named_parameters / named_buffers each walk the tree again (a
    # generator per module and depth); one walk with their rules costs a fifth of four.
    seen: set[int] = set()
    modules, params, buffers = [], [], []
    peft = False
    for name, mod in preorder(model):
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
    return ModuleTree(modules, params, buffers, peft)


def preorder(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules(remove_duplicate=False)``: every module under every name, parents
    first, children in order; one loop rather than a generator per module and depth."""
    stack = [("", model)]
    while stack:
        name, mod = stack.pop()
        yield name, mod
        dot = f"{name}." if name else ""
        stack.extend(reversed([(dot + k, m) for k, m in mod._modules.items() if m is not None]))


def _wraps_lora(mod: nn.Module) -> bool:
    return has_attr(mod, "lora_A") and has_attr(mod, "base_layer")


def has_attr(mod: nn.Module, name: str) -> bool:
    """``hasattr(mod, name)`` without the AttributeError that ``Module.__getattr__`` raises
    (and hasattr catches) for a missing name: most modules have neither peft attribute."""
    return (
        name in mod._modules
        or name in mod.__dict__
        or name in mod._parameters
        or name in mod._buffers
        or hasattr(type(mod), name)
    )


def _is_peft(model: nn.Module) -> bool:
    return any(map(_wraps_lora, model.modules()))


def _same_name(name: str) -> str:
    return name


def _strip_peft(name: str) -> str:
    name = name[len(_PEFT_PREFIX) :] if name.startswith(_PEFT_PREFIX) else name
    return _BASE_LAYER.sub("", name)


def base_names(model: nn.Module):
    """``name -> name in the base model``: identity, or for a peft model the name without
    peft's ``base_model.model.`` prefix and ``.base_layer`` segments."""
    return _strip_peft if _is_peft(model) else _same_name


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name is a peft LoRA adapter weight (not in the base checkpoint)."""
    return _ADAPTER_SEGMENTS.search(name) is not None


class ExpertsModule(NamedTuple):
    """An experts module of a model: its ``name``, the ``module``, its ``spec`` (FP8 scales
    included) and its MoE ``layer``: the placement row, shared by the experts modules one
    router drives (:func:`~moeshard.models.adapters.routed_block`)."""

    name: str
    module: nn.Module
    spec: ExpertsSpec
    layer: int


def expert_layers(model: nn.Module, specs: Sequence[ExpertsSpec] = DEFAULT_SPECS) -> list[ExpertsModule]:
    """Experts modules of ``model`` in module order, each with its MoE layer (layers numbered
    in the order their first experts module comes; JetMoE's ``input_linear`` and
    ``output_linear`` of one block share one). In a peft model the experts module is the
    innermost one (under its ``ParamWrapper`` chain)."""
    out = []
    tree = walk_modules(model)
    base = tree.base
    blocks: dict[str, int] = {}
    for name, mod in tree.modules:
        names = {n for n, p in mod._parameters.items() if p is not None}
        for spec in specs if names else ():  # an experts module has parameters
            if spec.matches(base(name), names, mod):
                layer = blocks.setdefault(routed_block(base(name), spec), len(blocks))
                out.append(ExpertsModule(name, mod, with_scales(spec, names), layer))
                break
    return out


# Why a model that keeps its experts packed reads a quantized checkpoint's stored tensors only
# (CheckpointIndex.without_packed), said in a refusal of one of them.
KEEPS_PACKED = "the model keeps its experts packed: every quantized weight is read as stored"


def keeps_packed(model: nn.Module, specs: Sequence[ExpertsSpec] = DEFAULT_SPECS) -> bool:
    """Whether ``model`` keeps its experts as a checkpoint stores them quantized: an experts
    module with an integer or one-byte parameter (packed codes, FP8 values, E8M0 scales). Such a
    model reads a quantized checkpoint's stored tensors
    (:meth:`~moeshard.io.index.CheckpointIndex.without_packed`), not their dequantized view,
    whose logical keys can be the stored ones (ModelOpt's and FP8's ``weight``)."""
    return any(
        not p.is_floating_point() or p.element_size() == 1
        for e in expert_layers(model, specs)
        for p in e.module.parameters(recurse=False)
    )


def layer_names(layers: Sequence[ExpertsModule]) -> list[str]:
    """One name per MoE layer of :func:`expert_layers`' ``layers``, in layer order: the experts
    module's, or for experts modules one router drives together their parent's."""
    out: dict[int, str] = {}
    for e in layers:
        if e.layer not in out:
            out[e.layer] = routed_block(e.name, e.spec)
    return [out[i] for i in range(len(out))]


def _choose_spec(
    candidates: Sequence[ExpertsSpec],
    module: str,
    index: CheckpointIndex | None,
    renamed: bool,
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
                    f"converter moeshard cannot express as box reads ({refused})"
                )
    spec = candidates[0]
    if (
        names is not None
        and not any(s in names.specs or s in PACKED_SPECS for s in candidates)
        and not any(_refused(names, f"{module}.{p.name}") for p in spec.params)
    ):
        # No converter of the family stacks this module's experts: transformers writes and reads
        # them fused on disk, under their (renamed) names. Experts kept packed are stored as
        # their spec says (transformers' quantizer reads them, not the family's converters).
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
    for pattern, why in names.refused if names is not None else ():
        if any(re.search(t.strip(), full) for t in pattern.split(", ")):
            return f"{pattern}: {why}"
    return None


def _fused_spec(
    spec: ExpertsSpec,
    module: str,
    key_of: Callable[[str], str | None],
) -> tuple[ExpertsSpec, dict[str, str]] | None:
    """Experts module ``module`` read from tensors fused on disk, one per parameter holding
    every expert (``[num_logical, *slice_shape]``, as gpt-oss and Llama 4 ship them and as
    transformers keeps them in memory): each parameter of ``spec`` stored under checkpoint key
    ``key_of(<module>.<param>)`` becomes a one-part fused :class:`ExpertParam`. None when one
    has no key. The module's other parameters (a packed gpt-oss's biases) stay whole tensors, as
    :func:`moeshard.parallelize` leaves them. Shapes are checked with the needs
    (:func:`moeshard.models.layout.need_table`)."""
    params, prefixes = [], {}
    for p in spec.params:
        key = key_of(f"{module}.{p.name}")
        if key is None:
            return None
        prefix, _, leaf = key.rpartition(".")
        params.append(ExpertParam(p.name, (leaf,), merged=p.merged))
        prefixes[p.name] = prefix
    return dataclasses.replace(spec, params=tuple(params)), prefixes


def describe_model(
    model: nn.Module,
    index: CheckpointIndex | None = None,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
) -> list[ParamDesc]:
    """Describe every parameter and persistent buffer of ``model`` (deduplicated; tied
    parameters list all their names as checkpoint keys, then the names a checkpoint of the
    model's family may use instead, :func:`~moeshard.models.adapters.checkpoint_names`).

    Without ``index`` the names are those the model's family writes (``config.model_type``).
    A peft model is described as its base model (checkpoint names without peft's segments;
    adapter weights left out, see :mod:`moeshard.lora`).
    """
    hf = hf_names(model)
    if hf is not None:  # transformers' own names for the family: its converters' specs first
        ordered, renamed = (*hf.specs, *(s for s in specs if s not in hf.specs)), False
    else:
        ordered, renamed = specs_for(model, specs)
    tree = walk_modules(model)
    base = tree.base
    experts: dict[str, tuple[int, ExpertsSpec, dict[str, str], nn.Module]] = {}
    blocks: dict[str, int] = {}  # routed block -> MoE layer (as expert_layers numbers them)
    # A spec matches only a module with its parameters: most modules have no spec's first one. A
    # spec of given classes (JetMoE's, whose one parameter is a ``weight``) only an instance of one.
    firsts = {s.params[0].name for s in ordered if not s.classes} if all(s.params for s in ordered) else None
    classes = frozenset().union(*(s.classes for s in ordered))
    for name, mod in tree.modules:
        own = {n for n, p in mod._parameters.items() if p is not None}
        if not own or (
            firsts is not None and firsts.isdisjoint(own) and not (classes and classes & class_names(type(mod)))
        ):
            continue
        matching = [s for s in ordered if s.matches(base(name), own, mod)]
        if matching:
            spec, prefixes = _choose_spec(matching, base(name), index, renamed, hf)
            scaled = with_scales(spec, own)
            for p in scaled.params[len(spec.params) :]:  # an FP8 scale is stored where its weight is
                prefixes[p.name] = prefixes[scaled_weight(p.name)]
            layer = blocks.setdefault(routed_block(base(name), spec), len(blocks))
            experts[name] = (layer, scaled, prefixes, mod)
    aliases, tensors = _aliases(tree)
    descs = []
    meshes: dict[int, np.ndarray] = {}  # id(DeviceMesh) -> its ranks (computing it is not free)
    from .. import collectives  # here: the module's need table stays importable without torch

    members = collectives.group_ranks()  # the running operation's group, if not the default one
    for tid, aliases_of in aliases.items():
        t = tensors[tid]
        name = aliases_of[0]
        module, _, attr = name.rpartition(".")
        expert = None
        shape = tuple(t.shape)
        if module in experts:
            layer_idx, spec, prefixes, mod = experts[module]
            for p in spec.params:
                if p.name == attr:
                    expert = ExpertRef(layer_idx, prefixes[p.name], p, identity_rows(mod, p.name))
                    shape = expert_shape(mod, spec, p, shape, sharded=_is_dtensor(t))
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
        split: tuple[tuple[str, ...], int] | None = None
        if hf is not None:  # the name transformers writes first, then the model's own
            keys = [k for n in aliases_of for k in (hf.checkpoint_name(base(n)), base(n))]
            if expert is None and hf.concats:
                split = hf.checkpoint_parts(base(name))
        else:
            keys = [k for n in aliases_of for k in checkpoint_names(base(n))]
            if renamed and index is None:  # the family's names first: they are what it writes
                keys = [k for n in aliases_of for k in reversed(checkpoint_names(base(n)))]
        parts, part_dim = split if split is not None else ((), 0)
        refused = ""
        if index is not None and expert is None and not parts and not any(k in index for k in keys):
            why = _refused(hf, base(name))
            if why is not None:  # what a read of it says, rather than "no tensor ..."
                refused = (
                    f"transformers reads {hf.family} checkpoints into it with a converter moeshard cannot "
                    f"express as box reads ({why})"
                )
        descs.append(
            ParamDesc(
                name, shape, t.dtype, mesh, placements, tuple(dict.fromkeys(keys)), expert, parts, part_dim, refused
            )
        )
    return descs


def _group_mesh(mesh: np.ndarray, members: list[int] | None, name: str) -> np.ndarray:
    """``mesh`` (global ranks, as a DeviceMesh holds them) in ranks of the running operation's
    process group (``members``: its global ranks; None: the default group)."""
    if members is None:
        return mesh
    of = {g: r for r, g in enumerate(members)}
    outside = sorted({int(g) for g in mesh.reshape(-1).tolist()} - set(of))
    if outside:
        raise ValueError(
            f"parameter {name}: its device mesh has global ranks {outside[:8]} outside the process group "
            f"the operation runs on (global ranks {members[:16]}{' ...' if len(members) > 16 else ''}); "
            "pass a group that holds the model's whole mesh"
        )
    return np.vectorize(of.__getitem__, otypes=[np.int64])(mesh)


def _aliases(tree: ModuleTree) -> tuple[dict[int, list[str]], dict[int, torch.Tensor]]:
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
    tree = walk_modules(model)
    base = tree.base
    aliases, _ = _aliases(tree)
    return [tuple(dict.fromkeys(base(n) for n in names)) for names in aliases.values()]


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return walk_modules(model).buffers


@functools.lru_cache(maxsize=1)
def _torch_classes() -> tuple[type, type]:
    """``(nn.Parameter, DTensor)``, imported on first use (this module is imported without
    torch by ``moeshard plan``)."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    return nn.Parameter, DTensor


def _is_dtensor(t: torch.Tensor) -> bool:
    return isinstance(t, _torch_classes()[1])


def local_tensor(t: torch.Tensor, desc: ParamDesc | None = None) -> torch.Tensor:
    """The rank-local tensor behind a parameter (DTensor or plain), writable in place; with
    ``desc`` (the parameter's description), viewed with its dims: a plain merged expert parameter
    (DBRX's ``[E * n, d]``) as ``[E, n, d]``."""
    parameter, dtensor = _torch_classes()
    if isinstance(t, dtensor):  # a DTensor parameter too: .data on it would go through DTensor dispatch
        t = t._local_tensor.detach()
    elif isinstance(t, parameter):
        t = t.data
    if desc is not None and desc.mesh is None and tuple(t.shape) != desc.shape:
        t = t.view(desc.shape)
    return t
