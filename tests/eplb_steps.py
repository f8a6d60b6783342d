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
