"""Tiny transformers MoE causal-LM models, one per family, for the tests that run moeshard over
every transformers MoE family (load, save, relocate, ... of real HF module trees and checkpoints).

This is a helper module, not a test file. `FAMILIES` lists the model_type of every family of
`transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` whose model has an
`...experts` module holding fused expert parameters with a leading expert dim (`gate_up_proj` /
`down_proj`, or `up_proj` / `down_proj` for nemotron_h) and that builds from a tiny config; and
the three whose experts are held otherwise, which moeshard's specs name (models/adapters.py):
dbrx (`ffn.experts.mlp.{w1,v1,w2}`, [E * ffn_hidden_size, d_model], experts merged into dim 0),
jetmoe (each `JetMoeParallelExperts`, `weight` [E, out, in]) and doge (with `is_moe`: the
embedding tables `mlp.down_embed` / `mlp.up_embed`, [E, hidden], one row per expert).
`tiny_config(mt)` gives that config and `build(mt)` the model, with reproducible weights.

Enumerated on transformers 5.24.0 (torch 2.13, CPU) by a development-time script, not at import
time: every family in FAMILIES builds, has >= 2 MoE layers and < 300k parameters, has untied
embeddings, and survives `save_pretrained` -> `from_pretrained(dtype=fp32,
output_loading_info=True)` with no missing/unexpected/mismatched keys and a bit-identical
state_dict. `PER_EXPERT_ON_DISK` / `FUSED_ON_DISK` record what that `save_pretrained` wrote.
The families transformers 5.24.0 added (hy_v4_vl, inkling2_loop, inkling2_loop_text, lara_mini,
sarvam_mla, sarvam_moe) are skipped on an older transformers (`installed()`); `REFUSED` names
those moeshard refuses to load, and why. hy_v4_vl and inkling2_loop have no causal-LM class: they
are image-text-to-text models (`IMAGE_TEXT`), built with tiny vision towers and run on text.

Notes for test writers:
- The composite model_types dots3_note, llama4, qwen3_5_moe and qwen4_exp build the same
  text-only model as their `*_text` twin; the saved config.json then says the `*_text` model_type.
- gemma4 builds Gemma4ForConditionalGeneration (tiny vision and audio towers included); its
  experts live at `model.language_model.layers.N.experts` (no `mlp.`).
- longcat_flash's experts module has `gate_up_proj` with n_routed + zero_expert_num rows (the
  identity "zero experts") but `down_proj` with n_routed rows only.
- jetmoe has four experts modules per layer, each a `JetMoeParallelExperts` with one `weight`
  [E, out, in] (fused on disk under its own name): the MoE MLP's `mlp.input_linear` /
  `mlp.output_linear` and the mixture of attention heads' `self_attention.experts.input_linear` /
  `output_linear` (the module named `experts` there holds only a bias and those submodules).
- Some families have a fused (leading dim 1) `shared_experts` module whose name also ends in
  "experts" (inkling_text: gate_proj / up_proj / down_proj of shape (1, ...)).
- What a fused family writes is not always `...experts.gate_up_proj` (aria_text: experts.fc1 /
  fc2, granitemoe*: input_linear / output_linear, inkling2_text: model.llm...experts.w1_weight).

- dbrx's default config does not build: DbrxAttention reads `attn_config.rope_theta`, which
  DbrxAttentionConfig lacks, and clamps q/k/v by `attn_config.clip_qkv` (None fails): both given.
No MoE causal-LM family of the mapping that builds from a tiny config is left out of FAMILIES.
transformers 5.24.0 gave inkling2 an `unpadded_vocab_size` (default 200058) that must not exceed
the tiny vocabulary: `_GENERIC` sets it (the suite passes on 5.23.0 and 5.24.0).
"""

from __future__ import annotations

import torch

TRANSFORMERS_VERSION = "5.24.0"  # the version FAMILIES and the *_ON_DISK sets were computed on

