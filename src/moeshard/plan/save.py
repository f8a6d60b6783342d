"""The save planner: who writes which checkpoint tensor into which file, and who sends what.

Pure and deterministic (no communication, same answer on every rank, any world size), the
mirror image of a load plan:

* every checkpoint tensor to write (a non-expert parameter or persistent buffer under its
  checkpoint name; one part of one logical expert of a fused expert parameter) is described by
  its :class:`Segment` s: which rank holds which box of it, and where in its local tensor;
* every box is written once: the tensor's *writer* (a rank holding the most of it, balanced by
  bytes over the ranks, largest tensors first) writes the boxes it holds itself; each other box
  comes from one of its holders (the least-sending one) by P2P;
* each writer packs its tensors, in model order, into files of at most ``max_shard_bytes``
  (a tensor larger than that gets a file of its own), numbered ``model-00001-of-0000N`` with
  N known in advance;
* transfers are split into pieces of at most a quarter of the staging budget and packed into
  batches in which every rank posts at most ``max_ops`` P2P ops and stages at most
  ``staging_bytes``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .._gc import paused_gc
from ..box import Box, box_numel, split_box
from ..io.checkpoint import DTYPE_NAMES, DTYPES, CheckpointIndex
from ..models.adapters import expert_parts
from ..models.layout import ParamDesc, rank_boxes
from ..placement import Placement
from ..topology import Topology
from .schedule import PlanCost, Schedule

__all__ = ["Segment", "OutTensor", "SaveFile", "Transfer", "LocalWrite", "SaveCost", "SavePlan",
           "describe_outputs", "plan_save", "shard_name", "tensor_schedule"]

DEFAULT_MAX_OPS = 64


@dataclass(frozen=True)
class Segment:
    """Rank ``rank`` holds box ``box`` (coordinates of the checkpoint tensor) in the local tensor
    of parameter ``param`` (index into the descriptions) at ``lead + box shifted by delta``.

    ``lead`` is the leading local dims the checkpoint tensor lacks (an expert's slot,
    ``((local_slot, 1),)``) or ``()``; ``delta[d]`` = local offset - checkpoint offset in dim d.
    """

    rank: int
    param: int
    box: Box
    lead: Box = ()
    delta: tuple[int, ...] = ()

    def local_box(self, sub: Box) -> Box:
        """Local box of ``sub`` (a box inside :attr:`box`, checkpoint coordinates)."""
        return self.lead + tuple((o + d, n) for (o, n), d in zip(sub, self.delta))


@dataclass(frozen=True)
class OutTensor:
    """One checkpoint tensor: ``key``, ``shape``, ``dtype`` (safetensors name), ``nbytes``, its
    ``writer`` rank, its ``file`` (index into :attr:`SavePlan.files`) and ``offset`` in that
    file's data section; ``segments``: one holder for each box, the boxes tiling the tensor."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    writer: int
    file: int
    offset: int
    segments: tuple[Segment, ...]
    is_buffer: bool = False


@dataclass(frozen=True)
class SaveFile:
    """A shard file: its final ``name``, ``writer`` rank, tensors (indices, in data order)."""

    name: str
    writer: int
    tensors: tuple[int, ...]
    data_bytes: int


@dataclass(frozen=True)
class Transfer:
    """``src`` sends box ``box`` of tensor ``tensor`` (its segment ``segment``) to ``dst``."""

    src: int
    dst: int
    tensor: int
    segment: int
    box: Box
    nbytes: int


@dataclass(frozen=True)
class LocalWrite:
    """The writer writes box ``box`` of tensor ``tensor`` from its own segment ``segment``."""

    tensor: int
    segment: int
    box: Box
    nbytes: int


@dataclass(frozen=True)
class SaveCost:
    """Per-rank counters (``int64[world]``): bytes written to files, sent, received, staged at
    most in one batch; job-wide: P2P ops and batches."""

    write_bytes: np.ndarray
    sent_bytes: np.ndarray
    recv_bytes: np.ndarray
    peak_staging_bytes: np.ndarray
    num_p2p_ops: int
    num_batches: int

    def summary(self) -> dict:
        return {
            "write_bytes_total": int(self.write_bytes.sum()),
            "write_bytes_max_rank": int(self.write_bytes.max(initial=0)),
            "write_bytes_min_rank": int(self.write_bytes.min()) if self.write_bytes.size else 0,
            "sent_bytes_total": int(self.sent_bytes.sum()),
            "sent_bytes_max_rank": int(self.sent_bytes.max(initial=0)),
            "recv_bytes_max_rank": int(self.recv_bytes.max(initial=0)),
            "peak_staging_bytes_max_rank": int(self.peak_staging_bytes.max(initial=0)),
            "num_p2p_ops": self.num_p2p_ops,
            "num_batches": self.num_batches,
        }


