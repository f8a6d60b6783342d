"""Tier 1: the migration-aware policy's count candidates of near-full nodes
(:func:`moeshard.eplb.aware.hot_counts`, :func:`moeshard.eplb.aware.lean_counts`, the old
counts capped under the limit), the fallback's hot-spread counts and the sticky packing's
second copies on ranks that held the expert (``sticky_pack(dup_held=)``)."""

from __future__ import annotations

import numpy as np
import pytest

from eplb_steps import aware_moves, compiled_and_numpy, count_calls
from moeshard.cli.bench.traces import zipf_trace
from moeshard.eplb import aware
from moeshard.eplb.sticky import sticky_pack

# DeepSeek-V3's shape: 32 ranks on 4 nodes, 8 groups, 288 slots
V3 = dict(num_physical=288, num_ranks=32, num_nodes=4, num_groups=8)


def _moves_with_and_without(monkeypatch, switch: str, off, seed: int) -> tuple[int, int]:
    """Copies the aware policy moves over a drifting trace at DeepSeek-V3's shape (12 layers,
    3 steps, every step within the limit: ``aware_moves`` checks it) as it is and with
    ``aware.<switch>`` set to ``off``."""
    trace = zipf_trace(12, 256, 4, seed=seed, alpha=1.2, drift=0.1)
    with_it = aware_moves(trace, V3)
    monkeypatch.setattr(aware, switch, off)
    return with_it, aware_moves(trace, V3)


def _moved(old, new):
    """Copies of ``new`` ``int[K, S]`` on a rank that did not hold their expert in ``old``."""
    return sum(int(e not in set(o)) for o, n in zip(old, new) for e in n if e >= 0)


def test_sticky_pack_puts_a_second_copy_on_a_rank_that_held_it():
    """Two ranks of three slots: rank 0 held 0, 1, 2, rank 1 held 3, 4, 5. New counts: experts
    2 and 5 gone, 0 and 3 two copies each (one free slot per rank). Plain sticky packing (at
    most one copy of an expert per rank) must put 0's second copy on rank 1 and 3's on rank 0:
    two moved copies. With ``dup_held`` each goes onto the rank that holds it: nothing moves."""
    old = np.array([[[0, 1, 2], [3, 4, 5]]])
    alive = np.ones((1, 2), dtype=bool)
    cnt = np.array([[2, 1, 0, 2, 1, 0]])
    wc = np.array([[1.0, 1.0, 0.0, 1.0, 1.0, 0.0]])
    thr = np.array([10.0])
    plain = sticky_pack(old, alive, cnt, wc, thr, no_duplicates=False)
    dup = sticky_pack(old, alive, cnt, wc, thr, no_duplicates=False, dup_held=np.array([True]))
    assert _moved(old[0], plain[0]) == 2
    assert _moved(old[0], dup[0]) == 0
    assert sorted(dup[0, 0]) == [0, 0, 1] and sorted(dup[0, 1]) == [3, 3, 4]
    # the counts are the ones asked for
    np.testing.assert_array_equal(np.bincount(dup.ravel(), minlength=6), cnt[0])
    # rows without the flag pack as before
    np.testing.assert_array_equal(
        sticky_pack(old, alive, cnt, wc, thr, no_duplicates=False, dup_held=np.array([False])), plain
    )


