"""The destination side of a refit: a serving engine's tensors described as boxes of the
trainer's logical tensors, and the refit planner.

An engine (vLLM, sglang) keeps its weights in its own layout: q/k/v fused into one
``qkv_proj``, gate and up fused into ``gate_up_proj`` or an expert tensor ``w13_weight
[local_experts, 2I, H]``, tensor-parallel shards, expert slots in the engine's own placement
(EPLB's redundant copies included). Each engine tensor is declared here as an
:class:`EngineTensor`: its :class:`Segment`\\ s (a logical tensor of the trainer, or an equal
part of one), concatenated along ``cat_dim``; each segment split into ``tp`` equal parts along
``shard_dim`` (vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` split each fused
part separately: rank r holds ``[q_r; k_r; v_r]``); an expert tensor has the local slots of its
MoE layer as its first dim. An :class:`EngineLayout` is those tensors, the engine's ranks, its
TP and EP sizes and its placement (``phy2log``, taken from the engine).

Logical tensors are the trainer model's own (a dense parameter or persistent buffer by name; an
expert parameter's slice of one logical expert as ``"<parameter>[<expert>]"``, the *units* of
:mod:`moeshard.plan.reshard`). :func:`engine_needs` turns a layout into need rows over those
units; :func:`plan_refit` plans the transfers from the trainer's live shards (the same planner
as a reshard: a cell an engine rank holds itself is copied, else sent once by one holder).

Pure and torch-free.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..topology import Topology
from .reshard import BoxRows, ReshardPlan, Units, plan_reshard

__all__ = ["Segment", "EngineTensor", "EngineLayout", "UnitInfo", "EngineNeeds", "engine_needs", "plan_refit"]


@dataclass(frozen=True)
class Segment:
    """One block of an engine tensor: part ``part[0]`` of ``part[1]`` equal parts along
    ``part_dim`` of the logical tensor ``source`` (default: all of it). For an expert tensor,
    ``source`` names the trainer's expert parameter and the part is of one expert's slice
    (``gate_up_proj``'s gate is part ``(0, 2)``)."""

    source: str
    part: tuple[int, int] = (0, 1)
    part_dim: int = 0

    def __post_init__(self) -> None:
        k, n = self.part
        if not (n >= 1 and 0 <= k < n):
            raise ValueError(f"segment {self.source}: part {self.part} is not (k, n) with 0 <= k < n")


@dataclass(frozen=True)
class EngineTensor:
    """One engine tensor, as a rank of the engine holds it.

    Args:
        name: the engine's name (``"model.layers.0.self_attn.qkv_proj.weight"``).
        segments: its blocks, in order along ``cat_dim``.
        cat_dim: the dim (of a dense tensor; of one expert's slice) the segments are
            concatenated along; the segments agree on every other dim.
        shard_dim: the dim each segment is split along into ``tp`` equal parts (None:
            replicated). vLLM: column-parallel (``qkv_proj``, ``gate_up_proj``, ``w13``) 0,
            row-parallel (``o_proj``, ``down_proj``, ``w2``) 1, vocabulary 0.
        moe_layer: for an expert tensor ``[num_local_slots, *slice]``, the row of the engine's
            placement that its slots follow; -1 for a dense tensor.
        pad_to: ``shard_dim`` is padded to a multiple of this before the split (vLLM's
            vocabulary: 64); rows past the logical length are the engine's padding, never
            written.
        group: install group: the engine tensors of a group change together (every tensor of a
            decoder layer: one group); -1 for tensors outside the layers.
        dtype: the engine's dtype name (``"bfloat16"``); None: the source's.
    """

    name: str
    segments: tuple[Segment, ...]
    cat_dim: int = 0
    shard_dim: int | None = None
    moe_layer: int = -1
    pad_to: int = 1
    group: int = -1
    dtype: str | None = None

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError(f"engine tensor {self.name} has no segments")
        if self.pad_to < 1:
            raise ValueError(f"engine tensor {self.name}: pad_to must be >= 1, got {self.pad_to}")
        if self.pad_to > 1 and len(self.segments) != 1:
            raise ValueError(f"engine tensor {self.name}: pad_to applies to a tensor of one segment")


@dataclass(frozen=True, eq=False)
class EngineLayout:
    """A serving engine's tensors on its ranks.

    Args:
        tensors: every engine tensor each engine rank holds (its own shard of it).
        ranks: the refit group's ranks of the engine's ranks, in engine rank order.
        tp: tensor-parallel size of the dense tensors (engine rank ``i`` holds TP shard
            ``i % tp``; data-parallel replicas repeat them).
        ep: expert-parallel size: 1 (experts split by ``tp`` like the dense tensors) or
            ``len(ranks)`` (vLLM's expert parallelism: slot ``p`` of a MoE layer on engine rank
            ``p // slots_per_rank``, experts not TP-split).
        phy2log: ``int64[num_moe_layers, num_physical]`` the engine's placement (redundant copies
            allowed), taken from the engine; None without expert tensors.
    """

    tensors: tuple[EngineTensor, ...]
    ranks: tuple[int, ...]
    tp: int = 1
    ep: int = 1
    phy2log: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.ranks)
        if n < 1 or len(set(self.ranks)) != n:
            raise ValueError(f"engine ranks {list(self.ranks)} must be distinct and not empty")
        if self.tp < 1 or n % self.tp:
            raise ValueError(f"tp={self.tp} must divide the {n} engine ranks")
        if self.ep not in (1, n):
            raise ValueError(f"ep={self.ep} must be 1 or the number of engine ranks ({n})")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("engine tensor names repeat")
        if any(t.moe_layer >= 0 for t in self.tensors):
            if self.phy2log is None:
                raise ValueError("the layout has expert tensors but no placement (phy2log=, the engine's)")
            p2l = np.asarray(self.phy2log)
            if p2l.ndim != 2 or p2l.shape[1] % self.ep:
                raise ValueError(f"phy2log of shape {list(p2l.shape)}: its slots must split evenly over ep={self.ep}")
            bad = [t.name for t in self.tensors if t.moe_layer >= len(p2l)]
            if bad:
                raise ValueError(f"expert tensor {bad[0]}: no row for its MoE layer in phy2log {list(p2l.shape)}")

    @property
    def slots_per_rank(self) -> int:
        return 0 if self.phy2log is None else int(np.asarray(self.phy2log).shape[1]) // self.ep

    def with_placement(self, phy2log: np.ndarray) -> EngineLayout:
        """The same tensors on the same ranks with the engine's new placement."""
        return EngineLayout(self.tensors, self.ranks, self.tp, self.ep, np.asarray(phy2log, np.int64))

    def digest(self) -> str:
        """What every rank of the refit describes alike."""
        h = hashlib.sha256(repr((self.tensors, self.ranks, self.tp, self.ep)).encode())
        if self.phy2log is not None:
            h.update(np.ascontiguousarray(self.phy2log, np.int64).tobytes())
        return h.hexdigest()[:16]


