"""The reference's replication and greedy packing (:func:`moeshard.eplb.oblivious.replicate_experts`,
:func:`moeshard.eplb.oblivious.balanced_pack`) and moeshard's repair of duplicate copies
(:func:`moeshard.eplb.oblivious.repair_duplicates`) compiled with numba, one row at a time: the
very copies, packs and swaps of the numpy loops (their dtype's arithmetic, float32 for the
reference's, the same ties).

Imported only when numba is installed (the ``fast`` extra); the first call in a process
compiles the loop or loads it from numba's on-disk cache.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["greedy_pack", "repair_duplicates", "replicate"]


@numba.njit(cache=True, nogil=True)
def greedy_pack(w_t, key_t, has_key, num_keys, num_packs, cap, first_fill, out):
    """Items heaviest first, each to the pack of least load with room (first on ties) that
    holds no item of its key if there is one (``has_key``), in place.

    Args:
        w_t: ``float[n, B]`` item loads in packing order (step ``t``, row ``b``), the dtype in
            which pack loads are summed.
        key_t: ``int64[n, B]`` each step's key (read where ``has_key``).
        num_packs, cap: packs, items per pack (``n = num_packs * cap``).
        first_fill: steps ``t < num_packs`` go to pack ``t`` (as the numpy loop, where it
            found that every row's first ``num_packs - 1`` items are heavier than 0).
        out: ``int64[B, num_packs, cap]`` out: the step of each pack's items, in packing order.
    """
    n, num_b = w_t.shape
    inf = w_t.dtype.type(np.inf)
    cost = np.zeros(num_packs, dtype=w_t.dtype)
    filled = np.zeros(num_packs, dtype=np.int64)
    held = np.zeros((max(num_keys, 1), num_packs), dtype=np.bool_)
    for b in range(num_b):
        for k in range(num_packs):
            cost[k] = 0
            filled[k] = 0
        start = 0
        if first_fill:
            start = num_packs
            for t in range(num_packs):
                cost[t] = w_t[t, b]
                out[b, t, 0] = t
                filled[t] = 1
                if has_key:
                    held[key_t[t, b], t] = True
        for t in range(start, n):
            k = -1
            if has_key:
                e = key_t[t, b]
                for j in range(num_packs):
                    if filled[j] < cap and not held[e, j] and (k < 0 or cost[j] < cost[k]):
                        k = j
                if k < 0:  # every pack with room holds it: the repair deals with it
                    for j in range(num_packs):
                        if filled[j] < cap and (k < 0 or cost[j] < cost[k]):
                            k = j
                held[e, k] = True
            else:
                for j in range(num_packs):
                    if filled[j] < cap and (k < 0 or cost[j] < cost[k]):
                        k = j
            out[b, k, filled[k]] = t
            filled[k] += 1
            cost[k] = cost[k] + w_t[t, b] if filled[k] < cap else inf
        if has_key:
            for t in range(n):
                held[key_t[t, b], :] = False


@numba.njit(cache=True, nogil=True)
def replicate(w, num_ranks, is_hot, phy, cnt):
    """``replicate_experts``, in place, row by row: slot ``i < n`` holds item ``i``; each further
    slot goes to the item of the highest load per copy (first on ties), with ``num_ranks > 0``
    (spread counts) among the open items: fewer than ``num_ranks`` copies and, if hot, the
    row's hot items fewer than ``num_ranks`` together (all closed: the highest load per copy).

    Args:
        w: ``float[B, n]`` loads (a copy's load is rounded to this dtype).
        num_ranks: ``> 0`` for spread counts, else the reference's counts.
        is_hot: ``bool[B, n]`` the hot items (read where ``num_ranks > 0``).
        phy: ``int64[B, P]`` out: item of each slot; ``cnt``: ``int64[B, n]`` out: copies.
    """
    num_b, n = w.shape
    num_phy = phy.shape[1]
    per_copy = np.empty(n, dtype=w.dtype)
    open_ = np.empty(n, dtype=w.dtype)
    ninf = w.dtype.type(-np.inf)
    for b in range(num_b):
        hot_total = 0
        for e in range(n):
            phy[b, e] = e
            cnt[b, e] = 1
            per_copy[e] = w[b, e]
            if num_ranks > 0 and is_hot[b, e]:
                hot_total += 1
        if num_ranks > 0:
            for e in range(n):
                ok = 1 < num_ranks and (not is_hot[b, e] or hot_total < num_ranks)
                open_[e] = per_copy[e] if ok else ninf
        for i in range(n, num_phy):
            j = 0
            if num_ranks > 0:
                for e in range(1, n):
                    if open_[e] > open_[j]:
                        j = e
                if open_[j] == ninf:
                    j = 0
                    for e in range(1, n):
                        if per_copy[e] > per_copy[j]:
                            j = e
            else:
                for e in range(1, n):
                    if per_copy[e] > per_copy[j]:
                        j = e
            phy[b, i] = j
            c = cnt[b, j] + 1
            cnt[b, j] = c
            v = w[b, j] / c  # float64, rounded to w's dtype where stored
            per_copy[j] = v
            if num_ranks > 0:
                hj = is_hot[b, j]
                if hj:
                    hot_total += 1
                open_[j] = v if c < num_ranks and (not hj or hot_total < num_ranks) else ninf
                if hj and hot_total == num_ranks:  # the row's hot items close together
                    for e in range(n):
                        if is_hot[b, e]:
                            open_[e] = ninf


@numba.njit(cache=True, nogil=True)
def repair_duplicates(slots, wc, cap):
    """:func:`moeshard.eplb.oblivious.repair_duplicates`, in place, row by row: while a rank
    holds more than ``cap`` copies of an expert (the violations in (rank, slot) order), the
    first violation with a swap that breaks no cap swaps with the copy of closest per-copy
    load on another rank (first in (rank, slot) order on ties); a row stops where none has one.

    Args:
        slots: ``int64[B, K, S]`` expert ids (-1 empty); ``wc``: ``float[B, E]``;
            ``cap``: ``int64[B, E]``.

    Returns:
        False, having changed nothing, where an id is beyond the experts.
    """
    num_b, num_k, num_s = slots.shape
    num_e = wc.shape[1]
    for b in range(num_b):
        for k in range(num_k):
            for s in range(num_s):
                if slots[b, k, s] >= num_e:
                    return False
    counts = np.zeros((num_k, num_e + 1), dtype=np.int64)
    viol = np.empty(num_k * num_s, dtype=np.int64)
    for b in range(num_b):
        row = slots[b]
        for _ in range(num_k * num_s):
            # copies per rank, and the slots holding more than cap copies before them
            n_viol = 0
            for k in range(num_k):
                for s in range(num_s):
                    e = row[k, s]
                    c = counts[k, e if e >= 0 else num_e]
                    counts[k, e if e >= 0 else num_e] = c + 1
                    if e >= 0 and c >= cap[b, e]:
                        viol[n_viol] = k * num_s + s
                        n_viol += 1
            pk = ps = qk = qs = -1
            for i in range(n_viol):
                k, s = viol[i] // num_s, viol[i] % num_s
                e = row[k, s]
                best = np.inf
                for k2 in range(num_k):
                    if k2 == k or counts[k2, e] >= cap[b, e]:
                        continue
                    for s2 in range(num_s):
                        f = row[k2, s2]
                        if f < 0 or f == e or counts[k, f] >= cap[b, f]:
                            continue
                        d = abs(wc[b, f] - wc[b, e])
                        if qk < 0 or d < best:
                            best, qk, qs = d, k2, s2
                if qk >= 0:
                    pk, ps = k, s
                    break
            for k in range(num_k):
                for s in range(num_s):
                    e = row[k, s]
                    counts[k, e if e >= 0 else num_e] = 0
            if pk < 0:  # none, or unavoidable
                break
            row[pk, ps], row[qk, qs] = row[qk, qs], row[pk, ps]
    return True
