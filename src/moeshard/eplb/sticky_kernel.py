"""The sequential loops of sticky packing (:mod:`moeshard.eplb.sticky`) compiled with numba, one
row (a node of a layer) at a time: the evictions, the placement of the remaining copies and
the swap repair, with the very choices of the numpy rounds (the same loads to the last bit,
the same ties, caps and stops).

Imported only when numba is installed (the ``fast`` extra); the first call in a process
compiles the loops or loads them from numba's on-disk cache.
"""

from __future__ import annotations

import numba
import numpy as np

from .swap_kernel import MAX_SLOTS, pairwise_sum

__all__ = ["MAX_SLOTS", "evict", "place", "restore", "swap_repair"]


@numba.njit(cache=True, nogil=True)
def evict(keep, wslot, kl, n_kept, alive, w_min, thr, lim):
    """Evictions of :func:`moeshard.eplb.sticky.sticky_pack`, in place: while a live rank's
    kept copies plus the reserve of its free slots (``w_min`` each) are over ``lim``, it drops
    the lightest kept copy that brings it under ``thr``, else its heaviest.

    Args:
        keep: ``bool[B, K, S]`` kept copies.
        wslot: ``float64[B, K, S]`` a kept copy's load (0 elsewhere).
        kl: ``float64[B, K]`` kept load per rank.
        n_kept: ``int64[B, K]`` kept copies per rank.
        alive: ``bool[B, K]``.
        w_min, thr, lim: ``float64[B]`` the row's lightest copy, threshold and ``thr`` with
            its slack.
    """
    num_b, num_k, num_s = keep.shape
    for b in range(num_b):
        for k in range(num_k):
            if not alive[b, k]:
                continue
            for _ in range(num_s):
                if n_kept[b, k] <= 0:
                    break
                reserve = (num_s - n_kept[b, k]) * w_min[b]
                if not kl[b, k] + reserve > lim[b]:
                    break
                excess = kl[b, k] + reserve - thr[b] + w_min[b]
                s1 = -1
                c1 = np.inf
                s2 = -1
                c2 = -np.inf
                for s in range(num_s):
                    if keep[b, k, s]:
                        ws = wslot[b, k, s]
                        if ws >= excess and ws < c1:
                            c1, s1 = ws, s
                        if ws > c2 or s2 < 0:
                            c2, s2 = ws, s
                s = s1 if s1 >= 0 else s2
                keep[b, k, s] = False
                n_kept[b, k] -= 1
                kl[b, k] -= wslot[b, k, s]
                wslot[b, k, s] = 0.0


@numba.njit(cache=True, nogil=True)
def place(new, kl, nfree, cap, pool_e, pool_w, per_row, w_min, lim, num_e):
    """Placement of :func:`moeshard.eplb.sticky.sticky_pack`'s remaining copies, in place: each
    row's pool in order (heaviest first) onto the least loaded live rank with a free slot
    that may take the expert, if it stays under ``lim`` with the reserve of its further
    free slots; else the least loaded one that may take it; else (every free rank holds it)
    the least loaded free rank.

    Args:
        new: ``int64[B, K, S]`` kept copies (``-1`` free or dead).
        kl: ``float64[B, K]`` load per rank; ``nfree``: ``int64[B, K]`` free live slots.
        cap: ``int64[B, E]`` most copies of an expert per rank.
        pool_e, pool_w: ``int64[B, M]`` / ``float64[B, M]`` copies to place and their loads.
        per_row: ``int64[B]`` pool length per row.
        w_min, lim: ``float64[B]``.
    """
    num_b, num_k, num_s = new.shape
    c = np.zeros((num_k, num_e + 1), dtype=np.int64)
    for b in range(num_b):
        if per_row[b] == 0:
            continue
        for k in range(num_k):
            for s in range(num_s):
                x = new[b, k, s]
                c[k, x if x >= 0 else num_e] += 1
        for i in range(per_row[b]):
            e = pool_e[b, i]
            w = pool_w[b, i]
            ka = -1
            fa = np.inf
            kf = -1
            ff = np.inf
            for k in range(num_k):
                if nfree[b, k] > 0 and c[k, e] < cap[b, e]:
                    a = kl[b, k] + w
                    if a < fa or ka < 0:
                        fa, ka = a, k
                    if a + (nfree[b, k] - 1) * w_min[b] <= lim[b] and (a < ff or kf < 0):
                        ff, kf = a, k
            if kf >= 0:
                ka = kf
            elif ka < 0:
                lo = np.inf
                for k in range(num_k):
                    if nfree[b, k] > 0 and (kl[b, k] < lo or ka < 0):
                        lo, ka = kl[b, k], k
            sp = 0
            while new[b, ka, sp] >= 0:
                sp += 1
            new[b, ka, sp] = e
            nfree[b, ka] -= 1
            kl[b, ka] += w
            c[ka, e] += 1
        for k in range(num_k):
            c[k, :] = 0


