"""Tier 3: HSDP dense parameters (``make_mesh(..., replicate=2)``: FSDP2's hybrid sharding on a
("replicate", "shard") mesh, one replica group per simulated node) with EP experts.

On 4 gloo ranks (2 nodes x 2) each family of ``tiny_hf.MATRIX`` (a tiny float32 Qwen3-MoE and
DeepSeek-V3) is built on meta, parallelized with 2 replica groups for the dense part (EP=4 with
redundant experts, and EP=2 x expert-FSDP=2), loaded by moeshard, verified, compared tensor by
tensor (parameters and DeepSeek-V3's ``e_score_correction_bias`` buffers) with
``from_pretrained``'s, trained 4 AdamW steps (each rank its quarter of the batch) whose losses and
gradient norms must match one process within 1e-5 relative, and saved: the saved checkpoint must
hold the trained model's tensors exactly, buffers included (each replica group holds the full set
of shards; each box written once).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tiny_hf
from mp import run_ranks
from training import one_process_steps

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

STEPS, LR, WORLD, LWS, RTOL = 4, 1e-3, 4, 2, 1e-5
# (family, EP, expert FSDP, redundant experts); replicate=2 in all
SCENARIOS = [(f, ep, efsdp, r) for f in tiny_hf.MATRIX for ep, efsdp, r in ((4, 1, True), (2, 2, False))]


def _placement(ep: int, redundant: bool):
    import moeshard

    if redundant:
        return tiny_hf.shuffled_redundant(8, ep, seed=3)
    return moeshard.Placement.contiguous(tiny_hf.NUM_LAYERS, 8, ep)


def _worker(ckpts: dict, root: str) -> list:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import moeshard

    rank = dist.get_rank()
    ids = tiny_hf.data(WORLD)[rank : rank + 1]
    out = []
    for i, (family, ep, efsdp, redundant) in enumerate(SCENARIOS):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(tiny_hf.config(family))
        mesh = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp, replicate=2)
        pl = _placement(ep, redundant)
        moeshard.parallelize(model, mesh, pl)
        dense = model.get_parameter("model.embed_tokens.weight")
        hsdp = (
            isinstance(dense, DTensor)
            and tuple(dense.placements) == (Replicate(), Shard(0))
            and dense.device_mesh.mesh.tolist() == [[0, 1], [2, 3]]
        )
        moeshard.load(model, ckpts[family], placement=pl)
        moeshard.verify(model, ckpts[family], placement=pl)
        loaded = {k: v.numpy() for k, v in tiny_hf.full_params(model, pl).items()}
        buffers = {k: v.numpy() for k, v in tiny_hf.persistent_buffers(model).items()}  # every rank's own
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, norms = [], []
        for _ in range(STEPS):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            moeshard.sync_redundant_grads(model)
            norms.append(float(moeshard.grad_norm(model)))
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / WORLD)
        saved = os.path.join(root, f"saved{i}")
        moeshard.save(model, saved, placement=pl, max_shard_bytes=40_000)
        trained = {k: v.numpy() for k, v in tiny_hf.full_params(model, pl).items()}
        out.append(
            dict(
                hsdp=hsdp,
                losses=losses,
                norms=norms,
                loaded=loaded if rank == 0 else None,
                trained=trained if rank == 0 else None,
                buffers=buffers,
                trained_buffers={k: v.numpy() for k, v in tiny_hf.persistent_buffers(model).items()},
            )
        )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    ckpts, refs = {}, {}
    for family in tiny_hf.MATRIX:
        ckpts[family] = str(root / family)
        tiny_hf.save_checkpoint(family, ckpts[family])
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(ckpts[family], dtype=torch.float32)
        reference = {k: v.detach().clone().numpy() for k, v in ref_model.state_dict().items()}
        refs[family] = reference, one_process_steps(ref_model, tiny_hf.data(WORLD), STEPS, LR)
    results = run_ranks(_worker, ckpts, str(root), world=WORLD, local_world=LWS, timeout=280)
    return root, refs, results


@pytest.mark.parametrize(
    "i",
    range(len(SCENARIOS)),
    ids=[f"{fam}-ep{e}-efsdp{f}{'-redundant' if r else ''}" for fam, e, f, r in SCENARIOS],
)
def test_hsdp_load_train_save(runs, i):
    from safetensors.numpy import load_file

    root, refs, results = runs
    family = SCENARIOS[i][0]
    reference, (ref_losses, ref_norms) = refs[family]
    assert ref_losses[-1] < ref_losses[0], "the reference must actually train"
    for r in results:
        got = r[i]
        assert got["hsdp"], "dense parameters must be HSDP DTensors (Replicate, Shard(0)) on the 2 x 2 mesh"
        np.testing.assert_allclose(got["losses"], ref_losses, rtol=RTOL, atol=0)
        np.testing.assert_allclose(got["norms"], ref_norms, rtol=RTOL, atol=0)
    first = results[0][i]
    assert set(first["loaded"]) | set(first["buffers"]) == set(reference)
    if family == "deepseek_v3":  # the routers' persistent buffers are compared too
        assert sum(k.endswith("e_score_correction_bias") for k in first["buffers"]) == tiny_hf.NUM_LAYERS
    for name, want in reference.items():  # the load: the checkpoint's values, bit for bit
        if name in first["loaded"]:
            np.testing.assert_array_equal(first["loaded"][name], want, err_msg=name)
        for r in results:  # buffers: whole on every rank
            if name in r[i]["buffers"]:
                np.testing.assert_array_equal(r[i]["buffers"][name], want, err_msg=name)
                np.testing.assert_array_equal(r[i]["trained_buffers"][name], want, err_msg=name)
    saved_dir = root / f"saved{i}"
    saved = {}
    for f in os.listdir(saved_dir):
        if f.endswith(".safetensors"):
            saved.update(load_file(str(saved_dir / f)))
    # The save: every trained tensor exactly, under the checkpoint's names (experts per expert).
    trained = {**first["trained"], **first["trained_buffers"]}
    assert any(not np.array_equal(trained[k], reference[k]) for k in reference), "training must change weights"
    for name, t in trained.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            continue
        np.testing.assert_array_equal(saved[name], t, err_msg=name)
    prefix = f"model.layers.{tiny_hf.moe_blocks(family)[0]}.mlp.experts"
    down = trained[f"{prefix}.down_proj"]
    for e in range(down.shape[0]):
        key = f"{prefix}.{e}.down_proj.weight"
        np.testing.assert_array_equal(saved[key], down[e], err_msg=key)
