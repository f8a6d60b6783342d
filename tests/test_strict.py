"""Tier 1: hostile checkpoints in one process.

FP8 weights are never cast without their scale, on every path that reads checkpoint data into
a tensor (load, verify, relocate's disk reads, LoRA adapters); checkpoint keys that no
parameter reads are reported, and those that say the checkpoint does not fit the model (a
stray expert, a layer beyond the model's) are an error unless ``strict=False``.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import moeshard
import tiny_moe
from moeshard.dtypes import cast_refusal

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E = tiny_moe.NUM_EXPERTS
FIRST = "layers.0.mlp.experts.0.gate_proj.weight"  # the first expert tensor a load reads


def _write(directory: Path, tensors: dict) -> Path:
    moeshard.write_checkpoint(directory, tensors.items(), max_shard_bytes=3000)
    return directory


def _meta_model(expert_dtype: torch.dtype | None = None, dtype: torch.dtype = torch.float32):
    with torch.device("meta"):
        model = tiny_moe.TinyMoE().to(dtype)
    if expert_dtype is not None:
        for b in tiny_moe.MOE_BLOCKS:
            model.layers[b].mlp.experts.to(expert_dtype)
    return model


def _quantized(tensors: dict, dtype=E4M3, scales: bool = True) -> dict:
    """Expert weights as FP8 (+ DeepSeek-V3's float32 ``weight_scale_inv`` [ceil(out/128),
    ceil(in/128)] under ``<weight key>_scale_inv``), everything else as it was."""
    out = dict(tensors)
    for key, t in tensors.items():
        if ".experts." in key:
            out[key] = t.float().to(dtype)
            if scales:
                out[key + "_scale_inv"] = torch.full((math.ceil(t.shape[0] / 128), math.ceil(t.shape[1] / 128)), 0.5)
    return out


def _plain_placement():
    return moeshard.Placement.contiguous(2, E, 1)


def _expert_bytes_equal(model, ckpt: dict) -> bool:
    """Every expert slot of ``model`` holds its checkpoint expert's bytes (dtype-agnostic)."""

    def u8(t):
        return t.detach().contiguous().view(torch.uint8)

    for b in tiny_moe.MOE_BLOCKS:
        experts = model.layers[b].mlp.experts
        for e in range(E):
            q = f"layers.{b}.mlp.experts.{e}"
            gate_up = torch.cat([u8(ckpt[f"{q}.gate_proj.weight"]), u8(ckpt[f"{q}.up_proj.weight"])])
            if not (
                torch.equal(u8(experts.gate_up_proj[e]), gate_up)
                and torch.equal(u8(experts.down_proj[e]), u8(ckpt[f"{q}.down_proj.weight"]))
            ):
                return False
    return True


@pytest.fixture(scope="module")
def good():
    return tiny_moe.checkpoint_tensors()


@pytest.fixture(scope="module")
def root(tmp_path_factory, good):
    """Checkpoints: good, FP8 experts with and without scales, e5m2 experts, stray keys."""
    d = tmp_path_factory.mktemp("strict")
    _write(d / "good", good)
    _write(d / "fp8", _quantized(good))
    _write(d / "fp8-noscale", _quantized(good, scales=False))
    _write(d / "e5m2", _quantized(good, E5M2, scales=False))
    # What the old load put into a bf16 model: the raw FP8 values cast, scales dropped.
    raw = {k: (t.to(torch.bfloat16) if t.dtype == E4M3 else t) for k, t in _quantized(good, scales=False).items()}
    _write(d / "raw-cast", raw)
    stray = dict(good)
    stray["layers.0.mlp.experts.99.gate_proj.weight"] = torch.ones(tiny_moe.INTER, tiny_moe.HIDDEN)
    _write(d / "stray-expert", stray)
    # A whole fourth block (the model has 3): 4 + 3 * 8 keys, more than the message lists.
    beyond = dict(good)
    for k, t in tiny_moe.checkpoint_tensors(seed=1).items():
        if k.startswith("layers.2."):
            beyond["layers.3." + k[len("layers.2.") :]] = t
    _write(d / "extra-layer", beyond)
    other = dict(good)
    other["rotary.inv_freq"] = torch.ones(4)
    other["layers.1.attn.rotary_emb.inv_freq"] = torch.ones(4)
    _write(d / "unrelated", other)
    return d


