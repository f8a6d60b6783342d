"""peft LoRA adapters on an EP + FSDP2 model: load and save them through moeshard's planner.

The user builds the model on meta, applies peft, parallelizes, loads::

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                             target_parameters=["mlp.experts.gate_up_proj",
                                                                "mlp.experts.down_proj"]))
    moeshard.parallelize(model, mesh, placement)
    moeshard.lora.load(model, "base_ckpt", "adapter_dir", placement=placement)
    ...train...
    moeshard.lora.save_adapter(model, "out_adapter", placement=placement)

Layouts. peft's ``lora.ParamWrapper`` on a fused expert parameter ``[E, out, in]`` holds
``lora_A.weight [r*E, in]`` (rows expert-major: ``reshape(E, r, in)``) and ``lora_B.weight
[out, r*E]`` (columns ``reshape(out, r, E)``: the expert is the *fast* index). Expert ``e``'s
delta is ``scaling * B[:, :, e] @ A[e]``. Under EP a rank keeps its ``S`` slots only:

* ``lora_A``: DTensor ``[r*P, in]``, ``Shard(0)`` on "ep" (local ``[r*S, in]``, slot-major; the
  rows of physical slot ``p`` are ``p*r .. p*r+r-1``); with expert FSDP also ``Shard(1)``;
* ``lora_B``: DTensor ``[out, r*P]``, ``Shard(1)`` on "ep" (local ``[out, r*S]`` in peft's
  ``(r, slot)`` column order, slot fastest); with expert FSDP also ``Shard(0)`` (its rows).

So for EP the A and B of one expert split on different dims, and B's columns of one expert
are strided. Loading and saving plan B in 3-D, the file tensor as ``[out, r, E]`` and a rank's
local one as ``[out_local, r, S]`` (the same bytes), where one expert's columns are one box; a
box covers a run of slots holding consecutive experts (one per rank for a contiguous
placement; :func:`~moeshard.models.lora.factor_boxes`). Every copy of a redundant expert gets
its logical expert's factors; saving writes each logical expert once, from its first copy.
Other LoRA weights (``lora.Linear`` on attention projections) are plain FSDP2 parameters:
``Shard(0)`` boxes like any dense weight.

Adapter files are peft's: ``adapter_model.safetensors`` (keys like
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, the model's parameter
names without the adapter name) and ``adapter_config.json``. One adapter per model
(``default`` or any single name); LoRA variants (DoRA, biases, embeddings) are refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import collectives
from ..box import box_numel, box_shape, box_slices
from ..execute import LocalTensors, Sink, Source, execute_schedule
from ..io.header import DTYPE_NAMES
from ..io.index import CheckpointIndex
from ..io.reader import CheckpointReader
from ..io.strict_json import load_json
from ..io.writer import pwrite_all, safetensors_header
from ..models.describe import ParamDesc, local_tensor
from ..models.layout import check_cast, inputs_digest, need_table
from ..models.lora import (
    AdapterTensor,
    adapter_desc,
    adapter_tensors,
    distinct_boxes,
    factor_boxes,
    local_view,
    lora_modules,
    plan_shape,
)
from ..models.routing import resolve_placement
from ..placement import Placement
from ..plan import DEFAULT_STAGING_BYTES, NeedTable, plan_transfers
from ..plan.arrays import row_prod, unique_rows
from ..plan.save import HeldBoxes, tensor_schedule
from ..topology import Topology
from .load import refuse_or_warn
from .report import OpReport
from .skeleton import group_topology

__all__ = [
    "AdapterError",
    "AdapterReport",
    "ADAPTER_WEIGHTS",
    "ADAPTER_CONFIG",
    "adapter_tensors",
    "load",
    "load_adapter",
    "save_adapter",
]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class AdapterError(collectives.DistributedError, ValueError):
    """Raised on every rank when an adapter does not fit the model (missing or unexpected key,
    a shape of another LoRA rank ``r``, a config with other ``r`` / ``lora_alpha``) or when
    loading or saving it failed on any rank; names each failing rank and its message."""


@dataclass(frozen=True)
class AdapterReport(OpReport):
    """What :func:`load_adapter` or :func:`save_adapter` did on this rank; ``unused_keys``:
    adapter keys the model has no LoRA weight for (only with ``strict=False``)."""

    num_tensors: int
    num_boxes: int
    bytes_rank: int
    unused_keys: tuple[str, ...] = ()


def check_adapter(
    pairs: list[tuple[AdapterTensor, torch.Tensor]],
    index: CheckpointIndex,
    config: dict | None,
    path: str,
    scalings: dict[str, tuple[int, float]],
    strict: bool = True,
) -> tuple[str, ...]:
    """ValueError for a key set, shape, dtype (the cast rule, :func:`moeshard.models.layout.check_cast`)
    or config that does not fit the model's adapter. Returns the adapter's keys the model has
    no LoRA weight for (an error when ``strict``, else logged as a warning on rank 0)."""
    want = {t.key: (t, p) for t, p in pairs}
    for key in want:
        if key not in index:
            t = want[key][0]
            raise ValueError(
                f"adapter {path} has no tensor {key!r} (the model expects a LoRA weight of shape "
                f"{list(t.shape)}, {t.what})"
            )
    extra = tuple(sorted(index.tensors.keys() - want.keys()))
    if extra:
        refuse_or_warn(
            f"adapter {path} has tensor {extra[0]!r} ({len(extra)} such), which the model has no LoRA "
            f"weight for; the model's adapter keys are like {sorted(want)[0]!r}",
            strict,
            "moeshard.lora.load_adapter",
        )
    for key, (t, p) in want.items():
        info = index.info(key)
        if tuple(info.shape) != t.shape:
            raise ValueError(
                f"adapter tensor {key!r} has shape {list(info.shape)}, the model expects {list(t.shape)} ({t.what})"
            )
        check_cast(f"LoRA weight {t.name}", key, index, p.dtype)
    if config is not None:
        for adapter, (r, scaling) in scalings.items():
            cr = config.get("r")
            alpha = config.get("lora_alpha", cr)
            if cr != r:
                raise ValueError(f"{path}/{ADAPTER_CONFIG}: r={cr}, the model's adapter {adapter!r} has r={r}")
            cs = alpha / (cr**0.5 if config.get("use_rslora") else cr)
            if not np.isclose(cs, scaling, rtol=1e-6):
                raise ValueError(
                    f"{path}/{ADAPTER_CONFIG}: lora_alpha={alpha} gives scaling {cs}, the model's "
                    f"adapter {adapter!r} has scaling {scaling}"
                )
    return extra


def _needs(
    items: list[tuple[AdapterTensor, ParamDesc]],
    index: CheckpointIndex,
    placement: Placement | None,
    world_size: int,
    keep_ranks: np.ndarray | None = None,
) -> NeedTable:
    """Every rank's needs of the adapter (expert factors in :func:`plan_shape` coordinates;
    ``index``: the adapter's headers with those shapes), or what one rank's plan takes
    (``keep_ranks``, as :func:`~moeshard.models.layout.need_table`'s). Param ``i`` is item ``i``.
    Pure; O(tensors) numpy calls over each tensor's boxes."""
    parts = []
    plain = [i for i, (t, _) in enumerate(items) if not t.factor]
    if plain:
        table = need_table([items[i][1] for i in plain], index, None, world_size, keep_ranks=keep_ranks)
        parts.append(dataclasses.replace(table, param=np.asarray(plain, np.int32)[table.param], digest=None))
    for i, (t, d) in enumerate(items):
        if t.factor:
            assert placement is not None
            b = factor_boxes(t, d, placement, world_size)
            # Alone: no other rank needs this box. Runs never straddle an expert with several
            # copies, so two ranks' boxes are equal or disjoint: a box seen once is alone.
            n = len(b.rank)
            _, inverse = unique_rows(np.concatenate([b.off, b.len], axis=1))
            parts.append(
                NeedTable(
                    keys=(t.key,),
                    ndim=np.asarray([b.off.shape[1]], np.int8),
                    rank=b.rank.astype(np.int32),
                    param=np.full(n, i, np.int32),
                    key=np.zeros(n, np.int32),
                    slot=np.full(n, -1, np.int64),
                    src_off=b.off,
                    src_len=b.len,
                    dst_off=b.local_off,
                    alone=np.bincount(inverse)[inverse] == 1,
                )
            )
    table = NeedTable.concat(parts, keep_ranks, lambda keys: index.key_columns(keys)[0])
    h = hashlib.sha256(b"moeshard.lora.needs/1")
    h.update(inputs_digest([d for _, d in items], placement, world_size, False))
    h.update(repr([(t.key, t.shape, t.factor, t.layer, t.rank) for t, _ in items]).encode())
    return dataclasses.replace(table, digest=h.digest())


def _planning_index(index: CheckpointIndex, items: list[tuple[AdapterTensor, ParamDesc]]) -> CheckpointIndex:
    """``index`` with each expert factor's shape as :func:`plan_shape` gives it (the same
    bytes: a reader of the planned boxes reads the right elements)."""
    tensors = dict(index.tensors)
    for t, _ in items:
        shape = plan_shape(t)
        if shape != tuple(t.shape):
            tensors[t.key] = dataclasses.replace(tensors[t.key], shape=shape)
    return dataclasses.replace(index, tensors=tensors)


def _scalings(model: nn.Module) -> dict[str, tuple[int, float]]:
    out = {}
    for m in lora_modules(model).values():
        for adapter in m.lora_A.keys():
            out[adapter] = (int(m.r[adapter]), float(m.scaling[adapter]))
    return out


def _agree(step, what: str, fingerprint=None):
    with collectives.errors_as(AdapterError):
        return collectives.agree(step, what, fingerprint=fingerprint)


def load_adapter(
    model: nn.Module,
    adapter: str | os.PathLike,
    placement: Placement | None = None,
    storage: str = "auto",
    *,
    topology: Topology | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    device: torch.device | None = None,
    strict: bool = True,
) -> AdapterReport:
    """Collective (every rank): load a peft adapter directory (or its ``.safetensors`` file)
    into the LoRA weights of a parallelized peft model, every rank its own boxes: FSDP shards
    of attention adapters, its slots' rows of expert ``lora_A`` and columns of ``lora_B``
    (every copy of a redundant expert gets its logical expert's). Reads, P2P and storage
    modes are :func:`moeshard.load`'s (the same planner and executor).

    ``placement``: as in :func:`moeshard.load` (None: the one the model routes by; another is
    refused). ``strict=False`` loads an adapter with keys the model has no LoRA weight for (a
    warning; ``AdapterReport.unused_keys``); a missing key is always an error.

    Raises:
        AdapterError (a ValueError) on every rank: an adapter key missing or unexpected, a
            shape of another rank r or expert count, a dtype the cast rule refuses,
            ``adapter_config.json``'s r / lora_alpha different from the model's, a failed read,
            any rank's bad argument (a placement other than its model's, a topology of another
            world size).
    """
    from ..execute import ReaderSource, TensorSink, node_groups
    from ..io.sources import resolve_sources
    from .load import materialize

    op = "moeshard.lora.load_adapter"
    # This rank's arguments are checked in the first exchange: a bad one raises on every rank.
    placement, topo, path, dev = _agree(
        lambda: (
            resolve_placement(model, placement, op),
            group_topology(topology),
            Path(os.fspath(adapter)),
            materialize(model, device),
        ),
        f"{op}: checking the arguments and materializing the model",
    )
    weights = path if path.suffix == ".safetensors" else path / ADAPTER_WEIGHTS
    root = weights.parent
    rank = topo.rank
    mode, readers, scope, index = resolve_sources(str(weights), storage, topo, weights.is_file())
    first = int(np.flatnonzero(readers)[0])

    def read_config():
        if rank != first or not (root / ADAPTER_CONFIG).is_file():
            return None
        return load_json(root / ADAPTER_CONFIG, "unreadable adapter config")  # untrusted: errors name the file

    what = f"moeshard.lora.load_adapter: reading {ADAPTER_CONFIG}"
    config = collectives.broadcast_object(_agree(read_config, what), src=first, what=what)

    def make_plan():
        pairs = adapter_tensors(model, placement)
        unused = check_adapter(pairs, index, config, str(root), _scalings(model), strict)
        items = [(t, adapter_desc(t, p)) for t, p in pairs]
        view = _planning_index(index, items)
        keep = ~np.asarray(readers, dtype=bool)  # this rank's plan: its needs and those of ranks that cannot read
        keep[rank] = True
        needs = _needs(items, view, placement, topo.world_size, keep)
        return (
            pairs,
            view,
            plan_transfers(needs, view, topo, readers, scope=scope, staging_bytes=staging_bytes, rank=rank),
            unused,
        )

    pairs, view, plan, unused = _agree(
        make_plan, f"moeshard.lora.load_adapter: planning {weights}", fingerprint=lambda pp: pp[2].fingerprint
    )
    reader = CheckpointReader(view, str(root)) if readers[rank] else None
    group = node_groups(topo) if plan.has_broadcasts else None
    try:
        with torch.no_grad(), collectives.errors_as(AdapterError):
            what = "moeshard.lora.load_adapter: executing the plan"
            dests = [local_view(t, local_tensor(p)) for t, p in pairs]
            stats = collectives.agree(
                lambda: execute_schedule(
                    plan,
                    rank,
                    ReaderSource(plan, reader, view),
                    TensorSink(plan, dests, rank),
                    dev,
                    node_group=group,
                    what=what,
                ).check(),
                what,
            )
    finally:
        if reader is not None:
            reader.close()
    collectives.barrier("moeshard.lora.load_adapter: finishing")
    return AdapterReport(
        rank=rank,
        world_size=topo.world_size,
        num_tensors=len(pairs),
        num_boxes=int((plan.deliveries.rank == rank).sum()),
        bytes_rank=stats.bytes_read + stats.bytes_received,
        plan=plan.cost.summary(),
        fingerprint=plan.fingerprint,
        bytes_read_rank=stats.bytes_read,
        bytes_sent_rank=stats.bytes_sent,
        bytes_received_rank=stats.bytes_received,
        peak_staging_bytes_rank=stats.peak_staging_bytes,
        unused_keys=unused,
    )


def load(model: nn.Module, checkpoint, adapter, placement: Placement | None = None, storage: str = "auto", **kwargs):
    """Collective: :func:`moeshard.load` of the base ``checkpoint`` (its keys have no peft
    prefixes), then :func:`load_adapter`; ``strict`` (default True) applies to both. Returns
    ``(LoadReport, AdapterReport)``."""
    from .load import load as load_base

    base = load_base(model, checkpoint, placement=placement, storage=storage, **kwargs)
    keep = {k: kwargs[k] for k in ("topology", "staging_bytes", "device", "strict") if k in kwargs}
    return base, load_adapter(model, adapter, placement=placement, storage=storage, **keep)


# -- save -----------------------------------------------------------------------------------


def _held_boxes(items, placement, world_size) -> Iterator[HeldBoxes]:
    """Per adapter tensor (made one at a time), the boxes tiling it once in :func:`plan_shape`
    coordinates: an expert's factors from its first copy, each distinct box of another
    tensor from its first holder. Raises ValueError where the ranks hold less than the tensor."""
    for t, d in items:
        b = (
            factor_boxes(t, d, placement, world_size, first_copy_only=True)
            if t.factor
            else distinct_boxes(d, world_size)
        )
        total, want = int(row_prod(b.len).sum()), math.prod(t.shape)
        if total != want:
            raise ValueError(
                f"adapter tensor {t.key!r}: the ranks hold {total} of its {want} elements "
                "(a logical expert with no slot?)"
            )
        yield b


def _header(items) -> tuple[bytes, list[int]]:
    """safetensors header (keys sorted) and each item's data offset."""
    order = sorted(range(len(items)), key=lambda i: items[i][0].key)
    offsets, entries, pos = [0] * len(items), [], 0
    for i in order:
        t, d = items[i]
        n = int(np.prod(t.shape)) * d.dtype.itemsize
        entries.append((t.key, DTYPE_NAMES[d.dtype], t.shape, pos, pos + n))
        offsets[i] = pos
        pos += n
    return safetensors_header(entries), offsets


def save_adapter(
    model: nn.Module,
    out_dir: str | os.PathLike,
    placement: Placement | None = None,
    *,
    single_writer: bool = False,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> AdapterReport:
    """Collective (every rank): write the model's LoRA weights as a peft adapter
    (``adapter_model.safetensors`` + ``adapter_config.json``) that ``PeftModel.from_pretrained``
    loads on one process.

    Each adapter tensor is assembled by one writer rank (tensors spread round-robin over the
    ranks; ``single_writer=True``: all by rank 0, for ``out_dir`` on storage only rank 0 sees),
    from the holders of its boxes by P2P; an expert's factors come from its first copy, once.
    Writers write their tensors at their offsets (known to every rank from the header) in the
    one file, so ``out_dir`` must be on storage all ranks share unless ``single_writer``. The
    file is written under a temporary name and renamed once every rank succeeded.
    ``placement``: as in :func:`moeshard.save` (None: the one the model routes by; another is
    refused).

    Raises:
        AdapterError on every rank if any rank failed (its input, or a write such as an
            ``out_dir`` one rank cannot write); what the save created in ``out_dir`` is removed.
    """
    rank, world = collectives.rank_and_world()

    def make_plan():
        out = Path(os.fspath(out_dir))
        placement_ = resolve_placement(model, placement, "moeshard.lora.save_adapter")
        items = [(t, adapter_desc(t, p)) for t, p in adapter_tensors(model, placement_)]
        if not items:
            raise ValueError("the model has no LoRA weights")
        for t, d in items:
            if d.dtype not in DTYPE_NAMES:
                raise ValueError(f"adapter tensor {t.key!r}: dtype {d.dtype} cannot be stored in safetensors")
        writers = [0 if single_writer else i % world for i in range(len(items))]
        head, offsets = _header(items)
        schedule = tensor_schedule(
            [t.key for t, _ in items],
            [plan_shape(t) for t, _ in items],
            [d.dtype.itemsize for _, d in items],
            _held_boxes(items, placement_, world),
            writers,
            world,
            staging_bytes,
            rank=rank,
        )
        return out, items, schedule, writers, head, offsets

    # The schedule's fingerprint digests its inputs: keys, shapes, writers and every box.
    out, items, schedule, writers, head, offsets = _agree(
        make_plan, "moeshard.lora.save_adapter: planning", fingerprint=lambda x: x[2].fingerprint
    )
    params = dict(model.named_parameters())
    locals_ = [local_view(t, local_tensor(params[t.name])) for t, _ in items]
    tmp = out / f".{ADAPTER_WEIGHTS}.moeshard-tmp"
    made: list[Path] = []  # what rank 0 created: removed again if the save fails

    def create():
        if rank == 0:
            missing = [p for p in [out, *out.parents] if not p.exists()]
            out.mkdir(parents=True, exist_ok=True)
            made.extend(reversed(missing))
            made.append(tmp)
            with open(tmp, "wb") as f:
                f.write(head)
                f.truncate(len(head) + sum(int(np.prod(t.shape)) * d.dtype.itemsize for t, d in items))

    written = [0]

    def write():
        _write_tensors(schedule, items, writers, offsets, len(head), locals_, tmp, rank, written)

    def finish():
        if rank == 0:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            config = getattr(model, "peft_config", None)
            if config:
                had = (out / ADAPTER_CONFIG).exists()
                (next(iter(config.values()))).save_pretrained(str(out))
                if not had:
                    made.append(out / ADAPTER_CONFIG)
            os.replace(tmp, out / ADAPTER_WEIGHTS)  # last: now the adapter is complete

    try:
        _agree(create, f"moeshard.lora.save_adapter: creating {tmp}")
        _agree(write, f"moeshard.lora.save_adapter: writing {tmp}")
        _agree(finish, f"moeshard.lora.save_adapter: renaming into {out}")
    except collectives.PeerLostError:
        _unmake(made)
        raise
    except AdapterError:  # raised on every rank: rank 0 removes what it made, then all return
        _unmake(made)
        collectives.barrier("moeshard.lora.save_adapter: removing the temporary file")
        raise
    return AdapterReport(
        rank=rank,
        world_size=world,
        num_tensors=len(items),
        num_boxes=int((schedule.views.rank == rank).sum()),
        bytes_rank=written[0],
        plan={"writers": sorted(set(writers))},
        fingerprint=schedule.fingerprint,
    )


class _AdapterFile(Sink):
    """The writer's side of one adapter file: boxes of a tensor are assembled in host memory
    and the tensor is written at its offset once complete (its boxes can be many thin
    columns: one write per tensor, not per run)."""

    def __init__(self, schedule, items, offsets, data_start: int, fd: int | None):
        # fd None on a writer: it could not open the file; it assembles and drops its tensors.
        self.s, self.items, self.offsets, self.data_start, self.fd = schedule, items, offsets, data_start, fd
        self.partial: dict[int, tuple[torch.Tensor, list[int]]] = {}
        self.written = 0

    def put(self, entries: list[tuple[int, torch.Tensor]]) -> None:
        s = self.s
        for row, data in entries:
            pid = int(s.deliveries.piece[row])
            i = int(s.pieces.key[pid])
            t, d = self.items[i]
            if i not in self.partial:  # in plan_shape (B: [out, r, E]): the file's bytes, contiguous
                self.partial[i] = (torch.empty(plan_shape(t), dtype=d.dtype), [0])
            full, filled = self.partial[i]
            box = s.piece_box(pid)
            full[box_slices(box)] = data.view(box_shape(box)).cpu()
            filled[0] += box_numel(box)
            if filled[0] == full.numel():
                del self.partial[i]
                if self.fd is None:
                    continue
                raw = full.contiguous().view(torch.uint8).numpy().tobytes()
                pwrite_all(self.fd, raw, self.data_start + self.offsets[i])
                self.written += len(raw)


class _AdapterViews(Source):
    def __init__(self, schedule, locals_, rank: int, items):
        self.s, self.items, self.local = schedule, items, LocalTensors(schedule, locals_, rank)

    def view(self, v: int, pid: int) -> torch.Tensor:
        return self.local.view(v, pid)

    def dtype(self, pid: int) -> torch.dtype:
        return self.items[int(self.s.pieces.key[pid])][1].dtype


def _unmake(made: list[Path]) -> None:
    """Remove what a failed :func:`save_adapter` created (files, then directories if empty), last first."""
    for p in reversed(made):
        try:
            if p.is_dir():
                p.rmdir()
            else:
                p.unlink(missing_ok=True)
        except OSError:
            pass  # a directory someone else filled meanwhile: not ours to remove


def _write_tensors(schedule, items, writers, offsets, data_start, locals_, path, rank, written) -> None:
    """Collective: run this rank's rows of the adapter's schedule
    (:func:`~moeshard.plan.save.tensor_schedule`); writers assemble their tensors and write them
    at their offsets."""
    device = next((x.device for x in locals_ if x is not None), torch.device("cpu"))
    fd, failure = None, None
    if rank in writers:
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError as e:  # this rank cannot write there: it still takes part (peers send to it)
            failure = e
    try:
        sink = _AdapterFile(schedule, items, offsets, data_start, fd)
        stats = execute_schedule(
            schedule,
            rank,
            _AdapterViews(schedule, locals_, rank, items),
            sink,
            device,
            what="moeshard.lora.save_adapter: sending the tensors to their writers",
        )
        if failure is not None:
            raise failure
        stats.check()
        assert not sink.partial, f"rank {rank}: adapter tensors left incomplete: {sorted(sink.partial)}"
        written[0] += sink.written
    finally:
        if fd is not None:
            os.close(fd)
