"""The one runner: a :class:`~moeshard.plan.schedule.Schedule` with torch.distributed.

Load, LoRA load, relocation, save and LoRA save all run here; they differ only in their
*source* (where pieces come from: a checkpoint reader, or views of local tensors) and their
*sink* (where pieces go: views of local tensors, or a shard writer). A refit's schedules, whose
pieces all come from views of local tensors and go into local tensors, run by a
:class:`ViewExchange` instead: small pieces packed per peer, the deliveries into the engine's
tensors held until the caller's agreement.

Every rank runs the rounds it takes part in, in the schedule's order, and posts only its own
rows, so P2P ops pair up without any loop over ranks and without deadlock (round t's
participants all finished their earlier rounds). Per round: copy the views the schedule
stashes or copies, read the pieces it sends first in this round (unless read ahead), post the
round's P2P ops as one batch, read the next round's pieces ahead (on a reader pool's threads,
or on this thread; within the staging budget, so that they are ready to send when their round
begins) and do a share of this rank's local work (reads and copies of round -1, which go
straight from storage or a view into place) while the batch is in flight, wait, join the
round's node broadcasts, make the round's deliveries (after every op of the round: a delivery
may overwrite a slot that a send of the same round reads), free the buffers it no longer
needs. Nothing calls a device synchronize: waits are on the ops' own work handles.

A round's ops go out as one batch, not each as soon as its piece has landed: on NCCL a batch
is one group, and ops of two ranks that send each other pieces in the same round, posted as
separate groups in different orders, can wait for each other forever. Reading ahead gives the
same overlap without changing what is paired with what.

A rank's local reads are planned as extents (:mod:`moeshard.io.extents`): its reads in one
file coalesced into few ``preadv`` calls straight into the destinations, files in a per-rank
staggered order, with read-ahead hints.

A read or a delivery that fails on one rank (an I/O error, a file changed under the job) does
not leave its peers blocked in a receive: the rank keeps running the schedule (sending zeros
in place of a piece it could not read) and records the error in :attr:`ExecStats.failures`;
:meth:`ExecStats.check` raises the first, and the callers agree on it so that every rank
raises one DistributedError naming the failing rank.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from . import collectives
from ._gc import paused_gc
from .box import box_shape, box_slices
from .io.extents import ExtentReads, contiguous_boxes
from .io.fp8 import dequantize, scale_box
from .io.index import CheckpointIndex
from .io.packed import decode_blob_into, read_blob
from .io.reader import CheckpointReader
from .io.readpool import ReadPool
from .plan.schedule import Schedule
from .topology import Topology

__all__ = [
    "ExecStats",
    "Source",
    "Sink",
    "FlatTargets",
    "Runner",
    "ViewExchange",
    "LocalTensors",
    "ReaderSource",
    "TensorSink",
    "Backup",
    "DequantSink",
    "execute_schedule",
    "piece_lists",
    "exchange",
    "node_groups",
]


@dataclass
class ExecStats:
    """What one rank did: bytes read from storage, sent, received (staging buffers), the
    peak of staging bytes held at once, and the errors of its failed reads and deliveries.

    ``bytes_read`` counts the pieces' bytes (what the plan predicts); ``gap_bytes_read`` the
    bytes between pieces that coalesced reads also read (into a scratch buffer, thrown away:
    :mod:`moeshard.io.extents`), not in ``bytes_read``."""

    bytes_read: int = 0
    gap_bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_staging_bytes: int = 0
    failures: list = field(default_factory=list)

    def check(self) -> ExecStats:
        """Raise this rank's first failure, if any (callers run it inside ``collectives.agree``)."""
        if self.failures:
            raise self.failures[0]
        return self


# The default process group that the cached node groups belong to, its world size, and
# {key: this rank's node group}. A load in a new default group (destroyed and re-initialized)
# clears it. The cache holds the default group object itself, so that object cannot be freed
# and its id reused by a new group while the cache still names it.
_NODE_GROUP_CACHE: dict = {"default": None, "world": 0, "groups": {}}


def node_groups(topology: Topology):
    """Collective (every rank of the current group, in the same order): one process group per
    node of ``topology`` (in the current group's ranks, :func:`moeshard.collectives.scope`); returns
    this rank's.

    The groups are created once per default process group and topology and reused by later
    calls (``dist.new_subgroups`` makes communicators that nothing frees; on NCCL each costs
    device memory and setup time). Every rank sees the same sequence of calls with the same
    arguments, so every rank hits or misses the cache alike and the collective creation stays
    matched. A destroyed and re-initialized default group is a new object: it gets new node
    groups. For the whole default group with torchrun's contiguous nodes they are
    ``dist.new_subgroups``; otherwise (a subgroup, uneven nodes) each rank creates its own
    node's group with its node's ranks only (``use_local_synchronization``).

    Raises:
        ValueError: no initialized process group, or ``topology`` does not fit the group.
    """
    if not collectives.is_dist():
        raise ValueError("node_groups needs an initialized default process group")
    rank, world = collectives.rank_and_world()
    if topology.world_size != world:
        raise ValueError(f"topology has world_size {topology.world_size}, the process group has {world}")
    members = collectives.group_ranks()
    default = dist.distributed_c10d._get_default_group()
    cache = _NODE_GROUP_CACHE
    if cache["default"] is not default or cache["world"] != dist.get_world_size():
        cache.update(default=default, world=dist.get_world_size(), groups={})
    plain = members is None and topology.nodes is None
    # A node's group is defined by its global ranks: groups of different callers with the same
    # ranks are one (and torch names a locally synchronized group by its ranks).
    mine = (
        None
        if plain
        else tuple(members[r] if members is not None else r for r in topology.node_ranks(topology.node_of(rank)))
    )
    key = topology.local_world_size if plain else mine
    group = cache["groups"].get(key)
    if group is None or not _is_live(group):
        with collectives.collective("moeshard: creating the node process groups"):
            if plain:
                group, _ = dist.new_subgroups(group_size=topology.local_world_size)
            else:
                group = dist.new_group(ranks=list(mine), use_local_synchronization=True)
        cache["groups"][key] = group
    return group


def _is_live(group) -> bool:
    """Whether ``group`` is still registered (not destroyed by ``destroy_process_group``)."""
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return pg_map is None or group in pg_map


