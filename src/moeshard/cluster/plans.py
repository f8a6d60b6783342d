"""moeshard's own plans, one per storage mode: the real planner's Schedule and lower
bounds, reduced to a :class:`StrategyCost` (with per-rank intra/inter-node link bytes)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np

from ..io.index import CheckpointIndex
from ..io.sources import storage_sources
from ..plan import NeedTable, Pieces, Schedule, cut_pieces, minimal_cost, plan_transfers
from ..topology import Topology
from .cost import LinkBytes, StrategyCost

__all__ = ["moeshard_cost", "plan_storage_modes"]


def moeshard_cost(name: str, plan: Schedule, minimal: dict, seconds: float) -> StrategyCost:
    """Counters of a moeshard plan, plus its per-rank intra/inter-node link bytes."""
    topo = plan.topology
    links = LinkBytes(topo)
    links.add_many(plan.sends.src, plan.sends.dst, plan.pieces.bytes[plan.sends.piece])
    if topo.local_world_size > 1:
        links.ring_many(
            plan.bcasts.node.astype(np.int64),
            plan.bcasts.root.astype(np.int64),
            plan.pieces.bytes[plan.bcasts.piece],
            topo.local_world_size,
        )
    intra, inter = links.max_rank()
    c = plan.cost
    read_node = c.read_bytes.reshape(-1, topo.local_world_size).sum(1)
    return StrategyCost(
        name=name,
        kind="moeshard",
        read_bytes_total=int(c.read_bytes.sum()),
        read_bytes_max_node=int(read_node.max()),
        cross_node_bytes=int(c.cross_node_bytes),
        sent_bytes_max_rank=int(c.sent_bytes.max()),
        recv_bytes_max_rank=int(c.recv_bytes.max()),
        num_p2p_ops=int(c.num_p2p_ops),
        num_collectives=int(c.num_broadcasts),
        num_batches=int(c.num_batches),
        peak_staging_bytes_max_rank=int(c.peak_staging_bytes.max()),
        intra_bytes_max_rank=intra,
        inter_bytes_max_rank=inter,
        sent_bytes_total=int(c.sent_bytes.sum()),
        minimal=dict(minimal),
        plan_seconds=seconds,
    )


def _plan_mode(mode: str, pieces: Pieces, index: CheckpointIndex, topo: Topology, staging: int) -> StrategyCost:
    t = time.perf_counter()
    name, readers, scope = storage_sources(mode, np.ones(topo.world_size, dtype=bool), topo)
    minimal = minimal_cost(pieces, index, topo, readers, scope)
    plan = plan_transfers(pieces, index, topo, readers, scope=scope, staging_bytes=staging)
    cost = moeshard_cost(f"moeshard {name}", plan, minimal, 0.0)
    return StrategyCost(**{**asdict(cost), "plan_seconds": time.perf_counter() - t})


def plan_storage_modes(
    needs: NeedTable | Pieces, index: CheckpointIndex, topo: Topology, modes: Sequence[str], staging: int
) -> list[StrategyCost]:
    """Plan every storage mode in ``modes`` and cost each plan (pure).

    The needs are cut into pieces once (:func:`~moeshard.plan.cut_pieces`, the same for every
    mode; or pass the :class:`~moeshard.plan.Pieces` for ``staging``) and each mode's schedule
    is reduced to its counters before the next is planned: one schedule in memory at a time.
    Running the modes in forked processes was tried: faster at 256 ranks on 2 cores (16 ->
    11 s), slower at 1,024 ranks (45 -> 53 s, 79 -> 114 s), so it is not done."""
    pieces = needs if isinstance(needs, Pieces) else cut_pieces(needs, index, staging)
    return [_plan_mode(mode, pieces, index, topo, staging) for mode in modes]
