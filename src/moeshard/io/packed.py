"""Boxes of packed quantized weights (MXFP4, NVFP4, INT4, FP8 with per-group / channel / tensor
scales; :mod:`moeshard.io.quant`): what a box of the logical (dequantized) tensor reads.

A box of a :class:`~moeshard.io.quant.PackedWeight`'s logical tensor (shape ``pw.shape``) maps
to a box of its *value-oriented* tensor ``V`` (``[..., R, C]``: the logical shape with its last
two dims swapped when ``pw.transposed``, as gpt-oss stores ``[E, 2I, H]`` for a parameter
``[E, H, 2I]``), which is read as a box of the values' bytes (``V``'s elements row-major at
``bits / 8`` bytes each: a ``uint8`` view ``[..., R, C * bits // 8]`` of the stored tensor,
whatever its stored shape) and a box of the scale (``[..., R, C // group]``; one value per
channel or per tensor), plus the whole global scale (one value) where the scheme has one.

Those three reads, concatenated, are a *blob* (``uint8[blob_nbytes]``): what a load moves
for a piece of a packed weight (between ranks too: packed bytes, not floats), decoded where it
lands (:func:`decode_blob`, float32 math of :func:`moeshard.io.codecs.decode`, cast once by the
caller). Bytes read are exactly the packed bytes plus the scale bytes of the box.

A box must start and end on whole groups along ``C`` (:func:`packed_align`): values of one
scale group are never split between boxes. The pure part is torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..box import Box, box_numel
from ..dtypes import ITEMSIZE
from .header import TensorInfo

if TYPE_CHECKING:
    import torch

    from .quant import PackedWeight

__all__ = [
    "packed_align",
    "packed_dim",
    "misaligned",
    "scale_box",
    "blob_parts",
    "blob_nbytes",
    "read_blob",
    "decode_blob",
    "decode_blob_into",
]


def packed_dim(pw: PackedWeight) -> int:
    """The dim of the logical tensor the values are packed and grouped along (``V``'s last)."""
    n = len(pw.shape)
    return n - 2 if pw.transposed else n - 1


def _columns(pw: PackedWeight) -> int:
    return int(pw.shape[packed_dim(pw)])


def packed_align(pw: PackedWeight) -> int:
    """The values a box of ``pw`` must start and end on along :func:`packed_dim` (but at the
    tensor's end): :attr:`~moeshard.io.quant.PackedWeight.step` (a scale group: 16 or 32 for
    NVFP4 / MXFP4, the group of INT4; else the values of one stored unit)."""
    return pw.step


def misaligned(pw: PackedWeight, box: Box) -> str | None:
    """Why ``box`` (of the logical tensor) does not start and end on whole groups, or None."""
    d, a, c = packed_dim(pw), packed_align(pw), _columns(pw)
    o, n = box[d]
    if o % a or ((o + n) % a and o + n != c):
        return (
            f"{pw.key}: a box [{o}, {o + n}) of dim {d} splits a group of {a} values of its "
            f"{pw.scheme.name} packing ({pw.scheme.method}); shards and slices must start and end on "
            f"multiples of {a} along that dim"
        )
    return None


def _value_bytes_box(pw: PackedWeight, box: Box) -> tuple[Box, tuple[int, ...]]:
    """``(byte box, byte view shape)``: the box of the values' ``uint8`` view ``[..., R,
    C * bits // 8]`` holding ``value_box(box)``."""
    from .quant import value_box

    v = value_box(pw, box)
    shape = list(pw.value_shape)
    bits = pw.scheme.bits
    (o, n) = v[-1]
    vshape = (*shape[:-1], shape[-1] * bits // 8)
    return (*v[:-1], (o * bits // 8, -(-n * bits // 8))), tuple(vshape)


def scale_box(pw: PackedWeight, box: Box, scale_shape: tuple[int, ...]) -> Box:
    """The box of the scale tensor (stored shape ``scale_shape``) that logical ``box`` needs:
    the groups it covers (per channel: its rows; per tensor: the whole, one value)."""
    from .quant import value_box

    g = pw.scheme.group
    if g == 0:
        return tuple((0, s) for s in scale_shape)
    v = value_box(pw, box)
    o, n = v[-1]
    if g >= _columns(pw):
        return (*v[:-1], (0, 1))
    return (*v[:-1], (o // g, -(-(o + n) // g) - o // g))


def blob_parts(pw: PackedWeight, box: Box, tensors: Mapping[str, TensorInfo]) -> tuple[int, int, int]:
    """``(values bytes, scale bytes, global scale bytes)`` of the blob of logical ``box``."""
    vb, _ = _value_bytes_box(pw, box)
    s = tensors[pw.scale]
    sb = box_numel(scale_box(pw, box, tuple(s.shape))) * ITEMSIZE[s.dtype]
    gb = tensors[pw.global_scale].nbytes if pw.global_scale else 0
    return box_numel(vb), sb, gb


def blob_nbytes(pw: PackedWeight, box: Box, tensors: Mapping[str, TensorInfo]) -> int:
    """Bytes read for logical ``box``: its packed values, its scales and the global scale."""
    return sum(blob_parts(pw, box, tensors))


def read_blob(reader, pw: PackedWeight, box: Box) -> torch.Tensor:
    """Read the blob of logical ``box`` with ``reader`` (a
    :class:`~moeshard.io.reader.CheckpointReader`): ``uint8[blob_nbytes]``, its bytes counted
    in ``reader.bytes_read``."""
    import torch

    tensors = reader.index.tensors
    vbox, vshape = _value_bytes_box(pw, box)
    v = tensors[pw.values]
    parts = blob_parts(pw, box, tensors)
    out = torch.empty(sum(parts), dtype=torch.uint8)
    as_bytes = TensorInfo(v.file, v.offset, "U8", vshape)
    assert math.prod(vshape) == v.nbytes, f"{pw.values}: {v.nbytes} bytes, not the values of {list(pw.shape)}"
    reader.read_info(pw.values, as_bytes, vbox, out[: parts[0]].view(box_shape_of(vbox)))
    s = tensors[pw.scale]
    sbox = scale_box(pw, box, tuple(s.shape))
    reader.read_info(
        pw.scale,
        TensorInfo(s.file, s.offset, "U8", (*s.shape[:-1], s.shape[-1] * s.itemsize) if s.shape else (s.itemsize,)),
        _byte_box(sbox, s.itemsize) if s.shape else ((0, s.itemsize),),
        out[parts[0] : parts[0] + parts[1]].view(-1),
    )
    if pw.global_scale:
        gi = tensors[pw.global_scale]
        reader.read_info(
            pw.global_scale, TensorInfo(gi.file, gi.offset, "U8", (gi.nbytes,)), ((0, gi.nbytes),), out[-parts[2] :]
        )
    return out


def _byte_box(box: Box, itemsize: int) -> Box:
    return (*box[:-1], (box[-1][0] * itemsize, box[-1][1] * itemsize))


def box_shape_of(box: Box) -> tuple[int, ...]:
    return tuple(n for _, n in box)


def _blob_tensors(pw: PackedWeight, box: Box, blob: torch.Tensor, tensors: Mapping[str, TensorInfo]):
    """``(values, scale, global scale or None)`` of a blob, views of it as :func:`decode` takes them."""
    from .header import DTYPES

    nv, ns, _ = blob_parts(pw, box, tensors)
    blob = blob.reshape(-1)
    vbox, _ = _value_bytes_box(pw, box)
    values = blob[:nv].view(box_shape_of(vbox))
    s = tensors[pw.scale]
    sshape = box_shape_of(scale_box(pw, box, tuple(s.shape)))
    scale = blob[nv : nv + ns].clone().view(DTYPES[s.dtype]).view(sshape)
    glob = None
    if pw.global_scale:
        gi = tensors[pw.global_scale]
        glob = blob[nv + ns :].clone().view(DTYPES[gi.dtype]).view(gi.shape)
    return values, scale, glob


def decode_blob(pw: PackedWeight, box: Box, blob: torch.Tensor, tensors: Mapping[str, TensorInfo]) -> torch.Tensor:
    """float32 logical ``box`` of ``pw`` from its blob (:func:`read_blob`, any device)."""
    from .codecs import decode
    from .quant import value_box

    out = decode(pw.scheme, *_blob_tensors(pw, box, blob, tensors))
    out = out.reshape(box_shape_of(value_box(pw, box)))
    return out.transpose(-1, -2) if pw.transposed else out


def decode_blob_into(
    pw: PackedWeight, box: Box, blob: torch.Tensor, tensors: Mapping[str, TensorInfo], out: torch.Tensor
) -> torch.Tensor:
    """Logical ``box`` of ``pw`` from its blob decoded straight into ``out`` (the box's shape,
    any float dtype and strides, on the blob's device), tile by tile: equal bit for bit to
    ``out.copy_(decode_blob(...))`` without its full-size float32 temporary. Returns ``out``.
    Local (any rank)."""
    from .codecs import decode_into

    shape = box_shape_of(box)
    if tuple(out.shape) != shape:
        raise ValueError(f"{pw.key}: destination of shape {list(out.shape)} for a box of shape {list(shape)}")
    dest = out.transpose(-1, -2) if pw.transposed else out
    decode_into(pw.scheme, *_blob_tensors(pw, box, blob, tensors), dest)
    return out
