"""The migration-aware policy chained over a drifting trace, each step checked against the
oblivious answer's balance."""

from __future__ import annotations

import numpy as np

from moeshard import eplb

# 16 ranks on 4 nodes, 8 groups, 144 slots: small enough for a test, hierarchical as
# DeepSeek-V3's shape
HIER16 = dict(num_physical=144, num_ranks=16, num_nodes=4, num_groups=8)


def aware_moves(trace: np.ndarray, cfg: dict = HIER16, tolerance: float = 0.01) -> int:
    """Copies moved in all by ``eplb.rebalance`` (1 + ``tolerance``) over the oblivious answer,
    chained from the oblivious placement of ``trace[0]`` over ``trace[1:]`` (``float[T, L, E]``);
    asserts every layer of every step within that limit."""
    ranks = cfg["num_ranks"]
    cur = eplb.rebalance(trace[0], **cfg, migration_aware=False)
    moved = 0
    for load in trace[1:]:
        new = eplb.rebalance(load, cur, **cfg, tolerance=tolerance, relative_to="oblivious")
        obl = eplb.rebalance(load, **cfg, migration_aware=False)
        limit = eplb.balance(load, obl, ranks) * (1 + tolerance) * (1 + 1e-12)
        assert (eplb.balance(load, new, ranks) <= limit).all()
        moved += eplb.copies_moved(cur, new, ranks)
        cur = new
    return moved


def count_calls(monkeypatch, module, name: str) -> list:
    """``module.name`` wrapped (for the test) so that each call appends to the returned list:
    proof that a compiled loop ran."""
    calls = []
    real = getattr(module, name)

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(module, name, counted)
    return calls


def compiled_and_numpy(monkeypatch, fn) -> dict:
    """``{"compiled": fn(), "numpy": fn()}``: ``fn`` called with the compiled loops allowed,
    then under ``MOESHARD_EPLB_JIT=0`` (numpy's loops)."""
    got = {}
    for mode, flag in (("compiled", "1"), ("numpy", "0")):
        monkeypatch.setenv("MOESHARD_EPLB_JIT", flag)
        got[mode] = fn()
    return got


def random_moved_instance(rng, num_ranks, s, num_nodes, dead):
    """One layer batch of ``num_ranks`` ranks of ``s`` slots: an old placement with every
    expert, a new one with some copies moved (so some experts lost a copy, some gained), the
    first ``dead`` ranks dead (empty in both); integer loads (ties) or random ones."""
    num_layers = 6
    num_e = num_ranks * s - int(rng.integers(0, num_ranks))
    rows = [
        rng.permutation(np.r_[np.arange(num_e), rng.integers(0, num_e, num_ranks * s - num_e)])
        for _ in range(num_layers)
    ]
    old = np.stack(rows).reshape(num_layers, num_ranks, s)
    new = old.copy()
    for lay in range(num_layers):
        for _ in range(int(rng.integers(1, 2 * num_ranks))):
            new[lay, rng.integers(0, num_ranks), rng.integers(0, s)] = rng.integers(0, num_e)
    old[:, :dead] = -1
    new[:, :dead] = -1
    if rng.random() < 0.5:
        w = rng.integers(1, 5, (num_layers, num_e)).astype(np.float64)
    else:
        w = rng.random((num_layers, num_e)) * 10
    return w, new, old, np.arange(num_ranks) // (num_ranks // num_nodes)


