"""Needs: which box of which checkpoint tensor every rank must hold, and where.

From parameter descriptions (:mod:`moeshard.models.describe`), for *every* rank, without
communication: the shard boxes (:mod:`moeshard.models.shards`) say what each rank holds, and
the :class:`~moeshard.placement.Placement` says which logical expert each physical slot of an
expert parameter holds. Every rank computes the same needs, so the planner gives the same
plan everywhere. :func:`need_table` (arrays, one row per need) and :func:`compute_needs` (the
same rows as :class:`Need` tuples) are pure, torch-free and work for any world size.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..dtypes import TORCH_NAMES, cast_refusal
from ..io.formats import scale_keys
from ..io.fp8 import fitting_scales, scale_of
from ..io.index import CheckpointIndex
from ..placement import Placement
from ..plan.arrays import expand_runs, row_prod, unique_rows
from ..plan.needs import Need, NeedPart, NeedTable, SharedKeysLeftOut
from .adapters import expert_parts
from .describe import ParamDesc
from .shards import holders_disjoint, param_boxes
from .unused import keys_of_experts

if TYPE_CHECKING:
    import torch

__all__ = ["Need", "need_table", "compute_needs", "inputs_digest", "check_cast", "expert_part_sizes"]


def need_table(
    descs: Sequence[ParamDesc],
    index: CheckpointIndex,
    placement: Placement | None,
    world_size: int,
    dequantize: bool = False,
    keep_ranks: np.ndarray | None = None,
    _experts_whole: bool = False,
) -> NeedTable:
    """Every rank's needs as a :class:`~moeshard.plan.needs.NeedTable`, from parameter
    descriptions (pure; any world size). Rows: parameters in order; a parameter's rows in
    mesh order, then local slot, then checkpoint part.

    ``keep_ranks`` (``bool[world_size]``): a table for one rank's plan. Of the other ranks only
    the rows that are not alone are kept (the rest counted in ``omitted_bytes``): pass the
    planning rank and every rank that cannot read (its needs are all transfers). The table's
    ``digest`` (of the descriptions, the placement and the world size: what the rows are a
    pure function of, with the checkpoint index every rank shares) is the same either way.

    Raises ValueError for a key missing from the checkpoint, a shape that disagrees, a dtype
    the cast rule refuses (:func:`~moeshard.dtypes.cast_refusal`: e.g. FP8 into bf16; with ``dequantize``, FP8
    weights with a block scale (:func:`moeshard.io.fp8.scale_of`) may go into float tensors: the
    load dequantizes them), or a placement inconsistent with the model's expert parameters.

    Cost: O(keys) Python (each check once per parameter and logical expert) plus numpy over
    the rows.
    """

    if keep_ranks is not None:
        keep_ranks = np.asarray(keep_ranks, dtype=bool)
        if keep_ranks.shape != (world_size,):
            raise ValueError(f"keep_ranks must be bool[{world_size}], got {len(keep_ranks)} entries")
    num_layers = 1 + max((d.expert.layer for d in descs if d.expert), default=-1)
    if placement is not None and num_layers:
        placement.check_layers(num_layers)
    parts: list[NeedPart] = []
    layouts: dict = {}  # what parameters of one shape and sharding share: worked out once per call
    for i, d in enumerate(descs):
        if d.expert is None:
            parts.append(_dense_rows(i, d, index, _layout(d, world_size, layouts), dequantize))
        else:
            parts.append(
                _expert_table(
                    i, d, index, placement, world_size, dequantize, None if _experts_whole else keep_ranks, layouts
                )
            )
    try:
        table = NeedTable.concat(parts, keep_ranks, lambda keys: index.key_columns(keys)[0])
    except SharedKeysLeftOut:  # tied expert tensors (rare): build every row, concat leaves them out
        return need_table(descs, index, placement, world_size, dequantize, keep_ranks, _experts_whole=True)
    return dataclasses.replace(table, digest=inputs_digest(descs, placement, world_size, dequantize))


def inputs_digest(descs: Sequence[ParamDesc], placement: Placement | None, world_size: int, dequantize: bool) -> bytes:
    """A digest of what :func:`need_table`'s rows are a function of (but the index): O(params)
    Python, each mesh's ranks hashed once."""
    h = hashlib.sha256(repr((world_size, dequantize)).encode())
    meshes: dict[int, int] = {}
    for d in descs:
        m = None
        if d.mesh is not None:
            m = meshes.get(id(d.mesh))
            if m is None:
                m = meshes[id(d.mesh)] = len(meshes)
                h.update(repr(d.mesh.shape).encode())
                h.update(np.ascontiguousarray(d.mesh, dtype=np.int64).tobytes())
        ex = d.expert
        h.update(
            repr(
                (
                    d.name,
                    d.shape,
                    m,
                    tuple(map(str, d.placements)),
                    d.keys,
                    None if ex is None else (ex.layer, ex.module, ex.param),
                    d.parts,
                    d.part_dim,
                )
            ).encode()
        )
    if placement is not None:
        h.update(repr((placement.num_logical, placement.num_ranks, placement.phy2log.shape)).encode())
        h.update(np.ascontiguousarray(placement.phy2log, dtype=np.int64).tobytes())
    return h.digest()


