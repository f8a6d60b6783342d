"""The input of the save planner (:mod:`moeshard.plan.save`): the checkpoint tensors a save
writes (:class:`Output`) and every rank's boxes of them, as the model side describes them
(:func:`moeshard.models.outputs.describe_outputs`, the twin of the load's needs).

Every checkpoint tensor to write (a non-expert parameter or persistent buffer under its
checkpoint name; one part of one logical expert of a per-expert parameter; or a fused expert
tensor) is described by its :class:`Segment` s: which rank holds which box of it, and where in
its local tensor. The segments of all tensors are one table of columns (:class:`SegTable`);
``Segment`` objects are made only when a caller reads them. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..box import Box

__all__ = ["Segment", "SegTable", "Output"]


@dataclass(frozen=True)
class Segment:
    """Rank ``rank`` holds box ``box`` (coordinates of the checkpoint tensor) in the local tensor
    of parameter ``param`` (index into the descriptions) at ``lead + box shifted by delta``.

    ``lead`` is the leading local dims the checkpoint tensor lacks (an expert's slot,
    ``((local_slot, 1),)``) or ``()``; ``delta[d]`` = local offset - checkpoint offset in dim d.
    """

    rank: int
    param: int
    box: Box
    lead: Box = ()
    delta: tuple[int, ...] = ()

    def local_box(self, sub: Box) -> Box:
        """Local box of ``sub`` (a box inside :attr:`box`, checkpoint coordinates)."""
        return self.lead + tuple((o + d, n) for (o, n), d in zip(sub, self.delta))


@dataclass(frozen=True)
class SegTable:
    """Segments of checkpoint tensors as columns (``S`` segments, ``W`` padded box dims: a
    tensor of fewer dims has offset 0, length 1 and delta 0 in the others).

    ``rank``, ``param``: ``int64[S]``; ``slot``: ``int64[S]`` the local expert slot of a
    segment whose ``lead`` is ``((slot, 1),)``, -1 for ``lead == ()``; ``off``, ``len``,
    ``delta``: ``int64[S, W]``: the box and its shift to local coordinates.
    """

    rank: np.ndarray
    param: np.ndarray
    slot: np.ndarray
    off: np.ndarray
    len: np.ndarray
    delta: np.ndarray

    def rows(self, lo: int, hi: int, width: int) -> SegTable:
        """Rows ``lo:hi`` with ``width`` box dims (>= their tensors' dims: cut or padded); the
        table itself when that is all of it (the planner only reads it: no copy of the job's
        largest table)."""
        if lo == 0 and hi == len(self.rank) and width == self.off.shape[1]:
            return self
        pad = ((0, 0), (0, max(0, width - self.off.shape[1])))
        return SegTable(
            self.rank[lo:hi],
            self.param[lo:hi],
            self.slot[lo:hi],
            np.pad(self.off[lo:hi, :width], pad),
            np.pad(self.len[lo:hi, :width], pad, constant_values=1),
            np.pad(self.delta[lo:hi, :width], pad),
        )

    @staticmethod
    def concat(parts: list[SegTable], width: int) -> SegTable:
        if not parts:
            e, e2 = np.zeros(0, np.int64), np.zeros((0, width), np.int64)
            return SegTable(e, e, e, e2, e2, e2)
        return SegTable(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("rank", "param", "slot", "off", "len", "delta"))
        )

    @staticmethod
    def of_segments(segments: Sequence[Segment], ndim: int, width: int) -> SegTable:
        """The table of :class:`Segment` objects of a tensor of ``ndim`` dims."""
        for s in segments:
            if len(s.box) != ndim:
                raise ValueError(f"segment box {list(s.box)} does not have the tensor's {ndim} dims")
        k = len(segments)
        off, ln, delta = (np.zeros((k, width), np.int64), np.ones((k, width), np.int64), np.zeros((k, width), np.int64))
        for i, s in enumerate(segments):
            off[i, :ndim] = [o for o, _ in s.box]
            ln[i, :ndim] = [n for _, n in s.box]
            dl = s.delta[:ndim]
            delta[i, : len(dl)] = dl
        return SegTable(
            np.asarray([s.rank for s in segments], np.int64).reshape(k),
            np.asarray([s.param for s in segments], np.int64).reshape(k),
            np.asarray([s.lead[0][0] if s.lead else -1 for s in segments], np.int64).reshape(k),
            off,
            ln,
            delta,
        )

    def segment(self, i: int, ndim: int) -> Segment:
        """Row ``i`` as a :class:`Segment` of a tensor of ``ndim`` dims."""
        off, ln, delta = self.off[i, :ndim].tolist(), self.len[i, :ndim].tolist(), self.delta[i, :ndim].tolist()
        slot = int(self.slot[i])
        return Segment(
            int(self.rank[i]), int(self.param[i]), tuple(zip(off, ln)), ((slot, 1),) if slot >= 0 else (), tuple(delta)
        )


class Output:
    """One checkpoint tensor to write and its holders' segments, always rows ``lo:hi`` of a
    :class:`SegTable` (the planner reads only the table): the table :func:`~moeshard.models.outputs.describe_outputs`
    shares between its tensors, or one of this tensor's own made from a list of
    :class:`Segment` (built by hand), which :attr:`segments` then gives back as it was.
    ``zeros``: nobody holds the tensor (no segments): it is written as zeros."""

    __slots__ = ("key", "shape", "dtype", "is_buffer", "_segments", "table", "rows", "zeros")

    def __init__(
        self,
        key: str,
        shape: tuple[int, ...],
        dtype: str,
        segments: list[Segment] | None = None,
        is_buffer: bool = False,
        *,
        table: SegTable | None = None,
        rows: tuple[int, int] = (0, 0),
        zeros: bool = False,
    ):
        self.key, self.shape, self.dtype, self.is_buffer, self.zeros = key, shape, dtype, is_buffer, zeros
        if table is None:
            segments = [] if segments is None else segments
            table, rows = SegTable.of_segments(segments, len(shape), max(len(shape), 1)), (0, len(segments))
        self._segments = segments  # None: made from the table on first use
        self.table, self.rows = table, rows

    @property
    def segments(self) -> list[Segment]:
        if self._segments is None:
            self._segments = [self.table.segment(i, len(self.shape)) for i in range(*self.rows)]
        return self._segments

    def __repr__(self) -> str:
        return f"Output({self.key!r}, {self.shape}, {self.dtype!r}, {len(self)} segments)"

    def __len__(self) -> int:
        return self.rows[1] - self.rows[0]
