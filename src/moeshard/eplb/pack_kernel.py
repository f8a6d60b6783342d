"""The reference's greedy packing (:func:`moeshard.eplb.oblivious.balanced_pack`) compiled with
numba, one row at a time: the very packs of the numpy loop (its dtype's sums, float32 for the
reference's, the same ties).

Imported only when numba is installed (the ``fast`` extra); the first call in a process
compiles the loop or loads it from numba's on-disk cache.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["greedy_pack"]


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
