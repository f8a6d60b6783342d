"""Properties of the array-based save planner on the random save cases of
``test_schedule_sim``: every byte of every tensor is written exactly once (by its writer's
local writes and the transfers to it), from a segment that holds it; the staging, op and
piece budgets hold; the objects (batches, local writes, segments) agree with the schedule's
arrays."""

from __future__ import annotations

import numpy as np
from test_schedule_sim import save_case

from moeshard.io.checkpoint import DTYPES
from moeshard.plan.save import plan_save


def _inside(sub, box) -> bool:
    return all(o <= so and so + sn <= o + n for (so, sn), (o, n) in zip(sub, box))


def _check(plan, outs, budget: int, max_ops: int, max_shard: int) -> None:
    covered = [np.zeros(o.shape, np.int64) for o in outs]
    pieces = [(w.tensor, w.segment, w.box, w.nbytes, r, r) for r, ws in enumerate(plan.local_writes) for w in ws]
    pieces += [(x.tensor, x.segment, x.box, x.nbytes, x.src, x.dst) for b in plan.batches for x in b]
    for t, si, box, nbytes, src, dst in pieces:
        ten = plan.tensors[t]
        seg = ten.segments[si]
        assert dst == ten.writer and seg.rank == src and _inside(box, seg.box)
        item = DTYPES[ten.dtype].itemsize
        assert nbytes == item * int(np.prod([n for _, n in box])) <= max(budget // 4, item)
        covered[t][tuple(slice(o, o + n) for o, n in box)] += 1
    assert all((c == 1).all() for c in covered)  # every element exactly once
    for b in plan.batches:
        staged, ops = np.zeros(plan.world_size, np.int64), np.zeros(plan.world_size, np.int64)
        for x in b:
            assert x.src != x.dst
            staged[[x.src, x.dst]] += x.nbytes
            ops[[x.src, x.dst]] += 1
        assert ops.max() <= max_ops and (staged.max() <= budget or len(b) == 1)
    assert all(f.data_bytes <= max_shard or len(f.tensors) == 1 for f in plan.files)
    assert sorted(t for f in plan.files for t in f.tensors) == list(range(len(outs)))
    s = plan.schedule
    flat = [x for b in plan.batches for x in b]
    assert s.send_src.tolist() == [x.src for x in flat] and s.send_dst.tolist() == [x.dst for x in flat]
    assert s.send_round.tolist() == [k for k, b in enumerate(plan.batches) for _ in b]
    assert int(plan.cost.sent_bytes.sum()) == sum(x.nbytes for x in flat) == int(s.piece_bytes[:len(flat)].sum())
    assert int(plan.cost.write_bytes.sum()) == plan.total_bytes


def test_save_plan_properties():
    for seed in range(40):
        outs, _, world, rng = save_case(seed)
        for budget, max_ops, max_shard in ((8, 2, 16), (24, 3, 200), (10**6, 64, 10**6)):
            plan = plan_save(outs, world, max_shard, budget, max_ops)
            _check(plan, outs, budget, max_ops, max_shard)
            assert plan.fingerprint == plan_save(outs, world, max_shard, budget, max_ops).fingerprint


def _least_loaded_naive(start, count, rank, size, world):
    load, out = [0] * world, []
    for s, c, b in zip(start.tolist(), count.tolist(), size.tolist()):
        j = min(range(s, s + c), key=lambda m: (load[int(rank[m])], m))  # least load, then first (lowest rank)
        load[int(rank[j])] += b
        out.append(j)
    return out


def _pack_naive(src, dst, nbytes, budget, max_ops):
    out, k, stage, ops = [], 0, {}, {}
    for i, (s, d, b) in enumerate(zip(src.tolist(), dst.tolist(), nbytes.tolist())):
        if i and (stage.get(s, 0) + b > budget or stage.get(d, 0) + b > budget or ops.get(s, 0) >= max_ops
                  or ops.get(d, 0) >= max_ops):
            k, stage, ops = k + 1, {}, {}
        for r in (s, d):
            stage[r], ops[r] = stage.get(r, 0) + b, ops.get(r, 0) + 1
        out.append(k)
    return out


def test_greedy_choices_match_their_definitions():
    """The save planner's two loops (the least-loaded choice of writers and holders, whose
    items with more than 32 candidates take a numpy path; the batch packing, which works on
    chunks of transfers) equal plain per-item definitions, on items with 1 to 100 candidates
    and on more transfers than one chunk."""
    from moeshard.plan import save as S

    rng = np.random.default_rng(0)
    for trial in range(30):
        world, n = int(rng.integers(1, 120)), int(rng.integers(1, 300))
        count = rng.choice([1, 2, 5, 33, 100], n).clip(max=world)
        rank = np.concatenate([np.sort(rng.choice(world, c, replace=False)) for c in count]).astype(np.int64)
        start = (np.cumsum(count) - count).astype(np.int64)
        size = rng.integers(0, 1000, n)
        got = S._least_loaded(start, count.astype(np.int64), rank, size, world).tolist()
        assert got == _least_loaded_naive(start, count, rank, size, world), trial
    chunk = S._CHUNK
    try:
        S._CHUNK = 7  # many chunks, batches across their edges
        for trial in range(300):  # also transfers of no bytes, over the budget alone, one op per batch
            world, n = int(rng.integers(2, 12)), int(rng.integers(1, 200))
            src = rng.integers(0, world, n)
            dst = (src + rng.integers(1, world, n)) % world
            nbytes = rng.integers(0, 50, n) * int(rng.choice([1, 4]))
            budget, max_ops = int(rng.choice([1, 10, 60, 10**6])), int(rng.choice([1, 2, 3, 64]))
            got = S._pack(src, dst, nbytes, budget, max_ops).tolist()
            assert got == _pack_naive(src, dst, nbytes, budget, max_ops), trial
    finally:
        S._CHUNK = chunk
