"""``moeshard.load``: put checkpoint weights into an (EP + FSDP2) model, every rank its own.

Steps (all collective, every rank of the group calls ``load``):
materialize a meta model -> decide who can read -> one rank reads the headers and shares them ->
every rank plans the same :class:`~moeshard.plan.Schedule` from its own model (errors and fingerprints
agreed before any data moves) -> execute -> report.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from .. import collectives
from ..dtypes import cast_refusal
from ..execute import DequantSink, ExecStats, ReaderSource, TensorSink, execute_schedule, node_groups
from ..io.fp8 import FP8_DTYPES
from ..io.index import CheckpointIndex
from ..io.reader import CheckpointReader
from ..io.readpool import default_read_threads
from ..io.sources import Storage, reader_root, resolve_sources, sources_share
from ..models.adapters import DEFAULT_SPECS, ExpertsSpec
from ..models.describe import KEEPS_PACKED, ParamDesc, describe_model, keeps_packed, local_tensor
from ..models.layout import need_table
from ..models.routing import resolve_placement
from ..models.unused import ignored_patterns, unused_keys
from ..placement import Placement
from ..plan import DEFAULT_STAGING_BYTES, NeedTable, Schedule, minimal_cost, plan_transfers
from ..plan.scales import ScaleNeeds, scale_needs
from ..topology import Topology
from .report import OpReport
from .skeleton import OpMeter, group_topology, local_tensors, named_tensors, progress_bar

__all__ = [
    "LoadReport",
    "load",
    "plan_load",
    "materialize",
    "target_device",
    "checked_unused_keys",
    "refuse_or_warn",
    "float_params",
]

logger = logging.getLogger("moeshard")


@dataclass(frozen=True)
class LoadReport(OpReport):
    """What a load did. ``*_rank`` fields are this rank's; ``plan`` holds job-wide counters
    (bytes read/sent per rank summarized, bytes crossing nodes, ops, batches).

    ``peak_rss_bytes`` is this process's peak resident set size *during this load*, as the
    kernel counts it (``peak_rss_source == "vmhwm"``: Linux VmHWM, reset at the start of the
    load by writing 5 to ``/proc/self/clear_refs`` and read at its end). Where the high-water
    mark cannot be reset (not Linux, or /proc not writable) it falls back to ``"ru_maxrss"``:
    the peak over the process's whole life, which may be an earlier load's or allocation's.

    ``minimal`` holds :func:`moeshard.plan.minimal_cost` of the plan (lower bounds on bytes
    read, sent and crossing nodes) only when ``load(..., report_minimal=True)``; else ``{}``.

    ``unused_keys`` are the checkpoint keys no parameter or buffer reads (sorted; the same on
    every rank), see :func:`checked_unused_keys`. ``dequantized_keys``: how many FP8 weights
    (job-wide) were dequantized with their block scales (whose bytes the byte counts include),
    and packed quantized weights (MXFP4, NVFP4, INT4, FP8 per channel / tensor) with theirs.
    """

    storage: str
    checkpoint_bytes: int
    rss_before_bytes: int
    peak_rss_bytes: int
    minimal: dict = field(default_factory=dict)
    peak_rss_source: str = "vmhwm"
    unused_keys: tuple[str, ...] = ()
    dequantized_keys: int = 0


def target_device(model: nn.Module) -> torch.device:
    """Where ``model``'s local tensors live: its DTensor mesh's device type (the current
    device of that type), else the first non-meta parameter's device, else CUDA under NCCL."""
    from torch.distributed.tensor import DTensor

    for p in model.parameters():
        if isinstance(p, DTensor):
            kind = p.device_mesh.device_type
            break
        if p.device.type != "meta":
            return p.device
    else:
        kind = "cuda" if (collectives.is_dist() and torch.distributed.get_backend() == "nccl") else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, kind)
    return torch.device(kind, mod.current_device())