@dataclass(frozen=True)
class UnitInfo:
    """The trainer's logical tensors, as the planner needs them: per name its shape (an expert
    parameter's: one expert's slice), dtype name, and whether it is an expert parameter
    (``num_logical`` experts, units ``"<name>[<expert>]"``)."""

    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, str]
    experts: frozenset[str]
    num_logical: int


@dataclass(frozen=True)
class EngineNeeds:
    """The need rows of an engine layout (``N`` rows, ``D`` padded dims; :class:`BoxRows` over
    unit ids, ``param`` = the engine tensor's index in ``layout.tensors``, ``slot`` its local
    slot or -1), the unit keys in id order, and every engine tensor's local shape and dtype."""

    rows: BoxRows
    keys: tuple[str, ...]
    local_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]


def _seg_shape(t: EngineTensor, s: Segment, info: UnitInfo) -> tuple[int, ...]:
    shape = info.shapes.get(s.source)
    if shape is None:
        raise ValueError(f"engine tensor {t.name}: the trainer has no tensor {s.source}")
    if (t.moe_layer >= 0) != (s.source in info.experts):
        kind = "an expert tensor" if t.moe_layer >= 0 else "a dense tensor"
        raise ValueError(f"engine tensor {t.name} is {kind} but its segment {s.source} is not")
    k, n = s.part
    if not 0 <= s.part_dim < len(shape) or shape[s.part_dim] % n:
        raise ValueError(
            f"engine tensor {t.name}: segment {s.source} of shape {list(shape)} has no {n} equal parts along dim "
            f"{s.part_dim}"
        )
    out = list(shape)
    out[s.part_dim] //= n
    return tuple(out)


