"""moeshard.save(..., quantize="source"): a float model loaded from a quantized checkpoint (the
fixtures of tests/quant_fixtures.py, as their float reference) and fine-tuned (its expert weights
changed) is written back in the source's format. The written tensors, read by the source's own
readers (transformers' MXFP4 dequantization for gpt-oss; compressed-tensors' decompression for
INT4 pack-quantized DeepSeek-V3, Kimi-K2-Thinking's layout), equal encode -> decode of the float
weights computed in this process; the key set, dtypes and quantization_config are the source's;
the report gives the requantization error. A source without such weights, and a model that
keeps its weights packed, are refused before anything is written.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import quant_fixtures

transformers = pytest.importorskip("transformers")


def _tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def _fine_tuned(fx, root: str):
    """The fixture's float model (fp32, from its dequantized reference) with every quantized
    weight changed, as a fine-tune changes it."""
    ref = quant_fixtures.write_reference(fx, os.path.join(root, "reference"), torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(name == k or k.startswith(name.rsplit(".", 1)[0] + ".") for k in fx.quantized):
                p.add_(0.01 * torch.randn(p.shape, generator=g))
    return model


def _roundtrip(scheme, w: torch.Tensor) -> torch.Tensor:
    """encode -> decode of value-oriented float ``w`` in this process (moeshard.io.codecs)."""
    from moeshard.io import codecs

    return codecs.decode(scheme, *codecs.encode(scheme, w))


def _expert_weight(state: dict, key: str) -> torch.Tensor:
    """Per-expert checkpoint tensor ``key`` (``<mod>.experts.<e>.<proj>.weight``) of a model
    holding its experts fused (``gate_up_proj`` [E, 2I, H] = gate rows, then up rows)."""
    head, e, proj, _ = key.rsplit(".", 3)
    if proj == "down_proj":
        return state[f"{head}.down_proj"][int(e)]
    both = state[f"{head}.gate_up_proj"][int(e)]
    half = both.shape[0] // 2
    return both[:half] if proj == "gate_proj" else both[half:]


def _check_layout(fx, out: str) -> None:
    src, saved = _tensors(fx.path), _tensors(out)
    assert set(saved) == set(src)
    for k, t in src.items():
        assert saved[k].dtype == t.dtype and saved[k].shape == t.shape, k
    with open(os.path.join(fx.path, "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        assert json.load(g)["quantization_config"] == json.load(f)["quantization_config"]


def test_gpt_oss_fine_tune_saved_in_mxfp4(tmp_path):
    """gpt-oss: the saved ``*_blocks`` / ``*_scales`` dequantized by transformers equal
    encode -> decode of the fine-tuned float weights; transformers' from_pretrained reads the
    saved checkpoint into those values."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    import moeshard
    from moeshard.io.quant import read_quant_configs, recognize

    fx = quant_fixtures.WRITERS["mxfp4"](str(tmp_path / "src"))
    model = _fine_tuned(fx, str(tmp_path))
    out = str(tmp_path / "out")
    rep = moeshard.save(model, out, quantize="source", reference=fx.path)
    _check_layout(fx, out)
    packed = recognize(*read_quant_configs(fx.path), moeshard.CheckpointIndex.open(fx.path).tensors)
    saved = _tensors(out)
    state = dict(model.named_parameters())
    worst = 0.0
    for key, pw in packed.items():
        w = state[key].detach()
        want = _roundtrip(pw.scheme, w.transpose(-1, -2)).transpose(-1, -2)
        got = convert_moe_packed_tensors(saved[pw.values], saved[pw.scale], dtype=torch.float32)
        assert torch.equal(got, want), key
        assert not torch.equal(saved[pw.values], _tensors(fx.path)[pw.values])  # the fine-tune is in it
        worst = max(worst, (want - w).abs().max().item())
    assert rep.num_requantized == len(packed) > 0
    assert rep.requant_max_abs_error == pytest.approx(worst, rel=1e-6) and worst > 0
    assert 0 < rep.requant_max_rel_error < 1
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for key, pw in packed.items():
        want = _roundtrip(pw.scheme, state[key].detach().transpose(-1, -2)).transpose(-1, -2)
        assert torch.equal(dict(back.named_parameters())[key].detach(), want), key
    src = _tensors(fx.path)
    for name, p in back.named_parameters():  # the rest as the model holds it, in the source's dtype
        if name not in packed:
            assert torch.equal(p, state[name].detach().to(src[name].dtype).float()), name