class Source:
    """Where one rank's pieces come from. Override what the schedules it runs use."""

    def read(self, pid: int) -> torch.Tensor:
        """Piece ``pid`` from storage (shape ``piece_len``, any device)."""
        raise NotImplementedError(f"this source cannot read piece {pid}")

    def read_into(self, pid: int, out: torch.Tensor) -> None:
        """Piece ``pid`` from storage straight into ``out`` (its shape, cast to its dtype)."""
        out.copy_(self.read(pid))

    def start_read_into(self, pid: int, out: torch.Tensor) -> bool:
        """Begin :meth:`read_into`; True when it is done on return (the default), False when
        it completes later: its bytes in :meth:`reads_done`, its error from :meth:`finish_reads`."""
        self.read_into(pid, out)
        return True

    def local_reads(self, items: list[tuple[int, torch.Tensor]], rank: int) -> list[Callable[[], int]]:
        """Units of work that read pieces straight into place, for ``rank`` (this process):
        ``items`` are ``(piece, out)`` (``out`` contiguous, the piece's shape). Each unit reads
        some of them (or starts to, on a pool) and returns the bytes that landed now (in the
        pieces' :meth:`dtype`); a unit that completes later counts in :meth:`reads_done`, its
        error in :meth:`finish_reads`; one that fails now raises.
        Default: a unit per piece (:meth:`start_read_into`)."""

        def unit(pid: int, out: torch.Tensor) -> Callable[[], int]:
            def run() -> int:
                return out.numel() * self.dtype(pid).itemsize if self.start_read_into(pid, out) else 0

            return run

        return [unit(pid, out) for pid, out in items]

    def read_ranges(self, pids: np.ndarray, views: list[memoryview], rank: int) -> list[Callable[[], int]] | None:
        """Units of work (as :meth:`local_reads`) that read pieces ``pids`` (``int[N]``), their
        bytes as stored, into ``views`` (writable byte buffers of each piece's
        ``piece_bytes``, e.g. slices of contiguous CPU tensors of the pieces' :meth:`dtype`);
        None where this source cannot (the default: the runner reads them by
        :meth:`local_reads`)."""
        return None

    def gap_bytes(self) -> int:
        """Bytes read from storage between pieces (coalesced reads), not counted as pieces'."""
        return 0

    def start_read(self, pid: int, device: torch.device) -> Callable[[], torch.Tensor] | None:
        """Begin :meth:`read` of piece ``pid`` into a new buffer on ``device`` ahead of its
        round (in the background, or now): a function that waits for it and returns the
        buffer (raising the read's error), or None where this source reads only in the piece's
        round (the default)."""
        return None

    def reads_done(self) -> int:
        """Bytes of started reads that completed since the last call."""
        return 0

    def finish_reads(self) -> list[BaseException]:
        """Wait for every started read; the errors of those that failed."""
        return []

    def view(self, v: int, pid: int) -> torch.Tensor:
        """The local tensor view of view row ``v``, which holds piece ``pid`` (its shape)."""
        raise NotImplementedError(f"this source has no local view {v}")

    def dtype(self, pid: int) -> torch.dtype:
        """dtype of a buffer that receives piece ``pid``."""
        raise NotImplementedError

    def buffer_shape(self, pid: int) -> tuple[int, ...] | None:
        """The shape of a buffer of piece ``pid`` where it is not the piece's box: a packed
        weight's piece travels as its blob (``uint8[bytes]``: packed values and scales,
        :mod:`moeshard.io.packed`), decoded by the sink where it lands, never read straight
        into place. None (the default): the box's shape."""
        return None


class Sink:
    """Where one rank's pieces go."""

    def target(self, row: int) -> torch.Tensor | None:
        """The tensor delivery ``row`` writes into in place, if it is one (reads go straight
        into it); None for a sink that is not memory (a file)."""
        return None

    def put(self, items: list[tuple[int, torch.Tensor]]) -> None:
        """Make deliveries: ``(delivery row, data of the piece's shape)`` each. One call per
        round (a file sink moves them to the host with one synchronization)."""
        raise NotImplementedError

    def flat_targets(self, rows: np.ndarray) -> FlatTargets | None:
        """Where deliveries ``rows`` land as byte ranges of contiguous CPU tensors, for reads
        straight into them without a tensor view per piece; None (the default): nowhere
        (the runner asks :meth:`target` row by row)."""
        return None

    def receive_target(self, row: int) -> torch.Tensor | None:
        """The tensor a piece received from a peer for delivery ``row`` may land in directly
        (no staging buffer, no copy), or None (the default: staged, then :meth:`put`). Only a
        sink whose targets no send of the same schedule reads from may give one: a receive
        lands when its batch completes, before the round's deliveries would have."""
        return None


@dataclass(frozen=True)
class FlatTargets:
    """Deliveries as byte ranges: row ``i`` lands at bytes ``start[i]`` on of
    ``buffers[buffer[i]]`` (a contiguous CPU tensor's bytes, of dtype ``dtypes[buffer[i]]``),
    or not as a byte range where ``buffer[i]`` is -1 (another device, not contiguous, a
    delivery that transforms the data)."""

    buffers: list
    dtypes: list
    buffer: np.ndarray
    start: np.ndarray


class PieceLists:
    """A schedule's per-piece columns as Python lists (``bytes``, ``key``, ``ndim``, ``shape``:
    the box's lengths), and the index tuples of its view and delivery rows as they are first
    used: what a runner looks up per piece, without a numpy scalar access each time. One per
    schedule (:func:`piece_lists`), kept while the schedule lives: a schedule run again (a
    cached plan) reuses them."""

    def __init__(self, s: Schedule):
        self.bytes: list[int] = s.pieces.bytes.tolist()
        self.key: list[int] = s.pieces.key.tolist()
        key_ndim = s.key_ndim.tolist()
        self.ndim: list[int] = [key_ndim[k] for k in self.key]
        self._s = weakref.ref(s)
        self._shape: dict[int, tuple[int, ...]] = {}
        self._at: dict[tuple[str, int, int], tuple[int, int, tuple[slice, ...]]] = {}

    def shape(self, pid: int) -> tuple[int, ...]:
        """The box lengths of piece ``pid`` (its shape)."""
        out = self._shape.get(pid)
        if out is None:
            s = self._s()
            out = self._shape[pid] = tuple(s.pieces.len[pid, : self.ndim[pid]].tolist())
        return out

    def index(self, table: str, row: int, pid: int) -> tuple[int, int, tuple[slice, ...]]:
        """``(param, slot, slices)`` of row ``row`` of ``table`` ("views" or "deliveries")
        holding piece ``pid``."""
        k = (table, row, pid)
        out = self._at.get(k)
        if out is None:
            t = getattr(self._s(), table)
            off = t.off[row, : self.ndim[pid]].tolist()
            idx = tuple(slice(o, o + n) for o, n in zip(off, self.shape(pid)))
            out = self._at[k] = (int(t.param[row]), int(t.slot[row]), idx)
        return out


_PIECE_LISTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def piece_lists(schedule: Schedule) -> PieceLists:
    """The :class:`PieceLists` of ``schedule`` (made on first use)."""
    out = _PIECE_LISTS.get(schedule)
    if out is None:
        out = _PIECE_LISTS[schedule] = PieceLists(schedule)
    return out


class LocalTensors:
    """Views ``tensors[param][slot][box]`` of one rank's local tensors, addressed by a
    schedule's ``(param, slot, off)`` rows and the piece's lengths (slot -1: no slot)."""

    def __init__(self, schedule: Schedule, tensors: Sequence[torch.Tensor | None], rank: int):
        self.s, self.tensors, self.rank = schedule, tensors, rank
        self.lists = piece_lists(schedule)

    def at(self, param: int, slot: int, off: np.ndarray, pid: int) -> torch.Tensor:
        nd = self.lists.ndim[pid]
        ln = self.lists.shape(pid)
        return self.index(param, slot, tuple(slice(o, o + n) for o, n in zip(off[:nd].tolist(), ln)))

    def index(self, param: int, slot: int, idx: tuple[slice, ...]) -> torch.Tensor:
        t = self.tensors[param]
        assert t is not None, f"rank {self.rank} has no tensor for parameter {param}"
        if slot >= 0:
            t = t[slot]
        return t[idx]

    def row(self, table: str, row: int, pid: int) -> torch.Tensor:
        """Row ``row`` of the schedule's ``table`` ("views" or "deliveries"), holding piece ``pid``."""
        return self.index(*self.lists.index(table, row, pid))

    def view(self, v: int, pid: int) -> torch.Tensor:
        """View row ``v`` of the schedule, holding piece ``pid``."""
        s = self.s
        assert s.views.rank[v] == self.rank, f"view {v} is rank {s.views.rank[v]}'s, not rank {self.rank}'s"
        return self.row("views", v, pid)