def compute_needs(
    descs: Sequence[ParamDesc],
    index: CheckpointIndex,
    placement: Placement | None,
    world_size: int,
) -> list[Need]:
    """Every rank's needs as :class:`Need` tuples: :func:`need_table`'s rows (same checks).
    A Python object per need: planning at scale should use :func:`need_table`."""
    return need_table(descs, index, placement, world_size).to_needs()


class _Layout(NamedTuple):
    """What the parameters of one shape and sharding share (:func:`~moeshard.models.shards.param_boxes` and what
    follows from it): ``ranks`` (``int64[M]``) and ``boxes`` (``int64[M, ndim, 2]``) in mesh
    order, ``keep`` (``bool[M]``: the box is not empty; None: none is), ``num`` non-empty boxes,
    and whether the holders' boxes are ``disjoint`` (:func:`~moeshard.models.shards.holders_disjoint`)."""

    ranks: np.ndarray
    boxes: np.ndarray
    keep: np.ndarray | None
    num: int
    disjoint: bool


class _DenseRows(NamedTuple):
    """The rows of dense parameter number ``param`` (a :class:`~moeshard.plan.needs.NeedPart`)
    until :meth:`NeedTable.concat` writes them:
    one per box of its ``shared`` layout (the :class:`_Layout` the parameters of its shape and
    sharding share, not a copy) that ``keep`` keeps (``bool[M]``, None for all; ``num`` of
    them), placed at the local tensor's origin."""

    param: int
    key_name: str
    shared: _Layout
    keep: np.ndarray | None
    num: int

    def __len__(self) -> int:
        return self.num

    @property
    def ranks(self) -> np.ndarray:
        return self.shared.ranks

    @property
    def boxes(self) -> np.ndarray:
        return self.shared.boxes

    @property
    def alone(self) -> bool:
        return self.shared.disjoint

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key_name,) if self.num else ()

    @property
    def ndim(self) -> np.ndarray:
        return np.asarray([self.boxes.shape[1]] if self.num else [], dtype=np.int8)

    @property
    def width(self) -> int:
        return self.boxes.shape[1]

    def _rows(self) -> tuple[np.ndarray, np.ndarray]:
        return (self.ranks, self.boxes) if self.keep is None else (self.ranks[self.keep], self.boxes[self.keep])

    @property
    def layout(self) -> int:
        """Equal for parameters of one layout (one :func:`need_table` call's :class:`_Layout`,
        alive while it runs; which boxes are empty follows from it)."""
        return id(self.shared)

    def row_ranks(self) -> np.ndarray:
        return self.ranks if self.keep is None else self.ranks[self.keep]

    def row_keys(self) -> np.ndarray:
        return np.zeros(self.num, dtype=np.int64)

    def row_numel(self) -> np.ndarray:
        numel = row_prod(self.boxes[:, :, 1])
        return numel if self.keep is None else numel[self.keep]

    def select(self, mask: np.ndarray) -> _DenseRows:
        """These rows where ``mask`` (``bool[len(self)]``) is True."""
        keep = np.zeros(len(self.ranks), dtype=bool)
        keep[np.flatnonzero(self.keep) if self.keep is not None else slice(None)] = mask
        # Not _replace: it checks the fields' count with len(), which is the rows' here.
        return _DenseRows(self.param, self.key_name, self.shared, keep, int(keep.sum()))

    def fill(self, table: NeedTable, rows: slice, key_ids: np.ndarray) -> None:
        ranks, boxes = self._rows()
        table.rank[rows] = ranks
        table.param[rows] = self.param
        table.key[rows] = key_ids[0]
        table.slot[rows] = -1
        d = self.width
        table.src_off[rows, :d] = boxes[:, :, 0]
        table.src_len[rows, :d] = boxes[:, :, 1]
        table.dst_off[rows, :d] = 0
        if table.alone is not None:
            table.alone[rows] = self.alone


def _cached(cache: dict, key: tuple, make: Callable):
    """``cache[key]``, made by ``make()`` on first use (always made where ``key`` is not
    hashable: a placement of another library's)."""
    try:
        hit = cache.get(key)
    except TypeError:
        return make()
    if hit is None:
        hit = cache[key] = make()
    return hit


def _layout(d: ParamDesc, world_size: int, cache: dict) -> _Layout:
    """:class:`_Layout` of ``d``, from ``cache`` (one :func:`need_table` call's: the descriptions
    of one model share their mesh arrays)."""

    def make() -> _Layout:
        ranks, boxes = param_boxes(d, world_size)
        keep = (boxes[:, :, 1] > 0).all(axis=1)
        num = int(keep.sum())
        return _Layout(ranks, boxes, None if num == len(keep) else keep, num, holders_disjoint(d, len(ranks)))

    return _cached(cache, _layout_key(d), make)


def _layout_key(d: ParamDesc) -> tuple:
    """What :class:`_Layout` is a function of (with the world size, one per call)."""
    return d.shape, None if d.mesh is None else id(d.mesh), d.placements


