"""Packed quantized checkpoints (gpt-oss MXFP4) loaded dequantized into a float model on EP x
expert-FSDP ranks with redundant experts, verified and relocated from the checkpoint; every
value compared with an independent dequantization (numpy E2M1 table times 2^(scale - 127) in
float32, cast once), and the refusals (a shard that splits a group, a missing scale) raised on
every rank."""

from __future__ import annotations

import json
import os

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


def _placement(seed: int, n: int, layers: int):
    """``n`` experts and 2 redundant copies per layer, shuffled, on 2 EP ranks."""
    import moeshard

    rng = np.random.default_rng(seed)
    rows = [rng.permutation(np.concatenate([np.arange(n), rng.integers(0, n, 2)])) for _ in range(layers)]
    return moeshard.Placement(np.stack(rows), num_logical=n, num_ranks=2)


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


def quant_worker(ckpt: str, missing: str) -> dict:
    import moeshard

    def build(hidden: int = 64):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(gptoss_config(hidden), dtype=torch.bfloat16)
        pl = _placement(5, 4, 2)
        # gpt-oss's expert biases are no expert parameters of its spec: parallelize refuses efsdp > 1
        moeshard.parallelize(model, moeshard.make_mesh("cpu", ep=2), pl)
        return model, pl

    out: dict = {"loads": []}
    for storage, staging in (("shared", 256 << 20), ("single", 8192)):
        model, pl = build()
        rep = moeshard.load(model, ckpt, placement=pl, storage=storage, staging_bytes=staging)
        assert moeshard.verify(model, ckpt, placement=pl).num_boxes_checked > 0
        out["loads"].append((storage, rep.bytes_read_rank, rep.plan["read_bytes_total"], _state(model, pl)))
    # verify decodes too: one wrong value in the model is found
    p = model.model.layers[1].mlp.experts.down_proj
    local = p.to_local()
    with torch.no_grad():
        local.view(-1)[0] += 1
    with pytest.raises(moeshard.DistributedError) as wrong_value:
        moeshard.verify(model, ckpt, placement=pl)
    out["wrong_value"] = str(wrong_value.value)
    with torch.no_grad():
        local.view(-1)[0] -= 1
    new = _placement(6, 4, 2)
    moved = moeshard.relocate(model, pl, new, checkpoint=ckpt, from_checkpoint=True)
    assert moeshard.verify(model, ckpt, placement=new).num_boxes_checked > 0
    out["relocated"] = (moved.bytes_read_rank, _state(model, new))
    for name, path in (("missing", missing),):
        model, pl = build()
        with pytest.raises(moeshard.DistributedError) as refused:
            moeshard.load(model, path, placement=pl)
        out[name] = str(refused.value)
    return out


@pytest.mark.dist
def test_mxfp4_loads_dequantized_verifies_relocates_and_refuses(tmp_path):
    ckpt, missing = (str(tmp_path / n) for n in ("mxfp4", "missing"))
    ref = write_mxfp4(ckpt)
    write_mxfp4(missing, drop="model.layers.1.mlp.experts.down_proj_scales")
    results = run_ranks(quant_worker, ckpt, missing, world=2, local_world=1, timeout=400)
    want = {k: v.to(torch.bfloat16) for k, v in ref.items()}
    total, planned_total = {}, {}
    for rank, res in enumerate(results):
        for storage, read, planned, state in res["loads"]:
            total[storage] = total.get(storage, 0) + read
            planned_total[storage] = planned
            if storage == "single":
                assert (read > 0) == (rank == 0)
            assert set(state) == set(want)
            for name, got in state.items():
                assert torch.equal(got, want[name]), f"rank {rank} {storage} {name}"
        for name, got in res["relocated"][1].items():
            assert torch.equal(got, want[name]), f"rank {rank} relocated {name}"
        assert "down_proj" in res["wrong_value"], res["wrong_value"]
        assert "down_proj_scales" in res["missing"], res["missing"]
    # What the ranks read is what the plan counts (packed values and scales, not floats).
    assert planned_total == total, (planned_total, total)
    floats = sum(v.numel() * 4 for v in ref.values())
    assert total["single"] < floats / 2, (total, floats)


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
