"""Tier 2: relocate on 8 real gloo ranks, hundreds of random old -> new placements
(576 layer maps: 96 relocate calls of 6 independently mapped layers;
MOESHARD_RELOCATE_MAPS=64 runs 4,608).

Values encode (layer, logical expert, tensor, element index), as the serving engines'
relocation tests do, so any slot holding the wrong expert, a stale value, or a half-written
part is caught. One spawned group runs every scenario: 1, 2 and 4 simulated nodes; 2, 5, 16
and 64 logical experts; redundant slots; random dead ranks (experts whose only copy died are
read from a checkpoint); ranks that join empty (scale-up); tiny staging budgets (many
rounds, stashes); a third of the maps of live ranks in chunks of layers (each chunk checked).
Then bad inputs, each an error on every rank with the weights unchanged.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import expert_values
from expert_values import checkpoint_pairs, encode
from mp import run_ranks

pytestmark = pytest.mark.dist

WORLD = 8
SHAPES = ((3, 4), (4,), (1,))  # per-expert slices: a weight, a bias, a quantization scale
MODULE = "model.layers.{layer}.mlp.experts"
NUM_LAYERS = 2  # bad-input scenarios
MAP_LAYERS = 6  # random maps: each layer of a relocate call is an independent old -> new map
LOGICAL = (2, 5, 16, 64)


def write_checkpoint(root: str, num_logical: int) -> str:
    from moeshard import write_checkpoint as write

    path = os.path.join(root, f"ckpt{num_logical}")
    write(path, checkpoint_pairs(MODULE, MAP_LAYERS, num_logical, SHAPES), max_shard_bytes=4096)
    return path


def fill(tensors: dict, phy2log: np.ndarray, rank: int, slots: int) -> None:
    for layer, ts in tensors.items():
        for j, t in enumerate(ts):
            for k in range(slots):
                e = int(phy2log[layer, rank * slots + k])
                t[k] = encode(layer, e, j, SHAPES[j]) if e >= 0 else float("nan")


def check(tensors: dict, phy2log: np.ndarray, rank: int, slots: int) -> list[str]:
    return expert_values.check(tensors, phy2log, rank, slots, SHAPES)


def random_placement(rng, num_logical: int, slots: int, dead=(), layers: int = NUM_LAYERS) -> np.ndarray:
    live = [s for s in range(WORLD * slots) if s // slots not in dead]
    rows = []
    for _ in range(layers):
        row = np.full(WORLD * slots, -1)
        perm = rng.permutation(live)
        row[perm[:num_logical]] = np.arange(num_logical)
        row[perm[num_logical:]] = rng.integers(0, num_logical, len(perm) - num_logical)
        rows.append(row)
    return np.stack(rows)


def scenarios(seed: int, maps_per_config: int):
    """Deterministic on every rank: (lws, num_logical, slots, old, new, active, budget)."""
    rng = np.random.default_rng(seed)
    for lws in (8, 4, 2):
        for num_logical in LOGICAL:
            for trial in range(maps_per_config):
                slots = -(-num_logical // WORLD) + int(rng.integers(0, 3))
                kind = trial % 4
                dead_old, dead_new = (), ()
                if kind == 1:  # ranks die
                    k = int(rng.integers(1, 3))
                    dead_new = tuple(int(x) for x in rng.choice(WORLD, k, replace=False))
                    if (WORLD - k) * slots < num_logical:
                        dead_new = ()
                elif kind == 2:  # ranks join empty
                    k = int(rng.integers(1, 3))
                    dead_old = tuple(int(x) for x in rng.choice(WORLD, k, replace=False))
                    if (WORLD - k) * slots < num_logical:
                        dead_old = ()
                old = random_placement(rng, num_logical, slots, dead_old, MAP_LAYERS)
                if kind == 3:  # a small drift: a few slots change
                    new = old.copy()
                    for layer in range(MAP_LAYERS):
                        idx = rng.choice(WORLD * slots, min(3, WORLD * slots), replace=False)
                        new[layer, idx] = new[layer, rng.permutation(idx)]
                else:
                    new = random_placement(rng, num_logical, slots, dead_new, MAP_LAYERS)
                active = np.ones(WORLD, dtype=bool)
                active[list(dead_new)] = False
                # A 48-byte budget cuts experts into many pieces and rounds (the costliest maps, ~10x
                # the rounds of the others): one map in six keeps the suite's time in check.
                budget = int(rng.choice([48, 400, 1 << 20], p=[1 / 6, 5 / 12, 5 / 12]))
                yield lws, num_logical, slots, old, new, active, budget


def random_maps_worker(root: str, seed: int, maps_per_config: int) -> dict:
    import torch.distributed as dist

    import moeshard

    rank = dist.get_rank()
    out = {"bad": [], "maps": 0, "copies": {}, "rounds_max": 0, "stashes": 0, "min_gap": 0, "chunks": 0}
    for i, (lws, num_logical, slots, old, new, active, budget) in enumerate(scenarios(seed, maps_per_config)):
        topo = moeshard.Topology(WORLD, lws)
        tensors = {layer: [torch.empty(slots, *s, dtype=torch.float64) for s in SHAPES] for layer in range(MAP_LAYERS)}
        fill(tensors, old, rank, slots)
        old_pl = moeshard.Placement(old, num_logical=num_logical, num_ranks=WORLD)
        new_pl = moeshard.Placement(new, num_logical=num_logical, num_ranks=WORLD)
        kw = dict(
            checkpoint=os.path.join(root, f"ckpt{num_logical}"),
            topology=topo,
            staging_bytes=budget,
            expert_params=expert_values.params(len(SHAPES)),
            module=MODULE,
        )
        if active.all() and i % 3 == 0:
            # Chunked: every slot matches the placement in force after each chunk (bounded by
            # the bytes of about two layers' changed slots).
            slot_bytes = sum(8 * int(np.prod(s)) for s in SHAPES)
            for st in moeshard.relocate_chunks(
                tensors, old_pl, new_pl, max_bytes=2 * slots * WORLD * slot_bytes // 3, **kw
            ):
                out["bad"] += check(tensors, st.placement.phy2log, rank, slots)[:3]
                out["chunks"] += 1
            out["bad"] += check(tensors, new, rank, slots)[:3]
            out["maps"] += MAP_LAYERS
            continue
        rep = moeshard.relocate(tensors, old_pl, new_pl, active_ranks=active, **kw)
        if active[rank]:
            out["bad"] += check(tensors, new, rank, slots)[:3]
        out["maps"] += MAP_LAYERS
        for k, v in rep.copies.items():
            out["copies"][k] = out["copies"].get(k, 0) + v
        out["rounds_max"] = max(out["rounds_max"], rep.num_rounds)
        out["stashes"] += rep.num_stashes
        out["min_gap"] += (rep.network_bytes - rep.min_network_bytes) + (
            rep.cross_node_bytes - rep.min_cross_node_bytes
        )
        if rep.peak_staging_bytes_rank > max(budget, 3 * 8 * 12 * 8):
            out["bad"].append(f"rank {rank}: staged {rep.peak_staging_bytes_rank} bytes with a budget of {budget}")
    return out


@pytest.mark.timeout(900)
def test_random_maps(tmp_path):
    # random maps with real process loss: tests/test_elastic_dist.py. A longer soak outside the
    # suite: MOESHARD_RELOCATE_MAPS=64 (4,608 layer maps).
    maps_per_config = int(os.environ.get("MOESHARD_RELOCATE_MAPS", 8))
    for n in LOGICAL:
        write_checkpoint(str(tmp_path), n)
    results = run_ranks(
        random_maps_worker, str(tmp_path), 1234, maps_per_config, world=WORLD, local_world=4, timeout=850
    )
    for r in results:
        assert r["bad"] == []
        assert r["maps"] == 3 * len(LOGICAL) * maps_per_config * MAP_LAYERS
    copies = results[0]["copies"]
    # Every class of copy was exercised, plans met the lower bounds, budgets forced rounds.
    assert all(copies[k] > 0 for k in ("local", "same_node", "cross_node", "disk")), copies
    assert results[0]["min_gap"] == 0
    assert results[0]["rounds_max"] > 1 and results[0]["stashes"] > 0
    assert results[0]["chunks"] > 3 * len(LOGICAL) * maps_per_config // 4  # some maps ran in several chunks


# -- a model prepared by moeshard: EP x expert-FSDP DTensors, then a rank dies --------------


def model_worker(root: str) -> dict:
    import moeshard
    import tiny_moe

    path = os.path.join(root, "tiny")
    ckpt = tiny_moe.read_all(path)
    out = {}
    num_moe, E = len(tiny_moe.MOE_BLOCKS), tiny_moe.NUM_EXPERTS
    for ep, efsdp in ((4, 2), (8, 1)):
        mesh = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp)
        old = moeshard.Placement.contiguous(num_moe, E, ep, num_redundant=ep)
        with torch.device("meta"):
            model = tiny_moe.TinyMoE()
        moeshard.parallelize(model, mesh, old)
        moeshard.load(model, path, placement=old)
        new = tiny_moe.shuffled_placement(num_moe, E, ep, old.num_physical, seed=ep)
        rep = moeshard.relocate(model, old, new)
        out[(ep, efsdp, "rebalance")] = (tiny_moe.compare(model, ckpt, new), rep.copies, rep.disk_experts)
        # The job's counters (with expert-FSDP 2 each rank plans only its shard's component, and
        # the report adds the components up): one box written per changed slot and shard.
        changed = int(((new.phy2log != old.phy2log) & (new.phy2log >= 0)).sum())
        out[(ep, efsdp, "counters")] = (
            sum(rep.copies.values()),
            efsdp * changed,
            rep.plan,
            rep.network_bytes == rep.min_network_bytes > 0,
        )
        moeshard.verify(model, path, placement=new)
        # EP rank 1 dies: its experts move to live ranks, from live copies or from disk.
        alive = np.ones(ep, dtype=bool)
        alive[1] = False
        spr = old.num_physical // ep
        rows = []
        rng = np.random.default_rng(ep)
        for _ in range(num_moe):
            row = np.full(old.num_physical, -1)
            live = [s for s in range(old.num_physical) if s // spr != 1]
            perm = rng.permutation(live)
            row[perm[:E]] = np.arange(E)
            row[perm[E:]] = rng.integers(0, E, len(perm) - E)
            rows.append(row)
        dead = moeshard.Placement(np.stack(rows), num_logical=E, num_ranks=ep)
        rep = moeshard.relocate(model, new, dead, checkpoint=path, active_ranks=alive)
        v = moeshard.verify(model, path, placement=dead)  # raises on a wrong slot of a live rank
        out[(ep, efsdp, "dead")] = (rep.copies, rep.disk_experts, v.num_boxes_checked > 0)
    return out


def test_model_rebalance_and_dead_rank(tmp_path):
    import tiny_moe

    tiny_moe.write(str(tmp_path / "tiny"))
    results = run_ranks(model_worker, str(tmp_path), world=WORLD, local_world=4, timeout=300)
    for res in results:
        for key, value in res.items():
            if key[2] == "counters":
                written, expected, summary, at_bound = value
                assert written == expected and at_bound, key
                assert summary == results[0][key][2], key  # the same job's figures on every rank
            elif key[2] == "rebalance":
                problems, copies, disk = value
                assert problems == [], (key, problems)
                assert disk == [] and copies["disk"] == 0
                assert copies["same_node"] + copies["cross_node"] > 0
            else:
                copies, disk, checked = value
                assert checked
                assert copies["same_node"] + copies["cross_node"] + copies["disk"] > 0
    # Rank 1's slots held the only copy of some experts in at least one layout: read from disk.
    assert any(res[key][1] for res in results for key in res if key[2] == "dead")


# -- bad input: an error on every rank, weights unchanged -----------------------------------


def bad_input_worker(root: str) -> dict:
    import torch.distributed as dist

    import moeshard

    rank = dist.get_rank()
    num_logical, slots = 5, 2
    rng = np.random.default_rng(3)
    old = random_placement(rng, num_logical, slots)
    tensors = {layer: [torch.empty(slots, *s, dtype=torch.float64) for s in SHAPES] for layer in range(NUM_LAYERS)}
    fill(tensors, old, rank, slots)
    before = {k: [t.clone() for t in v] for k, v in tensors.items()}
    old_pl = moeshard.Placement(old, num_logical=num_logical, num_ranks=WORLD)
    ckpt = os.path.join(root, f"ckpt{num_logical}")
    topo = moeshard.Topology(WORLD, 4)
    alive = np.ones(WORLD, dtype=bool)
    alive[6] = False
    # Expert 0's only copies in layer 0 are on rank 6, which dies.
    lonely = old.copy()
    lonely[0][lonely[0] == 0] = 1
    lonely[0, 12] = 0
    lonely_pl = moeshard.Placement(lonely, num_logical=num_logical, num_ranks=WORLD)
    moved = random_placement(np.random.default_rng(9), num_logical, slots, dead=(6,))
    moved_pl = moeshard.Placement(moved, num_logical=num_logical, num_ranks=WORLD)
    cases = {
        "new slot on a dead rank": dict(
            old=old_pl,
            new=moeshard.Placement(
                random_placement(np.random.default_rng(5), num_logical, slots), num_logical=num_logical, num_ranks=WORLD
            ),
            active_ranks=alive,
            checkpoint=ckpt,
        ),
        "no copy and no checkpoint": dict(old=lonely_pl, new=moved_pl, active_ranks=alive),
        "missing checkpoint keys": dict(
            old=lonely_pl, new=moved_pl, active_ranks=alive, checkpoint=ckpt, module="model.layers.{layer}.moe.experts"
        ),
        "placements differ across ranks": dict(
            old=old_pl,
            new=moved_pl
            if rank != 5
            else moeshard.Placement(
                random_placement(np.random.default_rng(11), num_logical, slots, dead=(6,)),
                num_logical=num_logical,
                num_ranks=WORLD,
            ),
            active_ranks=alive,
            checkpoint=ckpt,
        ),
        "wrong slot count": dict(
            old=moeshard.Placement(np.tile(np.arange(24) % 5, (2, 1)), num_ranks=WORLD), new=moved_pl, checkpoint=ckpt
        ),
        "wrong layer count": dict(old=moeshard.Placement(old[:1], num_ranks=WORLD), new=moved_pl),
    }
    out = {}
    for label, kw in cases.items():
        kw = dict(kw)
        kw.setdefault("module", MODULE)
        try:
            moeshard.relocate(tensors, topology=topo, expert_params=expert_values.params(len(SHAPES)), **kw)
            out[label] = "no error"
        except moeshard.DistributedError as e:
            out[label] = str(e)
        out[label + " unchanged"] = all(torch.equal(a, b) for k in tensors for a, b in zip(tensors[k], before[k]))
    # relocate_chunks cannot evacuate a dead rank (its docstring: dead ranks' slots must be empty
    # in old already): refused on every rank at the first chunk, nothing changed.
    label = "chunks from a dead rank's slots"
    try:
        for _ in moeshard.relocate_chunks(
            tensors,
            old_pl,
            moved_pl,
            layers_per_chunk=1,
            active_ranks=alive,
            checkpoint=ckpt,
            topology=topo,
            expert_params=expert_values.params(len(SHAPES)),
            module=MODULE,
        ):
            pass
        out[label] = "no error"
    except moeshard.DistributedError as e:
        out[label] = str(e)
    out[label + " unchanged"] = all(torch.equal(a, b) for k in tensors for a, b in zip(tensors[k], before[k]))
    # Tensors that disagree across ranks: rank 3's bias has another shape.
    odd = {k: list(v) for k, v in tensors.items()}
    if rank == 3:
        odd[1][1] = torch.zeros(slots, 5, dtype=torch.float64)
    try:
        moeshard.relocate(
            odd,
            old_pl,
            moved_pl,
            checkpoint=ckpt,
            active_ranks=alive,
            topology=topo,
            expert_params=expert_values.params(len(SHAPES)),
            module=MODULE,
        )
        out["shapes differ"] = "no error"
    except moeshard.DistributedError as e:
        out["shapes differ"] = str(e)
    out["shapes differ unchanged"] = all(torch.equal(a, b) for k in tensors for a, b in zip(tensors[k], before[k]))
    out.update(_dead_reader_cases(rank, old, ckpt, topo))
    return out


def _dead_reader_cases(rank: int, old: np.ndarray, ckpt: str, topo) -> dict:
    """Rank 0 dies holding the only copy of expert 0 of layer 0. storage="single": every rank
    sees the files, so a live rank reads it instead; only rank 0 sees them: an error saying so."""
    import moeshard

    num_logical, slots = 5, 2
    solo = old.copy()
    solo[0][solo[0] == 0] = 1
    solo[0, 0] = 0  # slot 0 is rank 0's
    solo_pl = moeshard.Placement(solo, num_logical=num_logical, num_ranks=WORLD)
    away = random_placement(np.random.default_rng(13), num_logical, slots, dead=(0,))
    away_pl = moeshard.Placement(away, num_logical=num_logical, num_ranks=WORLD)
    alive = np.arange(WORLD) != 0
    out = {}

    def run(storage: str, path: str):
        tensors = {layer: [torch.empty(slots, *s, dtype=torch.float64) for s in SHAPES] for layer in range(NUM_LAYERS)}
        fill(tensors, solo, rank, slots)
        rep = moeshard.relocate(
            tensors,
            solo_pl,
            away_pl,
            checkpoint=path,
            active_ranks=alive,
            storage=storage,
            topology=topo,
            expert_params=expert_values.params(len(SHAPES)),
            module=MODULE,
        )
        return rep.disk_experts, check(tensors, away, rank, slots) if alive[rank] else []

    out["single, rank 0 dead"] = run("single", ckpt)
    for storage in ("single", "auto"):
        try:
            run(storage, ckpt if rank == 0 else ckpt + "-not-here")
            out[f"only dead rank 0 sees the files ({storage})"] = "no error"
        except moeshard.DistributedError as e:
            out[f"only dead rank 0 sees the files ({storage})"] = str(e)
    return out


def test_bad_input_every_rank_weights_unchanged(tmp_path):
    write_checkpoint(str(tmp_path), 5)
    results = run_ranks(bad_input_worker, str(tmp_path), world=WORLD, local_world=4, timeout=300)
    expect = {
        "new slot on a dead rank": "rank 6 is not active",
        "no copy and no checkpoint": (
            r"no live copy and no checkpoint was given \(layer, logical expert\): \[\(0, 0\)\]"
        ),
        "missing checkpoint keys": "has no tensor 'model.layers.0.moe.experts.0.w0'",
        "placements differ across ranks": "ranks disagree on the plan fingerprint",
        "wrong slot count": "has 16 expert slots, the old placement has 24",
        "wrong layer count": "the old placement has 1 layers, the experts have 2 MoE layers",
        "chunks from a dead rank's slots": "rank 6 is not active",
        "shapes differ": r"layer 1 tensor 1: rank 3 has shape \[2, 5\] torch.float64, rank 0 has shape \[2, 4\]",
    }
    import re

    for res in results:
        for label, pattern in expect.items():
            assert re.search(pattern, res[label]), (label, res[label])
            assert res[label + " unchanged"], label
        disk, bad = res["single, rank 0 dead"]
        assert (0, 0) in disk and bad == []
        for storage in ("single", "auto"):
            text = res[f"only dead rank 0 sees the files ({storage})"]
            assert (
                "logical expert 0 of layer 0 has no live copy (held only by dead ranks [0]) and the only "
                "rank(s) that can read the checkpoint (rank 0) are not active"
            ) in text, text
