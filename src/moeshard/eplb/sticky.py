"""Sticky packing, the kernel of the migration-aware policy (:mod:`moeshard.eplb.aware`): pack
given replica counts onto the live ranks of a row (one layer, or one node of a layer), keeping
old copies where they are as far as a load threshold allows (:func:`sticky_pack`); the local
search that swaps copies between ranks over the threshold and light ranks
(:func:`_swap_repair`); and the one that, from a balanced packing (the reference's), swaps
copies back to ranks that held them while every rank stays within the threshold
(:func:`restore`). Arrays are batched over rows: ``[B, K, S]`` (rows, ranks, slots).

Where numba is installed (``pip install moeshard[fast]``), the sequential loops of large
packings (the evictions, the placement, the swap repair, the swap-back search) run compiled,
row by row (the ``sticky_kernel`` module): the same choices to the last bit, ties included.
``MOESHARD_EPLB_JIT=0`` in the environment keeps numpy's loops.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .metrics import count_last
from .oblivious import occurrence, per_rank_cap, repair_duplicates

# Relative slack of float comparisons against a load threshold.
EPS = 1e-9
# Sticky packings of at least this many slots (rows x ranks x slots) run their loops compiled
# where numba is installed (``sticky_kernel``; ``MOESHARD_EPLB_JIT=0`` keeps numpy's): a
# model's shape (DeepSeek-V3: ~20,000), not a toy's, whose few ms in numpy are less than
# importing numba costs a process. Once a process has it, smaller ones run compiled too.
_JIT_FROM = 4096

# Light ranks the swap repair pairs an overloaded rank with.
_NUM_LIGHT = 8


def _kernel(size: int, wc: np.ndarray, thr: np.ndarray):
    """The compiled loops' module (``sticky_kernel``) for a packing of ``size`` slots, or None
    (numpy's loops: see :func:`moeshard.eplb.jit.kernel`, or not float64 loads)."""
    if wc.dtype != np.float64 or thr.dtype != np.float64 or not (wc.flags.c_contiguous and thr.flags.c_contiguous):
        return None
    return jit.kernel("sticky_kernel", size, _JIT_FROM)


def sticky_pack(
    old: np.ndarray,
    alive: np.ndarray,
    cnt: np.ndarray,
    wc: np.ndarray,
    thr: np.ndarray,
    no_duplicates: bool = True,
    dup_held: np.ndarray | None = None,
) -> np.ndarray:
    """Sticky packing of ``cnt`` copies into live packs, keeping old copies where the load
    allows. ``old`` ``int[B, K, S]`` old expert ids (-1 empty), ``alive`` ``bool[B, K]``, ``cnt``
    ``int[B, E]`` new replica counts (their sum = live slots of the row), ``wc`` ``float[B, E]``
    per-copy load, ``thr`` ``float[B]`` eviction threshold. A copy never replaces a lighter one
    of a full rank: against the reference's own balance that costs moves the LPT fallback of
    :mod:`moeshard.eplb.aware` does not need. ``no_duplicates``: the swap repair of moeshard's
    rule (a rank holds no two copies of an expert when avoidable) afterwards; the reference has
    no such rule. ``dup_held`` ``bool[B]`` (rows, default none): a copy left to place goes
    preferably to a rank that held its expert, where it fits, even as a second copy there (made
    from the rank's own weights: nothing travels).
    Returns ``int[B, K, S]`` (kept copies in their old slot; dead packs -1)."""
    num_b, num_k, num_s = old.shape
    num_e = cnt.shape[1]
    rows = np.arange(num_b)
    bi = rows[:, None, None]
    x = np.where(alive[:, :, None], old, -1)
    kernel = _kernel(num_b * num_k * num_s, wc, thr)
    if kernel is not None:
        x, alive = np.ascontiguousarray(x, dtype=np.int64), np.ascontiguousarray(alive)
        w_min, lim = np.where(cnt > 0, wc, np.inf).min(1), thr * (1 + EPS)
        args = (wc, w_min, thr, lim, 1 - EPS, _NUM_LIGHT)
        dup = np.zeros(num_b, dtype=bool) if dup_held is None else np.ascontiguousarray(dup_held, dtype=bool)
        new, cap = kernel.pack(x, alive, np.ascontiguousarray(cnt, dtype=np.int64), *args, not no_duplicates, dup)
        if no_duplicates:
            repair_duplicates(new, wc, cap)
            kernel.swap_repair(new, alive, wc, cap, x, thr, lim, 1 - EPS, _NUM_LIGHT)
        return new
    n_live = alive.sum(1)
    cap = per_rank_cap(cnt, n_live)
    xe = np.maximum(x, 0)
    keep = (x >= 0) & (cnt[bi, xe] > 0)
    keep &= occurrence(np.where(keep, x, -1)) < cap[bi, xe]
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
    n_kept = keep.sum(-1)  # [B, K], kept up to date below
    limit = thr[:, None] * (1 + EPS)
    for _ in range(num_s):
        reserve = (num_s - n_kept) * w_min[:, None]
        ob, ok = np.nonzero((kl + reserve > limit) & alive & (n_kept > 0))
        if not len(ob):
            break
        ar = np.arange(len(ob))
        ws, ks = wslot[ob, ok], keep[ob, ok]
        excess = kl[ob, ok] + reserve[ob, ok] - thr[ob] + w_min[ob]  # evicting c saves w_c - w_min
        c1 = np.where(ks & (ws >= excess[:, None]), ws, np.inf)
        s1 = c1.argmin(1)
        s2 = np.where(ks, ws, -np.inf).argmax(1)
        s = np.where(np.isfinite(c1[ar, s1]), s1, s2)
        keep[ob, ok, s] = False
        n_kept[ob, ok] -= 1
        kl[ob, ok] -= wslot[ob, ok, s]
        wslot[ob, ok, s] = 0.0

    new = np.where(keep, x, -1)
    kept_cnt = count_last(np.where(keep, xe, -1).reshape(num_b, -1), num_e)
    rem = cnt - kept_cnt[:, :num_e]
    assert (rem >= 0).all()
    nfree = ((new < 0) & alive[:, :, None]).sum(-1)
    assert (nfree.sum(1) == rem.sum(1)).all()

    # Remaining copies, heaviest first (a pending pool per row), like the reference's greedy:
    # to the least loaded live rank with a free slot that may take the expert, if it stays
    # under the threshold (with the reserve); else to the least loaded rank with a free slot,
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
    # heaviest first, the first in the pool on ties: each row's pool sorted once
    order = np.argsort(-pool_w, axis=1, kind="stable")
    pool_e, pool_w = np.take_along_axis(pool_e, order, 1), np.take_along_axis(pool_w, order, 1)
    counts = count_last(new, num_e)
    if dup_held is not None:
        held_x = np.zeros((num_b, num_k, num_e + 1), dtype=bool)
        held_x[bi, np.arange(num_k)[None, :, None], np.where(x >= 0, x, num_e)] = True
    for i in range(m):
        r = np.flatnonzero(per_row > i)
        ar = np.arange(len(r))
        e, w = pool_e[r, i], pool_w[r, i]
        load = kl[r]
        if dup_held is None:
            blocked = counts[r, :, e] >= cap[r, e][:, None]
        else:
            h = held_x[r, :, e] & dup_held[r][:, None]
            blocked = counts[r, :, e] >= cap[r, e][:, None] + h
        free = nfree[r] > 0
        after_a = np.where(free & ~blocked, load + w[:, None], np.inf)
        ka = after_a.argmin(1)
        fa = after_a[ar, ka]
        # room for this copy and the lightest possible copy in each further free slot
        fit = np.where(free & ~blocked, load + w[:, None] + (nfree[r] - 1) * w_min[r][:, None], np.inf)
        fit = np.where(fit <= thr[r][:, None] * (1 + EPS), after_a, np.inf)
        kf = fit.argmin(1)
        if dup_held is not None:
            fh = np.where(h, fit, np.inf)
            kh = fh.argmin(1)
            kf = np.where(np.isfinite(fh[ar, kh]), kh, kf)
        ok_a = np.isfinite(fit[ar, kf])
        ka = np.where(ok_a, kf, ka)
        forced = ~ok_a & ~np.isfinite(fa)  # every free rank holds the expert: allow a duplicate
        if forced.any():
            ka[forced] = np.where(free[forced], load[forced], np.inf).argmin(1)
        # place into a free slot
        sp = (new[r, ka] < 0).argmax(1)
        new[r, ka, sp] = e
        nfree[r, ka] -= 1
        kl[r, ka] += w
        counts[r, ka, e] += 1
    if no_duplicates:
        repair_duplicates(new, wc, cap)
    _swap_repair(new, alive, wc, cap, x, thr)
    return new


def _swap_repair(
    new: np.ndarray,
    alive: np.ndarray,
    wc: np.ndarray,
    cap: np.ndarray,
    old: np.ndarray,
    thr: np.ndarray,
    num_heavy: int = 1,
    num_light: int = _NUM_LIGHT,
) -> None:
    """Local search, in place, for ranks over ``thr``: swap one of an overloaded rank's copies
    with a lighter copy on one of the row's ``num_light`` least loaded ranks, so that both end
    at most ``thr`` (fewest added moves, then the lowest peak) or at least the peak drops.

    The greedy placement of sticky_pack can only use the slots that evictions freed, and those are
    on ranks near the threshold; a few 2-exchanges with light ranks fix that. Each round
    repairs up to ``num_heavy`` overloaded ranks per row (distinct partners). ``new``
    ``int[B, K, S]``; ``old`` ``int[B, K, S]`` the old copies (to count moves); ``alive``
    ``bool[B, K]``; ``wc``/``cap`` ``[B, E]``; ``thr`` ``float[B]``.
    """
    num_k, num_s = new.shape[1:]
    num_e = wc.shape[1]
    li = np.arange(new.shape[0])[:, None, None]
    wslot = np.where(new >= 0, wc[li, np.maximum(new, 0)], 0.0)
    loads = np.where(alive, wslot.sum(-1), np.nan)
    # only rows with a rank over the threshold change: work on those
    rows0 = np.flatnonzero((np.nan_to_num(loads, nan=-np.inf) > (thr * (1 + EPS))[:, None]).any(1))
    if not len(rows0):
        return
    full, new = new, new[rows0]
    old, wc, cap, thr = old[rows0], wc[rows0], cap[rows0], thr[rows0]
    wslot, loads = wslot[rows0], loads[rows0]
    num_b = len(rows0)
    li = np.arange(num_b)[:, None, None]
    ki = np.arange(num_k)[None, :, None]
    held = np.zeros((num_b, num_k, num_e + 1), dtype=bool)
    held[li, ki, np.where(old < 0, num_e, old)] = True
    counts = count_last(new, num_e)
    limit = thr * (1 + EPS)
    stuck = np.zeros(num_b, dtype=bool)
    m1 = min(num_heavy, num_k)
    m2 = min(num_light, num_k)
    for _ in range(num_k):
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
        # flat indices (one index array per gather): slots of ranks, and (rank, expert) cells of
        # counts / held ([B, K, E + 1] both)
        rk1, rk2 = r[:, None] * num_k + k1, r[:, None] * num_k + k2  # [n, m1], [n, m2]
        sl = np.arange(num_s)
        f1, f2 = (rk1 * num_s)[..., None] + sl, (rk2 * num_s)[..., None] + sl
        newf, wsf = new.reshape(-1), wslot.reshape(-1)
        a, wa = newf[f1], wsf[f1]  # [n, m1, S]
        b, wb = newf[f2], wsf[f2]  # [n, m2, S]
        ae, be = np.maximum(a, 0), np.maximum(b, 0)
        e1 = num_e + 1
        cf, hf, capf = counts.reshape(-1), held.reshape(-1), cap.reshape(-1)
        # What does not depend on the pair of slots is built on the small shapes
        # [n, m1, S, m2] (a's side) and [n, m1, m2, S] (b's side), then broadcast once.
        at_k2 = (rk2 * e1)[:, None, None, :] + ae[..., None]  # a on k2: [n, m1, S, m2]
        at_k1 = (rk1 * e1)[:, :, None, None] + be[:, None]  # b on k1: [n, m1, m2, S]
        # the per-rank cap: k2 may take a, k1 may take b
        side_a = (cf[at_k2] < capf[r[:, None, None] * num_e + ae][..., None]) & (v1[:, :, None] & (a >= 0))[..., None]
        side_b = (cf[at_k1] < capf[r[:, None, None] * num_e + be][:, None]) & (v2[:, :, None] & (b >= 0))[:, None]
        gone = lambda h: (~h).astype(np.int64)  # noqa: E731 - a copy not held there before moves
        # moves added by the swap: a copy not held there before arrives, minus one that leaves
        mv_a = gone(hf[at_k2]) - gone(hf[(rk1 * e1)[..., None] + ae])[..., None]
        mv_b = gone(hf[at_k1]) - gone(hf[(rk2 * e1)[..., None] + be])[:, None]
        # Few pairs pass the masks (5-25 %): the peak and the score only on those.
        d = wa[:, :, :, None, None] - wb[:, None, None, :, :]  # [n, m1, S, m2, S]: load k1 -> k2
        # (two copies of one expert weigh the same: d > 0 also says a != b)
        ok = side_a[..., None] & side_b[:, :, None]
        ok &= d > 0
        idx = np.flatnonzero(ok)
        # idx = (((row * m1 + heavy) * S + slot_a) * m2 + light) * S + slot_b
        q = idx // num_s  # into [n, m1, S, m2]
        grp = q // (num_s * m2)  # row * m1 + heavy
        c2 = (q - grp * (num_s * m2)) % m2
        t = c2 * num_s + (idx - q * num_s)  # light * S + slot_b
        ci = grp // m1
        dc = d.ravel()[idx]
        l1c = l1.ravel()[grp]
        peak = np.maximum(l1c - dc, l2.ravel()[ci * m2 + c2] + dc)
        keep = np.flatnonzero(peak < l1c * (1 - EPS))
        idx, q, grp, t, ci, peak = idx[keep], q[keep], grp[keep], t[keep], ci[keep], peak[keep]
        rc = r[ci]
        base = np.where(peak <= limit[rc], (mv_a.ravel()[q] + mv_b.ravel()[grp * (m2 * num_s) + t]) * 4.0, 100.0)
        score = base + peak / np.maximum(thr[rc], 1e-300)
        # per (row, heavy rank): the lowest score, the first in (slot, light rank, slot) order on ties
        best = np.zeros(n * m1, dtype=np.int64)
        fine = np.zeros(n * m1, dtype=bool)
        if len(idx):
            starts = np.flatnonzero(np.r_[True, grp[1:] != grp[:-1]])
            low = np.minimum.reduceat(score, starts)
            at = np.flatnonzero(score == np.repeat(low, np.diff(np.r_[starts, len(score)])))
            ga = grp[at]
            first = at[np.r_[True, ga[1:] != ga[:-1]]]
            best[grp[first]] = idx[first] - grp[first] * (num_s * m2 * num_s)
            fine[grp[first]] = True
        best, fine = best.reshape(n, m1), fine.reshape(n, m1)
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
    full[rows0] = new


def restore(
    new: np.ndarray,
    old: np.ndarray,
    alive: np.ndarray,
    wc: np.ndarray,
    cap: np.ndarray,
    thr: np.ndarray,
    max_rounds: int = 8,
    num_holders: int = 1,
) -> None:
    """Local search, in place, that brings copies back to ranks that held them: swap two copies
    of two ranks of a row when the swap raises the number of copies on a rank that held
    their expert (by 1 or 2) and leaves both ranks at most ``thr`` (a balanced placement, e.g.
    the reference's packs, stays balanced while it moves fewer copies). Only swaps that send a
    copy to one of the first ``num_holders`` ranks that held its expert are looked at (the
    others gain nothing for it). Per round and row, the best swaps (most copies back, then the
    smallest load shift) on distinct ranks. ``new``/``old`` ``int[B, K, S]``; ``alive``
    ``bool[B, K]``; ``wc``/``cap`` ``[B, E]``; ``thr`` ``float[B]``."""
    num_b, num_k, num_s = new.shape
    num_e = wc.shape[1]
    if num_b == 0:
        return
    kernel = _kernel(new.size, wc, thr) if num_holders == 1 else None
    if kernel is not None:
        x = np.ascontiguousarray(new, dtype=np.int64)
        old = np.ascontiguousarray(old, dtype=np.int64)
        lim, scale = thr * (1 + EPS), 0.5 / np.maximum(thr, 1e-300)
        kernel.restore(x, old, wc, np.ascontiguousarray(cap, dtype=np.int64), lim, scale, max_rounds)
        new[...] = x
        return
    bk = np.arange(num_b)[:, None, None]
    held = np.zeros((num_b, num_k, num_e + 1), dtype=bool)
    held[bk, np.arange(num_k)[None, :, None], np.where(old < 0, num_e, old)] = True
    held[..., num_e] = False
    nh = min(num_holders, num_k)
    # holders[b, e, h]: the h-th rank that held expert e (-1: none)
    if nh == 1:
        # the first holder: argmax of a bool is its first True (a stable sort's first, cheaper)
        first = held[..., :num_e].argmax(1)  # [B, E]
        holders = np.where(held[..., :num_e].any(1), first, -1)[..., None]
    else:
        order = np.argsort(~held[..., :num_e], axis=1, kind="stable")[:, :nh, :]  # [B, H, E]
        holders = np.where(np.take_along_axis(held[..., :num_e], order, 1), order, -1).transpose(0, 2, 1)
    x = new.reshape(num_b, -1).copy()
    ks = num_k * num_s
    rank_of = np.repeat(np.arange(num_k), num_s)
    limit = thr * (1 + EPS)
    scale = 0.5 / np.maximum(thr, 1e-300)
    active = np.arange(num_b)
    for _ in range(max_rounds):
        if not len(active):
            break
        b = active
        nb = len(b)
        bb = np.arange(nb)
        xb = x[b]
        xe = np.where(xb < 0, num_e, xb)
        xc = np.minimum(xe, num_e - 1)
        wx = np.where(xb >= 0, wc[b[:, None], xc], 0.0)
        loads = wx.reshape(nb, num_k, num_s).sum(-1)
        counts = count_last(xb.reshape(nb, num_k, num_s), num_e)  # [nb, K, E+1]
        h_own = held[b[:, None], rank_of[None, :], xe]  # [nb, KS]
        # candidate swaps: a copy p that its rank did not hold -> slot t of a rank r that
        # held its expert (a kept copy gains nothing by leaving; the other side of a swap
        # is looked at from that copy's own candidates)
        lost = ~h_own & (xb >= 0)
        m = int(lost.sum(1).max())
        if m == 0:
            break
        p2 = np.argsort(~lost, axis=1, kind="stable")[:, :m]  # [nb, m]
        p_ok = np.take_along_axis(lost, p2, 1)
        r = np.where(p_ok[..., None], holders[b[:, None], np.take_along_axis(xc, p2, 1)], -1)  # [nb, m, H]
        rp = np.broadcast_to(rank_of[p2][:, :, None, None], (nb, m, nh, num_s))
        rq = np.broadcast_to(r[..., None], (nb, m, nh, num_s))
        q = np.maximum(rq, 0) * num_s + np.arange(num_s)
        p = np.broadcast_to(p2[:, :, None, None], q.shape)
        # flat indices (one index array per gather is much cheaper than four)
        b4 = bb[:, None, None, None]
        g4 = b[:, None, None, None]
        fp, fq = b4 * ks + p, b4 * ks + q
        rq0 = np.maximum(rq, 0)
        xp_, xq = xb.ravel()[fp], xb.ravel()[fq]
        xpe, xqe = xe.ravel()[fp], xe.ravel()[fq]
        e1 = num_e + 1
        valid = (rq >= 0) & (rq != rp) & (xq >= 0) & (xq != xp_)
        gain = 1 + held.ravel()[(g4 * num_k + rp) * e1 + xqe].astype(np.int8) - h_own.ravel()[fp] - h_own.ravel()[fq]
        d = wx.ravel()[fp] - wx.ravel()[fq]  # load that leaves rank(p) for rank(q)
        lim = limit[b][:, None, None, None]
        lf = loads.ravel()
        valid &= (gain > 0) & (lf[b4 * num_k + rp] - d <= lim) & (lf[b4 * num_k + rq0] + d <= lim)
        # Few swaps pass (a few %): the rest of the checks, the scores and the picks on those.
        at = np.flatnonzero(valid)
        row_c = at // valid[0].size  # into b
        g_c = b[row_c]
        rq_c, rp_c, xpe_c, xqe_c = rq0.ravel()[at], rp.ravel()[at], xpe.ravel()[at], xqe.ravel()[at]
        # the per-rank cap: rank(q) may take x[p], rank(p) may take x[q]
        cf, capf = counts.ravel(), cap.ravel()
        ok = cf[(row_c * num_k + rq_c) * e1 + xpe_c] < capf[g_c * num_e + np.minimum(xpe_c, num_e - 1)]
        ok &= cf[(row_c * num_k + rp_c) * e1 + xqe_c] < capf[g_c * num_e + np.minimum(xqe_c, num_e - 1)]
        at, row_c, rq_c, rp_c = at[ok], row_c[ok], rq_c[ok], rp_c[ok]
        if not len(at):
            break
        score = gain.ravel()[at] - np.abs(d.ravel()[at]) * scale[b][row_c]
        p_c, q_c = p.ravel()[at], q.ravel()[at]
        any_ok = np.zeros(nb, dtype=bool)
        any_ok[row_c] = True
        active = active[any_ok]
        touched = np.zeros((nb, num_k), dtype=bool).ravel()
        # several swaps per round on distinct ranks, best first (the first on ties)
        for _ in range(max(1, num_k // 2)):
            if not len(score):
                break
            starts = np.flatnonzero(np.r_[True, row_c[1:] != row_c[:-1]])
            top = np.maximum.reduceat(score, starts)
            hit = np.flatnonzero(score == np.repeat(top, np.diff(np.r_[starts, len(score)])))
            j = hit[np.r_[True, row_c[hit][1:] != row_c[hit][:-1]]]
            rows = b[row_c[j]]
            pp, qq = p_c[j], q_c[j]
            x[rows, pp], x[rows, qq] = x[rows, qq], x[rows, pp]
            touched[row_c[j] * num_k + rp_c[j]] = True
            touched[row_c[j] * num_k + rq_c[j]] = True
            left = ~(touched[row_c * num_k + rp_c] | touched[row_c * num_k + rq_c])
            score, row_c, rp_c, rq_c, p_c, q_c = (v[left] for v in (score, row_c, rp_c, rq_c, p_c, q_c))
    new[...] = x.reshape(new.shape)
