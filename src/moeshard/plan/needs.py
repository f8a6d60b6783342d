"""Needs as columns: which box of which checkpoint tensor every rank must hold, and where.

A :class:`NeedTable` is the array form of a list of :class:`Need`: one row per need, numpy
columns instead of a Python object per need (DeepSeek-V3 on 1,024 ranks has ~860,000 needs).
Boxes of tensors of different rank share one ``[N, D]`` layout: ``D`` is the largest tensor
rank among the needed keys, and the dims a key does not have are padded with ``(offset 0,
length 1)`` *after* its own dims, so element counts and row-major order are unchanged.

A table built for one rank's load plan leaves out the needs no other rank shares of every
other rank (counted in bytes only), so that a rank of a large job never holds every rank's
needs at once (DeepSeek-V3 on 8,192 ranks: 4.7 million of them).

Pure and torch-free: it is what the planners consume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from ..box import Box
from .arrays import row_prod

__all__ = ["Need", "NeedPart", "NeedTable", "SharedKeysLeftOut"]


class Need(NamedTuple):
    """Rank ``rank`` must hold box ``src`` of checkpoint tensor ``key`` at box ``dest`` of
    the local tensor of parameter number ``param``."""

    rank: int
    param: int
    dest: Box
    key: str
    src: Box


class NeedPart(Protocol):
    """A part of a :class:`NeedTable` under construction (:meth:`NeedTable.concat`): rows of
    needs over its own keys, e.g. the rows of a dense parameter, kept as views of its cached
    boxes until they are written into the table. A :class:`NeedTable` is one.

    A part may also have ``full`` and ``omitted_bytes`` (as :class:`NeedTable`): the rows it
    left out itself (an expert parameter's other ranks' slots).
    """

    keys: tuple[str, ...]  # its distinct checkpoint keys
    ndim: np.ndarray  # int8[len(keys)]: each key's tensor rank
    alone: np.ndarray | bool | None  # bool[N], one bool for every row, or None (as NeedTable.alone)
    layout: Hashable | None  # equal for parts whose rows have the same ranks and sizes; None: unknown

    @property
    def width(self) -> int:
        """Box dims per row."""

    def __len__(self) -> int:
        """Its number of rows ``N``."""

    def fill(self, table: NeedTable, rows: slice, key_ids: np.ndarray) -> None:
        """Write its rows into ``table`` at ``rows``, its key ``j`` as ``key_ids[j]``."""

    def row_ranks(self) -> np.ndarray:
        """``int[N]``: each row's rank."""

    def row_keys(self) -> np.ndarray:
        """``int[N]``: each row's key, numbered in its own ``keys``."""

    def row_numel(self) -> np.ndarray:
        """``int64[N]``: each row's elements."""

    def select(self, mask: np.ndarray) -> NeedPart:
        """The part of the rows ``mask`` (``bool[N]``)."""


class SharedKeysLeftOut(Exception):
    """:meth:`NeedTable.concat`: a part left out rows of a key that another part reads too
    (those rows may not be alone after all): build that part's rows and let concat decide."""


# NeedTable.concat with keep_ranks: above this many rows, rows are left out part by part.
_FILTER_PARTS_ABOVE = 1 << 16