class TensorSink(Sink):
    """Deliveries into local tensors (parameters, expert slots), cast to their dtype.

    ``receive_in_place``: received pieces land straight in their target (:meth:`receive_target`)
    where it is contiguous and of the piece's shape; only for tensors that none of the
    schedule's sends reads before its delivery (a load's or a reshard's new tensors, not a
    relocation's slots, which same-round sends read)."""

    def __init__(
        self,
        schedule: Schedule,
        tensors: Sequence[torch.Tensor | None],
        rank: int,
        receive_in_place: bool = False,
        index: CheckpointIndex | None = None,
    ):
        self.s, self.local = schedule, LocalTensors(schedule, tensors, rank)
        self.receive_in_place = receive_in_place
        # Packed weights' pieces arrive as blobs (ReaderSource.buffer_shape), decoded in put().
        self.packed = index.packed if index is not None else {}
        self.infos = index.tensors if index is not None else {}

    def receive_target(self, row: int) -> torch.Tensor | None:
        if not self.receive_in_place:
            return None
        out = self.target(row)
        return out if out.is_contiguous() else None

    def target(self, row: int) -> torch.Tensor:
        return self.local.row("deliveries", row, int(self.s.deliveries.piece[row]))

    def put(self, items: list[tuple[int, torch.Tensor]]) -> None:
        for row, data in items:
            out = self.target(row)
            if not self.put_packed(row, data, out):
                out.copy_(data.view(out.shape))

    def put_packed(self, row: int, data: torch.Tensor, out: torch.Tensor) -> bool:
        """Deliver ``data``, the blob of a packed weight's piece, decoded (float32, then cast
        once into ``out``); False, doing nothing, for a piece of another tensor."""
        if not self.packed:
            return False
        pid = int(self.s.deliveries.piece[row])
        pw = self.packed.get(self.s.piece_name(pid))
        if pw is None:
            return False
        box = self.s.piece_box(pid)
        # Decoded tile by tile straight into the destination (a gpt-oss weight through its
        # transposed view), one rounding to its dtype, no full-size float32 temporary.
        decode_blob_into(pw, box, data, self.infos, out.view(tuple(n for _, n in box)))
        return True

    def flat_targets(self, rows: np.ndarray) -> FlatTargets:
        s, tensors = self.s, self.local.tensors
        rows = np.asarray(rows, dtype=np.int64)
        params, slots, pids = s.deliveries.param[rows], s.deliveries.slot[rows], s.deliveries.piece[rows]
        d = s.deliveries.off.shape[1]
        nd = s.key_ndim[s.pieces.key[pids]].astype(np.int64)
        used, at = np.unique(params, return_inverse=True)
        buffers, dtypes = [], []
        ok_param = np.zeros(len(used), dtype=bool)
        shape = np.ones((len(used), d + 1), dtype=np.int64)  # the local tensor's, slot dim first
        tdim = np.zeros(len(used), dtype=np.int64)
        item = np.ones(len(used), dtype=np.int64)
        for j, p in enumerate(used.tolist()):
            t = tensors[p]
            buffers.append(None)
            dtypes.append(None)
            if t is None or t.device.type != "cpu" or not t.is_contiguous() or not t.numel() or t.dim() > d + 1:
                continue
            ok_param[j] = True
            buffers[j] = memoryview(t.detach().view(-1).view(torch.uint8).numpy()).cast("B")
            dtypes[j] = t.dtype
            shape[j, : t.dim()] = t.shape
            tdim[j] = t.dim()
            item[j] = t.element_size()
        has_slot = slots >= 0
        # A row addresses the local tensor (no slot) or its slot (the first dim); its box has
        # the piece's rank, which must be the addressed tensor's (else the runner's views).
        full = shape[at]
        sub = np.where(has_slot[:, None], full[:, 1:], full[:, :-1])
        fits = ok_param[at] & (tdim[at] - has_slot == nd)
        pad = np.arange(d)[None, :] >= nd[:, None]
        sub = np.where(pad, 1, sub)
        off = np.where(pad, 0, s.deliveries.off[rows])
        length = np.where(pad, 1, s.pieces.len[pids])
        ok, start = contiguous_boxes(sub, off, length)
        per_slot = np.prod(full[:, 1:], axis=1)
        start = (start + np.where(has_slot, slots * per_slot, 0)) * item[at]
        return FlatTargets(buffers, dtypes, np.where(ok & fits, at, -1), start)


class Backup:
    """What one rank's deliveries of a schedule will overwrite in local tensors, copied before
    the schedule runs, to put back if the operation fails (relocate: every rank ends with all
    of its slots either old or new, never a mix).

    Host memory holds the copies of accelerator tensors (the device keeps its staging budget):
    one buffer per dtype, pinned where CUDA is present, filled and restored with copies on the
    tensors' stream, so neither needs a synchronize. Costs the bytes this rank's deliveries
    write (``nbytes``)."""

    def __init__(self, schedule: Schedule, sink: TensorSink, rank: int):
        views: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for row in schedule.for_rank(rank).deliveries.tolist():
            v = sink.target(row)
            views.setdefault((v.dtype, v.device), []).append(v)
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (dtype, device), vs in views.items():
            on_host = device.type != "cpu"
            buf = torch.empty(
                sum(v.numel() for v in vs),
                dtype=dtype,
                device="cpu" if on_host else device,
                pin_memory=on_host and device.type == "cuda",
            )
            for v, flat in zip(vs, buf.split([v.numel() for v in vs])):
                copy = flat.view(v.shape)
                copy.copy_(v, non_blocking=True)
                self.saved.append((v, copy))
        self.nbytes = sum(v.numel() * v.element_size() for v, _ in self.saved)

    def restore(self) -> None:
        """Put every saved place back as it was (local; no communication)."""
        for view, copy in self.saved:
            view.copy_(copy, non_blocking=True)


