"""``moeshard.refit``: the trainer's live shards into a serving engine's tensors, P2P.

Reinforcement learning moves the weights after every training step from the trainer's layout
(EP x FSDP2 DTensors, float32 or bf16 masters) into the engine's (fused ``qkv_proj`` and
``w13_weight``, TP shards, expert slots in the engine's own placement). A refit is a reshard
whose destination is an :class:`~moeshard.plan.refit.EngineLayout`: every box of an engine
tensor comes from one live holder (a copy where the engine rank holds it itself, else one
send), so the bytes sent are the least any plan sends; nothing is gathered whole anywhere.

Steps (collective, every rank of ``group``: trainer ranks, engine ranks, or both):
check each rank's arguments and exchange who holds the trainer (one exchange) -> the first
trainer rank's layout to every rank (unless every rank kept it) -> plan this rank's transfers
(pure: :func:`moeshard.plan.refit.plan_refit`) -> agree on the inputs' fingerprint and the pair
check (one exchange; a repeated refit whose every rank kept its plan agrees on them in the first
exchange) -> per install batch (consecutive install groups, a decoder layer's engine tensors
each, as many as the staging budget holds): run the batch's schedule
(:class:`~moeshard.execute.ViewExchange`: small pieces between two ranks in a round travel as
one message; received pieces kept in it), agree, copy into the engine's tensors -> optional
verify -> report. A failure on any rank (a bad argument, a lost peer) raises on every rank;
every engine layer is then all old or all new.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .. import collectives
from ..execute import LocalTensors, ViewExchange, piece_lists
from ..models.adapters import DEFAULT_SPECS, ExpertsSpec
from ..models.describe import local_tensor
from ..models.ep import routing_tables
from ..models.shards import shard_boxes
from ..plan import DEFAULT_MAX_OPS, DEFAULT_STAGING_BYTES
from ..plan.refit import EngineLayout, RefitPlan, UnitInfo, check_pairs, plan_refit
from ..plan.reshard import BoxRows
from ..topology import Topology
from . import engine_quant
from .report import OpReport, Phases
from .reshard import ShardLayout, describe_shards
from .skeleton import group_topology, named_tensors

__all__ = ["RefitReport", "RefitVerifyError", "RefitInputs", "refit", "plan_for", "refit_inputs"]


class RefitVerifyError(collectives.DistributedError):
    """Raised on every rank by :func:`refit` with ``verify=True`` when an engine box differs
    from the trainer's (its digest); the message names the engine tensor, slot and box."""


@dataclass(frozen=True, kw_only=True)
class RefitReport(OpReport):
    """What a refit did (``*_rank``: this rank's; the others job-wide).

    Args:
        peer_bytes, copy_bytes: bytes sent between ranks and copied within a rank (planned, in
            the wire dtype: the engine's where it is narrower than the trainer's).
        groups: install groups run (each installed whole).
        batches: install batches run (groups that fit the staging budget together: one
            schedule and one agreement each, installed whole).
        engine_tensors_rank: engine tensors this rank installed.
        verified_boxes_rank: boxes this rank checked by digest (0 without ``verify``).
    """

    peer_bytes: int = 0
    copy_bytes: int = 0
    groups: int = 0
    batches: int = 0
    engine_tensors_rank: int = 0
    verified_boxes_rank: int = 0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsizes(names) -> dict[str, int]:
    return {n: torch.empty(0, dtype=getattr(torch, n)).element_size() for n in set(names)}


def _unit_info(shared: ShardLayout) -> UnitInfo:
    shapes, dtypes, experts = {}, {}, set()
    for t in shared.tensors:
        if t.layer >= 0:
            shapes[t.name], dtypes[t.name] = tuple(t.shape[1:]), t.dtype
            experts.add(t.name)
        else:
            shapes[t.name], dtypes[t.name] = tuple(t.shape), t.dtype
    return UnitInfo(shapes, dtypes, frozenset(experts), shared.num_logical)


