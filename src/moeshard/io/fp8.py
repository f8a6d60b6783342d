"""Block-quantized FP8 checkpoints: which weights carry a scale, and their dequantization.

DeepSeek-V3/R1 (and the checkpoints of transformers' ``FineGrainedFP8Config``) store a weight
``W [R, C]`` as ``float8_e4m3fn`` values ``Q`` plus a float32 ``weight_scale_inv`` ``S [ceil(R/bR),
ceil(C/bC)]`` (blocks of ``bR x bC``, 128 x 128 in DeepSeek's release), with
``W[i, j] = Q[i, j] * S[i // bR, j // bC]``. The scale may sit in another file than its weight.

A box of ``W`` (an expert's slice cut by expert FSDP, a piece cut by the staging budget) need not
align to the blocks: it is dequantized with the rows and columns of ``S`` it overlaps
(:func:`scale_box`). The pure part is torch-free; :func:`dequantize` imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..box import Box
from .formats import SCALE_SUFFIXES, scale_keys
from .header import TensorInfo
from .index import CheckpointIndex

if TYPE_CHECKING:
    import torch

__all__ = [
    "FP8_DTYPES",
    "Quantization",
    "block_size",
    "scale_of",
    "fitting_scales",
    "scale_box",
    "quantization",
    "dequantize",
    "read_dequantized",
]

FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})


def block_size(weight_shape, scale_shape) -> tuple[int, ...] | None:
    """The block shape of a scale ``scale_shape`` of a weight ``weight_shape``, or None when the
    ranks differ or the shapes do not determine it.

    Several block sizes ``b`` give ``ceil(n / b) == s`` (DeepSeek-V3's ``kv_a_proj_with_mqa``:
    576 rows in 5 blocks, ``b`` anywhere in 116..143). Quantizers use powers of two (128 x 128
    in DeepSeek's and transformers' FP8 checkpoints): per dim, the one power of two in that
    range, else the one value of the range; one block (``s == 1``) spans the dim.
    """
    if len(weight_shape) != len(scale_shape) or not weight_shape:
        return None
    out = []
    for n, s in zip(weight_shape, scale_shape):
        if s < 1 or s > max(n, 1):
            return None
        if s == 1:
            out.append(max(n, 1))
            continue
        lo, hi = -(-n // s), (n - 1) // (s - 1)  # every b with ceil(n / b) == s
        if lo > hi or -(-n // lo) != s:
            return None
        pow2 = [1 << k for k in range(lo.bit_length() - 1, hi.bit_length() + 1) if lo <= 1 << k <= hi]
        if len(pow2) == 1:
            out.append(pow2[0])
        elif lo == hi:
            out.append(lo)
        else:
            return None
    return tuple(out)


def scale_of(index: CheckpointIndex | Mapping[str, TensorInfo], key: str) -> tuple[str, tuple[int, ...]] | None:
    """``(scale key, block shape)`` of FP8 weight ``key`` when the checkpoint (an index, or its
    ``{key: TensorInfo}``) stores a float scale that fits it (:func:`block_size`), else None (not
    FP8, no scale, or a scale of another shape)."""
    if isinstance(index, CheckpointIndex) and key in index.packed:
        return None  # a packed weight's logical key: decoded by its format (moeshard.io.packed)
    tensors = index.tensors if isinstance(index, CheckpointIndex) else index
    info = tensors[key]
    if info.dtype not in FP8_DTYPES:
        return None
    for sk in scale_keys(key):
        if sk in tensors:
            s = tensors[sk]
            block = block_size(tuple(info.shape), tuple(s.shape)) if s.dtype in ("F32", "BF16", "F16") else None
            if block is not None:
                return sk, block
    return None


def fitting_scales(index: CheckpointIndex, keys: Sequence[str]) -> np.ndarray:
    """``bool[len(keys)]``: for each key, whether :func:`scale_of` finds a scale that fits it (an
    FP8 weight with a float block scale of its block grid), without a Python step per key: the
    index's kinds (dtype and shape) of each key and of its scale keys, then :func:`scale_of`
    once per distinct combination of them. What checks every expert's scale of every layer
    (256 experts x 61 layers) in a dict lookup per key and scale suffix."""
    if not len(keys):
        return np.zeros(0, dtype=bool)
    # One int64 per key for its kind and its scale keys' (kinds are -1 .. num_tensors - 1),
    # renumbered densely before each product so that it stays below len(keys) * (num_tensors + 1).
    base = len(index.tensors) + 1
    code = index.key_kinds(keys) + 1
    for suffix in SCALE_SUFFIXES:
        code = np.unique(code, return_inverse=True)[1].reshape(-1) * base
        code += index.key_kinds([k + suffix for k in keys]) + 1
    _, first, inverse = np.unique(code, return_index=True, return_inverse=True)
    fits = np.asarray([keys[i] in index and scale_of(index, keys[i]) is not None for i in first.tolist()], dtype=bool)
    return fits[inverse.reshape(-1)]


@dataclass(frozen=True)
class Quantization:
    """The FP8 tensors of a checkpoint (``moeshard inspect``): ``num_scaled`` weights with a block
    scale (``blocks``: the block shapes seen), their ``fp8_bytes`` and their scales'
    ``scale_bytes``; ``bf16_bytes``: those weights dequantized to bf16 (what a bf16 model holds;
    the load moves the FP8 bytes and the scales); ``unscaled``: FP8 tensors with no fitting
    scale (refused by a float model)."""

    num_scaled: int
    fp8_bytes: int
    scale_bytes: int
    bf16_bytes: int
    blocks: tuple[tuple[int, ...], ...]
    unscaled: tuple[str, ...]


def quantization(tensors: Mapping[str, TensorInfo]) -> Quantization | None:
    """:class:`Quantization` of a checkpoint's ``{key: TensorInfo}``, None without FP8 tensors."""
    fp8 = [k for k, t in tensors.items() if t.dtype in FP8_DTYPES]
    if not fp8:
        return None
    scaled = {k: f for k in fp8 if (f := scale_of(tensors, k)) is not None}
    return Quantization(
        num_scaled=len(scaled),
        fp8_bytes=sum(tensors[k].nbytes for k in scaled),
        scale_bytes=sum(tensors[sk].nbytes for sk, _ in scaled.values()),
        bf16_bytes=sum(2 * tensors[k].nbytes // tensors[k].itemsize for k in scaled),
        blocks=tuple(sorted({b for _, b in scaled.values()})),
        unscaled=tuple(sorted(k for k in fp8 if k not in scaled)),
    )


def scale_box(box: Box, block: tuple[int, ...]) -> Box:
    """The box of the scale tensor whose blocks ``box`` (of the weight) overlaps."""
    out = []
    for (o, n), b in zip(box, block):
        first, last = o // b, (o + max(n, 1) - 1) // b
        out.append((first, last - first + 1))
    return tuple(out)


def dequantize(q: torch.Tensor, box: Box, scale: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """``q`` (FP8 values of weight box ``box``, shape ``box_shape(box)``) times its scales, in
    float32. ``scale`` is the scale tensor's :func:`scale_box` of ``box`` (any float dtype, on any
    device: moved to ``q``'s)."""
    import torch

    out = to_float32(q)
    s = scale.to(device=q.device, dtype=torch.float32)
    if len(box) == 2 and box[1][0] % block[1] == 0 and out.numel():
        # Columns start on a block: multiply whole column blocks through a view (no expanded
        # scale of the box's size); only the rows are expanded, to [rows, column blocks].
        (o0, n0), (_, n1), (b0, b1) = box[0], box[1], block
        rows = torch.div(torch.arange(o0, o0 + n0, device=q.device), b0, rounding_mode="floor") - o0 // b0
        s = s.index_select(0, rows)
        full = n1 // b1
        if full:
            out[:, : full * b1].view(n0, full, b1).mul_(s[:, :full, None])
        if n1 > full * b1:
            out[:, full * b1 :].mul_(s[:, full : full + 1])
        return out
    for d, ((o, n), b) in enumerate(zip(box, block)):
        # Element o + i of this dim lies in block (o + i) // b, row (o + i) // b - o // b of ``s``.
        idx = torch.div(torch.arange(o, o + n, device=q.device), b, rounding_mode="floor") - o // b
        s = s.index_select(d, idx)
    return out.mul_(s)


_LUTS: dict = {}


def to_float32(q: torch.Tensor) -> torch.Tensor:
    """``q.to(float32)``; on CPU, for a one-byte float, through a 256-entry table: torch's CPU
    FP8 cast converts element by element, the table lookup is ~5x faster (same values, NaNs
    included)."""
    import torch

    if q.device.type != "cpu" or q.element_size() != 1 or not q.is_floating_point():
        return q.to(torch.float32)
    lut = _LUTS.get(q.dtype)
    if lut is None:
        lut = _LUTS[q.dtype] = torch.arange(256, dtype=torch.uint8).view(q.dtype).to(torch.float32)
    codes = q.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    return torch.index_select(lut, 0, codes).view(q.shape)


def read_dequantized(reader, key: str, box: Box, out: torch.Tensor) -> bool:
    """Read ``box`` of checkpoint tensor ``key`` into float tensor ``out`` (shape
    ``box_shape(box)``, two or more bytes per element) dequantized with the scale blocks covering
    it, which ``reader`` (a :class:`~moeshard.io.reader.CheckpointReader`) reads itself; the
    path of a read of a few boxes (relocation from disk), where load instead moves whole scales
    first. False, reading nothing, when ``key`` is no FP8 weight with a block scale or ``out`` is
    an FP8 tensor (which takes the bytes as stored)."""
    quant = scale_of(reader.index, key)
    if quant is None or out.element_size() < 2:
        return False
    scale, block = quant
    out.copy_(dequantize(reader.read(key, box), box, reader.read(scale, scale_box(box, block)), block))
    return True
