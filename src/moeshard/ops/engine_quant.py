"""Block-FP8 quantization of an engine's tensors during a refit.

An engine tensor declared ``quant="fp8_block"`` (:class:`~moeshard.plan.refit.EngineTensor`) is
held by the engine as ``float8_e4m3fn`` values plus a float32 scale per ``block`` (128 x 128 in
DeepSeek-V3's checkpoint and vLLM's / sglang's ``weight_block_size``), the scale being the
dequantization multiplier (``weight = fp8 * scale``, named ``weight_scale_inv`` after
DeepSeek's checkpoint). A block's scale needs the whole block, so the refit delivers the float
boxes into a staging tensor of the engine tensor's local shape (in the layout's ``dtype``), and
each engine rank quantizes it once every box has arrived, before installing values and scale.

The math is vLLM's ``per_block_cast_to_fp8`` (from DeepGEMM): per block ``amax = max |w|``
computed in float32 and floored at ``1e-4``, ``scale = amax / 448`` (float32), values
``fp8(w * (1 / scale))`` (round to nearest even; ``|w| * (1 / scale)`` never exceeds 448 by
more than float32 rounding, which rounds back to 448). Quantizing a block's rows or columns
past the tensor's end: they count as zeros (vLLM pads with zeros).

UE8M0 scales (``scale_fmt="ue8m0"``: DeepSeek-V3.1's checkpoints, DeepGEMM on Blackwell) round
the scale up to a power of two as vLLM's and sglang's ``per_block_cast_to_fp8`` with
``use_ue8m0`` do: ``scale = 2 ** ceil(log2(amax / 448))`` in float32 (``torch.log2`` on the
tensor's device: for a ratio a few ulps above a power of two it rounds to that power, whose
values then round to at most 448), values ``fp8(w * (1 / scale))``. Held as float32, or as
``float8_e8m0fnu`` (the scale's exponent byte, ``scale == 2 ** (byte - 127)``).

Local (any rank); runs on the tensors' device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..plan.refit import EngineTensor

__all__ = ["FP8_MAX", "AMAX_FLOOR", "block_fp8", "scale_shape", "Quantized", "staging", "quantize_staged", "install"]
__all__ += ["check_engine_tensor", "ue8m0_bytes", "quantize"]

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # vLLM's clamp of a block's amax (an all-zero block gets scale 1e-4 / 448)


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """The scale's shape of a tensor ``[..., R, C]`` quantized per ``block``: ``[...,
    ceil(R / block[0]), ceil(C / block[1])]``."""
    *lead, r, c = shape
    return (*lead, -(-r // block[0]), -(-c // block[1]))


def block_fp8(w: torch.Tensor, block: Sequence[int], scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float ``w`` ``[..., R, C]`` per ``block`` ``(bR, bC)`` of its last two dims.

    Returns ``(values, scale)``: ``float8_e4m3fn`` ``[..., R, C]`` and float32 ``[...,
    ceil(R / bR), ceil(C / bC)]`` with ``w ~= values * scale`` (block-wise), bit for bit vLLM's
    ``per_block_cast_to_fp8`` of every ``[R, C]`` matrix of ``w`` (``scale_fmt="ue8m0"``: with
    ``use_ue8m0``, powers of two). Temporaries: one matrix at a time (float32, padded to whole
    blocks)."""
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"block_fp8: expected a float tensor [..., R, C], got {w.dtype} {list(w.shape)}")
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"block_fp8: scale_fmt {scale_fmt!r} is not None or 'ue8m0'")
    values = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(scale_shape(w.shape, block), dtype=torch.float32, device=w.device)
    flat_w, flat_v, flat_s = (x.reshape(-1, *x.shape[-2:]) for x in (w, values, scale))
    for i in range(flat_w.shape[0]):
        flat_v[i], flat_s[i] = _matrix(flat_w[i], int(block[0]), int(block[1]), scale_fmt == "ue8m0")
    return values, scale


def ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Float32 powers of two ``scale`` as ``float8_e8m0fnu`` (their exponent bytes: ``2 ** (b -
    127)``, bit for bit the same values); raises ValueError for a scale that is not a normal
    power of two."""
    bits = scale.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    if bool(((bits < 0) | ((bits & 0x7FFFFF) != 0) | (exponent == 0) | (exponent == 0xFF)).any()):
        raise ValueError("ue8m0_bytes: a scale is not a positive normal power of two")
    return exponent.to(torch.uint8).view(torch.float8_e8m0fnu)


def _matrix(w: torch.Tensor, br: int, bc: int, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    r, c = w.shape
    nr, nc = -(-r // br), -(-c // bc)
    if r % br or c % bc:
        padded = w.new_zeros((nr * br, nc * bc))  # zeros leave every block's amax as it is
        padded[:r, :c] = w
    else:
        padded = w.contiguous()
    blocks = padded.view(nr, br, nc, bc)
    # |x| and max are exact in any float dtype: the amax of the float32 values, as vLLM's.
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).float().clamp(min=AMAX_FLOOR)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    values = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn)
    return values.view(nr * br, nc * bc)[:r, :c], scale.view(nr, nc)


class Quantized(NamedTuple):
    """A staged engine tensor after quantization: ``values`` ``float8_e4m3fn`` (the engine
    tensor's shape) and ``scale`` (:func:`scale_shape`, in the tensor's ``scale_dtype``)."""

    values: torch.Tensor
    scale: torch.Tensor


def check_engine_tensor(t: EngineTensor, x: torch.Tensor, scale: torch.Tensor | None, shape: Sequence[int]) -> None:
    """Raise ValueError unless the engine's tensors of quantized ``t`` are what the layout
    says: ``x`` ``float8_e4m3fn`` of the local ``shape`` and ``scale`` of :func:`scale_shape` in
    ``t.scale_dtype``, both contiguous."""
    want = scale_shape(shape, t.block)
    scale_dtype = getattr(torch, t.scale_dtype, None)
    if scale_dtype is None:
        raise ValueError(f"engine tensor {t.name}: this torch has no {t.scale_dtype} for its scale")
    for name, got, dtype, size in (
        (t.name, x, torch.float8_e4m3fn, tuple(shape)),
        (t.scale_name, scale, scale_dtype, want),
    ):
        if got is None:
            raise ValueError(f"engine tensor {name} (the scale of {t.name}) is missing")
        if tuple(got.shape) != size or got.dtype != dtype:
            raise ValueError(
                f"engine tensor {name}: {list(got.shape)} {got.dtype} here, the layout says {list(size)} {dtype} "
                f"(block FP8 of {list(t.block)})"
            )
        if not got.is_contiguous():
            raise ValueError(f"engine tensor {name} is not contiguous")


def staging(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float staging tensor of quantized engine tensor ``x`` (its shape and device, the
    layout's ``dtype``)."""
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def quantize_staged(tensors: Sequence[EngineTensor], stage: list) -> None:
    """Replace, in ``stage`` (per engine tensor of the layout: its staged tensor or None), every
    quantized tensor's staged float values by their :class:`Quantized` form. Call once every
    box of the install group has arrived, before anything is installed."""
    for j, t in enumerate(tensors):
        if t.quant is not None and stage[j] is not None:
            stage[j] = quantize(t, stage[j])


def quantize(t: EngineTensor, w: torch.Tensor) -> Quantized:
    """Engine tensor ``t``'s :class:`Quantized` form of its float values ``w`` (its block, scale
    format and scale dtype)."""
    values, scale = block_fp8(w, t.block, t.scale_fmt)
    return Quantized(values, ue8m0_bytes(scale) if t.scale_dtype == "float8_e8m0fnu" else scale)


def install(dst: torch.Tensor, scale: torch.Tensor | None, staged) -> None:
    """Copy a staged engine tensor into the engine's: a plain tensor into ``dst``, a
    :class:`Quantized` one's values into ``dst`` and its scale into ``scale``."""
    if isinstance(staged, Quantized):
        dst.copy_(staged.values)
        scale.copy_(staged.scale)
    else:
        dst.copy_(staged)
