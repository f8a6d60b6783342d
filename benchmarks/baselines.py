"""The loading strategies moeshard replaces, re-implemented from the public pull requests.

Each baseline writes into the local tensors of the *same* parallelized model that
``moeshard.load`` fills (so ``moeshard.verify`` checks them too) and counts its own traffic:

* :func:`rank0_broadcast` -- accelerate's ``fsdp2_load_full_state_dict`` (the path of
  transformers PR #45662): global rank 0 reads every tensor in full and ``dist.broadcast``-s
  it to every rank; each rank keeps its slice. For expert weights each per-expert checkpoint
  tensor is broadcast and a rank copies it into its local slots if it holds that logical
  expert (the corrected form of #45662; the original overwrote every rank's experts with rank
  0's).
* :func:`chunk_broadcast_loop` -- modelscope/twinkle PR #200 (``_scatter_ep_expert_tensor``):
  for every fused expert parameter of every layer, rank 0 holds the full tensor and, for each
  target rank 1..world-1, every rank allocates a buffer of that rank's local shape and joins a
  ``dist.broadcast`` of that rank's chunk, then a device synchronize; only the target keeps it
  (O(world^2) bytes). Dense parameters go as in :func:`rank0_broadcast`.
* :func:`node_local_p2p` -- modelscope/twinkle PR #207: local rank 0 of every node reads the
  whole checkpoint and sends each rank of its node the slices it holds (its EP slots, its FSDP
  shard of dense parameters) with one blocking ``dist.send`` / ``dist.recv`` at a time. (The
  PR sends dense tensors whole; sending only the shard, as here, is the cheaper reading.)

Traffic counting (bytes in the checkpoint's dtype), the same convention as moeshard's
``PlanCost``: a P2P send of ``n`` bytes counts ``n`` for the sender; a broadcast of ``n``
bytes to ``k`` receivers counts ``k * n`` for its root (each receiver gets a copy, whatever
tree the backend uses); "cross-node" counts the copies whose receiver is on another node than
the sender. Storage bytes are bytes read from the checkpoint files by this rank.

Every function here is collective: every rank of the default group calls it.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moeshard.box import box_shape, box_slices
from moeshard.io.index import CheckpointIndex
from moeshard.io.reader import CheckpointReader
from moeshard.models.adapters import DEFAULT_SPECS, ExpertsSpec
from moeshard.models.describe import ParamDesc, describe_model, local_tensor
from moeshard.models.layout import Need, compute_needs
from moeshard.placement import Placement

__all__ = ["Target", "BaselineStats", "BASELINES", "rank0_broadcast", "chunk_broadcast_loop", "node_local_p2p"]


@dataclass
class BaselineStats:
    """This rank's counters (bytes in the checkpoint's dtype)."""

    bytes_read: int = 0
    bytes_sent: int = 0
    bytes_sent_cross_node: int = 0
    bytes_received: int = 0
    num_collectives: int = 0


@dataclass
class Target:
    """What a baseline must fill on this rank, and what every other rank must hold.

    ``needs`` are every rank's needs (moeshard's pure ``compute_needs`` from the model's
    DTensor placements and the expert placement); ``locals`` this rank's local tensors, one per
    entry of ``descs``; ``local_shapes[r][i]`` the local shape of parameter ``i`` on rank ``r``.
    """

    rank: int
    world_size: int
    local_world_size: int
    index: CheckpointIndex
    root: str
    descs: list[ParamDesc]
    needs: list[Need]
    locals: list[torch.Tensor]
    local_shapes: list[list[tuple[int, ...]]]
    keys: list[str] = field(default_factory=list)  # every checkpoint key, in file order
    by_key_rank: dict[str, dict[int, list[Need]]] = field(default_factory=dict)
    by_param_rank: dict[int, dict[int, list[Need]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.keys = sorted(self.index.tensors, key=lambda k: (self.index.info(k).file, self.index.info(k).offset))
        by_key: dict[str, dict[int, list[Need]]] = defaultdict(lambda: defaultdict(list))
        by_param: dict[int, dict[int, list[Need]]] = defaultdict(lambda: defaultdict(list))
        for n in self.needs:
            by_key[n.key][n.rank].append(n)
            by_param[n.param][n.rank].append(n)
        self.by_key_rank = by_key
        self.by_param_rank = by_param

    @classmethod
    def build(
        cls,
        model: nn.Module,
        checkpoint: str | os.PathLike,
        placement: Placement | None,
        local_world_size: int,
        specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    ) -> Target:
        """Collective: describe a materialized, parallelized ``model`` (untimed set-up)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        path = os.fspath(checkpoint)
        index = CheckpointIndex.open(path)
        descs = describe_model(model, index, specs)
        needs = compute_needs(descs, index, placement, world)
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers())
        locals_ = [local_tensor(tensors[d.name]) for d in descs]
        shapes: list = [None] * world
        dist.all_gather_object(shapes, [tuple(t.shape) for t in locals_])
        root = path if os.path.isdir(path) else os.path.dirname(path) or "."
        return cls(rank, world, local_world_size, index, root, descs, needs, locals_, shapes)

    @property
    def device(self) -> torch.device:
        return self.locals[0].device

    def node(self, rank: int) -> int:
        return rank // self.local_world_size

    def mine(self, key: str) -> list[Need]:
        return self.by_key_rank.get(key, {}).get(self.rank, [])

    def put(self, n: Need, src: torch.Tensor) -> None:
        """Write ``src`` (the need's source box, any layout) into this rank's local tensor."""
        dst = self.locals[n.param][box_slices(n.dest)]
        dst.copy_(src.reshape(dst.shape))

    def shard_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.locals)

    def zero_(self) -> None:
        with torch.no_grad():
            for t in self.locals:
                t.zero_()


