"""The migration-aware policy (``migration_aware=True`` and a current placement).

The oblivious answer ignores where experts already are, so a rebalance after a small drift of
the load can move almost every copy. This policy moves few copies while, per layer, its
max/mean rank load is at most ``(1 + tolerance)`` x the reference's (deepseek-ai/EPLB);
``tolerance`` defaults to 0: never less balanced than the reference. Target ``T`` = that max
rank load. (moeshard's oblivious answer is never less balanced than the reference's and often
more; holding each step to it instead would move 2-3.5x as many copies: on DeepSeek-V3's
shape, 15 % / 55 % of the reference's moves instead of 6 % / 16 %, hierarchical / global,
``benchmarks/bench_eplb.py`` on 2026-11-26.)
Per layer:

* the old placement itself, where it is still valid and within ``T`` (nothing moves);
* hierarchical: a group stays on the node that holds most of its copies unless that node's
  load would exceed ``0.95 x T x live ranks`` (and the reference's heaviest node); where
  the packing below misses ``T``, again with the reference's heaviest node as the cap; on
  layers where groups move or the packing misses ``T``, also the assignments of groups to
  nodes that move fewest copies (a moved group moves all its copies) with every node's load
  at most ``f x T x live ranks``, ``f`` in 0.96, 0.97, ... 1.0 (every assignment looked at
  where there are at most a few thousand; else groups kept wherever their node fits under
  ``T``), and the oblivious answer's groups with its nodes matched to the old ones (its
  packing of a node is the fallback below, so nodes that keep their groups need not take it);
* node by node, *sticky packing* (:mod:`moeshard.eplb.sticky`) against ``T``: a node that
  holds exactly its experts and is within ``T`` stays as it is; else keep each old copy on
  its live rank (up to the new replica count), evict from ranks over ``T`` (the lightest
  copy that suffices, else the heaviest), place the rest heaviest first on the least loaded
  rank with room under ``T`` (a copy beyond a rank's old ones first as a second copy on a
  rank that held the expert: nothing travels), then swap copies between ranks over ``T`` and
  light ranks.
  Replica counts: the node's old counts (light nodes: nothing moves), and on nodes loaded
  over half of ``T x live ranks`` also ``replicate_experts``' counts and, where the old counts
  leave a copy much heavier than ``replicate_experts``' heaviest (a drifted hot expert), the
  old counts with fewest changes that bring it down (:func:`capped_counts`), on any node
  where the old counts leave a copy over ``T`` those with every copy brought under ``0.8 x T``
  (the hot expert gets about the copies it needs), and the
  oblivious answer's own counts where they fill the node's slots (spread and hot-spread
  counts: a ``T`` relative to the oblivious answer may be below what ``replicate_experts``'
  counts allow), and on nodes loaded over ``_HOT_FILL`` of ``T x live ranks`` lean counts
  (:func:`lean_counts`: each expert the fewest copies that fit beside the lightest ones, the
  slots left as second copies of the lightest experts) and the old counts
  with one of the heaviest experts one copy fewer (the slot to a second copy of the
  lightest expert, packed onto a rank that holds it) or one more (:func:`hot_counts`:
  near the limit the packing's granularity decides); a packing over ``T`` is first refined by the swap search
  (:func:`moeshard.eplb.refine.lower_peak`) and copies are swapped back to ranks that held
  them (:func:`restore`); the node takes the one within ``T`` that moves fewest copies;
* a node where sticky packing misses ``T``: the oblivious answer's packing of the node's
  copies where it has the same groups (the global policy: always), else the more balanced
  refined packing of the groups with, per node, the reference's, spread or hot-spread
  replica counts (:func:`moeshard.eplb.oblivious.group_packs`), matched to the old ranks, then a local
  search that swaps copies back to ranks that held them while both ranks stay within ``T``
  (:func:`restore`);
* each layer takes, among the candidates within ``T`` (checked up to the few ulps by which
  sums of the same copies in another order differ), the one with the fewest moved copies;
  the oblivious answer and the reference's, as they are or matched to the old ranks, always
  are candidates (the balance is guaranteed). A rank may hold two copies of an expert where
  the reference would. A group assignment (or its fallback packing) is not packed where its
  fewest possible moves (:func:`_fewest_moves`) already cannot beat a candidate within ``T``.

* on the chosen answer's nodes that move copies, copies are swapped back to ranks that held
  them while both ranks stay within ``T`` (:func:`restore`; the candidates' own searches
  stop at ``T``, not at fewest moves), taken where it moves fewer copies within ``T``;
* last, moved copies replaced by copies of experts their rank held, while every rank stays
  within ``T`` (:func:`moeshard.eplb.fill.fill_held`: nothing travels for such a copy), then
  moved copies shifted to ranks of their node that held them, those dropping a copy of an
  expert with two or more and the freed slot taking a copy of an expert its rank held
  (:func:`moeshard.eplb.shift.shift_held`).

In every candidate an expert that stays on a rank keeps its slot index; newcomers fill the
freed slots in order.

With the tolerance on the step (:func:`step_policy`, ``tolerance_scope="step"``), each layer
is solved as above under several limits and one per layer is picked so that the mean
balance over layers stays within the tolerance while few copies move in all
(:func:`cheapest_within_mean`).
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from ..placement import Placement
from . import jit
from .fill import fill_held
from .inputs import Shape
from .metrics import (
    as_float,
    copy_counts,
    first_min_per_key,
    held_by_rank,
    load_per_copy,
    max_over_mean,
    max_rank_load,
    moved_per_rank,
    moves3,
    rank_loads3,
    slot_sums,
)
from .oblivious import (
    ObliviousAnswer,
    group_loads,
    group_packs,
    node_loads,
    node_packs,
    per_rank_cap,
    replicate_nodes,
    scatter_packs,
)
from .refine import lower_peak
from .shift import shift_held
from .sticky import EPS, restore, sticky_pack


def _arrange(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Order each rank's copies: an expert the rank held keeps its old slot index (first old
    slot holding it); newcomers fill the remaining slots in order. ``new``, ``old``:
    ``int[X, S]`` -> ``int[X, S]``."""
    x, s = new.shape
    compiled = jit.kernel("aware_kernel", new.size, _JIT_FROM)
    if compiled is not None:
        out = np.empty((x, s), dtype=np.int64)
        compiled.arrange(np.ascontiguousarray(new, dtype=np.int64), np.ascontiguousarray(old, dtype=np.int64), out)
        return out.astype(new.dtype, copy=False)
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


def _nodes_of_old(held_old: np.ndarray, gl: np.ndarray, sh: Shape) -> np.ndarray:
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


