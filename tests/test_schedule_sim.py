"""Tier 1: schedules run by a numpy simulator of :func:`moeshard.execute.execute_schedule`.

All ranks' rows run round by round as the runner runs them: copies (views cloned, once per
piece), reads, the P2P batch (a send reads its view's content *now*, or the sender's buffer),
the round's deliveries, then buffers past their last use are freed; round -1 reads and copies
deliver straight into place. Staged bytes and P2P ops are counted per rank and round; a buffer
used before it exists or after it is freed, or acquired twice (the runner keeps one per piece)
fails. Relocation, save and LoRA-save schedules of random cases are checked on known data.
"""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import product

import numpy as np
import pytest
import torch

from moeshard import Placement, Topology
from moeshard.models.adapters import ExpertParam
from moeshard.models.describe import ExpertRef, ParamDesc
from moeshard.models.outputs import describe_outputs
from moeshard.models.shards import rank_boxes
from moeshard.plan.relocation import COUNTERS, DEFAULT_STAGING_BYTES, ExpertTensor, job_summary, plan_relocation
from moeshard.plan.save import HeldBoxes, plan_save, tensor_schedule


def sl(box):
    """Index of ``box`` (``(offset, length)`` per dim)."""
    return tuple(slice(int(o), int(o + n)) for o, n in box)


def simulate(s, src, sink=None, read=None):
    """Run schedule ``s``: ``src[rank][param]`` local tensors (views), ``sink[rank][param]``
    delivery targets (default ``src``), ``read(pid)`` the checkpoint. Returns write counts
    ``{(rank, param): int array}``, staged bytes and P2P ops ``{(rank, round): n}``."""
    sink, world = src if sink is None else sink, s.topology.world_size
    assert not s.has_broadcasts  # neither planner emits them
    mine = [s.for_rank(r) for r in range(world)]
    runs = [set(m.rounds.tolist()) for m in mine]
    for row in range(len(s.sends.src)):  # both ends of a send run its round
        assert {int(s.sends.round[row])} <= runs[s.sends.src[row]] & runs[s.sends.dst[row]]
    counts, bufs, staged, peak, ops = {}, {}, defaultdict(int), {}, defaultdict(int)
    nb = s.pieces.bytes.tolist()

    def idx(pid, slot, off):
        nd = int(s.key_ndim[s.pieces.key[pid]])
        return ((int(slot),) if slot >= 0 else ()) + sl(zip(off[:nd], s.pieces.len[pid, :nd]))

    def view(v, pid):
        return np.array(src[int(s.views.rank[v])][int(s.views.param[v])][idx(pid, s.views.slot[v], s.views.off[v])])

    def deliver(row, data):
        r, p = int(s.deliveries.rank[row]), int(s.deliveries.param[row])
        i = idx(int(s.deliveries.piece[row]), s.deliveries.slot[row], s.deliveries.off[row])
        sink[r][p][i] = data
        counts.setdefault((r, p), np.zeros(np.shape(sink[r][p]), np.int64))[i] += 1

    def add(r, pid, data):
        assert (r, pid) not in bufs, f"rank {r} already holds piece {pid}"
        bufs[(r, pid)] = data
        staged[r] += nb[pid]

    dlv_at = [defaultdict(lambda: defaultdict(list)) for _ in range(world)]  # rank -> round -> pid -> rows
    last_use = [dict() for _ in range(world)]
    for r, m in enumerate(mine):
        for row, t in zip(m.deliveries.tolist(), m.delivery_rounds.tolist()):
            dlv_at[r][t][int(s.deliveries.piece[row])].append(row)
        out = m.sends[(s.sends.src[m.sends] == r) & (s.sends.view[m.sends] < 0)]
        for pid, t in zip(
            np.concatenate([s.sends.piece[out], s.deliveries.piece[m.deliveries]]).tolist(),
            np.concatenate([s.sends.round[out], m.delivery_rounds]).tolist(),
        ):
            last_use[r][pid] = max(last_use[r].get(pid, -1), t)
        local = [(pid, None) for pid in m.local_reads().tolist()]  # round -1: straight into place
        local += [(int(s.copies.piece[c]), int(s.copies.view[c])) for c in m.local_copies().tolist()]
        for (pid, v), row in ((x, row) for x in local for row in dlv_at[r][-1].get(x[0], [])):
            deliver(row, read(pid) if v is None else view(v, pid))
    at = defaultdict(list)  # (kind, round) -> rows
    for k, rounds in (("copy", s.copies.round), ("read", s.reads.round), ("send", s.sends.round)):
        for i, t in enumerate(rounds.tolist()):
            at[(k, t)].append(i)
    for t in range(s.num_rounds):
        for c in at[("copy", t)]:
            r, pid = int(s.views.rank[s.copies.view[c]]), int(s.copies.piece[c])
            if (r, pid) not in bufs:
                add(r, pid, view(int(s.copies.view[c]), pid))
        for i in at[("read", t)]:
            add(int(s.reads.rank[i]), int(s.reads.piece[i]), read(int(s.reads.piece[i])))
        data = []
        for row in at[("send", t)]:  # every send reads before any receive of the round lands
            r, pid, v = int(s.sends.src[row]), int(s.sends.piece[row]), int(s.sends.view[row])
            assert v >= 0 or (r, pid) in bufs, f"round {t}: rank {r} sends piece {pid} it does not hold"
            data.append(view(v, pid) if v >= 0 else bufs[(r, pid)].copy())
        for row, d in zip(at[("send", t)], data):
            add(int(s.sends.dst[row]), int(s.sends.piece[row]), d)
            ops[(int(s.sends.src[row]), t)] += 1
            ops[(int(s.sends.dst[row]), t)] += 1
        for r in (r for r in range(world) if t in runs[r]):
            peak[(r, t)] = staged[r]
            for pid, rows in dlv_at[r].get(t, {}).items():
                assert (r, pid) in bufs, f"round {t}: rank {r} delivers piece {pid} it does not hold"
                for row in rows:
                    deliver(row, bufs[(r, pid)])
        for key in [k for k in bufs if t in runs[k[0]] and last_use[k[0]].get(k[1], -1) <= t]:
            staged[key[0]] -= nb[key[1]]
            del bufs[key]
    assert not bufs, f"buffers never freed: {sorted(bufs)[:5]}"
    return counts, peak, ops


