"""``moeshard.reshard``: fill a model built on a new mesh from the shards live ranks still hold.

Elastic training for whole models. Before a loss (at start-up, after each relocation), every
rank keeps :func:`describe_shards` of its model: a small, picklable record of the old layout
(every parameter's global shape, mesh in ranks and placements, the expert placement) and its
own rank in it. After ranks are lost (or to resize a job), the survivors, and any joiners, form
a NEW process group, build the model on a new mesh (another EP, expert-FSDP, FSDP or HSDP
replicate size, another placement) and call :func:`reshard` on it with their old record and old
local tensors (the old model object: its DTensors' local shards outlive their process group).

Steps (collective, every rank of ``group``): materialize the new model -> learn each member's
old rank and the old record (one exchange) -> plan (pure, :func:`moeshard.plan.reshard.plan_reshard`:
sources are the live holders of each box; storage only for boxes no survivor holds) -> agree ->
refuse or warn when a dense box would come from storage (older than the live weights) -> run the
peer schedule with the one runner -> read the missing boxes from the checkpoint (the load
planner, its needs clipped to those boxes) -> report. The old tensors are only read: a peer
lost during the reshard raises :class:`~moeshard.PeerLostError` and leaves them intact.

Optimizer state (``optimizer`` / ``old_optimizer``): every state tensor shaped like its
parameter (AdamW's ``exp_avg``, ``exp_avg_sq``) is resharded with it, as a unit of its own; a
scalar state (``step``) is taken from the survivors (the same on every rank of a job).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from .. import collectives
from ..execute import LocalTensors, ReaderSource, Source, TensorSink, execute_schedule
from ..io.extents import plan_extent_arrays
from ..io.reader import CheckpointReader
from ..io.sources import Storage, reader_root, resolve_sources, sources_share
from ..models.adapters import DEFAULT_SPECS, ExpertsSpec
from ..models.describe import ParamDesc, describe_model, local_tensor
from ..models.ep import slot_placement
from ..models.layout import need_table
from ..models.routing import resolve_placement
from ..models.shards import shard_boxes
from ..models.slot_guard import guard_optimizer
from ..plan import DEFAULT_MAX_OPS, DEFAULT_STAGING_BYTES, NeedTable, Schedule, plan_transfers
from ..plan.reshard import BoxRows, ReshardPlan, StorageCells, Units, plan_reshard
from ..topology import Topology
from .load import materialize
from .report import OpReport, Phases
from .skeleton import group_topology, local_tensors, named_tensors

__all__ = [
    "TensorLayout",
    "ShardLayout",
    "describe_shards",
    "ReshardReport",
    "StaleStateError",
    "reshard",
    "OPTIMIZER_SEP",
]

logger = logging.getLogger("moeshard")

# A unit of optimizer state is named "<parameter>::<state>" (AdamW's "...::exp_avg").
OPTIMIZER_SEP = "::"


class StaleStateError(collectives.DistributedError):
    """Raised on every rank by :func:`reshard` with ``dense_from_storage="raise"`` when some
    dense box has no live holder: reading it from the checkpoint would mix the checkpoint's
    training step with the live weights'. The message names the tensors."""


@dataclass(frozen=True)
class TensorLayout:
    """One tensor of a model as its ranks hold it (torch-free, picklable).

    Args:
        name: the parameter's (or persistent buffer's) name; an optimizer state's is
            ``"<parameter>::<state>"``.
        shape: global shape; an expert parameter's ``[num_physical, *slice]``.
        dtype: the torch dtype's name (``"float32"``).
        mesh: ``int64[*mesh_shape]`` ranks of its DTensor mesh, or None for a tensor every rank
            holds whole.
        placements: per mesh dim the tensor dim its ``Shard`` splits, or None (``Replicate``).
        layer: the MoE layer of an expert parameter, -1 for a dense one.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    mesh: np.ndarray | None
    placements: tuple
    layer: int = -1

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class ShardLayout:
    """A model's layout on its mesh, and one rank's place in it (:func:`describe_shards`).

    Args:
        tensors: every parameter and persistent buffer (and optimizer state, if described).
        phy2log: ``int64[num_layers, num_physical]`` the expert placement (None: no experts).
        num_logical: logical experts per MoE layer (0: no experts).
        world_size: the ranks of the process group the layout's meshes are in.
        rank: this rank in that group.
    """

    tensors: tuple[TensorLayout, ...]
    phy2log: np.ndarray | None
    num_logical: int
    world_size: int
    rank: int

    def digest(self) -> str:
        """What every rank of the job describes alike (everything but ``rank``)."""
        h = hashlib.sha256(repr((self.num_logical, self.world_size)).encode())
        for t in self.tensors:
            h.update(repr((t.name, t.shape, t.dtype, t.placements, t.layer)).encode())
            h.update(b"-" if t.mesh is None else np.ascontiguousarray(t.mesh, np.int64).tobytes())
        if self.phy2log is not None:
            h.update(np.ascontiguousarray(self.phy2log, np.int64).tobytes())
        return h.hexdigest()[:16]

    def shared(self) -> ShardLayout:
        """The layout without a rank's place (what a joiner is sent)."""
        return ShardLayout(self.tensors, self.phy2log, self.num_logical, self.world_size, -1)


