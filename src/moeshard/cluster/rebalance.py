"""A rebalance on paper: EPLB's migration-aware policy from the current placement, then the
relocation planner's plan for every expert tensor, summarized."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..dtypes import itemsize
from ..models.describe import ParamDesc
from ..models.shards import local_boxes
from ..placement import Placement
from .cost import LinkBytes
from .spec import ClusterSpec

__all__ = ["RelocationSummary", "plan_relocation_summary"]


@dataclass(frozen=True)
class RelocationSummary:
    """A rebalance: balance before/after, copies moved, and the relocation plan's costs."""

    balance_before: float
    balance_after: float
    copies_moved: int
    slots_changed: int
    cost: dict
    read_bytes_max_node: int
    intra_bytes_max_rank: int
    inter_bytes_max_rank: int
    plan_seconds: float
    rebalance_seconds: float


def plan_relocation_summary(descs: Sequence[ParamDesc], old: Placement, loads: np.ndarray, cluster: ClusterSpec,
                            readers: np.ndarray, staging_bytes: int,
                            num_groups: int | None) -> tuple[Placement, RelocationSummary]:
    """Rebalance ``loads`` (``float[num_moe_layers, num_logical]``) from ``old`` with EPLB's
    migration-aware policy and plan the relocation of every expert tensor (pure)."""
    from .. import eplb
    from ..plan.relocation import ExpertTensor, plan_relocation

    loads = np.asarray(loads)
    if loads.ndim != 2 or loads.shape != (old.num_layers, old.num_logical):
        raise ValueError(
            f"loads have shape {list(loads.shape)}, expected [num_moe_layers={old.num_layers}, "
            f"num_logical={old.num_logical}]"
        )
    nodes = cluster.ep_nodes()
    groups = num_groups if num_groups and old.num_logical % num_groups == 0 else None
    t0 = time.perf_counter()
    new = eplb.rebalance(loads, old, num_physical=old.num_physical, num_ranks=cluster.ep, num_nodes=nodes,
                         num_groups=groups, migration_aware=True)
    t1 = time.perf_counter()
    tensors = []
    for d in descs:
        if d.expert is None:
            continue
        boxes = local_boxes(d.shape, d.mesh.shape, d.placements)
        holdings = tuple((r, b[0][0], b[0][1], b[1:]) for r, b in zip(d.mesh.reshape(-1).tolist(), boxes))
        tensors.append(ExpertTensor(d.expert.layer, d.name, d.shape[1:], itemsize(d.dtype), holdings))
    topo = cluster.topology()
    plan = plan_relocation(tensors, old, new, topo, readers=readers, staging_bytes=staging_bytes)
    t2 = time.perf_counter()
    links = LinkBytes(topo)
    for m in plan.moves:
        for s, _, d in m.sends:
            links.add(s, d, m.nbytes)
        for s, d in m.relays:
            links.add(s, d, m.nbytes)
    intra, inter = links.max_rank()
    c = plan.cost
    summary = RelocationSummary(
        balance_before=float(eplb.balance(loads, old, cluster.ep).mean()),
        balance_after=float(eplb.balance(loads, new, cluster.ep).mean()),
        copies_moved=eplb.copies_moved(old, new, cluster.ep),
        slots_changed=eplb.slots_changed(old, new),
        cost=c.summary(),
        read_bytes_max_node=int(c.read_bytes.reshape(-1, topo.local_world_size).sum(1).max()),
        intra_bytes_max_rank=intra,
        inter_bytes_max_rank=inter,
        plan_seconds=t2 - t1,
        rebalance_seconds=t1 - t0,
    )
    return new, summary
