"""The job being sized: nodes x ranks per node, split into EP x expert-FSDP."""

from __future__ import annotations

from dataclasses import dataclass

from ..topology import Topology

__all__ = ["ClusterSpec"]


@dataclass(frozen=True)
class ClusterSpec:
    """A job: ``num_nodes`` x ``ranks_per_node`` ranks, EP size ``ep``, expert-FSDP ``efsdp``
    (``ep * efsdp`` = world size), ``num_redundant`` extra expert slots per MoE layer."""

    num_nodes: int
    ranks_per_node: int
    ep: int
    efsdp: int
    num_redundant: int = 0

    def __post_init__(self) -> None:
        for name, flag in (("num_nodes", "--nodes"), ("ranks_per_node", "--ranks-per-node"), ("ep", "--ep"),
                           ("efsdp", "--efsdp")):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.num_redundant < 0:
            raise ValueError(f"--redundant must be >= 0, got {self.num_redundant}")
        if self.ep * self.efsdp != self.world_size:
            raise ValueError(
                f"ep={self.ep} x efsdp={self.efsdp} = {self.ep * self.efsdp} ranks, but the cluster has "
                f"{self.num_nodes} nodes x {self.ranks_per_node} ranks = {self.world_size}"
            )

    @classmethod
    def build(cls, num_nodes: int, ranks_per_node: int, ep: int, efsdp: int | None,
              num_redundant: int = 0) -> ClusterSpec:
        """``efsdp=None``: the rest of the world (``world / ep``, which must be whole)."""
        world = num_nodes * ranks_per_node
        if efsdp is None:
            if ep < 1 or world % ep:
                raise ValueError(f"--ep {ep} does not divide the world size {world} "
                                 f"({num_nodes} nodes x {ranks_per_node} ranks)")
            efsdp = world // ep
        return cls(num_nodes, ranks_per_node, ep, efsdp, num_redundant)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def topology(self) -> Topology:
        return Topology(self.world_size, self.ranks_per_node)

    def ep_nodes(self) -> int:
        """Nodes one EP group spans, for EPLB's hierarchical policy (1: the global policy).
        EP groups are ``ep`` consecutive ranks; an irregular straddle counts as one node."""
        if self.ep >= self.ranks_per_node and self.ep % self.ranks_per_node == 0:
            return self.ep // self.ranks_per_node
        return 1
