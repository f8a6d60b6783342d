"""The migration-aware policy (``migration_aware=True`` and a current placement).

The oblivious answer ignores where experts already are, so a rebalance after a small drift of
the load can move almost every copy. This policy reaches the oblivious policy's balance (per
layer, max/mean rank load within ``tolerance``, default 1 %) while moving few copies. Per layer:

* hierarchical: a group stays on the node that holds most of its copies unless that node
  would exceed the oblivious policy's heaviest node load (x (1 + tolerance)); each node's
  replica counts then follow ``replicate_experts`` on the node's experts (global: the
  oblivious policy's counts);
* *sticky packing* within each node, against the target ``T`` = the oblivious policy's max
  rank load x (1 + tolerance): keep each old copy on its live rank (up to the new replica
  count, one per rank); a rank whose kept load, plus the lightest copy of the layer for each
  of its free slots, exceeds ``T`` evicts copies (the lightest one that suffices, else its
  heaviest); the remaining copies go heaviest first to the least loaded rank with a free slot
  that does not hold the expert and stays under ``T``, else replace a lighter copy of a full
  rank (that copy goes back to the queue), else to the least loaded rank with a free slot;
  then a local search swaps copies between ranks over ``T`` and light ranks (fewest added
  moves first) (:mod:`moeshard.eplb.sticky`);
* candidates: the sticky result; where it misses ``T``, the reference's greedy with a
  preference for the expert's old ranks ("sticky LPT"), and (hierarchical) both of these
  under the oblivious node assignment; the oblivious packs matched to ranks by greedy maximum
  overlap (nodes first); the oblivious placement itself. Each layer takes the candidate with
  the fewest moved copies among those within the tolerance; the last two always are, so the
  balance is guaranteed and the aware policy never moves more copies than the oblivious one.

In every candidate an expert that stays on a rank keeps its slot index; newcomers fill the
freed slots in order.
"""

from __future__ import annotations

import numpy as np

from ..placement import Placement
from .inputs import _Shape
from .metrics import _count_last, _counts, _held, _max_rank_load, _moves3, _per_copy
from .oblivious import _group_loads, _Oblivious, _replicate_nodes, _scatter_packs
from .sticky import _EPS, _sticky, _sticky_lpt


