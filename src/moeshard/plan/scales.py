"""The scales a load that dequantizes FP8 weights needs first (pure, torch-free).

Every rank that receives pieces of a block-quantized FP8 weight (:mod:`moeshard.io.fp8`) holds
that weight's whole scale tensor before the weights move: the scales are planned as needs of
their own (one row per rank and scale, the whole tensor, into a scratch tensor numbered by the
scale) and run as a first, small schedule by the same planner and runner, so that they follow
the storage mode (a rank that cannot read gets them from one that can) like any other tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..io.fp8 import scale_of
from ..io.index import CheckpointIndex
from .needs import NeedTable

__all__ = ["ScaleNeeds", "scale_needs"]


@dataclass(frozen=True, eq=False)
class ScaleNeeds:
    """``table``: rows (rank, scale ``j``): rank needs all of scale key ``table.keys[j]``, into
    scratch tensor ``j`` (``param`` = ``key`` = ``j``). ``weights``: ``{FP8 weight key: (j, block
    shape)}`` for every dequantized weight some rank needs."""

    table: NeedTable
    weights: dict[str, tuple[int, tuple[int, ...]]]

    def shapes(self, index: CheckpointIndex) -> list[tuple[int, ...]]:
        return [tuple(index.info(k).shape) for k in self.table.keys]


def scale_needs(needs: NeedTable, index: CheckpointIndex, into_float: np.ndarray) -> ScaleNeeds | None:
    """The scale needs of ``needs`` (every rank's), or None when no row reads an FP8 weight with
    a block scale into a float parameter. ``into_float``: ``bool[num_params]``, whether parameter
    ``i`` is a float tensor of two or more bytes (a model keeping FP8 parameters takes FP8 bytes
    as they are). Cost: one :func:`~moeshard.io.fp8.scale_of` per needed key, numpy over rows."""
    found = {k: f for k, key in enumerate(needs.keys) if (f := scale_of(index, key)) is not None}
    if not found:
        return None
    quantized = np.zeros(len(needs.keys), dtype=bool)
    quantized[list(found)] = True
    rows = np.flatnonzero(quantized[needs.key] & np.asarray(into_float, dtype=bool)[needs.param])
    if not len(rows):
        return None
    weights: dict[str, tuple[int, tuple[int, ...]]] = {}
    scale_ids: dict[str, int] = {}
    of_key = np.full(len(needs.keys), -1, np.int64)
    for k in np.unique(needs.key[rows]).tolist():
        sk, block = found[k]
        j = scale_ids.setdefault(sk, len(scale_ids))
        weights[needs.keys[k]] = (j, block)
        of_key[k] = j
    pairs = np.unique(np.stack([needs.rank[rows].astype(np.int64), of_key[needs.key[rows]]], axis=1), axis=0)
    keys = tuple(scale_ids)
    shapes = [index.info(k).shape for k in keys]
    width = max(len(sh) for sh in shapes)
    table = NeedTable.allocate(keys, np.asarray([len(sh) for sh in shapes], np.int8), len(pairs), width, alone=True)
    table.alone[:] = np.bincount(pairs[:, 1])[pairs[:, 1]] == 1  # a scale only one rank needs
    table.rank[:] = pairs[:, 0]
    table.param[:] = pairs[:, 1]
    table.key[:] = pairs[:, 1]
    table.slot[:] = -1
    lens = np.ones((len(keys), width), np.int64)
    for i, sh in enumerate(shapes):
        lens[i, : len(sh)] = sh
    table.src_len[:] = lens[pairs[:, 1]]
    return ScaleNeeds(table, weights)
