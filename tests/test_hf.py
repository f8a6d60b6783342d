"""Tier 3: a real transformers Qwen3-MoE model, saved by save_pretrained (sharded, per-expert
keys on disk), built on meta, parallelized (EP=4; EP=2 x expert-FSDP=2), loaded by moeshard on
4 gloo ranks, gathered back with DTensor.full_tensor(), and compared bit for bit with
``from_pretrained`` in one process (fused gate_up_proj / down_proj in memory).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from mp import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

NUM_LAYERS, NUM_EXPERTS = 2, 8


def _config(tied: bool):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def _placement(kind: str, ep: int):
    import moeshard

    if kind == "contiguous":
        return moeshard.Placement.contiguous(NUM_LAYERS, NUM_EXPERTS, ep)
    # Shuffled, redundant: 12 slots, every expert at least once, hot experts twice or more.
    rng = np.random.default_rng(ep)
    rows = [
        rng.permutation(np.concatenate([np.arange(NUM_EXPERTS), rng.integers(0, NUM_EXPERTS, 12 - NUM_EXPERTS)]))
        for _ in range(NUM_LAYERS)
    ]
    return moeshard.Placement(np.stack(rows), num_logical=NUM_EXPERTS, num_ranks=ep)


_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def hf_worker(scenarios) -> list:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import Qwen3MoeForCausalLM

    import moeshard

    rank = dist.get_rank()
    meshes = {}
    out = []
    for ckpt, tied, ep, efsdp, kind, storage in scenarios:
        # Build like from_pretrained(dtype=bf16) does: bf16 default dtype (rotary buffers stay fp32).
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta"):
                model = Qwen3MoeForCausalLM(_config(tied))
        finally:
            torch.set_default_dtype(old)
        if (ep, efsdp) not in meshes:
            meshes[(ep, efsdp)] = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp)
        pl = _placement(kind, ep)
        moeshard.parallelize(model, meshes[(ep, efsdp)], pl)
        report = moeshard.load(model, ckpt, placement=pl, storage=storage)
        verified = moeshard.verify(model, ckpt, placement=pl)
        experts = [n for n, _ in model.named_modules() if n.endswith(".experts")]
        state, copies_agree, placements = {}, True, {}
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            placements[name] = str(getattr(p, "placements", None))
            m = _EXPERTS.match(name)
            if m:
                # Physical slots -> logical experts; every copy of an expert must be identical.
                layer = experts.index(m[1])
                assert full.shape[0] == pl.num_physical
                logical = full[torch.as_tensor(pl.log2phy[layer, :, 0])]
                for e in range(pl.num_logical):
                    for slot in pl.log2phy[layer, e, : pl.logcnt[layer, e]].tolist():
                        copies_agree &= torch.equal(full[slot], logical[e])
                full = logical
            state[name] = full.detach().clone()
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        tied_ok = (model.lm_head.weight is model.model.embed_tokens.weight) if tied else None
        rec = dict(
            scenario=(tied, ep, efsdp, kind, storage),
            storage=report.storage,
            copies_agree=copies_agree,
            boxes=verified.num_boxes_checked,
            tied_ok=tied_ok,
            placements=placements,
        )
        if rank == 0:
            rec.update(state=state, buffers=buffers)
        out.append(rec)
    return out


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory):
    from transformers import Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("hf")
    refs = {}
    for tied in (False, True):
        ckpt = root / ("tied" if tied else "untied")
        torch.manual_seed(1 + tied)
        model = Qwen3MoeForCausalLM(_config(tied)).to(torch.bfloat16)
        with torch.no_grad():  # make every parameter distinct (norms start at ones)
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(ckpt, max_shard_size="20KB")
        ref = Qwen3MoeForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
        refs[tied] = (str(ckpt), ref.state_dict(), dict(ref.named_buffers()), len(list(ckpt.glob("*.safetensors"))))
    scenarios = [
        (refs[False][0], False, 4, 1, "contiguous", "shared"),
        (refs[False][0], False, 2, 2, "shuffled", "auto"),
        (refs[False][0], False, 4, 1, "shuffled", "single"),
        (refs[True][0], True, 2, 2, "shuffled", "node"),
        (refs[True][0], True, 4, 1, "contiguous", "single"),
    ]
    results = run_ranks(hf_worker, scenarios, world=4, local_world=2, timeout=280)
    return refs, results


def test_checkpoint_is_sharded_with_per_expert_keys(hf_results):
    refs, _ = hf_results
    import moeshard

    for tied in (False, True):
        ckpt, _, _, num_files = refs[tied]
        assert num_files > 3
        index = moeshard.CheckpointIndex.open(ckpt)
        assert "model.layers.1.mlp.experts.7.gate_proj.weight" in index
        assert "model.layers.1.mlp.experts.gate_up_proj" not in index
        assert ("lm_head.weight" in index) is (not tied)


@pytest.mark.parametrize("i", range(5))
def test_full_state_bit_for_bit(hf_results, i):
    refs, results = hf_results
    rec0 = results[0][i]
    tied, ep, efsdp, kind, storage = rec0["scenario"]
    _, ref_state, ref_buffers, _ = refs[tied]
    for rank, per_rank in enumerate(results):
        rec = per_rank[i]
        assert rec["copies_agree"], f"rank {rank}: copies of one logical expert differ"
        assert rec["boxes"] > 0
        if tied:
            assert rec["tied_ok"]
    assert rec0["storage"] == {"auto": "shared"}.get(storage, storage)
    # The layout really is EP (+ expert FSDP) + FSDP2.
    experts_pl = rec0["placements"]["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts_pl == ("(Shard(dim=1), Shard(dim=0))" if efsdp > 1 else "(Shard(dim=0),)")
    assert rec0["placements"]["model.layers.0.self_attn.q_proj.weight"] == "(Shard(dim=0),)"
    state = rec0["state"]
    named = dict(state)
    if tied:
        named["lm_head.weight"] = state["model.embed_tokens.weight"]
    assert set(named) == set(ref_state), set(named) ^ set(ref_state)
    for key, want in ref_state.items():
        got = named[key]
        assert got.dtype == want.dtype == torch.bfloat16, key
        assert got.shape == want.shape, key
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{key} differs"
    # Non-persistent buffers (RoPE) are recomputed, equal to from_pretrained's.
    buffers = rec0["buffers"]
    assert set(buffers) == set(ref_buffers)
    for key, want in ref_buffers.items():
        assert buffers[key].dtype == want.dtype and torch.equal(buffers[key], want), key
    assert "model.rotary_emb.inv_freq" in buffers
