"""peft LoRA adapters, the model side: expert LoRA wrappers -> per-slot local factors
(:func:`shard_expert_lora`, called by :func:`moeshard.parallelize`), and every adapter tensor of
a model with its layout (:func:`adapter_tensors`). The layouts are described in
:mod:`moeshard.ops.lora`, which loads and saves adapters.
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass

import torch
from torch import nn

from ..placement import Placement
from .adapters import ExpertsSpec
from .ep import SlotLora, ep_layers
from .layout import ParamDesc, is_adapter_param, rank_boxes

__all__ = ["AdapterTensor", "adapter_desc", "adapter_tensors", "expert_lora_wrappers", "lora_modules", "shard_expert_lora",
           "slot_boxes"]

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
            raise ValueError(f"{module_name}: a LoRA adapter on {wrapper.parameter_name!r}, which is not an "
                             f"expert parameter of its spec ({sorted(names)})")
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
        raise ValueError(f"{type(wrapper).__name__} on {wrapper.parameter_name!r}: moeshard supports one LoRA "
                         f"adapter per model, found {adapters}")
    name = adapters[0]
    if wrapper.lora_bias.get(name) or wrapper.use_dora.get(name):
        raise ValueError(f"LoRA adapter {name!r} on {wrapper.parameter_name!r}: lora_bias / DoRA are not supported")
    r, num_logical, num_physical = wrapper.r[name], placement.num_logical, placement.num_physical
    spr = placement.slots_per_rank(ep_mesh.size())
    a, b = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight
    if a.shape[0] != r * num_logical or b.shape[1] != r * num_logical:
        raise ValueError(f"LoRA adapter on {wrapper.parameter_name!r}: lora_A {list(a.shape)} / lora_B "
                         f"{list(b.shape)} do not hold r={r} x {num_logical} experts")
    for lin, old, local, dim in ((wrapper.lora_A[name], a, (r * spr, a.shape[1]), 0),
                                 (wrapper.lora_B[name], b, (b.shape[0], r * spr), 1)):
        shape = list(old.shape)
        shape[dim] = r * num_physical
        t = torch.empty(local, dtype=old.dtype, device=old.device)
        dt = DTensor.from_local(t, ep_mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                                stride=(shape[1], 1))
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
            out.append((AdapterTensor(name, key, tuple(shape), factor, layer, r,
                                      f"r={r} x {placement.num_logical} experts"), p))
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


def slot_boxes(t: AdapterTensor, d: ParamDesc, placement: Placement, world_size: int):
    """For an expert factor: ``(rank, slot, local box, file box)`` of every slot's rows of A /
    columns of B on every rank (B: one box per rank-r column). Slot ``p`` of A is global rows
    ``p*r ..``; B's global columns are ``(ep rank, r, slot)``: rank k's block is
    ``k*r*S .. (k+1)*r*S``."""
    r, num_logical = t.rank, placement.num_logical
    num_physical = placement.num_physical
    phy2log = placement.phy2log[t.layer]
    spr = num_physical // placement.num_ranks
    for rank, box in rank_boxes(d, world_size):
        if not all(n for _, n in box):
            continue
        (r0, nr), (c0, nc) = box
        if t.factor == "A":
            for p in range(r0 // r, (r0 + nr) // r):
                if phy2log[p] < 0:
                    continue  # an empty slot: nothing to load or save
                yield rank, p, ((p * r - r0, r), (0, nc)), ((int(phy2log[p]) * r, r), (c0, nc))
        else:
            k = c0 // (r * spr)
            for s in range(spr):
                p = k * spr + s
                if phy2log[p] < 0:
                    continue
                for j in range(r):
                    col = j * spr + s
                    yield rank, p, ((0, nr), (k * r * spr + col - c0, 1)), ((r0, nr), (j * num_logical + int(phy2log[p]), 1))


# -- load -----------------------------------------------------------------------------------
