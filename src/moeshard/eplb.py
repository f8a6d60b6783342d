"""Expert-parallel load balancing (EPLB): where each logical expert's copies should live.

Pure numpy, no torch, no communication: every rank computes the same answer from the same
``load`` (tokens routed to each logical expert, ``float[num_layers, num_logical]``).

Policies
--------
*Oblivious* (``migration_aware=False``) re-implements deepseek-ai/EPLB (``eplb.py``):

1. **hierarchical** (``num_groups`` given, ``num_groups % num_nodes == 0`` and every node has
   the same number of live ranks): pack expert *groups* onto nodes with ``balanced_packing``
   (heaviest group first, onto the lightest node that still has room; every node gets
   ``num_groups / num_nodes`` groups), so that a token's group-limited routing stays on few
   nodes; then, within each node, ``replicate_experts`` (each redundant slot goes to the
   expert with the highest load per copy) and ``balanced_packing`` of the copies (per-copy load
   ``load / count``) onto the node's live ranks, ``slots_per_rank`` copies each.
2. **global** otherwise: the same with one group and one node.

Pack ``k`` of a node goes to the node's ``k``-th live rank, its copies in packing order (as the
reference does). One rule is added to the reference: a rank never holds two copies of one
expert when it can be avoided (the greedy skips ranks that hold the expert, and a swap repair
fixes the rare dead end). Slots of dead (or not yet joined) ranks are ``-1``; slot ids stay
those of the full job, so an elastic job never renumbers.

*Migration-aware* (``migration_aware=True`` and a current placement): the oblivious answer
ignores where experts already are, so a rebalance after a small drift of the load can move
almost every copy. This policy reaches the oblivious policy's balance (per layer, max/mean rank
load within ``tolerance``, default 1 %) while moving few copies. Per layer:

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
  moves first);
* candidates: the sticky result; where it misses ``T``, the reference's greedy with a
  preference for the expert's old ranks ("sticky LPT"), and (hierarchical) both of these
  under the oblivious node assignment; the oblivious packs matched to ranks by greedy maximum
  overlap (nodes first); the oblivious placement itself. Each layer takes the candidate with
  the fewest moved copies among those within the tolerance; the last two always are, so the
  balance is guaranteed and the aware policy never moves more copies than the oblivious one.

In every candidate an expert that stays on a rank keeps its slot index; newcomers fill the
freed slots in order.

Metrics: :func:`rank_loads`, :func:`balance`, :func:`copies_moved`, :func:`slots_changed`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .placement import Placement

__all__ = ["rebalance", "rank_loads", "balance", "copies_moved", "slots_changed"]

# Relative slack of float comparisons against a load threshold.
_EPS = 1e-9


# -- validation -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    """Validated problem shape. ``node_alive``: ``int[num_nodes_used, live_per_node]`` rank ids
    (node-local index) of each used node's live ranks, in rank order."""

    num_layers: int
    num_logical: int
    num_physical: int
    num_ranks: int
    slots_per_rank: int
    active: np.ndarray  # bool[num_ranks]
    hierarchical: bool
    num_nodes: int  # nodes used by the policy (1 for global)
    num_groups: int  # groups used by the policy (1 for global)
    node_alive: np.ndarray

    @property
    def ranks_per_node(self) -> int:
        return self.num_ranks // self.num_nodes

    @property
    def live_per_node(self) -> int:
        return int(self.node_alive.shape[1])


def _check_load(load) -> np.ndarray:
    w = np.asarray(load)
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"load must be float[num_layers, num_logical], got shape {w.shape}")
    if w.dtype == bool or not (np.issubdtype(w.dtype, np.integer) or np.issubdtype(w.dtype, np.floating)):
        raise ValueError(f"load must hold numbers of tokens, got dtype {w.dtype}")
    w = w.astype(np.float64)
    if not np.isfinite(w).all():
        layer, expert = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"load[{layer}, {expert}] = {w[layer, expert]} is not finite")
    if (w < 0).any():
        layer, expert = np.argwhere(w < 0)[0]
        raise ValueError(f"load[{layer}, {expert}] = {w[layer, expert]} is negative")
    return w


def _check_active(active_ranks, num_ranks: int) -> np.ndarray:
    if active_ranks is None:
        return np.ones(num_ranks, dtype=bool)
    a = np.asarray(active_ranks)
    if a.shape != (num_ranks,):
        raise ValueError(f"active_ranks must be bool[num_ranks={num_ranks}], got shape {a.shape}")
    if a.dtype != bool:
        if not np.isin(a, (0, 1)).all():
            raise ValueError("active_ranks must hold booleans (or 0/1)")
        a = a.astype(bool)
    if not a.any():
        raise ValueError("active_ranks: all ranks are dead; no rank can hold an expert")
    return a


