"""Properties of the array-based save planner on the random save cases of
``test_schedule_sim``: every byte of every tensor is written exactly once (by its writer's
local writes and the transfers to it), from a segment that holds it; the staging, op and
piece budgets hold; the objects (batches, local writes, segments) agree with the schedule's
arrays."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard.io.header import DTYPES
from moeshard.plan.save import plan_save
from test_schedule_sim import save_case

TABLES = ("pieces", "reads", "sends", "bcasts", "deliveries", "views", "copies")  # a Schedule's tables


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
    peak = np.zeros(plan.world_size, np.int64)
    for b in plan.batches:
        staged, ops = np.zeros(plan.world_size, np.int64), np.zeros(plan.world_size, np.int64)
        for x in b:
            assert x.src != x.dst
            staged[[x.src, x.dst]] += x.nbytes
            ops[[x.src, x.dst]] += 1
        assert ops.max() <= max_ops and (staged.max() <= budget or len(b) == 1)
        peak = np.maximum(peak, staged)
    assert plan.cost.peak_staging_bytes.tolist() == peak.tolist()  # the packer's running peak is the batches'
    assert plan.cost.num_batches == len(plan.batches) and plan.cost.num_p2p_ops == sum(map(len, plan.batches))
    sent, recv = np.zeros(plan.world_size, np.int64), np.zeros(plan.world_size, np.int64)
    for x in (x for b in plan.batches for x in b):
        sent[x.src] += x.nbytes
        recv[x.dst] += x.nbytes
    assert plan.cost.sent_bytes.tolist() == sent.tolist() and plan.cost.recv_bytes.tolist() == recv.tolist()
    assert all(f.data_bytes <= max_shard or len(f.tensors) == 1 for f in plan.files)
    assert sorted(t for f in plan.files for t in f.tensors) == list(range(len(outs)))
    s = plan.schedule
    flat = [x for b in plan.batches for x in b]
    assert s.sends.src.tolist() == [x.src for x in flat] and s.sends.dst.tolist() == [x.dst for x in flat]
    assert s.sends.round.tolist() == [k for k, b in enumerate(plan.batches) for _ in b]
    assert int(plan.cost.sent_bytes.sum()) == sum(x.nbytes for x in flat) == int(s.pieces.bytes[: len(flat)].sum())
    assert int(plan.cost.write_bytes.sum()) == plan.total_bytes


def test_save_plan_properties():
    for seed in range(40):
        outs, _, world, rng = save_case(seed)
        for budget, max_ops, max_shard in ((8, 2, 16), (24, 3, 200), (10**6, 64, 10**6)):
            plan = plan_save(outs, world, max_shard, budget, max_ops)
            _check(plan, outs, budget, max_ops, max_shard)
            assert plan.fingerprint == plan_save(outs, world, max_shard, budget, max_ops).fingerprint
            _check_rank_plans(plan, outs, world, max_shard, budget, max_ops)


def _check_rank_plans(plan, outs, world: int, max_shard: int, budget: int, max_ops: int) -> None:
    """A plan built for one rank (``plan_save(rank=)``, what save runs) keeps exactly that
    rank's schedule of the whole job's plan, with the job's writers, files, counters and
    fingerprint, and refuses the whole job's views."""
    for r in range(world):
        mine = plan_save(outs, world, max_shard, budget, max_ops, rank=r)
        assert mine.rank == r and mine.fingerprint == plan.fingerprint
        assert [(t.writer, t.file, t.offset) for t in mine.tensors] == [
            (t.writer, t.file, t.offset) for t in plan.tensors
        ]
        assert mine.files == plan.files
        for f in ("write_bytes", "sent_bytes", "recv_bytes", "peak_staging_bytes"):
            assert getattr(mine.cost, f).tolist() == getattr(plan.cost, f).tolist(), f
        assert (mine.cost.num_p2p_ops, mine.cost.num_batches) == (plan.cost.num_p2p_ops, plan.cost.num_batches)
        a, b = mine.schedule_for(r), plan.schedule_for(r)
        arrays_b = dict(b.arrays())
        for f, va in a.arrays():
            vb = arrays_b[f]
            assert (va is None) == (vb is None), (r, f)
            if va is not None:
                assert va.dtype == vb.dtype and va.tolist() == vb.tolist(), (r, f)
        for f in a.__dataclass_fields__:
            va, vb = getattr(a, f), getattr(b, f)
            if f not in ("cost", *TABLES) and not isinstance(va, np.ndarray):
                assert va == vb, (r, f)
        assert len(mine._pieces.tensor) == len(a.pieces.key)  # nothing but the rank's pieces is kept
        other = (r + 1) % world
        if other != r:
            with pytest.raises(ValueError, match=f"rank {r}'s pieces only"):
                mine.schedule_for(other)
        for view in ("schedule", "batches", "local_writes"):
            with pytest.raises(ValueError, match="whole job"):
                getattr(mine, view)


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
        if i and (
            stage.get(s, 0) + b > budget
            or stage.get(d, 0) + b > budget
            or ops.get(s, 0) >= max_ops
            or ops.get(d, 0) >= max_ops
        ):
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
    chunk = S._CHUNK
    for trial in range(60):
        world, n = int(rng.integers(1, 120)), int(rng.integers(1, 300))
        count = rng.choice([1, 2, 5, 33, 100], n).clip(max=world)
        rank = np.concatenate([np.sort(rng.choice(world, c, replace=False)) for c in count]).astype(np.int64)
        start = (np.cumsum(count) - count).astype(np.int64)
        size = rng.integers(0, 1000, n)
        try:
            S._CHUNK = chunk if trial % 2 else int(rng.integers(1, 50))  # candidates a chunk of items at a time
            got = S._least_loaded(start, count.astype(np.int64), rank, size, world).tolist()
        finally:
            S._CHUNK = chunk
        assert got == _least_loaded_naive(start, count, rank, size, world), trial
    try:
        S._CHUNK = 7  # many chunks, batches across their edges
        for trial in range(300):  # also transfers of no bytes, over the budget alone, one op per batch
            world, n = int(rng.integers(2, 12)), int(rng.integers(1, 200))
            src = rng.integers(0, world, n)
            dst = (src + rng.integers(1, world, n)) % world
            nbytes = rng.integers(0, 50, n) * int(rng.choice([1, 4]))
            budget, max_ops = int(rng.choice([1, 10, 60, 10**6])), int(rng.choice([1, 2, 3, 64]))
            got = S._Packer(world, budget, max_ops)(src, dst, nbytes).tolist()
            assert got == _pack_naive(src, dst, nbytes, budget, max_ops), trial
    finally:
        S._CHUNK = chunk