# -- FP8: the cast rule ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, dst, refused",
    [
        ("BF16", torch.bfloat16, None),
        ("F32", torch.bfloat16, None),
        ("BF16", torch.float32, None),
        ("I64", torch.int32, None),
        ("F8_E4M3", E4M3, None),
        ("F8_E5M2", E5M2, None),
        ("F8_E4M3", torch.bfloat16, "from_fp8"),
        ("F8_E4M3", torch.float32, "from_fp8"),
        ("F8_E5M2", torch.float16, "from_fp8"),
        ("BF16", E4M3, "to_fp8"),
        ("F32", E5M2, "to_fp8"),
        ("F8_E4M3", E5M2, "fp8_formats"),
        ("F8_E5M2", E4M3, "fp8_formats"),
        ("I32", torch.float32, "kind"),
        ("BOOL", torch.int8, "kind"),
        ("F8_E4M3", torch.uint8, "from_fp8"),
    ],
)
def test_cast_rule(src, dst, refused):
    assert cast_refusal(src, dst) == refused


def test_fp8_with_scale_into_bf16_is_dequantized_or_refused(root, good):
    """FP8 with its scale loads dequantized (q * 0.5 here); verify compares the dequantized values
    and refuses the raw cast; dequantize=False refuses the cast, naming the scale it would drop."""
    model = _meta_model(dtype=torch.bfloat16)
    rep = moeshard.load(model, root / "fp8")
    assert rep.dequantized_keys == sum(".experts." in k for k in good) and rep.unused_keys == ()
    got = model.layers[0].mlp.experts.gate_up_proj[0, : tiny_moe.INTER].detach().clone()
    assert torch.equal(got, (good[FIRST].float().to(E4M3).float() * 0.5).to(torch.bfloat16))
    assert moeshard.verify(model, root / "fp8").num_boxes_checked > 0
    want = (
        rf"parameter layers\.0\.mlp\.experts\.gate_up_proj: checkpoint tensor '{FIRST}' has dtype F8_E4M3 "
        rf"\(FP8\), the model's tensor is torch\.bfloat16: its scale tensor '{FIRST}_scale_inv' \(F32 \[1, 1\]\) "
        r"would be dropped and the raw FP8 values loaded unscaled"
    )
    with pytest.raises(ValueError, match=want):
        moeshard.load(_meta_model(dtype=torch.bfloat16), root / "fp8", dequantize=False)
    # A model holding exactly what a cast without the scale produces (raw FP8 values cast to bf16,
    # max error vs. the dequantized weights unbounded): verify must not call it correct.
    moeshard.load(model, root / "raw-cast")
    raw = model.layers[0].mlp.experts.gate_up_proj[0, : tiny_moe.INTER].detach().clone()
    assert torch.equal(raw, good[FIRST].float().to(E4M3).to(torch.bfloat16))
    with pytest.raises(
        ValueError, match=r"experts\.(gate_up|down)_proj, physical slot .* differs from checkpoint tensor"
    ):
        moeshard.verify(model, root / "fp8")


def test_fp8_without_scale_is_refused(root):
    with pytest.raises(
        ValueError,
        match=rf"'{FIRST}' has dtype F8_E4M3 \(FP8\), the model's tensor is torch\.float32: "
        rf"the checkpoint has no scale tensor for it \(no '{FIRST}_scale_inv'\), and "
        r"its raw FP8 values would be meaningless as torch\.float32",
    ):
        moeshard.load(_meta_model(), root / "fp8-noscale")