def materialize(model: nn.Module, device: torch.device | None = None) -> torch.device:
    """Allocate a meta-device model on its device (``to_empty``, keeping tied parameters
    tied) and recompute its non-persistent buffers (e.g. RoPE ``inv_freq``), which no
    checkpoint holds.

    A module's non-persistent buffers are rebuilt by constructing a fresh module of the same
    class from its ``config`` (as transformers' rotary modules allow), else by the transformers
    model's own ``_init_weights`` on a stand-in of the module (Gemma 4's ``embed_scale``); a
    module that cannot be rebuilt either way raises ValueError naming the buffer.
    """
    device = target_device(model) if device is None else device
    meta_buffers = [
        (name, mod)
        for name, mod in model.named_modules()
        if any(b.is_meta for n, b in mod.named_buffers(recurse=False) if n in mod._non_persistent_buffers_set)
    ]
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        tied = _tied_parameters(model)
        model.to_empty(device=device)
        for (mod, name), *aliases in tied:  # to_empty gives each module its own new tensor
            for alias_mod, alias in aliases:
                setattr(alias_mod, alias, getattr(mod, name))
    for name, mod in meta_buffers:
        config, fresh = getattr(mod, "config", None), None
        if config is not None:
            try:
                with torch.device("cpu"):
                    fresh = type(mod)(config)
            except TypeError:  # a constructor that takes more than the config (Gemma 4's audio layers)
                fresh = None
        if fresh is None:
            fresh = _initialized_by_model(model, mod)
        if fresh is None:
            names = sorted(mod._non_persistent_buffers_set)
            raise ValueError(
                f"module {name!r} ({type(mod).__name__}) has non-persistent buffers {names} that no "
                "checkpoint holds and no config to recompute them from; initialize them before loading"
            )
        for b_name in mod._non_persistent_buffers_set:
            local_tensor(getattr(mod, b_name)).copy_(getattr(fresh, b_name))
    return device


def _initialized_by_model(model: nn.Module, mod: nn.Module) -> nn.Module | None:
    """A stand-in for ``mod`` whose non-persistent buffers the transformers model's own
    ``_init_weights`` filled (Gemma 4's ``embed_scale``: a constant its embedding module keeps
    as an attribute, not in a config), or None. The stand-in's parameters are on meta, so the
    initializer touches no real tensor; a buffer it leaves unset (still NaN) means None."""
    from ..models.hf_names import hf_model_of

    found = hf_model_of(model)
    init = getattr(found[0], "_init_weights", None) if found is not None else None
    if init is None:
        return None
    stand = copy.copy(mod)
    # Plain meta tensors (not DTensors: a random init of a DTensor would touch the RNG tracker).
    stand._parameters = {
        n: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"))
        for n, p in mod._parameters.items()
    }
    stand._buffers = {
        n: torch.full(b.shape, float("nan"), dtype=b.dtype, device="cpu")
        if n in mod._non_persistent_buffers_set and b.is_floating_point()
        else torch.empty(b.shape, dtype=b.dtype, device="meta")
        for n, b in mod._buffers.items()
        if b is not None
    }
    try:
        with torch.no_grad():
            init(stand)
    except Exception:  # noqa: BLE001 - an initializer that needs more than the module: not ours to fix
        return None
    done = all(
        n in stand._buffers and not stand._buffers[n].is_meta and not stand._buffers[n].isnan().any()
        for n in mod._non_persistent_buffers_set
    )
    return stand if done else None


def _tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of ``(module, attribute)`` holding one parameter object (tied weights, e.g. an
    LM head sharing the embedding), each group of 2 or more."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((mod, name))
    return [group for group in holders.values() if len(group) > 1]


def plan_load(
    model: nn.Module,
    index: CheckpointIndex,
    placement: Placement | None,
    topology: Topology,
    readers: np.ndarray,
    scope: str,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    dequantize: bool = False,
    rank: int | None = None,
    all_needs: bool = True,
) -> tuple[list[ParamDesc], NeedTable, Schedule]:
    """The parameter descriptions, every rank's needs and the schedule :func:`load` would run
    (pure given the model; no communication). Deliveries refer to parameters by their index in
    the descriptions. ``dequantize``: FP8 weights with a block scale may go into float
    parameters (the schedule moves the FP8 bytes; the scales are
    :func:`moeshard.plan.scales.scale_needs` of the needs). ``rank``: plan only what that rank
    runs (``plan_transfers(rank=)``, what :func:`load` does); None: the whole job.
    ``all_needs``: the need table has every rank's needs (what the scales and the lower bounds
    are computed from); False (with ``rank``): only those that rank's plan takes
    (``need_table(keep_ranks=)``: its own, those of ranks that cannot read, and those several
    ranks share)."""
    descs = describe_model(model, index, specs)
    keep = None
    # Packed weights: every rank's rows, whose reads are counted as packed values and scales
    # (plan.load.packed_bytes_delta), not as left-out rows' logical elements.
    if rank is not None and not all_needs and not index.packed:
        keep = ~np.asarray(readers, dtype=bool)
        keep[rank] = True
    needs = need_table(descs, index, placement, topology.world_size, dequantize, keep_ranks=keep)
    return (
        descs,
        needs,
        plan_transfers(needs, index, topology, readers, scope=scope, staging_bytes=staging_bytes, rank=rank),
    )


