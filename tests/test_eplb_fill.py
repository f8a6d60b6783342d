"""Tier 1: the migration-aware policy's last pass (:mod:`moeshard.eplb.fill`): moved copies
replaced by copies of experts their rank already held, within the layer's limit."""

from __future__ import annotations

import numpy as np
import pytest

from eplb_steps import compiled_and_numpy, count_calls, random_moved_instance
from moeshard import Placement, eplb
from moeshard.cli.bench.traces import zipf_trace
from moeshard.eplb.fill import fill_held
from moeshard.eplb.metrics import held_by_rank, moves3, rank_loads3
from test_eplb_budget_caps import check_valid


def _fill(w, new, old, thr, node_of_rank):
    w, new, old = np.asarray(w, float), np.asarray(new), np.asarray(old)
    return fill_held(w, new, old, held_by_rank(old, w.shape[1]), np.asarray(thr, float), np.asarray(node_of_rank))


def _peak(w, p2l):
    w = np.asarray(w, float)
    cnt = np.stack([np.bincount(p[p >= 0], minlength=w.shape[1]) for p in p2l.reshape(len(w), -1)])
    return rank_loads3(w, p2l, cnt).max(1)


# Two ranks of three slots, one layer. Old: rank 0 holds 0, 1, 2; rank 1 holds 0, 3. The answer
# to fill moved a copy of expert 1 (two copies) onto rank 1.
OLD = np.array([[[0, 1, 2], [0, 3, 3]]])
NEW = np.array([[[0, 1, 2], [0, 3, 1]]])


def test_fill_replaces_a_moved_copy_by_a_held_expert():
    """Loads 4, 1, 1, 2: the answer's ranks carry 3.5 and 4.5, one copy moved. One more copy of
    expert 3 (rank 1 holds it) instead of expert 1's moved copy: 4 and 4, nothing moved (a
    copy of expert 0 instead would put 4.67 on rank 1, over the limit)."""
    w = [[4.0, 1.0, 1.0, 2.0]]
    out = _fill(w, NEW, OLD, [4.5], [0, 0])
    held = held_by_rank(OLD, 4)
    assert moves3(held, NEW)[0] == 1 and moves3(held, out)[0] == 0
    np.testing.assert_array_equal(out, [[[0, 1, 2], [0, 3, 3]]])
    np.testing.assert_allclose(_peak(w, out), [4.0])


def test_fill_takes_the_replacement_within_the_limit():
    """Loads 4, 1, 1, 0.2 (peak 3.5 on rank 0): a third copy of expert 0 on rank 1 keeps every
    rank within 3.5 (3.33, 2.87); one more copy of expert 3 would put 4 on rank 0."""
    w = [[4.0, 1.0, 1.0, 0.2]]
    out = _fill(w, NEW, OLD, [3.5], [0, 0])
    np.testing.assert_array_equal(out, [[[0, 1, 2], [0, 3, 0]]])
    assert _peak(w, out)[0] <= 3.5


def test_fill_keeps_the_answer_where_no_replacement_fits():
    """Loads 4, 2, 1, 0.2: both replacements put rank 0 over its 4 (4.33, 5): nothing changes;
    a copy that is its expert's only one is never replaced."""
    w = [[4.0, 2.0, 1.0, 0.2]]
    np.testing.assert_array_equal(_fill(w, NEW, OLD, [4.0], [0, 0]), NEW)
    only = np.array([[[0, 2, 2], [0, 3, 1]]])  # expert 1's only copy moved onto rank 1
    np.testing.assert_array_equal(_fill([[4.0, 1.0, 1.0, 2.0]], only, OLD, [10.0], [0, 0]), only)


