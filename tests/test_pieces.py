"""Tier 1: the numpy helpers of the planners (packed row codes, lexicographic orders, ranks of
distinct rows), the staging peak against a brute force, and :class:`Pieces`: planning every
storage mode from one cut of the needs gives the plans and lower bounds the needs give."""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest
from test_plan import build_case

from moeshard.io.sources import storage_sources
from moeshard.models.layout import need_table
from moeshard.plan import Pieces, cut_pieces, minimal_cost, plan_transfers
from moeshard.plan.arrays import dense_rank, group_rows, lex_order, pack_rows, unique_rows
from moeshard.plan.load import no_transfers, peak_held_bytes, plan_pieces
from moeshard.topology import Topology


def _random_columns(rng, n: int, k: int, wide: bool) -> list[np.ndarray]:
    cols = [rng.integers(-3, 4, n).astype(rng.choice([np.int8, np.int32, np.int64])) for _ in range(k)]
    if wide:  # ranges whose product does not fit in 63 bits: the lexsort fallback
        cols.append(rng.integers(-2**62, 2**62, n))
    return cols


@pytest.mark.parametrize("wide", [False, True])
def test_orders_and_ranks_match_numpy(wide):
    rng = np.random.default_rng(int(wide))
    for _ in range(300):
        n, k = int(rng.integers(0, 40)), int(rng.integers(1, 5))
        cols = _random_columns(rng, n, k, wide)
        want = np.lexsort(cols[::-1])
        assert np.array_equal(lex_order(*cols), want)
        order, start = group_rows(*cols)
        assert np.array_equal(order, want)
        rows = np.stack(cols, axis=1) if n else np.zeros((0, len(cols)), np.int64)
        distinct, inverse = np.unique(rows, axis=0, return_inverse=True)
        assert start.sum() == len(distinct)
        rank, count = dense_rank(*cols)
        assert count == len(distinct) and np.array_equal(rank, inverse.reshape(-1))
        code = pack_rows(*cols)
        if code is not None:  # equal for equal rows, ordered as the rows
            assert np.array_equal(np.argsort(code, kind="stable"), want)
            assert len(np.unique(code)) == len(distinct)
        if n and not wide:
            got_rows, got_inv = unique_rows(rows.astype(np.int64))
            assert np.array_equal(got_rows, distinct) and np.array_equal(got_inv, inverse.reshape(-1))


def test_pack_rows_gives_up_beyond_63_bits():
    big = np.array([0, 2**40], dtype=np.int64)
    small = np.array([5, -5], dtype=np.int32)
    assert pack_rows(big, small) is not None  # spans 2**40 + 1 and 11
    assert pack_rows(big, big) is None  # (2**40 + 1)**2 > 2**63
    assert np.array_equal(lex_order(big, big[::-1], small), np.lexsort((small, big[::-1], big)))


def _brute_peak(world, num_rounds, holds):
    out = np.zeros(world, dtype=np.int64)
    for r in range(world):
        for t in range(num_rounds):
            held = sum(int(b) for rank, nb, first, last in holds
                       for rr, b, a, e in zip(rank, nb, first, last) if rr == r and a <= t <= e)
            out[r] = max(out[r], held)
    return out


def test_staging_peak_matches_brute_force():
    rng = np.random.default_rng(3)
    for _ in range(200):
        world, num_rounds = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        holds = []
        for _ in range(int(rng.integers(0, 4))):
            m = int(rng.integers(0, 8))
            first = rng.integers(0, num_rounds, m)
            last = np.minimum(first + rng.integers(0, 3, m), num_rounds - 1)
            holds.append((rng.integers(0, world, m).astype(rng.choice([np.int32, np.int64])),
                          rng.integers(0, 5, m) * 8, first, last))
        num = sum(len(h[0]) for h in holds)
        assert np.array_equal(peak_held_bytes(world, num_rounds, num, iter(holds)), _brute_peak(world, num_rounds, holds))