def _holdings(shared: ShardLayout, trainers: Sequence[int], info: UnitInfo, width: int) -> BoxRows:
    """The trainer ranks' boxes of every unit (ids: ``info.unit_base()``), from the layout's
    arithmetic (each tensor's shard boxes, on the ranks of ``trainers``)."""
    i64 = np.int64
    base = info.unit_base()
    is_trainer = np.zeros(shared.world_size, bool)
    is_trainer[np.asarray(trainers, i64)] = True
    made: dict[tuple, tuple[np.ndarray, ...]] = {}  # tensors sharded alike share their rows

    def rows_of(t) -> tuple[np.ndarray, ...]:
        key = (t.shape, t.placements, None if t.mesh is None else (t.mesh.shape, t.mesh.tobytes()))
        got = made.get(key)
        if got is None:
            nd = len(t.shape)
            if t.mesh is None:
                ranks = np.arange(shared.world_size, dtype=i64)
                boxes = np.broadcast_to(
                    np.stack([np.zeros(nd, i64), np.asarray(t.shape, i64)], -1), (len(ranks), nd, 2)
                )
            else:
                ranks = np.asarray(t.mesh, i64).reshape(-1)
                boxes = shard_boxes(t.shape, t.mesh.shape, t.placements)
            keep = is_trainer[ranks] & (boxes[:, :, 1] > 0).all(axis=1)
            r, box = ranks[keep], boxes[keep]
            off, ln = np.zeros((len(r), width), i64), np.ones((len(r), width), i64)
            off[:, :nd], ln[:, :nd] = box[:, :, 0], box[:, :, 1]
            got = made[key] = (r, off, ln)
        return got

    parts = []
    for j, t in enumerate(shared.tensors):
        r, off, ln = rows_of(t)
        if t.layer < 0:
            parts.append(
                (np.full(len(r), base[t.name], i64), r, np.full(len(r), j, i64), np.full(len(r), -1, i64), off, ln)
            )
            continue
        n = ln[:, 0]  # local slots of each rank's box, in rank then slot order
        row = np.repeat(np.arange(len(r)), n)
        k = np.arange(len(row), dtype=i64) - np.repeat(np.cumsum(n) - n, n)
        e = shared.phy2log[t.layer, off[row, 0] + k].astype(i64)
        on = e >= 0
        row, k, e = row[on], k[on], e[on]
        # An expert's slice: the box past the slot dim.
        sub_off, sub_len = np.zeros((len(row), width), i64), np.ones((len(row), width), i64)
        sub_off[:, : width - 1], sub_len[:, : width - 1] = off[row, 1:], ln[row, 1:]
        parts.append((base[t.name] + e, r[row], np.full(len(row), j, i64), k, sub_off, sub_len))
    if not parts:
        return BoxRows.empty(width)
    cols = [np.concatenate([p[c] for p in parts]) for c in range(6)]
    return BoxRows(*cols, np.zeros((len(cols[0]), width), i64))


class RefitInputs(NamedTuple):
    """What every rank plans a refit from (:func:`refit_inputs`): the trainer's logical
    tensors, its ranks' holdings (unit ids: ``info.unit_base()``), bytes per element of every
    dtype name involved, and a description of where the holdings came from (for the plan's
    fingerprint)."""

    info: UnitInfo
    holds: BoxRows
    itemsize: dict[str, int]
    described: str


def refit_inputs(shared: ShardLayout, trainers: Sequence[int], layout: EngineLayout) -> RefitInputs:
    """Local and pure: the :class:`RefitInputs` of a trainer layout held by refit-group ranks
    ``trainers``, refit into ``layout``."""
    info = _unit_info(shared)
    width = max([len(t.shape) for t in shared.tensors] + [1])
    holds = _holdings(shared, trainers, info, width)
    sizes = _itemsizes([*info.dtypes.values(), *(t.dtype for t in layout.tensors if t.dtype)])
    return RefitInputs(info, holds, sizes, f"{shared.digest()} {list(trainers)}")