def _dense_rows(i: int, d: ParamDesc, index: CheckpointIndex, layout: _Layout, dequantize: bool = False) -> _DenseRows:
    """The rows of dense parameter number ``i`` (checked against the checkpoint): one per
    non-empty box of its ``layout``."""

    if d.parts and not any(k in index for k in d.keys) and all(k in index for k in d.parts):
        return _dense_part_rows(i, d, index, layout, dequantize)
    key = find_key(d, index)
    info = index.info(key)
    check_cast(f"parameter {d.name}", key, index, d.dtype, dequantize)
    if tuple(info.shape) != d.shape:
        raise ValueError(
            f"parameter {d.name}: checkpoint tensor {key!r} has shape {list(info.shape)}, "
            f"the model expects {list(d.shape)}"
        )
    return _DenseRows(i, key, layout, layout.keep, layout.num)


def _dense_part_rows(
    i: int, d: ParamDesc, index: CheckpointIndex, layout: _Layout, dequantize: bool = False
) -> NeedTable:
    """The rows of dense parameter number ``i`` stored as checkpoint tensors ``d.parts``
    concatenated along ``d.part_dim`` (transformers' ``Concatenate`` converter, e.g. Kimi-Linear's
    ``q_conv1d`` + ``k_conv1d`` + ``v_conv1d`` -> ``conv1d``): per non-empty box of its
    ``layout``, one row per part the box overlaps (part sizes from the headers)."""
    dim = d.part_dim
    sizes = []
    for key in d.parts:
        check_cast(f"parameter {d.name}", key, index, d.dtype, dequantize)
        shape = list(index.info(key).shape)
        if len(shape) != len(d.shape) or any(a != b for k, (a, b) in enumerate(zip(shape, d.shape)) if k != dim):
            raise ValueError(
                f"parameter {d.name}: checkpoint tensor {key!r} has shape {shape}, which is no part of "
                f"a tensor of shape {list(d.shape)} (parts concatenated along dim {dim})"
            )
        sizes.append(shape[dim])
    if sum(sizes) != d.shape[dim]:
        raise ValueError(
            f"parameter {d.name}: checkpoint tensors {list(d.parts)} have sizes {sizes} along dim {dim}, "
            f"summing to {sum(sizes)}, not the model's {d.shape[dim]}"
        )
    ranks, boxes = layout.ranks, layout.boxes
    if layout.keep is not None:
        ranks, boxes = ranks[layout.keep], boxes[layout.keep]
    start, length = boxes[:, dim, 0], boxes[:, dim, 1]
    owner, part, src_off, src_len, dst_off = [], [], [], [], []
    lo = 0
    for j, size in enumerate(sizes):  # the boxes that meet part j, and where
        a, b = np.maximum(start, lo), np.minimum(start + length, lo + size)
        hit = np.flatnonzero(a < b)
        off, ln, dst = boxes[hit, :, 0].copy(), boxes[hit, :, 1].copy(), np.zeros((len(hit), len(d.shape)), np.int64)
        off[:, dim], ln[:, dim], dst[:, dim] = a[hit] - lo, (b - a)[hit], a[hit] - start[hit]
        owner.append(hit)
        part.append(np.full(len(hit), j, np.int32))
        src_off.append(off)
        src_len.append(ln)
        dst_off.append(dst)
        lo += size
    order = np.argsort(np.concatenate(owner), kind="stable")  # box by box, parts in order
    num = len(order)
    return NeedTable(
        keys=tuple(d.parts),
        ndim=np.full(len(d.parts), len(d.shape), np.int8),
        rank=ranks[np.concatenate(owner)[order]].astype(np.int32),
        param=np.full(num, i, np.int32),
        key=np.concatenate(part)[order],
        slot=np.full(num, -1, np.int64),
        src_off=np.concatenate(src_off)[order],
        src_len=np.concatenate(src_len)[order],
        dst_off=np.concatenate(dst_off)[order],
        alone=np.full(num, layout.disjoint),
    )


def find_key(d: ParamDesc, index: CheckpointIndex) -> str:
    for key in d.keys:
        if key in index:
            return key
    if d.refused:
        raise ValueError(f"parameter {d.name}: {d.refused}")
    also = f" (nor under its other names {list(d.keys[1:])})" if len(d.keys) > 1 else ""
    if d.parts:
        missing = [k for k in d.parts if k not in index]
        also += (
            f", nor all the tensors transformers concatenates into it along dim {d.part_dim} ({list(d.parts)}: "
            f"{missing} missing)"
        )
    also += next((note for k in d.keys if (note := index.read_as_stored(k))), "")
    raise ValueError(f"parameter {d.name}: checkpoint {index.root} has no tensor {d.keys[0]!r}{also}")


def check_cast(
    what: str,
    key: str,
    index: CheckpointIndex,
    dtype: torch.dtype | str,
    dequantize: bool = False,
    expert: int | None = None,
) -> None:
    """Raise ValueError when checkpoint tensor ``key`` may not be cast to ``dtype``
    (:func:`~moeshard.dtypes.cast_refusal`); ``what`` names the destination ("parameter x"),
    ``expert`` the logical expert whose tensor it is (None: not an expert's). The message ends
    with the file holding ``key``. ``dequantize``: an FP8 weight with a block scale that fits it
    (:func:`moeshard.io.fp8.scale_of`: a float tensor of the weight's block grid) may go into a
    float tensor of two or more bytes (the caller dequantizes it with that scale). Pure; every
    rank that plans a read calls it."""
    problem = _cast_problem(what, key, index, dtype, dequantize)
    if problem is not None:
        whose = f"logical expert {expert}'s tensor, " if expert is not None else ""
        raise ValueError(f"{problem} ({whose}in file {index.info(key).file}){index.read_as_stored(key)}")


