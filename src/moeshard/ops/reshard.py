"""``moeshard.reshard``: fill a model built on a new mesh from the shards live ranks still hold.

Elastic training for whole models. Before a loss (at start-up, after each relocation), every
rank keeps :func:`describe_shards` of its model: a small, picklable record of the old layout
(every parameter's global shape, mesh in ranks and placements, the expert placement) and its
own rank in it. After ranks are lost (or to resize a job), the survivors, and any joiners, form
a NEW process group, build the model on a new mesh (another EP, expert-FSDP, FSDP or HSDP
replicate size, another placement) and call :func:`reshard` on it with their old record and old
local tensors (the old model object: its DTensors' local shards outlive their process group).

Steps (collective, every rank of ``group``): check every member's arguments and old tensors and
learn each member's old rank and the old record (one exchange) -> plan (pure,
:func:`moeshard.plan.reshard.plan_reshard`: sources are the live holders of each box; storage only
for boxes no survivor holds) -> agree -> refuse or warn when a dense box or, under training, an
expert would come from storage (older than the live weights) -> plan the storage reads -> only
then materialize and write the new model -> run the peer schedule with the one runner -> read
the missing boxes from the checkpoint (the load planner, its needs clipped to those boxes) ->
install the optimizer's new state -> report. Every refusal comes before anything is written.
The old tensors are only read: a peer lost during the reshard raises
:class:`~moeshard.PeerLostError` and leaves them intact.

Optimizer state (``optimizer`` / ``old_optimizer``): every state tensor shaped like its
parameter (AdamW's ``exp_avg``, ``exp_avg_sq``) is resharded with it, as a unit of its own; the
scalar states (``step``) and the param groups' hyperparameters are the first survivor's
(:mod:`moeshard.ops.reshard_optimizer`). Persistent buffers are model state, never optimizer
state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
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
from ..models.describe import KEEPS_PACKED, ParamDesc, describe_model, keeps_packed, local_tensor
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
from .reshard_optimizer import OPTIMIZER_SEP, OptimizerRecord, install, map_groups, record_optimizer
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


class StaleStateError(collectives.DistributedError):
    """Raised on every rank by :func:`reshard` when some dense box (``dense_from_storage="raise"``)
    or some expert (``experts_from_storage="raise"``, the default with an optimizer) has no live
    holder: reading it from the checkpoint would mix the checkpoint's training step with the
    live weights'. The message names the tensors or experts; nothing was changed."""


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
    too (what :func:`reshard` carries is the state ``old_optimizer`` holds when it runs, so a
    layout taken before the first step serves as well). Take it while the job is whole (after
    parallelize, after each relocation); it is small (a record per tensor) and picklable. Ranks
    are those of ``group`` (default: the default group), in which every DTensor mesh of the
    model must lie."""
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
            tensor's name or ``"<expert parameter>[<logical expert>]"``, a box per-dim
            ``(offset, length)`` in it.
        dense_from_storage: the dense tensors some of whose boxes came from storage (older than
            the live state; allowed by ``dense_from_storage="warn"`` or ``"allow"``).
        experts_from_storage: the experts (``"<expert parameter>[<logical expert>]"``) that came
            from storage: no live rank held a copy.
        states_zeroed: the optimizer state units (``"<parameter>::<state>"``, an expert's with
            ``"[<logical expert>]"``) with no live holder, which start at zero.
        peer_bytes, copy_bytes, storage_bytes: bytes sent between ranks, copied within ranks,
            and read from storage (planned, job-wide).
        bytes_copied_rank: this rank's bytes copied from its own old tensors.
        joined: whether this rank held nothing of the old model.
    """

    storage_boxes: tuple = ()
    dense_from_storage: tuple[str, ...] = ()
    experts_from_storage: tuple[str, ...] = ()
    states_zeroed: tuple[str, ...] = ()
    peer_bytes: int = 0
    copy_bytes: int = 0
    storage_bytes: int = 0
    bytes_copied_rank: int = 0
    joined: bool = False


# -- describe: layouts -> box rows ---------------------------------------------------------


class UnitIndex:
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