def test_fp8_into_fp8_model_is_bit_exact(root, good, caplog):
    ckpt = _quantized(good, scales=False)
    model = _meta_model(expert_dtype=E4M3)
    rep = moeshard.load(model, root / "fp8-noscale")
    assert model.layers[0].mlp.experts.gate_up_proj.dtype == E4M3
    assert _expert_bytes_equal(model, ckpt) and rep.unused_keys == ()
    assert torch.equal(model.lm_head.weight.detach(), good["lm_head.weight"])
    assert moeshard.verify(model, root / "fp8-noscale").num_boxes_checked > 0
    # With the scales on disk the model, which has no parameter for them, would drop them.
    scales = sorted(k for k in _quantized(good) if k.endswith("_scale_inv"))
    with pytest.raises(
        ValueError,
        match=rf"has {len(scales)} key\(s\) that no parameter or buffer of the model reads: "
        rf"{len(scales)} name experts or expert tensors the model does not have: "
        r"\['layers\.0\.mlp\.experts\.0\.down_proj\.weight_scale_inv', .*\] \.\.\. "
        rf"\({len(scales)} in all\); pass strict=False",
    ):
        moeshard.load(_meta_model(expert_dtype=E4M3), root / "fp8")
    model = _meta_model(expert_dtype=E4M3)
    with caplog.at_level(logging.WARNING, logger="moeshard"):
        rep = moeshard.load(model, root / "fp8", strict=False)
    assert rep.unused_keys == tuple(scales)
    assert _expert_bytes_equal(model, ckpt)
    assert [r.name for r in caplog.records] == ["moeshard"] and "strict=False: ignored" in caplog.text


def test_casts_into_fp8_and_between_fp8_formats_are_refused(root):
    with pytest.raises(
        ValueError,
        match=rf"'{FIRST}' has dtype BF16, the model's tensor is torch\.float8_e4m3fn: "
        r"casting to FP8 is a quantization that needs a scale",
    ):
        moeshard.load(_meta_model(expert_dtype=E4M3), root / "good")
    with pytest.raises(
        ValueError,
        match=rf"'{FIRST}' has dtype F8_E5M2, the model's tensor is torch\.float8_e4m3fn: "
        r"converting between FP8 formats without rescaling loses precision",
    ):
        moeshard.load(_meta_model(expert_dtype=E4M3), root / "e5m2")


def test_relocate_disk_reads_dequantize_fp8_or_refuse_it_without_scale(root, good):
    """relocate's disk reads dequantize FP8 with its scale into a bf16 model (q * 0.5 here, as
    load does; verify agrees), and refuse FP8 without a scale, before any weight changes."""
    model = _meta_model(dtype=torch.bfloat16)
    moeshard.load(model, root / "good")
    moeshard.relocate(model, None, _plain_placement(), checkpoint=root / "fp8")
    got = model.layers[0].mlp.experts.gate_up_proj[0, : tiny_moe.INTER].detach().clone()
    assert torch.equal(got, (good[FIRST].float().to(E4M3).float() * 0.5).to(torch.bfloat16))
    assert moeshard.verify(model, root / "fp8").num_boxes_checked > 0
    moeshard.load(model, root / "good")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=rf"'{FIRST}' has dtype F8_E4M3 \(FP8\).*no scale tensor for it"):
        moeshard.relocate(model, None, _plain_placement(), checkpoint=root / "fp8-noscale")
    for n, p in model.named_parameters():  # refused before any weight changed
        assert torch.equal(p.detach(), before[n]), n
    # Plain expert tensors (a serving engine's), read from disk: the same rule.
    tensors = {
        b: [
            torch.zeros(E, 2 * tiny_moe.INTER, tiny_moe.HIDDEN, dtype=torch.bfloat16),
            torch.zeros(E, tiny_moe.HIDDEN, tiny_moe.INTER, dtype=torch.bfloat16),
        ]
        for b in tiny_moe.MOE_BLOCKS
    }
    kwargs = dict(expert_params=moeshard.HF_EXPERTS.params, module="layers.{layer}.mlp.experts")
    with pytest.raises(ValueError, match=rf"no scale tensor for it \(no '{FIRST}_scale_inv'\)"):
        moeshard.relocate(tensors, None, _plain_placement(), checkpoint=root / "fp8-noscale", **kwargs)
    moeshard.relocate(tensors, None, _plain_placement(), checkpoint=root / "fp8", **kwargs)
    assert torch.equal(
        tensors[0][0][0, : tiny_moe.INTER], (good[FIRST].float().to(E4M3).float() * 0.5).to(torch.bfloat16)
    )
    moeshard.relocate(tensors, None, _plain_placement(), checkpoint=root / "good", **kwargs)
    assert torch.equal(tensors[2][1][5], good["layers.2.mlp.experts.5.down_proj.weight"])