@pytest.mark.parametrize("world, lws, ep, efsdp, staging", [(8, 4, 4, 2, 1 << 20), (16, 4, 8, 2, 200), (12, 3, 6, 2, 60)])
def test_plans_from_pieces_are_the_plans_from_needs(world, lws, ep, efsdp, staging):
    case = build_case(world, lws, ep, efsdp, seed=world + staging)
    table = need_table(case.descs, case.index, case.placement, world)
    topo = Topology(world, lws)
    pieces = cut_pieces(table, case.index, staging)
    assert isinstance(pieces, Pieces) and pieces.num_needs == len(table)
    # Every need is met by the deliveries of its pieces; the pieces' bytes are the needs' bytes.
    assert len(pieces.dlv_piece) >= len(table)
    for mode in ("shared", "node", "single"):
        _, readers, scope = storage_sources(mode, np.ones(world, dtype=bool), topo)
        want = plan_transfers(table, case.index, topo, readers, scope=scope, staging_bytes=staging)
        got = plan_transfers(pieces, case.index, topo, readers, scope=scope, staging_bytes=staging)
        assert got.fingerprint == want.fingerprint
        bounds = minimal_cost(table, case.index, topo, readers, scope)
        # Cut pieces give the bounds of uncut ones (a piece's parts share its needers).
        assert minimal_cost(pieces, case.index, topo, readers, scope) == bounds
        assert minimal_cost(cut_pieces(table, case.index, None), case.index, topo, readers, scope) == bounds
    with pytest.raises(ValueError, match=f"cut for a staging budget of {staging} bytes, not {staging + 1}"):
        plan_transfers(pieces, case.index, topo, np.ones(world, dtype=bool), staging_bytes=staging + 1)


def _rank_rows(plan, rank: int) -> tuple:
    """Rank ``rank``'s rows of ``plan`` with pieces named by (key, box), not by number."""
    rs = plan.for_rank(rank)

    def name(p) -> tuple:
        nd = int(plan.key_ndim[plan.piece_key[p]])
        off, ln = plan.piece_off[p, :nd].tolist(), plan.piece_len[p, :nd].tolist()
        return plan.keys[plan.piece_key[p]], tuple(off), tuple(ln)

    def rows(piece, *cols) -> list:
        return [(name(p), *(int(c[i]) for c in cols)) for i, p in enumerate(piece.tolist())]

    dlv, sends, bcasts = rs.deliveries, rs.sends, rs.bcasts
    delivered = rows(plan.dlv_piece[dlv], plan.dlv_param[dlv], plan.dlv_slot[dlv])
    return (sorted(rows(plan.read_piece[rs.reads], plan.read_round[rs.reads])),
            rows(plan.send_piece[sends], plan.send_src[sends], plan.send_dst[sends], plan.send_round[sends]),
            rows(plan.bcast_piece[bcasts], plan.bcast_node[bcasts], plan.bcast_root[bcasts], plan.bcast_round[bcasts]),
            sorted((*r, tuple(off)) for r, off in zip(delivered, plan.dlv_off[dlv].tolist())),
            rs.rounds.tolist())


