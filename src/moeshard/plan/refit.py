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
units; :func:`plan_refit` plans one rank's transfers from the trainer's live shards
(:mod:`moeshard.plan.pairs`: a box an engine rank holds itself is copied, else sent once by one
holder), and :func:`check_pairs` checks that the ranks' plans fit together.

Pure and torch-free.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..topology import Topology
from .pairs import pair_rounds, plan_transfers_of, rank_schedule
from .reshard import BoxRows, ReshardPlan, StorageCells

__all__ = [
    "QUANTS",
    "SCALE_FMTS",
    "SCALE_DTYPES",
    "Segment",
    "EngineTensor",
    "EngineLayout",
    "UnitInfo",
    "EngineNeeds",
    "check_blocks",
    "engine_needs",
    "wire_dtypes",
    "plan_refit",
    "check_pairs",
]

# The quantizations an engine tensor may declare (None: none).
QUANTS = (None, "fp8_block")
# A block-FP8 tensor's scale: None, each block's amax / 448; "ue8m0", that rounded up to a
# power of two (DeepSeek-V3.1's ``"scale_fmt": "ue8m0"``, DeepGEMM on Blackwell).
SCALE_FMTS = (None, "ue8m0")
# The dtype names a block-FP8 tensor's scale may be held in ("float8_e8m0fnu": UE8M0 scales as
# exponent bytes).
SCALE_DTYPES = ("float32", "float8_e8m0fnu")


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
        dtype: the engine's dtype name (``"bfloat16"``); None: the source's. For a quantized
            tensor, the dtype its boxes travel and are staged in before quantization.
        quant: None, or ``"fp8_block"``: block FP8 as vLLM's and sglang's ``Fp8LinearMethod`` /
            ``Fp8MoEMethod`` with ``weight_block_size`` hold it (DeepSeek-V3's checkpoint
            format): the engine tensor is ``float8_e4m3fn`` of the local shape, and the tensor
            ``scale_name`` float32 ``[ceil(R / block[0]), ceil(C / block[1])]`` (an expert
            tensor: ``[num_local_slots, ...]`` of those) holds each block's dequantization
            multiplier (``weight = fp8 * scale``). The float tensor is assembled whole on the
            engine rank, then quantized per block (``amax / 448``, :mod:`moeshard.ops.engine_quant`).
            Its slice must be 2-D ``[R, C]`` and each segment's TP part must cover whole blocks
            (:func:`check_blocks`).
        block: the quantization block ``(rows, cols)``.
        scale_name: the engine's name of the scale tensor (default: ``name + "_scale_inv"``,
            vLLM's and sglang's load-time names: ``...weight_scale_inv``, ``w13_weight_scale_inv``).
        scale_fmt: None (each block's scale ``amax / 448``) or ``"ue8m0"``: that rounded up to a
            power of two (``2 ** ceil(log2(amax / 448))``, vLLM's and sglang's
            ``per_block_cast_to_fp8`` with ``use_ue8m0``: DeepSeek-V3.1's ``"scale_fmt":
            "ue8m0"``, DeepGEMM's scales on Blackwell).
        scale_dtype: the scale tensor's dtype name: ``"float32"``, or ``"float8_e8m0fnu"`` (one
            exponent byte per block; ``scale_fmt="ue8m0"`` only).
        shared: for an expert tensor, the segments of a dense expert held as one more local
            slot after the placement's (sglang's fused shared expert: DeepSeek-V3's
            ``shared_experts`` as the last slot of ``w13_weight`` / ``w2_weight`` on every engine
            rank); each the shape of the matching expert segment, split over TP as the expert
            slots are. Empty: none. The placement must then hold each of the trainer's experts
            once (sglang finds the fused slot only without redundant slots); another raises
            ValueError.
    """

    name: str
    segments: tuple[Segment, ...]
    cat_dim: int = 0
    shard_dim: int | None = None
    moe_layer: int = -1
    pad_to: int = 1
    group: int = -1
    dtype: str | None = None
    quant: str | None = None
    block: tuple[int, int] = (128, 128)
    scale_name: str = ""
    scale_fmt: str | None = None
    scale_dtype: str = "float32"
    shared: tuple[Segment, ...] = ()

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError(f"engine tensor {self.name} has no segments")
        if self.shared and (self.moe_layer < 0 or len(self.shared) != len(self.segments)):
            raise ValueError(
                f"engine tensor {self.name}: a shared expert slot is for an expert tensor, one segment per segment "
                f"({len(self.segments)})"
            )
        if self.pad_to < 1:
            raise ValueError(f"engine tensor {self.name}: pad_to must be >= 1, got {self.pad_to}")
        if self.pad_to > 1 and len(self.segments) != 1:
            raise ValueError(f"engine tensor {self.name}: pad_to applies to a tensor of one segment")
        if self.quant not in QUANTS:
            raise ValueError(
                f"engine tensor {self.name}: quant {self.quant!r} is not one of {sorted(QUANTS[1:])} or None"
            )
        if self.quant is None:
            if self.scale_fmt is not None or self.scale_dtype != "float32":
                raise ValueError(f"engine tensor {self.name}: a scale format without quant")
            return
        if self.scale_fmt not in SCALE_FMTS:
            raise ValueError(f"engine tensor {self.name}: scale_fmt {self.scale_fmt!r} is not None or 'ue8m0'")
        if self.scale_dtype not in SCALE_DTYPES or (self.scale_dtype != "float32" and self.scale_fmt != "ue8m0"):
            raise ValueError(
                f"engine tensor {self.name}: scale_dtype {self.scale_dtype!r} is not one of {list(SCALE_DTYPES)} "
                "('float8_e8m0fnu' holds UE8M0 scales: scale_fmt='ue8m0')"
            )
        if len(self.block) != 2 or min(self.block) < 1:
            raise ValueError(f"engine tensor {self.name}: block {self.block} is not (rows, cols) >= 1")
        if self.pad_to > 1:
            raise ValueError(f"engine tensor {self.name}: a padded (vocabulary) tensor is not quantized")
        if not self.scale_name:
            object.__setattr__(self, "scale_name", self.name + "_scale_inv")


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
            allowed, but not with a fused shared expert, :attr:`EngineTensor.shared`: sglang
            loads that only without redundant slots), taken from the engine; None without
            expert tensors.
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
            fused = [t.name for t in self.tensors if t.shared]
            if fused:
                _check_no_redundant_slots(fused[0], p2l)

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


# Why a fused shared expert admits no redundant slot, in sglang's code: DeepseekV2WeightLoaderMixin.
# do_load_weights (python/sglang/srt/models/deepseek_common/deepseek_weight_loader.py) loads
# mlp.shared_experts as expert n_routed_experts; FusedMoE.weight_loader and
# _map_global_expert_id_to_local_expert_id (python/sglang/srt/layers/moe/fused_moe_triton/layer.py)
# take an id for the shared expert, and put it in the slot after the rank's routed ones, only from
# _num_global_routed = n_routed_experts + ep_num_redundant_experts up. Below that the id is looked
# up as a routed expert (ExpertLocationMetadata.logical_to_all_physical, over n_routed_experts
# logical experts: python/sglang/srt/eplb/expert_location.py), so with redundant slots no slot
# holds the shared expert, and sglang's fusion decision
# (DeepseekV2ForCausalLM.determine_num_fused_shared_experts) does not look at redundant slots.
_SGLANG_FUSED_RULE = (
    "sglang's fused shared expert is loaded as expert n_routed_experts, which FusedMoE.weight_loader "
    "takes for the shared expert only without redundant slots (from _num_global_routed = n_routed_experts "
    "+ ep_num_redundant_experts up): run sglang without --ep-num-redundant-experts, or with "
    "--disable-shared-experts-fusion (fuse_shared_experts=False)"
)


def _check_no_redundant_slots(name: str, p2l: np.ndarray) -> None:
    """Raise ValueError (naming engine tensor ``name``) if a row of ``p2l`` places an expert
    twice: a placement that covers every expert has redundant slots exactly then."""
    s = np.sort(p2l, axis=1)
    twice = np.argwhere(s[:, 1:] == s[:, :-1])
    if len(twice):
        row, col = (int(v) for v in twice[0])
        raise ValueError(
            f"engine tensor {name} holds a fused shared expert but phy2log row {row} places expert "
            f"{int(s[row, col])} more than once (a redundant slot): {_SGLANG_FUSED_RULE}"
        )


@dataclass(frozen=True)
class UnitInfo:
    """The trainer's logical tensors, as the planner needs them: per name its shape (an expert
    parameter's: one expert's slice), dtype name, and whether it is an expert parameter
    (``num_logical`` experts, units ``"<name>[<expert>]"``)."""

    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, str]
    experts: frozenset[str]
    num_logical: int

    def unit_base(self) -> dict[str, int]:
        """``{name: id}`` of the units in their one numbering (every rank's alike): the
        tensors in ``shapes`` order, a dense one one unit, an expert parameter
        ``num_logical`` units (expert ``e``: ``id + e``)."""
        out, at = {}, 0
        for name in self.shapes:
            out[name] = at
            at += self.num_logical if name in self.experts else 1
        return out

    def unit_keys(self) -> tuple[str, ...]:
        """The units' keys in id order (``"<parameter>[<expert>]"`` for an expert's)."""
        keys: list[str] = []
        for name in self.shapes:
            if name in self.experts:
                keys.extend(f"{name}[{e}]" for e in range(self.num_logical))
            else:
                keys.append(name)
        return tuple(keys)

    def unit_columns(self) -> tuple[np.ndarray, list[str]]:
        """``(ndim int64[U], dtype name of each unit)`` in id order."""
        ndim, dtypes = [], []
        for name, shape in self.shapes.items():
            n = self.num_logical if name in self.experts else 1
            ndim += [len(shape)] * n
            dtypes += [self.dtypes[name]] * n
        return np.asarray(ndim, np.int64), dtypes


@dataclass(frozen=True)
class EngineNeeds:
    """The need rows of an engine layout (``N`` rows, ``D`` padded dims; :class:`BoxRows` over
    unit ids (:meth:`UnitInfo.unit_base`), ``param`` = the engine tensor's index in
    ``layout.tensors``, ``slot`` its local slot or -1), the unit keys in id order, and every
    engine tensor's local shape and dtype."""

    rows: BoxRows
    keys: tuple[str, ...]
    local_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]


