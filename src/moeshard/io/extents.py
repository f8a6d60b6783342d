"""Reads planned as extents: one rank's reads of many pieces, coalesced per file into few large
``preadv`` calls that scatter straight into the pieces' destinations.

A *segment* is one contiguous file byte range of one piece and where it lands (a piece whose
box is cut along a later dim has several). :func:`plan_extents` (pure) sorts a rank's segments
by file and offset and joins neighbours into *extents*: byte ranges of a file read with one
``preadv`` whose iovecs are the segments' destinations in order. A gap between two segments of
at most ``gap_bytes`` is read too, into a throwaway scratch buffer (one system call and one
sequential read instead of two; its bytes are counted apart from the pieces'); a larger gap,
overlapping segments, the iovec limit or ``max_bytes`` start a new extent.

Files are read in a per-rank staggered order: rank ``r`` starts at the ``r mod F``-th of its
``F`` files (in name order) and goes round, so that the ranks of a node do not all read the
same file at once. :class:`ExtentReads` binds a plan to its destinations and reads one extent
at a time, hinting the kernel (``posix_fadvise(WILLNEED)``) about the next ``advise_bytes``
ahead of the one it reads, so storage reads ahead while the rank copies.

Which destinations qualify (the caller decides, :meth:`CheckpointReader.reads_straight_into`):
contiguous CPU tensors of the checkpoint's dtype, read without a cast. Nothing here
communicates; each rank plans and reads its own.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..box import Box
from .reader import IOV_MAX, CheckpointReader

__all__ = [
    "Segment",
    "Part",
    "Extent",
    "plan_extents",
    "plan_extent_arrays",
    "contiguous_boxes",
    "ExtentReads",
    "READ_GAP_BYTES",
    "EXTENT_BYTES",
    "ADVISE_BYTES",
]

# Gaps up to this are read into a scratch buffer rather than skipped with a new read: on this
# project's hosts a system call plus its Python costs ~10 us, what the page cache copies 64 KiB
# in; on storage with seeks the bound is far below a seek's cost.
READ_GAP_BYTES = 64 * 2**10
# At most this many bytes per extent: a rank's reads are shared among its rounds and threads
# by extents, and progress advances by them.
EXTENT_BYTES = 16 * 2**20
# Read-ahead hints reach this far beyond the extent being read.
ADVISE_BYTES = 128 * 2**20


class Segment(NamedTuple):
    """A contiguous byte range of a file that lands in one destination: ``nbytes`` from file
    byte ``offset`` of ``file`` into item ``item``'s destination at byte ``pos``."""

    file: str
    offset: int
    nbytes: int
    item: int
    pos: int


class Part(NamedTuple):
    """One iovec of an extent: ``nbytes`` into segment ``seg`` (its index in the planned
    segments), or into the scratch buffer where ``seg`` is -1 (a gap)."""

    seg: int
    nbytes: int


@dataclass(frozen=True)
class Extent:
    """``nbytes`` of ``file`` from ``offset`` on, read with one ``preadv``: ``parts`` in file
    order cover it exactly; ``gap_bytes`` of them go to the scratch buffer."""

    file: str
    offset: int
    nbytes: int
    parts: tuple[Part, ...]
    gap_bytes: int

    @property
    def piece_bytes(self) -> int:
        """Bytes of the extent that land in destinations (its segments')."""
        return self.nbytes - self.gap_bytes


