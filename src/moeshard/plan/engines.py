"""Ready :class:`~moeshard.plan.refit.EngineLayout`\\ s: vLLM's and sglang's tensor names and
shapes for Qwen3-MoE, DeepSeek-V3 (MLA) and Mixtral, filled from a transformers-built trainer
(its parameter names: ``gate_up_proj [E, 2I, H]`` experts with gate first, as transformers keeps
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

sglang's layers are the same (its linear, embedding and ``FusedMoE`` layers derive from vLLM's,
with the same padding of 64 and the same ``w13_weight`` / ``w2_weight``); its DeepSeek-V3 names
the fused projection ``fused_qkv_a_proj_with_mqa`` and holds the shared expert unfused
(``--disable-shared-experts-fusion``) or, with ``fuse_shared_experts``, as the last local slot of
``w13_weight`` / ``w2_weight`` on every engine rank (a placement without redundant slots only:
see :func:`sglang_deepseek_v3`).

MLA's absorbed weights are not described: vLLM (``W_UK_T`` / ``W_UV`` of its MLA attention) and
sglang (``w_kc`` / ``w_vc``) derive them from ``kv_b_proj`` after loading (a split and a
transpose, dequantized first for FP8): a refit writes ``kv_b_proj``, and the engine's post-load
step must run after it (vLLM: ``process_weights_after_loading``; sglang:
``model.post_load_weights()``).

``quant="fp8"``: the block-FP8 model of the engines' ``Fp8Config`` with ``weight_block_size``
(DeepSeek-V3's release, Qwen3's ``-FP8`` checkpoints): every linear layer and the experts are
``float8_e4m3fn`` with a float32 ``<name>_scale_inv`` per ``block``; embeddings, ``lm_head``,
norms, routers and ``e_score_correction_bias`` stay unquantized. ``dtype`` is then the dtype the
quantized tensors' boxes travel and are staged in (``"bfloat16"``: half the bytes of a float32
trainer's) and the other tensors' dtype. ``scale_suffix`` names the scales (``"_scale_inv"``,
the load-time names; an engine version that renames a scale after loading, e.g. vLLM's linear
``weight_scale``, takes ``"_scale"``). ``scale_fmt="ue8m0"``: power-of-two scales
(DeepSeek-V3.1's ``"scale_fmt": "ue8m0"``, DeepGEMM's on Blackwell), held in float32 or, with
``scale_dtype="float8_e8m0fnu"``, one exponent byte per block.

Key/value heads must split evenly over TP (vLLM replicates them when TP exceeds their count: not
described here). Pure and torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .refit import EngineLayout, EngineTensor, Segment

__all__ = [
    "vllm_qwen3_moe",
    "vllm_mixtral",
    "vllm_deepseek_v3",
    "sglang_qwen3_moe",
    "sglang_mixtral",
    "sglang_deepseek_v3",
    "VOCAB_PAD",
    "FP8_BLOCK",
]

VOCAB_PAD = 64  # vLLM's and sglang's DEFAULT_VOCAB_PADDING_SIZE
FP8_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size


@dataclass(frozen=True)
class _Kind:
    """How a layout's tensors are declared: the engine dtype, whether linear layers and experts
    are block-FP8 (and the block, the scales' suffix)."""

    dtype: str | None
    quant: str | None = None
    block: tuple[int, int] = FP8_BLOCK
    scale_suffix: str = "_scale_inv"
    scale_fmt: str | None = None
    scale_dtype: str = "float32"

    def plain(self, name: str, segments, **kw) -> EngineTensor:
        """A tensor that stays unquantized (norms, routers, embeddings)."""
        return EngineTensor(name, tuple(segments), dtype=self.dtype, **kw)

    def linear(self, name: str, segments, **kw) -> EngineTensor:
        """A linear layer's weight or an expert tensor: block FP8 when the model is."""
        if self.quant is None:
            return self.plain(name, segments, **kw)
        return EngineTensor(
            name,
            tuple(segments),
            dtype=self.dtype,
            quant="fp8_block",
            block=self.block,
            scale_name=name + self.scale_suffix,
            scale_fmt=self.scale_fmt,
            scale_dtype=self.scale_dtype,
            **kw,
        )


def _kind(dtype, quant, block, scale_suffix, scale_fmt=None, scale_dtype="float32") -> _Kind:
    if quant not in (None, "fp8"):
        raise ValueError(f"quant={quant!r}: None or 'fp8' (block FP8)")
    if quant is None and (scale_fmt is not None or scale_dtype != "float32"):
        raise ValueError(f"scale_fmt={scale_fmt!r}, scale_dtype={scale_dtype!r}: for quant='fp8' only")
    q = None if quant is None else "fp8_block"
    return _Kind(dtype, q, tuple(block), scale_suffix, scale_fmt, scale_dtype)


def _halves(source: str) -> tuple[Segment, Segment]:
    return Segment(source, (0, 2)), Segment(source, (1, 2))


def _ends(k: _Kind) -> list[EngineTensor]:
    return [
        k.plain("model.embed_tokens.weight", [Segment("model.embed_tokens.weight")], shard_dim=0, pad_to=VOCAB_PAD),
        k.plain("model.norm.weight", [Segment("model.norm.weight")]),
        k.plain("lm_head.weight", [Segment("lm_head.weight")], shard_dim=0, pad_to=VOCAB_PAD),
    ]


def _norms(i: int, k: _Kind) -> list[EngineTensor]:
    p = f"model.layers.{i}"
    return [
        k.plain(f"{p}.{n}.weight", [Segment(f"{p}.{n}.weight")], group=i)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]


def _gqa(i: int, k: _Kind, qk_norm: bool) -> list[EngineTensor]:
    p = f"model.layers.{i}.self_attn"
    out = [
        k.linear(f"{p}.qkv_proj.weight", [Segment(f"{p}.{n}_proj.weight") for n in "qkv"], shard_dim=0, group=i),
        k.linear(f"{p}.o_proj.weight", [Segment(f"{p}.o_proj.weight")], shard_dim=1, group=i),
    ]
    if qk_norm:
        out += [k.plain(f"{p}.{n}.weight", [Segment(f"{p}.{n}.weight")], group=i) for n in ("q_norm", "k_norm")]
    return out


def _experts(i: int, row: int, trainer: str, engine: str, k: _Kind, shared: str | None = None) -> list[EngineTensor]:
    """A MoE layer's ``w13_weight`` / ``w2_weight``; ``shared``: the trainer's shared expert
    (``...mlp.shared_experts``) held as the last local slot of both (sglang's fusion)."""
    w13, w2 = {}, {}
    if shared is not None:
        w13 = dict(shared=(Segment(f"{shared}.gate_proj.weight"), Segment(f"{shared}.up_proj.weight")))
        w2 = dict(shared=(Segment(f"{shared}.down_proj.weight"),))
    return [
        k.linear(
            f"{engine}.w13_weight", _halves(f"{trainer}.gate_up_proj"), shard_dim=0, moe_layer=row, group=i, **w13
        ),
        k.linear(f"{engine}.w2_weight", [Segment(f"{trainer}.down_proj")], shard_dim=1, moe_layer=row, group=i, **w2),
    ]


def _mlp(i: int, trainer: str, engine: str, k: _Kind) -> list[EngineTensor]:
    return [
        k.linear(
            f"{engine}.gate_up_proj.weight",
            [Segment(f"{trainer}.gate_proj.weight"), Segment(f"{trainer}.up_proj.weight")],
            shard_dim=0,
            group=i,
        ),
        k.linear(f"{engine}.down_proj.weight", [Segment(f"{trainer}.down_proj.weight")], shard_dim=1, group=i),
    ]


def _layout(tensors, ranks: Sequence[int], tp: int, ep: int, phy2log) -> EngineLayout:
    p2l = None if phy2log is None else np.asarray(phy2log, np.int64)
    return EngineLayout(tuple(tensors), tuple(int(r) for r in ranks), tp, ep, p2l)


def _qwen3_moe(num_layers: int, k: _Kind) -> list[EngineTensor]:
    t = _ends(k)
    for i in range(num_layers):
        t += _gqa(i, k, qk_norm=True) + _norms(i, k)
        p = f"model.layers.{i}.mlp"
        t.append(k.plain(f"{p}.gate.weight", [Segment(f"{p}.gate.weight")], group=i))
        t += _experts(i, i, f"{p}.experts", f"{p}.experts", k)
    return t


def _mixtral(num_layers: int, k: _Kind) -> list[EngineTensor]:
    t = _ends(k)
    for i in range(num_layers):
        t += _gqa(i, k, qk_norm=False) + _norms(i, k)
        p, e = f"model.layers.{i}.mlp", f"model.layers.{i}.block_sparse_moe"
        t.append(k.plain(f"{e}.gate.weight", [Segment(f"{p}.gate.weight")], group=i))
        t += _experts(i, i, f"{p}.experts", f"{e}.experts", k)
    return t


def _deepseek_v3(
    num_layers: int, k: _Kind, first_k_dense: int, shared_experts: bool, fused_a: str, fuse_shared: bool = False
):
    t = _ends(k)
    for i in range(num_layers):
        a = f"model.layers.{i}.self_attn"
        t += [
            k.linear(
                f"{a}.{fused_a}.weight",
                [Segment(f"{a}.q_a_proj.weight"), Segment(f"{a}.kv_a_proj_with_mqa.weight")],
                group=i,
            ),
            k.plain(f"{a}.q_a_layernorm.weight", [Segment(f"{a}.q_a_layernorm.weight")], group=i),
            k.linear(f"{a}.q_b_proj.weight", [Segment(f"{a}.q_b_proj.weight")], shard_dim=0, group=i),
            k.plain(f"{a}.kv_a_layernorm.weight", [Segment(f"{a}.kv_a_layernorm.weight")], group=i),
            k.linear(f"{a}.kv_b_proj.weight", [Segment(f"{a}.kv_b_proj.weight")], shard_dim=0, group=i),
            k.linear(f"{a}.o_proj.weight", [Segment(f"{a}.o_proj.weight")], shard_dim=1, group=i),
        ]
        t += _norms(i, k)
        p = f"model.layers.{i}.mlp"
        if i < first_k_dense:
            t += _mlp(i, p, p, k)
            continue
        t += [
            k.plain(f"{p}.gate.weight", [Segment(f"{p}.gate.weight")], group=i),
            # The router's bias stays float32 in both engines, whatever the weights' dtype.
            EngineTensor(
                f"{p}.gate.e_score_correction_bias",
                (Segment(f"{p}.gate.e_score_correction_bias"),),
                group=i,
                dtype="float32",
            ),
        ]
        fused = f"{p}.shared_experts" if shared_experts and fuse_shared else None
        t += _experts(i, i - first_k_dense, f"{p}.experts", f"{p}.experts", k, fused)
        if shared_experts and not fuse_shared:
            t += _mlp(i, f"{p}.shared_experts", f"{p}.shared_experts", k)
    return t


def vllm_qwen3_moe(
    num_layers: int,
    ranks: Sequence[int],
    *,
    tp: int,
    ep: int = 1,
    phy2log=None,
    dtype: str | None = None,
    quant: str | None = None,
    block: tuple[int, int] = FP8_BLOCK,
    scale_suffix: str = "_scale_inv",
    scale_fmt: str | None = None,
    scale_dtype: str = "float32",
) -> EngineLayout:
    """vLLM's Qwen3-MoE (``Qwen3MoeForCausalLM``, every decoder layer MoE) on engine ``ranks``
    (refit group ranks), TP ``tp``, EP ``ep`` (1 or ``len(ranks)``), the engine's placement
    ``phy2log`` ``int64[num_layers, num_physical]``, engine dtype name ``dtype`` (None: the
    trainer's); ``quant="fp8"``: block FP8 (``block``, ``scale_suffix``, ``scale_fmt``,
    ``scale_dtype``: see the module)."""
    k = _kind(dtype, quant, block, scale_suffix, scale_fmt, scale_dtype)
    return _layout(_qwen3_moe(num_layers, k), ranks, tp, ep, phy2log)


def vllm_mixtral(
    num_layers: int,
    ranks: Sequence[int],
    *,
    tp: int,
    ep: int = 1,
    phy2log=None,
    dtype: str | None = None,
    quant: str | None = None,
    block: tuple[int, int] = FP8_BLOCK,
    scale_suffix: str = "_scale_inv",
    scale_fmt: str | None = None,
    scale_dtype: str = "float32",
) -> EngineLayout:
    """vLLM's Mixtral (``MixtralForCausalLM``: ``block_sparse_moe.gate`` and
    ``block_sparse_moe.experts``); arguments as :func:`vllm_qwen3_moe`'s."""
    k = _kind(dtype, quant, block, scale_suffix, scale_fmt, scale_dtype)
    return _layout(_mixtral(num_layers, k), ranks, tp, ep, phy2log)


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
    quant: str | None = None,
    block: tuple[int, int] = FP8_BLOCK,
    scale_suffix: str = "_scale_inv",
    scale_fmt: str | None = None,
    scale_dtype: str = "float32",
) -> EngineLayout:
    """vLLM's DeepSeek-V3 (``DeepseekV3ForCausalLM``, MLA with ``q_lora_rank``): layers before
    ``first_k_dense`` dense MLPs, the others MoE (row ``i - first_k_dense`` of ``phy2log``)
    with a shared expert; ``e_score_correction_bias`` (float32) with the router. Other arguments
    as :func:`vllm_qwen3_moe`'s. Run vLLM's post-load step after a refit (MLA's ``W_UK_T`` /
    ``W_UV`` come from ``kv_b_proj``)."""
    k = _kind(dtype, quant, block, scale_suffix, scale_fmt, scale_dtype)
    t = _deepseek_v3(num_layers, k, first_k_dense, shared_experts, "fused_qkv_a_proj")
    return _layout(t, ranks, tp, ep, phy2log)


