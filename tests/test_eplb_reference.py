"""Tier 1: ``eplb.reference`` (deepseek-ai/EPLB's own answer, pure numpy) and the
migration-aware policy against it: never less balanced per layer, far fewer moved copies,
valid placements (dead ranks included)."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard import Placement, eplb
from moeshard.cli.bench.traces import zipf_trace
from test_eplb import README_PHY2LOG, README_WEIGHT

CONFIGS = [
    dict(num_physical=24, num_ranks=4, num_nodes=2, num_groups=None),  # global
    dict(num_physical=40, num_ranks=8, num_nodes=2, num_groups=None),
    dict(num_physical=48, num_ranks=8, num_nodes=2, num_groups=4),  # hierarchical
    dict(num_physical=72, num_ranks=12, num_nodes=3, num_groups=6),
]
NUM_LOGICAL = {24: 16, 40: 32, 48: 32, 72: 48}


def _ids(c):
    return f"P{c['num_physical']}R{c['num_ranks']}N{c['num_nodes']}G{c['num_groups']}"


def _valid(pl: Placement, load, cfg, active) -> None:
    """Every logical expert has a live copy, slot counts right, dead ranks' slots -1, and
    (hierarchical) each group on one node, num_groups / num_nodes groups per node."""
    r, p = cfg["num_ranks"], cfg["num_physical"]
    num_layers, num_logical = load.shape
    assert pl.phy2log.shape == (num_layers, p)
    assert pl.num_ranks == r and pl.num_logical == num_logical
    p2l = pl.phy2log.reshape(num_layers, r, p // r)
    assert ((p2l < 0) == ~active[None, :, None]).all()
    assert (pl.logcnt >= 1).all()
    assert pl.logcnt.sum(1).tolist() == [int(active.sum()) * (p // r)] * num_layers
    g, n = cfg["num_groups"], cfg["num_nodes"]
    per_node = active.reshape(n, -1).sum(1)
    if g is not None and g % n == 0 and (per_node == per_node[0]).all():
        node = np.repeat(np.arange(n), p // n)
        for layer in range(num_layers):
            live = pl.phy2log[layer] >= 0
            grp = pl.phy2log[layer][live] // (num_logical // g)
            pairs = np.unique(np.stack([grp, node[live]]), axis=1)
            assert len(np.unique(pairs[0])) == pairs.shape[1] == g  # one node per group
            assert (np.bincount(pairs[1], minlength=n) == g // n).all()


# -- the reference -------------------------------------------------------------------------------


def test_reference_readme_exact():
    pl = eplb.reference(README_WEIGHT, num_physical=16, num_ranks=8, num_nodes=2, num_groups=4)
    np.testing.assert_array_equal(pl.phy2log, README_PHY2LOG)


def test_reference_keeps_two_copies_on_a_rank():
    # replicate_experts: expert 0 gets all 4 redundant slots (20 tokens per copy); the
    # greedy packs 20, 20 | 20 | 20 | 20 alternately, then the 1s: two ranks of 0, 0, ...
    pl = eplb.reference(np.array([[100, 1, 1, 1]]), num_physical=8, num_ranks=2)
    np.testing.assert_array_equal(pl.phy2log, [[0, 0, 0, 3, 0, 0, 1, 2]])
    np.testing.assert_allclose(eplb.balance([[100, 1, 1, 1]], pl, 2), [61 / 51.5])


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_reference_properties(cfg):
    rng = np.random.default_rng(cfg["num_physical"])
    num_logical = NUM_LOGICAL[cfg["num_physical"]]
    r = cfg["num_ranks"]
    load = rng.random((3, num_logical)) * 100  # no ties: replica counts as moeshard's
    ref = eplb.reference(load, **cfg)
    _valid(ref, load, cfg, np.ones(r, dtype=bool))
    # the oblivious policy may choose other replica counts (the joint search), never less balanced
    obl = eplb.rebalance(load, **cfg, migration_aware=False)
    assert (eplb.balance(load, obl, r) <= eplb.balance(load, ref, r) * (1 + 1e-12)).all()
    # dead rank: its slots empty, slot ids of the others unchanged
    active = np.ones(r, dtype=bool)
    active[1] = False
    dead = eplb.reference(load, **cfg, active_ranks=active)
    _valid(dead, load, cfg, active)


# -- the migration-aware policy against it --------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
@pytest.mark.parametrize("kind", ["zipf", "int"])
def test_aware_never_less_balanced_than_reference(cfg, kind):
    rng = np.random.default_rng(hash((cfg["num_physical"], kind)) % (1 << 32))
    num_logical = NUM_LOGICAL[cfg["num_physical"]]
    r, n = cfg["num_ranks"], cfg["num_nodes"]
    full = np.ones(r, dtype=bool)
    one_dead = full.copy()
    one_dead[0] = False
    even = full.copy()
    even[[0, r // n]] = False  # one dead rank in each of two nodes
    for _trial in range(2):
        if kind == "zipf":
            load0 = zipf_trace(4, num_logical, 1, seed=int(rng.integers(1 << 30)), alpha=1.2)[0]
        else:
            load0 = rng.integers(0, 200, size=(4, num_logical)).astype(float)
        old = eplb.rebalance(load0, **cfg, migration_aware=False)
        load1 = load0 * rng.lognormal(0, 0.3, size=load0.shape)
        for active in (full, one_dead, even if n == 2 else full):
            if active.sum() * (cfg["num_physical"] // r) < num_logical:
                continue
            aware = eplb.rebalance(load1, old, **cfg, active_ranks=active)
            ref = eplb.reference(load1, **cfg, active_ranks=active)
            obl = eplb.rebalance(load1, old, **cfg, active_ranks=active, migration_aware=False)
            _valid(aware, load1, cfg, active)
            _valid(obl, load1, cfg, active)
            b_ref = eplb.balance(load1, ref, r, active)
            assert (eplb.balance(load1, aware, r, active) <= b_ref * (1 + 1e-12)).all()
            assert (eplb.balance(load1, obl, r, active) <= b_ref * (1 + 1e-12)).all()
            # nothing moves when the load does not change
            assert eplb.copies_moved(aware, eplb.rebalance(load1, aware, **cfg, active_ranks=active), r) == 0


@pytest.mark.parametrize("hier, most", [(True, 0.2), (False, 0.3)])
def test_drifting_trace_moves_far_fewer_copies_than_reference(hier, most):
    """The reference rebalances from its own answers, the aware policy from its own; per
    step and layer the aware policy is as balanced, and it moves a fraction of the copies."""
    cfg = dict(num_physical=80, num_ranks=16, num_nodes=4, num_groups=8 if hier else None)
    trace = zipf_trace(6, 64, 7, seed=5, alpha=1.2, drift=0.1)
    cur_r, cur_a = eplb.reference(trace[0], **cfg), eplb.rebalance(trace[0], **cfg, migration_aware=False)
    moved_r = moved_a = 0
    for load in trace[1:]:
        ref, aware = eplb.reference(load, **cfg), eplb.rebalance(load, cur_a, **cfg)
        _valid(aware, load, cfg, np.ones(16, dtype=bool))
        assert (eplb.balance(load, aware, 16) <= eplb.balance(load, ref, 16) * (1 + 1e-12)).all()
        moved_r += eplb.copies_moved(cur_r, ref, 16)
        moved_a += eplb.copies_moved(cur_a, aware, 16)
        cur_r, cur_a = ref, aware
    assert moved_a <= most * moved_r, (moved_a, moved_r)


# -- property: never less balanced than the reference, first step and later ones ---------------

# Shapes of real models (experts, groups; slots, ranks, nodes), a few layers each: DeepSeek-V3
# (256 experts, 8 groups; 32 or 64 redundant), DeepSeek-V2 (160 experts, 8 groups), Qwen3-MoE
# (128 experts, no groups: 30B-A3B and 235B-A22B), Mixtral (8 experts), and DeepSeek-V3 without
# its groups (the global policy).
MODEL_SHAPES = [
    dict(num_logical=256, num_physical=288, num_ranks=32, num_nodes=4, num_groups=8),
    dict(num_logical=256, num_physical=320, num_ranks=64, num_nodes=8, num_groups=8),
    dict(num_logical=256, num_physical=320, num_ranks=32, num_nodes=4, num_groups=None),
    dict(num_logical=160, num_physical=192, num_ranks=16, num_nodes=2, num_groups=8),
    dict(num_logical=128, num_physical=160, num_ranks=16, num_nodes=2, num_groups=None),
    dict(num_logical=128, num_physical=144, num_ranks=8, num_nodes=1, num_groups=None),
    dict(num_logical=8, num_physical=16, num_ranks=8, num_nodes=1, num_groups=None),
    dict(num_logical=8, num_physical=12, num_ranks=4, num_nodes=2, num_groups=None),
]
TIGHT = 1e-12  # relative: only what sums of the same copies in another order may differ by


def _dead(rng, shape, num_logical) -> np.ndarray:
    """Live ranks: all, one dead, or one dead per node (the hierarchical policy still holds),
    where the live slots still hold every expert."""
    r, n = shape["num_ranks"], shape["num_nodes"]
    s = shape["num_physical"] // r
    active = np.ones(r, dtype=bool)
    kind = rng.integers(3)
    if kind == 1:
        active[rng.integers(r)] = False
    elif kind == 2 and r // n > 1:
        active[np.arange(n) * (r // n) + rng.integers(r // n, size=n)] = False
    return active if active.sum() * s >= num_logical else np.ones(r, dtype=bool)


@pytest.mark.parametrize("seed", range(6))
def test_never_less_balanced_than_reference_on_random_traces(seed):
    """Random drifting Zipf traces (exponent 0.5-1.6) at model shapes, with and without expert
    groups, some ranks dead (and back): per layer, the placement with no previous one (the
    oblivious policy) and every later migration-aware step are at least as balanced as
    deepseek-ai/EPLB's answer at the same inputs, up to ``TIGHT``."""
    rng = np.random.default_rng(1000 + seed)
    for i in rng.permutation(len(MODEL_SHAPES))[:4]:
        shape = dict(MODEL_SHAPES[i])
        num_logical = shape.pop("num_logical")
        r = shape["num_ranks"]
        trace = zipf_trace(
            int(rng.integers(2, 5)),
            num_logical,
            4,
            seed=int(rng.integers(1 << 30)),
            alpha=float(rng.uniform(0.5, 1.6)),
            drift=float(rng.uniform(0.0, 0.3)),
        )
        cur = None
        for step, load in enumerate(trace):
            active = _dead(rng, shape, num_logical)
            b_ref = eplb.balance(load, eplb.reference(load, **shape, active_ranks=active), r, active)
            first = eplb.rebalance(load, None, **shape, active_ranks=active)  # no previous placement
            new = first if cur is None else eplb.rebalance(load, cur, **shape, active_ranks=active)
            for policy, pl in (("first", first), ("aware", new)):
                _valid(pl, load, shape, active)
                ratio = eplb.balance(load, pl, r, active) / b_ref
                assert (ratio <= 1 + TIGHT).all(), (seed, shape, step, policy, ratio.max())
            cur = new