def composition(rng, n, k):
    """``k`` boxes ``(offset, length)`` tiling ``n`` (uneven shards; empty ones, as torch's
    chunking gives, when ``n < k`` or at random)."""
    if n >= k and rng.random() < 0.8:
        b = [0, *np.sort(rng.choice(np.arange(1, n), k - 1, replace=False)).tolist(), n] if k > 1 else [0, n]
    else:
        b = [0, *np.sort(rng.integers(0, n + 1, k - 1)).tolist(), n]
    return [(int(b[i]), int(b[i + 1] - b[i])) for i in range(k)]


def random_row(rng, slots, width, num_logical, empty):
    """A placement row: every expert once in ``slots``, the rest redundant or (``empty``) -1."""
    row, perm = np.full(width, -1), rng.permutation(slots)
    row[perm[:num_logical]] = rng.permutation(num_logical)
    rest = perm[num_logical:]
    row[rest] = np.where(rng.random(len(rest)) < empty, -1, rng.integers(0, num_logical, len(rest)))
    return row


SHAPES = [(6, 4), (4, 6), (5,), (3, 2, 3), (7,)]


def relocation_case(seed):
    rng = np.random.default_rng(seed)
    world = int(rng.choice([1, 2, 4, 6, 8]))
    topo = Topology(world, int(rng.choice([d for d in (1, 2, 3, 4, 8) if world % d == 0])))
    efsdp = int(rng.choice([d for d in (1, 2, 3) if world % d == 0]))
    ep, spr, outer = world // efsdp, int(rng.integers(1, 4)), bool(rng.integers(2))
    grank = (lambda e, f: f * ep + e) if outer else (lambda e, f: e * efsdp + f)
    num_physical, num_layers = spr * ep, int(rng.integers(1, 4))
    active = np.ones(world, bool)
    if world > 1 and rng.random() < 0.5:
        active[rng.choice(world, int(rng.integers(1, 3)), replace=False)] = False
    live_groups = [e for e in range(ep) if all(active[grank(e, f)] for f in range(efsdp))]
    if not live_groups:
        active[:], live_groups = True, list(range(ep))
    live = [s for s in range(num_physical) if s // spr in live_groups]
    num_logical = int(rng.integers(1, len(live) + 1))
    old = np.stack([random_row(rng, range(num_physical), num_physical, num_logical, 0.2) for _ in range(num_layers)])
    new = np.stack([random_row(rng, live, num_physical, num_logical, 0.2) for _ in range(num_layers)])
    for layer, s in product(range(num_layers), live):  # some slots keep their expert
        row, e = new[layer], old[layer, s]
        if rng.random() < 0.3 and e >= 0 and (row[s] < 0 or (row == row[s]).sum() > 1):
            row[s] = e
    tensors = []
    for layer in range(num_layers):
        whole = rng.random() < 0.2  # the whole layer on every efsdp rank, else tensor by tensor
        for k in rng.choice(len(SHAPES), int(rng.integers(2, 4)), replace=False).tolist():
            shape = SHAPES[k]
            # A tensor whole on every efsdp rank beside sharded ones: columns share its box.
            dim = -1 if whole or rng.random() < 0.2 else int(rng.integers(len(shape)))
            chunks = composition(rng, shape[max(dim, 0)], efsdp)
            holdings = tuple(
                (grank(e, f), e * spr, spr, tuple(chunks[f] if d == dim else (0, n) for d, n in enumerate(shape)))
                for e, f in product(range(ep), range(efsdp))
            )
            tensors.append(ExpertTensor(layer, f"l{layer}.{k}", shape, int(rng.choice([2, 4])), holdings))
    readers = rng.random(world) < 0.5
    readers[rng.choice(np.flatnonzero(active))] = True
    old = None if rng.random() < 0.05 else Placement(old, num_logical=num_logical, num_ranks=ep)  # initial fill
    return dict(
        tensors=tensors,
        old=old,
        new=Placement(new, num_logical=num_logical, num_ranks=ep),
        topology=topo,
        active=active,
        readers=readers,
        from_checkpoint=bool(rng.random() < 0.1),
        max_ops=int(rng.choice([2, 3, 8, 64])),
        staging_bytes=int(rng.choice([1, 6, 16, 40, 100, 10**6], p=[0.06, 0.1, 0.21, 0.21, 0.21, 0.21])),
    )


def check_relocation(case, seen):
    plan = plan_relocation(**case)
    s, tensors, active, new = plan.schedule, case["tensors"], case["active"], case["new"]
    old = np.full_like(new.phy2log, -1) if case["old"] is None else case["old"].phy2log
    truth = [
        1e6 * (t + 1)
        + np.arange(new.num_logical * math.prod(x.slice_shape), dtype=np.float64).reshape(
            new.num_logical, *x.slice_shape
        )
        for t, x in enumerate(tensors)
    ]  # distinct per (tensor, expert, element)
    local = defaultdict(dict)
    for t, x in enumerate(tensors):
        for r, s0, ns, box in x.holdings:
            local[r][t] = a = np.full((ns, *(n for _, n in box)), np.nan)
            for i in range(ns):
                if old[x.layer, s0 + i] >= 0 and active[r]:  # a dead rank's memory is lost
                    a[i] = truth[t][(old[x.layer, s0 + i], *sl(box))]
    for ranks in (s.reads.rank, s.sends.src, s.sends.dst, s.views.rank, s.deliveries.rank):
        assert active[ranks].all()
    assert case["readers"][s.reads.rank].all()

    def read(pid):  # the checkpoint: the logical expert's true data
        box = zip(s.pieces.off[pid, : s.key_ndim[s.pieces.key[pid]]], s.pieces.len[pid])
        return truth[int(s.pieces.key[pid])][sl(box)]

    counts, staged, ops = simulate(s, local, read=read)
    check_rank_plans(case, plan)
    for t, x in enumerate(tensors):
        for r, s0, ns, box in x.holdings:
            got = counts.get((r, t), np.zeros(local[r][t].shape, np.int64))
            for i in range(ns if active[r] else 0):
                e, was = new.phy2log[x.layer, s0 + i], old[x.layer, s0 + i]
                where = f"rank {r} {x.name} slot {s0 + i} (expert {was} -> {e})"
                assert (got[i] == int(e >= 0 and e != was)).all(), f"{where}: written {got[i].max()}x"
                if e >= 0:
                    assert np.array_equal(local[r][t][i], truth[t][(e, *sl(box))]), where
    # Budgets per rank and round; ops above max_ops only from one move's fan-out.
    budget, moves_in = (
        case.get("staging_bytes", DEFAULT_STAGING_BYTES),
        [plan.rounds[t // 2].moves for t in range(s.num_rounds)],
    )
    big = 4 * max((m.nbytes for m in plan.moves), default=0) > budget  # parts above a quarter of it
    for (r, t), b in staged.items():
        assert b <= plan.cost.peak_staging_bytes[r] and (b <= budget or big), (r, t, b, budget)
    for (r, t), n in ops.items():
        links = [
            [(a, b) for a, _, b in plan.moves[i].sends] if t % 2 == 0 else plan.moves[i].relays for i in moves_in[t]
        ]
        assert n <= case.get("max_ops", 64) or sum(any(r in x for x in lk) for lk in links) == 1, (r, t, n)
    node = case["topology"].nodes_array()
    for k, v in dict(
        stashes=len(plan.stashes),
        relays=(s.sends.round % 2).sum(),
        reads=len(s.reads.rank),
        cross_node=(node[s.sends.src] != node[s.sends.dst]).sum(),
        dead=not active.all(),
        components=plan.num_components > 1,
    ).items():
        seen[k] += int(v)
    return staged


def check_rank_plans(case, plan):
    """What each rank plans for itself (its component only) is the job's plan: the same rows
    in the same order, fingerprint and disk experts; the components' counters add up to the
    job's (:func:`job_summary`)."""
    s, world = plan.schedule, plan.topology.world_size
    table = np.zeros((plan.num_components, len(COUNTERS)), np.int64)
    for r in range(world):
        mine = plan_relocation(**case, rank=r)
        assert mine.fingerprint == plan.fingerprint and mine.disk_experts == plan.disk_experts, r
        assert np.array_equal(mine.component, plan.component) and mine.rank == r
        own = mine.schedule_for(r)
        assert own.fingerprint == plan.fingerprint, r
        assert rank_rows(own, r) == rank_rows(s, r), f"rank {r}"
        assert rank_rows(plan.schedule_for(r), r) == rank_rows(s, r), f"rank {r} (from the job's plan)"
        comp = plan.component[r]
        assert all(plan.component[q] == comp for m in mine.moves for q in m.ranks()), r
        if comp >= 0:
            if table[comp].any():
                assert np.array_equal(table[comp], mine.cost.counters()), r  # a component plans alike on its ranks
            table[comp] = mine.cost.counters()
        else:
            assert not mine.moves and not plan.schedule_for(r).sends.src.size, r
    assert job_summary(table) == plan.cost.summary()
    return plan.num_components


def rank_rows(s, rank):
    """What ``rank`` runs of schedule ``s``, with pieces and views spelled out (ids differ
    between a rank's own schedule and the job's): its reads, copies and sends in schedule
    order (the order both ends of a send post it in), its deliveries as a sorted list."""
    m = s.for_rank(rank)

    def piece(pid):
        nd = int(s.key_ndim[s.pieces.key[pid]])
        return int(s.pieces.key[pid]), s.pieces.off[pid, :nd].tolist(), s.pieces.len[pid, :nd].tolist()

    def view(v):
        return int(s.views.rank[v]), int(s.views.param[v]), int(s.views.slot[v]), s.views.off[v].tolist()

    return dict(
        reads=[(int(s.reads.round[i]), piece(s.reads.piece[i])) for i in m.reads],
        copies=[(int(s.copies.round[i]), view(s.copies.view[i]), piece(s.copies.piece[i])) for i in m.copies],
        sends=[
            (
                int(s.sends.round[i]),
                int(s.sends.src[i]),
                int(s.sends.dst[i]),
                piece(s.sends.piece[i]),
                view(s.sends.view[i]) if s.sends.src[i] == rank and s.sends.view[i] >= 0 else None,
            )
            for i in m.sends
        ],
        deliveries=sorted(
            (
                int(t),
                piece(s.deliveries.piece[i]),
                int(s.deliveries.param[i]),
                int(s.deliveries.slot[i]),
                s.deliveries.off[i].tolist(),
            )
            for i, t in zip(m.deliveries, m.delivery_rounds)
        ),
        rounds=m.rounds.tolist(),
    )


def test_relocation_schedules_simulated():
    seen = defaultdict(int)
    for seed in range(200):
        try:
            check_relocation(relocation_case(seed), seen)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
    assert min(seen.values()) > 0, dict(seen)


def one_layer(boxes, slots, old, new, lws, **kw):
    """A one-layer case: tensor ``t``'s ``boxes[t][r]`` on rank ``r``, which holds ``slots[r]``."""
    tensors = [
        ExpertTensor(
            0, f"t{t}", (max(o + n for ((o, n),) in bs),), 4, tuple((r, *slots[r], b) for r, b in enumerate(bs))
        )
        for t, bs in enumerate(boxes)
    ]
    kw = {"active": np.ones(len(slots), bool), "readers": np.zeros(len(slots), bool), **kw}
    return dict(
        tensors=tensors,
        old=Placement(np.array([old])),
        new=Placement(np.array([new])),
        topology=Topology(len(slots), lws),
        **kw,
    )


def regression(case, what_broke: str, name: str):
    """A case that once failed (``what_broke`` says how: it stays here as the record)."""
    return pytest.param(case, id=name)


@pytest.mark.parametrize(
    "case",
    [
        # EP=2 x efsdp=2 on one node (rank = 2 * ep_rank + f): A split in halves, B whole on both efsdp
        # ranks. Expert 1 lives only on EP rank 1, whose rank 3 died; rank 0 is the only reader.
        regression(
            one_layer(
                [[((r % 2 * 2, 2),) for r in range(4)], [((0, 3),)] * 4],
                [(0, 2), (0, 2), (2, 2), (2, 2)],
                [0, 0, 1, 1],
                [0, 1, -1, -1],
                4,
                active=np.array([1, 1, 1, 0], bool),
                readers=np.array([1, 0, 0, 0], bool),
            ),
            "pieces are keyed (tensor, expert, box), shared by columns with the same box of a tensor: rank 0 reads "
            "piece 1 for rank 1 and receives it from rank 2 in one round; the runner (one buffer per piece) then "
            "sends the buffer it is receiving into",
            "columns_sharing_a_box",
        ),
        # EP=1 x efsdp=4, torch.chunk-like: A (3,) leaves rank 3 an empty box, B (8,) gives it 2 elements.
        regression(
            one_layer(
                [[((min(r, 3), int(r < 3)),) for r in range(4)], [((2 * r, 2),) for r in range(4)]],
                [(0, 2)] * 4,
                [0, 1],
                [1, 0],
                4,
            ),
            "_columns drops a rank from the layer when one of its tensors' boxes is empty, so its other tensors' "
            "boxes are never relocated",
            "rank_with_an_empty_box",
        ),
    ],
)
def test_relocation_regressions(case):
    assert max(check_relocation(case, defaultdict(int)).values()) <= case.get("staging_bytes", 2**60)


def check_written(sink, counts, truth, writers):
    """Each tensor is on its writer, every element written once, nothing anywhere else."""
    for t, want in enumerate(truth):
        w = writers[t]
        assert np.array_equal(sink[w][t], want) and (counts[(w, t)] == 1).all(), f"tensor {t} on its writer {w}"
    assert set(counts) == {(writers[t], t) for t in range(len(truth))}


def save_case(seed):
    """Random dense parameters (replicated, FSDP, HSDP, uneven or empty shards) and fused expert
    parameters (EP x efsdp, gate/up parts) described by :func:`describe_outputs`."""
    rng = np.random.default_rng(seed)
    world = int(rng.integers(1, 7))
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    descs, full = [], []
    for t in range(int(rng.integers(1, 5))):
        shape, rep = tuple(int(n) for n in rng.integers(1, 7, int(rng.integers(0, 4)))), int(rng.choice(divisors))
        mesh, pl = (
            (None, ())
            if not shape or rng.random() < 0.2
            else (rng.permutation(world).reshape(rep, world // rep), (None, int(rng.integers(len(shape)))))
        )
        descs.append(ParamDesc(f"p{t}", shape, [torch.float32, torch.bfloat16][t % 2], mesh, pl, keys=(f"p{t}",)))
        full.append(t * 1e4 + np.arange(math.prod(shape), dtype=np.float64).reshape(shape))
    efsdp = int(rng.choice([d for d in divisors if d <= 3]))
    ep, spr, h, w = world // efsdp, int(rng.integers(1, 4)), int(rng.integers(1, 5)), int(rng.integers(1, 6))
    num_logical = int(rng.integers(1, ep * spr + 1))
    phy2log = random_row(rng, range(ep * spr), ep * spr, num_logical, 0.3)
    for k, (parts, shape) in enumerate([(("{e}.gate", "{e}.up"), (2 * h, w)), (("{e}.down",), (w, h))]):
        expert = ExpertRef(0, "experts", ExpertParam(f"w{k}", parts, 0))
        descs.append(
            ParamDesc(
                f"w{k}",
                (ep * spr, *shape),
                torch.float32,
                rng.permutation(world).reshape(ep, efsdp),
                (0, 1 + int(rng.integers(2))),
                expert=expert,
            )
        )
        fused = 1e7 * (k + 1) + np.arange(num_logical * math.prod(shape), dtype=np.float64).reshape(num_logical, *shape)
        full.append(np.where((phy2log >= 0)[:, None, None], fused[phy2log], np.nan))
    local = defaultdict(dict)  # every rank's box of every parameter
    for i, d in enumerate(descs):
        for r, box in rank_boxes(d, world):
            local[r][i] = full[i][sl(box)]
    return describe_outputs(descs, Placement(phy2log[None], num_logical=num_logical), world), local, world, rng


def test_save_schedules_simulated():
    for seed in range(120):
        outs, local, world, rng = save_case(seed)
        truth = []  # each tensor assembled from every holder's segments (replicas agree, no gap)
        for o in outs:
            truth.append(np.full(o.shape, np.nan))
            for g in o.segments:
                data = local[g.rank][g.param][sl(g.local_box(g.box))]
                data, into = data.reshape(data.shape[len(g.lead) :]), sl(g.box)
                assert np.isnan(truth[-1][into]).all() or np.array_equal(truth[-1][into], data), o.key
                truth[-1][into] = data
            assert not np.isnan(truth[-1]).any(), o.key
        budget, max_ops = int(rng.choice([8, 24, 64, 10**6])), int(rng.choice([2, 3, 64]))
        plan = plan_save(outs, world, int(rng.choice([16, 200, 10**6])), budget, max_ops)
        sink = {r: [np.full(o.shape, np.nan) for o in outs] for r in range(world)}
        counts, staged, ops = simulate(plan.schedule, local, sink)
        check_written(sink, counts, truth, [t.writer for t in plan.tensors])
        for (r, t), b in staged.items():
            assert b <= min(budget, plan.cost.peak_staging_bytes[r]), (seed, r, t, b)
        assert max(ops.values(), default=0) <= max_ops, seed
        for r in range(world):  # what a rank runs (save uses schedule_for) is its rows of the job's schedule
            own = plan.schedule_for(r)
            assert own.rank == r and own.fingerprint == plan.fingerprint and own.cost is not None, seed
            assert rank_rows(own, r) == rank_rows(plan.schedule, r), (seed, r)
            assert set(own.deliveries.rank.tolist()) <= {r}, seed
            assert len(own.pieces.key) <= len(plan.schedule.pieces.key), seed
        with pytest.raises(ValueError, match="outside"):
            plan.schedule_for(world)


def held_boxes(segments: list, ndim: int) -> HeldBoxes:
    """``(rank, local, local box, box)`` tuples as :class:`HeldBoxes` columns."""

    def column(j: int, k: int) -> np.ndarray:
        return np.asarray([[d[k] for d in seg[j]] for seg in segments], np.int64).reshape(len(segments), ndim)

    return HeldBoxes(np.asarray([seg[0] for seg in segments], np.int64), column(2, 0), column(3, 0), column(3, 1))


def test_tensor_schedules_simulated():
    for seed in range(150):
        rng = np.random.default_rng(seed)
        world, num = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        shapes = [tuple(int(x) for x in rng.integers(1, 6, int(rng.integers(0, 4)))) for _ in range(num)]
        itemsizes = [int(rng.choice([2, 4])) for _ in range(num)]
        local, truth, segments = defaultdict(dict), [], []
        for t, sh in enumerate(shapes):  # a random grid of boxes, each in one rank's local tensor t at box + pad
            truth.append(t * 1e4 + np.arange(math.prod(sh), dtype=np.float64).reshape(sh))
            mine = defaultdict(list)
            for box in product(*[composition(rng, n, int(rng.integers(1, min(n, 3) + 1))) for n in sh]):
                mine[int(rng.integers(world))].append(box)
            segments.append([])
            for r, boxes in mine.items():
                pad = tuple(int(x) for x in rng.integers(0, 3, len(sh)))
                local[r][t] = np.full(tuple(n + q for n, q in zip(sh, pad)), np.nan)
                for box in boxes:
                    lbox = tuple((o + q, n) for (o, n), q in zip(box, pad))
                    local[r][t][sl(lbox)] = truth[t][sl(box)]
                    segments[-1].append((r, t, lbox, box))
        writers, budget = rng.integers(world, size=num).tolist(), int(rng.choice([1, 32, 100, 10**6]))
        held = [held_boxes(segs, len(sh)) for segs, sh in zip(segments, shapes)]
        keys = [f"t{t}" for t in range(num)]
        s = tensor_schedule(keys, shapes, itemsizes, held, writers, world, budget)
        prints = set()
        for r in range(world):  # a rank's own schedule (what save_adapter runs) is its rows of the job's
            own = tensor_schedule(keys, shapes, itemsizes, iter(held), writers, world, budget, rank=r)
            assert own.rank == r and rank_rows(own, r) == rank_rows(s, r), (seed, r)
            assert own.cost.summary() == s.cost.summary() and own.num_rounds == s.num_rounds, (seed, r)
            prints.add(own.fingerprint)
        assert len(prints) == 1, seed  # every rank agrees on the schedule it runs a part of
        t = next((t for t, h in enumerate(held) if h.off.size), None)
        if t is not None:  # ... and the fingerprint sees the boxes: one offset moved, another one
            moved = list(held)
            moved[t] = held[t]._replace(off=held[t].off + (np.arange(held[t].off.size) == 0).reshape(held[t].off.shape))
            assert (
                tensor_schedule(keys, shapes, itemsizes, moved, writers, world, budget, rank=0).fingerprint
                not in prints
            ), seed
        sink = {r: [np.full(sh, np.nan) for sh in shapes] for r in range(world)}
        counts, staged, _ = simulate(s, local, sink)
        check_written(sink, counts, truth, writers)
        peak = [max((b for (q, _), b in staged.items() if q == r), default=0) for r in range(world)]
        biggest = max(math.prod(sh) * i for sh, i in zip(shapes, itemsizes))
        assert peak == s.cost.peak_staging_bytes.tolist() and max(peak) <= max(budget, biggest), seed