@dataclass(frozen=True, eq=False)
class SavePlan:
    """Everything every rank does to save, in order. Identical on every rank.

    ``schedule`` is what the runner executes: its keys are the checkpoint tensors (key ``t`` =
    ``tensors[t]``), a piece is a transfer's or local write's box; batch ``k`` is round ``k``;
    sends read views of the holders' local tensors; a writer's own boxes are copies of round
    -1 (straight from its tensors to the file); deliveries (param = the tensor) go to the file.
    """

    world_size: int
    tensors: tuple[OutTensor, ...]
    files: tuple[SaveFile, ...]
    batches: tuple[tuple[Transfer, ...], ...]
    local_writes: tuple[tuple[LocalWrite, ...], ...]  # per rank
    cost: SaveCost
    staging_bytes: int
    fingerprint: str = ""
    schedule: Schedule | None = None

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def files_of(self, rank: int) -> list[int]:
        return [i for i, f in enumerate(self.files) if f.writer == rank]

    def weight_map(self) -> dict[str, str]:
        return {t.key: self.files[t.file].name for t in self.tensors}


def shard_name(i: int, num_files: int) -> str:
    """HF's shard file name, ``i`` counted from 0."""
    return f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"


# -- model descriptions -> checkpoint tensors and their holders -------------------------------


