"""Tier 1: block-FP8 quantization of engine tensors (:mod:`moeshard.ops.engine_quant`) against an
independent reference written here from vLLM's ``per_block_cast_to_fp8`` formula (block by
block, not moeshard's padded view): the same FP8 bits and float32 scales, for bf16 and float32
inputs, partial edge blocks, all-zero blocks, subnormal and saturating ranges, a batch of expert
slots; the dequantized values within the format's rounding bound; the engine tensors' checks."""

from __future__ import annotations

import pytest
import torch

from moeshard.ops import engine_quant
from moeshard.plan.refit import EngineTensor, Segment


def _reference(x: torch.Tensor, block, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's formula, one block at a time: amax in float32 floored at 1e-4, scale = amax / 448
    (with ``ue8m0``, vLLM's and sglang's ``per_block_cast_to_fp8`` with ``use_ue8m0``: rounded
    up to ``2 ** ceil(log2(scale))``, their ``ceil_to_ue8m0``), values = fp8(x * (1 / scale))."""
    m, n = x.shape
    bm, bn = block
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-m // bm), -(-n // bn), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = x[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].float()
            scale = torch.clamp(blk.abs().max(), min=1e-4) / 448.0
            if ue8m0:
                scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
            s[i, j] = scale
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (blk * (1.0 / scale)).to(torch.float8_e4m3fn)
    return q, s


def _weights(dtype, shape=(37, 50)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.logspace(-6, 3, shape[-1])  # every column another range
    w[..., :16, :16] = 0.0  # an all-zero block
    if shape[-2] > 18:
        w[..., 18, 3] = 3.0e4  # a block whose other values go subnormal
    return w.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("shape", [(37, 50), (32, 64)])  # partial edge blocks, whole blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [(16, 16), (8, 32), (128, 128)])
def test_block_fp8_equals_vllms_formula(shape, dtype, block):
    w = _weights(dtype, shape)
    q, s = engine_quant.block_fp8(w, block)
    rq, rs = _reference(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == engine_quant.scale_shape(w.shape, block)
    assert torch.equal(_bits(q), _bits(rq))
    assert torch.equal(s, rs)
    assert not torch.isnan(q.float()).any()


def test_block_fp8_quantizes_every_slot_alike():
    w = _weights(torch.bfloat16, (3, 20, 24))
    q, s = engine_quant.block_fp8(w, (8, 16))
    assert s.shape == (3, 3, 2)
    for e in range(3):
        rq, rs = _reference(w[e], (8, 16))
        assert torch.equal(_bits(q[e]), _bits(rq)) and torch.equal(s[e], rs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_values_are_within_the_rounding_bound(dtype):
    """E4M3 keeps 3 mantissa bits: a normal value rounds within 2^-4 of itself, a subnormal one
    (below 2^-6 of the scale) within half its step, 2^-10 of the scale."""
    w = _weights(dtype)
    block = (16, 16)
    q, s = engine_quant.block_fp8(w, block)
    scale = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
    deq = q.float() * scale
    x = w.float()
    bound = (x.abs() * 2.0**-4 + scale * 2.0**-10) * (1 + 1e-6)
    assert ((deq - x).abs() <= bound).all()
    assert (deq - x).abs().max() > 0  # the bound is not vacuous: the values were rounded


def test_engine_tensor_checks_name_the_tensor():
    t = EngineTensor("o.weight", (Segment("o"),), quant="fp8_block", block=(16, 16))
    assert t.scale_name == "o.weight_scale_inv"
    x = torch.empty(40, 32, dtype=torch.float8_e4m3fn)
    engine_quant.check_engine_tensor(t, x, torch.empty(3, 2), (40, 32))
    with pytest.raises(ValueError, match=r"o.weight_scale_inv: \[3, 3\]"):
        engine_quant.check_engine_tensor(t, x, torch.empty(3, 3), (40, 32))
    with pytest.raises(ValueError, match="o.weight: .*bfloat16"):
        engine_quant.check_engine_tensor(t, x.to(torch.bfloat16), torch.empty(3, 2), (40, 32))
    with pytest.raises(ValueError, match="missing"):
        engine_quant.check_engine_tensor(t, x, None, (40, 32))
    with pytest.raises(ValueError, match="padded"):
        EngineTensor("emb", (Segment("emb"),), shard_dim=0, pad_to=64, quant="fp8_block")
    with pytest.raises(ValueError, match="quant 'int4'"):
        EngineTensor("o", (Segment("o"),), quant="int4")


def test_staged_tensors_are_quantized_and_installed_with_their_scale():
    tensors = (
        EngineTensor("a", (Segment("a"),), quant="fp8_block", block=(4, 4)),
        EngineTensor("b", (Segment("b"),)),
    )
    w = _weights(torch.float32, (6, 8))
    stage = [w.clone(), w.clone()]
    engine_quant.quantize_staged(tensors, stage)
    assert isinstance(stage[0], engine_quant.Quantized) and torch.equal(stage[1], w)
    dst, scale, plain = torch.empty(6, 8, dtype=torch.float8_e4m3fn), torch.empty(2, 2), torch.empty(6, 8)
    engine_quant.install(dst, scale, stage[0])
    engine_quant.install(plain, None, stage[1])
    rq, rs = _reference(w, (4, 4))
    assert torch.equal(_bits(dst), _bits(rq)) and torch.equal(scale, rs) and torch.equal(plain, w)


# -- UE8M0 scales ---------------------------------------------------------------------------------


def _ue8m0_weights(dtype) -> torch.Tensor:
    w = _weights(dtype, (37, 50))
    # Blocks whose amax / 448 is exactly a power of two (its own scale, not the next one up) and
    # a float32 ulp above one.
    w[24:32, 8:16] = 0.0
    w[25, 9] = -448.0 * 2.0**-5
    w[24:32, 40:48] = 0.0
    w[24, 40] = float(torch.tensor(448.0 * 2.0**-9).nextafter(torch.tensor(1e9)))
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [(8, 8), (16, 32), (128, 128)])
def test_ue8m0_block_fp8_equals_the_engines_formula(dtype, block):
    w = _ue8m0_weights(dtype)
    q, s = engine_quant.block_fp8(w, block, "ue8m0")
    rq, rs = _reference(w, block, ue8m0=True)
    assert torch.equal(_bits(q), _bits(rq)) and torch.equal(s, rs)
    assert not torch.isnan(q.float()).any()
    # Powers of two, the smallest at or above amax / 448 up to log2's float32 rounding.
    bits = s.view(torch.int32)
    assert bool(((bits & 0x7FFFFF) == 0).all())
    _, plain = engine_quant.block_fp8(w, block)
    assert bool((s >= plain * (1 - 2.0**-20)).all()) and bool((s < 2 * plain).all())
    assert not torch.equal(s, plain)
    if block == (8, 8):
        assert s[3, 1] == 2.0**-5  # exactly a power of two: kept
        # One ulp above: float32 log2 may round to the power itself (values then round to 448).
        assert s[3, 5] in (2.0**-9, 2.0**-8) and q[24, 40].float() * s[3, 5] <= 448.0 * 2.0**-9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ue8m0_dequantized_values_are_within_the_rounding_bound(dtype):
    """A power-of-two scale ``sf`` in ``[amax / 448, 2 amax / 448)``: the values still fit E4M3's
    range, each within 2^-4 of itself (normal) or 2^-10 of ``sf`` (subnormal)."""
    w = _ue8m0_weights(dtype)
    block = (16, 16)
    q, s = engine_quant.block_fp8(w, block, "ue8m0")
    scale = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
    x = w.float()
    err = (q.float() * scale - x).abs()
    assert bool((err <= (x.abs() * 2.0**-4 + scale * 2.0**-10) * (1 + 1e-6)).all()) and err.max() > 0


def test_ue8m0_scales_as_e8m0_bytes():
    t = EngineTensor(
        "o.weight", (Segment("o"),), quant="fp8_block", block=(8, 8), scale_fmt="ue8m0", scale_dtype="float8_e8m0fnu"
    )
    w = _ue8m0_weights(torch.bfloat16)
    got = engine_quant.quantize(t, w)
    rq, rs = _reference(w, (8, 8), ue8m0=True)
    assert got.scale.dtype == torch.float8_e8m0fnu and torch.equal(_bits(got.values), _bits(rq))
    # The exponent byte: 2 ** (byte - 127), the same value as the float32 scale.
    byte = got.scale.view(torch.uint8).to(torch.int32)
    assert torch.equal(torch.pow(2.0, (byte - 127).float()), rs) and torch.equal(got.scale.float(), rs)
    engine_quant.check_engine_tensor(t, got.values, got.scale, w.shape)
    with pytest.raises(ValueError, match=r"o.weight_scale_inv: \[5, 7\] torch.float32 here"):
        engine_quant.check_engine_tensor(t, got.values, rs, w.shape)
    with pytest.raises(ValueError, match="not a positive normal power of two"):
        engine_quant.ue8m0_bytes(torch.tensor([0.75]))
    # Installed with its values, as any quantized tensor.
    dst, scale = torch.empty_like(got.values), torch.empty_like(got.scale)
    engine_quant.install(dst, scale, got)
    assert torch.equal(_bits(dst), _bits(rq)) and torch.equal(scale.view(torch.uint8), got.scale.view(torch.uint8))