@dataclass(frozen=True, eq=False)
class NeedTable:
    """Every rank's needs, or those one rank's plan takes (``full``) (``N`` rows, ``D`` padded
    dims).

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
        full: ``bool[world]`` or None: the ranks all of whose rows the table has; the others'
            alone rows are left out (a table built for one rank, :meth:`concat` with
            ``keep_ranks``). None: every rank's rows.
        omitted_bytes: ``int64[world]`` or None: per rank, the bytes (checkpoint dtype) of its
            rows left out (with ``full``).
        digest: what identifies the rows of every rank (left out or not), when the builder
            knows it cheaply (:func:`moeshard.models.layout.need_table`: a digest of its
            inputs); None: the planner digests the rows.
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
    full: np.ndarray | None = None
    omitted_bytes: np.ndarray | None = None
    digest: bytes | None = None

    def __post_init__(self) -> None:
        n = len(self.rank)
        assert self.ndim.shape == (len(self.keys),), "one ndim per key"
        assert all(len(c) == n for c in (self.param, self.key, self.slot, self.src_off, self.src_len, self.dst_off))
        assert self.alone is None or self.alone.shape == (n,)
        assert (self.full is None) == (self.omitted_bytes is None)
        assert self.full is None or self.alone is not None, "rows are left out only where they are alone"
        assert self.src_off.shape == self.src_len.shape == self.dst_off.shape and self.src_off.ndim == 2

    def __len__(self) -> int:
        return len(self.rank)

    @property
    def width(self) -> int:
        """``D``: the number of box dims per row."""
        return self.src_off.shape[1]

    @staticmethod
    def concat(parts: Sequence[NeedPart], keep_ranks: np.ndarray | None = None, itemsize=None) -> NeedTable:
        """The rows of ``parts`` in order, over the union of their keys (first-seen order),
        written once into the table's columns (no padded copies of the parts).

        A part is a :class:`NeedPart`: a :class:`NeedTable`, or e.g. the rows of a dense
        parameter, kept as views of its cached boxes until here.

        ``alone`` is kept where every part has it (a part's distinct keys; the rows of a key
        that several parts read are not alone), else None.

        ``keep_ranks`` (``bool[world]``; needs ``alone``): a table for one rank. The alone rows
        of the other ranks are left out, counted per rank in ``omitted_bytes`` (``itemsize``:
        a function from a part's keys to their item sizes, ``int64``)."""
        keys: dict[str, int] = {}
        ids = []
        for t in parts:
            # A key's number: the next one where it is first seen. Most parts bring only new keys
            # (numbered at C speed); a part's own keys are distinct.
            n0, tk = len(keys), t.keys
            if keys.keys().isdisjoint(tk):
                keys.update(zip(tk, range(n0, n0 + len(tk))))
                assert len(keys) == n0 + len(tk), "a part's keys are distinct"
                ids.append(np.arange(n0, len(keys), dtype=np.int32))
            else:  # len(keys) is taken before setdefault
                ids.append(np.asarray([keys.setdefault(k, len(keys)) for k in tk], dtype=np.int32))
        all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int32)
        ndims = np.zeros(len(keys), dtype=np.int8)
        ndims[all_ids[::-1]] = (
            np.concatenate([t.ndim for t in parts])[::-1] if parts else []
        )  # a key's rank is its tensor's
        hint = all(t.alone is not None for t in parts)
        # Two parameters reading one key (tied weights): their rows may coincide.
        readers_of_key = np.bincount(all_ids, minlength=len(keys))
        full = None if keep_ranks is None else np.asarray(keep_ranks, dtype=bool)
        if full is not None and not hint:
            raise ValueError("rows can be left out only where the layout marks them alone")
        # Rows a part left out itself (an expert parameter's other ranks' slots).
        omitted = np.zeros(0 if full is None else len(full), dtype=np.int64)
        for t, kid in zip(parts, ids):
            if getattr(t, "omitted_bytes", None) is not None:
                if full is None or not np.array_equal(t.full, full):
                    raise ValueError("a part left out other ranks' rows than keep_ranks says")
                if readers_of_key[kid].max(initial=0) > 1:
                    raise SharedKeysLeftOut()
                omitted += t.omitted_bytes
        by_part = full is not None and sum(len(t) for t in parts) > _FILTER_PARTS_ABOVE
        if by_part:
            # Many rows: leave them out part by part, so that every rank's rows are never in
            # memory at once (DeepSeek-V3 at 8,192 ranks: 4.7 million rows, 440 MB). Few rows:
            # the whole table and one mask (each part's filter costs ~30 us of numpy calls).
            parts, left_out = _leave_out(parts, ids, readers_of_key, full, itemsize)
            omitted += left_out
        width = max((t.width for t in parts), default=0)
        table = NeedTable.allocate(tuple(keys), ndims, sum(len(t) for t in parts), width, alone=hint)
        pos = 0
        for t, kid in zip(parts, ids):
            n = len(t)
            if n:
                t.fill(table, slice(pos, pos + n), kid)
            pos += n
        if hint and len(table):
            np.logical_and(table.alone, readers_of_key[table.key] == 1, out=table.alone)
        if full is None:
            return table
        if not by_part:
            drop = table.alone & ~full[table.rank]
            omitted += table.bytes_per_rank(drop, np.asarray(itemsize(table.keys), np.int64), len(full))
            table = table.take(~drop)
        return dataclasses.replace(table, full=full, omitted_bytes=omitted)

    layout = None  # part interface: no two tables are known to share their rows' ranks and sizes

    @staticmethod
    def allocate(keys: tuple[str, ...], ndim: np.ndarray, num: int, width: int, alone: bool = False) -> NeedTable:
        """A table of ``num`` rows to fill in place: padding values in the box columns
        (offsets 0, lengths 1), the other columns uninitialized (``alone``: a column of
        False, else None)."""
        return NeedTable(
            keys=keys,
            ndim=ndim,
            rank=np.empty(num, np.int32),
            param=np.empty(num, np.int32),
            key=np.empty(num, np.int32),
            slot=np.empty(num, np.int64),
            src_off=np.zeros((num, width), np.int64),
            src_len=np.ones((num, width), np.int64),
            dst_off=np.zeros((num, width), np.int64),
            alone=np.zeros(num, bool) if alone else None,
        )

    def take(self, rows: np.ndarray) -> NeedTable:
        """The table of rows ``rows`` (indices or a ``bool[N]`` mask), over the same keys (a
        subset: no ``full``, ``omitted_bytes`` or ``digest``)."""
        return NeedTable(
            keys=self.keys,
            ndim=self.ndim,
            rank=self.rank[rows],
            param=self.param[rows],
            key=self.key[rows],
            slot=self.slot[rows],
            src_off=self.src_off[rows],
            src_len=self.src_len[rows],
            dst_off=self.dst_off[rows],
            alone=None if self.alone is None else self.alone[rows],
        )

    # The part interface of :meth:`concat` (a table is a part of a larger one).
    select = take

    def row_ranks(self) -> np.ndarray:
        return self.rank

    def row_keys(self) -> np.ndarray:
        return self.key

    def row_numel(self) -> np.ndarray:
        return row_prod(self.src_len)

    def bytes_per_rank(self, rows: np.ndarray, itemsize: np.ndarray, world: int) -> np.ndarray:
        """``int64[world]``: the bytes of rows ``rows`` (indices or a ``bool[N]`` mask) per rank,
        ``itemsize[k]`` the item size of key ``k`` (``int64[len(keys)]``)."""
        return np.bincount(
            self.rank[rows], weights=row_prod(self.src_len[rows]) * itemsize[self.key[rows]], minlength=world
        ).astype(np.int64)

    def fill(self, table: NeedTable, rows: slice, key_ids: np.ndarray) -> None:
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
    def from_needs(needs) -> NeedTable:
        """The table of a sequence of :class:`Need` (a need's ``dest`` box is
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

    def to_needs(self) -> list[Need]:
        """The rows as :class:`Need` tuples (for tests and small tools)."""
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


def _leave_out(
    parts: Sequence[NeedPart], ids: Sequence[np.ndarray], readers_of_key: np.ndarray, full: np.ndarray, itemsize
) -> tuple[list, np.ndarray]:
    """:meth:`NeedTable.concat`'s parts without the alone rows of the ranks not ``full``, and
    those rows' bytes per rank (``int64[world]``). Parts with the same ``layout`` (not None: the
    dense parameters of one shape and sharding) and a scalar ``alone`` have the same rows'
    ranks and sizes: what is left out of them is worked out once per layout."""
    omitted = np.zeros(len(full), dtype=np.int64)
    by_layout: dict = {}
    picked = []
    for t, kid in zip(parts, ids):
        layout = getattr(t, "layout", None)
        if layout is not None and np.ndim(t.alone) == 0 and readers_of_key[kid].max(initial=0) <= 1:
            hit = by_layout.get((layout, bool(t.alone)))
            if hit is None:
                ranks = t.row_ranks()
                drop = ~full[ranks] if t.alone else np.zeros(len(ranks), dtype=bool)
                numel = (
                    np.bincount(ranks[drop], weights=t.row_numel()[drop], minlength=len(full)) if drop.any() else None
                )
                hit = by_layout[(layout, bool(t.alone))] = (drop, numel)
            drop, numel = hit
            if numel is not None:
                omitted += (numel * int(np.asarray(itemsize(t.keys), np.int64)[0])).astype(np.int64)
                t = t.select(~drop)
        else:
            ranks = t.row_ranks()
            drop = (t.alone & (readers_of_key[kid[t.row_keys()]] == 1)) & ~full[ranks]
            if drop.any():
                nbytes = t.row_numel()[drop] * np.asarray(itemsize(t.keys), np.int64)[t.row_keys()[drop]]
                omitted += np.bincount(ranks[drop], weights=nbytes, minlength=len(full)).astype(np.int64)
                t = t.select(~drop)
        picked.append(t)
    return picked, omitted
