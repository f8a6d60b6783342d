"""Ranks, nodes and local ranks of a job (or of one process group of it).

A :class:`Topology` is plain data: it never talks to torch.distributed, so the planner can
be run for any world size on a laptop. By default the ranks of one node are contiguous and
every node has as many, as torchrun assigns them (rank = node * local_world_size +
local_rank). A process group of some of the job's ranks (the survivors of a lost rank, an EP
group inside a larger job) can have any number of ranks per node in any order: give
``nodes``, the node of every rank (:meth:`Topology.of_group` builds it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """Where each rank of a job lives.

    Args:
        world_size: number of ranks in the job (or group).
        local_world_size: ranks per node (torchrun's LOCAL_WORLD_SIZE); must divide world_size.
            With ``nodes`` given: the largest number of ranks on one node.
        rank: this process's rank (only used by code that runs on a rank; planning ignores it).
        nodes: the node of every rank (``world_size`` ints, nodes numbered ``0..num_nodes-1``
            with none left out), when it is not ``rank // local_world_size``; None otherwise.
    """

    world_size: int
    local_world_size: int
    rank: int = 0
    nodes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.nodes is not None:
            nodes = np.asarray(self.nodes, dtype=np.int64)
            if nodes.shape != (self.world_size,) or nodes.min() < 0:
                raise ValueError(
                    f"nodes must give a node id >= 0 for each of the {self.world_size} ranks, "
                    f"got {list(self.nodes)[:16]}"
                )
            counts = np.bincount(nodes)
            if not counts.all():
                raise ValueError(
                    f"nodes must number the nodes 0..{len(counts) - 1} with none left out, got {list(self.nodes)[:16]}"
                )
            if self.local_world_size != int(counts.max()):
                raise ValueError(
                    f"local_world_size={self.local_world_size} must be the most ranks on one node "
                    f"({int(counts.max())}) when nodes are given"
                )
        elif self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(
                f"local_world_size={self.local_world_size} must divide world_size={self.world_size}"
                " (every node must have the same number of ranks)"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} outside [0, {self.world_size})")

    @classmethod
    def from_nodes(cls, nodes, rank: int = 0) -> Topology:
        """The topology of ranks whose nodes are ``nodes`` (any ids; renumbered in order of
        first appearance). Stays the plain contiguous form where it is one."""
        raw = [int(n) for n in nodes]
        ids: dict[int, int] = {}
        dense = tuple(ids.setdefault(n, len(ids)) for n in raw)
        counts = np.bincount(np.asarray(dense, dtype=np.int64))
        lws = int(counts.max())
        if (counts == lws).all() and dense == tuple(r // lws for r in range(len(dense))):
            return cls(len(dense), lws, rank)
        return cls(len(dense), lws, rank, dense)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Topology:
        """Read RANK, WORLD_SIZE and LOCAL_WORLD_SIZE as torchrun sets them.

        Without those variables this is a single-process job. An initialized default process
        group overrides RANK/WORLD_SIZE (the environment may be stale in spawned processes).
        """
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
            local_world = min(local_world, world)
        return cls(world_size=world, local_world_size=local_world, rank=rank)

    @classmethod
    def of_group(cls, group=None, job: Topology | None = None) -> Topology:
        """The topology of process group ``group`` (None: the default group) in numbering of
        the group's ranks: each member's node is its job rank's node in ``job`` (default:
        :meth:`from_env`). ``rank`` is this process's group rank (0 outside the group)."""
        job = job or cls.from_env()
        import torch.distributed as dist

        if group is None or not (dist.is_available() and dist.is_initialized()):
            return job
        members = dist.get_process_group_ranks(group)
        me = dist.get_rank(group)
        if members == list(range(job.world_size)):
            return job.with_rank(max(me, 0))
        return cls.from_nodes([job.node_of(r) for r in members], rank=max(me, 0))

    @property
    def num_nodes(self) -> int:
        if self.nodes is not None:
            return max(self.nodes) + 1
        return self.world_size // self.local_world_size

    @property
    def node(self) -> int:
        """Node of this rank."""
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        """This rank's place among its node's ranks."""
        if self.nodes is not None:
            return self.nodes[: self.rank].count(self.nodes[self.rank])
        return self.rank % self.local_world_size

    def node_of(self, rank: int) -> int:
        if self.nodes is not None:
            return self.nodes[rank]
        return rank // self.local_world_size

    def node_ranks(self, node: int) -> range | list[int]:
        """Ranks of ``node``, in local-rank order."""
        if self.nodes is not None:
            return [r for r, n in enumerate(self.nodes) if n == node]
        start = node * self.local_world_size
        return range(start, start + self.local_world_size)

    def nodes_array(self) -> np.ndarray:
        """``int64[world_size]``: node of every rank."""
        if self.nodes is not None:
            return np.asarray(self.nodes, dtype=np.int64)
        return np.arange(self.world_size, dtype=np.int64) // self.local_world_size

    def node_sizes(self) -> np.ndarray:
        """``int64[num_nodes]``: ranks on every node."""
        if self.nodes is not None:
            return np.bincount(np.asarray(self.nodes, dtype=np.int64))
        return np.full(self.num_nodes, self.local_world_size, dtype=np.int64)

    def with_rank(self, rank: int) -> Topology:
        return Topology(self.world_size, self.local_world_size, rank, self.nodes)
