"""Numpy building blocks of the array planners (runs of equal rows, per-run sums, run
expansion). Pure; every function works on columns already in the order it says."""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "run_starts",
    "seg_excl_cumsum",
    "expand_runs",
    "unique_rows",
    "pack_rows",
    "lex_order",
    "group_rows",
    "dense_rank",
]


def run_starts(*cols: np.ndarray) -> np.ndarray:
    """``bool[n]``: where a run of equal rows (over ``cols``, already sorted) begins."""
    n = len(cols[0])
    out = np.zeros(n, dtype=bool)
    if n:
        out[0] = True
        for c in cols:
            out[1:] |= c[1:] != c[:-1]
    return out


def seg_excl_cumsum(start: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Exclusive running sum of ``values`` restarted where ``start`` is set."""
    if not len(values):
        return np.zeros(0, dtype=np.int64)
    cs = np.cumsum(values, dtype=np.int64) - values
    seg = np.cumsum(start) - 1
    return cs - cs[np.flatnonzero(start)][seg]


def expand_runs(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Expand runs: run ``r`` is ``starts[r], starts[r] + 1, ..., starts[r] + counts[r] - 1``.

    Returns ``(owner, value)``, both ``int64[counts.sum()]``: each element's run and value, runs
    in order."""
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts  # position of each run's first element
    return owner, np.arange(len(owner), dtype=np.int64) - first[owner] + starts[owner]


def row_prod(a: np.ndarray) -> np.ndarray:
    """``int64[n]``: the product of each row of ``int64[n, d]`` (``a.prod(axis=1)``, column by
    column: numpy's reduction along a short inner axis costs ~6x more at millions of rows)."""
    if a.shape[1] == 0:
        return np.ones(len(a), dtype=a.dtype)
    out = a[:, 0].copy()
    for d in range(1, a.shape[1]):
        out *= a[:, d]
    return out


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, inverse)``: the distinct rows of ``int64[M, K]`` (sorted) and each row's
    index among them, ``int64[M]``. A lexsort: ``np.unique(axis=0)`` sorts rows as opaque
    bytes, ~10x slower at 8,192 rows."""
    if a.shape[1] == 0:  # every row is the empty row
        return np.zeros((1 if len(a) else 0, 0), a.dtype), np.zeros(len(a), np.int64)
    if len(a) and (a == a[0]).all():  # one distinct row (every rank's expert slice alike): no sort
        return a[:1].copy(), np.zeros(len(a), np.int64)
    order = lex_order(*a.T)  # column 0 the primary key
    ranked = a[order]
    first = run_starts(*ranked.T)
    inverse = np.empty(len(a), np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ranked[first], inverse


def pack_rows(*cols: np.ndarray) -> np.ndarray | None:
    """``int64[n]``: one code per row of the columns ``cols`` (integers, ``[n]`` each), equal
    for equal rows and ordered as the rows are lexicographically (``cols[0]`` most
    significant); None when the columns' value ranges do not fit in 63 bits together."""
    n = len(cols[0])
    if not n:
        return np.zeros(0, dtype=np.int64)
    lo = [int(c.min()) for c in cols]
    span = [int(c.max()) - low + 1 for c, low in zip(cols, lo)]
    if math.prod(span) >= 2**63:
        return None
    code = np.zeros(n, dtype=np.int64)
    for c, low, s in zip(cols, lo, span):
        code *= s
        code += np.subtract(c, low, dtype=np.int64)
    return code


def lex_order(*cols: np.ndarray) -> np.ndarray:
    """``int64[n]``: the stable order of the rows sorted by ``cols`` (``cols[0]`` most
    significant), as ``np.lexsort(cols[::-1])``. One stable sort of the rows' packed codes
    (:func:`pack_rows`) where they fit: a lexsort is one stable sort per column (3-5x slower
    on 4 columns), and the packed sort gains most on nearly sorted rows."""
    code = pack_rows(*cols)
    if code is None:
        return np.lexsort(cols[::-1])
    return np.argsort(code, kind="stable")


def group_rows(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(order, start)``: the stable order of the rows sorted by ``cols`` (as
    :func:`lex_order`), ``int64[n]``, and ``bool[n]``: where a run of equal rows begins in it."""
    code = pack_rows(*cols)
    if code is None:
        order = np.lexsort(cols[::-1])
        return order, run_starts(*(c[order] for c in cols))
    order = np.argsort(code, kind="stable")
    return order, run_starts(code[order])


def dense_rank(*cols: np.ndarray) -> tuple[np.ndarray, int]:
    """``(rank, count)``: each row's rank among the distinct rows of ``cols`` in
    lexicographic order (``cols[0]`` most significant), ``int64[n]``, and how many there are."""
    order, start = group_rows(*cols)
    out = np.empty(len(order), dtype=np.int64)
    out[order] = np.cumsum(start) - 1
    return out, int(start.sum())
