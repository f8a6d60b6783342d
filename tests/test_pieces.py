"""Tier 1: the numpy helpers of the planners (packed row codes, lexicographic orders, ranks of
distinct rows), the staging peak against a brute force, and :class:`Pieces`: planning every
storage mode from one cut of the needs gives the plans and lower bounds the needs give."""

from __future__ import annotations

import numpy as np
import pytest
from test_plan import build_case

from moeshard.io.sources import storage_sources
from moeshard.models.layout import need_table
from moeshard.plan import Pieces, cut_pieces, minimal_cost, plan_transfers
from moeshard.plan.arrays import dense_rank, group_rows, lex_order, pack_rows, unique_rows
from moeshard.plan.load import _peak
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
        assert np.array_equal(_peak(world, num_rounds, num, iter(holds)), _brute_peak(world, num_rounds, holds))


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