def test_hot_counts_variants():
    """One node: experts 0-3 of loads 40, 10, 2, 1 (expert 4 not the node's), counts 4, 2, 1, 1,
    limit 12 (expert 0 needs 4 copies: 40 / 12 > 3). The variants: expert 0 one more (the slot
    from expert 1, whose per-copy load stays lowest); expert 1 one fewer (the slot to a second
    copy of the lightest, 3), which is also expert 3 one more; expert 2 one more (from expert
    1). Not expert 0 fewer or expert 1 more (a copy of expert 0 over 12), each variant once."""
    wr = np.array([[40.0, 10.0, 2.0, 1.0, 5.0]])
    cnt = np.array([[4, 2, 1, 1, 0]])
    rows, var = aware.hot_counts(wr, cnt, np.array([12.0]))
    assert (rows == 0).all()
    assert {tuple(v) for v in var} == {(5, 1, 1, 1, 0), (4, 1, 1, 2, 0), (4, 1, 2, 1, 0)}
    assert len(var) == 3
    # limit 9.5: every variant leaves a copy over it (expert 1 at one copy: 10, or expert 0 at
    # four: 10): none
    rows, var = aware.hot_counts(wr, cnt, np.array([9.5]))
    assert rows.shape == (0,) and var.shape == (0, 5)


def test_aware_hot_count_variants_save_copies(monkeypatch):
    """On a drifting hierarchical trace (16 ranks on 4 nodes, 8 groups) the count variants of
    near-full nodes move fewer copies than the policy without them (255 against 265 over three
    steps), every layer within 1 % of the oblivious answer."""
    trace = zipf_trace(8, 128, 4, seed=1, alpha=1.2, drift=0.1)

    with_variants = aware_moves(trace)
    monkeypatch.setattr(aware, "_HOT_EXPERTS", 0)
    without = aware_moves(trace)
    assert with_variants < without, (with_variants, without)


def test_hot_counts_compiled_equals_numpy(monkeypatch):
    """``hot_counts`` compiled (``aware_kernel.hot_counts``) gives numpy's variants in numpy's
    order (by expert and step, then by row; each once): rows with few experts (fewer than
    ``_HOT_EXPERTS``), integer loads (ties in the heaviest and the lightest), limits under and
    over the heaviest copy; the compiled loop ran (not under ``MOESHARD_EPLB_JIT=0``)."""
    pytest.importorskip("numba")
    from moeshard.eplb import aware_kernel

    monkeypatch.setattr(aware, "_JIT_FROM", 0)
    calls = count_calls(monkeypatch, aware_kernel, "hot_counts")
    rng = np.random.default_rng(3)
    total = 0
    for trial in range(24):
        num_b, num_e = int(rng.integers(1, 60)), int(rng.choice([3, 5, 16, 64]))
        cnt = rng.integers(0, 5, (num_b, num_e))
        cnt[:, 0] = np.maximum(cnt[:, 0], 1)
        wr = rng.integers(1, 12, (num_b, num_e)).astype(np.float64) if trial % 2 else rng.random((num_b, num_e)) * 10
        thr = (wr / np.maximum(cnt, 1)).max(1) * rng.choice([0.8, 1.0, 1.3, 2.0], num_b)
        got = compiled_and_numpy(monkeypatch, lambda: aware.hot_counts(wr, cnt, thr))
        for a, b in zip(got["compiled"], got["numpy"]):
            np.testing.assert_array_equal(a, b, err_msg=f"trial {trial}")
        total += len(got["numpy"][0])
    assert len(calls) == 24 and total > 300


def test_aware_second_copies_on_held_ranks_save_copies(monkeypatch):
    """Every candidate's sticky packing puts copies beyond a rank's old ones on ranks that held
    the expert (``_DUP_HELD``): over a drifting trace at DeepSeek-V3's shape (12 layers) the
    policy moves fewer copies than with second copies only in the count variants, every step
    within the limit (``aware_moves`` checks it)."""
    with_dup, without = _moves_with_and_without(monkeypatch, "_DUP_HELD", False, seed=5)
    assert with_dup < without, (with_dup, without)