def _seg_shape(t: EngineTensor, s: Segment, info: UnitInfo, shared: bool = False) -> tuple[int, ...]:
    """A segment's shape in its unit (``shared``: a segment of ``t.shared``, of a dense tensor)."""
    shape = info.shapes.get(s.source)
    if shape is None:
        raise ValueError(f"engine tensor {t.name}: the trainer has no tensor {s.source}")
    if shared and s.source in info.experts:
        raise ValueError(f"engine tensor {t.name}: its shared expert segment {s.source} is an expert parameter")
    if not shared and (t.moe_layer >= 0) != (s.source in info.experts):
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


def check_blocks(layout: EngineLayout, info: UnitInfo) -> None:
    """Raise ValueError naming the tensor for a block-quantized engine tensor whose blocks would
    straddle two segments or two TP ranks: its slice must be 2-D, every segment but the last must
    cover whole blocks along ``cat_dim``, and where a dim is split over TP (``tp > 1``) every
    segment's part on a rank must cover whole blocks along it (vLLM's
    ``validate_fp8_block_shape`` and ``Fp8MoEMethod``: a TP shard of a column- or row-parallel
    weight, and each part of a merged one, is a whole number of blocks). Pure."""
    for t in layout.tensors:
        if t.quant is None:
            continue
        split = t.shard_dim is not None and (t.moe_layer < 0 or layout.ep == 1) and layout.tp > 1
        segs = [_seg_shape(t, s, info) for s in t.segments]
        if len(segs[0]) != 2:
            raise ValueError(f"engine tensor {t.name}: block quantization needs a 2-D slice, got {list(segs[0])}")
        for d, b in enumerate(t.block):
            for i, (s, sh) in enumerate(zip(t.segments, segs)):
                n = sh[d] // layout.tp if split and d == t.shard_dim else sh[d]
                last_of_cat = d == t.cat_dim and i == len(segs) - 1
                needs_whole = (split and d == t.shard_dim) or (d == t.cat_dim and not last_of_cat)
                if needs_whole and n % b:
                    where = f"its part on each of tp={layout.tp} ranks" if split and d == t.shard_dim else "it"
                    raise ValueError(
                        f"engine tensor {t.name}: segment {s.source} has {n} along dim {d} ({where}), not whole "
                        f"blocks of {b}: a quantization block would straddle two "
                        f"{'TP ranks' if split and d == t.shard_dim else 'segments'}"
                    )


