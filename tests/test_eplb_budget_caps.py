"""Tier 1: move caps of ``eplb.rebalance`` / ``eplb.rebalance_with_report`` (copies moved in all,
per ordered rank pair, received per rank), partial answers (single copies moved within the caps)
and the report; the source rank of a moved copy (``eplb.move_pairs``). Pure numpy."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard import Placement, eplb
from moeshard.cli.bench.traces import zipf_trace

HIER = dict(num_physical=48, num_ranks=8, num_nodes=2, num_groups=4)
FLAT = dict(num_physical=48, num_ranks=8, num_nodes=2, num_groups=None)


def _case(cfg, seed, num_layers=12, num_logical=32, active=None, aware=True):
    tr = zipf_trace(num_layers, num_logical, 2, seed=seed, alpha=1.3, drift=0.4)
    old = eplb.rebalance(tr[0], **cfg, active_ranks=active, migration_aware=False)
    return tr[1], old


def check_valid(pl: Placement, cfg, active) -> None:
    """Every answer: each expert has a copy, dead ranks hold nothing, hierarchical: each group
    on one node, as many groups per node."""
    r, n, g = cfg["num_ranks"], cfg["num_nodes"], cfg["num_groups"]
    p3 = pl.phy2log.reshape(pl.num_layers, r, -1)
    assert (pl.logcnt >= 1).all()
    assert (p3[:, ~active] == -1).all()
    if g is not None:
        gsize = pl.num_logical // g
        node = np.arange(r) // (r // n)
        for layer in range(pl.num_layers):
            ranks, _ = np.nonzero(p3[layer] >= 0)
            grp = p3[layer][p3[layer] >= 0] // gsize
            nodes_of = [set(node[ranks[grp == k]]) for k in range(g)]
            assert all(len(s) == 1 for s in nodes_of)
            per_node = np.bincount([next(iter(s)) for s in nodes_of], minlength=n)
            assert (per_node == g // n).all()


CAPS = [
    dict(max_moves=3),
    dict(max_moves=17),
    dict(max_moves_per_pair=1),
    dict(max_moves_per_rank=2),
    dict(max_moves=25, max_moves_per_pair=1, max_moves_per_rank=3),
    dict(max_moves_per_pair=2, max_moves_per_rank=1),
]


@pytest.mark.parametrize("cfg", [HIER, FLAT], ids=["hierarchical", "global"])
def test_every_cap_respected_on_random_instances(cfg):
    """Every cap on random instances, partial or not; partial answers never less balanced
    than whole layers alone under the same caps (in all layers), nor than the current
    placement (per layer); the report's numbers are the metrics of its placements."""
    r = cfg["num_ranks"]
    gained = 0
    for seed in range(2):
        active = np.ones(r, dtype=bool)
        if seed % 2:
            active[[1, 5]] = False  # dead in the current placement already: no forced layer
        load, old = _case(cfg, seed, num_layers=24, active=active)
        free = eplb.rebalance(load, old, **cfg, active_ranks=active)
        for caps in CAPS:
            sums = []
            for partial in (False, True):
                rep = eplb.rebalance_with_report(load, old, **cfg, active_ranks=active, partial=partial, **caps)
                new = rep.placement
                if caps is CAPS[-2]:  # rebalance answers the report's placement
                    again = eplb.rebalance(load, old, **cfg, active_ranks=active, partial=partial, **caps)
                    np.testing.assert_array_equal(new.phy2log, again.phy2log)
                check_valid(new, cfg, active)
                pairs = eplb.move_pairs(old, new, r, cfg["num_nodes"], active_ranks=active).sum(0)
                moved = eplb.copies_moved(old, new, r)
                assert moved <= caps.get("max_moves", moved)
                assert pairs.max() <= caps.get("max_moves_per_pair", pairs.max())
                assert pairs.sum(0).max() <= caps.get("max_moves_per_rank", pairs.sum(0).max())
                assert moved == pairs.sum()  # every expert had a live holder: all moves have a pair
                # never less balanced than the current placement, per layer
                b_old = eplb.balance(load, old, r, active)
                b_new = eplb.balance(load, new, r, active)
                assert (b_new <= b_old * (1 + 1e-9)).all()
                # the report's numbers are the metrics of its placements
                np.testing.assert_allclose(rep.balance, b_new)
                np.testing.assert_allclose(rep.balance_old, b_old)
                np.testing.assert_allclose(rep.balance_unconstrained, eplb.balance(load, free, r, active))
                np.testing.assert_allclose(rep.budget_cost, b_new - eplb.balance(load, free, r, active))
                assert rep.copies_moved == moved
                np.testing.assert_array_equal(
                    rep.moved, [eplb.copies_moved(_layer(old, k), _layer(new, k), r) for k in range(old.num_layers)]
                )
                np.testing.assert_array_equal(
                    rep.pair_moves, eplb.move_pairs(old, new, r, cfg["num_nodes"], active_ranks=active)
                )
                np.testing.assert_array_equal(rep.max_pair_moves, rep.pair_moves.max((1, 2)))
                same_new = (new.phy2log == free.phy2log).all(1)
                same_old = (new.phy2log == old.phy2log).all(1)
                status = np.array(rep.status)
                assert set(status) <= {"taken", "left", "partial"}
                assert (same_new[status == "taken"]).all()
                assert (same_old[status == "left"]).all()
                assert not (same_old | same_new)[status == "partial"].any()
                if not partial:
                    assert (same_new | same_old).all()
                sums.append(b_new.sum())
            assert sums[1] <= sums[0] * (1 + 1e-9)
            gained += sums[1] < sums[0] * (1 - 1e-6)
    assert gained >= 6  # partial answers are strictly lighter in most cases


