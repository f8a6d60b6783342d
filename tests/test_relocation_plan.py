"""Tier 1: the relocation planner, checked by simulating its rounds on every rank.

The simulator keeps, for every live rank, what each (layer, slot, part group) holds and runs a
plan with the executor's semantics: stashes at a round's start, then reads, local clones and
phase-A sends (from the slot's *current* content, or its stash), phase-B relays from received
buffers, and only then the round's writes. A plan that overwrites a slot before sending it,
sends from a rank that does not hold the expert, or leaves a slot wrong fails here.
"""

from __future__ import annotations

import numpy as np
import pytest

from moeshard import Placement, Topology
from moeshard.box import full_box
from moeshard.plan.relocation import ExpertTensor, plan_relocation

SLICE = [(6, 4), (4, 3)]  # two tensors per layer: gate_up-like [6, 4], down-like [4, 3]


def expert_tensors(num_layers: int, num_physical: int, world: int, efsdp: int = 1, itemsize: int = 4):
    """EP = world // efsdp ranks along slots; efsdp splits dim 0 of each slice (Shard(1))."""
    ep = world // efsdp
    spr = num_physical // ep
    out = []
    for layer in range(num_layers):
        for t, shape in enumerate(SLICE):
            holdings = []
            for rank in range(world):
                e_rank, f = divmod(rank, efsdp)
                rows = shape[0] // efsdp
                box = ((f * rows, rows),) + full_box(shape[1:])
                holdings.append((rank, e_rank * spr, spr, box))
            out.append(ExpertTensor(layer, f"l{layer}.t{t}", shape, itemsize, tuple(holdings)))
    return out


def simulate(plan, old: Placement, new: Placement, active: np.ndarray) -> None:
    """Run ``plan`` on symbolic contents; assert every live slot ends with its new expert."""
    mem = {}  # (rank, layer, slot, part) -> expert
    for layer, cols in enumerate(plan.columns):
        for rank, (c, s0, ns) in cols.items():
            if not active[rank]:
                continue
            for s in range(s0, s0 + ns):
                for k in range(len(plan.parts[(layer, c)])):
                    mem[(rank, layer, s, k)] = int(old.phy2log[layer, s])
    stash = {}
    for rnd in plan.rounds:
        for si in rnd.stashes:
            st = plan.stashes[si]
            stash[(st.rank, st.layer, st.slot, st.part)] = mem[(st.rank, st.layer, st.slot, st.part)]

        def slot(r, layer, s, k):
            key = (r, layer, s, k)
            return stash[key] if key in stash else mem[key]

        pending = []
        for i in rnd.moves:
            m = plan.moves[i]
            have = {}
            if m.read >= 0:
                assert plan_readers[m.read]
                have[m.read] = m.expert
            for r, s in m.copies:
                have[r] = slot(r, m.layer, s, m.part)
            for src, s, dst in m.sends:
                assert active[src] and active[dst]
                have[dst] = slot(src, m.layer, s, m.part) if s >= 0 else have[src]
            for src, dst in m.relays:
                have[dst] = have[src]
            for r, slots in m.writes:
                assert active[r]
                assert have[r] == m.expert, f"move {m} delivers {have[r]} to rank {r}"
                pending.extend(((r, m.layer, s, m.part), have[r]) for s in slots)
        for key, val in pending:
            mem[key] = val
    for (rank, layer, s, k), val in mem.items():
        assert val == new.phy2log[layer, s], f"rank {rank} layer {layer} slot {s} part {k}: {val}"


plan_readers = np.ones(64, dtype=bool)  # the simulator's check that readers can read