def plan_for(
    shared: ShardLayout,
    trainers: Sequence[int],
    layout: EngineLayout,
    topology: Topology,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    max_ops: int = DEFAULT_MAX_OPS,
    rank: int | None = None,
) -> RefitPlan:
    """Local and pure (torch only for dtype sizes): rank ``rank``'s refit plan (default:
    ``topology.rank``) from a trainer layout (:func:`~moeshard.ops.reshard.describe_shards`,
    any rank's) held by refit-group ranks ``trainers`` (the trainer's ranks are the refit
    group's) to ``layout``."""
    world = topology.world_size
    if shared.world_size != world:
        raise ValueError(f"the trainer's layout is of {shared.world_size} ranks, the refit group has {world}")
    if max(layout.ranks) >= world or min(layout.ranks) < 0:
        raise ValueError(f"engine ranks {list(layout.ranks)} outside the refit group's {world} ranks")
    got = refit_inputs(shared, trainers, layout)
    me = topology.rank if rank is None else rank
    return plan_refit(layout, got.info, got.holds, got.itemsize, topology, staging_bytes, max_ops, me, got.described)


_DIGESTS: dict = {}


def _digest(x: EngineLayout | ShardLayout) -> str:
    """``x.digest()``, kept for the same object with the same placement array contents (a
    refit digests the same layouts step after step; the placement is an array a caller may
    change in place)."""
    p2l = x.phy2log
    key = (id(x), None if p2l is None else np.ascontiguousarray(p2l, np.int64).tobytes())
    hit = _DIGESTS.get(key)
    if hit is None or hit[0] is not x:
        if len(_DIGESTS) > 8:
            _DIGESTS.clear()
        hit = _DIGESTS[key] = (x, x.digest())
    return hit[1]


# refit's default max_ops: pieces per rank and round (most travel packed: PACK_BYTES).
MAX_OPS = 1024

# The trainer layout of the last refit on this rank (every rank's alike): a refit whose trainer
# layout has the same digest on every rank skips sending it.
_SHARED: list = []

# The last plan, by what it is a function of (the trainer's and engine's layouts, the ranks, the
# topology and budgets): planning is pure, so a repeated refit reuses it (still agreed by
# fingerprint on every rank).
_PLANS: dict = {}


@dataclass(frozen=True)
class _Ready:
    """This rank's checked inputs: trainer layout and local shards (None / [] on an engine-only
    rank), the engine tensors in layout order and their scale tensors (None for an unquantized
    one; both None where this rank is not an engine rank)."""

    layout: ShardLayout | None
    shards: list
    dst: list | None
    scales: list | None = None


def _prepare(model, dst_tensors, layout: EngineLayout, specs, rank: int) -> _Ready:
    is_engine = rank in layout.ranks
    if is_engine and dst_tensors is None:
        raise ValueError(f"rank {rank} is an engine rank of the layout but passed no dst_tensors")
    if not is_engine and dst_tensors:
        raise ValueError(f"rank {rank} passed dst_tensors but is not among the layout's engine ranks")
    dst = scales = None
    if is_engine:
        names = [n for t in layout.tensors for n in (t.name, t.scale_name) if n]
        missing = [n for n in names if n not in dst_tensors]
        if missing:
            raise ValueError(f"dst_tensors lacks engine tensor {missing[0]} ({len(missing)} missing)")
        dst = [dst_tensors[t.name] for t in layout.tensors]
        scales = [dst_tensors[t.scale_name] if t.quant else None for t in layout.tensors]
    if model is None:
        return _Ready(None, [], dst, scales)
    params = named_tensors(model)
    key = _model_key(model, params, specs)
    shared = _LAYOUTS.get(key)
    if shared is None:
        shared = describe_shards(model, specs=specs)
        _LAYOUTS.clear()  # one kept: an RL loop refits the same model step after step
        _LAYOUTS[key] = shared
    shards = [local_tensor(params[t.name]) for t in shared.tensors]
    return _Ready(shared, shards, dst, scales)


# The last trainer layout (describe_shards), by what it is a function of (_model_key): the
# model's tensors (names, objects, local storage, shapes, dtypes, DTensor meshes and placements)
# and the placement its routing tables hold (a relocation changes it), and the specs. The key
# names objects by id: the cached layout keeps nothing alive, so the model (which holds its
# tensors and meshes) is in the key by id too, and a new model misses.
_LAYOUTS: dict = {}


