"""Metrics of a placement under a load: per-rank loads, balance (max / mean rank load), copies
moved and slots changed between two placements; and the array forms that the policies use
(per-copy loads, copy counts, which ranks hold an expert, moves per layer)."""

from __future__ import annotations

import numpy as np

from ..placement import Placement
from . import jit
from .inputs import check_active, check_load

# Placements of at least this many slots (layers x slots) count copies and sum rank loads
# compiled where numba is installed (``load_kernel``, :mod:`moeshard.eplb.jit`): the balancer
# calls these on every candidate, and numpy's short sums of a rank's few slots cost most.
_JIT_FROM = 4096

# -- metrics (internal forms) --------------------------------------------------------------------


def count_last(ids: np.ndarray, num: int) -> np.ndarray:
    """``int[..., num + 1]``: occurrences of each id along the last axis of ``ids``
    (``int[..., n]``); ids < 0 count in the last column."""
    lead = ids.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    compiled = jit.kernel("load_kernel", ids.size, _JIT_FROM)
    if compiled is not None and ids.size:
        out = np.zeros((rows, num + 1), dtype=np.int64)
        if compiled.count_last(np.ascontiguousarray(ids, dtype=np.int64).reshape(rows, -1), out):
            return out.reshape(*lead, num + 1)
    flat = np.where(ids < 0, num, ids).reshape(rows, -1) + (np.arange(rows) * (num + 1))[:, None]
    return np.bincount(flat.ravel(), minlength=rows * (num + 1)).reshape(*lead, num + 1)


