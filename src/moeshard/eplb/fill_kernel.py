"""The rounds of :func:`moeshard.eplb.fill.fill_held` and :func:`moeshard.eplb.shift.shift_held`
compiled with numba: one layer at a time, its rounds in a loop, the very replacements of the
numpy rounds (the same rank loads to the last bit, the same peaks, the same ties).

Imported only when numba is installed (the ``fast`` extra); the first call in a process
compiles the loop or loads it from numba's on-disk cache.
"""

from __future__ import annotations

import numba
import numpy as np

from .swap_kernel import MAX_SLOTS, pairwise_sum

__all__ = ["MAX_SLOTS", "fill_rounds", "shift_rounds"]


@numba.njit(cache=True, nogil=True)
def fill_rounds(w, out, old3, held_old, thr, node_of_rank, num_nodes):
    """The rounds of :func:`moeshard.eplb.fill.fill_held`, in place on ``out``: per layer and
    round, on each node the replacement that leaves the lightest heaviest rank within the
    layer's limit (the first on ties, in the order slot, then old slot of the candidate), all
    of a round's taken at once, until a round takes none.

    Args:
        w: ``float64[L, E]`` loads; ``thr``: ``float64[L]`` limits.
        out: ``int64[L, R, S]`` the placement (``S <= MAX_SLOTS``), changed in place.
        old3: ``int64[L, R, S]`` old slots; ``held_old``: ``bool[L, R, E]``.
        node_of_rank: ``int64[R]``; ``num_nodes``: ``node_of_rank.max() + 1``.
    """
    num_layers, num_ranks, num_s = out.shape
    num_e = w.shape[1]
    t = _alloc(num_ranks, num_s, num_e, num_nodes)
    cnt, on_node, loads = t[0], t[3], t[6]
    best_pk = np.empty(num_nodes)
    best_r = np.empty(num_nodes, dtype=np.int64)
    best_j = np.empty(num_nodes, dtype=np.int64)
    best_f = np.empty(num_nodes, dtype=np.int64)
    for lay in range(num_layers):
        lim = thr[lay]
        while True:
            _tables(w, out, lay, node_of_rank, t)
            by_load = np.argsort(-loads)  # the heaviest untouched rank: any of equal loads
            for n in range(num_nodes):
                best_r[n] = -1
            for r in range(num_ranks):
                node = node_of_rank[r]
                for j in range(num_s):
                    e = out[lay, r, j]
                    if e < 0 or held_old[lay, r, e] or cnt[e] < 2:
                        continue
                    we = w[lay, e]
                    ce = cnt[e]
                    d_e = we / (ce - 1) - we / ce
                    for col in range(num_s):
                        f = old3[lay, r, col]
                        if f < 0 or f == e or not on_node[node, f]:
                            continue
                        wf = w[lay, f]
                        cf = cnt[f]
                        d_f = wf / (cf + 1) - wf / cf
                        own = wf / (cf + 1) - we / (ce - 1)
                        peak = _peak_after(t, by_load, e, f, d_e, d_f, r, own, -1, 0.0)
                        if peak <= lim and (best_r[node] < 0 or peak < best_pk[node]):
                            best_pk[node] = peak
                            best_r[node] = r
                            best_j[node] = j
                            best_f[node] = f
            _clear(out, lay, node_of_rank, t)  # back to zero for the next round
            taken = False
            for n in range(num_nodes):
                if best_r[n] >= 0:
                    out[lay, best_r[n], best_j[n]] = best_f[n]
                    taken = True
            if not taken:
                break


@numba.njit(cache=True, nogil=True)
def shift_rounds(w, out, old3, held_old, thr, node_of_rank, num_nodes):
    """The rounds of :func:`moeshard.eplb.shift.shift_held`, in place on ``out``: per layer and
    round, on each node the shift that leaves the lightest heaviest rank within the layer's
    limit (the first on ties, in the order rank ``a``, its slot, rank ``b``, its slot, ``a``'s
    old slot), all of a round's taken at once, until a round takes none. Arguments as
    :func:`fill_rounds`'."""
    num_layers, num_ranks, num_s = out.shape
    num_e = w.shape[1]
    t = _alloc(num_ranks, num_s, num_e, num_nodes)
    cnt, on_node, wc, loads = t[0], t[3], t[4], t[6]
    best_pk = np.empty(num_nodes)
    best_a = np.empty(num_nodes, dtype=np.int64)
    best_i = np.empty(num_nodes, dtype=np.int64)
    best_b = np.empty(num_nodes, dtype=np.int64)
    best_j = np.empty(num_nodes, dtype=np.int64)
    best_z = np.empty(num_nodes, dtype=np.int64)
    for lay in range(num_layers):
        lim = thr[lay]
        while True:
            _tables(w, out, lay, node_of_rank, t)
            by_load = np.argsort(-loads)
            for n in range(num_nodes):
                best_a[n] = -1
            for a in range(num_ranks):
                node = node_of_rank[a]
                for i in range(num_s):
                    x = out[lay, a, i]
                    if x < 0 or held_old[lay, a, x]:
                        continue
                    wx = wc[x]
                    for b in range(num_ranks):
                        if b == a or node_of_rank[b] != node or not held_old[lay, b, x]:
                            continue
                        for j in range(num_s):
                            y = out[lay, b, j]
                            if y < 0 or y == x or cnt[y] < 2:
                                continue
                            wy = w[lay, y]
                            cy = cnt[y]
                            d_y = wy / (cy - 1) - wy / cy
                            own_b = wx - wy / (cy - 1)
                            for col in range(num_s):
                                z = old3[lay, a, col]
                                if z < 0 or z == x or z == y or not on_node[node, z]:
                                    continue
                                wz = w[lay, z]
                                cz = cnt[z]
                                d_z = wz / (cz + 1) - wz / cz
                                own_a = wz / (cz + 1) - wx
                                peak = _peak_after(t, by_load, y, z, d_y, d_z, a, own_a, b, own_b)
                                if peak <= lim and (best_a[node] < 0 or peak < best_pk[node]):
                                    best_pk[node] = peak
                                    best_a[node] = a
                                    best_i[node] = i
                                    best_b[node] = b
                                    best_j[node] = j
                                    best_z[node] = z
            _clear(out, lay, node_of_rank, t)
            taken = False
            for n in range(num_nodes):
                if best_a[n] >= 0:
                    out[lay, best_b[n], best_j[n]] = out[lay, best_a[n], best_i[n]]  # x
                    out[lay, best_a[n], best_i[n]] = best_z[n]
                    taken = True
            if not taken:
                break


