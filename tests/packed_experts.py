"""Tiny models that keep their experts packed, as serving engines and a frozen quantized base
under LoRA hold them, and the checkpoints they come from (helper module, not a test file).

gpt-oss in MXFP4: each ``mlp.experts`` is a :class:`PackedGptOssExperts` whose parameters ARE
the checkpoint's tensors (``gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]``,
``gate_up_proj_scales`` uint8 ``[E, 2I, H/32]`` (E8M0), ``down_proj_blocks`` ``[E, H, I/32, 16]``,
``down_proj_scales`` ``[E, H, I/32]``, the float biases), the layout transformers'
``Mxfp4GptOssExperts`` is loaded from before it swizzles them for its triton kernels.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

import hf_families

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class PackedGptOssExperts(nn.Module):
    """gpt-oss experts kept in MXFP4: the packed blocks and E8M0 scales as stored, frozen."""

    def __init__(self, config, device=None):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.num_experts = e

        def frozen(*shape, dtype=torch.uint8):
            # requires_grad=False: packed bytes take no gradient (a frozen quantized base)
            return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)

        self.gate_up_proj_blocks = frozen(e, 2 * i, h // 32, 16)
        self.gate_up_proj_scales = frozen(e, 2 * i, h // 32)
        self.gate_up_proj_bias = frozen(e, 2 * i, dtype=torch.bfloat16)
        self.down_proj_blocks = frozen(e, h, i // 32, 16)
        self.down_proj_scales = frozen(e, h, i // 32)
        self.down_proj_bias = frozen(e, h, dtype=torch.bfloat16)


def packed_gpt_oss(device: str = "meta") -> nn.Module:
    """The tiny gpt-oss (bf16, as released) with every ``mlp.experts`` kept packed
    (:class:`PackedGptOssExperts`)."""
    model = hf_families.build("gpt_oss", dtype=torch.bfloat16, device=device)
    for name, _ in list(model.named_modules()):
        if name.endswith("mlp.experts"):
            model.set_submodule(name, PackedGptOssExperts(model.config, device=device))
    return model


def write_mxfp4_checkpoint(path: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A gpt-oss checkpoint with MXFP4 experts (random codes, scales 2^-3 .. 2^2), as the
    released ones are laid out (``quantization_config.quant_method == "mxfp4"``); returns its
    tensors."""
    model = hf_families.build("gpt_oss")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in model.state_dict().items():
        module, _, attr = name.rpartition(".")
        if module.endswith("mlp.experts") and attr in ("gate_up_proj", "down_proj"):
            rows, cols = p.shape[2], p.shape[1]  # stored [E, out, in]: the parameter transposed
            e = p.shape[0]
            tensors[f"{name}_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            tensors[f"{name}_scales"] = torch.randint(124, 130, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
        else:
            tensors[name] = (p.detach() + 0.1 * torch.randn(p.shape, generator=g)).to(torch.bfloat16)
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    _write(path, tensors, config)
    return tensors


INT4_GROUP = 16  # the tiny DeepSeek-V3's intermediate size is 16 (Kimi-K2-Thinking: 32)


class CompressedExperts(nn.Module):
    """HF-style experts kept in compressed-tensors' ``pack-quantized`` INT4 (Kimi-K2-Thinking's
    routed experts): ``gate_up_proj_weight_packed`` int32 ``[E, 2I, H/8]`` (gate then up rows,
    eight 4-bit values per int32), ``gate_up_proj_weight_scale`` bf16 ``[E, 2I, H/16]``,
    ``gate_up_proj_weight_shape`` int64 ``[E, 4]`` (gate's ``[I, H]`` then up's), ``down_proj_*``
    likewise (``[E, H, I/8]``, ``[E, H, I/16]``, ``[E, 2]``): the tensors of each expert's
    ``CompressedLinear`` (``run_compressed``) stacked, frozen."""

    def __init__(self, config, device=None):
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = e

        def frozen(*shape, dtype):
            return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)

        self.gate_up_proj_weight_packed = frozen(e, 2 * i, h // 8, dtype=torch.int32)
        self.gate_up_proj_weight_scale = frozen(e, 2 * i, h // INT4_GROUP, dtype=torch.bfloat16)
        self.gate_up_proj_weight_shape = frozen(e, 4, dtype=torch.int64)
        self.down_proj_weight_packed = frozen(e, h, i // 8, dtype=torch.int32)
        self.down_proj_weight_scale = frozen(e, h, i // INT4_GROUP, dtype=torch.bfloat16)
        self.down_proj_weight_shape = frozen(e, 2, dtype=torch.int64)


def compressed_deepseek_v3(device: str = "meta") -> nn.Module:
    """The tiny DeepSeek-V3 (bf16) with every routed ``mlp.experts`` kept compressed
    (:class:`CompressedExperts`)."""
    import transformers

    import tiny_hf

    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(tiny_hf.config("deepseek_v3"))
            for name, _ in list(model.named_modules()):
                if name.endswith("mlp.experts"):
                    model.set_submodule(name, CompressedExperts(model.config, device=device))
    finally:
        torch.set_default_dtype(old)
    return model


def int4_quantize(w: torch.Tensor, group: int = INT4_GROUP) -> dict[str, torch.Tensor]:
    """compressed-tensors' ``pack-quantized`` tensors of float ``w`` ``[R, C]`` (symmetric INT4,
    one bf16 scale per ``group`` values, packed by compressed-tensors itself)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    r, c = w.shape
    g = w.float().reshape(r, c // group, group)
    scale = (g.abs().amax(-1, keepdim=True) / 7).clamp(min=1e-4).to(torch.bfloat16)
    q = torch.round(g / scale.float()).clamp(-8, 7).to(torch.int8).reshape(r, c)
    return {
        "weight_packed": pack_to_int32(q, 4),
        "weight_scale": scale.reshape(r, c // group),
        "weight_shape": torch.tensor([r, c], dtype=torch.int64),
    }


def write_int4_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3 checkpoint whose routed experts are compressed-tensors ``pack-quantized``
    INT4 (Kimi-K2-Thinking's layout: ``experts.{e}.<proj>.weight_packed`` / ``weight_scale`` /
    ``weight_shape``), the rest bf16; returns its tensors."""
    from safetensors.torch import load_file

    import tiny_hf

    tmp = path + ".float"
    tiny_hf.save_checkpoint("deepseek_v3", tmp)
    tensors = {}
    for f in sorted(os.listdir(tmp)):
        if f.endswith(".safetensors"):
            for k, t in load_file(os.path.join(tmp, f)).items():
                if ".mlp.experts." in k and k.endswith("_proj.weight"):
                    base = k.removesuffix(".weight")
                    tensors.update({f"{base}.{n}": v for n, v in int4_quantize(t).items()})
                else:
                    # The router stays float32 in a bf16 model (_keep_in_fp32_modules), as released.
                    keep = not t.is_floating_point() or ".mlp.gate." in k
                    tensors[k] = t if keep else t.to(torch.bfloat16)
    with open(os.path.join(tmp, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": INT4_GROUP,
                },
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp.gate$", "re:model.layers.0.mlp.*"],
    }
    _write(path, tensors, config)
    import shutil

    shutil.rmtree(tmp)
    return tensors


def _write(path: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """``tensors`` in two safetensors shards with an index, and ``config.json``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    keys = sorted(tensors)
    half = len(keys) // 2
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for name, part in zip(names, (keys[:half], keys[half:])):
        save_file({k: tensors[k].contiguous() for k in part}, os.path.join(path, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: names[i >= half] for i, k in enumerate(keys)}}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


class StoredExperts(nn.Module):
    """HF-style experts kept as a checkpoint stores them: one frozen parameter per expert
    parameter of ``spec`` (:mod:`moeshard.models.adapters`), ``[E, *parts concatenated along
    dim 0]`` (a 0-d part: ``[E]``), of the checkpoint's dtype (shapes from expert 0 of
    ``prefix`` in ``tensors``)."""

    def __init__(self, spec, tensors: dict[str, torch.Tensor], prefix: str, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        for p in spec.params:
            parts = [tensors[k] for k in p.keys(prefix, 0)]
            one = parts[0] if parts[0].dim() == 0 else torch.cat(parts)
            t = torch.zeros((num_experts, *one.shape), dtype=one.dtype)
            self.register_parameter(p.name, nn.Parameter(t, requires_grad=False))


def stored_spec(fmt: str):
    """The spec of the experts a Qwen3-MoE in quant_fixtures format ``fmt`` keeps as stored:
    compressed-tensors NVFP4, ModelOpt NVFP4, or FP8 per channel (``gate_up_proj`` float8 and its
    ``gate_up_proj_scale`` ``[E, 2I, 1]``, transformers' FP8 experts' naming)."""
    from moeshard.models import adapters

    if fmt == "nvfp4":
        return adapters.COMPRESSED_EXPERTS[0]
    if fmt == "modelopt-nvfp4":
        return adapters.MODELOPT_EXPERTS
    assert fmt == "fp8", fmt
    return adapters.with_scales(adapters.HF_EXPERTS, {"gate_up_proj_scale", "down_proj_scale"})


def stored_qwen3(fmt: str, path: str) -> nn.Module:
    """The Qwen3-MoE of quant_fixtures checkpoint ``path`` (format ``fmt``), bf16, every
    ``mlp.experts`` a :class:`StoredExperts` of :func:`stored_spec`, on the meta device."""
    import transformers
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, f)))
    config = transformers.AutoConfig.from_pretrained(path)
    config.quantization_config = None
    spec = stored_spec(fmt)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for name, _ in list(model.named_modules()):
        if name.endswith("mlp.experts"):
            with torch.device("meta"):
                model.set_submodule(name, StoredExperts(spec, tensors, name, config.num_experts))
    return model