def _placements(d: ParamDesc) -> tuple:
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for p in d.placements:
        if isinstance(p, int) or p is None:
            out.append(p)
        elif type(p).__name__ == "_StridedShard":
            raise ValueError(f"parameter {d.name}: placement {p} cannot be resharded (Shard and Replicate can)")
        elif isinstance(p, Shard):
            out.append(p.dim + len(d.shape) if p.dim < 0 else p.dim)
        elif isinstance(p, Replicate):
            out.append(None)
        else:
            raise ValueError(f"parameter {d.name}: placement {p} cannot be resharded (Shard and Replicate can)")
    return tuple(out)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_layouts(descs: Sequence[ParamDesc]) -> list[TensorLayout]:
    return [
        TensorLayout(
            d.name,
            tuple(d.shape),
            _dtype_name(d.dtype),
            None if d.mesh is None else np.asarray(d.mesh, np.int64),
            _placements(d),
            d.expert.layer if d.expert is not None else -1,
        )
        for d in descs
    ]


def _state_layouts(
    layouts: Sequence[TensorLayout], params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer
) -> list[TensorLayout]:
    """The optimizer's per-parameter state tensors shaped like their parameter, as layouts of
    their own (sorted state names; a state the optimizer has not created yet is left out)."""
    out = []
    for t in layouts:
        p = params.get(t.name)
        state = optimizer.state.get(p, {}) if p is not None else {}
        for k in sorted(state):
            v = state[k]
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) and v.dim() > 0:
                out.append(
                    TensorLayout(
                        f"{t.name}{OPTIMIZER_SEP}{k}", t.shape, _dtype_name(v.dtype), t.mesh, t.placements, t.layer
                    )
                )
    return out


def describe_shards(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    group=None,
) -> ShardLayout:
    """Local (no communication): the layout of ``model`` (parallelized and loaded) and this
    rank's place in it, for a later :func:`reshard`; with ``optimizer``, its per-parameter state
    too. Take it while the job is whole (after parallelize, after each relocation); it is small
    (a record per tensor) and picklable. Ranks are those of ``group`` (default: the default
    group), in which every DTensor mesh of the model must lie."""
    with collectives.scope(group):
        rank, world = collectives.rank_and_world()
        descs = describe_model(model, None, specs)
        layouts = _tensor_layouts(descs)
        if optimizer is not None:
            layouts += _state_layouts(layouts, named_tensors(model), optimizer)
        pl = slot_placement(model)  # read from the routing tables
        has_experts = any(t.layer >= 0 for t in layouts)
        if has_experts and pl is None:
            raise ValueError(
                "the model has expert parameters but no placement (moeshard.parallelize sets model.moeshard_placement)"
            )
        phy2log = np.array(pl.phy2log, np.int64) if has_experts else None
        return ShardLayout(tuple(layouts), phy2log, pl.num_logical if has_experts else 0, world, rank)


@dataclass(frozen=True, kw_only=True)
class ReshardReport(OpReport):
    """What a reshard did (``*_rank``: this rank's; the others job-wide).

    Args:
        storage_boxes: ``(unit, box)`` of every box read from storage, sorted: a unit is a dense
            tensor's name or ``"<expert parameter>[<logical expert>]"`` (an optimizer state's
            with ``"::<state>"``), a box per-dim ``(offset, length)`` in it.
        dense_from_storage: the dense tensors some of whose boxes came from storage (older than
            the live state; allowed by ``dense_from_storage="warn"`` or ``"allow"``).
        peer_bytes, copy_bytes, storage_bytes: bytes sent between ranks, copied within ranks,
            and read from storage (planned, job-wide).
        bytes_copied_rank: this rank's bytes copied from its own old tensors.
        joined: whether this rank held nothing of the old model.
    """

    storage_boxes: tuple = ()
    dense_from_storage: tuple[str, ...] = ()
    peer_bytes: int = 0
    copy_bytes: int = 0
    storage_bytes: int = 0
    bytes_copied_rank: int = 0
    joined: bool = False


# -- describe: layouts -> box rows ---------------------------------------------------------