@pytest.mark.parametrize("world, lws, ep, efsdp, experts, dense, num_logical", [
    (8, 4, 4, 2, "shard", ("shard", "replicate", "plain"), 4),
    (8, 4, 8, 1, "shard", ("shard",), 16),  # one slot per expert: every row alone, only local reads
    (12, 3, 6, 2, "replicate", ("shard", "plain"), 4),
    (8, 2, 2, 4, "shard", ("replicate",), 3),
])
def test_a_schedule_planned_for_one_rank_has_that_ranks_rows_of_the_whole_jobs(world, lws, ep, efsdp, experts,
                                                                                 dense, num_logical):
    """``plan_transfers(rank=r)`` plans the transfers and rank r's local reads only; r's rows
    (reads, sends, broadcasts, deliveries, rounds), every cost counter and the number of rounds
    are the whole job's, every rank's fingerprint is the same, and it refuses another rank."""
    case = build_case(world, lws, ep, efsdp, seed=world + ep, expert_placements=experts, dense=dense,
                      num_logical=num_logical)
    table = need_table(case.descs, case.index, case.placement, world)
    assert table.alone is not None and table.alone.any()
    assert table.alone.all() == (num_logical == 16)
    itemsize = np.asarray([case.index.info(k).itemsize for k in table.keys])
    row_bytes = table.src_len.prod(axis=1) * itemsize[table.key]
    topo = Topology(world, lws)
    for staging in (1 << 20, 60):
        for mode, mask in (("shared", None), ("node", None), ("single", None), ("auto", np.arange(world) % 2 == 0)):
            _, readers, scope = storage_sources(mode, np.ones(world, bool) if mask is None else mask, topo)
            whole = plan_transfers(table, case.index, topo, readers, scope=scope, staging_bytes=staging)
            fingerprints = set()
            for r in range(world):
                got = plan_transfers(table, case.index, topo, readers, scope=scope, staging_bytes=staging, rank=r)
                assert got.rank == r and _rank_rows(got, r) == _rank_rows(whole, r), (staging, mode, r)
                # A table built for rank r's plan (what load builds) gives the same schedule.
                keep = ~readers
                keep[r] = True
                part = need_table(case.descs, case.index, case.placement, world, keep_ranks=keep)
                assert len(part) <= len(table) and part.digest == table.digest
                again = plan_transfers(part, case.index, topo, readers, scope=scope, staging_bytes=staging, rank=r)
                assert _rank_rows(again, r) == _rank_rows(got, r) and again.fingerprint == got.fingerprint
                assert again.cost.summary() == got.cost.summary()
                assert got.num_rounds == whole.num_rounds and got.cost.summary() == whole.cost.summary()
                for f in ("read_bytes", "sent_bytes", "recv_bytes", "peak_staging_bytes"):
                    assert np.array_equal(getattr(got.cost, f), getattr(whole.cost, f)), f
                # Other ranks' local reads are planned only for rows not alone: the whole job's
                # but the bytes of the alone rows of other ranks that read.
                def others_local(plan):
                    rows = (plan.read_rank != r) & (plan.read_round < 0)
                    return int(plan.piece_bytes[plan.read_piece[rows]].sum())

                dropped = table.alone & (table.rank != r) & readers[table.rank]
                assert others_local(got) == others_local(whole) - int(row_bytes[dropped].sum())
                fingerprints.add(got.fingerprint)
            assert len(fingerprints) == 1
            with pytest.raises(ValueError, match=f"planned for rank {world - 1} only, not rank 0"):
                got.for_rank(0)
    # Without the hint (needs given as rows) the whole job is planned: the same rows again.
    rows = table.to_needs()
    got = plan_transfers(rows, case.index, topo, np.ones(world, bool), rank=1)
    assert _rank_rows(got, 1) == _rank_rows(plan_transfers(rows, case.index, topo, np.ones(world, bool)), 1)


@pytest.mark.parametrize("world, lws, scope", [(8, 4, "job"), (8, 4, "node"), (6, 3, "job"), (1, 1, "job")])
def test_a_plan_without_transfers_is_the_planners_plan_of_no_pieces(world, lws, scope):
    """The shortcut a rank takes when all its needs are local reads is what the planner makes
    of no pieces: every array (values, dtypes, shapes), the counters and the fingerprint."""
    case = build_case(world, lws, world, 1, seed=5, num_logical=2 * world, dense=("shard",))
    table = need_table(case.descs, case.index, case.placement, world)
    topo = Topology(world, lws)
    for staging, max_ops in ((1 << 20, 64), (60, 2)):
        slow = plan_pieces(cut_pieces(table.take(np.zeros(len(table), bool)), case.index, staging), topo,
                     np.ones(world, bool), scope, staging, max_ops, base_load=np.arange(world, dtype=np.int64))
        fast = no_transfers(table, topo, staging, max_ops)
        for f in dataclasses.fields(slow):
            a, b = getattr(slow, f.name), getattr(fast, f.name)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f.name
            elif f.name == "cost":
                for g in dataclasses.fields(a):
                    x, y = getattr(a, g.name), getattr(b, g.name)
                    assert (np.array_equal(x, y) and x.dtype == y.dtype) if isinstance(x, np.ndarray) else x == y, g.name
            else:
                assert a == b, f.name
        assert fast.fingerprint == slow.fingerprint


