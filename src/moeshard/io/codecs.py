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

__all__ = ["E2M1_VALUES", "decode", "Encoded", "encode"]

# The 16 FP4 E2M1 codes: sign bit 3, exponent bits 2..1, mantissa bit 0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_PAIR_LUTS: dict = {}


def _pair_lut(code: str, device) -> torch.Tensor:
    """float32 ``[256, 2]``: the two values (low nibble first) of each byte of 4-bit codes."""
    import torch

    lut = _PAIR_LUTS.get((code, device))
    if lut is None:
        b = torch.arange(256, dtype=torch.int64)
        if code == "e2m1":
            vals = torch.tensor(E2M1_VALUES, dtype=torch.float32)
            lut = torch.stack((vals[b & 15], vals[b >> 4]), dim=1)
        else:  # int4: stored code + 8
            lut = torch.stack(((b & 15) - 8, (b >> 4) - 8), dim=1).to(torch.float32)
        lut = _PAIR_LUTS[(code, device)] = lut.to(device)
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
    return pairs.view(*lead, -1)


def _scale32(scheme: Scheme, scale: torch.Tensor) -> torch.Tensor:
    """float32 scale; for E8M0 the int32 exponent ``s - 127`` (applied by ``ldexp``)."""
    import torch

    if scheme.scale_dtype == "U8":
        return scale.contiguous().view(torch.uint8).to(torch.int32) - 127
    return to_float32(scale.contiguous())


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
    import torch

    if scheme.group == 0:
        if scale.numel() != 1:
            raise ValueError(f"{scheme.name} per-tensor scale must be one value, got shape {list(scale.shape)}")
        lead = tuple(values.shape[:-1])
    else:
        lead = tuple(scale.shape[:-1])
    q = _codes(scheme, values, lead)
    s = _scale32(scheme, scale)
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
        if scheme.scale_dtype == "U8":
            # E8M0: ldexp, as transformers computes it (finite 0.5 * 2^128, 0 * 2^128 == 0)
            out = torch.ldexp(grouped, s.unsqueeze(-1)).view(*lead, cols)
        else:
            out = grouped.mul_(s.unsqueeze(-1)).view(*lead, cols)
    if scheme.global_scale == "multiply":
        out.mul_(g)
    return out


class Encoded(NamedTuple):
    """A quantized tensor as its checkpoints store it: ``values``, ``scale``, ``global_scale``
    (None for a scheme without one)."""

    values: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None


def encode(scheme: Scheme, w: torch.Tensor, global_scale: torch.Tensor | None = None) -> Encoded:
    raise NotImplementedError("encode: next part")