class _UnitIndex:
    """Unit names -> ids, in order of first appearance, with their dims, dtype and kind."""

    def __init__(self):
        self.ids: dict[str, int] = {}
        self.ndim: list[int] = []
        self.dtype: list[str] = []
        self.dense: list[bool] = []

    def get(self, key: str, ndim: int, dtype: str, dense: bool) -> int:
        u = self.ids.get(key)
        if u is None:
            u = self.ids[key] = len(self.ndim)
            self.ndim.append(ndim)
            self.dtype.append(dtype)
            self.dense.append(dense)
        return u

    def units(self) -> Units:
        itemsize = [torch.empty(0, dtype=getattr(torch, d)).element_size() for d in self.dtype]
        return Units(
            tuple(self.ids),
            np.asarray(self.ndim, np.int64),
            np.asarray(itemsize, np.int64),
            np.asarray(self.dense, bool),
        )


def unit_key(name: str, expert: int | None) -> str:
    return name if expert is None else f"{name}[{expert}]"


def _box_rows(
    layouts: Sequence[TensorLayout],
    phy2log: np.ndarray | None,
    world: int,
    rank_map: np.ndarray,
    units: _UnitIndex,
    width: int,
) -> BoxRows:
    """Every rank's boxes of every unit of ``layouts`` (ranks of the layout's group mapped by
    ``rank_map``; a rank mapped to -1 holds nothing), rows as :class:`BoxRows`."""
    i64 = np.int64
    parts: list[tuple[np.ndarray, ...]] = []  # (unit, rank, param, slot, off, len) per layout
    for j, t in enumerate(layouts):
        nd = len(t.shape)
        if t.mesh is None:
            ranks = np.arange(world, dtype=i64)
            boxes = np.broadcast_to(np.stack([np.zeros(nd, i64), np.asarray(t.shape, i64)], -1), (world, nd, 2))
        else:
            ranks = np.asarray(t.mesh, i64).reshape(-1)
            boxes = shard_boxes(t.shape, t.mesh.shape, t.placements)
        keep = (rank_map[ranks] >= 0) & (boxes[:, :, 1] > 0).all(axis=1)
        r, box = rank_map[ranks[keep]], boxes[keep]
        if t.layer < 0:
            u = units.get(t.name, nd, t.dtype, True)
            parts.append(
                (
                    np.full(len(r), u, i64),
                    r,
                    np.full(len(r), j, i64),
                    np.full(len(r), -1, i64),
                    box[:, :, 0],
                    box[:, :, 1],
                )
            )
            continue
        n = box[:, 0, 1]  # local slots of each rank's box, in rank then slot order
        row = np.repeat(np.arange(len(r)), n)
        k = np.arange(len(row), dtype=i64) - np.repeat(np.cumsum(n) - n, n)
        e = phy2log[t.layer, box[row, 0, 0] + k].astype(i64)
        on = e >= 0
        row, k, e = row[on], k[on], e[on]
        # Unit ids in order of first appearance (as a row-by-row walk gives them).
        first = np.unique(e, return_index=True)[1]
        ids = np.zeros(int(e.max(initial=-1)) + 1, i64)
        for x in e[np.sort(first)].tolist():
            ids[x] = units.get(unit_key(t.name, x), nd - 1, t.dtype, False)
        parts.append((ids[e], r[row], np.full(len(row), j, i64), k, box[row, 1:, 0], box[row, 1:, 1]))
    n = sum(len(p[0]) for p in parts)
    off, ln = np.zeros((n, width), i64), np.ones((n, width), i64)
    at = 0
    for p in parts:
        m, nd = len(p[0]), p[4].shape[1]
        off[at : at + m, :nd], ln[at : at + m, :nd] = p[4], p[5]
        at += m

    def col(c: int) -> np.ndarray:
        return np.concatenate([p[c] for p in parts]).astype(i64) if parts else np.zeros(0, i64)

    return BoxRows(col(0), col(1), col(2), col(3), off, ln, np.zeros((n, width), i64))


def _check_compatible(old: Sequence[TensorLayout], new: Sequence[TensorLayout], old_nl: int, new_nl: int) -> None:
    """Tensors of both layouts have the same global shape (experts: the same slice shape and
    logical expert count). ValueError naming the first that differs."""
    by_name = {t.name: t for t in old}
    for t in new:
        o = by_name.get(t.name)
        if o is None:
            continue
        if (o.layer < 0) != (t.layer < 0):
            raise ValueError(f"tensor {t.name} is an expert parameter in one layout and dense in the other")
        if t.layer < 0 and o.shape != t.shape:
            raise ValueError(f"tensor {t.name}: shape {list(t.shape)} in the new model, {list(o.shape)} in the old")
        if t.layer >= 0 and (o.shape[1:] != t.shape[1:] or old_nl != new_nl):
            raise ValueError(
                f"expert parameter {t.name}: slice {list(t.shape[1:])} of {new_nl} logical experts in "
                f"the new model, {list(o.shape[1:])} of {old_nl} in the old"
            )


