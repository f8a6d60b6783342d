"""The relocation planner's entry point, :func:`plan_relocation`: old placement + new
placement -> :class:`~.plan.RelocationPlan` (pure), in steps: check the inputs, lay out each
layer (:mod:`.layouts`), find its needs (:mod:`.needs`), route them (:mod:`.routing`), pack the
moves into rounds (:mod:`.rounds`), fingerprint the inputs (:mod:`.fingerprint`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..._gc import paused_gc
from ...placement import Placement
from ...topology import Topology
from .fingerprint import fingerprint
from .layouts import components, holdings_key, layer_layouts, layer_parts, unread
from .needs import LayerNeeds, check_needs, needs_of
from .plan import RelocationPlan
from .records import DEFAULT_MAX_OPS, DEFAULT_STAGING_BYTES, ExpertTensor, Keys, RelocationCost
from .rounds import Packed, pack_components
from .routing import Router

__all__ = ["plan_relocation"]


def plan_relocation(
    tensors: Sequence[ExpertTensor],
    old: Placement | None,
    new: Placement,
    topology: Topology,
    active: Sequence[bool] | np.ndarray | None = None,
    readers: Sequence[bool] | np.ndarray | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    max_ops: int = DEFAULT_MAX_OPS,
    from_checkpoint: bool = False,
    rank: int | None = None,
) -> RelocationPlan:
    """Plan moving expert tensors from placement ``old`` to ``new`` (pure, deterministic).

    Args:
        tensors: every expert tensor of every MoE layer (see :class:`ExpertTensor`).
        old, new: placements of the same shape; a rank that is not ``active`` must hold only
            empty slots in ``new``. ``old=None``: nothing is held yet (an initial fill from
            the checkpoint).
        topology: world size and ranks per node.
        active: ``bool[world_size]``: live ranks (None: all). Dead ranks' memory is lost.
        readers: ``bool[world_size]``: ranks that can read the checkpoint (None: nobody).
        staging_bytes: per-rank budget for staged data in one round.
        max_ops: P2P ops per rank and phase before a round is closed.
        from_checkpoint: ignore live copies and read every changed slot from the checkpoint
            (what engines without P2P relocation do; a baseline, or for suspect peers).
        rank: plan only the component of the job that this rank takes part in (what a rank
            that runs the plan needs: see :class:`RelocationPlan`); None: the whole job.

    Raises:
        ValueError: placements that disagree in shape, a new slot on a dead rank, an expert
            with no live copy when no rank can read the checkpoint, or inconsistent tensors.
    """
    with paused_gc():
        return _plan(tensors, old, new, topology, active, readers, staging_bytes, max_ops, from_checkpoint, rank)


class _Inputs(NamedTuple):
    """The planner's inputs, checked: ``active`` / ``readers`` ``bool[world]`` (live readers
    only; ``dead_readers``: the readers that died), ``old_p2l`` (all -1 for an initial fill,
    which reads everything: ``from_checkpoint``), ``by_layer``: ``{layer: [tensor indices]}``."""

    active: np.ndarray
    readers: np.ndarray
    dead_readers: list[int]
    old_p2l: np.ndarray
    from_checkpoint: bool
    by_layer: dict[int, list[int]]


def _plan(
    tensors, old, new, topology, active, readers, staging_bytes, max_ops, from_checkpoint, rank: int | None
) -> RelocationPlan:
    world = topology.world_size
    inp = _checked(tensors, old, new, world, active, readers, staging_bytes, max_ops, from_checkpoint, rank)
    hkeys = [holdings_key(t) for t in tensors]
    layouts = layer_layouts(tensors, inp.by_layer, hkeys, world, max(1, staging_bytes // 4), inp.active)
    comp, firsts = components(layouts.same, world)
    num_experts = max(1, new.num_logical)  # key of (column, expert): column * num_experts + expert
    keys = Keys(new.num_layers, world, new.num_physical)

    def needs(keep: int | None) -> dict[int, LayerNeeds]:
        return needs_of(
            layouts, comp, firsts, keep, new.phy2log, inp.old_p2l, num_experts, keys, not inp.from_checkpoint
        )

    need = needs(None if rank is None else int(comp[rank]))  # a rank plans its component only
    read = check_needs(layouts, need, inp.old_p2l, inp.active, inp.readers, inp.dead_readers, num_experts)
    if unread(comp, firsts, read.columns, inp.readers):
        comp[:] = 0  # one component: its needs are every column's
        if rank is not None:
            need = needs(None)
    router = Router(
        world,
        topology.nodes_array().tolist(),
        inp.readers.tolist(),
        _comp_readers(comp, inp.readers),
        keys,
        num_experts,
    )
    col_comp = {key: comp[f].tolist() for key, f in firsts.items()}  # each column's component
    columns: list[dict] = [{} for _ in range(new.num_layers)]
    parts: dict = {}
    for layer in layouts.order:
        lay = layouts.of[layer]
        columns[layer] = lay.cols  # shared by the layers of a layout (read only)
        parts.update(layer_parts(layer, lay, inp.by_layer[layer]))
        router.route_layer(layer, lay, need[layer], col_comp[id(lay)])
    packed = pack_components(router.table, keys, world, staging_bytes, max_ops)
    plan = RelocationPlan(
        topology=topology.with_rank(0),
        tensors=tuple(tensors),
        columns=tuple(columns),
        parts=parts,
        moves=tuple(router.table.moves),
        stashes=tuple(packed.stashes),
        rounds=tuple(packed.rounds),
        cost=_cost(router, packed),
        staging_bytes=staging_bytes,
        max_ops=max_ops,
        old_phy2log=inp.old_p2l,
        rank=rank,
        component=comp,
        read_experts=tuple(sorted(read.experts)),
    )
    fp = fingerprint(plan, hkeys, inp.old_p2l, new, inp.active, inp.readers, inp.from_checkpoint)
    object.__setattr__(plan, "fingerprint", fp)
    return plan


def _checked(
    tensors, old, new, world, active, readers, staging_bytes, max_ops, from_checkpoint, rank: int | None
) -> _Inputs:
    """The inputs checked and normalized (ValueError for each inconsistency, in this order)."""
    if rank is not None and not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the world of {world} ranks")
    active = np.ones(world, dtype=bool) if active is None else np.asarray(active, dtype=bool)
    readers = np.zeros(world, dtype=bool) if readers is None else np.asarray(readers, dtype=bool)
    if active.shape != (world,) or readers.shape != (world,):
        raise ValueError(f"active and readers must be bool[{world}], got shapes {active.shape} and {readers.shape}")
    if not active.any():
        raise ValueError("no rank is active")
    dead_readers = np.flatnonzero(readers & ~active).tolist()  # named when an expert has no source
    readers = readers & active  # a dead rank reads nothing
    if old is None:
        old_p2l = np.full_like(new.phy2log, -1)
        from_checkpoint = True
    elif old.phy2log.shape != new.phy2log.shape or old.num_logical != new.num_logical:
        raise ValueError(
            f"old placement has {old.num_layers} layers x {old.num_physical} slots and {old.num_logical} "
            f"experts, the new one {new.num_layers} x {new.num_physical} and {new.num_logical}"
        )
    else:
        old_p2l = old.phy2log
    if staging_bytes < 1 or max_ops < 2:
        raise ValueError(f"staging_bytes must be >= 1 and max_ops >= 2, got {staging_bytes}, {max_ops}")
    by_layer: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        if not 0 <= t.layer < new.num_layers:
            raise ValueError(f"{t.name}: MoE layer {t.layer} outside the placement's {new.num_layers} layers")
        by_layer[t.layer].append(i)
    return _Inputs(active, readers, dead_readers, old_p2l, from_checkpoint, by_layer)


def _comp_readers(comp: np.ndarray, readers: np.ndarray) -> dict[int, list[int]]:
    """``{component: [its live readers, ascending]}``."""
    comp_l = comp.tolist()
    out: dict[int, list[int]] = {}
    for r in np.flatnonzero(readers).tolist():
        out.setdefault(comp_l[r], []).append(r)
    return out


def _cost(router: Router, packed: Packed) -> RelocationCost:
    return RelocationCost(
        copies=dict(router.copies),
        bytes=dict(router.bytes),
        sent_bytes=np.asarray(router.sent, dtype=np.int64),
        recv_bytes=np.asarray(router.recv, dtype=np.int64),
        read_bytes=np.asarray(router.read_load, dtype=np.int64),
        peak_staging_bytes=packed.peak,
        network_bytes=router.net,
        cross_node_bytes=router.cross,
        min_network_bytes=router.min_net,
        min_cross_node_bytes=router.min_cross,
        num_p2p_ops=packed.num_p2p_ops,
        num_rounds=len(packed.rounds),
        num_stashes=len(packed.stashes),
    )