def _layer(pl: Placement, k: int) -> Placement:
    return Placement(pl.phy2log[k : k + 1], num_logical=pl.num_logical, num_ranks=pl.num_ranks)


@pytest.mark.parametrize("partial", [False, True])
def test_zero_caps_move_nothing(partial):
    load, old = _case(HIER, 3)
    for caps in (dict(max_moves=0), dict(max_moves_per_pair=0), dict(max_moves_per_rank=0)):
        rep = eplb.rebalance_with_report(load, old, **HIER, partial=partial, **caps)
        np.testing.assert_array_equal(rep.placement.phy2log, old.phy2log)
        assert rep.copies_moved == 0 and rep.pair_moves.sum() == 0
        assert set(rep.status) == {"left"}
        assert (rep.budget_cost >= 0).all() and rep.budget_cost.max() > 0


@pytest.mark.parametrize("cfg", [HIER, FLAT], ids=["hierarchical", "global"])
def test_unlimited_caps_equal_the_unconstrained_answer(cfg):
    load, old = _case(cfg, 5)
    free = eplb.rebalance(load, old, **cfg, hysteresis=0.02)
    big = 10**9
    rep = eplb.rebalance_with_report(
        load, old, **cfg, hysteresis=0.02, max_moves=big, max_moves_per_pair=big, max_moves_per_rank=big
    )
    np.testing.assert_array_equal(rep.placement.phy2log, free.phy2log)
    np.testing.assert_array_equal(rep.budget_cost, 0.0)
    assert rep.budget_cost_ratio == 1.0
    # caps just at what the unconstrained answer uses: still all of it
    pairs = eplb.move_pairs(old, free, cfg["num_ranks"], cfg["num_nodes"]).sum(0)
    tight = eplb.rebalance(
        load,
        old,
        **cfg,
        hysteresis=0.02,
        partial=True,
        max_moves=eplb.copies_moved(old, free, cfg["num_ranks"]),
        max_moves_per_pair=int(pairs.max()),
        max_moves_per_rank=int(pairs.sum(0).max()),
    )
    np.testing.assert_array_equal(tight.phy2log, free.phy2log)


def test_dead_rank_forces_its_layers_beyond_the_caps():
    load, old = _case(HIER, 2)
    alive = np.ones(8, dtype=bool)
    alive[[3, 7]] = False  # one per node: still hierarchical
    rep = eplb.rebalance_with_report(load, old, **HIER, active_ranks=alive, max_moves=0, max_moves_per_pair=0)
    check_valid(rep.placement, HIER, alive)
    status = np.array(rep.status)
    assert (status == "forced").any() and set(status) <= {"forced", "left"}
    assert rep.copies_moved > 0


def test_partial_respects_hysteresis():
    load, old = _case(HIER, 7)
    r = HIER["num_ranks"]
    h = 0.3
    b_old = eplb.balance(load, old, r)
    gains = []
    for hyst in (0.0, h):
        new = eplb.rebalance(load, old, **HIER, hysteresis=hyst, max_moves=12, partial=True)
        moved = (new.phy2log != old.phy2log).any(1)
        gains.append(b_old[moved] / eplb.balance(load, new, r)[moved])
    assert (gains[0] <= 1 + h).any()  # without hysteresis some partial layer gains less
    assert len(gains[1]) and (gains[1] > 1 + h).all()


