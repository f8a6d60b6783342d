"""Tier 3: elastic training with real process loss, 8 ranks -> 4 -> 8 (a node lost, then replaced).

8 forked processes, 2 simulated nodes of 4 (LOCAL_WORLD_SIZE), a tiny float32 model of each
family (Qwen3-MoE and DeepSeek-V3, side by side in the same processes and jobs) with EP=8, every
expert on both nodes (redundant experts) and HSDP dense (a replica group per node), trained 2
AdamW steps (job A). Then, for each family:

1. The reference, planned resizes from A's state with every process alive: node 0's ranks form a
   group of 4 (job R4), reshard A onto EP=4 FSDP (AdamW moments included) and train 2 steps;
   then all 8 (node 1's ranks as joiners, ``old=None``) form a group of 8 (job R8), reshard that
   back onto EP=8 HSDP (another redundant placement) and train 2 steps.
2. Node 1 dies: its 4 processes SIGKILL themselves. The survivors rendezvous anew (job S, a new
   store and group of 4), reshard A onto EP=4 FSDP from each other and train 2 steps.
3. 4 fresh processes, started by the test after the deaths and holding nothing, join the
   survivors in a new rendezvous of 8 (job J), reshard S's model back onto EP=8 HSDP and train
   2 steps.

Asserted: no reshard reads anything from storage (every box has a live copy: no storage box,
0 bytes); after each reshard every parameter and AdamW moment, gathered whole (and DeepSeek-V3's
``e_score_correction_bias`` buffers), equals the one before it bit for bit; the losses of S and J
equal R4's and R8's within 1e-6.
"""

from __future__ import annotations

import datetime
import faulthandler
import fcntl
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
from mp import forkserver

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.hf, pytest.mark.dist]

WORLD, LWS, LR, STEPS = 8, 4, 1e-3, 2
SURVIVORS, VICTIMS = range(4), range(4, 8)  # node 0, node 1
NUM_EXPERTS = 8
STATES = ("exp_avg", "exp_avg_sq")
BACKSTOP_S = 120  # every rendezvous and collective; a hang ends the test, not the 280 s below
JOBS = ("a", "r4", "r8", "s", "j")  # one TCP store port each


def _pl8(seed: int):
    """EP=8, 2 slots a rank: node 0's 8 slots (ranks 0-3) and node 1's (ranks 4-7) each hold all
    8 experts, shuffled: either node alone holds every expert."""
    rng = np.random.default_rng(seed)
    rows = [
        np.concatenate([rng.permutation(NUM_EXPERTS), rng.permutation(NUM_EXPERTS)]) for _ in range(tiny_hf.NUM_LAYERS)
    ]
    return moeshard.Placement(np.stack(rows), num_logical=NUM_EXPERTS, num_ranks=8)


PL_A, PL_4, PL_8 = _pl8(0), moeshard.Placement.contiguous(tiny_hf.NUM_LAYERS, NUM_EXPERTS, 4), _pl8(1)


def _steps(model, opt, n: int) -> list[float]:
    """``n`` steps on the same global batch whatever the world size (8 rows, this rank's share),
    so that a resize keeps the gradients; the losses averaged over the ranks."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    per = WORLD // world
    return tiny_hf.train_steps(model, opt, tiny_hf.data(WORLD)[rank * per : (rank + 1) * per], n)


def _full(model, opt, pl) -> dict:
    """Collective: every parameter and AdamW moment gathered whole (experts in logical order),
    and the routers' ``e_score_correction_bias`` buffers."""
    out = {k: v.numpy() for k, v in tiny_hf.full_params(model, pl).items()}
    for s in STATES:
        got = tiny_hf.full_params(model, pl, of=lambda p, s=s: opt.state[p][s])
        out.update({f"{k}::{s}": v.numpy() for k, v in got.items()})
    out.update({k: v.detach().numpy() for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")})
    return out


def _differ(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not np.array_equal(a[k], b[k]))


def _init(port: int, rank: int, world: int) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = str(LWS)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=BACKSTOP_S),
    )


def _reshard(
    family: str, ep: int, replicate: int, pl, old, old_model, old_opt, ckpt: str, before: dict | None
) -> tuple:
    """Collective: reshard onto a new ``family`` model (EP=``ep``, HSDP ``replicate``) with its
    AdamW; what the report says, and the tensors that differ from ``before`` (None on a joiner)."""
    new = tiny_hf.meta_model(family, ep, pl, replicate=replicate)
    opt = torch.optim.AdamW(new.parameters(), lr=LR)
    rep = moeshard.reshard(new, old, old_model, ckpt, optimizer=opt, old_optimizer=old_opt)
    full = _full(new, opt, pl)
    out = dict(
        read=rep.bytes_read_rank,
        storage=rep.storage_bytes,
        boxes=rep.storage_boxes,
        dense=rep.dense_from_storage,
        joined=rep.joined,
        received=rep.bytes_received_rank,
        differ=None if before is None else _differ(full, before),
        names=len(full),
    )
    return new, opt, out


