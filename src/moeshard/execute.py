"""The one runner: a :class:`~moeshard.plan.schedule.Schedule` with torch.distributed.

Every rank runs the rounds it takes part in, in the schedule's order, and posts only its own
rows, so P2P ops pair up without any loop over ranks and without deadlock (round t's
participants all finished their earlier rounds). Per round: read the pieces it sends first in
this round into staging buffers, post the round's P2P ops as one batch, do a share of this
rank's local reads while the batch is in flight, wait, join the round's node broadcasts,
deliver what arrived, free the buffers it no longer sends. Nothing calls a device synchronize:
waits are on the ops' own work handles.

A read that fails on one rank (an I/O error, a file changed under the job) does not leave its
peers blocked in a receive: the rank keeps running the schedule with zeros in place of the
piece, and after the last round every rank raises one DistributedError naming the failing rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import _dist
from .io.checkpoint import CheckpointIndex, CheckpointReader
from .plan.schedule import Schedule

__all__ = ["ExecStats", "execute_schedule", "node_groups"]


@dataclass
class ExecStats:
    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    peak_staging_bytes: int = 0


# The default process group that the cached node groups belong to, its world size, and
# {local_world_size: this rank's node group}. A load in a new default group (destroyed and
# re-initialized) clears it. The cache holds the default group object itself, so that object
# cannot be freed and its id reused by a new group while the cache still names it.
_NODE_GROUP_CACHE: dict = {"default": None, "world": 0, "groups": {}}


def node_groups(local_world_size: int):
    """Collective (every rank of the default group, in the same order): one process group
    per node; returns this rank's.

    The groups are created once per default process group and ``local_world_size`` and
    reused by later calls (``dist.new_subgroups`` makes communicators that nothing frees;
    on NCCL each costs device memory and setup time). Every rank sees the same sequence of
    calls with the same arguments, so every rank hits or misses the cache alike and the
    collective creation stays matched. A destroyed and re-initialized default group is a new
    object: it gets new node groups.

    Raises:
        ValueError: no initialized process group, or ``local_world_size`` does not divide
            the world size.
    """
    if not _dist.is_dist():
        raise ValueError("node_groups needs an initialized default process group")
    world = dist.get_world_size()
    if local_world_size < 1 or world % local_world_size:
        raise ValueError(f"local_world_size={local_world_size} must divide the world size {world}")
    default = dist.distributed_c10d._get_default_group()
    cache = _NODE_GROUP_CACHE
    if cache["default"] is not default or cache["world"] != world:
        cache.update(default=default, world=world, groups={})
    group = cache["groups"].get(local_world_size)
    if group is None or not _is_live(group):
        with _dist.collective("moeshard: creating the node process groups"):
            group, _ = dist.new_subgroups(group_size=local_world_size)
        cache["groups"][local_world_size] = group
    return group


def _is_live(group) -> bool:
    """Whether ``group`` is still registered (not destroyed by ``destroy_process_group``)."""
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return pg_map is None or group in pg_map


def execute_schedule(
    schedule: Schedule,
    rank: int,
    reader: CheckpointReader | None,
    index: CheckpointIndex,
    dests: Sequence[torch.Tensor | None],
    device: torch.device,
    node_group=None,
    progress: Callable[[int], None] | None = None,
    what: str = "moeshard: running the schedule",
) -> ExecStats:
    """Collective (every rank of the default group): run ``schedule`` on this rank.

    Args:
        rank: this process's global rank.
        reader: reads this rank's pieces; None if the schedule gives this rank no reads.
        index: checkpoint headers (the dtype of each piece).
        dests: local tensor of every parameter the deliveries name (None where this rank
            holds nothing); written in place, cast to their dtype.
        device: where staging buffers live (the device of the model's local tensors).
        node_group: this rank's node group, required if the schedule has broadcasts.
        progress: called with the bytes of each piece this rank reads or receives
            (:meth:`Schedule.rank_bytes` is their total).
        what: the operation, for error messages (e.g. "moeshard.load: executing the plan").

    Raises:
        DistributedError: on every rank, after the whole schedule ran, if any rank failed a
            read (without a process group: that read's own error).
        PeerLostError: on the ranks that saw a peer die (a P2P batch or node broadcast with
            it, or the final exchange), naming the peers where known.
    """
    s = schedule
    mine = s.for_rank(rank)
    stats = ExecStats()
    failure: list[Exception] = []  # this rank's failed reads (the first is reported)
    if len(mine.reads) and reader is None:
        raise ValueError(f"rank {rank}: the schedule has this rank read the checkpoint, but it cannot")
    if len(mine.bcasts) and node_group is None:
        raise ValueError("the schedule has node broadcasts but no node group was given")
    lws = s.topology.local_world_size

    # This rank's deliveries per piece: (local tensor view of the whole box target).
    targets: dict[int, list[tuple[int, int, tuple[slice, ...]]]] = {}
    for i in mine.deliveries.tolist():
        pid = int(s.dlv_piece[i])
        nd = int(s.key_ndim[s.piece_key[pid]])
        off, ln = s.dlv_off[i, :nd].tolist(), s.piece_len[pid, :nd].tolist()
        sl = tuple(slice(o, o + n) for o, n in zip(off, ln))
        targets.setdefault(pid, []).append((int(s.dlv_param[i]), int(s.dlv_slot[i]), sl))

    def shape(pid: int) -> tuple[int, ...]:
        return tuple(s.piece_len[pid, : int(s.key_ndim[s.piece_key[pid]])].tolist())

    def view(param: int, slot: int, sl: tuple[slice, ...]) -> torch.Tensor:
        dest = dests[param]
        assert dest is not None, f"rank {rank} has no tensor for parameter {param}"
        return (dest[slot] if slot >= 0 else dest)[sl]

    def deliver(pid: int, buf: torch.Tensor) -> None:
        for param, slot, sl in targets.get(pid, ()):
            view(param, slot, sl).copy_(buf.view(shape(pid)))

    def read(pid: int) -> torch.Tensor:
        assert reader is not None
        try:
            return reader.read(s.piece_name(pid), s.piece_box(pid))
        except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
            failure.append(e)
            # Peers still expect this piece: send zeros rather than leave them waiting.
            return torch.zeros(shape(pid), dtype=index.info(s.piece_name(pid)).torch_dtype)

    def local_read(pid: int) -> None:
        assert reader is not None
        (dst, *more) = targets[pid]
        out = view(*dst)
        try:
            if not more and out.is_contiguous():
                # Straight from storage into the parameter (cast on the way): no staging.
                reader.read(s.piece_name(pid), s.piece_box(pid), out=out.view(shape(pid)))
            else:
                deliver(pid, reader.read(s.piece_name(pid), s.piece_box(pid)))
        except Exception as e:  # noqa: BLE001 - reported on every rank after the schedule
            failure.append(e)
        if progress:
            progress(int(s.piece_bytes[pid]))

    def empty(pid: int) -> torch.Tensor:
        return torch.empty(shape(pid), dtype=index.info(s.piece_name(pid)).torch_dtype, device=device)

    # Per round: pieces to read, P2P rows, broadcast rows; and the last round each buffer of
    # this rank is sent from (it is freed after it).
    reads_at = _by_round(s.read_round[mine.reads], s.read_piece[mine.reads])
    sends_at = _by_round(s.send_round[mine.sends], mine.sends)
    order = np.lexsort((s.bcast_piece[mine.bcasts], s.bcast_round[mine.bcasts]))
    bcasts_at = _by_round(s.bcast_round[mine.bcasts][order], mine.bcasts[order])
    last_use: dict[int, int] = {}
    out_rows = mine.sends[s.send_src[mine.sends] == rank]
    out_b = mine.bcasts[s.bcast_root[mine.bcasts] == rank]
    for pid, t in zip(np.concatenate([s.send_piece[out_rows], s.bcast_piece[out_b]]).tolist(),
                      np.concatenate([s.send_round[out_rows], s.bcast_round[out_b]]).tolist()):
        last_use[pid] = max(last_use.get(pid, -1), t)
    my_local = list(mine.local_reads().tolist())[::-1]
    rounds = mine.rounds.tolist()
    bufs: dict[int, torch.Tensor] = {}
    staged = 0
    for step, t in enumerate(rounds):
        for pid in reads_at.get(t, ()):
            buf = read(pid)
            bufs[pid] = buf.to(device, non_blocking=True) if buf.device != device else buf
            staged += int(s.piece_bytes[pid])
            deliver(pid, bufs[pid])
            if progress:
                progress(int(s.piece_bytes[pid]))
        ops = []
        received: list[int] = []
        for row in sends_at.get(t, ()):
            pid = int(s.send_piece[row])
            if s.send_src[row] == rank:
                ops.append(dist.P2POp(dist.isend, bufs[pid], int(s.send_dst[row])))
                stats.bytes_sent += int(s.piece_bytes[pid])
            else:
                bufs[pid] = empty(pid)
                ops.append(dist.P2POp(dist.irecv, bufs[pid], int(s.send_src[row])))
                received.append(pid)
                staged += int(s.piece_bytes[pid])
        stats.peak_staging_bytes = max(stats.peak_staging_bytes, staged)
        wait = _dist.start_p2p(ops, what) if ops else (lambda: None)
        # Overlap: a share of this rank's own reads while the batch is in flight.
        share = math.ceil(len(my_local) / max(len(rounds) - step, 1))
        for _ in range(min(share, len(my_local))):
            local_read(my_local.pop())
        wait()
        for row in bcasts_at.get(t, ()):
            pid, root = int(s.bcast_piece[row]), int(s.bcast_root[row])
            if root != rank:
                bufs[pid] = empty(pid)
                received.append(pid)
                staged += int(s.piece_bytes[pid])
                stats.peak_staging_bytes = max(stats.peak_staging_bytes, staged)
            else:
                stats.bytes_sent += int(s.piece_bytes[pid]) * (lws - 1)
            node = int(s.bcast_node[row])
            with _dist.collective(what, set(s.topology.node_ranks(node)) - {rank}):
                dist.broadcast(bufs[pid], src=root, group=node_group)
        for pid in received:
            stats.bytes_received += int(s.piece_bytes[pid])
            deliver(pid, bufs[pid])
            if progress:
                progress(int(s.piece_bytes[pid]))
        for pid in [p for p in bufs if last_use.get(p, -1) <= t]:
            staged -= int(s.piece_bytes[pid])
            del bufs[pid]
    while my_local:
        local_read(my_local.pop())
    if reader is not None:
        stats.bytes_read = reader.bytes_read

    def outcome() -> ExecStats:
        if failure:
            raise failure[0]
        return stats

    return _dist.agree(outcome, what)


def _by_round(rounds: np.ndarray, values: np.ndarray) -> dict[int, list[int]]:
    """``{round: [value, ...]}`` in the given order within each round."""
    out: dict[int, list[int]] = {}
    for t, v in zip(rounds.tolist(), values.tolist()):
        if t >= 0:
            out.setdefault(t, []).append(v)
    return out