def test_fallback_packs_a_near_full_node_with_hot_spread_counts():
    """The aware policy's fallback packing (``oblivious.group_packs``) chooses per node among
    the reference's, spread and hot-spread counts. DeepSeek-V3's shape, a drifting trace's layer
    42 with the groups kept where they were: node 0 carries 99.7 % of what its ranks may at the
    limit (1 % over the oblivious answer); the reference's and spread counts pack it 31 % over
    the limit, hot-spread counts within it, so the groups need not move (each a group's 32+
    copies)."""
    from moeshard import eplb
    from moeshard.eplb.inputs import check_shape
    from moeshard.eplb.metrics import copy_counts, rank_loads3
    from moeshard.eplb.oblivious import group_packs

    trace = zipf_trace(58, 256, 2, seed=0, alpha=1.2, drift=0.1)
    old = eplb.rebalance(trace[0], **V3, migration_aware=False).phy2log.reshape(58, 4, 72)[42]
    w = trace[1][42:43]
    gn = np.zeros((1, 8), dtype=np.int64)
    for node in range(4):
        gn[0, np.unique(old[node] // 32)] = node
    limit = eplb.rank_loads(w, eplb.rebalance(w, **V3, migration_aware=False), 32).max() * 1.01
    node_load = w[0].reshape(8, 32).sum(1)
    assert node_load[gn[0] == 0].sum() / (8 * limit) > 0.995
    packs = group_packs(w, check_shape(w, 288, 32, 4, 8, None), gn).reshape(1, 32, 9)
    loads = rank_loads3(w, packs, copy_counts(packs, 256))
    assert loads.max() <= limit, loads.max() / limit


def test_aware_counts_capped_under_the_limit_save_copies(monkeypatch):
    """Where a node's old counts leave a copy over the limit (a drifted hot expert), the
    candidate of the old counts capped at ``_CAP_OF_LIMIT`` of the limit gives the hot expert
    about the copies it needs: over a drifting trace at DeepSeek-V3's shape (12 layers) the
    policy moves fewer copies with it than without, every step within the limit."""
    with_cap, without = _moves_with_and_without(monkeypatch, "_CAP_OF_LIMIT", None, seed=6)
    assert with_cap < without, (with_cap, without)


def test_lean_counts():
    """One node: experts 0-4 of loads 40, 10, 2, 1, 1 (expert 5 not the node's), 3 slots per
    rank, limit 12. A rank with a copy also holds two others, at least the two lightest (1 + 1):
    room 10, so the fewest copies are 4, 1, 1, 1, 1 (40 / 10 = 4 fits exactly). Of 12 slots the
    4 left go one each to the lightest: experts 3, 4 (ties by id), 2, 1. With 7 slots the
    fewest copies (8) do not fit, and at limit 2 no copy has room: those rows keep ``cnt``."""
    wr = np.array([[40.0, 10.0, 2.0, 1.0, 1.0, 5.0]] * 3)
    cnt = np.array([[3, 3, 2, 2, 2, 0]] * 3)
    got, ok = aware.lean_counts(wr[:1], cnt[:1], np.array([12.0]), 3, 12)
    assert ok.tolist() == [True]
    assert got.tolist() == [[4, 2, 2, 2, 2, 0]]
    got, ok = aware.lean_counts(wr[:2], cnt[:2], np.array([12.0, 12.0]), 3, 7)
    assert ok.tolist() == [False, False] and (got == cnt[:2]).all()
    got, ok = aware.lean_counts(wr, cnt, np.array([12.0, 2.0, 12.0]), 3, 12)
    assert ok.tolist() == [True, False, True]
    assert got.tolist() == [[4, 2, 2, 2, 2, 0], [3, 3, 2, 2, 2, 0], [4, 2, 2, 2, 2, 0]]


def test_aware_lean_counts_save_copies(monkeypatch):
    """Near-full nodes also try lean counts (``lean_counts``): the hot experts get the copies
    they need, the other slots second copies of the lightest experts on the ranks that hold
    them. Over a drifting trace at DeepSeek-V3's shape (12 layers) the policy moves fewer copies
    with them than without (1,049 against 1,116), every step within the limit."""
    with_lean, without = _moves_with_and_without(monkeypatch, "_LEAN", False, seed=6)
    assert with_lean < without, (with_lean, without)