def contiguous_boxes(shape: np.ndarray, off: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ``N`` boxes of row-major tensors, whose elements are one contiguous range of the
    tensor's: ``(ok bool[N], start int64[N])``, ``start`` the box's first element's linear
    index (valid where ``ok``). ``shape``, ``off``, ``length``: ``int64[N, D]``, dims past a
    tensor's own padded with shape 1, offset 0, length 1. A box is contiguous when every dim
    after its first dim longer than one is whole. Pure, vectorized."""
    n, d = shape.shape
    if d == 0:
        return np.ones(n, dtype=bool), np.zeros(n, dtype=np.int64)
    longer = length > 1
    before = np.zeros_like(longer)
    before[:, 1:] = np.logical_or.accumulate(longer, axis=1)[:, :-1]
    ok = np.all(~before | (length == shape), axis=1)
    strides = np.ones_like(shape)
    strides[:, :-1] = np.cumprod(shape[:, :0:-1], axis=1)[:, ::-1]
    return ok, (off * strides).sum(axis=1)


def plan_extents(
    segments: Sequence[Segment],
    *,
    rank: int = 0,
    gap_bytes: int = READ_GAP_BYTES,
    max_bytes: int = EXTENT_BYTES,
    max_parts: int = IOV_MAX,
) -> tuple[Extent, ...]:
    """The extents that read ``segments``, in read order: files in name order rotated to start
    at the ``rank mod F``-th, each file's extents by offset. Every segment of a positive
    length is in exactly one extent, once; part ``seg`` numbers are positions in
    ``segments``. Pure.

    Raises:
        ValueError: a negative ``gap_bytes``, ``max_bytes`` < 1 or ``max_parts`` < 2.
    """
    files = sorted({s.file for s in segments})
    number = {f: i for i, f in enumerate(files)}
    return plan_extent_arrays(
        files,
        np.fromiter((number[s.file] for s in segments), dtype=np.int64, count=len(segments)),
        np.fromiter((s.offset for s in segments), dtype=np.int64, count=len(segments)),
        np.fromiter((s.nbytes for s in segments), dtype=np.int64, count=len(segments)),
        rank=rank,
        gap_bytes=gap_bytes,
        max_bytes=max_bytes,
        max_parts=max_parts,
    )


def plan_extent_arrays(
    files: Sequence[str],
    file_no: np.ndarray,
    offset: np.ndarray,
    nbytes: np.ndarray,
    *,
    rank: int = 0,
    gap_bytes: int = READ_GAP_BYTES,
    max_bytes: int = EXTENT_BYTES,
    max_parts: int = IOV_MAX,
) -> tuple[Extent, ...]:
    """:func:`plan_extents` of segments given as arrays (``int64[S]`` each): segment ``i`` is
    ``nbytes[i]`` bytes from ``offset[i]`` of ``files[file_no[i]]``; ``files`` in name order."""
    if gap_bytes < 0 or max_bytes < 1 or max_parts < 2:
        raise ValueError(
            f"gap_bytes >= 0, max_bytes >= 1 and max_parts >= 2 needed, got {gap_bytes}, {max_bytes}, {max_parts}"
        )
    if not len(files) or not len(file_no):
        return ()
    turn = (file_no - rank % len(files)) % len(files)
    order = np.lexsort((nbytes, offset, turn))
    order = order[nbytes[order] > 0]
    out: list[Extent] = []
    parts: list[Part] = []
    file, begin, end, gaps = -1, 0, 0, 0
    for i, f, o, n in zip(order.tolist(), file_no[order].tolist(), offset[order].tolist(), nbytes[order].tolist()):
        gap = o - end
        if (
            f != file
            or gap < 0
            or gap > gap_bytes
            or len(parts) + 1 + (gap > 0) > max_parts
            or o + n - begin > max_bytes
        ):
            if parts:
                out.append(Extent(files[file], begin, end - begin, tuple(parts), gaps))
            parts, file, begin, gaps = [], f, o, 0
        elif gap:
            parts.append(Part(-1, gap))
            gaps += gap
        parts.append(Part(i, n))
        end = o + n
    if parts:
        out.append(Extent(files[file], begin, end - begin, tuple(parts), gaps))
    return tuple(out)


class ExtentReads:
    """A rank's extents bound to their destinations: :meth:`read` reads extent ``i`` (one
    ``preadv`` straight into the destinations) and returns the bytes that landed.

    Segment ``i`` is ``nbytes[i]`` bytes from ``offset[i]`` of ``files[file_no[i]]`` (``files``
    in name order), landing in ``views[i]`` (a writable byte buffer of that length: a slice of
    a contiguous CPU tensor of the checkpoint's dtype). Safe to read different extents from
    several threads (the scratch buffer takes only gap bytes; a hint may be given twice)."""

    def __init__(
        self,
        reader: CheckpointReader,
        files: Sequence[str],
        file_no: np.ndarray,
        offset: np.ndarray,
        nbytes: np.ndarray,
        views: Sequence[memoryview],
        *,
        rank: int = 0,
        gap_bytes: int = READ_GAP_BYTES,
        max_bytes: int = EXTENT_BYTES,
        advise_bytes: int = ADVISE_BYTES,
    ):
        assert len(views) == len(file_no) == len(offset) == len(nbytes)
        self.reader = reader
        self.views = views
        self.extents = plan_extent_arrays(
            files, file_no, offset, nbytes, rank=rank, gap_bytes=gap_bytes, max_bytes=max_bytes
        )
        self.scratch = memoryview(bytearray(max((e.gap_bytes for e in self.extents), default=0)))
        self.advise_bytes = advise_bytes
        self._advised = 0  # extents before this one are advised
        self._before = list(itertools.accumulate((e.nbytes for e in self.extents), initial=0))

    @classmethod
    def of_boxes(cls, reader: CheckpointReader, items: Sequence[tuple[str, Box, object]], **kw) -> ExtentReads:
        """Extents for ``(key, box, out)`` items: ``out`` a tensor of shape ``box_shape(box)``
        that a read lands in as it is (``reader.reads_straight_into``)."""
        import torch

        segments: list[Segment] = []
        views = []
        for item, (key, box, out) in enumerate(items):
            assert reader.reads_straight_into(key, out), f"{key}: not a destination a read lands in as it is"
            flat = memoryview(out.detach().view(-1).view(torch.uint8).numpy()).cast("B") if out.numel() else None
            file = reader.index.info(key).file
            pos = 0
            for offset, n in reader.runs(key, box):
                segments.append(Segment(file, offset, n, item, pos))
                views.append(flat[pos : pos + n])
                pos += n
        files = sorted({sg.file for sg in segments})
        number = {f: i for i, f in enumerate(files)}
        reads = cls(
            reader,
            files,
            np.array([number[sg.file] for sg in segments], dtype=np.int64),
            np.array([sg.offset for sg in segments], dtype=np.int64),
            np.array([sg.nbytes for sg in segments], dtype=np.int64),
            views,
            **kw,
        )
        reads.segments = segments
        return reads

    @classmethod
    def of_pieces(
        cls,
        reader: CheckpointReader,
        keys: Sequence[str],
        key: np.ndarray,
        off: np.ndarray,
        length: np.ndarray,
        views: Sequence[memoryview],
        **kw,
    ) -> ExtentReads:
        """Extents for ``N`` pieces of a schedule, without a Python step per piece where a
        piece's box is one contiguous range of its file: piece ``i`` is the box
        ``off[i], length[i]`` (``int64[N, D]``, padded past the tensor's rank) of tensor
        ``keys[key[i]]`` and lands, all of it, in ``views[i]`` (a writable byte buffer of its
        size)."""
        d = off.shape[1] if off.ndim == 2 else 0
        used, at = np.unique(key, return_inverse=True)
        infos = [reader.index.info(keys[k]) for k in used.tolist()]
        files = sorted({i.file for i in infos})
        number = {f: i for i, f in enumerate(files)}
        shape = np.ones((len(used), d), dtype=np.int64)
        for j, info in enumerate(infos):
            shape[j, : len(info.shape)] = info.shape
        ndim = np.array([len(i.shape) for i in infos], dtype=np.int64)[at]
        pad = np.arange(d)[None, :] >= ndim[:, None]
        off = np.where(pad, 0, off)
        length = np.where(pad, 1, length)
        outside = np.flatnonzero(np.any((off < 0) | (length < 0) | (off + length > shape[at]), axis=1))
        if len(outside):
            i = int(outside[0])
            raise ValueError(
                f"{keys[int(key[i])]}: box {list(zip(off[i].tolist(), length[i].tolist()))} does not "
                f"fit in shape {list(infos[int(at[i])].shape)}"
            )
        ok, start = contiguous_boxes(shape[at], off, length)
        item = np.array([i.itemsize for i in infos], dtype=np.int64)[at]
        file_no = np.array([number[i.file] for i in infos], dtype=np.int64)[at]
        begin = np.array([i.offset for i in infos], dtype=np.int64)[at] + start * item
        nbytes = length.prod(axis=1) * item
        assert np.array_equal(np.fromiter(map(len, views), dtype=np.int64, count=len(views)), nbytes), (
            "a destination's size differs from its piece's"
        )
        seg_file, seg_off, seg_len = [file_no[ok]], [begin[ok]], [nbytes[ok]]
        seg_views = [views[i] for i in np.flatnonzero(ok).tolist()]
        for i in np.flatnonzero(~ok).tolist():  # boxes of several runs: one segment per run
            name = keys[int(key[i])]
            nd = int(ndim[i])
            box = tuple(zip(off[i, :nd].tolist(), length[i, :nd].tolist()))
            runs = reader.runs(name, box)
            pos = 0
            for _, m in runs:
                seg_views.append(views[i][pos : pos + m])
                pos += m
            seg_file.append(np.full(len(runs), file_no[i], dtype=np.int64))
            seg_off.append(np.array([o for o, _ in runs], dtype=np.int64))
            seg_len.append(np.array([m for _, m in runs], dtype=np.int64))
        return cls(
            reader, files, np.concatenate(seg_file), np.concatenate(seg_off), np.concatenate(seg_len), seg_views, **kw
        )

    def __len__(self) -> int:
        return len(self.extents)

    def advise(self, upto: int) -> None:
        """Hint the extents not hinted yet up to ``advise_bytes`` beyond extent ``upto`` (at
        least through ``upto``), neighbouring extents of a file in one hint."""
        ext = self.extents
        # The first extent starting advise_bytes or more beyond the end of extent upto.
        stop = max(upto + 1, bisect.bisect_left(self._before, self._before[upto + 1] + self.advise_bytes))
        stop = min(stop, len(ext))
        j = self._advised
        while j < stop:
            e = ext[j]
            end, k = e.offset + e.nbytes, j + 1
            while k < stop and ext[k].file == e.file and ext[k].offset >= end:
                end, k = ext[k].offset + ext[k].nbytes, k + 1
            self.reader.advise(e.file, e.offset, end - e.offset)
            j = k
        self._advised = max(self._advised, stop)

    def read(self, i: int) -> int:
        """Read extent ``i`` into its destinations; its pieces' bytes (gaps not counted).
        Raises the reader's CheckpointError (naming the file and byte) on a failed read."""
        extent = self.extents[i]
        self.reader.read_extent(extent, self.views, self.scratch)
        return extent.piece_bytes
