"""Moved copies given back to experts their rank already held (the last pass of the
migration-aware policy, :mod:`moeshard.eplb.aware`).

A copy *moves* when its rank did not hold the expert (:func:`moeshard.eplb.metrics.moves3`);
a copy of an expert the rank already holds is made from the local weights, nothing travels.
So a moved copy of an expert ``e`` with at least two copies can often be replaced by one more
copy of an expert ``f`` that its rank held before: ``e`` keeps one copy fewer (each of its
copies carries ``load[e] / (count[e] - 1)``), ``f`` one more (a finer split of its load; ``f``
may already be on the rank: then the rank holds two copies of it, as the reference's answers
may). One copy fewer moves; the replacement is taken only where the layer's heaviest rank
stays within its limit, checked on every rank's exact load after the change. Greedy, per
layer and node one replacement per round (the one that leaves the lightest heaviest rank), all
layers in one batch, until none fits.

Constraints kept: ``f`` is placed only on a node that already holds a copy of it (so in the
hierarchical policy an expert's copies stay on its group's node), every expert keeps at least
one copy, empty and dead slots stay empty, and only moved copies change (a copy that stays on
its rank stays).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import jit
from .metrics import copy_counts, count_last, first_min_per_key, load_per_copy, max_rank_load, slot_sums

# placements of at least this many slots (layers x ranks x slots) take the compiled rounds
# where numba is installed (``fill_kernel``; ``MOESHARD_EPLB_JIT=0`` keeps numpy's)
_JIT_FROM = 4096


def fill_held(
    w: np.ndarray, p2l: np.ndarray, old3: np.ndarray, held_old: np.ndarray, thr: np.ndarray, node_of_rank: np.ndarray
) -> np.ndarray:
    """``p2l`` ``int[L, R, S]`` (every layer within ``thr``) with moved copies replaced by
    copies of experts their rank held, while each layer's heaviest rank stays within ``thr``
    ``float[L]`` (the caller's limit, rounding slack included). ``w`` ``float[L, E]`` loads,
    ``old3`` ``int[L, R, S]`` the old slots (dead ranks -1), ``held_old`` ``bool[L, R, E]``
    which ranks held which experts, ``node_of_rank`` ``int[R]`` (all 0 where any expert may be
    on any rank). Returns a new ``int[L, R, S]``; pure."""
    return rounds_on_layers("fill_rounds", _one_round, w, p2l, old3, held_old, thr, node_of_rank)


def rounds_on_layers(compiled_name: str, one_round, w, p2l, old3, held_old, thr, node_of_rank) -> np.ndarray:
    """Rounds of a greedy pass on the moved copies of ``p2l`` ``int[L, R, S]`` (arguments as
    :func:`fill_held`'s): the compiled rounds ``fill_kernel.<compiled_name>`` where numba is
    installed and the placement is a model's, else ``one_round`` (numpy, one change per layer
    and node and round; returns the layers changed) until no layer changes. A layer whose
    experts span nodes (not the policies' answers) might add up over the limit, or lose an
    expert's last copy, from changes checked one by one: it keeps its copies. Pure."""
    out = p2l.copy()
    num_layers, _, s = p2l.shape
    num_logical = w.shape[1]
    num_nodes = int(node_of_rank.max(initial=0)) + 1
    compiled = jit.kernel("fill_kernel", p2l.size, _JIT_FROM) if w.dtype == thr.dtype == np.float64 else None
    if compiled is not None and s <= compiled.MAX_SLOTS:
        fast = np.ascontiguousarray(out, dtype=np.int64)
        args = (np.ascontiguousarray(old3, dtype=np.int64), np.ascontiguousarray(held_old, dtype=bool))
        getattr(compiled, compiled_name)(
            np.ascontiguousarray(w), fast, *args, np.ascontiguousarray(thr), node_of_rank.astype(np.int64), num_nodes
        )
        out = fast.astype(p2l.dtype, copy=False)
    else:
        active = np.arange(num_layers)
        while len(active):
            active = one_round(w, out, old3, held_old, thr, node_of_rank, num_nodes, num_logical, active)
    cnt = copy_counts(out, num_logical)
    bad = (max_rank_load(w, out, cnt) > thr) | ((cnt == 0) & (copy_counts(p2l, num_logical) > 0)).any(1)
    out[bad] = p2l[bad]
    return out


class LayerTables(NamedTuple):
    """A round's view of layers ``[A, R, S]``: copy counts ``cnt`` ``int[A, E]``, per-copy loads
    ``wc`` ``float[A, E]``, rank loads ``loads`` ``float[A, R]``, copies per rank ``per_rank``
    ``int[A, R, E + 1]`` (last column: empty slots) and experts on each node ``on_node``
    ``bool[A, N, E + 1]``."""

    cnt: np.ndarray
    wc: np.ndarray
    loads: np.ndarray
    per_rank: np.ndarray
    on_node: np.ndarray


def layer_tables(wa: np.ndarray, p: np.ndarray, node_of_rank: np.ndarray, num_nodes: int) -> LayerTables:
    """:class:`LayerTables` of the layers ``p`` ``int[A, R, S]`` under loads ``wa``
    ``float[A, E]``."""
    num_a, num_ranks, _ = p.shape
    num_logical = wa.shape[1]
    cnt = count_last(p.reshape(num_a, -1), num_logical)[:, :num_logical]
    wc = load_per_copy(wa, cnt)
    on_node = np.zeros((num_a, num_nodes, num_logical + 1), dtype=bool)
    on_node[np.arange(num_a)[:, None, None], node_of_rank[None, :, None], np.where(p >= 0, p, num_logical)] = True
    return LayerTables(cnt, wc, slot_sums(wc, p), count_last(p, num_logical), on_node)


def loads_after(t: LayerTables, wa: np.ndarray, la: np.ndarray, minus: np.ndarray, plus: np.ndarray):
    """Rank loads ``float[K, R]`` of layers ``la`` ``int[K]`` once expert ``minus`` ``int[K]``
    has one copy fewer and ``plus`` one more, every copy where it is (the caller adds the
    slot's own change), and the new per-copy loads of ``minus`` and ``plus`` ``float[K]``."""
    wm, wp = wa[la, minus], wa[la, plus]
    cm, cp = t.cnt[la, minus], t.cnt[la, plus]
    after_m, after_p = wm / (cm - 1), wp / (cp + 1)
    d_m = after_m - wm / cm  # each copy of minus left carries more
    d_p = after_p - wp / cp  # each copy of plus carries less
    new = t.loads[la] + t.per_rank[la, :, minus] * d_m[:, None] + t.per_rank[la, :, plus] * d_p[:, None]
    return new, after_m, after_p


def lightest_within(new: np.ndarray, lim: np.ndarray, key: np.ndarray) -> np.ndarray:
    """``int[M]``: per distinct ``key`` ``int[K]`` the candidate (a row of ``new`` ``float[K,
    R]``, the rank loads after it) whose heaviest rank is lightest among those within ``lim``
    ``float[K]``, the first on ties; ordered by key, none for a key without one."""
    peak = new.max(1)
    fits = np.flatnonzero(peak <= lim)
    return first_min_per_key(key, peak, fits) if len(fits) else fits


def _one_round(w, out, old3, held_old, thr, node_of_rank, num_nodes, num_logical, active) -> np.ndarray:
    """One replacement (the lightest heaviest rank after it) on each layer of ``active``
    ``int[A]`` that has one within ``thr``, in place on ``out``; returns those layers."""
    p = out[active]  # [A, R, S]
    num_ranks = p.shape[1]
    ri = np.arange(num_ranks)[None, :, None]
    pe = np.maximum(p, 0)
    cnt = count_last(p.reshape(len(p), -1), num_logical)[:, :num_logical]  # [A, E]
    # moved copies of experts with another copy
    moved = (p >= 0) & ~held_old[active[:, None, None], ri, pe] & (cnt[np.arange(len(p))[:, None, None], pe] >= 2)
    some = moved.any((1, 2))
    if not some.all():  # the rest of the work on the layers that have any
        active, p, moved = active[some], p[some], moved[some]
    a, r, j = np.nonzero(moved)
    if not len(a):
        return a
    wa = w[active]
    t = layer_tables(wa, p, node_of_rank, num_nodes)
    # candidates: the experts the rank held (its old slots), already on the rank's node
    f = old3[active[a], r]  # [M, S]
    e = p[a, r, j]
    ok = (f >= 0) & (f != e[:, None]) & t.on_node[a[:, None], node_of_rank[r][:, None], np.maximum(f, 0)]
    m, col = np.nonzero(ok)
    if not len(m):
        return m
    a, r, j, e, f = a[m], r[m], j[m], e[m], f[m, col]
    new, after_e, after_f = loads_after(t, wa, a, e, f)  # [K, R]
    new[np.arange(len(a)), r] += after_f - after_e  # the slot itself: e's copy out, f's in
    # one replacement per layer and node: those of different nodes touch different ranks and
    # experts (every copy of e and f is on the node), so each is checked exactly as it is
    first = lightest_within(new, thr[active[a]], a * num_nodes + node_of_rank[r])
    out[active[a[first]], r[first], j[first]] = f[first]
    return np.unique(active[a[first]])
