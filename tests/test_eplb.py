"""Tier 1: EPLB balancing policies (pure numpy): the reference's answer, properties of the
oblivious and migration-aware policies, elastic ranks, metrics, bad inputs."""

from __future__ import annotations

import numpy as np
import pytest

from eplb_steps import compiled_and_numpy, count_calls
from moeshard import Placement, eplb
from moeshard.cli.bench.traces import zipf_trace

try:
    import numba  # noqa: F401  (the fast extra: the compiled swap search)

    HAVE_NUMBA = True
except ImportError:
    HAVE_NUMBA = False
# the swap search's two paths: numpy's, and the compiled one (numba, the fast extra)
SWAP_PATHS = pytest.mark.parametrize(
    "jit", [False, pytest.param(True, marks=pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed"))]
)

README_WEIGHT = np.array(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
# deepseek-ai/EPLB README: rebalance_experts(weight, 16, 4, 2, 8) prints this phy2log.
README_PHY2LOG = np.array(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)


# -- helpers ----------------------------------------------------------------------------------


def _hierarchical(cfg, active) -> bool:
    g, n = cfg["num_groups"], cfg["num_nodes"]
    per_node = active.reshape(n, -1).sum(1)
    return g is not None and g % n == 0 and (per_node == per_node[0]).all()


def _check(pl: Placement, load, cfg, active, duplicates_ok: bool = False, ref: Placement | None = None) -> None:
    """Properties every answer of either policy has (``duplicates_ok``: the aware policy may
    keep the reference's two copies of an expert on one rank; ``ref``: the reference's answer,
    whose duplicates the oblivious policy keeps where the rule would cost balance)."""
    r, p = cfg["num_ranks"], cfg["num_physical"]
    s = p // r
    num_layers, num_logical = load.shape
    assert pl.phy2log.shape == (num_layers, p)
    assert pl.num_ranks == r and pl.num_logical == num_logical
    p2l = pl.phy2log.reshape(num_layers, r, s)
    # empty slots exactly on dead ranks
    assert ((p2l < 0) == ~active[None, :, None]).all()
    assert (pl.logcnt >= 1).all()  # also checked by Placement itself
    hier = _hierarchical(cfg, active)
    n = cfg["num_nodes"] if hier else 1
    live_per_domain = active.reshape(n, -1).sum(1)[0] if hier else active.sum()
    # no two copies of an expert on a rank unless it has more copies than its domain has ranks
    # (or a rank of the reference's answer holds as many copies of it)
    ref_most = np.zeros((num_layers, num_logical + 1), dtype=np.int64)
    if ref is not None:
        for layer, rank in np.ndindex(num_layers, r):
            e, c = np.unique(ref.phy2log.reshape(num_layers, r, s)[layer, rank], return_counts=True)
            ref_most[layer, e] = np.maximum(ref_most[layer, e], c)
    for layer in range(num_layers if not duplicates_ok else 0):
        for rank in np.flatnonzero(active):
            e, c = np.unique(p2l[layer, rank], return_counts=True)
            allowed = np.maximum(np.maximum(1, -(-pl.logcnt[layer, e] // live_per_domain)), ref_most[layer, e])
            assert (c <= allowed).all(), (layer, rank, p2l[layer, rank])
    if hier:
        # every group lives on one node, num_groups / num_nodes groups per node
        g = cfg["num_groups"]
        gsize = num_logical // g
        node_of_slot = np.repeat(np.arange(n), p // n)
        for layer in range(num_layers):
            nodes = [set() for _ in range(g)]
            for slot, e in enumerate(pl.phy2log[layer]):
                if e >= 0:
                    nodes[e // gsize].add(node_of_slot[slot])
            assert all(len(x) == 1 for x in nodes), nodes
            per_node = np.bincount([next(iter(x)) for x in nodes], minlength=n)
            assert (per_node == g // n).all()


def _kept_slots(old: Placement, new: Placement, num_ranks: int) -> bool:
    """An expert held by a rank before and after sits in one of its old slots."""
    s = old.num_physical // num_ranks
    o = old.phy2log.reshape(old.num_layers, num_ranks, s)
    n = new.phy2log.reshape(new.num_layers, num_ranks, s)
    for layer in range(o.shape[0]):
        for rank in range(num_ranks):
            for e in set(o[layer, rank].tolist()) & set(n[layer, rank].tolist()) - {-1}:
                if not ((o[layer, rank] == e) & (n[layer, rank] == e)).any():
                    return False
    return True


CONFIGS = [
    # global, no redundancy
    dict(num_physical=16, num_ranks=4, num_nodes=1, num_groups=None),
    # global, redundant
    dict(num_physical=24, num_ranks=4, num_nodes=2, num_groups=None),
    dict(num_physical=40, num_ranks=8, num_nodes=2, num_groups=None),
    # hierarchical
    dict(num_physical=16, num_ranks=8, num_nodes=2, num_groups=4),
    dict(num_physical=48, num_ranks=8, num_nodes=2, num_groups=4),
    dict(num_physical=72, num_ranks=12, num_nodes=3, num_groups=6),
    # groups that do not divide into nodes: global
    dict(num_physical=24, num_ranks=6, num_nodes=2, num_groups=3),
]
NUM_LOGICAL = {16: 16, 24: 16, 40: 32, 48: 32, 72: 48}


def _loads(rng, num_layers, num_logical, kind):
    if kind == "zipf":
        return zipf_trace(num_layers, num_logical, 1, seed=int(rng.integers(1 << 30)), alpha=1.0)[0]
    if kind == "int":
        return rng.integers(0, 200, size=(num_layers, num_logical))
    return rng.random((num_layers, num_logical)) * 100


# -- the reference --------------------------------------------------------------------------------


def test_readme_example_exact():
    pl = eplb.rebalance(README_WEIGHT, num_physical=16, num_ranks=8, num_nodes=2, num_groups=4, migration_aware=False)
    np.testing.assert_array_equal(pl.phy2log, README_PHY2LOG)
    ref = Placement(README_PHY2LOG, num_logical=12, num_ranks=8)
    np.testing.assert_array_equal(pl.logcnt, ref.logcnt)
    np.testing.assert_allclose(eplb.balance(README_WEIGHT, pl, 8), eplb.balance(README_WEIGHT, ref, 8))
    cfg = dict(num_physical=16, num_ranks=8, num_nodes=2, num_groups=4)
    _check(pl, README_WEIGHT, cfg, np.ones(8, dtype=bool))


def test_readme_example_aware_without_placement_is_oblivious():
    kw = dict(num_physical=16, num_ranks=8, num_nodes=2, num_groups=4)
    assert eplb.rebalance(README_WEIGHT, **kw) == eplb.rebalance(README_WEIGHT, **kw, migration_aware=False)


# -- properties -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: f"P{c['num_physical']}R{c['num_ranks']}N{c['num_nodes']}G{c['num_groups']}"
)
@pytest.mark.parametrize("kind", ["zipf", "int", "uniform"])
def test_policies_properties(cfg, kind):
    rng = np.random.default_rng(hash((cfg["num_physical"], cfg["num_ranks"], kind)) % (1 << 32))
    num_logical = NUM_LOGICAL[cfg["num_physical"]]
    num_layers = 4
    r = cfg["num_ranks"]
    tol = 0.01
    full = np.ones(r, dtype=bool)
    for _trial in range(3):
        load0 = _loads(rng, num_layers, num_logical, kind)
        old = eplb.rebalance(load0, **cfg, migration_aware=False)
        _check(old, load0, cfg, full, ref=eplb.reference(load0, **cfg))
        # a drifted load: some experts change popularity
        load1 = load0 * rng.lognormal(0, 0.3, size=load0.shape)
        obl = eplb.rebalance(load1, old, **cfg, migration_aware=False)
        aware = eplb.rebalance(load1, old, **cfg, tolerance=tol)
        ref = eplb.reference(load1, **cfg)
        _check(obl, load1, cfg, full, ref=ref)
        _check(aware, load1, cfg, full, duplicates_ok=True)
        b_obl, b_aw, b_ref = eplb.balance(load1, obl, r), eplb.balance(load1, aware, r), eplb.balance(load1, ref, r)
        assert (b_obl <= b_ref * (1 + 1e-12)).all(), (b_obl, b_ref)
        assert (b_aw <= b_ref * (1 + tol) * (1 + 1e-12)).all(), (b_aw, b_ref)
        assert eplb.copies_moved(old, aware, r) <= eplb.copies_moved(old, obl, r)
        assert _kept_slots(old, aware, r)
        # the same load again: nothing moves
        first = eplb.rebalance(load0, old, **cfg)
        again = eplb.rebalance(load0, first, **cfg)
        assert eplb.copies_moved(first, again, r) == 0
        assert again == first


@pytest.mark.parametrize(
    "cfg", CONFIGS[1:6], ids=lambda c: f"P{c['num_physical']}R{c['num_ranks']}N{c['num_nodes']}G{c['num_groups']}"
)
def test_dead_ranks_and_scale_up(cfg):
    rng = np.random.default_rng(cfg["num_physical"] * 7 + cfg["num_ranks"])
    num_logical = NUM_LOGICAL[cfg["num_physical"]]
    r, n = cfg["num_ranks"], cfg["num_nodes"]
    s = cfg["num_physical"] // r
    rpn = r // n
    full = np.ones(r, dtype=bool)
    load = _loads(rng, 3, num_logical, "zipf")
    old = eplb.rebalance(load, **cfg, migration_aware=False)
    patterns = []
    one_dead = full.copy()
    one_dead[1] = False
    patterns.append(one_dead)
    if n > 1:
        even = full.copy()
        even[[0, rpn]] = False  # one dead rank per node (2 nodes): hierarchical still possible
        if n == 2:
            patterns.append(even)
    for active in patterns:
        if active.sum() * s < num_logical:
            continue
        ref = eplb.reference(load, **cfg, active_ranks=active)
        for aware in (False, True):
            new = eplb.rebalance(load, old, **cfg, active_ranks=active, migration_aware=aware)
            _check(new, load, cfg, active, duplicates_ok=aware, ref=ref)
        obl = eplb.rebalance(load, old, **cfg, active_ranks=active, migration_aware=False)
        aw = eplb.rebalance(load, old, **cfg, active_ranks=active)
        b_ref = eplb.balance(load, ref, r, active)
        assert (eplb.balance(load, obl, r, active) <= b_ref * (1 + 1e-12)).all()
        assert (eplb.balance(load, aw, r, active) <= b_ref * (1 + 1e-12)).all()
        assert eplb.copies_moved(old, aw, r) <= eplb.copies_moved(old, obl, r)
        # most copies of live ranks stay where they are (only the dead ranks' copies move)
        assert eplb.copies_moved(old, aw, r) < eplb.copies_moved(old, obl, r) or eplb.copies_moved(old, obl, r) == 0
        # scale-up: the dead ranks come back empty and are filled again
        up = eplb.rebalance(load, aw, **cfg)
        _check(up, load, cfg, full, duplicates_ok=True)
        assert (up.phy2log.reshape(3, r, s)[:, ~active] >= 0).all()
        b_up = eplb.balance(load, up, r)
        assert (b_up <= eplb.balance(load, eplb.reference(load, **cfg), r) * (1 + 1e-12)).all()


def test_placement_none_and_balanced_answer_move_nothing():
    cfg = dict(num_physical=48, num_ranks=8, num_nodes=2, num_groups=4)
    load = zipf_trace(5, 32, 1, seed=3)[0]
    obl = eplb.rebalance(load, **cfg, migration_aware=False)
    assert eplb.rebalance(load, None, **cfg) == obl
    # an answer within the limit (the aware policy's own) stays as it is
    aw = eplb.rebalance(load, obl, **cfg)
    assert eplb.rebalance(load, aw, **cfg) == aw
    assert eplb.copies_moved(aw, eplb.rebalance(load, aw, **cfg), 8) == 0
    assert eplb.slots_changed(aw, eplb.rebalance(load, aw, **cfg)) == 0
    # the reference's answer too where it is the better oblivious answer in every layer
    ref = eplb.reference(load, **cfg)
    if (eplb.balance(load, ref, 8) <= eplb.balance(load, obl, 8)).all():
        assert eplb.rebalance(load, ref, **cfg) == ref


def test_from_contiguous_placement():
    cfg = dict(num_physical=40, num_ranks=8, num_nodes=2, num_groups=None)
    load = zipf_trace(3, 32, 1, seed=5)[0]
    old = Placement.contiguous(3, 32, 8, num_redundant=8)
    aw = eplb.rebalance(load, old, **cfg)
    obl = eplb.rebalance(load, old, **cfg, migration_aware=False)
    _check(aw, load, cfg, np.ones(8, dtype=bool), duplicates_ok=True)
    assert (eplb.balance(load, aw, 8) <= eplb.balance(load, eplb.reference(load, **cfg), 8) * (1 + 1e-12)).all()
    assert eplb.copies_moved(old, aw, 8) <= eplb.copies_moved(old, obl, 8)
    assert _kept_slots(old, aw, 8)


@pytest.mark.parametrize("hier, tol, most", [(True, 0.0, 0.3), (False, 0.01, 0.3), (False, 0.0, 0.5)])
def test_drifting_load_moves_few_copies(hier, tol, most):
    """Over a drifting trace, the aware policy moves a small fraction of what the oblivious
    one moves, at a balance within ``tol`` of the reference's per layer (the global policy,
    whose ranks are all near the limit, needs more moves to match it exactly)."""
    cfg = dict(num_physical=144, num_ranks=16, num_nodes=2, num_groups=8 if hier else None)
    trace = zipf_trace(8, 128, 6, seed=11, alpha=1.0, drift=0.1)
    cur_o = cur_a = eplb.rebalance(trace[0], **cfg, migration_aware=False)
    moved_o = moved_a = 0
    for load in trace[1:]:
        o = eplb.rebalance(load, cur_o, **cfg, migration_aware=False)
        a = eplb.rebalance(load, cur_a, **cfg, tolerance=tol)
        b_ref = eplb.balance(load, eplb.reference(load, **cfg), 16)
        assert (eplb.balance(load, a, 16) <= b_ref * (1 + tol) * (1 + 1e-12)).all()
        moved_o += eplb.copies_moved(cur_o, o, 16)
        moved_a += eplb.copies_moved(cur_a, a, 16)
        cur_o, cur_a = o, a
    assert moved_a <= most * moved_o, (moved_a, moved_o)


def test_capped_counts():
    """The old counts capped at replicate_experts' heaviest copy: the copies still fill the
    slots, every expert keeps one, no copy is over the cap, and fewer counts change than with
    replicate_experts' own counts."""
    from moeshard.eplb.aware import capped_counts
    from moeshard.eplb.oblivious import replicate_experts

    rng = np.random.default_rng(5)
    w = zipf_trace(6, 32, 1, seed=2, alpha=1.2)[0] * rng.lognormal(0, 0.5, size=(6, 32))
    old = 1 + rng.multinomial(8, np.ones(32) / 32, size=6)  # 40 slots, counts unrelated to w
    _, repl = replicate_experts(w, 40)
    cap = (w / repl).max(1)
    for factor in (1.0, 1.3):
        c = capped_counts(w, old, cap * factor)
        assert (c.sum(1) == 40).all() and (c >= 1).all()
        assert ((w / c).max(1) <= cap * factor * (1 + 1e-9)).all()
        assert (np.maximum(c - old, 0).sum(1) <= np.maximum(repl - old, 0).sum(1)).all()
    # counts already within the cap do not change
    np.testing.assert_array_equal(capped_counts(w, repl, cap), repl)


@pytest.mark.parametrize("groups", [None, 8])
def test_capped_counts_candidate_moves_no_more(groups, monkeypatch):
    """The capped-counts candidate (old counts where a drifted hot expert has too few copies)
    is one more candidate per node (the node takes the one that moves fewest copies): over a
    drifting trace, per layer no more moved copies than without it and fewer on some layers,
    at the same balance guarantee."""
    from moeshard.eplb import aware
    from moeshard.eplb.metrics import held_by_rank, moves3

    cfg = dict(num_physical=144, num_ranks=16, num_nodes=2, num_groups=groups)
    trace = zipf_trace(8, 128, 3, seed=11, alpha=1.2, drift=0.1)
    cur = eplb.rebalance(trace[0], **cfg, migration_aware=False)
    fewer = 0
    for load in trace[1:]:
        new = eplb.rebalance(load, cur, **cfg)
        monkeypatch.setattr(aware, "_CAP_OVER_REPLICATE", np.inf)
        without = eplb.rebalance(load, cur, **cfg)
        monkeypatch.undo()
        _check(new, load, cfg, np.ones(16, dtype=bool), duplicates_ok=True)
        b_ref = eplb.balance(load, eplb.reference(load, **cfg), 16)
        assert (eplb.balance(load, new, 16) <= b_ref * (1 + 1e-12)).all()
        held = held_by_rank(cur.phy2log.reshape(8, 16, 9), 128)
        m_new = moves3(held, new.phy2log.reshape(8, 16, 9))
        m_without = moves3(held, without.phy2log.reshape(8, 16, 9))
        assert (m_new <= m_without).all(), (m_new, m_without)
        fewer += int((m_new < m_without).sum())
        cur = new
    assert fewer > 0


def test_lower_peak():
    """The swap local search: each row's heaviest rank never rises (and drops on most rows of
    an LPT-like start), a node's copies stay on the node, each rank keeps its slot count, a
    cap that held still holds."""
    from moeshard.eplb.refine import lower_peak

    rng = np.random.default_rng(4)
    num_b, num_n, num_k, num_s, num_e = 20, 2, 4, 3, 12
    wc = rng.random((num_b, num_e)) * 100
    packs = np.stack(
        [
            rng.permutation(np.r_[np.arange(num_e), rng.integers(num_e, size=num_n * num_k * num_s - num_e)])
            for _ in range(num_b)
        ]
    ).reshape(num_b, num_n, num_k, num_s)
    packs[0, 1, 2, 1] = -1  # an empty slot stays empty
    bi = np.arange(num_b)[:, None, None, None]

    def peak(p):
        return np.where(p >= 0, wc[bi, np.maximum(p, 0)], 0.0).sum(-1).reshape(num_b, -1).max(1)

    for cap in (None, np.full((num_b, num_e), 2)):
        if cap is not None:  # a start within the cap: distinct experts per rank
            packs = np.stack([rng.permutation(num_e)[: num_k * num_s] for _ in range(num_b * num_n)])
            packs = packs.reshape(num_b, num_n, num_k, num_s)
        new = packs.copy()
        swaps = lower_peak(new, wc, cap)
        assert (peak(new) <= peak(packs)).all() and (peak(new) < peak(packs)).sum() >= (swaps > 0).sum() > 0
        assert ((new < 0) == (packs < 0)).all()
        np.testing.assert_array_equal(
            np.sort(new.reshape(num_b, num_n, -1), -1), np.sort(packs.reshape(num_b, num_n, -1), -1)
        )
        if cap is not None:
            for b, n, k in np.ndindex(num_b, num_n, num_k):
                assert np.bincount(new[b, n, k], minlength=num_e).max() <= 2


def test_lower_peak_stops_at_a_target():
    """``stop_at``: a row stops at the first round its heaviest rank is at most the target (the
    same swaps as the full search up to there, fewer in all), or where the full search stops."""
    from moeshard.eplb.refine import lower_peak

    rng = np.random.default_rng(5)
    num_b, num_k, num_s, num_e = 30, 8, 4, 40
    wc = rng.random((num_b, num_e)) * 100
    packs = np.stack([rng.permutation(num_e)[: num_k * num_s] for _ in range(num_b)]).reshape(num_b, 1, num_k, num_s)
    bi = np.arange(num_b)[:, None, None, None]

    def peak(p):
        return np.where(p >= 0, wc[bi, np.maximum(p, 0)], 0.0).sum(-1).reshape(num_b, -1).max(1)

    full = packs.copy()
    swaps_full = lower_peak(full, wc)
    target = (peak(packs) + peak(full)) / 2  # between the start and the full search's end
    part = packs.copy()
    swaps_part = lower_peak(part, wc, stop_at=target)
    assert (peak(part) <= target).all()
    assert (swaps_part <= swaps_full).all() and swaps_part.sum() < swaps_full.sum()
    again = packs.copy()
    lower_peak(again, wc, max_rounds=None, stop_at=np.full(num_b, -1.0))  # never reached: the full search
    np.testing.assert_array_equal(again, full)


def test_lower_peak_window_is_exact(monkeypatch):
    """The windowed swap search (copies whose load can lower the peak below the best swap with
    the lightest rank) finds the very swap of the search over every pair, ties included: the
    same packs after the whole search, with and without a cap (two copies of an expert per
    rank, or one: copies of an expert on several ranks that swaps must keep apart), on loads
    with many equal copies (integer loads, zeros, experts with several copies) and empty
    slots; and
    so does the compiled search where numba is installed."""
    from moeshard.eplb import refine

    rng = np.random.default_rng(7)
    num_b, num_n, num_k, num_s, num_e = 24, 2, 8, 3, 20
    for trial in range(9):
        wc = rng.integers(1, 12 if trial % 2 else 400, size=(num_b, num_e)).astype(float)
        wc[rng.random(wc.shape) < 0.1] = 0.0  # experts no token reached
        packs = rng.integers(num_e, size=(num_b, num_n, num_k, num_s))
        packs[rng.random(packs.shape) < 0.05] = -1
        cap = None
        if trial >= 3:  # within a cap of 2 copies of an expert per rank
            packs = np.stack(
                [
                    rng.permutation(np.r_[np.arange(num_e), np.arange(num_e)])[: num_k * num_s]
                    for _ in range(num_b * num_n)
                ]
            )
            packs = packs.reshape(num_b, num_n, num_k, num_s)
            cap = np.full((num_b, num_e), 2)
        if trial >= 6:  # one copy of an expert per rank: each rank's own draw of distinct experts
            packs = np.stack([rng.permutation(num_e)[:num_s] for _ in range(num_b * num_n * num_k)])
            packs = packs.reshape(num_b, num_n, num_k, num_s)
            cap = np.ones((num_b, num_e), dtype=np.int64)
        out = {}
        for name, pairs in (("window", 0), ("dense", 10**12)):
            monkeypatch.setattr(refine, "_DENSE_PAIRS", pairs)
            new = packs.copy()
            out[name] = (new, refine.lower_peak(new, wc, cap, jit=False))
        if HAVE_NUMBA:  # and the compiled search (one row at a time, every pair)
            new = packs.copy()
            out["jit"] = (new, refine.lower_peak(new, wc, cap, jit=True))
        assert out["window"][1].sum() > 0
        for name in out:
            np.testing.assert_array_equal(out[name][1], out["dense"][1])
            np.testing.assert_array_equal(out[name][0], out["dense"][0])
        if trial >= 6:
            flat = out["dense"][0].reshape(-1, num_s)
            assert (np.sort(flat, 1)[:, 1:] != np.sort(flat, 1)[:, :-1]).all()  # the cap held


def test_desc_order_is_the_stable_sort():
    """The heaviest-first order of the packing (integer sort of the floats' bits) is the stable
    argsort of ``-w``: ties first by index, zeros and ``-0.0`` alike, float32 and float64, and
    negative loads (the plain sort)."""
    from moeshard.eplb.oblivious import desc_order

    rng = np.random.default_rng(9)
    for dtype in (np.float64, np.float32):
        w = rng.integers(0, 6, size=(40, 30)).astype(dtype) * rng.choice([1.0, 0.1, 1e-30], size=(40, 1)).astype(dtype)
        w[0, :5] = -0.0
        w[1] = np.inf
        for x in (w, w - 2):
            np.testing.assert_array_equal(desc_order(x), np.argsort(-x, axis=-1, kind="stable"))


def test_lower_peak_without_numba(monkeypatch):
    """Without numba the swap search is numpy's (the same swaps as ``jit=False``), and asking
    for the compiled one (``jit=True``) is a ValueError that says how to install it."""
    from moeshard.eplb import refine

    monkeypatch.setattr(refine, "_KERNEL", [None])  # numba's import failed
    monkeypatch.setattr(refine, "_JIT_FROM", 0)  # compiled wherever numba is there
    rng = np.random.default_rng(13)
    wc = rng.random((6, 30)) * 10
    packs = np.stack([rng.permutation(30)[:12] for _ in range(12)]).reshape(6, 2, 4, 3)
    a, b = packs.copy(), packs.copy()
    np.testing.assert_array_equal(refine.lower_peak(a, wc), refine.lower_peak(b, wc, jit=False))
    np.testing.assert_array_equal(a, b)
    assert (a != packs).any()
    with pytest.raises(ValueError, match="fast"):
        refine.lower_peak(packs.copy(), wc, jit=True)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_compiled_rank_loads_are_numpys_sums():
    """The compiled search sums a rank's slot loads as numpy sums the last axis (pairwise,
    eight accumulators), so the two searches compare the same loads to the
    bit: 1 to 128 slots per rank (more take the numpy search), loads of many magnitudes, zeros."""
    from moeshard.eplb import swap_kernel

    rng = np.random.default_rng(12)
    for num_s in range(1, swap_kernel.MAX_SLOTS + 1):
        w = rng.random((5, num_s)) ** 3 * rng.choice([1e-3, 1.0, 1e6], size=(5, 1))
        w[rng.random(w.shape) < 0.2] = 0.0
        w[0] = 0.0
        np.testing.assert_array_equal(
            swap_kernel.rank_loads(w.reshape(-1), num_s), w.reshape(5, 1, num_s).sum(-1)[:, 0]
        )


@SWAP_PATHS
def test_lower_peak_batched_equals_one_row_at_a_time(monkeypatch, jit):
    """The swap search on many rows at once (numpy: flat arrays, the windowed rounds while
    many rows are left, and the node's sorted copies kept across rounds; or the compiled
    search, ``jit``) makes, on every row, the very swaps of numpy's search on that row alone
    over every pair: seeded Zipf traces replicated and packed as the oblivious policy does (a
    node-grouped shape and a global one of DeepSeek-V3's ranks and slots, and Kimi-K2's 13
    slots per rank: rank loads summed over 8 and more slots), with and without moeshard's
    cap, an empty slot, and a stop target."""
    from moeshard.eplb import refine
    from moeshard.eplb.oblivious import balanced_pack, per_rank_cap, replicate_experts

    def packed(num_rows, num_n, num_k, num_s, num_e, seed):
        w = zipf_trace(num_rows * num_n, num_e, 1, seed=seed, alpha=1.2)[0]
        phy, cnt = replicate_experts(w, num_k * num_s)
        wc = w / cnt
        slots = balanced_pack(np.take_along_axis(wc, phy, 1), phy, num_e, num_k, num_s)
        packs = np.take_along_axis(phy, slots.reshape(len(w), -1), 1).reshape(num_rows, num_n, num_k, num_s)
        # one row of experts per node here: node n of row r packs its own experts (ids shifted)
        wc_rows = wc.reshape(num_rows, num_n * num_e)
        packs = packs + (np.arange(num_n) * num_e)[None, :, None, None]
        cap = per_rank_cap(cnt, np.full(len(w), num_k)).reshape(num_rows, -1)
        return packs, wc_rows, cap

    # DeepSeek-V3: per node of 8 ranks; global; Kimi-K2 global
    cases = [(24, 4, 8, 9, 64, 1), (22, 1, 32, 9, 256, 2), (6, 1, 32, 13, 384, 3)]
    for num_rows, num_n, num_k, num_s, num_e, seed in cases:
        packs, wc, cap = packed(num_rows, num_n, num_k, num_s, num_e, seed)
        packs[0, 0, 1, 2] = -1  # an empty slot never takes part
        stop = np.where(np.arange(num_rows) % 3 == 0, wc.sum(1) / (num_n * num_k) * 1.02, -1.0)
        for c, stop_at in ((None, None), (cap, None), (cap, stop)):
            monkeypatch.setattr(refine, "_DENSE_PAIRS", 0)  # every round of the batch windowed
            batch = packs.copy()
            swaps = refine.lower_peak(batch, wc, c, stop_at=stop_at, jit=jit)
            monkeypatch.setattr(refine, "_DENSE_PAIRS", 10**12)  # one row: every pair
            for r in range(num_rows):
                alone = packs[r : r + 1].copy()
                one = refine.lower_peak(
                    alone,
                    wc[r : r + 1],
                    None if c is None else c[r : r + 1],
                    stop_at=None if stop_at is None else stop_at[r : r + 1],
                    jit=False,
                )
                assert one[0] == swaps[r], (num_n, r)
                np.testing.assert_array_equal(alone[0], batch[r])
            assert swaps.sum() > num_rows


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_rebalance_same_with_and_without_the_compiled_swap_search(monkeypatch):
    """``rebalance`` answers the same placement with the compiled swap search as with numpy's
    (``MOESHARD_EPLB_JIT=0``): DeepSeek-V3's shape hierarchical and global (one rank dead), a
    migration-aware step and one with a move budget, Kimi-K2's shape, FlashLB's example,
    small random instances (two or three slots per rank on 3-8 ranks) and steps of a drifting
    hierarchical trace where count variants of near-full nodes are packed (``dup_held`` rows
    of the compiled sticky packing); the compiled search runs in the first and not in the
    second. By default a toy's search is not compiled."""
    from moeshard.eplb import refine, sticky, sticky_kernel, swap_kernel

    calls = count_calls(monkeypatch, swap_kernel, "swap_search")
    dup_rows = []
    real_pack = sticky_kernel.pack
    monkeypatch.setattr(sticky_kernel, "pack", lambda *a: (dup_rows.append(int(a[-1].sum())), real_pack(*a))[1])
    monkeypatch.delenv("MOESHARD_EPLB_JIT", raising=False)
    dsv3 = dict(num_physical=288, num_ranks=32, num_nodes=4)
    tr = zipf_trace(6, 256, 2, seed=3, alpha=1.2, drift=0.1)
    # by default only searches of a model's size are compiled: a toy's stays numpy's
    eplb.rebalance(README_WEIGHT, num_physical=16, num_ranks=8, num_nodes=2, num_groups=4)
    assert not calls
    eplb.rebalance(tr[0], **dsv3, migration_aware=False)
    assert calls
    monkeypatch.setattr(refine, "_JIT_FROM", 0)  # the small instances' searches compiled too
    monkeypatch.setattr(sticky, "_JIT_FROM", 0)  # and their sticky packings
    alive = np.ones(32, dtype=bool)
    alive[5] = False
    cases = [
        (tr[0], None, dict(dsv3, num_groups=8, migration_aware=False)),
        (tr[0], None, dict(dsv3, migration_aware=False, active_ranks=alive)),
        (zipf_trace(3, 384, 1, seed=4, alpha=1.2)[0], None, dict(num_physical=416, num_ranks=32, num_nodes=4)),
        (np.array([[600, 560, 120, 120, 20, 10, 10, 10]]), None, dict(num_physical=16, num_ranks=8)),
    ]
    start = eplb.rebalance(tr[0], num_groups=8, migration_aware=False, **dsv3)
    cases.append((tr[1], start, dict(dsv3, num_groups=8, tolerance=0.01, relative_to="oblivious")))
    cases.append((tr[1], start, dict(dsv3, num_groups=8, max_moves=20)))
    rng = np.random.default_rng(8)
    for i in range(12):
        ranks, slots = (3, 3) if i % 3 == 0 else (int(rng.integers(3, 9)), 2)
        experts = int(rng.integers(3, min(10, ranks * slots) + 1))
        w = (np.arange(1, experts + 1) ** -rng.uniform(0.5, 1.5)) * 1000 * rng.lognormal(0, 0.2, experts)
        cases.append((w[rng.permutation(experts)][None], None, dict(num_physical=ranks * slots, num_ranks=ranks)))
    # a drifting hierarchical trace, each step from numpy's previous answer
    small = dict(num_physical=144, num_ranks=16, num_nodes=4, num_groups=8, tolerance=0.01, relative_to="oblivious")
    drift = zipf_trace(8, 128, 4, seed=1, alpha=1.2, drift=0.1)
    cur = eplb.rebalance(drift[0], **{k: small[k] for k in list(small)[:4]}, migration_aware=False)
    for load in drift[1:]:
        cases.append((load, cur, small))
        monkeypatch.setenv("MOESHARD_EPLB_JIT", "0")
        cur = eplb.rebalance(load, cur, **small)
    used = 0
    dup_rows.clear()
    for load, cur, cfg in cases:
        monkeypatch.delenv("MOESHARD_EPLB_JIT", raising=False)
        n0 = len(calls)
        fast = eplb.rebalance(load, cur, **cfg)
        n1 = len(calls)
        used += n1 > n0
        monkeypatch.setenv("MOESHARD_EPLB_JIT", "0")
        slow = eplb.rebalance(load, cur, **cfg)
        assert len(calls) == n1  # not under MOESHARD_EPLB_JIT=0
        np.testing.assert_array_equal(fast.phy2log, slow.phy2log)
    assert used >= len(cases) - 2, used
    assert sum(dup_rows) > 100, dup_rows  # the count variants were packed compiled


def test_aware_within_one_percent_of_the_oblivious_answer_moves_few_copies():
    """Held within 1 % of the oblivious answer (hot-spread counts make it much lighter than the
    reference's on hierarchical shapes), the migration-aware policy packs with the oblivious
    answer's counts, refines its sticky packings rather than repacking the nodes and also tries
    the groups kept wherever their node fits and the oblivious answer's groups matched to the
    old nodes (node by node), refills moved copies from the rank's own experts and tries count
    variants of near-full nodes: under 10.7 % of the reference's moves on a drifting
    hierarchical trace (11.06 % without the count variants, 11.3 % without the refills, 11.9 %
    with only the groups of the node fill cap, 17 % with only ``replicate_experts``' and the old
    counts), each layer within the limit."""
    from moeshard.cli.bench.traces import zipf_trace

    cfg = dict(num_physical=144, num_ranks=16, num_nodes=4, num_groups=8)
    trace = zipf_trace(8, 128, 4, seed=1, alpha=1.2, drift=0.1)
    cur = eplb.rebalance(trace[0], **cfg, migration_aware=False)
    ref = eplb.reference(trace[0], **cfg)
    moved = ref_moved = 0
    for load in trace[1:]:
        new = eplb.rebalance(load, cur, **cfg, tolerance=0.01, relative_to="oblivious")
        new_ref = eplb.reference(load, **cfg)
        obl = eplb.rebalance(load, **cfg, migration_aware=False)
        assert (eplb.balance(load, new, 16) <= eplb.balance(load, obl, 16) * 1.01 * (1 + 1e-12)).all()
        moved += eplb.copies_moved(cur, new, 16)
        ref_moved += eplb.copies_moved(ref, new_ref, 16)
        cur, ref = new, new_ref
    assert moved < 0.107 * ref_moved, (moved, ref_moved)


def test_aware_skips_only_candidates_that_cannot_be_taken(monkeypatch):
    """The migration-aware policy packs no (layer, group assignment) whose fewest possible
    moves (``_fewest_moves``: an expert's copy on a node that held none of it is moved) are no
    fewer than a candidate's already within the limit: the bound is never above the moves of
    a placement with those groups (the aware, the oblivious and the reference's answers, dead
    ranks included), candidates are skipped, and the answers are those of packing every
    one (a bound of 0) on a drifting DeepSeek-V3-like trace, per layer and per step."""
    from moeshard.eplb import aware
    from moeshard.eplb.inputs import check_shape
    from moeshard.eplb.metrics import held_by_rank, moves3

    cfg = dict(num_physical=192, num_ranks=16, num_nodes=4, num_groups=8)
    alive = np.ones(16, dtype=bool)
    alive[[3, 6, 9, 12]] = False  # one per node: still the hierarchical policy
    trace = zipf_trace(10, 128, 3, seed=4, alpha=1.2, drift=0.1)
    real, sticky_nodes = aware._fewest_moves, aware._sticky_nodes
    packed = {"real": 0, "zero": 0}  # (layer, assignment)s packed with each bound
    mode = ["real"]

    def counted(w, *args, **kwargs):
        packed[mode[0]] += len(w)
        return sticky_nodes(w, *args, **kwargs)

    monkeypatch.setattr(aware, "_sticky_nodes", counted)

    for extra in (dict(), dict(active_ranks=alive)):
        sh = check_shape(trace[0], 192, 16, 4, 8, extra.get("active_ranks"))
        cur = eplb.rebalance(trace[0], **cfg, migration_aware=False)
        for load in trace[1:]:
            answers = {}
            for bound in ("real", "zero"):
                monkeypatch.setattr(
                    aware, "_fewest_moves", real if bound == "real" else lambda h, g, s: 0 * real(h, g, s)
                )
                mode[0] = bound
                for scope in ("layer", "step"):
                    kw = dict(tolerance=0.01, relative_to="oblivious", tolerance_scope=scope)
                    answers[bound, scope] = eplb.rebalance(load, cur, **cfg, **extra, **kw).phy2log
            for scope in ("layer", "step"):
                np.testing.assert_array_equal(answers["real", scope], answers["zero", scope])
            old3 = np.where(sh.active[None, :, None], cur.phy2log.reshape(len(load), 16, -1), -1)
            held = held_by_rank(old3, 128)
            assert sh.hierarchical
            for p in (
                answers["real", "layer"],  # moves few copies: the bound is tight on many layers
                eplb.rebalance(load, **cfg, **extra, migration_aware=False).phy2log,
                eplb.reference(load, **cfg, **extra).phy2log,
            ):
                p3 = p.reshape(len(load), 16, -1)
                gn = (p3.reshape(len(load), 4, -1) // 16)[..., None] == np.arange(8)
                group_node = gn.any(2).argmax(1)  # [L, G]: the node holding each group
                assert (real(held, group_node, sh) <= moves3(held, p3)).all()
            cur = eplb.Placement(answers["real", "layer"], num_logical=128, num_ranks=16)
    assert packed["real"] < packed["zero"], packed


def test_zero_load_layer():
    cfg = dict(num_physical=24, num_ranks=4)
    load = np.zeros((2, 16))
    load[1] = np.arange(16)
    old = eplb.rebalance(load, **cfg, migration_aware=False)
    assert eplb.balance(load, old, 4)[0] == 1.0
    new = eplb.rebalance(load, old, **cfg)
    assert eplb.copies_moved(old, new, 4) == 0


def test_deterministic():
    cfg = dict(num_physical=72, num_ranks=12, num_nodes=3, num_groups=6)
    trace = zipf_trace(4, 48, 2, seed=1)
    old = eplb.rebalance(trace[0], **cfg, migration_aware=False)
    a = eplb.rebalance(trace[1], old, **cfg)
    b = eplb.rebalance(trace[1].copy(), old, **cfg)
    assert a == b


# -- metrics --------------------------------------------------------------------------------------


def test_metrics():
    load = np.array([[10.0, 20.0, 30.0, 40.0]])
    pl = Placement(np.array([[3, 0, 3, 1, 2, 1]]), num_logical=4, num_ranks=3)  # 3 ranks x 2 slots
    loads = eplb.rank_loads(load, pl, 3)
    np.testing.assert_allclose(loads, [[20 + 10, 20 + 10, 30 + 10]])
    np.testing.assert_allclose(loads.sum(), load.sum())
    np.testing.assert_allclose(eplb.balance(load, pl, 3), [40 / (100 / 3)])
    np.testing.assert_allclose(eplb.balance(load, pl, 3, np.array([True, True, False])), [1.0])
    same = Placement(np.array([[0, 3, 1, 3, 2, 1]]), num_logical=4, num_ranks=3)
    assert eplb.copies_moved(pl, same, 3) == 0  # only local reordering
    assert eplb.slots_changed(pl, same) == 4
    other = Placement(np.array([[3, 2, 3, 1, 0, 1]]), num_logical=4, num_ranks=3)
    assert eplb.copies_moved(pl, other, 3) == 2
    empty = Placement(np.array([[-1, -1, 3, 1, 2, 0]]), num_logical=4, num_ranks=3)
    assert eplb.copies_moved(empty, pl, 3) == 3  # rank 0 had nothing; rank 2 lacked expert 1
    assert eplb.copies_moved(pl, empty, 3) == 1  # rank 2 lacked expert 0; empty slots move nothing
    assert eplb.slots_changed(pl, empty) == 1


# -- bad inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(load=np.ones(8)), "load must be"),
        (dict(load=np.ones((2, 8, 1))), "load must be"),
        (dict(load=-np.ones((2, 8))), "negative"),
        (dict(load=np.full((2, 8), np.nan)), "not finite"),
        (dict(num_physical=10), "not divisible by num_ranks"),
        (dict(num_ranks=3, num_physical=12, num_nodes=2), "not divisible by num_nodes"),
        (dict(num_physical=4, num_ranks=4), "live slots"),
        (dict(active_ranks=np.array([True, False, False, False])), "live slots"),
        (dict(active_ranks=np.ones(3, dtype=bool)), "active_ranks must be"),
        (dict(active_ranks=np.zeros(4, dtype=bool)), "all ranks are dead"),
        (dict(num_groups=3), "equal groups"),
        (dict(placement=Placement.contiguous(2, 9, 4, num_redundant=3)), "num_logical"),
        (dict(placement=Placement.contiguous(2, 8, 4, num_redundant=8)), "num_physical"),
        (dict(placement=Placement.contiguous(3, 8, 4, num_redundant=4)), "layers"),
        (dict(placement=Placement.contiguous(2, 8, 2, num_redundant=4)), "num_ranks"),
        (dict(tolerance=-0.1), "tolerance"),
    ],
)
def test_bad_inputs(kwargs, match):
    args = dict(load=np.ones((2, 8)), placement=None, num_physical=12, num_ranks=4, num_nodes=1)
    args.update(kwargs)
    load = args.pop("load")
    placement = args.pop("placement")
    with pytest.raises(ValueError, match=match):
        eplb.rebalance(load, placement, **args)


def _sticky_rows(seed: int, num_b: int = 80, num_k: int = 4, num_s: int = 3, num_e: int = 6):
    """Small random rows for the sticky searches: ``new``/``old`` ``int[B, K, S]`` (a few empty
    slots), per-copy loads ``float[B, E]`` of a few integer values (ties), caps and thresholds
    near the mean rank load (some ranks over)."""
    from moeshard.eplb.oblivious import per_rank_cap

    rng = np.random.default_rng(seed)
    slots = num_k * num_s

    def fill():
        out = np.empty((num_b, slots), dtype=np.int64)
        for b in range(num_b):
            ids = np.r_[np.arange(num_e), rng.integers(0, num_e, slots - num_e)]
            out[b] = rng.permutation(ids)
        return out

    new, old = fill(), fill()
    new[rng.random(new.shape) < 0.05] = -1
    old[rng.random(old.shape) < 0.05] = -1
    cnt = np.stack([np.bincount(np.maximum(r, 0), minlength=num_e) for r in new])
    wc = rng.integers(1, 5, (num_b, num_e)).astype(np.float64)
    mean = np.where(new >= 0, np.take_along_axis(wc, np.maximum(new, 0), 1), 0.0).sum(1) / num_k
    thr = mean * rng.choice([1.0, 1.1, 1.25], num_b)
    cap = per_rank_cap(cnt, np.full(num_b, num_k))
    return new.reshape(num_b, num_k, num_s), old.reshape(num_b, num_k, num_s), wc, cap, thr


def _swap_repair_one_row(x, old, wc, cap, thr):
    """The swap repair of one row (all ranks live), pair by pair in plain loops."""
    from moeshard.eplb.sticky import EPS

    num_k, num_s = x.shape
    held = {(k, int(e)) for k in range(num_k) for e in old[k] if e >= 0}
    loads = [float(np.where(x[k] >= 0, wc[np.maximum(x[k], 0)], 0.0).sum()) for k in range(num_k)]
    count = lambda k, e: int((x[k] == e).sum())  # noqa: E731
    gone = lambda k, e: int((k, int(e)) not in held)  # noqa: E731
    limit = thr * (1 + EPS)
    for _ in range(num_k):
        if max(loads) <= limit:
            return
        k1 = int(np.argmax(loads))
        l1 = loads[k1]
        best = None
        for sa in range(num_s):
            for k2 in np.argsort(loads, kind="stable"):
                for sb in range(num_s):
                    a, b, l2 = x[k1, sa], x[k2, sb], loads[k2]
                    if a < 0 or b < 0 or l2 > limit or a == b:
                        continue
                    d = wc[a] - wc[b]
                    peak = max(l1 - d, l2 + d)
                    if not (d > 0 and peak < l1 * (1 - EPS)):
                        continue
                    if count(k2, a) >= cap[a] or count(k1, b) >= cap[b]:
                        continue
                    moves = gone(k2, a) + gone(k1, b) - gone(k1, a) - gone(k2, b)
                    score = (moves * 4.0 if peak <= limit else 100.0) + peak / max(thr, 1e-300)
                    if best is None or score < best[0]:
                        best = (score, sa, k2, sb, d)
        if best is None:
            return
        _, sa, k2, sb, d = best
        x[k1, sa], x[k2, sb] = x[k2, sb], x[k1, sa]
        loads[k1] -= d
        loads[k2] += d


def _restore_one_row(x, old, wc, cap, thr, max_rounds=8):
    """:func:`moeshard.eplb.sticky.restore` on one row (first holders only), in plain loops."""
    from moeshard.eplb.sticky import EPS

    num_k, num_s = x.shape
    held = np.zeros((num_k, len(wc)), dtype=bool)
    for k in range(num_k):
        held[k, old[k][old[k] >= 0]] = True
    holder = np.where(held.any(0), held.argmax(0), -1)
    limit, scale = thr * (1 + EPS), 0.5 / max(thr, 1e-300)
    flat = x.reshape(-1)
    for _ in range(max_rounds):
        wx = np.where(flat >= 0, wc[np.maximum(flat, 0)], 0.0)
        loads = wx.reshape(num_k, num_s).sum(-1)
        cands = []
        for p in range(num_k * num_s):
            rp, xp = p // num_s, flat[p]
            if xp < 0 or held[rp, xp] or holder[xp] < 0 or holder[xp] == rp:
                continue
            rq = holder[xp]
            for q in range(rq * num_s, (rq + 1) * num_s):
                xq = flat[q]
                if xq < 0 or xq == xp:
                    continue
                gain = 1 + int(held[rp, xq]) - int(held[rq, xq])
                d = wx[p] - wx[q]
                if gain <= 0 or loads[rp] - d > limit or loads[rq] + d > limit:
                    continue
                if (x[rq] == xp).sum() >= cap[xp] or (x[rp] == xq).sum() >= cap[xq]:
                    continue
                cands.append((gain - abs(d) * scale, rp, rq, p, q))
        if not cands:
            return
        touched = set()
        for _ in range(max(1, num_k // 2)):
            left = [c for c in cands if c[1] not in touched and c[2] not in touched]
            if not left:
                break
            score, rp, rq, p, q = max(left, key=lambda c: c[0])  # the first on ties
            flat[p], flat[q] = flat[q], flat[p]
            touched |= {rp, rq}


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_sticky_loops_compiled_equal_numpy(monkeypatch):
    """The sticky packing and the swap-back search compiled (``sticky_kernel``: the copies
    kept, the evictions, the placement of the rest, the swap repair, ``restore``) make the
    very choices of numpy's on every row, ties, caps and dead ranks included, and with
    ``dup_held`` on some rows (second copies on ranks that held the expert): the same arrays
    with and without ``MOESHARD_EPLB_JIT=0``, and each compiled loop ran (only in the first)."""
    from moeshard.eplb import sticky, sticky_kernel
    from moeshard.eplb.oblivious import per_rank_cap

    calls = {}
    for name in ("pack", "swap_repair", "restore"):
        real = getattr(sticky_kernel, name)
        monkeypatch.setattr(sticky_kernel, name, lambda *a, _f=real, _n=name: (calls.update({_n: 1}), _f(*a))[1])
    monkeypatch.setattr(sticky, "_JIT_FROM", 0)
    for seed in range(4):
        rng = np.random.default_rng(seed)
        num_b, num_k, num_s, num_e = 150, 6, 4, 10
        _, old, _, _, _ = _sticky_rows(seed, num_b, num_k, num_s, num_e)
        alive = np.ones((num_b, num_k), dtype=bool)
        alive[np.arange(num_b), rng.integers(0, num_k, num_b)] = rng.random(num_b) > 0.3  # a dead rank in some rows
        live = alive.sum(1) * num_s
        cnt = np.stack(
            [np.bincount(np.r_[np.arange(num_e), rng.integers(0, num_e, n - num_e)], minlength=num_e) for n in live]
        )
        w = rng.integers(1, 30, (num_b, num_e)).astype(np.float64)
        wc = w / cnt
        thr = w.sum(1) / alive.sum(1) * rng.choice([0.9, 1.0, 1.05, 1.2], num_b)
        dup = rng.random(num_b) < 0.5
        got = {}
        for mode in ("compiled", "numpy"):
            calls.clear()
            monkeypatch.setenv("MOESHARD_EPLB_JIT", "1" if mode == "compiled" else "0")
            packed = [sticky.sticky_pack(old, alive, cnt, wc, thr, no_duplicates=nd) for nd in (False, True)]
            back = packed[0].copy()
            sticky.restore(back, old, alive, wc, per_rank_cap(cnt, alive.sum(1)), thr)
            dh = [sticky.sticky_pack(old, alive, cnt, wc, thr, no_duplicates=nd, dup_held=dup) for nd in (False, True)]
            got[mode] = (*packed, back, *dh)
            assert len(calls) == (3 if mode == "compiled" else 0), calls
        for a, b in zip(got["compiled"], got["numpy"]):
            np.testing.assert_array_equal(a, b, err_msg=f"seed {seed}")
        assert (got["numpy"][2] != got["numpy"][0]).any()  # swaps back happened
        # dup_held changed the placement of some of its rows, none of the others
        changed = (got["numpy"][3] != got["numpy"][0]).any(axis=(1, 2))
        assert changed[dup].sum() >= 5 and not changed[~dup].any()
        assert (np.where(alive[:, :, None], old, -1) != got["numpy"][0]).any(axis=(1, 2)).mean() > 0.5


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_load_loops_compiled_equal_numpy(monkeypatch):
    """Copy counts, id counts, rank loads (per-copy loads summed over a rank's slots), slot
    sums, moved copies and the most copies of an expert on one rank compiled (``load_kernel``)
    give numpy's arrays to the bit: empty slots, counts of 0, loads of many magnitudes and
    zeros, 1 to 12 slots per rank, rows of other layers; and each compiled loop ran (only with
    the compiled loops allowed)."""
    from moeshard.eplb import aware, load_kernel, metrics

    monkeypatch.setattr(metrics, "_JIT_FROM", 0)
    names = ("copy_counts", "count_last", "rank_loads", "slot_sums", "moved_per_rank", "at_least_held")
    calls = {n: count_calls(monkeypatch, load_kernel, n) for n in names}
    for seed in range(12):
        rng = np.random.default_rng(seed)
        num_l, num_r, num_s, num_e = 7, 5, seed + 1, 11
        p2l = rng.integers(-1, num_e, (num_l, num_r, num_s))
        p2l[rng.random(p2l.shape) < 0.2] = -1
        w = rng.random((num_l, num_e)) ** 3 * rng.choice([1e-3, 1.0, 1e6], size=(num_l, 1))
        w[rng.random(w.shape) < 0.2] = 0.0
        cnt = metrics.copy_counts(p2l, num_e)
        cnt[rng.random(cnt.shape) < 0.1] = 0  # a count of 0: its copies carry nothing
        held = metrics.held_by_rank(rng.integers(-1, num_e, (num_l, num_r, num_s)), num_e)
        layers = rng.integers(0, num_l, num_l)
        for n in names:
            calls[n].clear()

        def run(p2l=p2l, w=w, cnt=cnt, held=held, layers=layers):
            cap = np.ones((num_l, num_e), dtype=np.int64)
            aware._at_least_held(cap, p2l)  # most copies of an expert on one rank
            return (
                cap,
                metrics.copy_counts(p2l, num_e),
                metrics.count_last(p2l, num_e),
                metrics.rank_loads3(w, p2l, cnt),
                metrics.slot_sums(w / 3.0, p2l),
                metrics.moves3(held, p2l),
                metrics.moved_per_rank(held, p2l, layers),
            )

        got = compiled_and_numpy(monkeypatch, run)
        # moves3 and moved_per_rank: two calls of its loop
        assert {n: len(c) for n, c in calls.items()} == dict(zip(names, (1, 1, 1, 1, 2, 1))), calls
        for a, b in zip(got["compiled"], got["numpy"]):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b, err_msg=f"seed {seed}")
        assert (got["numpy"][5] > 0).any() and (got["numpy"][3] > 0).any() and (got["numpy"][2][..., -1] > 0).any()
        assert (got["numpy"][0] > 1).any() or num_s < 3  # repeats on a rank
    # an id beyond the experts: numpy's indexing reports it, compiled or not
    p2l[0, 0, 0] = num_e
    for flag in ("1", "0"):
        monkeypatch.setenv("MOESHARD_EPLB_JIT", flag)
        for fn in (
            lambda: metrics.rank_loads3(w, p2l, cnt),
            lambda: metrics.slot_sums(w, p2l),
            lambda: metrics.moves3(held, p2l),
        ):
            with pytest.raises(IndexError):
                fn()


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_repair_duplicates_compiled_equals_numpy(monkeypatch):
    """The swap repair of duplicate copies compiled (``pack_kernel``) makes numpy's swaps on
    every row: ranks with two or three copies of an expert, caps of 1 and 2, empty slots,
    equal loads (ties), rows where a duplicate is unavoidable; and the compiled loop ran."""
    from moeshard.eplb import oblivious, pack_kernel

    monkeypatch.setattr(oblivious, "_JIT_FROM", 0)
    calls = count_calls(monkeypatch, pack_kernel, "repair_duplicates")
    for seed in range(6):
        rng = np.random.default_rng(seed)
        num_b, num_k, num_s, num_e = 60, 4, 3, 6
        slots = rng.integers(-1, num_e, (num_b, num_k, num_s))
        slots[: num_b // 4] = rng.integers(0, 2, (num_b // 4, num_k, num_s))  # 2 experts: unavoidable
        wc = rng.integers(1, 5, (num_b, num_e)).astype(np.float64)
        cap = rng.integers(1, 3, (num_b, num_e))
        calls.clear()

        def run(slots=slots, wc=wc, cap=cap):
            out = slots.copy()
            oblivious.repair_duplicates(out, wc, cap)
            return out

        got = compiled_and_numpy(monkeypatch, run)
        assert len(calls) == 1
        np.testing.assert_array_equal(got["compiled"], got["numpy"], err_msg=f"seed {seed}")
        assert (got["numpy"] != slots).any(axis=(1, 2)).sum() >= 10  # rows were repaired


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_balanced_pack_compiled_equals_numpy(monkeypatch):
    """The reference's greedy packing compiled (``pack_kernel``) gives numpy's packs: float32
    loads (the reference's sums) and float64, with and without keys (moeshard's no-duplicate
    rule, dead ends where every pack with room holds the key included), ties (integer loads),
    rows of zeros (no first fill); the compiled loop ran (not under ``MOESHARD_EPLB_JIT=0``)."""
    from moeshard.eplb import oblivious, pack_kernel

    monkeypatch.setattr(oblivious, "_JIT_FROM", 0)
    calls = count_calls(monkeypatch, pack_kernel, "greedy_pack")
    rng = np.random.default_rng(5)
    cases = [
        (40, 8, 9, 64, np.float64, False),
        (30, 8, 9, 64, np.float32, False),
        (20, 4, 2, 0, np.float64, False),
        (25, 5, 3, 4, np.float64, False),
        (15, 8, 9, 64, np.float64, True),
    ]
    for num_rows, num_packs, cap, num_keys, dtype, sparse in cases:
        n = num_packs * cap
        w = rng.integers(0, 2 if sparse else 6, (num_rows, n)).astype(dtype)  # ties
        w[1::3] = rng.random((len(w[1::3]), n)).astype(dtype)
        w[0] = 0
        key = rng.integers(0, num_keys, (num_rows, n)) if num_keys else None
        got = compiled_and_numpy(monkeypatch, lambda: oblivious.balanced_pack(w, key, num_keys, num_packs, cap))
        np.testing.assert_array_equal(got["compiled"], got["numpy"], err_msg=str((num_packs, cap, num_keys)))
    assert len(calls) == len(cases)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_replicate_experts_compiled_equals_numpy(monkeypatch):
    """The reference's replication compiled (``pack_kernel.replicate``) gives numpy's copies and
    counts: float32 loads (a copy's load rounded as the reference's) and float64, the
    reference's counts, spread counts and hot-spread counts (several ``hot`` per row, a hot
    group that closes), ties (integer loads); the compiled loop ran."""
    from moeshard.eplb import oblivious, pack_kernel

    monkeypatch.setattr(oblivious, "_JIT_FROM", 0)
    calls = count_calls(monkeypatch, pack_kernel, "replicate")
    rng = np.random.default_rng(7)
    cases = [
        (np.float64, None, 0),
        (np.float32, None, 0),
        (np.float64, 4, 0),
        (np.float64, 4, "rows"),
        (np.float32, 3, 2),
    ]
    for dtype, num_ranks, hot in cases:
        w = rng.integers(0, 9, (60, 12)).astype(dtype)  # ties
        w[1::2] = (rng.random((30, 12)) * 1000) ** 2
        hot_arg = rng.integers(0, 5, 60) if hot == "rows" else hot
        got = compiled_and_numpy(monkeypatch, lambda: oblivious.replicate_experts(w, 40, num_ranks, hot_arg))
        for a, b in zip(got["compiled"], got["numpy"]):
            np.testing.assert_array_equal(a, b, err_msg=str((dtype, num_ranks, hot)))
    assert len(calls) == len(cases)


def test_small_calls_load_no_kernel_and_none_is_needed(monkeypatch):
    """A toy's call (oblivious and migration-aware) loads no compiled loop (``eplb.jit``: the
    import of numba costs more than the call), a model's shape does where numba is installed,
    and without numba (the kernels' import failed) every call gives the placement of the
    numpy loops (``MOESHARD_EPLB_JIT=0``)."""
    from moeshard.eplb import jit

    monkeypatch.delenv("MOESHARD_EPLB_JIT", raising=False)
    monkeypatch.setattr(jit, "_LOADED", {})
    cfg = dict(num_physical=16, num_ranks=8, num_nodes=2, num_groups=4)
    old = eplb.rebalance(README_WEIGHT, **cfg, migration_aware=False)
    eplb.rebalance(README_WEIGHT[::-1], old, **cfg, tolerance=0.01, relative_to="oblivious")
    assert not jit._LOADED
    dsv3 = dict(num_physical=288, num_ranks=32, num_nodes=4, num_groups=8)
    tr = zipf_trace(20, 256, 2, seed=2, alpha=1.2, drift=0.1)
    start = eplb.rebalance(tr[0], **dsv3, migration_aware=False)
    calls = [(tr[1], start, dict(dsv3, tolerance=0.01, relative_to="oblivious")), (tr[1], None, dsv3)]
    fast = [eplb.rebalance(w, cur, **kw).phy2log for w, cur, kw in calls]
    if HAVE_NUMBA:
        assert jit._LOADED["sticky_kernel"] is not None and jit._LOADED["pack_kernel"] is not None
    monkeypatch.setattr(jit, "_LOADED", dict.fromkeys(jit._LOADED))  # numba missing
    none = [eplb.rebalance(w, cur, **kw).phy2log for w, cur, kw in calls]
    monkeypatch.setenv("MOESHARD_EPLB_JIT", "0")
    slow = [eplb.rebalance(w, cur, **kw).phy2log for w, cur, kw in calls]
    for a, b, c in zip(fast, none, slow):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed")
def test_aware_loops_compiled_equal_numpy(monkeypatch):
    """The migration-aware policy's compiled loops (``aware_kernel``) answer as numpy's: the
    cheapest group assignments per cap (fewest copies, then the lightest heaviest node, then
    the first; integer loads for ties, two to four groups per node, caps no assignment meets)
    and the slot order of a new placement (kept experts in their old slots, duplicates and
    empty slots), the old counts' fill and trim and the capped counts' steps; each compiled
    loop ran (not under ``MOESHARD_EPLB_JIT=0``)."""
    from moeshard.eplb import aware, aware_kernel

    monkeypatch.setattr(aware, "_JIT_FROM", 0)
    calls = {}
    for name in ("cheapest_groups", "arrange", "count_steps", "cap_steps"):
        real = getattr(aware_kernel, name)
        monkeypatch.setattr(aware_kernel, name, lambda *a, _f=real, _n=name: (calls.update({_n: 1}), _f(*a))[1])
    rng = np.random.default_rng(11)
    for num_groups, num_nodes in ((8, 4), (6, 3), (4, 2), (8, 2)):
        sh = type("Sh", (), dict(num_groups=num_groups, num_nodes=num_nodes))
        num_layers = 30
        gl = rng.integers(0, 5, (num_layers, num_groups)).astype(np.float64)
        gl[::2] = rng.random((len(gl[::2]), num_groups)) * 10
        gn_old = np.stack([rng.permutation(np.repeat(np.arange(num_nodes), num_groups // num_nodes)) for _ in gl])
        copies = rng.integers(1, 4, (num_layers, num_groups))
        mean = gl.sum(1) / num_nodes
        caps = np.array([0.96, 1.0, 1.1, 1.3])[:, None] * mean * rng.uniform(0.8, 1.3, num_layers)
        # and a cap exactly at the old assignment's heaviest node (summed as numpy sums it)
        at_old = [max(gl[i][gn_old[i] == k].sum() for k in range(num_nodes)) for i in range(num_layers)]
        caps = np.vstack([caps, at_old])
        got = compiled_and_numpy(monkeypatch, lambda: aware._cheapest_groups(gl, gn_old, copies, caps, sh))
        for a, b in zip(got["compiled"], got["numpy"]):
            np.testing.assert_array_equal(a, b)
        assert 0 < got["numpy"][1].sum() < got["numpy"][1].size  # some caps met, some not
    num_x, num_s = 500, 6
    old = rng.integers(-1, 8, (num_x, num_s))
    new = np.where(
        rng.random((num_x, num_s)) < 0.5, old[:, rng.permutation(num_s)], rng.integers(-1, 8, (num_x, num_s))
    )
    got = compiled_and_numpy(monkeypatch, lambda: aware._arrange(new, old))
    np.testing.assert_array_equal(got["compiled"], got["numpy"])
    # the count rules' steps: old counts filled or trimmed to a node's slots (groups moved to
    # other nodes, a dead rank), and old counts capped (experts of other nodes: count 0)
    from moeshard.eplb.inputs import check_shape
    from moeshard.eplb.oblivious import replicate_experts

    trace = zipf_trace(12, 128, 2, seed=4, alpha=1.2, drift=0.1)
    alive = np.ones(16, dtype=bool)
    alive[[3, 6, 9, 12]] = False  # one per node: still the hierarchical policy
    sh = check_shape(trace[1], 192, 16, 4, 8, alive)
    assert sh.hierarchical
    cur = eplb.rebalance(trace[0], num_physical=192, num_ranks=16, num_nodes=4, num_groups=8, migration_aware=False)
    old3 = aware._old_slots(cur, sh)
    gn = np.stack([rng.permutation(np.repeat(np.arange(4), 2)) for _ in range(12)])
    repl = rng.integers(1, 3, (12 * 4, 128))
    got = compiled_and_numpy(monkeypatch, lambda: aware._old_counts(trace[1], old3, gn, sh, repl))
    np.testing.assert_array_equal(got["compiled"], got["numpy"])
    w = zipf_trace(6, 32, 1, seed=2, alpha=1.2)[0] * rng.lognormal(0, 0.5, size=(6, 32))
    old_c = 1 + rng.multinomial(8, np.ones(32) / 32, size=6)
    old_c[:, :4] = 0  # not the node's
    cap = (w / replicate_experts(w, 40)[1]).max(1)
    for factor in (0.8, 1.0, 1.3):
        got = compiled_and_numpy(monkeypatch, lambda: aware.capped_counts(w, old_c, cap * factor))
        np.testing.assert_array_equal(got["compiled"], got["numpy"])
        assert (got["numpy"] != old_c).any()
    assert len(calls) == 4


def test_sticky_searches_equal_plain_loops():
    """The sticky packing's swap repair and the swap-back search (:mod:`moeshard.eplb.sticky`)
    score only the pairs that pass their masks, over many rows at once; on every row they make
    the very swaps, ties included, of the same search in plain loops over every pair."""
    from moeshard.eplb import sticky

    for seed in range(3):
        new, old, wc, cap, thr = _sticky_rows(seed)
        alive = np.ones(new.shape[:2], dtype=bool)
        batch = new.copy()
        sticky._swap_repair(batch, alive, wc, cap, old, thr)
        assert (batch != new).any()  # the case swaps
        back = new.copy()
        sticky.restore(back, old, alive, wc, cap, thr)
        assert (back != new).any()
        for b in range(len(new)):
            one = new[b].copy()
            _swap_repair_one_row(one, old[b], wc[b], cap[b], thr[b])
            np.testing.assert_array_equal(one, batch[b], err_msg=f"swap repair, seed {seed}, row {b}")
            one = new[b].copy()
            _restore_one_row(one, old[b], wc[b], cap[b], thr[b])
            np.testing.assert_array_equal(one, back[b], err_msg=f"restore, seed {seed}, row {b}")
