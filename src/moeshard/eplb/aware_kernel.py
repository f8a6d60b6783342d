"""Loops of the migration-aware policy (:mod:`moeshard.eplb.aware`) compiled with numba: the
cheapest assignments of groups to nodes, the slot order of a new placement and the steps of
the count rules (old counts filled or trimmed, capped counts), with the very
answers of the numpy code (the same sums to the last bit, the same ties).

Imported only when numba is installed (the ``fast`` extra); the first call in a process
compiles the loops or loads them from numba's on-disk cache.
"""

from __future__ import annotations

import numba
import numpy as np

from .swap_kernel import pairwise_sum

__all__ = ["arrange", "cap_steps", "cheapest_groups", "count_steps", "hot_counts"]


@numba.njit(cache=True, nogil=True)
def cheapest_groups(gl, members, assignments, gn_old, copies, node_caps, best, found):
    """:func:`moeshard.eplb.aware._cheapest_groups`, in place: per cap and layer, among the
    assignments whose heaviest node is within the cap, the one that moves fewest copies, then
    of the lightest heaviest node, then the first.

    Args:
        gl: ``float64[L, G]`` group loads; ``members``: ``int64[A, N, G/N]`` each node's groups
            (a node's load summed over them as numpy sums them).
        assignments: ``int64[A, G]``; ``gn_old``, ``copies``: ``int64[L, G]``.
        node_caps: ``float64[C, L]``.
        best, found: ``int64[C, L]`` / ``bool[C, L]`` out: index of the assignment, whether any.
    """
    num_c, num_layers = node_caps.shape
    num_a, num_n, per = members.shape
    num_g = gl.shape[1]
    buf = np.empty(per)
    b_cost = np.empty(num_c, dtype=np.int64)
    b_load = np.empty(num_c)
    for lay in range(num_layers):
        for c in range(num_c):
            best[c, lay] = -1
        for a in range(num_a):
            load = -np.inf
            for k in range(num_n):
                for j in range(per):
                    buf[j] = gl[lay, members[a, k, j]]
                v = 0.0 + pairwise_sum(buf, 0, per)
                if v > load:
                    load = v
            cost = 0
            for g in range(num_g):
                if assignments[a, g] != gn_old[lay, g]:
                    cost += copies[lay, g]
            for c in range(num_c):
                if load <= node_caps[c, lay] and (
                    best[c, lay] < 0 or cost < b_cost[c] or (cost == b_cost[c] and load < b_load[c])
                ):
                    best[c, lay], b_cost[c], b_load[c] = a, cost, load
        for c in range(num_c):
            found[c, lay] = best[c, lay] >= 0
            if best[c, lay] < 0:
                best[c, lay] = 0


@numba.njit(cache=True, nogil=True)
def arrange(new, old, out):
    """:func:`moeshard.eplb.aware._arrange`, row by row: an expert the row held keeps its old
    slot (the first old slot holding it takes the first new copy), newcomers fill the free
    slots in order. ``new``, ``old``, ``out``: ``int64[X, S]``."""
    num_x, num_s = new.shape
    placed = np.zeros(num_s, dtype=np.bool_)
    for x in range(num_x):
        for i in range(num_s):
            placed[i] = False
            out[x, i] = -1
        for j in range(num_s):
            e = old[x, j]
            if e < 0:
                continue
            for i in range(num_s):
                if not placed[i] and new[x, i] == e:
                    out[x, j] = e
                    placed[i] = True
                    break
        j = 0
        for i in range(num_s):
            if new[x, i] >= 0 and not placed[i]:
                while out[x, j] >= 0:
                    j += 1
                out[x, j] = new[x, i]