def _cast_problem(
    what: str, key: str, index: CheckpointIndex, dtype: torch.dtype | str, dequantize: bool
) -> str | None:
    """:func:`check_cast`'s message, or None when the cast is allowed."""
    ckpt_dtype = index.info(key).dtype
    why = cast_refusal(ckpt_dtype, dtype)
    if why is None:
        return None
    if why == "from_fp8" and dequantize and cast_refusal("F32", dtype) is None and scale_of(index, key) is not None:
        return None
    src = f"torch.{TORCH_NAMES[ckpt_dtype]}"  # as a torch dtype prints
    head = f"{what}: checkpoint tensor {key!r} has dtype {ckpt_dtype}"
    if why == "kind":
        return f"{head}, which cannot be cast to the model's {dtype}"
    if why == "to_fp8":
        return (
            f"{head}, the model's tensor is {dtype}: casting to FP8 is a quantization that needs a scale, "
            "which moeshard does not do; quantize the checkpoint (with its scales) or keep this tensor "
            f"in a wider dtype"
        )
    keep = f"load it into a model that keeps this tensor in {src}"
    if why == "fp8_formats":
        return (
            f"{head}, the model's tensor is {dtype}: converting between FP8 formats without rescaling "
            f"loses precision or overflows (float8_e4m3fn's largest value is 448, float8_e5m2 has 2 "
            f"mantissa bits); {keep}"
        )
    # The scale tensors a quantized checkpoint stores beside weight ``key`` (io.formats).
    scales = [k for k in scale_keys(key) if k in index]
    if scales:
        info = index.info(scales[0])
        what_scale = f"its scale tensor {scales[0]!r} ({info.dtype} {list(info.shape)})"
        if dequantize:  # there is a scale, but not a float one of this weight's block grid
            return (
                f"{head} (FP8), the model's tensor is {dtype}: {what_scale} is not a float block scale of a "
                f"weight of shape {list(index.info(key).shape)} (F32, BF16 or F16, of the shape a "
                f"power-of-two block grid gives), so it cannot be dequantized; {keep}"
            )
        return (
            f"{head} (FP8), the model's tensor is {dtype}: {what_scale} would be dropped and the raw FP8 "
            f"values loaded unscaled. moeshard.load dequantizes such weights (dequantize=True, its "
            f"default); this operation does not: {keep}"
        )
    return (
        f"{head} (FP8), the model's tensor is {dtype}: the checkpoint has no scale tensor for it (no "
        f"{scale_keys(key)[0]!r}), and its raw FP8 values would be meaningless as {dtype}; use a "
        f"dequantized checkpoint, or {keep}"
    )


def _slot_experts(d: ParamDesc, placement: Placement | None) -> tuple[np.ndarray, int]:
    """``(phy2log, num_logical)`` for expert parameter ``d``: ``int64[num_physical]`` the logical
    expert of each slot of its layer (-1: empty); without a placement, slot p holds expert p."""
    assert d.expert is not None
    num_physical = d.shape[0]
    if placement is None:
        return np.arange(num_physical, dtype=np.int64), num_physical
    if placement.num_physical != num_physical:
        raise ValueError(
            f"parameter {d.name} has {num_physical} expert slots per layer, the placement has "
            f"{placement.num_physical} physical slots"
        )
    return np.asarray(placement.phy2log[d.expert.layer], dtype=np.int64), placement.num_logical