def engine_needs(layout: EngineLayout, info: UnitInfo, width: int) -> EngineNeeds:
    """Every engine rank's need rows (pure): per engine tensor, rank, local slot and segment, the
    box of the logical unit it holds and where it lands in the local tensor. ``width``: padded
    dims (at least every unit's). Raises ValueError naming the tensor for a segment the trainer
    lacks, shapes that do not concatenate, or a split that is not even."""
    i64 = np.int64
    ids: dict[str, int] = {}
    ndims: list[int] = []
    n_eng = len(layout.ranks)
    eng_ranks = np.asarray(layout.ranks, i64)
    tp_rank = np.arange(n_eng, dtype=i64) % layout.tp
    p2l = None if layout.phy2log is None else np.asarray(layout.phy2log, i64)
    spr = layout.slots_per_rank
    cols: list[tuple[np.ndarray, ...]] = []
    shapes, dtypes = [], []

    def uid(key: str, nd: int) -> int:
        u = ids.get(key)
        if u is None:
            u = ids[key] = len(ndims)
            ndims.append(nd)
        return u

    for j, t in enumerate(layout.tensors):
        segs = [_seg_shape(t, s, info) for s in t.segments]
        nd = len(segs[0])
        if nd > width:
            raise ValueError(f"engine tensor {t.name}: {nd} dims, more than the planner's {width}")
        if not 0 <= t.cat_dim < nd or (t.shard_dim is not None and not 0 <= t.shard_dim < nd):
            raise ValueError(f"engine tensor {t.name}: cat_dim / shard_dim outside its {nd} dims")
        for s, sh in zip(t.segments, segs):
            if len(sh) != nd or any(a != b for d, (a, b) in enumerate(zip(sh, segs[0])) if d != t.cat_dim):
                raise ValueError(
                    f"engine tensor {t.name}: segment {s.source} {list(sh)} does not concatenate with "
                    f"{list(segs[0])} along dim {t.cat_dim}"
                )
        dtype = t.dtype or info.dtypes[t.segments[0].source]
        split = t.shard_dim is not None and (t.moe_layer < 0 or layout.ep == 1)
        tp = layout.tp if split else 1
        local = list(segs[0])
        local[t.cat_dim] = 0
        cat_at = 0
        for s, sh in zip(t.segments, segs):
            # The box of the segment in its unit (one row per TP rank), and its length here.
            n = sh[t.shard_dim] if split else 0
            padded = -(-n // t.pad_to) * t.pad_to
            per = -(-padded // tp) if split else 0
            if split and t.pad_to == 1 and n % tp:
                raise ValueError(
                    f"engine tensor {t.name}: segment {s.source} dim {t.shard_dim} ({n}) splits unevenly over tp={tp}"
                )
            base_off = np.zeros((n_eng, nd), i64)
            base_len = np.broadcast_to(np.asarray(sh, i64), (n_eng, nd)).copy()
            base_off[:, s.part_dim] = s.part[0] * sh[s.part_dim]
            if split:
                d = t.shard_dim
                lo = np.minimum(tp_rank * per, n)
                base_off[:, d] += lo
                base_len[:, d] = np.minimum(lo + per, n) - lo
            seg_len = per if split and t.shard_dim == t.cat_dim else sh[t.cat_dim]
            if split and t.shard_dim != t.cat_dim:
                local[t.shard_dim] = per
            dst = np.zeros((n_eng, nd), i64)
            dst[:, t.cat_dim] = cat_at
            cat_at += seg_len
            if t.moe_layer < 0:
                keep = (base_len > 0).all(axis=1)
                u = uid(s.source, nd)
                m = int(keep.sum())
                cols.append(
                    (
                        np.full(m, u, i64),
                        eng_ranks[keep],
                        np.full(m, j, i64),
                        np.full(m, -1, i64),
                        base_off[keep],
                        base_len[keep],
                        dst[keep],
                    )
                )
                continue
            # Expert tensor: every local slot of every engine rank (EP: its own slots; no EP:
            # every slot, on every rank).
            row = p2l[t.moe_layer]
            if layout.ep == 1:
                er = np.repeat(np.arange(n_eng, dtype=i64), len(row))
                slot = np.tile(np.arange(len(row), dtype=i64), n_eng)
                phys = slot
            else:
                er = np.repeat(np.arange(n_eng, dtype=i64), spr)
                slot = np.tile(np.arange(spr, dtype=i64), n_eng)
                phys = er * spr + slot
            e = row[phys]
            if (e < 0).any() or (e >= info.num_logical).any():
                raise ValueError(
                    f"engine tensor {t.name}: its placement row {t.moe_layer} names experts outside "
                    f"0..{info.num_logical - 1}"
                )
            keep = (base_len[er] > 0).all(axis=1)
            er, slot, e = er[keep], slot[keep], e[keep]
            uids = np.asarray([uid(f"{s.source}[{x}]", nd) for x in range(info.num_logical)], i64)
            cols.append((uids[e], eng_ranks[er], np.full(len(er), j, i64), slot, base_off[er], base_len[er], dst[er]))
        local[t.cat_dim] = cat_at
        lead = [(len(p2l[t.moe_layer]) if layout.ep == 1 else spr)] if t.moe_layer >= 0 else []
        shapes.append(tuple(lead + local))
        dtypes.append(dtype)
    n = sum(len(c[0]) for c in cols)
    off, ln, dst = np.zeros((n, width), i64), np.ones((n, width), i64), np.zeros((n, width), i64)
    at = 0
    for c in cols:
        m, nd = len(c[0]), c[4].shape[1]
        off[at : at + m, :nd], ln[at : at + m, :nd], dst[at : at + m, :nd] = c[4], c[5], c[6]
        at += m

    def col(i: int) -> np.ndarray:
        return np.concatenate([c[i] for c in cols]).astype(i64) if cols else np.zeros(0, i64)

    rows = BoxRows(col(0), col(1), col(2), col(3), off, ln, dst)
    return EngineNeeds(rows, tuple(ids), tuple(shapes), tuple(dtypes))


@dataclass(frozen=True, eq=False)
class RefitPlan:
    """A refit's plan per install group (the same on every rank).

    Args:
        groups: the install groups in order (-1 first, then ascending).
        plans: a :class:`~moeshard.plan.reshard.ReshardPlan` per install batch (units: the
            holdings'), run one after another.
        batches: per plan, the install groups it fills (consecutive in ``groups``; as many as
            fit together in the staging budget: :func:`install_batches`). A batch is
            installed whole, after every rank has all of it.
        needs: the layout's :class:`EngineNeeds` (unit ids: the holdings').
        wire_dtypes: per unit, the dtype name its pieces travel in: the engine tensor's where it
            is no wider than the trainer's (a cast before sending), else the trainer's.
        peer_bytes, copy_bytes: job-wide bytes sent between ranks and copied within a rank (in
            the wire dtypes).
    """

    groups: tuple[int, ...]
    plans: tuple[ReshardPlan, ...]
    needs: EngineNeeds
    wire_dtypes: tuple[str, ...]
    peer_bytes: int
    copy_bytes: int
    fingerprint: str = field(default="")
    batches: tuple[tuple[int, ...], ...] = ()

    @property
    def num_rounds(self) -> int:
        """P2P rounds of a refit, job-wide (each a batch of P2P ops on the ranks in it): the sum
        over the batches' schedules."""
        return sum(p.schedule.num_rounds for p in self.plans)


__all__ += ["RefitPlan", "install_batches"]


def install_batches(group_of: np.ndarray, nbytes: np.ndarray, staging_bytes: int) -> tuple[tuple[int, ...], ...]:
    """The install batches (pure): consecutive install groups (``-1`` first, then ascending)
    whose engine tensors every engine rank can stage at once within ``staging_bytes`` (a
    group larger than the budget alone). A batch costs one schedule and one agreement,
    however many groups it holds.

    Args:
        group_of: ``int64[T]`` each engine tensor's install group.
        nbytes: ``int64[T]`` an engine rank's bytes of each tensor (its local shape; every
            engine rank holds a shard of every tensor, of the same shape).
    """
    groups = sorted(set(np.asarray(group_of).tolist()))
    per = {g: int(np.asarray(nbytes)[np.asarray(group_of) == g].sum()) for g in groups}
    out: list[list[int]] = []
    held = 0
    for g in groups:
        if out and held + per[g] <= staging_bytes:
            out[-1].append(g)
            held += per[g]
        else:
            out.append([g])
            held = per[g]
    return tuple(tuple(b) for b in out)


def _check_inside(layout: EngineLayout, needs: EngineNeeds) -> None:
    """Invariant of :func:`engine_needs`: every need row's box lies inside its engine tensor's
    local shape (its slot's, for an expert tensor)."""
    rows = needs.rows
    width = rows.off.shape[1]
    inner = np.full((len(needs.local_shapes), width), np.iinfo(np.int64).max, np.int64)
    for j, shape in enumerate(needs.local_shapes):
        sub = shape[1:] if layout.tensors[j].moe_layer >= 0 else shape
        inner[j, : len(sub)] = sub
    bad = (rows.local < 0).any(axis=1) | (rows.local + rows.len > inner[rows.param]).any(axis=1)
    assert not bad.any(), f"engine tensor {layout.tensors[int(rows.param[bad][0])].name}: a need row outside its shape"


def plan_refit(
    layout: EngineLayout,
    info: UnitInfo,
    holds: BoxRows,
    units: Units,
    hold_dtypes: Sequence[str],
    itemsize: Mapping[str, int],
    topology: Topology,
    staging_bytes: int,
    max_ops: int,
) -> RefitPlan:
    """Plan a refit (pure, deterministic; every rank of the refit group computes the same).

    Args:
        layout: the engine's tensors (its ranks are ``topology``'s).
        info: the trainer's logical tensors.
        holds: the trainer ranks' live holdings over ``units`` (``param`` indexes each trainer
            rank's local tensors).
        units: the holdings' units (``U``); ``hold_dtypes`` their dtype names in the trainer.
        itemsize: bytes per element of every dtype name involved.
        topology, staging_bytes, max_ops: as :func:`~moeshard.plan.reshard.plan_reshard`'s.

    Raises ValueError for a layout the trainer's tensors do not fit, or a box no trainer rank
    holds."""
    width = holds.off.shape[1]
    needs = engine_needs(layout, info, width)
    # Re-key the needs onto the holdings' unit ids.
    at = {k: i for i, k in enumerate(units.keys)}
    missing = [k for k in needs.keys if k not in at]
    if missing:
        raise ValueError(f"no trainer rank holds {missing[0]} (needed by the engine layout)")
    remap = np.asarray([at[k] for k in needs.keys], np.int64)
    rows = needs.rows
    unit = remap[rows.unit] if len(rows.unit) else rows.unit
    needs = EngineNeeds(
        BoxRows(unit, rows.rank, rows.param, rows.slot, rows.off, rows.len, rows.local),
        tuple(units.keys),
        needs.local_shapes,
        needs.dtypes,
    )
    rows = needs.rows
    # The wire dtype of each unit: the engine's where it is no wider (one cast, at the sender).
    wire = list(hold_dtypes)
    seen: dict[int, str] = {}
    for u, j in zip(rows.unit.tolist(), rows.param.tolist()):
        d = needs.dtypes[j]
        if seen.setdefault(u, d) != d:
            wire[u] = hold_dtypes[u]  # needed in two dtypes: sent as the trainer holds it
            seen[u] = ""
        elif seen[u] and itemsize[d] <= itemsize[hold_dtypes[u]]:
            wire[u] = d
    wire_units = Units(units.keys, units.ndim, np.asarray([itemsize[d] for d in wire], np.int64), units.dense)
    group_of = np.asarray([t.group for t in layout.tensors], np.int64)
    groups = tuple(sorted(set(group_of.tolist())))
    _check_inside(layout, needs)
    plans = []
    # Everything the ranks act on: the schedules, the wire dtypes, and the engine tensors' local
    # shapes and dtypes (each rank checks its engine tensors against its own plan's, and its
    # deliveries address them: ranks that disagree on a shape must fail here, not mid-transfer).
    h = hashlib.sha256(layout.digest().encode())
    h.update(repr((wire, needs.local_shapes, needs.dtypes)).encode())
    peer = copy = 0
    # Engine tensors are staged whole on every engine rank (each holds every tensor's shard).
    elems = np.asarray([int(np.prod(sh)) for sh in needs.local_shapes], np.int64)
    tbytes = elems * np.asarray([itemsize[d] for d in needs.dtypes], np.int64)
    batches = install_batches(group_of, tbytes, staging_bytes)
    h.update(repr(batches).encode())
    for batch in batches:
        sel = np.isin(group_of[rows.param], batch)
        need_g = BoxRows(
            *(a[sel] for a in (rows.unit, rows.rank, rows.param, rows.slot, rows.off, rows.len, rows.local))
        )
        used = np.zeros(len(units.keys), bool)
        used[need_g.unit] = True
        hs = used[holds.unit]
        hold_g = BoxRows(
            *(a[hs] for a in (holds.unit, holds.rank, holds.param, holds.slot, holds.off, holds.len, holds.local))
        )
        p = plan_reshard(wire_units, hold_g, need_g, topology, staging_bytes, max_ops)
        if len(p.storage):
            i = int(p.storage.unit[0])
            raise ValueError(
                f"no trainer rank holds box {p.storage.off[0].tolist()} + {p.storage.len[0].tolist()} of "
                f"{units.keys[i]} (needed by engine tensor {layout.tensors[int(p.storage.param[0])].name})"
            )
        plans.append(p)
        peer += p.peer_bytes
        copy += p.copy_bytes
        h.update(p.fingerprint.encode())
    return RefitPlan(groups, tuple(plans), needs, tuple(wire), peer, copy, h.hexdigest()[:16], batches)
