"""The save planner: who writes which checkpoint tensor into which file, and who sends what.

Pure and deterministic (no communication, same answer on every rank, any world size), the
mirror image of a load plan:

* every checkpoint tensor to write (a non-expert parameter or persistent buffer under its
  checkpoint name; one part of one logical expert of a fused expert parameter) is described by
  its :class:`Segment` s: which rank holds which box of it, and where in its local tensor
  (:func:`~moeshard.models.outputs.describe_outputs`);
* every box is written once: the tensor's *writer* (a rank holding the most of it, balanced by
  bytes over the ranks, largest tensors first) writes the boxes it holds itself; each other box
  comes from one of its holders (the least-sending one) by P2P;
* each writer packs its tensors, in model order, into files of at most ``max_shard_bytes``
  (a tensor larger than that gets a file of its own), numbered ``model-00001-of-0000N`` with
  N known in advance;
* transfers are split into pieces of at most a quarter of the staging budget and packed into
  batches in which every rank posts at most ``max_ops`` P2P ops and stages at most
  ``staging_bytes``.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .._gc import paused_gc
from ..box import Box, split_box
from ..io.header import DTYPES
from ..topology import Topology
from .arrays import expand_runs, group_rows, lex_order, row_prod, run_starts
from .save_outputs import Output, Segment, SegTable
from .schedule import CopyTable, DeliveryTable, PieceTable, PlanCost, ReadTable, Schedule, SendTable, ViewTable

__all__ = [
    "Segment",
    "OutTensor",
    "SaveFile",
    "Transfer",
    "LocalWrite",
    "SaveCost",
    "SavePlan",
    "HeldBoxes",
    "plan_save",
    "shard_name",
    "tensor_schedule",
]

DEFAULT_MAX_OPS = 64
_CHUNK = 1 << 16  # rows a loop over millions of transfers turns into Python objects at a time


@dataclass(frozen=True)
class OutTensor:
    """One checkpoint tensor: ``key``, ``shape``, ``dtype`` (safetensors name), ``nbytes``, its
    ``writer`` rank, its ``file`` (index into :attr:`SavePlan.files`) and ``offset`` in that
    file's data section; :attr:`segments`: one holder for each box, the boxes tiling the tensor."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    writer: int
    file: int
    offset: int
    is_buffer: bool = False
    _source: tuple = field(default=(), repr=False, compare=False)  # (_Chosen, tensor index)
    zeros: bool = False  # nobody holds it: its bytes are zeros, which the writer leaves unwritten

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The chosen segment of each box, boxes in order (made from the plan's arrays on use)."""
        chosen, t = self._source
        return chosen.of(t)


@dataclass(frozen=True)
class SaveFile:
    """A shard file: its final ``name``, ``writer`` rank, tensors (indices, in data order)."""

    name: str
    writer: int
    tensors: tuple[int, ...]
    data_bytes: int


@dataclass(frozen=True)
class Transfer:
    """``src`` sends box ``box`` of tensor ``tensor`` (its segment ``segment``) to ``dst``."""

    src: int
    dst: int
    tensor: int
    segment: int
    box: Box
    nbytes: int


@dataclass(frozen=True)
class LocalWrite:
    """The writer writes box ``box`` of tensor ``tensor`` from its own segment ``segment``."""

    tensor: int
    segment: int
    box: Box
    nbytes: int


@dataclass(frozen=True)
class SaveCost:
    """Per-rank counters (``int64[world]``): bytes written to files, sent, received, staged at
    most in one batch; job-wide: P2P ops and batches."""

    write_bytes: np.ndarray
    sent_bytes: np.ndarray
    recv_bytes: np.ndarray
    peak_staging_bytes: np.ndarray
    num_p2p_ops: int
    num_batches: int

    def summary(self) -> dict:
        return {
            "write_bytes_total": int(self.write_bytes.sum()),
            "write_bytes_max_rank": int(self.write_bytes.max(initial=0)),
            "write_bytes_min_rank": int(self.write_bytes.min()) if self.write_bytes.size else 0,
            "sent_bytes_total": int(self.sent_bytes.sum()),
            "sent_bytes_max_rank": int(self.sent_bytes.max(initial=0)),
            "recv_bytes_max_rank": int(self.recv_bytes.max(initial=0)),
            "peak_staging_bytes_max_rank": int(self.peak_staging_bytes.max(initial=0)),
            "num_p2p_ops": self.num_p2p_ops,
            "num_batches": self.num_batches,
        }


@dataclass(frozen=True, eq=False)
class SavePlan:
    """Everything every rank does to save, in order: the whole job's, as arrays. Identical on
    every rank.

    :attr:`schedule` is the whole job's :class:`Schedule` (built on first use);
    :meth:`schedule_for` is what one rank runs (its rows only). Their keys are the checkpoint
    tensors (key ``t`` = ``tensors[t]``), a piece is a transfer's or local write's box; batch
    ``k`` is round ``k``; sends read views of the holders' local tensors; a writer's own boxes
    are copies of round -1 (straight from its tensors to the file); deliveries (param = the
    tensor) go to the file. :attr:`batches` and :attr:`local_writes` are made from the plan's
    arrays on first use.

    ``fingerprint`` is a digest of what the plan is made from (the tensors, every segment, the
    world size and the budgets): the planner is pure, so ranks that agree on it run parts of
    one plan.

    ``rank``: the plan holds only that rank's pieces (``plan_save(rank=)``): only
    :meth:`schedule_for` that rank can be built from it. None: every rank's.
    """

    world_size: int
    tensors: tuple[OutTensor, ...]
    files: tuple[SaveFile, ...]
    cost: SaveCost
    staging_bytes: int
    max_ops: int = DEFAULT_MAX_OPS
    fingerprint: str = ""
    rank: int | None = None
    _pieces: _TransferColumns | None = field(default=None, repr=False)
    _segs: SegTable | None = field(default=None, repr=False)

    @functools.cached_property
    def schedule(self) -> Schedule:
        """Every rank's rows (the job's view: tests, tools). A rank that runs the plan needs
        only :meth:`schedule_for` its rank."""
        self._whole_job("schedule")
        return _as_schedule(self)

    def schedule_for(self, rank: int) -> Schedule:
        """What rank ``rank`` runs: a :class:`Schedule` with ``rank`` set that holds only the
        pieces it sends, receives or writes itself (with their views and copies) and its own
        deliveries, in the plan's order (both ends of a send post it at the same position of
        their batch); ``cost`` and the fingerprint are the plan's, rounds keep the job's
        numbers. O(transfers) numpy to find the rank's rows, then O(its rows). Not cached."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the plan's {self.world_size} ranks")
        if self.rank is not None and rank != self.rank:
            raise ValueError(f"this plan holds rank {self.rank}'s pieces only, not rank {rank}'s")
        return _as_schedule(self, rank)

    def _whole_job(self, what: str) -> None:
        if self.rank is not None:
            raise ValueError(
                f"SavePlan.{what} is the whole job's; this plan holds rank {self.rank}'s pieces only "
                "(plan_save(rank=None) keeps every rank's)"
            )

    @functools.cached_property
    def batches(self) -> tuple[tuple[Transfer, ...], ...]:
        self._whole_job("batches")
        p = self._pieces
        x = len(p.round)
        rows = zip(
            p.src[:x].tolist(),
            p.dst[:x].tolist(),
            p.tensor[:x].tolist(),
            p.si[:x].tolist(),
            p.boxes()[:x],
            p.nbytes[:x].tolist(),
        )
        out: list[list[Transfer]] = [[] for _ in range(self.cost.num_batches)]
        for k, row in zip(p.round.tolist(), rows):
            out[k].append(Transfer(*row))
        return tuple(tuple(b) for b in out)

    @functools.cached_property
    def local_writes(self) -> tuple[tuple[LocalWrite, ...], ...]:  # per rank
        self._whole_job("local_writes")
        p = self._pieces
        x = len(p.round)
        out: list[list[LocalWrite]] = [[] for _ in range(self.world_size)]
        for r, t, si, box, nb in zip(
            p.dst[x:].tolist(), p.tensor[x:].tolist(), p.si[x:].tolist(), p.boxes()[x:], p.nbytes[x:].tolist()
        ):
            out[r].append(LocalWrite(t, si, box, nb))
        return tuple(tuple(v) for v in out)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def files_of(self, rank: int) -> list[int]:
        return [i for i, f in enumerate(self.files) if f.writer == rank]

    def weight_map(self) -> dict[str, str]:
        return {t.key: self.files[t.file].name for t in self.tensors}


def shard_name(i: int, num_files: int) -> str:
    """HF's shard file name, ``i`` counted from 0."""
    return f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"


# -- checkpoint tensors -> plan -------------------------------------------------------------------


def plan_save(
    outs: Sequence[Output],
    world_size: int,
    max_shard_bytes: int,
    staging_bytes: int,
    max_ops: int = DEFAULT_MAX_OPS,
    rank: int | None = None,
) -> SavePlan:
    """Writers, files and transfers for ``outs`` (:func:`~moeshard.models.outputs.describe_outputs`), pure.

    ``rank``: keep only the pieces that rank sends, receives or writes (what it runs,
    :meth:`SavePlan.schedule_for`); the writers, files, cost counters and fingerprint are the
    whole job's all the same. None: every rank's pieces (the whole job's
    :attr:`SavePlan.schedule`, :attr:`~SavePlan.batches`, :attr:`~SavePlan.local_writes`).
    Cost per rank: O(segments + transfers) numpy and one Python loop over the transfers (the
    batch packing is one greedy over them all), memory O(segments) plus the kept pieces.

    Raises:
        ValueError: a tensor whose holders' boxes leave a gap or overlap (not a grid of boxes),
            a tensor nobody holds, or limits below one element.
    """
    if max_shard_bytes < 1 or staging_bytes < 1 or max_ops < 2:
        raise ValueError(
            f"max_shard_bytes and staging_bytes must be >= 1 and max_ops >= 2, got "
            f"{max_shard_bytes}, {staging_bytes}, {max_ops}"
        )
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the plan's {world_size} ranks")
    with paused_gc():
        return _plan_save(outs, world_size, max_shard_bytes, staging_bytes, max_ops, rank)


@dataclass(frozen=True)
class _Boxes:
    """The distinct boxes of every tensor (``G`` boxes, sorted by tensor, then box as tuples
    compare) and their holders.

    ``tensor``: ``int64[G]``; ``first``: ``int64[T + 1]`` each tensor's first box; ``seg``:
    ``int64[S]`` each segment's box; ``off``, ``len``: ``int64[G, W]``; ``nbytes``:
    ``int64[G]``. Holders, one row per distinct (box, rank), sorted by box then rank:
    ``h_box``, ``h_rank``, ``h_seg`` (``int64[H]``: the rank's first segment of the box).
    """

    tensor: np.ndarray
    first: np.ndarray
    seg: np.ndarray
    off: np.ndarray
    len: np.ndarray
    nbytes: np.ndarray
    h_box: np.ndarray
    h_rank: np.ndarray
    h_seg: np.ndarray


def _gather(outs: Sequence[Output], width: int) -> tuple[SegTable, np.ndarray]:
    """Every tensor's segments as one table (tensor by tensor, each in its own order) and
    ``int64[T + 1]`` each tensor's first row."""
    counts = np.asarray([len(o) for o in outs], np.int64)
    first = np.zeros(len(outs) + 1, np.int64)
    np.cumsum(counts, out=first[1:])
    table = outs[0].table if outs else None
    if (
        table is not None
        and all(o.table is table for o in outs)
        and all(a.rows[1] == b.rows[0] for a, b in zip(outs, outs[1:]))
    ):  # describe_outputs' rows, in order
        return table.rows(outs[0].rows[0], outs[-1].rows[1], width), first
    return SegTable.concat([o.table.rows(*o.rows, width) for o in outs], width), first


def _distinct_boxes(segs: SegTable, seg_first: np.ndarray, itemsize: np.ndarray) -> _Boxes:
    """The distinct boxes of each tensor (``seg_first``: ``int64[T + 1]`` each tensor's first
    segment) and their holders, in the order of :class:`_Boxes`."""
    n = len(seg_first) - 1
    seg_t = np.repeat(np.arange(n, dtype=np.int64), np.diff(seg_first))
    cols = [c for d in range(segs.off.shape[1]) for c in (segs.off[:, d], segs.len[:, d])]  # as tuples compare
    order, start = group_rows(seg_t, *cols)
    box_of = np.empty(len(order), np.int64)
    box_of[order] = np.cumsum(start) - 1
    rep = order[start]  # a segment of each box
    tensor = seg_t[rep]
    first = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(tensor, minlength=n), out=first[1:])
    off, ln = segs.off[rep], segs.len[rep]
    nbytes = row_prod(ln) * itemsize[tensor]  # padded dims have length 1
    h_order, h_start = group_rows(box_of, segs.rank)  # stable: a rank's first segment comes first
    h_seg = h_order[h_start]
    return _Boxes(tensor, first, box_of, off, ln, nbytes, box_of[h_seg], segs.rank[h_seg], h_seg)


