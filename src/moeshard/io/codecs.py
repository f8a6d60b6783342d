"""Dequantization (:func:`decode`) and quantization (:func:`encode`) of the schemes
:mod:`moeshard.io.quant` recognizes.

The math is each format's own, in float32, with no rounding but the codes' and fp32's:

* MXFP4: ``e2m1(code) * 2^(s - 127)`` (transformers' ``convert_moe_packed_tensors``: ``ldexp``);
* INT4 (compressed-tensors ``pack-quantized``): ``(nibble - 8) * scale``;
* FP8 (compressed-tensors ``float-quantized``): ``fp8(q) * scale``;
* NVFP4 compressed-tensors: ``e2m1(code) * (scale / weight_global_scale)`` (the quotient first,
  as compressed-tensors computes it);
* NVFP4 ModelOpt: ``(e2m1(code) * weight_scale) * weight_scale_2``.

A caller casts the float32 result once to the model's dtype.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NamedTuple

from .fp8 import to_float32
from .quant import Scheme

if TYPE_CHECKING:
    import torch

__all__ = ["E2M1_VALUES", "decode", "decode_into", "Encoded", "encode"]

# The 16 FP4 E2M1 codes: sign bit 3, exponent bits 2..1, mantissa bit 0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_PAIR_LUTS: dict = {}


def _pair_lut(code: str, device) -> torch.Tensor:
    """int64 ``[256]``: for each byte of 4-bit codes, its two float32 values (low nibble first)
    as one 8-byte element (a 1-D gather of 8-byte elements is the fastest on CPU)."""
    import torch

    lut = _PAIR_LUTS.get((code, device))
    if lut is None:
        b = torch.arange(256, dtype=torch.int64)
        if code == "e2m1":
            vals = torch.tensor(E2M1_VALUES, dtype=torch.float32)
            pairs = torch.stack((vals[b & 15], vals[b >> 4]), dim=1)
        else:  # int4: stored code + 8
            pairs = torch.stack(((b & 15) - 8, (b >> 4) - 8), dim=1).to(torch.float32)
        lut = _PAIR_LUTS[(code, device)] = pairs.contiguous().view(torch.int64).reshape(256).to(device)
    return lut


def _mx_lut(device) -> torch.Tensor:
    """int64 ``[256 * 256]``: entry ``s * 256 + byte`` holds the two float32 values (low nibble
    first) of a byte of E2M1 codes under E8M0 scale ``s``, ``ldexp(e2m1, s - 127)`` as
    transformers computes it (s = 255 included): MXFP4 decodes in one gather (512 KiB table)."""
    import torch

    lut = _PAIR_LUTS.get(("mx", device))
    if lut is None:
        pairs = _pair_lut("e2m1", "cpu").view(torch.float32).view(1, 256, 2)
        exp = (torch.arange(256, dtype=torch.int32) - 127).view(256, 1, 1)
        table = torch.ldexp(pairs.expand(256, 256, 2), exp).contiguous()
        lut = _PAIR_LUTS[("mx", device)] = table.view(torch.int64).reshape(-1).to(device)
    return lut


_PAIR_INT = {2: "int32", 4: "int64"}  # the integer holding two values of an itemsize


def _mx_lut_as(dtype, device) -> torch.Tensor | None:
    """:func:`_mx_lut` cast element by element to ``dtype`` (bf16, fp16, fp32), each pair of
    values one integer (int32 for 2-byte dtypes): a gather from it equals decoding in float32
    and casting, value by value. None for a dtype of another size."""
    import torch

    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    lut = _PAIR_LUTS.get(("mx", dtype, device))
    if lut is None:
        f32 = _mx_lut("cpu").view(torch.float32)
        pair = getattr(torch, _PAIR_INT[torch.empty((), dtype=dtype).element_size()])
        lut = _PAIR_LUTS[("mx", dtype, device)] = f32.to(dtype).view(pair).to(device)
    return lut


def _int4_lut_as(dtype, device) -> torch.Tensor:
    """:func:`_pair_lut` ("int4", values -8..7, exact in any float dtype) in 2-byte ``dtype``."""
    import torch

    lut = _PAIR_LUTS.get(("int4", dtype, device))
    if lut is None:
        f32 = _pair_lut("int4", "cpu").view(torch.float32)
        lut = _PAIR_LUTS[("int4", dtype, device)] = f32.to(dtype).view(torch.int32).to(device)
    return lut


def _codes(scheme: Scheme, values: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """float32 ``[*lead, C]`` of the codes in ``values`` (any dtype/shape, row-major bytes)."""
    import torch

    if values.dtype == torch.int32 and values.device.type == "cpu" and sys.byteorder != "little":
        raise ValueError("INT4 values packed in int32 are read on little-endian hosts only")
    raw = values.contiguous()
    if scheme.bits == 8:
        if raw.dtype != torch.float8_e4m3fn:
            raw = raw.view(torch.uint8).view(torch.float8_e4m3fn)
        return to_float32(raw).reshape(*lead, -1)
    b = raw.view(torch.uint8).reshape(-1).to(torch.int32)
    pairs = torch.index_select(_pair_lut(scheme.code, values.device), 0, b)
    return pairs.view(torch.float32).view(*lead, -1)


def _decode_mx(values: torch.Tensor, scale: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """MXFP4: one gather per byte from :func:`_mx_lut` at ``s * 256 + byte``."""
    import torch

    raw = values.contiguous().view(torch.uint8).reshape(*lead, -1)
    ngroups = scale.shape[-1]
    if ngroups == 0 or raw.shape[-1] % ngroups:
        raise ValueError(f"mxfp4: {2 * raw.shape[-1]} columns of values do not split into {ngroups} scale groups")
    s = scale.contiguous().view(torch.uint8).to(torch.int32) << 8
    idx = raw.view(*lead, ngroups, -1).to(torch.int32) | s.unsqueeze(-1)
    out = torch.index_select(_mx_lut(values.device), 0, idx.reshape(-1))
    return out.view(torch.float32).view(*lead, 2 * raw.shape[-1])


def decode(
    scheme: Scheme, values: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None
) -> torch.Tensor:
    """float32 ``[..., R, C]``: a box of the value-oriented tensor dequantized, a box that starts
    and ends on groups along the last dim. ``values``: that box's packed elements (any
    dtype/shape holding the same bytes row-major, e.g. a uint8 view ``[..., R, C * bits // 8]``,
    MXFP4 ``[..., R, C / 32, 16]``, INT4 int32 ``[..., R, C / 8]``, FP8 ``[..., R, C]``);
    ``scale``: the scale's box ``[..., R, C // group]`` (per channel ``[..., R, 1]``; per tensor
    one value, then ``values`` carries the shape); ``global_scale``: one value for a scheme with
    one, else None. All on one device; runs there. Any rank may call it (local)."""
    if scheme.group == 0:
        if scale.numel() != 1:
            raise ValueError(f"{scheme.name} per-tensor scale must be one value, got shape {list(scale.shape)}")
        lead = tuple(values.shape[:-1])
    else:
        lead = tuple(scale.shape[:-1])
    if scheme.scale_dtype == "U8":  # E8M0: MXFP4
        return _decode_mx(values, scale, lead)
    q = _codes(scheme, values, lead)
    s = to_float32(scale.contiguous())
    if scheme.global_scale:
        if global_scale is None or global_scale.numel() != 1:
            raise ValueError(
                f"{scheme.method} needs one global scale value, "
                f"got {None if global_scale is None else list(global_scale.shape)}"
            )
        g = to_float32(global_scale.contiguous()).reshape(())
        if scheme.global_scale == "divide":
            s = s / g
    if scheme.group == 0:
        out = q.mul_(s.reshape(()))
    else:
        cols, ngroups = q.shape[-1], s.shape[-1]
        if ngroups == 0 or cols % ngroups:
            raise ValueError(f"{scheme.name}: {cols} columns of values do not split into {ngroups} scale groups")
        grouped = q.view(*lead, ngroups, cols // ngroups)
        out = grouped.mul_(s.unsqueeze(-1)).view(*lead, cols)
    if scheme.global_scale == "multiply":
        out.mul_(g)
    return out


# A tile of decode_into: 4 MiB of float32 (2 MiB of bf16): a gpt-oss expert of hidden 576 in one
# tile, 364 rows of hidden 2880, so a tile's transposed write stays within the caches and TLB
# (measured by benchmarks/bench_decode.py; much smaller tiles cost more per call than they save).
_TILE_BYTES = 1 << 22


def decode_into(
    scheme: Scheme,
    values: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`decode` written into ``out`` (``[..., R, C]``, any float dtype, any strides: e.g.
    the transposed view of a gpt-oss ``[E, H, 2I]`` parameter), equal bit for bit to
    ``out.copy_(decode(...))`` (float32 math, one rounding to ``out.dtype``), without a full-size
    float32 temporary: rows are decoded a tile at a time straight into ``out`` (MXFP4: one gather
    per byte from a ``scale x byte`` table already in ``out.dtype``; INT4 with a scale in
    ``out.dtype``: codes times scale in that dtype, exact since the float32 product is). Returns
    ``out``. Arguments as :func:`decode`'s, all on ``out``'s device. Any rank may call it (local)."""
    import torch

    if values.dtype == torch.int32 and values.device.type == "cpu" and sys.byteorder != "little":
        raise ValueError("INT4 values packed in int32 are read on little-endian hosts only")
    if scheme.group == 0:
        lead = tuple(values.shape[:-1])
    else:
        lead = tuple(scale.shape[:-1])
    if len(lead) == 0 or not out.is_floating_point() or out.dim() != len(lead) + 1 or tuple(out.shape[:-1]) != lead:
        return out.copy_(decode(scheme, values, scale, global_scale).view(out.shape))
    rows, cols = lead[-1], out.shape[-1]
    try:
        o3 = out.view(-1, rows, cols)
    except RuntimeError:  # lead dims that do not flatten: one whole decode
        return out.copy_(decode(scheme, values, scale, global_scale).view(out.shape))
    nb = values.numel() * values.element_size()
    if rows == 0 or cols == 0 or nb == 0:
        return out.copy_(decode(scheme, values, scale, global_scale).view(out.shape))
    v3 = values.contiguous().view(torch.uint8).reshape(o3.shape[0], rows, -1)
    s3 = scale.contiguous().reshape(o3.shape[0], rows, -1) if scheme.group else scale
    step = max(1, _TILE_BYTES // (4 * cols))
    tile = _mx_tile if scheme.scale_dtype == "U8" else _codes_tile
    for e in range(o3.shape[0]):
        for r in range(0, rows, step):
            t = slice(r, min(r + step, rows))
            tile(scheme, v3[e, t], s3[e, t] if scheme.group else s3, global_scale, o3[e, t])
    return out


def _mx_tile(scheme: Scheme, raw: torch.Tensor, scale: torch.Tensor, glob, out: torch.Tensor) -> None:
    """MXFP4 rows ``raw`` (uint8 ``[T, C/2]``) with E8M0 ``scale`` ``[T, C/32]`` into ``out``."""
    import torch

    lut = _mx_lut_as(out.dtype, out.device)
    if lut is None:
        out.copy_(_decode_mx(raw, scale, (raw.shape[0],)))
        return
    ngroups = scale.shape[-1]
    if ngroups == 0 or raw.shape[-1] % ngroups or 2 * raw.shape[-1] != out.shape[-1]:
        raise ValueError(f"mxfp4: {2 * raw.shape[-1]} columns of values do not split into {ngroups} scale groups")
    idx = raw.view(raw.shape[0], ngroups, -1).to(torch.int32)
    idx |= (scale.view(torch.uint8).to(torch.int32) << 8).unsqueeze(-1)
    pairs = _pairs_of(out, lut.dtype)
    if pairs is not None:
        torch.index_select(lut, 0, idx.view(-1), out=pairs)
    else:
        out.copy_(torch.index_select(lut, 0, idx.view(-1)).view(out.dtype).view(out.shape))


def _pairs_of(out: torch.Tensor, pair_dtype) -> torch.Tensor | None:
    """``out``'s memory as 1-D ``pair_dtype`` (two values each), or None (not contiguous, or not
    aligned to a pair)."""
    if not out.is_contiguous():
        return None
    flat = out.view(-1)
    if flat.storage_offset() % 2 or flat.numel() % 2:
        return None
    return flat.view(pair_dtype)


def _codes_tile(scheme: Scheme, raw: torch.Tensor, scale: torch.Tensor, glob, out: torch.Tensor) -> None:
    """Rows ``raw`` (the values' bytes ``[T, C * bits / 8]``) of any other scheme into ``out``."""
    import torch

    if (
        scheme.code == "int4"
        and not scheme.global_scale
        and scheme.group
        and out.dtype in (torch.bfloat16, torch.float16)
        and scale.dtype == out.dtype
        and out.is_contiguous()
    ):
        # code (-8..7) x scale is exact in float32, so one product rounded to out.dtype (what a
        # 2-byte float multiply does) equals the float32 product cast.
        ngroups = scale.shape[-1]
        cols = out.shape[-1]
        if ngroups == 0 or cols % ngroups or 2 * raw.shape[-1] != cols:
            raise ValueError(f"{scheme.name}: {cols} columns of values do not split into {ngroups} scale groups")
        q = torch.index_select(_int4_lut_as(out.dtype, out.device), 0, raw.reshape(-1).to(torch.int32))
        grouped = q.view(out.dtype).view(raw.shape[0], ngroups, cols // ngroups)
        torch.mul(grouped, scale.unsqueeze(-1), out=out.view(raw.shape[0], ngroups, cols // ngroups))
        return
    out.copy_(decode(scheme, raw, scale, glob).view(out.shape))


class Encoded(NamedTuple):
    """A quantized tensor as its checkpoints store it: ``values``, ``scale``, ``global_scale``
    (None for a scheme without one)."""

    values: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None


_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F8_E4M3": "float8_e4m3fn", "U8": "uint8"}
# |x| thresholds of E2M1's round-to-nearest-even: (0.25, 0.75, ...]; index i -> E2M1_VALUES[i].
_E2M1_UP = (0.25, 1.25, 2.5, 5.0)  # ties round down (to the even code)
_E2M1_AT = (0.75, 1.75, 3.5)  # ties round up (to the even code)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes of ``x`` (already scaled), saturated at 6, ties to even (compressed-
    tensors' ``cast_to_fp4``); the sign bit is ``x``'s (so -0.0 codes as 8)."""
    import torch

    a = x.abs()
    idx = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _E2M1_UP:
        idx += a > t
    for t in _E2M1_AT:
        idx += a >= t
    return idx | (torch.signbit(x).to(torch.uint8) << 3)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., C/2]``: two 4-bit codes per byte, the even index in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _group_amax(w: torch.Tensor, group: int) -> torch.Tensor:
    """``[..., R, C // group]`` max |w| per group (``group`` 0: the whole tensor, shape [])."""
    if group == 0:
        return w.abs().amax()
    return w.unflatten(-1, (w.shape[-1] // group, group)).abs().amax(dim=-1)


def _expand(s: torch.Tensor, group: int, cols: int) -> torch.Tensor:
    return s if group in (0, cols) else s.repeat_interleave(group, dim=-1)


def _mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 ``127 + floor(log2(amax')) - 2`` where ``amax'`` is ``amax`` rounded up to the
    next power of two when its mantissa is >= 1.75 (compressed-tensors' ``round_to_power_2``
    for E2M1's one mantissa bit, ``generate_mx_scales``), clamped to 0..255."""
    import torch

    bits = amax.float().contiguous().view(torch.int32)
    p2 = ((bits + (1 << 21)) & 0x7F800000).view(torch.float32)
    return (127 + torch.floor(torch.log2(p2)) - 2).clamp(0, 255).round().to(torch.uint8)


def _zero_to(s: torch.Tensor, eps: float) -> torch.Tensor:
    import torch

    return torch.where(s == 0, torch.tensor(eps, dtype=s.dtype, device=s.device), s)


def encode(
    scheme: Scheme, w: torch.Tensor, global_scale: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> Encoded:
    """The quantization of float ``w`` ``[..., R, C]`` (value-oriented: gpt-oss's logical
    ``[E, H, 2I]`` transposed first) in ``scheme``, stored as the format's checkpoints store it:

    * MXFP4: values U8 ``[..., R, C/32, 16]``, scale U8 E8M0 ``[..., R, C/32]``, exponent
      ``floor(log2(amax)) - 2`` (OCP's shared exponent, emax(E2M1) = 2) where ``amax`` is first
      rounded to E2M1's precision (a group max of mantissa >= 1.75 takes the next exponent
      instead of clipping to 6: compressed-tensors' ``generate_mx_scales``);
    * NVFP4 (compressed-tensors): values U8 ``[..., R, C/2]``, scale F8_E4M3 ``[..., R, C/16]`` =
      ``fp8(global * amax_group / 6)``, global F32 ``[1]`` = ``448 * 6 / amax`` (compressed-tensors'
      ``generate_gparam``);
    * NVFP4 (ModelOpt): as above with ``weight_scale_2`` F32 ``[]`` = ``amax / (6 * 448)`` and scale
      ``fp8(amax_group / (6 * weight_scale_2))`` (ModelOpt's NVFP4 quantizer);
    * INT4 (pack-quantized): values I32 ``[..., R, C/8]`` (``code + 8``, eight per word, the first
      in the low bits), scale ``[..., R, C/group]`` = ``amax_group / 7.5`` in ``scheme.scale_dtype``;
    * FP8: values F8_E4M3 ``[..., R, C]``, scale ``amax / 448`` per row ``[..., R, 1]`` or per
      tensor ``[1]``, in ``scheme.scale_dtype``.

    ``global_scale`` / ``scale``, when given, are used instead of computed (requantizing with a
    checkpoint's own scales reproduces its bytes for values they represent exactly). Codes
    round to nearest, ties to even, saturating; the arithmetic is compressed-tensors' (scales
    computed in ``w``'s dtype, a zero scale replaced as it replaces it), so decoding the result
    equals compressed-tensors' quantize-dequantize of ``w``. Local (any rank); runs on ``w``'s
    device."""
    import torch

    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"encode: expected a float tensor [..., R, C], got {w.dtype} {list(w.shape)}")
    cols, group = w.shape[-1], scheme.group
    if group and cols % group:
        raise ValueError(f"{scheme.name}: {cols} columns are not whole groups of {group}")
    if scheme.name == "mxfp4":
        e = _mx_exponent(_group_amax(w, 32)) if scale is None else scale.to(torch.uint8)
        step = torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=w.device), e.to(torch.int32) - 127)
        q = w.float().unflatten(-1, (cols // 32, 32)) / step.unsqueeze(-1)
        codes = _e2m1_codes(q.clamp(-6.0, 6.0))
        return Encoded(_pack_nibbles(codes).reshape(*w.shape[:-1], cols // 32, 16), e, None)
    if scheme.name == "nvfp4":
        if scheme.global_scale == "divide":  # compressed-tensors
            if global_scale is None:
                m = w.abs().amax().clamp(min=torch.finfo(w.dtype).tiny)
                global_scale = torch.nan_to_num(448.0 * 6.0 / m, nan=1.0, posinf=1.0, neginf=1.0)
            g = global_scale.to(torch.float32).reshape([1])
            if scale is None:
                amax = _group_amax(w, group)
                s32 = (g * (amax / torch.tensor(6.0, dtype=amax.dtype))).clamp(-448.0, 448.0)
                scale = _zero_to(s32.to(torch.float8_e4m3fn).to(torch.float32), 0.125).to(torch.float8_e4m3fn)
            eff = scale.to(torch.float32) / g
        else:  # ModelOpt
            if global_scale is None:
                global_scale = w.abs().amax().float() / (6.0 * 448.0)
            g = global_scale.to(torch.float32).reshape(())
            if scale is None:
                scale = _zero_to(_group_amax(w, group).float() / (6.0 * g), 1.0).to(torch.float8_e4m3fn)
            eff = scale.to(torch.float32) * g
        codes = _e2m1_codes((w.float() / _expand(eff, group, cols)).clamp(-6.0, 6.0))
        return Encoded(_pack_nibbles(codes), scale, g)
    sdt = getattr(torch, _DTYPES[scheme.scale_dtype])
    if scheme.name == "int4":
        if sys.byteorder != "little":
            raise ValueError("INT4 values packed in int32 are written on little-endian hosts only")
        g = min(group, cols)  # per channel: one group of the row
        if scale is None:
            amax = _group_amax(w, g)
            scale = _zero_to(amax / torch.tensor(7.5, dtype=amax.dtype), torch.finfo(amax.dtype).eps).to(sdt)
        codes = (torch.round((w / _expand(scale, g, cols)).clamp(-8, 7)).to(torch.int32) + 8).to(torch.uint8)
        # little-endian int32 words of the nibble bytes: code i at bits 4i.. of its word
        return Encoded(_pack_nibbles(codes).contiguous().view(torch.int32), scale, None)
    if scheme.name == "fp8":
        if scale is None:
            amax = _group_amax(w, group)
            scale = _zero_to(amax / torch.tensor(448.0, dtype=amax.dtype), torch.finfo(amax.dtype).eps).to(sdt)
            scale = scale.reshape([1]) if group == 0 else scale
        return Encoded((w / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale, None)
    raise ValueError(f"encode: unknown scheme {scheme.name!r}")