def float_params(descs: Sequence[ParamDesc]) -> np.ndarray:
    """``bool[len(descs)]``: which parameters are float tensors of two or more bytes (those an
    FP8 weight is dequantized into; an FP8 parameter takes FP8 bytes as they are)."""
    return np.asarray([cast_refusal("F32", d.dtype) is None for d in descs], dtype=bool)


def checked_unused_keys(
    model: nn.Module,
    descs: Sequence[ParamDesc],
    index: CheckpointIndex,
    placement: Placement | None,
    strict: bool,
    op: str,
    consumed: Sequence[str] = (),
) -> tuple[str, ...]:
    """The checkpoint keys no parameter or buffer of ``model`` reads, sorted (pure: every rank
    computes the same inside its planning step, so a strict error is raised on every rank).

    Raises ValueError when ``strict`` and some of them say the checkpoint does not fit the
    model (a stray expert, a layer beyond the model's, the scale of a loaded weight; see
    :class:`~moeshard.models.unused.UnusedKeys`), naming the first few and their count. With
    ``strict=False`` rank 0 logs the same text as a warning on the ``moeshard`` logger.
    """
    unused = unused_keys(descs, index, placement, ignored_patterns(model), consumed)
    refuse_or_warn(unused.problem(index.root), strict, op)
    return unused.keys


def refuse_or_warn(problem: str | None, strict: bool, op: str) -> None:
    """What ``strict`` does with a checkpoint that does not fit the model: ValueError naming
    ``problem`` when ``strict``, else a warning on the ``moeshard`` logger (rank 0 only, once
    for the job). Called inside a planning step, so the error reaches every rank."""
    if problem is None:
        return
    if strict:
        raise ValueError(f"{problem}; pass strict=False to load it anyway")
    if collectives.rank_and_world()[0] == 0:
        logger.warning("%s: %s (strict=False: ignored)", op, problem)


