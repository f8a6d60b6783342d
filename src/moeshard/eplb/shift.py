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

from .fill import layer_tables, lightest_within, loads_after, rounds_on_layers


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
    num_ranks = p.shape[1]
    wa = w[active]
    t = layer_tables(wa, p, node_of_rank, num_nodes)
    ri = np.arange(num_ranks)[None, :, None]
    moved = (p >= 0) & ~held_old[active[:, None, None], ri, np.maximum(p, 0)]
    # (layer, a, slot i) of each moved copy x, in order; then the ranks b of a's node that held x
    la, ra, ia = np.nonzero(moved)
    x = p[la, ra, ia]
    same_node = node_of_rank[None, :] == node_of_rank[ra][:, None]
    hb = held_old[active[la], :, x] & same_node & (np.arange(num_ranks)[None, :] != ra[:, None])  # [M, R]
    m, rb = np.nonzero(hb)
    la, ra, ia, x = la[m], ra[m], ia[m], x[m]
    # b's slot j holding y: a copy of an expert with another copy, not x
    y = p[la, rb]  # [M, S]
    ok_y = (y >= 0) & (y != x[:, None]) & (t.cnt[la[:, None], np.maximum(y, 0)] >= 2)
    m, jb = np.nonzero(ok_y)
    la, ra, ia, x, rb, y = la[m], ra[m], ia[m], x[m], rb[m], y[m, jb]
    # a's old slot holding z, an expert a held, on its node now, neither x nor y
    z = old3[active[la], ra]  # [M, S]
    on_node = t.on_node[la[:, None], node_of_rank[ra][:, None], np.maximum(z, 0)]
    ok_z = (z >= 0) & (z != x[:, None]) & (z != y[:, None]) & on_node
    m, col = np.nonzero(ok_z)
    if not len(m):
        return m
    la, ra, ia, x, rb, jb, y, z = la[m], ra[m], ia[m], x[m], rb[m], jb[m], y[m], z[m, col]
    new, after_y, after_z = loads_after(t, wa, la, y, z)  # [K, R]
    k = np.arange(len(la))
    wx = t.wc[la, x]
    new[k, ra] += after_z - wx  # a: x out, z in
    new[k, rb] += wx - after_y  # b: y out, x in
    # one shift per layer and node: those of different nodes touch different ranks and experts
    first = lightest_within(new, thr[active[la]], la * num_nodes + node_of_rank[ra])
    out[active[la[first]], ra[first], ia[first]] = z[first]
    out[active[la[first]], rb[first], jb[first]] = x[first]
    return np.unique(active[la[first]])