def test_fill_checks_each_replacement_against_the_limit():
    """Two nodes of two ranks, each with one moved copy: node 0 as in the first test (the
    replacement leaves 4), node 1 the same shape with loads 4.5, 2.25, 1.125, 0.225, where both
    replacements go over the limit 4.5 (4.875, 5.625). Node 0's is taken, node 1 stays (a
    replacement over the limit taken would put the layer over it)."""
    old = np.array([[[0, 1, 2], [0, 3, 3], [4, 5, 6], [4, 7, 7]]])
    new = np.array([[[0, 1, 2], [0, 3, 1], [4, 5, 6], [4, 7, 5]]])
    w = [[4.0, 1.0, 1.0, 2.0, 4.5, 2.25, 1.125, 0.225]]
    out = _fill(w, new, old, [4.5], [0, 0, 1, 1])
    np.testing.assert_array_equal(out, [[[0, 1, 2], [0, 3, 3], [4, 5, 6], [4, 7, 5]]])
    np.testing.assert_allclose(_peak(w, out), [4.5])


def test_fill_keeps_experts_on_their_node():
    """Four ranks on two nodes: rank 1 held expert 5, whose copy is now on node 1 (its group
    moved). Replacing the moved copy of expert 1 on rank 1 by expert 5 would leave the lightest
    heaviest rank (2.5 against 4), but expert 5 is not on rank 1's node: expert 0 (held, on the
    node) is taken instead; where any expert may be on any rank (the global policy), expert 5,
    and then expert 5's moved copy on rank 2 (no longer its only one) goes back to expert 2:
    nothing moves."""
    old = np.array([[[0, 1], [5, 0], [2, 3], [4, 2]]])
    new = np.array([[[0, 1], [0, 1], [5, 3], [4, 2]]])
    w = [[1.0, 1.0, 1.0, 1.0, 1.0, 3.0]]
    hier = _fill(w, new, old, [10.0], [0, 0, 1, 1])
    np.testing.assert_array_equal(hier, [[[0, 1], [0, 0], [5, 3], [4, 2]]])
    flat = _fill(w, new, old, [10.0], [0, 0, 0, 0])
    np.testing.assert_array_equal(flat, [[[0, 1], [0, 5], [2, 3], [4, 2]]])
    np.testing.assert_allclose(_peak(w, hier), [4.0])
    np.testing.assert_allclose(_peak(w, flat), [3.5])


def test_fill_leaves_layers_spanning_nodes_as_they_were_if_wrong():
    """Replacements on different nodes are taken in one round, each checked alone (exact where
    every expert's copies are on one node, as in the policies' answers). A layer whose expert
    spans nodes keeps its copies where together they would go over the limit or take the
    expert's last copy."""
    # expert 0 on three one-rank nodes (6 tokens, 2 per copy): each replacement of a moved
    # copy by the rank's held expert alone leaves 4 on the heaviest rank, both 7 on rank 2
    old = np.array([[[1, 1], [2, 2], [0, 3]]])
    new = np.array([[[1, 0], [2, 0], [0, 3]]])
    w = [[6.0, 1.0, 1.0, 1.0]]
    out = _fill(w, new, old, [4.0], [0, 1, 2])
    np.testing.assert_array_equal(out, new)
    # expert 0 on two nodes, two copies: each replacement alone fits, both leave it no copy
    old = np.array([[[1, 1], [2, 2]]])
    new = np.array([[[1, 0], [2, 0]]])
    out = _fill([[4.0, 1.0, 1.0]], new, old, [5.0], [0, 1])
    np.testing.assert_array_equal(out, new)


