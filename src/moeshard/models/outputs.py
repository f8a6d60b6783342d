"""Model descriptions -> the checkpoint tensors a save writes and every rank's boxes of them
(:func:`describe_outputs`, pure): the input of the save planner (:mod:`moeshard.plan.save`),
as :mod:`.layout` gives the load planner its needs. The records it makes
(:class:`~moeshard.plan.save_outputs.Output`, :class:`~moeshard.plan.save_outputs.Segment`)
are the planner's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .._gc import paused_gc
from ..io.header import DTYPE_NAMES
from ..io.index import CheckpointIndex
from ..placement import ROW_RULE, Placement
from ..plan.arrays import expand_runs
from ..plan.save_outputs import Output, SegTable
from .describe import ParamDesc
from .shards import param_boxes

__all__ = ["describe_outputs"]


def describe_outputs(
    descs: Sequence[ParamDesc],
    placement: Placement | None,
    world_size: int,
    reference: CheckpointIndex | None = None,
    *,
    tied_targets: frozenset[str] = frozenset(),
    skip_keys: frozenset[str] = frozenset(),
    buffers: frozenset[str] = frozenset(),
    num_experts: dict[int, int] | None = None,
) -> list[Output]:
    """Checkpoint tensors of a model and every rank's boxes of them (pure).

    Args:
        descs: :func:`~moeshard.models.describe.describe_model` of the model.
        placement: which logical expert each physical slot holds (None: slot p = expert p).
        reference: a checkpoint whose names and expert part sizes to mirror.
        tied_targets: names of tied parameters a checkpoint drops (``lm_head.weight``); a
            tied parameter is written under another of its names.
        skip_keys: keys not to write (the model's ``_keys_to_ignore_on_save``).
        buffers: names of persistent buffers (not counted as parameters).
        num_experts: logical experts per MoE layer as the model declares them.

    Raises:
        ValueError: a logical expert with no physical slot, fused expert parts that do not
            split, a shape disagreeing with ``reference``, a dtype safetensors cannot store.
    """
    with paused_gc():
        return _describe_outputs(
            descs, placement, world_size, reference, tied_targets, skip_keys, buffers, num_experts or {}
        )


class _Rows:
    """Segment rows collected per chunk (``tensor``: ``int64[k]`` output index of each row),
    made into one :class:`SegTable` sorted by tensor at the end."""

    def __init__(self):
        self.chunks: list[tuple] = []

    def add(self, tensor, rank, param: int, slot, off, ln, delta) -> None:
        self.chunks.append((tensor, rank, param, slot, off, ln, delta))

    def table(self, num_tensors: int, width: int) -> tuple[SegTable, np.ndarray]:
        """The table (rows of each tensor in the order they were added) and ``int64[T + 1]``
        the first row of each tensor. Each chunk is written straight to its rows' places (a
        stable sort by tensor) and let go: the rows are never held twice over (DeepSeek-V3 on
        8,192 ranks: 4.7 million rows, 325 MiB)."""
        sizes = [len(c[1]) for c in self.chunks]
        total = sum(sizes)
        tensor = np.concatenate(
            [np.broadcast_to(np.asarray(c[0], np.int64), (k,)) for c, k in zip(self.chunks, sizes)]
            + [np.zeros(0, np.int64)]
        )
        bounds = np.zeros(num_tensors + 1, np.int64)
        np.cumsum(np.bincount(tensor, minlength=num_tensors), out=bounds[1:])
        place = np.empty(total, np.int64)
        place[np.argsort(tensor, kind="stable")] = np.arange(total, dtype=np.int64)  # row i goes to place[i]
        del tensor
        rank, param, slot = (np.empty(total, np.int64) for _ in range(3))
        off, ln, delta = (np.empty((total, width), np.int64) for _ in range(3))
        at = 0
        chunks, self.chunks = self.chunks, []
        chunks.reverse()  # popped from the end: each chunk is freed once written
        while chunks:
            _, r, p, sl, o, n, dl = chunks.pop()
            k, nd = len(r), o.shape[1]
            rows = place[at : at + k]
            rank[rows], param[rows], slot[rows] = r, p, sl
            off[rows, :nd], ln[rows, :nd], delta[rows, :nd] = o, n, dl
            if nd < width:  # padded dims: offset 0, length 1, no shift
                off[rows, nd:], ln[rows, nd:], delta[rows, nd:] = 0, 1, 0
            at += k
        return SegTable(rank, param, slot, off, ln, delta), bounds


def _describe_outputs(
    descs, placement, world_size, reference, tied_targets, skip_keys, buffers, num_experts
) -> list[Output]:
    heads: list[tuple] = []  # (key, shape, dtype, is_buffer, zeros) per output
    rows = _Rows()
    num_layers = 1 + max((d.expert.layer for d in descs if d.expert), default=-1)
    phy2log, num_logical = _expert_table(descs, placement, num_layers, reference, num_experts)
    for i, d in enumerate(descs):
        if d.dtype not in DTYPE_NAMES:
            raise ValueError(f"parameter {d.name}: dtype {d.dtype} cannot be stored in safetensors")
        ranks, off, ln = _rank_box_arrays(d, world_size)
        if d.expert is None:
            key = _choose_key(d, reference, tied_targets)
            if key in skip_keys:
                continue
            if d.parts and not (reference is not None and key in reference):
                # Written as the parts transformers concatenates into it, as save_pretrained does.
                _dense_part_outputs(i, d, ranks, off, ln, reference, heads, rows)
                continue
            if reference is not None and key in reference and tuple(reference.info(key).shape) != d.shape:
                raise ValueError(
                    f"parameter {d.name}: the reference checkpoint has {key!r} of shape "
                    f"{list(reference.info(key).shape)}, the model {list(d.shape)}"
                )
            keep = (ln > 0).all(axis=1)
            rows.add(
                len(heads), ranks[keep], i, np.full(int(keep.sum()), -1, np.int64), off[keep], ln[keep], -off[keep]
            )
            heads.append((key, d.shape, DTYPE_NAMES[d.dtype], d.name in buffers, False))
        elif d.expert.param.fused and d.expert.param.merged:
            _merged_output(i, d, phy2log[d.expert.layer], num_logical, ranks, off, ln, heads, rows)
        elif d.expert.param.fused:
            _fused_output(i, d, phy2log[d.expert.layer], num_logical, ranks, off, ln, heads, rows)
        elif d.expert.identity and placement is None:
            # An unsharded model holds the identity experts' rows after its logical experts'
            # (slot p = expert p): they are written as the experts they follow.
            _expert_outputs(i, d, np.arange(d.shape[0]), d.shape[0], ranks, off, ln, reference, heads, rows)
        else:
            # An EP model does not hold them (no forward reads them): they are written as zeros.
            _expert_outputs(
                i, d, phy2log[d.expert.layer], num_logical, ranks, off, ln, reference, heads, rows, d.expert.identity
            )
    width = max((len(h[1]) for h in heads), default=1) or 1
    table, bounds = rows.table(len(heads), width)
    outs = [
        Output(key, shape, dtype, None, is_buffer, table=table, rows=(lo, hi), zeros=zeros)
        for (key, shape, dtype, is_buffer, zeros), lo, hi in zip(heads, bounds[:-1].tolist(), bounds[1:].tolist())
    ]
    if len({o.key for o in outs}) == len(outs):
        return outs
    seen: set[str] = set()
    for o in outs:
        if o.key in seen:
            raise ValueError(f"two tensors of the model would be written as {o.key!r}")
        seen.add(o.key)
    return outs


def _rank_box_arrays(d: ParamDesc, world_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`rank_boxes` as ``(rank int64[R], off int64[R, ndim], len int64[R, ndim])``."""
    ranks, boxes = param_boxes(d, world_size)
    return ranks, boxes[:, :, 0], boxes[:, :, 1]