# -- run -----------------------------------------------------------------------------------


class _OldTensors(Source):
    """Boxes of this rank's old local tensors (the plan's views); buffers in the holders' dtype."""

    def __init__(
        self, plan: ReshardPlan, tensors: Sequence[torch.Tensor | None], rank: int, dtypes: Sequence[torch.dtype]
    ):
        self.s = plan.schedule
        self.local = LocalTensors(plan.schedule, tensors, rank)
        self.dtypes = dtypes

    def view(self, v: int, pid: int) -> torch.Tensor:
        return self.local.view(v, pid)

    def dtype(self, pid: int) -> torch.dtype:
        return self.dtypes[int(self.s.pieces.key[pid])]


def _clip_storage(cells: StorageCells, table: NeedTable) -> NeedTable:
    """The load's needs cut to the storage cells (``M`` cells, the table's ``N`` rows of width
    ``D``): for each cell (a box of a new local tensor), the parts of the need rows of its rank,
    parameter and slot that fall inside it (their checkpoint boxes shifted alike); rows in cell
    order, then in the table's order. Pure; numpy over (cell, row) pairs of the same rank,
    parameter and slot. Raises ValueError where the rows do not cover a cell."""
    i64 = np.int64
    width = table.src_off.shape[1]
    m = len(cells)
    keys = np.concatenate(
        [
            np.stack([cells.rank, cells.param, cells.slot], 1).astype(i64),
            np.stack([table.rank, table.param, table.slot], 1).astype(i64),
        ]
    )
    gid = np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1)
    g_cell, g_row = gid[:m], gid[m:]
    order = np.argsort(g_row, kind="stable")
    starts = np.searchsorted(g_row[order], np.arange(len(keys) + 1))
    count = starts[g_cell + 1] - starts[g_cell]
    pc = np.repeat(np.arange(m), count)  # pairs (cell, row) of the same rank, param, slot
    pr = order[np.repeat(starts[g_cell] - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))]
    # The cells in the table's width (a cell's padding dims are beyond every key's ndim).
    k = min(width, cells.dst.shape[1])
    lo_c, hi_c = np.zeros((m, width), i64), np.ones((m, width), i64)
    lo_c[:, :k] = cells.dst[:, :k]
    hi_c[:, :k] = cells.dst[:, :k] + np.maximum(cells.len[:, :k], 1)
    d0, ln = table.dst_off[pr].astype(i64), table.src_len[pr].astype(i64)
    lo = np.maximum(d0, lo_c[pc])
    hi = np.minimum(d0 + ln, hi_c[pc])
    valid = np.arange(width)[None, :] < table.ndim[table.key[pr]].astype(i64)[:, None]
    ok = np.all(~valid | (hi > lo), axis=1)
    pc, pr, lo, hi, d0, valid = pc[ok], pr[ok], lo[ok], hi[ok], d0[ok], valid[ok]
    src = np.where(valid, table.src_off[pr] + lo - d0, table.src_off[pr]).astype(i64)
    size = np.where(valid, hi - lo, table.src_len[pr]).astype(i64)
    dst = np.where(valid, lo, table.dst_off[pr]).astype(i64)
    covered = np.zeros(m, i64)
    np.add.at(covered, pc, np.prod(np.where(valid, size, 1), axis=1))
    want = np.prod(np.where(cells.len > 0, cells.len, 1), axis=1) if m else np.zeros(0, i64)
    bad = np.flatnonzero(covered != want)
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"rank {int(cells.rank[i])}: the checkpoint's needs for parameter {int(cells.param[i])} "
            f"slot {int(cells.slot[i])} do not cover box {cells.dst[i].tolist()} + "
            f"{cells.len[i].tolist()} (a layout the reshard cannot read from storage)"
        )
    return NeedTable(
        keys=table.keys,
        ndim=table.ndim,
        rank=table.rank[pr],
        param=table.param[pr],
        key=table.key[pr],
        slot=table.slot[pr],
        src_off=src,
        src_len=size,
        dst_off=dst,
    )