FAMILIES: tuple[str, ...] = (
    "afmoe",
    "aria_text",
    "axk1",
    "axk2",
    "bailing_hybrid",
    "beam",
    "cohere2_moe",
    "dbrx",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v4",
    "doge",
    "dots1",
    "dots3_note",
    "dots3_note_text",
    "ernie4_5_moe",
    "exaone_moe",
    "flex_olmo",
    "flint",
    "gemma4",
    "gemma4_text",
    "glm4_moe",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "gpt_oss",
    "granitemoe",
    "granitemoe_swa",
    "granitemoehybrid",
    "granitemoeshared",
    "hunyuan_v1_moe",
    "hy_v3",
    "hy_v4",
    "hy_v4_vl",
    "inkling2_loop",
    "inkling2_loop_text",
    "inkling2_text",
    "inkling_text",
    "jamba",
    "jetmoe",
    "kimi_linear",
    "kolibri1",
    "laguna",
    "lara_mini",
    "lfm2_moe",
    "llama4",
    "llama4_text",
    "longcat_flash",
    "mellum",
    "mimo_v2_flash",
    "minimax",
    "minimax_m2",
    "minimax_m3_vl_text",
    "mixtral",
    "nemotron_h",
    "olmoe",
    "phimoe",
    "qwen2_moe",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_moe",
    "qwen3_next",
    "qwen4_exp",
    "qwen4_exp_text",
    "sarvam_mla",
    "sarvam_moe",
    "solar_open",
    "zaya",
)

# Families whose save_pretrained writes per-expert expert keys (matching r"\.experts\.\d+\.",
# e.g. `...experts.3.gate_proj.weight` or mixtral-style `...experts.3.w1.weight`).
PER_EXPERT_ON_DISK: frozenset[str] = frozenset(
    {
        "afmoe",
        "axk1",
        "axk2",
        "bailing_hybrid",
        "beam",
        "cohere2_moe",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "deepseek_v4",
        "dots1",
        "dots3_note",
        "dots3_note_text",
        "ernie4_5_moe",
        "exaone_moe",
        "flex_olmo",
        "flint",
        "glm4_moe",
        "glm4_moe_lite",
        "glm_moe_dsa",
        "hunyuan_v1_moe",
        "hy_v3",
        "jamba",
        "kimi_linear",
        "kolibri1",
        "laguna",
        "lfm2_moe",
        "longcat_flash",
        "mellum",
        "mimo_v2_flash",
        "minimax",
        "minimax_m2",
        "mixtral",
        "nemotron_h",
        "olmoe",
        "phimoe",
        "qwen2_moe",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_moe",
        "qwen3_next",
        "qwen4_exp",
        "qwen4_exp_text",
        "sarvam_mla",
        "sarvam_moe",
        "solar_open",
    }
)
# Image-text-to-text families (no causal-LM class): built and loaded by AutoModelForImageTextToText
# (:func:`auto_class`), tiny vision towers included; run on text alone.
IMAGE_TEXT: frozenset[str] = frozenset({"hy_v4_vl", "inkling2_loop"})
# The others: save_pretrained writes the experts fused (one tensor per layer and projection).
FUSED_ON_DISK: frozenset[str] = frozenset(FAMILIES) - PER_EXPERT_ON_DISK

# Families moeshard refuses to load from what save_pretrained writes, with the reason its error
# states (a substring of it): a transformers converter between the checkpoint and the model that
# moeshard cannot express as box reads. load and verify raise it naming the converter; save
# writes what from_pretrained reads back where it can (lara_mini and sarvam_moe: the model's
# own tensors, which from_pretrained also reads), else refuses before writing.
REFUSED: dict[str, str] = {
    # experts: gate and up rows alternate on disk
    "inkling2_text": "operations ['Interleave'] on checkpoint tensor mlp.experts.w13_weight: Interleave(dim=1)",
    # experts dequantized by the family's own op (NVFP4 / MXFP8 with amax and an outer scale
    # denominator), then interleaved
    "inkling2_loop_text": "operations ['Inkling2LoopDequantizeExperts', 'Interleave']",
    "inkling2_loop": "operations ['Inkling2LoopDequantizeExperts', 'Interleave']",
    # dense: one checkpoint tensor cut into several model tensors
    "lara_mini": "Split(dim=0) cuts checkpoint tensor linear_attn.in_proj into the model's linear_attn.in_proj_qkv",
    "sarvam_moe": "Split(dim=0) cuts checkpoint tensor query_key_value into the model's q_proj, k_proj, v_proj",
}
# Families whose refusal covers save too (it would write names from_pretrained does not read back).
SAVE_REFUSED: frozenset[str] = frozenset({"inkling2_text", "inkling2_loop_text", "inkling2_loop"})

