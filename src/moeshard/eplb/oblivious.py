"""The oblivious policy (no previous placement to keep): deepseek-ai/EPLB (``eplb.py``)
re-implemented, vectorized over layers, and improved so that per layer it is never less
balanced than the reference.

The reference's steps:

1. **hierarchical** (``num_groups`` given, ``num_groups % num_nodes == 0`` and every node has
   the same number of live ranks): pack expert *groups* onto nodes with ``balanced_packing``
   (heaviest group first, onto the lightest node that still has room; every node gets
   ``num_groups / num_nodes`` groups), so that a token's group-limited routing stays on few
   nodes; then, within each node, ``replicate_experts`` (each redundant slot goes to the
   expert with the highest load per copy) and ``balanced_packing`` of the copies (per-copy load
   ``load / count``) onto the node's live ranks, ``slots_per_rank`` copies each.
2. **global** otherwise: the same with one group and one node.

Pack ``k`` of a node goes to the node's ``k``-th live rank, its copies in packing order (as the
reference does). Slots of dead (or not yet joined) ranks are ``-1``; slot ids stay those of
the full job, so an elastic job never renumbers. :func:`reference_answer` is the reference's
own answer (its float32 arithmetic, no moeshard rule).

moeshard's answer (:func:`oblivious_policy`) is, per layer, the most balanced (lightest heaviest
rank; max / mean rank load, the mean being the same for every answer) of three candidates,
each refined by a swap local search within each node that never raises the heaviest rank
(:func:`moeshard.eplb.refine.lower_peak`; groups stay on their node):

* the reference's steps with moeshard's rule: a rank never holds two copies of one expert
  when it can be avoided (the greedy skips ranks that hold the expert, and a swap repair fixes
  the rare dead end);
* the same with, per node, the lightest packing of *spread* and *hot-spread* replica counts
  (:func:`replicate_experts`): with spread counts an expert gets at most one copy per live rank
  of its node before any expert gets more (the reference can give a hot expert ``K + 1``
  copies on ``K`` ranks, so that one rank carries two of them; on DeepSeek-V3's hierarchical
  shape, Zipf loads, the reference's heaviest rank is up to 1.7x this one's); with hot-spread
  counts the node's ``h`` heaviest experts (``h`` in 1..4) get at most ``K`` copies together,
  so that no rank carries two heavy copies (per-copy greed gives a node's two hottest experts
  more copies than it has ranks, and two of its ranks carry two heavy copies each);
* the reference's answer itself.

The first two keep moeshard's rule; the third is taken where it is the most balanced and keeps
the rule too, or where neither of the others is at least as balanced as the reference (then
with the reference's duplicates, and the search adds none). So the answer is never less
balanced than the reference's, by construction.

The building blocks (replicate, pack, the no-duplicate repair, replicas per node, packs to
ranks, the refined packing of given groups) serve the migration-aware policy too
(:mod:`moeshard.eplb.aware`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import jit
from .inputs import Shape
from .metrics import count_last, load_per_copy, max_rank_load, slot_sums
from .refine import lower_peak

# Packings of at least this many items (rows x items) run compiled where numba is installed
# (``pack_kernel``, :mod:`moeshard.eplb.jit`): a model's shape (DeepSeek-V3: a few thousand).
_JIT_FROM = 2048

# -- the reference's building blocks, vectorized over rows ---------------------------------------


def desc_order(w: np.ndarray) -> np.ndarray:
    """``np.argsort(-w, axis=-1, kind="stable")``: heaviest first, the first on ties. Floats
    that are all >= 0 are in the order of their bit patterns as integers, whose stable sort is
    faster (``-0.0`` made ``+0.0`` first)."""
    if w.dtype.kind == "f" and w.dtype.itemsize in (4, 8) and (w >= 0).all():
        bits = np.ascontiguousarray(w + w.dtype.type(0)).view(np.int64 if w.dtype.itemsize == 8 else np.int32)
        return np.argsort(-bits, axis=-1, kind="stable")
    return np.argsort(-w, axis=-1, kind="stable")


def replicate_experts(
    w: np.ndarray, num_phy: int, num_ranks: int | None = None, hot: int | np.ndarray = 0
) -> tuple[np.ndarray, np.ndarray]:
    """EPLB ``replicate_experts``: ``w`` ``float[B, n]`` -> ``phy2item`` ``int[B, num_phy]``
    (slot i < n holds item i; each further slot the item with the highest load per copy, first
    on ties) and ``cnt`` ``int[B, n]``.

    ``num_ranks`` (moeshard's *spread* counts): each further slot goes to the item of the
    highest load per copy among those with fewer than ``num_ranks`` copies (all items have
    that many: the highest load per copy). ``c`` copies on ``K`` ranks put ``ceil(c / K)`` of
    them on some rank, ``ceil(c / K) * w / c >= w / K``: a copy beyond one per rank lowers no
    rank's share of the item (and ``K + 1`` copies raise it to ``2w / (K + 1)``), while the
    slot lowers another item's.

    ``hot`` (with ``num_ranks``; moeshard's *hot-spread* counts; an int or ``int[B]`` per row):
    besides, the ``hot`` heaviest items of a row (first on ties) get at most ``num_ranks``
    copies together, so that no rank needs two of their copies: when the heaviest items'
    copies outnumber the ranks, some rank carries two heavy copies, and fewer heavy copies
    one per rank are often lighter."""
    num_rows, n = w.shape
    assert num_phy >= n
    phy = np.empty((num_rows, num_phy), dtype=np.int64)
    compiled = jit.kernel("pack_kernel", num_rows * num_phy, _JIT_FROM) if w.dtype in (np.float32, np.float64) else None
    if compiled is not None:
        cnt = np.empty((num_rows, n), dtype=np.int64)
        compiled.replicate(np.ascontiguousarray(w), num_ranks or 0, _hot_items(w, num_ranks, hot), phy, cnt)
        return phy, cnt
    phy[:, :n] = np.arange(n)
    cnt = np.ones((num_rows, n), dtype=np.int64)
    per_copy = w.copy()
    rows = np.arange(num_rows)
    if num_ranks is None:
        for i in range(n, num_phy):
            j = per_copy.argmax(axis=1)
            phy[:, i] = j
            c = cnt[rows, j] + 1
            cnt[rows, j] = c
            per_copy[rows, j] = w[rows, j] / c  # rounded to w's dtype (float32: eplb.py's)
        return phy, cnt
    is_hot = _hot_items(w, num_ranks, hot)
    # An item is open while it has fewer than num_ranks copies and, if hot, the row's hot
    # items have fewer than num_ranks together; ``open_`` is its load per copy, -inf once
    # closed (kept up to date item by item: an item closes for good).
    hot_total = is_hot.sum(1)
    open_ = np.where((cnt < num_ranks) & (~is_hot | (hot_total < num_ranks)[:, None]), per_copy, -np.inf)
    for i in range(n, num_phy):
        j = open_.argmax(axis=1)
        full = np.isneginf(open_[rows, j])
        if full.any():
            j[full] = per_copy[full].argmax(axis=1)
        phy[:, i] = j
        c = cnt[rows, j] + 1
        cnt[rows, j] = c
        v = w[rows, j] / c  # rounded to w's dtype
        per_copy[rows, j] = v
        hj = is_hot[rows, j]
        hot_total += hj
        open_[rows, j] = np.where((c < num_ranks) & (~hj | (hot_total < num_ranks)), v, -np.inf)
        shut = hj & (hot_total == num_ranks)  # the row's hot items close together
        if shut.any():
            open_[shut] = np.where(is_hot[shut], -np.inf, open_[shut])
    return phy, cnt


def _hot_items(w: np.ndarray, num_ranks: int | None, hot: int | np.ndarray) -> np.ndarray:
    """``bool[B, n]``: each row's ``hot`` heaviest items of ``w`` ``float[B, n]`` (the first on
    ties; none without ``num_ranks``)."""
    num_rows, n = w.shape
    is_hot = np.zeros((num_rows, n), dtype=bool)
    hot = np.broadcast_to(np.asarray(hot, dtype=np.int64), (num_rows,))
    if num_ranks is not None and hot.any():
        np.put_along_axis(is_hot, desc_order(w), np.arange(n) < hot[:, None], axis=1)
    return is_hot


def balanced_pack(w: np.ndarray, key: np.ndarray | None, num_keys: int, num_packs: int, cap: int) -> np.ndarray:
    """EPLB ``balanced_packing`` with the no-duplicate rule: items ``float[B, n]``
    (``n == num_packs * cap``), heaviest first (stable), each to the lightest pack with room
    (first on ties) that holds no item of the same ``key`` (``int[B, n]`` in [0, num_keys)) if
    there is one. Returns ``int[B, num_packs, cap]`` item indices in packing order."""
    num_rows, n = w.shape
    assert n == num_packs * cap
    if cap == 1:  # the reference's shortcut: item i is pack i
        return np.broadcast_to(np.arange(n).reshape(1, n, 1), (num_rows, n, 1)).copy()
    order = desc_order(w)
    # per step t, every row's item (rows of the transposed arrays are contiguous)
    w_t = np.ascontiguousarray(np.take_along_axis(w, order, axis=1).T)
    # a pack's load (float32 sums for the exact reference), inf once it is full: the cost of
    # putting the next item there; flat [B * num_packs] so that a step reads it with one index
    compiled = jit.kernel("pack_kernel", num_rows * n, _JIT_FROM) if w.dtype in (np.float32, np.float64) else None
    if compiled is not None:
        key_t = np.zeros((1, 1), dtype=np.int64) if key is None else np.take_along_axis(key, order, axis=1).T
        steps = np.empty((num_rows, num_packs, cap), dtype=np.int64)
        first_fill = bool((w_t[: num_packs - 1] > 0).all())
        compiled.greedy_pack(
            w_t,
            np.ascontiguousarray(key_t, dtype=np.int64),
            key is not None,
            num_keys,
            num_packs,
            cap,
            first_fill,
            steps,
        )
        return np.take_along_axis(order, steps.reshape(num_rows, -1), axis=1).reshape(num_rows, num_packs, cap)
    cost = np.zeros(num_rows * num_packs, dtype=w.dtype)
    filled = np.zeros(num_rows * num_packs, dtype=np.int64)
    base = np.arange(num_rows) * num_packs
    # pack of each step's item (small ints: the stable sort by pack at the end is a radix sort)
    dest = np.empty((n, num_rows), dtype=np.int16 if num_packs < 2**15 else np.int64)
    if key is not None:
        key_t = np.ascontiguousarray(np.take_along_axis(key, order, axis=1).T) + (np.arange(num_rows) * num_keys)
        # inf where the pack holds an item of the key, else 0: added to the costs (cheaper than
        # a masked choice)
        held = np.zeros((num_rows * num_keys, num_packs), dtype=w.dtype)
        held_f = held.reshape(-1)
    # added to a pack's cost as it takes its i-th item: inf once full
    full = np.zeros(cap + 1, dtype=w.dtype)
    full[cap:] = np.inf
    cost2 = cost.reshape(num_rows, num_packs)
    start = 0
    if (w_t[: num_packs - 1] > 0).all():
        # item t < num_packs goes to pack t: the packs with an item are heavier than the empty
        # ones, and an empty pack holds no key (no pack is full yet: cap >= 2)
        start = num_packs
        dest[:start] = np.arange(start)[:, None]
        cost2[:] = w_t[:start].T
        filled[:] = 1
        if key is not None:
            held_f[key_t[:start] * num_packs + np.arange(start)[:, None]] = np.inf
    for t in range(start, n):
        if key is not None:
            e = key_t[t]
            strict = held[e] + cost2
            k = strict.argmin(axis=1)
            stuck = np.isinf(strict.reshape(-1)[base + k])
            if stuck.any():  # every pack with room holds it: the repair deals with it
                k[stuck] = cost2[stuck].argmin(axis=1)
            held_f[e * num_packs + k] = np.inf
        else:
            k = cost2.argmin(axis=1)
        dest[t] = k
        kf = base + k
        at = filled[kf] + 1
        filled[kf] = at
        cost[kf] = cost[kf] + w_t[t] + full[at]
    # each pack's items in packing order: the steps sorted by pack (stable)
    by_pack = np.argsort(dest.T, axis=1, kind="stable")
    return np.take_along_axis(order, by_pack, axis=1).reshape(num_rows, num_packs, cap)


def per_rank_cap(cnt: np.ndarray, num_live: np.ndarray) -> np.ndarray:
    """``int[B, E]``: most copies of an expert one rank may hold (1 unless it has more copies
    than there are live ranks)."""
    live = np.broadcast_to(num_live[:, None], cnt.shape)
    out = np.ones(cnt.shape, dtype=np.result_type(cnt, num_live))
    more = cnt > live  # few: an integer division of the rest is slow and gives 1
    out[more] = -(-cnt[more] // live[more])
    return out


def occurrence(x: np.ndarray) -> np.ndarray:
    """``int[..., S]``: how many earlier slots of the same rank hold the same expert."""
    s = x.shape[-1]
    earlier = np.tril(np.ones((s, s), dtype=bool), -1)
    return ((x[..., :, None] == x[..., None, :]) & earlier).sum(-1)


def repair_duplicates(slots: np.ndarray, wc: np.ndarray, cap: np.ndarray) -> None:
    """Swap repair, in place: while a rank holds more than ``cap`` copies of an expert, swap
    one copy with the copy of closest per-copy load on another rank, when the swap breaks no
    cap. ``slots`` ``int[B, K, S]`` expert ids (-1 empty), ``wc``/``cap`` ``[B, E]``."""
    compiled = jit.kernel("pack_kernel", slots.size, _JIT_FROM)
    if (
        compiled is not None
        and slots.dtype == np.int64
        and slots.flags.c_contiguous
        and wc.dtype == np.float64
        and slots.size
        and compiled.repair_duplicates(slots, np.ascontiguousarray(wc), np.ascontiguousarray(cap, dtype=np.int64))
    ):
        return
    num_experts = wc.shape[1]
    x = np.maximum(slots, 0)
    b_idx = np.arange(slots.shape[0])[:, None, None]
    bad = (slots >= 0) & (occurrence(slots) >= cap[b_idx, x])
    for b in np.unique(np.nonzero(bad)[0]):
        row = slots[b]
        for _ in range(row.size):  # each swap removes a violation; bounded anyway
            xr = np.maximum(row, 0)
            viol = np.argwhere((row >= 0) & (occurrence(row) >= cap[b, xr]))
            if not len(viol):
                break
            counts = count_last(row, num_experts)
            done = False
            for k, s in viol:
                e = row[k, s]
                f = row
                ok = (f >= 0) & (f != e) & (counts[:, e] < cap[b, e])[:, None]
                ok &= counts[k, np.maximum(f, 0)] < cap[b, np.maximum(f, 0)]
                ok[k] = False
                if not ok.any():
                    continue
                d = np.where(ok, np.abs(wc[b, np.maximum(f, 0)] - wc[b, e]), np.inf)
                k2, s2 = np.unravel_index(d.argmin(), d.shape)
                row[k, s], row[k2, s2] = row[k2, s2], e
                done = True
                break
            if not done:  # unavoidable
                break


def _node_experts(group_node: np.ndarray, group_load: np.ndarray, num_nodes: int, group_size: int) -> np.ndarray:
    """``int[L, N, E/N]``: each node's experts, groups in packing order (heaviest first, the
    reference's ``rank_in_pack`` order) and experts in id order within a group."""
    num_layers, num_groups = group_node.shape
    gid = np.broadcast_to(np.arange(num_groups), group_node.shape)
    order = np.lexsort((gid, -group_load, group_node), axis=-1)
    experts = order[..., None] * group_size + np.arange(group_size)
    return experts.reshape(num_layers, num_nodes, -1)


# -- the oblivious policy ------------------------------------------------------------------------


@dataclass(frozen=True)
class ObliviousAnswer:
    """An answer of the oblivious policy (or the reference's). ``packs``:
    ``int[L, N, live_per_node, S]`` expert ids (pack k of node n goes to live rank k of node
    n); ``group_node``: ``int[L, G]``; ``cnt``: ``int[L, E]``; ``phy2log``: ``int[L, R, S]``;
    ``max_load``: ``float[L]`` heaviest rank; ``node_max``: ``float[L]`` heaviest node."""

    packs: np.ndarray
    group_node: np.ndarray
    cnt: np.ndarray
    phy2log: np.ndarray
    max_load: np.ndarray
    node_max: np.ndarray


def group_loads(w: np.ndarray, sh: Shape) -> np.ndarray:
    return w.reshape(w.shape[0], sh.num_groups, -1).sum(-1)


def replicate_nodes(w: np.ndarray, group_node: np.ndarray, sh: Shape, spread: bool = False):
    """Replicas within each node (``spread``: moeshard's spread counts, see :func:`replicate_experts`).
    Returns ``mlog2log`` ``int[L*N, E/N]``, ``phy2m`` ``int[L*N, P_node]`` (node-local expert
    index per copy), ``mcnt`` ``int[L*N, E/N]``, ``cnt`` ``int[L, E]``."""
    num_layers, num_logical = w.shape
    n = sh.num_nodes
    gl = group_loads(w, sh)
    mlog2log = _node_experts(group_node, gl, n, num_logical // sh.num_groups).reshape(num_layers * n, -1)
    w_m = np.take_along_axis(np.repeat(w, n, axis=0), mlog2log, axis=1)
    phy2m, mcnt = replicate_experts(w_m, sh.live_per_node * sh.slots_per_rank, sh.live_per_node if spread else None)
    cnt = np.zeros((num_layers, num_logical), dtype=np.int64)
    np.put_along_axis(cnt, mlog2log.reshape(num_layers, -1), mcnt.reshape(num_layers, -1), axis=1)
    return mlog2log, phy2m, mcnt, cnt


def scatter_packs(packs: np.ndarray, sh: Shape, rank_of_pack: np.ndarray | None = None) -> np.ndarray:
    """``packs`` ``int[L, N, live_per_node, S]`` -> ``phy2log`` ``int[L, R, S]``. Pack k of node
    n goes to node-local rank ``rank_of_pack[l, n, k]`` (default: the node's k-th live rank)."""
    num_layers = packs.shape[0]
    n, rpn, s = sh.num_nodes, sh.ranks_per_node, sh.slots_per_rank
    out = np.full((num_layers, n, rpn, s), -1, dtype=np.int64)
    if rank_of_pack is None:
        rank_of_pack = np.broadcast_to(sh.node_alive, packs.shape[:3])
    li = np.arange(num_layers)[:, None, None]
    ni = np.arange(n)[None, :, None]
    out[li, ni, rank_of_pack] = packs
    return out.reshape(num_layers, sh.num_ranks, s)


def node_packs(
    w: np.ndarray, group_node: np.ndarray, sh: Shape, no_duplicates: bool, spread: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Steps 2 and 3 for a given ``group_node`` ``int[L, G]``: replicas within each node
    (``spread``: moeshard's spread counts), then balanced packing of the copies onto the node's
    live ranks (``no_duplicates``: with moeshard's rule, before the repair). Returns packs
    ``int[L*N, live_per_node, S]`` and ``cnt`` ``int[L, E]``."""
    packs, cnt, _, _ = _node_packs_parts(w, group_node, sh, no_duplicates, spread)
    return packs, cnt


def _node_packs_parts(w: np.ndarray, group_node: np.ndarray, sh: Shape, no_duplicates: bool, spread: bool = False):
    """:func:`node_packs`, and besides the copies ``phy2m`` ``int[L*N, P_node]`` (node-local
    expert per copy, :func:`replicate_nodes`) and the packing ``int[L*N, live * S]`` (copy
    indices), so that a packing of the same copies need not be made again."""
    num_layers = w.shape[0]
    n, s, live = sh.num_nodes, sh.slots_per_rank, sh.live_per_node
    mlog2log, phy2m, mcnt, cnt = replicate_nodes(w, group_node, sh, spread)
    w_m = np.take_along_axis(np.repeat(w, n, axis=0), mlog2log, axis=1)
    w_phy = np.take_along_axis((w_m / mcnt).astype(w.dtype), phy2m, axis=1)
    slots = balanced_pack(w_phy, phy2m if no_duplicates else None, mlog2log.shape[1], live, s)
    slots = slots.reshape(num_layers * n, -1)
    packs_m = np.take_along_axis(phy2m, slots, axis=1)
    packs = np.take_along_axis(mlog2log, packs_m, axis=1).reshape(num_layers * n, live, s)
    return packs, cnt, phy2m, slots


def groups_to_nodes(w: np.ndarray, sh: Shape) -> np.ndarray:
    """Step 1, ``int[L, G]`` node of each expert group: the reference's ``balanced_packing`` of
    the group loads onto the nodes, ``G / N`` groups each."""
    num_layers = w.shape[0]
    n = sh.num_nodes
    group_node = np.zeros((num_layers, sh.num_groups), dtype=np.int64)
    if n > 1:
        gslots = balanced_pack(group_loads(w, sh), None, 0, n, sh.num_groups // n)
        np.put_along_axis(
            group_node, gslots.reshape(num_layers, -1), np.repeat(np.arange(n), sh.num_groups // n)[None, :], axis=1
        )
    return group_node


def _answer(w: np.ndarray, sh: Shape, packs: np.ndarray, group_node: np.ndarray, cnt: np.ndarray) -> ObliviousAnswer:
    """The :class:`ObliviousAnswer` of ``packs`` ``int[L*N, live_per_node, S]`` (groups
    ``group_node`` ``int[L, G]``, replica counts ``cnt`` ``int[L, E]``), loads of ``w``."""
    num_layers = w.shape[0]
    n = sh.num_nodes
    packs = packs.reshape(num_layers, n, sh.live_per_node, sh.slots_per_rank)
    p2l = scatter_packs(packs, sh)
    node_max = node_loads(w, sh, group_node).max(1)
    return ObliviousAnswer(packs, group_node, cnt, p2l, max_rank_load(w, p2l, cnt), node_max)


def node_loads(w: np.ndarray, sh: Shape, group_node: np.ndarray) -> np.ndarray:
    """``float[L, N]``: each node's load, the loads ``w`` ``float[L, E]`` of the groups
    ``group_node`` ``int[L, G]`` puts on it."""
    gl = group_loads(w, sh)
    return (gl[:, :, None] * (group_node[:, :, None] == np.arange(sh.num_nodes))).sum(1)


def reference_answer(w: np.ndarray, sh: Shape) -> ObliviousAnswer:
    """The reference's own answer: no "never two copies of an expert on a rank" rule, no
    repair, and its float32 arithmetic, so that near-ties of sums and per-copy loads break as
    they do in ``eplb.py``."""
    # eplb.py decides in float32 (``weight.float()``); float64 results of one division or
    # addition rounded to float32 are the float32 results, so keeping the arrays float32 suffices.
    wd = w.astype(np.float32)
    group_node = groups_to_nodes(wd, sh)
    packs, cnt = node_packs(wd, group_node, sh, no_duplicates=False)
    return _answer(w, sh, packs, group_node, cnt)


def _refined(
    w: np.ndarray, sh: Shape, packs: np.ndarray, group_node: np.ndarray, cnt: np.ndarray, no_duplicates: bool
) -> ObliviousAnswer:
    """``packs`` ``int[L*N, live_per_node, S]`` after the swap local search
    (:func:`moeshard.eplb.refine.lower_peak`): each layer's heaviest rank never rises.
    ``no_duplicates``: moeshard's rule (:func:`per_rank_cap`), the swap repair first and no
    swap that breaks it; else no rank takes more copies of an expert than the rule and
    ``packs``' fullest rank for that expert allow (the search adds no duplicate of its own)."""
    return _refined_many(sh, [(w, packs, group_node, cnt, no_duplicates)])[0]


def _refined_many(sh: Shape, items: list) -> list[ObliviousAnswer]:
    """:func:`_refined` of each ``(w, packs, group_node, cnt, no_duplicates)`` of ``items``, in
    one search (rows are independent: the same answers, fewer rounds of the search's loop)."""
    prepared = []
    for w, packs, _, cnt, no_duplicates in items:
        num_layers = w.shape[0]
        n, live = sh.num_nodes, sh.live_per_node
        packs = packs.copy()
        wc = load_per_copy(w, cnt)
        cap = per_rank_cap(cnt, np.full(num_layers, live))
        if no_duplicates:
            repair_duplicates(packs, np.repeat(wc, n, axis=0), np.repeat(cap, n, axis=0))
        else:
            per_rank = count_last(packs.reshape(num_layers, n * live, -1), cnt.shape[1])[..., :-1]
            cap = np.maximum(cap, per_rank.max(1))
        prepared.append((packs.reshape(num_layers, n, live, sh.slots_per_rank), wc, cap))
    packs = np.concatenate([p for p, _, _ in prepared])
    wc = np.concatenate([c for _, c, _ in prepared])
    cap = np.concatenate([c for _, _, c in prepared])
    # a row that starts as the first item's row of the same index (often a layer's plain
    # candidate and the reference's answer) ends as it: searched once
    n0 = len(prepared[0][0])
    twin = np.full(len(packs), -1)
    at = n0
    for p, c, k in prepared[1:]:
        m = min(len(p), n0)
        same = (p[:m] == packs[:m]).all((1, 2, 3)) & (c[:m] == wc[:m]).all(1) & (k[:m] == cap[:m]).all(1)
        twin[at : at + m][same] = np.flatnonzero(same)
        at += len(p)
    own = np.flatnonzero(twin < 0)
    sub = packs[own]
    lower_peak(sub, wc[own], cap[own])
    packs[own] = sub
    packs[twin >= 0] = packs[twin[twin >= 0]]
    out, at = [], 0
    for w, _, group_node, cnt, _ in items:
        out.append(_answer(w, sh, packs[at : at + len(w)].reshape(-1, *packs.shape[2:]), group_node, cnt))
        at += len(w)
    return out


def _keeps_rule(o: ObliviousAnswer, sh: Shape) -> np.ndarray:
    """``bool[L]``: no rank of ``o`` holds more copies of an expert than moeshard's rule
    allows (:func:`per_rank_cap`)."""
    num_layers, num_logical = o.cnt.shape
    per_rank = count_last(o.packs.reshape(num_layers, -1, sh.slots_per_rank), num_logical)[..., :num_logical]
    cap = per_rank_cap(o.cnt, np.full(num_layers, sh.live_per_node))
    return (per_rank <= cap[:, None, :]).all((1, 2))


# Hot-spread counts (:func:`replicate_experts`) are tried for this many of a node's heaviest experts
# (0: spread counts).
_HOT = (0, 1, 2, 3, 4)
# ... on the nodes whose spread counts' packing is this far (relative) over the node's mean rank
# load: closer, no count can gain more.
_GAIN = 1e-3


def _with_layers(base: ObliviousAnswer, layers: np.ndarray, sub: ObliviousAnswer) -> ObliviousAnswer:
    """``base`` with its ``layers`` ``int[M]`` replaced by ``sub``'s (``M`` layers)."""
    fields = []
    for f in ObliviousAnswer.__dataclass_fields__:
        a = getattr(base, f).copy()
        a[layers] = getattr(sub, f)
        fields.append(a)
    return ObliviousAnswer(*fields)


def _hot_variants(w: np.ndarray, num_phy: int, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`replicate_experts` of ``w`` ``float[B, n]`` with spread counts and each ``hot`` in
    ``_HOT``: ``phy2item`` ``int[V*B, num_phy]`` and ``cnt`` ``int[V*B, n]``, variant ``v`` of
    row ``r`` in row ``v * B + r``. A variant whose ``hot`` heaviest items end with at most
    ``num_ranks`` copies together with ``hot=0`` is ``hot=0``'s: the limit never closed them to
    a slot they would take (it closes them only once they have that many), so every slot goes
    where it goes without it."""
    num_b, n = w.shape
    phy0, cnt0 = replicate_experts(w, num_phy, num_ranks)
    hot = np.repeat(_HOT, num_b)
    row = np.tile(np.arange(num_b), len(_HOT))
    order = desc_order(w)
    top = np.cumsum(np.take_along_axis(cnt0, order, axis=1), axis=1)  # copies of the h heaviest
    differ = np.flatnonzero((hot > 0) & (top[row, np.clip(hot, 1, n) - 1] > num_ranks))
    phy, cnt = np.tile(phy0, (len(_HOT), 1)), np.tile(cnt0, (len(_HOT), 1))
    if len(differ):
        phy[differ], cnt[differ] = replicate_experts(w[row[differ]], num_phy, num_ranks, hot[differ])
    return phy, cnt


def _hot_spread(
    w: np.ndarray, sh: Shape, group_node: np.ndarray, plain_cnt: np.ndarray, plain_parts: tuple | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The candidate with hot-spread replica counts, before refinement, with moeshard's rule:
    per node, the counts of :func:`replicate_experts` with ``hot`` in ``_HOT`` whose balanced
    packing has the lightest heaviest rank (nodes are independent once their groups are fixed;
    a variant whose counts are those of ``hot=0`` is not packed again). ``plain_parts``: the
    copies ``phy2m`` and packing ``slots`` of the candidate with the reference's counts
    (:func:`_node_packs_parts`); a node whose ``hot=0`` copies are those is not packed again
    either (the same copies pack the same). Returns the layers ``int[M]`` whose counts differ
    from ``plain_cnt`` ``int[L, E]`` and, for them, packs ``int[M*N, live_per_node, S]`` and
    counts ``int[M, E]``."""
    num_layers, num_e = w.shape
    n, live, s = sh.num_nodes, sh.live_per_node, sh.slots_per_rank
    rows = num_layers * n
    mlog2log = _node_experts(group_node, group_loads(w, sh), n, num_e // sh.num_groups).reshape(rows, -1)
    w_m = np.take_along_axis(np.repeat(w, n, axis=0), mlog2log, axis=1)  # [L*N, E/N]
    num_v = len(_HOT)
    phy2m, mcnt = _hot_variants(w_m, live * s, live)
    # variant v of node row r is row v * rows + r: variant 0 first, then the variants that differ
    # from it on the rows where variant 0's heaviest rank is over the node's mean by _GAIN
    peak_full = np.full(num_v * rows, np.inf)
    packs_full = np.zeros((num_v * rows, live, s), dtype=np.int64)

    def peaks(idx, w_phy, slots):
        packs_full[idx] = np.take_along_axis(phy2m[idx], slots, axis=1).reshape(len(idx), live, s)
        peak_full[idx] = np.take_along_axis(w_phy, slots, axis=1).reshape(len(idx), live, s).sum(-1).max(-1)

    def w_phy_of(idx):
        return np.take_along_axis(np.tile(w_m, (num_v, 1))[idx] / mcnt[idx], phy2m[idx], axis=1)

    def pack(idx):
        w_phy = w_phy_of(idx)
        peaks(idx, w_phy, balanced_pack(w_phy, phy2m[idx], mlog2log.shape[1], live, s).reshape(len(idx), -1))

    first = np.arange(rows)
    if plain_parts is not None:
        plain_phy2m, plain_slots = plain_parts
        same = (phy2m[:rows] == plain_phy2m).all(1)
        if same.any():
            idx = first[same]
            peaks(idx, w_phy_of(idx), plain_slots[same])
        first = first[~same]
    if len(first):
        pack(first)
    over = peak_full[:rows] > w_m.sum(1) / live * (1 + _GAIN)
    differ = (mcnt[rows:] != np.tile(mcnt[:rows], (num_v - 1, 1))).any(1) & np.tile(over, num_v - 1)
    if differ.any():
        pack(rows + np.flatnonzero(differ))
    # per node row, the variant of the lightest peak (the first on ties)
    cand = peak_full.reshape(num_v, rows)
    v = np.zeros(rows, dtype=np.int64)
    best = cand[0].copy()
    for k in range(1, num_v):
        better = cand[k] < best * (1 - _TIE)
        v[better], best[better] = k, cand[k][better]
    sel = v * rows + np.arange(rows)
    packs = np.take_along_axis(mlog2log, packs_full[sel].reshape(rows, -1), axis=1).reshape(rows, live, s)
    cnt = np.zeros((num_layers, num_e), dtype=np.int64)
    chosen = mcnt[sel]
    np.put_along_axis(cnt, mlog2log.reshape(num_layers, -1), chosen.reshape(num_layers, -1), axis=1)
    layers = np.flatnonzero((cnt != plain_cnt).any(1))
    packs = packs.reshape(num_layers, n, live, s)[layers].reshape(-1, live, s)
    return layers, packs, cnt[layers]


# A candidate replaces an earlier one only if its heaviest rank is lighter by this relative
# margin (two sums of the same copies in another order differ by a few ulps): the earlier
# candidates keep moeshard's rule.
_TIE = 1e-13


def _most_balanced(cands: list[ObliviousAnswer], allowed: np.ndarray) -> np.ndarray:
    """``int[L]``: per layer, the candidate of the lightest heaviest rank among the
    ``allowed`` ones ``bool[C, L]`` (the first, up to ``_TIE``; -1 where none is allowed)."""
    pick = np.full(allowed.shape[1], -1, dtype=np.int64)
    best = np.full(allowed.shape[1], np.inf)
    for i, c in enumerate(cands):
        better = allowed[i] & (c.max_load < best * (1 - _TIE))
        pick[better], best[better] = i, c.max_load[better]
    return pick


def _select(cands: list[ObliviousAnswer], pick: np.ndarray) -> ObliviousAnswer:
    """Layer ``l`` of candidate ``pick[l]``, for every layer."""
    li = np.arange(len(pick))
    fields = ObliviousAnswer.__dataclass_fields__
    return ObliviousAnswer(*[np.stack([getattr(c, f) for c in cands])[pick, li] for f in fields])


def group_packs(w: np.ndarray, sh: Shape, group_node: np.ndarray, limit: np.ndarray | None = None) -> np.ndarray:
    """For the groups ``group_node`` ``int[L, G]``, per node the most balanced of the
    reference's steps 2 and 3 with its counts, with spread counts and with hot-spread counts
    (:func:`_hot_spread`: where a drifted hot expert needs more copies than the reference's
    counts give it, a node near its ranks' capacity fits only with them), each refined
    without moeshard's rule (the migration-aware policy's fallback packing; nodes are
    independent once their groups are fixed). With ``limit`` ``float[L]``, hot-spread counts
    only on the layers where a node's lighter of the first two is over it. Returns packs
    ``int[L, N, live_per_node, S]``."""
    num_layers, n = w.shape[0], sh.num_nodes
    items = []
    for spread in (False, True):
        packs, cnt = node_packs(w, group_node, sh, no_duplicates=False, spread=spread)
        items.append((w, packs, group_node, cnt, False))
    cands = _refined_many(sh, items)
    packs = np.stack([c.packs.reshape(num_layers, n, sh.live_per_node, -1) for c in cands])
    peaks = np.stack([_node_peaks(w, c) for c in cands])  # [C, L, N]
    rows = np.arange(num_layers)
    if limit is not None:
        rows = np.flatnonzero((peaks.min(0) > limit[:, None]).any(1))
    if len(rows):
        hot_layers, hot_packs, hot_cnt = _hot_spread(w[rows], sh, group_node[rows], items[1][3][rows])
        if len(hot_layers):
            layers = rows[hot_layers]
            (hot_ans,) = _refined_many(sh, [(w[layers], hot_packs, group_node[layers], hot_cnt, False)])
            hot = packs[1].copy()
            hot[layers] = hot_ans.packs.reshape(len(layers), n, sh.live_per_node, -1)
            hot_peak = np.full((num_layers, n), np.inf)
            hot_peak[layers] = _node_peaks(w[layers], hot_ans)
            packs, peaks = np.concatenate([packs, hot[None]]), np.concatenate([peaks, hot_peak[None]])
    # per node the lightest heaviest rank, the first candidate on ties (up to _TIE)
    pick = np.zeros((num_layers, n), dtype=np.int64)
    best = peaks[0].copy()
    for i in range(1, len(peaks)):
        better = peaks[i] < best * (1 - _TIE)
        pick[better], best[better] = i, peaks[i][better]
    return packs[pick, np.arange(num_layers)[:, None], np.arange(n)[None, :]]


def _node_peaks(w: np.ndarray, ans: ObliviousAnswer) -> np.ndarray:
    """``float[L, N]``: the heaviest rank of each node of ``ans`` under the loads ``w``."""
    num_layers, n, live, s = ans.packs.shape
    loads = slot_sums(load_per_copy(w, ans.cnt), ans.packs.reshape(num_layers, n * live, s))
    return loads.reshape(num_layers, n, live).max(-1)


def oblivious_policy(w: np.ndarray, sh: Shape, ref: ObliviousAnswer | None = None) -> ObliviousAnswer:
    """moeshard's oblivious policy (module docstring). Per layer, the most balanced answer
    that keeps moeshard's rule among: deepseek-ai/EPLB's steps with the rule, the same with
    per node the lightest of spread and hot-spread replica counts (both in float64), and the
    reference's answer ``ref`` (computed when None), each refined (:func:`_refined`); where
    none of them is at least as balanced as the reference, the refined reference (its
    duplicates, if any, kept): never less balanced than the reference, by construction."""
    ref = reference_answer(w, sh) if ref is None else ref
    group_node = groups_to_nodes(w, sh)
    packs, cnt, phy2m, slots = _node_packs_parts(w, group_node, sh, no_duplicates=True)
    num_layers = w.shape[0]
    hot_layers, hot_packs, hot_cnt = _hot_spread(w, sh, group_node, cnt, (phy2m, slots))
    ref_packs = ref.packs.reshape(num_layers * sh.num_nodes, sh.live_per_node, -1)
    items = [(w, packs, group_node, cnt, True), (w, ref_packs, ref.group_node, ref.cnt, False)]
    if len(hot_layers):
        items.append((w[hot_layers], hot_packs, group_node[hot_layers], hot_cnt, True))
    plain, ref_refined, *hot = _refined_many(sh, items)
    hot = _with_layers(plain, hot_layers, hot[0]) if len(hot_layers) else plain
    cands = [plain, hot, ref_refined]
    allowed = np.ones((len(cands), num_layers), dtype=bool)
    allowed[2] = _keeps_rule(ref_refined, sh)
    pick = _most_balanced(cands, allowed)
    # the rule yields where keeping it is less balanced than the reference
    lose = (pick < 0) | (np.stack([c.max_load for c in cands])[pick, np.arange(num_layers)] > ref.max_load * (1 + _TIE))
    pick[lose] = 2
    return _select(cands, pick)