@dataclass
class _Out:
    key: str
    shape: tuple[int, ...]
    dtype: str
    segments: list[Segment]
    is_buffer: bool = False


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
) -> list[_Out]:
    """Checkpoint tensors of a model and every rank's boxes of them (pure).

    Args:
        descs: :func:`~moeshard.layout.describe_model` of the model.
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
        return _describe_outputs(descs, placement, world_size, reference, tied_targets, skip_keys, buffers,
                                 num_experts or {})


def _describe_outputs(descs, placement, world_size, reference, tied_targets, skip_keys, buffers,
                      num_experts) -> list[_Out]:
    outs: list[_Out] = []
    num_layers = 1 + max((d.expert.layer for d in descs if d.expert), default=-1)
    phy2log, num_logical = _expert_table(descs, placement, num_layers, reference, num_experts)
    for i, d in enumerate(descs):
        if d.dtype not in DTYPE_NAMES:
            raise ValueError(f"parameter {d.name}: dtype {d.dtype} cannot be stored in safetensors")
        per_rank = rank_boxes(d, world_size)
        if d.expert is None:
            key = _choose_key(d, reference, tied_targets)
            if key in skip_keys:
                continue
            if reference is not None and key in reference and tuple(reference.info(key).shape) != d.shape:
                raise ValueError(
                    f"parameter {d.name}: the reference checkpoint has {key!r} of shape "
                    f"{list(reference.info(key).shape)}, the model {list(d.shape)}"
                )
            segs = [Segment(r, i, box, (), tuple(-o for o, _ in box)) for r, box in per_rank
                    if all(n for _, n in box)]
            outs.append(_Out(key, d.shape, DTYPE_NAMES[d.dtype], segs, d.name in buffers))
        else:
            _expert_outputs(i, d, phy2log[d.expert.layer], num_logical, per_rank, reference, outs)
    seen: set[str] = set()
    for o in outs:
        if o.key in seen:
            raise ValueError(f"two tensors of the model would be written as {o.key!r}")
        seen.add(o.key)
    return outs


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
    num_physical = next(d.shape[0] for d in descs if d.expert)
    if placement is None:
        phy2log = np.tile(np.arange(num_physical), (num_layers, 1))
        num_logical = num_physical
    else:
        phy2log = np.asarray(placement.phy2log)
        if phy2log.ndim != 2 or phy2log.shape[0] != num_layers:
            raise ValueError(f"the model has {num_layers} MoE layers, the placement describes "
                             f"{phy2log.shape[0] if phy2log.ndim == 2 else '?'}")
        num_logical = int(getattr(placement, "num_logical", None) or (phy2log.max() + 1))
    for d in descs:
        if d.expert is not None and d.shape[0] != phy2log.shape[1]:
            raise ValueError(f"parameter {d.name} has {d.shape[0]} expert slots per layer, the placement has "
                             f"{phy2log.shape[1]} physical slots")
    for layer in range(num_layers):
        want = num_experts.get(layer, num_logical)
        if want < num_logical:
            raise ValueError(f"layer {layer}: the placement has {num_logical} logical experts, the model's "
                             f"experts module declares {want}")
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
                if shape != [num_logical, *d.shape[1:]]:
                    raise ValueError(
                        f"parameter {d.name}: the reference checkpoint's {key!r} (every expert fused on disk) has "
                        f"shape {shape}, the model's {num_logical} logical experts make {[num_logical, *d.shape[1:]]}")
            elif ref is not None and ref.param.keys(ref.module, num_logical)[0] in reference:
                raise ValueError(f"parameter {d.name}: the reference checkpoint has logical expert {num_logical}, "
                                 f"the model has {num_logical} logical experts")
    return phy2log, num_logical


def _expert_outputs(i, d: ParamDesc, phy2log: np.ndarray, num_logical: int, per_rank, reference, outs) -> None:
    ref = d.expert
    if ref.param.fused:
        outs.append(_fused_output(i, d, phy2log, num_logical, per_rank))
        return
    dim = ref.param.dim
    slice_shape = d.shape[1:]
    part_sizes = _part_sizes(d, slice_shape, reference)
    los = [sum(part_sizes[:j]) for j in range(len(part_sizes))]
    dtype = DTYPE_NAMES[d.dtype]
    part_shapes = [slice_shape[:dim] + (n,) + slice_shape[dim + 1:] for n in part_sizes]
    by_expert: list[list[_Out]] = []
    for e in range(num_logical):
        keys = ref.param.keys(ref.module, e)
        by_expert.append([_Out(k, part_shapes[j], dtype, []) for j, k in enumerate(keys)])
    for rank, box in per_rank:
        (s0, ns), rest = box[0], box[1:]
        if not ns or not all(n for _, n in rest):
            continue
        origin = [o for o, _ in rest]
        parts = []
        for j, part_box, _ in expert_parts(rest, part_sizes, dim):
            delta = tuple((los[j] if k == dim else 0) - origin[k] for k in range(len(rest)))
            parts.append((j, part_box, delta))
        for slot in range(s0, s0 + ns):
            e = int(phy2log[slot])
            if e < 0:
                continue
            lead = ((slot - s0, 1),)
            for j, part_box, delta in parts:
                by_expert[e][j].segments.append(Segment(rank, i, part_box, lead, delta))
    for row in by_expert:
        outs.extend(row)


def _fused_output(i, d: ParamDesc, phy2log: np.ndarray, num_logical: int, per_rank) -> _Out:
    """The one checkpoint tensor ``[num_logical, *slice_shape]`` of an expert parameter written
    fused (as transformers writes gpt-oss, Llama 4, ...): row ``e`` from every slot holding
    logical expert ``e`` (copies are alternatives, as replicas of a dense tensor are)."""
    ref = d.expert
    segments = []
    for rank, box in per_rank:
        (s0, ns), rest = box[0], box[1:]
        if not ns or not all(n for _, n in rest):
            continue
        origin = tuple(-o for o, _ in rest)
        for slot in range(s0, s0 + ns):
            e = int(phy2log[slot])
            if e >= 0:  # checkpoint row e <- local slot (slot - s0)
                segments.append(Segment(rank, i, ((e, 1),) + tuple(rest), (), (slot - s0 - e,) + origin))
    (key,) = ref.param.keys(ref.module, 0)
    return _Out(key, (num_logical, *d.shape[1:]), DTYPE_NAMES[d.dtype], segments)


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


# -- checkpoint tensors -> plan -------------------------------------------------------------------


def plan_save(
    outs: Sequence[_Out],
    world_size: int,
    max_shard_bytes: int,
    staging_bytes: int,
    max_ops: int = DEFAULT_MAX_OPS,
) -> SavePlan:
    """Writers, files and transfers for ``outs`` (:func:`describe_outputs`), pure.

    Raises:
        ValueError: a tensor whose holders' boxes leave a gap or overlap (not a grid of boxes),
            a tensor nobody holds, or limits below one element.
    """
    if max_shard_bytes < 1 or staging_bytes < 1 or max_ops < 2:
        raise ValueError(f"max_shard_bytes and staging_bytes must be >= 1 and max_ops >= 2, got "
                         f"{max_shard_bytes}, {staging_bytes}, {max_ops}")
    with paused_gc():
        return _plan_save(outs, world_size, max_shard_bytes, staging_bytes, max_ops)


def _plan_save(outs, world, max_shard_bytes, staging_bytes, max_ops) -> SavePlan:
    n = len(outs)
    itemsizes = [DTYPES[o.dtype].itemsize for o in outs]
    nbytes = [math.prod(o.shape) * s for o, s in zip(outs, itemsizes)]
    # 1. Distinct boxes of each tensor, their holders, and a check that the boxes tile it.
    boxes_of: list[dict[Box, list[Segment]]] = []
    box_bytes: dict[tuple[Box, int], int] = {}  # (box, itemsize) -> bytes; boxes repeat across tensors
    for t, o in enumerate(outs):
        by_box: dict[Box, list[Segment]] = {}
        for s in o.segments:
            segs = by_box.get(s.box)
            if segs is None:
                by_box[s.box] = [s]
                if (s.box, itemsizes[t]) not in box_bytes:
                    box_bytes[(s.box, itemsizes[t])] = box_numel(s.box) * itemsizes[t]
            else:
                segs.append(s)
        _check_tiling(o.key, o.shape, list(by_box), nbytes[t])
        boxes_of.append(by_box)
    # 2. Writers: largest tensors first, to the least-loaded rank among those holding the most of it.
    write_load = [0] * world
    sent_load = [0] * world
    writer = [0] * n
    for t in sorted(range(n), key=lambda t: (-nbytes[t], t)):
        held: dict[int, int] = {}
        for box, segs in boxes_of[t].items():
            size = box_bytes[(box, itemsizes[t])]
            for r in {s.rank for s in segs}:
                held[r] = held.get(r, 0) + size
        best = max(held.values(), default=0)
        cands = [r for r, b in held.items() if b == best] or range(world)  # an empty tensor: anyone
        w = min(cands, key=lambda r: (write_load[r], r))
        writer[t] = w
        write_load[w] += nbytes[t]
    # 3. One holder per box: the writer's own, else the holder that has sent least so far.
    chosen: list[list[Segment]] = []
    for t in range(n):
        segs_t = []
        for box in sorted(boxes_of[t]):
            segs = boxes_of[t][box]
            own = [s for s in segs if s.rank == writer[t]]
            if own:
                s = own[0]
            else:
                s = min(segs, key=lambda s: (sent_load[s.rank], s.rank))
                sent_load[s.rank] += box_bytes[(box, itemsizes[t])]
            segs_t.append(s)
        chosen.append(segs_t)
    # 4. Files: each writer's tensors in model order, at most max_shard_bytes each.
    per_writer: list[list[list[int]]] = [[] for _ in range(world)]
    filled = [0] * world
    position = [(0, 0)] * n  # (file number within its writer, place in the file)
    for t in range(n):
        files, w = per_writer[writer[t]], writer[t]
        if not files or (files[-1] and filled[w] + nbytes[t] > max_shard_bytes):
            files.append([])
            filled[w] = 0
        position[t] = (len(files) - 1, len(files[-1]))
        files[-1].append(t)
        filled[w] += nbytes[t]
    num_files = sum(len(f) for f in per_writer)
    files: list[SaveFile] = []
    file_of, offset_of = [0] * n, [0] * n
    for r in range(world):
        for members in per_writer[r]:
            pos = 0
            for t in members:
                file_of[t], offset_of[t] = len(files), pos
                pos += nbytes[t]
            files.append(SaveFile(shard_name(len(files), num_files), r, tuple(members), pos))
    tensors = tuple(
        OutTensor(o.key, tuple(o.shape), o.dtype, nbytes[t], writer[t], file_of[t], offset_of[t],
                  tuple(chosen[t]), o.is_buffer)
        for t, o in enumerate(outs)
    )
    # 5. Pieces: transfers (in rounds over the writers' files, so every writer is busy) and local writes.
    max_piece = max(1, staging_bytes // 4)
    local: list[list[LocalWrite]] = [[] for _ in range(world)]
    transfers: list[Transfer] = []
    order = sorted(range(n), key=lambda t: (position[t], writer[t]))
    for t in order:
        item = itemsizes[t]
        for si, s in enumerate(chosen[t]):
            size = box_bytes[(s.box, item)]
            subs = [s.box] if size <= max_piece else split_box(s.box, max(1, max_piece // item))
            for sub in subs:
                size = box_bytes[(s.box, item)] if len(subs) == 1 else box_numel(sub) * item
                if s.rank == writer[t]:
                    local[s.rank].append(LocalWrite(t, si, sub, size))
                else:
                    transfers.append(Transfer(s.rank, writer[t], t, si, sub, size))
    batches, sent, recv, peak = _pack(transfers, world, staging_bytes, max_ops)
    cost = SaveCost(np.asarray(write_load, dtype=np.int64), sent, recv, peak, len(transfers), len(batches))
    plan = SavePlan(world, tensors, tuple(files), batches, tuple(tuple(v) for v in local), cost, staging_bytes)
    object.__setattr__(plan, "fingerprint", _fingerprint(plan))
    object.__setattr__(plan, "schedule", _as_schedule(plan, max_ops))
    return plan


def tensor_schedule(
    keys: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    itemsizes: Sequence[int],
    segments: Sequence[Sequence[tuple[int, int, Box, Box]]],
    writers: Sequence[int],
    world_size: int,
    staging_bytes: int,
) -> Schedule:
    """Whole tensors to their writers, as a :class:`Schedule` (pure; LoRA adapters: a few
    small tensors in one file).

    Tensor ``i`` (``keys[i]``, ``shapes[i]``) is written by rank ``writers[i]`` from its
    ``segments[i]``: ``(holder rank, local tensor index, local box, tensor box)`` tiling it.
    A piece is one segment; a holder other than the writer sends it from its view, the
    writer's own are round -1 copies; deliveries (param = ``i``) carry the tensor box.
    Tensors are packed into rounds of at most ``staging_bytes`` (at least one tensor).
    """
    width = max((len(s) for s in shapes), default=1) or 1
    p_key, p_off, p_len, p_bytes = [], [], [], []
    v_rank, v_param, v_off = [], [], []
    sends, copies, dlv = [], [], []
    rnd, size = 0, 0
    for i, segs in enumerate(segments):
        n = math.prod(shapes[i]) * itemsizes[i]
        if size and size + n > staging_bytes:
            rnd, size = rnd + 1, 0
        size += n
        for holder, local, lbox, box in segs:
            pid = len(p_key)
            pad = [0] * (width - len(box))
            p_key.append(i)
            p_off.append([o for o, _ in box] + pad)
            p_len.append([m for _, m in box] + [1] * len(pad))
            p_bytes.append(box_numel(box) * itemsizes[i])
            v = len(v_rank)
            v_rank.append(holder)
            v_param.append(local)
            v_off.append([o for o, _ in lbox] + [0] * (width - len(lbox)))
            if holder == writers[i]:
                copies.append((v, pid))
            else:
                sends.append((holder, writers[i], pid, rnd, v))
            dlv.append((pid, writers[i], i))
    dlv.sort()
    i32, i64 = np.int32, np.int64
    sent = np.zeros(world_size, dtype=i64)
    recv = np.zeros(world_size, dtype=i64)
    held: dict[tuple[int, int], int] = {}  # (rank, round) -> bytes received in it
    for src, dst, pid, r, _ in sends:
        sent[src] += p_bytes[pid]
        recv[dst] += p_bytes[pid]
        held[(dst, r)] = held.get((dst, r), 0) + p_bytes[pid]
    peak = np.zeros(world_size, dtype=i64)
    for (dst, _), b in held.items():
        peak[dst] = max(peak[dst], b)
    off = np.asarray(p_off, i64).reshape(-1, width)
    return Schedule(
        topology=Topology(world_size, 1), staging_bytes=staging_bytes, max_ops=max(2, len(sends)),
        keys=tuple(keys), key_ndim=np.asarray([len(s) for s in shapes], np.int8),
        piece_key=np.asarray(p_key, i32), piece_off=off, piece_len=np.asarray(p_len, i64).reshape(-1, width),
        piece_bytes=np.asarray(p_bytes, i64),
        read_rank=np.zeros(0, i32), read_piece=np.zeros(0, i32), read_round=np.zeros(0, i64),
        send_src=np.asarray([x[0] for x in sends], i32), send_dst=np.asarray([x[1] for x in sends], i32),
        send_piece=np.asarray([x[2] for x in sends], i32), send_round=np.asarray([x[3] for x in sends], i64),
        send_view=np.asarray([x[4] for x in sends], i32),
        bcast_node=np.zeros(0, i32), bcast_root=np.zeros(0, i32), bcast_piece=np.zeros(0, i32),
        bcast_round=np.zeros(0, i64),
        dlv_piece=np.asarray([x[0] for x in dlv], i32), dlv_rank=np.asarray([x[1] for x in dlv], i32),
        dlv_param=np.asarray([x[2] for x in dlv], i32), dlv_slot=np.full(len(dlv), -1, i64),
        dlv_off=off[[x[0] for x in dlv]].reshape(-1, width), num_rounds=rnd + 1,
        cost=PlanCost(read_bytes=np.zeros(world_size, dtype=i64), sent_bytes=sent, recv_bytes=recv,
                      peak_staging_bytes=peak, cross_node_bytes=0, num_p2p_ops=len(sends),
                      num_batches=rnd + 1, num_broadcasts=0),
        view_rank=np.asarray(v_rank, i32), view_param=np.asarray(v_param, i32),
        view_slot=np.full(len(v_rank), -1, i64), view_off=np.asarray(v_off, i64).reshape(-1, width),
        copy_view=np.asarray([x[0] for x in copies], i32), copy_piece=np.asarray([x[1] for x in copies], i32),
        copy_round=np.full(len(copies), -1, i64),
    )


def _as_schedule(plan: SavePlan, max_ops: int) -> Schedule:
    """The plan as a :class:`Schedule` (see :class:`SavePlan` for its conventions)."""
    width = max((len(t.shape) for t in plan.tensors), default=1) or 1  # a column even for scalars
    p_key, p_off, p_len, p_bytes = [], [], [], []
    v_rank, v_param, v_slot, v_off = [], [], [], []
    sends, copies, dlv = [], [], []

    def piece(tensor: int, box: Box, nbytes: int) -> int:
        pad = width - len(box)
        p_key.append(tensor)
        p_off.append([o for o, _ in box] + [0] * pad)
        p_len.append([n for _, n in box] + [1] * pad)
        p_bytes.append(nbytes)
        return len(p_key) - 1

    def view(tensor: int, segment: int, box: Box) -> int:
        seg = plan.tensors[tensor].segments[segment]
        v_rank.append(seg.rank)
        v_param.append(seg.param)
        v_slot.append(seg.lead[0][0] if seg.lead else -1)
        delta = seg.delta + (0,) * (len(box) - len(seg.delta))
        v_off.append([o + d for (o, _), d in zip(box, delta)] + [0] * (width - len(box)))
        return len(v_rank) - 1

    for k, batch in enumerate(plan.batches):
        for x in batch:
            pid = piece(x.tensor, x.box, x.nbytes)
            sends.append((x.src, x.dst, pid, k, view(x.tensor, x.segment, x.box)))
            dlv.append((pid, x.dst, x.tensor))
    for rank, writes in enumerate(plan.local_writes):
        for w in writes:
            pid = piece(w.tensor, w.box, w.nbytes)
            copies.append((view(w.tensor, w.segment, w.box), pid))
            dlv.append((pid, rank, w.tensor))
    dlv.sort()
    i32, i64 = np.int32, np.int64
    c = plan.cost
    zeros = np.zeros(plan.world_size, dtype=i64)
    return Schedule(
        topology=Topology(plan.world_size, 1), staging_bytes=plan.staging_bytes, max_ops=max_ops,
        keys=tuple(t.key for t in plan.tensors), key_ndim=np.asarray([len(t.shape) for t in plan.tensors], np.int8),
        piece_key=np.asarray(p_key, i32), piece_off=np.asarray(p_off, i64).reshape(-1, width),
        piece_len=np.asarray(p_len, i64).reshape(-1, width), piece_bytes=np.asarray(p_bytes, i64),
        read_rank=np.zeros(0, i32), read_piece=np.zeros(0, i32), read_round=np.zeros(0, i64),
        send_src=np.asarray([x[0] for x in sends], i32), send_dst=np.asarray([x[1] for x in sends], i32),
        send_piece=np.asarray([x[2] for x in sends], i32), send_round=np.asarray([x[3] for x in sends], i64),
        send_view=np.asarray([x[4] for x in sends], i32),
        bcast_node=np.zeros(0, i32), bcast_root=np.zeros(0, i32), bcast_piece=np.zeros(0, i32),
        bcast_round=np.zeros(0, i64),
        dlv_piece=np.asarray([x[0] for x in dlv], i32), dlv_rank=np.asarray([x[1] for x in dlv], i32),
        dlv_param=np.asarray([x[2] for x in dlv], i32), dlv_slot=np.full(len(dlv), -1, i64),
        dlv_off=np.asarray(p_off, i64).reshape(-1, width)[[x[0] for x in dlv]].reshape(-1, width),
        num_rounds=len(plan.batches),
        cost=PlanCost(read_bytes=zeros, sent_bytes=c.sent_bytes, recv_bytes=c.recv_bytes,
                      peak_staging_bytes=c.peak_staging_bytes, cross_node_bytes=0, num_p2p_ops=c.num_p2p_ops,
                      num_batches=c.num_batches, num_broadcasts=0),
        view_rank=np.asarray(v_rank, i32), view_param=np.asarray(v_param, i32), view_slot=np.asarray(v_slot, i64),
        view_off=np.asarray(v_off, i64).reshape(-1, width),
        copy_view=np.asarray([x[0] for x in copies], i32), copy_piece=np.asarray([x[1] for x in copies], i32),
        copy_round=np.full(len(copies), -1, i64),
    )


def _check_tiling(key: str, shape: tuple[int, ...], boxes: list[Box], nbytes: int) -> None:
    """Raise ValueError unless ``boxes`` (distinct, non-empty) are a grid that tiles ``shape``."""
    if not nbytes:
        return
    if not boxes:
        raise ValueError(f"tensor {key!r}: no rank holds any of it")
    per_dim = [sorted({b[d] for b in boxes}) for d in range(len(shape))]
    for d, intervals in enumerate(per_dim):
        pos = 0
        for off, length in intervals:
            if off != pos:
                what = "a gap" if off > pos else "overlapping boxes"
                raise ValueError(f"tensor {key!r}: the ranks' boxes leave {what} at offset {pos} of dim {d} "
                                 f"(shape {list(shape)}); cannot write every element exactly once")
            pos = off + length
        if pos != shape[d]:
            raise ValueError(f"tensor {key!r}: no rank holds offsets {pos}.. of dim {d} (shape {list(shape)})")
    if len(boxes) != math.prod(len(v) for v in per_dim):
        raise ValueError(f"tensor {key!r}: the ranks' boxes are not a grid over shape {list(shape)}")


def _pack(transfers: list[Transfer], world: int, budget: int, max_ops: int):
    sent = np.zeros(world, dtype=np.int64)
    recv = np.zeros(world, dtype=np.int64)
    peak = np.zeros(world, dtype=np.int64)
    batches: list[tuple[Transfer, ...]] = []
    cur: list[Transfer] = []
    stage: dict[int, int] = {}
    ops: dict[int, int] = {}

    def flush():
        if cur:
            batches.append(tuple(cur))
            for r, v in stage.items():
                peak[r] = max(peak[r], v)
            cur.clear()
            stage.clear()
            ops.clear()

    for x in transfers:
        if cur and any(stage.get(r, 0) + x.nbytes > budget or ops.get(r, 0) + 1 > max_ops for r in (x.src, x.dst)):
            flush()
        cur.append(x)
        for r in (x.src, x.dst):
            stage[r] = stage.get(r, 0) + x.nbytes
            ops[r] = ops.get(r, 0) + 1
        sent[x.src] += x.nbytes
        recv[x.dst] += x.nbytes
    flush()
    return tuple(batches), sent, recv, peak


def _fingerprint(plan: SavePlan) -> str:
    """A digest of what the plan makes ranks do, from plain tuples (their repr is C code; the
    dataclasses' generated reprs are Python)."""
    h = hashlib.sha256()
    h.update(repr((plan.world_size, plan.staging_bytes)).encode())
    h.update(repr([(t.key, t.shape, t.dtype, t.writer, t.file, t.offset) for t in plan.tensors]).encode())
    h.update(repr([[(w.tensor, w.segment, w.box) for w in ws] for ws in plan.local_writes]).encode())
    h.update(repr([(f.name, f.writer, f.tensors) for f in plan.files]).encode())
    h.update(repr([[(x.src, x.dst, x.tensor, x.segment, x.box) for x in b] for b in plan.batches]).encode())
    return h.hexdigest()[:16]
