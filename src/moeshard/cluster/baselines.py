"""The three baselines of ``benchmarks/baselines.py``, costed analytically from what each of
them sends (nothing is planned or executed)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..dtypes import ITEMSIZE
from ..io.index import CheckpointIndex
from ..models.describe import ParamDesc
from ..models.shards import param_boxes
from ..plan import NeedTable
from .cost import StrategyCost
from .spec import ClusterSpec

__all__ = ["baseline_costs"]


def _local_bytes(d: ParamDesc, itemsize: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ranks, bytes)``, ``int64[M]`` each: every mesh rank of one DTensor parameter and
    the bytes of its local tensor (numpy: one row per rank)."""
    ranks, boxes = param_boxes(d, world)
    return ranks, boxes[:, :, 1].prod(axis=1) * itemsize


def baseline_costs(
    needs: NeedTable, descs: Sequence[ParamDesc], index: CheckpointIndex, cluster: ClusterSpec
) -> list[StrategyCost]:
    """Costs of the three baselines of ``benchmarks/baselines.py``, computed from what each
    sends (no execution):

    * rank0-broadcast: rank 0 reads every tensor and broadcasts it whole to all ranks;
    * chunk-broadcast-loop: dense tensors as above; for every fused expert parameter rank 0
      reads all its per-expert tensors and, for each rank r = 1..world-1, broadcasts r's local
      shard to all ranks (one collective + device synchronize each);
    * node-local-p2p: local rank 0 of every node reads the whole checkpoint and sends each rank
      of its node each of its boxes with one blocking send.
    """
    world, lws = cluster.world_size, cluster.ranks_per_node
    num_nodes = cluster.num_nodes
    infos = index.tensors
    nbytes = {k: t.nbytes for k, t in infos.items()}
    total = sum(nbytes.values())
    max_tensor = max(nbytes.values(), default=0)
    # Ring-broadcast link bytes over all ranks: a middle rank forwards intra-node, a node's
    # first/last rank receives/sends across nodes.
    intra_ring = 1 if lws > 1 else 0
    inter_ring = 1 if num_nodes > 1 else 0
    out = []

    # rank0-broadcast: every checkpoint tensor once, to every rank.
    out.append(
        StrategyCost(
            name="rank0-broadcast",
            kind="baseline",
            read_bytes_total=total,
            read_bytes_max_node=total,
            cross_node_bytes=total * (world - lws),
            sent_bytes_max_rank=total * (world - 1),
            recv_bytes_max_rank=total if world > 1 else 0,
            num_p2p_ops=0,
            num_collectives=len(infos),
            num_batches=len(infos),
            peak_staging_bytes_max_rank=max_tensor,
            intra_bytes_max_rank=total * intra_ring,
            inter_bytes_max_rank=total * inter_ring,
            note="accelerate fsdp2_load_full_state_dict (transformers #45662)",
        )
    )

    # chunk-broadcast-loop.
    expert_keys: set[str] = set()
    bcast_bytes = 0  # sum of the payloads of all broadcasts
    num_bcast = 0
    peak0 = 0
    num_logical = _num_logical(descs, index)
    for d in descs:
        if d.expert is None:
            continue
        ref = d.expert
        keys = [k for e in range(num_logical) for k in ref.param.keys(ref.module, e)]
        expert_keys.update(keys)
        full = sum(nbytes[k] for k in keys)
        ranks, local = _local_bytes(d, ITEMSIZE[infos[keys[0]].dtype], world)
        local = local[(ranks != 0) & (local > 0)]
        bcast_bytes += int(local.sum())
        num_bcast += len(local)
        peak0 = max(peak0, full + int(local.max(initial=0)))
    dense_bytes = sum(b for k, b in nbytes.items() if k not in expert_keys)
    num_dense = len(infos) - len(expert_keys)
    payload = dense_bytes + bcast_bytes
    out.append(
        StrategyCost(
            name="chunk-broadcast-loop",
            kind="baseline",
            read_bytes_total=total,
            read_bytes_max_node=total,
            cross_node_bytes=payload * (world - lws),
            sent_bytes_max_rank=payload * (world - 1),
            recv_bytes_max_rank=payload if world > 1 else 0,
            num_p2p_ops=0,
            num_collectives=num_dense + num_bcast,
            num_batches=num_dense + num_bcast,
            peak_staging_bytes_max_rank=max(max_tensor, peak0),
            intra_bytes_max_rank=payload * intra_ring,
            inter_bytes_max_rank=payload * inter_ring,
            note=f"twinkle #200: {num_bcast} expert broadcasts, each followed by a device synchronize",
        )
    )

    # node-local-p2p: one blocking send per need of a rank other than its node's local rank 0.
    item = np.asarray([ITEMSIZE[infos[k].dtype] for k in needs.keys], dtype=np.int64)
    ranks = needs.rank.astype(np.int64)
    sizes = needs.src_len.prod(axis=1) * item[needs.key]
    need_bytes = np.zeros(world, dtype=np.int64)
    np.add.at(need_bytes, ranks, sizes)  # exact int64 sums (bincount's weights are float64)
    need_ops = np.bincount(ranks, minlength=world)
    is_source = (np.arange(world) % lws) == 0
    recv = np.where(is_source, 0, need_bytes)
    sent_node = recv.reshape(num_nodes, lws).sum(1)
    ops_node = np.where(is_source, 0, need_ops).reshape(num_nodes, lws).sum(1)
    ops = int(ops_node.sum())  # job-wide, as PlanCost counts; nodes send in parallel, so the
    # sequential steps (batches) are the busiest node's sends
    max_need = int(sizes[~is_source[ranks]].max(initial=0))
    out.append(
        StrategyCost(
            name="node-local-p2p",
            kind="baseline",
            read_bytes_total=total * num_nodes,
            read_bytes_max_node=total,
            cross_node_bytes=0,
            sent_bytes_max_rank=int(sent_node.max()),
            recv_bytes_max_rank=int(recv.max()),
            num_p2p_ops=ops,
            num_collectives=0,
            num_batches=int(ops_node.max()),
            peak_staging_bytes_max_rank=max(max_tensor, max_need),
            intra_bytes_max_rank=int(max(sent_node.max(), recv.max())),
            inter_bytes_max_rank=0,
            note="twinkle #207: every node reads the whole checkpoint; blocking sends one at a time",
        )
    )
    return out


def _num_logical(descs: Sequence[ParamDesc], index: CheckpointIndex) -> int:
    d = next(d for d in descs if d.expert is not None)
    ref = d.expert
    n = 0
    while ref.param.keys(ref.module, n)[0] in index:
        n += 1
    return n
