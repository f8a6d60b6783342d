"""Refinement of a packing of expert copies onto ranks: a local search that lowers the heaviest
rank of a layer by swapping one of its copies with a lighter copy of another rank of its node
(:func:`lower_peak`).

deepseek-ai/EPLB packs copies greedily (heaviest first onto the lightest rank with room, LPT),
which often leaves the heaviest rank a little over what a few swaps reach; the oblivious
policy (:mod:`moeshard.eplb.oblivious`) runs this search on its candidates, the reference's
answer among them, so that its answer is never less balanced than the reference's. Arrays
are batched over rows (layers): ``[B, N, K, S]`` (rows, nodes, live ranks of a node, slots
per rank). Only the heaviest rank of a row matters (the balance is max / mean and the mean
does not change), so each round works on that rank alone and its node's ranks.
"""

from __future__ import annotations

import numpy as np

# A swap must lower the pair's peak below the heaviest rank by this relative margin: sums of
# the same copies in another order differ by a few ulps, and such "gains" could cycle.
_MARGIN = 1e-12
# Relative widening (of the heaviest load) of the window of copy loads a round looks at:
# covers the rounding of ``d`` and of the loads' sums, so no swap that lowers the peak is
# outside it.
_WINDOW_SLACK = 1e-11
# Rounds with at most this many candidate pairs (rows x S x K x S) look at every pair.
_DENSE_PAIRS = 50000


def lower_peak(
    packs: np.ndarray,
    wc: np.ndarray,
    cap: np.ndarray | None = None,
    max_rounds: int | None = None,
    stop_at: np.ndarray | None = None,
) -> np.ndarray:
    """Swap local search, in place, on ``packs`` ``int[B, N, K, S]`` (expert ids; ``-1``, an
    empty slot, never takes part): per round and row, the heaviest rank ``h`` of the row (first
    on ties) swaps one of its copies ``a`` with a lighter copy ``b`` of another rank ``k`` of
    its node when both ranks end below ``h``'s load: the swap of lowest resulting peak
    ``max(load_h - d, load_k + d)``, ``d = w_a - w_b`` (first on ties). A row stops when its
    heaviest rank has no such swap. So a row's heaviest load never rises, copies never change
    node (groups stay on their node), and every rank keeps its number of copies.

    Args:
        packs: ``int[B, N, K, S]`` expert ids per row, node, rank and slot.
        wc: ``float[B, E]`` load of one copy of each expert.
        cap: ``int[B, E]`` most copies of an expert one rank may hold (moeshard's "no two
            copies of an expert on a rank when avoidable"); None: no limit (the reference's).
            A swap never breaks it; a rank already over it stays so.
        max_rounds: bound on the rounds (default ``N * K * S``: each round moves a copy per
            row, and in practice a row stops long before).
        stop_at: ``float[B]``: a row stops as soon as its heaviest rank is at most this (None:
            only when no swap lowers it; fewer swaps where a target is all that is needed).

    Returns:
        ``int[B]``: swaps made per row.
    """
    num_b, num_n, num_k, num_s = packs.shape
    num_e = wc.shape[1]
    swaps = np.zeros(num_b, dtype=np.int64)
    if num_b == 0 or num_k < 2:
        return swaps
    bi = np.arange(num_b)[:, None, None, None]
    wslot = np.where(packs >= 0, wc[bi, np.maximum(packs, 0)], 0.0)
    loads = wslot.sum(-1)  # [B, N, K]
    counts = None
    if cap is not None:
        # copies of each expert per rank (empty slots in the last column)
        flat = (
            np.where(packs < 0, num_e, packs).reshape(-1, num_s)
            + (np.arange(num_b * num_n * num_k) * (num_e + 1))[:, None]
        )
        counts = np.bincount(flat.ravel(), minlength=num_b * num_n * num_k * (num_e + 1))
        counts = counts.reshape(num_b, num_n, num_k, num_e + 1)
    # Each node's copies by load (empty slots last) and where each slot is in that order, for
    # the windowed search of large rounds: a swap exchanges two slots' copies, so the sorted
    # loads of a node never change, only which slot holds them.
    by_load = where = None
    if num_b * num_k * num_s * num_s > _DENSE_PAIRS:
        key = np.where(packs >= 0, wslot, np.inf).reshape(num_b, num_n, -1)
        by_load = np.argsort(key, axis=-1, kind="stable")
        sorted_w = np.take_along_axis(key, by_load, axis=-1)
        where = np.empty_like(by_load)
        np.put_along_axis(where, by_load, np.arange(num_k * num_s), axis=-1)
    active = np.arange(num_b)
    for _ in range(num_n * num_k * num_s if max_rounds is None else max_rounds):
        if stop_at is not None and len(active):
            active = active[loads[active].reshape(len(active), -1).max(1) > stop_at[active]]
        if not len(active):
            break
        peak = loads[active].reshape(len(active), -1).argmax(1)
        node, h = np.divmod(peak, num_k)
        found, k, sa, sb = _best_swaps(
            packs[active, node],
            wslot[active, node],
            loads[active, node],
            h,
            None if cap is None else (counts, cap, active, node),
            None if by_load is None else (sorted_w[active, node], by_load[active, node]),
        )
        active, node, h, k, sa, sb = active[found], node[found], h[found], k[found], sa[found], sb[found]
        if by_load is not None:
            p, q = h * num_s + sa, k * num_s + sb
            wp, wq = where[active, node, p], where[active, node, q]
            by_load[active, node, wp], by_load[active, node, wq] = q, p
            where[active, node, p], where[active, node, q] = wq, wp
        ea, eb = packs[active, node, h, sa], packs[active, node, k, sb]
        wa, wb = wslot[active, node, h, sa], wslot[active, node, k, sb]
        packs[active, node, h, sa], packs[active, node, k, sb] = eb, ea
        wslot[active, node, h, sa], wslot[active, node, k, sb] = wb, wa
        # the two ranks' loads summed again (not updated by +-d): no drift over rounds
        loads[active, node, h] = wslot[active, node, h].sum(-1)
        loads[active, node, k] = wslot[active, node, k].sum(-1)
        if counts is not None:  # one swap per row: no repeated index within an update
            counts[active, node, h, ea] -= 1
            counts[active, node, h, eb] += 1
            counts[active, node, k, eb] -= 1
            counts[active, node, k, ea] += 1
        swaps[active] += 1
    return swaps


