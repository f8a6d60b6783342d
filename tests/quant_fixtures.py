"""Tiny REAL quantized MoE checkpoints, written by the tests themselves, and the reference float
state dict of each, computed by the INDEPENDENT dequantizer of its format (never moeshard's):

* :func:`write_gpt_oss`: gpt-oss, routed experts MXFP4 as gpt-oss ships them
  (``experts.gate_up_proj_blocks`` U8 ``[E, 2I, H/32, 16]`` + ``_scales`` U8 E8M0, biases and
  everything else bf16), config.json ``quantization_config.quant_method = "mxfp4"``; reference:
  transformers' ``convert_moe_packed_tensors`` (which also transposes to the model's ``[E, H, 2I]``);
* :func:`write_deepseek_int4`: DeepSeek-V3 with routed experts compressed-tensors
  ``pack-quantized`` INT4, group 32, per expert (Kimi-K2-Thinking's layout: ``weight_packed``
  I32, ``weight_scale`` BF16, ``weight_shape`` I64; shared experts, the dense first layer and
  attention bf16); reference: compressed-tensors' own decompression;
* :func:`write_qwen3_nvfp4`: Qwen3-MoE, experts compressed-tensors ``nvfp4-pack-quantized``
  (``weight_packed`` U8, ``weight_scale`` F8_E4M3 per 16, ``weight_global_scale``,
  ``input_global_scale``); ``dense=True`` quantizes attention projections too; reference:
  compressed-tensors' unpacking and dequantize;
* :func:`write_qwen3_modelopt_nvfp4`: Qwen3-MoE, experts ModelOpt NVFP4 (``hf_quant_config.json``;
  ``weight`` U8 packed by hand here, ``weight_scale`` F8_E4M3, ``weight_scale_2`` F32 ``[]``,
  ``input_scale``); reference: ``value x weight_scale x weight_scale_2`` computed here exactly in
  float64 and rounded once;
* :func:`write_qwen3_fp8`: Qwen3-MoE, experts compressed-tensors ``float-quantized`` FP8 per
  output channel (``weight`` F8_E4M3, ``weight_scale`` BF16 ``[R, 1]``); reference:
  compressed-tensors' dequantize.

Qwen3-MoE and DeepSeek-V3 are per expert on disk (``experts.<e>.gate_proj.weight_packed``...), as
their published checkpoints are. Sizes: hidden and (moe) intermediate 64, so that groups of 16 and
32 divide every packed dim and an expert-FSDP=2 half (32 rows or columns) stays on whole groups.
Two shards with an index; the scales of the last layer sit in the first shard, away from their
values. Each writer returns a :class:`Fixture`; :func:`write_reference` writes its reference as a
plain float checkpoint (the same model, nothing quantized), for tests that compare a quantized
load against a float load. A helper module, not a test file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

import tiny_hf

__all__ = [
    "Fixture",
    "HIDDEN",
    "INTERMEDIATE",
    "write_gpt_oss",
    "write_deepseek_int4",
    "write_qwen3_nvfp4",
    "write_qwen3_modelopt_nvfp4",
    "write_qwen3_fp8",
    "WRITERS",
    "write_reference",
]

HIDDEN = 64
INTERMEDIATE = 64
NUM_EXPERTS = 8
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class Fixture:
    """A quantized checkpoint at ``path`` and its ``reference``: ``{key: float32 tensor}`` in the
    layout of the same model's plain float checkpoint (gpt-oss: ``experts.gate_up_proj``
    ``[E, H, 2I]``; others: ``experts.<e>.gate_proj.weight`` ``[I, H]``), every value the
    independent dequantizer's (unquantized tensors: their stored bf16 values). ``quantized``:
    the reference keys that are stored quantized; ``config``: the model's transformers config
    (no quantization); ``fmt``: "mxfp4" | "int4" | "nvfp4" | "modelopt-nvfp4" | "fp8"."""

    path: str
    reference: dict[str, torch.Tensor]
    quantized: tuple[str, ...]
    config: object
    fmt: str


# -- shared plumbing -----------------------------------------------------------------------------


def _config(family: str):
    if family == "gpt_oss":
        import transformers

        return transformers.GptOssConfig(
            vocab_size=tiny_hf.VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=INTERMEDIATE,
            num_hidden_layers=2,
            num_local_experts=NUM_EXPERTS,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            sliding_window=8,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        )
    cfg = tiny_hf.config(family)
    cfg.hidden_size = HIDDEN
    cfg.moe_intermediate_size = INTERMEDIATE
    cfg.intermediate_size = 2 * INTERMEDIATE
    return cfg


def _float_state(cfg, seed: int) -> dict[str, torch.Tensor]:
    """The on-disk float state dict of a random model of ``cfg`` (``save_pretrained``'s keys
    and shapes: per expert where the family saves per expert), bf16 but for fp32 buffers."""
    import tempfile

    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        state = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                state.update(load_file(os.path.join(d, f)))
    return {k: (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)) for k, v in state.items()}


def _save(path: str, cfg, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> None:
    """Two safetensors shards + index (the last layer's scales in the first shard) and config.json."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    last = f"layers.{cfg.num_hidden_layers - 1}."
    is_scale = ("_scale", "_scales", "_scale_2", "_global_scale", "weight_shape")

    def shard(k: str) -> int:
        if last in k:
            return 0 if k.endswith(is_scale) else 1
        return 0

    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    parts: list[dict] = [{}, {}]
    for k, v in tensors.items():
        parts[shard(k)][k] = v.contiguous()
    for name, part in zip(names, parts):
        save_file(part, os.path.join(path, name), metadata={"format": "pt"})
    weight_map = {k: names[shard(k)] for k in sorted(tensors)}
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg_dict = json.loads(cfg.to_json_string())
    cfg_dict["torch_dtype"] = cfg_dict["dtype"] = "bfloat16"
    if quantization_config is not None:
        cfg_dict["quantization_config"] = quantization_config
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2)