def _old_locals(layout: ShardLayout, tensors, old_optimizer) -> list[torch.Tensor | None]:
    """This rank's old local tensors in the layout's order; ValueError naming a missing one or one
    whose shape is not the box the layout says this rank holds."""
    if isinstance(tensors, nn.Module):
        params = named_tensors(tensors)
    else:
        params = dict(tensors)
    out = []
    for t in layout.tensors:
        name, _, state = t.name.partition(OPTIMIZER_SEP)
        p = params.get(name)
        if p is None:
            raise ValueError(f"old rank {layout.rank}: no tensor {name} in old_tensors (the old model)")
        if state:
            if old_optimizer is None:
                raise ValueError(
                    f"old rank {layout.rank}: the old layout has optimizer state {t.name}; pass old_optimizer="
                )
            v = old_optimizer.state.get(p, {}).get(state)
            if v is None:
                raise ValueError(f"old rank {layout.rank}: the old optimizer has no state {state!r} for {name}")
            p = v
        loc = local_tensor(p)
        if t.mesh is not None:
            ranks = np.asarray(t.mesh).reshape(-1)
            at = np.flatnonzero(ranks == layout.rank)
            want = None
            if len(at):
                box = shard_boxes(t.shape, t.mesh.shape, t.placements)[int(at[0])]
                want = tuple(int(n) for n in box[:, 1])
            if want is not None and tuple(loc.shape) != want:
                raise ValueError(
                    f"old rank {layout.rank}: tensor {t.name} has local shape {list(loc.shape)}, the "
                    f"layout says {list(want)}"
                )
        elif tuple(loc.shape) != t.shape:
            loc = loc.view(t.shape)
        out.append(loc)
    return out


