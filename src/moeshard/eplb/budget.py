"""Move budgets and hysteresis: which layers of a new placement to take, given the current one.

A rebalance moves copies between ranks (network traffic, a pause of the layer's experts); a
serving engine bounds that per step (SwiftBalancer caps the copies exchanged, STAIR rebalances
a layer only when the gain is worth it). :func:`within_budget` keeps, per layer, the current
placement unless the new one is taken:

* a layer whose current placement is no longer valid (a dead rank held an expert's only live
  copy, or, hierarchical, a group left its node) is always taken, its moves counted first;
* **hysteresis**: a layer is taken only where the new heaviest rank is lighter than the
  current one's (under the same load) by more than the factor ``1 + hysteresis``;
* **budget**: of those, layers in order of balance gained per copy moved (gain = drop of the
  heaviest rank over the layer's mean rank load), while their moves fit in ``max_moves``
  (a layer that does not fit is skipped, a later smaller one may fit); a layer that moves no
  copy (slots reordered on a rank) costs nothing.

Per layer the answer is thus one of the two placements, so the balance a budget costs is the
current placement's on the layers left out.
"""

from __future__ import annotations

import numpy as np

from .aware import still_valid
from .inputs import Shape
from .metrics import copy_counts, held_by_rank, max_rank_load, moves3


def within_budget(
    w: np.ndarray, old3: np.ndarray, new3: np.ndarray, sh: Shape, max_moves: int | None, hysteresis: float
) -> np.ndarray:
    """Per layer ``new3`` or ``old3`` (``int[L, R, S]``, dead ranks' slots -1) under the load
    ``w`` ``float[L, E]`` (module docstring). Returns ``int[L, R, S]``."""
    num_logical = w.shape[1]
    moves = moves3(held_by_rank(old3, num_logical), new3)
    old_max = max_rank_load(w, old3, np.maximum(copy_counts(old3, num_logical), 1))
    new_max = max_rank_load(w, new3, copy_counts(new3, num_logical))
    must = ~still_valid(old3, sh)
    worth = ~must & (old_max > new_max * (1 + hysteresis) * (1 + 1e-12))
    take = must.copy()
    if max_moves is None:
        take |= worth
    else:
        left = max_moves - int(moves[must].sum())
        mean = np.maximum(w.sum(1) / int(sh.active.sum()), 1e-300)
        gain = (old_max - new_max) / mean
        cands = np.flatnonzero(worth)
        order = cands[np.argsort(-gain[cands] / np.maximum(moves[cands], 0.5), kind="stable")]
        for layer in order:
            if moves[layer] <= left:
                take[layer] = True
                left -= int(moves[layer])
    return np.where(take[:, None, None], new3, old3)
