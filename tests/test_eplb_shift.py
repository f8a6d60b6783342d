"""Tier 1: the migration-aware policy's shift pass (:mod:`moeshard.eplb.shift`): a moved copy
goes to a rank of its node that held the expert, which drops a copy of an expert with two or
more, and its own slot takes a copy of an expert it held, within the layer's limit."""

from __future__ import annotations

import numpy as np
import pytest

from eplb_steps import HIER16, moved_passes_agree, on_moved, pass_saves_copies, peak_of
from moeshard.cli.bench.traces import zipf_trace
from moeshard.eplb.metrics import held_by_rank, moves3
from moeshard.eplb.shift import shift_held

# Two ranks of three slots. Old: rank 0 holds 0, 1, 2; rank 1 holds 0, 3. The answer moved
# expert 1's only copy onto rank 1 and gave rank 0 a second copy of expert 0.
OLD = np.array([[[0, 1, 2], [0, 3, 3]]])
NEW = np.array([[[0, 0, 2], [0, 3, 1]]])


def test_shift_takes_a_moved_only_copy_back_to_its_old_rank():
    """Loads 3, 1, 1, 2 (ranks 3 and 4): expert 1's copy cannot be dropped (its only one), but
    it can go back to rank 0, which drops one of its copies of expert 0 (three copies), while
    rank 1 takes a second copy of expert 3, which it held: 3.5 and 3.5, nothing moves."""
    w = [[3.0, 1.0, 1.0, 2.0]]
    out = on_moved(shift_held, w, NEW, OLD, [4.0], [0, 0])
    held = held_by_rank(OLD, 4)
    assert moves3(held, NEW)[0] == 1 and moves3(held, out)[0] == 0
    np.testing.assert_array_equal(out, [[[1, 0, 2], [0, 3, 3]]])
    np.testing.assert_allclose(peak_of(w, out), [3.5])


def test_shift_keeps_the_answer_where_the_limit_forbids_it():
    """Loads 3, 1, 1, 0.2: the shift would put 3.5 on rank 0 (expert 0 split in two, not three),
    over the limit 3 the answer keeps: nothing changes."""
    w = [[3.0, 1.0, 1.0, 0.2]]
    np.testing.assert_array_equal(on_moved(shift_held, w, NEW, OLD, [3.0], [0, 0]), NEW)
    assert on_moved(shift_held, w, NEW, OLD, [3.5], [0, 0])[0, 1, 2] == 3  # at 3.5 it fits


def test_shift_stays_on_the_experts_node():
    """Four ranks: expert 4 (held by rank 2) was moved onto rank 1. Where any expert may be on
    any rank, it goes back to rank 2 (which drops one of its two copies of expert 3) and rank 1
    takes a copy of expert 0, which it held: nothing moves. With ranks 0-1 and 2-3 on two
    nodes, rank 2 is on another node than the copy: nothing changes."""
    old = np.array([[[0, 1], [0, 2], [3, 4], [3, 5]]])
    new = np.array([[[0, 1], [2, 4], [3, 3], [3, 5]]])
    w = np.ones((1, 6))
    flat = on_moved(shift_held, w, new, old, [10.0], [0, 0, 0, 0])
    np.testing.assert_array_equal(flat, [[[0, 1], [2, 0], [4, 3], [3, 5]]])
    assert moves3(held_by_rank(old, 6), flat)[0] == 0
    np.testing.assert_array_equal(on_moved(shift_held, w, new, old, [10.0], [0, 0, 1, 1]), new)


def test_shift_compiled_equals_numpy(monkeypatch):
    """The compiled rounds (``fill_kernel.shift_rounds``) make exactly numpy's shifts on seeded
    instances: 2, 3 and 9 slots per rank, one to four nodes, dead ranks, integer loads (ties)
    and limits at the answer's peak or above; the compiled path ran, and shifts happened."""
    pytest.importorskip("numba")
    changed = moved_passes_agree(monkeypatch, "shift_rounds", shift_held, seed=7)
    assert changed > 100, changed


@pytest.mark.parametrize("groups, seed", [(8, 1), (None, 0)])
def test_aware_policy_moves_fewer_copies_with_shift(groups, seed, monkeypatch):
    """Over a drifting trace (1 % over the oblivious answer per layer), the aware policy with
    the pass moves no more copies per layer than without it and fewer in all; every layer
    within the limit, each answer a valid placement (groups on one node each). The global
    policy leaves the pass less to do (all ranks near the limit): a trace where it saves some."""
    trace = zipf_trace(8, 128, 4, seed=seed, alpha=1.2, drift=0.1)
    assert pass_saves_copies(monkeypatch, "shift_held", dict(HIER16, num_groups=groups), trace) > 0
