"""Ready :class:`~moeshard.plan.refit.EngineLayout`\\ s: vLLM's tensor names and shapes for
Qwen3-MoE, DeepSeek-V3 (MLA) and Mixtral, filled from a transformers-built trainer (its
parameter names: ``gate_up_proj [E, 2I, H]`` experts with gate first, as transformers keeps
them).

vLLM's layers, as the descriptions follow them:

* ``VocabParallelEmbedding`` / ``ParallelLMHead``: rows split over TP after padding the
  vocabulary to a multiple of 64 (``pad_to``);
* ``QKVParallelLinear`` (``qkv_proj``) and ``MergedColumnParallelLinear`` (``gate_up_proj``):
  each fused part split over TP on dim 0, rank r holding ``[q_r; k_r; v_r]``;
  DeepSeek-V3's ``fused_qkv_a_proj`` (``q_a_proj`` + ``kv_a_proj_with_mqa``) is not split
  (``disable_tp``);
* ``ColumnParallelLinear`` (``q_b_proj``, ``kv_b_proj``): dim 0 split; ``RowParallelLinear``
  (``o_proj``, ``down_proj``): dim 1 split; norms, routers (``ReplicatedLinear``) and
  ``e_score_correction_bias``: whole on every rank;
* ``FusedMoE``: ``w13_weight [local_experts, 2I, H]`` (gate then up), ``w2_weight
  [local_experts, H, I]``; with expert parallelism (``ep`` = the engine ranks) each rank holds
  its slots of the engine's placement whole; without, every slot split over TP like
  ``gate_up_proj`` / ``down_proj``.

Key/value heads must split evenly over TP (vLLM replicates them when TP exceeds their count: not
described here). Pure and torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .refit import EngineLayout, EngineTensor, Segment

__all__ = ["vllm_qwen3_moe", "vllm_mixtral", "vllm_deepseek_v3", "VOCAB_PAD"]

VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def _halves(source: str) -> tuple[Segment, Segment]:
    return Segment(source, (0, 2)), Segment(source, (1, 2))


def _ends(dtype: str | None) -> list[EngineTensor]:
    return [
        EngineTensor(
            "model.embed_tokens.weight",
            (Segment("model.embed_tokens.weight"),),
            shard_dim=0,
            pad_to=VOCAB_PAD,
            dtype=dtype,
        ),
        EngineTensor("model.norm.weight", (Segment("model.norm.weight"),), dtype=dtype),
        EngineTensor("lm_head.weight", (Segment("lm_head.weight"),), shard_dim=0, pad_to=VOCAB_PAD, dtype=dtype),
    ]


def _norms(i: int, dtype: str | None) -> list[EngineTensor]:
    p = f"model.layers.{i}"
    return [
        EngineTensor(f"{p}.{n}.weight", (Segment(f"{p}.{n}.weight"),), group=i, dtype=dtype)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]


def _gqa(i: int, dtype: str | None, qk_norm: bool) -> list[EngineTensor]:
    p = f"model.layers.{i}.self_attn"
    out = [
        EngineTensor(
            f"{p}.qkv_proj.weight",
            tuple(Segment(f"{p}.{n}_proj.weight") for n in "qkv"),
            shard_dim=0,
            group=i,
            dtype=dtype,
        ),
        EngineTensor(f"{p}.o_proj.weight", (Segment(f"{p}.o_proj.weight"),), shard_dim=1, group=i, dtype=dtype),
    ]
    if qk_norm:
        out += [
            EngineTensor(f"{p}.{n}.weight", (Segment(f"{p}.{n}.weight"),), group=i, dtype=dtype)
            for n in ("q_norm", "k_norm")
        ]
    return out


def _experts(i: int, row: int, trainer: str, engine: str, dtype: str | None) -> list[EngineTensor]:
    return [
        EngineTensor(
            f"{engine}.w13_weight", _halves(f"{trainer}.gate_up_proj"), shard_dim=0, moe_layer=row, group=i, dtype=dtype
        ),
        EngineTensor(
            f"{engine}.w2_weight", (Segment(f"{trainer}.down_proj"),), shard_dim=1, moe_layer=row, group=i, dtype=dtype
        ),
    ]


def _mlp(i: int, trainer: str, engine: str, dtype: str | None) -> list[EngineTensor]:
    return [
        EngineTensor(
            f"{engine}.gate_up_proj.weight",
            (Segment(f"{trainer}.gate_proj.weight"), Segment(f"{trainer}.up_proj.weight")),
            shard_dim=0,
            group=i,
            dtype=dtype,
        ),
        EngineTensor(
            f"{engine}.down_proj.weight", (Segment(f"{trainer}.down_proj.weight"),), shard_dim=1, group=i, dtype=dtype
        ),
    ]


def _layout(tensors, ranks: Sequence[int], tp: int, ep: int, phy2log) -> EngineLayout:
    p2l = None if phy2log is None else np.asarray(phy2log, np.int64)
    return EngineLayout(tuple(tensors), tuple(int(r) for r in ranks), tp, ep, p2l)


def vllm_qwen3_moe(
    num_layers: int, ranks: Sequence[int], *, tp: int, ep: int = 1, phy2log=None, dtype: str | None = None
) -> EngineLayout:
    """vLLM's Qwen3-MoE (``Qwen3MoeForCausalLM``, every decoder layer MoE) on engine ``ranks``
    (refit group ranks), TP ``tp``, EP ``ep`` (1 or ``len(ranks)``), the engine's placement
    ``phy2log`` ``int64[num_layers, num_physical]``, engine dtype name ``dtype`` (None: the
    trainer's)."""
    t = _ends(dtype)
    for i in range(num_layers):
        t += _gqa(i, dtype, qk_norm=True) + _norms(i, dtype)
        p = f"model.layers.{i}.mlp"
        t.append(EngineTensor(f"{p}.gate.weight", (Segment(f"{p}.gate.weight"),), group=i, dtype=dtype))
        t += _experts(i, i, f"{p}.experts", f"{p}.experts", dtype)
    return _layout(t, ranks, tp, ep, phy2log)


def vllm_mixtral(
    num_layers: int, ranks: Sequence[int], *, tp: int, ep: int = 1, phy2log=None, dtype: str | None = None
) -> EngineLayout:
    """vLLM's Mixtral (``MixtralForCausalLM``: ``block_sparse_moe.gate`` and
    ``block_sparse_moe.experts``); arguments as :func:`vllm_qwen3_moe`'s."""
    t = _ends(dtype)
    for i in range(num_layers):
        t += _gqa(i, dtype, qk_norm=False) + _norms(i, dtype)
        p, e = f"model.layers.{i}.mlp", f"model.layers.{i}.block_sparse_moe"
        t.append(EngineTensor(f"{e}.gate.weight", (Segment(f"{p}.gate.weight"),), group=i, dtype=dtype))
        t += _experts(i, i, f"{p}.experts", f"{e}.experts", dtype)
    return _layout(t, ranks, tp, ep, phy2log)


def vllm_deepseek_v3(
    num_layers: int,
    ranks: Sequence[int],
    *,
    tp: int,
    ep: int = 1,
    phy2log=None,
    first_k_dense: int = 3,
    shared_experts: bool = True,
    dtype: str | None = None,
) -> EngineLayout:
    """vLLM's DeepSeek-V3 (``DeepseekV3ForCausalLM``, MLA with ``q_lora_rank``): layers before
    ``first_k_dense`` dense MLPs, the others MoE (row ``i - first_k_dense`` of ``phy2log``)
    with a shared expert; ``e_score_correction_bias`` with the router. Other arguments as
    :func:`vllm_qwen3_moe`'s."""
    t = _ends(dtype)
    for i in range(num_layers):
        a = f"model.layers.{i}.self_attn"
        t += [
            EngineTensor(
                f"{a}.fused_qkv_a_proj.weight",
                (Segment(f"{a}.q_a_proj.weight"), Segment(f"{a}.kv_a_proj_with_mqa.weight")),
                group=i,
                dtype=dtype,
            ),
            EngineTensor(f"{a}.q_a_layernorm.weight", (Segment(f"{a}.q_a_layernorm.weight"),), group=i, dtype=dtype),
            EngineTensor(f"{a}.q_b_proj.weight", (Segment(f"{a}.q_b_proj.weight"),), shard_dim=0, group=i, dtype=dtype),
            EngineTensor(f"{a}.kv_a_layernorm.weight", (Segment(f"{a}.kv_a_layernorm.weight"),), group=i, dtype=dtype),
            EngineTensor(
                f"{a}.kv_b_proj.weight", (Segment(f"{a}.kv_b_proj.weight"),), shard_dim=0, group=i, dtype=dtype
            ),
            EngineTensor(f"{a}.o_proj.weight", (Segment(f"{a}.o_proj.weight"),), shard_dim=1, group=i, dtype=dtype),
        ]
        t += _norms(i, dtype)
        p = f"model.layers.{i}.mlp"
        if i < first_k_dense:
            t += _mlp(i, p, p, dtype)
            continue
        t += [
            EngineTensor(f"{p}.gate.weight", (Segment(f"{p}.gate.weight"),), group=i, dtype=dtype),
            # The router's bias stays float32 in vLLM, whatever the weights' dtype.
            EngineTensor(f"{p}.gate.e_score_correction_bias", (Segment(f"{p}.gate.e_score_correction_bias"),), group=i),
        ]
        t += _experts(i, i - first_k_dense, f"{p}.experts", f"{p}.experts", dtype)
        if shared_experts:
            t += _mlp(i, f"{p}.shared_experts", f"{p}.shared_experts", dtype)
    return _layout(t, ranks, tp, ep, phy2log)
