"""``moeshard.relocate``: move expert weights in place from one placement to another.

Steps (all collective, every rank of the group calls ``relocate``): describe the
expert tensors (a model prepared by moeshard, or plain per-layer tensors as serving engines
keep them) -> check that every rank sees the same tensors and placements -> plan
(:func:`~moeshard.plan.relocation.plan_relocation`; the checkpoint is opened only if some expert
has no live copy) -> agree on the plan's fingerprint -> run its rounds -> report.

Every check runs before any weight changes, so a bad input leaves the weights as they were.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .. import collectives
from ..box import box_shape, full_box
from ..execute import Backup, ExecStats, LocalTensors, Source, TensorSink, execute_schedule
from ..io.index import CheckpointIndex
from ..io.reader import CheckpointReader
from ..io.sources import Storage, reader_root, resolve_sources, sources_share
from ..models.adapters import DEFAULT_SPECS, ExpertParam, ExpertsSpec, read_expert_box
from ..models.describe import (
    KEEPS_PACKED,
    ExpertRef,
    ParamDesc,
    describe_model,
    expert_layers,
    keeps_packed,
    local_tensor,
)
from ..models.ep import model_placement, set_placement
from ..models.layout import expert_part_sizes
from ..models.routing import ROUTING_MODES, check_routing, resolve_placement, take_over
from ..models.shards import local_boxes
from ..placement import ROW_RULE, Placement
from ..plan.chunks import relocation_chunks
from ..plan.relocation import (
    COUNTERS,
    DEFAULT_MAX_OPS,
    DEFAULT_STAGING_BYTES,
    ExpertTensor,
    RelocationPlan,
    job_summary,
    plan_relocation,
)
from ..plan.schedule import Schedule
from ..topology import Topology
from .load import target_device
from .report import OpReport
from .skeleton import OpMeter, group_topology, progress_bar

__all__ = [
    "RelocationReport",
    "RelocationStep",
    "relocate",
    "relocate_chunks",
    "describe_expert_tensors",
    "expert_states",
]

ExpertTensors = Mapping[int, Sequence[torch.Tensor]]


@dataclass(frozen=True)
class RelocationReport(OpReport):
    """What a relocation did. Job-wide: ``copies`` / ``bytes`` per class (local, same_node,
    cross_node, disk; a copy is one slot box, see :class:`~moeshard.plan.relocation.RelocationCost`),
    network and cross-node bytes beside their lower bounds, rounds, stashes and the experts
    read from the checkpoint. ``*_rank`` fields are this rank's."""

    copies: dict
    bytes: dict
    network_bytes: int
    min_network_bytes: int
    cross_node_bytes: int
    min_cross_node_bytes: int
    num_rounds: int
    num_stashes: int
    disk_experts: list


@dataclass(frozen=True)
class _Source:
    """Where a layer's expert tensors come from in the checkpoint (for experts no live rank
    holds): the experts module's name, the tensor's :class:`ExpertParam`, and the tensor's
    dtype (known on every rank, also where it holds no slot: the cast rule is checked there)."""

    module: str
    param: ExpertParam | None
    dtype: torch.dtype
    # Optimizer state: not in the checkpoint; an expert with no live copy starts from zeros.
    zeros: bool = False


