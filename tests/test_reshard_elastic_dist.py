"""Tier 3: elastic training of a whole model with real process loss (4 ranks -> 2; 8 -> 4 -> 8,
with joiners: test_reshard_elastic8_dist).

4 forked processes, 2 simulated nodes of 2 (LOCAL_WORLD_SIZE), tiny float32 models: model A of
each family (Qwen3-MoE and DeepSeek-V3, side by side in the same processes) with EP=4 and every
expert on both nodes (redundant experts), HSDP dense (a replica group per node), trained 2 AdamW
steps; model B (Qwen3-MoE, EP=4, HSDP, some experts only on node 1), loaded only.

1. The reference (job R: a planned scale-down, no loss): node 0's ranks form a group of 2,
   reshard each A onto EP=2 FSDP from live shards (optimizer moments included) and train 2 steps.
2. Job C (4 ranks, a new rendezvous) reshards A and B 4 -> 4 onto a new group (nothing read).
   Node 1 then dies during a reshard (both its ranks SIGKILL themselves once they have sent
   their part): every survivor raises PeerLostError, and its old tensors are intact.
3. Job D: the survivors rendezvous anew and reshard each A onto EP=2 from each other: 0 bytes
   from storage, every tensor (and DeepSeek-V3's buffers) equal to A's at the loss, and the next
   2 losses equal the reference's within 1e-6. B's reshard reads from storage exactly the
   experts whose every copy was on node 1 (their bytes, once), everything else from the
   survivors.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import time

import numpy as np
import pytest
import torch

import moeshard
import tiny_hf
from moeshard._launch import free_port
from mp import forkserver, start_and_join

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.hf, pytest.mark.dist]

WORLD, LWS, LR, STEPS = 4, 2, 1e-3, 2
VICTIMS = (2, 3)  # node 1
NUM_EXPERTS = 8
LOSS_TIMEOUT_S = 15  # job C's backend timeout: survivors not talking to a victim learn of the loss from it
BACKSTOP_S = 120


def _pl_a():
    """Every expert on both nodes: slots of node 0 (ranks 0, 1) and node 1 (ranks 2, 3) each
    hold all 8 experts, shuffled."""
    rng = np.random.default_rng(0)
    rows = [
        np.concatenate([rng.permutation(NUM_EXPERTS), rng.permutation(NUM_EXPERTS)]) for _ in range(tiny_hf.NUM_LAYERS)
    ]
    return moeshard.Placement(np.stack(rows), num_logical=NUM_EXPERTS, num_ranks=4)


def _pl_b():
    return tiny_hf.shuffled_redundant(NUM_EXPERTS, 4, seed=1)


def _pl_new():
    return moeshard.Placement.contiguous(tiny_hf.NUM_LAYERS, NUM_EXPERTS, 2)


def _full(model, pl) -> dict:
    return {k: v.numpy() for k, v in tiny_hf.full_params(model, pl).items()}


def _init(port: int, rank: int, world: int, timeout: float) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(LWS)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.1)


def _local_copies(model) -> dict:
    from moeshard.models.describe import local_tensor

    return {n: local_tensor(p).clone() for n, p in model.named_parameters()}


def _buffers(model) -> dict:
    return {k: v.detach().clone().numpy() for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")}


def _scale_down(family: str, model, layout, opt_old, ckpt: str, rank: int) -> tuple:
    """On a group of node 0's 2 ranks: reshard ``model`` onto EP=2 FSDP and train 2 steps on
    the whole batch (each rank 2 rows)."""
    new = tiny_hf.meta_model(family, 2, _pl_new())
    opt = torch.optim.AdamW(new.parameters(), lr=LR)
    rep = moeshard.reshard(new, layout, model, ckpt, optimizer=opt, old_optimizer=opt_old)
    full = _full(new, _pl_new())
    ids = tiny_hf.data(WORLD)[2 * rank : 2 * rank + 2]
    return rep, full, _buffers(new), tiny_hf.train_steps(new, opt, ids, STEPS)


def _rank_main(idx: int, ports: tuple, root: str, ckpts: dict) -> None:
    os.environ.update(MOESHARD_PROGRESS="0")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    torch.set_num_threads(1)
    dist = torch.distributed
    out: dict = {}
    try:
        # Job A: train model A of each family, load model B.
        _init(ports[0], idx, WORLD, BACKSTOP_S)
        a, opt_a, layout_a, full_a, buffers_a = {}, {}, {}, {}, {}
        for f in tiny_hf.MATRIX:
            a[f] = tiny_hf.meta_model(f, 4, _pl_a(), replicate=2)
            moeshard.load(a[f], ckpts[f], placement=_pl_a())
            opt_a[f] = torch.optim.AdamW(a[f].parameters(), lr=LR)
            tiny_hf.train_steps(a[f], opt_a[f], tiny_hf.data(WORLD)[idx : idx + 1], STEPS)
            layout_a[f] = moeshard.describe_shards(a[f], opt_a[f])
            full_a[f], buffers_a[f] = _full(a[f], _pl_a()), _buffers(a[f])
        b = tiny_hf.meta_qwen3(4, _pl_b(), replicate=2)
        moeshard.load(b, ckpts["qwen3_moe"], placement=_pl_b())
        layout_b = moeshard.describe_shards(b)
        dist.destroy_process_group()
        # Job R: the reference, a planned scale-down to node 0 (node 1 waits).
        if idx < 2:
            _init(ports[1], idx, 2, BACKSTOP_S)
            for f in tiny_hf.MATRIX:
                rep, full, _, out[f, "ref_losses"] = _scale_down(f, a[f], layout_a[f], opt_a[f], ckpts[f], idx)
                out[f, "ref_equal"] = sorted(k for k in full_a[f] if np.array_equal(full[k], full_a[f][k]))
                out[f, "ref_read"] = rep.bytes_read_rank
            dist.destroy_process_group()
            if idx == 0:
                open(os.path.join(root, "job_c"), "w").close()
        _wait_for(os.path.join(root, "job_c"))
        # Job C: A and B moved onto a new group of the 4 ranks (from live shards), then node 1 dies.
        _init(ports[2], idx, WORLD, LOSS_TIMEOUT_S)
        a2, opt_a2, layout_a2 = {}, {}, {}
        out["move_read"] = 0
        for f in tiny_hf.MATRIX:
            a2[f] = tiny_hf.meta_model(f, 4, _pl_a(), replicate=2)
            opt_a2[f] = torch.optim.AdamW(a2[f].parameters(), lr=LR)
            rep = moeshard.reshard(a2[f], layout_a[f], a[f], optimizer=opt_a2[f], old_optimizer=opt_a[f])
            out["move_read"] += rep.bytes_read_rank
            layout_a2[f] = moeshard.describe_shards(a2[f], opt_a2[f])
        b2 = tiny_hf.meta_qwen3(4, _pl_b(), replicate=2)
        rep_b = moeshard.reshard(b2, layout_b, b)
        out["move_read"] += rep_b.bytes_read_rank
        layout_b2 = moeshard.describe_shards(b2)
        q = "qwen3_moe"
        before = _local_copies(a2[q])
        scratch = tiny_hf.meta_qwen3(4, moeshard.Placement.contiguous(tiny_hf.NUM_LAYERS, NUM_EXPERTS, 4))
        if idx in VICTIMS:
            from moeshard.ops import reshard as reshard_mod

            real_run = reshard_mod.execute_schedule

            def run_then_die(*args, **kwargs):
                real_run(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)

            reshard_mod.execute_schedule = run_then_die
        t0 = time.monotonic()
        try:
            moeshard.reshard(scratch, layout_a2[q], a2[q])
            out["lost"] = None
        except moeshard.DistributedError as e:
            out["lost"] = (type(e).__name__, str(e), time.monotonic() - t0)
        after = _local_copies(a2[q])
        out["old_intact"] = all(torch.equal(before[k], after[k]) for k in before)
        dist.destroy_process_group()
        # Job D: the survivors (node 0) recover from each other.
        _init(ports[3], idx, 2, BACKSTOP_S)
        for f in tiny_hf.MATRIX:
            rep, full, buffers, out[f, "losses"] = _scale_down(f, a2[f], layout_a2[f], opt_a2[f], ckpts[f], idx)
            out[f, "recovery"] = dict(
                read=rep.bytes_read_rank,
                storage=rep.storage_bytes,
                boxes=rep.storage_boxes,
                received=rep.bytes_received_rank,
                copied=rep.bytes_copied_rank,
            )
            out[f, "equal"] = sorted(k for k in full_a[f] if np.array_equal(full[k], full_a[f][k]))
            out[f, "buffers_equal"] = buffers.keys() == buffers_a[f].keys() and all(
                np.array_equal(buffers[k], buffers_a[f][k]) for k in buffers
            )
            out[f, "full_a"] = full_a[f] if idx == 0 else None
        nb = tiny_hf.meta_qwen3(2, _pl_new())
        rep = moeshard.reshard(nb, layout_b2, b2, ckpts["qwen3_moe"])
        out["b"] = dict(
            read=rep.bytes_read_rank, storage=rep.storage_bytes, boxes=rep.storage_boxes, dense=rep.dense_from_storage
        )
        full_b = _full(nb, _pl_new())
        out["b_full"] = full_b if idx == 0 else None
        dist.destroy_process_group()
        result = ("ok", out)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(root, f"{idx}.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)


def test_node_loss_survivors_reshard_from_live_peers_and_continue(tmp_path):
    root = str(tmp_path)
    ckpts = {f: os.path.join(root, f) for f in tiny_hf.MATRIX}
    for f, path in ckpts.items():
        tiny_hf.save_checkpoint(f, path)
    reference = {
        k: v.detach().numpy()
        for k, v in transformers.AutoModelForCausalLM.from_pretrained(
            ckpts["qwen3_moe"], dtype=torch.float32
        ).named_parameters()
    }
    ctx = forkserver(__name__)
    ports = tuple(free_port() for _ in range(4))
    procs = [ctx.Process(target=_rank_main, args=(i, ports, root, ckpts), daemon=True) for i in range(WORLD)]
    alive = start_and_join(procs, 280)  # within pytest's 300 s: a hang is reported as one
    assert not alive, f"processes {alive} still running (a hang)"
    assert all(procs[v].exitcode == -signal.SIGKILL for v in VICTIMS)
    res = {}
    for i in (0, 1):
        with open(os.path.join(root, f"{i}.pkl"), "rb") as f:
            kind, value = pickle.load(f)
        assert kind == "ok", f"process {i} failed:\n{value}"
        res[i] = value
    for r in res.values():
        # the loss during a reshard: raised on every survivor, old tensors intact
        assert r["lost"] is not None and r["lost"][0] == "PeerLostError", r["lost"]
        assert r["lost"][2] < LOSS_TIMEOUT_S + 15
        assert r["old_intact"]
        assert r["move_read"] == 0
        for f in tiny_hf.MATRIX:
            names = sorted(res[0][f, "full_a"])
            assert r[f, "ref_read"] == 0
            # recovery from live peers: nothing from storage, the live state bit for bit
            rec = r[f, "recovery"]
            assert rec["read"] == 0 and rec["storage"] == 0 and rec["boxes"] == (), (f, rec)
            assert rec["copied"] > 0
            assert r[f, "equal"] == names and r[f, "ref_equal"] == names, f
            assert r[f, "buffers_equal"], f
            np.testing.assert_allclose(r[f, "losses"], r[f, "ref_losses"], rtol=0, atol=1e-6, err_msg=f)
    for f in tiny_hf.MATRIX:
        assert sum(r[f, "recovery"]["received"] for r in res.values()) > 0
    # model B: exactly the experts whose every copy was on node 1 came from storage
    pl_b = _pl_b()
    spr = pl_b.num_physical // 4
    missing = [
        (layer, e)
        for layer, row in enumerate(pl_b.phy2log)
        for e in range(NUM_EXPERTS)
        if {int(p) // spr for p in np.flatnonzero(row == e)} <= set(VICTIMS)
    ]
    assert missing, "model B's placement must leave some experts only on node 1"
    want = sorted(
        f"model.layers.{layer}.mlp.experts.{p}[{e}]" for layer, e in missing for p in ("down_proj", "gate_up_proj")
    )
    expert_bytes = 4 * (2 * 16 * 32 + 32 * 16)
    for r in res.values():
        assert sorted({k for k, _ in r["b"]["boxes"]}) == want and r["b"]["dense"] == ()
        assert r["b"]["storage"] == len(missing) * expert_bytes
    assert sum(r["b"]["read"] for r in res.values()) == len(missing) * expert_bytes
    for name, t in res[0]["b_full"].items():  # B was never trained: the checkpoint's values
        np.testing.assert_array_equal(t, reference[name], err_msg=name)
