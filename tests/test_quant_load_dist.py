"""Packed quantized checkpoints (gpt-oss MXFP4) loaded dequantized into a float model on EP x
expert-FSDP ranks with redundant experts, verified and relocated from the checkpoint; every
value compared with an independent dequantization (numpy E2M1 table times 2^(scale - 127) in
float32, cast once), and the refusals (a shard that splits a group, a missing scale, a float
model loading a quantized checkpoint with dequantize=False: named format) raised on every rank."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from mp import run_ranks

# FP4 E2M1 codes 0..15 (low nibble = even index), as the OCP microscaling spec lists them.
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def gptoss_config(hidden: int = 64):
    return transformers.GptOssConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * 2,
    )


def write_mxfp4(directory: str, hidden: int = 64, drop: str | None = None) -> dict[str, torch.Tensor]:
    """A tiny gpt-oss checkpoint with MXFP4 experts (random codes and E8M0 scales, as gpt-oss
    stores them: ``*_blocks [E, rows, cols / 32, 16]``, ``*_scales [E, rows, cols / 32]``, the
    parameter the transpose of the decoded ``[E, rows, cols]``); returns the float32 state dict
    it stands for. ``drop``: a key left out."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(gptoss_config(hidden))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    ref = dict(sd)
    rng = np.random.default_rng(1)
    for k in list(sd):
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, a, b = sd.pop(k).shape  # parameter [E, a, b]; stored decoded [E, b, a]
            codes = rng.integers(0, 16, (e, b, a), dtype=np.uint8)
            scales = rng.integers(118, 132, (e, b, a // 32), dtype=np.uint8)
            packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(e, b, a // 32, 16)
            sd[k + "_blocks"], sd[k + "_scales"] = torch.from_numpy(packed.copy()), torch.from_numpy(scales)
            deq = E2M1[codes] * np.exp2(scales.astype(np.float32) - 127).repeat(32, axis=-1)
            ref[k] = torch.from_numpy(np.ascontiguousarray(deq.transpose(0, 2, 1)))
    if drop is not None:
        sd.pop(drop)
    os.makedirs(directory, exist_ok=True)
    half = len(sd) // 2
    keys = sorted(sd)
    files = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    for name, ks in files.items():
        save_file({k: sd[k] for k in ks}, os.path.join(directory, name))
    index = {"metadata": {}, "weight_map": {k: n for n, ks in files.items() for k in ks}}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    cfg = gptoss_config(hidden).to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return ref


def _placement(seed: int, n: int, layers: int, ranks: int = 2):
    """``n`` experts and redundant copies (slots a multiple of ``ranks``), shuffled per layer."""
    import moeshard

    rng = np.random.default_rng(seed)
    extra = ranks + (-(n + ranks)) % ranks
    rows = [rng.permutation(np.concatenate([np.arange(n), rng.integers(0, n, extra)])) for _ in range(layers)]
    return moeshard.Placement(np.stack(rows), num_logical=n, num_ranks=ranks)


def _state(model, pl) -> dict[str, torch.Tensor]:
    """Full tensors, expert parameters as one row per logical expert (every copy checked equal)."""
    from torch.distributed.tensor import DTensor

    experts = [n for n, m in model.named_modules() if n.endswith(".experts")]
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        module, _, attr = name.rpartition(".")
        if module in experts and full.shape[0] == pl.phy2log.shape[1]:
            layer = experts.index(module)
            for e in range(pl.num_logical):
                slots = pl.log2phy[layer, e, : pl.logcnt[layer, e]].tolist()
                assert all(torch.equal(full[s], full[slots[0]]) for s in slots), name
            full = full[torch.as_tensor(pl.log2phy[layer, :, 0])]
        out[name] = full.clone()
    return out


def _build(config, placement, efsdp: int):
    """``config``'s model on the meta device in bf16, parallelized with ``placement`` on the 4
    ranks: EP 2 x expert-FSDP 2, or EP 4 (``efsdp=1``: gpt-oss, whose expert biases its spec does
    not shard, so that parallelize refuses expert FSDP)."""
    import moeshard

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    mesh = moeshard.make_mesh("cpu", ep=4 // efsdp, efsdp=efsdp)
    moeshard.parallelize(model, mesh, placement)
    return model


PACKED = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


def _kept_packed(path: str) -> dict:
    """gpt-oss with its experts kept packed (parameters named by the checkpoint's keys, uint8),
    on EP 4 with redundant experts: loaded as stored; each rank's slots as bytes, by logical
    expert."""
    from torch import nn

    import moeshard
    from moeshard.models.adapters import DEFAULT_SPECS, ExpertParam, ExpertsSpec

    class PackedExperts(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
            shapes = {
                "gate_up_proj_blocks": (e, 2 * i, h // 32, 16),
                "gate_up_proj_scales": (e, 2 * i, h // 32),
                "down_proj_blocks": (e, h, i // 32, 16),
                "down_proj_scales": (e, h, i // 32),
            }
            for name, shape in shapes.items():
                self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False))
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
            self.down_proj_bias = nn.Parameter(torch.empty(e, h))

    spec = ExpertsSpec(
        module=r"(^|\.)experts$",
        params=tuple(ExpertParam(n, (n,)) for n in (*PACKED, "gate_up_proj_bias", "down_proj_bias")),
        classes=frozenset({"PackedExperts"}),
    )
    config = gptoss_config()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        for layer in model.model.layers:
            layer.mlp.experts = PackedExperts(config)
    pl = _placement(7, 4, 2, 4)
    specs = (spec, *DEFAULT_SPECS)
    moeshard.parallelize(model, moeshard.make_mesh("cpu", ep=4), pl, specs=specs, ep_forward=False)
    rep = moeshard.load(model, path, placement=pl, specs=specs)
    assert moeshard.verify(model, path, placement=pl, specs=specs).num_boxes_checked > 0
    slots = {}
    for layer, block in enumerate(model.model.layers):
        for name in PACKED:
            local = getattr(block.mlp.experts, name).to_local()
            first = local.shape[0] * int(torch.distributed.get_rank())
            for j in range(local.shape[0]):
                slots[(layer, name, first + j)] = (int(pl.phy2log[layer, first + j]), local[j].clone())
    return {"slots": slots, "dequantized": rep.dequantized_keys, "unused": rep.unused_keys}


def formats_worker(cases: list, missing: str, bad_shape: tuple) -> dict:
    """Per format: the quantized checkpoint loaded dequantized (shared, and single storage with
    a small staging budget: packed pieces sent between ranks), verified, a wrong value found,
    relocated from the checkpoint; the reference float checkpoint loaded the same way."""
    import moeshard

    out: dict = {}
    for fmt, path, ref_path, config, num_experts, efsdp in cases:
        moe_layers = config.num_hidden_layers - getattr(config, "first_k_dense_replace", 0)
        ranks = 4 // efsdp
        pl, new = _placement(5, num_experts, moe_layers, ranks), _placement(6, num_experts, moe_layers, ranks)
        res: dict = {"loads": []}
        for storage, staging in (("shared", 256 << 20), ("single", 16384)):
            model = _build(config, pl, efsdp)
            rep = moeshard.load(model, path, placement=pl, storage=storage, staging_bytes=staging)
            assert moeshard.verify(model, path, placement=pl).num_boxes_checked > 0
            res["loads"].append((storage, rep.bytes_read_rank, rep.plan["read_bytes_total"], _state(model, pl)))
        experts = next(m for n, m in model.named_modules() if n.endswith("layers.1.mlp.experts"))
        local = experts.down_proj.to_local()
        kept = local.view(-1)[0].clone()
        with torch.no_grad():
            local.view(-1)[0] += 1
        with pytest.raises(moeshard.DistributedError) as wrong_value:
            moeshard.verify(model, path, placement=pl)
        res["wrong_value"] = str(wrong_value.value)
        with torch.no_grad():
            local.view(-1)[0] = kept
        moved = moeshard.relocate(model, pl, new, checkpoint=path, from_checkpoint=True)
        assert moeshard.verify(model, path, placement=new).num_boxes_checked > 0
        res["relocated"] = (moved.bytes_read_rank, _state(model, new))
        if ref_path is not None:
            reference = _build(config, pl, efsdp)
            moeshard.load(reference, ref_path, placement=pl)
            res["reference"] = _state(reference, pl)
            # A float model told not to dequantize: refused, naming the format and the way out.
            with pytest.raises(moeshard.DistributedError) as as_stored:
                moeshard.load(_build(config, pl, efsdp), path, placement=pl, dequantize=False)
            res["as_stored"] = str(as_stored.value)
        out[fmt] = res
    out["kept"] = _kept_packed(cases[0][1])
    fmt, path, ref_path, config, num_experts, efsdp = cases[0]
    pl = _placement(5, num_experts, 2, 4 // efsdp)
    model = _build(config, pl, efsdp)
    with pytest.raises(moeshard.DistributedError) as refused:
        moeshard.load(model, missing, placement=pl)
    out["missing"] = str(refused.value)
    # An INT4 weight whose weight_shape disagrees with its packed values, checked by the ranks
    # that read it (not at index open): refused on every rank.
    path, config, num_experts = bad_shape
    pl = _placement(5, num_experts, config.num_hidden_layers - config.first_k_dense_replace, 2)
    with pytest.raises(moeshard.DistributedError) as refused:
        moeshard.load(_build(config, pl, 2), path, placement=pl)
    out["bad_shape"] = str(refused.value)
    return out


# How a refusal names each fixture's format (io.quant.describe) when a float model loads it with
# dequantize=False.
AS_STORED = {
    "mxfp4": "mxfp4 (mxfp4, group 32, E8M0 scale)",
    "int4": "int4 (compressed-tensors/pack-quantized, group 32, ",
    "nvfp4": "nvfp4 (compressed-tensors/nvfp4-pack-quantized, group 16, F8_E4M3 scale, global scale)",
    "modelopt-nvfp4": "nvfp4 (modelopt/NVFP4, group 16, F8_E4M3 scale, global scale)",
    "fp8": "fp8 (compressed-tensors/float-quantized, per channel, ",
}


@pytest.mark.dist
def test_packed_formats_load_dequantized_verify_relocate_and_refuse(tmp_path):
    """gpt-oss MXFP4 (EP 4), DeepSeek-V3 INT4, Qwen3-MoE NVFP4 (compressed-tensors and
    ModelOpt) and FP8 per channel (EP 2 x expert-FSDP 2), redundant experts: every value equal
    to the independent dequantizer's (through a float load of its reference checkpoint, and for
    gpt-oss also to this file's own numpy decode), bytes read as the plan counts them."""
    from quant_fixtures import WRITERS, corrupt_weight_shape, write_reference

    own = str(tmp_path / "own-mxfp4")
    own_ref = write_mxfp4(own)
    missing = str(tmp_path / "missing")
    write_mxfp4(missing, drop="model.layers.1.mlp.experts.down_proj_scales")
    cases = []
    for fmt in ("mxfp4", "int4", "nvfp4", "modelopt-nvfp4", "fp8"):
        fx = WRITERS[fmt](str(tmp_path / fmt))
        ref_path = write_reference(fx, str(tmp_path / f"{fmt}-reference"))
        n = getattr(fx.config, "num_local_experts", None) or getattr(fx.config, "n_routed_experts", None)
        n = n or fx.config.num_experts
        cases.append((fmt, fx.path, ref_path, fx.config, n, 1 if fmt == "mxfp4" else 2))
    cases.insert(0, ("own-mxfp4", own, None, gptoss_config(), 4, 1))
    bad = str(tmp_path / "bad-shape")
    shutil.copytree(cases[2][1], bad)  # the INT4 DeepSeek-V3
    bad_key, bad_value = corrupt_weight_shape(bad)
    bad_shape = (bad, cases[2][3], cases[2][4])
    results = run_ranks(formats_worker, cases, missing, bad_shape, world=4, local_world=2, timeout=600)
    own_want = {k: v.to(torch.bfloat16) for k, v in own_ref.items()}
    from safetensors import safe_open

    stored = {}
    for name in os.listdir(own):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(own, name), "pt") as f:
                stored.update({k: f.get_tensor(k) for k in f.keys()})
    for rank, res in enumerate(results):
        assert "down_proj_scales" in res["missing"], res["missing"]
        assert f"{bad_key}_shape: weight_shape {bad_value} disagrees" in res["bad_shape"], res["bad_shape"]
        kept = res["kept"]
        assert kept["unused"] == () and len(kept["slots"]) == 2 * 4 * 2  # 2 layers x 4 tensors x 2 slots
        for (layer, name, _), (expert, got) in kept["slots"].items():  # the stored bytes, unchanged
            assert torch.equal(got, stored[f"model.layers.{layer}.mlp.experts.{name}"][expert]), (rank, name)
        for fmt, *_ in cases:
            r = res[fmt]
            want = own_want if fmt == "own-mxfp4" else r["reference"]
            assert set(want) == set(r["loads"][0][3])
            for storage, read, _, state in r["loads"]:
                if storage == "single":
                    assert (read > 0) == (rank == 0), (fmt, rank, read)
                for name, got in state.items():
                    assert torch.equal(got, want[name]), f"{fmt} rank {rank} {storage} {name}"
            for name, got in r["relocated"][1].items():
                assert torch.equal(got, want[name]), f"{fmt} rank {rank} relocated {name}"
            assert "down_proj" in r["wrong_value"], (fmt, r["wrong_value"])
            if fmt in AS_STORED:  # every rank's line names the format and says to dequantize
                text = r["as_stored"]
                assert text.count(f" is stored quantized as {AS_STORED[fmt]}") == 4, (fmt, text)
                assert text.count("pass dequantize=True") == 4, (fmt, text)
    for fmt, *_ in cases:
        for i, storage in enumerate(("shared", "single")):
            read = sum(res[fmt]["loads"][i][1] for res in results)
            planned = results[0][fmt]["loads"][i][2]
            # What the ranks read is what the plan counts: packed values and scales, not floats.
            assert read == planned, (fmt, storage, read, planned)
        assert sum(res[fmt]["relocated"][0] for res in results) > 0  # changed slots re-read, decoded


def test_a_box_that_splits_a_group_is_refused_naming_it(tmp_path):
    """An FSDP shard (a need) or a read of a few boxes cutting a group of 32 values of an MXFP4
    weight: ValueError naming the key and the group, never a wrong value."""
    from moeshard.io.index import CheckpointIndex
    from moeshard.io.reader import CheckpointReader
    from moeshard.plan.needs import Need, NeedTable
    from moeshard.plan.pieces import cut_pieces

    ref = write_mxfp4(str(tmp_path))
    index = CheckpointIndex.open(str(tmp_path))
    key = "model.layers.0.mlp.experts.gate_up_proj"  # [E, H = 64, 2I = 128], packed along H
    assert index.info(key).shape == (4, 64, 128)
    half = ((0, 1), (0, 48), (0, 128))  # rows 0..47 of H: the second group cut at 16 of 32
    table = NeedTable.from_needs([Need(0, 0, ((0, 1), (0, 48), (0, 128)), key, half)])
    with pytest.raises(ValueError, match=r"experts.gate_up_proj.*group of 32 values"):
        cut_pieces(table, index, None)
    with CheckpointReader(index) as reader:
        with pytest.raises(ValueError, match="multiples of 32"):
            reader.read(key, half)
        whole = ((1, 2), (32, 32), (5, 70))  # any box on whole groups: bit-exact
        got = reader.read(key, whole)
        assert torch.equal(got, ref[key][1:3, 32:64, 5:75])
        before = reader.bytes_read
        reader.read(key, whole, out=torch.empty(2, 32, 70, dtype=torch.bfloat16))
        # 2 experts x 70 rows x one group of 32 values: 16 bytes of codes and 1 scale byte each
        assert reader.bytes_read - before == 2 * 70 * (16 + 1)
