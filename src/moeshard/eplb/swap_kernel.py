"""The swap search of :func:`moeshard.eplb.refine.lower_peak` compiled with numba: one row
(layer) at a time, its rounds in a loop over every pair of copies, the very swaps of the numpy
search (the same loads to the last bit, the same ties, caps and stops).

Imported only when numba is installed (the ``fast`` extra); the first call in a process
compiles the loop or loads it from numba's on-disk cache.
"""

from __future__ import annotations

import numba
import numpy as np

# slots per rank up to which :func:`pairwise_sum` is numpy's sum (numpy splits longer ones in
# halves; the search takes them the numpy way)
MAX_SLOTS = 128


@numba.njit(cache=True, nogil=True)
def pairwise_sum(a, lo, n):
    """``a[lo:lo + n].sum()`` as numpy sums the last axis of a float64 array of ``n <= 128``
    (eight accumulators): a rank's load to the bit of the numpy search's."""
    if n < 8:
        res = -0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - (n % 8):
        r0 += a[lo + i]
        r1 += a[lo + i + 1]
        r2 += a[lo + i + 2]
        r3 += a[lo + i + 3]
        r4 += a[lo + i + 4]
        r5 += a[lo + i + 5]
        r6 += a[lo + i + 6]
        r7 += a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


def rank_loads(ws, num_s):
    """``float64[M]``: the load of each rank of ``ws`` ``float64[M * S]`` (slot loads, rank
    by rank, ``S <= MAX_SLOTS``), summed as :func:`pairwise_sum` does (for tests)."""
    return _rank_loads(np.ascontiguousarray(ws, dtype=np.float64), num_s)


@numba.njit(cache=True, nogil=True)
def _rank_loads(ws, num_s):
    m = len(ws) // num_s
    out = np.empty(m)
    for r in range(m):
        out[r] = 0.0 + pairwise_sum(ws, r * num_s, num_s)
    return out


@numba.njit(cache=True, nogil=True)
def _scan(p, wn, ld, c, cp, has_cap, nonneg, num_s, h, lh, k_lo, k_hi, bar, lim):
    """The first swap, in ``(a, k, b)`` order, of the heaviest rank ``h``'s copies with those
    of ranks ``k_lo .. k_hi - 1`` whose peak ``max(lh - d, lk + d)`` is the lowest below
    ``bar``: ``(peak, slot a, slot b)`` (``(inf, -1, -1)`` where none is). Where loads are
    ``nonneg``, ranks and copies whose every peak is over ``lim`` (a peak some swap reaches)
    or at least the best so far are passed over."""
    qa = qb = -1
    best = np.inf
    for sa in range(num_s):
        ia = h * num_s + sa
        ea = p[ia]
        wa = wn[ia]
        # loads >= 0: d = w_a - w_b <= w_a, so the peak is at least lh - w_a (rounded the same
        # way, rounding is monotone); an empty slot's NaN compares false
        if ea < 0 or (nonneg and (lh - wa >= bar or lh - wa > lim)):
            continue
        for k in range(k_lo, k_hi):
            lk = ld[k]
            # a peak below bar <= lh needs d > 0, so it is at least lk + d >= lk; and
            # max(lh - d, lh + d) >= lh: a swap with h itself never lowers the peak
            if k == h or (nonneg and (lk >= bar or lk > lim)):
                continue
            if has_cap and c[k, ea] >= cp[ea]:  # k may not take a
                continue
            for ib in range(k * num_s, k * num_s + num_s):
                d = wa - wn[ib]
                x = lh - d
                y = lk + d
                peak = x if x >= y else y
                # strictly below: the first of equal peaks; h may take b
                if peak < bar and not (has_cap and c[h, p[ib]] >= cp[p[ib]]):
                    bar = best = peak
                    qa, qb = ia, ib
    return best, qa, qb


@numba.njit(cache=True, nogil=True)
def swap_search(
    pk, ws, loads, num_e, cap, has_cap, stop_at, has_stop, nonneg, num_n, num_k, num_s, max_rounds, margin, swaps
):
    """The swap search of ``lower_peak``, in place, row by row (one caller, any rank).

    Args:
        pk: ``int64[B, N*K*S]`` expert ids (``-1`` empty), rank by rank.
        ws: ``float64[B, N*K*S]`` load of the copy in each slot (0 for an empty slot).
        loads: ``float64[B, N*K]`` each rank's load, numpy's sum of its slots' loads.
        num_e: experts (ids ``0 .. E - 1``).
        cap: ``int64[B, E]`` most copies of an expert per rank (read where ``has_cap``).
        stop_at: ``float64[B]`` a row's target (read where ``has_stop``).
        nonneg: every load is >= 0 (then ranks and copies that cannot beat the best swap so
            far are passed over: the same swaps, fewer pairs looked at).
        max_rounds: most swaps per row.
        margin: a swap's peak is below ``(1 - margin)`` times the heaviest load.
        swaps: ``int64[B]`` out: swaps made per row.
    """
    num_b = pk.shape[0]
    nk = num_n * num_k
    keep = 1.0 - margin
    # copies of each expert per rank of the row at hand (empty slots in the last column):
    # built per row from its slots and cleared after it
    c = np.zeros((nk, num_e + 1), dtype=np.int16)
    wn = np.empty(nk * num_s)
    for row in range(num_b):
        p, w, ld, cp = pk[row], ws[row], loads[row], cap[row]
        for i in range(nk * num_s):  # an empty slot's NaN load: its every peak NaN, never below
            wn[i] = w[i] if p[i] >= 0 else np.nan
        if has_cap:
            for i in range(nk * num_s):
                c[i // num_s, p[i] if p[i] >= 0 else num_e] += 1
        done = 0
        while done < max_rounds:
            h = 0
            lh = ld[0]
            for r in range(1, nk):
                if ld[r] > lh:
                    h, lh = r, ld[r]
            if has_stop and not lh > stop_at[row]:
                break
            thr = lh * keep
            first = (h // num_k) * num_k
            # A bound first: the peak of the best swap with the node's lightest rank. The full
            # scan passes over the ranks and copies whose every peak is over it (most of them)
            # and still meets the first swap of the lowest peak.
            light = first
            for r in range(first + 1, first + num_k):
                if ld[r] < ld[light]:
                    light = r
            lim = np.inf
            if nonneg:
                lim, qa, qb = _scan(p, wn, ld, c, cp, has_cap, nonneg, num_s, h, lh, light, light + 1, thr, lim)
            bar, qa, qb = _scan(p, wn, ld, c, cp, has_cap, nonneg, num_s, h, lh, first, first + num_k, thr, lim)
            if qa < 0:
                break
            ea, eb = p[qa], p[qb]
            p[qa], p[qb] = eb, ea
            w[qa], w[qb] = w[qb], w[qa]
            wn[qa], wn[qb] = wn[qb], wn[qa]
            k = qb // num_s
            # the two ranks' loads summed again, as numpy sums them (0 + the pairwise sum)
            ld[h] = 0.0 + pairwise_sum(w, h * num_s, num_s)
            ld[k] = 0.0 + pairwise_sum(w, k * num_s, num_s)
            if has_cap:
                c[h, ea] -= 1
                c[h, eb] += 1
                c[k, eb] -= 1
                c[k, ea] += 1
            done += 1
        swaps[row] = done
        if has_cap:
            for i in range(nk * num_s):
                c[i // num_s, p[i] if p[i] >= 0 else num_e] = 0
