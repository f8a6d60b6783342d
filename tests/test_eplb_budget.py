"""Tier 1: move budgets and hysteresis of ``eplb.rebalance`` (a layer is rebalanced or left as
it is; the budget is never exceeded; a zero budget moves nothing; dead ranks still force the
layers they break) and the aware policy's limit relative to the oblivious policy."""

from __future__ import annotations

import numpy as np
import pytest

from eplb_steps import aware_moves
from moeshard import eplb
from moeshard.cli.bench.traces import zipf_trace

CFG = dict(num_physical=48, num_ranks=8, num_nodes=2, num_groups=4)
R = CFG["num_ranks"]


def _trace():
    tr = zipf_trace(8, 32, 2, seed=3, alpha=1.2, drift=0.3)
    old = eplb.rebalance(tr[0], **CFG, migration_aware=False)
    return tr[1], old


def test_zero_budget_moves_nothing():
    load, old = _trace()
    for kw in (dict(migration_aware=True), dict(migration_aware=False), dict(tolerance=0.01, tolerance_scope="step")):
        new = eplb.rebalance(load, old, **CFG, **kw, max_moves=0)
        assert eplb.copies_moved(old, new, R) == 0
        np.testing.assert_array_equal(new.phy2log, old.phy2log)


def test_budget_respected_layer_by_layer():
    load, old = _trace()
    free = eplb.rebalance(load, old, **CFG, migration_aware=False)
    total = eplb.copies_moved(old, free, R)
    assert total > 0
    np.testing.assert_array_equal(
        eplb.rebalance(load, old, **CFG, migration_aware=False, max_moves=None).phy2log, free.phy2log
    )
    seen = set()
    for budget in (1, total // 4, total // 2, total):
        new = eplb.rebalance(load, old, **CFG, migration_aware=False, max_moves=budget)
        assert eplb.copies_moved(old, new, R) <= budget
        # each layer is the unconstrained answer's or the old one
        same_new = (new.phy2log == free.phy2log).all(1)
        same_old = (new.phy2log == old.phy2log).all(1)
        assert (same_new | same_old).all()
        seen.add(int(same_new.sum()))
    assert len(seen) > 1  # the budget changes which layers move
    # with the whole unconstrained cost, every layer that gains is rebalanced
    full = eplb.rebalance(load, old, **CFG, migration_aware=False, max_moves=total)
    assert eplb.balance(load, full, R).mean() == pytest.approx(eplb.balance(load, free, R).mean())


def test_hysteresis_keeps_layers_with_small_gains():
    load, old = _trace()
    assert eplb.copies_moved(old, eplb.rebalance(load, old, **CFG, hysteresis=100.0), R) == 0
    small = eplb.rebalance(load, old, **CFG, migration_aware=False, hysteresis=0.05)
    free = eplb.rebalance(load, old, **CFG, migration_aware=False)
    b_old, b_new = eplb.balance(load, old, R), eplb.balance(load, free, R)
    kept = (small.phy2log == old.phy2log).all(1)
    np.testing.assert_array_equal(kept, ~(b_old > b_new * 1.05 * (1 + 1e-12)))


def test_dead_rank_forces_its_layers_beyond_the_budget():
    load, old = _trace()
    alive = np.ones(R, dtype=bool)
    alive[3] = False
    new = eplb.rebalance(load, old, **CFG, active_ranks=alive, max_moves=0)
    assert (new.phy2log.reshape(8, R, -1)[:, 3] == -1).all()
    assert (new.logcnt >= 1).all()


def test_aware_relative_to_oblivious():
    load, old = _trace()
    obl = eplb.rebalance(load, old, **CFG, migration_aware=False)
    new = eplb.rebalance(load, old, **CFG, tolerance=0.01, relative_to="oblivious")
    assert (eplb.balance(load, new, R) <= eplb.balance(load, obl, R) * 1.01 * (1 + 1e-9)).all()
    assert eplb.copies_moved(old, new, R) <= eplb.copies_moved(old, obl, R)


def test_step_scope_spends_the_tolerance_on_the_mean_and_moves_fewer_copies():
    """``tolerance_scope="step"``: the mean over layers of max/mean rank load within 1 % of the
    oblivious answer's mean (each layer within 1 + 8 x 1 %), fewer copies moved than with the
    tolerance on every layer from the same placement (never more), and the move caps exact."""
    cfg = dict(num_physical=144, num_ranks=16, num_nodes=4, num_groups=8)
    trace = zipf_trace(8, 128, 4, seed=0, alpha=1.2, drift=0.1)
    cur = eplb.rebalance(trace[0], **cfg, migration_aware=False)
    moved = {"layer": 0, "step": 0}
    for load in trace[1:]:
        obl = eplb.balance(load, eplb.rebalance(load, **cfg, migration_aware=False), 16)
        new = {}
        for scope in moved:
            new[scope] = eplb.rebalance(
                load, cur, **cfg, tolerance=0.01, relative_to="oblivious", tolerance_scope=scope
            )
            moved[scope] += eplb.copies_moved(cur, new[scope], 16)
        b = eplb.balance(load, new["step"], 16)
        assert b.mean() <= obl.mean() * 1.01 * (1 + 1e-12)
        assert (b <= obl * 1.08 * (1 + 1e-12)).all()
        assert eplb.copies_moved(cur, new["step"], 16) <= eplb.copies_moved(cur, new["layer"], 16)
        capped = eplb.rebalance(load, cur, **cfg, tolerance=0.01, tolerance_scope="step", max_moves=5)
        assert eplb.copies_moved(cur, capped, 16) <= 5
        cur = new["step"]
    # 227 against 253 (2026-11-29; the per-layer scope's last pass, fill_held, saves more
    # copies there than in the step scope)
    assert moved["step"] < 0.95 * moved["layer"], moved


def test_cheapest_within_mean_against_every_choice():
    """The step scope's choice of one option per layer: always within the balance budget, and
    on small random instances within one layer's moves of the best of every choice and mostly at it."""
    import itertools

    from moeshard.eplb.aware import cheapest_within_mean

    rng = np.random.default_rng(0)
    at_best = 0
    for _ in range(40):
        num_layers, k = 4, 4
        bal = np.sort(1 + rng.random((num_layers, k)) * 0.1, axis=1)
        moves = np.sort(rng.integers(0, 50, (num_layers, k)), axis=1)[:, ::-1].astype(float)
        budget = bal[:, 0].sum() + rng.random() * (bal[:, -1] - bal[:, 0]).sum()
        pick = cheapest_within_mean(moves, bal, budget)
        rows = np.arange(num_layers)
        assert bal[rows, pick].sum() <= budget
        best = min(
            moves[rows, list(c)].sum()
            for c in itertools.product(range(k), repeat=num_layers)
            if bal[rows, list(c)].sum() <= budget
        )
        assert moves[rows, pick].sum() <= best + moves.max()
        at_best += moves[rows, pick].sum() == best
    assert at_best >= 25, at_best  # 29 of 40 (2026-11-29)


def test_aware_swaps_copies_back_within_the_limit():
    """The per-layer answer after copies are swapped back to ranks that held them where both
    ranks stay within the limit: fewer copies moved on a seeded drifting trace (328; 330 before
    the swap-back pass), every layer within 1 % of the oblivious answer."""
    moved = aware_moves(zipf_trace(8, 128, 4, seed=2, alpha=1.2, drift=0.1))
    assert moved < 330, moved


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_moves=-1),
        dict(max_moves=1.5),
        dict(hysteresis=-0.1),
        dict(relative_to="best"),
        dict(tolerance_scope="all"),
    ],
)
def test_budget_arguments_checked(kw):
    load, old = _trace()
    with pytest.raises(ValueError):
        eplb.rebalance(load, old, **CFG, **kw)


