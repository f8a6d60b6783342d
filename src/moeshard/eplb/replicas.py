"""Replica budgets per layer: with a total number of expert copies for all layers, skewed layers
get more copies and balanced layers fewer (memory for redundant experts is best spent where a
layer's load is skewed); the slots a layer does not use stay empty (``-1``).

:func:`split_budget` gives each copy beyond one per expert to the (layer, expert) whose copy
carries the most load over the layer's mean rank load (min-max-replica across layers, each
layer's load normalized by its mean so that layers of any volume compare), within the slots
of its bin (global: the layer's live slots; hierarchical: those of its group's node).
:func:`budget_policy` places each bin's copies with the oblivious policy (global: any expert
on any live rank of the bin), the unused slots as zero-load placeholder experts that are
emptied afterwards (so the packing sees every slot). Hierarchical (:func:`hierarchical_policy`):
expert groups onto nodes as the reference does (``balanced_packing`` of the group loads, the
same number of groups per node), then each (layer, node) is a bin placed on the node's live
ranks."""

from __future__ import annotations

import numpy as np

from .inputs import Shape, check_shape
from .joint import joint_improve
from .metrics import copy_counts, max_rank_load
from .oblivious import groups_to_nodes, oblivious_policy, reference_answer


def split_budget(w: np.ndarray, total: int, cap: np.ndarray, num_ranks: int, bin_of: np.ndarray | None = None):
    """``int[B]`` copies per bin of ``w`` ``float[L, E]``: every expert one copy at least, bin
    ``b`` at most ``cap[b]``, ``total`` in all (module docstring). ``bin_of`` ``int[L, E]``:
    each expert's bin (default: its layer, ``B = L``)."""
    num_layers, num_e = w.shape
    if bin_of is None:
        bin_of = np.repeat(np.arange(num_layers), num_e).reshape(num_layers, num_e)
    num_bins = len(cap)
    cnt = np.ones((num_layers, num_e), dtype=np.int64)
    mean = np.maximum(w.sum(1) / num_ranks, 1e-300)
    per_copy = w / mean[:, None]
    per = np.bincount(bin_of.ravel(), minlength=num_bins).astype(np.int64)
    head = per_copy.copy()
    head[per[bin_of] >= cap[bin_of]] = -np.inf
    for _ in range(total - num_layers * num_e):
        layer, e = divmod(int(head.argmax()), num_e)
        b = bin_of[layer, e]
        cnt[layer, e] += 1
        per[b] += 1
        head[layer, e] = per_copy[layer, e] / cnt[layer, e]
        if per[b] >= cap[b]:
            head[bin_of == b] = -np.inf
    return per


def budget_policy(w: np.ndarray, sh: Shape, per: np.ndarray, num_nodes: int, active: np.ndarray) -> np.ndarray:
    """``int[L, R, S]``: per layer, ``per[l]`` copies placed by the oblivious policy (global:
    placeholders have no group), the live slots beyond them empty."""
    num_layers, num_e = w.shape
    live_slots = int(active.sum()) * sh.slots_per_rank
    out = np.full((num_layers, sh.num_ranks, sh.slots_per_rank), -1, dtype=np.int64)
    for d in np.unique(live_slots - per):
        layers = np.flatnonzero(live_slots - per == d)
        wa = np.concatenate([w[layers], np.zeros((len(layers), int(d)))], axis=1)
        sub = check_shape(wa, sh.num_physical, sh.num_ranks, num_nodes, None, active)
        ref = reference_answer(wa, sub)
        obl = oblivious_policy(wa, sub, ref)
        best = joint_improve(wa, sub, obl)
        # a placeholder holds one slot: where the search gave one more, the plain answer
        extra = (copy_counts(best.phy2log, wa.shape[1])[:, num_e:] > 1).any(1)
        p2l = np.where(extra[:, None, None], obl.phy2log, best.phy2log)
        assert (copy_counts(p2l, wa.shape[1])[:, num_e:] == 1).all()
        out[layers] = np.where(p2l >= num_e, -1, p2l)
    return out