def _to4(family: str, a, layout_a, opt_a, ckpt: str, full_a: dict) -> tuple:
    """On node 0's 4 ranks: A onto EP=4 FSDP, 2 steps; the model, its layout, its state, the record."""
    m4, opt4, out = _reshard(family, 4, 1, PL_4, layout_a, a, opt_a, ckpt, full_a)
    out["losses"] = _steps(m4, opt4, STEPS)
    return m4, opt4, moeshard.describe_shards(m4, opt4), _full(m4, opt4, PL_4), out


def _to8(family: str, layout4, m4, opt4, ckpt: str, full4: dict | None) -> dict:
    """On 8 ranks (node 1's with nothing): the EP=4 model onto EP=8 HSDP, 2 steps; the record."""
    m8, opt8, out = _reshard(family, 8, 2, PL_8, layout4, m4, opt4, ckpt, full4)
    out["losses"] = _steps(m8, opt8, STEPS)
    return out


def _lock_path(root: str, idx: int) -> str:
    return os.path.join(root, f"alive{idx}")


def _old_main(idx: int, ports: dict, root: str, ckpts: dict, out: dict) -> None:
    dist = torch.distributed
    victim = idx in VICTIMS
    if victim:
        # Held until the process dies: the kernel releases it, which is how the survivors learn
        # of the loss without a timeout or a sleep.
        lock = open(_lock_path(root, idx), "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
    fams = tiny_hf.MATRIX
    for f in fams:
        out[f] = {}
    # Job A: the models to recover, trained.
    _init(ports["a"], idx, WORLD)
    a, opt_a, layout_a, full_a = {}, {}, {}, {}
    for f in fams:
        a[f] = tiny_hf.meta_model(f, 8, PL_A, replicate=2)
        moeshard.load(a[f], ckpts[f], placement=PL_A)
        opt_a[f] = torch.optim.AdamW(a[f].parameters(), lr=LR)
        out[f]["a_losses"] = _steps(a[f], opt_a[f], STEPS)
        layout_a[f] = moeshard.describe_shards(a[f], opt_a[f])
        full_a[f] = _full(a[f], opt_a[f], PL_A)
    dist.destroy_process_group()
    # Job R4, the reference: node 0 alone, a planned scale-down (node 1 waits in R8's rendezvous).
    r4 = {f: (None, None, None, None) for f in fams}
    if not victim:
        _init(ports["r4"], idx, 4)
        for f in fams:
            m4, opt4, layout4, full4, out[f]["r4"] = _to4(f, a[f], layout_a[f], opt_a[f], ckpts[f], full_a[f])
            r4[f] = (layout4, m4, opt4, full4)
        dist.destroy_process_group()
    # Job R8, the reference: back to 8, node 1's ranks holding nothing as the joiners will.
    _init(ports["r8"], idx, WORLD)
    for f in fams:
        layout4, m4, opt4, full4 = r4[f]
        out[f]["r8"] = _to8(f, layout4, m4, opt4, ckpts[f], full4)
    del r4, m4, opt4, layout4, full4
    # Node 1 dies once every survivor is past R8's last collective (nothing of it in flight),
    # with R8's group still up on the survivors.
    if victim:
        for i in SURVIVORS:
            _wait_for(os.path.join(root, f"r8done{i}"))
        os.kill(os.getpid(), signal.SIGKILL)
    open(os.path.join(root, f"r8done{idx}"), "w").close()
    for v in VICTIMS:
        with open(_lock_path(root, v)) as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # returns once process v is gone
    dist.destroy_process_group()
    # Job S: the survivors recover A from each other.
    _init(ports["s"], idx, 4)
    s4 = {}
    for f in fams:
        m4, opt4, layout4, full4, out[f]["s"] = _to4(f, a[f], layout_a[f], opt_a[f], ckpts[f], full_a[f])
        s4[f] = (layout4, m4, opt4, full4)
    dist.destroy_process_group()
    # Job J: 4 fresh processes join; S's models back onto 8.
    _init(ports["j"], idx, WORLD)
    for f in fams:
        out[f]["j"] = _to8(f, *s4[f][:3], ckpts[f], s4[f][3])
    dist.destroy_process_group()


def _joiner_main(idx: int, ports: dict, root: str, ckpts: dict, out: dict) -> None:
    _init(ports["j"], idx, WORLD)
    for f in tiny_hf.MATRIX:
        out[f] = {"j": _to8(f, None, None, None, ckpts[f], None)}
    torch.distributed.destroy_process_group()


def _wait_for(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.05)


def _rank_main(role: str, idx: int, ports: dict, root: str, ckpts: dict, deadline: float) -> None:
    os.environ.update(MOESHARD_PROGRESS="0")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    torch.set_num_threads(1)
    # A process still running shortly before the test gives up on it leaves its stacks, for the
    # test's message (the monotonic clock is the machine's, the test's deadline is ours too).
    stacks = open(os.path.join(root, f"{role}{idx}.stacks"), "w")
    faulthandler.dump_traceback_later(max(1.0, deadline - time.monotonic() - 10), file=stacks)
    out: dict = {}
    t0 = time.monotonic()
    try:
        (_old_main if role == "old" else _joiner_main)(idx, ports, root, ckpts, out)
        out["wall"] = time.monotonic() - t0
        result = ("ok", out)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(root, f"{role}{idx}.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)  # skip finalization beside gloo's workers (moeshard._launch.exit_process)


def _join(procs: list, deadline: float) -> None:
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))


