"""Tier 1: move budgets and hysteresis of ``eplb.rebalance`` (a layer is rebalanced or left as
it is; the budget is never exceeded; a zero budget moves nothing; dead ranks still force the
layers they break) and the aware policy's limit relative to the oblivious policy."""

from __future__ import annotations

import numpy as np
import pytest

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
    for aware in (True, False):
        new = eplb.rebalance(load, old, **CFG, migration_aware=aware, max_moves=0)
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


@pytest.mark.parametrize(
    "kw",
    [dict(max_moves=-1), dict(max_moves=1.5), dict(hysteresis=-0.1), dict(relative_to="best")],
)
def test_budget_arguments_checked(kw):
    load, old = _trace()
    with pytest.raises(ValueError):
        eplb.rebalance(load, old, **CFG, **kw)


def test_budget_needs_a_placement():
    load, _ = _trace()
    with pytest.raises(ValueError, match="current placement"):
        eplb.rebalance(load, None, **CFG, max_moves=3)
