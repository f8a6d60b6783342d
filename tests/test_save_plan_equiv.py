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