def _diagnosis(root: str) -> str:
    """What the processes left: every error, and the stacks of those that hung."""
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.endswith(".pkl"):
            with open(path, "rb") as f:
                kind, value = pickle.load(f)
            if kind != "ok":
                out.append(f"{name}: {value}")
        elif name.endswith(".stacks") and os.path.getsize(path):
            with open(path) as f:
                out.append(f"{name}:\n{f.read()}")
    return "\n".join(out)


def test_node_lost_then_replaced_8_to_4_to_8(tmp_path):
    root = str(tmp_path)
    ckpts = {f: os.path.join(root, f) for f in tiny_hf.MATRIX}
    for f, path in ckpts.items():
        tiny_hf.save_checkpoint(f, path)
    ctx = forkserver(__name__)
    ports = {k: free_port() for k in JOBS}
    deadline = time.monotonic() + 280  # within pytest's 300 s: a hang is reported as one
    old, joiners = (
        [ctx.Process(target=_rank_main, args=(role, i, ports, root, ckpts, deadline), daemon=True) for i in ranks]
        for role, ranks in (("old", range(WORLD)), ("join", VICTIMS))
    )
    try:
        for p in old:
            p.start()
        _join([old[v] for v in VICTIMS], deadline)
        dead = [old[v].exitcode for v in VICTIMS]
        assert dead == [-signal.SIGKILL] * 4, f"node 1 did not die as planned: {dead}\n{_diagnosis(root)}"
        for p in joiners:  # replacements, started after the loss
            p.start()
        _join(old + joiners, deadline)
        alive = [p.name for p in old + joiners if p.is_alive()]
        assert not alive, f"processes {alive} still running (a hang)\n{_diagnosis(root)}"
    finally:
        for p in old + joiners:
            if p.is_alive():
                p.kill()
    res = {}
    for name in [f"old{i}" for i in SURVIVORS] + [f"join{i}" for i in VICTIMS]:
        with open(os.path.join(root, f"{name}.pkl"), "rb") as f:
            kind, value = pickle.load(f)
        assert kind == "ok", f"process {name} failed:\n{value}"
        res[name] = value
    print({k: round(r["wall"], 1) for k, r in res.items()})  # each process's seconds (pytest -s)
    for f in tiny_hf.MATRIX:
        survivors = [res[f"old{i}"][f] for i in SURVIVORS]
        joined = [res[f"join{i}"][f] for i in VICTIMS]
        for r in survivors:
            # the reference and the recovery: the same re-layouts of the same state
            for job in ("r4", "s", "r8", "j"):
                rec = r[job]
                assert rec["read"] == 0 and rec["storage"] == 0 and rec["boxes"] == () and rec["dense"] == (), (
                    f,
                    job,
                    rec,
                )
                assert rec["differ"] == [] and rec["names"] > 0, (f, job, rec["differ"][:4])
                assert not rec["joined"]
            np.testing.assert_allclose(r["s"]["losses"], r["r4"]["losses"], rtol=0, atol=1e-6, err_msg=f)
            np.testing.assert_allclose(r["j"]["losses"], r["r8"]["losses"], rtol=0, atol=1e-6, err_msg=f)
        for r in joined:
            rec = r["j"]
            assert rec["joined"] and rec["read"] == 0 and rec["boxes"] == () and rec["received"] > 0, f
            np.testing.assert_allclose(rec["losses"], survivors[0]["r8"]["losses"], rtol=0, atol=1e-6, err_msg=f)