# Generic small overrides. tiny_config passes each one only if the family's config class knows the
# field (it appears in the default config's to_dict()), so one dict serves every naming scheme.
_GENERIC = dict(
    vocab_size=128,
    unpadded_vocab_size=128,  # inkling2 (transformers >= 5.24): the real vocab in a padded lm_head; <= vocab_size
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    shared_intermediate_size=16,
    shared_experts_intermediate_size=16,
    moe_shared_expert_intermediate_size=16,
    expert_ffn_hidden_size=16,
    ffn_hidden_size=64,
    dense_intermediate_size=64,
    intermediate_size_mlp=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,  # = heads: multi-head latent attention (MLA) families run forward only so
    head_dim=8,  # also gives hunyuan_v1_moe a rope dim (its default head_dim=None fails to build)
    max_position_embeddings=64,
    sliding_window=16,
    tie_word_embeddings=False,
    # experts and routing
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    num_experts_per_token=2,
    moe_topk=2,
    moe_k=2,
    n_shared_experts=1,
    num_shared_experts=1,
    moe_num_shared_experts=1,
    n_group=1,
    topk_group=1,
    num_expert_group=1,
    # MLA and sparse-attention indexers
    kv_lora_rank=16,
    q_lora_rank=16,
    o_lora_rank=16,
    qk_rope_head_dim=8,  # = head_dim, which MLA families' rotary embedding uses
    qk_nope_head_dim=8,
    v_head_dim=8,
    index_head_dim=8,
    index_n_heads=2,
    index_topk=8,
    # linear attention and mamba mixers
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_head_dim=8,
    linear_num_heads=4,
    mamba_n_heads=4,
    mamba_d_head=8,
    mamba_d_state=8,
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=8,
    mamba_dt_rank=4,
)

# "dense first" below: the family makes its first layer(s) dense MLPs; 3 layers keep one dense
# layer and give 2 MoE layers.
_DOTS3_TEXT = dict(
    num_hidden_layers=3,  # dense first (first_k_dense_replace defaults to 1)
    num_key_value_heads=4,  # MLA: validation requires num_key_value_heads == num_attention_heads
    # layer 2 is a sliding-attention layer with its own per-layer MLA shape from the swa_* kwargs
    # (defaults: 64 heads, ranks 1024 -> ~38M parameters)
    swa_num_attention_heads=2,
    swa_num_key_value_heads=2,
    swa_q_lora_rank=16,
    swa_kv_lora_rank=16,
    swa_head_dim=12,
    swa_qk_nope_head_dim=8,
    swa_v_head_dim=8,
)
_GEMMA4_TEXT = dict(
    enable_moe_block=True,  # off by default: no experts at all
    top_k_experts=2,  # defaults to None
    vocab_size_per_layer_input=128,
    hidden_size_per_layer_input=8,  # per-layer input embeddings (262144 x 256)
    global_head_dim=16,  # full-attention layers get head_dim 512 by default
)

# its looped layers start and end on attention-residual block boundaries (blocks of 6 layers by
# default, loop layers 6..18): blocks of 1 layer loop layer 1 twice in 3 layers
_INKLING2_LOOP_TEXT = dict(
    num_hidden_layers=3,
    n_layers_per_attn_res_block=1,
    loop_layer_index_start=1,
    loop_layer_index_end=2,
    loop_num_passes=2,
    loop_gate_rank=8,  # default 64
    swa_num_attention_heads=4,  # sliding-window heads as inkling_text's
    swa_num_key_value_heads=2,
    swa_head_dim=8,
)