class DequantSink(TensorSink):
    """:class:`TensorSink` that dequantizes the pieces of block-quantized FP8 weights on delivery
    (:func:`moeshard.io.fp8.dequantize`, in float32, then cast to the destination's dtype).

    ``scales``: ``{weight key: (its whole scale tensor on this rank, block shape)}`` for every
    FP8 key this rank receives pieces of (loaded beforehand: they are small, 1/16,384 of the
    weights' elements with DeepSeek's 128 x 128 blocks)."""

    def __init__(
        self,
        schedule: Schedule,
        tensors: Sequence[torch.Tensor | None],
        rank: int,
        scales: dict[str, tuple[torch.Tensor, tuple[int, ...]]],
        index: CheckpointIndex | None = None,
    ):
        super().__init__(schedule, tensors, rank, index=index)
        self.scales = scales

    def _scale(self, row: int, out: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        # An FP8 destination (a model keeping FP8 parameters) takes the FP8 bytes as they are.
        entry = self.scales.get(self.s.piece_name(int(self.s.deliveries.piece[row])))
        return entry if entry is not None and out.element_size() > 1 else None

    def target(self, row: int) -> torch.Tensor | None:
        # FP8 pieces are staged and go through put(): a read straight into place would cast unscaled.
        out = super().target(row)
        return None if self._scale(row, out) is not None else out

    def flat_targets(self, rows: np.ndarray) -> FlatTargets:
        # FP8 pieces are staged and go through put(), as in target().
        flat = super().flat_targets(rows)
        if not self.scales:
            return flat
        buffer = flat.buffer.copy()
        for i, row in enumerate(np.asarray(rows).tolist()):
            if (
                buffer[i] >= 0
                and self.s.piece_name(int(self.s.deliveries.piece[row])) in self.scales
                and flat.dtypes[buffer[i]].itemsize > 1
            ):
                buffer[i] = -1
        return FlatTargets(flat.buffers, flat.dtypes, buffer, flat.start)

    def put(self, items: list[tuple[int, torch.Tensor]]) -> None:
        for row, data in items:
            pid = int(self.s.deliveries.piece[row])
            out = super().target(row)
            if self.put_packed(row, data, out):
                continue
            entry = self._scale(row, out)
            if entry is None:
                out.copy_(data.view(out.shape))
                continue
            scale, block = entry
            box = self.s.piece_box(pid)
            sub = scale[box_slices(scale_box(box, block))]
            out.copy_(dequantize(data.view(box_shape(box)), box, sub, block).view(out.shape))


class ReaderSource(Source):
    """Pieces of checkpoint tensors (a schedule's keys are checkpoint keys), and views of
    this rank's local tensors (for schedules that send from them).

    A rank's reads straight into place (a schedule's local reads) into contiguous CPU tensors
    of the checkpoint's dtype go by extents (:mod:`moeshard.io.extents`: coalesced ``preadv``
    calls, files in a per-rank staggered order, read-ahead hints); other destinations piece by
    piece. ``read_threads`` > 1: those reads and the read-ahead of pieces to send run on a
    :class:`~moeshard.io.readpool.ReadPool` of that many threads, overlapped with each other
    and with the rounds (pinned buffers and side-stream copies for CUDA destinations); 1: on
    the calling thread, the pieces to send of a round read while the previous round's batch
    is in flight. Close the source (or use it as a context manager) to stop the threads."""

    def __init__(
        self,
        schedule: Schedule,
        reader: CheckpointReader | None,
        index: CheckpointIndex,
        tensors: Sequence[torch.Tensor | None] = (),
        rank: int = 0,
        read_threads: int = 1,
    ):
        self.s, self.reader, self.index = schedule, reader, index
        self.local = LocalTensors(schedule, tensors, rank)
        self.pool = ReadPool(reader, read_threads) if reader is not None and read_threads > 1 else None
        self._counted = 0
        self._gap0 = 0 if reader is None else reader.gap_bytes_read

    def read(self, pid: int) -> torch.Tensor:
        assert self.reader is not None
        pw = self.index.packed.get(self.s.piece_name(pid)) if self.index.packed else None
        if pw is not None:
            return read_blob(self.reader, pw, self.s.piece_box(pid))
        return self.reader.read(self.s.piece_name(pid), self.s.piece_box(pid))

    def buffer_shape(self, pid: int) -> tuple[int, ...] | None:
        if self.index.packed and self.s.piece_name(pid) in self.index.packed:
            return (int(self.s.pieces.bytes[pid]),)
        return None

    def read_into(self, pid: int, out: torch.Tensor) -> None:
        assert self.reader is not None
        self.reader.read(self.s.piece_name(pid), self.s.piece_box(pid), out=out)

    def start_read_into(self, pid: int, out: torch.Tensor) -> bool:
        if self.pool is None:
            return super().start_read_into(pid, out)
        self.pool.submit(self.s.piece_name(pid), self.s.piece_box(pid), out)
        return False

    def local_reads(self, items: list[tuple[int, torch.Tensor]], rank: int) -> list[Callable[[], int]]:
        """Destinations a read lands in as they are (contiguous CPU tensors of the checkpoint's
        dtype) are read by extents (:meth:`read_ranges`); the others a unit per piece (through
        the pool for CUDA destinations)."""
        if self.reader is None or not items:
            return super().local_reads(items, rank)
        s, reader = self.s, self.reader
        straight, others, views = [], [], []
        for pid, out in items:
            if reader.reads_straight_into(s.piece_name(pid), out) and out.numel():
                straight.append(pid)
                views.append(memoryview(out.detach().view(-1).view(torch.uint8).numpy()).cast("B"))
            else:
                others.append((pid, out))
        units = self.read_ranges(np.asarray(straight, dtype=np.int64), views, rank) if straight else []
        return (units or []) + super().local_reads(others, rank)

    def read_ranges(self, pids: np.ndarray, views: list[memoryview], rank: int) -> list[Callable[[], int]] | None:
        """By extents (:class:`~moeshard.io.extents.ExtentReads`): coalesced ``preadv`` calls,
        files in ``rank``'s staggered order, read-ahead hints for the first extents issued now;
        a unit per extent, on the pool when there is one."""
        if self.reader is None:
            return None
        s = self.s
        extents = ExtentReads.of_pieces(
            self.reader, s.keys, s.pieces.key[pids], s.pieces.off[pids], s.pieces.len[pids], views, rank=rank
        )
        extents.advise(-1)

        def unit(i: int) -> Callable[[], int]:
            def run() -> int:
                extents.advise(i)
                return extents.read(i)

            def submit() -> int:  # lands later: its bytes by reads_done, its error by finish_reads
                assert self.pool is not None
                self.pool.run(run)
                return 0

            return run if self.pool is None else submit

        return [unit(i) for i in range(len(extents))]

    def gap_bytes(self) -> int:
        return 0 if self.reader is None else self.reader.gap_bytes_read - self._gap0

    def start_read(self, pid: int, device: torch.device) -> Callable[[], torch.Tensor] | None:
        if self.pool is None or self.buffer_shape(pid) is not None:
            # No threads: read now, on the caller's thread, which the runner calls while the
            # round's batch is in flight (the piece is ready to send when its round begins).
            try:
                buf, error = self.read(pid).to(device, non_blocking=True), None
            except Exception as e:  # noqa: BLE001 - raised by done(), in the piece's round
                buf, error = None, e

            def ready() -> torch.Tensor:
                if error is not None:
                    raise error
                return buf

            return ready
        buf = torch.empty(box_shape(self.s.piece_box(pid)), dtype=self.dtype(pid), device=device)
        wait = self.pool.read_ahead(self.s.piece_name(pid), self.s.piece_box(pid), buf)

        def done() -> torch.Tensor:
            wait()
            return buf

        return done

    def reads_done(self) -> int:
        if self.pool is None:
            return 0
        done = self.pool.bytes_done
        new, self._counted = done - self._counted, done
        return new

    def finish_reads(self) -> list[BaseException]:
        return [] if self.pool is None else self.pool.drain()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> ReaderSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def view(self, v: int, pid: int) -> torch.Tensor:
        return self.local.view(v, pid)

    def dtype(self, pid: int) -> torch.dtype:
        if self.buffer_shape(pid) is not None:
            return torch.uint8
        return self.index.info(self.s.piece_name(pid)).torch_dtype


def execute_schedule(
    schedule: Schedule,
    rank: int,
    source: Source,
    sink: Sink,
    device: torch.device,
    node_group=None,
    progress: Callable[[int], None] | None = None,
    what: str = "moeshard: running the schedule",
) -> ExecStats:
    """Collective (every rank of the current group, :func:`moeshard.collectives.scope`): run
    ``schedule`` on this rank (a :class:`Runner`).

    Args:
        rank: this process's rank in the current group (the schedule's ranks are the group's).
        source: reads this rank's pieces (its reads) and gives its views (its copies and the
            sends from views).
        sink: takes this rank's deliveries.
        device: where staging buffers live (the device of the local tensors).
        node_group: this rank's node group, required if the schedule has broadcasts.
        progress: called with the bytes of each piece this rank delivers (once per piece,
            however many places it goes to).
        what: the operation, for error messages (e.g. "moeshard.load: executing the plan").

    Returns this rank's :class:`ExecStats`; failed reads and deliveries are in its
    ``failures`` (:meth:`ExecStats.check` raises the first).

    Raises:
        PeerLostError: on the ranks that saw a peer die (a P2P batch or node broadcast with
            it), naming the peers where known.
    """
    # The setup allocates a few small objects per piece and no reference cycles: the cyclic
    # collector's passes over them (and over the whole heap of a large model) cost more than
    # the setup itself. Reference counting still frees everything.
    with paused_gc():
        return Runner(schedule, rank, source, sink, device, node_group, progress, what).run()


class Runner:
    """One rank's run of a schedule (:func:`execute_schedule`; the module docstring says what
    a round does). Its methods are the steps: :meth:`stage` (copies and reads of the round's
    pieces), :meth:`post` (the round's P2P batch), :meth:`read_ahead` (the next round's reads
    while the batch flies), :meth:`local_work` (a share of the reads and copies of round -1),
    :meth:`join_broadcasts`, :meth:`deliver_round`, :meth:`free`. Failed reads and deliveries
    go to ``stats.failures``; the run goes on, so that no peer waits for this rank in vain.

    Collective (every rank of the current group) through :meth:`run`; one run per object.
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        source: Source,
        sink: Sink,
        device: torch.device,
        node_group=None,
        progress: Callable[[int], None] | None = None,
        what: str = "moeshard: running the schedule",
    ):
        s = self.s = schedule
        self.rank, self.source, self.sink, self.device = rank, source, sink, device
        self.node_group, self.progress, self.what = node_group, progress, what
        mine = self.mine = s.for_rank(rank)
        self.lists = piece_lists(s)
        self.stats = ExecStats()
        if len(mine.bcasts) and node_group is None:
            raise ValueError("the schedule has node broadcasts but no node group was given")
        self.members = collectives.group_ranks()  # the schedule's ranks are the current group's
        self.node_size = s.topology.node_sizes()
        # This rank's deliveries: {round: {piece: [rows]}} in schedule order.
        self.dlv_at: dict[int, dict[int, list[int]]] = {}
        for row, t in zip(mine.deliveries.tolist(), mine.delivery_rounds.tolist()):
            self.dlv_at.setdefault(t, {}).setdefault(int(s.deliveries.piece[row]), []).append(row)
        self.local_rows = self.dlv_at.pop(-1, {})
        # Per round: pieces to read, views to copy, P2P rows, broadcast rows (by node, piece).
        self.reads_at = _by_round(s.reads.round[mine.reads], s.reads.piece[mine.reads])
        self.copies_at = _by_round(s.copies.round[mine.copies], mine.copies)
        self.sends_at = _by_round(s.sends.round[mine.sends], mine.sends)
        # {send row: (piece, src, dst, view)} of this rank's sends and receives.
        self.send_rows = {
            row: (pid, src, dst, v)
            for row, pid, src, dst, v in zip(
                mine.sends.tolist(),
                s.sends.piece[mine.sends].tolist(),
                s.sends.src[mine.sends].tolist(),
                s.sends.dst[mine.sends].tolist(),
                s.sends.view[mine.sends].tolist(),
            )
        }
        order = np.lexsort((s.bcasts.piece[mine.bcasts], s.bcasts.round[mine.bcasts]))
        self.bcasts_at = _by_round(s.bcasts.round[mine.bcasts][order], mine.bcasts[order])
        # The last round each buffer of this rank is used in (it is freed after it).
        self.last_use: dict[int, int] = {}
        out_rows = mine.sends[(s.sends.src[mine.sends] == rank) & (s.sends.view[mine.sends] < 0)]
        out_b = mine.bcasts[s.bcasts.root[mine.bcasts] == rank]
        for pid, t in zip(
            np.concatenate(
                [s.sends.piece[out_rows], s.bcasts.piece[out_b], s.deliveries.piece[mine.deliveries]]
            ).tolist(),
            np.concatenate([s.sends.round[out_rows], s.bcasts.round[out_b], mine.delivery_rounds]).tolist(),
        ):
            self.last_use[pid] = max(self.last_use.get(pid, -1), t)
        self.rounds = mine.rounds.tolist()
        self.bufs: dict[int, torch.Tensor] = {}
        self.staged = 0  # bytes of self.bufs
        self.received_in_place = 0  # bytes of this round that landed in place (for progress)
        # Reads of the next round's pieces started while this round's transfers fly, as far as
        # the staging budget allows with what is staged now.
        self.ahead: dict[int, Callable[[], torch.Tensor]] = {}
        self.ahead_bytes = 0
        self.work = self._local_work_list()

    # -- helpers ---------------------------------------------------------------------------

    def shape(self, pid: int) -> tuple[int, ...]:
        blob = self.source.buffer_shape(pid)
        if blob is not None:
            return blob
        return self.lists.shape(pid)

    def nbytes(self, pid: int) -> int:
        return self.lists.bytes[pid]

    def empty(self, pid: int) -> torch.Tensor:
        return torch.empty(self.shape(pid), dtype=self.source.dtype(pid), device=self.device)

    def landed(self, nbytes: int) -> None:
        """Bytes read straight into place (delivered without staging)."""
        self.stats.bytes_read += nbytes
        if self.progress and nbytes:
            self.progress(nbytes)

    def read(self, pid: int) -> torch.Tensor:
        """Piece ``pid`` from storage into a new buffer on the device (zeros if the read
        failed: peers still expect the piece)."""
        try:
            buf = self.source.read(pid)
        except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
            self.stats.failures.append(e)
            buf = torch.zeros(self.shape(pid), dtype=self.source.dtype(pid), device=self.device)
        self.stats.bytes_read += self.nbytes(pid)
        return buf.to(self.device, non_blocking=True) if buf.device != self.device else buf

    def view(self, v: int, pid: int) -> torch.Tensor:
        """The source's view row ``v`` holding piece ``pid`` (zeros of the piece's shape if it
        failed or has another shape: peers still expect the piece)."""
        try:
            data = self.source.view(v, pid)
            if tuple(data.shape) != self.shape(pid):
                raise ValueError(f"rank {self.rank}: view {v} of piece {pid} is {list(data.shape)}, not the piece's")
            return data
        except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
            self.stats.failures.append(e)
            return torch.zeros(self.shape(pid), dtype=self.source.dtype(pid), device=self.device)

    # -- the steps -------------------------------------------------------------------------

    def deliver(self, items: list[tuple[int, torch.Tensor]], nbytes: int) -> None:
        """Hand ``(delivery row, data)`` items to the sink (one call), then report progress."""
        try:
            self.sink.put(items)
        except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
            self.stats.failures.append(e)
        if self.progress and nbytes:
            self.progress(nbytes)

    def _local_work_list(self) -> list:
        """This rank's work of round -1, in the order it is done (popped from the end): reads
        straight into place (the source's units: coalesced extents for a checkpoint reader),
        staged reads (a piece with several destinations, or one a read cannot land in), and
        copies from views."""
        s, mine, source = self.s, self.mine, self.source
        pids = mine.local_reads().tolist()
        rows = [self.local_rows.get(pid, ()) for pid in pids]
        single = [pid for pid, r in zip(pids, rows) if len(r) == 1]
        staged = [("staged", pid) for pid, r in zip(pids, rows) if len(r) != 1]
        one = np.array([self.local_rows[pid][0] for pid in single], dtype=np.int64)
        units: list = []
        # Destinations that are byte ranges of contiguous CPU tensors of the piece's dtype: read
        # by ranges, without a tensor view per piece.
        try:
            flat = self.sink.flat_targets(one) if len(one) else None
        except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule; the
            self.stats.failures.append(e)  # pieces still go by target() below
            flat = None
        ranged, views, rest = [], [], []
        dtypes: dict[int, torch.dtype] = {}
        for i, pid in enumerate(single):
            b = -1 if flat is None else int(flat.buffer[i])
            key = int(s.pieces.key[pid])
            if b >= 0 and key not in dtypes:
                try:
                    dtypes[key] = source.dtype(pid)
                except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
                    self.stats.failures.append(e)
                    dtypes[key] = None
            if b >= 0 and flat.dtypes[b] == dtypes[key]:
                start = int(flat.start[i])
                ranged.append(pid)
                views.append(flat.buffers[b][start : start + self.nbytes(pid)])
            else:
                rest.append((pid, int(one[i])))
        try:
            got = source.read_ranges(np.asarray(ranged, dtype=np.int64), views, self.rank) if ranged else []
        except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
            self.stats.failures.append(e)
            got = []
        if got is None:  # the source reads by tensors only
            row_of = dict(zip(single, one.tolist()))
            rest = [(pid, row_of[pid]) for pid in ranged] + rest
            got = []
        units.extend(("unit", u) for u in got)
        direct: list[tuple[int, torch.Tensor]] = []
        for pid, row in rest:
            if self.source.buffer_shape(pid) is not None:  # a blob: decoded by the sink's put
                staged.append(("staged", pid))
                continue
            try:
                out = self.sink.target(row)
            except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
                self.stats.failures.append(e)
                continue
            if out is not None and out.is_contiguous():
                direct.append((pid, out.view(self.shape(pid))))
            else:
                staged.append(("staged", pid))
        try:
            if direct:
                units.extend(("unit", u) for u in source.local_reads(direct, self.rank))
        except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
            self.stats.failures.append(e)
        work = units + staged + [("copy", c) for c in mine.local_copies().tolist()]
        work.reverse()
        return work

    def local_work(self, n: int) -> None:
        """Do ``n`` items of this rank's round -1 work (the copies among them as one group)."""
        copies = []
        for _ in range(min(n, len(self.work))):
            kind, x = self.work.pop()
            if kind == "unit":
                try:
                    self.landed(x())
                except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
                    self.stats.failures.append(e)
            elif kind == "staged":
                buf = self.read(x)
                self.deliver([(r, buf) for r in self.local_rows.get(x, [])], self.nbytes(x))
            else:
                copies.append(x)
        self.local_copies(copies)

    def local_copies(self, copies: list[int]) -> None:
        # Grouped up to half the staging budget: a file sink moves a group to the host with
        # one synchronization.
        s = self.s
        items: list[tuple[int, torch.Tensor]] = []
        nbytes = 0
        for c in copies:
            pid = int(s.copies.piece[c])
            if items and nbytes + self.nbytes(pid) > s.staging_bytes // 2:
                self.deliver(items, nbytes)
                items, nbytes = [], 0
            data = self.view(int(s.copies.view[c]), pid)
            items.extend((r, data) for r in self.local_rows.get(pid, []))
            nbytes += self.nbytes(pid)
        if items:
            self.deliver(items, nbytes)

    def read_ahead(self, t: int) -> None:
        """Start reading round ``t``'s pieces ahead (:meth:`Source.start_read`: on a pool's
        threads, or now on this thread), within the staging budget."""
        for pid in self.reads_at.get(t, ()):
            nbytes = self.nbytes(pid)
            if self.staged + self.ahead_bytes + nbytes > self.s.staging_bytes:
                return
            try:
                done = self.source.start_read(pid, self.device)
            except Exception:  # noqa: BLE001 - read in its round instead, where its error is kept
                return
            if done is None:
                return
            self.ahead[pid] = done
            self.ahead_bytes += nbytes

    def stage(self, t: int) -> None:
        """Round ``t``'s buffers before its transfers: copies of views (stashes), and reads."""
        s = self.s
        for c in self.copies_at.get(t, ()):
            pid = int(s.copies.piece[c])
            if pid not in self.bufs:  # a second copy of the same piece (another slot) is the same data
                self.bufs[pid] = self.view(int(s.copies.view[c]), pid).clone()
                self.staged += self.nbytes(pid)
        for pid in self.reads_at.get(t, ()):
            done = self.ahead.pop(pid, None)
            if done is None:
                self.bufs[pid] = self.read(pid)
            else:
                self.ahead_bytes -= self.nbytes(pid)
                try:
                    self.bufs[pid] = done()
                except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
                    self.stats.failures.append(e)
                    self.bufs[pid] = torch.zeros(self.shape(pid), dtype=self.source.dtype(pid), device=self.device)
                self.stats.bytes_read += self.nbytes(pid)
            self.staged += self.nbytes(pid)

    def post(self, t: int) -> Callable[[], None]:
        """Post round ``t``'s P2P ops as one batch; returns the wait."""
        stats = self.stats
        ops = []
        for row in self.sends_at.get(t, ()):
            pid, src, dst, v = self.send_rows[row]
            if src == self.rank:
                data = self.bufs[pid] if v < 0 else self.view(v, pid)
                ops.append(
                    collectives.p2p(dist.isend, data if data.is_contiguous() else data.contiguous(), dst, self.members)
                )
                stats.bytes_sent += self.nbytes(pid)
            else:
                into = self.receive_in_place(t, pid)
                if into is None:
                    into = self.bufs[pid] = self.empty(pid)
                    self.staged += self.nbytes(pid)
                ops.append(collectives.p2p(dist.irecv, into, src, self.members))
                stats.bytes_received += self.nbytes(pid)
        stats.peak_staging_bytes = max(stats.peak_staging_bytes, self.staged)
        return collectives.start_p2p(ops, self.what) if ops else (lambda: None)

    def receive_in_place(self, t: int, pid: int) -> torch.Tensor | None:
        """Where piece ``pid``, received in round ``t``, lands if it goes straight into its one
        delivery of the round (the sink's :meth:`Sink.receive_target`, of the piece's shape and
        dtype, and no later use of the buffer); that delivery is then done. None: staged."""
        rows = self.dlv_at.get(t, {}).get(pid)
        if (
            rows is None
            or len(rows) != 1
            or self.last_use.get(pid, t) != t
            or self.source.buffer_shape(pid) is not None
        ):
            return None
        try:
            out = self.sink.receive_target(rows[0])
            dtype = self.source.dtype(pid)
        except Exception:  # noqa: BLE001 - staged instead; the delivery reports any error
            return None
        if (
            out is None
            or out.dtype != dtype
            or out.device != self.device
            or out.numel() != self.nbytes(pid) // out.element_size()
        ):
            return None
        del self.dlv_at[t][pid]
        self.received_in_place += self.nbytes(pid)
        return out.view(self.shape(pid))

    def join_broadcasts(self, t: int) -> None:
        """Round ``t``'s node broadcasts, by node and piece (as every rank of the node)."""
        s, stats = self.s, self.stats
        for row in self.bcasts_at.get(t, ()):
            pid, root = int(s.bcasts.piece[row]), int(s.bcasts.root[row])
            if root != self.rank:
                self.bufs[pid] = self.empty(pid)
                stats.bytes_received += self.nbytes(pid)
                self.staged += self.nbytes(pid)
                stats.peak_staging_bytes = max(stats.peak_staging_bytes, self.staged)
            node = int(s.bcasts.node[row])
            if root == self.rank:
                stats.bytes_sent += self.nbytes(pid) * int(self.node_size[node] - 1)
            with collectives.collective(self.what, set(s.topology.node_ranks(node)) - {self.rank}):
                dist.broadcast(
                    self.bufs[pid], src=root if self.members is None else self.members[root], group=self.node_group
                )

    def deliver_round(self, t: int) -> None:
        """Round ``t``'s deliveries, after every op of the round (a delivery may overwrite a
        slot that a send of the same round reads)."""
        due = self.dlv_at.get(t, {})
        if due:
            self.deliver(
                [(r, self.bufs[pid]) for pid, rows in due.items() for r in rows], sum(self.nbytes(pid) for pid in due)
            )
        if self.received_in_place and self.progress:
            self.progress(self.received_in_place)
        self.received_in_place = 0

    def free(self, t: int) -> None:
        """Drop the buffers whose last use was round ``t`` or earlier."""
        for pid in [p for p in self.bufs if self.last_use.get(p, -1) <= t]:
            self.staged -= self.nbytes(pid)
            del self.bufs[pid]

    def run(self) -> ExecStats:
        """Every round of this rank, then the rest of its local work (Collective)."""
        rounds, stats = self.rounds, self.stats
        if rounds:  # the first round's reads in parallel, too
            self.read_ahead(rounds[0])
        for step, t in enumerate(rounds):
            self.stage(t)
            wait = self.post(t)
            if step + 1 < len(rounds):
                self.read_ahead(rounds[step + 1])
                stats.peak_staging_bytes = max(stats.peak_staging_bytes, self.staged + self.ahead_bytes)
            # Overlap: a share of this rank's own work while the batch is in flight.
            self.local_work(math.ceil(len(self.work) / max(len(rounds) - step, 1)))
            wait()
            self.landed(self.source.reads_done())
            self.join_broadcasts(t)
            self.deliver_round(t)
            self.free(t)
        self.local_work(len(self.work))
        stats.failures.extend(self.source.finish_reads())
        self.landed(self.source.reads_done())
        stats.gap_bytes_read = self.source.gap_bytes()
        return stats


class _Piece(NamedTuple):
    """A piece of a view exchange as one rank runs it: its key (the dtype it travels in), bytes,
    shape, contiguous strides and byte offset in its message, the ``(param, index)`` of the
    view it is sent or copied from (None: received), and of the places it is delivered to."""

    key: int
    nbytes: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    off: int
    src: _At | None
    dst: tuple[_At, ...]


class _At(NamedTuple):
    """Where a view or a delivery is in its local tensor: ``tensors[param][slot][box]`` (slot
    -1: none), the box at ``off`` (the piece's shape), ``index`` the same as one indexing."""

    param: int
    slot: int
    off: tuple[int, ...]
    index: tuple


class _Message(NamedTuple):
    """One P2P message of a view exchange, to or from ``peer``: ``pieces`` at their offsets in
    a buffer of ``size`` bytes; ``alone``: one piece larger than the packing limit, in a
    buffer of its own shape and dtype (sent from its view as it is where it can be)."""

    peer: int
    size: int
    alone: bool
    pieces: tuple[_Piece, ...]


class _ViewProgram:
    """What one rank does in a schedule of views (:class:`ViewExchange`), derived once per
    schedule, rank and packing limit, and kept with the schedule: per round its messages out
    and in (both ends of a pair derive the same messages, in the same order, from the pair's
    rows, which are ordered by unit and box on both), then its copies; each piece with the
    index of its view and of its deliveries in their local tensors."""

    def __init__(self, s: Schedule, rank: int, pack_bytes: int):
        mine = s.for_rank(rank)
        if len(mine.reads) or len(mine.bcasts) or (s.copies.round[mine.copies] >= 0).any():
            raise ValueError("a view exchange runs schedules of views only: no reads, broadcasts or stashed copies")
        lists = piece_lists(s)
        dlv: dict[int, list[int]] = {}
        for row, pid in zip(mine.deliveries.tolist(), s.deliveries.piece[mine.deliveries].tolist()):
            dlv.setdefault(pid, []).append(row)

        def piece(pid: int, off: int, view: int | None, deliver: bool) -> _Piece:
            shape = lists.shape(pid)
            return _Piece(
                lists.key[pid],
                lists.bytes[pid],
                shape,
                _contiguous_strides(shape),
                off,
                None if view is None else _row_index(lists, "views", view, pid),
                tuple(_row_index(lists, "deliveries", row, pid) for row in dlv.get(pid, ())) if deliver else (),
            )

        groups: dict[int, dict[tuple[int, bool], tuple[list, list]]] = {}
        rows = mine.sends
        for t, src, dst, pid, v in zip(
            s.sends.round[rows].tolist(),
            s.sends.src[rows].tolist(),
            s.sends.dst[rows].tolist(),
            s.sends.piece[rows].tolist(),
            s.sends.view[rows].tolist(),
        ):
            out = src == rank
            small, big = groups.setdefault(t, {}).setdefault((dst if out else src, out), ([], []))
            (small if lists.bytes[pid] <= pack_bytes else big).append((pid, v if out else None))
        self.rounds: list[tuple[list[_Message], list[_Message]]] = []
        for t in sorted(groups):
            outs: list[_Message] = []
            ins: list[_Message] = []
            for (peer, out), (small, big) in sorted(groups[t].items()):
                into = outs if out else ins
                if small:
                    at = _packed_offsets([lists.bytes[pid] for pid, _ in small])
                    pieces = tuple(piece(p, a, v, not out) for (p, v), a in zip(small, at))
                    into.append(_Message(peer, at[-1], False, pieces))
                for p, v in big:
                    into.append(_Message(peer, lists.bytes[p], True, (piece(p, 0, v, not out),)))
            self.rounds.append((outs, ins))
        copies = zip(s.copies.view[mine.copies].tolist(), s.copies.piece[mine.copies].tolist())
        self.copies: tuple[_Piece, ...] = tuple(piece(pid, 0, v, True) for v, pid in copies)
        # Per local tensor, the extent its views (deliveries) reach: [slots, *box ends] or
        # [*box ends] (None where rows of one tensor differ in rank): a tensor that holds them
        # all is viewed by strides, without indexing.
        every = [x for outs, ins in self.rounds for m in outs + ins for x in m.pieces] + list(self.copies)
        self.src_reach = _reach(x.src for x in every if x.src is not None)
        self.dst_reach = _reach(a for x in every for a in x.dst)


def _row_index(lists: PieceLists, table: str, row: int, pid: int) -> _At:
    """Where row ``row`` of ``table`` ("views" or "deliveries"), holding piece ``pid``, is."""
    param, slot, idx = lists.index(table, row, pid)
    return _At(param, slot, tuple(x.start for x in idx), (slot, *idx) if slot >= 0 else idx)


def _reach(ats) -> dict[int, tuple[int, ...] | None]:
    """``{param: extent}`` of views ``ats`` (:class:`_At`; their boxes' lengths from their
    index): per dim the largest end, the slot dim first where they have one; None where the
    rows of a tensor differ in rank."""
    out: dict[int, tuple[int, ...] | None] = {}
    for a in ats:
        ends = ((a.slot + 1,) if a.slot >= 0 else ()) + tuple(x.stop for x in a.index[1 if a.slot >= 0 else 0 :])
        if a.param in out:
            have = out[a.param]
            if have is not None:
                out[a.param] = tuple(map(max, have, ends)) if len(have) == len(ends) else None
        else:
            out[a.param] = ends
    return out


def _geometry(tensors: Sequence[torch.Tensor | None], reach: dict) -> dict[int, tuple]:
    """``{param: (tensor, slot stride, box strides, storage offset)}`` of the tensors whose
    views are taken by strides: every dim as far as ``reach`` says (so every view of the
    schedule lies inside the tensor, as indexing would check)."""
    out = {}
    for param, ends in reach.items():
        t = tensors[param] if param < len(tensors) else None
        if ends is None or not isinstance(t, torch.Tensor) or t.dim() != len(ends):
            continue
        if all(n >= e for n, e in zip(t.shape, ends)):
            st = t.stride()
            out[param] = (t, st[0], st, st[1:], t.storage_offset())
    return out


def _view(geo: dict, tensors: Sequence[torch.Tensor | None], a: _At, p: _Piece) -> torch.Tensor:
    """The view ``a`` of piece ``p`` in ``tensors``: by strides where ``geo`` (:func:`_geometry`)
    has its tensor, else by indexing (ValueError unless of the piece's shape)."""
    g = geo.get(a.param)
    if g is None:
        x = tensors[a.param][a.index]
        if x.shape != p.shape:
            raise ValueError(f"a view of {list(x.shape)} where the piece is {list(p.shape)}")
        return x
    t, st0, st, sub, at = g
    if a.slot >= 0:
        at += a.slot * st0
        st = sub
    for o, k in zip(a.off, st):
        at += o * k
    return t.as_strided(p.shape, st, at)


_VIEW_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ViewExchange:
    """One rank's run of a schedule whose pieces all come from views of local tensors (sends
    from views, copies of round -1; no reads, broadcasts or stashes) and go into local
    tensors, the deliveries into *held* tensors made only by :meth:`install`: a refit writes
    the engine's tensors once every rank agreed that every piece arrived (each install batch
    all old or all new), without staging them.

    Per round, the pieces one rank sends another travel as one message where they are at most
    ``pack_bytes`` each (at 16-byte aligned offsets; one copy per piece from its view into the
    message, cast to the piece's dtype on the way), larger ones as a message each (sent from
    the view itself where it is contiguous and of the piece's dtype). A piece received stays
    in its message until it is delivered; a copy is delivered from its view. What the
    schedule alone determines (messages, offsets, the index of every view and delivery in
    its tensor) is kept with the schedule for the next run: a run costs two views and a copy
    per piece and place, in a loop over prepared tuples.

    A view or a place that fails (a missing tensor, a box of another shape) goes to the
    stats' ``failures`` (zeros travel in place of a piece that could not be read) and the run
    goes on, as :class:`Runner`'s. :meth:`run` is collective (every rank of the current
    group, each with the same ``pack_bytes``); one run and one install per object.

    Args:
        schedule, rank, device, what: as :func:`execute_schedule`'s.
        sources: this rank's local tensors that its views address (by the schedule's
            ``param``; None where it holds none).
        dtypes: per key of the schedule, the dtype its pieces travel in (a view of another
            dtype is cast on its copy).
        targets: the local tensors that its deliveries address (by ``param``).
        held: per target, whether its deliveries wait for :meth:`install` (missing: False,
            delivered during :meth:`run`).
        pack_bytes: the largest piece that travels packed.
    """

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        sources: Sequence[torch.Tensor | None],
        dtypes: Sequence[torch.dtype],
        targets: Sequence[torch.Tensor | None],
        device: torch.device,
        held: Sequence[bool] = (),
        what: str = "moeshard: running the schedule",
        pack_bytes: int = 2**20,
    ):
        progs = _VIEW_PROGRAMS.setdefault(schedule, {})
        prog = progs.get((rank, pack_bytes))
        if prog is None:
            prog = progs[(rank, pack_bytes)] = _ViewProgram(schedule, rank, pack_bytes)
        self.prog, self.rank, self.device, self.what = prog, rank, device, what
        self.sources, self.dtypes, self.targets = sources, dtypes, targets
        self.held = [bool(h) for h in held] + [False] * (len(targets) - len(held))
        self.members = collectives.group_ranks()
        self.stats = ExecStats()
        self.now: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # (places, data)
        self.later: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    def run(self) -> ExecStats:
        """Collective: every round's messages, the deliveries into tensors not held, and the
        places of the held ones; returns this rank's stats (``failures``: raise with
        :meth:`ExecStats.check`, agreed by the caller, before :meth:`install`)."""
        stats, p2p = self.stats, collectives.p2p
        self.src_geo = _geometry(self.sources, self.prog.src_reach)
        self.dst_geo = _geometry(self.targets, self.prog.dst_reach)
        kept = 0  # bytes of received messages held for their deliveries
        with paused_gc():
            local = True
            for outs, ins in self.prog.rounds:
                ops, got = [], []
                out_bytes = 0
                for m in outs:
                    ops.append(p2p(dist.isend, self.pack(m), m.peer, self.members))
                    out_bytes += m.size
                for m in ins:
                    buf = self.empty(m)
                    kept += m.size
                    got.append((m, buf))
                    ops.append(p2p(dist.irecv, buf, m.peer, self.members))
                stats.peak_staging_bytes = max(stats.peak_staging_bytes, kept + out_bytes)
                wait = collectives.start_p2p(ops, self.what)
                if local:  # this rank's own copies while the first batch is in flight
                    self.copies()
                    local = False
                wait()
                for m, buf in got:
                    self.arrived(m, buf)
            if local:
                self.copies()
            self.deliver(self.now)
        return stats

    def install(self) -> None:
        """Local: the deliveries into held tensors (after every rank agreed on :meth:`run`)."""
        with torch.no_grad():
            self.deliver(self.later)

    # -- the steps -------------------------------------------------------------------------

    def pack(self, m: _Message) -> torch.Tensor:
        """The buffer of message ``m`` out: its pieces' views copied (and cast) into it."""
        sources, dtypes, failures, geo = self.sources, self.dtypes, self.stats.failures, self.src_geo
        if m.alone:
            (p,) = m.pieces
            dtype = dtypes[p.key]
            self.stats.bytes_sent += p.nbytes
            try:
                data = _view(self.src_geo, sources, p.src, p)
            except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
                failures.append(self.failed(e))
                return torch.zeros(p.shape, dtype=dtype, device=self.device)
            if data.dtype == dtype and data.is_contiguous():
                return data
            out = torch.empty(p.shape, dtype=dtype, device=self.device)
            self.deliver(([out], [data]))
            return out
        buf = torch.empty(m.size, dtype=torch.uint8, device=self.device)
        typed: dict = {}
        places, data = [], []
        for p in m.pieces:
            place = _in_message(buf, typed, p, dtypes[p.key])
            self.stats.bytes_sent += p.nbytes
            try:
                x = _view(geo, sources, p.src, p)
            except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
                failures.append(self.failed(e))
                place.zero_()
                continue
            places.append(place)
            data.append(x)
        self.deliver((places, data))
        return buf

    def empty(self, m: _Message) -> torch.Tensor:
        if m.alone:
            return torch.empty(m.pieces[0].shape, dtype=self.dtypes[m.pieces[0].key], device=self.device)
        return torch.empty(m.size, dtype=torch.uint8, device=self.device)

    def arrived(self, m: _Message, buf: torch.Tensor) -> None:
        """Message ``m`` has landed in ``buf``: its pieces' deliveries."""
        if m.alone:
            self.stats.bytes_received += m.pieces[0].nbytes
            self.place(m.pieces[0], buf)
            return
        typed: dict = {}
        for p in m.pieces:
            self.stats.bytes_received += p.nbytes
            self.place(p, _in_message(buf, typed, p, self.dtypes[p.key]))

    def copies(self) -> None:
        """This rank's copies: deliveries straight from its views."""
        for p in self.prog.copies:
            try:
                data = _view(self.src_geo, self.sources, p.src, p)
            except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
                self.stats.failures.append(self.failed(e))
                continue
            self.place(p, data)

    def place(self, p: _Piece, data: torch.Tensor) -> None:
        """Queue the deliveries of piece ``p`` (``data``): now, or at :meth:`install`."""
        targets, held, geo = self.targets, self.held, self.dst_geo
        for a in p.dst:
            try:
                out = _view(geo, targets, a, p)
            except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
                self.stats.failures.append(self.failed(e))
                continue
            places, data_of = self.later if held[a.param] else self.now
            places.append(out)
            data_of.append(data)

    def failed(self, e: Exception) -> Exception:
        """``e``, a view's or a place's error, naming this rank where it is a shape's."""
        return ValueError(f"rank {self.rank}: {e}") if type(e) is ValueError else e

    def deliver(self, pairs: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
        """Copy ``pairs`` (places, data; cast to the places' dtypes) in one call where none
        fails, then forget them."""
        places, data = pairs
        if not places:
            return
        try:
            torch._foreach_copy_(places, data)
        except Exception:  # noqa: BLE001 - one by one, to record which failed
            for out, x in zip(places, data):
                try:
                    out.copy_(x)
                except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
                    self.stats.failures.append(e)
        places.clear()
        data.clear()


def exchange(outbox: dict[int, torch.Tensor], inbox: dict[int, torch.Tensor], what: str) -> Callable[[], None]:
    """Collective among the peers named: send ``outbox[r]`` to rank ``r`` and receive
    ``inbox[r]`` from rank ``r`` in one P2P batch (every peer posts the matching op, e.g.
    verify's digests, whose sizes both sides derive from the same schedule). Returns the
    wait; do local work before calling it."""
    members = collectives.group_ranks()
    ops = [collectives.p2p(dist.isend, outbox[r], r, members) for r in sorted(outbox)]
    ops += [collectives.p2p(dist.irecv, inbox[r], r, members) for r in sorted(inbox)]
    return collectives.start_p2p(ops, what) if ops else (lambda: None)


def _in_message(buf: torch.Tensor, typed: dict, p: _Piece, dtype: torch.dtype) -> torch.Tensor:
    """Piece ``p``'s place in packed message ``buf`` (bytes), as ``dtype``; ``typed`` keeps one
    view of ``buf`` per dtype for the message's pieces."""
    alias = typed.get(dtype)
    if alias is None:
        alias = typed[dtype] = buf.view(dtype)
    return alias.as_strided(p.shape, p.strides, p.off // dtype.itemsize)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _packed_offsets(sizes: Sequence[int]) -> list[int]:
    """Byte offsets of pieces of ``sizes`` bytes in one packed message, each aligned to 16
    (any dtype's view of it lands aligned), and the message's size last."""
    at = [0]
    for n in sizes:
        at.append(at[-1] + -(-n // 16) * 16)
    return at


def _by_round(rounds: np.ndarray, values: np.ndarray) -> dict[int, list[int]]:
    """``{round: [value, ...]}`` in the given order within each round."""
    out: dict[int, list[int]] = {}
    for t, v in zip(rounds.tolist(), values.tolist()):
        if t >= 0:
            out.setdefault(t, []).append(v)
    return out