def _model_key(model: nn.Module, params: Mapping[str, torch.Tensor], specs) -> tuple:
    cells = []
    for name, t in params.items():
        loc = local_tensor(t)
        mesh = getattr(t, "device_mesh", None)
        cells.append(
            (
                name,
                id(t),
                loc.data_ptr(),
                tuple(loc.shape),
                loc.dtype,
                tuple(t.shape),
                repr(getattr(t, "placements", ())),
                id(mesh),
            )
        )
    # The placement the routing tables hold (slot_placement's rows, without building it).
    tables = tuple((ep.layer, np.asarray(ep.phy2log, np.int64).tobytes()) for _, ep in routing_tables(model))
    return (id(model), tuple(id(x) for x in specs), tuple(cells), tables)


def _check_dst(plan: RefitPlan, layout: EngineLayout, dst: list, scales: list) -> None:
    for t, shape, dtype, x, scale in zip(layout.tensors, plan.needs.local_shapes, plan.needs.dtypes, dst, scales):
        if t.quant is not None:
            engine_quant.check_engine_tensor(t, x, scale, shape)
            continue
        if tuple(x.shape) != shape or _dtype_name(x.dtype) != dtype:
            raise ValueError(
                f"engine tensor {t.name}: {list(x.shape)} {_dtype_name(x.dtype)} here, the layout says {list(shape)} "
                f"{dtype}"
            )
        if not x.is_contiguous():
            raise ValueError(f"engine tensor {t.name} is not contiguous")


class _Exchanged(NamedTuple):
    """What the first exchange gives: this rank's checked inputs, the trainer ranks, the
    trainer's layout, the refit group's topology, and where every rank kept the last refit's plan for these inputs and
    the plans agree (the same fingerprint, a pair check summing to 0), that plan and every
    rank's ``(fingerprint, check, sent bytes, copied bytes)`` (else None, None: plan and agree)."""

    ready: _Ready
    trainers: list[int]
    shared: ShardLayout
    topo: Topology
    plan: RefitPlan | None
    shares: list | None


def _plan_key(shared_digest: str, trainers: Sequence[int], layout: EngineLayout, topo, staging_bytes, max_ops):
    return (shared_digest, tuple(trainers), _digest(layout), topo, staging_bytes, max_ops)


def _kept_plan(ready: _Ready, layout: EngineLayout, topo, staging_bytes: int, max_ops: int):
    """The plan kept from the last refit if this rank's own inputs match its key (the engine
    layout, topology and budgets; the trainer's layout and ranks are matched once every
    rank's are known) and this rank's engine tensors fit it: ``(plan, share)``, the share
    naming the plan's trainer layout and ranks; else None."""
    if len(_PLANS) != 1:
        return None
    ((key, plan),) = _PLANS.items()
    if key[2:] != _plan_key("", (), layout, topo, staging_bytes, max_ops)[2:]:
        return None
    if ready.layout is not None and _digest(ready.layout) != key[0]:
        return None
    if ready.dst is not None:
        try:
            _check_dst(plan, layout, ready.dst, ready.scales)
        except ValueError:
            return None  # planned and checked again, where the error is raised on every rank
    return plan, (key[0], _ranks_digest(key[1]), plan.fingerprint, plan.check, plan.sent_bytes, plan.copy_bytes)


def _ranks_digest(ranks: Sequence[int]) -> str:
    return hashlib.blake2b(repr(tuple(ranks)).encode(), digest_size=8).hexdigest()