@numba.njit(cache=True, nogil=True)
def _alloc(num_ranks, num_s, num_e, num_nodes):
    """The round's tables (all zero): copy counts ``cnt``, ranks holding each expert ``nh``,
    copies per rank ``per_rank``, experts on each node ``on_node``, per-copy loads ``wc``, a
    rank's slot loads ``buf``, rank loads ``loads`` and the ranks holding each expert (each
    rank once) ``hold[start[e]:start[e + 1]]`` (``fill``: the next free place)."""
    return (
        np.zeros(num_e, dtype=np.int64),
        np.zeros(num_e, dtype=np.int64),
        np.zeros((num_ranks, num_e), dtype=np.int64),
        np.zeros((num_nodes, num_e), dtype=np.bool_),
        np.empty(num_e),
        np.empty(num_s),
        np.empty(num_ranks),
        np.zeros(num_e + 1, dtype=np.int64),
        np.empty(num_e, dtype=np.int64),
        np.empty(num_ranks * num_s, dtype=np.int64),
    )


@numba.njit(cache=True, nogil=True)
def _tables(w, out, lay, node_of_rank, t):
    """Fill the tables ``t`` (:func:`_alloc`) from layer ``lay`` of ``out``: a rank's copies of an
    expert counted at its first; rank loads summed as numpy sums them."""
    cnt, nh, per_rank, on_node, wc, buf, loads, start, fill, hold = t
    num_ranks, num_s = out.shape[1], out.shape[2]
    for r in range(num_ranks):
        for s in range(num_s):
            e = out[lay, r, s]
            if e >= 0:
                cnt[e] += 1
                if per_rank[r, e] == 0:
                    nh[e] += 1
                per_rank[r, e] += 1
                on_node[node_of_rank[r], e] = True
    for e in range(len(cnt)):
        wc[e] = w[lay, e] / cnt[e] if cnt[e] > 0 else 0.0
        start[e + 1] = start[e] + nh[e]
        fill[e] = start[e]
    for r in range(num_ranks):
        for s in range(num_s):
            e = out[lay, r, s]
            buf[s] = wc[e] if e >= 0 else 0.0
            if e >= 0 and (fill[e] == start[e] or hold[fill[e] - 1] != r):
                hold[fill[e]] = r
                fill[e] += 1
        loads[r] = 0.0 + pairwise_sum(buf, 0, num_s)


@numba.njit(cache=True, nogil=True)
def _clear(out, lay, node_of_rank, t):
    """The tables ``t`` back to zero where layer ``lay`` of ``out`` set them."""
    cnt, nh, per_rank, on_node = t[0], t[1], t[2], t[3]
    for r in range(out.shape[1]):
        for s in range(out.shape[2]):
            e = out[lay, r, s]
            if e >= 0:
                cnt[e] = 0
                nh[e] = 0
                per_rank[r, e] = 0
                on_node[node_of_rank[r], e] = False


@numba.njit(cache=True, nogil=True)
def _peak_after(t, by_load, m, p, d_m, d_p, ra, own_a, rb, own_b):
    """The heaviest rank of a layer (its tables ``t``, :func:`_tables`; ``by_load`` its ranks
    heaviest first) once expert ``m`` has one copy fewer (each left carrying ``d_m`` more) and
    ``p`` one more (``d_p`` each), rank ``ra`` changing by ``own_a`` more and ``rb`` (-1: none)
    by ``own_b``: numpy's loads plus the changes, summed in the numpy rounds' order."""
    per_rank, loads, start, hold = t[2], t[6], t[7], t[9]
    # ranks other than ra and rb without m or p keep their load
    peak = -np.inf
    for k in range(len(by_load)):
        q = by_load[k]
        if q != ra and q != rb and per_rank[q, m] == 0 and per_rank[q, p] == 0:
            peak = loads[q]
            break
    # the ranks holding m or p, then ra and rb themselves (they may hold neither)
    for u in range(4):
        one = ra if u == 2 else rb  # u >= 2: that rank alone
        if u < 2:
            x = m if u == 0 else p
            lo, hi = start[x], start[x + 1]
        else:
            lo, hi = 0, (1 if one >= 0 else 0)
        for h in range(lo, hi):
            q = hold[h] if u < 2 else one
            v = loads[q] + per_rank[q, m] * d_m + per_rank[q, p] * d_p
            if q == ra:
                v += own_a
            if q == rb:
                v += own_b
            if v > peak:
                peak = v
    return peak