# -- keys no parameter reads ----------------------------------------------------------------


def test_stray_expert(root, good, caplog):
    stray = "layers.0.mlp.experts.99.gate_proj.weight"
    for op in (moeshard.load, moeshard.verify):
        model = _meta_model()
        if op is moeshard.verify:
            moeshard.load(model, root / "good")
        with pytest.raises(
            ValueError,
            match=rf"checkpoint \S+stray-expert has 1 key\(s\) that no parameter or buffer "
            rf"of the model reads: 1 name experts or expert tensors the model does not "
            rf"have: \['{stray}'\]; pass strict=False",
        ):
            op(model, root / "stray-expert")
    model = _meta_model()
    with caplog.at_level(logging.WARNING, logger="moeshard"):
        rep = moeshard.load(model, root / "stray-expert", strict=False)
    assert rep.unused_keys == (stray,)
    assert tiny_moe.compare(model, good, _plain_placement()) == []
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    assert f"moeshard.load: checkpoint {root / 'stray-expert'} has 1 key(s)" in caplog.text and stray in caplog.text
    assert moeshard.verify(model, root / "stray-expert", strict=False).unused_keys == (stray,)


def test_empty_slots_do_not_make_keys_unused(root, good):
    # 10 slots per layer, two of them empty (a dead rank's): every logical expert is still read.
    model = _meta_model()
    for b in tiny_moe.MOE_BLOCKS:
        with torch.device("meta"):
            model.layers[b].mlp.experts = tiny_moe.Experts(E + 2, tiny_moe.HIDDEN, tiny_moe.INTER)
    row = [7, 6, 5, 4, 3, 2, 1, 0, -1, -1]
    pl = moeshard.Placement(np.array([row] * 2), num_logical=E, num_ranks=1)
    rep = moeshard.load(model, root / "good", placement=pl)
    assert rep.unused_keys == ()
    assert torch.equal(
        model.layers[2].mlp.experts.down_proj[2].detach(), good["layers.2.mlp.experts.5.down_proj.weight"].float()
    )


def test_layer_beyond_the_model(root):
    keys = sorted(k for k in moeshard.CheckpointIndex.open(root / "extra-layer").tensors if k.startswith("layers.3."))
    assert len(keys) == 4 + 3 * E
    with pytest.raises(
        ValueError,
        match=rf"has {len(keys)} key\(s\) that no parameter or buffer of the model reads: "
        rf"{len(keys)} are in layers beyond the model's 3 under 'layers': "
        r"\['layers\.3\.attn\.bias', 'layers\.3\.attn\.weight', "
        r"'layers\.3\.mlp\.experts\.0\.down_proj\.weight', "
        r"'layers\.3\.mlp\.experts\.0\.gate_proj\.weight', "
        r"'layers\.3\.mlp\.experts\.0\.up_proj\.weight'\] \.\.\. "
        rf"\({len(keys)} in all\); pass strict=False",
    ):
        moeshard.load(_meta_model(), root / "extra-layer")
    assert moeshard.load(_meta_model(), root / "extra-layer", strict=False).unused_keys == tuple(keys)


def test_unrelated_keys_are_reported_only(root, good, caplog):
    model = _meta_model()
    with caplog.at_level(logging.WARNING, logger="moeshard"):
        rep = moeshard.load(model, root / "unrelated")
    assert rep.unused_keys == ("layers.1.attn.rotary_emb.inv_freq", "rotary.inv_freq")
    assert caplog.records == []
    assert tiny_moe.compare(model, good, _plain_placement()) == []
    assert moeshard.verify(model, root / "unrelated").unused_keys == rep.unused_keys


