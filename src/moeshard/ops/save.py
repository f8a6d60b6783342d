"""``moeshard.save``: write an (EP + FSDP2) model as a Hugging Face safetensors checkpoint.

Collective (every rank of the group calls :func:`save`). The inverse of
:func:`moeshard.load`: each checkpoint tensor (a dense parameter or persistent buffer under its
checkpoint name; each part of each logical expert of a fused expert parameter, e.g.
``experts.{e}.gate_proj.weight``) is written once, whole, into one file, by one *writer* rank
that holds part of it; the other holders of its boxes send them to the writer by P2P
(``batch_isend_irecv`` in bounded batches, on the model's own device). Every rank writes its own
shard files; there is no gather to rank 0. The plan (:mod:`moeshard.plan.save`) is pure, so
every rank knows every file name (``model-00001-of-0000N.safetensors``) in advance, and the
ranks agree on its fingerprint before anything is written.

Files are streamed: each shard's safetensors header is written first (every offset is known
from the plan), then every box is written at its place in the file as soon as it is local
(``pwrite``), so a rank holds at most its staging budget of tensor data, never a whole shard.

Atomic: everything is written into a temporary directory inside ``out_dir``, fsync-ed, and the
ranks agree that every rank succeeded; then shard files and config files are renamed into
place and the index (``model.safetensors.index.json``) is renamed last. A failure on any rank
raises the same :class:`SaveError` on every rank and removes what was written; a crash leaves
no index, so the directory never looks like a complete checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import collectives
from ..box import Box
from ..collectives import DistributedError
from ..execute import LocalTensors, Sink, Source, execute_schedule
from ..io.header import DTYPES, read_header
from ..io.index import INDEX_NAME, CheckpointIndex
from ..io.sources import resolve_sources, sources_share
from ..io.writer import pwrite_all, safetensors_header
from ..models.adapters import DEFAULT_SPECS, ExpertsSpec, packed_tensor_names
from ..models.describe import ParamDesc, describe_model, expert_layers, local_tensor, persistent_buffers, tensor_names
from ..models.hf_names import hf_names
from ..models.outputs import describe_outputs
from ..models.routing import declared_experts, resolve_placement
from ..placement import Placement
from ..plan import DEFAULT_STAGING_BYTES
from ..plan.save import SavePlan, plan_save
from ..plan.schedule import Schedule
from ..topology import Topology
from .load import target_device
from .report import OpReport
from .requantize import (
    HF_QUANT_CONFIG,
    QUANTIZE_MODES,
    ConvertedFile,
    Requantization,
    check_outputs,
    convert_file,
    logical_index,
    requantization,
)
from .skeleton import OpMeter, group_topology, local_tensors, named_tensors, progress_bar

__all__ = ["SaveError", "SaveReport", "save", "plan_model_save", "DEFAULT_MAX_SHARD_BYTES"]

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_TMP_PREFIX = ".moeshard-save-"

# File operations, module-level so that tests can make one of them fail on one rank.
_replace = os.replace


class SaveError(DistributedError, ValueError):
    """Raised on every rank when saving failed on any rank (bad input, an existing checkpoint,
    a failed write or rename); the message names each failing rank and its error."""


@dataclass(frozen=True)
class SaveReport(OpReport):
    """What a save did. ``*_rank`` fields and ``files`` are this rank's; ``plan`` holds job-wide
    counters (bytes written per rank, bytes sent, P2P ops, batches).

    ``peak_rss_bytes`` is this process's peak resident set size during the save (Linux VmHWM
    reset at its start, ``peak_rss_source == "vmhwm"``; else the process's lifetime peak).
    """

    out_dir: str
    files: tuple[str, ...]
    num_files: int
    bytes_written_rank: int
    total_bytes: int
    rss_before_bytes: int
    peak_rss_bytes: int
    peak_rss_source: str = "vmhwm"
    # quantize="source": the weights requantized (job-wide) and the largest error of their
    # requantized values against the model's float ones (absolute; relative to the weight's
    # largest magnitude).
    num_requantized: int = 0
    requant_max_abs_error: float = 0.0
    requant_max_rel_error: float = 0.0


def plan_model_save(
    model: nn.Module,
    placement: Placement | None,
    world_size: int,
    reference: CheckpointIndex | None = None,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    rank: int | None = None,
) -> tuple[list[ParamDesc], SavePlan]:
    """The parameter descriptions and the plan :func:`save` would run (no communication).
    ``rank``: the plan keeps only that rank's pieces (what :func:`save` runs on it); None: the
    whole job's (:func:`~moeshard.plan.save.plan_save`).

    Names are those the model's family writes (``reference``: that checkpoint's); a tied
    parameter is written once, under the name transformers keeps; non-persistent buffers and
    the model's ``_keys_to_ignore_on_save`` are not written.
    """
    descs = describe_model(model, reference, specs)
    hints = {}
    for e in expert_layers(model, specs):
        n = declared_experts(e.module)  # not num_experts as such: transformers' EP counts one rank's there
        if n is not None:
            hints[e.layer] = n
    skip = frozenset(getattr(model, "_keys_to_ignore_on_save", None) or ())
    outs = describe_outputs(
        descs,
        placement,
        world_size,
        reference,
        tied_targets=_tied_targets(model),
        skip_keys=skip,
        buffers=frozenset(name for name, _ in persistent_buffers(model)),
        num_experts=hints,
    )
    _check_names(model, [o.key for o in outs], skip, descs)
    return descs, plan_save(outs, world_size, max_shard_bytes, staging_bytes, rank=rank)


def _check_names(model: nn.Module, keys: list[str], skip: frozenset[str], descs: list[ParamDesc]) -> None:
    """Refuse a key set that the model's ``from_pretrained`` would not read back whole: a
    missing tensor is re-initialized there and an unexpected key ignored, with only a warning.
    Experts kept packed (``descs``' parameters of a packed spec and their checkpoint tensors)
    are left out: transformers reads those through its quantizer, not the family's converters.
    Pure (every rank raises the same error while planning, before anything is written)."""
    names = hf_names(model)
    if names is None:
        return
    params, leaves = packed_tensor_names()
    packed = [d for d in descs if d.expert is not None and d.expert.param.name in params]
    if packed:
        prefixes = tuple(f"{d.expert.module}." for d in packed)
        skip = skip | {d.name for d in packed}
        keys = [k for k in keys if not (k.startswith(prefixes) and k.rpartition(".")[2] in leaves)]
    expected = [n for n in tensor_names(model) if not set(n) & skip]
    mismatch = names.check_keys(keys, expected)
    if mismatch is not None:
        raise ValueError(mismatch.message("moeshard.save"))


def _requantization(tensors: dict, source: str, index: CheckpointIndex) -> Requantization:
    """What ``quantize="source"`` writes (source checkpoint ``source``, its ``index``), refused
    before anything is written for a model that keeps experts packed (``tensors``: the model's,
    by name) or a source without weights to requantize into."""
    _check_float_experts(tensors)
    return requantization(source, index)


def _check_float_experts(tensors: dict) -> None:
    """``quantize`` requantizes float weights: refuse a model that keeps experts packed."""
    params, _ = packed_tensor_names()
    kept = [(n, t) for n, t in tensors.items() if n.rpartition(".")[2] in params]
    if kept:
        name, t = kept[0]
        raise ValueError(
            f"quantize='source': the model keeps its experts packed ({name}, {t.dtype}); only float weights are "
            "requantized: save it without quantize, which writes the packed tensors as they are"
        )


def _tied_targets(model: nn.Module) -> frozenset[str]:
    """Names transformers drops from a checkpoint when weights are tied (the keys of
    ``_tied_weights_keys``, e.g. ``lm_head.weight``)."""
    out = set()
    for name, mod in model.named_modules():
        keys = getattr(mod, "_tied_weights_keys", None)
        if isinstance(keys, dict):
            out.update(f"{name}.{k}" if name else k for k in keys)
    return frozenset(out)


@collectives.runs_on_group
def save(
    model: nn.Module,
    out_dir: str | os.PathLike,
    placement: Placement | None = None,
    *,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    reference: str | os.PathLike | CheckpointIndex | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    topology: Topology | None = None,
    fsync: bool = True,
    progress: bool | None = None,
    quantize: str | None = None,
    group=None,
) -> SaveReport:
    """Collective (every rank of ``group``): write ``model`` to ``out_dir`` as a
    Hugging Face safetensors checkpoint (shards + ``model.safetensors.index.json``, plus
    ``config.json`` / ``generation_config.json`` for a transformers model).

    Args:
        model: prepared by :func:`moeshard.parallelize` and loaded (expert parameters are
            DTensors ``[num_physical, *slice]``; other parameters FSDP2-sharded), or plain
            tensors held in full by every rank.
        out_dir: a directory every rank sees (a shared filesystem); created if missing.
        placement: the placement the model was parallelized with or last relocated to. None: the
            one its EP forward routes by (:func:`moeshard.models.ep.model_placement`), slot
            p = expert p for a model without it; a placement other than the model's is refused.
            Every logical expert must have a slot; with redundant experts one copy is written.
        reference: a checkpoint (directory or index) whose names and expert part sizes to
            mirror; without it, names are the model family's and fused experts split into
            equal parts.
        max_shard_bytes: tensor bytes per file at most (a larger tensor gets its own file).
        overwrite: replace a checkpoint already in ``out_dir`` (its index is removed first, so
            a failure leaves no complete-looking checkpoint); otherwise such a directory is
            refused.
        staging_bytes: per-rank budget for boxes in flight.
        fsync: fsync every file and the directory before the index is published.
        progress: bytes written / total on local rank 0 of each node (default: the
            ``MOESHARD_PROGRESS`` environment variable).
        quantize: ``"source"``: write the weights that ``reference`` (required; a directory every
            rank sees) stores quantized (MXFP4, NVFP4, INT4, FP8 per channel) in its format
            again: same scheme and group size (:func:`moeshard.io.codecs.encode`), the same
            keys and dtypes (packed values, scales, global scales, ``weight_shape``; activation
            scales copied), its ``quantization_config`` in ``config.json`` and its
            ``hf_quant_config.json``, so its readers (transformers, compressed-tensors) read
            the result. For a model trained in float; the report gives the error of the
            requantized values against the float ones. Refused before anything is written for a
            source without such weights, or a weight the model does not hold in float with the
            source's shape. None: every tensor as the model holds it.
        group: the process group that runs it (default: the default group), e.g. one EP group
            of a larger job; ranks in plans and messages are its ranks. The model's device
            meshes must lie within it; ``topology`` defaults to its members' nodes.

    Raises:
        SaveError (a ValueError and a DistributedError): on every rank, before any file is
            written, for bad input (a logical expert with no slot, a model on the meta device,
            an existing checkpoint, a directory some rank cannot see, one rank's placement
            other than its model's or topology of another world size); or after a failed write
            or rename on any rank, with every file of this save removed. Without a process
            group the underlying error is raised as is.
        PeerLostError: on the ranks that saw a peer die or the network fail; each removes the
            files it wrote, the index is not published.
    """
    with collectives.errors_as(SaveError):
        return _save(
            model,
            out_dir,
            placement,
            specs,
            reference,
            max_shard_bytes,
            overwrite,
            staging_bytes,
            topology,
            group,
            fsync,
            progress,
            quantize,
        )


@dataclass(frozen=True)
class _PlannedSave:
    """What every rank agreed on before any file is written: the model's descriptions, this
    rank's part of the save plan, and the device of its local tensors."""

    descs: list[ParamDesc]
    plan: SavePlan
    device: torch.device
    requant: Requantization | None = None


@dataclass(frozen=True)
class _Arguments:
    """A rank's arguments of a save, checked: the placement, the topology with its rank, and
    for a ``reference`` given as a path, that path and whether this rank sees it."""

    placement: Placement | None
    topology: Topology
    out: Path
    reference_path: str | None
    sees_reference: bool


def _check_arguments(
    model: nn.Module, placement, topology: Topology | None, group, out_dir, reference, quantize=None
) -> _Arguments:
    """This rank's step of save's first exchange: every check of its own arguments that can
    fail (a placement other than the model's, a topology of another world size, an output
    directory or reference that is not a path; ``quantize`` without a source this rank sees)."""
    if quantize is not None:
        if quantize not in QUANTIZE_MODES:
            raise ValueError(f"quantize={quantize!r}: expected one of {QUANTIZE_MODES} or None")
        if reference is None or isinstance(reference, CheckpointIndex):
            raise ValueError("quantize='source' needs reference=<the directory of the quantized source checkpoint>")
        if not os.path.isdir(os.fspath(reference)):
            raise ValueError(f"quantize='source': the source checkpoint {os.fspath(reference)} is not visible here")
    placement = resolve_placement(model, placement, "moeshard.save")
    topo = group_topology(topology, group)
    out = Path(out_dir)
    if reference is None or isinstance(reference, CheckpointIndex):
        return _Arguments(placement, topo, out, None, False)
    path = os.fspath(reference)
    return _Arguments(placement, topo, out, path, os.path.exists(path))


def _reference_index(reference, args: _Arguments, everyone: list) -> CheckpointIndex | None:
    """Collective where ``reference`` is a path (its headers, read by the ranks that see it and
    sent to every rank): the index of the checkpoint whose names and dtypes the save keeps.
    ``everyone``: every rank's share of the first exchange (None where it passed no path)."""
    # Every rank holds ``everyone`` alike: the same answer on every rank, with no exchange.
    collectives.unanimous(lambda: _same_reference_kind(everyone), "moeshard.save: checking the arguments")
    if args.reference_path is None:
        return reference
    return resolve_sources(args.reference_path, "auto", args.topology, args.sees_reference, everyone=everyone)[3]


def _same_reference_kind(everyone: list) -> None:
    """Every rank passed ``reference`` as a path, or none did (the path's headers take an
    exchange that every rank must join). Pure."""
    paths = [r for r, e in enumerate(everyone) if e is not None]
    if paths and len(paths) != len(everyone):
        others = [r for r, e in enumerate(everyone) if e is None]
        raise ValueError(
            f"reference: ranks {paths[:16]} passed a path, ranks {others[:16]} none or a CheckpointIndex; "
            "every rank must pass the same"
        )


def _save(
    model,
    out_dir,
    placement,
    specs,
    reference,
    max_shard_bytes,
    overwrite,
    staging_bytes,
    topology,
    group,
    fsync,
    progress,
    quantize=None,
) -> SaveReport:
    meter = OpMeter(peak_rss=True)
    # One exchange: every rank's argument errors (a rank's bad argument raises on every rank,
    # before any of them waits on it) and what the reference's storage is resolved from.
    args, everyone = collectives.agree_and_gather(
        lambda: _check_arguments(model, placement, topology, group, out_dir, reference, quantize),
        "moeshard.save: checking the arguments",
        share=lambda a: None if a.reference_path is None else sources_share(a.sees_reference, "auto", a.topology),
    )
    placement, topo = args.placement, args.topology
    rank, world, out = topo.rank, topo.world_size, args.out
    index = _reference_index(reference, args, everyone)

    tensors = named_tensors(model)
    made: list[Path] = []  # directories rank 0 created (removed again if the save fails)

    def make_plan():
        # This rank's pieces only: the job's are O(transfers) (4.2 million at DeepSeek-V3 on 8,192 ranks).
        requant = None if quantize is None else _requantization(tensors, args.reference_path, index)
        names = index if requant is None else logical_index(requant)  # a float model's names
        descs, plan = plan_model_save(model, placement, world, names, specs, max_shard_bytes, staging_bytes, rank=rank)
        meta = [d.name for d in descs if local_tensor(tensors[d.name]).is_meta]
        if meta:
            raise ValueError(
                f"parameter {meta[0]} is on the meta device ({len(meta)} in all): load the model before saving it"
            )
        if requant is not None:
            check_outputs(requant, [(t.key, t.shape, t.dtype) for t in plan.tensors])
        if rank == 0:
            _prepare_dir(out, out / f"{_TMP_PREFIX}{plan.fingerprint}", overwrite, made)
        return _PlannedSave(descs, plan, target_device(model), requant)

    def unmake() -> None:
        for d in reversed(made):
            if d.name.startswith(_TMP_PREFIX):
                shutil.rmtree(d, ignore_errors=True)
            else:
                _rmdir(d)

    # One round: every rank's plan (the same fingerprint, the same overwrite flag, so the same
    # collectives follow) and rank 0's check of out_dir; nothing is written if any rank failed.
    planned = _agree_or_undo(
        make_plan,
        "moeshard.save: planning and checking the output directory",
        unmake,
        fingerprint=lambda r: f"{r.plan.fingerprint}/{overwrite}",
    )
    plan = planned.plan
    t_plan = meter.end("plan")
    tmp = out / f"{_TMP_PREFIX}{plan.fingerprint}"
    dests = local_tensors(tensors, planned.descs)
    created: list[Path] = []
    failure: list[Exception] = []
    if not tmp.is_dir():
        failure.append(
            ValueError(
                f"{out} is not shared with rank 0 (its temporary directory {tmp.name} is not "
                "visible here): save needs a directory that every rank sees"
            )
        )
    renamed: list[Path] = []

    def undo() -> None:
        for p in created + renamed:
            _unlink(p)
        if rank == 0:
            unmake()

    bar = progress_bar("save", int(plan.cost.write_bytes[rank]), progress, topo)
    try:
        with torch.no_grad():
            stats = _write_shards(plan, rank, dests, planned.device, tmp, fsync, bar, created, failure)
    except collectives.PeerLostError:
        undo()  # this rank's files; no exchange can follow
        raise
    bar.close()
    converted = None
    if planned.requant is not None:
        converted = _requantize_files(planned.requant, plan, rank, tmp, failure, undo)
    extra: list[str] = []  # config files (rank 0)
    if rank == 0 and not failure:
        try:
            extra = _write_configs(model, tmp, fsync, planned.requant)
            if converted is None:
                _write_index(plan, tmp / INDEX_NAME, fsync)
            else:
                _write_converted_index(converted, tmp / INDEX_NAME, fsync)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            failure.append(e)

    def outcome() -> None:
        if failure:
            raise failure[0]

    _agree_or_undo(outcome, "moeshard.save: writing the shard files", undo)
    meter.end("write")
    mine = [plan.files[i].name for i in plan.files_of(rank)]
    _put_in_place(plan, rank, out, tmp, mine + extra, overwrite, fsync, undo, renamed)
    meter.end("publish")
    report = _report(plan, topo, out, mine, stats, meter, t_plan)
    return report if converted is None else _with_requantization(report, converted)


def _with_requantization(report: SaveReport, converted: list[list[tuple[str, ConvertedFile]]]) -> SaveReport:
    """``report`` with the job's requantization figures (every rank's ``converted`` files)."""
    files = [c for share in converted for _, c in share]
    return dataclasses.replace(
        report,
        num_requantized=sum(c.num_requantized for c in files),
        requant_max_abs_error=max((c.max_abs_error for c in files), default=0.0),
        requant_max_rel_error=max((c.max_rel_error for c in files), default=0.0),
    )


def _requantize_files(
    req: Requantization, plan: SavePlan, rank: int, tmp: Path, failure: list, undo: Callable[[], None]
) -> list[list[tuple[str, ConvertedFile]]]:
    """Collective (every rank of the save), once every shard is written in ``tmp``: each rank
    requantizes the files it wrote (:func:`~moeshard.ops.requantize.convert_file`); returns every
    rank's ``[(file name, ConvertedFile)]``. A failure (of the writing before, or here) on any
    rank runs ``undo`` on every rank and raises."""

    def step():
        if failure:
            raise failure[0]
        return [(plan.files[i].name, convert_file(req, tmp / plan.files[i].name)) for i in plan.files_of(rank)]

    what = "moeshard.save: requantizing the shard files"
    try:
        return collectives.agree_and_gather(step, what, share=lambda r: r).shares
    except collectives.PeerLostError:
        undo()
        raise
    except BaseException:
        undo()
        collectives.barrier(what)
        raise


def _write_converted_index(converted: list[list[tuple[str, ConvertedFile]]], path: Path, fsync: bool) -> None:
    """The index of requantized shard files (every rank's ``converted`` files)."""
    files = [(name, c) for share in converted for name, c in share]
    index = {
        "metadata": {"total_size": sum(c.nbytes for _, c in files)},
        "weight_map": {key: name for name, c in files for key in c.keys},
    }
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def _report(
    plan: SavePlan, topo: Topology, out: Path, mine: list[str], stats: dict[str, int], meter: OpMeter, t_plan: float
) -> SaveReport:
    """This rank's :class:`SaveReport` of a finished save: ``mine`` are the files it wrote,
    ``stats`` its bytes (:func:`_write_shards`)."""
    peak = meter.peak_rss()
    return SaveReport(
        rank=topo.rank,
        world_size=topo.world_size,
        out_dir=str(out),
        files=tuple(mine),
        num_files=len(plan.files),
        bytes_written_rank=stats["written"],
        total_bytes=plan.total_bytes,
        wall_seconds=meter.seconds(),
        plan_seconds=t_plan,
        bytes_sent_rank=stats["sent"],
        bytes_received_rank=stats["received"],
        peak_staging_bytes_rank=stats["peak"],
        rss_before_bytes=meter.rss_before,
        peak_rss_bytes=peak.bytes,
        peak_rss_source=peak.source,
        plan=plan.cost.summary(),
        fingerprint=plan.fingerprint,
        phase_seconds=meter.phases.seconds,
        phase_cpu_seconds=meter.phases.cpu_seconds,
    )


def _put_in_place(
    plan: SavePlan,
    rank: int,
    out: Path,
    tmp: Path,
    names: list[str],
    overwrite: bool,
    fsync: bool,
    undo: Callable[[], None],
    renamed: list[Path],
) -> None:
    """Collective (every rank of the save), once every file is written in ``tmp``: remove the
    old index (``overwrite``), move this rank's files ``names`` into ``out`` (each recorded in
    ``renamed``), then rank 0 publishes the index; each step agreed, ``undo`` on a failure."""
    if overwrite:  # the old index goes first: from now on the directory is not a complete checkpoint

        def remove_old_index() -> None:
            if rank == 0:
                for name in (INDEX_NAME, "model.safetensors"):
                    _unlink(out / name, strict=True)
                _fsync_dir(out, fsync)

        _agree_or_undo(remove_old_index, "moeshard.save: removing the old index", undo)

    def move_into_place() -> None:
        for name in names:
            _replace(tmp / name, out / name)
            renamed.append(out / name)
        if names:
            _fsync_dir(out, fsync)

    _agree_or_undo(move_into_place, "moeshard.save: moving the files into place", undo)

    def publish() -> None:
        if rank != 0:
            return
        if overwrite:
            new = {f.name for f in plan.files}
            for p in out.iterdir():
                if _SHARD_RE.fullmatch(p.name) and p.name not in new:
                    _unlink(p, strict=True)
        _replace(tmp / INDEX_NAME, out / INDEX_NAME)  # last: now the checkpoint is complete
        shutil.rmtree(tmp, ignore_errors=True)
        _fsync_dir(out, fsync, strict=False)

    _agree_or_undo(publish, "moeshard.save: writing the index", undo)


def _agree_or_undo(step, what: str, undo, fingerprint=None):
    """Collective: run ``step``; if it failed on any rank, run ``undo`` on every rank, then raise.
    After a lost peer (:class:`PeerLostError`) each rank undoes its own part and raises at once."""
    try:
        return collectives.agree(step, what, fingerprint=fingerprint)
    except collectives.PeerLostError:
        undo()
        raise
    except BaseException:
        undo()
        collectives.barrier(what)  # nobody returns before every rank has cleaned up
        raise


def _prepare_dir(out: Path, tmp: Path, overwrite: bool, made: list[Path]) -> None:
    """Rank 0: refuse an existing checkpoint (unless ``overwrite``), create ``out`` and the
    temporary directory ``tmp`` in it (temporary directories of saves that crashed are
    removed; saving into one directory from two jobs at once is not supported); ``made`` gets
    the directories created."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and not overwrite:
        found = sorted(p.name for p in out.iterdir() if p.name == INDEX_NAME or p.name.endswith(".safetensors"))
        if found:
            raise ValueError(
                f"{out} already holds a checkpoint ({', '.join(found[:3])}"
                f"{', ...' if len(found) > 3 else ''}); pass overwrite=True to replace it"
            )
    missing = [p for p in [out, *out.parents] if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    made.extend(reversed(missing))
    for stale in out.glob(f"{_TMP_PREFIX}*"):  # left by a save that crashed
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir()
    made.append(tmp)


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()  # only if empty
    except OSError:
        pass


# -- writing ------------------------------------------------------------------------------------


class ShardWriter:
    """One safetensors file, written in place: the header first (every offset is known), then
    boxes at their offsets, in any order. Counts the data bytes written."""

    def __init__(self, path: Path, plan: SavePlan, file: int):
        self.path, self.plan, self.file = path, plan, file
        header = _header(plan, file)
        self.data_start = len(header)
        # A tensor of zeros (nobody holds it) is left unwritten: the file's size makes it a hole,
        # which reads as zeros.
        self.expected = plan.files[file].data_bytes - sum(
            plan.tensors[t].nbytes for t in plan.files[file].tensors if plan.tensors[t].zeros
        )
        self.done = 0
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        pwrite_all(self.fd, header, 0)
        os.ftruncate(self.fd, self.data_start + plan.files[file].data_bytes)

    def write(self, tensor: int, box: Box, data: torch.Tensor) -> int:
        t = self.plan.tensors[tensor]
        flat = memoryview(data.reshape(-1).view(torch.uint8).numpy())
        pos = 0
        for off, n in _runs(t.shape, box, DTYPES[t.dtype].itemsize):
            pwrite_all(self.fd, flat[pos : pos + n], self.data_start + t.offset + off)
            pos += n
        self.done += pos
        return pos

    def close(self, fsync: bool) -> None:
        try:
            if self.done != self.expected:
                raise RuntimeError(f"{self.path}: {self.done} data bytes written, the plan has {self.expected}")
            if fsync:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
        self._check()

    def _check(self) -> None:
        """Read the header back with the checkpoint reader's validation."""
        header, size = read_header(self.path)
        want = {self.plan.tensors[i].key: self.plan.tensors[i] for i in self.plan.files[self.file].tensors}
        if size != self.data_start + self.plan.files[self.file].data_bytes or set(header) != set(want):
            raise RuntimeError(f"{self.path}: the written file does not match its plan")
        for key, info in header.items():
            t = want[key]
            if (info.offset, info.dtype, info.shape) != (self.data_start + t.offset, t.dtype, t.shape):
                raise RuntimeError(f"{self.path}: header entry {key!r} does not match its plan")


def _header(plan: SavePlan, file: int) -> bytes:
    """safetensors header of ``file``."""
    tensors = (plan.tensors[i] for i in plan.files[file].tensors)
    return safetensors_header((t.key, t.dtype, t.shape, t.offset, t.offset + t.nbytes) for t in tensors)


def _runs(shape: tuple[int, ...], box: Box, itemsize: int):
    """``(byte offset, byte length)`` of the contiguous runs of ``box`` in a row-major tensor
    of ``shape``, in row-major order."""
    if not shape:
        yield 0, itemsize
        return
    k = len(shape) - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1  # dims after k are whole: each run spans them
    inner = math.prod(shape[k + 1 :]) * itemsize
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(k)]
    start = box[k][0] * inner
    for idx in np.ndindex(*(n for _, n in box[:k])):
        yield start + sum((box[d][0] + i) * strides[d] for d, i in enumerate(idx)), box[k][1] * inner


def _to_host(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Contiguous CPU copies (or the tensors themselves on CPU); one stream sync for all."""
    if device.type == "cpu":
        return [t if t.is_contiguous() else t.contiguous() for t in tensors]
    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for o, t in zip(out, tensors):
        o.copy_(t, non_blocking=True)
    torch.accelerator.current_stream(device).synchronize()
    return out


class _ViewSource(Source):
    """A save reads nothing from storage: every piece is a view of a holder's local tensor."""

    def __init__(self, plan: SavePlan, schedule: Schedule, dests, rank: int):
        self.plan, self.s, self.local = plan, schedule, LocalTensors(schedule, dests, rank)

    def view(self, v: int, pid: int) -> torch.Tensor:
        return self.local.view(v, pid)

    def dtype(self, pid: int) -> torch.dtype:
        return DTYPES[self.plan.tensors[int(self.s.pieces.key[pid])].dtype]


class _FileSink(Sink):
    """This rank's shard files: each delivery is a box of a checkpoint tensor, written at its
    place in the tensor's file. After the first failed write it writes nothing more (the
    save is undone), but the runner goes on sending, so no peer is left waiting."""

    def __init__(self, plan: SavePlan, schedule: Schedule, writers: dict, device: torch.device, bar, failure: list):
        self.plan, self.s, self.writers, self.device, self.bar = plan, schedule, writers, device, bar
        self.failure = failure
        self.written = 0

    def put(self, items: list[tuple[int, torch.Tensor]]) -> None:
        if self.failure:
            return
        s = self.s
        try:
            for (row, _), data in zip(items, _to_host([x for _, x in items], self.device)):
                pid = int(s.deliveries.piece[row])
                tensor = int(s.pieces.key[pid])
                n = self.writers[self.plan.tensors[tensor].file].write(tensor, s.piece_box(pid), data)
                self.written += n
                self.bar.update(n)
        except Exception as e:
            self.failure.append(e)
            raise


def _write_shards(
    plan: SavePlan,
    rank: int,
    dests,
    device: torch.device,
    tmp: Path,
    fsync: bool,
    bar,
    created: list[Path],
    failure: list[Exception],
) -> dict:
    """Collective: run the plan's schedule and write this rank's files. A write that fails
    stops this rank's writing (recorded in ``failure``) but not its sends and receives, so no
    peer is left waiting."""
    writers: dict[int, ShardWriter] = {}
    try:
        for i in plan.files_of(rank):
            path = tmp / plan.files[i].name
            writers[i] = ShardWriter(path, plan, i)
            created.append(path)
    except Exception as e:  # noqa: BLE001 - reported on every rank
        failure.append(e)
    schedule = plan.schedule_for(rank)
    sink = _FileSink(plan, schedule, writers, device, bar, failure)
    stats = execute_schedule(
        schedule,
        rank,
        _ViewSource(plan, schedule, dests, rank),
        sink,
        device,
        what="moeshard.save: sending the boxes to their writers",
    )
    for e in stats.failures:
        if e not in failure:
            failure.append(e)
    for w in writers.values():
        try:
            w.close(fsync and not failure)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            failure.append(e)
    if fsync and writers and not failure:
        try:
            _fsync_dir(tmp, True)
        except Exception as e:  # noqa: BLE001 - reported on every rank
            failure.append(e)
    return {
        "written": sink.written,
        "sent": stats.bytes_sent,
        "received": stats.bytes_received,
        "peak": stats.peak_staging_bytes,
    }


def _write_configs(model: nn.Module, tmp: Path, fsync: bool, requant: Requantization | None = None) -> list[str]:
    """config.json (and generation_config.json for a generative model) as transformers'
    save_pretrained writes them: dtype and architectures set; with ``requant``, the source's
    ``quantization_config`` in it and its ``hf_quant_config.json`` beside it. Returns the file
    names."""
    config = getattr(model, "config", None)
    before = set(os.listdir(tmp))
    if requant is not None and requant.hf_quant is not None:
        with open(tmp / HF_QUANT_CONFIG, "w", encoding="utf-8") as f:
            f.write(json.dumps(requant.hf_quant, indent=2) + "\n")
    if config is None or not hasattr(config, "save_pretrained"):
        return sorted(set(os.listdir(tmp)) - before)
    config = copy.deepcopy(config)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None:
        config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    if requant is not None and requant.config is not None:
        config.quantization_config = dict(requant.config)
    config.save_pretrained(tmp)
    can_generate = getattr(model, "can_generate", None)
    gen = getattr(model, "generation_config", None)
    if gen is not None and callable(can_generate) and can_generate():
        gen.save_pretrained(tmp)
    names = sorted(set(os.listdir(tmp)) - before)
    if fsync:
        for name in names:
            _fsync_file(tmp / name)
    return names


def _write_index(plan: SavePlan, path: Path, fsync: bool) -> None:
    num_params = sum(math.prod(t.shape) for t in plan.tensors if not t.is_buffer)
    index = {
        "metadata": {"total_parameters": num_params, "total_size": plan.total_bytes},
        "weight_map": plan.weight_map(),
    }
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path, enabled: bool, strict: bool = True) -> None:
    """fsync a directory (makes renames in it durable); not possible on every platform."""
    if not enabled or sys.platform == "win32":
        return
    try:
        _fsync_file(path)
    except OSError:
        if strict:
            raise


def _unlink(path: Path, strict: bool = False) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        if strict:
            raise