def _exchange(
    model, dst_tensors, layout: EngineLayout, specs, rank: int, topology, group, staging_bytes, max_ops
) -> _Exchanged:
    """Collective: check every rank's arguments, find the trainer ranks, compare the layouts,
    give every rank the trainer's layout (sent only when some rank lacks the last one), and
    agree on the last refit's plans where every rank kept one for these inputs (one exchange
    for all of it)."""

    def step():
        ready = _prepare(model, dst_tensors, layout, specs, rank)
        topo = group_topology(topology, group)
        return ready, topo, _kept_plan(ready, layout, topo, staging_bytes, max_ops)

    gathered = collectives.agree_and_gather(
        step,
        "moeshard.refit: checking the arguments",
        share=lambda r: (
            r[0].layout is not None,
            _digest(layout),
            None if r[0].layout is None else _digest(r[0].layout),
            _digest(_SHARED[0]) if _SHARED else None,
            None if r[2] is None else r[2][1],
        ),
    )
    (ready, topo, kept), everyone = gathered.result, gathered.shares
    trainers = [r for r, e in enumerate(everyone) if e[0]]

    def _same():
        if not trainers:
            raise ValueError("no rank passed a trainer model")
        if len({e[1] for e in everyone}) != 1:
            raise ValueError("the engine layout differs between ranks")
        if len({e[2] for e in everyone if e[0]}) != 1:
            raise ValueError("the trainer's layout differs between trainer ranks")

    collectives.unanimous(_same, "moeshard.refit: comparing the layouts")
    held = everyone[trainers[0]][2]
    if all(e[3] is not None and e[3] == held for e in everyone):
        shared = _SHARED[0]  # every rank holds the trainer's layout already (the last refit's)
    else:
        shared = collectives.broadcast_object(
            None if ready.layout is None else ready.layout.shared(),
            src=trainers[0],
            what="moeshard.refit: trainer layout",
        )
        _SHARED[:] = [shared]
    # Every rank decides alike, from the gathered shares, whether the kept plans stand.
    kept_shares = [e[4] for e in everyone]
    if all(k is not None and k[0] == held and k[1] == _ranks_digest(trainers) for k in kept_shares) and all(
        e[3] == held for e in everyone
    ):
        shares = [k[2:] for k in kept_shares]
        try:
            check_pairs(shares)
        except ValueError:
            pass  # planned and agreed again, where a real mismatch raises on every rank
        else:
            return _Exchanged(ready, trainers, shared, topo, kept[0], shares)
    return _Exchanged(ready, trainers, shared, topo, None, None)


@collectives.runs_on_group
def refit(
    model: nn.Module | None,
    dst_tensors: Mapping[str, torch.Tensor] | None,
    layout: EngineLayout,
    *,
    verify: bool = False,
    topology: Topology | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    max_ops: int = MAX_OPS,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    device: torch.device | None = None,
    group=None,
) -> RefitReport:
    """Collective (every rank of ``group``: trainer ranks and engine ranks, colocated or
    disjoint): write the trainer's current weights into the engine's tensors.

    Args:
        model: the trainer model (:func:`moeshard.parallelize`, on a mesh of ``group``'s ranks)
            on a trainer rank; None on an engine-only rank. Only read.
        dst_tensors: on an engine rank, ``{engine tensor name: local tensor}`` for every tensor
            of ``layout`` (its local shape and dtype: an expert tensor ``[num_local_slots,
            *slice]``; a block-FP8 one ``float8_e4m3fn`` and its float32 scale under its
            ``scale_name``); None elsewhere. Written in place, one install group at a time.
        layout: the engine's tensors, ranks and placement (the same on every rank; the
            placement is the engine's current one, e.g. after an EPLB rebalance).
        verify: after the writes, compare a digest of every delivered box with the digest of
            its source box (cast alike; a block-FP8 tensor's box as staged, before quantization,
            and its installed values and scale blocks with those its quantization made); a
            difference raises :class:`RefitVerifyError` on every rank naming it.
        staging_bytes: per-rank budget for staging: the engine tensors of one install batch
            (consecutive install groups whose engine tensors fit it together, one schedule and
            one agreement per batch; a group larger than the budget alone) bound the pieces a
            rank receives and keeps until the batch is installed.
        max_ops: at most this many pieces a rank sends and receives in one round. The small
            ones (up to 1 MiB) between two ranks travel as one message, so a round posts at
            most two messages per peer plus its large pieces, whose number the staging budget
            bounds: the default (1024) lets a refit of small pieces run in few rounds.
        topology, specs: as :func:`moeshard.reshard`'s.
        device: where staging buffers live (default: the first engine tensor's device, else
            the trainer's).
        group: the refit group (default: the default group).

    Returns a :class:`RefitReport`.

    Raises:
        DistributedError: on every rank, for any rank's bad input (a missing or misshapen engine
            tensor, layouts that differ between ranks, a box no trainer rank holds); nothing
            written.
        PeerLostError: a rank died during the refit: the install batches done before are new,
            the others old (each engine layer all old or all new).
    """
    t0 = time.perf_counter()
    phases = Phases(t0)
    rank, world = collectives.rank_and_world()
    ready, trainers, shared, topo, plan, shares = _exchange(
        model, dst_tensors, layout, specs, rank, topology, group, staging_bytes, max_ops
    )
    phases.end("exchange")

    def make_plan():
        key = _plan_key(_digest(shared), trainers, layout, topo, staging_bytes, max_ops)
        plan = _PLANS.get(key)
        if plan is None:
            plan = plan_for(shared, trainers, layout, topo, staging_bytes, max_ops, rank)
            _PLANS.clear()  # one plan kept: an RL loop refits the same layouts step after step
            _PLANS[key] = plan
        if ready.dst is not None:
            _check_dst(plan, layout, ready.dst, ready.scales)
        return plan

    # Each rank plans its own transfers: the ranks agree that they planned from the same inputs
    # (the fingerprint) and that the two ends of every transfer planned it alike (the pair
    # check's terms sum to 0), in one exchange before any data moves; a repeated refit does it
    # in the first exchange (_exchange).
    if plan is None:
        gathered = collectives.agree_and_gather(
            make_plan,
            "moeshard.refit: planning",
            share=lambda p: (p.fingerprint, p.check, p.sent_bytes, p.copy_bytes),
        )
        plan, shares = gathered.result, gathered.shares
        collectives.unanimous(lambda: check_pairs(shares), "moeshard.refit: planning")
    peer_bytes = sum(s[2] for s in shares)
    copy_bytes = sum(s[3] for s in shares)
    t_plan = phases.end("plan") - t0
    wire = [getattr(torch, d) for d in plan.wire_dtypes]
    record = _QuantRecord() if verify else None
    sent, received, peak, installed = _install(plan, layout, ready, rank, wire, device, record)
    phases.end("install")
    checked = 0
    if verify:
        checked = _verify(plan, layout, ready, rank, record)
        phases.end("verify")
    return RefitReport(
        rank=rank,
        world_size=world,
        wall_seconds=time.perf_counter() - t0,
        plan_seconds=t_plan,
        fingerprint=plan.fingerprint,
        plan={"peer_bytes": peer_bytes, "copy_bytes": copy_bytes, "groups": len(plan.groups)},
        bytes_sent_rank=sent,
        bytes_received_rank=received,
        peak_staging_bytes_rank=peak,
        phase_seconds=phases.seconds,
        phase_cpu_seconds=phases.cpu_seconds,
        peer_bytes=peer_bytes,
        copy_bytes=copy_bytes,
        groups=len(plan.groups),
        batches=len(plan.plans),
        engine_tensors_rank=installed,
        verified_boxes_rank=checked,
    )