_FAMILY: dict[str, dict] = {
    "afmoe": dict(num_hidden_layers=3),  # dense first (num_dense_layers=1)
    "axk1": dict(num_hidden_layers=3),  # dense first (default mlp_layer_types)
    "axk2": dict(num_hidden_layers=3),  # dense first (default mlp_layer_types)
    # dense first (first_k_dense_replace defaults to 2); layer_group_size=3 makes layer 2 full
    # attention (otherwise all 3 layers are linear attention)
    "bailing_hybrid": dict(num_hidden_layers=3, first_k_dense_replace=1, layer_group_size=3),
    # the default makes the first min(3, num_hidden_layers) layers dense
    "beam": dict(num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"]),
    # its own names (d_model, n_heads, n_layers); DbrxAttention reads attn_config.rope_theta, which
    # the attention sub-config lacks unless given; its forward clamps q/k/v by clip_qkv (None fails)
    "dbrx": dict(
        d_model=32,
        n_heads=4,
        n_layers=2,
        max_seq_len=64,
        attn_config=dict(kv_n_heads=4, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(hidden_size=32, ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2),
    ),
    "deepseek_v3": dict(num_hidden_layers=3, first_k_dense_replace=1),  # default 3 dense layers
    # dense MLPs unless is_moe; its product-key router takes the top num_experts_per_tok of
    # floor(sqrt(num_experts))^2 candidates: 16 experts give 4 x 4
    "doge": dict(is_moe=True, num_experts=16, num_experts_per_tok=4),
    "deepseek_v32": dict(num_hidden_layers=3, first_k_dense_replace=1),  # default 3 dense layers
    # the vision/audio adapters (not built here) must output the text hidden size (validation)
    "dots3_note": dict(
        text_config=_DOTS3_TEXT, vision_config=dict(adapter_out_dim=32), audio_config=dict(adapter_out_dim=32)
    ),
    "dots3_note_text": _DOTS3_TEXT,
    "ernie4_5_moe": dict(num_hidden_layers=3),  # dense first (moe_layer_start_index=1)
    "exaone_moe": dict(num_hidden_layers=3),  # dense first (first_k_dense_replace=1)
    "flint": dict(num_hidden_layers=3, mlp_only_layers=[0]),  # default mlp_only_layers=[0, 1]
    # Gemma4ForConditionalGeneration builds the vision and audio towers: shrink them as well
    # (position table 10240 x hidden, 16x16 patches, 1536-wide audio output projection)
    "gemma4": dict(
        text_config=_GEMMA4_TEXT,
        vision_config=dict(position_embedding_size=64, patch_size=4),
        audio_config=dict(output_proj_dims=32, subsampling_conv_channels=[8, 8]),
    ),
    "gemma4_text": _GEMMA4_TEXT,
    "glm4_moe": dict(num_hidden_layers=3),  # dense first (first_k_dense_replace=1)
    "glm4_moe_lite": dict(num_hidden_layers=3),  # dense first (default mlp_layer_types)
    "glm_moe_dsa": dict(num_hidden_layers=3, first_k_dense_replace=1),  # default 3 dense layers
    # validation: mamba_n_heads * mamba_d_head must equal mamba_expand (2) * hidden_size
    "granitemoehybrid": dict(mamba_n_heads=8),
    "hy_v3": dict(num_hidden_layers=3),  # dense first (default mlp_layer_types)
    "hy_v4": dict(num_hidden_layers=3),  # dense first (default mlp_layer_types)
    # sliding-window layers have their own head counts (defaults 64/48 heads x 128 -> ~1.4M params)
    "inkling_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8),
    "inkling2_text": dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8),
    "inkling2_loop_text": _INKLING2_LOOP_TEXT,
    # its vision sub-config is declared as any AutoConfig: named here; its projection must output
    # the text hidden size (validation)
    "inkling2_loop": dict(
        text_config=_INKLING2_LOOP_TEXT,
        vision_config=dict(
            model_type="inkling2_vision",
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            patch_size=4,
            posemb_grid_size=4,
            projection_hidden_dim=32,
            text_hidden_size=32,
        ),
    ),
    # default: experts every 2nd layer from 1 and attention every 8th from 4 (none in 2 layers);
    # here both layers are MoE, layer 0 mamba and layer 1 attention
    "jamba": dict(expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1),
    # the attention experts' width is kv_channels * num_key_value_heads (default 128 * heads: ~390k params)
    "jetmoe": dict(kv_channels=8),
    "kimi_linear": dict(num_hidden_layers=3),  # dense first (default mlp_layer_types)
    "laguna": dict(num_hidden_layers=3),  # dense first (default mlp_layer_types)
    # layer_types defaults to None, which the model indexes (TypeError); num_dense_layers defaults to 2
    "lfm2_moe": dict(num_hidden_layers=3, num_dense_layers=1, layer_types=["conv", "full_attention", "conv"]),
    # counts layers in num_layers (num_hidden_layers = 2 * num_layers); the default 256 identity
    # "zero experts" each add a gate_up_proj row block, so keep 2 of them
    "longcat_flash": dict(num_layers=2, zero_expert_num=2),
    "mimo_v2_flash": dict(num_hidden_layers=3, num_key_value_heads=2),  # dense first; its SWA heads need GQA
    # default layers_block_type has one MoE layer among 4 (mamba, moe, attention, mlp); the mamba
    # mixer's n_groups (default 8) must divide mamba_num_heads (its scan repeats B and C
    # num_heads // n_groups times: 0 with 4 heads, and forward fails)
    "nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"], n_groups=2),
    # mrope_section must sum to qk_rope_head_dim // 2; the vision tower's position table is
    # (max_image_size / patch_size)^2 x hidden (8.4M parameters with the defaults)
    "hy_v4_vl": dict(
        text_config=dict(
            num_hidden_layers=3,  # dense first, as hy_v4
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1]),
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_hidden_layers=1,
            out_hidden_size=32,
            patch_size=4,
            max_image_size=32,
        ),
    ),
    "qwen4_exp": dict(text_config=dict(hc_lowrank=8)),  # hyper-connection rank 320 -> ~400k params
    "qwen4_exp_text": dict(hc_lowrank=8),
    # validation: only num_experts_per_tok=1; router MLP width 256 -> ~260k params
    "zaya": dict(num_experts_per_tok=1, router_hidden_size=16),
}
# Families whose model class also builds the vision/audio towers: shrink those sub-configs too.
_SHRINK_SUBCONFIGS = frozenset({"gemma4", "hy_v4_vl", "inkling2_loop"})