def _check_spans(d: ParamDesc, boxes: np.ndarray, slots_per_rank: int) -> None:
    """Raise ValueError when a non-empty box (``int64[M, ndim, 2]``) of expert parameter
    ``d`` covers slots of more than one EP rank (``slots_per_rank`` slots each)."""
    s0, ns = boxes[:, 0, 0], boxes[:, 0, 1]
    bad = np.flatnonzero((ns > 0) & (s0 // slots_per_rank != (s0 + ns - 1) // slots_per_rank))
    if bad.size:
        box = tuple(map(tuple, boxes[bad[0]].tolist()))
        raise ValueError(f"parameter {d.name}: local box {list(box)} spans several EP ranks' slots")


# need_table(keep_ranks=): an expert parameter with more held (box, slot) pairs than this does not
# build other ranks' alone rows; with fewer, building them all and leaving them out in
# NeedTable.concat costs less than counting them apart (~0.1 ms per parameter).
_UNBUILT_ABOVE = 4096


def _expert_table(
    i: int,
    d: ParamDesc,
    index: CheckpointIndex,
    placement: Placement | None,
    world_size: int,
    dequantize: bool,
    keep_ranks: np.ndarray | None,
    cache: dict,
) -> _ExpertRows | NeedTable:
    """The rows of expert parameter number ``i``: for each rank holding a non-empty box of it
    (dim 0 = slots), each slot of its box holding a logical expert, each checkpoint part of
    that expert the box overlaps.

    ``keep_ranks`` (:func:`need_table`'s): the alone rows of the other ranks are not built but
    counted (``omitted_bytes``, ``full``), where there are many (``_UNBUILT_ABOVE``) and every
    part of every held expert has one item size (a slot's box then weighs its elements times
    that size); else they are built, for :meth:`NeedTable.concat` to leave out.

    ``cache`` (one :func:`need_table` call's): the rows of parameters of one layout, placement
    row and part sizes differ only in their keys (every MoE layer of a model alike), so they are
    worked out once; each parameter's keys are still checked against the checkpoint."""

    ref = d.expert
    assert ref is not None
    phy2log, num_logical = _slot_experts(d, placement)
    spans = (
        d.shape[0] // placement.num_ranks
        if d.mesh is not None and placement is not None and placement.num_ranks is not None
        else None
    )
    where = (*_layout_key(d), phy2log.tobytes(), num_logical, spans)
    slots = _cached(
        cache, ("slots", *where), lambda: _held_slots(d, _layout(d, world_size, cache), phy2log, num_logical, spans)
    )
    if ref.param.fused and ref.param.merged:
        return _merged_rows(i, d, index, num_logical, slots, dequantize)
    if ref.param.fused:
        return _fused_rows(i, d, index, phy2log, num_logical, slots, dequantize)
    part_sizes = expert_part_sizes(d, index, 0, d.shape[1:], dequantize)  # expert 0's: every expert must agree
    # Rows of identity experts follow the logical experts' on disk (an unsharded model, slot p =
    # expert p, reads them as experts too): the expert after them would be a stray one.
    beyond = num_logical + ref.identity if placement is not None else num_logical
    extra = ref.param.keys(ref.module, beyond)
    if extra[0] in index:
        what = f" and {ref.identity} identity experts" if ref.identity and placement is not None else ""
        raise ValueError(
            f"parameter {d.name}: the checkpoint has expert {beyond} ({extra[0]!r}) but the "
            f"placement has only {num_logical} logical experts{what}"
        )
    keys = _held_expert_keys(d, index, slots.held.tolist(), part_sizes, dequantize)
    unit = None  # the one item size of the keys, where other ranks' alone rows go unbuilt
    if keep_ranks is not None and len(slots.owner) > _UNBUILT_ABOVE:
        itemsize = index.key_columns(keys)[0]
        if (itemsize == itemsize[0]).all():
            unit = int(itemsize[0])
    rows = _cached(
        cache,
        ("rows", *where, part_sizes, ref.param.dim, unit),
        lambda: _expert_rows(slots, part_sizes, ref.param.dim, len(keys), keep_ranks, unit),
    )
    return _ExpertRows(i, tuple(keys), rows)


class _ExpertRows(NamedTuple):
    """The rows of expert parameter number ``param`` (a :class:`~moeshard.plan.needs.NeedPart`)
    until :meth:`NeedTable.concat` writes them: the read-only ``rows`` of its layout
    (:func:`_expert_rows`, shared by the parameters of one layout, placement row and part
    sizes), named by its own checkpoint ``keys``."""

    param: int
    keys: tuple[str, ...]
    rows: NeedTable

    def __len__(self) -> int:
        return len(self.rows)

    ndim = property(lambda self: self.rows.ndim)
    alone = property(lambda self: self.rows.alone)
    width = property(lambda self: self.rows.width)
    full = property(lambda self: self.rows.full)
    omitted_bytes = property(lambda self: self.rows.omitted_bytes)
    layout = None  # rows left out by key and rank, not by layout

    def row_ranks(self) -> np.ndarray:
        return self.rows.rank

    def row_keys(self) -> np.ndarray:
        return self.rows.key

    def row_numel(self) -> np.ndarray:
        return self.rows.row_numel()

    def select(self, mask: np.ndarray) -> _ExpertRows:
        return _ExpertRows(self.param, self.keys, self.rows.take(mask))

    def fill(self, table: NeedTable, rows: slice, key_ids: np.ndarray) -> None:
        self.rows.fill(table, rows, key_ids)
        table.param[rows] = self.param  # over the shared rows' unset param


class _HeldSlots(NamedTuple):
    """The (box, slot) pairs of an expert parameter's layout that hold a logical expert:
    ``ranks`` (``int64[M']``) and ``boxes`` (``int64[M', ndim, 2]``) the non-empty boxes, then
    per pair (box order, then slot order) the box's index ``owner``, the global ``slot`` and
    its logical ``expert``; ``held``: the logical experts some slot holds (ascending);
    ``copies``: ``int64[num_logical]`` slots per logical expert; ``disjoint``: the layout's."""

    ranks: np.ndarray
    boxes: np.ndarray
    owner: np.ndarray
    slot: np.ndarray
    expert: np.ndarray
    held: np.ndarray
    copies: np.ndarray
    disjoint: bool


def _expert_rows(
    slots: _HeldSlots,
    part_sizes: tuple[int, ...],
    dim: int,
    num_keys: int,
    keep_ranks: np.ndarray | None,
    unit: int | None,
) -> NeedTable:
    """:func:`_expert_table`'s rows for ``slots`` and checkpoint parts of ``part_sizes`` along
    ``dim``, the keys still unnamed (``num_keys`` of them: part by part, then held expert) and
    ``param`` unset; read-only (parameters of one layout share them). ``unit``: the item size
    where the alone rows of ranks not in ``keep_ranks`` go unbuilt, else None."""
    ranks, boxes, owner, slot, expert = slots.ranks, slots.boxes, slots.owner, slots.slot, slots.expert
    omitted = None
    if unit is not None:
        assert keep_ranks is not None
        drop = (slots.copies[expert] == 1) & slots.disjoint & ~keep_ranks[ranks[owner]]
        if drop.any():
            numel = row_prod(boxes[owner[drop], 1:, 1])  # the parts a box overlaps tile it
            omitted = np.bincount(ranks[owner[drop]], weights=numel * unit, minlength=len(keep_ranks)).astype(np.int64)
            owner, slot, expert = owner[~drop], slot[~drop], expert[~drop]
    # The parts a box overlaps depend only on its slice dims: computed once per distinct tail.
    used = np.unique(owner)
    tails, tail_of_used = unique_rows(boxes[used, 1:, :].reshape(len(used), 2 * (boxes.shape[1] - 1)))
    first, count, part, src_off, src_len, dst_off = _part_rows(
        tails.reshape(len(tails), boxes.shape[1] - 1, 2), part_sizes, dim
    )
    tail = tail_of_used[np.searchsorted(used, owner)]
    row, prow = expand_runs(first[tail], count[tail])
    # Keys are part by part. Each is used (but for experts whose rows were left out): the
    # boxes of a held slot tile its slice, so they overlap every part.
    key = part[prow] * len(slots.held) + np.searchsorted(slots.held, expert[row])
    num = len(row)
    columns = dict(
        ndim=np.full(num_keys, boxes.shape[1] - 1, np.int8),
        rank=ranks[owner[row]].astype(np.int32),
        param=np.zeros(num, np.int32),
        key=key.astype(np.int32),
        slot=slot[row] - boxes[owner[row], 0, 0],
        src_off=src_off[prow],
        src_len=src_len[prow],
        dst_off=dst_off[prow],
        alone=(slots.copies[expert[row]] == 1) & slots.disjoint,
        full=None if omitted is None else np.asarray(keep_ranks, dtype=bool),
        omitted_bytes=omitted,
    )
    for a in columns.values():
        if a is not None:
            a.setflags(write=False)
    return NeedTable(keys=("",) * num_keys, **columns)


def _held_slots(d: ParamDesc, layout: _Layout, phy2log: np.ndarray, num_logical: int, spans: int | None) -> _HeldSlots:
    """:class:`_HeldSlots` of expert parameter ``d`` of ``layout`` (its slot ``p`` holds logical
    expert ``phy2log[p]``, -1 for none). ``spans``: the slots of one EP rank, where a box must
    not cover two ranks' (ValueError)."""
    ranks, boxes = layout.ranks, layout.boxes
    if layout.keep is not None:
        ranks, boxes = ranks[layout.keep], boxes[layout.keep]
    if spans is not None:
        _check_spans(d, boxes, spans)
    owner, slot = expand_runs(boxes[:, 0, 0], boxes[:, 0, 1])
    expert = phy2log[slot]
    live = expert >= 0  # -1: an empty slot (dead or not-yet-joined rank), nothing to load
    owner, slot, expert = owner[live], slot[live], expert[live]
    held = np.flatnonzero(np.bincount(expert, minlength=num_logical))
    # A slot's boxes are another rank's too only if its expert has several slots (or a mesh
    # dim replicates the parameter): the boxes of one slot are disjoint.
    copies = np.bincount(phy2log[phy2log >= 0], minlength=num_logical)
    return _HeldSlots(ranks, boxes, owner, slot, expert, held, copies, layout.disjoint)


def _fused_rows(
    i: int,
    d: ParamDesc,
    index: CheckpointIndex,
    phy2log: np.ndarray,
    num_logical: int,
    slots: _HeldSlots,
    dequantize: bool = False,
) -> NeedTable:
    """:func:`_expert_table`'s rows for an expert parameter fused on disk: one checkpoint tensor
    ``[num_logical, *slice_shape]``, row ``e`` logical expert ``e``. A rank's run of local slots
    holding consecutive experts is one row (a contiguous placement: one row per rank), read
    into the whole local tensor (``slot`` -1, the local slot as the first dst offset)."""
    key, shape = _fused_tensor(d, index, dequantize)
    want = [num_logical, *d.shape[1:]]
    if shape != want:
        raise ValueError(
            f"parameter {d.name}: checkpoint tensor {key!r} (every expert fused on disk) has shape {shape}, "
            f"the model expects {want} ({num_logical} logical experts of slice {want[1:]})"
        )
    ranks, boxes, owner, slot, expert = slots.ranks, slots.boxes, slots.owner, slots.slot, slots.expert
    # Runs: the same rank, the next slot, the next expert.
    start = np.ones(len(slot), dtype=bool)
    start[1:] = (owner[1:] != owner[:-1]) | (slot[1:] != slot[:-1] + 1) | (expert[1:] != expert[:-1] + 1)
    first = np.flatnonzero(start)
    length = np.diff(np.append(first, len(slot)))
    owner, slot, expert = owner[first], slot[first], expert[first]
    num, ndim = len(first), len(d.shape)
    tail_off, tail_len = boxes[owner, 1:, 0], boxes[owner, 1:, 1]
    src_off = np.concatenate([expert[:, None], tail_off], axis=1)
    src_len = np.concatenate([length[:, None], tail_len], axis=1)
    dst_off = np.zeros((num, ndim), np.int64)
    dst_off[:, 0] = slot - boxes[owner, 0, 0]
    # Runs of different ranks share a box only where an expert has several slots.
    alone = slots.disjoint and bool((slots.copies <= 1).all())
    return NeedTable(
        keys=(key,),
        ndim=np.full(1, ndim, np.int8),
        rank=ranks[owner].astype(np.int32),
        param=np.full(num, i, np.int32),
        key=np.zeros(num, np.int32),
        slot=np.full(num, -1, np.int64),
        src_off=src_off.astype(np.int64),
        src_len=src_len.astype(np.int64),
        dst_off=dst_off,
        alone=np.full(num, alone),
    )


def _merged_rows(
    i: int, d: ParamDesc, index: CheckpointIndex, num_logical: int, slots: _HeldSlots, dequantize: bool = False
) -> NeedTable:
    """:func:`_expert_table`'s rows for an expert parameter fused on disk with its expert dim
    merged into the slice's dim 0 (DBRX: one tensor ``[num_logical * n, *rest]``, expert ``e`` at
    rows ``e*n ..``): one row per held (box, slot), into that slot (the checkpoint tensor has
    the slice's dims, not the local tensor's)."""
    key, shape = _fused_tensor(d, index, dequantize)
    n = d.shape[1] if len(d.shape) > 1 else 0
    want = [num_logical * n, *d.shape[2:]]
    if len(d.shape) < 2 or shape != want:
        raise ValueError(
            f"parameter {d.name}: checkpoint tensor {key!r} (every expert fused on disk, merged into dim 0) has "
            f"shape {shape}, the model expects {want} ({num_logical} logical experts of slice {list(d.shape[1:])})"
        )
    ranks, boxes, owner, slot, expert = slots.ranks, slots.boxes, slots.owner, slots.slot, slots.expert
    num, ndim = len(owner), len(d.shape) - 1
    src_off = boxes[owner, 1:, 0].copy()
    src_off[:, 0] += expert * n
    return NeedTable(
        keys=(key,),
        ndim=np.full(1, ndim, np.int8),
        rank=ranks[owner].astype(np.int32),
        param=np.full(num, i, np.int32),
        key=np.zeros(num, np.int32),
        slot=(slot - boxes[owner, 0, 0]).astype(np.int64),
        src_off=src_off.astype(np.int64),
        src_len=boxes[owner, 1:, 1].astype(np.int64),
        dst_off=np.zeros((num, ndim), np.int64),
        alone=(slots.copies[expert] == 1) & slots.disjoint,
    )


def _fused_tensor(d: ParamDesc, index: CheckpointIndex, dequantize: bool) -> tuple[str, list[int]]:
    """``(key, shape)`` of the one checkpoint tensor of expert parameter ``d`` fused on disk;
    ValueError when the checkpoint lacks it or the cast rule refuses its dtype."""
    assert d.expert is not None
    (key,) = d.expert.param.keys(d.expert.module, 0)
    if key not in index:
        raise ValueError(
            f"parameter {d.name}: checkpoint {index.root} has no tensor {key!r}{index.read_as_stored(key)}"
        )
    check_cast(f"parameter {d.name}", key, index, d.dtype, dequantize)
    return key, list(index.info(key).shape)


def _held_expert_keys(
    d: ParamDesc, index: CheckpointIndex, held: Sequence[int], part_sizes: tuple[int, ...], dequantize: bool = False
) -> list[str]:
    """The checkpoint keys of logical experts ``held`` (ascending) of expert parameter ``d``,
    part by part (:func:`~moeshard.models.unused.keys_of_experts`). Raises ValueError for an
    expert whose parts do not fit the slice as expert 0's (``part_sizes``) do, or (with
    ``dequantize``) whose FP8 part going into a float tensor lacks a block scale that fits it
    (missing, not float, or not of its block grid: :func:`~moeshard.io.fp8.scale_of`), naming
    the key, its file and the expert. Every expert is checked, in one pass over the index."""
    ref = d.expert
    assert ref is not None
    keys = keys_of_experts(ref, held)
    num_parts, num_held = len(ref.param.parts), len(held)
    # An expert whose parts have expert 0's dtypes and shapes passes every check of the parts
    # expert 0 passed; only the others go through the full check, for its error message.
    kinds = index.key_kinds(keys).reshape(num_parts, num_held)
    first = ref.param.keys(ref.module, 0)
    want = index.key_kinds(first)
    odd = (kinds != want[:, None]).any(axis=0)
    if dequantize:
        # Each expert's FP8 part is dequantized with its own scale: expert 0's scale fitting says
        # nothing of the others' (one missing would load that expert's raw FP8 values).
        fp8 = [
            j for j, k in enumerate(first) if k in index and cast_refusal(index.info(k).dtype, d.dtype) == "from_fp8"
        ]
        for j in fp8:
            odd |= ~fitting_scales(index, keys[j * num_held : (j + 1) * num_held])
    suspect = np.asarray(held, dtype=np.int64)[odd]
    for e in suspect.tolist():
        if expert_part_sizes(d, index, e, d.shape[1:], dequantize) != part_sizes:
            raise ValueError(
                f"parameter {d.name}: checkpoint tensors {list(ref.param.keys(ref.module, e))} of "
                f"logical expert {e} differ in shape from expert 0's"
            )
    return keys


def _part_rows(tails: np.ndarray, part_sizes: tuple[int, ...], dim: int) -> tuple[np.ndarray, ...]:
    """The checkpoint parts of each distinct slice box (``tails``: ``int64[T, ndim, 2]``,
    expert dim excluded), by :func:`~moeshard.models.adapters.expert_parts`.

    Returns ``(first, count, part, src_off, src_len, dst_off)``: tail ``t``'s parts are rows
    ``first[t] .. first[t] + count[t] - 1`` (``int64[T]``); per row (``P`` of them) the part
    index ``int64[P]``, the box in the part's tensor ``int64[P, ndim]`` (offsets, lengths) and
    where it lands relative to the tail's origin ``int64[P, ndim]``.
    """
    ndim = tails.shape[1]
    count = np.zeros(len(tails), np.int64)
    part, src, dst = [], [], []
    for t, tail in enumerate(tails.tolist()):
        box = tuple(map(tuple, tail))
        # A 0-dim slice (a per-expert scalar) is its one part, whole.
        pieces = expert_parts(box, part_sizes, dim) if ndim else [(0, (), ())]
        count[t] = len(pieces)
        for j, part_box, sub in pieces:
            part.append(j)
            src.append(part_box)
            dst.append([o - b for (o, _), (b, _) in zip(sub, box)])
    src_arr = np.asarray(src, np.int64).reshape(len(src), ndim, 2)
    return (
        np.cumsum(count) - count,
        count,
        np.asarray(part, np.int64),
        np.ascontiguousarray(src_arr[:, :, 0]),
        np.ascontiguousarray(src_arr[:, :, 1]),
        np.asarray(dst, np.int64).reshape(len(dst), ndim),
    )


def expert_part_sizes(
    d: ParamDesc, index: CheckpointIndex, expert: int, slice_shape: tuple[int, ...], dequantize: bool = False
) -> tuple[int, ...]:
    """Sizes along the concatenation dim of the checkpoint parts of logical ``expert``'s
    slice of expert parameter ``d`` (``(1,)`` for a 0-dim slice: one scalar part). Raises
    ValueError for a missing part, a dtype the cast rule refuses or parts that do not make up
    a slice of ``slice_shape``."""
    ref = d.expert
    assert ref is not None
    keys = ref.param.keys(ref.module, expert)
    dim = ref.param.dim
    if ref.param.fused and ref.param.merged:  # rows ``expert * n ..`` of one tensor, dim 0 merged
        key, shape = _fused_tensor(d, index, dequantize)
        n = slice_shape[0] if slice_shape else 0
        if (
            not n
            or len(shape) != len(slice_shape)
            or shape[1:] != list(slice_shape[1:])
            or shape[0] % n
            or shape[0] // n <= expert
        ):
            raise ValueError(
                f"parameter {d.name}: checkpoint tensor {key!r} (every expert fused on disk, merged into "
                f"dim 0) has shape {shape}, which holds no logical expert {expert} of slice "
                f"{list(slice_shape)}"
            )
        return (slice_shape[dim],)
    if ref.param.fused:  # row ``expert`` of one tensor holding every expert
        key, shape = _fused_tensor(d, index, dequantize)
        if shape[1:] != list(slice_shape) or not shape or shape[0] <= expert:
            raise ValueError(
                f"parameter {d.name}: checkpoint tensor {key!r} (every expert fused on disk) has shape "
                f"{shape}, which holds no logical expert {expert} of slice {list(slice_shape)}"
            )
        return (slice_shape[dim] if slice_shape else 1,)
    sizes = []
    for key in keys:
        if key not in index:
            raise ValueError(
                f"parameter {d.name}: checkpoint {index.root} has no tensor {key!r} (logical expert {expert})"
                f"{index.read_as_stored(key)}"
            )
        info = index.info(key)
        check_cast(f"parameter {d.name}", key, index, d.dtype, dequantize, expert)
        shape = list(info.shape)
        want = list(slice_shape)
        if len(shape) != len(want) or any(a != b for k, (a, b) in enumerate(zip(shape, want)) if k != dim):
            raise ValueError(
                f"parameter {d.name}: checkpoint tensor {key!r} has shape {shape}, which does not fit "
                f"an expert slice of shape {want} (parts concatenated along dim {dim})"
            )
        sizes.append(shape[dim] if shape else 1)
    total = slice_shape[dim] if slice_shape else 1
    if sum(sizes) != total:
        raise ValueError(
            f"parameter {d.name}: checkpoint tensors {list(keys)} of logical "
            f"expert {expert} have sizes {sizes} along dim {dim}, summing to {sum(sizes)}, "
            f"not {total}"
        )
    return tuple(sizes)