def sglang_qwen3_moe(
    num_layers: int,
    ranks: Sequence[int],
    *,
    tp: int,
    ep: int = 1,
    phy2log=None,
    dtype: str | None = None,
    quant: str | None = None,
    block: tuple[int, int] = FP8_BLOCK,
    scale_suffix: str = "_scale_inv",
    scale_fmt: str | None = None,
    scale_dtype: str = "float32",
) -> EngineLayout:
    """sglang's Qwen3-MoE (``Qwen3MoeForCausalLM``: ``qkv_proj``, ``q_norm`` / ``k_norm``, the
    router ``mlp.gate`` unquantized, ``mlp.experts.w13_weight`` / ``w2_weight``): the same
    tensors as vLLM's; ``ep``: sglang's ``--ep-size`` equal to its TP size (``moe_tp_size`` 1),
    or 1; ``phy2log``: its expert location (EPLB's redundant slots included). Other arguments
    as :func:`vllm_qwen3_moe`'s."""
    k = _kind(dtype, quant, block, scale_suffix, scale_fmt, scale_dtype)
    return _layout(_qwen3_moe(num_layers, k), ranks, tp, ep, phy2log)


def sglang_mixtral(
    num_layers: int,
    ranks: Sequence[int],
    *,
    tp: int,
    ep: int = 1,
    phy2log=None,
    dtype: str | None = None,
    quant: str | None = None,
    block: tuple[int, int] = FP8_BLOCK,
    scale_suffix: str = "_scale_inv",
    scale_fmt: str | None = None,
    scale_dtype: str = "float32",
) -> EngineLayout:
    """sglang's Mixtral (``block_sparse_moe.gate``, ``block_sparse_moe.experts.w13_weight`` /
    ``w2_weight``): the same tensors as vLLM's; arguments as :func:`sglang_qwen3_moe`'s."""
    k = _kind(dtype, quant, block, scale_suffix, scale_fmt, scale_dtype)
    return _layout(_mixtral(num_layers, k), ranks, tp, ep, phy2log)