def test_budget_needs_a_placement():
    load, _ = _trace()
    with pytest.raises(ValueError, match="current placement"):
        eplb.rebalance(load, None, **CFG, max_moves=3)


# -- replica budgets per layer -------------------------------------------------------------------


def test_replica_budget_per_layer_with_empty_slots():
    skewed = zipf_trace(2, 16, 1, seed=1, alpha=1.5)[0]
    flat = zipf_trace(2, 16, 1, seed=2, alpha=0.1)[0]
    load = np.concatenate([skewed, flat])
    total = 4 * 16 + 12
    pl = eplb.rebalance_replicas(load, total, num_physical=32, num_ranks=8)
    per = pl.logcnt.sum(1)
    assert per.sum() == total and (pl.logcnt >= 1).all()
    assert (per[:2] > per[2:]).all()  # the skewed layers get the copies
    np.testing.assert_array_equal((pl.phy2log < 0).sum(1), 32 - per)  # the rest empty
    np.testing.assert_array_equal(pl.empty.sum(1), 32 - per)
    # skewed layers are more balanced than with one copy per expert and every slot empty beyond
    one = eplb.rebalance_replicas(load, 4 * 16, num_physical=32, num_ranks=8)
    assert (eplb.balance(load, pl, 8)[:2] < eplb.balance(load, one, 8)[:2]).all()
    # a dead rank: its slots empty, the budget counts live slots only
    alive = np.ones(8, dtype=bool)
    alive[3] = False
    dead = eplb.rebalance_replicas(load, total, num_physical=32, num_ranks=8, active_ranks=alive)
    assert (dead.phy2log.reshape(4, 8, 4)[:, 3] == -1).all()
    assert dead.logcnt.sum() == total and (dead.logcnt >= 1).all()


@pytest.mark.parametrize("total", [4 * 16 - 1, 4 * 32 + 1, 70.0])
def test_replica_budget_checked(total):
    load = zipf_trace(4, 16, 1, seed=1)[0]
    with pytest.raises(ValueError, match="total_copies"):
        eplb.rebalance_replicas(load, total, num_physical=32, num_ranks=8)
