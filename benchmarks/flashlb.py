"""FlashLB (vllm-ascend #3042) re-implemented from its published description, as a baseline.

The description: replica counts and placement are decided *jointly*, expert by expert (hottest
first), by a tree search that keeps the partial solutions whose expected balance is best
(deployed replicas plus the pending experts' load spread over the free slots), with pruning.
The PR's code is not copied; this is our reading of it:

* experts hottest first; a beam of ``beam`` partial placements (rank loads, free slots, counts);
* each expert branches on replica counts around the greedy min-max-replica allotment's
  (``count - 1, count, count + 1``, at least 1, leaving a slot for every later expert; the last
  expert takes every remaining slot), its copies placed heaviest first onto the least loaded
  ranks with a free slot that hold no copy of it yet (else any with a free slot);
* a partial placement is scored by ``max_r(load_r + pending * free_r / free)`` with ``pending``
  the load of the experts still to place; the ``beam`` best survive.

One policy, global (every expert may go to any rank; FlashLB does not describe nodes/groups).
"""

from __future__ import annotations

import numpy as np


def _mmr_counts(w: np.ndarray, num_slots: int) -> np.ndarray:
    cnt = np.ones(len(w), dtype=np.int64)
    for _ in range(num_slots - len(w)):
        j = int(np.argmax(w / cnt))
        cnt[j] += 1
    return cnt


def flashlb_layer(w: np.ndarray, num_ranks: int, slots_per_rank: int, beam: int = 8) -> np.ndarray:
    """``int[num_ranks, slots_per_rank]`` expert ids for one layer ``w`` ``float[E]``."""
    w = np.asarray(w, dtype=np.float64)
    num_e = len(w)
    num_slots = num_ranks * slots_per_rank
    base = _mmr_counts(w, num_slots)
    order = np.argsort(-w, kind="stable")
    # a state: (loads float[R], free int[R], ranks list of lists)
    states = [(np.zeros(num_ranks), np.full(num_ranks, slots_per_rank), [[] for _ in range(num_ranks)])]
    for i, e in enumerate(order):
        later = num_e - i - 1
        pending = float(w[order[i + 1 :]].sum())
        children = []
        for loads, free, ranks in states:
            left = int(free.sum())
            if later == 0:
                options = [left]
            else:
                options = sorted({c for c in (base[e] - 1, base[e], base[e] + 1) if 1 <= c <= left - later})
            for c in options:
                ld, fr = loads.copy(), free.copy()
                rk = [list(r) for r in ranks]
                piece = w[e] / c
                for _ in range(c):
                    ok = (fr > 0) & np.array([e not in r for r in rk])
                    if not ok.any():
                        ok = fr > 0
                    r = int(np.argmin(np.where(ok, ld, np.inf)))
                    ld[r] += piece
                    fr[r] -= 1
                    rk[r].append(int(e))
                tot_free = int(fr.sum())
                score = float((ld + (pending * fr / tot_free if tot_free else 0.0)).max())
                children.append((score, float(ld.max()), ld, fr, rk))
        children.sort(key=lambda t: (t[0], t[1]))
        states = [(ld, fr, rk) for _, _, ld, fr, rk in children[:beam]]
    best = min(states, key=lambda s: s[0].max())
    return np.array(best[2], dtype=np.int64)


def flashlb(load, num_physical: int, num_ranks: int, beam: int = 8):
    """``moeshard.Placement`` of FlashLB's answer per layer of ``load`` ``float[L, E]``."""
    from moeshard import Placement

    load = np.asarray(load, dtype=np.float64)
    spr = num_physical // num_ranks
    p2l = np.stack([flashlb_layer(row, num_ranks, spr, beam).reshape(-1) for row in load])
    return Placement(p2l, num_logical=load.shape[1], num_ranks=num_ranks)