# Pieces up to this size that one rank sends another in the same round travel as one message
# (ViewExchange's pack_bytes): below it a message's latency costs more than the copy into the
# packed buffer (a cast the piece takes anyway where the wire dtype is narrower).
PACK_BYTES = 2**20


def _install(plan: RefitPlan, layout: EngineLayout, ready: _Ready, rank: int, wire, device, record=None):
    """Collective: per install batch (``plan.batches``: install groups that fit the staging
    budget together), run its schedule (received pieces kept in their messages; a quantized
    engine tensor staged whole and quantized), agree that every rank has all of it, then
    copy it into the engine's tensors (``record``: verify's :class:`_QuantRecord`, filled as
    quantized tensors are quantized). Returns this rank's bytes sent, received, peak staging
    bytes and engine tensors installed."""
    dev = device
    if dev is None:
        ref = ready.dst[0] if ready.dst else (ready.shards[0] if ready.shards else None)
        dev = ref.device if ref is not None else torch.device("cpu")
    group_of = [t.group for t in layout.tensors]
    batches = plan.batches or tuple((g,) for g in plan.groups)
    sent = received = peak = 0
    installed = 0
    for batch, p in zip(batches, plan.plans):
        what = f"moeshard.refit: install group{'s' if len(batch) > 1 else ''} {', '.join(map(str, batch))}"
        members = set(batch)
        stage: list = [None] * len(layout.tensors)
        into: list = [None] * len(layout.tensors)
        held = [False] * len(layout.tensors)
        staged = 0
        if ready.dst is not None:
            for j, t in enumerate(layout.tensors):
                if group_of[j] not in members:
                    continue
                if t.quant is not None:  # staged in float, quantized whole once it arrived
                    into[j] = stage[j] = engine_quant.staging(ready.dst[j], getattr(torch, plan.needs.dtypes[j]))
                    staged += stage[j].numel() * stage[j].element_size()
                else:  # written by install(), after the agreement (rows the engine pads never)
                    into[j], held[j] = ready.dst[j], True
                    installed += 1
        ex = ViewExchange(p.schedule, rank, ready.shards, wire, into, dev, held, what, PACK_BYTES)

        def run(ex=ex, stage=stage, p=p):
            stats = ex.run().check()
            _quantize(layout, stage, p.schedule, rank, record)
            return stats

        with torch.no_grad():
            # Installed only once every rank has every piece of the batch: each engine layer
            # is all old or all new, whichever rank or group failed.
            stats = collectives.agree(run, what)
            ex.install()
            for j, x in enumerate(stage):
                if x is not None:
                    engine_quant.install(ready.dst[j], ready.scales[j], x)
                    installed += 1
        sent += stats.bytes_sent
        received += stats.bytes_received
        peak = max(peak, stats.peak_staging_bytes + staged)
    return sent, received, peak, installed