@numba.njit(cache=True, nogil=True)
def swap_repair(new, alive, wc, cap, old, thr, lim, keep_frac, num_light):
    """:func:`moeshard.eplb.sticky._swap_repair` (one heavy rank per round), in place, row by
    row: while the heaviest rank is over ``lim`` (at most ``K`` rounds), the swap of one of
    its copies with a copy of one of the ``num_light`` least loaded ranks within ``lim`` that
    lowers the pair's peak below ``keep_frac`` x its load: fewest added moves where the peak
    is within ``lim``, then the lowest peak (first in (slot, light rank, slot) order on ties);
    a row stops when there is none.

    Args:
        new: ``int64[B, K, S]`` packing; ``old``: ``int64[B, K, S]`` the old copies.
        alive: ``bool[B, K]``; ``wc``: ``float64[B, E]`` per-copy loads; ``cap``: ``int64[B, E]``.
        thr, lim: ``float64[B]`` threshold, with its slack.
        keep_frac: ``1 - EPS``.
    """
    num_b, num_k, num_s = new.shape
    num_e = wc.shape[1]
    m2 = min(num_light, num_k)
    c = np.zeros((num_k, num_e + 1), dtype=np.int64)
    held = np.zeros((num_k, num_e + 1), dtype=np.bool_)
    ws = np.empty(num_k * num_s)
    lr = np.empty(num_k)
    light = np.empty(num_k, dtype=np.int64)
    for b in range(num_b):
        for k in range(num_k):
            for s in range(num_s):
                x = new[b, k, s]
                ws[k * num_s + s] = wc[b, x] if x >= 0 else 0.0
            lr[k] = 0.0 + pairwise_sum(ws, k * num_s, num_s) if alive[b, k] else -np.inf
        h = 0
        for k in range(1, num_k):
            if lr[k] > lr[h]:
                h = k
        if not lr[h] > lim[b]:
            continue
        for k in range(num_k):
            for s in range(num_s):
                x = new[b, k, s]
                c[k, x if x >= 0 else num_e] += 1
                y = old[b, k, s]
                held[k, y if y >= 0 else num_e] = True
        den = max(thr[b], 1e-300)
        for _ in range(num_k):
            h = 0
            for k in range(1, num_k):
                if lr[k] > lr[h]:
                    h = k
            lh = lr[h]
            if not lh > lim[b]:
                break
            # the ranks by load, lightest first (dead ones last), the first on ties
            for k in range(num_k):
                light[k] = k
            for i in range(1, num_k):
                j = i
                while j > 0 and _after(lr, light[j - 1], light[j]):
                    light[j - 1], light[j] = light[j], light[j - 1]
                    j -= 1
            best = np.inf
            qa = qk = qb = -1
            bar = lh * keep_frac
            for sa in range(num_s):
                a = new[b, h, sa]
                if a < 0:
                    continue
                wa = ws[h * num_s + sa]
                for j in range(m2):
                    k = light[j]
                    l2 = lr[k]
                    if not (np.isfinite(l2) and l2 <= lim[b]) or c[k, a] >= cap[b, a]:
                        continue
                    mv_a = (0 if held[k, a] else 1) - (0 if held[h, a] else 1)
                    for sb in range(num_s):
                        e = new[b, k, sb]
                        if e < 0 or c[h, e] >= cap[b, e]:
                            continue
                        d = wa - ws[k * num_s + sb]
                        if not d > 0:
                            continue
                        x = lh - d
                        y = l2 + d
                        peak = x if x >= y else y
                        if not peak < bar:
                            continue
                        mv = mv_a + (0 if held[h, e] else 1) - (0 if held[k, e] else 1)
                        score = (mv * 4.0 if peak <= lim[b] else 100.0) + peak / den
                        if score < best:
                            best, qa, qk, qb = score, sa, k, sb
            if qa < 0:
                break
            ea, eb = new[b, h, qa], new[b, qk, qb]
            wa, wb = ws[h * num_s + qa], ws[qk * num_s + qb]
            new[b, h, qa], new[b, qk, qb] = eb, ea
            ws[h * num_s + qa], ws[qk * num_s + qb] = wb, wa
            c[h, ea] -= 1
            c[h, eb] += 1
            c[qk, eb] -= 1
            c[qk, ea] += 1
            lr[h] -= wa - wb
            lr[qk] += wa - wb
        for k in range(num_k):
            c[k, :] = 0
            held[k, :] = False


