"""peft LoRA adapters, the model side: expert LoRA wrappers -> per-slot local factors
(:func:`shard_expert_lora`, called by :func:`moeshard.parallelize`), and every adapter tensor of
a model with its layout (:func:`adapter_tensors`). The layouts are described in
:mod:`moeshard.ops.lora`, which loads and saves adapters.
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..placement import Placement
from ..plan.arrays import group_rows
from ..plan.save import HeldBoxes
from .adapters import ExpertsSpec
from .describe import ParamDesc, is_adapter_param
from .ep import SlotLora, ep_layers
from .shards import param_boxes

__all__ = [
    "AdapterTensor",
    "adapter_desc",
    "adapter_tensors",
    "distinct_boxes",
    "expert_lora_wrappers",
    "factor_boxes",
    "local_view",
    "lora_modules",
    "plan_shape",
    "shard_expert_lora",
]

# -- parallelize's part: expert LoRA wrappers -> per-slot local factors --------------------


def _is_param_wrapper(m: nn.Module) -> bool:
    return hasattr(m, "parameter_name") and hasattr(m, "lora_A") and hasattr(m, "base_layer")


def expert_lora_wrappers(model: nn.Module, module_name: str, spec: ExpertsSpec) -> list[nn.Module]:
    """peft ``ParamWrapper`` modules around experts module ``module_name`` (its
    ``...base_layer`` parents), innermost first; [] without peft."""
    out = []
    names = {p.name for p in spec.params}
    while module_name.endswith(".base_layer"):
        module_name = module_name[: -len(".base_layer")]
        wrapper = model.get_submodule(module_name)
        if not _is_param_wrapper(wrapper):
            break
        if wrapper.parameter_name not in names:
            raise ValueError(
                f"{module_name}: a LoRA adapter on {wrapper.parameter_name!r}, which is not an "
                f"expert parameter of its spec ({sorted(names)})"
            )
        out.append(wrapper)
    return out


def _passthrough(self, *args, **kwargs):
    # The EP forward adds the delta for the local slots (peft's parametrization would add a
    # [num_logical, ...] delta to a [num_physical, ...] DTensor).
    return self.base_layer(*args, **kwargs)


def shard_expert_lora(wrapper: nn.Module, ep_mesh, placement: Placement) -> SlotLora:
    """Replace ``wrapper``'s (meta) ``lora_A`` ``[r*E, in]`` / ``lora_B`` ``[out, r*E]`` by EP
    DTensors holding this rank's slots (module doc), bypass peft's forward, and return the
    :class:`SlotLora` the EP forward uses. Called by :func:`moeshard.parallelize`."""
    from torch.distributed.tensor import DTensor, Shard

    adapters = list(wrapper.lora_A.keys())
    if len(adapters) != 1:
        raise ValueError(
            f"{type(wrapper).__name__} on {wrapper.parameter_name!r}: moeshard supports one LoRA "
            f"adapter per model, found {adapters}"
        )
    name = adapters[0]
    if wrapper.lora_bias.get(name) or wrapper.use_dora.get(name):
        raise ValueError(f"LoRA adapter {name!r} on {wrapper.parameter_name!r}: lora_bias / DoRA are not supported")
    r, num_logical, num_physical = wrapper.r[name], placement.num_logical, placement.num_physical
    spr = placement.slots_per_rank(ep_mesh.size())
    a, b = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight
    if a.shape[0] != r * num_logical or b.shape[1] != r * num_logical:
        raise ValueError(
            f"LoRA adapter on {wrapper.parameter_name!r}: lora_A {list(a.shape)} / lora_B "
            f"{list(b.shape)} do not hold r={r} x {num_logical} experts"
        )
    for lin, old, local, dim in (
        (wrapper.lora_A[name], a, (r * spr, a.shape[1]), 0),
        (wrapper.lora_B[name], b, (b.shape[0], r * spr), 1),
    ):
        shape = list(old.shape)
        shape[dim] = r * num_physical
        t = torch.empty(local, dtype=old.dtype, device=old.device)
        dt = DTensor.from_local(
            t, ep_mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape), stride=(shape[1], 1)
        )
        lin.weight = nn.Parameter(dt, requires_grad=old.requires_grad)
    wrapper.forward = types.MethodType(_passthrough, wrapper)
    return SlotLora(wrapper.parameter_name, wrapper, name, float(wrapper.scaling[name]), spr)


# -- the model's adapter tensors ------------------------------------------------------------


@dataclass(frozen=True)
class AdapterTensor:
    """One LoRA weight of the model as the adapter file stores it.

    Args:
        name: parameter name in the model.
        key: key in ``adapter_model.safetensors`` (``name`` without the adapter name).
        shape: shape in the file (expert factors: over all ``num_logical`` experts).
        factor: "A" or "B" for a factor of an expert parameter, "" otherwise.
        layer: MoE layer of an expert factor (-1 otherwise).
        rank: LoRA rank r.
        what: for messages (``r=8`` and, for expert factors, the number of experts).
    """

    name: str
    key: str
    shape: tuple[int, ...]
    factor: str = ""
    layer: int = -1
    rank: int = 0
    what: str = ""


def _adapter_key(name: str, adapter: str) -> str:
    return re.sub(rf"\.(lora_A|lora_B)\.{re.escape(adapter)}(?=\.)", r".\1", name)


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """peft LoRA layers (``lora_A`` ModuleDicts) by qualified name."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}


