"""A Hugging Face ``config.json`` -> the checkpoint headers it implies (no files, no weights).

Supported: DeepSeek-V2/V3 (MLA attention, ``first_k_dense_replace`` dense layers, shared
experts, FP8 block quantization with ``weight_scale_inv``), Qwen3-MoE / Qwen2-MoE and Mixtral.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..dtypes import ITEMSIZE
from ..io.header import TensorInfo
from ..io.index import CheckpointIndex
from ..io.strict_json import load_json

__all__ = ["read_config", "synthetic_index", "num_params"]

# HF's default max_shard_size "5GB" (decimal), as save_pretrained writes checkpoints.
_SHARD_BYTES = 5 * 10**9
_TORCH_DTYPES = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32"}
_WHAT = "config"
# A config is untrusted input: any count or size above these describes no real model and
# would only make planning hang (10**9 layers) or overflow the planner's int64 byte counts.
_MAX_CONFIG_INT = 2**31 - 1
_MAX_TENSORS = 1_000_000  # DeepSeek-V3 (FP8): ~91,000; one maximal safetensors header: ~1,000,000
_MAX_BYTES = 2**48  # 256 TiB; DeepSeek-V3 in BF16: 1.3 TB

Spec = tuple[str, str, tuple[int, ...]]  # (key, safetensors dtype, shape)


def read_config(path: str | os.PathLike) -> dict:
    """Parse a Hugging Face ``config.json`` (ValueError if missing or not a JSON object)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such config file")
    cfg = load_json(p, "not a readable JSON config")  # untrusted: any parse failure names the file
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: a config must be a JSON object")
    return cfg