def sglang_deepseek_v3(
    num_layers: int,
    ranks: Sequence[int],
    *,
    tp: int,
    ep: int = 1,
    phy2log=None,
    first_k_dense: int = 3,
    shared_experts: bool = True,
    fuse_shared_experts: bool = False,
    dtype: str | None = None,
    quant: str | None = None,
    block: tuple[int, int] = FP8_BLOCK,
    scale_suffix: str = "_scale_inv",
    scale_fmt: str | None = None,
    scale_dtype: str = "float32",
) -> EngineLayout:
    """sglang's DeepSeek-V3 (``DeepseekV3ForCausalLM``, MLA with ``q_lora_rank``): vLLM's
    tensors but the fused projection ``fused_qkv_a_proj_with_mqa`` (``q_a_proj`` then
    ``kv_a_proj_with_mqa``, replicated) and attention TP = ``tp`` (no DP attention). sglang
    derives ``w_kc`` / ``w_vc`` from ``kv_b_proj`` after loading: call
    ``model.post_load_weights()`` after a refit.

    The shared expert is ``mlp.shared_experts.gate_up_proj`` / ``down_proj``
    (``--disable-shared-experts-fusion``), or with ``fuse_shared_experts`` (sglang's fusion,
    ``num_fused_shared_experts = n_shared_experts = 1``) one more slot of ``mlp.experts``:
    ``w13_weight [local_slots + 1, 2I, H]`` / ``w2_weight [local_slots + 1, H, I]``, the shared
    expert (loaded by sglang as expert ``n_routed_experts``) after the engine rank's slots of
    ``phy2log`` on every rank, whole under EP, TP-split like the other slots without. Its
    intermediate size must be the experts' (``n_shared_experts = 1``).

    sglang fuses by default (``DeepseekV2ForCausalLM.determine_num_fused_shared_experts``) for
    DeepSeek-V3 (256 routed experts, one shared) on CUDA without expert parallelism, DeepEP or
    batch overlap, under EP only on ROCm gfx942+; ``--enforce-shared-experts-fusion`` fuses in
    every case (DeepEP's per-rank shared slots hold the same weights). A fused shared expert
    with redundant slots (``--ep-num-redundant-experts``: a ``phy2log`` row placing an expert
    twice) raises ValueError: sglang's ``FusedMoE.weight_loader`` takes the shared expert,
    loaded as expert ``n_routed_experts``, for a routed one then, so no slot holds it. Other
    arguments as :func:`vllm_deepseek_v3`'s."""
    k = _kind(dtype, quant, block, scale_suffix, scale_fmt, scale_dtype)
    t = _deepseek_v3(num_layers, k, first_k_dense, shared_experts, "fused_qkv_a_proj_with_mqa", fuse_shared_experts)
    return _layout(t, ranks, tp, ep, phy2log)