def _best_swaps(packs: np.ndarray, wslot: np.ndarray, loads: np.ndarray, h: np.ndarray, caps, by_load=None):
    """One round of :func:`lower_peak` on ``n`` rows, each its heaviest rank's node:
    ``packs``/``wslot`` ``[n, K, S]``, ``loads`` ``float[n, K]``, ``h`` ``int[n]`` the heaviest
    rank, ``caps`` None or (``counts`` ``int[B, N, K, E + 1]``, ``cap`` ``int[B, E]``, the rows
    ``int[n]`` and nodes ``int[n]`` in them). Returns ``found`` ``bool[n]`` and, per row, the
    partner rank ``k`` and the two slots ``sa`` (on ``h``), ``sb`` (on ``k``), ``int[n]``: the
    swap of lowest peak, the first in ``(sa, k, sb)`` order on ties. Both ways of finding it
    give the same swap; the windowed one (which needs ``by_load``: the node's copy loads sorted,
    empty slots ``inf``, ``float[n, K*S]``, and their flat slots ``int[n, K*S]``) is cheaper
    when there are many pairs."""
    n, num_k, num_s = packs.shape
    if by_load is not None and n * num_k * num_s * num_s > _DENSE_PAIRS:
        return _best_swaps_window(packs, wslot, loads, h, caps, by_load)
    return _best_swaps_dense(packs, wslot, loads, h, caps)


