"""What one loading strategy costs: the record every strategy (moeshard's plans and the
baselines) is reported as, and the per-rank link counters behind its time estimate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..topology import Topology

__all__ = ["StrategyCost", "LinkBytes"]


@dataclass(frozen=True)
class StrategyCost:
    """What one loading strategy costs (bytes in the checkpoint's dtype).

    ``sent_bytes_max_rank`` follows the project's convention (a broadcast of n bytes to k
    receivers counts k*n for its root). The time model instead uses *link* bytes per rank
    (``intra_bytes_max_rank`` / ``inter_bytes_max_rank``: max of a rank's bytes sent and
    received over that kind of link), with every broadcast modeled as a pipelined ring (each
    member receives n and forwards n once): the most favourable reading for broadcasts.
    """

    name: str
    kind: str  # "moeshard" or "baseline"
    read_bytes_total: int
    read_bytes_max_node: int
    cross_node_bytes: int
    sent_bytes_max_rank: int
    recv_bytes_max_rank: int
    num_p2p_ops: int
    num_collectives: int
    num_batches: int
    peak_staging_bytes_max_rank: int
    intra_bytes_max_rank: int
    inter_bytes_max_rank: int
    sent_bytes_total: int = 0
    minimal: dict = field(default_factory=dict)
    plan_seconds: float = 0.0
    note: str = ""

    def at_minimum(self) -> dict:
        """Which counters equal their lower bound (moeshard plans only)."""
        if not self.minimal:
            return {}
        return {
            "read": self.read_bytes_total == self.minimal["read_bytes"],
            "network": self.sent_bytes_total == self.minimal["network_bytes"],
            "cross_node": self.cross_node_bytes == self.minimal["cross_node_bytes"],
        }



class LinkBytes:
    """Per-rank bytes sent and received over intra-node and inter-node links, for the time
    estimate (a rank's link load is the larger of what it sends and what it receives)."""

    def __init__(self, topo: Topology) -> None:
        self._node = topo.nodes_array().tolist()
        world = topo.world_size
        self._sent = ([0] * world, [0] * world)  # [0]: intra-node, [1]: inter-node
        self._recv = ([0] * world, [0] * world)

    def add(self, src: int, dst: int, nbytes: int) -> None:
        """One transfer of ``nbytes`` from ``src`` to ``dst``."""
        k = int(self._node[src] != self._node[dst])
        self._sent[k][src] += nbytes
        self._recv[k][dst] += nbytes

    def ring(self, ranks: Sequence[int], root: int, nbytes: int) -> None:
        """A pipelined ring broadcast from ``root`` over ``ranks`` (root first, then rank
        order): every member but the root receives ``nbytes`` once and forwards it once."""
        ring = [root] + [r for r in ranks if r != root]
        for a, b in zip(ring, ring[1:]):
            self.add(a, b, nbytes)

    def add_many(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> None:
        """Many transfers at once: ``int[n]`` each."""
        node = np.asarray(self._node)
        world = len(node)
        for k, sel in enumerate((node[src] == node[dst], node[src] != node[dst])):
            sent = np.bincount(src[sel], weights=nbytes[sel], minlength=world).astype(np.int64).tolist()
            recv = np.bincount(dst[sel], weights=nbytes[sel], minlength=world).astype(np.int64).tolist()
            self._sent[k][:] = [a + b for a, b in zip(self._sent[k], sent)]
            self._recv[k][:] = [a + b for a, b in zip(self._recv[k], recv)]

    def ring_many(self, node: np.ndarray, root: np.ndarray, nbytes: np.ndarray, lws: int) -> None:
        """Many :meth:`ring` broadcasts at once, each over every rank of its node."""
        members = node[:, None] * lws + np.arange(lws)[None, :]
        # Ring order: the root, then the node's other ranks in rank order.
        later = np.sort(np.where(members == root[:, None], np.iinfo(np.int64).max, members), axis=1)[:, : lws - 1]
        ring = np.concatenate([root[:, None], later], axis=1)
        n = np.repeat(nbytes, lws - 1)
        self.add_many(ring[:, :-1].reshape(-1), ring[:, 1:].reshape(-1), n)

    def max_rank(self) -> tuple[int, int]:
        """``(intra, inter)``: the busiest rank's bytes on each kind of link."""
        intra, inter = (max(max(s, r) for s, r in zip(sent, recv)) for sent, recv in zip(self._sent, self._recv))
        return int(intra), int(inter)
