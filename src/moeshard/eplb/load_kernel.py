"""Copy counts, rank loads and moved copies of a placement (:mod:`moeshard.eplb.metrics`)
compiled with numba, one layer at a time: the same integers, and the same per-copy loads summed
as numpy sums the last axis (:func:`moeshard.eplb.swap_kernel.pairwise_sum`), to the last bit.
Each loop returns False, leaving its output unfinished, at an id beyond the experts (the caller
then takes numpy's way, whose indexing reports it).

Imported only when numba is installed (the ``fast`` extra); the first call in a process
compiles the loops or loads them from numba's on-disk cache.
"""

from __future__ import annotations

import numba
import numpy as np

from .swap_kernel import MAX_SLOTS, pairwise_sum

__all__ = ["MAX_SLOTS", "at_least_held", "copy_counts", "count_last", "moved_per_rank", "rank_loads", "slot_sums"]


@numba.njit(cache=True, nogil=True)
def copy_counts(p2l, out):
    """``out`` ``int64[L, E]`` (zeroed) += copies of each expert in ``p2l`` ``int64[L, M]``
    (ids < 0: empty slots, not counted)."""
    num_l, num_m = p2l.shape
    num_e = out.shape[1]
    for lay in range(num_l):
        for j in range(num_m):
            e = p2l[lay, j]
            if e >= num_e:
                return False
            if e >= 0:
                out[lay, e] += 1
    return True


@numba.njit(cache=True, nogil=True)
def count_last(ids, out):
    """``out`` ``int64[M, num + 1]`` (zeroed) += occurrences of each id in the rows of
    ``ids`` ``int64[M, n]`` (ids < 0 in the last column)."""
    num_m, num_n = ids.shape
    num = out.shape[1] - 1
    for i in range(num_m):
        for j in range(num_n):
            e = ids[i, j]
            if e >= num:
                return False
            out[i, e if e >= 0 else num] += 1
    return True


@numba.njit(cache=True, nogil=True)
def rank_loads(w, p2l, cnt, out):
    """``out`` ``float64[L, R]``: per rank of ``p2l`` ``int64[L, R, S]`` (``S <= MAX_SLOTS``)
    the sum of its copies' loads ``w[l, e] / cnt[l, e]`` (``w`` ``float64[L, E]``, ``cnt``
    ``int64[L, E]``; 0 for an empty slot or a count of 0), in numpy's order."""
    num_l, num_r, num_s = p2l.shape
    num_e = w.shape[1]
    ws = np.empty(num_s)
    for lay in range(num_l):
        for r in range(num_r):
            for s in range(num_s):
                e = p2l[lay, r, s]
                if e >= num_e:
                    return False
                ws[s] = w[lay, e] / cnt[lay, e] if e >= 0 and cnt[lay, e] > 0 else 0.0
            out[lay, r] = 0.0 + pairwise_sum(ws, 0, num_s)
    return True


@numba.njit(cache=True, nogil=True)
def slot_sums(wc, p2l, out):
    """``out`` ``float64[B, R]``: per rank of ``p2l`` ``int64[B, R, S]`` (``S <= MAX_SLOTS``)
    the sum of its copies' loads ``wc[b, e]`` (``float64[B, E]``; 0 for an empty slot), in
    numpy's order."""
    num_b, num_r, num_s = p2l.shape
    num_e = wc.shape[1]
    ws = np.empty(num_s)
    for b in range(num_b):
        for r in range(num_r):
            for s in range(num_s):
                e = p2l[b, r, s]
                if e >= num_e:
                    return False
                ws[s] = wc[b, e] if e >= 0 else 0.0
            out[b, r] = 0.0 + pairwise_sum(ws, 0, num_s)
    return True


@numba.njit(cache=True, nogil=True)
def moved_per_rank(held, layers, new, out):
    """``out`` ``int64[K, R]``: per rank of ``new`` ``int64[K, R, S]`` (row ``k`` a placement
    of layer ``layers[k]``) its copies whose rank held no copy of the expert (``held``
    ``bool[L, R, E]``)."""
    num_k, num_r, num_s = new.shape
    num_e = held.shape[2]
    for k in range(num_k):
        lay = layers[k]
        for r in range(num_r):
            m = 0
            for s in range(num_s):
                e = new[k, r, s]
                if e >= num_e:
                    return False
                if e >= 0 and not held[lay, r, e]:
                    m += 1
            out[k, r] = m
    return True


@numba.njit(cache=True, nogil=True)
def at_least_held(cap, p):
    """``cap`` ``int64[B, E]`` raised, in place, to the most copies of an expert one rank of
    ``p`` ``int64[B, K, S]`` holds."""
    num_b, num_k, num_s = p.shape
    num_e = cap.shape[1]
    for b in range(num_b):
        for k in range(num_k):
            for s in range(num_s):
                e = p[b, k, s]
                if e >= num_e:
                    return False
    for b in range(num_b):
        for k in range(num_k):
            for s in range(num_s):
                e = p[b, k, s]
                if e < 0:
                    continue
                m = 0
                for t in range(num_s):
                    m += 1 if p[b, k, t] == e else 0
                if m > cap[b, e]:
                    cap[b, e] = m
    return True