def _shape(w: np.ndarray, num_physical, num_ranks, num_nodes, num_groups, active_ranks) -> _Shape:
    num_layers, num_logical = w.shape
    for name, v in (("num_physical", num_physical), ("num_ranks", num_ranks), ("num_nodes", num_nodes)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    num_physical, num_ranks, num_nodes = int(num_physical), int(num_ranks), int(num_nodes)
    if num_physical % num_ranks:
        raise ValueError(f"num_physical={num_physical} slots per layer is not divisible by num_ranks={num_ranks}")
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks={num_ranks} is not divisible by num_nodes={num_nodes}")
    if num_groups is not None:
        if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
            raise ValueError(f"num_groups must be a positive integer or None, got {num_groups!r}")
        if num_groups % num_nodes == 0 and num_logical % num_groups:  # the hierarchical policy needs it
            raise ValueError(f"num_logical={num_logical} experts cannot form num_groups={num_groups} equal groups")
    active = _check_active(active_ranks, num_ranks)
    spr = num_physical // num_ranks
    live_slots = int(active.sum()) * spr
    if live_slots < num_logical:
        raise ValueError(
            f"{int(active.sum())} live rank(s) x {spr} slots = {live_slots} live slots cannot hold "
            f"num_logical={num_logical} experts (each needs at least one copy)"
        )
    per_node = active.reshape(num_nodes, -1)
    hier = (
        num_groups is not None
        and num_groups % num_nodes == 0
        and bool((per_node.sum(1) == per_node.sum(1)[0]).all())
    )
    nodes, groups = (num_nodes, int(num_groups)) if hier else (1, 1)
    alive = active.reshape(nodes, -1)
    node_alive = np.stack([np.flatnonzero(row) for row in alive])
    return _Shape(num_layers, num_logical, num_physical, num_ranks, spr, active, hier, nodes, groups, node_alive)


# -- the reference's building blocks, vectorized over rows ---------------------------------------


def _replicate(w: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray]:
    """EPLB ``replicate_experts``: ``w`` ``float[B, n]`` -> ``phy2item`` ``int[B, num_phy]``
    (slot i < n holds item i; each further slot the item with the highest load per copy, first
    on ties) and ``cnt`` ``int[B, n]``."""
    num_rows, n = w.shape
    assert num_phy >= n
    phy = np.empty((num_rows, num_phy), dtype=np.int64)
    phy[:, :n] = np.arange(n)
    cnt = np.ones((num_rows, n), dtype=np.int64)
    per_copy = w.copy()
    rows = np.arange(num_rows)
    for i in range(n, num_phy):
        j = per_copy.argmax(axis=1)
        phy[:, i] = j
        cnt[rows, j] += 1
        per_copy[rows, j] = w[rows, j] / cnt[rows, j]
    return phy, cnt


def _pack(w: np.ndarray, key: np.ndarray | None, num_keys: int, num_packs: int, cap: int) -> np.ndarray:
    """EPLB ``balanced_packing`` with the no-duplicate rule: items ``float[B, n]``
    (``n == num_packs * cap``), heaviest first (stable), each to the lightest pack with room
    (first on ties) that holds no item of the same ``key`` (``int[B, n]`` in [0, num_keys)) if
    there is one. Returns ``int[B, num_packs, cap]`` item indices in packing order."""
    num_rows, n = w.shape
    assert n == num_packs * cap
    if cap == 1:  # the reference's shortcut: item i is pack i
        return np.broadcast_to(np.arange(n).reshape(1, n, 1), (num_rows, n, 1)).copy()
    order = np.argsort(-w, axis=1, kind="stable")
    rows = np.arange(num_rows)
    pack_w = np.zeros((num_rows, num_packs))
    pack_n = np.zeros((num_rows, num_packs), dtype=np.int64)
    slots = np.full((num_rows, num_packs, cap), -1, dtype=np.int64)
    holds = np.zeros((num_rows, num_packs, num_keys), dtype=bool) if key is not None else None
    for t in range(n):
        i = order[:, t]
        cost = np.where(pack_n >= cap, np.inf, pack_w)
        if holds is not None:
            e = key[rows, i]
            strict = np.where(holds[rows, :, e], np.inf, cost)
            k = strict.argmin(axis=1)
            stuck = np.isinf(strict[rows, k])
            if stuck.any():  # every pack with room holds it: the repair deals with it
                k[stuck] = cost[stuck].argmin(axis=1)
            holds[rows, k, e] = True
        else:
            k = cost.argmin(axis=1)
        slots[rows, k, pack_n[rows, k]] = i
        pack_n[rows, k] += 1
        pack_w[rows, k] += w[rows, i]
    return slots


def _per_rank_cap(cnt: np.ndarray, num_live: np.ndarray) -> np.ndarray:
    """``int[B, E]``: most copies of an expert one rank may hold (1 unless it has more copies
    than there are live ranks)."""
    return np.maximum(1, -(-cnt // num_live[:, None]))


def _count_last(ids: np.ndarray, num: int) -> np.ndarray:
    """``int[..., num + 1]``: occurrences of each id along the last axis of ``ids``
    (``int[..., n]``); ids < 0 count in the last column."""
    lead = ids.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    flat = np.where(ids < 0, num, ids).reshape(rows, -1) + (np.arange(rows) * (num + 1))[:, None]
    return np.bincount(flat.ravel(), minlength=rows * (num + 1)).reshape(*lead, num + 1)


def _occurrence(x: np.ndarray) -> np.ndarray:
    """``int[..., S]``: how many earlier slots of the same rank hold the same expert."""
    s = x.shape[-1]
    earlier = np.tril(np.ones((s, s), dtype=bool), -1)
    return ((x[..., :, None] == x[..., None, :]) & earlier).sum(-1)


def _repair(slots: np.ndarray, wc: np.ndarray, cap: np.ndarray) -> None:
    """Swap repair, in place: while a rank holds more than ``cap`` copies of an expert, swap
    one copy with the copy of closest per-copy load on another rank, when the swap breaks no
    cap. ``slots`` ``int[B, K, S]`` expert ids (-1 empty), ``wc``/``cap`` ``[B, E]``."""
    num_experts = wc.shape[1]
    x = np.maximum(slots, 0)
    b_idx = np.arange(slots.shape[0])[:, None, None]
    bad = (slots >= 0) & (_occurrence(slots) >= cap[b_idx, x])
    for b in np.unique(np.nonzero(bad)[0]):
        row = slots[b]
        for _ in range(row.size):  # each swap removes a violation; bounded anyway
            xr = np.maximum(row, 0)
            viol = np.argwhere((row >= 0) & (_occurrence(row) >= cap[b, xr]))
            if not len(viol):
                break
            counts = _count_last(row, num_experts)
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
class _Oblivious:
    """The reference's answer. ``packs``: ``int[L, N, live_per_node, S]`` expert ids (pack k of
    node n goes to live rank k of node n); ``group_node``: ``int[L, G]``; ``cnt``: ``int[L, E]``;
    ``phy2log``: ``int[L, R, S]``; ``max_load``: ``float[L]`` heaviest rank; ``node_max``:
    ``float[L]`` heaviest node."""

    packs: np.ndarray
    group_node: np.ndarray
    cnt: np.ndarray
    phy2log: np.ndarray
    max_load: np.ndarray
    node_max: np.ndarray


def _group_loads(w: np.ndarray, sh: _Shape) -> np.ndarray:
    return w.reshape(w.shape[0], sh.num_groups, -1).sum(-1)


def _replicate_nodes(w: np.ndarray, group_node: np.ndarray, sh: _Shape):
    """Replicas within each node. Returns ``mlog2log`` ``int[L*N, E/N]``, ``phy2m``
    ``int[L*N, P_node]`` (node-local expert index per copy), ``mcnt`` ``int[L*N, E/N]``,
    ``cnt`` ``int[L, E]``."""
    num_layers, num_logical = w.shape
    n = sh.num_nodes
    gl = _group_loads(w, sh)
    mlog2log = _node_experts(group_node, gl, n, num_logical // sh.num_groups).reshape(num_layers * n, -1)
    w_m = np.take_along_axis(np.repeat(w, n, axis=0), mlog2log, axis=1)
    phy2m, mcnt = _replicate(w_m, sh.live_per_node * sh.slots_per_rank)
    cnt = np.zeros((num_layers, num_logical), dtype=np.int64)
    np.put_along_axis(cnt, mlog2log.reshape(num_layers, -1), mcnt.reshape(num_layers, -1), axis=1)
    return mlog2log, phy2m, mcnt, cnt


def _scatter_packs(packs: np.ndarray, sh: _Shape, rank_of_pack: np.ndarray | None = None) -> np.ndarray:
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


def _oblivious(w: np.ndarray, sh: _Shape) -> _Oblivious:
    num_layers, num_logical = w.shape
    n, s, live = sh.num_nodes, sh.slots_per_rank, sh.live_per_node
    gl = _group_loads(w, sh)
    group_node = np.zeros((num_layers, sh.num_groups), dtype=np.int64)
    if n > 1:  # step 1: groups -> nodes
        gslots = _pack(gl, None, 0, n, sh.num_groups // n)
        np.put_along_axis(group_node, gslots.reshape(num_layers, -1),
                          np.repeat(np.arange(n), sh.num_groups // n)[None, :], axis=1)
    # step 2: replicas within nodes
    mlog2log, phy2m, mcnt, cnt = _replicate_nodes(w, group_node, sh)
    w_m = np.take_along_axis(np.repeat(w, n, axis=0), mlog2log, axis=1)
    w_phy = np.take_along_axis(w_m / mcnt, phy2m, axis=1)
    # step 3: copies -> live ranks of the node
    slots = _pack(w_phy, phy2m, mlog2log.shape[1], live, s)
    packs_m = np.take_along_axis(phy2m, slots.reshape(num_layers * n, -1), axis=1)
    packs = np.take_along_axis(mlog2log, packs_m, axis=1).reshape(num_layers * n, live, s)
    wc = _per_copy(w, cnt)
    _repair(packs, np.repeat(wc, n, axis=0), _per_rank_cap(np.repeat(cnt, n, axis=0), np.full(num_layers * n, live)))
    packs = packs.reshape(num_layers, n, live, s)
    p2l = _scatter_packs(packs, sh)
    node_max = (gl[:, :, None] * (group_node[:, :, None] == np.arange(n))).sum(1).max(1)
    return _Oblivious(packs, group_node, cnt, p2l, _max_rank_load(w, p2l, cnt), node_max)


# -- metrics (internal forms) --------------------------------------------------------------------


def _per_copy(w: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    return np.where(cnt > 0, w / np.maximum(cnt, 1), 0.0)


def _counts(p2l: np.ndarray, num_logical: int) -> np.ndarray:
    """``int[L, E]`` copies per expert of ``p2l`` ``int[L, ...]``."""
    flat = p2l.reshape(p2l.shape[0], -1)
    return _count_last(flat, num_logical)[:, :num_logical]


def _rank_loads3(w: np.ndarray, p2l: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """``p2l`` ``int[L, R, S]`` -> ``float[L, R]``."""
    wc = _per_copy(w, cnt)
    li = np.arange(w.shape[0])[:, None, None]
    return np.where(p2l >= 0, wc[li, np.maximum(p2l, 0)], 0.0).sum(-1)


def _max_rank_load(w, p2l, cnt) -> np.ndarray:
    return _rank_loads3(w, p2l, cnt).max(1)


def _held(p2l: np.ndarray, num_logical: int) -> np.ndarray:
    """``bool[L, R, E]``: rank holds a copy of the expert (``p2l`` ``int[L, R, S]``)."""
    num_layers, num_ranks, _ = p2l.shape
    h = np.zeros((num_layers, num_ranks, num_logical + 1), dtype=bool)
    h[np.arange(num_layers)[:, None, None], np.arange(num_ranks)[None, :, None], np.where(p2l < 0, num_logical, p2l)] = True
    return h[..., :num_logical]


def _moves3(held_old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``int[L]``: copies of ``new`` ``int[L, R, S]`` whose rank did not hold the expert."""
    li = np.arange(new.shape[0])[:, None, None]
    ri = np.arange(new.shape[1])[None, :, None]
    return ((new >= 0) & ~held_old[li, ri, np.maximum(new, 0)]).sum((1, 2))


# -- migration-aware building blocks -------------------------------------------------------------


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


def _sticky(old: np.ndarray, alive: np.ndarray, cnt: np.ndarray, wc: np.ndarray, thr: np.ndarray) -> np.ndarray:
    """Sticky packing of ``cnt`` copies into live packs, keeping old copies where the load
    allows. ``old`` ``int[B, K, S]`` old expert ids (-1 empty), ``alive`` ``bool[B, K]``, ``cnt``
    ``int[B, E]`` new replica counts (their sum = live slots of the row), ``wc`` ``float[B, E]``
    per-copy load, ``thr`` ``float[B]`` eviction threshold. Returns ``int[B, K, S]`` (kept copies
    in their old slot; dead packs -1)."""
    num_b, num_k, num_s = old.shape
    num_e = cnt.shape[1]
    rows = np.arange(num_b)
    bi = rows[:, None, None]
    n_live = alive.sum(1)
    cap = _per_rank_cap(cnt, n_live)
    x = np.where(alive[:, :, None], old, -1)
    xe = np.maximum(x, 0)
    keep = (x >= 0) & (cnt[bi, xe] > 0)
    keep &= _occurrence(np.where(keep, x, -1)) < cap[bi, xe]
    # At most cnt[e] copies kept: the first ones in slot order.
    key = np.where(keep, bi * num_e + xe, -1).ravel()
    order = np.argsort(key, kind="stable")
    sk = key[order]
    idx = np.arange(sk.size)
    first = np.maximum.accumulate(np.where(np.r_[True, sk[1:] != sk[:-1]], idx, 0))
    pos = np.empty_like(idx)
    pos[order] = idx - first
    keep &= pos.reshape(keep.shape) < cnt[bi, xe]

    # Evict from ranks over the threshold: the lightest copy that brings the rank under it,
    # else the heaviest (then look again). A free slot will take a copy at least as heavy as
    # the lightest copy of the row, so that much is reserved per free slot: otherwise ranks
    # left just under the threshold end over it.
    wslot = np.where(keep, wc[bi, xe], 0.0)
    kl = wslot.sum(-1)
    w_min = np.where(cnt > 0, wc, np.inf).min(1)
    reserve = lambda: (num_s - keep.sum(-1)) * w_min[:, None]  # noqa: E731
    limit = thr[:, None] * (1 + _EPS)
    for _ in range(num_s):
        ob, ok = np.nonzero((kl + reserve() > limit) & alive & keep.any(-1))
        if not len(ob):
            break
        ar = np.arange(len(ob))
        ws, ks = wslot[ob, ok], keep[ob, ok]
        excess = kl[ob, ok] + reserve()[ob, ok] - thr[ob] + w_min[ob]  # evicting c saves w_c - w_min
        c1 = np.where(ks & (ws >= excess[:, None]), ws, np.inf)
        s1 = c1.argmin(1)
        s2 = np.where(ks, ws, -np.inf).argmax(1)
        s = np.where(np.isfinite(c1[ar, s1]), s1, s2)
        keep[ob, ok, s] = False
        kl[ob, ok] -= wslot[ob, ok, s]
        wslot[ob, ok, s] = 0.0

    new = np.where(keep, x, -1)
    kept_cnt = _count_last(np.where(keep, xe, -1).reshape(num_b, -1), num_e)
    rem = cnt - kept_cnt[:, :num_e]
    assert (rem >= 0).all()
    nfree = ((new < 0) & alive[:, :, None]).sum(-1)
    assert (nfree.sum(1) == rem.sum(1)).all()

    # Remaining copies, heaviest first (a pending pool per row), like the reference's greedy:
    # to the least loaded live rank with a free slot that may take the expert, if it stays
    # under the threshold (with the reserve); else replace, on the full rank where that gives
    # the lowest load under the threshold, the lightest copy that is lighter and suffices, that
    # copy going back to the pool (the freed slots sit on ranks near the threshold, so heavy
    # copies need room made on light ranks); else to the least loaded rank with a free slot,
    # for _swap_repair to fix.
    ib, ie = np.nonzero(rem)
    reps = rem[ib, ie]
    ib, ie = np.repeat(ib, reps), np.repeat(ie, reps)
    per_row = np.bincount(ib, minlength=num_b)
    ipos = np.arange(ib.size) - (np.cumsum(per_row) - per_row)[ib]
    m = int(per_row.max()) if ib.size else 0
    pool_e = np.full((num_b, m), -1, dtype=np.int64)
    pool_e[ib, ipos] = ie
    pool_w = np.where(pool_e >= 0, wc[rows[:, None], np.maximum(pool_e, 0)], -np.inf)
    counts = _count_last(new, num_e)
    wslot = np.where(new >= 0, wslot, np.inf)
    max_bumps = 2 * num_k * num_s
    it = 0
    while True:
        r = np.nonzero(np.isfinite(pool_w).any(1))[0]
        if not len(r):
            break
        n = len(r)
        ar = np.arange(n)
        q = pool_w[r].argmax(1)
        e, w = pool_e[r, q], pool_w[r, q]
        pool_w[r, q] = -np.inf
        load = kl[r]
        blocked = counts[r, :, e] >= cap[r, e][:, None]
        free = nfree[r] > 0
        after_a = np.where(free & ~blocked, load + w[:, None], np.inf)
        ka = after_a.argmin(1)
        fa = after_a[ar, ka]
        # room for this copy and the lightest possible copy in each further free slot
        fit = np.where(free & ~blocked, load + w[:, None] + (nfree[r] - 1) * w_min[r][:, None], np.inf)
        fit = np.where(fit <= thr[r][:, None] * (1 + _EPS), after_a, np.inf)
        kf = fit.argmin(1)
        ok_a = np.isfinite(fit[ar, kf])
        ka = np.where(ok_a, kf, ka)
        # the lightest copy lighter than this one whose swap keeps the rank under the threshold
        need = load + w[:, None] - thr[r][:, None]
        ws = wslot[r]
        ws = np.where((new[r] != e[:, None, None]) & (ws >= need[..., None]) & (ws < w[:, None, None] * (1 - _EPS)),
                      ws, np.inf)
        sb = ws.argmin(2)
        out = np.take_along_axis(ws, sb[..., None], 2)[..., 0]
        after_b = np.where(~free & ~blocked & np.isfinite(out), load - out + w[:, None], np.inf)
        kb = after_b.argmin(1)
        bump = ~ok_a & (after_b[ar, kb] <= thr[r] * (1 + _EPS)) & (it < max_bumps)
        forced = ~ok_a & ~bump & ~np.isfinite(fa)  # every free rank holds the expert: allow a duplicate
        if forced.any():
            ka[forced] = np.where(free[forced], load[forced], np.inf).argmin(1)
        # place into a free slot
        pa = ~bump
        rp, kp, ep, wp = r[pa], ka[pa], e[pa], w[pa]
        sp = (new[rp, kp] < 0).argmax(1)
        new[rp, kp, sp] = ep
        wslot[rp, kp, sp] = wp
        nfree[rp, kp] -= 1
        kl[rp, kp] += wp
        counts[rp, kp, ep] += 1
        # replace a copy of the chosen full rank; it goes back into the pool
        rb, kk, eb, wb = r[bump], kb[bump], e[bump], w[bump]
        ss = sb[ar[bump], kk]
        out_e, out_w = new[rb, kk, ss], wslot[rb, kk, ss]
        new[rb, kk, ss] = eb
        wslot[rb, kk, ss] = wb
        kl[rb, kk] += wb - out_w
        counts[rb, kk, eb] += 1
        counts[rb, kk, out_e] -= 1
        pool_e[rb, q[bump]] = out_e
        pool_w[rb, q[bump]] = out_w
        it += 1
    _repair(new, wc, cap)
    _swap_repair(new, alive, wc, cap, x, thr)
    return new


def _sticky_lpt(old: np.ndarray, alive: np.ndarray, cnt: np.ndarray, wc: np.ndarray, thr: np.ndarray) -> np.ndarray:
    """The reference's greedy (copies heaviest first, each to the least loaded live rank with
    room that does not hold the expert) with a preference: a copy goes to a rank that held
    the expert before (the least loaded of them) when it fits there under ``thr``, counting
    the lightest copy of the row for each of that rank's further free slots. Arguments and
    result as in :func:`_sticky`."""
    num_b, num_k, num_s = old.shape
    num_e = cnt.shape[1]
    rows = np.arange(num_b)
    bi = rows[:, None, None]
    x = np.where(alive[:, :, None], old, -1)
    held = np.zeros((num_b, num_k, num_e + 1), dtype=bool)
    held[bi, np.arange(num_k)[None, :, None], np.where(x < 0, num_e, x)] = True
    cap = _per_rank_cap(cnt, alive.sum(1))
    # copies of each row, heaviest first
    ib, ie = np.nonzero(cnt)
    reps = cnt[ib, ie]
    ib, ie = np.repeat(ib, reps), np.repeat(ie, reps)
    iw = wc[ib, ie]
    o = np.lexsort((ie, -iw, ib))
    ib, ie, iw = ib[o], ie[o], iw[o]
    per_row = np.bincount(ib, minlength=num_b)
    m = int(per_row.max())
    assert (per_row == alive.sum(1) * num_s).all()
    items = ie.reshape(num_b, m)
    weights = iw.reshape(num_b, m)
    w_min = weights[:, -1]
    load = np.zeros((num_b, num_k))
    used = np.where(alive, 0, num_s)
    counts = np.zeros((num_b, num_k, num_e), dtype=np.int64)
    new = np.full((num_b, num_k, num_s), -1, dtype=np.int64)
    limit = thr * (1 + _EPS)
    for t in range(m):
        e, w = items[:, t], weights[:, t]
        room = used < num_s
        may = room & (counts[rows, :, e] < cap[rows, e][:, None])
        fit = load + w[:, None] + (num_s - used - 1) * w_min[:, None] <= limit[:, None]
        pref = np.where(may & fit & held[rows, :, e], load, np.inf)
        k = pref.argmin(1)
        lpt = ~np.isfinite(pref[rows, k])
        if lpt.any():
            cost = np.where(may[lpt], load[lpt], np.inf)
            k2 = cost.argmin(1)
            bad = ~np.isfinite(cost[np.arange(len(k2)), k2])
            if bad.any():  # every rank with room holds it: a duplicate
                k2[bad] = np.where(room[lpt][bad], load[lpt][bad], np.inf).argmin(1)
            k[lpt] = k2
        new[rows, k, used[rows, k]] = e
        used[rows, k] += 1
        load[rows, k] += w
        counts[rows, k, e] += 1
    _repair(new, wc, cap)
    _swap_repair(new, alive, wc, cap, x, thr)
    return new


def _swap_repair(new: np.ndarray, alive: np.ndarray, wc: np.ndarray, cap: np.ndarray, old: np.ndarray,
                 thr: np.ndarray, num_heavy: int = 4, num_light: int = 8) -> None:
    """Local search, in place, for ranks over ``thr``: swap one of an overloaded rank's copies
    with a lighter copy on one of the row's ``num_light`` least loaded ranks, so that both end
    at most ``thr`` (fewest added moves, then the lowest peak) or at least the peak drops.

    The greedy placement of _sticky can only use the slots that evictions freed, and those are
    on ranks near the threshold; a few 2-exchanges with light ranks fix that. Each round
    repairs up to ``num_heavy`` overloaded ranks per row (distinct partners). ``new``
    ``int[B, K, S]``; ``old`` ``int[B, K, S]`` the old copies (to count moves); ``alive``
    ``bool[B, K]``; ``wc``/``cap`` ``[B, E]``; ``thr`` ``float[B]``.
    """
    num_b, num_k, num_s = new.shape
    num_e = wc.shape[1]
    li = np.arange(num_b)[:, None, None]
    ki = np.arange(num_k)[None, :, None]
    held = np.zeros((num_b, num_k, num_e + 1), dtype=bool)
    held[li, ki, np.where(old < 0, num_e, old)] = True
    counts = _count_last(new, num_e)
    wslot = np.where(new >= 0, wc[li, np.maximum(new, 0)], 0.0)
    loads = np.where(alive, wslot.sum(-1), np.nan)
    limit = thr * (1 + _EPS)
    stuck = np.zeros(num_b, dtype=bool)
    m1 = min(num_heavy, num_k)
    m2 = min(num_light, num_k)
    for _ in range(4 * num_k):
        over = np.nan_to_num(loads, nan=-np.inf) > limit[:, None]
        r = np.nonzero(over.any(1) & ~stuck)[0]
        if not len(r):
            break
        n = len(r)
        lr = np.nan_to_num(loads[r], nan=-np.inf)
        k1 = np.argsort(-lr, axis=1, kind="stable")[:, :m1]  # heaviest first
        l1 = np.take_along_axis(lr, k1, 1)
        v1 = l1 > limit[r][:, None]
        k2 = np.argsort(np.nan_to_num(loads[r], nan=np.inf), axis=1, kind="stable")[:, :m2]
        l2 = np.take_along_axis(lr, k2, 1)
        v2 = np.isfinite(l2) & (l2 <= limit[r][:, None])
        rr = r[:, None, None]
        a, wa = new[rr, k1[:, :, None], np.arange(num_s)], wslot[rr, k1[:, :, None], np.arange(num_s)]  # [n, m1, S]
        b, wb = new[rr, k2[:, :, None], np.arange(num_s)], wslot[rr, k2[:, :, None], np.arange(num_s)]  # [n, m2, S]
        d = wa[:, :, :, None, None] - wb[:, None, None, :, :]  # [n, m1, S, m2, S]: load k1 -> k2
        peak = np.maximum(l1[:, :, None, None, None] - d, l2[:, None, None, :, None] + d)
        ae, be = np.maximum(a, 0), np.maximum(b, 0)
        r4 = r[:, None, None, None]
        ok = (d > 0) & (peak < l1[:, :, None, None, None] * (1 - _EPS))
        ok &= (v1[:, :, None] & (a >= 0))[:, :, :, None, None] & (v2[:, :, None] & (b >= 0))[:, None, None]
        ok &= a[:, :, :, None, None] != b[:, None, None]
        # the per-rank cap: k2 may take a, k1 may take b
        ok &= (counts[r4, k2[:, None, None, :], ae[..., None]] < cap[r[:, None, None], ae][..., None])[..., None]
        ok &= (counts[r4, k1[:, :, None, None], be[:, None]] < cap[r[:, None, None], be][:, None])[:, :, None]
        gone = lambda h: (~h).astype(np.int64)  # noqa: E731 - a copy not held there before moves
        dmoves = (gone(held[r4, k2[:, None, None, :], ae[..., None]])[..., None]
                  + gone(held[r4, k1[:, :, None, None], be[:, None]])[:, :, None]
                  - gone(held[rr, k1[:, :, None], ae])[..., None, None]
                  - gone(held[rr, k2[:, :, None], be])[:, None, None])
        rel = peak / np.maximum(thr[r], 1e-300)[:, None, None, None, None]
        good = ok & (peak <= limit[r][:, None, None, None, None])
        score = np.where(good, dmoves * 4.0 + rel, np.where(ok, 100.0 + rel, np.inf)).reshape(n, m1, -1)
        best = score.argmin(2)
        fine = np.isfinite(np.take_along_axis(score, best[..., None], 2)[..., 0])  # [n, m1]
        sa, j2, sb = np.unravel_index(best, (num_s, m2, num_s))
        # one swap per partner rank and round: the heaviest overloaded rank wins
        same = (j2[:, :, None] == j2[:, None, :]) & fine[:, None, :] & np.tri(m1, k=-1, dtype=bool)[None]
        fine &= ~same.any(2)
        stuck[r[~fine.any(1)]] = True
        ri, i = np.nonzero(fine)
        row = r[ri]
        ka, kb = k1[ri, i], k2[ri, j2[ri, i]]
        sa, sb = sa[ri, i], sb[ri, i]
        ea, eb = new[row, ka, sa], new[row, kb, sb]
        wa_, wb_ = wslot[row, ka, sa], wslot[row, kb, sb]
        new[row, ka, sa], new[row, kb, sb] = eb, ea
        wslot[row, ka, sa], wslot[row, kb, sb] = wb_, wa_
        counts[row, ka, ea] -= 1
        counts[row, ka, eb] += 1
        counts[row, kb, eb] -= 1
        counts[row, kb, ea] += 1
        loads[row, ka] -= wa_ - wb_
        loads[row, kb] += wa_ - wb_


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


# -- public API ----------------------------------------------------------------------------------


def rebalance(
    load,
    placement: Placement | None = None,
    *,
    num_physical: int,
    num_ranks: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
    active_ranks=None,
    migration_aware: bool = True,
    tolerance: float = 0.01,
) -> Placement:
    """A balanced placement of every MoE layer's experts for ``load``.

    Args:
        load: ``float[num_layers, num_logical]`` tokens routed to each logical expert.
        placement: the current placement (``num_layers x num_physical``), or None.
        num_physical: physical slots per layer (all ranks, dead ones included).
        num_ranks: EP size of the full job (dead ranks included); slot ``p`` is on rank
            ``p // (num_physical // num_ranks)``.
        num_nodes: nodes; ranks ``[k * num_ranks/num_nodes, (k+1) * num_ranks/num_nodes)``
            are node k.
        num_groups: expert groups (group-limited routing) for the hierarchical policy; None
            for the global policy.
        active_ranks: ``bool[num_ranks]`` live ranks (None: all). Slots of the others are -1.
        migration_aware: keep copies where they are as far as the balance allows (see the
            module docstring); False: the reference (oblivious) policy.
        tolerance: per layer, the aware policy's max/mean rank load is at most
            ``(1 + tolerance)`` x the oblivious policy's.

    Returns:
        ``Placement`` with ``phy2log`` ``int[num_layers, num_physical]``.

    Raises:
        ValueError: malformed ``load``, shapes that do not divide, fewer live slots than
            experts, bad ``active_ranks``, a ``placement`` of another shape.
    """
    w = _check_load(load)
    sh = _shape(w, num_physical, num_ranks, num_nodes, num_groups, active_ranks)
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if placement is not None:
        _check_placement(placement, sh)
    obl = _oblivious(w, sh)
    if not migration_aware or placement is None:
        return Placement(obl.phy2log.reshape(sh.num_layers, -1), num_logical=sh.num_logical, num_ranks=sh.num_ranks)
    new = _aware(w, placement, obl, sh, float(tolerance))
    return Placement(new.reshape(sh.num_layers, -1), num_logical=sh.num_logical, num_ranks=sh.num_ranks)


def _check_placement(placement, sh: _Shape) -> None:
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a moeshard.Placement or None, got {type(placement).__name__}")
    if placement.num_logical != sh.num_logical:
        raise ValueError(f"placement has num_logical={placement.num_logical}, load has {sh.num_logical} experts")
    if placement.num_physical != sh.num_physical:
        raise ValueError(f"placement has num_physical={placement.num_physical}, expected {sh.num_physical}")
    if placement.num_layers != sh.num_layers:
        raise ValueError(f"placement has {placement.num_layers} layers, load has {sh.num_layers}")
    if placement.num_ranks is not None and placement.num_ranks != sh.num_ranks:
        raise ValueError(f"placement was made for num_ranks={placement.num_ranks}, expected {sh.num_ranks}")


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


def rank_loads(load, placement: Placement, num_ranks: int) -> np.ndarray:
    """``float[num_layers, num_ranks]``: tokens per rank, each copy carrying
    ``load[e] / logcnt[e]`` (tokens of an expert split evenly over its copies)."""
    w = _check_load(load)
    if w.shape != (placement.num_layers, placement.num_logical):
        raise ValueError(f"load has shape {w.shape}, placement describes {(placement.num_layers, placement.num_logical)}")
    s = placement.slots_per_rank(num_ranks)
    p2l = placement.phy2log.reshape(placement.num_layers, num_ranks, s)
    return _rank_loads3(w, p2l, placement.logcnt)


def balance(load, placement: Placement, num_ranks: int, active_ranks=None) -> np.ndarray:
    """``float[num_layers]``: max / mean rank load over the live ranks (1.0 is perfect; a
    layer with no load counts as 1.0)."""
    loads = rank_loads(load, placement, num_ranks)[:, _check_active(active_ranks, num_ranks)]
    mean = loads.mean(1)
    return np.where(mean > 0, loads.max(1) / np.where(mean > 0, mean, 1.0), 1.0)


def _check_pair(old: Placement, new: Placement) -> None:
    if old.phy2log.shape != new.phy2log.shape:
        raise ValueError(f"placements differ in shape: {old.phy2log.shape} vs {new.phy2log.shape}")


def copies_moved(old: Placement, new: Placement, num_ranks: int) -> int:
    """Copies that must travel (network or storage): non-empty slots of ``new`` whose rank
    held no copy of that expert anywhere in ``old``."""
    _check_pair(old, new)
    s = new.slots_per_rank(num_ranks)
    num_logical = max(old.num_logical, new.num_logical)
    held = _held(old.phy2log.reshape(old.num_layers, num_ranks, s), num_logical)
    return int(_moves3(held, new.phy2log.reshape(new.num_layers, num_ranks, s)).sum())


def slots_changed(old: Placement, new: Placement) -> int:
    """Non-empty slots of ``new`` that hold another expert than in ``old`` (local copies
    between slots of one rank included)."""
    _check_pair(old, new)
    return int(((new.phy2log >= 0) & (new.phy2log != old.phy2log)).sum())
