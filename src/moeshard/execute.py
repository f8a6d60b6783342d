"""The one runner: a :class:`~moeshard.plan.schedule.Schedule` with torch.distributed.

Load, LoRA load, relocation, save and LoRA save all run here; they differ only in their
*source* (where pieces come from: a checkpoint reader, or views of local tensors) and their
*sink* (where pieces go: views of local tensors, or a shard writer).

Every rank runs the rounds it takes part in, in the schedule's order, and posts only its own
rows, so P2P ops pair up without any loop over ranks and without deadlock (round t's
participants all finished their earlier rounds). Per round: copy the views the schedule
stashes or copies, read the pieces it sends first in this round, post the round's P2P ops as
one batch, start reading the next round's pieces (a source with a reader pool, within the
staging budget) and do a share of this rank's local work (reads and copies of round -1, which
go straight from storage or a view into place) while the batch is in flight, wait, join the
round's node broadcasts, make the round's deliveries (after every op of the round: a delivery
may overwrite a slot that a send of the same round reads), free the buffers it no longer
needs. Nothing calls a device synchronize: waits are on the ops' own work handles.

A read or a delivery that fails on one rank (an I/O error, a file changed under the job) does
not leave its peers blocked in a receive: the rank keeps running the schedule (sending zeros
in place of a piece it could not read) and records the error in :attr:`ExecStats.failures`;
:meth:`ExecStats.check` raises the first, and the callers agree on it so that every rank
raises one DistributedError naming the failing rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import collectives
from .box import box_shape, box_slices
from .io.checkpoint import CheckpointIndex, CheckpointReader
from .io.fp8 import dequantize, scale_box
from .io.readpool import ReadPool
from .plan.schedule import Schedule
from .topology import Topology

__all__ = ["ExecStats", "Source", "Sink", "LocalTensors", "ReaderSource", "TensorSink", "Backup", "DequantSink",
           "execute_schedule",
           "exchange", "node_groups"]


@dataclass
class ExecStats:
    """What one rank did: bytes read from storage, sent, received (staging buffers), the
    peak of staging bytes held at once, and the errors of its failed reads and deliveries."""

    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_staging_bytes: int = 0
    failures: list = field(default_factory=list)

    def check(self) -> "ExecStats":
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
    mine = None if plain else tuple(members[r] if members is not None else r
                                    for r in topology.node_ranks(topology.node_of(rank)))
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

    def start_read(self, pid: int, device: torch.device) -> Callable[[], torch.Tensor] | None:
        """Begin :meth:`read` of piece ``pid`` into a new buffer on ``device``, in the
        background: a function that waits for it and returns the buffer (raising the read's
        error), or None where this source reads only in the foreground (the default)."""
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


class LocalTensors:
    """Views ``tensors[param][slot][box]`` of one rank's local tensors, addressed by a
    schedule's ``(param, slot, off)`` rows and the piece's lengths (slot -1: no slot)."""

    def __init__(self, schedule: Schedule, tensors: Sequence[torch.Tensor | None], rank: int):
        self.s, self.tensors, self.rank = schedule, tensors, rank

    def at(self, param: int, slot: int, off: np.ndarray, pid: int) -> torch.Tensor:
        s = self.s
        nd = int(s.key_ndim[s.piece_key[pid]])
        t = self.tensors[param]
        assert t is not None, f"rank {self.rank} has no tensor for parameter {param}"
        if slot >= 0:
            t = t[slot]
        ln = s.piece_len[pid, :nd].tolist()
        return t[tuple(slice(o, o + n) for o, n in zip(off[:nd].tolist(), ln))]

    def view(self, v: int, pid: int) -> torch.Tensor:
        """View row ``v`` of the schedule, holding piece ``pid``."""
        s = self.s
        assert s.view_rank[v] == self.rank, f"view {v} is rank {s.view_rank[v]}'s, not rank {self.rank}'s"
        return self.at(int(s.view_param[v]), int(s.view_slot[v]), s.view_off[v], pid)


class TensorSink(Sink):
    """Deliveries into local tensors (parameters, expert slots), cast to their dtype."""

    def __init__(self, schedule: Schedule, tensors: Sequence[torch.Tensor | None], rank: int):
        self.s, self.local = schedule, LocalTensors(schedule, tensors, rank)

    def target(self, row: int) -> torch.Tensor:
        s = self.s
        return self.local.at(int(s.dlv_param[row]), int(s.dlv_slot[row]), s.dlv_off[row], int(s.dlv_piece[row]))

    def put(self, items: list[tuple[int, torch.Tensor]]) -> None:
        for row, data in items:
            out = self.target(row)
            out.copy_(data.view(out.shape))


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
            buf = torch.empty(sum(v.numel() for v in vs), dtype=dtype, device="cpu" if on_host else device,
                              pin_memory=on_host and device.type == "cuda")
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

    def __init__(self, schedule: Schedule, tensors: Sequence[torch.Tensor | None], rank: int,
                 scales: dict[str, tuple[torch.Tensor, tuple[int, ...]]]):
        super().__init__(schedule, tensors, rank)
        self.scales = scales

    def _scale(self, row: int, out: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]] | None:
        # An FP8 destination (a model keeping FP8 parameters) takes the FP8 bytes as they are.
        entry = self.scales.get(self.s.piece_name(int(self.s.dlv_piece[row])))
        return entry if entry is not None and out.element_size() > 1 else None

    def target(self, row: int) -> torch.Tensor | None:
        # FP8 pieces are staged and go through put(): a read straight into place would cast unscaled.
        out = super().target(row)
        return None if self._scale(row, out) is not None else out

    def put(self, items: list[tuple[int, torch.Tensor]]) -> None:
        for row, data in items:
            pid = int(self.s.dlv_piece[row])
            out = super().target(row)
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

    ``read_threads`` > 1: reads straight into place (a schedule's local reads) run on a
    :class:`~moeshard.io.readpool.ReadPool` of that many threads, overlapped with each other
    and with the rounds (pinned buffers and side-stream copies for CUDA destinations). Close
    the source (or use it as a context manager) to stop the threads."""

    def __init__(self, schedule: Schedule, reader: CheckpointReader | None, index: CheckpointIndex,
                 tensors: Sequence[torch.Tensor | None] = (), rank: int = 0, read_threads: int = 1):
        self.s, self.reader, self.index = schedule, reader, index
        self.local = LocalTensors(schedule, tensors, rank)
        self.pool = ReadPool(reader, read_threads) if reader is not None and read_threads > 1 else None
        self._counted = 0

    def read(self, pid: int) -> torch.Tensor:
        assert self.reader is not None
        return self.reader.read(self.s.piece_name(pid), self.s.piece_box(pid))

    def read_into(self, pid: int, out: torch.Tensor) -> None:
        assert self.reader is not None
        self.reader.read(self.s.piece_name(pid), self.s.piece_box(pid), out=out)

    def start_read_into(self, pid: int, out: torch.Tensor) -> bool:
        if self.pool is None:
            return super().start_read_into(pid, out)
        self.pool.submit(self.s.piece_name(pid), self.s.piece_box(pid), out)
        return False

    def start_read(self, pid: int, device: torch.device) -> Callable[[], torch.Tensor] | None:
        if self.pool is None:
            return None
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

    def __enter__(self) -> "ReaderSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def view(self, v: int, pid: int) -> torch.Tensor:
        return self.local.view(v, pid)

    def dtype(self, pid: int) -> torch.dtype:
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
    ``schedule`` on this rank.

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
    s = schedule
    mine = s.for_rank(rank)
    stats = ExecStats()
    failure = stats.failures
    if len(mine.bcasts) and node_group is None:
        raise ValueError("the schedule has node broadcasts but no node group was given")
    members = collectives.group_ranks()  # the schedule's ranks are the current group's
    node_size = s.topology.node_sizes()

    # This rank's deliveries: {round: {piece: [rows]}} in schedule order.
    dlv_at: dict[int, dict[int, list[int]]] = {}
    for row, t in zip(mine.deliveries.tolist(), mine.delivery_rounds.tolist()):
        dlv_at.setdefault(t, {}).setdefault(int(s.dlv_piece[row]), []).append(row)
    local_rows = dlv_at.pop(-1, {})

    def shape(pid: int) -> tuple[int, ...]:
        return tuple(s.piece_len[pid, : int(s.key_ndim[s.piece_key[pid]])].tolist())

    def deliver(items: list[tuple[int, torch.Tensor]], nbytes: int) -> None:
        try:
            sink.put(items)
        except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
            failure.append(e)
        if progress and nbytes:
            progress(nbytes)

    def read(pid: int) -> torch.Tensor:
        try:
            buf = source.read(pid)
        except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
            failure.append(e)
            # Peers still expect this piece: send zeros rather than leave them waiting.
            buf = torch.zeros(shape(pid), dtype=source.dtype(pid), device=device)
        stats.bytes_read += int(s.piece_bytes[pid])
        return buf.to(device, non_blocking=True) if buf.device != device else buf

    def landed(nbytes: int) -> None:  # bytes read straight into place
        stats.bytes_read += nbytes
        if progress and nbytes:
            progress(nbytes)

    def local_read(pid: int) -> None:
        rows = local_rows.get(pid, [])
        out = sink.target(rows[0]) if len(rows) == 1 else None
        try:
            if out is not None and out.is_contiguous():
                # Straight from storage into place (cast on the way): no staging. A source
                # with a reader pool finishes it later (bytes by reads_done, errors by
                # finish_reads).
                if source.start_read_into(pid, out.view(shape(pid))):
                    landed(int(s.piece_bytes[pid]))
                return
        except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
            failure.append(e)
            return
        buf = read(pid)
        deliver([(r, buf) for r in rows], int(s.piece_bytes[pid]))

    def local_copies(copies: list[int]) -> None:
        # Grouped up to half the staging budget: a file sink moves a group to the host with
        # one synchronization.
        items: list[tuple[int, torch.Tensor]] = []
        nbytes = 0
        for c in copies:
            pid = int(s.copy_piece[c])
            if items and nbytes + int(s.piece_bytes[pid]) > s.staging_bytes // 2:
                deliver(items, nbytes)
                items, nbytes = [], 0
            data = source.view(int(s.copy_view[c]), pid)
            items.extend((r, data) for r in local_rows.get(pid, []))
            nbytes += int(s.piece_bytes[pid])
        if items:
            deliver(items, nbytes)

    def empty(pid: int) -> torch.Tensor:
        return torch.empty(shape(pid), dtype=source.dtype(pid), device=device)

    # Per round: pieces to read, views to copy, P2P rows, broadcast rows; and the last round
    # each buffer of this rank is used in (it is freed after it).
    reads_at = _by_round(s.read_round[mine.reads], s.read_piece[mine.reads])
    copies_at = _by_round(s.copy_round[mine.copies], mine.copies)
    sends_at = _by_round(s.send_round[mine.sends], mine.sends)
    order = np.lexsort((s.bcast_piece[mine.bcasts], s.bcast_round[mine.bcasts]))
    bcasts_at = _by_round(s.bcast_round[mine.bcasts][order], mine.bcasts[order])
    last_use: dict[int, int] = {}
    out_rows = mine.sends[(s.send_src[mine.sends] == rank) & (s.send_view[mine.sends] < 0)]
    out_b = mine.bcasts[s.bcast_root[mine.bcasts] == rank]
    for pid, t in zip(np.concatenate([s.send_piece[out_rows], s.bcast_piece[out_b], s.dlv_piece[mine.deliveries]]).tolist(),
                      np.concatenate([s.send_round[out_rows], s.bcast_round[out_b], mine.delivery_rounds]).tolist()):
        last_use[pid] = max(last_use.get(pid, -1), t)
    my_local = [("read", p) for p in mine.local_reads().tolist()] + [("copy", c) for c in mine.local_copies().tolist()]
    my_local.reverse()

    def local_work(n: int) -> None:
        copies = []
        for _ in range(min(n, len(my_local))):
            kind, x = my_local.pop()
            if kind == "read":
                local_read(x)
            else:
                copies.append(x)
        local_copies(copies)

    rounds = mine.rounds.tolist()
    bufs: dict[int, torch.Tensor] = {}
    staged = 0
    # Reads of the next round's pieces started while this round's transfers fly (a source with
    # a reader pool), as far as the staging budget allows with what is staged now.
    ahead: dict[int, Callable[[], torch.Tensor]] = {}
    ahead_bytes = 0

    def read_ahead(t: int) -> None:
        nonlocal ahead_bytes
        for pid in reads_at.get(t, ()):
            nbytes = int(s.piece_bytes[pid])
            if staged + ahead_bytes + nbytes > s.staging_bytes:
                return
            try:
                done = source.start_read(pid, device)
            except Exception:  # noqa: BLE001 - read in its round instead, where its error is kept
                return
            if done is None:
                return
            ahead[pid] = done
            ahead_bytes += nbytes

    if rounds:  # the first round's reads in parallel, too
        read_ahead(rounds[0])
    for step, t in enumerate(rounds):
        for c in copies_at.get(t, ()):
            pid = int(s.copy_piece[c])
            if pid not in bufs:  # a second copy of the same piece (another slot) is the same data
                bufs[pid] = source.view(int(s.copy_view[c]), pid).clone()
                staged += int(s.piece_bytes[pid])
        for pid in reads_at.get(t, ()):
            done = ahead.pop(pid, None)
            if done is None:
                bufs[pid] = read(pid)
            else:
                ahead_bytes -= int(s.piece_bytes[pid])
                try:
                    bufs[pid] = done()
                except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
                    failure.append(e)
                    bufs[pid] = torch.zeros(shape(pid), dtype=source.dtype(pid), device=device)
                stats.bytes_read += int(s.piece_bytes[pid])
            staged += int(s.piece_bytes[pid])
        ops = []
        for row in sends_at.get(t, ()):
            pid = int(s.send_piece[row])
            if s.send_src[row] == rank:
                v = int(s.send_view[row])
                data = bufs[pid] if v < 0 else source.view(v, pid)
                ops.append(collectives.p2p(dist.isend, data if data.is_contiguous() else data.contiguous(),
                                     int(s.send_dst[row]), members))
                stats.bytes_sent += int(s.piece_bytes[pid])
            else:
                bufs[pid] = empty(pid)
                ops.append(collectives.p2p(dist.irecv, bufs[pid], int(s.send_src[row]), members))
                stats.bytes_received += int(s.piece_bytes[pid])
                staged += int(s.piece_bytes[pid])
        stats.peak_staging_bytes = max(stats.peak_staging_bytes, staged)
        wait = collectives.start_p2p(ops, what) if ops else (lambda: None)
        if step + 1 < len(rounds):
            read_ahead(rounds[step + 1])
            stats.peak_staging_bytes = max(stats.peak_staging_bytes, staged + ahead_bytes)
        # Overlap: a share of this rank's own work while the batch is in flight.
        local_work(math.ceil(len(my_local) / max(len(rounds) - step, 1)))
        wait()
        landed(source.reads_done())
        for row in bcasts_at.get(t, ()):
            pid, root = int(s.bcast_piece[row]), int(s.bcast_root[row])
            if root != rank:
                bufs[pid] = empty(pid)
                stats.bytes_received += int(s.piece_bytes[pid])
                staged += int(s.piece_bytes[pid])
                stats.peak_staging_bytes = max(stats.peak_staging_bytes, staged)
            node = int(s.bcast_node[row])
            if root == rank:
                stats.bytes_sent += int(s.piece_bytes[pid]) * int(node_size[node] - 1)
            with collectives.collective(what, set(s.topology.node_ranks(node)) - {rank}):
                dist.broadcast(bufs[pid], src=root if members is None else members[root], group=node_group)
        due = dlv_at.get(t, {})
        if due:
            deliver([(r, bufs[pid]) for pid, rows in due.items() for r in rows],
                    sum(int(s.piece_bytes[pid]) for pid in due))
        for pid in [p for p in bufs if last_use.get(p, -1) <= t]:
            staged -= int(s.piece_bytes[pid])
            del bufs[pid]
    local_work(len(my_local))
    failure.extend(source.finish_reads())
    landed(source.reads_done())
    return stats


def exchange(outbox: dict[int, torch.Tensor], inbox: dict[int, torch.Tensor], what: str) -> Callable[[], None]:
    """Collective among the peers named: send ``outbox[r]`` to rank ``r`` and receive
    ``inbox[r]`` from rank ``r`` in one P2P batch (every peer posts the matching op, e.g.
    verify's digests, whose sizes both sides derive from the same schedule). Returns the
    wait; do local work before calling it."""
    members = collectives.group_ranks()
    ops = [collectives.p2p(dist.isend, outbox[r], r, members) for r in sorted(outbox)]
    ops += [collectives.p2p(dist.irecv, inbox[r], r, members) for r in sorted(inbox)]
    return collectives.start_p2p(ops, what) if ops else (lambda: None)


def _by_round(rounds: np.ndarray, values: np.ndarray) -> dict[int, list[int]]:
    """``{round: [value, ...]}`` in the given order within each round."""
    out: dict[int, list[int]] = {}
    for t, v in zip(rounds.tolist(), values.tolist()):
        if t >= 0:
            out.setdefault(t, []).append(v)
    return out
