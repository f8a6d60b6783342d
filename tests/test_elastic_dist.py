"""Tier 2: elastic EP with real process loss. One rank is killed (SIGKILL); the survivors meet
again in a new process group (a new rendezvous) with a process that was never in the old one,
and recover with ``relocate(..., group=survivors)``; the joiner is then fed by live ranks.

One run of 9 forked processes (8 ranks, 2 nodes x 4, and a joiner), in steps:

1. job A (8 ranks): the initial fill from the checkpoint; two EP groups of 4 relocating at the
   same time, each on its own group (random maps, some experts only on disk); a ``load`` and
   ``verify`` of a plain model on each group with node broadcasts (the node groups of a
   subgroup);
2. a relocation that rank 3 does not survive (it kills itself after running its part of the
   plan): every survivor raises PeerLostError and has its slots back at the old placement;
3. job B: the 7 survivors and the joiner (as rank 3) rendezvous anew. The survivors alone (a
   group of 7 on nodes of 3 and 4 ranks) relocate to a placement without rank 3: experts that
   had a live copy come P2P, only the others from disk; then random maps on that group;
4. scale-up: all 8 relocate to a placement that uses rank 3 again; the joiner gets its
   experts P2P (nothing is read from disk: every expert has a live copy).

Every slot is compared with the checkpoint's bytes after every step.
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

import expert_values
import moeshard
import tiny_moe
from expert_values import checkpoint_pairs
from moeshard import eplb
from moeshard._launch import free_port
from mp import forkserver, start_and_join

pytestmark = pytest.mark.dist

WORLD, LWS, VICTIM, JOINER = 8, 4, 3, 8  # JOINER: the process index of the joiner
SLOTS, LOGICAL, LAYERS = 2, 12, 3
SUB_LOGICAL = 6  # the EP groups of 4 in step 1: 8 slots each
SHAPES = ((3, 4), (4,))  # per-expert slices: a weight and a bias
MODULE = "model.layers.{layer}.mlp.experts"
SURVIVORS = [r for r in range(WORLD) if r != VICTIM]

# Job A's timeout: gloo tells only the victim's direct peers that it died; the others learn it
# from this timeout (a real job's agent would tear the group down sooner).
LOSS_TIMEOUT_S = 10
# Random maps on the survivors' group after the loss (each of LAYERS independent layer maps), and
# their seed: MOESHARD_ELASTIC_MAPS=400 makes this a soak (1,200 layer maps, about a minute more).
MAPS = int(os.environ.get("MOESHARD_ELASTIC_MAPS", "4"))
MAPS_SEED = int(os.environ.get("MOESHARD_ELASTIC_SEED", "7"))
# Job B's timeout: the joiner waits in the scale-up's first collective while the survivors run
# their maps on a group of their own.
BACKSTOP_S = 60 + MAPS // 4


def write_checkpoint(path: str) -> None:
    moeshard.write_checkpoint(path, checkpoint_pairs(MODULE, LAYERS, LOGICAL, SHAPES), max_shard_bytes=2048)


def empty_tensors() -> dict:
    return {
        layer: [torch.full((SLOTS, *s), float("nan"), dtype=torch.float64) for s in SHAPES] for layer in range(LAYERS)
    }


def check(tensors: dict, phy2log: np.ndarray, ep_rank: int, what: str) -> list[str]:
    return expert_values.check(tensors, phy2log, ep_rank, SLOTS, SHAPES, what)


def balanced(seed: int, old, active=None, ranks: int = WORLD, logical: int = LOGICAL) -> moeshard.Placement:
    load = np.random.default_rng(seed).gamma(1.0, 1.0, size=(LAYERS, logical))
    return eplb.rebalance(
        load,
        old,
        num_physical=ranks * SLOTS,
        num_ranks=ranks,
        num_nodes=ranks // LWS or 1,
        active_ranks=active,
        migration_aware=old is not None,
    )


def random_placement(rng, ranks: list[int], num_ranks: int, logical: int) -> np.ndarray:
    """Every expert once on the slots of ``ranks``, the other slots of them redundant or empty."""
    slots = [r * SLOTS + k for r in ranks for k in range(SLOTS)]
    out = np.full((LAYERS, num_ranks * SLOTS), -1)
    for layer in range(LAYERS):
        perm = rng.permutation(slots)
        out[layer, perm[:logical]] = rng.permutation(logical)
        rest = perm[logical:]
        out[layer, rest] = np.where(rng.random(len(rest)) < 0.3, -1, rng.integers(0, logical, len(rest)))
    return out


def only_on(phy2log: np.ndarray, dead_rank: int) -> list[tuple[int, int]]:
    """``(layer, expert)`` whose every copy is on ``dead_rank``."""
    out = []
    for layer, row in enumerate(phy2log):
        ranks = np.arange(len(row)) // SLOTS
        for e in np.unique(row[row >= 0]).tolist():
            if set(ranks[row == e].tolist()) == {dead_rank}:
                out.append((layer, e))
    return out


def _init(port: int, rank: int, timeout: float = BACKSTOP_S) -> None:
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _job_a(rank: int, root: str, out: dict) -> tuple:
    """Step 1 on the 8 ranks of job A; returns the rank's tensors and the placement."""
    dist = torch.distributed
    ckpt = os.path.join(root, "ckpt")
    kw = dict(expert_params=expert_values.params(len(SHAPES)), module=MODULE)
    tensors = empty_tensors()
    pl0 = balanced(0, None)
    rep = moeshard.relocate(tensors, None, pl0, checkpoint=ckpt, **kw)
    out["bad"] += check(tensors, pl0.phy2log, rank, "initial fill")
    out["fill_read"] = rep.bytes_read_rank
    # Two EP groups of 4 inside the job, relocating at the same time on their own groups.
    halves = [dist.new_group([0, 1, 2, 3]), dist.new_group([4, 5, 6, 7])]
    mine, sub_rank = halves[rank // 4], rank % 4
    rng = np.random.default_rng(100 + rank // 4)
    sub = empty_tensors()
    cur = None
    out["sub_disk"] = 0
    for step in range(4):
        new = random_placement(rng, list(range(4)), 4, SUB_LOGICAL)
        active = None
        if step % 2:  # a rank of the group dead: its slots empty in the new placement
            dead = int(rng.integers(4))
            active = np.arange(4) != dead
            new = random_placement(rng, [r for r in range(4) if r != dead], 4, SUB_LOGICAL)
        pl_new = moeshard.Placement(new, num_logical=SUB_LOGICAL, num_ranks=4)
        rep = moeshard.relocate(sub, cur, pl_new, checkpoint=ckpt, active_ranks=active, group=mine, **kw)
        if active is None or active[sub_rank]:
            out["bad"] += check(sub, new, sub_rank, f"EP group {rank // 4} map {step}")
        out["sub_disk"] += len(rep.disk_experts)
        assert rep.world_size == 4 and rep.rank == sub_rank
        cur = pl_new
    # A plain model loaded by each group with node broadcasts (a group of one node's 4 ranks).
    model = tiny_moe.TinyMoE()
    rep = moeshard.load(model, os.path.join(root, "tiny"), storage="node", group=mine)
    out["load_broadcasts"] = rep.plan.get("num_broadcasts", None)
    out["load_read"] = rep.bytes_read_rank
    identity = moeshard.Placement(np.tile(np.arange(tiny_moe.NUM_EXPERTS), (len(tiny_moe.MOE_BLOCKS), 1)))
    out["load_bad"] = tiny_moe.compare(model, tiny_moe.read_all(os.path.join(root, "tiny")), identity)
    moeshard.verify(model, os.path.join(root, "tiny"), group=mine)
    out["load_world"] = rep.world_size
    return tensors, pl0


def _lost_relocation(rank: int, tensors: dict, pl0, ckpt: str, kw: dict, out: dict) -> None:
    """Step 2: a relocation the victim does not survive. It runs its whole part of the plan and
    dies before the closing agreement, when the survivors have written every slot they were
    changing: each must raise and have its slots back at ``pl0``."""
    from moeshard.execute import TensorSink
    from moeshard.ops import relocate as relocate_mod

    mid = moeshard.Placement(
        random_placement(np.random.default_rng(5), list(range(WORLD)), WORLD, LOGICAL),
        num_logical=LOGICAL,
        num_ranks=WORLD,
    )
    real_run, real_put = relocate_mod.execute_schedule, TensorSink.put
    writes = []

    def run_then_die(*args, **kwargs):
        stats = real_run(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        return stats

    def counted_put(self, items):
        real_put(self, items)
        writes.append(len(items))

    if rank == VICTIM:
        relocate_mod.execute_schedule = run_then_die
    TensorSink.put = counted_put
    t0 = time.monotonic()
    try:
        moeshard.relocate(tensors, pl0, mid, checkpoint=ckpt, staging_bytes=256, **kw)
        out["lost"] = None
    except moeshard.DistributedError as e:
        out["lost"] = (type(e).__name__, str(e), time.monotonic() - t0)
    finally:
        TensorSink.put = real_put
    out["written_before_loss"] = sum(writes)
    out["bad"] += check(tensors, pl0.phy2log, rank, "after the relocation the victim did not survive")


def _rank_main(idx: int, ports: tuple[int, int], root: str, out_dir: str) -> None:
    os.environ.update(LOCAL_WORLD_SIZE=str(LWS), MOESHARD_PROGRESS="0")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    torch.set_num_threads(1)
    dist = torch.distributed
    ckpt = os.path.join(root, "ckpt")
    kw = dict(expert_params=expert_values.params(len(SHAPES)), module=MODULE)
    out: dict = {"bad": []}
    try:
        if idx != JOINER:
            rank = idx
            _init(ports[0], rank, LOSS_TIMEOUT_S)
            tensors, pl0 = _job_a(rank, root, out)
            _lost_relocation(rank, tensors, pl0, ckpt, kw, out)
            dist.destroy_process_group()
            if rank == 0:
                open(os.path.join(root, "job_b"), "w").close()
        else:
            rank, tensors, pl0 = VICTIM, empty_tensors(), balanced(0, None)  # the joiner plays EP rank 3
            while not os.path.exists(os.path.join(root, "job_b")):  # joins when job B forms
                time.sleep(0.2)
        # Job B: a new rendezvous of the survivors and the joiner (as rank 3).
        _init(ports[1], rank)
        alive = np.arange(WORLD) != VICTIM
        pl1 = balanced(1, pl0, active=alive)
        if rank != VICTIM:
            survivors = dist.new_group(SURVIVORS, use_local_synchronization=True)
            rep = moeshard.relocate(tensors, pl0, pl1, checkpoint=ckpt, active_ranks=alive, group=survivors, **kw)
            out["bad"] += check(tensors, pl1.phy2log, rank, "recovery")
            out["recovery"] = dict(
                disk=rep.disk_experts,
                read=rep.bytes_read_rank,
                recv=rep.bytes_received_rank,
                copies=rep.copies,
                world=rep.world_size,
                rank=rep.rank,
            )
            out["want_disk"] = only_on(pl0.phy2log, VICTIM)
            # Random maps on the survivors' group: nodes of 3 and 4 ranks, group ranks != EP ranks.
            rng = np.random.default_rng(MAPS_SEED)
            cur = pl1
            out["maps"] = 0
            for _ in range(MAPS):
                new = moeshard.Placement(
                    random_placement(rng, SURVIVORS, WORLD, LOGICAL), num_logical=LOGICAL, num_ranks=WORLD
                )
                moeshard.relocate(
                    tensors,
                    cur,
                    new,
                    checkpoint=ckpt,
                    active_ranks=alive,
                    group=survivors,
                    staging_bytes=int(rng.choice([64, 256, 1 << 20])),
                    **kw,
                )
                out["bad"] += check(tensors, new.phy2log, rank, "survivors' map")
                out["maps"] += LAYERS
                cur = new
            back = pl1
            moeshard.relocate(tensors, cur, back, checkpoint=ckpt, active_ranks=alive, group=survivors, **kw)
        # Scale-up: everyone, the joiner included, on job B's default group.
        pl2 = balanced(2, pl1)
        rep = moeshard.relocate(tensors, pl1, pl2, checkpoint=ckpt, **kw)
        out["bad"] += check(tensors, pl2.phy2log, rank, "scale-up")
        out["scale_up"] = dict(
            disk=rep.disk_experts,
            read=rep.bytes_read_rank,
            recv=rep.bytes_received_rank,
            slots=int((pl2.phy2log[:, rank * SLOTS : (rank + 1) * SLOTS] >= 0).sum()),
        )
        dist.barrier()
        dist.destroy_process_group()
        result = ("ok", out)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{idx}.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)


def test_survivors_recover_and_joiner_is_fed_by_live_ranks(tmp_path):
    root = str(tmp_path)
    write_checkpoint(os.path.join(root, "ckpt"))
    tiny_moe.write(os.path.join(root, "tiny"))
    ctx = forkserver(__name__)
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=_rank_main, args=(i, ports, root, root), daemon=True) for i in range(WORLD + 1)]
    alive = start_and_join(procs, 4 * BACKSTOP_S)
    assert not alive, f"processes {alive} still running (a hang)"
    assert procs[VICTIM].exitcode == -signal.SIGKILL
    res = {}
    for i in range(WORLD + 1):
        if i == VICTIM:
            continue
        with open(os.path.join(root, f"{i}.pkl"), "rb") as f:
            kind, value = pickle.load(f)
        assert kind == "ok", f"process {i} failed:\n{value}"
        res[i] = value
    for i, r in res.items():
        assert r["bad"] == [], f"process {i}: {r['bad'][:5]}"
    survivors = [res[r] for r in SURVIVORS]
    # Step 1: the fill read every expert once; the groups of 4 planned on their own ranks; the
    # plain model's load read each byte once per node and broadcast it (node groups of a subgroup).
    assert all(r["fill_read"] > 0 for r in survivors)
    assert all(r["load_world"] == 4 and r["load_bad"] == [] and r["load_broadcasts"] > 0 for r in survivors)
    assert sum(r["sub_disk"] for r in survivors) > 0  # some experts had no live copy in the EP groups
    # Step 2: the relocation the victim died in raised PeerLostError on every survivor (within
    # the backend's timeout), after they had written slots; those slots were put back (every
    # survivor's slots were checked against the old placement: "bad" above).
    for r in survivors:
        assert r["lost"] is not None and r["lost"][0] == "PeerLostError", r["lost"]
        assert r["lost"][2] < LOSS_TIMEOUT_S + 10
    assert all(r["written_before_loss"] > 0 for r in survivors)
    # Step 3: recovery on the survivors' group of 7: exactly the experts whose every copy was on
    # the dead rank were read from disk; the rest came from live copies.
    want = survivors[0]["want_disk"]
    assert want, "the test's placement must leave some experts only on the victim"
    for r in SURVIVORS:
        rec = res[r]["recovery"]
        assert rec["world"] == 7 and rec["rank"] == SURVIVORS.index(r)
        assert rec["disk"] == want
    assert sum(res[r]["recovery"]["read"] for r in SURVIVORS) > 0
    assert sum(res[r]["recovery"]["recv"] for r in SURVIVORS) > 0
    assert all(r["maps"] == MAPS * LAYERS for r in survivors)
    # Step 4: the joiner got its slots from live ranks, nothing from disk.
    joiner = res[JOINER]["scale_up"]
    assert joiner["slots"] > 0 and joiner["recv"] > 0
    assert all(r["scale_up"]["disk"] == [] and r["scale_up"]["read"] == 0 for r in res.values())