def _best_swaps_window(packs: np.ndarray, wslot: np.ndarray, loads: np.ndarray, h: np.ndarray, caps, by_load):
    """:func:`_best_swaps` over the pairs of copies in a window (for many candidates):
    ``packs``/``wslot`` ``[n, K, S]``, ``loads`` ``float[n, K]``, ``h`` ``int[n]`` the heaviest
    rank, ``caps`` None or (``counts`` ``int[B, N, K, E + 1]``, ``cap`` ``int[B, E]``, the rows
    ``int[n]`` and nodes ``int[n]`` in them). Returns ``found`` ``bool[n]`` and, per row, the
    partner rank ``k`` and the two slots ``sa`` (on ``h``), ``sb`` (on ``k``), ``int[n]``.

    The swap of copy ``a`` (rank ``h``) with copy ``b`` (rank ``k``) moves ``d = w_a - w_b``
    from ``h`` to ``k``; it lowers the peak below ``h``'s load only if ``0 < d < load_h -
    load_k <= load_h - min load``. So per copy ``a`` only the copies ``b`` whose load lies in
    that window are looked at (the copies of the row sorted by load once): near the end of
    the search, when the ranks are within a small gap of each other, a few per copy instead of
    every copy of the node. Among those, the lowest peak, ties to the first in ``(a, k, b)``
    order: the same swap as a search over every pair."""
    n, num_k, num_s = packs.shape
    ks = num_k * num_s
    rows = np.arange(n)
    lh = loads[rows, h]
    ea = packs[rows, h]  # [n, S]
    # A swap that is not allowed gets a NaN or infinite peak: swapping an empty slot (NaN), a
    # copy that rank h may not take (NaN) and a copy rank k may not take (its load +inf). A
    # swap with h itself or of two copies of one expert never lowers the peak.
    wa = np.where(ea >= 0, wslot[rows, h], np.nan)
    wb = np.where(packs >= 0, wslot, np.nan).reshape(n, ks)
    # An upper bound P on the round's best peak: the best swap with the lightest rank (inf if
    # none). A swap of peak <= P has load_h - d <= P and load_k + d <= P, so w_b lies in
    # [w_a - (P - min load), w_a - (load_h - P)], widened by what rounding of d and of the
    # loads' sums may add; the whole [w_a - (load_h - min load), w_a) where P is inf.
    light = loads.argmin(1)
    lmin = loads[rows, light]
    p_light = _pair_peaks(
        wa, wb.reshape(n, num_k, num_s)[rows, light], lh, lmin, caps, packs[rows, light], ea, h, light
    )
    p_eff = np.minimum(p_light.min(1), lh)
    slack = _WINDOW_SLACK * np.abs(lh)
    ok_a = ~np.isnan(wa)
    q_lo = np.where(ok_a, wa - (p_eff - lmin + slack)[:, None], -np.inf)
    q_hi = np.where(ok_a, wa - (lh - p_eff - slack)[:, None], -np.inf)
    # counts of copies b with w_b < q (widened)
    sorted_w, b_sorted = by_load
    # One search over all rows: row r's loads (in [0, top]) shifted by r * span, its empty
    # slots at 0.7 span and its queries clamped to [-0.2, 0.45] span: bands that never mix.
    # The shift may round loads and queries by up to ``err``: the window is widened by that
    # (a wider window only adds candidates that the exact check below rejects).
    top = float(np.max(lh, initial=0.0))
    span = 4 * top + 1.0
    shift = np.arange(n)[:, None] * span
    err = 4 * np.spacing(n * span)
    keys = (np.minimum(sorted_w, 0.7 * span) + shift).ravel()
    lo = np.searchsorted(keys, (np.clip(q_lo, -0.2 * span, 0.45 * span) + shift).ravel() - err)
    hi = np.searchsorted(keys, (np.clip(q_hi, -0.2 * span, 0.45 * span) + shift).ravel() + err)
    lo = lo.reshape(n, num_s) - np.arange(n)[:, None] * ks
    hi = np.maximum(hi.reshape(n, num_s) - np.arange(n)[:, None] * ks, lo)
    # the candidates, one per (row, a, b in a's window), flat
    per = (hi - lo).ravel()
    ra = np.repeat(np.arange(n * num_s), per)  # row * S + sa
    at = np.repeat(lo.ravel() - (np.cumsum(per) - per), per) + np.arange(len(ra))
    row, sa = np.divmod(ra, num_s)
    bc = b_sorted[row, at]  # flat copy index k * S + sb
    k = bc // num_s
    wbc = wb[row, bc]
    load_k = loads[row, k]
    wac = wa[row, sa]
    if caps is not None:
        counts, cap, brow, node = caps
        g, nd = brow[row], node[row]
        pb = np.maximum(packs.reshape(n, ks)[row, bc], 0)
        ae = np.maximum(ea[row, sa], 0)
        wbc = np.where(counts[g, nd, h[row], pb] < cap[g, pb], wbc, np.nan)  # h may take b
        load_k = np.where(counts[g, nd, k, ae] < cap[g, ae], load_k, np.inf)  # k may take a
    d = wac - wbc  # load leaving h for k
    peak = np.maximum(lh[row] - d, load_k + d)
    # below h's load by the margin (d > 0 follows); NaN compares false
    ok = peak < lh[row] * (1 - _MARGIN)
    row, peak, flat = row[ok], peak[ok], (sa * ks + bc)[ok]  # flat: index in (a, k, b) order
    # per row the lowest peak, then the first in (a, k, b) order
    best = np.full(n, np.inf)
    np.minimum.at(best, row, peak)
    tie = peak == best[row]
    j = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(j, row[tie], flat[tie])
    found = np.isfinite(best)
    j = np.where(found, j, 0)
    sa, kb = np.divmod(j, ks)
    k, sb = np.divmod(kb, num_s)
    return found, k, sa, sb