@collectives.runs_on_group
def load(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    placement: Placement | None = None,
    storage: Storage = "auto",
    *,
    topology: Topology | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    device: torch.device | None = None,
    report_minimal: bool = False,
    progress: bool | None = None,
    strict: bool = True,
    dequantize: bool = True,
    read_threads: int | None = None,
    direct_io: bool = False,
    group=None,
) -> LoadReport:
    """Collective (every rank of ``group``): load ``checkpoint`` into ``model`` in place.

    Args:
        model: parameters are DTensors (FSDP2 / EP, e.g. from :func:`moeshard.parallelize`)
            or plain tensors (held in full by every rank); may be on the meta device.
            Expert parameters have global shape ``[num_physical, *slice_shape]``.
        checkpoint: HF safetensors directory (with index) or a ``.safetensors`` file.
        placement: which logical expert each physical slot holds. None: the one the model's EP
            forward routes by (:func:`moeshard.models.ep.model_placement`), slot p = expert p
            for a model without it; a placement other than the model's is refused.
        storage: "shared", "node", "single" or "auto" (detect which ranks see the files).
        topology: ranks per node (default: torchrun's environment).
        staging_bytes: per-rank budget for pieces in flight.
        progress: show progress on local rank 0 of each node (a bar on a terminal, log
            lines otherwise); default: the ``MOESHARD_PROGRESS`` environment variable.
        report_minimal: also compute the plan's lower bounds (``LoadReport.minimal``; pure,
            costs time proportional to the number of needs).
        strict: refuse a checkpoint with keys that no parameter reads and that say it does not
            fit the model (stray experts, layers beyond the model's, scales of loaded weights;
            as torch's ``load_state_dict(strict=True)``); False: log a warning and load. Every
            unused key is in ``LoadReport.unused_keys`` either way.
        dequantize: FP8 weights stored with a block scale (DeepSeek-V3's ``weight_scale_inv``,
            :mod:`moeshard.io.fp8`) load into float parameters dequantized (``q * scale`` in
            float32, then cast); each rank first gets the whole scales of the weights it
            receives, then the FP8 bytes move as usual (half the bytes of bf16) and are
            dequantized where they land. False: refuse them, as the cast rule does (FP8 with
            no fitting scale is refused either way).
        read_threads: threads reading this rank's own pieces straight into place, in parallel
            and overlapped with the transfers (:class:`~moeshard.io.readpool.ReadPool`; CUDA
            destinations through pinned buffers and side-stream copies). Default: the
            ``MOESHARD_READ_THREADS`` environment variable, else this host's cores per local
            rank, at most 8 for a model on the CPU and at most 4 on an accelerator (the fastest
            measured on a GPU host); 1 reads serially on the calling thread.
        direct_io: read with ``O_DIRECT``, bypassing the page cache (cold storage read once,
            a checkpoint larger than host memory; Linux; see
            :class:`~moeshard.io.reader.CheckpointReader`).
        group: the process group that loads (default: the default group), e.g. one EP group
            of a larger job; ranks in plans and messages are its ranks. The model's device
            meshes must lie within it; ``topology`` defaults to its members' nodes.

    On Linux the process's peak-RSS high-water mark (VmHWM) is reset at the start of the
    load, so that ``LoadReport.peak_rss_bytes`` is this load's peak.

    Raises:
        DistributedError: on every rank, if any rank hit a bad input (missing key, shape or
            dtype mismatch, a cast the cast rule refuses (:func:`moeshard.dtypes.cast_refusal`:
            e.g. FP8 weights into a bf16 model), bad file, inconsistent placement, a strict
            unused-key error) or the ranks' plans differ. One rank's bad argument (a placement
            other than its model's, a topology of another world size, ``read_threads`` below 1)
            raises on every rank in the first exchange, naming that rank.
    """
    meter = OpMeter(peak_rss=True)
    # One exchange: every rank's errors (its own arguments checked first, then its model
    # materialized), whether it can see the checkpoint and its storage arguments. A rank whose
    # arguments are wrong raises here with the others, before any of them waits on it.
    opened, everyone = collectives.agree_and_gather(
        lambda: _open(model, placement, topology, group, checkpoint, device, read_threads),
        "moeshard.load: checking the arguments and materializing the model",
        share=lambda o: sources_share(o.sees_checkpoint, storage, o.topology),
    )
    meter.end("materialize")
    placement, topo, read_threads, path = opened.placement, opened.topology, opened.read_threads, opened.path
    mode, readers, scope, index = resolve_sources(path, storage, topo, opened.sees_checkpoint, everyone=everyone)
    if keeps_packed(model, specs):  # packed weights under their stored keys only
        index = index.without_packed(KEEPS_PACKED)
    elif not dequantize:
        index = index.without_packed("dequantize=False: pass dequantize=True, the default, to load it dequantized")
    meter.end("headers")
    opening: list[CheckpointReader] = []  # this rank's reader, opened in the planning step
    try:

        def plan() -> _LoadPlan:
            if readers[topo.rank]:
                opening.append(CheckpointReader(index, reader_root(path), direct_io=direct_io))
            return _plan(
                model,
                index,
                placement,
                topo,
                readers,
                scope,
                staging_bytes,
                specs,
                dequantize,
                strict,
                report_minimal,
                opening[0] if opening else None,
            )

        planned = collectives.agree(plan, "moeshard.load: planning", fingerprint=lambda p: p.fingerprint)
        t_plan = meter.end("plan")
        reader = opening[0] if opening else None
        ran = _run(model, planned, index, reader, topo, opened.device, progress, read_threads, meter)
    finally:
        for reader in opening:
            reader.close()
    # No barrier here: the execution's agreement (an all-reduce every rank enters after its
    # last transfer) already returns on no rank before every rank has finished.
    meter.end("finish")
    return _report(meter, mode, topo, index, readers, scope, planned, ran, t_plan, report_minimal)


