"""Moved copies shifted to ranks that held them (a pass of the migration-aware policy after
:func:`moeshard.eplb.fill.fill_held`, :mod:`moeshard.eplb.aware`).

A copy of ``x`` on rank ``a`` *moves* when ``a`` did not hold ``x``. Where another rank ``b`` of
the same node held ``x``, the copy can go there instead, nothing travelling: ``b`` makes room by
dropping one copy of an expert ``y`` that has at least two (each of ``y``'s copies left carries
``load[y] / (count[y] - 1)``), and ``a`` fills the slot with one more copy of an expert ``z``
it held (``load[z] / (count[z] + 1)`` each; ``z`` already on the node). ``x`` keeps its
count; at least one copy fewer moves (two where ``b``'s copy of ``y`` had moved). A shift is
taken only where the layer's heaviest rank stays within its limit, checked on every rank's
exact load after it. Greedy, per layer and node one shift per round (the one that leaves the
lightest heaviest rank, the first on ties in the order ``a``, its slot, ``b``, its slot,
``a``'s old slot of ``z``), all layers in one batch, until none fits.

Constraints kept: every copy stays on its expert's node, every expert keeps at least one
copy, empty and dead slots stay empty, and a copy that stays on its rank stays, except the
dropped copy of ``y``.
"""

from __future__ import annotations

import numpy as np

from .fill import lightest_per_node, rounds_on_layers
from .metrics import count_last, load_per_copy


def shift_held(
    w: np.ndarray, p2l: np.ndarray, old3: np.ndarray, held_old: np.ndarray, thr: np.ndarray, node_of_rank: np.ndarray
) -> np.ndarray:
    """``p2l`` ``int[L, R, S]`` (every layer within ``thr``) with moved copies shifted to ranks
    of their node that held them (module docstring), while each layer's heaviest rank stays
    within ``thr`` ``float[L]``. ``w`` ``float[L, E]`` loads, ``old3`` ``int[L, R, S]`` the
    old slots (dead ranks -1), ``held_old`` ``bool[L, R, E]``, ``node_of_rank`` ``int[R]``
    (all 0 where any expert may be on any rank). Returns a new ``int[L, R, S]``; pure."""
    return rounds_on_layers("shift_rounds", _one_round, w, p2l, old3, held_old, thr, node_of_rank)


def _one_round(w, out, old3, held_old, thr, node_of_rank, num_nodes, num_logical, active) -> np.ndarray:
    """One shift (the lightest heaviest rank after it) on each layer and node of ``active``
    ``int[A]`` that has one within ``thr``, in place on ``out``; returns the layers shifted."""
    p = out[active]  # [A, R, S]
    num_a, num_ranks, s = p.shape
    cnt = count_last(p.reshape(num_a, -1), num_logical)[:, :num_logical]  # [A, E]
    ai = np.arange(num_a)[:, None, None]
    ri = np.arange(num_ranks)[None, :, None]
    pe = np.maximum(p, 0)
    moved = (p >= 0) & ~held_old[active[:, None, None], ri, pe]
    # (layer, a, slot i) of each moved copy x, in order; then the ranks b of a's node that held x
    la, ra, ia = np.nonzero(moved)
    x = p[la, ra, ia]
    same_node = node_of_rank[None, :] == node_of_rank[ra][:, None]
    hb = held_old[active[la], :, x] & same_node & (np.arange(num_ranks)[None, :] != ra[:, None])  # [M, R]
    m, rb = np.nonzero(hb)
    la, ra, ia, x = la[m], ra[m], ia[m], x[m]
    # b's slot j holding y: a copy of an expert with another copy, not x
    y = p[la, rb]  # [M, S]
    ok_y = (y >= 0) & (y != x[:, None]) & (cnt[la[:, None], np.maximum(y, 0)] >= 2)
    m, jb = np.nonzero(ok_y)
    la, ra, ia, x, rb, y = la[m], ra[m], ia[m], x[m], rb[m], y[m, jb]
    # a's old slot holding z, an expert a held, on its node now, neither x nor y
    on_node = np.zeros((num_a, num_nodes, num_logical + 1), dtype=bool)
    on_node[ai, node_of_rank[None, :, None], np.where(p >= 0, p, num_logical)] = True
    z = old3[active[la], ra]  # [M, S]
    zc = np.maximum(z, 0)
    ok_z = (z >= 0) & (z != x[:, None]) & (z != y[:, None]) & on_node[la[:, None], node_of_rank[ra][:, None], zc]
    m, col = np.nonzero(ok_z)
    if not len(m):
        return m
    la, ra, ia, x, rb, jb, y, z = la[m], ra[m], ia[m], x[m], rb[m], jb[m], y[m], z[m, col]
    wa = w[active]
    wc = load_per_copy(wa, cnt)
    loads = np.where(p >= 0, wc[ai, pe], 0.0).sum(-1)  # [A, R]
    per_rank = count_last(p, num_logical)  # [A, R, E + 1]
    n_y, n_z = per_rank[la, :, y], per_rank[la, :, z]  # [K, R]
    wy, wz = wa[la, y], wa[la, z]
    cy, cz = cnt[la, y], cnt[la, z]
    d_y = wy / (cy - 1) - wy / cy  # each copy of y left carries more
    d_z = wz / (cz + 1) - wz / cz  # each copy of z carries less
    new = loads[la] + n_y * d_y[:, None] + n_z * d_z[:, None]  # [K, R]
    k = np.arange(len(la))
    wx = wc[la, x]
    new[k, ra] += wz / (cz + 1) - wx  # a: x out, z in
    new[k, rb] += wx - wy / (cy - 1)  # b: y out, x in
    peak = new.max(1)
    fits = peak <= thr[active[la]]
    if not fits.any():
        return np.zeros(0, dtype=np.int64)
    # one shift per layer and node: those of different nodes touch different ranks and experts
    first = lightest_per_node(k[fits], la * num_nodes + node_of_rank[ra], peak)
    out[active[la[first]], ra[first], ia[first]] = z[first]
    out[active[la[first]], rb[first], jb[first]] = x[first]
    return np.unique(active[la[first]])
