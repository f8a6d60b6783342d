"""Tier 3: ``moeshard.reshard`` on 4 gloo ranks (2 nodes x 2), tiny float32 Qwen3-MoE.

The old model: EP=4 with redundant experts, HSDP dense (2 replica groups, one per node), loaded
and trained 2 AdamW steps (its weights and moments differ from the checkpoint's). Then:

1. planned resizes with every rank holding its shards (EP=2 x expert-FSDP=2 FSDP, contiguous
   placement; EP=4 FSDP with another redundant placement): every new tensor equals the old
   model's, bit for bit; 0 bytes read from storage; the optimizer's moments move with their
   parameters, so 2 more steps give the losses the old model gives (within 1e-6);
2. node 1's shards lost (ranks 2 and 3 pass ``old=None``, as joiners): dense weights come from
   node 0's HSDP replica, experts with a copy on node 0 from it, and exactly the experts whose
   every copy was on node 1 from the checkpoint (their bytes read, once);
3. the same loss without HSDP: a dense box has no live holder, and every rank raises
   StaleStateError (nothing read); with ``dense_from_storage="warn"`` the box is read.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_hf
from mp import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

WORLD, LWS, LR, STEPS = 4, 2, 1e-3, 2
NUM_EXPERTS = 8


def _placement(seed: int, ep: int = 4):
    return tiny_hf.shuffled_redundant(NUM_EXPERTS, ep, seed)


def _full(model, pl) -> dict:
    return {k: v.numpy() for k, v in tiny_hf.full_params(model, pl).items()}


def _worker(ckpt: str) -> dict:
    import torch.distributed as dist

    import moeshard

    rank = dist.get_rank()
    ids = tiny_hf.data(WORLD)[rank : rank + 1]
    pl0 = _placement(1)
    old = tiny_hf.meta_qwen3(4, pl0, replicate=2)
    moeshard.load(old, ckpt, placement=pl0)
    opt0 = torch.optim.AdamW(old.parameters(), lr=LR)
    tiny_hf.train_steps(old, opt0, ids, STEPS)
    layout = moeshard.describe_shards(old, opt0)
    old_full = _full(old, pl0)
    out: dict = {"layout_digest": layout.digest(), "resize": []}

    # 1. planned resizes, every rank holding its shards
    for ep, efsdp, replicate, pl in (
        (2, 2, 1, moeshard.Placement.contiguous(tiny_hf.NUM_LAYERS, NUM_EXPERTS, 2)),
        (4, 1, 1, _placement(7)),
    ):
        new = tiny_hf.meta_qwen3(ep, pl, efsdp=efsdp, replicate=replicate)
        opt = torch.optim.AdamW(new.parameters(), lr=LR)
        rep = moeshard.reshard(new, layout, old, optimizer=opt, old_optimizer=opt0)
        full = _full(new, pl)
        same = sorted(k for k in old_full if np.array_equal(full[k], old_full[k]))
        out["resize"].append(
            dict(
                same=same,
                read=rep.bytes_read_rank,
                storage=rep.storage_bytes,
                boxes=rep.storage_boxes,
                peer=rep.peer_bytes,
                received=rep.bytes_received_rank,
                staged=rep.peak_staging_bytes_rank,
                losses=tiny_hf.train_steps(new, opt, ids, STEPS),
            )
        )

    # 2. node 1's shards lost: dense from the node-0 replica, experts from live copies or storage
    lost = rank >= 2
    new = tiny_hf.meta_qwen3(4, pl0, replicate=2)
    rep = moeshard.reshard(new, None if lost else layout, None if lost else old, ckpt)
    full = _full(new, pl0)  # collective
    out["lost"] = dict(
        full=full if rank == 0 else None,
        boxes=rep.storage_boxes,
        read=rep.bytes_read_rank,
        storage=rep.storage_bytes,
        dense=rep.dense_from_storage,
        joined=rep.joined,
    )

    # 3. without HSDP: a dense box with no live holder is refused on every rank, or read with "warn"
    plain = tiny_hf.meta_qwen3(4, pl0)
    moeshard.load(plain, ckpt, placement=pl0)
    plain_layout = moeshard.describe_shards(plain)
    new = tiny_hf.meta_qwen3(4, pl0)
    try:
        moeshard.reshard(new, None if lost else plain_layout, None if lost else plain, ckpt)
        out["refused"] = None
    except moeshard.StaleStateError as e:
        out["refused"] = str(e)
    rep = moeshard.reshard(
        new, None if lost else plain_layout, None if lost else plain, ckpt, dense_from_storage="warn"
    )
    full = _full(new, pl0)
    out["warned"] = dict(dense=rep.dense_from_storage, read=rep.bytes_read_rank, full=full if rank == 0 else None)

    # the reference: the old model's next steps
    out["ref_losses"] = tiny_hf.train_steps(old, opt0, ids, STEPS)
    out["old_full"] = old_full if rank == 0 else None
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    ckpt = str(root / "ckpt")
    tiny_hf.save_checkpoint("qwen3_moe", ckpt)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    reference = {k: v.detach().clone().numpy() for k, v in model.named_parameters()}
    return reference, run_ranks(_worker, ckpt, world=WORLD, local_world=LWS, timeout=280)


def _only_on(pl, ranks: set[int]) -> list[tuple[int, int]]:
    """``(layer, expert)`` whose every copy is on ``ranks`` (EP=4)."""
    spr = pl.num_physical // 4
    out = []
    for layer, row in enumerate(pl.phy2log):
        for e in range(NUM_EXPERTS):
            if {int(p) // spr for p in np.flatnonzero(row == e)} <= ranks:
                out.append((layer, e))
    return out


def test_planned_resize_moves_live_state(runs):
    reference, results = runs
    first = results[0]
    names = sorted(first["old_full"])
    assert any(not np.array_equal(first["old_full"][k], reference[k]) for k in names), "the old model must train"
    for r in results:
        assert r["layout_digest"] == first["layout_digest"]
        for res in r["resize"]:
            assert res["same"] == names, f"tensors differ: {sorted(set(names) - set(res['same']))[:4]}"
            assert res["read"] == 0 and res["storage"] == 0 and res["boxes"] == ()
            assert res["peer"] > 0
            np.testing.assert_allclose(res["losses"], r["ref_losses"], rtol=0, atol=1e-6)
        # The contiguous EP=2 x expert-FSDP=2 target has one delivery per received piece, each a
        # contiguous box: every piece lands straight in the new tensor, none is staged.
        assert r["resize"][0]["staged"] == 0
    assert sum(r["resize"][0]["received"] for r in results) > 0


def test_lost_node_recovers_dense_from_replica_and_reads_only_lost_experts(runs):
    reference, results = runs
    pl0 = _placement(1)
    missing = _only_on(pl0, {2, 3})
    assert missing, "the placement must leave some experts only on node 1"
    want = sorted(
        f"model.layers.{layer}.mlp.experts.{p}[{e}]" for layer, e in missing for p in ("down_proj", "gate_up_proj")
    )
    for r in results:
        lost = r["lost"]
        assert lost["dense"] == ()
        assert sorted({k for k, _ in lost["boxes"]}) == want
    # each missing expert's bytes read once (float32 on disk and in the model)
    expert_bytes = 4 * (2 * 16 * 32 + 32 * 16)
    assert sum(r["lost"]["read"] for r in results) == len(missing) * expert_bytes == results[0]["lost"]["storage"]
    assert [r["lost"]["joined"] for r in results] == [False, False, True, True]
    full, old_full = results[0]["lost"]["full"], results[0]["old_full"]
    gone = {(layer, e) for layer, e in missing}
    for name, t in full.items():
        if ".mlp.experts." not in name:
            np.testing.assert_array_equal(t, old_full[name], err_msg=name)  # live dense state, not the checkpoint's
            continue
        layer = int(name.split(".")[2])
        for e in range(NUM_EXPERTS):
            src = reference if (layer, e) in gone else old_full
            np.testing.assert_array_equal(t[e], src[name][e], err_msg=f"{name}[{e}]")


def test_dense_box_without_live_holder_is_refused_or_warned(runs):
    reference, results = runs
    for r in results:
        assert r["refused"] is not None and "dense tensors have boxes no live rank holds" in r["refused"]
        assert "model.embed_tokens.weight" in r["refused"]
        assert "model.embed_tokens.weight" in r["warned"]["dense"]
    assert sum(r["warned"]["read"] for r in results) > 0
    full = results[0]["warned"]["full"]
    for name, t in full.items():  # the old model was the checkpoint's: everything equals it
        np.testing.assert_array_equal(t, reference[name] if ".mlp.experts." not in name else t, err_msg=name)
        if ".mlp.experts." in name:
            np.testing.assert_array_equal(t, reference[name], err_msg=name)
