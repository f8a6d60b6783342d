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

Where numba is installed (``pip install moeshard[fast]``), large searches run compiled, row
by row (the ``swap_kernel`` module): the same swaps, a few times faster; the first such call
in a process imports numba and loads the compiled code from numba's cache (compiles it, the
first time). ``MOESHARD_EPLB_JIT=0`` in the environment, or ``jit=False``, keeps the numpy
search.
"""

from __future__ import annotations

import os

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
# The windowed search's sorted copies are built where the first round has this many times
# _DENSE_PAIRS pairs or more: fewer, and the few windowed rounds do not repay them.
_WINDOW_FROM = 4
# The compiled search (jit=None) is used where the first round has this many candidate pairs
# or more (rows x N x K x S x S): smaller calls take a few ms in numpy, less than importing
# numba and loading the compiled code costs a process (~0.75 s of CPU).
_JIT_FROM = 20000


def lower_peak(
    packs: np.ndarray,
    wc: np.ndarray,
    cap: np.ndarray | None = None,
    max_rounds: int | None = None,
    stop_at: np.ndarray | None = None,
    *,
    jit: bool | None = None,
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
        jit: the compiled search (numba) or the numpy one: the same swaps. None: compiled
            where numba is installed, ``MOESHARD_EPLB_JIT`` is not ``0`` and the call is large
            enough to repay numba's start (a model's shape, not a toy's); True: compiled
            (ValueError without numba); False: numpy.

    Returns:
        ``int[B]``: swaps made per row.
    """
    num_b, num_n, num_k, num_s = packs.shape
    swaps = np.zeros(num_b, dtype=np.int64)
    if num_b == 0 or num_k < 2:
        _kernel(jit)  # jit=True without numba raises all the same
        return swaps
    kernel = _kernel(False if jit is None and num_b * num_n * num_k * num_s * num_s < _JIT_FROM else jit)
    if (
        kernel is not None
        and num_s <= kernel.MAX_SLOTS
        and wc.dtype == np.float64
        and (stop_at is None or stop_at.dtype == np.float64)
    ):
        return _compiled(kernel, packs, wc, cap, max_rounds, stop_at)
    st = _State(packs, wc, cap, window=num_b * num_k * num_s * num_s > _WINDOW_FROM * _DENSE_PAIRS)
    nk = num_n * num_k
    ar_s = np.arange(num_s)
    active = np.arange(num_b)
    for _ in range(num_n * num_k * num_s if max_rounds is None else max_rounds):
        lmat = st.loads.reshape(num_b, nk)[active]
        if stop_at is not None and len(active):
            keep = lmat.max(1) > stop_at[active]
            active, lmat = active[keep], lmat[keep]
        if not len(active):
            break
        rk_h = active * nk + lmat.argmax(1)  # the heaviest rank, flat (band * K + rank)
        band = rk_h // num_k  # row * N + node
        if st.window and len(active) * num_k * num_s * num_s > _DENSE_PAIRS:
            found, qa, qb = _window_round(st, active, rk_h, band)
        else:
            found, qa, qb = _dense_round(st, active, rk_h, band)
        active, qa, qb = active[found], qa[found], qb[found]
        st.swap(qa, qb, ar_s)
        swaps[active] += 1
    st.finish()
    return swaps


_KERNEL: list = []  # the compiled search's module once imported, or None without numba


def _kernel(jit: bool | None):
    """The compiled search's module (``swap_kernel``, numba) or None (numpy's)."""
    if jit is False or (jit is None and os.environ.get("MOESHARD_EPLB_JIT", "1").strip() == "0"):
        return None
    if not _KERNEL:
        try:
            from . import swap_kernel
        except ImportError:
            swap_kernel = None
        _KERNEL.append(swap_kernel)
    if jit and _KERNEL[0] is None:
        raise ValueError("lower_peak(jit=True) needs numba: pip install 'moeshard[fast]'")
    return _KERNEL[0]


def _compiled(kernel, packs, wc, cap, max_rounds, stop_at):
    """:func:`lower_peak` through the compiled search (float64 loads: the numpy search's
    arithmetic to the bit)."""
    num_b, num_n, num_k, num_s = packs.shape
    num_e = wc.shape[1]
    bi = np.arange(num_b)[:, None, None, None]
    # the slot loads and rank loads exactly as the numpy search builds them
    wslot = np.where(packs >= 0, wc[bi, np.maximum(packs, 0)], 0.0)
    loads = wslot.sum(-1).reshape(num_b, -1)
    pk = packs.reshape(num_b, -1).astype(np.int64)
    has_cap = cap is not None
    cap_a = np.minimum(cap, num_s + 1).astype(np.int64) if has_cap else np.zeros((num_b, 1), dtype=np.int64)
    has_stop = stop_at is not None
    stop_a = np.ascontiguousarray(stop_at, dtype=np.float64) if has_stop else np.zeros(num_b)
    rounds = num_n * num_k * num_s if max_rounds is None else max_rounds
    swaps = np.zeros(num_b, dtype=np.int64)
    ws = wslot.reshape(num_b, -1)
    kernel.swap_search(
        pk,
        ws,
        loads,
        num_e,
        cap_a,
        has_cap,
        stop_a,
        has_stop,
        bool((ws >= 0).all()),
        num_n,
        num_k,
        num_s,
        rounds,
        _MARGIN,
        swaps,
    )
    packs[...] = pk.reshape(packs.shape)
    return swaps


