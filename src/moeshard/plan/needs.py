"""Needs as columns: which box of which checkpoint tensor every rank must hold, and where.

A :class:`NeedTable` is the array form of a list of :class:`~moeshard.layout.Need`: one row per
need, numpy columns instead of a Python object per need (DeepSeek-V3 on 1,024 ranks has
~860,000 needs). Boxes of tensors of different rank share one ``[N, D]`` layout: ``D`` is the
largest tensor rank among the needed keys, and the dims a key does not have are padded with
``(offset 0, length 1)`` *after* its own dims, so element counts and row-major order are
unchanged.

Pure and torch-free: it is what the planners consume and what every rank computes alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["NeedTable"]


@dataclass(frozen=True, eq=False)
class NeedTable:
    """Every rank's needs (``N`` rows, ``D`` padded dims).

    Row ``i``: rank ``rank[i]`` must hold box ``(src_off[i], src_len[i])`` of checkpoint tensor
    ``keys[key[i]]`` in the local tensor of parameter number ``param[i]``, at offsets
    ``dst_off[i]`` (the same lengths), inside expert slot ``slot[i]`` of that local tensor when
    ``slot[i] >= 0`` (an expert parameter's local tensor is ``[local_slots, *slice]``; the
    checkpoint tensor fills part of one slot) or of the whole local tensor when ``slot[i] == -1``.

    Args:
        keys: checkpoint keys, indexed by ``key``.
        ndim: ``int8[len(keys)]`` tensor rank of each key (the dims of a row beyond it are padding).
        rank: ``int32[N]``.
        param: ``int32[N]``: index into the parameter descriptions.
        key: ``int32[N]``: index into ``keys``.
        slot: ``int64[N]``: local expert slot, or -1.
        src_off, src_len: ``int64[N, D]``: the box in the checkpoint tensor.
        dst_off: ``int64[N, D]``: where the box starts in the local tensor (or slot).
        alone: ``bool[N]`` or None: True where no row of *another* rank has the same key and
            box (a hint from the layout, which knows it without comparing rows; False where
            unsure), None where unknown. :func:`~moeshard.plan.load.plan_transfers` with
            ``rank=`` plans only the rows of other ranks that are not alone.
    """

    keys: tuple[str, ...]
    ndim: np.ndarray
    rank: np.ndarray
    param: np.ndarray
    key: np.ndarray
    slot: np.ndarray
    src_off: np.ndarray
    src_len: np.ndarray
    dst_off: np.ndarray
    alone: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.rank)
        assert self.ndim.shape == (len(self.keys),), "one ndim per key"
        assert all(len(c) == n for c in (self.param, self.key, self.slot, self.src_off, self.src_len, self.dst_off))
        assert self.alone is None or self.alone.shape == (n,)
        assert self.src_off.shape == self.src_len.shape == self.dst_off.shape and self.src_off.ndim == 2

    def __len__(self) -> int:
        return len(self.rank)

    @property
    def width(self) -> int:
        """``D``: the number of box dims per row."""
        return self.src_off.shape[1]

    @staticmethod
    def concat(parts: Sequence) -> "NeedTable":
        """The rows of ``parts`` in order, over the union of their keys (first-seen order),
        written once into the table's columns (no padded copies of the parts).

        A part is a :class:`NeedTable` or any object with the same ``keys``, ``ndim``,
        ``width`` and ``len()`` and a ``fill(table, rows, key_ids)`` method that writes its rows
        into ``table`` at ``rows`` (a slice), its key ``j`` as ``key_ids[j]`` (e.g. the rows of
        a dense parameter, kept as views of its cached boxes until here).

        ``alone`` is kept where every part has it (a part's distinct keys; the rows of a key
        that several parts read are not alone), else None."""
        keys: dict[str, int] = {}
        ndims: list[int] = []
        for t in parts:
            for k, nd in zip(t.keys, t.ndim.tolist()):
                if k not in keys:
                    keys[k] = len(keys)
                    ndims.append(nd)
        width = max((t.width for t in parts), default=0)
        hint = all(t.alone is not None for t in parts)
        table = NeedTable.allocate(tuple(keys), np.asarray(ndims, dtype=np.int8), sum(len(t) for t in parts), width,
                                   alone=hint)
        pos = 0
        ids = []
        for t in parts:
            n = len(t)
            if n:
                ids.append(np.asarray([keys[k] for k in t.keys], dtype=np.int32))
                t.fill(table, slice(pos, pos + n), ids[-1])
            pos += n
        if hint and ids:
            # Two parameters reading one key (tied weights): their rows may coincide.
            readers_of_key = np.bincount(np.concatenate(ids), minlength=len(keys))
            np.logical_and(table.alone, readers_of_key[table.key] == 1, out=table.alone)
        return table

    @staticmethod
    def allocate(keys: tuple[str, ...], ndim: np.ndarray, num: int, width: int, alone: bool = False) -> "NeedTable":
        """A table of ``num`` rows to fill in place: padding values in the box columns
        (offsets 0, lengths 1), the other columns uninitialized (``alone``: a column of
        False, else None)."""
        return NeedTable(
            keys=keys, ndim=ndim, rank=np.empty(num, np.int32), param=np.empty(num, np.int32),
            key=np.empty(num, np.int32), slot=np.empty(num, np.int64), src_off=np.zeros((num, width), np.int64),
            src_len=np.ones((num, width), np.int64), dst_off=np.zeros((num, width), np.int64),
            alone=np.zeros(num, bool) if alone else None,
        )

    def take(self, rows: np.ndarray) -> "NeedTable":
        """The table of rows ``rows`` (indices or a ``bool[N]`` mask), over the same keys."""
        return NeedTable(
            keys=self.keys, ndim=self.ndim, rank=self.rank[rows], param=self.param[rows], key=self.key[rows],
            slot=self.slot[rows], src_off=self.src_off[rows], src_len=self.src_len[rows], dst_off=self.dst_off[rows],
            alone=None if self.alone is None else self.alone[rows],
        )

    def fill(self, table: "NeedTable", rows: slice, key_ids: np.ndarray) -> None:
        """Write these rows into ``table`` at ``rows``, key ``j`` as ``key_ids[j]``
        (:meth:`concat`)."""
        table.rank[rows] = self.rank
        table.param[rows] = self.param
        table.key[rows] = key_ids[self.key]
        table.slot[rows] = self.slot
        d = self.width
        table.src_off[rows, :d] = self.src_off
        table.src_len[rows, :d] = self.src_len
        table.dst_off[rows, :d] = self.dst_off
        if table.alone is not None:
            table.alone[rows] = self.alone

    @staticmethod
    def from_needs(needs) -> "NeedTable":
        """The table of a sequence of :class:`~moeshard.layout.Need` (a need's ``dest`` box is
        ``src``'s lengths, after one leading ``(slot, 1)`` dim for an expert slot)."""
        keys: dict[str, int] = {}
        ndims: list[int] = []
        for n in needs:
            if n.key not in keys:
                keys[n.key] = len(keys)
                ndims.append(len(n.src))
        width = max(ndims, default=0)
        num = len(needs)
        rank = np.empty(num, np.int32)
        param = np.empty(num, np.int32)
        key = np.empty(num, np.int32)
        slot = np.full(num, -1, np.int64)
        src_off = np.zeros((num, width), np.int64)
        src_len = np.ones((num, width), np.int64)
        dst_off = np.zeros((num, width), np.int64)
        for i, n in enumerate(needs):
            rank[i], param[i], key[i] = n.rank, n.param, keys[n.key]
            nd = len(n.src)
            dest = n.dest
            if len(dest) == nd + 1:
                assert dest[0][1] == 1, f"an expert need's leading dest dim is one slot: {n}"
                slot[i] = dest[0][0]
                dest = dest[1:]
            assert len(dest) == nd and all(a[1] == b[1] for a, b in zip(dest, n.src)), f"dest and src differ: {n}"
            if nd:
                src_off[i, :nd] = [o for o, _ in n.src]
                src_len[i, :nd] = [ln for _, ln in n.src]
                dst_off[i, :nd] = [o for o, _ in dest]
        return NeedTable(tuple(keys), np.asarray(ndims, np.int8), rank, param, key, slot, src_off, src_len, dst_off)

    def to_needs(self) -> list:
        """The rows as :class:`~moeshard.layout.Need` tuples (for tests and small tools)."""
        from ..models.layout import Need

        out = []
        ndim = self.ndim.tolist()
        for i in range(len(self)):
            k = int(self.key[i])
            nd = ndim[k]
            lens = self.src_len[i, :nd].tolist()
            src = tuple(zip(self.src_off[i, :nd].tolist(), lens))
            dest = tuple(zip(self.dst_off[i, :nd].tolist(), lens))
            s = int(self.slot[i])
            if s >= 0:
                dest = ((s, 1),) + dest
            out.append(Need(int(self.rank[i]), int(self.param[i]), dest, self.keys[k], src))
        return out