@pytest.mark.parametrize("groups, seed", [(8, 1), (None, 2)])
def test_aware_policy_moves_fewer_copies_with_fill(groups, seed, monkeypatch):
    """Over a drifting trace (1 % over the oblivious answer per layer), the aware policy with
    the pass moves no more copies per layer than without it and fewer in all; every layer
    within the limit (checked by ``eplb.balance``), each answer a valid placement (groups on
    one node each), and the move caps still apply to it (a zero cap moves nothing, a cap per
    rank holds). The global policy's answers leave it less to do (all ranks near the limit): a
    trace where it saves some."""
    from moeshard.eplb import aware

    cfg = dict(num_physical=144, num_ranks=16, num_nodes=4, num_groups=groups)
    trace = zipf_trace(8, 128, 4, seed=seed, alpha=1.2, drift=0.1)
    cur = eplb.rebalance(trace[0], **cfg, migration_aware=False)
    kw = dict(tolerance=0.01, relative_to="oblivious")
    fewer = 0
    for load in trace[1:]:
        new = eplb.rebalance(load, cur, **cfg, **kw)
        monkeypatch.setattr(aware, "fill_held", lambda w, p2l, *a: p2l)
        without = eplb.rebalance(load, cur, **cfg, **kw)
        monkeypatch.undo()
        check_valid(new, cfg, np.ones(16, dtype=bool))
        obl = eplb.rebalance(load, **cfg, migration_aware=False)
        assert (eplb.balance(load, new, 16) <= eplb.balance(load, obl, 16) * 1.01 * (1 + 1e-12)).all()
        assert eplb.rank_loads(load, new, 16).shape == (8, 16)
        held = held_by_rank(cur.phy2log.reshape(8, 16, 9), 128)
        m_new = moves3(held, new.phy2log.reshape(8, 16, 9))
        m_without = moves3(held, without.phy2log.reshape(8, 16, 9))
        assert (m_new <= m_without).all(), (m_new, m_without)
        fewer += int(m_without.sum() - m_new.sum())
        assert eplb.rebalance(load, cur, **cfg, **kw, max_moves=0) == cur
        capped = eplb.rebalance(load, cur, **cfg, **kw, max_moves_per_rank=1, partial=True)
        received = eplb.move_pairs(cur, capped, 16).sum(0)
        assert received.max() <= 1, received
        cur = new
    assert fewer > 0


def test_fill_result_loads_as_a_placement():
    """An answer with two copies of an expert on a rank (the pass's duplicates) is a valid
    ``Placement`` whose ``rank_loads`` count both copies."""
    out = _fill([[4.0, 1.0, 1.0, 2.0]], NEW, OLD, [4.5], [0, 0])
    pl = Placement(out.reshape(1, -1), num_logical=4, num_ranks=2)
    np.testing.assert_array_equal(pl.logcnt, [[2, 1, 1, 2]])
    np.testing.assert_allclose(eplb.rank_loads([[4.0, 1.0, 1.0, 2.0]], pl, 2), [[4.0, 4.0]])


def test_fill_compiled_equals_numpy(monkeypatch):
    """The compiled rounds (``fill_kernel``) replace exactly the copies numpy's rounds replace,
    on seeded instances: 2 and 9 slots per rank (numpy's sums short and in eight
    accumulators), one or two nodes (the node limit), dead ranks, integer loads (ties between
    replacements) and limits exactly at the answer's peak (a replacement that leaves the peak
    to the bit of numpy's sum fits) or above it; the compiled path ran, and both change many
    copies."""
    pytest.importorskip("numba")
    from moeshard.eplb import fill, fill_kernel

    monkeypatch.setattr(fill, "_JIT_FROM", 0)
    calls = count_calls(monkeypatch, fill_kernel, "fill_rounds")
    rng = np.random.default_rng(5)
    changed = 0
    for trial in range(60):
        num_ranks, s, num_nodes = [(4, 2, 1), (8, 9, 2), (8, 3, 4)][trial % 3]
        w, new, old, node_of_rank = random_moved_instance(rng, num_ranks, s, num_nodes, dead=trial % 2)
        num_e = w.shape[1]
        peak = _peak(w, new)
        thr = peak if trial % 4 == 0 else peak * rng.uniform(1.0, 1.2, len(peak))
        got = compiled_and_numpy(
            monkeypatch, lambda: fill_held(w, new, old, held_by_rank(old, num_e), thr, node_of_rank)
        )
        np.testing.assert_array_equal(got["compiled"], got["numpy"])
        changed += int((got["numpy"] != new).sum())
    assert len(calls) == 60 and changed > 200, (len(calls), changed)