@numba.njit(cache=True, nogil=True)
def restore(new, old, wc, cap, lim, scale, max_rounds):
    """:func:`moeshard.eplb.sticky.restore` (first holders only), in place, row by row: per
    round, from the round's loads, every swap that sends a copy its rank did not hold to the
    first rank that held its expert, gains copies back and leaves both ranks within ``lim``;
    then the best ones (score ``gain - |d| x scale``, the first on ties) on distinct ranks, at
    most ``K / 2``. A row stops after a round with none.

    Args:
        new: ``int64[B, K, S]``; ``old``: ``int64[B, K, S]`` the old copies.
        wc: ``float64[B, E]``; ``cap``: ``int64[B, E]``; ``lim``, ``scale``: ``float64[B]``.
    """
    num_b, num_k, num_s = new.shape
    num_e = wc.shape[1]
    ks = num_k * num_s
    held = np.zeros((num_k, num_e + 1), dtype=np.bool_)
    holder = np.empty(num_e, dtype=np.int64)
    c = np.zeros((num_k, num_e + 1), dtype=np.int64)
    wx = np.empty(ks)
    loads = np.empty(num_k)
    h_own = np.empty(ks, dtype=np.bool_)
    n_max = ks * num_s
    c_score = np.empty(n_max)
    c_p = np.empty(n_max, dtype=np.int64)
    c_q = np.empty(n_max, dtype=np.int64)
    touched = np.zeros(num_k, dtype=np.bool_)
    for b in range(num_b):
        x = new[b].reshape(-1)
        for k in range(num_k):
            for s in range(num_s):
                y = old[b, k, s]
                if y >= 0:
                    held[k, y] = True
        for e in range(num_e):
            holder[e] = -1
            for k in range(num_k):
                if held[k, e]:
                    holder[e] = k
                    break
        for _ in range(max_rounds):
            for p in range(ks):
                xp = x[p]
                wx[p] = wc[b, xp] if xp >= 0 else 0.0
                c[p // num_s, xp if xp >= 0 else num_e] += 1
                h_own[p] = xp >= 0 and held[p // num_s, xp]
            for k in range(num_k):
                loads[k] = 0.0 + pairwise_sum(wx, k * num_s, num_s)
            n = 0
            for p in range(ks):
                xp = x[p]
                if xp < 0 or h_own[p]:
                    continue
                rq = holder[xp]
                rp = p // num_s
                if rq < 0 or rq == rp:
                    continue
                for q in range(rq * num_s, rq * num_s + num_s):
                    xq = x[q]
                    if xq < 0 or xq == xp:
                        continue
                    gain = 1 + (1 if held[rp, xq] else 0) - (1 if h_own[q] else 0)
                    d = wx[p] - wx[q]
                    if gain <= 0 or not loads[rp] - d <= lim[b] or not loads[rq] + d <= lim[b]:
                        continue
                    if c[rq, xp] >= cap[b, xp] or c[rp, xq] >= cap[b, xq]:
                        continue
                    c_score[n] = gain - abs(d) * scale[b]
                    c_p[n] = p
                    c_q[n] = q
                    n += 1
            for k in range(num_k):
                c[k, :] = 0
            if n == 0:
                break
            for k in range(num_k):
                touched[k] = False
            for _ in range(max(1, num_k // 2)):
                j = -1
                for i in range(n):
                    if touched[c_p[i] // num_s] or touched[c_q[i] // num_s]:
                        continue
                    if j < 0 or c_score[i] > c_score[j]:
                        j = i
                if j < 0:
                    break
                p, q = c_p[j], c_q[j]
                x[p], x[q] = x[q], x[p]
                touched[p // num_s] = True
                touched[q // num_s] = True
        for k in range(num_k):
            held[k, :] = False


@numba.njit(cache=True, nogil=True)
def _after(lr, i, j):
    """Rank ``i`` sorts after rank ``j`` by load (dead ranks, ``-inf``, last; then by index)."""
    li = lr[i] if np.isfinite(lr[i]) or lr[i] > 0 else np.inf
    lj = lr[j] if np.isfinite(lr[j]) or lr[j] > 0 else np.inf
    return li > lj or (li == lj and i > j)
