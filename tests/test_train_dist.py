"""Tier 3, training: loss parity with one process (the check of transformers PR #45662 / TRL).

Tiny fp32 Qwen3-MoE, Mixtral and DeepSeek-V3 models are written by ``save_pretrained``. On 4
gloo ranks each is built on meta, parallelized (EP=4, or EP=2 x expert-FSDP=2), loaded by
moeshard and trained 4 AdamW steps on fixed data, each rank on its quarter of the global batch
(tokens reach their experts through the EP all-to-all). The mean loss over ranks and the
global gradient norm of every step must match ``from_pretrained`` + the same 4 steps on the
whole batch in one process within 1e-5 relative. Redundant placements (hot experts copied)
exercise copy selection and :func:`moeshard.sync_redundant_grads`. Two runs rebalance between
steps, one layer per chunk (:func:`moeshard.relocate_chunks`) with a forward after each chunk
whose logits must not change, and AdamW's state moving with its experts: their losses too
must match the one-process run's. After training, a relocation
to another placement must leave the logits unchanged (tokens follow their experts).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mp import run_ranks
from training import one_process_steps

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

STEPS, LR, WORLD, SEQ = 4, 1e-3, 4, 16
RTOL = 1e-5


def _config(family: str):
    common = dict(
        vocab_size=128,
        hidden_size=32,
        num_attention_heads=4,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=8,
            **common,
        )
    if family == "mixtral":  # 6 experts: 3 slots per EP rank, which expert-FSDP=2 does not divide
        return transformers.MixtralConfig(
            intermediate_size=16, num_hidden_layers=2, num_key_value_heads=2, head_dim=8, num_local_experts=6, **common
        )
    assert family == "deepseek_v3"  # first layer dense, shared experts, grouped routing
    return transformers.DeepseekV3Config(
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        **common,
    )


NUM_LAYERS = {"qwen3_moe": 2, "mixtral": 2, "deepseek_v3": 2}
NUM_EXPERTS = {"qwen3_moe": 8, "mixtral": 6, "deepseek_v3": 8}


def _data() -> torch.Tensor:
    return torch.randint(0, 128, (WORLD, SEQ), generator=torch.Generator().manual_seed(0))


def _placement(family: str, ep: int, redundant: bool, seed: int | None = None):
    import moeshard

    layers, experts = NUM_LAYERS[family], NUM_EXPERTS[family]
    if not redundant:
        return moeshard.Placement.contiguous(layers, experts, ep)
    # Every expert once, plus one extra copy per EP rank of random experts, shuffled.
    rng = np.random.default_rng(ep if seed is None else seed)
    rows = [rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, ep)])) for _ in range(layers)]
    return moeshard.Placement(np.stack(rows), num_logical=experts, num_ranks=ep)


def train_worker(ckpts: dict, scenarios: list) -> list:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import moeshard

    rank = dist.get_rank()
    ids = _data()[rank : rank + 1]
    meshes, out = {}, []
    for family, ep, efsdp, redundant, rebalance in scenarios:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(_config(family))
        if (ep, efsdp) not in meshes:
            meshes[(ep, efsdp)] = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp)
        pl = _placement(family, ep, redundant)
        moeshard.parallelize(model, meshes[(ep, efsdp)], pl)
        moeshard.load(model, ckpts[family], placement=pl)
        all_dtensors = all(isinstance(p, DTensor) for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=LR)  # stock optimizer, foreach default
        losses, norms, synced = [], [], 0
        chunks, chunk_diff, moved = [], 0.0, False
        for step in range(STEPS):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            synced += moeshard.sync_redundant_grads(model)
            norms.append(float(moeshard.grad_norm(model)))
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / dist.get_world_size())
            if rebalance and step < STEPS - 1:
                # Rebalance between steps, one layer per chunk with a forward after each chunk
                # (serving between chunks); AdamW's moments move with their experts, so the
                # next steps' losses stay the one-process run's.
                new = _placement(family, ep, True, seed=100 + step)
                spr = new.slots_per_rank(ep)
                mine = slice((rank % ep) * spr, (rank % ep + 1) * spr)
                moved |= not np.array_equal(new.phy2log[:, mine], pl.phy2log[:, mine])
                with torch.no_grad():
                    before = model(input_ids=ids).logits
                    for st in moeshard.relocate_chunks(model, pl, new, layers_per_chunk=1, optimizer=opt):
                        chunks.append(st.layers)
                        after = model(input_ids=ids).logits
                        chunk_diff = max(chunk_diff, float((after - before).abs().max() / before.abs().max()))
                pl = new
        rec = dict(
            losses=losses,
            norms=norms,
            all_dtensors=all_dtensors,
            synced=synced,
            chunks=chunks,
            chunk_diff=chunk_diff,
            moved=moved,
        )
        if not redundant and not rebalance:
            # Rebalance the trained model: after relocate, tokens must follow their experts to
            # their new slots, so the logits stay those of the same logical model.
            with torch.no_grad():
                before = model(input_ids=ids).logits
                rng = np.random.default_rng(1)
                new = moeshard.Placement(
                    np.stack([rng.permutation(pl.num_physical) for _ in range(NUM_LAYERS[family])]),
                    num_logical=pl.num_logical,
                    num_ranks=ep,
                )
                moeshard.relocate(model, pl, new)
                after = model(input_ids=ids).logits
            spr = new.slots_per_rank(ep)
            mine = slice((rank % ep) * spr, (rank % ep + 1) * spr)
            rec["relocated_logits_diff"] = float((after - before).abs().max() / before.abs().max())
            rec["slots_changed"] = not np.array_equal(new.phy2log[:, mine], pl.phy2log[:, mine])
        out.append(rec)
    return out


def _reference(ckpt: str) -> tuple[list[float], list[float]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    return one_process_steps(model, _data(), STEPS, LR)


SCENARIOS = [  # (family, EP, expert FSDP, redundant copies, rebalance between steps)
    ("qwen3_moe", 4, 1, False, False),
    ("qwen3_moe", 2, 2, False, False),
    ("qwen3_moe", 4, 1, True, False),
    ("qwen3_moe", 2, 2, True, False),
    ("mixtral", 2, 2, False, False),
    ("deepseek_v3", 4, 1, True, False),
    ("qwen3_moe", 2, 2, True, True),
    ("deepseek_v3", 4, 1, True, True),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    ckpts, refs = {}, {}
    for family in NUM_LAYERS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(family))
        with torch.no_grad():  # distinct values everywhere (norms start at ones, biases at zero)
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        ckpts[family] = str(root / family)
        model.save_pretrained(ckpts[family], max_shard_size="50KB")
        refs[family] = _reference(ckpts[family])
    results = run_ranks(train_worker, ckpts, SCENARIOS, world=WORLD, local_world=2, timeout=280)
    return refs, results


@pytest.mark.parametrize(
    "i",
    range(len(SCENARIOS)),
    ids=[f"{f}-ep{e}-efsdp{d}{'-redundant' if r else ''}{'-rebalanced' if b else ''}" for f, e, d, r, b in SCENARIOS],
)
def test_loss_and_grad_norm_match_one_process(trained, i):
    refs, results = trained
    family, _, _, redundant, rebalance = SCENARIOS[i]
    ref_losses, ref_norms = refs[family]
    assert ref_losses[-1] < ref_losses[0], "the reference must actually train"
    for rank_results in results:
        got = rank_results[i]
        assert got["all_dtensors"], "every parameter must be a DTensor (a stock optimizer cannot mix them)"
        np.testing.assert_allclose(got["losses"], ref_losses, rtol=RTOL, atol=0)
        np.testing.assert_allclose(got["norms"], ref_norms, rtol=RTOL, atol=0)
        # Redundant placements: every MoE layer was synchronized at every step.
        assert got["synced"] == (STEPS * NUM_LAYERS[family] if redundant else 0)
        if rebalance:  # every chunk moved one layer; forwards between chunks kept the logits
            assert got["chunks"] and all(len(c) == 1 for c in got["chunks"])
            assert len(got["chunks"]) == (STEPS - 1) * NUM_LAYERS[family]
            assert got["chunk_diff"] < 1e-5
        elif not redundant:
            assert got["slots_changed"]
            assert got["relocated_logits_diff"] < 1e-5
    if rebalance:
        assert any(r[i]["moved"] for r in results), "the rebalancing must move experts between ranks"