def adapter_tensors(model: nn.Module, placement: Placement | None) -> list[tuple[AdapterTensor, nn.Parameter]]:
    """Every LoRA weight of a (peft, parallelized) model with its file key and file shape."""
    experts = {}
    for module, ep in ep_layers(model):
        for lora in module.moeshard_lora:
            experts[id(lora.a())] = ("A", ep.layer, lora)
            experts[id(lora.b())] = ("B", ep.layer, lora)
    layers = lora_modules(model)
    out = []
    for name, p in model.named_parameters():
        if not is_adapter_param(name):
            continue
        owner = next((layers[m] for m in _prefixes(name) if m in layers), None)
        if owner is None or not re.search(r"\.lora_(A|B)\.[^.]+\.weight$", name):
            raise ValueError(f"parameter {name}: only LoRA A/B weights are supported (no DoRA, embeddings, biases)")
        adapter = name.rsplit(".", 2)[-2]
        r = owner.r[adapter]
        key = _adapter_key(name, adapter)
        if id(p) in experts:
            factor, layer, _ = experts[id(p)]
            if placement is None:
                raise ValueError("a model with LoRA on expert parameters needs its placement")
            shape = list(p.shape)
            dim = 0 if factor == "A" else 1
            shape[dim] = r * placement.num_logical
            out.append(
                (
                    AdapterTensor(
                        name, key, tuple(shape), factor, layer, r, f"r={r} x {placement.num_logical} experts"
                    ),
                    p,
                )
            )
        else:
            out.append((AdapterTensor(name, key, tuple(p.shape), rank=r, what=f"r={r}"), p))
    return out


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def adapter_desc(t: AdapterTensor, p: torch.Tensor) -> ParamDesc:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        mesh, placements = p.device_mesh.mesh.cpu().numpy(), tuple(p.placements)
    else:
        mesh, placements = None, ()
    return ParamDesc(t.name, tuple(p.shape), p.dtype, mesh, placements, (t.key,))