def test_alone_rows_are_those_no_other_rank_shares():
    """The layout's ``alone`` hint is never wrong: an alone row's (key, box) is no other rank's
    (it may miss some: then the whole job plans them, as before)."""
    for world, lws, ep, efsdp, experts, dense in [(8, 4, 4, 2, "shard", ("shard", "replicate", "plain")),
                                                  (12, 3, 6, 2, "replicate", ("shard",)),
                                                  (1, 1, 1, 1, "shard", ("plain",))]:
        for num_logical in (3, 2 * ep):
            case = build_case(world, lws, ep, efsdp, seed=3, expert_placements=experts, dense=dense,
                              num_logical=num_logical)
            table = need_table(case.descs, case.index, case.placement, world)
            holders: dict = {}
            for i in range(len(table)):
                holders.setdefault((int(table.key[i]), table.src_off[i].tobytes(), table.src_len[i].tobytes()),
                                   set()).add(int(table.rank[i]))
            shared = np.asarray([len(holders[(int(table.key[i]), table.src_off[i].tobytes(),
                                              table.src_len[i].tobytes())]) > 1 for i in range(len(table))])
            assert not (table.alone & shared).any()
            if num_logical == 2 * ep and experts == "shard":  # one slot per expert: it finds every one
                assert np.array_equal(table.alone, ~shared)


def test_ranks_with_different_needs_get_different_fingerprints():
    """A schedule planned for one rank is compared by a fingerprint that covers every rank's
    needs, not only the transfers: two experts swapped between ranks (the same bytes per rank,
    no transfer either way) change it on every rank."""
    case = build_case(8, 4, 8, 1, seed=2, num_logical=16, dense=("shard",))
    pl = case.placement
    swapped = pl.phy2log.copy()
    swapped[0, [0, 2]] = swapped[0, [2, 0]]  # slot 0 (rank 0) and slot 2 (rank 1) trade experts
    other = type(pl)(swapped, num_logical=pl.num_logical, num_ranks=pl.num_ranks)
    topo = Topology(8, 4)
    plans = [plan_transfers(need_table(case.descs, case.index, p, 8), case.index, topo, np.ones(8, bool), rank=5)
             for p in (pl, other)]
    assert not len(plans[0].send_src) and not len(plans[1].send_src)
    assert np.array_equal(plans[0].cost.read_bytes, plans[1].cost.read_bytes)
    assert plans[0].fingerprint != plans[1].fingerprint