def describe_expert_tensors(
    target: nn.Module | ExpertTensors,
    world_size: int,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    expert_params: Sequence[ExpertParam] | None = None,
    module: str | Callable[[int], str] = "model.layers.{layer}.mlp.experts",
    ep_ranks: Sequence[int] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[list[ExpertTensor], list[torch.Tensor | None], list[_Source | None]]:
    """The planner's view of ``target``'s expert tensors (no communication).

    ``target`` is a model (expert parameters: DTensors or plain tensors of global shape
    ``[num_physical, *slice_shape]``) or ``{layer: [tensor[num_local_slots, *slice_shape], ...]}``
    with the EP group = the running operation's group: its rank ``r`` is EP rank
    ``ep_ranks[r]`` (default ``r``) and holds slots ``ep_ranks[r] * num_local_slots ...``; dict
    keys are model layer ids, sorted into MoE layer order. ``optimizer`` (models only): each
    expert parameter's per-element state (:func:`expert_states`) follows it, as tensors of
    their own after the parameter's.

    Returns ``(tensors, local tensors of this rank (None where it holds nothing), sources)``.
    """
    rank = collectives.rank_and_world()[0]
    if isinstance(target, nn.Module):
        out, locals_, sources = [], [], []
        params = dict(target.named_parameters(remove_duplicate=False))
        for d in describe_model(target, None, specs):
            if d.expert is None:
                continue
            slice_shape = d.shape[1:]
            if d.mesh is None:
                holdings = tuple((r, 0, d.shape[0], full_box(slice_shape)) for r in range(world_size))
            else:
                boxes = local_boxes(d.shape, d.mesh.shape, d.placements)
                holdings = tuple((r, b[0][0], b[0][1], b[1:]) for r, b in zip(d.mesh.reshape(-1).tolist(), boxes))
            mine = any(r == rank for r, *_ in holdings)
            entries = [(d.name, params[d.name], _Source(d.expert.module, d.expert.param, d.dtype))]
            entries += [
                (f"{d.name} (optimizer state {key!r})", st, _Source(d.expert.module, None, st.dtype, zeros=True))
                for key, st in expert_states(optimizer, params[d.name], d.name)
            ]
            for name, t, src in entries:
                out.append(ExpertTensor(d.expert.layer, name, slice_shape, t.element_size(), holdings))
                locals_.append(local_tensor(t) if mine else None)
                sources.append(src)
        if not out:
            raise ValueError("the model has no experts module that the expert specs match")
        _check_undeclared(target, specs, out)
        return out, locals_, sources
    if expert_params is not None and not isinstance(expert_params, (list, tuple)):
        raise ValueError("expert_params must be a sequence of ExpertParam, one per tensor of a layer")
    out, locals_, sources = [], [], []
    for moe_layer, key in enumerate(sorted(target)):
        layer_tensors = list(target[key])
        if expert_params is not None and len(expert_params) != len(layer_tensors):
            raise ValueError(f"layer {key}: {len(layer_tensors)} tensors but {len(expert_params)} expert_params")
        name = module(key) if callable(module) else module.format(layer=key)
        for j, t in enumerate(layer_tensors):
            if t.dim() < 1:
                raise ValueError(f"layer {key} tensor {j}: expected [num_local_slots, ...], got a 0-dim tensor")
            slots, slice_shape = t.shape[0], tuple(t.shape[1:])
            ep = range(world_size) if ep_ranks is None else ep_ranks
            holdings = tuple((r, int(ep[r]) * slots, slots, full_box(slice_shape)) for r in range(world_size))
            out.append(ExpertTensor(moe_layer, f"layer {key} tensor {j}", slice_shape, t.element_size(), holdings))
            locals_.append(t)
            sources.append(_Source(name, expert_params[j], t.dtype) if expert_params is not None else None)
    return out, locals_, sources


def expert_states(optimizer: torch.optim.Optimizer | None, param: torch.Tensor, name: str) -> list:
    """``[(key, tensor)]``: the state of ``param`` in ``optimizer`` that holds one value per
    element of the parameter (AdamW's ``exp_avg`` and ``exp_avg_sq``, SGD's
    ``momentum_buffer``), in key order. Those move with their expert; a scalar (AdamW's
    ``step``, the same for every slot of the parameter) stays. Empty before the first step.

    Raises:
        ValueError: a state tensor of another shape or sharding than its parameter (a
            factored second moment, say): it cannot follow the experts slot by slot.
    """
    if optimizer is None:
        return []
    out = []
    for key, value in sorted(optimizer.state.get(param, {}).items(), key=lambda kv: str(kv[0])):
        if not torch.is_tensor(value) or value.dim() == 0:
            continue
        if value.shape != param.shape or getattr(value, "placements", None) != getattr(param, "placements", None):
            raise ValueError(
                f"optimizer state {key!r} of {name} has shape {list(value.shape)} "
                f"{getattr(value, 'placements', '')}, its parameter {list(param.shape)} "
                f"{getattr(param, 'placements', '')}: only state of the parameter's shape and sharding can move with "
                "its experts"
            )
        out.append((key, value))
    return out


def _check_undeclared(model: nn.Module, specs: Sequence[ExpertsSpec], tensors: list[ExpertTensor]) -> None:
    """An experts module's parameter that the spec does not declare would stay behind while
    its expert moves: refuse when it looks per-expert (leading dim = number of slots)."""
    num_physical = max(s0 + ns for t in tensors for _, s0, ns, _ in t.holdings)
    for name, mod, spec, _ in expert_layers(model, specs):
        if getattr(mod, "moeshard_lora", ()):
            raise ValueError(
                f"experts module {name} carries LoRA adapters (peft), which relocate does not move yet: "
                "save the adapter (moeshard.lora.save_adapter), relocate the base model, load the adapter again"
            )
        declared = {p.name for p in spec.params}
        for pname, p in mod.named_parameters(recurse=False):
            if pname not in declared and p.dim() and p.shape[0] == num_physical:
                raise ValueError(
                    f"parameter {name}.{pname} of shape {list(p.shape)} looks per-expert but its experts "
                    f"spec declares only {sorted(declared)}: declare it (ExpertsSpec) so it moves with its expert"
                )


def _signature(target: ExpertTensors) -> list:
    return [(key, [(tuple(t.shape), str(t.dtype)) for t in target[key]]) for key in sorted(target)]


def _check_same_tensors(everyone: list) -> None:
    """Plain expert tensors must agree in layers, shapes and dtypes on every rank (given
    every rank's :func:`_signature`)."""
    ref = everyone[0]
    for r, sig in enumerate(everyone):
        if [k for k, _ in sig] != [k for k, _ in ref]:
            raise ValueError(f"rank {r} has expert layers {[k for k, _ in sig]}, rank 0 has {[k for k, _ in ref]}")
        for (key, a), (_, b) in zip(sig, ref):
            if len(a) != len(b):
                raise ValueError(f"layer {key}: rank {r} has {len(a)} expert tensors, rank 0 has {len(b)}")
            for j, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    raise ValueError(
                        f"layer {key} tensor {j}: rank {r} has shape {list(x[0])} {x[1]}, rank 0 has "
                        f"shape {list(y[0])} {y[1]}"
                    )


def _ep_ranks(target: ExpertTensors, new: Placement, active_ranks, world: int) -> np.ndarray | None:
    """For plain tensors: the EP rank of every rank of the group, or None when they are the
    same (the group has one rank per EP rank, dead ones included). A group of fewer ranks (the
    survivors of a lost rank) plays the active EP ranks, in order."""
    first = next((ts for ts in target.values() if len(ts)), None)
    if first is None:
        raise ValueError("the expert tensors hold no layer")
    slots = int(first[0].shape[0]) if first[0].dim() else 0
    if slots < 1 or new.num_physical % slots:
        raise ValueError(
            f"the expert tensors hold {slots} slots per rank, which does not divide the placement's "
            f"{new.num_physical} slots"
        )
    ep_size = new.num_physical // slots
    if world == ep_size:
        return None
    act = None if active_ranks is None else np.asarray(active_ranks, dtype=bool).reshape(-1)
    if act is None or len(act) != ep_size or int(act.sum()) != world:
        raise ValueError(
            f"the group has {world} ranks, the placement's {new.num_physical} slots make {ep_size} EP ranks of "
            f"{slots} slots: pass active_ranks with one bool per EP rank and as many True as the group has ranks "
            f"(group rank i then holds the slots of the i-th active EP rank), got "
            f"{'none' if act is None else f'{len(act)} entries, {int(act.sum())} True'}"
        )
    return np.flatnonzero(act)


def _active_global(active_ranks, tensors: Sequence[ExpertTensor], num_physical: int, world: int) -> np.ndarray:
    """``bool[world]`` from ``active_ranks`` given per EP rank (or per global rank)."""
    if active_ranks is None:
        return np.ones(world, dtype=bool)
    act = np.asarray(active_ranks, dtype=bool).reshape(-1)
    if len(act) == world:
        return act
    spr = min(ns for t in tensors for _, _, ns, _ in t.holdings if ns) if tensors else 0
    if not spr or num_physical % spr or len(act) != num_physical // spr:
        raise ValueError(
            f"active_ranks has {len(act)} entries; expected one per EP rank "
            f"({num_physical // spr if spr else '?'}) or one per rank ({world})"
        )
    out = np.ones(world, dtype=bool)
    for t in tensors:
        for r, s0, ns, _ in t.holdings:
            if ns:
                out[r] &= act[s0 // spr]
    return out


def _job_summary(plan: RelocationPlan, rank: int) -> dict:
    """Collective (every rank of the group, each with its own plan): the job's cost summary.
    A rank plans only its component (:class:`~moeshard.plan.relocation.RelocationPlan`); the
    components' counters are put together with one all-reduce (max) of a ``[components,
    counters]`` table, each component's row filled in by its own ranks (all with the same
    figures). Nothing is exchanged when every rank's plan is the whole job's."""
    if plan.whole_job:
        return plan.cost.summary()
    table = np.zeros((plan.num_components, len(COUNTERS)), dtype=np.int64)
    k = int(plan.component[rank])
    if k >= 0:
        table[k] = plan.cost.counters()
    return job_summary(collectives.all_reduce_max(table, "moeshard.relocate: the job's counters"))


def _check_disk_keys(plan: RelocationPlan, index: CheckpointIndex, sources) -> None:
    """Every tensor of every expert read from the checkpoint exists there with a fitting shape
    and a dtype the cast rule allows into the tensor's (load's check: an FP8 weight goes into a
    float tensor only with its block scale, and is dequantized as it is read)."""
    for layer, expert in plan.disk_experts:
        for t, et in enumerate(plan.tensors):
            if et.layer != layer:
                continue
            src = sources[t]
            if src is not None and src.zeros:
                continue
            if src is None:
                raise ValueError(
                    f"{et.name}: logical expert {expert} must be read from the checkpoint, but no "
                    "expert_params say which checkpoint keys hold it"
                )
            desc = ParamDesc(
                et.name, (0, *et.slice_shape), src.dtype, None, (), (), ExpertRef(layer, src.module, src.param)
            )
            expert_part_sizes(desc, index, expert, et.slice_shape, dequantize=True)


@collectives.runs_on_group
def relocate(
    target: nn.Module | ExpertTensors,
    old: Placement | None,
    new: Placement,
    checkpoint: str | os.PathLike | None = None,
    active_ranks: Sequence[bool] | np.ndarray | None = None,
    *,
    storage: Storage = "auto",
    topology: Topology | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    max_ops: int = DEFAULT_MAX_OPS,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    expert_params: Sequence[ExpertParam] | None = None,
    module: str | Callable[[int], str] = "model.layers.{layer}.mlp.experts",
    from_checkpoint: bool = False,
    progress: bool | None = None,
    transactional: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
    routing: str = "auto",
    group=None,
) -> RelocationReport:
    """Collective (every rank of ``group``): move expert weights from placement ``old`` to
    ``new`` in place; only slots whose expert changes are written.

    Args:
        target: a model prepared by moeshard (expert params ``[num_physical, ...]``, DTensor
            or plain), or plain expert tensors ``{layer: [tensor[num_local_slots, ...], ...]}``
            (every tensor of an expert: weights, biases, scales), EP group = ``group``.
        old, new: the current placement and the wanted one (e.g. from
            :func:`moeshard.eplb.rebalance`); slots of inactive ranks must be empty in ``new``.
            ``old=None``: the tensors hold nothing yet; fill them all from the checkpoint.
        checkpoint: read experts that no live rank holds from here (just those slices).
        active_ranks: ``bool`` per EP rank (or per rank): dead ranks' memory is not used.
            With plain tensors and a ``group`` of the live ranks only (the survivors of a lost
            rank, in a new process group), the group has one rank per True entry and its rank
            ``i`` holds the slots of the ``i``-th active EP rank. Otherwise dead ranks are
            members of ``group`` and call this function (they send and receive nothing).
        storage: which ranks read the checkpoint ("auto", "shared", "node", "single"); only
            active ranks read. "single" means "only rank 0 reads while it is active": with
            rank 0 dead, the active ranks that see the files read instead.
        topology: ranks per node (default: torchrun's environment).
        staging_bytes: per-rank budget for data in flight in one round.
        max_ops: P2P ops per rank in one batch.
        expert_params, module: for plain tensors, the checkpoint keys of tensor ``j`` of a
            layer are ``expert_params[j].keys(module.format(layer=key), expert)``.
        from_checkpoint: read every changed slot from the checkpoint, ignoring live copies
            (refused with ``optimizer``: the checkpoint holds older weights and no state).
        progress: show progress on local rank 0 of each node (a bar on a terminal, log
            lines otherwise); default: the ``MOESHARD_PROGRESS`` environment variable.
        transactional: keep what this rank's slots held before they are overwritten (in host
            memory for accelerator tensors: the bytes this rank writes) and put it back if the
            relocation fails, so that each rank's slots are either all old or all new (see
            "Failures" below). ``False`` saves that memory and copy; a failed relocation then
            leaves the slots it was changing undefined. Without ``old`` nothing is kept.
        optimizer: a model's optimizer: the state it keeps per element of an expert
            parameter (AdamW's ``exp_avg``, ``exp_avg_sq``; :func:`expert_states`) moves with
            the expert, so training goes on as if nothing moved (scalars such as ``step`` stay).
            Copies of a redundant expert hold the same state: after every optimizer step the
            first copy's is copied over the others (:mod:`moeshard.models.copies`). An expert
            read from the checkpoint (no live copy) starts from zero state. Every rank passes its optimizer, or none.
        routing: who sends a model's tokens to the new slots afterwards
            (:mod:`moeshard.models.routing`). ``"auto"``: moeshard does, or the call refuses
            before anything moves. It re-points its own EP forward (:func:`moeshard.parallelize`'s);
            an experts module that transformers made expert-parallel
            (``from_pretrained(..., distributed_config=DistributedConfig(ep_size=...))``, whose
            forward sends logical expert e to slot e) gets moeshard's EP forward, which routes by
            the placement, with transformers' gradient convention (a transformers-built model
            has one slot per logical expert: no redundant copies, and ``old`` must be its
            contiguous layout); a module without a forward has nothing to route. Any other
            experts module (its own dispatch, a torchtitan model, a transformers model in one
            process) is refused, naming it. ``"caller"``: the caller routes those modules' tokens
            by ``new`` itself (its own dispatch reads ``new.phy2log`` / ``log2phy``); moeshard
            moves the weights, re-points its own EP forward and changes no other forward. Plain
            tensors are the caller's to route: ``routing`` does not apply to them.
        group: the process group that relocates (default: the default group): the survivors
            of a lost rank, a group with a joiner that was never in the old one, or one EP
            group of a larger job. Ranks in plans and messages are its ranks; a model's device
            meshes must lie within it; ``topology`` defaults to its members' nodes.

    Failures: a relocation that fails once weights move (a peer dies, a read fails) raises on
    every rank (on a dead rank's direct peers at once, on the others at the latest when the
    backend's timeout ends the closing agreement) and each rank that raises has its slots and,
    for a model, its routing back at ``old``: recover with ``relocate(target, old, ...)`` (the
    survivors: ``group=``, ``active_ranks=``). A rank returns only after every rank ran the whole
    plan. The one case of ranks ending on different sides: a peer dying *during* that closing
    agreement, after some ranks completed it; ranks that returned then hold ``new``, the others
    ``old`` (exchange which in the recovery group and build the placement from each rank's
    rows, :meth:`~moeshard.placement.Placement.by_rank`).

    Raises:
        DistributedError: on every rank, before any weight changes, for a bad input (placements
            that differ across ranks or do not fit the tensors, a new slot on a dead rank, an
            expert with no live copy and no checkpoint, tensors that disagree across ranks, an
            experts module whose routing moeshard cannot update, see ``routing``), also where
            only one rank's argument is bad (an ``old`` other than its model's placement, a
            ``routing`` or topology it alone passed, no checkpoint where one is needed): that
            rank is named.
        PeerLostError: on the ranks that saw a peer die or the network fail (a
            DistributedError naming the step and, for P2P, the peers).
    """
    meter = OpMeter()
    options = _PlanOptions(staging_bytes, max_ops, from_checkpoint)
    planned = _describe_and_plan(
        target, old, new, topology, group, active_ranks, specs, expert_params, module, optimizer, routing, options
    )
    old, topo = planned.old, planned.topology
    reads = _plan_checkpoint_reads(target, checkpoint, storage, planned, old, new, topo, specs, options)
    t_plan = meter.end("plan")
    stats = _execute(target, reads, planned.locals_, topo, progress, transactional and old is not None)
    meter.end("execute")
    _reroute(target, planned.routes, new, routing)
    return _report(reads.plan, topo, meter, t_plan, stats)


def _checked_old(target, old: Placement | None, optimizer, routing: str, from_checkpoint: bool) -> Placement | None:
    """The arguments :func:`relocate` refuses before any exchange, and ``old`` resolved
    against a moeshard model's own placement."""
    if optimizer is not None and not isinstance(target, nn.Module):
        raise ValueError("optimizer= needs a model (plain expert tensors have no optimizer to look up)")
    if optimizer is not None and from_checkpoint:
        # The checkpoint is older than the live weights and holds no optimizer state: the moved
        # experts would go back to it and their state to zero, not "as if nothing moved".
        raise ValueError(
            "from_checkpoint=True with optimizer=: the moved experts would be re-read from the checkpoint "
            "(older than the live weights) and their optimizer state reset to zero; relocate from the live "
            "copies (from_checkpoint=False) to keep training"
        )
    if routing not in ROUTING_MODES:
        raise ValueError(f"routing={routing!r}: expected one of {list(ROUTING_MODES)}")
    if isinstance(target, nn.Module) and old is not None and model_placement(target) is not None:
        # The experts are where moeshard's forward routes tokens: an ``old`` that says otherwise
        # would move the wrong slots (check_routing judges other forwards' ``old``).
        return resolve_placement(target, old, "moeshard.relocate (old)")
    return old


def _report(plan: RelocationPlan, topo: Topology, meter: OpMeter, t_plan: float, stats: ExecStats) -> RelocationReport:
    """Collective (every rank of the relocation, :func:`_job_summary`): the report."""
    c = _job_summary(plan, topo.rank)
    return RelocationReport(
        rank=topo.rank,
        world_size=topo.world_size,
        wall_seconds=meter.seconds(),
        plan_seconds=t_plan,
        copies=dict(c["copies"]),
        bytes=dict(c["bytes"]),
        network_bytes=c["network_bytes"],
        min_network_bytes=c["min_network_bytes"],
        cross_node_bytes=c["cross_node_bytes"],
        min_cross_node_bytes=c["min_cross_node_bytes"],
        num_rounds=c["num_rounds"],
        num_stashes=c["num_stashes"],
        disk_experts=plan.disk_experts,
        bytes_sent_rank=stats.bytes_sent,
        bytes_received_rank=stats.bytes_received,
        bytes_read_rank=stats.bytes_read,
        peak_staging_bytes_rank=stats.peak_staging_bytes,
        plan=c,
        fingerprint=plan.fingerprint,
        phase_seconds=meter.phases.seconds,
        phase_cpu_seconds=meter.phases.cpu_seconds,
    )


class _PlanOptions(NamedTuple):
    """:func:`relocate`'s arguments that every plan of one relocation takes, in
    :func:`~moeshard.plan.relocation.plan_relocation`'s order."""

    staging_bytes: int
    max_ops: int
    from_checkpoint: bool


@dataclass(frozen=True)
class _Planned:
    """What every rank agreed on from the live copies alone: the expert tensors, this rank's
    local ones (None where it holds nothing) and their checkpoint sources, the active ranks
    (``bool[world]``), the plan (as if every live rank could read), and for a model who
    routes its tokens afterwards (:func:`~moeshard.models.routing.check_routing`)."""

    tensors: list[ExpertTensor]
    locals_: list[torch.Tensor | None]
    sources: list[_Source | None]
    active: np.ndarray
    plan: RelocationPlan
    routes: object
    old: Placement | None
    topology: Topology


def _describe_and_plan(
    target,
    old: Placement | None,
    new: Placement,
    topology: Topology | None,
    group,
    active_ranks,
    specs,
    expert_params,
    module,
    optimizer,
    routing: str,
    options: _PlanOptions,
) -> _Planned:
    """Collective (every rank of the relocation): check this rank's arguments (:func:`_checked_old`,
    the topology), describe the expert tensors, check them against both placements, and plan
    from the live copies; agreed on the plan's fingerprint (and, for plain tensors, their layers,
    shapes and dtypes: ranks that differ are named). A rank's bad argument raises here on every
    rank, before any of them waits on it."""
    # Plain tensors: their layers, shapes and dtypes are part of what the ranks agree on below
    # (in the fingerprint); every rank's are gathered only when the ranks disagree, to name them.
    signature = None if isinstance(target, nn.Module) else _signature(target)

    def describe() -> _Planned:
        old_ = _checked_old(target, old, optimizer, routing, options.from_checkpoint)
        topo = group_topology(topology, group)
        rank, world = topo.rank, topo.world_size
        # Before anything moves: who routes the tokens afterwards (refused here, on every rank).
        routes = check_routing(target, old_, new, routing, specs) if isinstance(target, nn.Module) else None
        ep_ranks = None if isinstance(target, nn.Module) else _ep_ranks(target, new, active_ranks, world)
        tensors, locals_, sources = describe_expert_tensors(
            target, world, specs, expert_params, module, ep_ranks, optimizer
        )
        for p, what in ((old_, "old"), (new, "new")):
            if p is not None:
                _check_fits(p, what, tensors, ep_ranks is None)
        active = _active_global(active_ranks, tensors, new.num_physical, world)
        # First plan as if every live rank could read: it tells whether the checkpoint is needed.
        plan = plan_relocation(tensors, old_, new, topo, active, active, *options, rank=rank)
        return _Planned(tensors, locals_, sources, active, plan, routes, old_, topo)

    def fingerprint(x: _Planned) -> str:
        if signature is None:
            return x.plan.fingerprint
        return f"{x.plan.fingerprint}:{hashlib.blake2b(repr(signature).encode(), digest_size=8).hexdigest()}"

    try:
        return collectives.agree(describe, "moeshard.relocate: planning", fingerprint)
    except collectives.PlanMismatchError:
        if signature is None:
            raise
        # Every rank is here (the mismatch is raised on all): name the tensors that differ.
        everyone = collectives.all_gather_object(signature, what="moeshard.relocate: comparing the expert tensors")
        collectives.unanimous(lambda: _check_same_tensors(everyone), "moeshard.relocate: comparing the expert tensors")
        raise


def _check_fits(p: Placement, what: str, tensors: Sequence[ExpertTensor], check_slots: bool) -> None:
    """Placement ``p`` (``what``: "old" or "new") has the tensors' MoE layers and, where
    ``check_slots`` (else :func:`_ep_ranks` checked them), their number of slots."""
    layers = 1 + max(t.layer for t in tensors)
    if p.num_layers != layers:
        raise ValueError(
            f"the {what} placement has {p.num_layers} layers, the experts have {layers} MoE layers ({ROW_RULE})"
        )
    for t in tensors if check_slots else ():
        top = max(s0 + ns for _, s0, ns, _ in t.holdings)
        if top != p.num_physical:
            raise ValueError(f"{t.name} has {top} expert slots, the {what} placement has {p.num_physical}")


@dataclass(frozen=True)
class _CheckpointReads:
    """The plan again, now with the ranks that can read the checkpoint, the tensors' sources
    in it, and this rank's reader (None where it reads nothing)."""

    plan: RelocationPlan
    sources: list[_Source | None]
    reader: CheckpointReader | None


def _plan_checkpoint_reads(
    target,
    checkpoint,
    storage: Storage,
    planned: _Planned,
    old: Placement | None,
    new: Placement,
    topo: Topology,
    specs,
    options: _PlanOptions,
) -> _CheckpointReads:
    """Collective (every rank of the relocation): for experts with no live copy, agree on who
    reads ``checkpoint`` and plan again with those readers; every key read exists with a
    fitting shape and dtype, and every file a rank reads opens there. Every expert with a live
    copy: the live copies' plan as it is, and no reader (no exchange)."""
    if not planned.plan.disk_experts:  # the agreed plan's: the same answer on every rank
        return _CheckpointReads(planned.plan, planned.sources, None)

    def sees() -> tuple[str, bool]:
        if checkpoint is None:
            lost = planned.plan.disk_experts
            raise ValueError(
                f"{len(lost)} expert(s) have no live copy and no checkpoint was given "
                f"(layer, logical expert): {lost[:8]}{' ...' if len(lost) > 8 else ''}"
            )
        path = os.fspath(checkpoint)
        return path, os.path.exists(path)

    # One exchange: a rank given no checkpoint raises on every rank (with those given one), and
    # every rank's storage arguments for the readers.
    (path, can_read), everyone = collectives.agree_and_gather(
        sees,
        "moeshard.relocate: finding the checkpoint",
        share=lambda s: sources_share(s[1], storage, topo, planned.active),
    )
    rank = topo.rank
    _, readers, _, index = resolve_sources(path, storage, topo, can_read, active=planned.active, everyone=everyone)
    if isinstance(target, torch.nn.Module) and keeps_packed(target, specs):  # read the stored packed bytes
        index = index.without_packed(KEEPS_PACKED)

    def replan() -> _CheckpointReads:
        sources = planned.sources
        if isinstance(target, nn.Module):  # the model's keys in this checkpoint (per expert, or fused)
            found = iter(
                [
                    _Source(d.expert.module, d.expert.param, d.dtype)
                    for d in describe_model(target, index, specs)
                    if d.expert is not None
                ]
            )
            sources = [src if src.zeros else next(found) for src in sources]
            assert next(found, None) is None and len(sources) == len(planned.tensors)
        p = plan_relocation(planned.tensors, old, new, topo, planned.active, readers, *options, rank=rank)
        _check_disk_keys(p, index, sources)
        if p.moves and any(m.read == rank for m in p.moves):
            r = CheckpointReader(index, reader_root(path))
            r.check_keys(_disk_keys(p, rank, sources))
            return _CheckpointReads(p, sources, r)
        return _CheckpointReads(p, sources, None)

    return collectives.agree(
        replan, "moeshard.relocate: planning checkpoint reads", fingerprint=lambda x: x.plan.fingerprint
    )


def _execute(
    target,
    reads: _CheckpointReads,
    locals_,
    topo: Topology,
    progress: bool | None,
    transactional: bool,
) -> ExecStats:
    """Collective (every rank of the relocation): :func:`_run` the plan with its checkpoint
    reads, then close this rank's reader (also when the run fails)."""
    try:
        return _run(target, reads.plan, locals_, reads.sources, reads.reader, topo, progress, transactional)
    finally:
        if reads.reader is not None:
            reads.reader.close()


def _reroute(target, routes, new: Placement, routing: str) -> None:
    """A model's tokens go where the experts are now: transformers' EP experts get moeshard's
    EP forward (``routing="auto"``), moeshard's EP forward routes by ``new``. Nothing for
    plain tensors (their caller routes)."""
    if isinstance(target, nn.Module):
        if routing == "auto":
            take_over(routes, new)  # transformers' EP experts: moeshard's EP forward, by the placement
        set_placement(target, new)  # route tokens to where the experts are now


def _run(
    target,
    plan: RelocationPlan,
    locals_,
    sources,
    reader: CheckpointReader | None,
    topo: Topology,
    progress: bool | None,
    transactional: bool,
) -> ExecStats:
    """Collective (every rank of the relocation): run this rank's rows of ``plan`` into its
    local expert tensors; with ``transactional``, what they held is put back if any rank fails."""
    rank = topo.rank
    with torch.no_grad():
        s = plan.schedule_for(rank)  # this rank's rows only (the job's would be O(world))
        bar = progress_bar("relocate", s.delivered_bytes(rank), progress, topo)
        device = (
            target_device(target)
            if isinstance(target, nn.Module)
            else next((x.device for x in locals_ if x is not None), torch.device("cpu"))
        )
        what = "moeshard.relocate: running the plan"
        sink = TensorSink(s, locals_, rank)
        # Old or new, never a mix: what this rank's deliveries overwrite is kept aside until
        # every rank has run the whole plan (the agreement below), and put back otherwise.
        backup = Backup(s, sink, rank) if transactional else None
        try:
            return collectives.agree(
                lambda: execute_schedule(
                    s,
                    rank,
                    _ExpertSource(plan, s, rank, locals_, reader, sources, device),
                    sink,
                    device,
                    progress=bar.update,
                    what=what,
                ).check(),
                what,
            )
        except BaseException:
            if backup is not None:
                backup.restore()
            raise
        finally:
            bar.close()


@dataclass(frozen=True)
class RelocationStep:
    """One chunk of :func:`relocate_chunks`: the MoE layers it moved, the placement in force
    after it (route tokens by it until the next chunk), and its relocation report."""

    layers: tuple[int, ...]
    placement: Placement
    report: RelocationReport


def relocate_chunks(
    target: nn.Module | ExpertTensors,
    old: Placement,
    new: Placement,
    *,
    layers_per_chunk: int | None = None,
    max_bytes: int | None = None,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    optimizer: torch.optim.Optimizer | None = None,
    **kwargs,
) -> Iterator[RelocationStep]:
    """Move from ``old`` to ``new`` a few layers at a time, so that serving (or training) goes
    on between chunks. Each ``next()`` is collective (every rank of ``group`` steps the iterator
    together) and is one :func:`relocate` call from the placement of the previous chunk to the
    next (:func:`moeshard.plan.chunks.relocation_chunks`: each layer's row is old until its
    chunk, new after it); a model's routing switches layer by layer, as its chunk completes.

    Args:
        layers_per_chunk: at most this many changed layers per chunk.
        max_bytes: at most this many bytes written per chunk on the whole job (a layer's
            changed slots times the bytes of one slot: every expert tensor, and the optimizer
            state that moves with it); a layer above it gets a chunk of its own.
        specs, optimizer, **kwargs: as :func:`relocate` (``checkpoint``, ``active_ranks``,
            ``group``, ...). Slots of dead ranks must be empty in ``old`` already: a chunked
            move cannot evacuate a dead rank (its old rows would stay in force until their
            chunk); recover with one :func:`relocate` call.

    Yields a :class:`RelocationStep` per chunk. Each chunk is transactional on its own
    (:func:`relocate`, "Failures"): after a failure every rank holds the placement of the
    last completed chunk (or its own next one; see there).
    """

    def chunks() -> list[tuple[tuple[int, ...], Placement]]:
        if old is None:
            raise ValueError(
                "relocate_chunks needs the old placement: a fill from the checkpoint (old=None) is one relocate call"
            )
        slot_bytes = _slot_bytes(target, specs, optimizer)
        return list(
            relocation_chunks(old, new, layers_per_chunk=layers_per_chunk, max_bytes=max_bytes, slot_bytes=slot_bytes)
        )

    def fingerprint(steps) -> str:
        return hashlib.blake2b(
            repr([(layers, p.fingerprint()) for layers, p in steps]).encode(), digest_size=8
        ).hexdigest()

    # Every rank steps through the same chunks (each a relocate call): a rank whose arguments make
    # other chunks, or none, raises with the others here instead of leaving them in a relocate.
    with collectives.scope(kwargs.get("group")):
        steps = collectives.agree(chunks, "moeshard.relocate_chunks: planning the chunks", fingerprint)
    for layers, placement in steps:
        report = relocate(target, old, placement, specs=specs, optimizer=optimizer, **kwargs)
        yield RelocationStep(layers, placement, report)
        old = placement


def _slot_bytes(target: nn.Module | ExpertTensors, specs: Sequence[ExpertsSpec], optimizer) -> np.ndarray:
    """``int64[num_moe_layers]``: bytes of one expert slot per MoE layer (every expert tensor,
    and a model's optimizer state that moves with it). Local, from shapes only."""
    if not isinstance(target, nn.Module):
        return np.array(
            [sum(math.prod(t.shape[1:]) * t.element_size() for t in target[key]) for key in sorted(target)],
            dtype=np.int64,
        )
    params = dict(target.named_parameters(remove_duplicate=False))
    out: dict[int, int] = {}
    for d in describe_model(target, None, specs):
        if d.expert is not None:
            states = expert_states(optimizer, params[d.name], d.name)
            sizes = [d.dtype.itemsize] + [st.element_size() for _, st in states]
            out[d.expert.layer] = out.get(d.expert.layer, 0) + math.prod(d.shape[1:]) * sum(sizes)
    return np.array([out[k] for k in sorted(out)], dtype=np.int64)


def _disk_keys(plan: RelocationPlan, rank: int, sources) -> set[str]:
    keys = set()
    for m in plan.moves:
        if m.read == rank:
            for part in plan.parts[(m.layer, m.column)][m.part]:
                src = sources[part.tensor]
                if not src.zeros:
                    keys.update(src.param.keys(src.module, m.expert))
    return keys


class _ExpertSource(Source):
    """Pieces of a relocation schedule: old slot contents (views of the local expert tensors)
    and, for experts no live rank holds, expert slices read from the checkpoint."""

    def __init__(
        self, plan: RelocationPlan, schedule: Schedule, rank: int, locals_, reader, sources, device: torch.device
    ):
        self.s, self.plan, self.reader, self.sources, self.device = schedule, plan, reader, sources, device
        self.local = LocalTensors(schedule, locals_, rank)

    def dtype(self, pid: int) -> torch.dtype:
        t = int(self.s.pieces.key[pid])
        src = self.sources[t]
        return src.dtype if src is not None else self.local.tensors[t].dtype

    def view(self, v: int, pid: int) -> torch.Tensor:
        return self.local.view(v, pid)

    def read(self, pid: int) -> torch.Tensor:
        s = self.s
        t, nd = int(s.pieces.key[pid]), int(s.key_ndim[s.pieces.key[pid]])
        expert = int(s.pieces.off[pid, 0])
        box = tuple(zip(s.pieces.off[pid, 1:nd].tolist(), s.pieces.len[pid, 1:nd].tolist()))
        src = self.sources[t]
        if src.zeros:  # optimizer state of an expert whose every copy is lost
            return torch.zeros((1, *box_shape(box)), dtype=self.dtype(pid), device=self.device)
        buf = torch.empty((1, *box_shape(box)), dtype=self.dtype(pid), device=self.device)
        try:
            shape = self.plan.tensors[t].slice_shape
            read_expert_box(self.reader, src.param, src.module, expert, box, buf[0], shape[0] if shape else 0)
        except Exception as e:
            layer = self.plan.tensors[t].layer
            raise OSError(
                f"reading logical expert {expert} of layer {layer}: {e} (the relocation fails on every rank)"
            ) from e
        return buf
