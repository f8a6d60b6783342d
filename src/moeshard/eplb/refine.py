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


def lower_peak(
    packs: np.ndarray, wc: np.ndarray, cap: np.ndarray | None = None, max_rounds: int | None = None
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
        counts = np.zeros((num_b, num_n, num_k, num_e + 1), dtype=np.int32)
        np.add.at(
            counts,
            (
                bi,
                np.arange(num_n)[None, :, None, None],
                np.arange(num_k)[None, None, :, None],
                np.where(packs < 0, num_e, packs),
            ),
            1,
        )
    active = np.arange(num_b)
    for _ in range(num_n * num_k * num_s if max_rounds is None else max_rounds):
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
        )
        active, node, h, k, sa, sb = active[found], node[found], h[found], k[found], sa[found], sb[found]
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


def _best_swaps(packs: np.ndarray, wslot: np.ndarray, loads: np.ndarray, h: np.ndarray, caps):
    """One round of :func:`lower_peak` on ``n`` rows, each its heaviest rank's node:
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