def _get_int(cfg: dict, *names: str, default: int | None = None) -> int:
    for name in names:
        v = cfg.get(name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_CONFIG_INT:
                raise ValueError(f"{_WHAT}: {name}={v!r} is not a non-negative integer below 2**31")
            return v
    if default is None:
        raise ValueError(f"{_WHAT}: missing {' / '.join(names)}")
    return default


def _int_set(cfg: dict, name: str) -> set[int]:
    """A list of layer numbers (``mlp_only_layers``), validated."""
    v = cfg.get(name) or []
    if not isinstance(v, list) or not all(type(i) is int for i in v):
        raise ValueError(f"{_WHAT}: {name}={v!r} is not a list of integers")
    return set(v)


def _model_kind(cfg: dict) -> str:
    mt = str(cfg.get("model_type", ""))
    if mt in ("deepseek_v3", "deepseek_v2") or "n_routed_experts" in cfg:
        return "deepseek"
    if mt == "mixtral" or "num_local_experts" in cfg:
        return "mixtral"
    if mt in ("qwen3_moe", "qwen2_moe") or "num_experts" in cfg:
        return "qwen2_moe" if mt == "qwen2_moe" else "qwen3_moe"
    raise ValueError(
        f"config: model_type {mt!r} has no routed-expert count (n_routed_experts / num_experts / "
        "num_local_experts): not a MoE model"
    )


class _Specs:
    """Tensor specs in save order, in the config's dtype. FP8 block-quantized checkpoints
    (DeepSeek-V3's release) store every projection in fp8 with an fp32 scale per block;
    routers, embeddings and norms stay in the model dtype."""

    def __init__(self, cfg: dict) -> None:
        self.dtype = _TORCH_DTYPES.get(str(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))), "BF16")
        qc = cfg.get("quantization_config")
        qc = qc if isinstance(qc, dict) else {}
        self.fp8 = qc.get("quant_method") == "fp8"
        self.qdtype = ("F8_E5M2" if qc.get("fmt") == "e5m2" else "F8_E4M3") if self.fp8 else self.dtype
        block = (qc.get("weight_block_size") or [128, 128]) if self.fp8 else None
        if self.fp8 and not (
            isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ValueError(f"config: quantization_config.weight_block_size={block!r} is not two positive integers")
        self.block = block
        self.out: list[Spec] = []

    def _add(self, spec: Spec) -> None:
        if len(self.out) >= _MAX_TENSORS:
            raise ValueError(f"{_WHAT}: describes more than {_MAX_TENSORS:,} tensors (layers x experts too large)")
        self.out.append(spec)

    def lin(self, key: str, rows: int, cols: int, quantized: bool = True) -> None:
        """A projection ``key.weight [rows, cols]`` (plus its block scales when quantized)."""
        if quantized and self.fp8:
            self._add((f"{key}.weight", self.qdtype, (rows, cols)))
            self._add((f"{key}.weight_scale_inv", "F32", (-(-rows // self.block[0]), -(-cols // self.block[1]))))
        else:
            self._add((f"{key}.weight", self.dtype, (rows, cols)))

    def vec(self, key: str, n: int, dt: str | None = None) -> None:
        self._add((key, dt or self.dtype, (n,)))

    def mlp(self, prefix: str, inter: int, hidden: int) -> None:
        """A gated MLP: ``gate_proj``, ``up_proj`` ``[inter, hidden]``, ``down_proj`` ``[hidden, inter]``."""
        self.lin(f"{prefix}.gate_proj", inter, hidden)
        self.lin(f"{prefix}.up_proj", inter, hidden)
        self.lin(f"{prefix}.down_proj", hidden, inter)


def _deepseek_layers(cfg: dict, s: _Specs, H: int, L: int, heads: int) -> None:
    """DeepSeek-V2/V3 decoder layers: MLA attention, dense first layers, routed + shared experts."""
    E = _get_int(cfg, "n_routed_experts")
    mI = _get_int(cfg, "moe_intermediate_size")
    dI = _get_int(cfg, "intermediate_size")
    q_lora = _get_int(cfg, "q_lora_rank", default=0)
    kv_lora = _get_int(cfg, "kv_lora_rank")
    rope = _get_int(cfg, "qk_rope_head_dim")
    nope = _get_int(cfg, "qk_nope_head_dim")
    v_dim = _get_int(cfg, "v_head_dim")
    n_shared = _get_int(cfg, "n_shared_experts", default=0)
    first_dense = _get_int(cfg, "first_k_dense_replace", default=0)
    freq = max(1, _get_int(cfg, "moe_layer_freq", default=1))
    bias = cfg.get("model_type") == "deepseek_v3" or cfg.get("topk_method") == "noaux_tc"
    for i in range(L):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if q_lora:
            s.lin(f"{a}.q_a_proj", q_lora, H)
            s.vec(f"{a}.q_a_layernorm.weight", q_lora)
            s.lin(f"{a}.q_b_proj", heads * (nope + rope), q_lora)
        else:
            s.lin(f"{a}.q_proj", heads * (nope + rope), H)
        s.lin(f"{a}.kv_a_proj_with_mqa", kv_lora + rope, H)
        s.vec(f"{a}.kv_a_layernorm.weight", kv_lora)
        s.lin(f"{a}.kv_b_proj", heads * (nope + v_dim), kv_lora)
        s.lin(f"{a}.o_proj", H, heads * v_dim)
        s.vec(f"{p}.input_layernorm.weight", H)
        s.vec(f"{p}.post_attention_layernorm.weight", H)
        m = f"{p}.mlp"
        if E and i >= first_dense and i % freq == 0:
            s.lin(f"{m}.gate", E, H, quantized=False)
            if bias:
                s.vec(f"{m}.gate.e_score_correction_bias", E, "F32")
            for e in range(E):
                s.mlp(f"{m}.experts.{e}", mI, H)
            if n_shared:
                s.mlp(f"{m}.shared_experts", mI * n_shared, H)
        else:
            s.mlp(m, dI, H)


def _qwen_mixtral_layers(cfg: dict, s: _Specs, kind: str, H: int, L: int, heads: int) -> None:
    """Qwen3-MoE / Qwen2-MoE / Mixtral decoder layers: GQA attention, routed experts (plus
    Qwen2-MoE's gated shared expert), dense ``mlp_only_layers`` / ``decoder_sparse_step``."""
    mixtral = kind == "mixtral"
    E = _get_int(cfg, "num_local_experts" if mixtral else "num_experts")
    kv = _get_int(cfg, "num_key_value_heads", default=heads)
    hd = _get_int(cfg, "head_dim", default=0) or H // heads
    mI = _get_int(cfg, "intermediate_size" if mixtral else "moe_intermediate_size")
    dI = _get_int(cfg, "intermediate_size")
    step = max(1, _get_int(cfg, "decoder_sparse_step", default=1))
    dense_layers = _int_set(cfg, "mlp_only_layers")
    qkv_bias = bool(cfg.get("qkv_bias", kind == "qwen2_moe")) or bool(cfg.get("attention_bias", False))
    for i in range(L):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        for name, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            s.lin(f"{a}.{name}", rows, H)
            if qkv_bias:
                s.vec(f"{a}.{name}.bias", rows)
        s.lin(f"{a}.o_proj", H, heads * hd)
        if kind == "qwen3_moe":
            s.vec(f"{a}.q_norm.weight", hd)
            s.vec(f"{a}.k_norm.weight", hd)
        s.vec(f"{p}.input_layernorm.weight", H)
        s.vec(f"{p}.post_attention_layernorm.weight", H)
        if mixtral:
            m = f"{p}.block_sparse_moe"
            s.lin(f"{m}.gate", E, H, quantized=False)
            for e in range(E):
                s.lin(f"{m}.experts.{e}.w1", mI, H)
                s.lin(f"{m}.experts.{e}.w2", H, mI)
                s.lin(f"{m}.experts.{e}.w3", mI, H)
            continue
        m = f"{p}.mlp"
        if E and i not in dense_layers and (i + 1) % step == 0:
            s.lin(f"{m}.gate", E, H, quantized=False)
            for e in range(E):
                s.mlp(f"{m}.experts.{e}", mI, H)
            sI = _get_int(cfg, "shared_expert_intermediate_size", default=0)
            if sI:
                s.mlp(f"{m}.shared_expert", sI, H)
                s.lin(f"{m}.shared_expert_gate", 1, H, quantized=False)
        else:
            s.mlp(m, dI, H)


def _tensor_specs(cfg: dict) -> list[Spec]:
    """``[(key, dtype, shape)]`` of the checkpoint a config describes, in save order."""
    kind = _model_kind(cfg)
    s = _Specs(cfg)
    H = _get_int(cfg, "hidden_size")
    V = _get_int(cfg, "vocab_size")
    L = _get_int(cfg, "num_hidden_layers")
    heads = _get_int(cfg, "num_attention_heads")
    if not (H and V and L and heads):
        raise ValueError("config: hidden_size, vocab_size, num_hidden_layers and num_attention_heads must be > 0")
    s.out.append(("model.embed_tokens.weight", s.dtype, (V, H)))
    if kind == "deepseek":
        _deepseek_layers(cfg, s, H, L, heads)
    else:
        _qwen_mixtral_layers(cfg, s, kind, H, L, heads)
    s.vec("model.norm.weight", H)
    if not cfg.get("tie_word_embeddings", False):
        s.out.append(("lm_head.weight", s.dtype, (V, H)))
    return s.out


def synthetic_index(cfg: dict, root: str = "<synthetic>", shard_bytes: int = _SHARD_BYTES) -> CheckpointIndex:
    """Checkpoint headers (no files) of the model ``cfg`` describes, laid out as
    ``save_pretrained`` writes it: tensors in module order, shards of at most ``shard_bytes``,
    per-expert keys (``...experts.{e}.gate_proj.weight``).

    DeepSeek-V3's multi-token-prediction layer is not synthesized (transformers does not
    load it).
    """
    files: list[list[tuple[str, str, tuple[int, ...], int]]] = [[]]
    size = total = 0
    for key, dt, shape in _tensor_specs(cfg):
        nbytes = math.prod(shape) * ITEMSIZE[dt]
        total += nbytes
        if total > _MAX_BYTES:
            raise ValueError(f"{_WHAT}: describes a checkpoint of more than 2**48 bytes (256 TiB): sizes too large")
        if files[-1] and size + nbytes > shard_bytes:
            files.append([])
            size = 0
        files[-1].append((key, dt, shape, nbytes))
        size += nbytes
    tensors: dict[str, TensorInfo] = {}
    file_sizes: dict[str, int] = {}
    for j, entries in enumerate(files):
        name = f"model-{j + 1:05d}-of-{len(files):05d}.safetensors"
        # A safetensors header is ~100 bytes of JSON per tensor; only the order matters here.
        offset = 8 + 128 * len(entries)
        for key, dt, shape, nbytes in entries:
            tensors[key] = TensorInfo(name, offset, dt, shape)
            offset += nbytes
        file_sizes[name] = offset
    return CheckpointIndex(root, tensors, file_sizes)


def num_params(index: CheckpointIndex) -> int:
    """Model parameters in a checkpoint (FP8 block scales not counted)."""
    return sum(math.prod(t.shape) for k, t in index.tensors.items() if not k.endswith("_scale_inv"))
