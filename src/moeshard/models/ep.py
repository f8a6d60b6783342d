"""Expert-parallel forward for a HF-style experts module, and what training needs around it.

After :func:`moeshard.parallelize`, an experts module holds only its EP rank's slots
(``gate_up_proj`` local ``[S, 2I, H]``, ``down_proj`` local ``[S, H, I]``, ``S`` slots per
rank). Its forward keeps the HF signature ``(hidden [T, H], top_k_index [T, K] logical
experts, top_k_weights [T, K]) -> [T, H]`` and becomes:

1. every (token, k) pair picks one physical copy of its logical expert (redundant experts:
   copies share the tokens; a copy on this rank is preferred, else they take turns);
2. rows are sorted by slot, so each EP rank's rows are contiguous, and exchanged with a
   differentiable all-to-all inside the EP group (counts first, then rows);
3. each rank runs its local slots on the rows it received;
4. a second all-to-all brings the outputs back; they are weighted and summed per token.

Gradient convention (the data-parallel one FSDP applies to every other parameter): the
gradient of an expert parameter is the *mean* over all ranks of the gradients of their local
losses. Rows from every rank of the EP group reach an expert, so its raw gradient is a sum
over the EP group; it is divided by the EP size here, and FSDP's reduce-scatter over "efsdp"
divides by that axis' size (its default), so the product is the world size. (Not FSDP's
``set_gradient_divide_factor``: it needs a PREMUL_SUM reduction, which gloo lacks.)

Copies of a redundant expert see different tokens, so their gradients differ; call
:func:`sync_redundant_grads` after backward (before clipping and the optimizer step) to give
every copy the sum, the gradient a single copy would have had. :func:`clip_grad_norm_`
counts each logical expert once.
"""

from __future__ import annotations

import dataclasses
import math
import types
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .layout import local_tensor