def _slots(phy2log: np.ndarray, off: np.ndarray, ln: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every held slot of an expert parameter holding a logical expert: ``(q, local, e)``,
    ``int64[K]`` each: the rank box row, the local slot, the logical expert; in (row, slot)
    order. Rows with an empty box are skipped."""
    valid = (ln > 0).all(axis=1)
    counts = np.where(valid, ln[:, 0], 0)
    q, slot = expand_runs(off[:, 0], counts)
    e = phy2log[slot].astype(np.int64) if len(slot) else np.zeros(0, np.int64)
    keep = e >= 0
    return q[keep], (slot - off[q, 0])[keep], e[keep]


def _choose_key(d: ParamDesc, reference: CheckpointIndex | None, tied_targets: frozenset[str]) -> str:
    if reference is not None:
        for k in d.keys:
            if k in reference:
                return k
    return next((k for k in d.keys if k not in tied_targets), d.keys[0] if d.keys else d.name)


def _expert_table(descs, placement, num_layers, reference, num_experts) -> tuple[np.ndarray, int]:
    """``phy2log[num_layers, num_physical]`` and the number of logical experts, after checking
    that every logical expert of every layer has a slot."""
    if not num_layers:
        return np.zeros((0, 0), dtype=np.int64), 0
    # An unsharded model's parameters with rows for identity experts have those rows after the slots.
    num_physical = next(d.shape[0] - (d.expert.identity if placement is None else 0) for d in descs if d.expert)
    if placement is None:
        phy2log = np.tile(np.arange(num_physical), (num_layers, 1))
        num_logical = num_physical
    else:
        phy2log = np.asarray(placement.phy2log)
        if phy2log.ndim != 2 or phy2log.shape[0] != num_layers:
            raise ValueError(
                f"the model has {num_layers} MoE layers, the placement describes "
                f"{phy2log.shape[0] if phy2log.ndim == 2 else '?'} ({ROW_RULE})"
            )
        num_logical = int(getattr(placement, "num_logical", None) or (phy2log.max() + 1))
    for d in descs:
        if d.expert is not None and d.shape[0] - (d.expert.identity if placement is None else 0) != phy2log.shape[1]:
            raise ValueError(
                f"parameter {d.name} has {d.shape[0]} expert slots per layer, the placement has "
                f"{phy2log.shape[1]} physical slots"
            )
    for layer in range(num_layers):
        want = num_experts.get(layer, num_logical)
        if want < num_logical:
            raise ValueError(
                f"layer {layer}: the placement has {num_logical} logical experts, the model's "
                f"experts module declares {want}"
            )
        row = phy2log[layer]
        present = np.zeros(want, dtype=bool)
        present[row[(row >= 0) & (row < want)]] = True
        missing = np.flatnonzero(~present)
        if len(missing):
            raise ValueError(
                f"layer {layer}: logical expert {int(missing[0])} has no physical slot in the placement "
                f"({len(missing)} expert(s) of this layer missing): it cannot be saved"
            )
    num_logical = max([num_logical, *num_experts.values()])
    if reference is not None:
        for d in descs:
            ref = d.expert
            if ref is not None and ref.param.fused:
                (key,) = ref.param.keys(ref.module, 0)
                shape = list(reference.info(key).shape) if key in reference else None
                want = [num_logical * d.shape[1], *d.shape[2:]] if ref.param.merged else [num_logical, *d.shape[1:]]
                if shape != want:
                    raise ValueError(
                        f"parameter {d.name}: the reference checkpoint's {key!r} (every expert fused on disk) has "
                        f"shape {shape}, the model's {num_logical} logical experts make {want}"
                    )
            elif ref is not None and ref.param.keys(ref.module, num_logical + ref.identity)[0] in reference:
                also = f" and {ref.identity} identity experts" if ref.identity else ""
                raise ValueError(
                    f"parameter {d.name}: the reference checkpoint has logical expert "
                    f"{num_logical + ref.identity}, the model has {num_logical} logical experts{also}"
                )
    return phy2log, num_logical


def _expert_outputs(
    i,
    d: ParamDesc,
    phy2log: np.ndarray,
    num_logical: int,
    ranks,
    off,
    ln,
    reference,
    heads,
    rows: _Rows,
    zeros: int = 0,
) -> None:
    """The checkpoint tensors of a (not fused) expert parameter: part ``j`` of logical expert
    ``e`` in output ``base + e * parts + j``, its rows in (rank box, local slot) order; then
    the parts of ``zeros`` more experts that nobody holds, written as zeros (the rows of
    identity experts an EP model does not hold)."""
    ref = d.expert
    dim = ref.param.dim
    slice_shape = d.shape[1:]
    if not slice_shape:  # one 0-d tensor per expert (ModelOpt's weight_scale_2 [E]): no part dim
        assert len(ref.param.parts) == 1, ref.param
        base = len(heads)
        dtype = DTYPE_NAMES[d.dtype]
        heads.extend(
            (ref.param.keys(ref.module, e)[0], (), dtype, False, e >= num_logical) for e in range(num_logical + zeros)
        )
        q, local, e = _slots(phy2log, off, ln)
        rest_off, rest_len = off[q, 1:], ln[q, 1:]
        rows.add(base + e, ranks[q], i, local, rest_off.copy(), rest_len.copy(), -rest_off)
        return
    part_sizes = _part_sizes(d, slice_shape, reference)
    los = [sum(part_sizes[:j]) for j in range(len(part_sizes))]
    dtype = DTYPE_NAMES[d.dtype]
    part_shapes = [slice_shape[:dim] + (n,) + slice_shape[dim + 1 :] for n in part_sizes]
    base, num_parts = len(heads), len(part_sizes)
    for e in range(num_logical + zeros):
        keys = ref.param.keys(ref.module, e)
        assert len(keys) == num_parts, (keys, part_sizes)
        heads.extend((k, part_shapes[j], dtype, False, e >= num_logical) for j, k in enumerate(keys))
    q, local, e = _slots(phy2log, off, ln)
    rest_off, rest_len = off[q, 1:], ln[q, 1:]
    start, length = rest_off[:, dim], rest_len[:, dim]
    for j, (lo, size) in enumerate(zip(los, part_sizes)):
        a, b = np.maximum(start, lo), np.minimum(start + length, lo + size)
        has = a < b  # the rank's box meets part j
        p_off, p_len, delta = rest_off[has].copy(), rest_len[has].copy(), -rest_off[has]
        p_off[:, dim], p_len[:, dim] = a[has] - lo, (b - a)[has]
        delta[:, dim] += lo
        rows.add(base + e[has] * num_parts + j, ranks[q[has]], i, local[has], p_off, p_len, delta)


def _dense_part_outputs(i, d: ParamDesc, ranks, off, ln, reference, heads, rows: _Rows) -> None:
    """The checkpoint tensors ``d.parts`` of a dense parameter stored split along ``d.part_dim``:
    the reference checkpoint's part sizes, else equal chunks (transformers' ``Chunk``, the reverse
    of its ``Concatenate``: what ``save_pretrained`` writes)."""
    dim, num_parts = d.part_dim, len(d.parts)
    if reference is not None and all(k in reference for k in d.parts):
        sizes = [reference.info(k).shape[dim] if len(reference.info(k).shape) > dim else -1 for k in d.parts]
        if sum(sizes) != d.shape[dim] or min(sizes) < 0:
            raise ValueError(
                f"parameter {d.name}: the reference checkpoint's tensors {list(d.parts)} have sizes "
                f"{sizes} along dim {dim}, which do not split the model's shape {list(d.shape)}"
            )
    elif d.shape[dim] % num_parts:
        raise ValueError(
            f"parameter {d.name} of shape {list(d.shape)} does not split into {num_parts} equal parts "
            f"{list(d.parts)} along dim {dim} (what transformers' save_pretrained writes); pass "
            "reference= to give the part sizes"
        )
    else:
        sizes = [d.shape[dim] // num_parts] * num_parts
    keep = (ln > 0).all(axis=1)
    ranks, off, ln = ranks[keep], off[keep], ln[keep]
    start, length = off[:, dim], ln[:, dim]
    lo = 0
    for j, size in enumerate(sizes):
        a, b = np.maximum(start, lo), np.minimum(start + length, lo + size)
        has = a < b  # the rank's box meets part j
        p_off, p_len, delta = off[has].copy(), ln[has].copy(), -off[has]
        p_off[:, dim], p_len[:, dim] = a[has] - lo, (b - a)[has]
        delta[:, dim] += lo
        rows.add(len(heads), ranks[has], i, np.full(int(has.sum()), -1, np.int64), p_off, p_len, delta)
        heads.append((d.parts[j], d.shape[:dim] + (size,) + d.shape[dim + 1 :], DTYPE_NAMES[d.dtype], False, False))
        lo += size


def _fused_output(i, d: ParamDesc, phy2log: np.ndarray, num_logical: int, ranks, off, ln, heads, rows: _Rows) -> None:
    """The one checkpoint tensor ``[num_logical, *slice_shape]`` of an expert parameter written
    fused (as transformers writes gpt-oss, Llama 4, ...): row ``e`` from every slot holding
    logical expert ``e`` (copies are alternatives, as replicas of a dense tensor are)."""
    ref = d.expert
    q, local, e = _slots(phy2log, off, ln)
    box_off = np.concatenate([e[:, None], off[q, 1:]], axis=1)  # checkpoint row e <- local slot
    box_len = np.concatenate([np.ones((len(q), 1), np.int64), ln[q, 1:]], axis=1)
    delta = np.concatenate([(local - e)[:, None], -off[q, 1:]], axis=1)
    rows.add(len(heads), ranks[q], i, np.full(len(q), -1, np.int64), box_off, box_len, delta)
    (key,) = ref.param.keys(ref.module, 0)
    heads.append((key, (num_logical, *d.shape[1:]), DTYPE_NAMES[d.dtype], False, False))


def _merged_output(i, d: ParamDesc, phy2log: np.ndarray, num_logical: int, ranks, off, ln, heads, rows: _Rows) -> None:
    """The one checkpoint tensor ``[num_logical * n, *rest]`` of an expert parameter written fused
    with its expert dim merged into dim 0 (DBRX's w1 / v1 / w2): rows ``e*n ..`` from a slot
    holding logical expert ``e`` (each slot's box a segment of its own)."""
    ref = d.expert
    n = d.shape[1]
    q, local, e = _slots(phy2log, off, ln)
    box_off = off[q, 1:].copy()
    box_off[:, 0] += e * n
    # In the slot, the rank's box of the slice starts at 0: local = checkpoint offset - box_off.
    rows.add(len(heads), ranks[q], i, local, box_off, ln[q, 1:].copy(), -box_off)
    (key,) = ref.param.keys(ref.module, 0)
    heads.append((key, (num_logical * n, *d.shape[2:]), DTYPE_NAMES[d.dtype], False, False))


def _part_sizes(d: ParamDesc, slice_shape: tuple[int, ...], reference: CheckpointIndex | None) -> tuple[int, ...]:
    ref = d.expert
    dim, num_parts = ref.param.dim, len(ref.param.parts)
    if reference is not None:
        keys = ref.param.keys(ref.module, 0)
        if all(k in reference for k in keys):
            sizes = tuple(reference.info(k).shape[dim] if len(reference.info(k).shape) > dim else -1 for k in keys)
            if sum(sizes) != slice_shape[dim] or min(sizes) < 0:
                raise ValueError(
                    f"parameter {d.name}: the reference checkpoint's tensors {list(keys)} have sizes {list(sizes)} "
                    f"along dim {dim}, which do not split the model's expert slice of shape {list(slice_shape)}"
                )
            return sizes
    if slice_shape[dim] % num_parts:
        raise ValueError(
            f"parameter {d.name}: an expert slice of shape {list(slice_shape)} does not split into "
            f"{num_parts} equal parts along dim {dim}; pass reference= to give the part sizes"
        )
    return (slice_shape[dim] // num_parts,) * num_parts