@numba.njit(cache=True, nogil=True)
def hot_counts(wr, cnt, thr, num_hot, steps, eps):
    """:func:`moeshard.eplb.aware.hot_counts` row by row: the variants of each row in the order
    (expert ``j``, step) made, each once (the first with its key, a hash of its counts).

    Args:
        wr: ``float64[B, E]`` loads; ``cnt``: ``int64[B, E]`` counts; ``thr``: ``float64[B]``.
        num_hot: experts varied (``_HOT_EXPERTS``); ``steps``: ``int64[D]`` (``_HOT_STEPS``);
            ``eps``: the slack of the limit.

    Returns:
        ``int64[V]`` rows, ``int64[V]`` index ``j * D + step`` of each variant, ``int64[V, E]``
        counts (rows in increasing order).
    """
    num_b, num_e = cnt.shape
    num_d = len(steps)
    num_j = min(num_hot, num_e)
    out_r = np.empty(num_b * num_j * num_d, dtype=np.int64)
    out_i = np.empty(num_b * num_j * num_d, dtype=np.int64)
    out_c = np.empty((num_b * num_j * num_d, num_e), dtype=np.int64)
    keys = np.empty(num_j * num_d, dtype=np.int64)
    key_h = np.empty(num_e)
    key_l = np.empty(num_e)
    c = np.empty(num_e, dtype=np.int64)
    nv = 0
    for b in range(num_b):
        for e in range(num_e):
            key_h[e] = -wr[b, e] if cnt[b, e] > 0 else np.inf
            key_l[e] = wr[b, e] if cnt[b, e] > 0 else np.inf
        by_load = np.argsort(key_h, kind="mergesort")
        light = np.argsort(key_l, kind="mergesort")
        lim = thr[b] * (1 + eps)
        n_row = 0
        for j in range(num_j):
            hot = by_load[j]
            least = max(1, np.int64(np.ceil(wr[b, hot] / max(thr[b], 1e-300) * (1 - 1e-12))))
            for di in range(num_d):
                d = steps[di]
                for e in range(num_e):
                    c[e] = cnt[b, e]
                c[hot] += d
                ok = cnt[b, hot] > 0 and c[hot] >= least
                if d < 0:
                    for i in range(-d):
                        c[light[i]] += 1
                for _ in range(max(d, 0)):
                    lo = 0
                    lo_v = np.inf
                    for e in range(num_e):
                        if e != hot and cnt[b, e] > 0 and c[e] > 1:
                            v = wr[b, e] / max(c[e] - 1, 1)
                            if v < lo_v:
                                lo_v, lo = v, e
                    others = lo != hot and cnt[b, lo] > 0 and c[lo] > 1
                    ok = ok and others
                    if others:
                        c[lo] -= 1
                if not ok:
                    continue
                changed = False
                for e in range(num_e):
                    if c[e] != cnt[b, e]:
                        changed = True
                    v = wr[b, e] / max(c[e], 1) if cnt[b, e] > 0 else 0.0
                    if not v <= lim:
                        ok = False
                        break
                if not (ok and changed):
                    continue
                h = np.int64(0)
                for e in range(num_e):
                    h += c[e] * (2 * e + 1)
                key = b * 1_000_003 + h % 1_000_003
                seen = False
                for i in range(n_row):
                    if keys[i] == key:
                        seen = True
                        break
                if seen:
                    continue
                keys[n_row] = key
                n_row += 1
                out_r[nv] = b
                out_i[nv] = j * num_d + di
                for e in range(num_e):
                    out_c[nv, e] = c[e]
                nv += 1
    return out_r[:nv], out_i[:nv], out_c[:nv]


@numba.njit(cache=True, nogil=True)
def _most_per_copy(c, m, wr, r):
    """The first expert of row ``r`` of the highest ``wr / max(c, 1)`` among ``m`` (0 where
    none: numpy's argmax of all ``-inf``) and that load per copy."""
    j = 0
    best = wr[r, 0] / max(c[r, 0], 1) if m[r, 0] else -np.inf
    for e in range(1, c.shape[1]):
        v = wr[r, e] / max(c[r, e], 1) if m[r, e] else -np.inf
        if v > best:
            best, j = v, e
    return j, best


@numba.njit(cache=True, nogil=True)
def _least_without_one(c, m, wr, r):
    """The first expert of row ``r`` of the lowest ``wr / max(c - 1, 1)`` among ``m`` with
    more than one copy (0 where none: numpy's argmin of all ``inf``)."""
    j = 0
    best = wr[r, 0] / max(c[r, 0] - 1, 1) if m[r, 0] and c[r, 0] > 1 else np.inf
    for e in range(1, c.shape[1]):
        v = wr[r, e] / max(c[r, e] - 1, 1) if m[r, e] and c[r, e] > 1 else np.inf
        if v < best:
            best, j = v, e
    return j


@numba.njit(cache=True, nogil=True)
def count_steps(c, m, wr, d):
    """:func:`moeshard.eplb.aware._old_counts`' rounds, in place, row by row: while ``d[r] > 0``
    a copy more for the expert of the highest load per copy, while ``d[r] < 0`` a copy less
    for the expert whose load per copy stays lowest (among ``m``, the first on ties).

    Args:
        c: ``int64[B, E]`` counts; ``m``: ``bool[B, E]``; ``wr``: ``float64[B, E]``;
            ``d``: ``int64[B]`` copies to add (< 0: to take).
    """
    for r in range(c.shape[0]):
        dr = d[r]
        while dr > 0:
            j, _ = _most_per_copy(c, m, wr, r)
            c[r, j] += 1
            dr -= 1
        while dr < 0:
            j = _least_without_one(c, m, wr, r)
            c[r, j] -= 1
            dr += 1


@numba.njit(cache=True, nogil=True)
def cap_steps(c, m, wr, lim, rounds):
    """:func:`moeshard.eplb.aware.capped_counts`' rounds, in place, row by row (at most
    ``rounds``): while the highest load per copy is over ``lim[r]``, that expert takes a copy
    from the expert whose load per copy stays lowest without it.

    Args:
        c: ``int64[B, E]`` counts; ``m``: ``bool[B, E]`` the row's experts; ``wr``:
            ``float64[B, E]``; ``lim``: ``float64[B]``.
    """
    for r in range(c.shape[0]):
        for _ in range(rounds):
            hi, top = _most_per_copy(c, m, wr, r)
            if not top > lim[r]:
                break
            lo = _least_without_one(c, m, wr, r)
            c[r, hi] += 1
            c[r, lo] -= 1