def test_tied_embedding_with_both_names_stored(root, good, tmp_path):
    model = _meta_model()
    model.lm_head.weight = model.embed.weight  # tied: one parameter, two names
    rep = moeshard.load(model, root / "good")
    assert rep.unused_keys == ("lm_head.weight",)  # read under embed.weight, the other is harmless
    assert model.lm_head.weight is model.embed.weight  # still tied after materializing
    assert torch.equal(model.embed.weight.detach(), good["embed.weight"])
    # Stored once, under the head's name: read through the alias.
    only_head = {k: t for k, t in good.items() if k != "embed.weight"}
    model = _meta_model()
    model.lm_head.weight = model.embed.weight
    assert moeshard.load(model, _write(tmp_path / "head", only_head)).unused_keys == ()
    assert torch.equal(model.embed.weight.detach(), good["lm_head.weight"])


# -- transformers models --------------------------------------------------------------------


def _add_tensors(ckpt: Path, tensors: dict) -> None:
    """Add ``tensors`` to a sharded HF checkpoint as one more file named in its index."""
    from safetensors.torch import save_file

    save_file(tensors, str(ckpt / "extra.safetensors"))
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"].update({k: "extra.safetensors" for k in tensors})
    index.write_text(json.dumps(data))


def test_deepseek_v3_mtp_layer_is_ignored_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    # DeepSeek-V3's real depth (61 blocks, MTP layer 61 on disk) at toy width: 2 MoE blocks.
    config = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=61,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=59,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        max_position_embeddings=32,
    )
    cls = transformers.DeepseekV3ForCausalLM
    assert cls._keys_to_ignore_on_load_unexpected == [r"model\.layers\.61.*"]
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path / "ckpt", max_shard_size="200KB")
    ref = cls.from_pretrained(tmp_path / "ckpt").state_dict()
    mtp = {
        "model.layers.61.enorm.weight": torch.ones(16),
        "model.layers.61.eh_proj.weight": torch.ones(16, 32),
        "model.layers.61.mlp.experts.0.gate_proj.weight": torch.ones(8, 16),
    }
    _add_tensors(tmp_path / "ckpt", mtp)
    with torch.device("meta"):
        model = cls(config)
    rep = moeshard.load(model, tmp_path / "ckpt")
    assert rep.unused_keys == tuple(sorted(mtp))
    state = model.state_dict()
    assert set(state) == set(ref)
    for key, want in ref.items():
        assert torch.equal(state[key], want), key
    # Layer 62 is beyond the model and no pattern covers it.
    _add_tensors(tmp_path / "ckpt", {**mtp, "model.layers.62.enorm.weight": torch.ones(16)})
    with torch.device("meta"):
        model = cls(config)
    with pytest.raises(
        ValueError,
        match=r"1 are in layers beyond the model's 61 under 'model\.layers': "
        r"\['model\.layers\.62\.enorm\.weight'\]",
    ):
        moeshard.load(model, tmp_path / "ckpt")


