"""Experts fused on disk (one ``[num_experts, ...]`` tensor per layer and projection, as gpt-oss
and Llama 4 checkpoints ship them), loaded by moeshard on 2 gloo ranks with EP=2 and a shuffled,
redundant placement (6 slots for 4 experts): every slot gathered back with full_tensor() equals
its logical expert's row of the checkpoint's fused tensor, bit for bit, and so does every other
parameter (gpt-oss's expert biases stay whole tensors); verify passes. Then a relocation to another
placement reads every changed slot from the fused tensors, and the same holds; save writes the
fused layout save_pretrained writes, which from_pretrained reads back bit for bit.

The single-process load of every fused-on-disk family is in tests/test_families.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import hf_families
from mp import run_ranks

transformers = pytest.importorskip("transformers")

FAMILIES = ("gpt_oss", "llama4_text", "dbrx")  # dbrx: [E * n, d] on disk and in memory (experts merged into dim 0)
EXPERTS, SLOTS = 4, 6


def _placement(layers: int, seed: int = 3):
    import moeshard

    rng = np.random.default_rng(seed)
    rows = [
        rng.permutation(np.concatenate([np.arange(EXPERTS), rng.integers(0, EXPERTS, SLOTS - EXPERTS)]))
        for _ in range(layers)
    ]
    return moeshard.Placement(np.stack(rows), num_logical=EXPERTS, num_ranks=2)


def fused_worker(root: str) -> dict:
    from torch.distributed.tensor import DTensor

    import moeshard
    from moeshard.models.describe import expert_layers

    mesh = moeshard.make_mesh("cpu", ep=2, efsdp=1)
    out = {}
    for family in FAMILIES:
        model = hf_families.build(family, device="meta")
        params = {e.name: [p.name for p in e.spec.params] for e in expert_layers(model)}
        experts = list(params)
        pl = _placement(len(experts))
        moeshard.parallelize(model, mesh, pl)
        moeshard.load(model, os.path.join(root, family), placement=pl)
        checked = moeshard.verify(model, os.path.join(root, family), placement=pl).num_boxes_checked
        # Then every changed slot re-read from the fused tensors (rows of them).
        new = _placement(len(experts), seed=4)
        moeshard.relocate(model, pl, new, checkpoint=os.path.join(root, family), from_checkpoint=True)
        pl = new
        moeshard.save(model, os.path.join(root, f"{family}-saved"), pl, max_shard_bytes=40_000)
        state = {}
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            module, _, attr = name.rpartition(".")
            if module in experts and attr in params[module]:
                assert full.shape[0] == SLOTS
                state[name] = (full.clone(), pl.phy2log[experts.index(module)].tolist())
            else:
                state[name] = (full.clone(), None)
        out[family] = (state, checked)
    return out


@pytest.mark.dist
def test_fused_on_disk_experts_load_with_ep_and_redundant_copies(tmp_path):
    refs = {}
    for family in FAMILIES:
        model = hf_families.build(family)
        with torch.no_grad():  # every element distinct from its init (norms start at ones)
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(tmp_path / family, max_shard_size="40KB")
        refs[family] = {n: p.detach().clone() for n, p in model.named_parameters()}
    import moeshard

    index = moeshard.CheckpointIndex.open(str(tmp_path / "gpt_oss"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in index  # really fused on disk
    assert not any(".experts.0." in k for k in index.tensors)
    results = run_ranks(fused_worker, str(tmp_path), world=2, local_world=2, timeout=240)
    for rank, res in enumerate(results):
        for family in FAMILIES:
            state, checked = res[family]
            assert checked > 0
            assert set(state) == set(refs[family]), family
            for name, (got, phy2log) in state.items():
                want = refs[family][name]
                if phy2log is not None:  # slot s holds logical expert phy2log[s] (dbrx's [E * n, d] as [E, n, d])
                    want = want.reshape(EXPERTS, *got.shape[1:])[torch.as_tensor(phy2log)]
                assert torch.equal(got, want), f"rank {rank} {family} {name}"
    for family in FAMILIES:  # saved by 2 EP ranks from a redundant placement, fused as on disk
        saved = str(tmp_path / f"{family}-saved")
        assert set(moeshard.CheckpointIndex.open(saved).tensors) == set(
            moeshard.CheckpointIndex.open(str(tmp_path / family)).tensors
        )
        back, info = transformers.AutoModelForCausalLM.from_pretrained(
            saved, dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        for name, p in back.named_parameters():
            assert torch.equal(p, refs[family][name]), f"{family} saved {name}"