def _kwargs(cls, overrides: dict, shrink_subconfigs: bool = False) -> dict:
    """Constructor kwargs for config class `cls`: the generic overrides it knows, then `overrides`.

    A `text_config` sub-config is always shrunk the same way; other sub-configs (vision, audio) only
    when `shrink_subconfigs` (the causal-LM class builds them), else their overrides pass verbatim.
    """
    if "model_type" in overrides:  # a sub-config declared as any AutoConfig: the class it names
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        cls = CONFIG_MAPPING[overrides["model_type"]]
        overrides = {k: v for k, v in overrides.items() if k != "model_type"}
    default = cls().to_dict()
    kw = {k: v for k, v in _GENERIC.items() if k in default}
    vocab = kw.get("vocab_size", default.get("vocab_size"))
    for k in ("pad_token_id", "bos_token_id", "eos_token_id", "eod_token_id", "sep_token_id"):
        v = default.get(k)
        if vocab is not None and isinstance(v, int) and v >= vocab:
            kw[k] = None  # the default id lies outside the tiny vocabulary (padding_idx would fail)
    kw.update(overrides)
    for name, sub_cls in (getattr(cls, "sub_configs", None) or {}).items():
        if name == "text_config" or shrink_subconfigs:
            kw[name] = _kwargs(sub_cls, overrides.get(name, {}), shrink_subconfigs)
    return kw


def auto_class(model_type: str):
    """The transformers auto class that builds and loads family `model_type`: the causal-LM one,
    or the image-text-to-text one for the families of :data:`IMAGE_TEXT`."""
    import transformers

    if model_type in IMAGE_TEXT:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def tiny_config(model_type: str):
    """A tiny config of family `model_type` (a key of transformers' CONFIG_MAPPING)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    return cls(**_kwargs(cls, _FAMILY.get(model_type, {}), model_type in _SHRINK_SUBCONFIGS))


def build(model_type: str, dtype: torch.dtype = torch.float32, device=None):
    """`auto_class(model_type).from_config(tiny_config(model_type))` with parameters in `dtype`,
    created under `torch.device(device)` when given (e.g. "meta"); seeded, so reproducible."""
    cls = auto_class(model_type)
    cfg = tiny_config(model_type)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        if device is None:
            return cls.from_config(cfg)
        with torch.device(device):
            return cls.from_config(cfg)
    finally:
        torch.set_default_dtype(old)


# The families transformers 5.24.0 added: an older transformers has none of them.
ADDED_IN_5_24: frozenset[str] = frozenset(
    {"hy_v4_vl", "inkling2_loop", "inkling2_loop_text", "lara_mini", "sarvam_mla", "sarvam_moe"}
)


def installed(model_type: str) -> bool:
    """Whether the installed transformers has family `model_type` (the suite runs on the pinned
    transformers and on the newest, which may differ in families)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def per_expert_on_disk(model_type: str) -> bool:
    """Whether `save_pretrained` of this family writes per-expert keys (`...experts.<i>....`)."""
    if model_type not in FAMILIES:
        raise KeyError(f"unknown MoE family {model_type!r}")
    return model_type in PER_EXPERT_ON_DISK