__all__ = ["EPLayer", "SlotLora", "install_ep_forward", "set_placement", "slot_params", "sync_redundant_grads", "grad_norm",
           "clip_grad_norm_"]


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
    """

    layer: int
    phy2log: np.ndarray
    log2phy: np.ndarray
    logcnt: np.ndarray
    slots_per_rank: int
    ep_rank: int
    ep_group: dist.ProcessGroup
    grad_scale: float

    @property
    def ep_size(self) -> int:
        return len(self.phy2log) // self.slots_per_rank

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


def install_ep_forward(module: nn.Module, ep_layer: EPLayer, loras: tuple[SlotLora, ...] = ()) -> None:
    """Replace ``module``'s forward (HF experts: ``gate_up_proj``, ``down_proj``, ``act_fn``)
    with the EP forward for ``ep_layer``, adding ``loras``' deltas to the local slots' weights.
    Called by :func:`moeshard.parallelize`."""
    module.moeshard_ep = ep_layer
    module.moeshard_lora = tuple(loras)
    module._moeshard_route = {}
    module.forward = types.MethodType(_ep_forward, module)


def set_placement(model: nn.Module, placement) -> int:
    """Point every EP experts module of ``model`` at ``placement`` (after its weights moved:
    :func:`moeshard.relocate` calls this), so tokens are routed to the slots that now hold
    their experts. Local, no communication; every rank must do it with the same placement.
    Returns the number of layers updated."""
    layers = ep_layers(model)
    if not layers:  # custom experts modules route tokens themselves
        return 0
    placement.check_layers(len(layers))
    for module, ep in layers:
        if placement.num_physical != len(ep.phy2log):
            raise ValueError(f"the placement has {placement.num_physical} slots per layer, the model {len(ep.phy2log)}")
        module.moeshard_ep = dataclasses.replace(
            ep, phy2log=placement.phy2log[ep.layer], log2phy=placement.log2phy[ep.layer],
            logcnt=placement.logcnt[ep.layer])
        module._moeshard_route = {}
    return len(layers)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def slot_params(module: nn.Module) -> list[tuple[nn.Parameter, Callable[[torch.Tensor], torch.Tensor]]]:
    """Per-slot parameters of an EP experts module, each with the view of a local tensor (the
    parameter's or its gradient's) that puts the slots first: the fused expert weights
    ``[S, ...]`` as they are, and the LoRA factors of :class:`SlotLora`."""
    out: list = [(p, _identity) for p in module.parameters(recurse=False)]
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
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        recv, send = ctx.splits
        out = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send, recv, group=ctx.group)
        return out, None, None, None


def _local_weight(p: torch.Tensor, scale: float) -> torch.Tensor:
    w = p.to_local() if hasattr(p, "to_local") else p
    return w if scale == 1.0 else _ScaleGrad.apply(w, scale)


def _pick_copies(module: nn.Module, ep: EPLayer, experts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Physical slot of each (token, k) row: a copy on this rank if there is one, else the
    copies take turns by token index. ``experts``, ``tokens``: ``int[N]``; returns ``int[N]``."""
    route = module._moeshard_route.get(experts.device)
    if route is None:  # the tables, once per device (the tokens' device: GPU under NCCL)
        route = module._moeshard_route[experts.device] = (
            torch.tensor(ep.log2phy, device=experts.device), torch.tensor(ep.logcnt, device=experts.device))
    log2phy, logcnt = route
    cnt = logcnt[experts]
    slots = log2phy[experts, (tokens + ep.ep_rank) % cnt]
    if log2phy.shape[1] > 1:
        copies = log2phy[experts]  # [N, max_copies]
        local = (copies // ep.slots_per_rank == ep.ep_rank) & (copies >= 0)
        has_local = local.any(dim=1)
        first_local = copies.gather(1, local.to(torch.int8).argmax(dim=1, keepdim=True)).squeeze(1)
        slots = torch.where(has_local, first_local, slots)
    return slots


def _ep_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """EP forward (see module doc). Collective over the EP group: every EP rank calls it the
    same number of times (a rank with no tokens still exchanges empty buffers).

    Shapes: ``hidden_states [T, H]``, ``top_k_index [T, K]`` (logical ids), ``top_k_weights
    [T, K]`` -> ``[T, H]``.
    """
    ep: EPLayer = self.moeshard_ep
    T, K = top_k_index.shape
    group, spr, n = ep.ep_group, ep.slots_per_rank, ep.ep_size
    experts = top_k_index.reshape(-1)
    tokens = torch.arange(T, device=experts.device).repeat_interleave(K)
    with torch.no_grad():
        slots = _pick_copies(self, ep, experts, tokens)
        order = torch.argsort(slots, stable=True)  # by slot, hence by destination rank
        sorted_slots = slots[order]
        send_counts = torch.bincount(sorted_slots // spr, minlength=n)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        recv_slots = sorted_slots.new_empty(sum(recv_splits))
        dist.all_to_all_single(recv_slots, sorted_slots - (sorted_slots // spr) * spr, recv_splits, send_splits, group=group)
    x = hidden_states[tokens[order]]
    x = _AllToAll.apply(x, recv_splits, send_splits, group)
    y = _local_experts(self, x, recv_slots, ep)
    y = _AllToAll.apply(y, send_splits, recv_splits, group)
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros_like(hidden_states)
    return out.index_add(0, tokens[order], y.to(out.dtype))


def _local_experts(self, x: torch.Tensor, local_slots: torch.Tensor, ep: EPLayer) -> torch.Tensor:
    """Run this rank's slots: ``x [R, H]`` rows for local slots ``local_slots int[R]`` -> ``[R, H]``."""
    gate_up = _with_lora(self, "gate_up_proj", _local_weight(self.gate_up_proj, ep.grad_scale), ep)  # [S, 2I, H]
    down = _with_lora(self, "down_proj", _local_weight(self.down_proj, ep.grad_scale), ep)  # [S, H, I]
    order = torch.argsort(local_slots, stable=True)
    counts = torch.bincount(local_slots, minlength=ep.slots_per_rank).tolist()
    # unbind, not gate_up[s]: its backward stacks the slots' gradients into one tensor, where
    # indexing would allocate a zero-filled [S, ...] gradient for every slot.
    gate_ups, downs = gate_up.unbind(0), down.unbind(0)
    outs = []
    for s, rows in enumerate(torch.split(x[order], counts)):
        if not counts[s]:
            continue
        gate, up = nn.functional.linear(rows, gate_ups[s]).chunk(2, dim=-1)
        outs.append(nn.functional.linear(self.act_fn(gate) * up, downs[s]))
    if not outs:
        # Keep rows and weights in the graph: every rank's backward must run the same
        # collectives (the return all-to-all's and the dispatch all-to-all's).
        return x * 0 + 0 * (gate_up.sum() + down.sum())
    y = torch.cat(outs)
    # Back to arrival order (the order the return all-to-all expects).
    return torch.empty_like(y).index_copy(0, order, y)


def _with_lora(self, name: str, w: torch.Tensor, ep: EPLayer) -> torch.Tensor:
    """``w [S, out, in]`` plus the active LoRA deltas on parameter ``name`` (peft's factored
    form: ``baddbmm(W, B, A, alpha=scaling)`` over the local slots)."""
    for lora in self.moeshard_lora:
        if lora.param == name and lora.active():
            a = lora.a_slots(_local_weight(lora.a(), ep.grad_scale))  # [S, r, in]
            b = lora.b_slots(_local_weight(lora.b(), ep.grad_scale))  # [S, out, r]
            w = torch.baddbmm(w, b.to(w.dtype), a.to(w.dtype), alpha=lora.scaling)
    return w


def ep_layers(model: nn.Module) -> list[tuple[nn.Module, EPLayer]]:
    """Experts modules of ``model`` with an EP forward installed, in layer order."""
    return [(m, m.moeshard_ep) for m in model.modules() if isinstance(getattr(m, "moeshard_ep", None), EPLayer)]


@torch.no_grad()
def sync_redundant_grads(model: nn.Module) -> int:
    """Collective (every rank): give every copy of a redundant expert the sum of its copies'
    gradients (what one copy seeing all the tokens would get). Call after backward, before
    clipping and ``optimizer.step()``; a no-op for layers without redundant copies.

    With expert FSDP the gradients are sharded ``[S, dim1/efsdp, ...]``: the ranks of one EP
    group hold the same shard, so the sum runs over the EP group. Returns the number of
    layers synchronized.
    """
    done = 0
    for module, ep in ep_layers(model):
        if int(ep.logcnt.max()) <= 1:
            continue
        lo = ep.ep_rank * ep.slots_per_rank
        experts = ep.phy2log[lo : lo + ep.slots_per_rank]
        live_slots = np.flatnonzero(experts >= 0)  # local slots holding an expert
        for p, slots in slot_params(module):
            if p.grad is None:
                continue
            g = slots(local_tensor(p.grad))  # [S, ...]
            live = torch.tensor(live_slots, device=g.device)
            idx = torch.tensor(experts[live_slots], device=g.device)
            total = g.new_zeros((len(ep.logcnt), *g.shape[1:]))
            total.index_add_(0, idx, g[live])
            dist.all_reduce(total, group=ep.ep_group)
            g[live] = total[idx]
        done += 1
    return done


@torch.no_grad()
def grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """Collective (every rank): the global gradient norm of ``model``, counting every element
    of the logical model once: FSDP shards once each, a plain (replicated) tensor once, a
    redundant expert once (its first copy). Equals the norm one process would compute for the
    unsharded model. Returns a scalar tensor on the gradients' device."""
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
            keep = torch.tensor(ep.first_copy(), device=g.device)
            sq = slots(g)[keep].pow(2).sum()
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