def _routed(key: str, v: torch.Tensor) -> bool:
    """A routed expert's projection weight (not a shared expert's, not the router's)."""
    return ".mlp.experts." in key and key.endswith("_proj.weight") and v.dim() == 2


def _attn(key: str, v: torch.Tensor) -> bool:
    return ".self_attn." in key and key.endswith("_proj.weight") and v.dim() == 2


def _fp8_codes(shape, gen, lo: float, hi: float) -> torch.Tensor:
    """Positive float8_e4m3fn values spread over [lo, hi] (scales)."""
    return (lo + (hi - lo) * torch.rand(shape, generator=gen)).to(torch.float8_e4m3fn)


def _e2m1_values(shape, gen) -> torch.Tensor:
    """Random E2M1-representable float32 values (sign x {0 .. 6})."""
    mag = torch.tensor(E2M1)[torch.randint(0, 8, shape, generator=gen)]
    return torch.where(torch.rand(shape, generator=gen) < 0.5, -mag, mag)


# -- (a) gpt-oss MXFP4 -------------------------------------------------------------------------


def write_gpt_oss(path: str, seed: int = 0) -> Fixture:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = _config("gpt_oss")
    state = _float_state(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    tensors, reference, quantized = {}, {}, []
    for k, v in state.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, c, r = v.shape  # [E, H, 2I]: the values are packed along H, rows are the 2I outputs
            blocks = torch.randint(0, 256, (e, r, c // 32, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(115, 122, (e, r, c // 32), generator=gen, dtype=torch.uint8)
            tensors[k + "_blocks"], tensors[k + "_scales"] = blocks, scales
            reference[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert reference[k].shape == v.shape
            quantized.append(k)
        else:
            tensors[k] = v
            reference[k] = v.float()
    qc = {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    }
    _save(path, cfg, tensors, qc)
    return Fixture(path, reference, tuple(quantized), cfg, "mxfp4")


# -- compressed-tensors --------------------------------------------------------------------------


def _ct_config(fmt: str, weights: dict, input_activations: dict | None, ignore: list[str], targets=("Linear",)) -> dict:
    return {
        "config_groups": {
            "group_0": {
                "format": fmt,
                "input_activations": input_activations,
                "output_activations": None,
                "targets": list(targets),
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    **weights,
                },
            }
        },
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
    }


INT4_WEIGHTS = {"group_size": 32, "num_bits": 4, "strategy": "group", "symmetric": True, "type": "int"}
NVFP4_WEIGHTS = {"group_size": 16, "num_bits": 4, "strategy": "tensor_group", "symmetric": True, "type": "float"}
FP8_WEIGHTS = {"group_size": None, "num_bits": 8, "strategy": "channel", "symmetric": True, "type": "float"}


def write_deepseek_int4(path: str, seed: int = 1) -> Fixture:
    """(b) DeepSeek-V3, routed experts INT4 pack-quantized group 32 (Kimi-K2-Thinking's layout)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    cfg = _config("deepseek_v3")
    state = _float_state(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**INT4_WEIGHTS))
    tensors, reference, quantized = {}, {}, []
    for k, v in state.items():
        if _routed(k, v):
            r, c = v.shape
            codes = torch.randint(-8, 8, (r, c), generator=gen, dtype=torch.int8)
            scale = (0.002 + 0.01 * torch.rand(r, c // 32, generator=gen)).to(torch.bfloat16)
            pre = k[: -len("weight")]
            packed = pack_to_int32(codes, 4)
            tensors[pre + "weight_packed"], tensors[pre + "weight_scale"] = packed, scale
            tensors[pre + "weight_shape"] = torch.tensor([r, c])
            ref = PackedQuantizationCompressor.decompress(
                {"weight_packed": packed, "weight_scale": scale.float(), "weight_shape": torch.tensor([r, c])}, scheme
            )["weight"]
            assert ref.dtype == torch.float32
            reference[k] = ref
            quantized.append(k)
        else:
            tensors[k] = v
            reference[k] = v.float()
    ignore = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
    _save(path, cfg, tensors, _ct_config("pack-quantized", INT4_WEIGHTS, None, ignore))
    return Fixture(path, reference, tuple(quantized), cfg, "int4")


def write_qwen3_nvfp4(path: str, seed: int = 2, dense: bool = False) -> Fixture:
    """(c) Qwen3-MoE, experts (and with ``dense`` the attention projections) NVFP4 compressed-tensors."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    cfg = _config("qwen3_moe")
    state = _float_state(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    args = QuantizationArgs(**NVFP4_WEIGHTS)
    tensors, reference, quantized = {}, {}, []
    for k, v in state.items():
        if _routed(k, v) or (dense and _attn(k, v)):
            r, c = v.shape
            packed = pack_fp4_to_uint8(_e2m1_values((r, c), gen))
            scale = _fp8_codes((r, c // 16), gen, 16.0, 448.0)
            gscale = torch.tensor([6.0 * 448.0 / (0.05 + 0.1 * torch.rand((), generator=gen).item())])
            pre = k[: -len("weight")]
            tensors[pre + "weight_packed"], tensors[pre + "weight_scale"] = packed, scale
            tensors[pre + "weight_global_scale"] = gscale
            tensors[pre + "input_global_scale"] = torch.tensor([123.0])
            q = unpack_fp4_from_uint8(packed, r, c, dtype=torch.float32)
            reference[k] = dequantize(q, scale.float(), args=args, global_scale=gscale, dtype=torch.float32)
            quantized.append(k)
        else:
            tensors[k] = v
            reference[k] = v.float()
    act = {
        **NVFP4_WEIGHTS,
        "dynamic": "local",
        "actorder": None,
        "block_structure": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    ignore = ["lm_head", "re:.*mlp.gate$"] + ([] if dense else ["re:.*self_attn.*"])
    _save(path, cfg, tensors, _ct_config("nvfp4-pack-quantized", NVFP4_WEIGHTS, act, ignore))
    return Fixture(path, reference, tuple(quantized), cfg, "nvfp4")


def write_qwen3_fp8(path: str, seed: int = 4) -> Fixture:
    """(e) Qwen3-MoE, experts FP8 per output channel compressed-tensors (llm-compressor FP8_DYNAMIC)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    cfg = _config("qwen3_moe")
    state = _float_state(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**FP8_WEIGHTS))
    tensors, reference, quantized = {}, {}, []
    for k, v in state.items():
        if _routed(k, v):
            r, c = v.shape
            w = (torch.randn(r, c, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
            scale = (1e-4 + 4e-4 * torch.rand(r, 1, generator=gen)).to(torch.bfloat16)
            tensors[k], tensors[k + "_scale"] = w, scale
            ref = FloatQuantizationCompressor.decompress({"weight": w, "weight_scale": scale.float()}, scheme)["weight"]
            assert ref.dtype == torch.float32
            reference[k] = ref
            quantized.append(k)
        else:
            tensors[k] = v
            reference[k] = v.float()
    act = {"dynamic": True, "group_size": None, "num_bits": 8, "strategy": "token", "symmetric": True, "type": "float"}
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*self_attn.*"]
    _save(path, cfg, tensors, _ct_config("float-quantized", FP8_WEIGHTS, act, ignore))
    return Fixture(path, reference, tuple(quantized), cfg, "fp8")


# -- (d) ModelOpt NVFP4 ------------------------------------------------------------------------


def write_qwen3_modelopt_nvfp4(path: str, seed: int = 3) -> Fixture:
    """(d) Qwen3-MoE, experts ModelOpt NVFP4 (hf_quant_config.json), packed by hand."""
    cfg = _config("qwen3_moe")
    state = _float_state(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    e2m1 = torch.tensor(E2M1, dtype=torch.float64)
    tensors, reference, quantized = {}, {}, []
    for k, v in state.items():
        if _routed(k, v):
            r, c = v.shape
            codes = torch.randint(0, 16, (r, c), generator=gen, dtype=torch.uint8)  # bit 3: sign
            packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # even index in the low nibble
            scale = _fp8_codes((r, c // 16), gen, 16.0, 448.0)
            scale_2 = torch.tensor((0.05 + 0.1 * torch.rand((), generator=gen).item()) / (6.0 * 448.0))
            pre = k[: -len("weight")]
            tensors[k], tensors[pre + "weight_scale"], tensors[pre + "weight_scale_2"] = packed, scale, scale_2
            tensors[pre + "input_scale"] = torch.tensor(0.0125)
            value = e2m1[(codes & 7).long()] * (1.0 - 2.0 * (codes >> 3).double())
            # exact in float64 (2 + 4 + 24 significant bits), rounded once to float32
            reference[k] = (value * scale.double().repeat_interleave(16, dim=1) * scale_2.double()).float()
            quantized.append(k)
        else:
            tensors[k] = v
            reference[k] = v.float()
    _save(path, cfg, tensors, None)
    hf_quant = {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": ["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate"],
        },
    }
    with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
        json.dump(hf_quant, f, indent=2)
    return Fixture(path, reference, tuple(quantized), cfg, "modelopt-nvfp4")


WRITERS = {
    "mxfp4": write_gpt_oss,
    "int4": write_deepseek_int4,
    "nvfp4": write_qwen3_nvfp4,
    "modelopt-nvfp4": write_qwen3_modelopt_nvfp4,
    "fp8": write_qwen3_fp8,
}


def write_reference(fixture: Fixture, path: str, dtype: torch.dtype = torch.float32) -> str:
    """The fixture's reference as a plain ``dtype`` checkpoint at ``path`` (same model, nothing
    quantized, no quantization_config): what a quantized load must equal, value for value, once
    cast to the model's dtype. Returns ``path``."""
    ref = {k: (v if k.endswith("e_score_correction_bias") else v.to(dtype)) for k, v in fixture.reference.items()}
    _save(path, fixture.config, ref, None)
    return path


def corrupt_weight_shape(path: str) -> str:
    """Overwrite, in place, the ``weight_shape`` value of the first INT4 weight of checkpoint
    ``path`` (compressed-tensors ``pack-quantized``) with a shape its packed values do not hold;
    returns that weight's logical key and the value written, as an error prints it."""
    from moeshard.io.index import CheckpointIndex

    index = CheckpointIndex.open(path)
    pw = next(p for _, p in sorted(index.packed.items()) if p.shape_key)
    info = index.tensors[pw.shape_key]
    rows, cols = pw.value_shape[-2:]
    value = np.asarray([rows, cols - 8], dtype="<i4" if info.dtype == "I32" else "<i8")
    with open(os.path.join(path, info.file), "r+b") as f:
        f.seek(info.offset)
        f.write(value.tobytes())
    return pw.key, str(value.tolist())
