"""Expert-parallel forward for an HF-style experts module, and what training needs around it.

After :func:`moeshard.parallelize`, an experts module holds only its EP rank's slots: every
expert parameter is local ``[S, ...]`` (``S`` slots per rank; ``gate_up_proj``, ``down_proj``
and, where the family has them, biases ``[S, out]``). Its forward (or, where its parent runs it
with its weights, DBRX's, the parent's: :func:`ep_host`) becomes an EP forward with the
family's own signature, for one of these kinds of experts module (:func:`experts_kind`):

* *routed* (every transformers experts class decorated with ``@use_experts_implementation``:
  Qwen3-MoE, Mixtral, DeepSeek, gpt-oss, Aria, Nemotron-H, ...):
  ``forward(hidden [T, H], top_k_index [T, K] logical experts, top_k_weights [T, K]) -> [T, H]``,
  the sum over k of ``top_k_weights[t, k] * expert_{top_k_index[t, k]}(hidden[t])``;
* *pre-routed* (Llama 4's ``Llama4TextExperts``): ``forward(routed_in [E*T, H]) -> [E*T, H]``,
  block ``e`` (rows ``e*T .. (e+1)*T``) holding the T tokens already scaled by their routing
  score for expert ``e`` (0 where not routed to it) and the output block ``e`` being expert
  ``e`` applied to it (the parent MoE block sums the blocks);
* *grouped* (JetMoE's ``JetMoeParallelExperts``, one linear map per expert):
  ``forward(inputs [N, in], expert_size) -> [N, out]``, the rows sorted by expert,
  ``expert_size[e]`` of them for expert ``e``, each row mapped by its expert's ``weight[e]``;
* *lookup* (an ``nn.Embedding`` whose rows are experts, Doge's ``down_embed`` / ``up_embed``):
  ``forward(ids [...]) -> [..., d]``, expert ``ids[i]``'s row. Its EP forward sends each id to a
  copy of its expert and that row comes back (the row is the expert: as many values travel as
  a token would, and the family's own forward does the rest).

Either way the EP forward

1. gives every (token, expert) pair one physical copy of its logical expert (redundant experts:
   copies share the tokens; a copy on this rank is preferred, else they take turns);
2. sorts the pairs' rows by slot, so each EP rank's rows are contiguous, and exchanges them with
   a differentiable all-to-all inside the EP group (counts first, then rows);
3. runs the local slots on the rows each rank received with the family's *own* experts forward,
   called on a view of the module whose expert parameters are the local slots (plus LoRA
   deltas) and whose expert count is ``S`` (routed: each row routed to its local slot with
   weight 1; pre-routed: one call per slot; grouped: the rows sorted by local slot; lookup: the
   slots' rows). Gate/up interleaving, biases, clamped or custom activations, ``[E, in, out]``
   layouts and the configured experts implementation (eager, ``grouped_mm``, ...) are therefore
   the family's, not a re-implementation;
4. brings the outputs back with a second all-to-all; routed: weighted and summed per token (plus,
   for identity "zero" experts, the token's own state times its weight, never exchanged);
   the other kinds: put back in place.

A transformers experts module of another kind gets a forward that raises NotImplementedError
naming its class: its parameters hold only this rank's slots, so its own forward would be wrong.

Gradient convention (the data-parallel one FSDP applies to every other parameter): the
gradient of an expert parameter is the *mean* over all ranks of the gradients of their local
losses. Rows from every rank of the EP group reach an expert, so its raw gradient is a sum
over the EP group; it is divided by the EP size here, and FSDP's reduce-scatter over "efsdp"
divides by that axis' size (its default), so the product is the world size. (Not FSDP's
``set_gradient_divide_factor``: it needs a PREMUL_SUM reduction, which gloo lacks.)

Mixed precision (``parallelize(..., mp_policy=MixedPrecisionPolicy(param_dtype=...))``, FSDP2's
own policy): with expert FSDP (efsdp > 1) FSDP2 all-gathers the expert weights in ``param_dtype``
as it does every other parameter. With efsdp == 1 the expert weights are FSDP's ignored
parameters, which it never casts, so the EP forward casts the local weights (and LoRA factors)
to ``param_dtype`` itself (:attr:`EPLayer.compute_dtype`), through autograd: the whole model
computes in ``param_dtype`` as under FSDP2, and the gradient reaches the float32 parameter cast
back to float32, where the 1/EP mean is applied (FSDP2 divides in ``reduce_dtype``, float32 in
the usual policy). ``reduce_dtype`` has nothing to act on in that path: no weight gradient is
communicated (each slot's gradient is computed where it lives, its sum over the EP ranks' tokens
inside the weight-gradient matmul, in ``param_dtype`` as a one-rank FSDP2 module's is; the
all-to-all carries activations and their gradients in ``param_dtype``, as FSDP2's activations
are), except redundant copies' gradients (below), summed where the cast's backward has brought
them back to the parameters' dtype (float32: at least ``reduce_dtype``'s precision).

Copies of a redundant expert see different tokens, so their gradients differ. The EP forward
makes a stock loop exact without any call (:mod:`moeshard.models.copies`): in backward each
redundant expert's first copy gets the sum of its copies' gradients (the gradient one copy
seeing every token would have had) and the other copies zero, so any gradient norm counts the
expert once; after every optimizer step the first copy's weights and optimizer state are copied
to the other copies. :func:`sync_redundant_grads` is therefore a no-op kept for old loops, and
:func:`grad_norm` / :func:`clip_grad_norm_` equal torch's own.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .. import collectives
from ..placement import Placement
from .adapters import class_names, identity_experts
from .copies import CopyRoutes, combine_copy_grads, track
from .describe import local_tensor

__all__ = [
    "EPLayer",
    "SlotLora",
    "ep_host",
    "ep_forward_installed",
    "ep_layer_names",
    "expose_placement",
    "experts_kind",
    "install_ep_forward",
    "model_placement",
    "routing_tables",
    "slot_placement",
    "unsupported_forward",
    "set_placement",
    "slot_params",
    "sync_redundant_grads",
    "grad_norm",
    "clip_grad_norm_",
]

ROUTED, PREROUTED, GROUPED, LOOKUP = "routed", "prerouted", "grouped", "lookup"
# Experts classes with the pre-routed forward (module doc), by class name: FSDP2 gives a module
# it shards a class of its own, which keeps the original among its bases.
PREROUTED_CLASSES = frozenset({"Llama4TextExperts"})
# ... and with the grouped one.
GROUPED_CLASSES = frozenset({"JetMoeParallelExperts"})
# transformers experts classes outside @use_experts_implementation whose own forward is the routed
# one (module doc), by class name. LongCat-Flash's: ids past its routed experts are identity
# ("zero") experts (:func:`~moeshard.models.adapters.identity_experts`), which the EP forward
# applies where the token is, with no exchange. DBRX's: its weights are its child's (below).
ROUTED_CLASSES = frozenset({"LongcatFlashExperts", "DbrxExperts"})
# Experts modules (a spec's module: the one holding the expert parameters) whose parent's forward
# runs them with their weights, by class name: the EP forward goes on the parent (:func:`ep_host`).
# DBRX's DbrxExperts runs the experts with the weights of its ``mlp``, a DbrxExpertGLU.
RUN_BY_PARENT = frozenset({"DbrxExpertGLU"})
# Attributes of an experts module that count its experts: a slot view (the local slots only)
# sets each one it has to the number of local slots (identity experts: none there).
_COUNTS = ("num_experts", "num_routed_experts", "total_experts")


@dataclass(frozen=True, eq=False)
class EPLayer:
    """The EP layout of one experts module (what its forward and the gradient helpers need).

    Args:
        layer: MoE layer index (the placement's row).
        phy2log: ``int[num_physical]`` logical expert of each slot (-1: empty).
        log2phy: ``int[num_logical, max_copies]`` slots of each logical expert (-1 padded).
        logcnt: ``int[num_logical]`` copies of each logical expert.
        slots_per_rank: slots per EP rank (the module's local expert count).
        ep_rank: this rank's coordinate on the "ep" mesh dim.
        ep_group: the EP process group (this rank's row of the mesh).
        grad_scale: factor applied to the local expert weights' gradient (1/EP, see module doc).
        param_names: the module's per-slot parameters (its spec's, EP-sharded ``[S, ...]``); its
            other parameters hold one row per logical expert, whole (``[E, ...]``: a packed
            gpt-oss's frozen biases). Empty: every parameter is per slot.
        compute_dtype: the mixed-precision policy's ``param_dtype`` (None: compute in the
            parameters' own dtype). The forward casts the local expert weights to it, with
            autograd (module doc, "Mixed precision").
    """

    layer: int
    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray
    slots_per_rank: int
    ep_rank: int
    ep_group: dist.ProcessGroup
    grad_scale: float
    param_names: tuple[str, ...] = ()
    compute_dtype: torch.dtype | None = None

    @property
    def ep_size(self) -> int:
        return len(self.phy2log) // self.slots_per_rank

    @cached_property
    def copy_routes(self) -> CopyRoutes:
        """Where this rank's copies of redundant experts meet their first copy
        (:mod:`moeshard.models.copies`)."""
        return CopyRoutes.of(self.phy2log, self.log2phy, self.slots_per_rank, self.ep_rank)

    def first_copy(self) -> np.ndarray:
        """``bool[slots_per_rank]``: local slots holding the first copy of their expert (the
        one gradient norms count)."""
        lo = self.ep_rank * self.slots_per_rank
        slots = np.arange(lo, lo + self.slots_per_rank)
        experts = self.phy2log[slots]
        return (experts >= 0) & (self.log2phy[np.maximum(experts, 0), 0] == slots)


@dataclass(frozen=True, eq=False)
class SlotLora:
    """A peft LoRA adapter (``lora.ParamWrapper``) on expert parameter ``param`` of an EP experts
    module, restricted to this rank's slots (see :mod:`moeshard.lora`).

    Local tensors (``S`` slots, rank ``r``): ``lora_A`` ``[r*S, in]``, rows slot-major (peft's
    expert-major order over local slots); ``lora_B`` ``[out, r*S]``, columns ``(r, S)`` with the
    slot fastest (peft's ``(r, experts)`` order). Slot ``s``'s weight is
    ``W[s] + scaling * B[:, :, s] @ A[s]``.
    """

    param: str
    wrapper: nn.Module  # the peft ParamWrapper holding lora_A / lora_B
    adapter: str
    scaling: float
    slots_per_rank: int

    def a(self) -> torch.Tensor:
        return self.wrapper.lora_A[self.adapter].weight

    def b(self) -> torch.Tensor:
        return self.wrapper.lora_B[self.adapter].weight

    def a_slots(self, t: torch.Tensor) -> torch.Tensor:
        """``[r*S, in] -> [S, r, in]`` (a view)."""
        return t.unflatten(0, (self.slots_per_rank, -1))

    def b_slots(self, t: torch.Tensor) -> torch.Tensor:
        """``[out, r*S] -> [S, out, r]`` (a view)."""
        return t.unflatten(1, (-1, self.slots_per_rank)).permute(2, 0, 1)

    def active(self) -> bool:
        w = self.wrapper
        return not w.disable_adapters and not w.merged and self.adapter in w.active_adapters


def _from_transformers(module: nn.Module) -> bool:
    """Whether ``module``'s class is (or derives from) one transformers defines."""
    return any(c.__module__.startswith("transformers.") for c in type(module).__mro__)


def experts_kind(module: nn.Module) -> str | None:
    """How moeshard's EP forward drives experts module ``module`` (module doc): ``"routed"``,
    ``"prerouted"``, ``"grouped"``, ``"lookup"``, or None when moeshard does not know what its
    forward computes."""
    names = class_names(type(module))
    if names & PREROUTED_CLASSES:
        return PREROUTED
    if names & ROUTED_CLASSES:
        return ROUTED
    if names & GROUPED_CLASSES:
        return GROUPED
    if isinstance(module, nn.Embedding):  # an experts module whose rows are the experts (parallelize's spec says)
        return LOOKUP
    if hasattr(module, "has_gate") and hasattr(module, "_is_expert_parallel"):
        # transformers' @use_experts_implementation: its grouped_mm / batched_mm forwards, which
        # stand in for the class's own, compute each (token, k) row as expert(x) * weight and sum
        # over k, from the module's own parameters and _apply_gate / act_fn.
        return ROUTED
    if not _from_transformers(module) and all(hasattr(module, a) for a in ("gate_up_proj", "down_proj", "act_fn")):
        return ROUTED  # a custom HF-style module (parallelize's contract): the routed signature
    return None


def ep_host(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """The module whose forward runs the experts of experts module ``module`` (named ``name`` in
    ``model``): itself, or for a module whose parent runs it with its weights
    (:data:`RUN_BY_PARENT`) that parent."""
    if class_names(type(module)).isdisjoint(RUN_BY_PARENT):
        return module
    return model.get_submodule(name.rpartition(".")[0])


def install_ep_forward(
    module: nn.Module, ep_layer: EPLayer, loras: tuple[SlotLora, ...] = (), holder: nn.Module | None = None
) -> bool:
    """Replace ``module``'s forward with the EP forward for ``ep_layer`` (its kind: see
    :func:`experts_kind`), adding ``loras``' deltas to the local slots' weights. Called by
    :func:`moeshard.parallelize`. ``holder``: the experts module holding the expert parameters,
    when ``module`` runs them from a child of its own (:func:`ep_host`); default ``module``.

    Returns whether the EP forward was installed. When not: a transformers experts module gets a
    forward that raises NotImplementedError naming its class; a custom one keeps its forward
    (it must route tokens to its ``num_local_experts`` local slots itself).

    Raises:
        ValueError: a parameter of the module with neither the slots nor the logical experts
            first (the EP forward runs every parameter of the module on the local slots).
    """
    holder = module if holder is None else holder
    if holder is not module and next((c for c in module._modules.values() if c is holder), None) is None:
        raise ValueError(
            f"{type(module).__name__}: the experts' parameters must be held by the module or one of "
            f"its children, not by {type(holder).__name__}"
        )
    kind = experts_kind(module)
    if kind is None:
        if _from_transformers(module):
            module.forward = types.MethodType(unsupported_forward, module)
        return False
    for name, p in holder.named_parameters(recurse=False):
        rows, what = (
            (len(ep_layer.phy2log), "slots") if _per_slot(ep_layer, name) else (len(ep_layer.logcnt), "logical experts")
        )
        if p.dim() == 0 or p.shape[0] != rows:
            raise ValueError(
                f"{type(module).__name__}.{name} of shape {list(p.shape)}: the EP forward runs every "
                f"parameter of an experts module on the local slots, and this one is not [{rows} "
                f"{what}, ...]"
            )
    if kind == PREROUTED and set(module._parameters) != {"gate_up_proj", "down_proj"}:
        # _ep_forward_prerouted skips zero rows: exact only for experts without biases.
        raise ValueError(
            f"{type(module).__name__}: pre-routed experts with parameters {sorted(module._parameters)}; "
            "moeshard's EP forward supports gate_up_proj and down_proj only"
        )
    module.__dict__["moeshard_holder"] = holder  # not a submodule: no second name in the module tree
    module.moeshard_ep = ep_layer
    module.moeshard_lora = tuple(loras)
    module.moeshard_kind = kind
    module.moeshard_identity = identity_experts(module)
    module._moeshard_route = {}
    if kind == LOOKUP and (module.padding_idx is not None or module.max_norm is not None or module.sparse):
        raise ValueError(
            f"{type(module).__name__}: an embedding of experts with padding_idx, max_norm or sparse "
            "gradients; moeshard's EP lookup supports plain row lookups only"
        )
    forwards = {
        ROUTED: _ep_forward,
        PREROUTED: _ep_forward_prerouted,
        GROUPED: _ep_forward_grouped,
        LOOKUP: _ep_forward_lookup,
    }
    module.forward = types.MethodType(forwards[kind], module)
    track(module, _copy_params)  # redundant copies equal again after every optimizer step
    return True


def _copy_params(module: nn.Module):
    """``(EP layout, [(parameter, slots view), ...])`` of an experts module, for
    :func:`moeshard.models.copies.track`."""
    return getattr(module, "moeshard_ep", None), slot_params(module)


def unsupported_forward(self, *args, **kwargs):
    """The forward :func:`install_ep_forward` gives a transformers experts module it does not support."""
    raise NotImplementedError(
        f"{type(self).__module__}.{type(self).__name__}: moeshard's EP forward does not support this experts "
        "module (neither transformers' routed experts forward, @use_experts_implementation or "
        f"{sorted(ROUTED_CLASSES)}, nor a pre-routed one, {sorted(PREROUTED_CLASSES)}, nor a grouped one, "
        f"{sorted(GROUPED_CLASSES)}). Its parameters hold only this rank's slots, so its own forward would "
        "be wrong; parallelize(..., ep_forward=False) keeps it, for a forward that routes tokens to the "
        "module's num_local_experts local slots itself"
    )


def set_placement(model: nn.Module, placement) -> int:
    """Point every routing table of ``model`` (:func:`routing_tables`) at ``placement`` (after
    its weights moved: :func:`moeshard.relocate` calls this), so tokens are routed to the slots
    that now hold their experts. The tables are the model's one record of its placement:
    ``model.moeshard_placement``, :func:`model_placement` and the state-dict guards
    (:mod:`moeshard.models.slot_guard`) read them. Local, no communication; every rank must do
    it with the same placement. Returns the number of MoE layers whose EP forward now routes by
    it (experts modules one router drives share one).

    Raises:
        ValueError: ``placement`` does not fit the model (layers, slots per layer, logical
            experts), before any table changes.
    """
    tables = routing_tables(model)
    if not tables:  # nothing parallelized by moeshard: the caller routes tokens itself
        return 0
    first = tables[0][1]
    # The experts modules one router drives (JetMoE's input_linear/output_linear) share a row.
    have = (len(_layer_rows(tables)), len(first.phy2log), len(first.logcnt))
    if (placement.num_layers, placement.num_physical, placement.num_logical) != have:
        raise ValueError(
            f"the placement has {placement.num_layers} layers x {placement.num_physical} slots for "
            f"{placement.num_logical} logical experts, the model {have[0]} x {have[1]} for {have[2]}"
        )
    for module, ep in tables:
        module.moeshard_ep = dataclasses.replace(
            ep,
            phy2log=placement.phy2log[ep.layer],
            log2phy=placement.log2phy[ep.layer],
            logcnt=placement.logcnt[ep.layer],
        )
        module._moeshard_route = {}
    return len(_layer_rows(ep_layers(model)))


def model_placement(model: nn.Module) -> Placement | None:
    """The placement ``model``'s EP forward routes tokens by (:func:`moeshard.parallelize` sets
    it, :func:`moeshard.relocate` changes it), read from its routing tables: ``phy2log
    [num_moe_layers, num_physical]``. None for a model without moeshard EP layers (custom
    experts modules route tokens themselves). Local, no communication."""
    return _placement_of(ep_layers(model))


def slot_placement(model: nn.Module) -> Placement | None:
    """The placement the expert slots of ``model`` hold, read from the routing table of every
    experts module :func:`moeshard.parallelize` gave slots (:func:`routing_tables`: those with
    moeshard's EP forward and those that route tokens themselves): ``model.moeshard_placement``.
    It is :func:`model_placement` whenever moeshard's EP forward runs every MoE layer. None
    when no module has a table. Local, no communication."""
    return _placement_of(routing_tables(model))


def _placement_of(layers: list[tuple[nn.Module, EPLayer]]) -> Placement | None:
    if not layers:
        return None
    rows = _layer_rows(layers)
    first = layers[0][1]
    return Placement(
        np.stack([rows[i].phy2log for i in sorted(rows)]), num_logical=len(first.logcnt), num_ranks=first.ep_size
    )


def _layer_rows(layers: list[tuple[nn.Module, EPLayer]]) -> dict[int, EPLayer]:
    """MoE layer -> the EP layout of its first experts module (:func:`ep_layers`' ``layers``;
    the experts modules one router drives share their layer and its routing tables)."""
    rows: dict[int, EPLayer] = {}
    for _, ep in layers:
        rows.setdefault(ep.layer, ep)
    return rows


# A parallelized model's class with the derived ``moeshard_placement``, by the model's class.
_WITH_PLACEMENT: dict[type, type] = {}


def expose_placement(model: nn.Module) -> None:
    """Give ``model`` a read-only ``model.moeshard_placement``: :func:`slot_placement`, derived
    from its routing tables on every read, so it cannot fall out of step with them (assigning it
    raises AttributeError). Local. Called by :func:`moeshard.parallelize` before FSDP2 wraps the
    model: as ``fully_shard`` does, it gives the instance a subclass of its class (same name,
    one property added)."""
    cls = type(model)
    if isinstance(getattr(cls, "moeshard_placement", None), property):
        return
    sub = _WITH_PLACEMENT.get(cls)
    if sub is None:
        prop = property(slot_placement, doc=slot_placement.__doc__)
        sub = _WITH_PLACEMENT[cls] = type(
            cls.__name__, (cls,), {"moeshard_placement": prop, "__module__": cls.__module__}
        )
    model.__class__ = sub


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def slot_params(module: nn.Module) -> list[tuple[nn.Parameter, Callable[[torch.Tensor], torch.Tensor]]]:
    """Per-slot parameters of an EP experts module, each with the view of a local tensor (the
    parameter's or its gradient's) that puts the slots first: the fused expert parameters
    ``[S, ...]`` as they are (not the whole per-logical-expert ones, :attr:`EPLayer.param_names`),
    and the LoRA factors of :class:`SlotLora`."""
    ep = getattr(module, "moeshard_ep", None)
    holder = getattr(module, "moeshard_holder", module)
    out: list = [
        (p, _identity) for name, p in holder.named_parameters(recurse=False) if ep is None or _per_slot(ep, name)
    ]
    for lora in getattr(module, "moeshard_lora", ()):
        out += [(lora.a(), lora.a_slots), (lora.b(), lora.b_slots)]
    return out


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` (the EP mean, see module doc)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` of rows: ``x [sum(send), ...] -> [sum(recv), ...]``;
    its backward is the reverse exchange. (Public collectives only: torch's own autograd
    wrapper in ``torch.distributed.nn`` is deprecated, its replacement private.)"""

    @staticmethod
    def forward(ctx, x, recv, send, group):
        ctx.splits, ctx.group = (recv, send), group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        with collectives.collective("moeshard EP forward: exchanging tokens (all-to-all)"):
            dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        recv, send = ctx.splits
        out = grad.new_empty((sum(send), *grad.shape[1:]))
        with collectives.collective("moeshard EP backward: exchanging gradients (all-to-all)"):
            dist.all_to_all_single(out, grad.contiguous(), send, recv, group=ctx.group)
        return out, None, None, None


def _local_weight(p: torch.Tensor, scale: float) -> torch.Tensor:
    w = p.to_local() if hasattr(p, "to_local") else p
    return w if scale == 1.0 else _ScaleGrad.apply(w, scale)


def _per_slot(ep: EPLayer, name: str) -> bool:
    """Whether parameter ``name`` of the module holds slots (else one row per logical expert)."""
    return not ep.param_names or name in ep.param_names


def _route_tables(module: nn.Module, ep: EPLayer, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(log2phy, logcnt, local slots' logical experts)`` of ``ep`` on ``device``, built once per
    device (the tokens' device: GPU under NCCL) and placement (:func:`set_placement` clears them).
    An empty local slot's expert reads as 0: no row reaches it."""
    route = module._moeshard_route.get(device)
    if route is None:
        lo = ep.ep_rank * ep.slots_per_rank
        slot_experts = np.maximum(ep.phy2log[lo : lo + ep.slots_per_rank], 0)
        route = module._moeshard_route[device] = tuple(
            torch.tensor(t, device=device) for t in (ep.log2phy, ep.logcnt, slot_experts)
        )
    return route


def _pick_copies(module: nn.Module, ep: EPLayer, experts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Physical slot of each (token, expert) pair: a copy on this rank if there is one, else the
    copies take turns by token index. ``experts``, ``tokens``: ``int[N]``; returns ``int[N]``."""
    log2phy, logcnt, _ = _route_tables(module, ep, experts.device)
    cnt = logcnt[experts]
    slots = log2phy[experts, (tokens + ep.ep_rank) % cnt]
    if log2phy.shape[1] > 1:
        copies = log2phy[experts]  # [N, max_copies]
        local = (copies // ep.slots_per_rank == ep.ep_rank) & (copies >= 0)
        has_local = local.any(dim=1)
        first_local = copies.gather(1, local.to(torch.int8).argmax(dim=1, keepdim=True)).squeeze(1)
        slots = torch.where(has_local, first_local, slots)
    return slots


def _ep_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """EP forward of a routed experts module (module doc). Collective over the EP group: every
    EP rank calls it the same number of times (a rank with no tokens still exchanges empty
    buffers).

    Shapes: ``hidden_states [T, H]``, ``top_k_index [T, K]`` (logical ids), ``top_k_weights
    [T, K]`` -> ``[T, H]``.
    """
    shape = hidden_states.shape  # [T, H], or [B, S, H] (DBRX's experts take the batch)
    hidden_states = hidden_states.reshape(-1, shape[-1])
    T, K = top_k_index.shape
    experts = top_k_index.reshape(-1)
    tokens = torch.arange(T, device=experts.device).repeat_interleave(K)
    weights = top_k_weights.reshape(-1)
    # As transformers' experts (grouped_mm): each output times its weight in their promoted dtype
    # (float32 for DeepSeek-V3's float32 router weights), the K products summed in at least
    # float32, rounded once to the hidden dtype.
    acc = torch.promote_types(torch.promote_types(hidden_states.dtype, weights.dtype), torch.float32)
    out = torch.zeros(hidden_states.shape, dtype=acc, device=hidden_states.device)
    if self.moeshard_identity:
        # Identity ("zero") experts, ids past the logical ones: the token's own state times its
        # weight, where it is; the other pairs go to their experts.
        with torch.no_grad():
            zero = experts >= len(self.moeshard_ep.logcnt)
            ident, routed = zero.nonzero().squeeze(1), (~zero).nonzero().squeeze(1)
        y = hidden_states[tokens[ident]] * weights[ident, None]
        out = out.index_add(0, tokens[ident], y.to(acc))
        experts, tokens, weights = experts[routed], tokens[routed], weights[routed]
    y, order = _exchange(self, hidden_states, tokens, experts, tokens)
    y = y * weights[order, None]
    return out.index_add(0, tokens[order], y.to(acc)).to(hidden_states.dtype).view(shape)


def _ep_forward_prerouted(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """EP forward of a pre-routed experts module (module doc; collective as :func:`_ep_forward`).

    ``hidden_states [E*T, H]``, block ``e`` the tokens scaled by their score for logical expert
    ``e`` -> ``[E*T, H]``, block ``e`` expert ``e``'s output. Only nonzero rows travel: a pair not
    routed to its expert has score 0, hence a zero row, whose output (no biases: checked at
    install) and gradients are 0 when ``act_fn(0) == 0`` (checked once, see
    :func:`_check_zero_rows_vanish`). So the traffic is that of the routed top-k pairs, not E
    rows per token.
    """
    num_logical = len(self.moeshard_ep.logcnt)
    if hidden_states.dim() != 2 or hidden_states.shape[0] % num_logical:
        raise ValueError(
            f"{type(self).__name__}: expected pre-routed rows [{num_logical} experts x tokens, hidden], "
            f"got {list(hidden_states.shape)}"
        )
    _check_zero_rows_vanish(self, hidden_states)
    T = hidden_states.shape[0] // num_logical
    with torch.no_grad():
        pairs = hidden_states.ne(0).any(dim=1).nonzero().squeeze(1)  # rows e*T + t
    y, order = _exchange(self, hidden_states, pairs, pairs // T, pairs % T)
    out = torch.zeros_like(hidden_states)
    return out.index_copy(0, pairs[order], y.to(out.dtype))


def _ep_forward_grouped(self, inputs: torch.Tensor, expert_size) -> torch.Tensor:
    """EP forward of a grouped experts module (module doc; collective as :func:`_ep_forward`).

    ``inputs [N, in]`` sorted by logical expert, ``expert_size`` (``E`` counts, a list or a
    tensor) rows each -> ``[N, out]``: each row mapped by a copy of its expert, in place."""
    num_logical = len(self.moeshard_ep.logcnt)
    with torch.no_grad():
        sizes = torch.as_tensor(expert_size, device=inputs.device, dtype=torch.long)
        if sizes.shape != (num_logical,) or int(sizes.sum()) != len(inputs):
            raise ValueError(
                f"{type(self).__name__}: expected rows sorted by expert with {num_logical} counts "
                f"summing to {len(inputs)}, got expert_size of shape {list(sizes.shape)}"
            )
        rows = torch.arange(len(inputs), device=inputs.device)
        experts = torch.repeat_interleave(torch.arange(num_logical, device=inputs.device), sizes)
    y, order = _exchange(self, inputs, rows, experts, rows)
    out = y.new_empty((len(inputs), *y.shape[1:]))
    return out.index_copy(0, order, y)


def _ep_forward_lookup(self, ids: torch.Tensor) -> torch.Tensor:
    """EP forward of an embedding whose rows are experts (module doc; collective as
    :func:`_ep_forward`): ``ids [...]`` logical experts -> ``[..., d]`` their rows, each from a
    copy of its expert (only the slot travels there: one placeholder value per id)."""
    flat = ids.reshape(-1)
    rows = torch.arange(len(flat), device=flat.device)
    weight = self.__dict__.get("moeshard_holder", self)._parameters["weight"]
    placeholder = torch.zeros((len(flat), 1), dtype=weight.dtype, device=flat.device)
    y, order = _exchange(self, placeholder, rows, flat, rows)
    out = y.new_empty((len(flat), *y.shape[1:]))
    return out.index_copy(0, order, y).view(*ids.shape, -1)


def _check_zero_rows_vanish(self, like: torch.Tensor) -> None:
    """Skipping zero rows is exact when the expert maps 0 to 0 with zero gradients: true without
    biases when ``act_fn(0) == 0`` (then ``up(0) * act(gate(0))`` vanishes and so do its
    derivatives at 0); ``act_fn`` comes from the config, so check it once per module."""
    if getattr(self, "_moeshard_zero_ok", False):
        return
    if bool(self.act_fn(like.new_zeros(1)).ne(0).any()):
        raise NotImplementedError(
            f"{type(self).__name__}: act_fn(0) != 0; moeshard's pre-routed EP forward skips "
            "the zero rows of pairs not routed, exact only when act_fn(0) == 0"
        )
    self._moeshard_zero_ok = True


def _exchange(
    self, source: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-4 of the module doc for N (token, expert) pairs: row ``source[rows[i]]`` goes to a
    copy of logical expert ``experts[i]`` (``tokens[i]``: the token, for the copies' turns), runs
    there, and its output comes back.

    Shapes: ``source [*, H]``; ``rows``, ``experts``, ``tokens`` ``int[N]``. Returns ``(y [N, H'],
    order int[N])``: ``y[j]`` is the output of pair ``order[j]`` (pairs sorted by slot).
    """
    ep: EPLayer = self.moeshard_ep
    group, spr, n = ep.ep_group, ep.slots_per_rank, ep.ep_size
    with torch.no_grad():
        slots = _pick_copies(self, ep, experts, tokens)
        order = torch.argsort(slots, stable=True)  # by slot, hence by destination rank
        sorted_slots = slots[order]
        send_counts = torch.bincount(sorted_slots // spr, minlength=n)
        recv_counts = torch.empty_like(send_counts)
        with collectives.collective("moeshard EP forward: exchanging routing counts (all-to-all)"):
            dist.all_to_all_single(recv_counts, send_counts, group=group)
            send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
            recv_slots = sorted_slots.new_empty(sum(recv_splits))
            dist.all_to_all_single(recv_slots, sorted_slots % spr, recv_splits, send_splits, group=group)
    x = _AllToAll.apply(source[rows[order]], recv_splits, send_splits, group)
    y = _local_experts(self, x, recv_slots, ep)
    return _AllToAll.apply(y, send_splits, recv_splits, group), order


def _local_experts(self, x: torch.Tensor, local_slots: torch.Tensor, ep: EPLayer) -> torch.Tensor:
    """Run this rank's slots with the module's own forward: ``x [R, H]`` rows for local slots
    ``local_slots int[R]`` -> ``[R, H']`` in arrival order (the return all-to-all's)."""
    x, weights = _local_params(self, ep, x)
    if self.moeshard_kind == LOOKUP:  # the local slots' rows (in the graph even when there are none)
        return weights["weight"][local_slots]
    if not len(x):
        # Keep rows and weights in the graph: every rank's backward must run the same
        # collectives (the return all-to-all's and the dispatch all-to-all's).
        return x * 0 + 0 * sum(w.sum() for w in weights.values())
    forward = type(self).forward  # the class's (transformers': dispatches on _experts_implementation)
    if self.moeshard_kind == PREROUTED:
        return _prerouted_local(self, forward, weights, x, local_slots, ep.slots_per_rank)
    if self.moeshard_kind == GROUPED:  # the rows sorted by local slot, then put back in arrival order
        order = torch.argsort(local_slots, stable=True)
        counts = torch.bincount(local_slots, minlength=ep.slots_per_rank).tolist()
        y = forward(_slot_view(self, weights, ep.slots_per_rank), x[order], counts)
        return torch.empty_like(y).index_copy(0, order, y)
    # Each row routed to its local slot with weight 1: the forward returns expert(x) * 1,
    # summed over one k: exactly the expert's output.
    view = _slot_view(self, weights, ep.slots_per_rank)
    if self.moeshard_identity:
        # LongCat-Flash's forward needs two picks per row (it squeezes the pick dim): the second is
        # an identity expert (id S of the view) with weight 0, which adds exactly 0 and no compute.
        view.__dict__["total_experts"] = ep.slots_per_rank + 1
        index = torch.stack([local_slots, torch.full_like(local_slots, ep.slots_per_rank)], dim=1)
        weight = torch.stack([x.new_ones(len(x)), x.new_zeros(len(x))], dim=1)
        return forward(view, x, index, weight).reshape(len(x), -1)
    return forward(view, x, local_slots[:, None], x.new_ones((len(x), 1))).reshape(len(x), -1)


def _local_params(self, ep: EPLayer, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every parameter of the module for this rank's slots, ``[S, ...]``: a per-slot one local,
    its gradient scaled (the EP mean, module doc), plus its LoRA deltas; a per-logical-expert one
    (whole ``[E, ...]`` while FSDP has it unsharded) gathered at the slots' experts, unscaled:
    FSDP's gradient reduction over every rank already averages it.

    The per-slot tensors (weights and LoRA factors) go with the received rows ``x [R, H]``
    through :func:`moeshard.models.copies.combine_copy_grads`: in backward, a redundant
    expert's copies' gradients are summed into its first copy. Returns ``(x, parameters)``."""
    holder = self.__dict__.get("moeshard_holder", self)  # whose parameters they are (DBRX: the child)
    names = [n for n, p in holder._parameters.items() if p is not None and _per_slot(ep, n)]
    loras = [lora for lora in self.moeshard_lora if lora.param in names and lora.active()]
    local = [_local_weight(holder._parameters[n], ep.grad_scale) for n in names]
    local += [_local_weight(t, ep.grad_scale) for lora in loras for t in (lora.a(), lora.b())]
    views = [_identity] * len(names) + [v for lora in loras for v in (lora.a_slots, lora.b_slots)]
    x, local = combine_copy_grads(ep, x, local, views)
    out = {}
    factors = iter(zip(local[len(names) :: 2], local[len(names) + 1 :: 2]))
    by_param = {n: [] for n in names}
    for lora in loras:
        by_param[lora.param].append((lora, *next(factors)))
    for name, w in zip(names, local):
        # Scale first, then combine copies, then cast: the cast's backward brings the gradient to
        # the parameter's dtype, where the copies are summed and the 1/EP mean is taken (module
        # doc, "Mixed precision").
        out[name] = _with_lora(_compute(w, ep), by_param[name])
    for name, p in holder._parameters.items():
        if p is None or name in out:
            continue
        whole = _compute(_local_weight(p, 1.0), ep)  # not local_tensor: that detaches
        assert whole.shape[0] == len(ep.logcnt), (name, tuple(whole.shape))  # unsharded by FSDP here
        out[name] = whole[_route_tables(self, ep, x.device)[2].to(whole.device)]
    return x, out


def _compute(w: torch.Tensor, ep: EPLayer) -> torch.Tensor:
    """``w`` in the mixed-precision compute dtype (a differentiable cast; ``w`` itself when it is
    already in it, as FSDP2's all-gathered expert weights are with efsdp > 1)."""
    dtype = ep.compute_dtype
    return w if dtype is None or not w.is_floating_point() else w.to(dtype)


def _prerouted_local(
    self, forward, weights: dict[str, torch.Tensor], x: torch.Tensor, local_slots: torch.Tensor, spr: int
) -> torch.Tensor:
    """Pre-routed local compute: the module's forward once per local slot, on a one-slot view and
    that slot's rows (its forward takes equal blocks per expert; ours are ragged).
    ``x [R, H]``, ``local_slots int[R]`` -> ``[R, H]`` in arrival order."""
    order = torch.argsort(local_slots, stable=True)
    counts = torch.bincount(local_slots, minlength=spr).tolist()
    # unbind, not w[s]: its backward stacks the slots' gradients into one tensor, where
    # indexing would allocate a zero-filled [S, ...] gradient for every slot.
    per_slot = {name: w.unbind(0) for name, w in weights.items()}
    outs = []
    for s, rows in enumerate(torch.split(x[order], counts)):
        if counts[s]:
            view = _slot_view(self, {name: t[s].unsqueeze(0) for name, t in per_slot.items()}, 1)
            outs.append(forward(view, rows))
    y = torch.cat(outs)
    return torch.empty_like(y).index_copy(0, order, y)


def _slot_view(self, params: dict[str, torch.Tensor], num_slots: int) -> nn.Module:
    """A shallow copy of experts module ``self`` whose parameters are ``params`` (local tensors
    ``[num_slots, ...]``: autograd flows through them to the DTensor parameters) and whose
    ``num_experts`` is ``num_slots``; it shares everything else (config, act_fn, submodules).
    Only its forward is called (not ``__call__``: no hooks), so nothing is registered."""
    holder = self.__dict__.get("moeshard_holder", self)
    if holder is not self:  # the parameters are a child's: a view of the child under the same name
        child = next(k for k, m in self._modules.items() if m is holder)
        view = _slot_view(holder, params, num_slots)
        params = {}
    view_self = object.__new__(type(self))
    view_self.__dict__.update(self.__dict__)
    view_self.__dict__["_parameters"] = {**self._parameters, **params}
    if holder is not self:
        view_self.__dict__["_modules"] = {**self._modules, child: view}
    view_self.__dict__.pop("forward", None)  # the EP forward installed on self
    for count in _COUNTS:
        if count in view_self.__dict__:
            view_self.__dict__[count] = num_slots
    return view_self


def _with_lora(w: torch.Tensor, loras: list[tuple[SlotLora, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``w [S, d1, d2]`` plus the deltas of ``loras`` (``(lora, local A, local B)``, active, on
    this parameter) in peft's factored form over the local slots: ``baddbmm(W, B, A,
    alpha=scaling)`` for a ``[E, out, in]`` parameter, ``baddbmm(W, A^T, B^T, ...)`` for an
    ``[E, in, out]`` one (peft's ``ParamWrapper.get_delta_factors``: it swaps in/out unless the
    experts module says ``is_transposed``)."""
    for lora, a_local, b_local in loras:
        a = lora.a_slots(a_local).to(w.dtype)  # [S, r, in]
        b = lora.b_slots(b_local).to(w.dtype)  # [S, out, r]
        if getattr(lora.wrapper, "_did_swap_in_out_features", True):
            w = torch.baddbmm(w, b, a, alpha=lora.scaling)
        else:
            w = torch.baddbmm(w, a.transpose(1, 2), b.transpose(1, 2), alpha=lora.scaling)
    return w


def routing_tables(model: nn.Module) -> list[tuple[nn.Module, EPLayer]]:
    """Every module of ``model`` with a routing table (``module.moeshard_ep``), in layer order:
    the module running each experts module :func:`moeshard.parallelize` (or a relocation of a
    transformers EP model, :func:`moeshard.models.routing.take_over`) gave slots, whether its
    forward is moeshard's EP forward (:func:`ep_layers`) or routes tokens itself by the table.
    The tables are the one record of the model's placement; :func:`set_placement` changes them."""
    return [(m, m.moeshard_ep) for m in model.modules() if isinstance(getattr(m, "moeshard_ep", None), EPLayer)]


def ep_forward_installed(module: nn.Module) -> bool:
    """Whether ``module`` runs moeshard's EP forward (:func:`install_ep_forward`), routing tokens
    by its table."""
    return (
        isinstance(getattr(module, "moeshard_ep", None), EPLayer) and getattr(module, "moeshard_kind", None) is not None
    )


def ep_layers(model: nn.Module) -> list[tuple[nn.Module, EPLayer]]:
    """Experts modules of ``model`` with an EP forward installed, in layer order."""
    return [(m, ep) for m, ep in routing_tables(model) if ep_forward_installed(m)]


def ep_layer_names(model: nn.Module) -> list[str]:
    """One name per MoE layer of ``model``'s EP experts modules (:func:`ep_layers`), in layer
    order: the module whose forward runs the layer's experts, or where several do (JetMoE's
    ``input_linear`` and ``output_linear``, which one router drives) their common parent. Local."""
    names = {id(m): n for n, m in model.named_modules()}
    by_layer: dict[int, list[str]] = {}
    for module, ep in ep_layers(model):
        by_layer.setdefault(ep.layer, []).append(names[id(module)])
    out = []
    for layer in sorted(by_layer):
        parts = [n.split(".") for n in by_layer[layer]]
        common = parts[0]
        for p in parts[1:]:
            k = next((i for i, (a, b) in enumerate(zip(common, p)) if a != b), min(len(common), len(p)))
            common = common[:k]
        out.append(".".join(common) if len(parts) > 1 else by_layer[layer][0])
    return out


def sync_redundant_grads(model: nn.Module) -> int:
    """A no-op kept for loops written before the EP forward did it in backward: every redundant
    expert's first copy already holds the sum of its copies' gradients and the other copies
    zero (:mod:`moeshard.models.copies`), which every gradient norm and optimizer step (with
    the copy of first copies after it) treat right. Calling it changes nothing, so it never
    counts a gradient twice. Local, no communication.

    Returns the number of MoE layers of ``model`` with redundant copies (each combined in
    backward).
    """
    return sum(int(ep.logcnt.max()) > 1 for ep in _layer_rows(ep_layers(model)).values())


@torch.no_grad()
def grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """Collective (every rank): the global gradient norm of ``model``, counting every element
    of the logical model once: FSDP shards once each, a plain (replicated) tensor once, a
    redundant expert once (its first copy, which holds the copies' sum; the others hold zero).
    Equals the norm one process would compute for the unsharded model, and the norm of torch's
    ``clip_grad_norm_`` taken per mesh (accelerate's and the Trainer's mixed-mesh path).
    Returns a scalar tensor on the gradients' device."""
    if norm_type != 2.0:
        raise ValueError(f"only the 2-norm is supported, got norm_type={norm_type}")
    experts = {id(p): (ep, slots) for m, ep in ep_layers(model) for p, slots in slot_params(m)}
    total, device = None, None
    rank = dist.get_rank()
    for p in model.parameters():
        if p.grad is None:
            continue
        g = local_tensor(p.grad).float()
        device = g.device
        if id(p) in experts:
            ep, slots = experts[id(p)]
            first = ep.first_copy()
            if first.all():  # no redundant copy here: every local element counts (also when FSDP
                sq = g.pow(2).sum()  # shards the slots themselves, transformers' dim-0 expert FSDP)
            else:
                sq = slots(g)[torch.tensor(first, device=g.device)].pow(2).sum()
        elif hasattr(p.grad, "placements"):
            from torch.distributed.tensor import Replicate

            # A Replicate axis holds copies: only coordinate 0 of each such axis counts.
            coord = p.grad.device_mesh.get_coordinate() or []
            dup = any(isinstance(pl, Replicate) and c for pl, c in zip(p.grad.placements, coord))
            sq = g.new_zeros(()) if dup else g.pow(2).sum()
        else:
            sq = g.pow(2).sum() if rank == 0 else g.new_zeros(())
        total = sq if total is None else total + sq
    if total is None:  # no gradients here: still join the all-reduce, on the model's device
        device = device or local_tensor(next(model.parameters())).device
        total = torch.zeros((), device=device)
    dist.all_reduce(total)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Collective: :func:`grad_norm`, then scale every gradient by ``max_norm / norm`` when the
    norm exceeds ``max_norm`` (as ``torch.nn.utils.clip_grad_norm_``). Returns the norm."""
    norm = grad_norm(model)
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0 and math.isfinite(coef):
        for p in model.parameters():
            if p.grad is not None:
                local_tensor(p.grad).mul_(coef)
    return norm