def _check_tilings(outs, boxes: _Boxes, ndim: np.ndarray, nbytes: np.ndarray) -> None:
    """Raise ValueError (:func:`_check_tiling`'s, for the first tensor in order) unless every
    tensor with bytes is tiled by a grid of its boxes. Vectorized over a chunk of tensors at a
    time (boxes are sorted by tensor): tensors that may fail are found with arrays, then
    checked one by one."""
    n = len(outs)
    num_boxes = np.diff(boxes.first)
    grid = np.ones(n, np.int64)
    bad = (nbytes > 0) & (num_boxes == 0) & ~np.asarray([o.zeros for o in outs], dtype=bool).reshape(n)
    width = boxes.off.shape[1]
    shapes = np.asarray([(*o.shape, *(1,) * (width - len(o.shape))) for o in outs], np.int64).reshape(n, width)
    for a, b in _chunks(boxes.first):
        lo, hi = int(boxes.first[a]), int(boxes.first[b])
        for d in range(width):
            sel = lo + np.flatnonzero(ndim[boxes.tensor[lo:hi]] > d)
            t, start, ln = boxes.tensor[sel], boxes.off[sel, d], boxes.len[sel, d]
            order, first = group_rows(t, start, ln)
            t, start, end = (
                t[order][first],
                start[order][first],
                (start + ln)[order][first],
            )  # distinct intervals, sorted
            new_t = run_starts(t)
            bad[t[start != np.where(new_t, 0, np.concatenate([[0], end[:-1]]))]] = True  # a gap or an overlap
            last = np.append(np.flatnonzero(new_t)[1:] - 1, len(t) - 1) if len(t) else np.zeros(0, np.int64)
            bad[t[last][end[last] != shapes[t[last], d]]] = True  # short of the end
            np.multiply.at(grid, t[new_t], np.diff(np.append(np.flatnonzero(new_t), len(t))))  # intervals per dim
    bad |= (num_boxes != grid) & (num_boxes > 0)
    bad &= nbytes > 0
    for t in np.flatnonzero(bad).tolist():
        lo, hi = boxes.first[t], boxes.first[t + 1]
        nd = int(ndim[t])
        box_list = [tuple(zip(a[:nd], b[:nd])) for a, b in zip(boxes.off[lo:hi].tolist(), boxes.len[lo:hi].tolist())]
        _check_tiling(outs[t].key, tuple(outs[t].shape), box_list, int(nbytes[t]))


