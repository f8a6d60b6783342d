"""Needs -> pieces: the part of load planning that does not depend on who can read.

A *piece* is one box of one checkpoint tensor that at least one rank needs: the distinct
``(key, box)`` pairs of a :class:`~moeshard.plan.needs.NeedTable`, in file order, each cut to
at most one part of the staging budget (``staging_bytes // STAGING_PARTS`` bytes). Every need
is then met by *deliveries*: one per piece of its box, sorted by (piece, rank).

The storage modes differ only in who reads a piece and how it travels; :class:`Pieces` is
the same for all of them, so ``moeshard plan`` cuts it once and plans every mode from it
(:func:`~moeshard.plan.load.plan_transfers` and :func:`~moeshard.plan.load.minimal_cost`
take it in place of the needs). Pure and torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..box import split_box
from ..io.index import CheckpointIndex
from ..io.packed import blob_nbytes, misaligned, packed_align, packed_dim
from .arrays import expand_runs, group_rows, lex_order, row_prod, run_starts
from .needs import NeedTable

__all__ = ["Pieces", "cut_pieces", "STAGING_PARTS"]

# The staging budget in parts: a piece is at most one part; a rank's windows share what its
# pieces leave of the budget (see plan/load.py).
STAGING_PARTS = 11


@dataclass(frozen=True, eq=False)
class Pieces:
    """Needs cut into pieces (``P`` pieces in file order, ``N`` deliveries, ``D`` padded dims
    as in :class:`~moeshard.plan.needs.NeedTable`).

    Args:
        keys, key_ndim: the needs' checkpoint keys and their tensor ranks.
        staging_bytes: the budget the pieces were cut for (None: not cut; lower bounds only).
        piece_key: ``int32[P]``; piece_off, piece_len: ``int64[P, D]`` its box;
            piece_bytes: ``int64[P]``.
        dlv_piece, dlv_rank, dlv_param: ``int32[N]``; dlv_slot: ``int64[N]``; dlv_off:
            ``int64[N, D]``: rank ``dlv_rank`` puts the piece at ``dlv_off`` in the local tensor
            of parameter ``dlv_param`` (in expert slot ``dlv_slot``, -1: none). Sorted by
            (piece, rank).
        num_needs: rows of the need table.
    """

    keys: tuple[str, ...]
    key_ndim: np.ndarray
    staging_bytes: int | None
    piece_key: np.ndarray
    piece_off: np.ndarray
    piece_len: np.ndarray
    piece_bytes: np.ndarray
    dlv_piece: np.ndarray
    dlv_rank: np.ndarray
    dlv_param: np.ndarray
    dlv_slot: np.ndarray
    dlv_off: np.ndarray
    num_needs: int

    @property
    def num_pieces(self) -> int:
        return len(self.piece_key)

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(piece, rank)``, ``int32[Q]`` each: the distinct (piece, rank) pairs of the
        deliveries, sorted (a rank needing several boxes of one piece counts once)."""
        start = run_starts(self.dlv_piece, self.dlv_rank)
        return self.dlv_piece[start], self.dlv_rank[start]


