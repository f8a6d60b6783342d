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

__all__ = ["MAX_SLOTS", "pack", "restore", "swap_repair"]


@numba.njit(cache=True, nogil=True)
def pack(x, alive, cnt, wc, w_min, thr, lim, keep_frac, num_light, repair, dup_held):
    """:func:`moeshard.eplb.sticky.sticky_pack`, row by row: the copies kept (each old copy of
    an expert of the row on its live rank, at most ``cap`` per rank and ``cnt`` in all, the
    first in slot order), the evictions, the placement of the rest and (``repair``) the swap
    repair (:func:`swap_repair`).

    Args:
        x: ``int64[B, K, S]`` old copies, dead ranks' ``-1``.
        alive: ``bool[B, K]``; ``cnt``: ``int64[B, E]`` new replica counts; ``wc``:
            ``float64[B, E]`` per-copy loads.
        w_min, thr, lim: ``float64[B]`` the row's lightest copy, threshold, threshold with
            its slack; ``keep_frac``: ``1 - EPS``; ``num_light``: the repair's light ranks.
        dup_held: ``bool[B]`` rows whose copies left to place go first to a rank that held
            their expert (:func:`_place_row`).

    Returns:
        ``int64[B, K, S]`` the packing and ``int64[B, E]`` the caps (most copies of an
        expert per rank).
    """
    num_b, num_k, num_s = x.shape
    num_e = cnt.shape[1]
    new = np.full((num_b, num_k, num_s), -1, dtype=np.int64)
    cap = np.empty((num_b, num_e), dtype=np.int64)
    keep = np.zeros((num_k, num_s), dtype=np.bool_)
    wslot = np.zeros((num_k, num_s))
    kl = np.empty(num_k)
    n_kept = np.zeros(num_k, dtype=np.int64)
    nfree = np.zeros(num_k, dtype=np.int64)
    cr = np.zeros((num_k, num_e + 1), dtype=np.int64)
    ce = np.zeros(num_e, dtype=np.int64)
    pool_e = np.empty(num_k * num_s, dtype=np.int64)
    ids = np.empty(num_e, dtype=np.int64)
    key = np.empty(num_e)
    c, held, ws, lr, light = _scratch(num_k, num_s, num_e)
    for b in range(num_b):
        n_live = 0
        for k in range(num_k):
            n_live += 1 if alive[b, k] else 0
        for e in range(num_e):
            # 1 unless more copies than live ranks (no division for the many others)
            ce_ = cnt[b, e]
            cap[b, e] = max(1, (ce_ + n_live - 1) // n_live) if n_live > 0 and ce_ > n_live else 1
        # kept: the rank's first cap copies of an expert, the row's first cnt (slot order)
        for k in range(num_k):
            n_kept[k] = 0
            for s in range(num_s):
                e = x[b, k, s]
                keep[k, s] = False
                wslot[k, s] = 0.0
                if e >= 0 and cnt[b, e] > 0:
                    o = cr[k, e]
                    cr[k, e] += 1
                    if o < cap[b, e]:
                        if ce[e] < cnt[b, e]:
                            keep[k, s] = True
                            wslot[k, s] = wc[b, e]
                            n_kept[k] += 1
                        ce[e] += 1
            kl[k] = 0.0 + pairwise_sum(wslot[k], 0, num_s)
        _evict_row(keep, wslot, kl, n_kept, alive[b], w_min[b], thr[b], lim[b])
        for k in range(num_k):
            nfree[k] = 0
            for s in range(num_s):
                e = x[b, k, s]
                if e >= 0:
                    cr[k, e] = 0
                if keep[k, s]:
                    new[b, k, s] = e
                elif alive[b, k]:
                    nfree[k] += 1
        # the rest, heaviest first (by expert id on ties)
        for e in range(num_e):
            ce[e] = cnt[b, e]
        for k in range(num_k):
            for s in range(num_s):
                if keep[k, s]:
                    ce[x[b, k, s]] -= 1
        n_ids = 0
        m = 0
        for e in range(num_e):
            assert ce[e] >= 0
            if ce[e] > 0:
                ids[n_ids] = e
                key[n_ids] = -wc[b, e]
                n_ids += 1
                m += ce[e]
        total_free = 0
        for k in range(num_k):
            total_free += nfree[k]
        assert total_free == m
        order = np.argsort(key[:n_ids], kind="mergesort")
        i = 0
        for j in range(n_ids):
            e = ids[order[j]]
            for _ in range(ce[e]):
                pool_e[i] = e
                i += 1
        for e in range(num_e):
            ce[e] = 0
        _place_row(new[b], kl, nfree, cap[b], pool_e, m, wc[b], w_min[b], lim[b], cr, x[b], dup_held[b])
        _zero_at(cr, new[b])
        if repair:
            _repair_row(
                new[b], alive[b], wc[b], cap[b], x[b], thr[b], lim[b], keep_frac, num_light, c, held, ws, lr, light
            )
    return new, cap


@numba.njit(cache=True, nogil=True)
def _evict_row(keep, wslot, kl, n_kept, alive, w_min, thr, lim):
    """The evictions of one row, in place: while a live rank's kept copies plus the reserve of
    its free slots (``w_min`` each) are over ``lim``, it drops the lightest kept copy that
    brings it under ``thr``, else its heaviest."""
    num_k, num_s = keep.shape
    for k in range(num_k):
        if not alive[k]:
            continue
        for _ in range(num_s):
            if n_kept[k] <= 0:
                break
            reserve = (num_s - n_kept[k]) * w_min
            if not kl[k] + reserve > lim:
                break
            excess = kl[k] + reserve - thr + w_min
            s1 = -1
            c1 = np.inf
            s2 = -1
            c2 = -np.inf
            for s in range(num_s):
                if keep[k, s]:
                    ws = wslot[k, s]
                    if ws >= excess and ws < c1:
                        c1, s1 = ws, s
                    if ws > c2 or s2 < 0:
                        c2, s2 = ws, s
            s = s1 if s1 >= 0 else s2
            keep[k, s] = False
            n_kept[k] -= 1
            kl[k] -= wslot[k, s]
            wslot[k, s] = 0.0


@numba.njit(cache=True, nogil=True)
def _place_row(new, kl, nfree, cap, pool_e, m, wc, w_min, lim, c, old, dup):
    """The placement of one row's pool ``pool_e[:m]`` (heaviest first), in place: each copy
    onto the least loaded live rank with a free slot that may take the expert, if it stays
    under ``lim`` with the reserve of its further free slots; else the least loaded one that
    may take it; else (every free rank holds it) the least loaded free rank. ``c``: a zeroed
    ``int64[K, E + 1]`` scratch. ``dup``: a rank that held the expert in ``old``
    ``int64[K, S]`` may take one copy over the cap, and the least loaded such rank where the
    copy fits goes first."""
    num_k, num_s = new.shape
    num_e = len(wc)
    for k in range(num_k):
        for s in range(num_s):
            y = new[k, s]
            c[k, y if y >= 0 else num_e] += 1
    for i in range(m):
        e = pool_e[i]
        w = wc[e]
        ka = -1
        fa = np.inf
        kf = -1
        ff = np.inf
        kh = -1
        fh = np.inf
        for k in range(num_k):
            h = 0
            if dup:
                for s in range(num_s):
                    if old[k, s] == e:
                        h = 1
                        break
            if nfree[k] > 0 and c[k, e] < cap[e] + h:
                a = kl[k] + w
                if a < fa or ka < 0:
                    fa, ka = a, k
                if a + (nfree[k] - 1) * w_min <= lim:
                    if a < ff or kf < 0:
                        ff, kf = a, k
                    if h and (a < fh or kh < 0):
                        fh, kh = a, k
        if kh >= 0:
            ka = kh
        elif kf >= 0:
            ka = kf
        elif ka < 0:
            lo = np.inf
            for k in range(num_k):
                if nfree[k] > 0 and (kl[k] < lo or ka < 0):
                    lo, ka = kl[k], k
        sp = 0
        while new[ka, sp] >= 0:
            sp += 1
        new[ka, sp] = e
        nfree[ka] -= 1
        kl[ka] += w
        c[ka, e] += 1


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
    c, held, ws, lr, light = _scratch(num_k, num_s, wc.shape[1])
    for b in range(num_b):
        _repair_row(
            new[b], alive[b], wc[b], cap[b], old[b], thr[b], lim[b], keep_frac, num_light, c, held, ws, lr, light
        )


@numba.njit(cache=True, nogil=True)
def _scratch(num_k, num_s, num_e):
    """Zeroed work arrays of :func:`_repair_row`: copies and old copies per rank and expert,
    slot loads, rank loads, ranks by load."""
    return (
        np.zeros((num_k, num_e + 1), dtype=np.int64),
        np.zeros((num_k, num_e + 1), dtype=np.bool_),
        np.empty(num_k * num_s),
        np.empty(num_k),
        np.empty(num_k, dtype=np.int64),
    )


@numba.njit(cache=True, nogil=True)
def _repair_row(new, alive, wc, cap, old, thr, lim, keep_frac, num_light, c, held, ws, lr, light):
    """The swap repair of one row (:func:`swap_repair`), in place; ``c`` and ``held`` are
    zeroed again on return."""
    num_k, num_s = new.shape
    num_e = len(wc)
    m2 = min(num_light, num_k)
    for k in range(num_k):
        for s in range(num_s):
            x = new[k, s]
            ws[k * num_s + s] = wc[x] if x >= 0 else 0.0
        lr[k] = 0.0 + pairwise_sum(ws, k * num_s, num_s) if alive[k] else -np.inf
    h = 0
    for k in range(1, num_k):
        if lr[k] > lr[h]:
            h = k
    if not lr[h] > lim:
        return
    for k in range(num_k):
        for s in range(num_s):
            x = new[k, s]
            c[k, x if x >= 0 else num_e] += 1
            y = old[k, s]
            held[k, y if y >= 0 else num_e] = True
    den = max(thr, 1e-300)
    # loads >= 0: a swap's d = w_a - w_b <= w_a, so its peak is at least max(lh - w_a, l2)
    # (rounding is monotone) and its moves at least those of a, less one: copies and ranks
    # whose every swap misses the bar or cannot score below the best so far are passed over
    nonneg = True
    for i in range(num_k * num_s):
        if not ws[i] >= 0.0:
            nonneg = False
    for _ in range(num_k):
        h = 0
        for k in range(1, num_k):
            if lr[k] > lr[h]:
                h = k
        lh = lr[h]
        if not lh > lim:
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
            a = new[h, sa]
            if a < 0:
                continue
            wa = ws[h * num_s + sa]
            xa = lh - wa
            if nonneg and not xa < bar:
                continue
            for j in range(m2):
                k = light[j]
                l2 = lr[k]
                if not (np.isfinite(l2) and l2 <= lim) or c[k, a] >= cap[a]:
                    continue
                mv_a = (0 if held[k, a] else 1) - (0 if held[h, a] else 1)
                if nonneg:
                    lb = xa if xa >= l2 else l2
                    if not ((mv_a - 1) * 4.0 if lb <= lim else 100.0) + lb / den < best:
                        continue
                for sb in range(num_s):
                    e = new[k, sb]
                    if e < 0:
                        continue
                    d = wa - ws[k * num_s + sb]
                    if not d > 0:
                        continue
                    x = lh - d
                    y = l2 + d
                    peak = x if x >= y else y
                    # the cap's lookups after the cheap tests (the same swaps pass)
                    if not peak < bar or c[h, e] >= cap[e]:
                        continue
                    mv = mv_a + (0 if held[h, e] else 1) - (0 if held[k, e] else 1)
                    score = (mv * 4.0 if peak <= lim else 100.0) + peak / den
                    if score < best:
                        best, qa, qk, qb = score, sa, k, sb
        if qa < 0:
            break
        ea, eb = new[h, qa], new[qk, qb]
        wa, wb = ws[h * num_s + qa], ws[qk * num_s + qb]
        new[h, qa], new[qk, qb] = eb, ea
        ws[h * num_s + qa], ws[qk * num_s + qb] = wb, wa
        c[h, ea] -= 1
        c[h, eb] += 1
        c[qk, eb] -= 1
        c[qk, ea] += 1
        lr[h] -= wa - wb
        lr[qk] += wa - wb
    # swaps keep a row's ids: the nonzero counts are the final row's
    _zero_at(c, new)
    _unset_at(held, old)


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
            _zero_at(c, new[b])
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
        _unset_at(held, old[b])


@numba.njit(cache=True, nogil=True)
def _after(lr, i, j):
    """Rank ``i`` sorts after rank ``j`` by load (dead ranks, ``-inf``, last; then by index)."""
    li = lr[i] if np.isfinite(lr[i]) or lr[i] > 0 else np.inf
    lj = lr[j] if np.isfinite(lr[j]) or lr[j] > 0 else np.inf
    return li > lj or (li == lj and i > j)


@numba.njit(cache=True, nogil=True)
def _zero_at(c, row):
    """``c[k, e] = 0`` (``int64[K, E + 1]``) for each id ``e`` of ``row`` ``int64[K, S]`` (-1:
    the last column): a count table back to zeros where the row's ids are its only nonzeros,
    without clearing every expert of every rank."""
    num_k, num_s = row.shape
    num_e = c.shape[1] - 1
    for k in range(num_k):
        for s in range(num_s):
            e = row[k, s]
            c[k, e if e >= 0 else num_e] = 0


@numba.njit(cache=True, nogil=True)
def _unset_at(held, row):
    """:func:`_zero_at` of a ``bool[K, E + 1]`` table."""
    num_k, num_s = row.shape
    num_e = held.shape[1] - 1
    for k in range(num_k):
        for s in range(num_s):
            e = row[k, s]
            held[k, e if e >= 0 else num_e] = False
