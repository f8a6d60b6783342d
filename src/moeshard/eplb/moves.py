"""Where a moved copy comes from: the rank pair of each move, and the copies moved per pair.

A *move* is a copy of expert ``e`` that the new placement puts on a live rank ``b`` which held
no copy of ``e`` in the old placement (:func:`moeshard.eplb.copies_moved` counts them). Its
*source* is a live rank ``a`` that holds ``e`` in the old placement, chosen as the relocation
engine does (:mod:`moeshard.plan.relocation`: same node first), but without state so that a
budget can count a move's pair before the others are known:

* among the live old holders of ``e`` on ``b``'s node, else among all of them,
* the first after ``b`` in ring order (smallest ``(a - b) mod num_ranks``), which spreads a
  node's sends over its holders as the engine's "least-sending holder" does.

A move whose expert no live rank holds (a dead rank held its only copies) has no source
rank (it is read from storage) and counts in no pair. Pairs are ordered: ``(a, b)`` is the
copies ``a`` sends to ``b`` in one step; a rank's *received* copies are its column sum.
"""

from __future__ import annotations

import numpy as np

from .inputs import check_active
from .metrics import held_by_rank, moved3


def rank_nodes(num_ranks: int, num_nodes: int) -> np.ndarray:
    """``int[num_ranks]``: node of each rank (ranks ``[k * R/N, (k+1) * R/N)`` are node k)."""
    return np.arange(num_ranks) // (num_ranks // num_nodes)


def source_key(node: np.ndarray) -> np.ndarray:
    """``int[R_b, R_a]``: preference of source ``a`` for receiver ``b`` (lower first):
    another node costs ``R``, then the ring distance ``(a - b) mod R``."""
    num_ranks = len(node)
    r = np.arange(num_ranks)
    return (node[None, :] != node[:, None]) * num_ranks + (r[None, :] - r[:, None]) % num_ranks


def sources(held_old: np.ndarray, layer: np.ndarray, dst: np.ndarray, expert: np.ndarray, key: np.ndarray):
    """``int[M]`` source rank of ``M`` moves (``layer``, receiver ``dst``, ``expert``, each
    ``int[M]``) under the old holders ``held_old`` ``bool[L, R, E]`` (live ranks only) and
    :func:`source_key` ``key``; -1 where no live rank holds the expert."""
    if len(layer) == 0:
        return np.zeros(0, dtype=np.int64)
    has = held_old[layer, :, expert]  # [M, R]
    k = np.where(has, key[dst], np.iinfo(np.int64).max)
    src = k.argmin(1)
    return np.where(has.any(1), src, -1)


def move_list(held_old: np.ndarray, new3: np.ndarray):
    """The moves of ``new3`` ``int[L, R, S]`` from the holders ``held_old`` ``bool[L, R, E]``:
    ``(layer, dst, expert)``, each ``int[M]``, in slot order."""
    layer, dst, slot = np.nonzero(moved3(held_old, new3))
    return layer, dst, new3[layer, dst, slot]


def pair_moves3(held_old: np.ndarray, new3: np.ndarray, key: np.ndarray) -> np.ndarray:
    """``int[L, R, R]``: copies of ``new3`` ``int[L, R, S]`` fetched from rank ``a`` (axis 1)
    onto rank ``b`` (axis 2) (module docstring)."""
    num_layers, num_ranks = new3.shape[:2]
    layer, dst, expert = move_list(held_old, new3)
    src = sources(held_old, layer, dst, expert, key)
    ok = src >= 0
    flat = (layer[ok] * num_ranks + src[ok]) * num_ranks + dst[ok]
    return np.bincount(flat, minlength=num_layers * num_ranks * num_ranks).reshape(num_layers, num_ranks, num_ranks)


def move_pairs(old, new, num_ranks: int, num_nodes: int = 1, active_ranks=None) -> np.ndarray:
    """``int[num_layers, num_ranks, num_ranks]``: per layer, the copies of ``new`` fetched
    from rank ``a`` (axis 1) onto rank ``b`` (axis 2) (module docstring): a copy on a rank
    that held no copy of its expert in ``old`` comes from a live holder on its node first,
    the first after it in ring order. Copies no live rank of ``old`` holds count in no pair.

    Args:
        old, new: ``Placement`` of the same shape.
        num_ranks: EP size (dead ranks included); ``num_nodes``: nodes (ranks in equal
            consecutive blocks); ``active_ranks``: ``bool[num_ranks]`` live ranks (None: all;
            a dead rank sends nothing).

    Raises:
        ValueError: placements of different shapes, slots not divisible by ``num_ranks``, a
            ``num_nodes`` that does not divide ``num_ranks``, bad ``active_ranks``.
    """
    if old.phy2log.shape != new.phy2log.shape:
        raise ValueError(f"placements differ in shape: {old.phy2log.shape} vs {new.phy2log.shape}")
    for name, v in (("num_ranks", num_ranks), ("num_nodes", num_nodes)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks={num_ranks} is not divisible by num_nodes={num_nodes}")
    s = new.slots_per_rank(num_ranks)
    active = check_active(active_ranks, num_ranks)
    num_logical = max(old.num_logical, new.num_logical)
    old3 = np.where(active[None, :, None], old.phy2log.reshape(old.num_layers, num_ranks, s), -1)
    held = held_by_rank(old3, num_logical)
    key = source_key(rank_nodes(num_ranks, num_nodes))
    return pair_moves3(held, new.phy2log.reshape(new.num_layers, num_ranks, s), key)
