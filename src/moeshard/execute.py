"""Run a :class:`~moeshard.plan.TransferPlan` with torch.distributed.

Every rank walks the same chunk list in the same order and posts only the ops that involve
it, so P2P ops pair up without any loop over ranks and without deadlock (step k's
participants all finished their earlier steps). Per chunk: read pieces for others into
staging buffers, post phase A (batch_isend_irecv + node broadcasts), do a share of this rank's
local reads while those are in flight, wait, deliver; then phase B (relays). Nothing calls a
device synchronize: waits are on the ops' own work handles.

A read that fails on one rank (an I/O error, a file changed under the job) does not leave its
peers blocked in a receive: the rank keeps running the plan with zeros in place of the piece,
and after the last chunk every rank raises one DistributedError naming the failing rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from . import _dist
from .box import box_shape, box_slices
from .checkpoint import CheckpointIndex, CheckpointReader
from .plan import TransferPlan

__all__ = ["ExecStats", "execute_plan", "node_groups", "rank_bytes"]


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


def execute_plan(
    plan: TransferPlan,
    rank: int,
    reader: CheckpointReader | None,
    index: CheckpointIndex,
    dests: Sequence[torch.Tensor | None],
    device: torch.device,
    node_group=None,
    progress: Callable[[int], None] | None = None,
    what: str = "moeshard: running the transfer plan",
) -> ExecStats:
    """Collective (every rank of the default group): run ``plan`` on this rank.

    Args:
        rank: this process's global rank.
        reader: reads this rank's pieces; None if the plan gives this rank no reads.
        index: checkpoint headers (dtype and shape of each piece).
        dests: local tensor of every parameter of the plan's needs (None where this rank
            holds nothing); written in place, cast to their dtype.
        device: where staging buffers live (the device of the model's local tensors).
        node_group: this rank's node group, required if the plan has broadcasts.
        progress: called with the bytes of each piece this rank reads or receives
            (:func:`rank_bytes` is their total).
        what: the operation, for error messages (e.g. "moeshard.load: executing the plan").

    Raises:
        DistributedError: on every rank, after the whole plan ran, if any rank failed a read
            (without a process group: that read's own error).
        PeerLostError: on the ranks that saw a peer die (a P2P batch or node broadcast with
            it, or the final exchange), naming the peers where known.
    """
    stats = ExecStats()
    failure: list[Exception] = []  # this rank's failed reads (the first is reported)
    pieces, needs = plan.pieces, plan.needs
    my_local = list(plan.local_reads[rank])
    if (my_local or any(r == rank for c in plan.chunks for r, _ in c.reads)) and reader is None:
        raise ValueError(f"rank {rank}: the plan has this rank read the checkpoint, but it cannot")
    my_chunks = [c for c in plan.chunks if _involves(c, rank, plan)]

    def deliver(pid: int, buf: torch.Tensor) -> None:
        for r, idx in pieces[pid].needs:
            if r != rank:
                continue
            for i in idx:
                n = needs[i]
                dest = dests[n.param]
                assert dest is not None, f"rank {rank} has no tensor for {n}"
                # The dest box may carry extra leading dims of length 1 (an expert slot).
                dest[box_slices(n.dest)].copy_(buf.view(box_shape(n.dest)))

    def local_read(pid: int) -> None:
        assert reader is not None
        piece = pieces[pid]
        # In scope "node" the piece may also be needed (and read) on other nodes.
        (idx,) = [idx for r, idx in piece.needs if r == rank]
        view = dests[needs[idx[0]].param][box_slices(needs[idx[0]].dest)]
        try:
            if len(idx) == 1 and view.is_contiguous():
                # Straight from storage into the parameter (cast on the way): no staging.
                reader.read(piece.key, piece.src, out=view.view(box_shape(piece.src)))
            else:
                deliver(pid, reader.read(piece.key, piece.src))
        except Exception as e:  # noqa: BLE001 - reported on every rank after the plan
            failure.append(e)
        if progress:
            progress(piece.nbytes)

    def read_for_others(pid: int) -> torch.Tensor:
        assert reader is not None
        try:
            return reader.read(pieces[pid].key, pieces[pid].src)
        except Exception as e:  # noqa: BLE001 - reported on every rank after the plan
            failure.append(e)
            # Peers still expect this piece: send zeros rather than leave them waiting.
            return torch.zeros(box_shape(pieces[pid].src), dtype=index.info(pieces[pid].key).torch_dtype)

    def empty(pid: int) -> torch.Tensor:
        p = pieces[pid]
        return torch.empty(box_shape(p.src), dtype=index.info(p.key).torch_dtype, device=device)

    remaining_chunks = len(my_chunks)
    for chunk in my_chunks:
        bufs: dict[int, torch.Tensor] = {}
        staged = 0
        for r, pid in chunk.reads:
            if r == rank:
                buf = read_for_others(pid)
                bufs[pid] = buf.to(device, non_blocking=True) if buf.device != device else buf
                staged += pieces[pid].nbytes
                deliver(pid, bufs[pid])
                if progress:
                    progress(pieces[pid].nbytes)
        for phase in chunk.phases:
            ops = []
            received: list[int] = []
            for s in phase.sends:
                if s.src == rank:
                    ops.append(dist.P2POp(dist.isend, bufs[s.piece], s.dst))
                    stats.bytes_sent += pieces[s.piece].nbytes
                elif s.dst == rank:
                    bufs[s.piece] = empty(s.piece)
                    ops.append(dist.P2POp(dist.irecv, bufs[s.piece], s.src))
                    received.append(s.piece)
                    staged += pieces[s.piece].nbytes
            wait = _dist.start_p2p(ops, what)
            # Overlap: this rank's own reads while the batch is in flight.
            share = math.ceil(len(my_local) / max(remaining_chunks * 2, 1))
            for _ in range(min(share, len(my_local))):
                local_read(my_local.pop())
            wait()
            for b in phase.broadcasts:
                if rank not in plan.topology.node_ranks(b.node):
                    continue
                if node_group is None:
                    raise ValueError("the plan has node broadcasts but no node group was given")
                if b.root != rank:
                    bufs[b.piece] = empty(b.piece)
                    received.append(b.piece)
                    staged += pieces[b.piece].nbytes
                else:
                    stats.bytes_sent += pieces[b.piece].nbytes * (plan.topology.local_world_size - 1)
                with _dist.collective(what, set(plan.topology.node_ranks(b.node)) - {rank}):
                    dist.broadcast(bufs[b.piece], src=b.root, group=node_group)
            for pid in received:
                stats.bytes_received += pieces[pid].nbytes
                deliver(pid, bufs[pid])
                if progress:
                    progress(pieces[pid].nbytes)
        stats.peak_staging_bytes = max(stats.peak_staging_bytes, staged)
        remaining_chunks -= 1
        del bufs
    while my_local:
        local_read(my_local.pop())
    if reader is not None:
        stats.bytes_read = reader.bytes_read

    def outcome() -> ExecStats:
        if failure:
            raise failure[0]
        return stats

    return _dist.agree(outcome, what)


def rank_bytes(plan: TransferPlan, rank: int) -> int:
    """Bytes of the pieces ``rank`` reads or receives when running ``plan`` (pure)."""
    lws = plan.topology.local_world_size
    total = sum(plan.pieces[p].nbytes for p in plan.local_reads[rank])
    for chunk in plan.chunks:
        total += sum(plan.pieces[p].nbytes for r, p in chunk.reads if r == rank)
        for phase in chunk.phases:
            total += sum(plan.pieces[s.piece].nbytes for s in phase.sends if s.dst == rank)
            total += sum(plan.pieces[b.piece].nbytes for b in phase.broadcasts
                         if b.root != rank and rank // lws == b.node)
    return total


def _involves(chunk, rank: int, plan: TransferPlan) -> bool:
    if any(r == rank for r, _ in chunk.reads):
        return True
    for phase in chunk.phases:
        if any(s.src == rank or s.dst == rank for s in phase.sends):
            return True
        if any(rank in plan.topology.node_ranks(b.node) for b in phase.broadcasts):
            return True
    return False