def _qwen_with_lora(tmp_path: Path):
    """A tiny transformers Qwen3-MoE checkpoint and a peft adapter (attention LoRA) saved for it;
    returns ``(base dir, adapter dir, a fresh meta peft model builder)``."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    model.save_pretrained(tmp_path / "base", max_shard_size="10KB")
    peft.get_peft_model(model, lora).save_pretrained(tmp_path / "adapter")

    def build():
        with torch.device("meta"):
            return peft.get_peft_model(transformers.Qwen3MoeForCausalLM(config), lora)

    return tmp_path / "base", tmp_path / "adapter", build


def test_lora_load_applies_the_cast_rule_and_strict(tmp_path):
    from safetensors.torch import load_file, save_file

    base, adapter, build = _qwen_with_lora(tmp_path)
    weights = adapter / moeshard.lora.ADAPTER_WEIGHTS
    factors = load_file(str(weights))
    _, rep = moeshard.lora.load(build(), base, adapter)
    assert rep.unused_keys == ()
    # The base: a stray expert is refused as by moeshard.load.
    _add_tensors(base, {"model.layers.1.mlp.experts.9.down_proj.weight": torch.ones(16, 8)})
    with pytest.raises(ValueError, match=r"1 name experts .*'model\.layers\.1\.mlp\.experts\.9\.down_proj\.weight'"):
        moeshard.lora.load(build(), base, adapter)
    # The adapter: an FP8 factor into an fp32 LoRA weight, then an extra key.
    key = sorted(factors)[0]
    save_file({**factors, key: factors[key].to(E4M3)}, str(weights))
    with pytest.raises(ValueError, match=rf"LoRA weight \S+: checkpoint tensor '{key}' has dtype F8_E4M3 \(FP8\)"):
        moeshard.lora.load(build(), base, adapter, strict=False)
    extra = key.replace("layers.0", "layers.7")
    save_file({**factors, extra: factors[key].clone()}, str(weights))
    with pytest.raises(ValueError, match=rf"adapter \S+ has tensor '{extra}' \(1 such\).*pass strict=False"):
        moeshard.lora.load_adapter(build(), adapter)
    model = build()
    base_rep, rep = moeshard.lora.load(model, base, adapter, strict=False)
    assert base_rep.unused_keys == ("model.layers.1.mlp.experts.9.down_proj.weight",)
    assert rep.unused_keys == (extra,)
    got = dict(model.named_parameters())[key.replace(".lora_A.weight", ".lora_A.default.weight")]
    assert torch.equal(got.detach(), factors[key])


def test_expert_keys_match_the_spec_templates():
    # unused_keys builds every expert's keys by concatenation; any template gives keys() alike.
    from moeshard.models.describe import ExpertRef
    from moeshard.models.unused import expert_checkpoint_keys

    params = list(moeshard.HF_EXPERTS.params) + [
        moeshard.ExpertParam("w", ("{e:03d}.w.weight",)),
        moeshard.ExpertParam("w", ("{e}.w{e}.weight", "bias")),
    ]
    for p in params:
        for module in ("model.layers.3.mlp.experts", ""):
            want = [k for e in range(12) for k in p.keys(module, e)]
            assert sorted(expert_checkpoint_keys(ExpertRef(0, module, p), 12)) == sorted(want)


def test_adapter_config_is_checked_after_the_key_checks():
    """The adapter checks go on past the key and dtype checks to adapter_config.json's r and
    lora_alpha (a regression: an early return once skipped them)."""
    from moeshard.io.index import CheckpointIndex
    from moeshard.ops.lora import check_adapter

    empty = CheckpointIndex("adapter", {}, {})
    scalings = {"default": (8, 2.0)}
    with pytest.raises(ValueError, match=r"r=4, the model's adapter 'default' has r=8"):
        check_adapter([], empty, {"r": 4, "lora_alpha": 8}, "adapter", scalings)
    with pytest.raises(
        ValueError, match=r"lora_alpha=8 gives scaling 1\.0, the model's adapter 'default' has scaling 2\.0"
    ):
        check_adapter([], empty, {"r": 8, "lora_alpha": 8}, "adapter", scalings)
    assert check_adapter([], empty, {"r": 8, "lora_alpha": 16}, "adapter", scalings) == ()


def test_one_walk_is_torchs_walks(tmp_path):
    """describe_model's single walk of the module tree lists what torch's ``named_modules()``,
    ``named_parameters(remove_duplicate=False)`` and persistent ``named_buffers()`` list, and
    finds peft's wrappers as ``hasattr`` does: a peft model, a plain one, a shared submodule."""
    from moeshard.models.describe import has_attr, preorder, walk_modules

    _, _, build = _qwen_with_lora(tmp_path)
    peft_model = build()
    shared = torch.nn.Linear(2, 2)
    tied = torch.nn.Sequential(shared, torch.nn.ReLU(), torch.nn.Sequential(shared, torch.nn.BatchNorm1d(2)))
    tied.register_module("none", None)
    for model in (peft_model, peft_model.base_model.model, tied):
        tree = walk_modules(model)
        assert list(preorder(model)) == list(model.named_modules(remove_duplicate=False))
        assert tree.modules == list(model.named_modules())
        assert [(n, id(p)) for n, p in tree.params] == [
            (n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)
        ]
        persistent = {n for n, _ in model.state_dict(keep_vars=True).items()}
        assert [n for n, _ in tree.buffers] == [n for n, _ in model.named_buffers() if n in persistent]
        for _, mod in tree.modules:
            for attr in ("base_layer", "lora_A", "weight", "training", "forward", "absent"):
                assert has_attr(mod, attr) == hasattr(mod, attr), (type(mod).__name__, attr)
    assert walk_modules(peft_model).peft and not walk_modules(tied).peft