def _sync(device: torch.device) -> None:
    """The per-tensor device synchronize of twinkle #200 (a no-op on CPU)."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def _broadcast_keys(t: Target, keys: Sequence[str], st: BaselineStats, reader: CheckpointReader | None) -> None:
    """Rank 0 reads each tensor in full and broadcasts it; every rank keeps its boxes."""
    w, lws = t.world_size, t.local_world_size
    for key in keys:
        info = t.index.info(key)
        if t.rank == 0:
            assert reader is not None
            buf = reader.read(key).to(t.device)
        else:
            buf = torch.empty(info.shape, dtype=info.torch_dtype, device=t.device)
        dist.broadcast(buf, src=0)
        st.num_collectives += 1
        if t.rank == 0:
            st.bytes_sent += info.nbytes * (w - 1)
            st.bytes_sent_cross_node += info.nbytes * (w - lws)  # every rank off node 0
        else:
            st.bytes_received += info.nbytes
        for n in t.mine(key):
            t.put(n, buf[box_slices(n.src)])
        del buf


def rank0_broadcast(t: Target) -> BaselineStats:
    """Collective: accelerate's FSDP2 full-state-dict load (rank 0 reads, broadcasts all)."""
    st = BaselineStats()
    reader = CheckpointReader(t.index, t.root) if t.rank == 0 else None
    try:
        with torch.no_grad():
            _broadcast_keys(t, t.keys, st, reader)
    finally:
        if reader is not None:
            st.bytes_read = reader.bytes_read
            reader.close()
    return st


def chunk_broadcast_loop(t: Target) -> BaselineStats:
    """Collective: twinkle #200 -- per fused expert parameter, one broadcast per target rank."""
    st = BaselineStats()
    w, lws = t.world_size, t.local_world_size
    reader = CheckpointReader(t.index, t.root) if t.rank == 0 else None
    expert_params = [i for i, d in enumerate(t.descs) if d.expert is not None]
    expert_keys = {n.key for i in expert_params for ns in t.by_param_rank.get(i, {}).values() for n in ns}
    try:
        with torch.no_grad():
            _broadcast_keys(t, [k for k in t.keys if k not in expert_keys], st, reader)
            for i in expert_params:
                per_rank = t.by_param_rank.get(i, {})
                keys = sorted(
                    {n.key for ns in per_rank.values() for n in ns},
                    key=lambda k: (t.index.info(k).file, t.index.info(k).offset),
                )
                if not keys:
                    continue
                dtype = t.index.info(keys[0]).torch_dtype
                full: dict[str, torch.Tensor] = {}
                if t.rank == 0:
                    # Rank 0 holds the full fused parameter (all logical experts of this layer).
                    assert reader is not None
                    full = {k: reader.read(k).to(t.device) for k in keys}
                    for n in per_rank.get(0, []):
                        t.put(n, full[n.key][box_slices(n.src)])
                for r in range(1, w):
                    shape = t.local_shapes[r][i]
                    if not math.prod(shape):
                        continue
                    recv = torch.empty(shape, dtype=dtype, device=t.device)
                    if t.rank == 0:
                        for n in per_rank.get(r, []):
                            recv[box_slices(n.dest)].copy_(full[n.key][box_slices(n.src)].reshape(box_shape(n.dest)))
                    dist.broadcast(recv, src=0)
                    _sync(t.device)
                    st.num_collectives += 1
                    nbytes = recv.numel() * recv.element_size()
                    if t.rank == 0:
                        st.bytes_sent += nbytes * (w - 1)
                        st.bytes_sent_cross_node += nbytes * (w - lws)
                    else:
                        st.bytes_received += nbytes
                    if t.rank == r:
                        t.locals[i].copy_(recv)
                    del recv
                del full
    finally:
        if reader is not None:
            st.bytes_read = reader.bytes_read
            reader.close()
    return st


def node_local_p2p(t: Target) -> BaselineStats:
    """Collective: twinkle #207 -- each node's local rank 0 reads everything, sends serially."""
    st = BaselineStats()
    lws = t.local_world_size
    source = t.node(t.rank) * lws
    node_ranks = range(source, source + lws)
    with torch.no_grad():
        if t.rank == source:
            with CheckpointReader(t.index, t.root) as reader:
                for key in t.keys:
                    full = reader.read(key).to(t.device)  # the whole checkpoint, on every node
                    per_rank = t.by_key_rank.get(key, {})
                    for r in node_ranks:
                        for n in per_rank.get(r, []):
                            piece = full[box_slices(n.src)]
                            if r == t.rank:
                                t.put(n, piece)
                                continue
                            dist.send(piece.contiguous(), dst=r)
                            st.bytes_sent += piece.numel() * piece.element_size()
                            st.num_collectives += 1
                    del full
                st.bytes_read = reader.bytes_read
        else:
            for key in t.keys:
                dtype = t.index.info(key).torch_dtype
                for n in t.mine(key):
                    buf = torch.empty(box_shape(n.src), dtype=dtype, device=t.device)
                    dist.recv(buf, src=source)
                    st.bytes_received += buf.numel() * buf.element_size()
                    t.put(n, buf)
    return st


BASELINES: dict[str, Callable[[Target], BaselineStats]] = {
    "rank0-broadcast": rank0_broadcast,
    "chunk-broadcast-loop": chunk_broadcast_loop,
    "node-local-p2p": node_local_p2p,
}