def box_rows(
    layouts: Sequence[TensorLayout],
    phy2log: np.ndarray | None,
    world: int,
    rank_map: np.ndarray,
    units: UnitIndex,
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
    parameter and slot. Raises ValueError where the rows do not cover a cell.

    An expert parameter fused on disk has rows of slot -1 into the whole local tensor
    ``[local_slots, *slice]`` (dim 0: a run of local slots): its cells (slot ``s``, a box of the
    slice) are matched as boxes ``[(s, 1), *box]`` of the whole local tensor, and the clipped
    rows keep that form."""
    i64 = np.int64
    width = table.src_off.shape[1]
    m = len(cells)
    whole = _whole_tensor_cells(cells, table)
    keys = np.concatenate(
        [
            np.stack([whole.rank, whole.param, whole.slot], 1).astype(i64),
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
    k = min(width, whole.dst.shape[1])
    lo_c, hi_c = np.zeros((m, width), i64), np.ones((m, width), i64)
    lo_c[:, :k] = whole.dst[:, :k]
    hi_c[:, :k] = whole.dst[:, :k] + np.maximum(whole.len[:, :k], 1)
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


def _whole_tensor_cells(cells: StorageCells, table: NeedTable) -> StorageCells:
    """``cells`` with those of a parameter whose need rows for that rank have slot -1 but the
    cell a slot (an expert parameter fused on disk) moved into the whole local tensor's
    coordinates: slot -1, box ``[(slot, 1), *box]`` (the slice's dims shifted right by one; the
    cells' width has room, a local tensor having one dim more than its slice)."""
    if not len(cells) or not (table.slot < 0).any():
        return cells
    # (rank, param) pairs as one code: a cell moves where slot -1 rows have its pair.
    base = int(max(cells.param.max(), table.param.max())) + 1
    fused = np.unique(table.rank[table.slot < 0].astype(np.int64) * base + table.param[table.slot < 0])
    move = (cells.slot >= 0) & np.isin(cells.rank.astype(np.int64) * base + cells.param, fused)
    if not move.any():
        return cells
    assert np.all(cells.dst[move, -1] == 0) and np.all(cells.len[move, -1] <= 1), "no room for the slot dim"
    dst, ln, slot = cells.dst.copy(), cells.len.copy(), cells.slot.copy()
    dst[move, 1:], ln[move, 1:] = cells.dst[move, :-1], cells.len[move, :-1]
    dst[move, 0], ln[move, 0], slot[move] = cells.slot[move], 1, -1
    return StorageCells(cells.unit, cells.rank, cells.param, slot, cells.off, ln, dst)


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


_CHOICES = ("raise", "warn", "allow")


def _check_args(
    old, old_tensors, optimizer, old_optimizer, dense_from_storage, experts_from_storage, checkpoint
) -> str | None:
    """This rank's arguments, checked before the first exchange (agreed there): the checkpoint
    path (None: none)."""
    if dense_from_storage not in _CHOICES:
        raise ValueError(f"dense_from_storage must be 'raise', 'warn' or 'allow', got {dense_from_storage!r}")
    if experts_from_storage is not None and experts_from_storage not in _CHOICES:
        raise ValueError(f"experts_from_storage must be None, 'raise', 'warn' or 'allow', got {experts_from_storage!r}")
    if old is not None and (optimizer is None) != (old_optimizer is None):
        raise ValueError("pass optimizer= and old_optimizer= together (a joiner passes optimizer= only)")
    if old is not None and old_tensors is None:
        raise ValueError("old= was given without old_tensors= (the old model, whose local shards this rank holds)")
    return None if checkpoint is None else os.fspath(checkpoint)


def _old_layout(old: ShardLayout, old_tensors, old_optimizer) -> ShardLayout:
    """The old layout to reshard from: its parameters and persistent buffers, and with
    ``old_optimizer`` the per-parameter state tensors that optimizer holds now (described
    here, so that a layout taken before the optimizer's first step carries them too)."""
    tensors = tuple(t for t in old.tensors if OPTIMIZER_SEP not in t.name)
    if old_optimizer is not None:
        tensors += tuple(_state_layouts(tensors, _old_params(old_tensors), old_optimizer))
    return dataclasses.replace(old, tensors=tensors)


def _old_params(old_tensors) -> dict[str, torch.Tensor]:
    return named_tensors(old_tensors) if isinstance(old_tensors, nn.Module) else dict(old_tensors)


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
    experts_from_storage: Literal["raise", "warn", "allow"] | None = None,
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

    Every check (each member's arguments, the layouts, the param groups, the boxes no member
    holds) is agreed before anything is written to ``model`` or ``optimizer`` (whose new state
    is built aside, installed at the end): a refusal changes nothing. The old ones are only read.

    Args:
        model: the new model (:func:`moeshard.parallelize` on a mesh of ``group``'s ranks, any EP,
            expert-FSDP, FSDP / HSDP replicate size or placement; its placement is the model's).
        old: this rank's :func:`describe_shards` of the old model (taken while the job was
            whole); None on a joiner, which holds nothing (every member must have the same old
            layout).
        old_tensors: the old model (or ``{name: tensor}`` of its parameters and persistent
            buffers) whose local shards this rank still holds; only read. None on a joiner.
        checkpoint: read for boxes no member holds (None: every box must have a live holder).
        optimizer, old_optimizer: carry ``old_optimizer``'s state into ``optimizer`` (over
            ``model``'s parameters; a joiner passes ``optimizer`` only): state tensors shaped like
            their parameter (AdamW's ``exp_avg``) resharded with it; scalar states (``step``) and
            each param group's hyperparameters (``lr`` as a scheduler left it, ``betas``, ...)
            the first survivor's. ``optimizer``'s param groups must hold ``old_optimizer``'s
            parameters group by group (by name); its state is replaced. Buffers are model state,
            never optimizer state. A state box with no live holder (its parameter's read from
            the checkpoint, as allowed below) starts at zero.
        dense_from_storage: a dense box with no live holder (its checkpoint value is older than
            the live weights): "raise" (:class:`StaleStateError` on every rank, nothing
            changed), "warn" (read it, with a warning naming the staleness), "allow" (read it).
        experts_from_storage: an expert whose every holder is lost, the same choice; None (the
            default): "raise" when ``optimizer`` is given (training: the checkpoint's expert is
            older than the live weights) and "allow" without (serving: the checkpoint's experts
            are the weights).
        storage, topology, staging_bytes, max_ops, device: as :func:`moeshard.load`'s.
        group: the process group of the members (default: the default group).

    Every checkpoint read is logged (``logging.warning`` on rank 0: dense tensors, experts,
    bytes). Returns a :class:`ReshardReport` (boxes from storage, bytes per source).

    Raises:
        StaleStateError: on every rank, a dense box or (by the choice above) an expert has no
            live holder; nothing changed.
        PeerLostError: a member died during the reshard (on every member that saw it; the old
            tensors and ``optimizer`` are intact, the new model partly filled).
        DistributedError: on every rank, for any member's bad input (arguments or layouts
            that differ between members, shapes between the models, a box with no holder and
            no checkpoint, param groups that cannot be mapped); nothing changed.
    """
    t0 = time.perf_counter()
    phases = Phases(t0)
    members = _meet(
        model,
        old,
        old_tensors,
        optimizer,
        old_optimizer,
        (dense_from_storage, experts_from_storage),
        checkpoint,
        storage,
        topology,
        group,
    )
    rank, world = collectives.rank_and_world()
    phases.end("exchange")
    planned = collectives.agree(
        lambda: _plan(model, members, optimizer, specs, staging_bytes, max_ops),
        "moeshard.reshard: planning",
        fingerprint=lambda r: r.plan.fingerprint,
    )
    plan, use = planned.plan, planned.use
    _check_stale(use, dense_from_storage, experts_from_storage, optimizer is not None)
    t_plan = phases.end("plan") - t0

    stats, read = _fill(model, members, planned, storage, staging_bytes, device, phases)
    if optimizer is not None:
        install(optimizer, named_tensors(model), members.record, planned.group_map, stats.fresh)
    sched = plan.schedule
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
        bytes_sent_rank=stats.peers.bytes_sent,
        bytes_received_rank=stats.peers.bytes_received,
        peak_staging_bytes_rank=stats.peers.peak_staging_bytes,
        phase_seconds=phases.seconds,
        phase_cpu_seconds=phases.cpu_seconds,
        storage_boxes=use.boxes,
        dense_from_storage=use.dense,
        experts_from_storage=use.experts,
        states_zeroed=use.states,
        peer_bytes=plan.peer_bytes,
        copy_bytes=plan.copy_bytes,
        storage_bytes=use.bytes,
        bytes_copied_rank=copied,
        joined=old is None,
    )


@dataclass(frozen=True)
class _Members:
    """What the first exchanges tell every member: this rank's topology, checkpoint path and old
    local tensors; every member's shares (old rank, old layout's digest, sees the checkpoint,
    arguments); their old ranks, the first survivor, the old layout (the first survivor's) and
    the first survivor's :class:`OptimizerRecord` (None without an optimizer)."""

    topology: Topology
    path: str | None
    old_locals: list
    everyone: list
    old_ranks: np.ndarray
    survivors: np.ndarray
    first: int
    shared: ShardLayout
    record: OptimizerRecord | None


def _meet(model, old, old_tensors, optimizer, old_optimizer, choices, checkpoint, storage, topology, group) -> _Members:
    """Collective: check this rank's arguments and old tensors, gather every member's old rank,
    layout digest and arguments, refuse (on every rank) when no member holds the old model or
    their layouts or arguments differ, and send the old layout (where a joiner needs it) and
    the old optimizer's record (with an optimizer) from the first survivor."""

    def prepare():
        path = _check_args(old, old_tensors, optimizer, old_optimizer, *choices, checkpoint)
        topo = group_topology(topology, group)
        layout = _old_layout(old, old_tensors, old_optimizer) if old is not None else None
        locals_ = _old_locals(layout, old_tensors, old_optimizer) if layout is not None else []
        return topo, path, layout, locals_

    gathered = collectives.agree_and_gather(
        prepare,
        "moeshard.reshard: checking the arguments",
        share=lambda r: (
            r[2].rank if r[2] is not None else -1,
            r[2].digest() if r[2] is not None else None,
            r[1] is not None and os.path.exists(r[1]),
            (optimizer is not None, *choices, storage),
        ),
    )
    (topo, path, layout, old_locals), everyone = gathered.result, gathered.shares
    old_ranks = np.asarray([e[0] for e in everyone], np.int64)
    survivors = np.flatnonzero(old_ranks >= 0)
    digests = {e[1] for e in everyone if e[1] is not None}
    args = [e[3] for e in everyone]
    if not len(survivors):
        collectives.unanimous(
            lambda: _fail("no member holds the old model (every old= is None): use moeshard.load"), "moeshard.reshard"
        )
    if len(set(args)) > 1:
        differ = ", ".join(f"rank {r}: {a}" for r, a in enumerate(args) if a != args[0])
        collectives.unanimous(
            lambda: _fail(
                "the members pass different arguments (optimizer given, dense_from_storage, "
                f"experts_from_storage, storage): rank 0: {args[0]}, {differ}"
            ),
            "moeshard.reshard",
        )
    if len(digests) > 1:
        collectives.unanimous(
            lambda: _fail(
                f"the members' old layouts differ (digests {sorted(digests)}): every "
                "survivor must pass the describe_shards of the same old model (and its old_optimizer)"
            ),
            "moeshard.reshard",
        )
    first = int(survivors[0])
    rank, _ = collectives.rank_and_world()
    joiners = len(survivors) < len(old_ranks)
    shared, record = (layout.shared() if layout is not None else None), None
    if joiners or optimizer is not None:
        sent = collectives.broadcast_result(
            lambda: (
                shared if joiners else None,
                record_optimizer(_old_params(old_tensors), old_optimizer) if optimizer is not None else None,
            ),
            src=first,
            what="moeshard.reshard: sending the old layout and optimizer record",
        )
        shared = sent[0] if joiners else shared
        record = sent[1]
    return _Members(topo, path, old_locals, everyone, old_ranks, survivors, first, shared, record)


@dataclass(frozen=True)
class _StorageUse:
    """What a plan reads from storage, and what it cannot: the cells to read (the plan's
    storage cells but the optimizer states'), their distinct boxes (sorted) and bytes, the dense
    tensors and the expert units among them (sorted), and the optimizer state units with no
    live holder (they start at zero)."""

    cells: StorageCells
    boxes: tuple
    bytes: int
    dense: tuple[str, ...]
    experts: tuple[str, ...]
    states: tuple[str, ...]


@dataclass(frozen=True)
class _Planned:
    """A rank's reshard plan and what its run needs: the new model's descriptions and
    placement, the plan, each unit's dtype, what comes from storage, the optimizer state
    tensors to create (``{state unit name: (parameter name, state name)}``, in destination
    order after the parameters) and the new param groups' old groups."""

    descs: list
    placement: object
    plan: ReshardPlan
    dtypes: list
    use: _StorageUse
    states: dict
    group_map: tuple[int, ...]
    packed: bool  # the model keeps its experts packed: it reads a quantized checkpoint as stored


def _plan(model, members: _Members, optimizer, specs, staging_bytes, max_ops) -> _Planned:
    """One rank's step of the planning agreement (writes nothing): the new layouts (with the
    optimizer states the old layout has), the holders' and the new model's box rows,
    :func:`~moeshard.plan.reshard.plan_reshard`, and the refusals that need them."""
    shared, old_ranks, survivors = members.shared, members.old_ranks, members.survivors
    topo, path = members.topology, members.path
    _, world = collectives.rank_and_world()
    # The slots' placement (read from the routing tables, as describe_shards reads the old one):
    # an experts module with its own forward (kept packed, a serving engine's) has no EP forward's.
    placement = resolve_placement(model, slot_placement(model), "moeshard.reshard", specs)
    descs = describe_model(model, None, specs)
    new_layouts = _tensor_layouts(descs)
    states: dict[str, tuple[str, str]] = {}
    group_map: tuple[int, ...] = ()
    if optimizer is not None:  # its moments are placed in slot order: checked from now on
        guard_optimizer(optimizer)
        params = named_tensors(model)
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        old_states = [t.name.partition(OPTIMIZER_SEP) for t in shared.tensors if OPTIMIZER_SEP in t.name]
        by_param: dict[str, list[str]] = {}
        for name, _, k in old_states:
            by_param.setdefault(name, []).append(k)
        for t in list(new_layouts):
            ks = by_param.get(t.name, ())
            if ks and id(params[t.name]) not in held:
                raise ValueError(
                    f"optimizer does not hold parameter {t.name}, whose state old_optimizer holds "
                    f"({', '.join(ks)}): build the new optimizer over the same parameters"
                )
            for k in ks:
                name = f"{t.name}{OPTIMIZER_SEP}{k}"
                states[name] = (t.name, k)
                new_layouts.append(TensorLayout(name, t.shape, t.dtype, t.mesh, t.placements, t.layer))
        group_map = map_groups(members.record, params, optimizer)
    new_nl = placement.num_logical if placement is not None else 0
    _check_compatible(shared.tensors, new_layouts, shared.num_logical, new_nl)
    if old_ranks.max() >= shared.world_size:
        raise ValueError(f"old ranks {old_ranks.tolist()} outside the old layout's {shared.world_size} ranks")
    if len(set(old_ranks[survivors].tolist())) != len(survivors):
        raise ValueError(f"two members claim the same old rank: {old_ranks.tolist()}")
    rank_map = np.full(shared.world_size, -1, np.int64)
    rank_map[old_ranks[survivors]] = survivors
    width = max([len(t.shape) for t in (*shared.tensors, *new_layouts)] + [1])
    units = UnitIndex()
    holds = box_rows(shared.tensors, shared.phy2log, shared.world_size, rank_map, units, width)
    new_p2l = np.asarray(placement.phy2log) if placement is not None else None
    needs = box_rows(new_layouts, new_p2l, world, np.arange(world, dtype=np.int64), units, width)
    table = units.units()
    plan = plan_reshard(table, holds, needs, topo, staging_bytes, max_ops)
    use = _storage_use(plan, table)
    if len(use.cells) and path is None:
        raise ValueError(
            f"{len(use.boxes)} boxes have no live holder (e.g. {use.boxes[0][0]}) and no checkpoint= was given"
        )
    dtypes = [getattr(torch, d) for d in units.dtype]
    return _Planned(descs, placement, plan, dtypes, use, states, group_map, keeps_packed(model, specs))


def _storage_use(plan: ReshardPlan, units: Units) -> _StorageUse:
    """The plan's storage cells split into reads (parameters and buffers) and optimizer states
    that start at zero. Raises ValueError for a state box whose parameter's box is live (a
    layout no optimizer makes)."""
    keys = plan.schedule.keys
    is_state = np.asarray([OPTIMIZER_SEP in k for k in keys], bool)
    st = plan.storage
    keep = ~is_state[st.unit] if len(st) else np.zeros(0, bool)
    cells = StorageCells(*(a[keep] for a in (st.unit, st.rank, st.param, st.slot, st.off, st.len, st.dst)))
    read_units = {keys[u] for u in np.unique(cells.unit).tolist()}
    states = sorted({keys[u] for u in np.unique(st.unit[~keep]).tolist()})
    for s in states:
        name, _, rest = s.partition(OPTIMIZER_SEP)
        param = name + rest[rest.index("[") :] if "[" in rest else name
        if param not in read_units:
            raise ValueError(f"optimizer state {s} has no live holder while its parameter has one")
    boxes = tuple(b for b in plan.storage_boxes if OPTIMIZER_SEP not in b[0])
    nbytes = 0
    ids = {k: u for u, k in enumerate(keys)}
    for key, box in boxes:
        nbytes += math.prod(n for _, n in box) * int(units.itemsize[ids[key]])
    dense = tuple(sorted(k for k in read_units if units.dense[ids[k]]))
    experts = tuple(sorted(k for k in read_units if not units.dense[ids[k]]))
    return _StorageUse(cells, boxes, nbytes, dense, experts, tuple(states))


def _experts_named(keys: Sequence[str]) -> str:
    """Expert unit keys (``"<parameter>[<expert>]"``) as ``"<parameter> [e, ...]"`` per parameter."""
    by: dict[str, list[int]] = {}
    for k in keys:
        name, _, e = k.rpartition("[")
        by.setdefault(name, []).append(int(e.rstrip("]")))
    return "; ".join(f"{n} experts {sorted(es)}" for n, es in sorted(by.items()))


def _check_stale(use: _StorageUse, dense_from_storage: str, experts_from_storage: str | None, training: bool) -> None:
    """Refuse (every rank: the plan is every rank's) or warn when dense boxes, or experts, would
    come from storage, whose values are older than the live weights."""
    experts = experts_from_storage or ("raise" if training else "allow")
    for kind, found, choice in (("dense", use.dense, dense_from_storage), ("experts", use.experts, experts)):
        if not found or choice == "allow":
            continue
        if kind == "dense":
            names = ", ".join(found[:6]) + (" ..." if len(found) > 6 else "")
            text = f"{len(found)} dense tensors have boxes no live rank holds ({names})"
            fix = "keep an HSDP replica (make_mesh(replicate=...)) or pass dense_from_storage='warn'"
        else:
            text = f"{len(found)} experts have no live copy ({_experts_named(found)})"
            fix = "keep redundant copies on other nodes or pass experts_from_storage='warn'"
        text = (
            f"moeshard.reshard: {text}; their checkpoint values are older than the live weights (mixing training steps)"
        )
        if choice == "raise":
            raise StaleStateError(f"{text}; {fix} to read them anyway")
        if collectives.rank_and_world()[0] == 0:
            logger.warning("%s: reading them from the checkpoint (%s_from_storage='warn')", text, kind)


def _log_storage(use: _StorageUse) -> None:
    """Log (warning) what the reshard reads from the checkpoint, and which optimizer states
    start at zero."""
    if not len(use.cells):
        return
    parts = []
    if use.dense:
        parts.append(f"dense {', '.join(use.dense[:8])}{' ...' if len(use.dense) > 8 else ''}")
    if use.experts:
        parts.append(_experts_named(use.experts))
    logger.warning(
        "moeshard.reshard: reading %d boxes (%d bytes) from the checkpoint that no live rank holds: %s",
        len(use.boxes),
        use.bytes,
        "; ".join(parts),
    )
    if use.states:
        logger.warning(
            "moeshard.reshard: optimizer state of %d units with no live holder starts at zero (%s%s)",
            len(use.states),
            ", ".join(use.states[:6]),
            " ..." if len(use.states) > 6 else "",
        )


def _targets(model, descs, states: dict, device) -> tuple[torch.device, list, dict]:
    """Materialize the new model and create the optimizer's new state tensors (zeros, like
    their parameter; not yet in the optimizer): the device, every destination local tensor
    (parameters, then states) and ``{parameter name: {state name: tensor}}``."""
    dev = materialize(model, device)
    params = named_tensors(model)
    dests = local_tensors(params, descs)
    fresh: dict[str, dict[str, torch.Tensor]] = {}
    for name, k in states.values():
        t = torch.zeros_like(params[name], memory_format=torch.preserve_format)
        fresh.setdefault(name, {})[k] = t
        dests.append(local_tensor(t))
    return dev, dests, fresh


@dataclass(frozen=True)
class _Filled:
    """What :func:`_fill` did on this rank: the peer schedule's run statistics and the
    optimizer's new state tensors (``{parameter name: {state name: tensor}}``)."""

    peers: object
    fresh: dict


def _fill(model, members: _Members, planned: _Planned, storage, staging_bytes, device, phases) -> tuple[_Filled, int]:
    """Collective, once every refusal is behind: plan the storage reads (hinted to the kernel
    first, so that storage works while peers send), materialize the new model and create the
    optimizer's new state tensors aside, log what storage gives, run the peer schedule, then
    the storage reads. Returns what was done and this rank's bytes read."""
    rank = members.topology.rank
    plan, use, descs = planned.plan, planned.use, planned.descs
    what = "moeshard.reshard: copying from live ranks"
    with torch.no_grad(), contextlib.ExitStack() as closing:
        reads = _plan_storage(
            use.cells,
            descs,
            planned.placement,
            members.path,
            storage,
            members.topology,
            members.everyone,
            staging_bytes,
            closing,
            planned.packed,
        )
        dev, dests, fresh = collectives.agree(
            lambda: _targets(model, descs, planned.states, device), "moeshard.reshard: materializing the model"
        )
        if rank == 0:
            _log_storage(use)
        sched = plan.schedule
        stats = collectives.agree(
            lambda: execute_schedule(
                sched,
                rank,
                _OldTensors(plan, members.old_locals, rank, planned.dtypes),
                TensorSink(sched, dests, rank, receive_in_place=True),
                dev,
                what=what,
            ).check(),
            what,
        )
        phases.end("peers")
        read = 0
        if reads is not None:
            read = _read_storage(reads, dests, dev)
            phases.end("storage")
    return _Filled(stats, fresh), read


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
    cells: StorageCells,
    descs,
    placement,
    path: str,
    storage: Storage,
    topo: Topology,
    everyone,
    staging_bytes: int,
    closing: contextlib.ExitStack,
    packed: bool,
) -> _StorageReads | None:
    """Collective: plan the reads of the storage ``cells`` with the load planner (its needs
    clipped to the cells), open this rank's reader and hint the kernel about its reads
    (``posix_fadvise(WILLNEED)``) so that storage reads them while the peers' transfers run;
    a rank's failure is every rank's. None without storage cells; the reader is closed with
    ``closing``. ``packed``: the model keeps its experts packed (it reads the stored tensors, as
    :func:`moeshard.load` does for it)."""
    if not len(cells):
        return None
    rank = topo.rank
    can = bool(everyone[rank][2])
    shares = [sources_share(bool(e[2]), storage, topo) for e in everyone]
    mode, readers, scope, index = resolve_sources(path, storage, topo, can, everyone=shares)
    if packed:
        index = index.without_packed(KEEPS_PACKED)

    def make():
        table = _clip_storage(cells, need_table(descs, index, placement, topo.world_size))
        sched = plan_transfers(table, index, topo, readers, scope=scope, staging_bytes=staging_bytes)
        reader = closing.enter_context(CheckpointReader(index, reader_root(path))) if readers[rank] else None
        if reader is not None:
            reader.check_keys(sched.piece_name(pid) for pid in sched.reads.piece[sched.for_rank(rank).reads].tolist())
            _hint_reads(sched, reader, rank)
        return sched, reader

    sched, reader = collectives.agree(
        make, "moeshard.reshard: planning the storage reads", fingerprint=lambda r: r[0].fingerprint
    )
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