def _pair_peaks(wa, wb, lh, lk, caps, pb, ea, h, k) -> np.ndarray:
    """``float[n, S * S]``: the peak of each swap of a copy of rank ``h`` (loads ``wa``
    ``[n, S]``, NaN for none) with a copy of one partner rank ``k`` ``int[n]`` (loads ``wb``
    ``[n, S]``, ids ``pb``, load ``lk`` ``float[n]``), ``inf`` where not allowed or not below
    ``h``'s load by the margin (as :func:`_best_swaps`)."""
    load_k = np.broadcast_to(lk[:, None], wa.shape)
    if caps is not None:
        counts, cap, brow, node = caps
        g = brow[:, None]
        be, ae = np.maximum(pb, 0), np.maximum(ea, 0)
        wb = np.where(counts[g, node[:, None], h[:, None], be] < cap[g, be], wb, np.nan)
        load_k = np.where(counts[g, node[:, None], k[:, None], ae] < cap[g, ae], load_k, np.inf)
    d = wa[:, :, None] - wb[:, None, :]
    peak = np.maximum(lh[:, None, None] - d, load_k[:, :, None] + d)
    return np.where(peak < (lh * (1 - _MARGIN))[:, None, None], peak, np.inf).reshape(len(lh), -1)


def _best_swaps_dense(packs: np.ndarray, wslot: np.ndarray, loads: np.ndarray, h: np.ndarray, caps):
    """:func:`_best_swaps` over every pair of copies (for few candidates: fewer passes):
    ``packs``/``wslot`` ``[n, K, S]``, ``loads`` ``float[n, K]``, ``h`` ``int[n]`` the heaviest
    rank, ``caps`` None or (``counts`` ``int[B, N, K, E + 1]``, ``cap`` ``int[B, E]``, the rows
    ``int[n]`` and nodes ``int[n]`` in them). Returns ``found`` ``bool[n]`` and, per row, the
    partner rank ``k`` and the two slots ``sa`` (on ``h``), ``sb`` (on ``k``), ``int[n]``."""
    n, num_k, num_s = packs.shape
    rows = np.arange(n)
    lh = loads[rows, h]
    ea = packs[rows, h]  # [n, S]
    # A swap that is not allowed gets a NaN or infinite peak, folded into the small operands:
    # the [n, S, K, S] candidates cost a handful of passes. Swapping an empty slot (NaN), a
    # copy that rank h may not take (NaN) and a copy rank k may not take (its load +inf) are
    # not allowed. A swap with h itself or of two copies of one expert never lowers the peak.
    wa = np.where(ea >= 0, wslot[rows, h], np.nan)
    wb = np.where(packs >= 0, wslot, np.nan)
    load_k = np.broadcast_to(loads[:, None, :], (n, num_s, num_k))
    if caps is not None:
        counts, cap, brow, node = caps
        r1 = brow[:, None, None]
        ae, be = np.maximum(ea, 0), np.maximum(packs, 0)
        take_b = counts[r1, node[:, None, None], h[:, None, None], be] < cap[r1, be]  # [n, K, S]
        wb = np.where(take_b, wb, np.nan)
        ranks = np.arange(num_k)[None, None, :]
        take_a = counts[r1, node[:, None, None], ranks, ae[:, :, None]] < cap[r1, ae[:, :, None]]  # [n, S, K]
        load_k = np.where(take_a, load_k, np.inf)  # [n, S(a), K]
    d = wa[:, :, None, None] - wb[:, None]  # [n, S(a), K, S(b)]: load leaving h for k
    peak = np.maximum(lh[:, None, None, None] - d, load_k[..., None] + d)
    # below h's load by the margin (d > 0 follows); NaN compares false
    score = np.where(peak < (lh * (1 - _MARGIN))[:, None, None, None], peak, np.inf).reshape(n, -1)
    j = score.argmin(1)
    found = np.isfinite(score[rows, j])
    sa, k, sb = np.unravel_index(j, (num_s, num_k, num_s))
    return found, k, sa, sb
