"""Ranks, nodes and local ranks of a job.

A :class:`Topology` is plain data: it never talks to torch.distributed, so the planner can
be run for any world size on a laptop. Ranks of one node are contiguous, as torchrun assigns
them (rank = node * local_world_size + local_rank).
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
        world_size: number of ranks in the job.
        local_world_size: ranks per node (torchrun's LOCAL_WORLD_SIZE); must divide world_size.
        rank: this process's rank (only used by code that runs on a rank; planning ignores it).
    """

    world_size: int
    local_world_size: int
    rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(
                f"local_world_size={self.local_world_size} must divide world_size={self.world_size}"
                " (every node must have the same number of ranks)"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} outside [0, {self.world_size})")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Topology":
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

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def node(self) -> int:
        """Node of this rank."""
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    def node_ranks(self, node: int) -> range:
        """Global ranks of ``node``, in local-rank order."""
        start = node * self.local_world_size
        return range(start, start + self.local_world_size)

    def nodes_array(self) -> np.ndarray:
        """``int64[world_size]``: node of every rank."""
        return np.arange(self.world_size, dtype=np.int64) // self.local_world_size

    def with_rank(self, rank: int) -> "Topology":
        return Topology(self.world_size, self.local_world_size, rank)