def cut_pieces(
    table: NeedTable,
    index: CheckpointIndex,
    staging_bytes: int | None,
    keys: tuple[np.ndarray, np.ndarray] | None = None,
) -> Pieces:
    """The pieces and deliveries of ``table`` (pure, deterministic). ``staging_bytes``: cut
    every piece to at most ``staging_bytes // STAGING_PARTS`` bytes (None: do not cut).
    ``keys``: ``index.key_columns(table.keys)`` (item sizes and file order), when the caller
    has them.

    Raises ValueError when one element of a needed tensor does not fit in a part.
    Cost: one sort of the needs (``O(n log n)``) and Python per piece that must be cut."""
    itemsize, key_rank = keys if keys is not None else index.key_columns(table.keys)
    if staging_bytes is not None:
        part = staging_bytes // STAGING_PARTS
        used = np.flatnonzero(np.bincount(table.key, minlength=len(table.keys)))  # the keys some need reads
        too_big = used[itemsize[used] > part]
        if len(too_big):
            k = int(too_big[0])
            raise ValueError(
                f"staging budget of {staging_bytes} bytes cannot hold one element of {table.keys[k]!r} in each of "
                f"its {STAGING_PARTS} parts (at least {STAGING_PARTS * int(itemsize[k])} bytes)"
            )
    # Rows in file order; distinct (key, box) pairs are pieces.
    order, start = group_rows(key_rank[table.key], *_box_columns(table.src_off, table.src_len))
    row_piece = np.cumsum(start, dtype=np.int64) - 1  # per row in file order
    first_row = order[np.flatnonzero(start)]
    del start
    pkey = table.key[first_row].astype(np.int64)
    poff, plen = table.src_off[first_row], table.src_len[first_row]
    packed = _packed_keys(table.keys, index)
    if packed:
        _check_aligned(packed, pkey, poff, plen)
    parent = None
    if staging_bytes is not None:
        limit = np.maximum(1, part // itemsize[pkey])
        if packed:  # split packed weights in whole groups: lengths along their packed dim in groups
            units = _group_units(packed, pkey, len(table.keys), poff.shape[1])
            poff, plen, limit = poff // units, -(-plen // units), np.maximum(1, limit // units.prod(axis=1))
        parent, poff, plen = _split(pkey, poff, plen, table.ndim, limit)
        if packed:
            units = _group_units(packed, pkey if parent is None else pkey[parent], len(table.keys), poff.shape[1])
            ends = _key_shapes(packed, pkey if parent is None else pkey[parent], len(table.keys), poff.shape[1])
            poff = poff * units
            plen = np.minimum(plen * units, ends - poff)
    if parent is None:  # nothing cut: one delivery per row
        d_piece, rows = row_piece, order
    else:
        pkey = pkey[parent]
        counts = np.bincount(parent, minlength=len(first_row))
        owner, d_piece = expand_runs((np.cumsum(counts) - counts)[row_piece], counts[row_piece])
        rows = order[owner]
        del owner
    del order, row_piece
    # Deliveries by (piece, rank): pieces already ascend, so this sort mostly orders ranks.
    perm = lex_order(d_piece, table.rank[rows])
    d_piece, rows = d_piece[perm], rows[perm]
    del perm
    d_off = table.dst_off[rows]
    if parent is not None:  # a delivery of a cut piece starts where the piece starts in the need
        d_off += poff[d_piece]
        d_off -= table.src_off[rows]
    piece_bytes = row_prod(plen) * itemsize[pkey]
    for p in np.flatnonzero(np.isin(pkey, list(packed))).tolist() if packed else ():
        nd = int(table.ndim[pkey[p]])
        box = tuple(zip(poff[p, :nd].tolist(), plen[p, :nd].tolist()))
        piece_bytes[p] = blob_nbytes(packed[int(pkey[p])], box, index.tensors)
    return Pieces(
        keys=table.keys,
        key_ndim=table.ndim,
        staging_bytes=staging_bytes,
        piece_key=pkey.astype(np.int32),
        piece_off=poff,
        piece_len=plen,
        piece_bytes=piece_bytes,
        dlv_piece=d_piece.astype(np.int32),
        dlv_rank=table.rank[rows].astype(np.int32),
        dlv_param=table.param[rows].astype(np.int32),
        dlv_slot=table.slot[rows].astype(np.int64),
        dlv_off=d_off,
        num_needs=len(table),
    )


def _packed_keys(keys: tuple[str, ...], index: CheckpointIndex) -> dict:
    """``{key number: PackedWeight}`` of the keys that are packed weights' logical keys."""
    if not index.packed:
        return {}
    return {k: pw for k, key in enumerate(keys) if (pw := index.packed.get(key)) is not None}


def _check_aligned(packed: dict, pkey: np.ndarray, poff: np.ndarray, plen: np.ndarray) -> None:
    """ValueError naming the key and its group when a needed box of a packed weight does not
    start and end on whole groups along its packed dim (an FSDP shard cutting a group)."""
    for k, pw in packed.items():
        d, a, c = packed_dim(pw), packed_align(pw), int(pw.shape[packed_dim(pw)])
        rows = np.flatnonzero(pkey == k)
        o, n = poff[rows, d], plen[rows, d]
        bad = rows[(o % a != 0) | (((o + n) % a != 0) & (o + n != c))]
        if len(bad):
            p = int(bad[0])
            box = tuple(zip(poff[p, : len(pw.shape)].tolist(), plen[p, : len(pw.shape)].tolist()))
            raise ValueError(
                f"{misaligned(pw, box)}: it cannot be loaded dequantized with this sharding (shard the "
                f"model so that each rank's part of {pw.key!r} holds whole groups of {a})"
            )


def _group_units(packed: dict, pkey: np.ndarray, num_keys: int, width: int) -> np.ndarray:
    """``int64[P, D]``: per piece and dim, the values one unit of a split stands for (its group
    along a packed weight's packed dim, else 1)."""
    unit = np.ones((num_keys, width), np.int64)
    for k, pw in packed.items():
        unit[k, packed_dim(pw)] = packed_align(pw)
    return unit[pkey]


def _key_shapes(packed: dict, pkey: np.ndarray, num_keys: int, width: int) -> np.ndarray:
    """``int64[P, D]``: per piece, its packed weight's logical shape (padded with a huge value)."""
    big = np.iinfo(np.int64).max // 4
    shape = np.full((num_keys, width), big, np.int64)
    for k, pw in packed.items():
        shape[k, : len(pw.shape)] = pw.shape
    return shape[pkey]


def _box_columns(off: np.ndarray, ln: np.ndarray) -> list[np.ndarray]:
    """Columns that order boxes as ``(off[0], len[0], off[1], len[1], ...)`` does: one per dim
    (offset and length packed in one int64) where both fit in 31 bits, else two."""
    cols = []
    for d in range(off.shape[1]):
        if off.shape[0] and max(int(off[:, d].max()), int(ln[:, d].max())) < 2**31:
            cols.append((off[:, d] << 32) | ln[:, d])
        else:
            cols += [off[:, d], ln[:, d]]
    return cols


def _split(pkey, poff, plen, ndim, limit) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """``(parent, off, len)``: pieces of more than ``limit[p]`` elements split along their
    first dims (:func:`~moeshard.box.split_box`), in order; ``parent`` maps new to old (None:
    nothing was split, the pieces are as given)."""
    numel = row_prod(plen)
    big = np.flatnonzero(numel > limit)
    if not len(big):
        return None, poff, plen
    counts = np.ones(len(pkey), dtype=np.int64)
    subs: dict[int, np.ndarray] = {}
    for p in big.tolist():
        nd = int(ndim[pkey[p]])
        box = tuple(zip(poff[p, :nd].tolist(), plen[p, :nd].tolist()))
        subs[p] = np.asarray(split_box(box, int(limit[p])), dtype=np.int64).reshape(-1, nd, 2)
        counts[p] = len(subs[p])
    parent = np.repeat(np.arange(len(pkey)), counts)
    off, ln = poff[parent], plen[parent]
    first = np.cumsum(counts) - counts
    for p, arr in subs.items():
        nd = arr.shape[1]
        off[first[p] : first[p] + len(arr), :nd] = arr[:, :, 0]
        ln[first[p] : first[p] + len(arr), :nd] = arr[:, :, 1]
    return parent, off, ln
