"""Tier 1: the oblivious policy at the optimum of small instances (the joint search over replica
counts and placement), checked against the exact solver (``benchmarks/eplb_exact.py``, HiGHS,
with moeshard's rule: no two copies of an expert on a rank when avoidable)."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard import Placement, eplb

FLASHLB = np.array([[600, 560, 120, 120, 20, 10, 10, 10]], dtype=float)


def test_flashlb_example_at_the_optimum():
    # FlashLB's published example (vllm-ascend #3042): the reference puts 232 on the busiest
    # rank, FlashLB 205; the optimum is 196.7 (counts [4, 3, 1, 3, 1, 1, 1, 2] or alike)
    pl = eplb.rebalance(FLASHLB, num_physical=16, num_ranks=8, migration_aware=False)
    assert eplb.rank_loads(FLASHLB, pl, 8).max() == pytest.approx(560 / 3 + 10)
    ref = eplb.reference(FLASHLB, num_physical=16, num_ranks=8)
    assert eplb.rank_loads(FLASHLB, ref, 8).max() == pytest.approx(232)
    assert (pl.logcnt >= 1).all() and pl.logcnt.sum() == 16
    # no rank holds two copies of one expert
    p2l = pl.phy2log.reshape(8, 2)
    assert (p2l[:, 0] != p2l[:, 1]).all()


def _instances(num: int, seed: int):
    """Seeded small shapes: two slots per rank on 3-8 ranks, up to 10 experts, or three slots
    per rank on 3 ranks; Zipf-like loads."""
    rng = np.random.default_rng(seed)
    for i in range(num):
        ranks, slots = int(rng.integers(3, 9)), 2
        experts = int(rng.integers(ranks, min(10, 2 * ranks) + 1))
        if i % 3 == 0:
            ranks, slots, experts = 3, 3, int(rng.integers(3, 10))
        w = (np.arange(1, experts + 1) ** -rng.uniform(0.5, 1.5)) * 1000 * rng.lognormal(0, 0.2, experts)
        yield w[rng.permutation(experts)], ranks, slots


def test_small_instances_at_the_exact_optimum():
    pytest.importorskip("highspy")
    from benchmarks.eplb_exact import solve_exact

    for w, ranks, slots in _instances(10, seed=45):
        exact = solve_exact(w, ranks, slots)
        assert exact.status == "optimal"
        pl = eplb.rebalance(w[None], num_physical=ranks * slots, num_ranks=ranks, migration_aware=False)
        got = eplb.rank_loads(w[None], pl, ranks).max()
        # the optimum among placements that keep moeshard's rule (the policy yields the rule
        # only to the reference's own duplicates, which can be lighter still), within the
        # solver's tolerance
        assert got <= exact.value * (1 + 1e-6), (w, ranks, slots, pl.logcnt, exact.counts)


def test_yardstick_bounds_bracket_the_exact_optimum():
    # the per-node bounds of the hierarchical rows: node_bound at most the unconstrained
    # optimum (any copies on any rank), node_upper a placement no lighter than it
    pytest.importorskip("highspy")
    from benchmarks.eplb_exact import node_bound, node_upper, solve_exact

    for w, ranks, slots in _instances(12, seed=7):
        exact = solve_exact(w, ranks, slots, rule=False)
        assert exact.status == "optimal"
        lo = node_bound(w[None], ranks * slots, ranks)[0]
        hi = node_upper(w, ranks, slots)
        assert lo <= exact.value * (1 + 1e-9) and hi >= exact.value * (1 - 1e-9), (w, ranks, slots)


def test_hierarchical_hot_expert_near_the_bound():
    # DeepSeek-V3's node shape (8 ranks of 9 slots: 64 experts and 8 spare slots per node) on 2
    # nodes, a layer's two hottest experts (8 and 3.3 times the mean rank load) in one group:
    # per-copy greed gives them more copies than the node has ranks, so two ranks carry two
    # heavy copies each; the policy must be within 2 % of the lower bound or of a feasible
    # repack of its own groups (eplb_exact.node_upper per node)
    from benchmarks.eplb_exact import lower_bound, node_upper

    rng = np.random.default_rng(45)
    cfg = dict(num_physical=144, num_ranks=16, num_nodes=2, num_groups=8)
    w = rng.lognormal(0, 0.5, size=(4, 128)) * (np.arange(1, 129) ** -0.6)[rng.permutation(128)]
    for layer in range(4):
        hot = 16 * rng.integers(8) + rng.choice(16, size=2, replace=False)
        w[layer, hot] = w[layer].sum() / 16 * np.array([8.0, 3.3])
    pl = eplb.rebalance(w, **cfg, migration_aware=False)
    got = eplb.rank_loads(w, pl, 16).max(1)
    lb = lower_bound(w, 144, 16, 2, 8)
    p2l = pl.phy2log.reshape(4, 2, 72)
    for layer in range(4):
        feasible = max(node_upper(w[layer, np.unique(p2l[layer, n])], 8, 9) for n in range(2))
        assert got[layer] <= min(lb[layer], feasible) * 1.02, (layer, got[layer], lb[layer], feasible)
    assert (got <= eplb.rank_loads(w, eplb.reference(w, **cfg), 16).max(1) * (1 + 1e-12)).all()


def test_min_moves_is_the_fewest_of_every_placement():
    """The fewest-moves integer program (benchmarks/eplb_exact.py) against every placement of
    small instances (two ranks of three slots, four experts, any multiset per rank): the same
    fewest moved copies within the limit, or infeasible where none fits; its copies are one
    such placement."""
    import itertools

    from benchmarks.eplb_exact import min_moves

    rng = np.random.default_rng(3)
    multisets = list(itertools.combinations_with_replacement(range(4), 3))
    fewest_seen = set()
    for _ in range(12):
        w = rng.integers(1, 9, 4).astype(float)
        held = rng.random((2, 4)) < 0.5
        limit = float(w.sum() / 2 * rng.uniform(1.0, 1.6))
        best = np.inf
        for a, b in itertools.product(multisets, multisets):
            n = np.zeros((2, 4), dtype=np.int64)
            np.add.at(n[0], list(a), 1)
            np.add.at(n[1], list(b), 1)
            c = n.sum(0)
            if (c == 0).any() or ((n * (w / np.maximum(c, 1))).sum(1) > limit * (1 + 1e-12)).any():
                continue
            best = min(best, int((n * ~held).sum()))
        got = min_moves(w, held, 3, limit, time_limit=10.0)
        assert got.value == best, (w, held, limit, got, best)
        if np.isfinite(best):
            assert got.status == "optimal"
            c = got.copies.sum(0)
            assert (c >= 1).all() and (got.copies.sum(1) == 3).all()
            assert ((got.copies * (w / c)).sum(1) <= limit * (1 + 1e-9)).all()
            assert int((got.copies * ~held).sum()) == best
            fewest_seen.add(best)
    assert len(fewest_seen) >= 2  # instances of different difficulty


def test_forced_group_moves_bounds_every_answer():
    """bench_eplb_optimum's lower bound of the migration-aware moves: the groups that must
    change node for every node to fit under the limit. From a placement whose node 0 holds the
    two groups that became hot, at least one group must leave it (a swap: two), and every
    answer within the limit (the aware policy's, the oblivious one's) moves at least as many
    groups as the bound says, each group at least one copy per expert."""
    from benchmarks.bench_eplb_optimum import forced_group_moves

    s = dict(logical=16, physical=24, ranks=4, nodes=2, groups=4)
    cfg = dict(num_physical=24, num_ranks=4, num_nodes=2, num_groups=4)
    # node 0 (ranks 0, 1) holds groups 0 and 1, node 1 groups 2 and 3
    old = Placement(
        np.r_[np.arange(8), np.arange(4), np.arange(8, 16), np.arange(8, 12)][None], num_logical=16, num_ranks=4
    )
    w1 = np.array([[8.0] * 8 + [1.0] * 8])  # groups 0 and 1 hot
    limit = eplb.rank_loads(w1, eplb.rebalance(w1, **cfg, migration_aware=False), 4).max(1) * 1.01
    forced = forced_group_moves(w1, old, s, limit)
    assert forced[0] == 2
    # none where the old nodes fit
    assert forced_group_moves(w1, old, s, limit * 10)[0] == 0

    def groups_moved(a, b):
        node = lambda p: [set(np.flatnonzero((p.phy2log.reshape(2, -1) // 4 == g).any(1))) for g in range(4)]  # noqa: E731
        return sum(x != y for x, y in zip(node(a), node(b)))

    for new in (
        eplb.rebalance(w1, old, **cfg, tolerance=0.01, relative_to="oblivious"),
        eplb.rebalance(w1, **cfg, migration_aware=False),
    ):
        assert eplb.rank_loads(w1, new, 4).max() <= limit[0] * (1 + 1e-12)
        assert groups_moved(old, new) >= forced[0]
        assert eplb.copies_moved(old, new, 4) >= 4 * forced[0]


def test_group_move_floor_bounds_the_chained_policy():
    """bench_eplb_optimum's floor of a hierarchical policy's moves over steps: from a
    placement whose node 0 holds the two groups that become hot, one hot group and one cold
    group must swap nodes (each expert at least one copy: 8 copies), and nothing more at a
    second step of the same loads; the aware policy chained over both steps moves at least
    that, and with limits 10x higher the floor is 0."""
    from benchmarks.bench_eplb_optimum import group_move_floor

    s = dict(logical=16, physical=24, ranks=4, nodes=2, groups=4)
    cfg = dict(num_physical=24, num_ranks=4, num_nodes=2, num_groups=4)
    old = Placement(
        np.r_[np.arange(8), np.arange(4), np.arange(8, 16), np.arange(8, 12)][None], num_logical=16, num_ranks=4
    )
    w1 = np.array([[8.0] * 8 + [1.0] * 8])
    trace = np.stack([w1, w1, w1])
    limit = eplb.rank_loads(w1, eplb.rebalance(w1, **cfg, migration_aware=False), 4).max(1) * 1.01
    assert group_move_floor(trace, old, s, [limit, limit]).tolist() == [8]
    assert group_move_floor(trace, old, s, [limit * 10, limit * 10]).tolist() == [0]
    cur, moved = old, 0
    for w in trace[1:]:
        new = eplb.rebalance(w, cur, **cfg, tolerance=0.01, relative_to="oblivious")
        moved += eplb.copies_moved(cur, new, 4)
        cur = new
    assert moved >= 8
