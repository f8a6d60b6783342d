"""Tier 1: chunked relocation plans (:func:`moeshard.relocation_chunks`, pure) and which optimizer
state moves with its experts (:func:`moeshard.ops.relocate.expert_states`). The distributed
runs of both: ``tests/test_train_dist.py`` (rebalanced training runs)."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard import Placement, relocation_chunks
from moeshard.eplb import slots_changed


def _pair(seed: int, layers: int = 7, logical: int = 6, slots: int = 8, ranks: int = 4):
    rng = np.random.default_rng(seed)

    def rows():
        return np.stack(
            [
                rng.permutation(np.concatenate([np.arange(logical), rng.integers(0, logical, slots - logical)]))
                for _ in range(layers)
            ]
        )

    old = rows()
    new = rows()
    new[2] = old[2]  # a layer that does not change takes no chunk
    return Placement(old, num_logical=logical, num_ranks=ranks), Placement(new, num_logical=logical, num_ranks=ranks)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(
    "bounds",
    [
        dict(layers_per_chunk=1),
        dict(layers_per_chunk=3),
        dict(max_bytes=100, slot_bytes=10),
        dict(max_bytes=35, slot_bytes=10),
        dict(layers_per_chunk=2, max_bytes=60, slot_bytes=10),
    ],
)
def test_chunks_move_each_changed_layer_once_within_bounds(seed, bounds):
    old, new = _pair(seed)
    chunks = relocation_chunks(old, new, **bounds)
    assert chunks[-1][1] == new
    moved = [layer for layers, _ in chunks for layer in layers]
    assert moved == sorted(moved) and 2 not in moved
    assert moved == np.flatnonzero((old.phy2log != new.phy2log).any(axis=1)).tolist()
    per_layer = slots_changed(old, new, per_layer=True) * bounds.get("slot_bytes", 0)
    prev = old
    for layers, pl in chunks:
        # Each layer's row is new once its chunk ran, old before: every intermediate is valid.
        done = [layer for c, _ in chunks[: chunks.index((layers, pl)) + 1] for layer in c]
        for layer in range(old.num_layers):
            want = new.phy2log[layer] if layer in done else old.phy2log[layer]
            assert np.array_equal(pl.phy2log[layer], want)
        changed = np.flatnonzero((prev.phy2log != pl.phy2log).any(axis=1)).tolist()
        assert changed == list(layers)
        if "layers_per_chunk" in bounds:
            assert len(layers) <= bounds["layers_per_chunk"]
        if "max_bytes" in bounds and len(layers) > 1:  # a single layer above the bound is alone
            assert per_layer[list(layers)].sum() <= bounds["max_bytes"]
        prev = pl
    # Greedy: a chunk closes only when the next layer would break a bound.
    for (a, _), (b, _) in zip(chunks, chunks[1:]):
        full_layers = "layers_per_chunk" in bounds and len(a) == bounds["layers_per_chunk"]
        full_bytes = "max_bytes" in bounds and per_layer[list(a)].sum() + per_layer[b[0]] > bounds["max_bytes"]
        assert full_layers or full_bytes


def test_nothing_to_move_and_bad_arguments():
    old, new = _pair(0)
    assert relocation_chunks(old, old, layers_per_chunk=1) == []
    with pytest.raises(ValueError, match="layers_per_chunk or max_bytes"):
        relocation_chunks(old, new)
    with pytest.raises(ValueError, match="layers_per_chunk must be >= 1"):
        relocation_chunks(old, new, layers_per_chunk=0)
    with pytest.raises(ValueError, match="max_bytes needs slot_bytes"):
        relocation_chunks(old, new, max_bytes=10)
    with pytest.raises(ValueError, match="shape"):
        relocation_chunks(old, Placement(new.phy2log[:3], num_logical=6), layers_per_chunk=1)


def test_expert_states_per_element_state_moves_scalars_stay():
    import torch

    from moeshard.ops.relocate import expert_states

    w = torch.nn.Parameter(torch.randn(4, 3, 2))
    opt = torch.optim.AdamW([w], lr=0.1)
    assert expert_states(opt, w, "w") == []  # no state before the first step
    assert expert_states(None, w, "w") == []
    w.grad = torch.ones_like(w)
    opt.step()
    got = expert_states(opt, w, "w")
    assert [k for k, _ in got] == ["exp_avg", "exp_avg_sq"]  # "step" is a scalar: it stays
    assert all(t is opt.state[w][k] for k, t in got)
    opt.state[w]["row_stats"] = torch.zeros(4, 3)  # a factored moment cannot follow slots
    with pytest.raises(ValueError, match="optimizer state 'row_stats' of w has shape \\[4, 3\\]"):
        expert_states(opt, w, "w")
