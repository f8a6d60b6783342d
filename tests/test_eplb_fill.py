"""Tier 1: the migration-aware policy's last pass (:mod:`moeshard.eplb.fill`): moved copies
replaced by copies of experts their rank already held, within the layer's limit."""

from __future__ import annotations

import numpy as np
import pytest

from eplb_steps import HIER16, moved_passes_agree, on_moved, pass_saves_copies, peak_of
from moeshard import Placement, eplb
from moeshard.cli.bench.traces import zipf_trace
from moeshard.eplb.fill import fill_held
from moeshard.eplb.metrics import held_by_rank, moves3

# Two ranks of three slots, one layer. Old: rank 0 holds 0, 1, 2; rank 1 holds 0, 3. The answer
# to fill moved a copy of expert 1 (two copies) onto rank 1.
OLD = np.array([[[0, 1, 2], [0, 3, 3]]])
NEW = np.array([[[0, 1, 2], [0, 3, 1]]])


def test_fill_replaces_a_moved_copy_by_a_held_expert():
    """Loads 4, 1, 1, 2: the answer's ranks carry 3.5 and 4.5, one copy moved. One more copy of
    expert 3 (rank 1 holds it) instead of expert 1's moved copy: 4 and 4, nothing moved (a
    copy of expert 0 instead would put 4.67 on rank 1, over the limit)."""
    w = [[4.0, 1.0, 1.0, 2.0]]
    out = on_moved(fill_held, w, NEW, OLD, [4.5], [0, 0])
    held = held_by_rank(OLD, 4)
    assert moves3(held, NEW)[0] == 1 and moves3(held, out)[0] == 0
    np.testing.assert_array_equal(out, [[[0, 1, 2], [0, 3, 3]]])
    np.testing.assert_allclose(peak_of(w, out), [4.0])


def test_fill_takes_the_replacement_within_the_limit():
    """Loads 4, 1, 1, 0.2 (peak 3.5 on rank 0): a third copy of expert 0 on rank 1 keeps every
    rank within 3.5 (3.33, 2.87); one more copy of expert 3 would put 4 on rank 0."""
    w = [[4.0, 1.0, 1.0, 0.2]]
    out = on_moved(fill_held, w, NEW, OLD, [3.5], [0, 0])
    np.testing.assert_array_equal(out, [[[0, 1, 2], [0, 3, 0]]])
    assert peak_of(w, out)[0] <= 3.5


def test_fill_keeps_the_answer_where_no_replacement_fits():
    """Loads 4, 2, 1, 0.2: both replacements put rank 0 over its 4 (4.33, 5): nothing changes;
    a copy that is its expert's only one is never replaced."""
    w = [[4.0, 2.0, 1.0, 0.2]]
    np.testing.assert_array_equal(on_moved(fill_held, w, NEW, OLD, [4.0], [0, 0]), NEW)
    only = np.array([[[0, 2, 2], [0, 3, 1]]])  # expert 1's only copy moved onto rank 1
    np.testing.assert_array_equal(on_moved(fill_held, [[4.0, 1.0, 1.0, 2.0]], only, OLD, [10.0], [0, 0]), only)


def test_fill_checks_each_replacement_against_the_limit():
    """Two nodes of two ranks, each with one moved copy: node 0 as in the first test (the
    replacement leaves 4), node 1 the same shape with loads 4.5, 2.25, 1.125, 0.225, where both
    replacements go over the limit 4.5 (4.875, 5.625). Node 0's is taken, node 1 stays (a
    replacement over the limit taken would put the layer over it)."""
    old = np.array([[[0, 1, 2], [0, 3, 3], [4, 5, 6], [4, 7, 7]]])
    new = np.array([[[0, 1, 2], [0, 3, 1], [4, 5, 6], [4, 7, 5]]])
    w = [[4.0, 1.0, 1.0, 2.0, 4.5, 2.25, 1.125, 0.225]]
    out = on_moved(fill_held, w, new, old, [4.5], [0, 0, 1, 1])
    np.testing.assert_array_equal(out, [[[0, 1, 2], [0, 3, 3], [4, 5, 6], [4, 7, 5]]])
    np.testing.assert_allclose(peak_of(w, out), [4.5])


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
    hier = on_moved(fill_held, w, new, old, [10.0], [0, 0, 1, 1])
    np.testing.assert_array_equal(hier, [[[0, 1], [0, 0], [5, 3], [4, 2]]])
    flat = on_moved(fill_held, w, new, old, [10.0], [0, 0, 0, 0])
    np.testing.assert_array_equal(flat, [[[0, 1], [0, 5], [2, 3], [4, 2]]])
    np.testing.assert_allclose(peak_of(w, hier), [4.0])
    np.testing.assert_allclose(peak_of(w, flat), [3.5])


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
    out = on_moved(fill_held, w, new, old, [4.0], [0, 1, 2])
    np.testing.assert_array_equal(out, new)
    # expert 0 on two nodes, two copies: each replacement alone fits, both leave it no copy
    old = np.array([[[1, 1], [2, 2]]])
    new = np.array([[[1, 0], [2, 0]]])
    out = on_moved(fill_held, [[4.0, 1.0, 1.0]], new, old, [5.0], [0, 1])
    np.testing.assert_array_equal(out, new)


@pytest.mark.parametrize("groups, seed", [(8, 1), (None, 2)])
def test_aware_policy_moves_fewer_copies_with_fill(groups, seed, monkeypatch):
    """Over a drifting trace (1 % over the oblivious answer per layer), the aware policy with
    the pass moves no more copies per layer than without it and fewer in all; every layer
    within the limit (checked by ``eplb.balance``), each answer a valid placement (groups on
    one node each), and the move caps still apply to it (a zero cap moves nothing, a cap per
    rank holds). The global policy's answers leave it less to do (all ranks near the limit): a
    trace where it saves some."""
    cfg = dict(HIER16, num_groups=groups)
    kw = dict(tolerance=0.01, relative_to="oblivious")

    def caps_hold(load, cur, new):
        assert eplb.rank_loads(load, new, 16).shape == (8, 16)
        assert eplb.rebalance(load, cur, **cfg, **kw, max_moves=0) == cur
        capped = eplb.rebalance(load, cur, **cfg, **kw, max_moves_per_rank=1, partial=True)
        received = eplb.move_pairs(cur, capped, 16).sum(0)
        assert received.max() <= 1, received

    trace = zipf_trace(8, 128, 4, seed=seed, alpha=1.2, drift=0.1)
    assert pass_saves_copies(monkeypatch, "fill_held", cfg, trace, caps_hold) > 0


def test_fill_result_loads_as_a_placement():
    """An answer with two copies of an expert on a rank (the pass's duplicates) is a valid
    ``Placement`` whose ``rank_loads`` count both copies."""
    out = on_moved(fill_held, [[4.0, 1.0, 1.0, 2.0]], NEW, OLD, [4.5], [0, 0])
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
    changed = moved_passes_agree(monkeypatch, "fill_rounds", fill_held, seed=5)
    assert changed > 200, changed