def _arrange(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Order each rank's copies: an expert the rank held keeps its old slot index (first old
    slot holding it); newcomers fill the remaining slots in order. ``new``, ``old``:
    ``int[X, S]`` -> ``int[X, S]``."""
    x, s = new.shape
    out = np.full_like(new, -1)
    placed = np.zeros((x, s), dtype=bool)
    rows = np.arange(x)
    for j in range(s):
        e = old[:, j]
        m = (new == e[:, None]) & ~placed & (e >= 0)[:, None]
        has = m.any(1)
        i = m.argmax(1)
        out[has, j] = e[has]
        placed[rows[has], i[has]] = True
    todo = (new >= 0) & ~placed
    free_pos = np.argsort(out >= 0, axis=1, kind="stable")  # free slots first, in order
    item_pos = np.argsort(~todo, axis=1, kind="stable")  # unplaced copies first, in order
    take = np.arange(s)[None, :] < todo.sum(1, keepdims=True)
    r = np.broadcast_to(rows[:, None], (x, s))
    out[r[take], free_pos[take]] = new[r[take], item_pos[take]]
    return out


def _greedy_match(overlap: np.ndarray, col_ok: np.ndarray) -> np.ndarray:
    """Greedy maximum-overlap matching of J rows to J of K columns. ``overlap``
    ``float[B, J, K]``, ``col_ok`` ``bool[B, K]`` (exactly J true per row) -> ``int[B, J]``
    column of each row. Ties: lowest row, then lowest column."""
    num_b, num_j, num_k = overlap.shape
    m = np.where(col_ok[:, None, :], overlap.astype(np.float64), -np.inf).reshape(num_b, -1).copy()
    out = np.full((num_b, num_j), -1, dtype=np.int64)
    rows = np.arange(num_b)
    m3 = m.reshape(num_b, num_j, num_k)
    for _ in range(num_j):
        j, k = np.divmod(m.argmax(1), num_k)
        out[rows, j] = k
        m3[rows, j, :] = -np.inf
        m3[rows, :, k] = -np.inf
    return out


def _nodes_of_old(held_old: np.ndarray, gl: np.ndarray, sh: _Shape) -> np.ndarray:
    """``int[L, N, G/N]``: groups each node held (most of their experts' copies), at most
    G/N per node (those with most copies there), ``-1`` padding."""
    num_layers = held_old.shape[0]
    n, g = sh.num_nodes, sh.num_groups
    per_node = held_old.reshape(num_layers, n, sh.ranks_per_node, g, -1).any(2).sum(-1)  # [L, N, G]
    old_node = per_node.argmax(1)  # [L, G]
    presence = per_node.max(1)
    old_node = np.where(presence > 0, old_node, n)  # groups with no live copy: no node
    gid = np.broadcast_to(np.arange(g), old_node.shape)
    order = np.lexsort((gid, -presence, old_node), axis=-1)
    sorted_node = np.take_along_axis(old_node, order, axis=1)
    start = (sorted_node[:, None, :] < np.arange(n + 1)[None, :, None]).sum(-1)  # [L, N+1]
    out = np.full((num_layers, n, g // n), -1, dtype=np.int64)
    for node in range(n):
        for j in range(g // n):
            at = start[:, node] + j
            ok = at < start[:, node + 1]
            out[ok, node, j] = order[ok, at[ok]]
    return out


def _sticky_candidate(w, old3, group_node, thr, sh: _Shape, lpt: bool = False) -> np.ndarray:
    """Sticky packing of every node's replicas (``group_node`` ``int[L, G]`` fixed) onto the
    node's ranks. ``old3`` ``int[L, R, S]``; returns ``int[L, R, S]``."""
    num_layers, num_logical = w.shape
    n, rpn = sh.num_nodes, sh.ranks_per_node
    mlog2log, _, mcnt, cnt = _replicate_nodes(w, group_node, sh)
    wc = _per_copy(w, cnt)
    cnt_rows = np.zeros((num_layers * n, num_logical), dtype=np.int64)
    np.put_along_axis(cnt_rows, mlog2log, mcnt, axis=1)
    old_rows = old3.reshape(num_layers * n, rpn, -1)
    alive_rows = np.tile(sh.active.reshape(n, rpn), (num_layers, 1))
    new = (_sticky_lpt if lpt else _sticky)(old_rows, alive_rows, cnt_rows, np.repeat(wc, n, axis=0), np.repeat(thr, n))
    return new.reshape(num_layers, sh.num_ranks, -1)


def _matched_oblivious(obl: _Oblivious, held_old: np.ndarray, sh: _Shape) -> tuple[np.ndarray, np.ndarray]:
    """The oblivious packs, nodes then ranks matched to the old placement by overlap. Returns
    ``phy2log`` ``int[L, R, S]`` and the matched ``group_node`` ``int[L, G]``."""
    num_layers, num_ranks, num_logical = held_old.shape
    n, rpn = sh.num_nodes, sh.ranks_per_node
    li = np.arange(num_layers)[:, None]
    if n > 1:
        node_of_expert = np.repeat(obl.group_node, num_logical // sh.num_groups, axis=1)  # [L, E]
        pres_new = (node_of_expert[:, None, :] == np.arange(n)[None, :, None]).astype(np.float32)
        pres_old = held_old.reshape(num_layers, n, rpn, -1).any(2).astype(np.float32)
        node_perm = _greedy_match(pres_new @ pres_old.transpose(0, 2, 1), np.ones((num_layers, n), dtype=bool))
    else:
        node_perm = np.zeros((num_layers, 1), dtype=np.int64)
    # Pack j of obl node a is placed on physical node node_perm[l, a].
    live = sh.live_per_node
    packs = np.empty_like(obl.packs)
    packs[li, node_perm] = obl.packs
    cnt_new = _count_last(packs, num_logical).astype(np.float32)
    old_nodes = held_old.reshape(num_layers, n, rpn, -1).astype(np.float32)
    overlap = cnt_new[..., :num_logical] @ old_nodes.transpose(0, 1, 3, 2)  # [L, N, live, rpn]
    col_ok = np.broadcast_to(sh.active.reshape(1, n, rpn), (num_layers, n, rpn)).reshape(-1, rpn)
    rank_of_pack = _greedy_match(overlap.reshape(num_layers * n, live, rpn), col_ok).reshape(num_layers, n, live)
    group_node = np.take_along_axis(node_perm, obl.group_node, axis=1)
    return _scatter_packs(packs, sh, rank_of_pack), group_node


def _aware(w: np.ndarray, placement: Placement, obl: _Oblivious, sh: _Shape, tol: float) -> np.ndarray:
    """The migration-aware policy (module docstring); returns ``int[L, R, S]``."""
    num_layers, num_logical = w.shape
    s = sh.slots_per_rank
    old3 = np.where(sh.active[None, :, None], placement.phy2log.reshape(num_layers, sh.num_ranks, s), -1)
    held_old = _held(old3, num_logical)
    limit = obl.max_load * (1 + tol)
    best = obl.phy2log.copy()  # always within the tolerance: the baseline to beat
    best_moves = _moves3(held_old, best)

    def consider(cand: np.ndarray, layers: np.ndarray) -> None:
        ok = _max_rank_load(w[layers], cand, _counts(cand, num_logical)) <= limit[layers] * (1 + _EPS)
        mv = _moves3(held_old[layers], cand)
        better = ok & (mv < best_moves[layers])
        best[layers[better]] = cand[better]
        best_moves[layers[better]] = mv[better]

    everywhere = np.arange(num_layers)
    matched, matched_gn = _matched_oblivious(obl, held_old, sh)
    consider(matched, everywhere)
    group_node = obl.group_node
    if sh.hierarchical:
        # Groups stay on their node unless it would exceed the oblivious heaviest node.
        gl = _group_loads(w, sh)
        n = sh.num_nodes
        g_slots = _sticky(_nodes_of_old(held_old, gl, sh), np.ones((num_layers, n), dtype=bool),
                          np.ones_like(gl, dtype=np.int64), gl, obl.node_max * (1 + tol))
        group_node = np.zeros_like(obl.group_node)
        np.put_along_axis(group_node, g_slots.reshape(num_layers, -1),
                          np.repeat(np.arange(n), sh.num_groups // n)[None, :], axis=1)
    sticky = _sticky_candidate(w, old3, group_node, limit, sh)
    consider(sticky, everywhere)
    # Where sticky packing missed the balance: the other candidates, on those layers only.
    miss = np.nonzero(_max_rank_load(w, sticky, _counts(sticky, num_logical)) > limit * (1 + _EPS))[0]
    tries = [(group_node, True)]
    if sh.hierarchical:
        tries += [(matched_gn, False), (matched_gn, True)]
    for gn, lpt in tries:
        if not len(miss):
            break
        cand = _sticky_candidate(w[miss], old3[miss], gn[miss], limit[miss], sh, lpt=lpt)
        consider(cand, miss)
        miss = miss[_max_rank_load(w[miss], cand, _counts(cand, num_logical)) > limit[miss] * (1 + _EPS)]
    return _arrange(best.reshape(-1, s), old3.reshape(-1, s)).reshape(best.shape)