def _old_counts(w: np.ndarray, old3: np.ndarray, group_node: np.ndarray, sh: Shape, repl_cnt: np.ndarray) -> np.ndarray:
    """``int[L*N, E]`` replica counts per node (row ``l * N + k``) that stay as close to the old
    placement's as the slots allow: each expert of the node keeps its old copies on the node's
    live ranks (at least one); missing slots go, one by one, to the expert of the highest load
    per copy (as ``replicate_experts`` does), surplus copies leave the expert whose per-copy
    load stays lowest. On a node far under the limit any counts do, and these move nothing."""
    num_layers, num_logical = w.shape
    n = sh.num_nodes
    oc = copy_counts(old3.reshape(num_layers * n, -1), num_logical).reshape(num_layers, n, -1)  # [L, N, E]
    node_of = np.repeat(group_node, num_logical // sh.num_groups, axis=1)  # [L, E]
    mine = (node_of[:, None, :] == np.arange(n)[None, :, None]).reshape(num_layers * n, -1)
    cnt = np.where(mine, np.maximum(oc.reshape(num_layers * n, -1), 1), 0)
    wr = np.repeat(w, n, axis=0)
    diff = sh.live_per_node * sh.slots_per_rank - cnt.sum(1)
    # A node whose groups changed much gets replicate_experts' counts (its copies move
    # anyway), which bounds the rounds below.
    far = np.abs(diff) > _MAX_COUNT_CHANGES
    cnt[far] = repl_cnt[far]
    diff[far] = 0
    rows = np.flatnonzero(diff != 0)  # few rows: work on those only
    c, m, wrr, d = cnt[rows], mine[rows], wr[rows], diff[rows]
    ar = np.arange(len(rows))
    compiled = jit.kernel("aware_kernel", cnt.size, _JIT_FROM) if wrr.dtype == np.float64 else None
    if compiled is not None:
        c = np.ascontiguousarray(c, dtype=np.int64)
        compiled.count_steps(c, np.ascontiguousarray(m), np.ascontiguousarray(wrr), d.astype(np.int64))
        d = np.zeros_like(d)  # done
    while (d != 0).any():
        add, rem = d > 0, d < 0
        j = np.where(m, wrr / as_float(np.maximum(c, 1)), -np.inf).argmax(1)
        c[ar[add], j[add]] += 1
        j = np.where(m & (c > 1), wrr / as_float(np.maximum(c - 1, 1)), np.inf).argmin(1)
        c[ar[rem], j[rem]] -= 1
        d = d - add + rem
    cnt[rows] = c
    return cnt


def capped_counts(wr: np.ndarray, cnt: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """``int[B, E]``: the counts ``cnt`` (a node's rows; experts with count 0 are not the
    node's) with fewest copies changed so that no per-copy load of ``wr`` ``float[B, E]``
    exceeds ``cap`` ``float[B]``: while one does, the expert of the highest per-copy load takes
    a copy from the expert whose per-copy load stays lowest without it (each such change is
    one moved copy, where ``replicate_experts``' counts after a drift change many). A ``cap``
    at least ``replicate_experts``' highest per-copy load is always reached (the exchange
    gives the smallest possible maximum)."""
    c = cnt.copy()
    mine = c > 0
    lim = cap * (1 + EPS)
    rows = np.arange(len(c))
    rounds = int(c.sum(1).max(initial=0))
    compiled = jit.kernel("aware_kernel", c.size, _JIT_FROM) if wr.dtype == lim.dtype == np.float64 else None
    if compiled is not None and c.dtype == np.int64:
        compiled.cap_steps(c, mine, np.ascontiguousarray(wr), np.ascontiguousarray(lim), rounds)
        return c
    for _ in range(rounds):
        pc = np.where(mine, wr / as_float(np.maximum(c, 1)), -np.inf)
        hi = pc.argmax(1)
        r = np.flatnonzero(pc[rows, hi] > lim)
        if not len(r):
            break
        lo = np.where(mine[r] & (c[r] > 1), wr[r] / as_float(np.maximum(c[r] - 1, 1)), np.inf).argmin(1)
        c[r, hi[r]] += 1
        c[r, lo] -= 1
    return c


def lean_counts(
    wr: np.ndarray, cnt: np.ndarray, thr: np.ndarray, slots_per_rank: int, total: int
) -> tuple[np.ndarray, np.ndarray]:
    """Lean counts for nodes near what their ranks carry at the limit: ``cnt`` ``int[B, E]``
    a node's counts (experts with count 0 are not the node's), ``wr`` ``float[B, E]`` loads,
    ``thr`` ``float[B]`` the limit, ``total`` the node's live slots. Each of the node's experts
    gets the fewest copies (at least one) whose per-copy load fits on a rank beside the
    node's ``slots_per_rank - 1`` lightest experts under ``thr``; the slots left go one each
    to the lightest experts (second copies, which the packing puts on the ranks that hold
    them: nothing travels). Old counts keep copies in place but may leave a hot expert's
    copies too heavy to pack or take slots from ranks a hot expert needs; these give the
    hot experts just what they need and free the rest. Returns ``int[B, E]`` and ``bool[B]``
    the rows where the fewest copies fit in ``total`` (elsewhere the counts are ``cnt``)."""
    mine = cnt > 0
    num_e = cnt.shape[1]
    by_load = np.argsort(np.where(mine, wr, np.inf), axis=1, kind="stable")  # lightest first
    nmine = mine.sum(1)
    lightest = np.take_along_axis(wr, by_load[:, : slots_per_rank - 1], axis=1)
    lightest = np.where(np.arange(lightest.shape[1]) < nmine[:, None], lightest, 0.0)
    room = thr - lightest.sum(1)
    ok = room > 0
    fewest = np.ceil(wr / np.where(ok, room, 1.0)[:, None] * (1 - 1e-12))
    c = np.where(mine, np.maximum(fewest, 1.0), 0.0).astype(np.int64)
    left = total - c.sum(1)
    ok &= left >= 0
    left = np.where(ok, left, 0)[:, None]
    pos = np.empty_like(by_load)  # each expert's place, lightest first
    np.put_along_axis(pos, by_load, np.broadcast_to(np.arange(num_e), by_load.shape), axis=1)
    per = np.maximum(nmine, 1)[:, None]
    c += np.where(mine, left // per + (pos < left % per), 0)
    return np.where(ok[:, None], c, cnt), ok


def hot_counts(wr: np.ndarray, cnt: np.ndarray, thr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Count variants for nodes near what their ranks carry at the limit, where the packing's
    granularity decides: ``cnt`` ``int[B, E]`` a node's counts (experts with count 0 are not
    the node's), ``wr`` ``float[B, E]`` loads, ``thr`` ``float[B]`` the limit. Each of the
    node's ``_HOT_EXPERTS`` heaviest experts with ``d`` in ``_HOT_STEPS`` copies more or fewer
    (no copy of the node over ``thr``): the slots one fewer frees go one each to the node's lightest
    experts (second copies, which the packing puts on the ranks that hold them: nothing
    travels), the slot one more takes from the expert whose per-copy load stays lowest.
    Returns ``int[V]`` (the row of each variant) and ``int[V, E]`` its counts, each variant
    once, none equal to ``cnt``."""
    num_b = len(cnt)
    compiled = jit.kernel("aware_kernel", cnt.size, _JIT_FROM) if wr.dtype == thr.dtype == np.float64 else None
    if compiled is not None:
        steps = np.array(_HOT_STEPS, dtype=np.int64)
        args = (np.ascontiguousarray(wr), np.ascontiguousarray(cnt, dtype=np.int64), np.ascontiguousarray(thr))
        vr, vi, vc = compiled.hot_counts(*args, _HOT_EXPERTS, steps, EPS)
        # in the order made: by (expert, step), then by row
        order = np.argsort(vi * max(num_b, 1) + vr, kind="stable")
        return vr[order], vc[order].astype(cnt.dtype, copy=False)
    rows = np.arange(num_b)
    mine = cnt > 0
    by_load = np.argsort(np.where(mine, -wr, np.inf), axis=1, kind="stable")  # heaviest first
    light = np.argsort(np.where(mine, wr, np.inf), axis=1, kind="stable")  # lightest first
    out_r, out_c = [np.zeros(0, dtype=np.int64)], [cnt[:0]]
    for j in range(min(_HOT_EXPERTS, cnt.shape[1])):
        hot = by_load[:, j]
        ok0 = mine[rows, hot]
        least = np.maximum(1, np.ceil(wr[rows, hot] / np.maximum(thr, 1e-300) * (1 - 1e-12))).astype(np.int64)
        for d in _HOT_STEPS:
            c = cnt.copy()
            c[rows, hot] += d
            ok = ok0 & (c[rows, hot] >= least)
            if d < 0:
                for i in range(-d):
                    c[rows, light[:, i]] += 1
            for _ in range(max(d, 0)):
                others = mine & (c > 1)
                others[rows, hot] = False
                lo = np.where(others, wr / as_float(np.maximum(c - 1, 1)), np.inf).argmin(1)
                ok &= others[rows, lo]
                c[rows, lo] -= others[rows, lo]
            per_copy = np.where(mine, wr / as_float(np.maximum(c, 1)), 0.0)
            ok &= (c != cnt).any(1) & (per_copy <= thr[:, None] * (1 + EPS)).all(1)
            out_r.append(rows[ok])
            out_c.append(c[ok])
    # each variant once (the first, in the order made)
    vr, vc = np.concatenate(out_r), np.concatenate(out_c)
    # a variant's key: its row and a hash of its counts (a collision only drops a variant)
    key = vr * 1_000_003 + (vc * np.arange(1, 2 * vc.shape[1], 2)).sum(1) % 1_000_003
    first = np.sort(np.unique(key, return_index=True)[1])
    return vr[first], vc[first]


def _node_counts(w, old3, group_node, sh: Shape) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Replica counts per node row (``l * N + k``) ``int[L*N, E]`` and the per-copy loads
    ``float[L*N, E]`` they give: :func:`_old_counts`, and ``replicate_experts`` per node."""
    num_layers, num_logical = w.shape
    n = sh.num_nodes
    mlog2log, _, mcnt, _ = replicate_nodes(w, group_node, sh)
    cnt_r = np.zeros((num_layers * n, num_logical), dtype=np.int64)
    np.put_along_axis(cnt_r, mlog2log, mcnt, axis=1)
    cnt_k = _old_counts(w, old3, group_node, sh, cnt_r)
    per_copy = lambda c: np.repeat(load_per_copy(w, c.reshape(num_layers, n, -1).sum(1)), n, axis=0)  # noqa: E731
    return (cnt_k, per_copy(cnt_k)), (cnt_r, per_copy(cnt_r))


def _node_match(group_node: np.ndarray, held_old: np.ndarray, sh: Shape) -> np.ndarray:
    """``int[L, N]``: node ``a`` of the group assignment ``group_node`` ``int[L, G]`` goes onto
    physical node ``out[l, a]``, matched to the old placement by overlap (greedy)."""
    num_layers, _, num_logical = held_old.shape
    n = sh.num_nodes
    if n == 1:
        return np.zeros((num_layers, 1), dtype=np.int64)
    node_of_expert = np.repeat(group_node, num_logical // sh.num_groups, axis=1)  # [L, E]
    pres_new = (node_of_expert[:, None, :] == np.arange(n)[None, :, None]).astype(np.float32)
    pres_old = held_old.reshape(num_layers, n, sh.ranks_per_node, -1).any(2).astype(np.float32)
    return _greedy_match(pres_new @ pres_old.transpose(0, 2, 1), np.ones((num_layers, n), dtype=bool))


def _matched_oblivious(
    obl: ObliviousAnswer, held_old: np.ndarray, sh: Shape, node_perm: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The oblivious packs, nodes then ranks matched to the old placement by overlap (or node
    ``a`` of ``obl`` onto node ``node_perm[l, a]``, ``int[L, N]``, when given). Returns
    ``phy2log`` ``int[L, R, S]`` and the matched ``group_node`` ``int[L, G]``."""
    num_layers, num_ranks, num_logical = held_old.shape
    n, rpn = sh.num_nodes, sh.ranks_per_node
    li = np.arange(num_layers)[:, None]
    if node_perm is None:
        node_perm = _node_match(obl.group_node, held_old, sh)
    # Pack j of obl node a is placed on physical node node_perm[l, a].
    live = sh.live_per_node
    packs = np.empty_like(obl.packs)
    packs[li, node_perm] = obl.packs
    # overlap[l, k, j, r]: copies of pack j that rank r of node k held (each copy counts)
    old_nodes = held_old.reshape(num_layers, n, rpn, -1).transpose(0, 1, 3, 2)  # [L, N, E, rpn]
    held = old_nodes[li[:, :, None, None], np.arange(n)[None, :, None, None], np.maximum(packs, 0)]
    overlap = (held & (packs >= 0)[..., None]).sum(3)  # [L, N, live, rpn]
    col_ok = np.broadcast_to(sh.active.reshape(1, n, rpn), (num_layers, n, rpn)).reshape(-1, rpn)
    rank_of_pack = _greedy_match(overlap.reshape(num_layers * n, live, rpn), col_ok).reshape(num_layers, n, live)
    group_node = np.take_along_axis(node_perm, obl.group_node, axis=1)
    return scatter_packs(packs, sh, rank_of_pack), group_node


# Calls of at least this many items (slots, or layers x group assignments) run their loops
# compiled where numba is installed (``aware_kernel``, :mod:`moeshard.eplb.jit`).
_JIT_FROM = 4096
# Relative slack of the checks that a candidate is within the limit: only what two sums of the
# same copies in another order may differ by (a few ulps), so that the answer is never less
# balanced than the reference beyond that (the sticky packing's thresholds use a looser one).
_SLACK = 1e-13
# Nodes loaded over this fraction of what their ranks may carry under the limit (live ranks x
# limit) also try replicate_experts' counts; lighter nodes keep their old counts (they fit).
_LOOSE = 0.5
# Groups may stay on a node while its load is at most this fraction of its ranks' capacity
# under the limit (live ranks x limit): room for the packing.
_NODE_FILL = 0.95
# At most this many copies added to or taken from a node's old counts (else replicate_experts').
_MAX_COUNT_CHANGES = 8
# Nodes whose old counts leave a copy heavier than this many times replicate_experts' heaviest
# copy also try the old counts capped there (capped_counts): after a drift a hot expert may
# have too few copies for the old counts to fit, while replicate_experts' counts change many
# cold experts' counts too. 1.3 moved fewest copies on the global DeepSeek-V3 trace (1.0:
# +30 %, 2.0: +17 %).
_CAP_OVER_REPLICATE = 1.3
# Count variants of nodes loaded over _HOT_FILL of what their ranks carry at the limit
# (hot_counts): each of the node's _HOT_EXPERTS heaviest experts with _HOT_STEPS copies more
# or fewer. On the DeepSeek-V3 drifting trace (benchmarks/bench_eplb_optimum.py, 7,571 copies
# without them) these moved 7,024; 3 experts 7,260, 6 experts 6,993 (more rows, more CPU);
# steps (-1, 1) 7,182, (-3, -2, -1, 1) 7,023; fill 0.9 7,041; the freed slots to the heaviest
# per copy as well as to the lightest experts about the same, at twice the rows. With the
# lean counts (lean_counts, on the same nodes) the step -2 saves 10 copies over four seeds
# (28,500 against 28,510) for a ninth of the variants' rows: left out.
_HOT_STEPS = (-1, 1)
_HOT_EXPERTS = 4
_HOT_FILL = 0.8
# Nodes loaded over _HOT_FILL also try lean counts (lean_counts). On the DeepSeek-V3 drifting
# trace (benchmarks/bench_eplb_optimum.py, four seeds) 28,510 copies against 29,003 without;
# on nodes over half of what their ranks carry 28,496 (more rows); the room for the copy at 0.95
# or 1.02 of what the lightest experts leave: 28,638 and 28,540; the slots left to the experts
# whose old counts were higher (their copies stay) instead of the lightest: 28,919.
_LEAN = True
# Sticky packing of every candidate puts a copy beyond a rank's old ones first on a rank that
# held the expert, as a second copy (nothing travels); False: only the count variants' (on the
# DeepSeek-V3 drifting trace of benchmarks/bench_eplb_optimum.py 22 copies more over the 5
# steps, 25 with seed 1).
_DUP_HELD = True
# Where the old counts leave a copy over the limit, also the old counts capped at this fraction
# of the limit (None: not). On the DeepSeek-V3 drifting traces of benchmarks/bench_eplb_optimum
# (seeds 0-3, 5 steps each) 0.8 moved 28,925 copies, 1.0 29,019, 0.9 28,955, 0.7 28,942, none
# 29,043.
_CAP_OF_LIMIT = 0.8
# Group assignments enumerated at most (8 groups on 4 nodes: 2,520).
_MAX_ASSIGNMENTS = 5000
# Node fills (of live ranks x limit) under which the cheapest group assignments are tried.
_FILLS = (0.96, 0.97, 0.98, 0.99, 1.0)


def _restored(
    w: np.ndarray, cand: np.ndarray, old3: np.ndarray, thr: np.ndarray, sh: Shape, nodes: np.ndarray
) -> np.ndarray:
    """``cand`` ``int[L, R, S]`` (within ``thr`` ``float[L]``) after :func:`restore` in the
    nodes ``bool[L, N]``: swaps that bring copies back to their old ranks."""
    num_layers, num_logical = w.shape
    n, rpn = sh.num_nodes, sh.ranks_per_node
    cnt = copy_counts(cand, num_logical)
    out = cand.reshape(num_layers * n, rpn, -1).copy()
    r = np.flatnonzero(nodes)
    rows = out[r]
    alive_rows = np.tile(sh.active.reshape(n, rpn), (num_layers, 1))[r]
    cnt_rows = np.repeat(cnt, n, axis=0)[r]
    cap = per_rank_cap(cnt_rows, np.full(len(r), sh.live_per_node))
    restore(
        rows,
        old3.reshape(num_layers * n, rpn, -1)[r],
        alive_rows,
        np.repeat(load_per_copy(w, cnt), n, axis=0)[r],
        cap,
        np.repeat(thr, n)[r],
    )
    out[r] = rows
    return out.reshape(cand.shape)


def _node_stats(
    w: np.ndarray, cand: np.ndarray, held_old: np.ndarray, sh: Shape, layers: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per layer and node of ``cand`` ``int[L, R, S]``: heaviest rank ``float[L, N]`` and moved
    copies ``int[L, N]`` (against ``held_old`` ``bool[L, R, E]``). With ``layers`` ``int[K]``,
    ``cand`` is ``int[K, R, S]``, row ``k`` a placement of layer ``layers[k]``."""
    num_layers, num_ranks, _ = cand.shape
    if layers is None:
        layers = np.arange(num_layers)
    loads = rank_loads3(w[layers], cand, copy_counts(cand, w.shape[1]))
    moved = moved_per_rank(held_old, cand, layers)
    shape = (num_layers, sh.num_nodes, sh.ranks_per_node)
    return loads.reshape(shape).max(-1), moved.reshape(shape).sum(-1)


def _compose(w: np.ndarray, held_old: np.ndarray, cands: list, limit: np.ndarray, sh: Shape):
    """Node by node, the candidate within ``limit`` that moves fewest copies. ``cands``:
    ``int[L, R, S]`` placements that put the same groups on each node (so a node's copies,
    replica counts and loads do not depend on the other nodes; the first on ties). Returns
    ``int[L, R, S]`` and ``float[L, N]`` the chosen node's moved copies (``inf``: no candidate
    within ``limit``)."""
    num_layers = w.shape[0]
    n, rpn = sh.num_nodes, sh.ranks_per_node
    stacked = np.stack([c.reshape(num_layers, n, rpn, -1) for c in cands])
    # every candidate's layers in one batch
    layers = np.tile(np.arange(num_layers), len(cands))
    peak, moved = _node_stats(w, stacked.reshape(len(layers), sh.num_ranks, -1), held_old, sh, layers)
    score = np.where(peak <= np.tile(limit, len(cands))[:, None] * (1 + _SLACK), moved, np.inf)
    score = score.reshape(len(cands), num_layers, n)  # [C, L, N]
    pick = score.argmin(0)
    out = stacked[pick, np.arange(num_layers)[:, None], np.arange(n)[None, :]]
    return out.reshape(num_layers, sh.num_ranks, -1), score.min(0)


def _group_nodes(w: np.ndarray, held_old: np.ndarray, node_cap: np.ndarray, sh: Shape) -> np.ndarray:
    """``int[L, G]``: groups stay on the node that held them unless its load would exceed
    ``node_cap`` ``float[L]`` (sticky packing of the groups onto the nodes)."""
    num_layers = w.shape[0]
    n = sh.num_nodes
    gl = group_loads(w, sh)
    g_slots = sticky_pack(
        _nodes_of_old(held_old, gl, sh),
        np.ones((num_layers, n), dtype=bool),
        np.ones_like(gl, dtype=np.int64),
        gl,
        node_cap,
    )
    gn = np.zeros((num_layers, sh.num_groups), dtype=np.int64)
    np.put_along_axis(gn, g_slots.reshape(num_layers, -1), np.repeat(np.arange(n), sh.num_groups // n)[None, :], axis=1)
    return gn


@functools.lru_cache(maxsize=8)
def _assignments(num_groups: int, num_nodes: int) -> np.ndarray:
    """``int[A, G]``: every assignment of ``G`` groups to ``N`` nodes, ``G / N`` per node (empty
    where there are more than ``_MAX_ASSIGNMENTS``)."""
    per = num_groups // num_nodes
    count = math.factorial(num_groups) // math.factorial(per) ** num_nodes
    if count > _MAX_ASSIGNMENTS:
        return np.zeros((0, num_groups), dtype=np.int64)
    out = []
    for perm in itertools.permutations(range(num_groups)):
        # canonical: within each node the groups in increasing order
        if all(perm[i] < perm[i + 1] for i in range(num_groups - 1) if (i + 1) % per):
            a = np.empty(num_groups, dtype=np.int64)
            a[list(perm)] = np.repeat(np.arange(num_nodes), per)
            out.append(a)
    return np.array(out, dtype=np.int64)


def _cheapest_groups(
    gl: np.ndarray, gn_old: np.ndarray, copies: np.ndarray, node_caps: np.ndarray, sh: Shape
) -> tuple[np.ndarray, np.ndarray]:
    """Per cap, the assignment of groups to nodes that moves fewest copies (``copies``
    ``int[L, G]`` a group's copies, all moved when its node changes; ties: the lighter heaviest
    node) with every node's load (``gl`` ``float[L, G]``) at most the cap (``node_caps``
    ``float[C, L]``). Returns ``int[C, L, G]`` (the old assignment ``gn_old`` where none) and
    ``bool[C, L]`` whether there is one."""
    a = _assignments(sh.num_groups, sh.num_nodes)
    num_c, num_layers = node_caps.shape
    if not len(a):
        return np.broadcast_to(gn_old, (num_c, *gn_old.shape)), np.zeros((num_c, num_layers), dtype=bool)
    # groups of each node per assignment: [A, N, G/N]
    members = np.argsort(a, axis=1, kind="stable").reshape(len(a), sh.num_nodes, -1)
    compiled = jit.kernel("aware_kernel", num_layers * len(a), _JIT_FROM) if gl.dtype == np.float64 else None
    if compiled is not None:
        best = np.empty((num_c, num_layers), dtype=np.int64)
        found = np.empty((num_c, num_layers), dtype=bool)
        args = (np.ascontiguousarray(gl), members, a, np.ascontiguousarray(gn_old, dtype=np.int64))
        caps = np.ascontiguousarray(node_caps, dtype=np.float64)
        compiled.cheapest_groups(*args, np.ascontiguousarray(copies, dtype=np.int64), caps, best, found)
        return np.where(found[..., None], a[best], gn_old[None]), found
    if members.shape[-1] == 2:  # a sum of two: one rounding (numpy's), without the [L, A, N, 2] gather
        node_load = (gl[:, members[..., 0]] + gl[:, members[..., 1]]).max(-1)  # [L, A]
    else:
        node_load = gl[:, members].sum(-1).max(-1)
    cost = np.zeros(node_load.shape, dtype=np.int64)  # [L, A], group by group (no [L, A, G])
    for g in range(sh.num_groups):
        cost += copies[:, g, None] * (a[None, :, g] != gn_old[:, g, None])
    # per cap, among the assignments within it: fewest copies, then the lightest heaviest
    # node, then the first (three masked minima, not a sort of every assignment)
    best = np.zeros((num_c, num_layers), dtype=np.int64)
    found = np.zeros((num_c, num_layers), dtype=bool)
    big = np.iinfo(np.int64).max
    for c in range(num_c):
        within = node_load <= node_caps[c][:, None]
        c_min = np.where(within, cost, big).min(1)
        cheapest = within & (cost == c_min[:, None])
        lightest = cheapest & (node_load == np.where(cheapest, node_load, np.inf).min(1)[:, None])
        best[c], found[c] = lightest.argmax(1), c_min < big
    return np.where(found[..., None], a[best], gn_old[None]), found


def _sticky_nodes(w, old3, held_old, gn, limit, sh: Shape, obl_cnt=None, known=None) -> tuple[np.ndarray, np.ndarray]:
    """For the groups ``gn`` ``int[L, G]``, node by node the sticky packing of fewest moves
    within ``limit`` ``float[L]``: with the old replica counts (:func:`_old_counts`: nothing
    moves on the many nodes far under the limit) or, on nodes loaded over ``_LOOSE`` of
    what their ranks may carry, with ``replicate_experts``' counts, and where the old counts
    leave a copy over ``_CAP_OVER_REPLICATE`` x ``replicate_experts``' heaviest copy, with the
    old counts capped there (:func:`capped_counts`), on any node where they leave a copy over
    the limit, capped at ``_CAP_OF_LIMIT`` of the limit, and with the oblivious answer's counts
    ``obl_cnt`` ``int[L, E]`` where they fill the node's slots (its spread and hot-spread
    counts: after the oblivious answer got lighter than ``replicate_experts``' counts allow,
    the only ones within a limit relative to it), and on nodes loaded over ``_HOT_FILL`` of
    what their ranks carry, :func:`lean_counts` in the first batch and the old counts'
    variants of :func:`hot_counts` (packed with second
    copies on the ranks that held the expert) where they may move fewer copies than the
    node's choice among the others. Two batches of rows (the cost is in the rounds of the
    loops, not in the rows). ``known``: ``(same, cand, bad)``, ``bool[L, N]`` nodes whose
    answer is already known (a node's answer depends only on its layer, its groups and the
    limit), given by ``cand`` ``int[L, R, S]`` and ``bad`` ``bool[L, N]``: not packed again.
    Returns ``int[L, R, S]`` and the nodes over the limit ``bool[L, N]``."""
    num_layers, num_logical = w.shape
    n, rpn = sh.num_nodes, sh.ranks_per_node
    old_rows = old3.reshape(num_layers * n, rpn, -1)
    alive_rows = np.tile(sh.active.reshape(n, rpn), (num_layers, 1))
    # Nodes that hold exactly their experts, every live slot filled, every rank within the
    # limit at the old counts: sticky packing would keep them as they are (most nodes).
    oc = copy_counts(old3.reshape(num_layers * n, -1), num_logical).reshape(num_layers, n, -1)  # [L, N, E]
    mine = np.repeat(gn, num_logical // sh.num_groups, axis=1)[:, None, :] == np.arange(n)[None, :, None]
    wc_node = np.where(oc > 0, w[:, None, :] / as_float(np.maximum(oc, 1)), 0.0).reshape(num_layers * n, -1)
    peak = slot_sums(wc_node, old_rows).max(-1)
    full = ((old_rows >= 0) | ~alive_rows[:, :, None]).all((1, 2))
    as_is = ((oc > 0) == mine).all(-1).ravel() & full & (peak <= np.repeat(limit, n) * (1 + _SLACK))
    if known is not None:
        as_is |= known[0].ravel()  # not packed: their answer is set below
    node_load = node_loads(w, sh, gn)
    # a node whose load is over what its ranks carry at the limit is over it in any packing
    hopeless = _hopeless(node_load, limit, sh).ravel()
    todo = np.flatnonzero(~as_is & ~hopeless)
    tight = np.flatnonzero(~as_is & ~hopeless & (node_load > limit[:, None] * sh.live_per_node * _LOOSE).ravel())

    (cnt_k, wc_k), (cnt_r, wc_r) = _node_counts(w, old3, gn, sh)
    thr_rows = np.repeat(limit, n)
    # capped old counts where the old counts leave a copy much heavier than needed
    wr = np.repeat(w, n, axis=0)
    heaviest = lambda cnt: np.where(cnt > 0, wr / as_float(np.maximum(cnt, 1)), 0.0).max(1)  # noqa: E731
    cap = heaviest(cnt_r) * _CAP_OVER_REPLICATE
    capped = np.flatnonzero(
        ~as_is
        & ~hopeless
        & (heaviest(cnt_k) > cap * (1 + EPS))
        & (node_load > limit[:, None] * sh.live_per_node * _LOOSE).ravel()
    )
    cnt_c = capped_counts(wr[capped], cnt_k[capped], cap[capped])
    # per-copy loads: the node's own experts from its capped counts (one node per expert)
    wc_c = load_per_copy(wr[capped], cnt_c)
    # and, on any node where the old counts leave a copy over the limit itself (a drifted hot
    # expert), the old counts with fewest changes that bring every copy within a fraction of
    # it: the hot expert gets about the copies it needs, where the cap above may give it more
    over_t = heaviest(cnt_k) > thr_rows * (1 + EPS)
    at_t = np.flatnonzero(~as_is & ~hopeless & over_t & (_CAP_OF_LIMIT is not None))
    cnt_t = capped_counts(wr[at_t], cnt_k[at_t], thr_rows[at_t] * (_CAP_OF_LIMIT or 0.0))
    wc_t = load_per_copy(wr[at_t], cnt_t)
    # the oblivious answer's counts on the tight nodes where they fill the node's slots
    if obl_cnt is None:
        own = np.zeros(0, dtype=np.int64)
        cnt_o = wc_o = np.zeros((0, num_logical))
    else:
        cnt_all = np.where(mine.reshape(num_layers * n, -1), np.repeat(obl_cnt, n, axis=0), 0)
        fills = cnt_all.sum(1) == sh.live_per_node * sh.slots_per_rank
        own = tight[fills[tight] & (cnt_all[tight] != cnt_r[tight]).any(1)]
        cnt_o = cnt_all[own]
        wc_o = load_per_copy(wr[own], cnt_o)
    # lean counts on the near-full nodes
    near = np.flatnonzero(~as_is & ~hopeless & (node_load > limit[:, None] * sh.live_per_node * _HOT_FILL).ravel())
    total = sh.live_per_node * sh.slots_per_rank
    cnt_l, ok_l = lean_counts(wr[near], cnt_k[near], thr_rows[near], sh.slots_per_rank, total)
    ok_l &= (cnt_l != cnt_k[near]).any(1) & _LEAN
    lean, cnt_l = near[ok_l], cnt_l[ok_l]
    wc_l = load_per_copy(wr[lean], cnt_l)
    sets = (todo, tight, capped, own, at_t, lean)
    rows = np.concatenate(sets)
    cands = [old_rows.copy() for _ in sets]
    if len(rows):
        cnt_rows = np.concatenate([cnt_k[todo], cnt_r[tight], cnt_c, cnt_o, cnt_t, cnt_l]).astype(np.int64)
        wc_rows = np.concatenate([wc_k[todo], wc_r[tight], wc_c, wc_o, wc_t, wc_l])
        packed = _pack_rows(old_rows[rows], alive_rows[rows], cnt_rows, wc_rows, thr_rows[rows], sh, _DUP_HELD)
        ends = np.cumsum([len(x) for x in sets])
        for c, idx, a, b in zip(cands, sets, np.r_[0, ends[:-1]], ends):
            c[todo] = packed[: ends[0]]  # every node: the old counts unless the candidate's own
            c[idx] = packed[a:b]
    shape = (num_layers, sh.num_ranks, -1)
    cands = [c.reshape(shape) for c in cands]
    comp, best = _compose(w, held_old, cands, limit, sh)
    # Near-full nodes: the old counts' variants (hot_counts), packed with second copies on the
    # ranks that held the expert. Per node the variant within the limit that moves fewest
    # copies replaces the choice above where it moves fewer. Each variant keeps the node's
    # experts, so it moves at least its copies of experts no rank of the node held: variants
    # (and nodes) whose bound is no fewer than the choice's moves are not packed.
    node_held = held_old.reshape(num_layers * n, rpn, num_logical).any(1)
    best = best.ravel()
    near = near[((cnt_k[near] > 0) & ~node_held[near]).sum(1) < best[near]]
    hv_r, cnt_h = hot_counts(wr[near], cnt_k[near], thr_rows[near])
    hot_rows = near[hv_r]
    fewer = (cnt_h * ~node_held[hot_rows]).sum(1) < best[hot_rows]
    hot_rows, cnt_h = hot_rows[fewer], cnt_h[fewer]
    if len(hot_rows):
        wc_h = load_per_copy(wr[hot_rows], cnt_h)
        hp = _pack_rows(old_rows[hot_rows], alive_rows[hot_rows], cnt_h, wc_h, thr_rows[hot_rows], sh, True)
        peak_h = slot_sums(wc_h, hp).max(-1)
        # held_old's node rows are those of old_rows (both from old3)
        moved_h = moved_per_rank(held_old.reshape(num_layers * n, rpn, -1), hp, hot_rows).sum(1)
        score = np.where(peak_h <= thr_rows[hot_rows] * (1 + _SLACK), moved_h, np.iinfo(np.int64).max)
        first = first_min_per_key(hot_rows, score)
        first = first[score[first] < np.iinfo(np.int64).max]
        if len(first):
            # the layers with a variant: the choice above against their variants (ties to it)
            lv = np.unique(hot_rows[first] // n)
            hv = comp.reshape(num_layers * n, rpn, -1).copy()
            hv[hot_rows[first]] = hp[first]
            sub, best_v = _compose(w[lv], held_old[lv], [comp[lv], hv.reshape(shape)[lv]], limit[lv], sh)
            comp[lv] = sub
            best = best.reshape(num_layers, n)
            best[lv] = best_v
    bad = ~np.isfinite(best).reshape(num_layers, n) | hopeless.reshape(num_layers, n)
    if known is not None:
        same, cand_k, bad_k = known
        comp4, cand4 = comp.reshape(num_layers, n, rpn, -1), cand_k.reshape(num_layers, n, rpn, -1)
        comp4[same], bad[same] = cand4[same], bad_k[same]
    return comp, bad


def _pack_rows(old_rows, alive_rows, cnt_rows, wc_rows, thr_rows, sh: Shape, dup_held: bool) -> np.ndarray:
    """Sticky packing of node rows (``int[B, K, S]`` old copies, ``bool[B, K]`` live ranks,
    ``int[B, E]`` counts, ``float[B, E]`` per-copy loads, ``float[B]`` limits; ``dup_held``:
    second copies on ranks that held the expert); rows over the limit then refined by the
    swap search and the swap-back search. Returns ``int[B, K, S]``."""
    # two copies of an expert on a rank are allowed, as in the reference
    dup = np.ones(len(cnt_rows), dtype=bool) if dup_held else None
    packed = sticky_pack(old_rows, alive_rows, cnt_rows, wc_rows, thr_rows, no_duplicates=False, dup_held=dup)
    # rows over the limit: the swap search lowers their heaviest rank (a few more moves
    # where the alternative is the fallback's repacking of the node)
    peak = slot_sums(wc_rows, packed).max(-1)
    over = np.flatnonzero(peak > thr_rows * (1 + _SLACK))
    if len(over):
        sub = packed[over][:, None]
        cap = per_rank_cap(cnt_rows[over], np.full(len(over), sh.live_per_node))
        _at_least_held(cap, sub[:, 0])
        # compiled where the batch is a model's (its few rows over the limit alone may not be)
        fast = jit.kernel("swap_kernel", old_rows.size, _JIT_FROM) is not None or None
        lower_peak(sub, wc_rows[over], cap, stop_at=thr_rows[over], jit=fast)
        # the swap search lowers the peak whatever copies it moves: swap copies back to
        # ranks that held them where both ranks stay within the limit
        restore(sub[:, 0], old_rows[over], alive_rows[over], wc_rows[over], cap, thr_rows[over])
        packed[over] = sub[:, 0]
    return packed


def _at_least_held(cap: np.ndarray, p: np.ndarray) -> None:
    """Raise ``cap`` ``int[B, E]`` (each >= 1), in place, to the most copies of an expert one
    rank of ``p`` ``int[B, K, S]`` holds (only repeats matter: slots sorted per rank)."""
    compiled = (
        jit.kernel("load_kernel", p.size, _JIT_FROM) if cap.dtype == np.int64 and cap.flags.c_contiguous else None
    )
    if compiled is not None and compiled.at_least_held(cap, np.ascontiguousarray(p, dtype=np.int64)):
        return
    srt = np.sort(p, axis=-1)
    run = np.ones(srt.shape, dtype=np.int64)  # position in its run of equal ids
    for j in range(1, srt.shape[-1]):
        run[..., j] += (srt[..., j] == srt[..., j - 1]) * run[..., j - 1]
    again = (run > 1) & (srt >= 0)
    if again.any():
        np.maximum.at(cap, (np.nonzero(again)[0], srt[again]), run[again])


def _within(w: np.ndarray, p2l: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """``bool[L]``: layers whose heaviest rank under ``p2l`` ``int[L, R, S]`` (loads ``w``
    ``float[L, E]``) is within ``limit`` ``float[L]``, up to rounding (``_SLACK``)."""
    if not len(p2l):
        return np.zeros(0, dtype=bool)
    return max_rank_load(w, p2l, copy_counts(p2l, w.shape[1])) <= limit * (1 + _SLACK)


def _fewest_moves(held_old: np.ndarray, group_node: np.ndarray, sh: Shape) -> np.ndarray:
    """``int[K]``: a lower bound on the copies any answer with the groups on the nodes
    ``group_node`` ``int[K, G]`` moves (``held_old`` ``bool[K, R, E]``): every expert has a
    copy on its group's node, moved where no rank of that node held the expert."""
    num_rows, _, num_logical = held_old.shape
    node_held = held_old.reshape(num_rows, sh.num_nodes, sh.ranks_per_node, num_logical).any(2)  # [K, N, E]
    node_of = np.repeat(group_node, num_logical // sh.num_groups, axis=1)  # [K, E]
    return (~np.take_along_axis(node_held, node_of[:, None, :], axis=1)[:, 0]).sum(1)


def _hopeless(node_load: np.ndarray, limit: np.ndarray, sh: Shape) -> np.ndarray:
    """``bool[L, N]``: nodes whose load ``float[L, N]`` exceeds what their live ranks carry at
    ``limit`` ``float[L]`` (beyond any rounding): no packing of them is within the limit."""
    return node_load > limit[:, None] * sh.live_per_node * (1 + EPS)


def _lpt_nodes(
    w, old3, held_old, gn, limit, sh: Shape, cand: np.ndarray, bad: np.ndarray, packs: np.ndarray | None = None
) -> np.ndarray:
    """``cand`` ``int[L, R, S]`` with its ``bad`` nodes ``bool[L, N]`` replaced by the
    reference's LPT packing of the node's copies (groups ``gn``; ``packs``
    ``int[L, N, live_per_node, S]`` when already known), matched to the old ranks and restored
    (:func:`_restored`)."""
    num_layers = w.shape[0]
    n = sh.num_nodes
    if packs is None:
        packs, _ = node_packs(w, gn, sh, no_duplicates=False)
    lpt_answer = ObliviousAnswer(packs.reshape(num_layers, n, sh.live_per_node, -1), gn, None, None, None, None)
    lpt = _matched_oblivious(lpt_answer, held_old, sh, np.broadcast_to(np.arange(n), (num_layers, n)))[0]
    lpt = _restored(w, lpt, old3, limit, sh, bad)
    return np.where(np.repeat(bad, sh.ranks_per_node, axis=1)[:, :, None], lpt, cand)


def still_valid(old3: np.ndarray, sh: Shape) -> np.ndarray:
    """``bool[L]``: the old placement ``int[L, R, S]`` (dead ranks' slots -1) is a valid answer
    as it is: every expert has a live copy, and (hierarchical) each group lives on one node,
    ``G / N`` groups per node."""
    num_layers = old3.shape[0]
    ok = (copy_counts(old3, sh.num_logical) > 0).all(1)
    if sh.hierarchical:
        gsize = sh.num_logical // sh.num_groups
        node = np.broadcast_to(np.arange(sh.num_nodes).repeat(sh.ranks_per_node)[None, :, None], old3.shape)
        grp = np.where(old3 >= 0, old3 // gsize, sh.num_groups)
        on = np.zeros((num_layers, sh.num_groups + 1, sh.num_nodes), dtype=bool)
        on[np.arange(num_layers)[:, None, None], grp, node] = True
        on = on[:, : sh.num_groups]
        ok &= (on.sum(2) == 1).all(1)
        ok &= (on.sum(1) == sh.num_groups // sh.num_nodes).all(1)
    return ok


def aware_policy(
    w: np.ndarray,
    placement: Placement,
    obl: ObliviousAnswer,
    ref: ObliviousAnswer,
    sh: Shape,
    tol: float,
    limit: np.ndarray | None = None,
) -> np.ndarray:
    """The migration-aware policy (module docstring): ``obl`` moeshard's oblivious answer,
    ``ref`` the reference's; per layer the heaviest rank stays within ``limit`` ``float[L]``
    (default: the reference's, times ``1 + tol``; never below the oblivious answer's);
    returns ``int[L, R, S]``."""
    return _aware(w, _old_slots(placement, sh), obl, ref, sh, np.full(w.shape[0], float(tol)), limit)


def _old_slots(placement: Placement, sh: Shape) -> np.ndarray:
    """``int[L, R, S]``: the placement's slots, dead ranks' -1."""
    shape = (placement.num_layers, sh.num_ranks, sh.slots_per_rank)
    return np.where(sh.active[None, :, None], placement.phy2log.reshape(shape), -1)


# Multiples of the tolerance at which the step scope tries each layer's limit; the largest
# bounds how far one layer may go over its base (1 + 8 x tolerance). On the DeepSeek-V3
# drifting trace most layers take 0.25-0.75 (the copies a group move or a repack costs are
# saved where they buy least balance); these 8 moved fewer copies there than 10 (1.5, 3 and
# 5 instead of 2 and 4), at 4/5 of the time.
_STEP_MULTS = (0.0, 0.25, 0.5, 0.75, 1.0, 2.0, 4.0, 8.0)


def _tiled(ans: ObliviousAnswer, k: int) -> ObliviousAnswer:
    """``ans`` with its layers repeated ``k`` times (layer ``i * L + l`` is layer ``l``)."""
    tile = lambda x: None if x is None else np.tile(x, (k,) + (1,) * (x.ndim - 1))  # noqa: E731
    return ObliviousAnswer(*[tile(getattr(ans, f)) for f in ObliviousAnswer.__dataclass_fields__])


def _rows(ans: ObliviousAnswer, idx: np.ndarray) -> ObliviousAnswer:
    """``ans`` on the layers ``idx`` ``int[K]`` only."""
    return ObliviousAnswer(
        *[None if (x := getattr(ans, f)) is None else x[idx] for f in ObliviousAnswer.__dataclass_fields__]
    )


def cheapest_within_mean(moves: np.ndarray, bal: np.ndarray, budget: float) -> np.ndarray:
    """``int[L]``: per layer one option of ``moves`` / ``bal`` ``float[L, K]`` (copies moved,
    balance) with ``sum(bal) <= budget`` and few moves in all: the options a Lagrangian price
    of balance picks (bisected to the lowest price within ``budget``), then, while the slack
    allows, the switch that saves most copies. Option 0 of every layer must fit the budget."""
    num_layers, k = moves.shape
    rows = np.arange(num_layers)
    tie = 1e-9 * np.arange(k)  # lowest option on ties

    def pick(price: float) -> np.ndarray:
        return np.argmin(moves + price * bal + tie, axis=1)

    scale = max(1.0, float(moves.max(initial=0.0)))
    lo, hi = 0.0, scale * 1e6 / max(float(np.abs(bal).max(initial=1.0)), 1e-300) + 1e6
    best = pick(hi)
    if bal[rows, best].sum() > budget:
        best = np.zeros(num_layers, dtype=np.int64)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        p = pick(mid)
        if bal[rows, p].sum() <= budget:
            hi, best = mid, p
        else:
            lo = mid
    assert bal[rows, best].sum() <= budget
    for _ in range(num_layers * k):
        slack = budget - bal[rows, best].sum()
        gain = moves[rows, best][:, None] - moves
        ok = (gain > 0) & (bal - bal[rows, best][:, None] <= slack)
        if not ok.any():
            break
        layer, opt = np.unravel_index(np.where(ok, gain, -1).argmax(), moves.shape)
        best[layer] = opt
    return best


def step_policy(
    w: np.ndarray, placement: Placement, obl: ObliviousAnswer, ref: ObliviousAnswer, sh: Shape, tol: float, base: str
) -> np.ndarray:
    """The migration-aware policy with the tolerance on the step's mean balance
    (``tolerance_scope="step"``): the mean over layers of max/mean rank load is at most
    ``(1 + tol)`` x the mean of the ``base`` answer's (``"oblivious"`` or ``"reference"``),
    each layer at most ``1 + 8 x tol`` x its own. Each layer's aware answer (:func:`_aware`)
    under limits of ``1 + m x tol`` x the base's heaviest rank, ``m`` in ``_STEP_MULTS`` (one
    batch); per layer the one :func:`cheapest_within_mean` picks, unless the per-layer answer
    (``m = 1``) moves fewer copies in all. Returns ``int[L, R, S]``."""
    num_layers, num_logical = w.shape
    old3 = _old_slots(placement, sh)
    k = len(_STEP_MULTS)
    mult = np.repeat(np.array(_STEP_MULTS), num_layers)
    base_ans = obl if base == "oblivious" else ref
    limit = np.tile(base_ans.max_load, k) * (1 + mult * tol)
    wt = np.tile(w, (k, 1))
    cand = _aware(wt, np.tile(old3, (k, 1, 1)), _tiled(obl, k), _tiled(ref, k), sh, mult * tol, limit)
    moves = moves3(np.tile(held_by_rank(old3, num_logical), (k, 1, 1)), cand).reshape(k, num_layers).T
    bal = max_over_mean(rank_loads3(wt, cand, copy_counts(cand, num_logical))[:, sh.active]).reshape(k, num_layers).T
    base_p2l = base_ans.phy2log
    base_bal = max_over_mean(rank_loads3(w, base_p2l, copy_counts(base_p2l, num_logical))[:, sh.active])
    pick = cheapest_within_mean(moves.astype(np.float64), bal, (1 + tol) * base_bal.sum())
    rows = np.arange(num_layers)
    per_layer = _STEP_MULTS.index(1.0)
    if moves[rows, pick].sum() > moves[:, per_layer].sum():
        pick = np.full(num_layers, per_layer)
    return cand.reshape(k, num_layers, *cand.shape[1:])[pick, rows]


def _aware(
    w: np.ndarray,
    old3: np.ndarray,
    obl: ObliviousAnswer,
    ref: ObliviousAnswer,
    sh: Shape,
    tol: np.ndarray,
    limit: np.ndarray | None,
) -> np.ndarray:
    """:func:`aware_policy` from the old slots ``old3`` ``int[L, R, S]`` (dead ranks -1), with
    a tolerance per layer ``tol`` ``float[L]``."""
    num_layers, num_logical = w.shape
    s = sh.slots_per_rank
    held_old = held_by_rank(old3, num_logical)
    limit = ref.max_load * (1 + tol) if limit is None else np.maximum(limit, obl.max_load)
    # The old placement itself where it still is a valid answer within the limit: nothing
    # moves, and nothing else need be looked at (layers are independent).
    stay = still_valid(old3, sh) & _within(w, old3, limit)
    if stay.any():
        out = old3.copy()
        rest = np.flatnonzero(~stay)
        if len(rest):
            out[rest] = _aware(w[rest], old3[rest], _rows(obl, rest), _rows(ref, rest), sh, tol[rest], limit[rest])
        return out
    # The oblivious answer is within the limit (never less balanced than the reference's);
    # it, the reference's and both matched to the old placement (greedily) are the baseline
    # to beat where within the limit: the one of them that moves fewest copies, so the aware
    # policy never moves more copies than the oblivious policy.
    best = obl.phy2log.copy()
    best_moves = moves3(held_old, best)
    perm = _node_match(obl.group_node, held_old, sh)  # the oblivious answer's nodes on the old ones
    # the reference's matched where it is within the limit (matching moves its packs, whose
    # loads stay those of its own ranks: elsewhere it is not within the limit either)
    ref_ok = np.flatnonzero(_within(w, ref.phy2log, limit))
    ref_matched = ref.phy2log.copy()
    if len(ref_ok):
        ref_matched[ref_ok] = _matched_oblivious(_rows(ref, ref_ok), held_old[ref_ok], sh)[0]
    for o in (ref.phy2log, _matched_oblivious(obl, held_old, sh, perm)[0], ref_matched):
        mv = moves3(held_old, o)
        fewer = np.flatnonzero(mv < best_moves)
        take = fewer[_within(w[fewer], o[fewer], limit[fewer])]
        best[take], best_moves[take] = o[take], mv[take]
    # Group assignments to try (hierarchical): groups stay on their node unless its load
    # would exceed what its ranks may well carry under the limit (most nodes are far under
    # it, so few groups move); where sticky packing misses the limit with those, also the
    # assignment whose nodes stay under the reference's heaviest node.
    everywhere = np.arange(num_layers)
    if sh.hierarchical:
        cap = ref.node_max * (1 + tol)
        gn = _group_nodes(w, held_old, np.maximum(cap, limit * sh.live_per_node * _NODE_FILL), sh)
    else:
        gn = ref.group_node
    cand, bad = _sticky_nodes(w, old3, held_old, gn, limit, sh, obl.cnt)
    lay, gn_all = everywhere, gn
    if sh.hierarchical:
        # Layers whose groups all stay and whose nodes are within the limit move only a few
        # copies; elsewhere (a group moved costs all its copies) more assignments are tried:
        # those that move fewest copies with every node's load under a few fills of what its
        # ranks carry at the limit (every assignment looked at where they are few; else the
        # groups kept wherever their node fits at all, the packing may still reach it).
        gn_old = _group_nodes(w, held_old, np.full(num_layers, np.inf), sh)
        ml = np.flatnonzero((gn != gn_old).any(1) | bad.any(1))
        if not len(ml):
            gncs, founds = np.zeros((0, 0, sh.num_groups), dtype=np.int64), np.zeros((0, 0), dtype=bool)
        elif len(_assignments(sh.num_groups, sh.num_nodes)):
            copies = copy_counts(obl.phy2log[ml], num_logical).reshape(len(ml), sh.num_groups, -1).sum(-1)
            caps = np.array(_FILLS)[:, None] * limit[ml] * sh.live_per_node
            gncs, founds = _cheapest_groups(group_loads(w[ml], sh), gn_old[ml], copies, caps, sh)
        else:
            gncs = _group_nodes(w[ml], held_old[ml], limit[ml] * sh.live_per_node * (1 + _SLACK), sh)[None]
            founds = np.ones((1, len(ml)), dtype=bool)
        extra = [
            (ml[found & (gnc != gn[ml]).any(1)], gnc[found & (gnc != gn[ml]).any(1)])
            for gnc, found in zip(gncs, founds)
        ]
        # the oblivious answer's groups, nodes matched to the old ones: node by node sticky
        # packing, else the oblivious answer's packing of the node (within the limit), so
        # nodes that keep their groups need not take the oblivious packing too
        gn_m = np.take_along_axis(perm, obl.group_node, axis=1)
        diff = ml[(gn_m[ml] != gn[ml]).any(1)]
        extra.append((diff, gn_m[diff]))
        # where sticky packing misses the limit, groups under the reference's heaviest node
        miss = np.flatnonzero(bad.any(1))
        if len(miss):
            gn2 = _group_nodes(w[miss], held_old[miss], cap[miss], sh)
            moved2 = (gn2 != gn[miss]).any(1)
            extra.append((miss[moved2], gn2[moved2]))
        # one batch for all of them (the cost is in the rounds of the packing, not the rows),
        # each (layer, assignment) once
        d = np.concatenate([e[0] for e in extra])
        gd = np.concatenate([e[1] for e in extra])
        _, first = np.unique(np.column_stack([d, gd]), axis=0, return_index=True)
        first = np.sort(first)
        d, gd = d[first], gd[first]
        # those whose fewest possible moves are no fewer than the baseline's or than the first
        # assignment's packing within the limit cannot be taken (ties go to those): not packed
        bar = np.minimum(best_moves, np.where(bad.any(1), np.iinfo(np.int64).max, moves3(held_old, cand)))
        fewer = _fewest_moves(held_old[d], gd, sh) < bar[d]
        d, gd = d[fewer], gd[fewer]
        if len(d):
            # a node with the groups it has in the first answer: that answer's node
            nodes = np.arange(sh.num_nodes)
            same = ((gd[:, :, None] == nodes) == (gn[d][:, :, None] == nodes)).all(1)
            known = (same, cand[d], bad[d])
            cand1, bad1 = _sticky_nodes(w[d], old3[d], held_old[d], gd, limit[d], sh, obl.cnt[d], known)
            lay, gn_all = np.concatenate([lay, d]), np.concatenate([gn_all, gd])
            cand, bad = np.concatenate([cand, cand1]), np.concatenate([bad, bad1])
    # Where sticky packing misses the limit: the reference's LPT packing of those nodes, restored
    # (not on layers with a node over what its ranks carry at the limit: never within it).
    hopeless = _hopeless(node_loads(w[lay], sh, gn_all), limit[lay], sh).any(1)
    rows = np.flatnonzero(bad.any(1) & ~hopeless)
    if len(rows):
        # none for a row that cannot be taken: its fewest possible moves no fewer than the
        # baseline's, or more than those of a packing of its layer within the limit
        big = np.iinfo(np.int64).max
        low = np.full(num_layers, big)
        np.minimum.at(low, lay, np.where(bad.any(1), big, moves3(held_old[lay], cand)))
        fewest = _fewest_moves(held_old[lay[rows]], gn_all[rows], sh)
        rows = rows[(fewest < best_moves[lay[rows]]) & (fewest <= low[lay[rows]])]
    if len(rows):
        wl, ol, hl, ll = w[lay[rows]], old3[lay[rows]], held_old[lay[rows]], limit[lay[rows]]
        # The oblivious answer's packs where it has the same groups (always in the global
        # policy): they are within the limit. Else the best refined packing of the groups.
        same = (gn_all[rows] == obl.group_node[lay[rows]]).all(1)
        packs = obl.packs[lay[rows]].copy()
        if sh.hierarchical:
            # the matched assignment: node a's packs on node perm[l, a]
            perm_r = perm[lay[rows]]
            permuted = np.empty_like(packs)
            permuted[np.arange(len(rows))[:, None], perm_r] = packs
            matched = ~same & (gn_all[rows] == gn_m[lay[rows]]).all(1)
            packs[matched] = permuted[matched]
            same |= matched
        if not same.all():
            packs[~same] = group_packs(wl[~same], sh, gn_all[rows][~same], ll[~same])
        cand[rows] = _lpt_nodes(wl, ol, hl, gn_all[rows], ll, sh, cand[rows], bad[rows], packs)
    ok = ~hopeless & _within(w[lay], cand, limit[lay])
    mv = np.where(ok, moves3(held_old[lay], cand), np.iinfo(np.int64).max)
    # per layer, the variant that moves fewest copies (first on ties)
    first = first_min_per_key(lay, mv)
    better = mv[first] < best_moves[lay[first]]
    best[lay[first][better]] = cand[first][better]
    # Copies swapped back to ranks that held them where both ranks stay within the limit (the
    # candidates' own searches stop at the limit, not at fewest moves), on nodes that move any.
    moved_nodes = _node_stats(w, best, held_old, sh)[1] > 0
    back = _restored(w, best, old3, limit, sh, moved_nodes)
    take = (moves3(held_old, back) < moves3(held_old, best)) & _within(w, back, limit)
    best[take] = back[take]
    # Moved copies replaced by copies of experts their rank held, where the limit allows.
    node_of_rank = np.arange(sh.num_ranks) // sh.ranks_per_node if sh.hierarchical else np.zeros(sh.num_ranks, int)
    best = fill_held(w, best, old3, held_old, limit * (1 + _SLACK), node_of_rank)
    # Moved copies shifted to ranks of their node that held them, where the limit allows.
    best = shift_held(w, best, old3, held_old, limit * (1 + _SLACK), node_of_rank)
    return _arrange(best.reshape(-1, s), old3.reshape(-1, s)).reshape(best.shape)
