"""Tier 3: elastic training of a whole model with real process loss (4 ranks -> 2; 8 -> 4 -> 8,
with joiners: test_reshard_elastic8_dist).

4 forked processes, 2 simulated nodes of 2 (LOCAL_WORLD_SIZE), a tiny float32 Qwen3-MoE: model A
with EP=4 and every expert on both nodes (redundant experts), HSDP dense (a replica group per
node), trained 2 AdamW steps; model B (EP=4, HSDP, some experts only on node 1), loaded only.

1. The reference (job R: a planned scale-down, no loss): node 0's ranks form a group of 2,
   reshard A onto EP=2 FSDP from live shards (optimizer moments included) and train 2 steps.
2. Job C (4 ranks, a new rendezvous) reshards A and B 4 -> 4 onto a new group (nothing read).
   Node 1 then dies during a reshard (both its ranks SIGKILL themselves once they have sent
   their part): every survivor raises PeerLostError, and its old tensors are intact.
3. Job D: the survivors rendezvous anew and reshard A onto EP=2 from each other: 0 bytes from
   storage, every tensor equal to A's at the loss, and the next 2 losses equal the reference's
   within 1e-6. B's reshard reads from storage exactly the experts whose every copy was on
   node 1 (their bytes, once), everything else from the survivors.
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


def _scale_down(model, layout, opt_old, ckpt: str, rank: int) -> tuple:
    """On a group of node 0's 2 ranks: reshard ``model`` onto EP=2 FSDP and train 2 steps on
    the whole batch (each rank 2 rows)."""
    new = tiny_hf.meta_qwen3(2, _pl_new())
    opt = torch.optim.AdamW(new.parameters(), lr=LR)
    rep = moeshard.reshard(new, layout, model, ckpt, optimizer=opt, old_optimizer=opt_old)
    full = _full(new, _pl_new())
    ids = tiny_hf.data(WORLD)[2 * rank : 2 * rank + 2]
    return rep, full, tiny_hf.train_steps(new, opt, ids, STEPS)


def _rank_main(idx: int, ports: tuple, root: str, ckpt: str) -> None:
    os.environ.update(MOESHARD_PROGRESS="0")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    torch.set_num_threads(1)
    dist = torch.distributed
    out: dict = {}
    try:
        # Job A: train model A, load model B.
        _init(ports[0], idx, WORLD, BACKSTOP_S)
        a = tiny_hf.meta_qwen3(4, _pl_a(), replicate=2)
        moeshard.load(a, ckpt, placement=_pl_a())
        opt_a = torch.optim.AdamW(a.parameters(), lr=LR)
        tiny_hf.train_steps(a, opt_a, tiny_hf.data(WORLD)[idx : idx + 1], STEPS)
        layout_a = moeshard.describe_shards(a, opt_a)
        full_a = _full(a, _pl_a())
        b = tiny_hf.meta_qwen3(4, _pl_b(), replicate=2)
        moeshard.load(b, ckpt, placement=_pl_b())
        layout_b = moeshard.describe_shards(b)
        dist.destroy_process_group()
        # Job R: the reference, a planned scale-down to node 0 (node 1 waits).
        if idx < 2:
            _init(ports[1], idx, 2, BACKSTOP_S)
            rep, full, out["ref_losses"] = _scale_down(a, layout_a, opt_a, ckpt, idx)
            out["ref_equal"] = sorted(k for k in full_a if np.array_equal(full[k], full_a[k]))
            out["ref_read"] = rep.bytes_read_rank
            dist.destroy_process_group()
            if idx == 0:
                open(os.path.join(root, "job_c"), "w").close()
        _wait_for(os.path.join(root, "job_c"))
        # Job C: A and B moved onto a new group of the 4 ranks (from live shards), then node 1 dies.
        _init(ports[2], idx, WORLD, LOSS_TIMEOUT_S)
        a2, b2 = tiny_hf.meta_qwen3(4, _pl_a(), replicate=2), tiny_hf.meta_qwen3(4, _pl_b(), replicate=2)
        opt_a2 = torch.optim.AdamW(a2.parameters(), lr=LR)
        rep_a = moeshard.reshard(a2, layout_a, a, optimizer=opt_a2, old_optimizer=opt_a)
        rep_b = moeshard.reshard(b2, layout_b, b)
        out["move_read"] = rep_a.bytes_read_rank + rep_b.bytes_read_rank
        layout_a2, layout_b2 = moeshard.describe_shards(a2, opt_a2), moeshard.describe_shards(b2)
        before = _local_copies(a2)
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
            moeshard.reshard(scratch, layout_a2, a2)
            out["lost"] = None
        except moeshard.DistributedError as e:
            out["lost"] = (type(e).__name__, str(e), time.monotonic() - t0)
        after = _local_copies(a2)
        out["old_intact"] = all(torch.equal(before[k], after[k]) for k in before)
        dist.destroy_process_group()
        # Job D: the survivors (node 0) recover from each other.
        _init(ports[3], idx, 2, BACKSTOP_S)
        rep, full, out["losses"] = _scale_down(a2, layout_a2, opt_a2, ckpt, idx)
        out["recovery"] = dict(
            read=rep.bytes_read_rank,
            storage=rep.storage_bytes,
            boxes=rep.storage_boxes,
            received=rep.bytes_received_rank,
            copied=rep.bytes_copied_rank,
        )
        out["equal"] = sorted(k for k in full_a if np.array_equal(full[k], full_a[k]))
        nb = tiny_hf.meta_qwen3(2, _pl_new())
        rep = moeshard.reshard(nb, layout_b2, b2, ckpt)
        out["b"] = dict(
            read=rep.bytes_read_rank, storage=rep.storage_bytes, boxes=rep.storage_boxes, dense=rep.dense_from_storage
        )
        full_b = _full(nb, _pl_new())
        out["b_full"] = full_b if idx == 0 else None
        out["full_a"] = full_a if idx == 0 else None
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
    ckpt = os.path.join(root, "ckpt")
    tiny_hf.save_checkpoint("qwen3_moe", ckpt)
    reference = {
        k: v.detach().numpy()
        for k, v in transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).named_parameters()
    }
    ctx = forkserver(__name__)
    ports = tuple(free_port() for _ in range(4))
    procs = [ctx.Process(target=_rank_main, args=(i, ports, root, ckpt), daemon=True) for i in range(WORLD)]
    alive = start_and_join(procs, 280)  # within pytest's 300 s: a hang is reported as one
    assert not alive, f"processes {alive} still running (a hang)"
    assert all(procs[v].exitcode == -signal.SIGKILL for v in VICTIMS)
    res = {}
    for i in (0, 1):
        with open(os.path.join(root, f"{i}.pkl"), "rb") as f:
            kind, value = pickle.load(f)
        assert kind == "ok", f"process {i} failed:\n{value}"
        res[i] = value
    names = sorted(res[0]["full_a"])
    for r in res.values():
        # the loss during a reshard: raised on every survivor, old tensors intact
        assert r["lost"] is not None and r["lost"][0] == "PeerLostError", r["lost"]
        assert r["lost"][2] < LOSS_TIMEOUT_S + 15
        assert r["old_intact"]
        assert r["move_read"] == 0 and r["ref_read"] == 0
        # recovery from live peers: nothing from storage, the live state bit for bit
        assert r["recovery"]["read"] == 0 and r["recovery"]["storage"] == 0 and r["recovery"]["boxes"] == ()
        assert r["recovery"]["copied"] > 0
        assert r["equal"] == names and r["ref_equal"] == names
        np.testing.assert_allclose(r["losses"], r["ref_losses"], rtol=0, atol=1e-6)
    assert sum(r["recovery"]["received"] for r in res.values()) > 0
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