def test_a_table_built_for_one_rank_is_planned_for_that_rank_only():
    """``need_table(keep_ranks=)`` leaves out other ranks' alone needs (counted in bytes): it is
    refused for the whole job, for another rank, for lower bounds, and where a rank that cannot
    read lost needs."""
    case = build_case(8, 4, 8, 1, seed=4, num_logical=16, dense=("shard", "plain"))
    topo = Topology(8, 4)
    table = need_table(case.descs, case.index, case.placement, 8)
    keep = np.zeros(8, dtype=bool)
    keep[2] = True
    part = need_table(case.descs, case.index, case.placement, 8, keep_ranks=keep)
    itemsize = np.asarray([case.index.info(k).itemsize for k in table.keys])
    row_bytes = table.src_len.prod(axis=1) * itemsize[table.key]
    left_out = table.alone & (table.rank != 2)
    assert len(part) == len(table) - left_out.sum() and set(part.rank[part.alone].tolist()) == {2}
    assert np.array_equal(part.omitted_bytes, np.bincount(table.rank[left_out], weights=row_bytes[left_out],
                                                          minlength=8).astype(np.int64))
    everyone = np.ones(8, dtype=bool)
    plan_transfers(part, case.index, topo, everyone, rank=2)
    with pytest.raises(ValueError, match="cannot be planned for the whole job"):
        plan_transfers(part, case.index, topo, everyone)
    with pytest.raises(ValueError, match="cannot be planned for rank 3"):
        plan_transfers(part, case.index, topo, everyone, rank=3)
    with pytest.raises(ValueError, match=r"lacks some needs of ranks \[5\], which cannot read"):
        plan_transfers(part, case.index, topo, np.arange(8) != 5, rank=2)
    with pytest.raises(ValueError, match="lower bounds need every rank's needs"):
        minimal_cost(part, case.index, topo, everyone)
    # Large tables leave rows out part by part, small ones with one mask: the same table.
    from moeshard.plan import needs as needs_module

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(needs_module, "_FILTER_PARTS_ABOVE", 0)
        by_part = need_table(case.descs, case.index, case.placement, 8, keep_ranks=keep)
    for f in ("rank", "param", "key", "slot", "src_off", "src_len", "dst_off", "alone", "full", "omitted_bytes"):
        assert np.array_equal(getattr(by_part, f), getattr(part, f)), f
    assert by_part.keys == part.keys and by_part.digest == part.digest
    with pytest.raises(ValueError, match="keep_ranks must be bool\\[8\\]"):
        need_table(case.descs, case.index, case.placement, 8, keep_ranks=keep[:4])


def test_expert_rows_left_out_unbuilt_are_those_concat_leaves_out(monkeypatch):
    """An expert parameter with many slots' rows does not build other ranks' alone rows (counted
    as elements times the item size); the table is the one built with every row and filtered by
    concat. Where two parameters read the same expert tensors (tied), its rows are built after
    all (they are not alone), and every row of those keys stays."""
    import dataclasses as dc

    from moeshard.models import layout

    monkeypatch.setattr(layout, "_UNBUILT_ABOVE", 0)  # however few the rows (as at scale)
    case = build_case(8, 4, 4, 2, seed=6, num_logical=8)
    keep = np.zeros(8, dtype=bool)
    keep[[1, 6]] = True
    part = need_table(case.descs, case.index, case.placement, 8, keep_ranks=keep)
    assert part.omitted_bytes is not None and part.omitted_bytes.sum() > 0
    whole_rows = need_table(case.descs, case.index, case.placement, 8, keep_ranks=keep, _experts_whole=True)
    for f in ("rank", "param", "key", "slot", "src_off", "src_len", "dst_off", "alone", "full", "omitted_bytes"):
        assert np.array_equal(getattr(part, f), getattr(whole_rows, f)), f
    assert part.keys == whole_rows.keys
    first_expert = next(i for i, d in enumerate(case.descs) if d.expert is not None)
    tied = [*case.descs, dc.replace(case.descs[first_expert], name="tied.gate_up_proj")]
    table = need_table(tied, case.index, case.placement, 8)
    got = need_table(tied, case.index, case.placement, 8, keep_ranks=keep)
    tied_keys = {table.keys[k] for k in table.key[table.param == len(tied) - 1].tolist()}
    tied_ids = [got.keys.index(k) for k in tied_keys]
    all_ids = [table.keys.index(k) for k in tied_keys]
    assert tied_keys and np.isin(got.key, tied_ids).sum() == np.isin(table.key, all_ids).sum()
    assert not got.alone[np.isin(got.key, tied_ids)].any()