@dataclass(frozen=True)
class _Template:
    """The need rows of one engine tensor up to its units (``m`` rows): the segment of each
    (``t.segments`` then ``t.shared``), the engine index (position in ``layout.ranks``), the
    local slot and physical slot (-1: a dense tensor, or the shared expert's slot), the box in
    the unit and where it lands (``int64[m, width]``, padded), and the tensor's local shape.
    Engine tensors alike but for their sources share one."""

    seg: np.ndarray
    eng: np.ndarray
    slot: np.ndarray
    phys: np.ndarray
    off: np.ndarray
    len: np.ndarray
    local: np.ndarray
    shape: tuple[int, ...]


def _template(t: EngineTensor, segs: list, layout: EngineLayout, num_slots: int, width: int) -> _Template:
    """The :class:`_Template` of engine tensor ``t`` (segment shapes ``segs``, those of
    ``t.shared`` alike; ``num_slots``: the slots of its placement row). Raises ValueError naming
    ``t`` for a split that is not even."""
    i64 = np.int64
    nd = len(segs[0])
    n_eng = len(layout.ranks)
    tp_rank = np.arange(n_eng, dtype=i64) % layout.tp
    spr = layout.slots_per_rank
    split = t.shard_dim is not None and (t.moe_layer < 0 or layout.ep == 1)
    tp = layout.tp if split else 1
    local = list(segs[0])
    local[t.cat_dim] = 0
    cat_at = 0
    if t.moe_layer < 0:
        er = np.arange(n_eng, dtype=i64)
        slot = phys = np.full(n_eng, -1, i64)
    elif layout.ep == 1:  # every slot, on every rank
        er = np.repeat(np.arange(n_eng, dtype=i64), num_slots)
        slot = phys = np.tile(np.arange(num_slots, dtype=i64), n_eng)
    else:  # its own slots
        er = np.repeat(np.arange(n_eng, dtype=i64), spr)
        slot = np.tile(np.arange(spr, dtype=i64), n_eng)
        phys = er * spr + slot
    lead = [num_slots if layout.ep == 1 else spr] if t.moe_layer >= 0 else []
    # Each segment on the engine ranks and slots of the placement, then each shared expert
    # segment in the slot after them on every engine rank (its offsets in the slot restart).
    todo = [(k, s, sh, er, slot, phys) for k, (s, sh) in enumerate(zip(t.segments, segs))]
    if t.shared:
        every = np.arange(n_eng, dtype=i64)
        last, none = np.full(n_eng, lead[0], i64), np.full(n_eng, -1, i64)
        todo += [(len(segs) + k, s, segs[k], every, last, none) for k, s in enumerate(t.shared)]
    parts = []
    for k, s, sh, er, slot, phys in todo:
        if k == len(segs):
            cat_at = 0
        # The box of the segment in its unit (one row per TP rank), and its length here.
        n = sh[t.shard_dim] if split else 0
        padded = -(-n // t.pad_to) * t.pad_to
        per = -(-padded // tp) if split else 0
        if split and t.pad_to == 1 and n % tp:
            raise ValueError(
                f"engine tensor {t.name}: segment {s.source} dim {t.shard_dim} ({n}) splits unevenly over tp={tp}"
            )
        base_off = np.zeros((n_eng, width), i64)
        base_len = np.ones((n_eng, width), i64)
        base_len[:, :nd] = sh
        base_off[:, s.part_dim] = s.part[0] * sh[s.part_dim]
        if split:
            d = t.shard_dim
            lo = np.minimum(tp_rank * per, n)
            base_off[:, d] += lo
            base_len[:, d] = np.minimum(lo + per, n) - lo
        seg_len = per if split and t.shard_dim == t.cat_dim else sh[t.cat_dim]
        if split and t.shard_dim != t.cat_dim:
            local[t.shard_dim] = per
        dst = np.zeros((n_eng, width), i64)
        dst[:, t.cat_dim] = cat_at
        cat_at += seg_len
        if k < len(segs):
            local[t.cat_dim] = cat_at
        keep = (base_len[er] > 0).all(axis=1)
        e = er[keep]
        parts.append((np.full(len(e), k, i64), e, slot[keep], phys[keep], base_off[e], base_len[e], dst[e]))
    if t.shared:
        lead[0] += 1
    cols = [np.concatenate([p[c] for p in parts]) for c in range(7)]
    return _Template(*cols, tuple(lead + local))


def engine_needs(layout: EngineLayout, info: UnitInfo, width: int) -> EngineNeeds:
    """Every engine rank's need rows (pure): per engine tensor, rank, local slot and segment, the
    box of the logical unit it holds and where it lands in the local tensor. ``width``: padded
    dims (at least every unit's). Raises ValueError naming the tensor for a segment the trainer
    lacks, shapes that do not concatenate, or a split that is not even."""
    i64 = np.int64
    ids = info.unit_base()
    eng_ranks = np.asarray(layout.ranks, i64)
    p2l = None if layout.phy2log is None else np.asarray(layout.phy2log, i64)
    num_slots = 0 if p2l is None else p2l.shape[1]
    made: dict[tuple, _Template] = {}
    cols: list[tuple[np.ndarray, ...]] = []
    shapes, dtypes = [], []
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
        for s, sh in zip(t.shared, segs):
            if _seg_shape(t, s, info, shared=True) != sh:
                raise ValueError(
                    f"engine tensor {t.name}: shared expert segment {s.source} "
                    f"{list(_seg_shape(t, s, info, shared=True))} is not the shape of an expert's {list(sh)}"
                )
        if t.shared and num_slots != info.num_logical:
            raise ValueError(
                f"engine tensor {t.name}: a fused shared expert needs a placement of the {info.num_logical} "
                f"experts, one slot each; phy2log has {num_slots} slots: {_SGLANG_FUSED_RULE}"
            )
        dtypes.append(t.dtype or info.dtypes[t.segments[0].source])
        key = (
            tuple(segs),
            tuple((s.part, s.part_dim) for s in t.segments),
            t.cat_dim,
            t.shard_dim,
            t.pad_to,
            t.moe_layer >= 0,
            tuple((s.part, s.part_dim) for s in t.shared),
        )
        tm = made.get(key)
        if tm is None:
            tm = made[key] = _template(t, segs, layout, num_slots, width)
        shapes.append(tm.shape)
        base = np.asarray([ids[s.source] for s in t.segments + t.shared], i64)[tm.seg]
        if t.moe_layer >= 0:
            routed = tm.phys >= 0  # the shared expert's slot follows no placement
            e = p2l[t.moe_layer][tm.phys[routed]]
            if (e < 0).any() or (e >= info.num_logical).any():
                raise ValueError(
                    f"engine tensor {t.name}: its placement row {t.moe_layer} names experts outside "
                    f"0..{info.num_logical - 1}"
                )
            base[routed] += e
        cols.append((base, tm.eng, np.full(len(base), j, i64), tm.slot, tm.off, tm.len, tm.local))

    def col(i: int, empty) -> np.ndarray:
        return np.concatenate([c[i] for c in cols]) if cols else empty

    z, zz = np.zeros(0, i64), np.zeros((0, width), i64)
    rows = BoxRows(col(0, z), eng_ranks[col(1, z)], col(2, z), col(3, z), col(4, zz), col(5, zz), col(6, zz))
    check_blocks(layout, info)
    return EngineNeeds(rows, info.unit_keys(), tuple(shapes), tuple(dtypes))


@dataclass(frozen=True, eq=False)
class RefitPlan:
    """One rank's refit plan, per install group (:func:`plan_refit`).

    Args:
        groups: the install groups in order (-1 first, then ascending).
        plans: a :class:`~moeshard.plan.reshard.ReshardPlan` per install batch, run one after
            another: its ``schedule`` holds only the rows this rank takes part in.
        batches: per plan, the install groups it fills (consecutive in ``groups``; as many as
            fit together in the staging budget: :func:`install_batches`). A batch is
            installed whole, after every rank has all of it.
        needs: the layout's :class:`EngineNeeds` (the engine tensors' local shapes and dtypes;
            ``rows``: the need rows this rank planned from).
        wire_dtypes: per unit, the dtype name its pieces travel in: the engine tensor's where it
            is no wider than the trainer's (a cast before sending), else the trainer's.
        rank: the rank planned for.
        sent_bytes, copy_bytes: bytes this rank sends to other ranks and copies within itself
            (in the wire dtypes; summed over the ranks: the job's).
        check: this rank's term of the pair check (:class:`~moeshard.plan.pairs.RankPart`):
            the ranks' terms sum to 0 mod 2**64 when the two ends of every transfer planned it
            alike.
        send_params: per batch, ``int64[S]`` the receiver's engine tensor of each send row of
            its schedule (-1: a row this rank receives).
        fingerprint: a digest of the inputs every rank plans from alike (the layouts, the
            trainer's holdings, the topology and budgets, the engine tensors' local shapes).
    """

    groups: tuple[int, ...]
    plans: tuple[ReshardPlan, ...]
    needs: EngineNeeds
    wire_dtypes: tuple[str, ...]
    rank: int
    sent_bytes: int
    copy_bytes: int
    check: int
    send_params: tuple[np.ndarray, ...] = ()
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


def _check_inside(layout: EngineLayout, needs: EngineNeeds, rank: int) -> None:
    """Invariant of :func:`engine_needs`: every need row of ``rank`` lies inside its engine
    tensor's local shape (its slot's, for an expert tensor)."""
    mine = np.flatnonzero(needs.rows.rank == rank)
    rows = BoxRows(
        *(
            a[mine]
            for a in (
                needs.rows.unit,
                needs.rows.rank,
                needs.rows.param,
                needs.rows.slot,
                needs.rows.off,
                needs.rows.len,
                needs.rows.local,
            )
        )
    )
    width = rows.off.shape[1]
    inner = np.full((len(needs.local_shapes), width), np.iinfo(np.int64).max, np.int64)
    for j, shape in enumerate(needs.local_shapes):
        sub = shape[1:] if layout.tensors[j].moe_layer >= 0 else shape
        inner[j, : len(sub)] = sub
    bad = (rows.local < 0).any(axis=1) | (rows.local + rows.len > inner[rows.param]).any(axis=1)
    assert not bad.any(), f"engine tensor {layout.tensors[int(rows.param[bad][0])].name}: a need row outside its shape"


def wire_dtypes(layout: EngineLayout, info: UnitInfo, itemsize: Mapping[str, int]) -> list[str]:
    """Per unit (id order), the dtype it travels in: the one engine dtype its tensors take where
    it is no wider than the trainer's, else the trainer's."""
    base = info.unit_base()
    want: dict[str, set[str]] = {}
    for t in layout.tensors:
        for sg in t.segments + t.shared:
            want.setdefault(sg.source, set()).add(t.dtype or info.dtypes[sg.source])
    out: list[str] = []
    for name in base:
        have = info.dtypes[name]
        w = want.get(name, set())
        d = next(iter(w)) if len(w) == 1 and itemsize[next(iter(w))] <= itemsize[have] else have
        out += [d] * (info.num_logical if name in info.experts else 1)
    return out


def plan_refit(
    layout: EngineLayout,
    info: UnitInfo,
    holds: BoxRows,
    itemsize: Mapping[str, int],
    topology: Topology,
    staging_bytes: int,
    max_ops: int,
    rank: int,
    holds_digest: str | None = None,
) -> RefitPlan:
    """Plan rank ``rank``'s part of a refit (pure, deterministic; :mod:`moeshard.plan.pairs`):
    the transfers it sends, receives or copies, per install group, from its own need rows,
    the holdings of the units it needs, and the other engine ranks' needs of the units it
    holds. Every rank calls it with the same arguments but ``rank``.

    Args:
        layout: the engine's tensors (its ranks are ``topology``'s).
        info: the trainer's logical tensors.
        holds: the trainer ranks' live holdings over the units of ``info`` (ids:
            :meth:`UnitInfo.unit_base`; ``param`` indexes each trainer rank's local tensors);
            rows of units this rank neither needs nor holds are not read.
        itemsize: bytes per element of every dtype name involved.
        topology: the refit group's ranks and nodes.
        staging_bytes, max_ops: as :func:`~moeshard.plan.reshard.plan_reshard`'s.
        rank: the rank to plan for.
        holds_digest: a digest of what ``holds`` was computed from (the trainer's layout and
            ranks), for the fingerprint; None: the fingerprint hashes ``holds`` itself.

    Raises ValueError for a layout the trainer's tensors do not fit, for a box of this rank's
    needs no trainer rank holds, or for budgets below 1 byte or 2 ops."""
    if staging_bytes < 1 or max_ops < 2:
        raise ValueError(f"staging_bytes must be >= 1 and max_ops >= 2, got {staging_bytes}, {max_ops}")
    width = holds.off.shape[1]
    needs = engine_needs(layout, info, width)
    _check_inside(layout, needs, rank)
    rows = needs.rows
    wire = wire_dtypes(layout, info, itemsize)
    ndim, _ = info.unit_columns()
    wire_size = np.asarray([itemsize[d] for d in wire], np.int64)
    world = topology.world_size
    node = np.asarray([topology.node_of(r) for r in range(world)], np.int64)
    rule = pair_rounds(world, staging_bytes, max_ops)
    shape = np.ones((len(ndim), width), np.int64)
    for name, u in info.unit_base().items():
        n = info.num_logical if name in info.experts else 1
        shape[u : u + n, : len(info.shapes[name])] = info.shapes[name]
    tr = plan_transfers_of(rank, holds, rows, shape, wire_size, node, rule)
    for bad, what in ((tr.uncovered, "no trainer rank holds all of"), (tr.over, "the trainer's holdings overlap in")):
        if len(bad):
            i = int(bad[0])
            nd = int(ndim[rows.unit[i]])
            raise ValueError(
                f"{what} box {rows.off[i, :nd].tolist()} + {rows.len[i, :nd].tolist()} of "
                f"{needs.keys[int(rows.unit[i])]} (needed by engine tensor {layout.tensors[int(rows.param[i])].name} "
                f"on rank {rank})"
            )
    # What every rank plans from alike: the engine layout, the holdings, the wire dtypes, the
    # engine tensors' local shapes and dtypes (each rank checks its engine tensors against
    # them, and its deliveries address them), the topology and the budgets.
    h = hashlib.sha256(layout.digest().encode())
    h.update(repr((sorted(info.shapes.items()), sorted(info.dtypes.items()), sorted(info.experts))).encode())
    h.update(repr((wire, needs.local_shapes, needs.dtypes, staging_bytes, max_ops)).encode())
    h.update(repr((world, topology.local_world_size, topology.nodes)).encode())
    if holds_digest is not None:
        h.update(holds_digest.encode())
    else:
        for a in (holds.unit, holds.rank, holds.param, holds.slot, holds.off, holds.len, holds.local):
            h.update(np.ascontiguousarray(a, np.int64).tobytes())
    group_of = np.asarray([t.group for t in layout.tensors], np.int64)
    groups = tuple(sorted(set(group_of.tolist())))
    t_group = group_of[rows.param[tr.need]]
    # Engine tensors are staged whole on every engine rank (each holds every tensor's shard).
    elems = np.asarray([int(np.prod(sh)) for sh in needs.local_shapes], np.int64)
    tbytes = elems * np.asarray([itemsize[d] for d in needs.dtypes], np.int64)
    batches = install_batches(group_of, tbytes, staging_bytes)
    h.update(repr(batches).encode())
    plans, send_params = [], []
    sent = copied = 0
    check = 0
    for gi, batch in enumerate(batches):
        part = rank_schedule(
            tr,
            np.isin(t_group, batch),
            rank,
            holds,
            rows,
            needs.keys,
            ndim,
            wire_size,
            topology,
            node,
            rule,
            staging_bytes,
            max_ops,
            gi,
        )
        empty = StorageCells(*(np.zeros(0, np.int64),) * 4, *(np.zeros((0, width), np.int64),) * 3)
        plans.append(ReshardPlan(part.schedule, empty, (), (), part.sent_bytes, part.copy_bytes, 0))
        send_params.append(part.send_param)
        sent += part.sent_bytes
        copied += part.copy_bytes
        check = (check + part.check) % 2**64
    return RefitPlan(
        groups,
        tuple(plans),
        needs,
        tuple(wire),
        rank,
        sent,
        copied,
        check,
        tuple(send_params),
        h.hexdigest()[:16],
        batches,
    )


def check_pairs(shares) -> None:
    """Every rank's ``(fingerprint, check, ...)`` of its :class:`RefitPlan` (by rank; pure):
    ValueError unless the fingerprints are equal and the checks sum to 0 mod 2**64 (the two
    ends of every transfer planned it alike)."""
    fps = [s[0] for s in shares]
    if len(set(fps)) != 1:
        by = ", ".join(f"rank {r}: {f}" for r, f in enumerate(fps))
        raise ValueError(f"ranks planned from different inputs (fingerprints {by})")
    if sum(s[1] for s in shares) % 2**64:
        raise ValueError(
            "the senders' and receivers' plans of some transfers differ (the pair check does not sum to 0): "
            "every rank must run the same moeshard and describe the layouts alike"
        )