def load_per_copy(w: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    return np.where(cnt > 0, w / as_float(np.maximum(cnt, 1)), 0.0)


def as_float(cnt: np.ndarray) -> np.ndarray:
    """``cnt`` (counts) as float64: numpy divides a float by an int the same way (the int
    cast first), but its mixed-type loop costs ~10x a division of two float arrays."""
    return cnt.astype(np.float64, copy=False)


def copy_counts(p2l: np.ndarray, num_logical: int) -> np.ndarray:
    """``int[L, E]`` copies per expert of ``p2l`` ``int[L, ...]``."""
    flat = p2l.reshape(p2l.shape[0], -1)
    compiled = jit.kernel("load_kernel", flat.size, _JIT_FROM)
    if compiled is not None and flat.size:
        out = np.zeros((flat.shape[0], num_logical), dtype=np.int64)
        if compiled.copy_counts(np.ascontiguousarray(flat, dtype=np.int64), out):
            return out
    return count_last(flat, num_logical)[:, :num_logical]


def rank_loads3(w: np.ndarray, p2l: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """``p2l`` ``int[L, R, S]`` -> ``float[L, R]``."""
    compiled = _loads_kernel(w, p2l)
    if compiled is not None and np.issubdtype(cnt.dtype, np.integer):
        out = np.empty(p2l.shape[:2])
        args = (np.ascontiguousarray(p2l, dtype=np.int64), np.ascontiguousarray(cnt, dtype=np.int64))
        if compiled.rank_loads(np.ascontiguousarray(w), *args, out):
            return out
    wc = load_per_copy(w, cnt)
    li = np.arange(w.shape[0])[:, None, None]
    return np.where(p2l >= 0, wc[li, np.maximum(p2l, 0)], 0.0).sum(-1)


def slot_sums(wc: np.ndarray, p2l: np.ndarray) -> np.ndarray:
    """``float[B, R]``: per rank of ``p2l`` ``int[B, R, S]`` the sum of its copies' loads
    ``wc`` ``float[B, E]`` (empty slots 0)."""
    compiled = _loads_kernel(wc, p2l)
    if compiled is not None:
        out = np.empty(p2l.shape[:2])
        if compiled.slot_sums(np.ascontiguousarray(wc), np.ascontiguousarray(p2l, dtype=np.int64), out):
            return out
    bi = np.arange(p2l.shape[0])[:, None, None]
    return np.where(p2l >= 0, wc[bi, np.maximum(p2l, 0)], 0.0).sum(-1)


def _loads_kernel(w: np.ndarray, p2l: np.ndarray):
    """``load_kernel`` for sums of ``w`` ``float[B, E]`` over the slots of ``p2l``
    ``int[B, R, S]``, or None (numpy's: see :func:`moeshard.eplb.jit.kernel`; not float64
    loads, too many slots per rank)."""
    compiled = jit.kernel("load_kernel", p2l.size, _JIT_FROM)
    if compiled is None or not p2l.size or w.dtype != np.float64 or p2l.shape[-1] > compiled.MAX_SLOTS:
        return None
    return compiled if len(w) == len(p2l) else None


def first_min_per_key(key: np.ndarray, score: np.ndarray, among: np.ndarray | None = None) -> np.ndarray:
    """``int[M]``: indices into ``key`` ``int[C]`` and ``score`` ``[C]`` of, per distinct key
    among the candidates ``among`` ``int[K]`` (default all, in index order), the one of the
    lowest score, the first in ``among``'s order on ties; ordered by key."""
    k = np.arange(len(key)) if among is None else among
    k = k[np.lexsort((k, score[k], key[k]))]
    return k[np.r_[True, key[k][1:] != key[k][:-1]]]


def max_rank_load(w, p2l, cnt) -> np.ndarray:
    return rank_loads3(w, p2l, cnt).max(1)


def max_over_mean(loads: np.ndarray) -> np.ndarray:
    """``float[L]``: max / mean of ``loads`` ``float[L, R]`` per layer (a layer with no load:
    1.0)."""
    mean = loads.mean(1)
    return np.where(mean > 0, loads.max(1) / np.where(mean > 0, mean, 1.0), 1.0)


def held_by_rank(p2l: np.ndarray, num_logical: int) -> np.ndarray:
    """``bool[L, R, E]``: rank holds a copy of the expert (``p2l`` ``int[L, R, S]``)."""
    num_layers, num_ranks, _ = p2l.shape
    h = np.zeros((num_layers, num_ranks, num_logical + 1), dtype=bool)
    experts = np.where(p2l < 0, num_logical, p2l)
    h[np.arange(num_layers)[:, None, None], np.arange(num_ranks)[None, :, None], experts] = True
    return np.ascontiguousarray(h[..., :num_logical])  # contiguous: the compiled counts take it as it is


def moved3(held_old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``bool[L, R, S]``: slots of ``new`` ``int[L, R, S]`` holding a copy whose rank did not
    hold the expert (``held_old``: :func:`held_by_rank` of the old placement)."""
    li = np.arange(new.shape[0])[:, None, None]
    ri = np.arange(new.shape[1])[None, :, None]
    return (new >= 0) & ~held_old[li, ri, np.maximum(new, 0)]


def moves3(held_old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``int[L]``: copies of ``new`` ``int[L, R, S]`` whose rank did not hold the expert."""
    return moved_per_rank(held_old, new).sum(1)


def moved_per_rank(held_old: np.ndarray, new: np.ndarray, layers: np.ndarray | None = None) -> np.ndarray:
    """``int[K, R]``: per rank of ``new`` ``int[K, R, S]`` (row ``k`` a placement of layer
    ``layers[k]``, default ``k``) its copies whose rank did not hold the expert (``held_old``
    ``bool[L, R, E]``)."""
    if layers is None:
        layers = np.arange(len(new))
    compiled = jit.kernel("load_kernel", new.size, _JIT_FROM)
    if compiled is not None and new.size and held_old.shape[1] == new.shape[1]:
        out = np.empty(new.shape[:2], dtype=np.int64)
        args = (np.ascontiguousarray(layers, dtype=np.int64), np.ascontiguousarray(new, dtype=np.int64))
        if compiled.moved_per_rank(np.ascontiguousarray(held_old, dtype=bool), *args, out):
            return out
    li = layers[:, None, None]
    ri = np.arange(new.shape[1])[None, :, None]
    return ((new >= 0) & ~held_old[li, ri, np.maximum(new, 0)]).sum(-1)


# -- public API ----------------------------------------------------------------------------------


def rank_loads(load, placement: Placement, num_ranks: int) -> np.ndarray:
    """``float[num_layers, num_ranks]``: tokens per rank, each copy carrying
    ``load[e] / logcnt[e]`` (tokens of an expert split evenly over its copies)."""
    w = check_load(load)
    if w.shape != (placement.num_layers, placement.num_logical):
        raise ValueError(
            f"load has shape {w.shape}, placement describes {(placement.num_layers, placement.num_logical)}"
        )
    s = placement.slots_per_rank(num_ranks)
    p2l = placement.phy2log.reshape(placement.num_layers, num_ranks, s)
    return rank_loads3(w, p2l, placement.logcnt)


def balance(load, placement: Placement, num_ranks: int, active_ranks=None) -> np.ndarray:
    """``float[num_layers]``: max / mean rank load over the live ranks (1.0 is perfect; a
    layer with no load counts as 1.0)."""
    return max_over_mean(rank_loads(load, placement, num_ranks)[:, check_active(active_ranks, num_ranks)])


def _check_pair(old: Placement, new: Placement) -> None:
    if old.phy2log.shape != new.phy2log.shape:
        raise ValueError(f"placements differ in shape: {old.phy2log.shape} vs {new.phy2log.shape}")


def copies_moved(old: Placement, new: Placement, num_ranks: int) -> int:
    """Copies that must travel (network or storage): non-empty slots of ``new`` whose rank
    held no copy of that expert anywhere in ``old``."""
    _check_pair(old, new)
    s = new.slots_per_rank(num_ranks)
    num_logical = max(old.num_logical, new.num_logical)
    held = held_by_rank(old.phy2log.reshape(old.num_layers, num_ranks, s), num_logical)
    return int(moves3(held, new.phy2log.reshape(new.num_layers, num_ranks, s)).sum())