def _new_states(
    model: nn.Module, descs: Sequence[ParamDesc], optimizer: torch.optim.Optimizer, state_names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """Create the new optimizer's per-parameter state tensors (zeros, like their parameter) that
    the old layout holds, so the reshard can fill them: ``{unit tensor name: state tensor}``."""
    params = named_tensors(model)
    out = {}
    for d in descs:
        p = params[d.name]
        for k in state_names:
            name = f"{d.name}{OPTIMIZER_SEP}{k}"
            st = optimizer.state.setdefault(p, {})
            if k not in st:
                st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out[name] = st[k]
    return out


@collectives.runs_on_group
def reshard(
    model: nn.Module,
    old: ShardLayout | None,
    old_tensors: nn.Module | Mapping[str, torch.Tensor] | None = None,
    checkpoint: str | os.PathLike | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    old_optimizer: torch.optim.Optimizer | None = None,
    dense_from_storage: Literal["raise", "warn", "allow"] = "raise",
    storage: Storage = "auto",
    topology: Topology | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    max_ops: int = DEFAULT_MAX_OPS,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    device: torch.device | None = None,
    group=None,
) -> ReshardReport:
    """Collective (every rank of ``group``: the survivors and any joiners): fill ``model``, built
    on a new mesh and parallelized (it may be on the meta device), from the old model's shards
    that the members still hold; read from ``checkpoint`` only the boxes no member holds.

    Args:
        model: the new model (:func:`moeshard.parallelize` on a mesh of ``group``'s ranks, any EP,
            expert-FSDP, FSDP / HSDP replicate size or placement; its placement is the model's).
        old: this rank's :func:`describe_shards` of the old model (taken before the loss); None
            on a joiner, which holds nothing (every member must have the same old layout).
        old_tensors: the old model (or ``{name: tensor}`` of its parameters and persistent
            buffers) whose local shards this rank still holds; only read. None on a joiner.
        checkpoint: read for boxes no member holds (None: every box must have a live holder).
        optimizer, old_optimizer: reshard the per-parameter state of ``old_optimizer`` (described
            by ``describe_shards(old_model, old_optimizer)``) into ``optimizer`` over ``model``'s
            parameters (its state tensors created as needed; scalar states, e.g. AdamW's
            ``step``, taken from the first survivor). A state box with no live holder is refused
            (a checkpoint has no optimizer state).
        dense_from_storage: a dense box with no live holder (its checkpoint value is older than
            the live weights): "raise" (:class:`StaleStateError` on every rank, nothing changed),
            "warn" (log a warning on rank 0 and read it), "allow".
        storage, topology, staging_bytes, max_ops, device: as :func:`moeshard.load`'s.
        group: the process group of the members (default: the default group).

    Returns a :class:`ReshardReport` (which boxes came from storage, bytes per source).

    Raises:
        StaleStateError: ``dense_from_storage="raise"`` and some dense box has no live holder.
        PeerLostError: a member died during the reshard (on every member that saw it; the old
            tensors are intact, the new model partly filled).
        DistributedError: on every rank, for any member's bad input (layouts that differ between
            members, shapes that differ between the models, a box with no holder and no
            checkpoint, an optimizer state with no holder).
    """
    t0 = time.perf_counter()
    phases = Phases(t0)
    if dense_from_storage not in ("raise", "warn", "allow"):
        raise ValueError(f"dense_from_storage must be 'raise', 'warn' or 'allow', got {dense_from_storage!r}")
    if old is not None and (optimizer is None) != (old_optimizer is None):
        raise ValueError("pass optimizer= and old_optimizer= together (a joiner passes optimizer= only)")
    if old is not None and optimizer is None:  # the parameters only
        old = dataclasses.replace(old, tensors=tuple(t for t in old.tensors if OPTIMIZER_SEP not in t.name))
    rank, world = collectives.rank_and_world()
    topo = group_topology(topology, group)
    path = None if checkpoint is None else os.fspath(checkpoint)
    members = _meet(model, old, old_tensors, old_optimizer, device, path)
    phases.end("exchange")
    placement = resolve_placement(model, None, "moeshard.reshard", specs)
    planned = collectives.agree(
        lambda: _plan(model, members, placement, optimizer, specs, topo, staging_bytes, max_ops, path),
        "moeshard.reshard: planning",
        fingerprint=lambda r: r.plan.fingerprint,
    )
    descs, plan, dests, dtypes = planned.descs, planned.plan, planned.dests, planned.dtypes
    _check_stale(plan, dense_from_storage, rank)
    t_plan = phases.end("plan") - t0

    what = "moeshard.reshard: copying from live ranks"
    with torch.no_grad(), contextlib.ExitStack() as closing:
        # Storage reads planned and hinted to the kernel first: storage works while peers send.
        reads = _plan_storage(plan, descs, placement, path, storage, topo, members.everyone, staging_bytes, closing)
        sched = plan.schedule
        stats = collectives.agree(
            lambda: execute_schedule(
                sched,
                rank,
                _OldTensors(plan, members.old_locals, rank, dtypes),
                TensorSink(sched, dests, rank, receive_in_place=True),
                members.device,
                what=what,
            ).check(),
            what,
        )
        phases.end("peers")
        read = 0
        if reads is not None:
            read = _read_storage(reads, dests, members.device)
            phases.end("storage")
        if optimizer is not None:
            _scalar_states(model, descs, optimizer, old_tensors, old_optimizer, members.first, rank)
    # No closing barrier: the last agree (an all-reduce) returns once every rank is done.
    phases.end("finish")
    copied = int(sched.pieces.bytes[sched.copies.piece[sched.views.rank[sched.copies.view] == rank]].sum())
    return ReshardReport(
        rank=rank,
        world_size=world,
        wall_seconds=time.perf_counter() - t0,
        plan_seconds=t_plan,
        fingerprint=plan.fingerprint,
        plan=sched.cost.summary(),
        bytes_read_rank=read,
        bytes_sent_rank=stats.bytes_sent,
        bytes_received_rank=stats.bytes_received,
        peak_staging_bytes_rank=stats.peak_staging_bytes,
        phase_seconds=phases.seconds,
        phase_cpu_seconds=phases.cpu_seconds,
        storage_boxes=plan.storage_boxes,
        dense_from_storage=plan.dense_from_storage,
        peer_bytes=plan.peer_bytes,
        copy_bytes=plan.copy_bytes,
        storage_bytes=plan.storage_bytes,
        bytes_copied_rank=copied,
        joined=old is None,
    )


@dataclass(frozen=True)
class _Members:
    """What one exchange tells every member: its device, its old local tensors, every member's
    shares (old rank, old layout's digest, sees the checkpoint), their old ranks, the first
    survivor and the old layout (sent by it)."""

    device: torch.device
    old_locals: list
    everyone: list
    old_ranks: np.ndarray
    survivors: np.ndarray
    first: int
    shared: ShardLayout


def _meet(model, old, old_tensors, old_optimizer, device, path) -> _Members:
    """Collective: materialize the new model, gather every member's old rank and layout digest,
    refuse (on every rank) when no member holds the old model or their layouts differ, and send
    the old layout from the first survivor where a joiner needs it."""

    def prepare():
        dev = materialize(model, device)
        locals_ = _old_locals(old, old_tensors, old_optimizer) if old is not None else []
        return dev, locals_

    gathered = collectives.agree_and_gather(
        prepare,
        "moeshard.reshard: materializing the model",
        share=lambda _: (
            old.rank if old is not None else -1,
            old.digest() if old is not None else None,
            path is not None and os.path.exists(path),
        ),
    )
    (dev, old_locals), everyone = gathered.result, gathered.shares
    old_ranks = np.asarray([e[0] for e in everyone], np.int64)
    survivors = np.flatnonzero(old_ranks >= 0)
    digests = {e[1] for e in everyone if e[1] is not None}
    if not len(survivors):
        collectives.unanimous(
            lambda: _fail("no member holds the old model (every old= is None): use moeshard.load"), "moeshard.reshard"
        )
    if len(digests) > 1:
        collectives.unanimous(
            lambda: _fail(
                f"the members' old layouts differ (digests {sorted(digests)}): every "
                "survivor must pass the describe_shards of the same old model"
            ),
            "moeshard.reshard",
        )
    first = int(survivors[0])
    rank, _ = collectives.rank_and_world()
    if len(survivors) == len(old_ranks):  # no joiner: every member has the (agreed) layout
        shared = old.shared()
    else:
        shared = collectives.broadcast_object(
            old.shared() if rank == first else None, src=first, what="moeshard.reshard: sending the old layout"
        )
    return _Members(dev, old_locals, everyone, old_ranks, survivors, first, shared)


@dataclass(frozen=True)
class _Planned:
    """A rank's reshard plan and what its run needs: the new model's descriptions, the plan, the
    destination local tensors (parameters, then optimizer states) and each unit's dtype."""

    descs: list
    plan: ReshardPlan
    dests: list
    dtypes: list


def _plan(model, members: _Members, placement, optimizer, specs, topo, staging_bytes, max_ops, path) -> _Planned:
    """One rank's step of the planning agreement: the new layouts (with optimizer states), the
    holders' and the new model's box rows, :func:`~moeshard.plan.reshard.plan_reshard`, and the
    refusals that need the plan (an optimizer state or a box with no holder and no checkpoint)."""
    shared, old_ranks, survivors = members.shared, members.old_ranks, members.survivors
    _, world = collectives.rank_and_world()
    if optimizer is not None:  # its moments are placed in slot order: checked from now on
        guard_optimizer(optimizer)
    descs = describe_model(model, None, specs)
    new_layouts = _tensor_layouts(descs)
    new_states = {}
    if optimizer is not None:
        states = sorted({t.name.partition(OPTIMIZER_SEP)[2] for t in shared.tensors if OPTIMIZER_SEP in t.name})
        new_states = _new_states(model, descs, optimizer, states)
        new_layouts += [
            TensorLayout(name, t.shape, _dtype_name(new_states[name].dtype), t.mesh, t.placements, t.layer)
            for t in list(new_layouts)
            for name in (f"{t.name}{OPTIMIZER_SEP}{k}" for k in states)
        ]
    new_nl = placement.num_logical if placement is not None else 0
    _check_compatible(shared.tensors, new_layouts, shared.num_logical, new_nl)
    if old_ranks.max() >= shared.world_size:
        raise ValueError(f"old ranks {old_ranks.tolist()} outside the old layout's {shared.world_size} ranks")
    if len(set(old_ranks[survivors].tolist())) != len(survivors):
        raise ValueError(f"two members claim the same old rank: {old_ranks.tolist()}")
    rank_map = np.full(shared.world_size, -1, np.int64)
    rank_map[old_ranks[survivors]] = survivors
    width = max([len(t.shape) for t in (*shared.tensors, *new_layouts)] + [1])
    units = _UnitIndex()
    holds = _box_rows(shared.tensors, shared.phy2log, shared.world_size, rank_map, units, width)
    new_p2l = np.asarray(placement.phy2log) if placement is not None else None
    needs = _box_rows(new_layouts, new_p2l, world, np.arange(world, dtype=np.int64), units, width)
    plan = plan_reshard(units.units(), holds, needs, topo, staging_bytes, max_ops)
    state_missing = sorted(
        {plan.schedule.keys[u] for u in plan.storage.unit.tolist() if OPTIMIZER_SEP in plan.schedule.keys[u]}
    )
    if state_missing:
        raise ValueError(
            f"optimizer state boxes of {state_missing[:4]} (of {len(state_missing)}) have no live "
            "holder and no checkpoint holds optimizer state"
        )
    if len(plan.storage) and path is None:
        raise ValueError(
            f"{len(plan.storage_boxes)} boxes have no live holder (e.g. {plan.storage_boxes[0][0]}) "
            "and no checkpoint= was given"
        )
    dests = local_tensors(named_tensors(model), descs)  # one walk of the model, not one per tensor
    dests += [local_tensor(new_states[t.name]) for t in new_layouts[len(descs) :]]
    return _Planned(descs, plan, dests, [getattr(torch, d) for d in units.dtype])


def _check_stale(plan: ReshardPlan, dense_from_storage: str, rank: int) -> None:
    """Refuse (every rank: the plan is every rank's) or warn when dense boxes would come from
    storage, whose values are older than the live weights."""
    if not plan.dense_from_storage or dense_from_storage == "allow":
        return
    names = ", ".join(plan.dense_from_storage[:6]) + (" ..." if len(plan.dense_from_storage) > 6 else "")
    text = (
        f"moeshard.reshard: {len(plan.dense_from_storage)} dense tensors have boxes no live rank holds "
        f"({names}); their checkpoint values are older than the live weights (mixing training steps)"
    )
    if dense_from_storage == "raise":
        raise StaleStateError(
            f"{text}; keep an HSDP replica (make_mesh(replicate=...)) or pass "
            "dense_from_storage='warn' to read them anyway"
        )
    if rank == 0:
        logger.warning("%s: reading them from the checkpoint (dense_from_storage='warn')", text)


def _fail(message: str):
    raise ValueError(message)


@dataclass(frozen=True)
class _StorageReads:
    """A rank's part of reading the boxes no member holds: the load planner's schedule for
    them, its reader (None where this rank reads nothing) and index, and the node group for
    the schedule's broadcasts (None without them)."""

    sched: Schedule
    reader: CheckpointReader | None
    index: object
    node_group: object


def _plan_storage(
    plan: ReshardPlan,
    descs,
    placement,
    path: str,
    storage: Storage,
    topo: Topology,
    everyone,
    staging_bytes: int,
    closing: contextlib.ExitStack,
) -> _StorageReads | None:
    """Collective: plan the reads of the plan's storage cells with the load planner (its needs
    clipped to the cells), and hint the kernel about this rank's (``posix_fadvise(WILLNEED)``)
    so that storage reads them while the peers' transfers run. None without storage cells;
    the reader is closed with ``closing``."""
    if not len(plan.storage):
        return None
    rank = topo.rank
    can = bool(everyone[rank][2])
    shares = [sources_share(bool(e[2]), storage, topo) for e in everyone]
    mode, readers, scope, index = resolve_sources(path, storage, topo, can, everyone=shares)

    def make():
        table = _clip_storage(plan.storage, need_table(descs, index, placement, topo.world_size))
        sched = plan_transfers(table, index, topo, readers, scope=scope, staging_bytes=staging_bytes)
        return sched

    sched = collectives.agree(make, "moeshard.reshard: planning the storage reads", fingerprint=lambda s: s.fingerprint)
    reader = closing.enter_context(CheckpointReader(index, reader_root(path))) if readers[rank] else None
    if reader is not None:
        _hint_reads(sched, reader, rank)
    node_group = None
    if sched.has_broadcasts:
        from ..execute import node_groups

        node_group = node_groups(topo)
    return _StorageReads(sched, reader, index, node_group)


def _hint_reads(sched: Schedule, reader: CheckpointReader, rank: int) -> None:
    """``posix_fadvise(WILLNEED)`` every file byte range this rank will read in ``sched``,
    coalesced as the runner's reads are (:func:`~moeshard.io.extents.plan_extent_arrays`)."""
    files, offsets, sizes = [], [], []
    for pid in sched.reads.piece[sched.for_rank(rank).reads].tolist():
        key = sched.piece_name(pid)
        for offset, n in reader.runs(key, sched.piece_box(pid)):
            files.append(reader.index.info(key).file)
            offsets.append(offset)
            sizes.append(n)
    names = sorted(set(files))
    file_no = np.searchsorted(names, files).astype(np.int64)
    for e in plan_extent_arrays(names, file_no, np.asarray(offsets, np.int64), np.asarray(sizes, np.int64), rank=rank):
        reader.advise(e.file, e.offset, e.nbytes)


def _read_storage(reads: _StorageReads, dests, dev) -> int:
    """Collective: run the storage reads planned by :func:`_plan_storage` (the caller closes
    the reader); this rank's bytes read."""
    rank = collectives.rank_and_world()[0]
    what = "moeshard.reshard: reading boxes no live rank holds"
    with ReaderSource(reads.sched, reads.reader, reads.index) as source:
        stats = collectives.agree(
            lambda: execute_schedule(
                reads.sched,
                rank,
                source,
                TensorSink(reads.sched, dests, rank, receive_in_place=True),
                dev,
                node_group=reads.node_group,
                what=what,
            ).check(),
            what,
        )
    return stats.bytes_read


def _scalar_states(model, descs, optimizer, old_tensors, old_optimizer, first: int, rank: int) -> None:
    """Collective: the scalar per-parameter states (AdamW's ``step``) and the param groups'
    hyperparameters of the first survivor, on every member."""
    scalars = None
    if rank == first:
        params = named_tensors(old_tensors) if isinstance(old_tensors, nn.Module) else dict(old_tensors)
        scalars = {}
        for d in descs:
            p = params.get(d.name)
            for k, v in (old_optimizer.state.get(p, {}) if p is not None else {}).items():
                if not (isinstance(v, torch.Tensor) and v.dim() > 0):
                    scalars.setdefault(d.name, {})[k] = v.item() if isinstance(v, torch.Tensor) else v
    scalars = collectives.broadcast_object(scalars, src=first, what="moeshard.reshard: optimizer scalars")
    params = named_tensors(model)
    for name, states in scalars.items():
        p = params[name]
        st = optimizer.state.setdefault(p, {})
        for k, v in states.items():
            old = st.get(k)
            st[k] = (
                torch.tensor(v, dtype=old.dtype if isinstance(old, torch.Tensor) else torch.float32)
                if isinstance(v, float) or isinstance(old, torch.Tensor)
                else v
            )
