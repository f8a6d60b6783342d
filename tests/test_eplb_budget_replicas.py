"""Tier 1: replica budgets per layer (``eplb.rebalance_replicas``), hierarchical form (groups
onto nodes, each node's share of the copies on its live ranks) and from a current placement
under move caps. Pure numpy."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard import eplb
from moeshard.cli.bench.traces import zipf_trace
from test_eplb_budget_caps import check_valid

HIER = dict(num_physical=64, num_ranks=8, num_nodes=2, num_groups=4)


def _load(seed=1):
    skewed = zipf_trace(3, 32, 1, seed=seed, alpha=1.6)[0]
    flat = zipf_trace(3, 32, 1, seed=seed + 1, alpha=0.1)[0]
    return np.concatenate([skewed, flat])


def _even(load, total, cfg, active=None):
    """Each layer placed alone with the same share of the copies (the even spread)."""
    share = total // load.shape[0]
    return np.concatenate(
        [
            eplb.balance(
                load[k : k + 1],
                eplb.rebalance_replicas(load[k : k + 1], share, **cfg, active_ranks=active),
                cfg["num_ranks"],
                active,
            )
            for k in range(load.shape[0])
        ]
    )


@pytest.mark.parametrize("dead", [False, True])
def test_hierarchical_replica_budget(dead):
    load = _load()
    r = HIER["num_ranks"]
    active = np.ones(r, dtype=bool)
    if dead:
        active[[2, 5]] = False  # one per node: still hierarchical
    total = 6 * 32 + 36
    pl = eplb.rebalance_replicas(load, total, **HIER, active_ranks=active)
    per = pl.logcnt.sum(1)
    assert per.sum() == total
    if not dead:
        assert per[:3].min() > per[3:].max()  # the skewed layers get the copies
    check_valid(pl, HIER, active)  # groups on one node each, every expert a copy, dead ranks empty
    np.testing.assert_array_equal((pl.phy2log >= 0).sum(1), per)
    # the worst layer no less balanced than with the copies spread evenly over the layers
    bal = eplb.balance(load, pl, r, active)
    even = _even(load, total, HIER, active)
    assert bal.max() <= even.max() * (1 + 1e-9)
    if not dead:  # (with 3 live ranks a node, the skewed layers are at their floor either way)
        assert bal[:3].mean() < even[:3].mean()


def test_global_replica_budget_no_less_balanced_than_even():
    load = _load(seed=4)
    cfg = dict(num_physical=32, num_ranks=8)
    total = 6 * 16 + 30
    pl = eplb.rebalance_replicas(load[:, :16], total, **cfg)
    assert pl.logcnt.sum() == total
    bal = eplb.balance(load[:, :16], pl, 8)
    even = _even(load[:, :16], total, cfg)
    assert bal.max() <= even.max() * (1 + 1e-9)


def test_replica_budget_from_a_placement_under_caps():
    load = _load(seed=6)
    r = HIER["num_ranks"]
    total = 6 * 32 + 36
    old = eplb.rebalance(load, **HIER)  # every slot used
    free = eplb.rebalance_replicas(load, total, **HIER)
    np.testing.assert_array_equal(eplb.rebalance_replicas(load, total, old, **HIER).phy2log, free.phy2log)
    # with hysteresis, a layer is the budget's only where that is lighter by the factor (from
    # one copy per expert: the skewed layers gain, the flat ones do not)
    h = 0.01
    one = eplb.rebalance_replicas(load, 6 * 32, **HIER)
    hyst = eplb.rebalance_replicas(load, total, one, **HIER, hysteresis=h)
    b_one, b_free = eplb.balance(load, one, r), eplb.balance(load, free, r)
    taken = (hyst.phy2log != one.phy2log).any(1)
    np.testing.assert_array_equal(taken, b_one > b_free * (1 + h))
    assert taken.any() and not taken.all()
    np.testing.assert_array_equal(hyst.phy2log[taken], free.phy2log[taken])
    nothing = eplb.rebalance_replicas(load, total, old, **HIER, max_moves=0)
    np.testing.assert_array_equal(nothing.phy2log, old.phy2log)
    for partial in (False, True):
        for caps in (dict(max_moves=9), dict(max_moves_per_pair=1, max_moves_per_rank=2)):
            pl = eplb.rebalance_replicas(load, total, old, **HIER, partial=partial, **caps)
            check_valid(pl, HIER, np.ones(r, dtype=bool))
            pairs = eplb.move_pairs(old, pl, r, HIER["num_nodes"]).sum(0)
            assert eplb.copies_moved(old, pl, r) <= caps.get("max_moves", 10**9)
            assert pairs.max() <= caps.get("max_moves_per_pair", 10**9)
            assert pairs.sum(0).max() <= caps.get("max_moves_per_rank", 10**9)
            same_new = (pl.phy2log == free.phy2log).all(1)
            same_old = (pl.phy2log == old.phy2log).all(1)
            # layers taken have the budget's copies, the others keep theirs
            np.testing.assert_array_equal(pl.logcnt.sum(1), np.where(same_new, free.logcnt.sum(1), old.logcnt.sum(1)))
            if not partial:
                assert (same_new | same_old).all()


@pytest.mark.parametrize(
    "kw, name",
    [(dict(max_moves=-1), "max_moves"), (dict(partial=1), "partial"), (dict(max_moves_per_rank=0.5), "per_rank")],
)
def test_replica_budget_arguments_checked(kw, name):
    load = _load()
    old = eplb.rebalance(load, **HIER)
    with pytest.raises(ValueError, match=name):
        eplb.rebalance_replicas(load, 6 * 32, old, **HIER, **kw)
    with pytest.raises(ValueError, match="needs the current placement"):
        eplb.rebalance_replicas(load, 6 * 32, **HIER, max_moves=2)