# -- verify --------------------------------------------------------------------------------

_MIX = 0x9E3779B97F4A7C15 - 2**64  # as a signed int64


def digest(t: torch.Tensor) -> int:
    """A position-sensitive digest of ``t``'s bits (any shape, any dtype): the sum over its
    elements of their bits times a weight from their flat index, wrapping in int64."""
    flat = t.detach().contiguous().reshape(-1)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    x = flat.view(bits).to(torch.int64)
    idx = torch.arange(x.numel(), dtype=torch.int64, device=x.device)
    w = (idx * _MIX) ^ (idx >> 7) | 1
    return int((x * w).sum())


def _box_key(s, pid: int) -> tuple:
    """A piece as both ends of its transfer name it: its unit and box (piece numbers are each
    rank's own)."""
    return (int(s.pieces.key[pid]), s.piece_box(pid))


def _scale_blocks(t, idx: tuple[slice, ...]) -> tuple[slice, ...]:
    """The blocks of quantized engine tensor ``t``'s scale that cover box ``idx`` of its (slot's)
    ``[R, C]`` values."""
    return tuple(slice(i.start // b, -(-i.stop // b)) for i, b in zip(idx, t.block))


class _QuantRecord:
    """Verify's record of this engine rank's quantized deliveries, by ``(schedule id, delivery
    row)``: the digest of the box as staged (the staging dtype, before quantization), and of
    the FP8 values and the scale blocks its install group's quantization made of it."""

    def __init__(self) -> None:
        self.staged: dict[tuple[int, int], int] = {}
        self.values: dict[tuple[int, int], int] = {}
        self.scales: dict[tuple[int, int], int] = {}

    def quantize(self, layout: EngineLayout, stage: list, s, rank: int) -> None:
        lists = piece_lists(s)
        rows = [
            (row, *lists.index("deliveries", row, int(s.deliveries.piece[row])))
            for row in np.flatnonzero(s.deliveries.rank == rank).tolist()
            if layout.tensors[int(s.deliveries.param[row])].quant is not None
        ]
        for row, j, slot, idx in rows:
            x = stage[j] if slot < 0 else stage[j][slot]
            self.staged[(id(s), row)] = digest(x[idx])
        engine_quant.quantize_staged(layout.tensors, stage)
        for row, j, slot, idx in rows:
            q = stage[j]
            values, scale = (q.values, q.scale) if slot < 0 else (q.values[slot], q.scale[slot])
            self.values[(id(s), row)] = digest(values[idx])
            self.scales[(id(s), row)] = digest(scale[_scale_blocks(layout.tensors[j], idx)])


def _quantize(layout: EngineLayout, stage: list, s, rank: int, record: _QuantRecord | None) -> None:
    """Quantize the staged quantized tensors of an install batch (schedule ``s``), recording
    their digests for verify when ``record`` is given."""
    if record is None:
        engine_quant.quantize_staged(layout.tensors, stage)
    else:
        record.quantize(layout, stage, s, rank)


def _verify(plan: RefitPlan, layout: EngineLayout, ready: _Ready, rank: int, record: _QuantRecord) -> int:
    """Collective: every delivery's digest at its source (the trainer's box, cast to the
    engine tensor's dtype) against the engine's installed box, or for a quantized tensor its
    box as staged before quantization, and the installed FP8 values and scale blocks of the box
    against those its quantization made; :class:`RefitVerifyError` on every rank naming the
    first box that differs. Returns the boxes this rank checked."""
    eng_dtypes = [getattr(torch, d) for d in plan.needs.dtypes]
    mine: dict[tuple, int] = {}  # (plan, receiver, unit and box) -> digest at the source
    for gi, p in enumerate(plan.plans):
        s = p.schedule
        if not ready.shards:
            break
        local = LocalTensors(s, ready.shards, rank)
        dl = s.deliveries
        first_param = {}
        for pid, j in zip(dl.piece.tolist(), dl.param.tolist()):
            first_param.setdefault(pid, j)
        for row in np.flatnonzero(s.sends.src == rank).tolist():
            pid, dst, v = int(s.sends.piece[row]), int(s.sends.dst[row]), int(s.sends.view[row])
            dt = eng_dtypes[int(plan.send_params[gi][row])]
            mine[(gi, dst, _box_key(s, pid))] = digest(local.view(v, pid).to(dt))
        for c in np.flatnonzero(s.views.rank[s.copies.view] == rank).tolist():
            pid, v = int(s.copies.piece[c]), int(s.copies.view[c])
            dt = eng_dtypes[first_param[pid]]
            mine[(gi, rank, _box_key(s, pid))] = digest(local.view(v, pid).to(dt))
    every = collectives.all_gather_object(mine, what="moeshard.refit: verify digests")
    source = {}
    for d in every:
        source.update(d)
    checked = 0

    def check():
        nonlocal checked
        if ready.dst is None:
            return
        for gi, p in enumerate(plan.plans):
            s = p.schedule
            lists = piece_lists(s)
            for row in np.flatnonzero(s.deliveries.rank == rank).tolist():
                pid = int(s.deliveries.piece[row])
                j, slot, idx = lists.index("deliveries", row, pid)
                t = layout.tensors[j]
                want = source.get((gi, rank, _box_key(s, pid)))
                unit = s.keys[int(s.pieces.key[pid])]
                nd = int(s.key_ndim[s.pieces.key[pid]])
                box = list(zip(s.pieces.off[pid, :nd].tolist(), s.pieces.len[pid, :nd].tolist()))
                where = f"rank {rank}: engine tensor {t.name}{f' slot {slot}' if slot >= 0 else ''}"
                at = s.deliveries.off[row, :nd].tolist()
                checked += 1
                if t.quant is None:
                    got = digest(ready.dst[j][slot][idx] if slot >= 0 else ready.dst[j][idx])
                    if want != got:
                        raise RefitVerifyError(
                            f"{where} at {at} differs from box {box} of {unit} (digest {got:#x}, the trainer's "
                            f"{want if want is None else hex(want)})"
                        )
                    continue
                key = (id(s), row)
                got = record.staged[key]
                if want != got:
                    raise RefitVerifyError(
                        f"{where} at {at}, as staged before quantization ({plan.needs.dtypes[j]}), differs from box "
                        f"{box} of {unit} (digest {got:#x}, the trainer's {want if want is None else hex(want)})"
                    )
                values = ready.dst[j] if slot < 0 else ready.dst[j][slot]
                if digest(values[idx]) != record.values[key]:
                    raise RefitVerifyError(
                        f"{where} at {at} (box {box} of {unit}): its installed FP8 values differ from the "
                        "quantization of what arrived"
                    )
                scale = ready.scales[j] if slot < 0 else ready.scales[j][slot]
                blocks = _scale_blocks(t, idx)
                if digest(scale[blocks]) != record.scales[key]:
                    span = [[b.start, b.stop] for b in blocks]
                    raise RefitVerifyError(
                        f"{where}: its scale {t.scale_name} blocks {span} (of box {box} of {unit} at {at}) differ "
                        "from the quantization of what arrived"
                    )

    with collectives.errors_as(RefitVerifyError):
        collectives.agree(check, "moeshard.refit: verify")
    return checked