def _report(
    meter: OpMeter,
    mode: str,
    topo: Topology,
    index: CheckpointIndex,
    readers: np.ndarray,
    scope: str,
    planned: _LoadPlan,
    ran: _Ran,
    t_plan: float,
    report_minimal: bool,
) -> LoadReport:
    """This rank's :class:`LoadReport` of a finished load (``report_minimal``: with the
    plan's lower bounds, computed now)."""
    peak = meter.peak_rss()
    minimal = minimal_cost(planned.needs, index, topo, readers, scope) if report_minimal else {}
    return LoadReport(
        storage=mode,
        rank=topo.rank,
        world_size=topo.world_size,
        wall_seconds=meter.seconds(),
        plan_seconds=t_plan,
        checkpoint_bytes=index.total_bytes,
        bytes_read_rank=ran.total("bytes_read"),
        bytes_sent_rank=ran.total("bytes_sent"),
        bytes_received_rank=ran.total("bytes_received"),
        peak_staging_bytes_rank=ran.stats.peak_staging_bytes,
        rss_before_bytes=meter.rss_before,
        peak_rss_bytes=peak.bytes,
        plan=planned.schedule.cost.summary(),
        minimal=minimal,
        fingerprint=planned.schedule.fingerprint,
        peak_rss_source=peak.source,
        unused_keys=planned.unused_keys,
        dequantized_keys=(len(planned.scales.weights) if planned.scales is not None else 0)
        + sum(k in index.packed for k in planned.needs.keys),
        phase_seconds=meter.phases.seconds,
        phase_cpu_seconds=meter.phases.cpu_seconds,
    )


@dataclass(frozen=True)
class _Opened:
    """A rank's part of load's first exchange: its arguments checked (the placement, the
    topology with its rank, the read threads), the device its model now lives on, and whether
    it sees the checkpoint."""

    placement: Placement | None
    topology: Topology
    read_threads: int
    device: torch.device
    path: str
    sees_checkpoint: bool


def _open(
    model: nn.Module,
    placement: Placement | None,
    topology: Topology | None,
    group,
    checkpoint: str | os.PathLike,
    device: torch.device | None,
    read_threads: int | None,
) -> _Opened:
    """This rank's step of load's first exchange: every check of its own arguments that can
    fail (a placement other than the model's, a topology of another world size, a checkpoint
    that is not a path, a read thread count below 1), then the model materialized. Agreed, so
    a rank's bad argument raises on every rank."""
    placement = resolve_placement(model, placement, "moeshard.load")
    topo = group_topology(topology, group)
    path = os.fspath(checkpoint)
    dev = materialize(model, device)
    return _Opened(placement, topo, _read_threads(read_threads, topo, dev), dev, path, os.path.exists(path))


def _read_threads(read_threads: int | None, topology: Topology, device: torch.device) -> int:
    if read_threads is None:
        return default_read_threads(topology.local_world_size, device.type)
    if read_threads < 1:
        raise ValueError(f"read_threads must be >= 1, got {read_threads}")
    return read_threads


@dataclass(frozen=True)
class _LoadPlan:
    """What every rank agreed on before any data moves: the model's descriptions, the needs,
    this rank's schedule, the unused checkpoint keys and, for FP8 weights that load
    dequantized, their scales' needs and schedule (run first)."""

    descs: list[ParamDesc]
    needs: NeedTable
    schedule: Schedule
    unused_keys: tuple[str, ...]
    scales: ScaleNeeds | None
    scale_schedule: Schedule | None

    @property
    def fingerprint(self) -> str:
        return self.schedule.fingerprint + (self.scale_schedule.fingerprint if self.scale_schedule is not None else "")

    @property
    def has_broadcasts(self) -> bool:
        return self.schedule.has_broadcasts or (self.scale_schedule is not None and self.scale_schedule.has_broadcasts)