def plan_shape(t: AdapterTensor) -> tuple[int, ...]:
    """The shape adapter tensor ``t`` is planned in: its file shape, but an expert factor B
    ``[out, r*E]`` as ``[out, r, E]`` (the same bytes; one expert's columns, strided in 2-D,
    are one box in 3-D)."""
    if t.factor == "B":
        out, cols = t.shape
        return (out, t.rank, cols // t.rank)
    return tuple(t.shape)


def local_view(t: AdapterTensor, local: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of ``t`` as :func:`factor_boxes` addresses it: B's local
    ``[out_local, r*S]`` as ``[out_local, r, S]`` (a view: writes land in the parameter)."""
    if t.factor == "B":
        return local.unflatten(1, (t.rank, local.shape[1] // t.rank))
    return local


def factor_boxes(
    t: AdapterTensor, d: ParamDesc, placement: Placement, world_size: int, first_copy_only: bool = False
) -> HeldBoxes:
    """Every rank's boxes of expert factor ``t`` (pure; numpy over the mesh's boxes), in
    :func:`plan_shape` coordinates, local offsets in :func:`local_view` coordinates.

    A row is a run of consecutive slots on one rank holding consecutive logical experts (one
    box of the file tensor): A's rows ``p*r ..`` hold expert ``phy2log[p]``'s rows ``e*r ..``;
    B's local ``[:, :, s]`` holds ``[:, :, e]`` of ``[out, r, E]``. A run never spans an expert
    with several copies, so those rows are one expert wide and equal on every copy. Empty slots
    hold nothing; ``first_copy_only`` (save): only each logical expert's first copy. Rows in mesh
    order, then slot.

    Raises ValueError for a factor whose sharding splits one slot's ``r`` rows of A, or any
    rank's ``r*S`` columns of B."""
    ranks, boxes = param_boxes(d, world_size)
    held = (boxes[:, :, 1] > 0).all(axis=1)
    ranks, boxes = ranks[held], boxes[held]
    r, spr = t.rank, placement.num_physical // placement.num_ranks
    if t.factor == "A":  # rows: whole slots of r rows
        lo, n = boxes[:, 0, 0], boxes[:, 0, 1]
        bad, what = (lo % r != 0) | (n % r != 0), f"the {r} rows of one slot"
        first, count = lo // r, n // r  # each box's first slot and its number of slots
    else:  # columns: whole EP ranks of r*S columns
        lo, n = boxes[:, 1, 0], boxes[:, 1, 1]
        bad, what = (lo % (r * spr) != 0) | (n != r * spr), f"the {r * spr} columns of an EP rank"
        first, count = lo // (r * spr) * spr, np.full(len(lo), spr, np.int64)
    if bad.any():
        raise ValueError(
            f"LoRA weight {t.name}: its sharding {d.placements} splits {what} (r={r}, {spr} slots per rank)"
        )
    box = np.repeat(np.arange(len(lo)), count)
    slot = np.repeat(first, count) + np.arange(len(box)) - np.repeat(np.cumsum(count) - count, count)
    phy2log = placement.phy2log[t.layer]
    expert = phy2log[slot]
    keep = expert >= 0
    if first_copy_only:
        keep &= placement.log2phy[t.layer, :, 0][np.maximum(expert, 0)] == slot
    box, slot, expert = box[keep], slot[keep], expert[keep]
    many = (np.bincount(phy2log[phy2log >= 0], minlength=placement.num_logical) > 1)[expert]
    start = np.ones(len(box), bool)
    start[1:] = (
        (box[1:] != box[:-1]) | (slot[1:] != slot[:-1] + 1) | (expert[1:] != expert[:-1] + 1) | many[1:] | many[:-1]
    )
    at = np.flatnonzero(start)
    runs = np.diff(np.append(at, len(box)))
    box, slot, expert = box[at], slot[at], expert[at]
    b = boxes[box]
    if t.factor == "A":  # [r*P, in] -> file [r*E, in]
        local_off = np.stack([(slot - first[box]) * r, np.zeros_like(slot)], axis=1)
        off = np.stack([expert * r, b[:, 1, 0]], axis=1)
        length = np.stack([runs * r, b[:, 1, 1]], axis=1)
    else:  # local [out_local, r, S] -> file [out, r, E]
        zero = np.zeros_like(slot)
        local_off = np.stack([zero, zero, slot - first[box]], axis=1)
        off = np.stack([b[:, 0, 0], zero, expert], axis=1)
        length = np.stack([b[:, 0, 1], np.full_like(slot, r), runs], axis=1)
    return HeldBoxes(ranks[box], local_off, off, length)


def distinct_boxes(d: ParamDesc, world_size: int) -> HeldBoxes:
    """Each distinct non-empty box of a plain LoRA weight (an FSDP2 DTensor or a plain tensor)
    once, from its first holder in mesh order (pure): the boxes tile the tensor."""
    ranks, boxes = param_boxes(d, world_size)
    held = np.flatnonzero((boxes[:, :, 1] > 0).all(axis=1))
    order, start = group_rows(*boxes[held].reshape(len(held), -1).T)  # stable: a group's first is its first holder
    rows = held[np.sort(order[start])]
    return HeldBoxes(
        ranks[rows], np.zeros((len(rows), len(d.shape)), np.int64), boxes[rows, :, 0].copy(), boxes[rows, :, 1].copy()
    )
