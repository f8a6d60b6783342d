"""Replica budgets per layer: with a total number of expert copies for all layers, skewed layers
get more copies and balanced layers fewer (memory for redundant experts is best spent where a
layer's load is skewed); the slots a layer does not use stay empty (``-1``).

:func:`split_budget` gives each copy beyond one per expert to the layer whose heaviest copy,
over the layer's mean rank load, is highest (min-max-replica across layers, each layer's
load normalized by its mean so that layers of any volume compare). :func:`budget_policy`
then places each layer's copies with the oblivious policy, the unused slots as zero-load
placeholder experts that are emptied afterwards (so the packing sees every slot)."""

from __future__ import annotations

import numpy as np

from .inputs import Shape, check_shape
from .joint import joint_improve
from .metrics import copy_counts
from .oblivious import oblivious_policy, reference_answer


def split_budget(w: np.ndarray, total: int, max_per_layer: int, num_ranks: int) -> np.ndarray:
    """``int[L]`` copies per layer of ``w`` ``float[L, E]``: ``E`` each at least, at most
    ``max_per_layer``, ``total`` in all (module docstring)."""
    num_layers, num_e = w.shape
    cnt = np.ones((num_layers, num_e), dtype=np.int64)
    mean = np.maximum(w.sum(1) / num_ranks, 1e-300)
    per_copy = w / mean[:, None]
    per = np.full(num_layers, num_e, dtype=np.int64)
    for _ in range(total - num_layers * num_e):
        head = np.where((per < max_per_layer)[:, None], per_copy / cnt, -np.inf)
        layer, e = divmod(int(head.argmax()), num_e)
        cnt[layer, e] += 1
        per[layer] += 1
    return per


def budget_policy(w: np.ndarray, sh: Shape, per: np.ndarray, num_nodes: int, active: np.ndarray) -> np.ndarray:
    """``int[L, R, S]``: per layer, ``per[l]`` copies placed by the oblivious policy (global:
    placeholders have no group), the live slots beyond them empty."""
    num_layers, num_e = w.shape
    live_slots = int(active.sum()) * sh.slots_per_rank
    out = np.full((num_layers, sh.num_ranks, sh.slots_per_rank), -1, dtype=np.int64)
    for d in np.unique(live_slots - per):
        layers = np.flatnonzero(live_slots - per == d)
        wa = np.concatenate([w[layers], np.zeros((len(layers), int(d)))], axis=1)
        sub = check_shape(wa, sh.num_physical, sh.num_ranks, num_nodes, None, active)
        ref = reference_answer(wa, sub)
        obl = oblivious_policy(wa, sub, ref)
        best = joint_improve(wa, sub, obl)
        # a placeholder holds one slot: where the search gave one more, the plain answer
        extra = (copy_counts(best.phy2log, wa.shape[1])[:, num_e:] > 1).any(1)
        p2l = np.where(extra[:, None, None], obl.phy2log, best.phy2log)
        assert (copy_counts(p2l, wa.shape[1])[:, num_e:] == 1).all()
        out[layers] = np.where(p2l >= num_e, -1, p2l)
    return out