def _chunks(first: np.ndarray) -> list[tuple[int, int]]:
    """Ranges ``[a, b)`` of groups (tensors, items; ``first``: ``int64[G + 1]`` each group's
    first row) of about ``_CHUNK`` rows each, a group of more rows alone: what keeps the
    temporaries of work done group by group the size of a chunk. Rows ``first[a]:first[b]``."""
    n = len(first) - 1
    total = int(first[-1]) if n > 0 else 0
    cuts = np.unique(np.searchsorted(first, np.arange(_CHUNK, total, _CHUNK), side="right") - 1)
    edges = [0, *(c for c in cuts.tolist() if 0 < c < n), max(n, 0)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if a < b]


def _least_loaded(start: np.ndarray, count: np.ndarray, rank: np.ndarray, size: np.ndarray, world: int) -> np.ndarray:
    """A greedy in order: item ``i`` (of ``N``, ``size[i]`` bytes) goes to the candidate
    (``rank[start[i]:start[i] + count[i]]``, ascending, at least one) with the least load, the
    sizes of the items before it that went to the same rank; ties: the lowest rank. Returns
    ``int64[N]`` the chosen candidate row of each item.

    Sequential, but only the items with a choice are looped over: an item with one candidate
    is fixed, and the load of a rank at item ``i`` is the fixed items' sizes before ``i``
    (sorted prefix sums) plus what the loop gave it."""
    n = len(start)
    chosen = start.copy()
    multi = np.flatnonzero(count > 1)
    if not len(multi):
        return chosen
    fixed = np.flatnonzero(count == 1)
    code = rank[start[fixed]] * n + fixed
    order = np.argsort(code, kind="stable")
    code = code[order]
    prefix = np.concatenate([[0], np.cumsum(size[fixed][order])])
    cm = count[multi]
    extra = [0] * world
    for i0, i1 in _chunks(np.concatenate([[0], np.cumsum(cm)])):  # items of about _CHUNK candidates at a time
        items, c_m = multi[i0:i1], cm[i0:i1]
        _, k = expand_runs(start[items], c_m)  # every candidate of every item with a choice
        cand_rank = rank[k]
        item = np.repeat(items, c_m)
        base = prefix[np.searchsorted(code, cand_rank * n + item)] - prefix[np.searchsorted(code, cand_rank * n)]
        few = c_m <= 32  # plain Python beats numpy's call overhead on these
        on_list = np.repeat(few, c_m)  # Python lists of their candidates only (not of thousands per item)
        base_l, rank_l, k_l = base[on_list].tolist(), cand_rank[on_list].tolist(), k[on_list].tolist()
        at = at_l = 0  # the item's first candidate in the arrays, in the lists
        for i, c, nb, small in zip(items.tolist(), c_m.tolist(), size[items].tolist(), few.tolist()):
            if small:
                j, least = at_l, base_l[at_l] + extra[rank_l[at_l]]
                for m in range(at_l + 1, at_l + c):
                    v = base_l[m] + extra[rank_l[m]]
                    if v < least:  # strictly: the first minimum is the lowest rank
                        j, least = m, v
                r, pick = rank_l[j], k_l[j]
                at_l += c
            else:
                j = at + int(np.argmin(base[at : at + c] + np.asarray(extra)[cand_rank[at : at + c]]))
                r, pick = int(cand_rank[j]), int(k[j])
            extra[r] += nb
            chosen[i] = pick
            at += c
    return chosen