class _State:
    """The search's arrays, flat so that a round indexes them with one index each: slot
    ``q = (row * N + node) * K * S + rank * S + slot``, rank ``q // S``."""

    def __init__(self, packs, wc, cap, window):
        num_b, num_n, num_k, num_s = packs.shape
        num_e = wc.shape[1]
        self.out = packs
        self.packs = np.ascontiguousarray(packs)
        self.pk = self.packs.reshape(-1)
        self.num_s, self.ks, self.e1 = num_s, num_k * num_s, num_e + 1
        bi = np.arange(num_b)[:, None, None, None]
        self.wslot = np.where(packs >= 0, wc[bi, np.maximum(packs, 0)], 0.0)
        self.ws = self.wslot.reshape(-1)
        self.loads = self.wslot.sum(-1)  # [B, N, K]
        self.lf = self.loads.reshape(-1)
        self.counts = self.cf = self.capf = None
        if cap is not None:
            # copies of each expert per rank (empty slots in the last column)
            flat = (
                np.where(packs < 0, num_e, packs).reshape(-1, num_s)
                + (np.arange(num_b * num_n * num_k) * (num_e + 1))[:, None]
            )
            # small counts (at most S per rank; a cap over S is S + 1): small arrays for the rounds' random reads;
            # a slot's count is how many slots of its rank hold the same expert
            self.cf = np.zeros(num_b * num_n * num_k * (num_e + 1), dtype=np.int8 if num_s < 2**7 - 1 else np.int64)
            self.cf[flat] = (flat[:, :, None] == flat[:, None, :]).sum(-1)
            self.counts = self.cf.reshape(num_b, num_n, num_k, num_e + 1)
            self.capf = np.minimum(cap, num_s + 1).astype(self.cf.dtype).reshape(-1)  # a cap over S never binds
            self.num_e = num_e
        self.wn = np.where(self.pk >= 0, self.ws, np.nan)
        self.window = window
        if window:
            # Each node's copies by load (empty slots last) and where each slot is in that
            # order: a swap exchanges two slots' copies, so the sorted loads of a node never
            # change, only which slot holds them. One sorted key array for all rows: node band
            # i's loads (in [0, top], empty slots at 0.7 span) shifted by i * span, so that one
            # search finds every row's windows.
            bands = num_b * num_n
            key = np.where(packs >= 0, self.wslot, np.inf).reshape(bands, -1)
            # loads >= 0 (inf included) sort as their bit patterns, as integers (a faster sort)
            bits = (key + 0.0).view(np.int64) if (key >= 0).all() else key
            order = np.argsort(bits, axis=-1, kind="stable")
            sorted_w = np.take_along_axis(key, order, axis=-1)
            self.by = (order + np.arange(bands)[:, None] * self.ks).reshape(-1)  # slot at each position
            self.where = np.empty_like(self.by)
            self.where[self.by] = np.arange(len(self.by))
            top = float(np.max(self.loads, initial=0.0))
            self.span = 4 * top + 1.0
            self.keys = (np.minimum(sorted_w, 0.7 * self.span) + np.arange(bands)[:, None] * self.span).reshape(-1)
            # the load at each position (that of the slot ``by`` names there: a swap moves the
            # two slots' positions with their loads), read in order by a round's windows
            self.sorted_w = sorted_w.reshape(-1)
            self.err = 4 * np.spacing(bands * self.span)

    def swap(self, qa, qb, ar_s):
        """Swap the copies of slots ``qa`` and ``qb`` ``int[n]`` (distinct ranks within a
        call); the two ranks' loads summed again (not updated by +-d): no drift over rounds."""
        pk, ws = self.pk, self.ws
        ea, eb = pk[qa], pk[qb]
        wa, wb = ws[qa], ws[qb]
        pk[qa], pk[qb] = eb, ea
        ws[qa], ws[qb] = wb, wa
        self.wn[qa], self.wn[qb] = self.wn[qb], self.wn[qa]
        if self.window:
            pa, pb = self.where[qa], self.where[qb]
            self.by[pa], self.by[pb] = qb, qa
            self.where[qa], self.where[qb] = pb, pa
        s = self.num_s
        r = np.concatenate((qa, qb)) // s  # distinct ranks: no repeated index within an update
        self.lf[r] = ws[r[:, None] * s + ar_s].sum(-1)
        if self.cf is not None:
            e1, e_out, e_in = self.e1, np.concatenate((ea, eb)), np.concatenate((eb, ea))
            self.cf[r * e1 + e_out] -= 1
            self.cf[r * e1 + e_in] += 1

    def finish(self):
        if self.out is not self.packs:
            self.out[...] = self.packs