def hierarchical_policy(w: np.ndarray, sh: Shape, total: int, per: np.ndarray | None = None) -> np.ndarray:
    """``int[L, R, S]``: ``total`` copies, groups onto nodes, each (layer, node)'s share of the
    copies (``per`` ``int[L * N]``, default :func:`split_budget`'s) placed on the node's live
    ranks (module docstring)."""
    num_layers, num_e = w.shape
    n, live, s = sh.num_nodes, sh.live_per_node, sh.slots_per_rank
    gsize = num_e // sh.num_groups
    group_node = groups_to_nodes(w, sh)
    node_of = np.repeat(group_node, gsize, axis=1)  # [L, E]
    bins = np.arange(num_layers)[:, None] * n + node_of
    if per is None:
        per = split_budget(w, total, np.full(num_layers * n, live * s), int(sh.active.sum()), bins)
    # each bin's experts, in expert order: E / N of them
    experts = np.argsort(bins, axis=1, kind="stable").reshape(num_layers, n, num_e // n)
    wb = np.take_along_axis(w, experts.reshape(num_layers, -1), axis=1).reshape(num_layers * n, -1)
    sub = check_shape(wb, live * s, live, 1, None, None)
    local = budget_policy(wb, sub, per, 1, np.ones(live, dtype=bool)).reshape(num_layers, n, live, s)
    glob = np.where(
        local >= 0,
        np.take_along_axis(experts, np.maximum(local, 0).reshape(num_layers, n, -1), axis=2).reshape(local.shape),
        -1,
    )
    out = np.full((num_layers, n, sh.ranks_per_node, s), -1, dtype=np.int64)
    out[:, np.arange(n)[:, None], sh.node_alive] = glob
    return out.reshape(num_layers, sh.num_ranks, s)


def _place(w: np.ndarray, sh: Shape, per_bin: np.ndarray | None, total: int, num_nodes: int) -> np.ndarray:
    if sh.hierarchical:
        return hierarchical_policy(w, sh, total, per_bin)
    return budget_policy(w, sh, per_bin, num_nodes, sh.active)


def even_bins(w: np.ndarray, sh: Shape, total: int) -> np.ndarray:
    """Copies per bin when every layer gets the same share of ``total`` (the first layers one
    more where it does not divide), split within each layer as :func:`split_budget` does."""
    num_layers, num_e = w.shape
    share = total // num_layers + (np.arange(num_layers) < total % num_layers)
    if not sh.hierarchical:
        return share.astype(np.int64)
    n, cap = sh.num_nodes, sh.live_per_node * sh.slots_per_rank
    node_of = np.repeat(groups_to_nodes(w, sh), num_e // sh.num_groups, axis=1)
    live = int(sh.active.sum())
    return np.concatenate(
        [
            split_budget(w[k : k + 1], int(share[k]), np.full(n, cap), live, node_of[k : k + 1])
            for k in range(num_layers)
        ]
    )


def replica_policy(w: np.ndarray, sh: Shape, total: int, num_nodes: int) -> np.ndarray:
    """``int[L, R, S]``: ``total`` copies split by :func:`split_budget`, or spread evenly over
    the layers where that is lighter in the worst layer (max / mean rank load; a copy more
    can pack a hair worse), so that the worst layer is never less balanced than with an even
    spread."""
    live_slots = int(sh.active.sum()) * sh.slots_per_rank
    if sh.hierarchical:
        skewed = _place(w, sh, None, total, num_nodes)
    else:
        per = split_budget(w, total, np.full(w.shape[0], live_slots), int(sh.active.sum()))
        skewed = _place(w, sh, per, total, num_nodes)
    even = _place(w, sh, even_bins(w, sh, total), total, num_nodes)
    mean = np.maximum(w.sum(1) / int(sh.active.sum()), 1e-300)

    def worst(p2l):
        return float((max_rank_load(w, p2l, np.maximum(copy_counts(p2l, w.shape[1]), 1)) / mean).max())

    return even if worst(even) < worst(skewed) * (1 - 1e-12) else skewed