def _plan(
    model: nn.Module,
    index: CheckpointIndex,
    placement: Placement | None,
    topo: Topology,
    readers: np.ndarray,
    scope: str,
    staging_bytes: int,
    specs: Sequence[ExpertsSpec],
    dequantize: bool,
    strict: bool,
    report_minimal: bool,
    reader: CheckpointReader | None,
) -> _LoadPlan:
    """This rank's step of load's planning (agreed by every rank): each rank plans what it
    runs, the transfers and its own local reads; and checks the files it reads."""
    rank = topo.rank
    # Every rank's needs only where the scales of FP8 weights are planned (each rank gets those of
    # the weights it receives, wherever they come from) or the lower bounds are asked for.
    fp8 = dequantize and bool(index.dtypes & FP8_DTYPES)
    descs, needs, plan = plan_load(
        model,
        index,
        placement,
        topo,
        readers,
        scope,
        staging_bytes,
        specs,
        dequantize,
        rank,
        all_needs=fp8 or report_minimal,
    )
    scales = scale_needs(needs, index, float_params(descs)) if fp8 else None
    scale_plan = (
        None
        if scales is None
        else plan_transfers(scales.table, index, topo, readers, scope=scope, staging_bytes=staging_bytes, rank=rank)
    )
    unused = checked_unused_keys(
        model,
        descs,
        index,
        placement,
        strict,
        "moeshard.load",
        consumed=scales.table.keys if scales is not None else (),
    )
    mine = set()
    for p in (plan, scale_plan):
        if p is not None:
            keys = np.unique(p.pieces.key[p.reads.piece[p.reads.rank == rank]])
            mine |= {p.keys[k] for k in keys.tolist()}
    if mine:
        assert reader is not None
        reader.check_keys(mine)
    return _LoadPlan(descs, needs, plan, unused, scales, scale_plan)


@dataclass(frozen=True)
class _Ran:
    """What this rank's run of the schedules moved: the weights' and, with FP8 scales, theirs."""

    stats: ExecStats
    scale_stats: ExecStats | None

    def total(self, counter: str) -> int:
        return getattr(self.stats, counter) + (getattr(self.scale_stats, counter) if self.scale_stats else 0)


def _run(
    model: nn.Module,
    planned: _LoadPlan,
    index: CheckpointIndex,
    reader: CheckpointReader | None,
    topo: Topology,
    dev: torch.device,
    progress: bool | None,
    read_threads: int,
    meter: OpMeter,
) -> _Ran:
    """Collective (every rank of the load): run the agreed schedules into the model's local
    tensors, the FP8 scales' first (each rank's whole, small) then the weights'."""
    rank, plan = topo.rank, planned.schedule
    node_group = node_groups(topo) if planned.has_broadcasts else None
    dests = local_tensors(named_tensors(model), planned.descs)
    with torch.no_grad():
        fp8: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {}
        scale_stats = None
        if planned.scale_schedule is not None:
            fp8, scale_stats = _run_scales(planned, index, reader, rank, dev, node_group)
            meter.end("scales")
        bar = progress_bar("load", plan.delivered_bytes(rank), progress, topo)
        what = "moeshard.load: executing the plan"
        sink = (
            DequantSink(plan, dests, rank, fp8, index=index)
            if fp8
            else TensorSink(plan, dests, rank, receive_in_place=True, index=index)
        )
        with ReaderSource(plan, reader, index, read_threads=read_threads) as source:
            stats = collectives.agree(
                lambda: execute_schedule(
                    plan, rank, source, sink, dev, node_group=node_group, progress=bar.update, what=what
                ).check(),
                what,
            )
        bar.close()
        meter.end("execute")
    return _Ran(stats, scale_stats)


class _Scales(NamedTuple):
    """The FP8 scales this rank received: ``weights`` maps a weight's key to ``(scale tensor,
    block shape)``; ``stats``: this rank's counters of their schedule."""

    weights: dict[str, tuple[torch.Tensor, tuple[int, ...]]]
    stats: ExecStats


def _run_scales(
    planned: _LoadPlan,
    index: CheckpointIndex,
    reader: CheckpointReader | None,
    rank: int,
    dev: torch.device,
    node_group,
) -> _Scales:
    """Collective (every rank of the load): every rank's FP8 scales, whole, by the same runner."""
    scale_plan, scales = planned.scale_schedule, planned.scales
    assert scale_plan is not None and scales is not None
    mine = set(scale_plan.deliveries.param[scale_plan.deliveries.rank == rank].tolist())
    scratch = [
        torch.empty(sh, dtype=index.info(k).torch_dtype, device=dev) if j in mine else None
        for j, (k, sh) in enumerate(zip(scales.table.keys, scales.shapes(index)))
    ]
    what = "moeshard.load: loading FP8 scales"
    stats = collectives.agree(
        lambda: execute_schedule(
            scale_plan,
            rank,
            ReaderSource(scale_plan, reader, index),
            TensorSink(scale_plan, scratch, rank),
            dev,
            node_group=node_group,
            what=what,
        ).check(),
        what,
    )
    return _Scales(
        {w: (scratch[j], block) for w, (j, block) in scales.weights.items() if scratch[j] is not None}, stats
    )
