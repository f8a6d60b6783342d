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
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from ..box import Box
from .checkpoint import IOV_MAX, CheckpointReader

__all__ = ["Segment", "Part", "Extent", "plan_extents", "ExtentReads", "READ_GAP_BYTES", "EXTENT_BYTES",
           "ADVISE_BYTES"]

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


def plan_extents(segments: Sequence[Segment], *, rank: int = 0, gap_bytes: int = READ_GAP_BYTES,
                 max_bytes: int = EXTENT_BYTES, max_parts: int = IOV_MAX) -> tuple[Extent, ...]:
    """The extents that read ``segments``, in read order: files in name order rotated to start
    at the ``rank mod F``-th, each file's extents by offset. Every segment is in exactly one
    extent, once. Pure.

    Raises:
        ValueError: a negative ``gap_bytes``, ``max_bytes`` < 1 or ``max_parts`` < 2.
    """
    if gap_bytes < 0 or max_bytes < 1 or max_parts < 2:
        raise ValueError(f"gap_bytes >= 0, max_bytes >= 1 and max_parts >= 2 needed, got {gap_bytes}, "
                         f"{max_bytes}, {max_parts}")
    files = sorted({s.file for s in segments})
    if not files:
        return ()
    start = rank % len(files)
    rank_of_file = {f: (i - start) % len(files) for i, f in enumerate(files)}
    order = sorted(range(len(segments)), key=lambda i: (rank_of_file[segments[i].file], segments[i].offset,
                                                        segments[i].nbytes))
    out: list[Extent] = []
    parts: list[Part] = []
    file, begin, end, gaps = "", 0, 0, 0

    def close() -> None:
        if parts:
            out.append(Extent(file, begin, end - begin, tuple(parts), gaps))

    for i in order:
        seg = segments[i]
        if seg.nbytes <= 0:
            continue
        gap = seg.offset - end
        joins = (parts and seg.file == file and 0 <= gap <= gap_bytes
                 and len(parts) + 1 + (gap > 0) <= max_parts and seg.offset + seg.nbytes - begin <= max_bytes)
        if not joins:
            close()
            parts, file, begin, end, gaps = [], seg.file, seg.offset, seg.offset, 0
        elif gap:
            parts.append(Part(-1, gap))
            gaps += gap
        parts.append(Part(i, seg.nbytes))
        end = seg.offset + seg.nbytes
    close()
    return tuple(out)


class ExtentReads:
    """A rank's extents bound to their destinations: :meth:`read` reads extent ``i`` (one
    ``preadv`` straight into the destinations) and returns the bytes that landed.

    ``items``: ``(key, box, out)`` per destination: ``out`` a contiguous CPU tensor of the
    checkpoint's dtype and shape ``box_shape(box)`` (``reader.reads_straight_into``). Safe to
    read different extents from several threads (the scratch buffer takes only gap bytes)."""

    def __init__(self, reader: CheckpointReader, items: Sequence[tuple[str, Box, object]], *, rank: int = 0,
                 gap_bytes: int = READ_GAP_BYTES, max_bytes: int = EXTENT_BYTES, advise_bytes: int = ADVISE_BYTES):
        import torch

        self.reader = reader
        segments: list[Segment] = []
        flats = []
        for item, (key, box, out) in enumerate(items):
            assert reader.reads_straight_into(key, out), f"{key}: not a destination a read lands in as it is"
            flats.append(memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B") if out.numel() else None)
            file = reader.index.info(key).file
            pos = 0
            for offset, n in reader.runs(key, box):
                segments.append(Segment(file, offset, n, item, pos))
                pos += n
        self.segments = segments
        self.extents = plan_extents(segments, rank=rank, gap_bytes=gap_bytes, max_bytes=max_bytes)
        self.views = [flats[s.item][s.pos:s.pos + s.nbytes] for s in segments]
        self.scratch = memoryview(bytearray(max((e.gap_bytes for e in self.extents), default=0)))
        self.advise_bytes = advise_bytes
        self._advised = 0  # extents before this one are advised
        self._before = list(itertools.accumulate((e.nbytes for e in self.extents), initial=0))

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