def _window_round(st: _State, active: np.ndarray, rk_h: np.ndarray, band: np.ndarray):
    """One round of :func:`lower_peak` over the pairs of copies in a window (for many
    candidates): rows ``active`` ``int[n]``, their heaviest ranks ``rk_h`` and node bands
    ``band`` (flat, :class:`_State`). Returns ``found`` ``bool[n]`` and the slots ``qa`` (on
    the heaviest rank) and ``qb`` ``int[n]`` to swap: the swap of lowest peak, the first in
    ``(a, k, b)`` order on ties, the same swap as :func:`_dense_round`.

    The swap of copy ``a`` (rank ``h``) with copy ``b`` (rank ``k``) moves ``d = w_a - w_b``
    from ``h`` to ``k``; it lowers the peak below ``h``'s load only if ``0 < d < load_h -
    load_k <= load_h - min load``. So per copy ``a`` only the copies ``b`` whose load lies in
    that window are looked at (the copies of the node sorted by load once): near the end of
    the search, when the ranks are within a small gap of each other, a few per copy instead of
    every copy of the node."""
    n = len(active)
    s, ks, num_k = st.num_s, st.ks, st.ks // st.num_s
    rows = np.arange(n)
    lh = st.lf[rk_h]
    # A swap that is not allowed gets a NaN or infinite peak: swapping an empty slot (NaN), a
    # copy that rank h may not take (NaN) and a copy rank k may not take (its load +inf). A
    # swap with h itself or of two copies of one expert never lowers the peak.
    wa, ea = st.wn.reshape(-1, s)[rk_h], st.pk.reshape(-1, s)[rk_h]  # [n, S]: h's copies
    # An upper bound P on the round's best peak: the best swap with the lightest rank (inf if
    # none). A swap of peak <= P has load_h - d <= P and load_k + d <= P, so w_b lies in
    # [w_a - (P - min load), w_a - (load_h - P)], widened by what rounding of d and of the
    # loads' sums may add; the whole [w_a - (load_h - min load), w_a) where P is inf.
    lrow = st.lf.reshape(-1, num_k)[band]
    light = lrow.argmin(1)
    lmin = lrow[rows, light]
    rk_l = band * num_k + light
    wbl = st.wn.reshape(-1, s)[rk_l]
    lk = lmin[:, None]
    if st.cf is not None:
        cf, capf, e1 = st.cf, st.capf, st.e1
        coff = (active * st.num_e)[:, None]
        pbl, ae = np.maximum(st.pk.reshape(-1, s)[rk_l], 0), np.maximum(ea, 0)
        wbl = np.where(cf[rk_h[:, None] * e1 + pbl] < capf[coff + pbl], wbl, np.nan)  # h may take b
        lk = np.where(cf[rk_l[:, None] * e1 + ae] < capf[coff + ae], lk, np.inf)  # light may take a
    d = wa[:, :, None] - wbl[:, None, :]
    peak = np.maximum(lh[:, None, None] - d, lk[:, :, None] + d)
    p_light = np.where(peak < (lh * (1 - _MARGIN))[:, None, None], peak, np.inf).reshape(n, -1).min(1)
    p_eff = np.minimum(p_light, lh)
    slack = _WINDOW_SLACK * np.abs(lh)
    # and below w_a: a swap lowers the peak by the margin only if d > (margin - rounding) * load_h
    # (so neither a itself nor a copy of the same expert is looked at). An empty slot a (NaN)
    # has an empty window.
    q = np.stack(
        (
            wa - (p_eff - lmin + slack)[:, None],
            np.minimum(wa - (lh - p_eff - slack)[:, None], wa - (0.5 * _MARGIN * lh)[:, None]),
        )
    )
    # queries clamped to [-0.2, 0.45] span within the band: they never reach another band's keys
    span, err = st.span, st.err
    q = np.clip(q, -0.2 * span, 0.45 * span) + band[:, None] * span
    q[0] -= err
    q[1] += err
    lo, hi = np.searchsorted(st.keys, q.reshape(2, -1))
    per = np.maximum(hi - lo, 0)
    # the candidates, one per (row, a, b in a's window), flat, grouped by row
    ra = np.repeat(np.arange(n * s), per)  # row * S + sa
    if not len(ra):
        return np.zeros(n, dtype=bool), rk_h * s, rk_h * s
    at = np.repeat(lo - (np.cumsum(per) - per), per) + np.arange(len(ra))
    qb = st.by[at]  # slot of b
    rkb = qb // s
    lhc = lh[ra // s]
    d = wa.reshape(-1)[ra] - st.sorted_w[at]  # load leaving h for k (b's load: that of its position)
    peak = np.maximum(lhc - d, st.lf[rkb] + d)
    # below h's load by the margin (d > 0 follows); NaN (an empty slot) compares false. Only
    # these candidates are kept: the cap's checks below only take some of them away.
    keep = np.flatnonzero(peak < lhc * (1 - _MARGIN))
    ra, qb, rkb, peak = ra[keep], qb[keep], rkb[keep], peak[keep]
    row = ra // s
    if st.cf is not None:
        coff_c = (active * st.num_e)[row]
        pb = np.maximum(st.pk[qb], 0)
        ae = np.maximum(ea.reshape(-1)[ra], 0)
        take = (cf[rk_h[row] * e1 + pb] < capf[coff_c + pb]) & (
            cf[rkb * e1 + ae] < capf[coff_c + ae]
        )  # h may take b, k a
        peak = np.where(take, peak, np.inf)
    # per row the lowest peak, then the first in (a, k, b) order
    per_row = np.bincount(row, minlength=n)
    has = per_row > 0
    starts = (np.cumsum(per_row) - per_row)[has]
    best = np.full(n, np.inf)
    if len(row):
        best[has] = np.minimum.reduceat(peak, starts)
    flat = (ra - row * s) * ks + (qb - band[row] * ks)  # index in (a, k, b) order
    big = np.iinfo(np.int64).max
    first = np.zeros(n, dtype=np.int64)
    if len(row):
        first[has] = np.minimum.reduceat(np.where(peak == best[row], flat, big), starts)
    found = np.isfinite(best)
    first = np.where(found, first, 0)
    sa, kb = np.divmod(first, ks)
    return found, rk_h * s + sa, band * ks + kb


def _dense_round(st: _State, active: np.ndarray, rk_h: np.ndarray, band: np.ndarray):
    """One round of :func:`lower_peak` over every pair of copies (for few candidates: fewer
    passes): rows ``active`` ``int[n]``, their heaviest ranks ``rk_h`` and node bands ``band``
    (flat, :class:`_State`). Returns ``found`` ``bool[n]`` and the slots ``qa`` (on the
    heaviest rank) and ``qb`` ``int[n]`` to swap: the swap of lowest peak, the first in
    ``(a, k, b)`` order on ties."""
    n = len(active)
    s, ks = st.num_s, st.ks
    num_k = ks // s
    rows = np.arange(n)
    lh = st.lf[rk_h]
    # A swap that is not allowed gets a NaN or infinite peak, folded into the small operands:
    # the [n, S, K, S] candidates cost a handful of passes. Swapping an empty slot (NaN), a
    # copy that rank h may not take (NaN) and a copy rank k may not take (its load +inf) are
    # not allowed. A swap with h itself or of two copies of one expert never lowers the peak.
    wa = st.wn.reshape(-1, s)[rk_h]  # [n, S]: h's copies
    wb = st.wn.reshape(-1, ks)[band]  # [n, K*S]: the node's
    load_k = st.lf.reshape(-1, num_k)[band][:, None, :]  # [n, 1, K]
    if st.cf is not None:
        cf, capf, e1 = st.cf, st.capf, st.e1
        coff = (active * st.num_e)[:, None]
        ae, be = np.maximum(st.pk.reshape(-1, s)[rk_h], 0), np.maximum(st.pk.reshape(-1, ks)[band], 0)
        wb = np.where(cf[rk_h[:, None] * e1 + be] < capf[coff + be], wb, np.nan)  # h may take b
        ranks = (band * num_k)[:, None, None] + np.arange(num_k)  # [n, 1, K]
        take_a = cf[ranks * e1 + ae[:, :, None]] < capf[coff[:, :, None] + ae[:, :, None]]  # [n, S, K]
        load_k = np.where(take_a, load_k, np.inf)  # [n, S(a), K]
    d = wa[:, :, None, None] - wb.reshape(n, 1, num_k, s)  # [n, S(a), K, S(b)]: load leaving h for k
    peak = np.maximum(lh[:, None, None, None] - d, load_k[..., None] + d)
    # below h's load by the margin (d > 0 follows); NaN compares false
    score = np.where(peak < (lh * (1 - _MARGIN))[:, None, None, None], peak, np.inf).reshape(n, -1)
    j = score.argmin(1)
    found = np.isfinite(score[rows, j])
    sa, kb = np.divmod(j, ks)
    return found, rk_h * s + sa, band * ks + kb