def test_move_pairs_sources_same_node_first_then_ring_order():
    # 4 ranks, 2 nodes (ranks 0-1, 2-3), one slot each; 3 experts
    old = Placement(np.array([[0, 1, 0, 2]]), num_logical=3, num_ranks=4)
    new = Placement(np.array([[2, 0, 1, 0]]), num_logical=3, num_ranks=4)
    pairs = eplb.move_pairs(old, new, 4, num_nodes=2)[0]
    want = np.zeros((4, 4), dtype=int)
    want[3, 0] = 1  # expert 2 onto rank 0: only rank 3 holds it (another node)
    want[0, 1] = 1  # expert 0 onto rank 1: rank 0 holds it on rank 1's node (rank 2 too, elsewhere)
    want[1, 2] = 1  # expert 1 onto rank 2: only rank 1 holds it
    want[2, 3] = 1  # expert 0 onto rank 3: rank 2 holds it on rank 3's node
    np.testing.assert_array_equal(pairs, want)
    # one node: the first holder after the receiver in ring order
    old1 = Placement(np.array([[0, 1, 2, 0]]), num_logical=3, num_ranks=4)
    new1 = Placement(np.array([[1, 0, 2, 0]]), num_logical=3, num_ranks=4)
    p1 = eplb.move_pairs(old1, new1, 4)[0]
    assert p1[3, 1] == 1 and p1[1, 0] == 1 and p1.sum() == 2  # (3 - 1) % 4 = 2 < (0 - 1) % 4 = 3
    # a dead holder sends nothing: expert 0 only from rank 2 now
    alive = np.array([False, True, True, True])
    new2 = Placement(np.array([[-1, 0, 1, 2]]), num_logical=3, num_ranks=4)
    p2 = eplb.move_pairs(old, new2, 4, num_nodes=2, active_ranks=alive)[0]
    want2 = np.zeros((4, 4), dtype=int)
    want2[2, 1] = want2[1, 2] = 1
    np.testing.assert_array_equal(p2, want2)
    # an expert no live rank holds counts in no pair (read from storage)
    old4 = Placement(np.array([[0, 1, 1, 2, 0, 2, 2, 1]]), num_logical=3, num_ranks=4)
    new4 = Placement(np.array([[-1, -1, 0, 1, -1, -1, 2, 0]]), num_logical=3, num_ranks=4)
    p4 = eplb.move_pairs(old4, new4, 4, 2, np.array([False, True, False, True]))
    assert p4.sum() == 0 and eplb.copies_moved(old4, new4, 4) == 2


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(max_moves_per_pair=-1), "max_moves_per_pair"),
        (dict(max_moves_per_pair=1.5), "max_moves_per_pair"),
        (dict(max_moves_per_rank=True), "max_moves_per_rank"),
        (dict(max_moves_per_rank="2"), "max_moves_per_rank"),
        (dict(partial="yes"), "partial"),
        (dict(hysteresis=float("nan")), "hysteresis"),
        (dict(max_moves=-2), "max_moves"),
    ],
)
def test_cap_arguments_checked(kw, name):
    load, old = _case(HIER, 1, num_layers=2)
    with pytest.raises(ValueError, match=name):
        eplb.rebalance(load, old, **HIER, **kw)
    with pytest.raises(ValueError, match=name):
        eplb.rebalance_with_report(load, old, **HIER, **kw)


def test_caps_need_a_placement():
    load, _ = _case(HIER, 1, num_layers=2)
    with pytest.raises(ValueError, match="max_moves_per_pair needs the current placement"):
        eplb.rebalance(load, None, **HIER, max_moves_per_pair=1)
    with pytest.raises(ValueError, match="placement"):
        eplb.rebalance_with_report(load, None, **HIER)
    old = eplb.rebalance(load, **HIER)
    with pytest.raises(ValueError, match="num_nodes"):
        eplb.move_pairs(old, old, 8, num_nodes=3)
    with pytest.raises(ValueError, match="differ in shape"):
        eplb.move_pairs(old, _layer(old, 0), 8)


def test_no_caps_no_hysteresis_takes_every_layer():
    """Without caps and hysteresis the answer is the policy's on every layer, even where it is
    not lighter than the current placement (here: the same copies, slots reordered)."""
    load, _ = _case(HIER, 4, num_layers=4)
    free = eplb.rebalance(load, **HIER, migration_aware=False)
    p = free.phy2log.copy()
    p[:, [0, 1]] = p[:, [1, 0]]  # two slots of rank 0 swapped: the same loads
    cur = Placement(p, num_logical=free.num_logical, num_ranks=free.num_ranks)
    np.testing.assert_array_equal(eplb.rebalance(load, cur, **HIER, migration_aware=False).phy2log, free.phy2log)
    rep = eplb.rebalance_with_report(load, cur, **HIER, migration_aware=False)
    assert set(rep.status) == {"taken"} and rep.copies_moved == 0