def _writers(boxes: _Boxes, nbytes: np.ndarray, world: int) -> tuple[list[int], list[int]]:
    """Writer of each tensor (largest first, ties by index: the least-loaded (write load, rank)
    of the ranks holding most bytes of it; any rank for a tensor nobody holds) and each rank's
    write load."""
    n = len(nbytes)
    p_t, p_rank, held = _held_bytes(boxes)
    best = np.full(n, -1, np.int64)
    np.maximum.at(best, p_t, held)
    cand = held == best[p_t]
    c_rank = p_rank[cand]  # by tensor, ranks ascending
    count = np.bincount(p_t[cand], minlength=n)
    first = np.cumsum(count) - count
    nobody = np.flatnonzero(count == 0)  # an empty tensor: anyone
    first[nobody], count[nobody] = len(c_rank) + world * np.arange(len(nobody)), world
    c_rank = np.concatenate([c_rank, np.tile(np.arange(world, dtype=np.int64), len(nobody))])
    seq = np.lexsort((np.arange(n), -nbytes))  # largest first
    pick = _least_loaded(first[seq], count[seq], c_rank, nbytes[seq], world)
    writer = np.empty(n, np.int64)
    writer[seq] = c_rank[pick]
    load = np.zeros(world, np.int64)
    np.add.at(load, writer, nbytes)
    return writer.tolist(), load.tolist()


def _held_bytes(boxes: _Boxes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tensor, rank, bytes)``, ``int64[P]`` each: the bytes of each tensor each of its
    holders holds, pairs sorted by tensor then rank. Grouped a chunk of tensors at a time
    (holder rows are sorted by tensor), so the sort's temporaries stay the size of a chunk."""
    t_h = boxes.tensor[boxes.h_box]  # ascending
    out = []
    h_first = np.searchsorted(boxes.h_box, boxes.first)  # each tensor's first holder row
    for a, b in _chunks(h_first):
        lo, hi = int(h_first[a]), int(h_first[b])
        t, r = t_h[lo:hi], boxes.h_rank[lo:hi]
        order, start = group_rows(t, r)  # (tensor, rank) pairs
        starts = np.flatnonzero(start)
        out.append(
            (t[order[starts]], r[order[starts]], np.add.reduceat(boxes.nbytes[boxes.h_box[lo:hi]][order], starts))
        )
    if not out:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return tuple(np.concatenate(c) for c in zip(*out))


def _holders(boxes: _Boxes, writer: list[int], world: int) -> np.ndarray:
    """``int64[G]``: the segment each box is sent or written from: the writer's own (its first)
    if any, else the first of the holder that has sent least so far (ties: lowest rank), boxes
    in order."""
    wr = np.asarray(writer, np.int64)
    num = len(boxes.tensor)
    chosen = np.full(num, -1, np.int64)
    own = boxes.h_rank == wr[boxes.tensor[boxes.h_box]]
    chosen[boxes.h_box[own]] = boxes.h_seg[own]
    rest = np.flatnonzero(chosen < 0)
    sel = np.flatnonzero(chosen[boxes.h_box] < 0)  # holder rows of those boxes, by box then rank
    count = np.bincount(np.searchsorted(rest, boxes.h_box[sel]), minlength=len(rest))
    pick = _least_loaded(np.cumsum(count) - count, count, boxes.h_rank[sel], boxes.nbytes[rest], world)
    chosen[rest] = boxes.h_seg[sel][pick]
    return chosen


def _files(nbytes: list[int], writer: list[int], world: int, max_shard_bytes: int):
    """Each writer's tensors in model order, in files of at most ``max_shard_bytes`` (a larger
    tensor alone). Returns the files, each tensor's file and offset in it, and ``int64[T]`` its
    (file of its writer, place in the file) as a sort key."""
    n = len(nbytes)
    per_writer: list[list[list[int]]] = [[] for _ in range(world)]
    filled = [0] * world
    fno, place = [0] * n, [0] * n
    for t in range(n):
        w = writer[t]
        files = per_writer[w]
        if not files or (files[-1] and filled[w] + nbytes[t] > max_shard_bytes):
            files.append([])
            filled[w] = 0
        fno[t], place[t] = len(files) - 1, len(files[-1])
        files[-1].append(t)
        filled[w] += nbytes[t]
    num_files = sum(len(f) for f in per_writer)
    out: list[SaveFile] = []
    file_of, offset_of = [0] * n, [0] * n
    for r in range(world):
        for members in per_writer[r]:
            pos = 0
            for t in members:
                file_of[t], offset_of[t] = len(out), pos
                pos += nbytes[t]
            out.append(SaveFile(shard_name(len(out), num_files), r, tuple(members), pos))
    return out, file_of, offset_of, np.asarray(fno, np.int64), np.asarray(place, np.int64)


