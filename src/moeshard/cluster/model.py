"""The model a job would have, without building it: the :class:`ParamDesc` records
:func:`moeshard.parallelize` gives it on a cluster, and its expert placement."""

from __future__ import annotations

import numpy as np

from ..io.index import CheckpointIndex
from ..models.describe import ExpertRef, ParamDesc
from ..placement import Placement
from .experts import MoeLayout
from .spec import ClusterSpec

__all__ = ["synthesize_descs", "make_placement"]

# Persistent buffers FSDP2 does not shard (it only shards parameters): every rank holds them.
_PLAIN_SUFFIXES = ("e_score_correction_bias",)


def synthesize_descs(layout: MoeLayout, index: CheckpointIndex, cluster: ClusterSpec) -> list[ParamDesc]:
    """The :class:`ParamDesc` records ``moeshard.parallelize`` would give the model of this
    checkpoint on ``cluster`` (model dtype = checkpoint dtype, so bytes are checkpoint bytes).

    Torch-free: dtypes are safetensors names and placements their plain spelling (the int dim
    of a ``Shard``, None for ``Replicate``; :class:`~moeshard.models.describe.ParamDesc`)."""
    world = cluster.world_size
    dp = np.arange(world)  # the flattened ("efsdp", "ep") mesh is ranks 0..world-1 in order
    if cluster.efsdp == 1:
        emesh, eplace, eplace0 = dp, (0,), (0,)
    else:
        emesh = dp.reshape(cluster.efsdp, cluster.ep)
        # (Shard(1), Shard(0)); a 0-dim per-expert tensor (a per-expert scalar scale) has no dim
        # 1 to shard: (Replicate(), Shard(0)).
        eplace, eplace0 = (1, 0), (None, 0)
    num_physical = layout.num_logical + cluster.num_redundant
    descs: list[ParamDesc] = []
    for key in layout.dense_keys:
        info = index.info(key)
        if not info.shape or key.endswith(_PLAIN_SUFFIXES):
            descs.append(ParamDesc(key, tuple(info.shape), info.dtype, None, (), (key,)))
        else:
            descs.append(ParamDesc(key, tuple(info.shape), info.dtype, dp, (0,), (key,)))
    for em in layout.experts:
        for p in em.params:
            parts = [index.info(k) for k in p.keys(em.module, 0)]
            slice_shape = (sum(t.shape[0] for t in parts), *parts[0].shape[1:]) if parts[0].shape else ()
            place = eplace if slice_shape else eplace0
            descs.append(
                ParamDesc(
                    f"{em.module}.{p.name}",
                    (num_physical, *slice_shape),
                    parts[0].dtype,
                    emesh,
                    place,
                    (),
                    ExpertRef(em.layer, em.module, p),
                )
            )
    return descs


def make_placement(layout: MoeLayout, cluster: ClusterSpec, phy2log: np.ndarray | None = None) -> Placement:
    """Contiguous placement (``num_redundant`` extra copies), or ``phy2log`` checked against
    the checkpoint's shape ``[num_moe_layers, num_logical + num_redundant]``."""
    num_physical = layout.num_logical + cluster.num_redundant
    if num_physical % cluster.ep:
        raise ValueError(
            f"--ep {cluster.ep} does not divide the {num_physical} expert slots per layer "
            f"({layout.num_logical} experts + {cluster.num_redundant} redundant)"
        )
    if phy2log is None:
        return Placement.contiguous(layout.num_layers, layout.num_logical, cluster.ep, cluster.num_redundant)
    want = (layout.num_layers, num_physical)
    if phy2log.shape != want:
        raise ValueError(
            f"--placement: phy2log has shape {list(phy2log.shape)}, expected [num_moe_layers={want[0]}, "
            f"num_physical={want[1]}] (set --redundant to num_physical - {layout.num_logical})"
        )
    return Placement(phy2log, num_logical=layout.num_logical, num_ranks=cluster.ep)