def test_streamed_pieces_are_the_whole_plan():
    """The pieces are made a chunk of tensors at a time, the batch packing carrying its state
    over the chunks: chunks of a few boxes give the same schedule, counters and rank plans as
    one chunk."""
    from moeshard.plan import save as S

    for seed in range(40):
        outs, _, world, rng = save_case(seed)
        budget, max_ops, max_shard = (8, 2, 16) if seed % 2 else (24, 3, 200)
        whole = plan_save(outs, world, max_shard, budget, max_ops)
        chunk = S._CHUNK
        try:
            S._CHUNK = int(rng.integers(1, 4))
            small = plan_save(outs, world, max_shard, budget, max_ops)
            ranks = [plan_save(outs, world, max_shard, budget, max_ops, rank=r) for r in range(world)]
        finally:
            S._CHUNK = chunk
        assert arrays_of(small.schedule) == arrays_of(whole.schedule), seed
        for f in ("sent_bytes", "recv_bytes", "peak_staging_bytes"):
            assert getattr(small.cost, f).tolist() == getattr(whole.cost, f).tolist(), (seed, f)
        assert small.cost.num_batches == whole.cost.num_batches, seed
        for r, mine in enumerate(ranks):
            assert arrays_of(mine.schedule_for(r)) == arrays_of(whole.schedule_for(r)), (seed, r)


def arrays_of(schedule) -> dict:
    """A schedule's arrays as lists."""
    return {f: a.tolist() for f, a in schedule.arrays() if a is not None}


def test_tiling_checked_a_chunk_of_tensors_at_a_time():
    """With chunks of one box, a gap or an overlap in any tensor, first or last, is still found
    (and named), and tensors that tile pass."""
    from moeshard.plan import save as S
    from moeshard.plan.save_outputs import Output, Segment

    def tiled(k: int) -> Output:
        return Output(f"t{k}", (8, 2), "F32", [Segment(r, 0, ((4 * r, 4), (0, 2))) for r in range(2)])

    gap = Output("gap", (10,), "F32", [Segment(0, 0, ((0, 4),)), Segment(1, 0, ((5, 5),))])
    overlap = Output("overlap", (10,), "F32", [Segment(0, 0, ((0, 6),)), Segment(1, 0, ((4, 6),))])
    chunk = S._CHUNK
    try:
        S._CHUNK = 1
        assert plan_save([tiled(k) for k in range(5)], 2, 1024, 1024).cost.write_bytes.sum() == 5 * 16 * 4
        for bad, match in ((gap, "'gap'.*gap at offset 4"), (overlap, "'overlap'.*overlapping")):
            for at in (0, 3, 5):
                outs = [tiled(k) for k in range(5)]
                outs.insert(at, bad)
                with pytest.raises(ValueError, match=match):
                    plan_save(outs, 2, 1024, 1024)
    finally:
        S._CHUNK = chunk