@dataclass(frozen=True)
class _TransferColumns:
    """The save's transfers and local writes as columns (not the load's
    :class:`~moeshard.plan.pieces.Pieces`), in the schedule's piece order: the ``X`` transfers
    in batch order, then the local writes by writer (``P`` pieces in all).

    ``tensor``, ``si`` (the box's index among its tensor's), ``seg`` (row of the segment it is
    read from), ``src``, ``dst`` (the writer), ``nbytes``: ``int64[P]``; ``off``, ``len``:
    ``int64[P, W]``; ``ndim``: ``int64[P]`` the tensor's dims; ``round``: ``int64[X]``.
    """

    tensor: np.ndarray
    si: np.ndarray
    seg: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    off: np.ndarray
    len: np.ndarray
    ndim: np.ndarray
    round: np.ndarray

    def boxes(self) -> list[Box]:
        return [tuple(zip(o[:k], n[:k])) for o, n, k in zip(self.off.tolist(), self.len.tolist(), self.ndim.tolist())]


def _split(boxes: _Boxes, g: np.ndarray, itemsize: np.ndarray, ndim: np.ndarray, max_piece: int):
    """Pieces of the boxes ``g`` (``int64[K]``, in order): a box of more than ``max_piece``
    bytes split by :func:`split_box`. Returns ``(box int64[P], off, len int64[P, W])``."""
    item = itemsize[boxes.tensor[g]]
    big = np.flatnonzero(boxes.nbytes[g] > max_piece).tolist()
    counts = np.ones(len(g), np.int64)
    subs = {}
    for k in big:
        nd = int(ndim[boxes.tensor[g[k]]])
        box = tuple(zip(boxes.off[g[k], :nd].tolist(), boxes.len[g[k], :nd].tolist()))
        subs[k] = split_box(box, max(1, max_piece // int(item[k])))
        counts[k] = len(subs[k])
    rep = np.repeat(np.arange(len(g)), counts)
    off, ln = boxes.off[g][rep], boxes.len[g][rep]
    at = (np.cumsum(counts) - counts).tolist()
    for k, parts in subs.items():
        for j, sub in enumerate(parts):
            off[at[k] + j, : len(sub)] = [o for o, _ in sub]
            ln[at[k] + j, : len(sub)] = [n for _, n in sub]
    return g[rep], off, ln


def _make_pieces(
    boxes: _Boxes,
    chosen: np.ndarray,
    segs: SegTable,
    writer: list[int],
    itemsize,
    ndim,
    t_order: np.ndarray,
    staging_bytes: int,
    max_ops: int,
    world: int,
    rank: int | None,
) -> tuple[_TransferColumns, np.ndarray, np.ndarray, _Packer]:
    """Every tensor's boxes (tensors in ``t_order``, boxes in order) cut into pieces; pieces
    from another rank are transfers, packed into batches; the writer's are local writes.

    Streamed: tensors a chunk at a time (about ``_CHUNK`` boxes), so the job's pieces are never
    in memory at once; the batch packing carries its state over the chunks. Kept: every piece
    (``rank`` None), or only those ``rank`` sends, receives or writes. Returns the pieces,
    ``int64[world]`` the bytes each rank sends and receives, and the packer (its counters:
    staged bytes per rank, ops, batches): the whole job's either way."""
    wr = np.asarray(writer, np.int64)
    count = np.diff(boxes.first)[t_order]
    max_piece = max(1, staging_bytes // 4)
    pack = _Packer(world, staging_bytes, max_ops)
    sent, recv = np.zeros(world, np.int64), np.zeros(world, np.int64)
    moved: list[tuple] = []  # kept transfers of each chunk, in order
    written: list[tuple] = []  # kept local writes of each chunk, in order
    for lo, hi in _chunks(np.concatenate([[0], np.cumsum(count)])):
        _, g = expand_runs(boxes.first[t_order[lo:hi]], count[lo:hi])
        g, off, ln = _split(boxes, g, itemsize, ndim, max_piece)
        t = boxes.tensor[g]
        seg = chosen[g]
        src, dst = segs.rank[seg], wr[t]
        nbytes = row_prod(ln) * itemsize[t]
        cols = (t, g - boxes.first[t], seg, src, dst, nbytes, off, ln)
        x = np.flatnonzero(src != dst)
        rounds = pack(src[x], dst[x], nbytes[x])
        np.add.at(sent, src[x], nbytes[x])
        np.add.at(recv, dst[x], nbytes[x])
        local = np.flatnonzero(src == dst)
        if rank is not None:
            mine = (src[x] == rank) | (dst[x] == rank)
            x, rounds = x[mine], rounds[mine]
            local = local[dst[local] == rank]
        moved.append(tuple(c[x] for c in cols) + (rounds,))
        written.append(tuple(c[local] for c in cols))
    width = boxes.off.shape[1]
    empty = tuple(np.zeros((0, width) if j in (6, 7) else 0, np.int64) for j in range(9))  # off, len: [0, W]
    xs = [np.concatenate(c) for c in zip(empty, *moved)]
    ls = [np.concatenate(c) for c in zip(empty[:8], *written)]
    by_writer = np.argsort(ls[4], kind="stable")  # local writes by writer, each in order
    cols = [np.concatenate([a, b[by_writer]]) for a, b in zip(xs[:8], ls)]
    pieces = _TransferColumns(*cols[:6], cols[6], cols[7], ndim[cols[0]], xs[8])
    return pieces, sent, recv, pack


class _Packer:
    """The batch packing over transfers given a chunk at a time, in order: a new batch when a
    transfer would take its sender or receiver over ``budget`` staged bytes or ``max_ops`` ops
    (never for the first transfer). A loop (greedy; ``src != dst``); a rank's counters are
    reset lazily, when first touched in a new batch, after its last batch's staged bytes are
    folded into its peak. Calls return ``int64[X]`` the batch of each transfer."""

    def __init__(self, world: int, budget: int, max_ops: int):
        self.budget, self.max_ops = budget, max_ops
        self.stage, self.ops, self.stamp, self.top = [0] * world, [0] * world, [0] * world, [0] * world
        self.k, self.num_ops = 0, 0

    @property
    def num_batches(self) -> int:
        return self.k + 1 if self.num_ops else 0

    def peak(self) -> np.ndarray:
        """``int64[world]``: the most bytes each rank stages in one batch, so far."""
        return np.maximum(np.asarray(self.top, np.int64), np.asarray(self.stage, np.int64))

    def __call__(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        out = np.empty(len(src), np.int64)
        stage, ops, stamp, top = self.stage, self.ops, self.stamp, self.top
        budget, max_ops, k, first = self.budget, self.max_ops, self.k, self.num_ops == 0
        for lo in range(0, len(src), _CHUNK):  # Python lists of one chunk at a time: bounded memory
            hi = lo + _CHUNK
            got: list[int] = []
            put = got.append
            for s, d, b in zip(src[lo:hi].tolist(), dst[lo:hi].tolist(), nbytes[lo:hi].tolist()):
                if stamp[s] != k:
                    if stage[s] > top[s]:
                        top[s] = stage[s]
                    stamp[s], stage[s], ops[s] = k, 0, 0
                if stamp[d] != k:
                    if stage[d] > top[d]:
                        top[d] = stage[d]
                    stamp[d], stage[d], ops[d] = k, 0, 0
                at_s, at_d = stage[s] + b, stage[d] + b
                if (at_s > budget or at_d > budget or ops[s] >= max_ops or ops[d] >= max_ops) and not first:
                    k += 1
                    if stage[s] > top[s]:
                        top[s] = stage[s]
                    if stage[d] > top[d]:
                        top[d] = stage[d]
                    stamp[s] = stamp[d] = k
                    at_s = at_d = b
                    ops[s] = ops[d] = 0
                first = False
                stage[s], stage[d] = at_s, at_d
                ops[s] += 1
                ops[d] += 1
                put(k)
            out[lo:hi] = got
        self.k = k
        self.num_ops += len(src)
        return out


def _plan_save(outs, world, max_shard_bytes, staging_bytes, max_ops, rank) -> SavePlan:
    itemsize = np.asarray([DTYPES[o.dtype].itemsize for o in outs], np.int64)
    ndim = np.asarray([len(o.shape) for o in outs], np.int64)
    sizes = [math.prod(o.shape) * int(s) for o, s in zip(outs, itemsize.tolist())]
    nbytes = np.asarray(sizes, np.int64)
    width = int(ndim.max(initial=0)) or 1  # a column even for scalars
    # 1. Distinct boxes of each tensor, their holders, and a check that the boxes tile it.
    segs, seg_first = _gather(outs, width)
    boxes = _distinct_boxes(segs, seg_first, itemsize)
    _check_tilings(outs, boxes, ndim, nbytes)
    # 2. Writers: largest tensors first, to the least-loaded rank among those holding the most of it.
    writer, write_load = _writers(boxes, nbytes, world)
    # 3. One holder per box: the writer's own, else the holder that has sent least so far.
    chosen = _holders(boxes, writer, world)
    # 4. Files: each writer's tensors in model order, at most max_shard_bytes each.
    files, file_of, offset_of, fno, place = _files(sizes, writer, world, max_shard_bytes)
    # 5. Pieces: transfers (in rounds over the writers' files, so every writer is busy) and local writes.
    t_order = lex_order(fno, place, np.asarray(writer, np.int64))
    pieces, sent, recv, pack = _make_pieces(
        boxes, chosen, segs, writer, itemsize, ndim, t_order, staging_bytes, max_ops, world, rank
    )
    cost = SaveCost(np.asarray(write_load, dtype=np.int64), sent, recv, pack.peak(), pack.num_ops, pack.num_batches)
    source = _Chosen(outs, segs, seg_first, boxes, chosen)
    tensors = tuple(
        OutTensor(
            o.key,
            tuple(o.shape),
            o.dtype,
            sizes[t],
            writer[t],
            file_of[t],
            offset_of[t],
            o.is_buffer,
            (source, t),
            o.zeros,
        )
        for t, o in enumerate(outs)
    )
    fingerprint = _fingerprint(outs, segs, seg_first, world, max_shard_bytes, staging_bytes, max_ops)
    return SavePlan(world, tensors, tuple(files), cost, staging_bytes, max_ops, fingerprint, rank, pieces, segs)


class _Chosen:
    """The chosen segment of every box, as :class:`Segment` objects on demand: the caller's
    own objects where it gave them, else made from the table's rows."""

    def __init__(self, outs, segs: SegTable, seg_first: np.ndarray, boxes: _Boxes, chosen: np.ndarray):
        self.outs, self.segs, self.seg_first, self.box_first, self.chosen = outs, segs, seg_first, boxes.first, chosen

    def of(self, t: int) -> tuple[Segment, ...]:
        o = self.outs[t]
        rows = self.chosen[self.box_first[t] : self.box_first[t + 1]].tolist()
        if o._segments is not None:
            start = int(self.seg_first[t])
            return tuple(o._segments[r - start] for r in rows)
        return tuple(self.segs.segment(r, len(o.shape)) for r in rows)


def _as_schedule(plan: SavePlan, only: int | None = None) -> Schedule:
    """The plan as a :class:`Schedule` (see :class:`SavePlan` for its conventions): the whole
    job's, piece ``i`` = the plan's piece row ``i``, read through view ``i``, deliveries in
    piece order; or with ``only`` the rows of that rank (the pieces it sends, receives or
    writes, renumbered in order, and its deliveries)."""
    i32, i64 = np.int32, np.int64
    p, segs, c = plan._pieces, plan._segs, plan.cost
    width = p.off.shape[1]
    x = len(p.round)
    if only is None:
        keep = np.arange(len(p.tensor))
    else:  # a local write has src == dst == its writer
        keep = np.flatnonzero((p.src == only) | (p.dst == only))
    kx = int(np.searchsorted(keep, x))  # the kept transfers come first, then the local writes
    num = len(keep)
    seg, dst, tensor, poff = p.seg[keep], p.dst[keep], p.tensor[keep], p.off[keep]
    mine = np.arange(num, dtype=i32) if only is None else np.flatnonzero(dst == only).astype(i32)
    off = poff.astype(i64).reshape(-1, width)
    zeros = np.zeros(plan.world_size, dtype=i64)
    return Schedule(
        topology=Topology(plan.world_size, 1),
        staging_bytes=plan.staging_bytes,
        max_ops=plan.max_ops,
        keys=tuple(t.key for t in plan.tensors),
        key_ndim=np.asarray([len(t.shape) for t in plan.tensors], np.int8),
        pieces=PieceTable(
            tensor.astype(i32), off, p.len[keep].astype(i64).reshape(-1, width), p.nbytes[keep].astype(i64)
        ),
        reads=ReadTable(),
        sends=SendTable(
            p.src[keep[:kx]].astype(i32),
            dst[:kx].astype(i32),
            np.arange(kx, dtype=i32),
            p.round[keep[:kx]].astype(i64),
            np.arange(kx, dtype=i32),
        ),
        deliveries=DeliveryTable(
            mine, dst[mine].astype(i32), tensor[mine].astype(i32), np.full(len(mine), -1, i64), off[mine]
        ),
        num_rounds=c.num_batches,
        cost=PlanCost(
            read_bytes=zeros,
            sent_bytes=c.sent_bytes,
            recv_bytes=c.recv_bytes,
            peak_staging_bytes=c.peak_staging_bytes,
            cross_node_bytes=0,
            num_p2p_ops=c.num_p2p_ops,
            num_batches=c.num_batches,
            num_broadcasts=0,
        ),
        views=ViewTable(
            segs.rank[seg].astype(i32),
            segs.param[seg].astype(i32),
            segs.slot[seg].astype(i64),
            (poff + segs.delta[seg]).astype(i64).reshape(-1, width),
        ),
        copies=CopyTable(np.arange(kx, num, dtype=i32), np.arange(kx, num, dtype=i32), np.full(num - kx, -1, i64)),
        rank=only,
        basis=None if only is None else plan.fingerprint,
    )


class HeldBoxes(NamedTuple):
    """Boxes of one tensor and who holds them (``S`` rows, ``D`` = the tensor's dims): rank
    ``rank[i]`` holds box ``(off[i], len[i])`` of the tensor at offsets ``local_off[i]`` of its
    local tensor. ``rank``: ``int64[S]``; ``local_off``, ``off``, ``len``: ``int64[S, D]``."""

    rank: np.ndarray
    local_off: np.ndarray
    off: np.ndarray
    len: np.ndarray


_TENSOR_RULE = b"moeshard.plan.tensor_schedule/1"


def tensor_schedule(
    keys: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    itemsizes: Sequence[int],
    boxes: Iterable[HeldBoxes],
    writers: Sequence[int],
    world_size: int,
    staging_bytes: int,
    rank: int | None = None,
) -> Schedule:
    """Whole tensors to their writers, as a :class:`Schedule` (pure; LoRA adapters: a few
    hundred tensors in one file).

    Tensor ``i`` (``keys[i]``, ``shapes[i]``) is written by rank ``writers[i]`` from its
    ``boxes`` (the ``i``-th item: :class:`HeldBoxes` tiling it; local tensor ``i`` of each
    holder). ``boxes`` is consumed once, in order: it may make each tensor's rows on demand, so
    the job's rows are never all in memory. A piece is one box; a holder other than the writer
    sends it from its view, the writer's own are round -1 copies; deliveries (param = ``i``)
    carry the tensor box. Tensors are packed into rounds of at most ``staging_bytes`` (at
    least one tensor).

    With ``rank``: only the pieces that rank sends, receives or copies, and its deliveries;
    ``cost`` and rounds are the job's, and the fingerprint is a digest of the inputs (the same
    on every rank). Cost: O(tensors) numpy calls over each tensor's rows, on every rank.
    """
    width = max((len(s) for s in shapes), default=1) or 1
    i64 = np.int64
    sent, recv, peak = (np.zeros(world_size, dtype=i64) for _ in range(3))
    digest = hashlib.sha256(_TENSOR_RULE)
    digest.update(
        repr(
            (tuple(keys), tuple(map(tuple, shapes)), tuple(itemsizes), tuple(writers), world_size, staging_bytes)
        ).encode()
    )
    kept = []  # per tensor with rows kept: (tensor, writer, round, holder, local_off, off, len, nbytes)
    held: dict[int, int] = {}  # writer -> bytes it receives in the current round
    rnd, size, num_sends, count = 0, 0, 0, 0
    for i, b in enumerate(boxes):
        count += 1
        n = math.prod(shapes[i]) * itemsizes[i]
        if size and size + n > staging_bytes:
            rnd, size, held = rnd + 1, 0, {}
        size += n
        w = writers[i]
        for a in b:
            a = np.ascontiguousarray(a, dtype=i64)
            digest.update(repr(a.shape).encode())
            digest.update(a)
        nbytes = row_prod(b.len) * itemsizes[i]
        remote = b.rank != w  # the job's counters, whichever rows are kept
        num_sends += int(remote.sum())
        sent += np.bincount(b.rank[remote], weights=nbytes[remote], minlength=world_size).astype(i64)
        got = int(nbytes[remote].sum())
        recv[w] += got
        held[w] = held.get(w, 0) + got
        peak[w] = max(peak[w], held[w])
        keep = slice(None) if rank is None else np.flatnonzero((b.rank == rank) | (w == rank))
        if rank is None or len(keep):
            kept.append((i, w, rnd, b.rank[keep], b.local_off[keep], b.off[keep], b.len[keep], nbytes[keep]))
    if count != len(keys):
        raise ValueError(f"tensor_schedule: boxes for {count} tensors, {len(keys)} keys")

    def flat(j: int) -> np.ndarray:  # field j of the kept rows
        return np.concatenate([np.asarray(x[j], i64) for x in kept]) if kept else np.zeros(0, i64)

    def padded(j: int, fill: int) -> np.ndarray:  # box field j of the kept rows, dims padded to width
        return (
            np.concatenate(
                [
                    np.pad(np.asarray(x[j], i64), ((0, 0), (0, width - x[j].shape[1])), constant_values=fill)
                    for x in kept
                ]
            )
            if kept
            else np.zeros((0, width), i64)
        )

    sizes = [len(x[3]) for x in kept]
    tensor = np.repeat(np.asarray([x[0] for x in kept], i64), sizes)
    writer = np.repeat(np.asarray([x[1] for x in kept], i64), sizes)
    rounds = np.repeat(np.asarray([x[2] for x in kept], i64), sizes)
    holder, local_off, off, length, nbytes = flat(3), padded(4, 0), padded(5, 0), padded(6, 1), flat(7)
    pid = np.arange(len(holder), dtype=i64)
    send, copy = np.flatnonzero(holder != writer), np.flatnonzero(holder == writer)
    dlv = pid if rank is None else np.flatnonzero(writer == rank)
    i32 = np.int32
    return Schedule(
        topology=Topology(world_size, 1),
        staging_bytes=staging_bytes,
        max_ops=max(2, num_sends),
        keys=tuple(keys),
        key_ndim=np.asarray([len(s) for s in shapes], np.int8),
        pieces=PieceTable(tensor.astype(i32), off, length, nbytes),
        reads=ReadTable(),
        sends=SendTable(
            holder[send].astype(i32), writer[send].astype(i32), send.astype(i32), rounds[send], send.astype(i32)
        ),
        deliveries=DeliveryTable(
            dlv.astype(i32), writer[dlv].astype(i32), tensor[dlv].astype(i32), np.full(len(dlv), -1, i64), off[dlv]
        ),
        num_rounds=rnd + 1,
        cost=PlanCost(
            read_bytes=np.zeros(world_size, dtype=i64),
            sent_bytes=sent,
            recv_bytes=recv,
            peak_staging_bytes=peak,
            cross_node_bytes=0,
            num_p2p_ops=num_sends,
            num_batches=rnd + 1,
            num_broadcasts=0,
        ),
        views=ViewTable(holder.astype(i32), tensor.astype(i32), np.full(len(pid), -1, i64), local_off),
        copies=CopyTable(copy.astype(i32), copy.astype(i32), np.full(len(copy), -1, i64)),
        rank=rank,
        basis=None if rank is None else digest.hexdigest()[:16],
    )


def _check_tiling(key: str, shape: tuple[int, ...], boxes: list[Box], nbytes: int) -> None:
    """Raise ValueError unless ``boxes`` (distinct, non-empty) are a grid that tiles ``shape``."""
    if not nbytes:
        return
    if not boxes:
        raise ValueError(f"tensor {key!r}: no rank holds any of it")
    per_dim = [sorted({b[d] for b in boxes}) for d in range(len(shape))]
    for d, intervals in enumerate(per_dim):
        pos = 0
        for off, length in intervals:
            if off != pos:
                what = "a gap" if off > pos else "overlapping boxes"
                raise ValueError(
                    f"tensor {key!r}: the ranks' boxes leave {what} at offset {pos} of dim {d} "
                    f"(shape {list(shape)}); cannot write every element exactly once"
                )
            pos = off + length
        if pos != shape[d]:
            raise ValueError(f"tensor {key!r}: no rank holds offsets {pos}.. of dim {d} (shape {list(shape)})")
    if len(boxes) != math.prod(len(v) for v in per_dim):
        raise ValueError(f"tensor {key!r}: the ranks' boxes are not a grid over shape {list(shape)}")


_RULE = b"moeshard.plan.save/inputs-1"  # changes with the planner's rules: old and new ranks disagree


def _fingerprint(
    outs: Sequence[Output],
    segs: SegTable,
    seg_first: np.ndarray,
    world: int,
    max_shard_bytes: int,
    staging_bytes: int,
    max_ops: int,
) -> str:
    """sha256 of what the plan is made from: the budgets, every tensor's key, shape, dtype and
    kind, and the bytes of the segment table (``seg_first``: each tensor's first row). The
    planner is pure and deterministic, so equal inputs give equal plans; made in one pass over
    the arrays, where a digest of the plan's own rows would cost O(transfers) Python."""
    h = hashlib.sha256(_RULE)
    h.update(repr((world, max_shard_bytes, staging_bytes, max_ops)).encode())
    h.update(repr([(o.key, tuple(o.shape), o.dtype, bool(o.is_buffer), o.zeros) for o in outs]).encode())
    for a in (seg_first, segs.rank, segs.param, segs.slot, segs.off, segs.len, segs.delta):
        a = np.ascontiguousarray(a, dtype=np.int64)
        h.update(repr(a.shape).encode())
        h.update(a)
    return h.hexdigest()[:16]