def moved_passes_agree(monkeypatch, kernel: str, pass_fn, seed: int) -> int:
    """A pass on moved copies (``pass_fn(w, p2l, old3, held_old, thr, node_of_rank)``, e.g.
    ``fill_held``) on 60 seeded :func:`random_moved_instance` batches (2, 9 and 3 slots per
    rank on one, two and four nodes, dead ranks, limits at the answer's peak or up to 1.2x
    over it), with its compiled rounds ``fill_kernel.<kernel>`` and with numpy's: asserts the
    same placements and that the compiled rounds ran each time; returns the slots changed."""
    from moeshard.eplb import fill, fill_kernel
    from moeshard.eplb.metrics import copy_counts, held_by_rank, rank_loads3

    monkeypatch.setattr(fill, "_JIT_FROM", 0)
    calls = count_calls(monkeypatch, fill_kernel, kernel)
    rng = np.random.default_rng(seed)
    changed = 0
    for trial in range(60):
        num_ranks, s, num_nodes = [(4, 2, 1), (8, 9, 2), (8, 3, 4)][trial % 3]
        w, new, old, node_of_rank = random_moved_instance(rng, num_ranks, s, num_nodes, dead=trial % 2)
        num_e = w.shape[1]
        peak = rank_loads3(w, new, copy_counts(new, num_e)).max(1)
        thr = peak if trial % 4 == 0 else peak * rng.uniform(1.0, 1.2, len(peak))
        got = compiled_and_numpy(monkeypatch, lambda: pass_fn(w, new, old, held_by_rank(old, num_e), thr, node_of_rank))
        np.testing.assert_array_equal(got["compiled"], got["numpy"])
        changed += int((got["numpy"] != new).sum())
    assert len(calls) == 60, len(calls)
    return changed


def peak_of(w, p2l) -> np.ndarray:
    """``float[L]``: the heaviest rank of ``p2l`` ``int[L, R, S]`` under loads ``w``."""
    from moeshard.eplb.metrics import copy_counts, rank_loads3

    w = np.asarray(w, float)
    return rank_loads3(w, p2l, copy_counts(p2l, w.shape[1])).max(1)


def on_moved(pass_fn, w, new, old, thr, node_of_rank) -> np.ndarray:
    """``pass_fn`` (``fill_held``, ``shift_held``) on lists: loads ``w``, the answer ``new`` and
    old slots ``old`` ``[L, R, S]``, limits ``thr`` ``[L]``, ``node_of_rank`` ``[R]``."""
    from moeshard.eplb.metrics import held_by_rank

    w, new, old = np.asarray(w, float), np.asarray(new), np.asarray(old)
    return pass_fn(w, new, old, held_by_rank(old, w.shape[1]), np.asarray(thr, float), np.asarray(node_of_rank))


def pass_saves_copies(monkeypatch, pass_name: str, cfg: dict, trace: np.ndarray, each_step=None) -> int:
    """Copies the aware policy's pass ``aware.<pass_name>`` saves over ``trace`` ``float[T, L,
    E]`` (8 layers, 128 experts, 16 ranks of 9 slots; 1 % over the oblivious answer per
    layer, chained on the answers with the pass): per step the answer with the pass is a valid
    placement (groups on one node each), within the limit, and moves no more copies on any
    layer than without it. ``each_step(load, cur, new)``: more checks per step."""
    from moeshard.eplb import aware
    from moeshard.eplb.metrics import held_by_rank, moves3
    from test_eplb_budget_caps import check_valid

    cur = eplb.rebalance(trace[0], **cfg, migration_aware=False)
    kw = dict(tolerance=0.01, relative_to="oblivious")
    fewer = 0
    for load in trace[1:]:
        new = eplb.rebalance(load, cur, **cfg, **kw)
        monkeypatch.setattr(aware, pass_name, lambda w, p2l, *a: p2l)
        without = eplb.rebalance(load, cur, **cfg, **kw)
        monkeypatch.undo()
        check_valid(new, cfg, np.ones(16, dtype=bool))
        obl = eplb.rebalance(load, **cfg, migration_aware=False)
        assert (eplb.balance(load, new, 16) <= eplb.balance(load, obl, 16) * 1.01 * (1 + 1e-12)).all()
        held = held_by_rank(cur.phy2log.reshape(8, 16, 9), 128)
        m_new = moves3(held, new.phy2log.reshape(8, 16, 9))
        m_without = moves3(held, without.phy2log.reshape(8, 16, 9))
        assert (m_new <= m_without).all(), (m_new, m_without)
        fewer += int(m_without.sum() - m_new.sum())
        if each_step is not None:
            each_step(load, cur, new)
        cur = new
    return fewer