def random_placement(rng, num_layers, num_logical, num_physical, num_ranks, dead=()):
    spr = num_physical // num_ranks
    rows = []
    live_slots = [s for s in range(num_physical) if s // spr not in dead]
    for _ in range(num_layers):
        row = np.full(num_physical, -1)
        perm = rng.permutation(live_slots)
        row[perm[:num_logical]] = np.arange(num_logical)
        row[perm[num_logical:]] = rng.integers(0, num_logical, len(perm) - num_logical)
        rows.append(row)
    return Placement(np.stack(rows), num_logical=num_logical, num_ranks=num_ranks)


@pytest.mark.parametrize("lws", [1, 2, 4, 8])
@pytest.mark.parametrize("num_logical", [2, 5, 16, 64])
def test_random_maps_simulated(lws, num_logical):
    rng = np.random.default_rng(lws * 100 + num_logical)
    world = 8
    topo = Topology(world, lws)
    for trial in range(60):
        efsdp = [1, 2][trial % 2] if num_logical < 64 else 1
        ep = world // efsdp
        per_rank = -(-num_logical // ep) + int(rng.integers(0, 3))
        num_physical = per_rank * ep
        dead_old = (
            tuple(int(x) for x in rng.choice(ep, int(rng.integers(0, 2)), replace=False)) if trial % 3 == 1 else ()
        )
        dead_new = (
            tuple(int(x) for x in rng.choice(ep, int(rng.integers(1, 3)), replace=False)) if trial % 3 == 2 else ()
        )
        if (ep - len(dead_new)) * per_rank < num_logical:
            dead_new = ()
        if (ep - len(dead_old)) * per_rank < num_logical:
            dead_old = ()
        old = random_placement(rng, 2, num_logical, num_physical, ep, dead_old)
        new = random_placement(rng, 2, num_logical, num_physical, ep, dead_new)
        active = np.ones(world, dtype=bool)
        for d in dead_new:
            active[d * efsdp : (d + 1) * efsdp] = False
        budget = int(rng.choice([64, 200, 10_000]))
        tensors = expert_tensors(2, num_physical, world, efsdp)
        plan = plan_relocation(
            tensors,
            old,
            new,
            topo,
            active,
            readers=np.ones(world, bool),
            staging_bytes=budget,
            max_ops=int(rng.choice([2, 8, 64])),
        )
        simulate(plan, old, new, active)
        c = plan.cost
        assert c.network_bytes == c.min_network_bytes
        assert c.cross_node_bytes == c.min_cross_node_bytes
        assert c.peak_staging_bytes.max() <= max(budget, max(m.nbytes for m in plan.moves) * 8 if plan.moves else 0)


def test_unchanged_costs_nothing():
    topo = Topology(8, 4)
    old = Placement.contiguous(3, 16, 8, 8)
    plan = plan_relocation(expert_tensors(3, 24, 8), old, old, topo)
    assert plan.moves == () and plan.rounds == ()
    assert sum(plan.cost.copies.values()) == 0


def test_local_copy_and_swap_cycle():
    # Two ranks swap their experts (a cycle): one stash breaks it, all within one node.
    topo = Topology(2, 2)
    old = Placement(np.array([[0, 1]]), num_ranks=2)
    new = Placement(np.array([[1, 0]]), num_ranks=2)
    tensors = expert_tensors(1, 2, 2)
    plan = plan_relocation(tensors, old, new, topo, staging_bytes=1)
    simulate(plan, old, new, np.ones(2, bool))
    assert plan.cost.copies["same_node"] == 2 * len(plan.parts[(0, 0)])
    # With room for everything, a swap is one round and needs no stash.
    big = plan_relocation(tensors, old, new, topo)
    assert big.cost.num_rounds == 1
    # A rank reordering its own slots is local copies only, whatever it costs in rounds.
    old = Placement(np.array([[0, 1, 2, 3]]), num_ranks=1)
    new = Placement(np.array([[3, 0, 1, 2]]), num_ranks=1)
    plan = plan_relocation(expert_tensors(1, 4, 1), old, new, Topology(1, 1), staging_bytes=1)
    simulate(plan, old, new, np.ones(1, bool))
    assert plan.cost.network_bytes == 0 and plan.cost.copies["local"] > 0
    assert plan.cost.num_stashes >= 1


def test_same_node_preferred_and_cross_node_once():
    # Expert 0 lives on rank 0 (node 0) and rank 4 (node 1); ranks 5, 6, 7 need it.
    topo = Topology(8, 4)
    old = np.arange(8) % 4
    old[4] = 0
    new = old.copy()
    new[5:] = 0
    new[1:4] = [1, 2, 3]  # keep every expert alive
    old_p = Placement(old[None], num_logical=4, num_ranks=8)
    new_p = Placement(new[None], num_logical=4, num_ranks=8)
    plan = plan_relocation(expert_tensors(1, 8, 8), old_p, new_p, topo)
    simulate(plan, old_p, new_p, np.ones(8, bool))
    for m in plan.moves:
        assert all(src == 4 for src, _, _ in m.sends)  # the node-1 holder, not rank 0
    assert plan.cost.cross_node_bytes == 0
    # Kill rank 4: one copy crosses to node 1 and is relayed there.
    active = np.ones(8, bool)
    active[4] = False
    new[4] = -1
    new[5] = 1
    new_p = Placement(new[None], num_logical=4, num_ranks=8)
    plan = plan_relocation(expert_tensors(1, 8, 8), old_p, new_p, topo, active)
    simulate(plan, old_p, new_p, active)
    per_move = plan.moves[0].nbytes
    assert plan.cost.cross_node_bytes == plan.cost.min_cross_node_bytes
    assert plan.cost.cross_node_bytes == sum(m.nbytes for m in plan.moves if m.expert == 0)
    assert any(m.relays for m in plan.moves if m.expert == 0) and per_move > 0


def test_dead_only_copy_read_from_disk():
    topo = Topology(4, 2)
    active = np.array([True, True, False, True])
    # Old: 4 ranks, 2 slots each; expert 2 only on rank 2, which dies.
    old = Placement(np.array([[0, 1, 0, 1, 2, 3, 3, 1]]), num_ranks=4)
    new = Placement(np.array([[0, 1, 2, 3, -1, -1, 3, 1]]), num_ranks=4)
    tensors = expert_tensors(1, 8, 4)
    with pytest.raises(ValueError, match="logical expert 2 of layer 0 has no live copy .*dead ranks \\[2\\]"):
        plan_relocation(tensors, old, new, topo, active)
    plan = plan_relocation(tensors, old, new, topo, active, readers=np.ones(4, bool))
    simulate(plan, old, new, active)
    assert plan.disk_experts == [(0, 2)]
    assert plan.cost.copies["disk"] == len(plan.parts[(0, 0)])
    assert plan.cost.read_bytes.sum() == sum(m.nbytes for m in plan.moves if m.read >= 0)
    assert all(m.read == 1 for m in plan.moves if m.expert == 2)  # the needer reads it itself


def test_new_slot_on_dead_rank_rejected():
    topo = Topology(4, 4)
    old = Placement.contiguous(1, 4, 4)
    new = Placement(np.array([[1, 0, 2, 3]]), num_ranks=4)
    with pytest.raises(ValueError, match="slot 3 of layer 0, which rank 3 holds, but rank 3 is not active"):
        plan_relocation(expert_tensors(1, 4, 4), old, new, topo, np.array([True, True, True, False]))


def test_deterministic_fingerprint():
    rng = np.random.default_rng(7)
    topo = Topology(8, 4)
    old = random_placement(rng, 4, 16, 32, 8)
    new = random_placement(rng, 4, 16, 32, 8)
    a = plan_relocation(expert_tensors(4, 32, 8), old, new, topo, staging_bytes=300)
    b = plan_relocation(expert_tensors(4, 32, 8), old, new, topo, staging_bytes=300)
    c = plan_relocation(expert_tensors(4, 32, 8), old, new, topo, staging_bytes=301)
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_initial_fill_from_checkpoint():
    # old=None: nothing is held; every slot box is read (once per job) and sent where needed.
    topo = Topology(8, 4)
    new = Placement.contiguous(2, 12, 8, 4)
    tensors = expert_tensors(2, 16, 8)
    plan = plan_relocation(tensors, None, new, topo, readers=np.ones(8, bool))
    boxes = sum(len(plan.parts[(layer, 0)]) * 16 for layer in range(2))
    assert plan.cost.copies["disk"] == boxes
    per_expert = sum(m.nbytes for m in plan.moves if m.layer == 0 and m.expert == 0)
    assert plan.cost.read_bytes.sum() == 2 * 12 * per_expert  # each logical expert read once
    assert sorted(plan.disk_experts) == [(layer, e) for layer in range(2) for e in range(12)]
    with pytest.raises(ValueError, match="no live copy"):
        plan_relocation(tensors, None, new, topo)
