"""Copies of a redundant expert, right in a stock training loop.

A redundant expert has several physical copies (slots), on one or several EP ranks; each copy
sees only the tokens routed to it, so after backward the copies' gradients differ, and a
stock loop (the transformers Trainer: ``loss.backward()``, ``clip_grad_norm_`` over
``model.parameters()``, ``optimizer.step()``) knows nothing of copies. What moeshard installs
(through :func:`moeshard.parallelize`) so that such a loop computes exactly what one process
computes for the logical model:

1. **In backward, the copies' gradients are summed into the first copy** (the slot
   ``log2phy[layer, e, 0]``, :meth:`moeshard.models.ep.EPLayer.first_copy`) **and the other copies'
   gradients are zero** (:func:`combine_copy_grads`). The first copy then holds the gradient
   one copy seeing every token would have had, and any gradient norm (torch's
   ``clip_grad_norm_`` / ``get_total_norm``, accelerate's and the Trainer's per-mesh norms,
   :func:`moeshard.grad_norm`) counts each logical expert once; clipping scales it right.
2. **After every** ``optimizer.step()`` **the first copy's weights and optimizer state are copied
   to the other copies** (:func:`copy_first_copies_`, run by a global optimizer step post-hook,
   ``torch.optim.optimizer.register_optimizer_step_post_hook``, for every optimizer holding a
   tracked module's expert parameters). The other copies stepped on a zero gradient (AdamW's
   weight decay still moved them); they are overwritten, so every copy is again identical,
   state included: :func:`moeshard.relocate` may move any copy's optimizer state with it.

How (1) runs. The EP forward passes the local expert weights (``[S, ...]``, each per-slot
tensor: fused weights and LoRA factors that require grad) together with the rows this rank
received through one identity autograd function. Its backward runs once the local experts'
backward produced both the rows' and the weights' gradients, and before the backward of the
dispatch all-to-all, which needs its rows' gradient: on every rank the layer's communication
in backward is one chain (return all-to-all, copies, dispatch all-to-all) whatever tokens the
rank saw (none included), so no two ranks can wait on each other in different orders. The
copies' gradients travel point to point, each non-first copy's rows to its first copy's rank
(one message per peer and tensor; copies on the first copy's own rank are added locally), in
an order both ends derive from the placement: ranks without such copies take no part. Being
linear per micro-batch, it accumulates exactly over gradient-accumulation steps.

With expert FSDP (efsdp > 1) it runs on the unsharded gradient FSDP2 then reduce-scatters over
"efsdp" (the ranks of one EP group hold the same efsdp coordinate, so their copies' rows
match); FSDP2's own gradient handling is untouched. Bytes per micro-batch and layer: each
non-first copy's expert gradient once (unsharded), sent to one rank. The sum is taken in the
gradient's dtype where it runs: the parameters' with efsdp == 1 (the EP forward casts to a
mixed-precision ``param_dtype`` after it), FSDP2's ``param_dtype`` with efsdp > 1 (its
unsharded gradient, before the reduce-scatter in ``reduce_dtype``): one rounding per added
copy in bf16 there.

Alternatives weighed:

* Give every copy the sum (what :func:`moeshard.sync_redundant_grads` used to do, after
  backward): copies then step identically with no step hook, but every norm a stock loop
  computes counts a redundant expert once per copy (the clipping coefficient is wrong), and it
  needs a call the Trainer never makes. Rejected.
* Sum after backward in a post-accumulate-grad hook of each parameter: FSDP2 assigns its
  reduced gradient without autograd, so the hook never sees it with efsdp > 1, and hooks of
  several parameters fire in an order that is not guaranteed to match across ranks (a
  collective inside could deadlock). Rejected.
* An all-reduce over the EP group of every redundant expert's gradient (simplest, every rank
  takes part): each rank sends ~2x the size of every redundant expert of the layer, where
  point to point each sends only its own extra copies (at 32 redundant experts on 32 EP
  ranks, ~64x fewer bytes). Rejected for the cost.
* Copy weights in the forward instead of after the step: no optimizer hook, but it runs at
  every micro-batch and evaluation forward and leaves the copies' optimizer state apart.

Which loops it covers: any ``torch.optim.Optimizer`` (accelerate's ``AcceleratedOptimizer``
and the Trainer step one; a step that a gradient scaler skips changes nothing, so nothing needs
copying). An optimizer that is not a ``torch.optim.Optimizer`` steps without the hook: call
:func:`sync_after_step` with it after its step (it reads ``param_groups`` and ``state``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from .. import collectives
from .describe import local_tensor

__all__ = ["CopyRoutes", "combine_copy_grads", "copy_first_copies_", "track", "tracked_layers", "sync_after_step"]

View = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, eq=False)
class CopyRoutes:
    """Where this EP rank's copies of redundant experts meet their first copy, for one MoE
    layer. Local slot indices (``int64`` arrays), pure function of the placement.

    Attributes:
        others: local slots holding a non-first copy of a redundant expert.
        local_copy, local_first: pairs on this rank: non-first copy slot -> its first copy's
            local slot.
        to_first: ``{EP peer: local slots}``: this rank's non-first copies whose first copy is on
            ``peer``, in global slot order.
        from_copies: ``{EP peer: local slots}``: this rank's first copy of each of ``peer``'s
            non-first copies, in that copy's global slot order (the order ``peer`` sends in).
    """

    others: np.ndarray
    local_copy: np.ndarray
    local_first: np.ndarray
    to_first: dict[int, np.ndarray]
    from_copies: dict[int, np.ndarray]
    _on_device: dict = field(default_factory=dict, repr=False)

    def on(self, device: torch.device) -> CopyRoutes:
        """The same routes as ``int64`` tensors on ``device`` (the gradients' device), made once
        per device: no host-to-device copy per backward or step."""
        got = self._on_device.get(device)
        if got is None:
            def t(a):
                return torch.as_tensor(a, dtype=torch.long).to(device)
            got = self._on_device[device] = CopyRoutes(
                t(self.others), t(self.local_copy), t(self.local_first),
                {r: t(a) for r, a in self.to_first.items()}, {r: t(a) for r, a in self.from_copies.items()})
        return got

    @property
    def empty(self) -> bool:
        """No copy of a redundant expert on this rank, nor the first copy of one elsewhere."""
        return not len(self.others) and not self.from_copies

    @staticmethod
    def of(phy2log: np.ndarray, log2phy: np.ndarray, slots_per_rank: int, ep_rank: int) -> CopyRoutes:
        """Routes of EP rank ``ep_rank`` for one layer: ``phy2log int[num_physical]`` (-1: empty
        slot), ``log2phy int[num_logical, max_copies]`` (-1 padded)."""
        spr = slots_per_rank
        phy2log = np.asarray(phy2log)
        slots = np.arange(len(phy2log))
        experts = np.maximum(phy2log, 0)
        first = np.asarray(log2phy)[experts, 0]  # every slot's expert's first copy (slot)
        copy = (phy2log >= 0) & (first != slots)  # non-first copies, anywhere
        copy_rank, first_rank = slots // spr, first // spr
        mine = copy & (copy_rank == ep_rank)
        lo = ep_rank * spr
        local = mine & (first_rank == ep_rank)
        to_first = {int(r): slots[mine & (first_rank == r)] - lo for r in np.unique(first_rank[mine & ~local])}
        theirs = copy & (first_rank == ep_rank) & (copy_rank != ep_rank)
        from_copies = {int(r): first[theirs & (copy_rank == r)] - lo for r in np.unique(copy_rank[theirs])}
        return CopyRoutes(slots[mine] - lo, slots[local] - lo, first[local] - lo, to_first, from_copies)


def _swap(ep, send: dict[int, list[torch.Tensor]], recv: dict[int, list[torch.Tensor]], what: str) -> None:
    """Send ``send[peer][i]`` to EP rank ``peer`` and receive ``recv[peer][i]`` from it, in one
    P2P batch over the EP group (message ``i`` of a pair tagged ``i``: both ends list their
    tensors in the same order). Only the peers named take part."""
    group = ep.ep_group
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, peer), group=group, tag=i)
           for peer in sorted(send) for i, t in enumerate(send[peer])]
    ops += [dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group=group, tag=i)
            for peer in sorted(recv) for i, t in enumerate(recv[peer])]
    if ops:
        with collectives.scope(group):
            collectives.start_p2p(ops, what)()


class _CombineCopies(torch.autograd.Function):
    """Identity forward of ``(rows, *weights)``; backward: the weights' gradients with each
    redundant expert's copies summed into its first copy and zero in the others (module doc)."""

    @staticmethod
    def forward(ctx, ep, views, rows, *weights):
        ctx.ep, ctx.views = ep, views
        return (rows.view_as(rows), *(w.view_as(w) for w in weights))

    @staticmethod
    def backward(ctx, grad_rows, *grads):
        return None, None, grad_rows, *_combined(ctx.ep, ctx.views, grads)


def _combined(ep, views: Sequence[View], grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Point-to-point part of :class:`_CombineCopies`' backward. ``grads[i]`` is the gradient of
    weight ``i`` (``views[i]`` puts its slots first: ``[S, ...]``)."""
    out = [g.clone() for g in grads]
    slotted = [view(g) for view, g in zip(views, out)]
    routes = ep.copy_routes.on(out[0].device)
    send = {peer: [v[s] for v in slotted] for peer, s in routes.to_first.items()}
    recv = {peer: [v.new_empty((len(f), *v.shape[1:])) for v in slotted] for peer, f in routes.from_copies.items()}
    if len(routes.local_copy):
        for v in slotted:
            v.index_add_(0, routes.local_first, v[routes.local_copy])
    _swap(ep, send, recv, "moeshard: summing redundant expert copies' gradients")
    for peer, rows in recv.items():
        for v, r in zip(slotted, rows):
            v.index_add_(0, routes.from_copies[peer], r)
    for v in slotted:
        v[routes.others] = 0
    return out


def combine_copy_grads(ep, rows: torch.Tensor, weights: Sequence[torch.Tensor],
                       views: Sequence[View]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(rows, weights)`` unchanged, joined in one autograd node whose backward sums each
    redundant expert's copies' gradients into its first copy and zeroes the others (module doc).

    Args:
        ep: the layer's EP layout (:class:`moeshard.models.ep.EPLayer`).
        rows: ``[R, H]`` the rows this rank received for its slots (their gradient is what the
            dispatch all-to-all's backward waits on).
        weights: local per-slot tensors of the experts module (``[S, ...]`` after ``views[i]``).
        views: the view of each weight (and of its gradient) that puts the slots first.

    In backward: point to point over the EP group, between the ranks holding copies of one
    redundant expert (module doc); every rank runs it in the same place of the layer's chain.
    A layer without redundant copies here, or with nothing requiring grad, is returned as is.
    """
    if not torch.is_grad_enabled() or not any(w.requires_grad for w in weights) or ep.copy_routes.empty:
        return rows, list(weights)
    pick = [i for i, w in enumerate(weights) if w.requires_grad]
    joined = _CombineCopies.apply(ep, tuple(views[i] for i in pick), rows, *(weights[i] for i in pick))
    out = list(weights)
    for i, w in zip(pick, joined[1:]):
        out[i] = w
    return joined[0], out


@torch.no_grad()
def copy_first_copies_(ep, tensors: Sequence[tuple[torch.Tensor, View]]) -> None:
    """Collective among the EP ranks holding copies of a redundant expert: write each redundant
    expert's first copy over its other copies, in every local tensor of ``tensors`` (``(local
    tensor, view putting its slots first)``; the same list, in the same order, on every rank
    of the EP group: parameters, then their optimizer state)."""
    if ep.copy_routes.empty or not tensors:
        return
    slotted = [view(t) for t, view in tensors]
    routes = ep.copy_routes.on(slotted[0].device)
    send = {peer: [v[f] for v in slotted] for peer, f in routes.from_copies.items()}
    recv = {peer: [v.new_empty((len(s), *v.shape[1:])) for v in slotted] for peer, s in routes.to_first.items()}
    _swap(ep, send, recv, "moeshard: copying redundant experts' first copies")
    if len(routes.local_copy):
        for v in slotted:
            v[routes.local_copy] = v[routes.local_first]
    for peer, rows in recv.items():
        for v, r in zip(slotted, rows):
            v[routes.to_first[peer]] = r


# Experts modules whose copies the optimizer hook keeps equal: (module, its tensors), in the
# order they were tracked (parallelize's, the same on every rank). Weak: a dropped model goes.
_TRACKED: list[tuple[weakref.ref, Callable]] = []
_HOOK: list = []
_LOCK = threading.Lock()


def track(module: torch.nn.Module, describe: Callable) -> None:
    """Keep the copies of ``module``'s redundant experts equal after every optimizer step that
    updates its expert parameters. ``describe(module) -> (ep, [(parameter, view), ...])``: its
    EP layout now and its per-slot parameters (``view`` puts a local tensor's slots first).
    Local; every rank tracks the same modules in the same order."""
    with _LOCK:
        if any(ref() is module for ref, _ in _TRACKED):
            return
        _TRACKED.append((weakref.ref(module), describe))
        if not _HOOK:
            _HOOK.append(register_optimizer_step_post_hook(_after_step))


def tracked_layers(
        params: Sequence[torch.Tensor] | None = None) -> list[tuple[object, list[tuple[torch.Tensor, View]]]]:
    """``[(ep, [(parameter, view), ...])]``: the tracked experts modules' layouts with redundant
    copies and their per-slot parameters (only those in ``params``, when given), in tracking
    order; a module with none of ``params`` is left out."""
    with _LOCK:
        alive = [(ref(), describe) for ref, describe in _TRACKED]
        _TRACKED[:] = [(ref, d) for (ref, d), (m, _) in zip(_TRACKED, alive) if m is not None]
    ids = None if params is None else {id(p) for p in params}
    out = []
    for module, describe in alive:
        if module is None:
            continue
        ep, pairs = describe(module)
        if ep is None or int(np.max(ep.logcnt, initial=0)) <= 1:
            continue
        pairs = [(p, v) for p, v in pairs if ids is None or id(p) in ids]
        if pairs:
            out.append((ep, pairs))
    return out


def sync_after_step(optimizer: torch.optim.Optimizer) -> int:
    """Copy every redundant expert's first copy (weights and ``optimizer``'s per-element state)
    over its other copies, for the tracked modules whose parameters ``optimizer`` holds.
    Collective over each such module's EP group (every rank steps the same optimizers).
    Returns the number of layers copied."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    layers = tracked_layers(params)
    for ep, pairs in layers:
        tensors = []
        for p, view in pairs:
            tensors.append((local_tensor(p), view))
            state = optimizer.state.get(p, {})
            for key in sorted(state, key=str):  # AdamW's exp_avg, exp_avg_sq: per element of p
                value = state[key]
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim():
                    tensors.append((local_tensor(value), view))
        copy_first_copies_(ep, tensors)
    return len(layers)


def _after_step(optimizer, args, kwargs) -> None:
    sync_after_step(optimizer)