def test_deepseek_v3_int4_fine_tune_saved_pack_quantized(tmp_path):
    """DeepSeek-V3 with INT4 routed experts: compressed-tensors' own decompression of the saved
    ``weight_packed`` / ``weight_scale`` / ``weight_shape`` equals encode -> decode of the
    fine-tuned float weights."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    import moeshard
    from moeshard.io.quant import read_quant_configs, recognize

    fx = quant_fixtures.WRITERS["int4"](str(tmp_path / "src"))
    model = _fine_tuned(fx, str(tmp_path))
    out = str(tmp_path / "out")
    rep = moeshard.save(model, out, quantize="source", reference=fx.path)
    _check_layout(fx, out)
    packed = recognize(*read_quant_configs(fx.path), moeshard.CheckpointIndex.open(fx.path).tensors)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**quant_fixtures.INT4_WEIGHTS))
    saved = _tensors(out)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for key, pw in packed.items():
        want = _roundtrip(pw.scheme, _expert_weight(state, key))
        got = PackedQuantizationCompressor.decompress(
            {
                "weight_packed": saved[pw.values],
                "weight_scale": saved[pw.scale].float(),
                "weight_shape": saved[pw.shape_key],
            },
            scheme,
        )["weight"]
        assert torch.equal(got, want), key
    assert rep.num_requantized == len(packed) > 0 and rep.requant_max_abs_error > 0


def test_requantize_refused_before_anything_is_written(tmp_path):
    """A source with no quantized weights, a model that keeps its experts packed (nothing float
    to requantize), and quantize without a source are refused, and nothing is written."""
    import moeshard
    import packed_experts

    fx = quant_fixtures.WRITERS["mxfp4"](str(tmp_path / "src"))
    plain = quant_fixtures.write_reference(fx, str(tmp_path / "plain"), torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    with pytest.raises(ValueError, match="holds no MXFP4, NVFP4, INT4 or FP8-channel"):
        moeshard.save(model, tmp_path / "a", quantize="source", reference=plain)
    with pytest.raises(ValueError, match="needs reference="):
        moeshard.save(model, tmp_path / "b", quantize="source")
    with pytest.raises(ValueError, match="quantize='int8'"):
        moeshard.save(model, tmp_path / "c", quantize="int8", reference=fx.path)
    src = str(tmp_path / "packed_src")
    packed_experts.write_mxfp4_checkpoint(src)
    kept = packed_experts.packed_gpt_oss("cpu")
    with pytest.raises(ValueError, match="keeps its experts packed .*gate_up_proj_blocks"):
        moeshard.save(kept, tmp_path / "d", quantize="source", reference=src)
    assert not any((tmp_path / d).exists() for d in "abcd")


@pytest.mark.parametrize("fmt", ["nvfp4", "modelopt-nvfp4", "fp8"])
def test_qwen3_fine_tune_saved_in_its_format(tmp_path, fmt):
    """Qwen3-MoE in compressed-tensors NVFP4, ModelOpt NVFP4 (hf_quant_config.json) and
    compressed-tensors FP8 per channel: the saved values, scales and global scales equal
    moeshard.io.codecs.encode of the fine-tuned float weights in this process, under the source's
    keys, shapes and dtypes, with the source's config files."""
    import moeshard
    from moeshard.io import codecs
    from moeshard.io.quant import read_quant_configs, recognize

    fx = quant_fixtures.WRITERS[fmt](str(tmp_path / "src"))
    model = _fine_tuned(fx, str(tmp_path))
    out = str(tmp_path / "out")
    rep = moeshard.save(model, out, quantize="source", reference=fx.path)
    src, saved = _tensors(fx.path), _tensors(out)
    assert set(saved) == set(src)
    for k, t in src.items():
        assert saved[k].dtype == t.dtype and saved[k].shape == t.shape, k
    configs = read_quant_configs(fx.path)
    assert read_quant_configs(out) == configs
    packed = recognize(*configs, moeshard.CheckpointIndex.open(fx.path).tensors)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for key, pw in packed.items():
        enc = codecs.encode(pw.scheme, state[key] if key in state else _expert_weight(state, key))
        assert torch.equal(
            saved[pw.values].view(torch.uint8), enc.values.reshape(src[pw.values].shape).view(torch.uint8)
        )
        assert torch.equal(saved[pw.scale].float(), enc.scale.reshape(src[pw.scale].shape).float()), key
        if pw.global_scale is not None:
            assert torch.equal(saved[pw.global_scale], enc.global_scale.reshape(src[pw.global_scale].shape)), key
    assert rep.num_requantized == len(packed) > 0 and rep.requant_max_abs_error > 0
