"""The EPLB yardstick: the exact min-max rank load over replica counts and placement (an integer
program solved by HiGHS, ``highspy``, a benchmark/test dependency only) and a lower bound for
the shapes the solver cannot finish.

The problem (one layer): experts of load ``w[e]``; ``num_ranks`` ranks of ``slots_per_rank``
slots, every slot filled; expert ``e`` gets ``c[e] >= 1`` copies, each carrying ``w[e] / c[e]``
(two copies on one rank count twice, as :func:`moeshard.eplb.balance` weighs them); by default
a rank holds at most ``ceil(c[e] / num_ranks)`` copies of ``e``, moeshard's rule (a second
copy of an expert on a rank wastes a slot; the policies keep the rule wherever they can).
Minimize the heaviest rank's load.

Integer program (:func:`solve_exact`): binary ``z[e, k]`` (expert ``e`` has ``k`` copies),
integer ``n[p]`` (ranks holding the multiset ``p`` of copies), ``sum_k z[e, k] = 1``, copies
of ``(e, k)`` over all patterns ``= k z[e, k]``, ``sum_p n[p] = num_ranks``, ``T >= load(p)``
for every used pattern; minimize ``T``.

Fewest moves (:func:`min_moves`): the fewest copies moved from a placement so that no rank
is over a limit, for one node or one small layer (the migration-aware policy's yardstick).

Lower bound (:func:`lower_bound`, pure numpy, any shape): the largest of the mean rank load
and the smallest ``T`` with ``sum_e max(1, ceil(w[e] / T)) <= slots`` (no copy can exceed the
heaviest rank); hierarchical (expert groups onto nodes, ``num_groups / num_nodes`` per node):
the smallest over the assignments of groups to nodes of the heaviest node's bound, when there
are few enough assignments to enumerate (else the global bound, which is also a bound).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Exact:
    """One layer solved: ``status`` "optimal" or "time_limit"; ``value`` the best max rank load
    found; ``bound`` the solver's lower bound (``== value`` when optimal); ``counts``
    ``int[E]``; ``ranks`` ``int[R, S]`` expert ids per rank."""

    status: str
    value: float
    bound: float
    counts: np.ndarray
    ranks: np.ndarray
    seconds: float


def solve_exact(
    w, num_ranks: int, slots_per_rank: int, upper: float | None = None, time_limit: float = 20.0, rule: bool = True
) -> Exact:
    """The exact min-max rank load of one layer ``w`` ``float[E]`` (global policy: any expert
    on any rank). ``upper``: a known max rank load (a heuristic's) that prunes the copy counts
    and rank patterns (default: the lighter of the reference's and moeshard's; where it
    proves too low, the total load). ``rule``: moeshard's rule, a rank holds at most
    ``ceil(k / num_ranks)`` copies of an expert of ``k`` copies (False: any number, the
    unconstrained optimum). Needs ``highspy``.

    Ranks are interchangeable, so the program counts rank *patterns* (a multiset of
    ``slots_per_rank`` copies ``(e, k)``: a copy of ``e`` when it has ``k`` copies) instead of
    placing copies on numbered ranks: ``n[p]`` ranks use pattern ``p``, ``u[p]`` binary marks a
    used pattern, ``T >= load(p) u[p]``. No rank symmetry is left to search through."""
    import highspy

    w = np.asarray(w, dtype=np.float64)
    num_e = len(w)
    num_slots = num_ranks * slots_per_rank
    assert num_slots >= num_e
    if upper is None:
        from moeshard import eplb

        cfg = dict(num_physical=num_slots, num_ranks=num_ranks)
        ref = eplb.reference(w[None], **cfg)
        own = eplb.rebalance(w[None], **cfg, migration_aware=False)
        # moeshard's answer first (the tightest pruning); it may hold the reference's
        # duplicates, then the rule's optimum can lie above it: the solver says infeasible
        upper = min(float(eplb.rank_loads(w[None], p, num_ranks).max()) for p in (ref, own))
        found = solve_exact(w, num_ranks, slots_per_rank, upper, time_limit, rule)
        if found.status != "infeasible":
            return found
        upper = float(w.sum())
    upper = upper * (1 + 1e-9) + 1e-12
    kmin = np.maximum(1, np.ceil(w / upper - 1e-12)).astype(np.int64)
    kmax = num_slots - (kmin.sum() - kmin)
    pieces = [(e, k) for e in range(num_e) for k in range(int(kmin[e]), int(kmax[e]) + 1)]
    pw = np.array([w[e] / k for e, k in pieces])
    patterns, loads = [], []
    for combo in itertools.combinations_with_replacement(range(len(pieces)), slots_per_rank):
        experts = {}
        for i in combo:
            e, k = pieces[i]
            experts.setdefault(e, set()).add(k)
        if any(len(ks) > 1 for ks in experts.values()):
            continue  # two different counts of one expert: never consistent
        if rule and any(combo.count(i) > -(-pieces[i][1] // num_ranks) for i in set(combo)):
            continue  # moeshard's rule: no two copies of an expert on a rank when avoidable
        load = float(pw[list(combo)].sum())
        if load <= upper:
            patterns.append(combo)
            loads.append(load)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", 1e-9)
    h.setOptionValue("mip_abs_gap", 1e-9)
    h.setOptionValue("threads", 1)
    integer = highspy.HighsVarType.kInteger
    t = h.addVariable(lb=0.0, ub=highspy.kHighsInf, obj=1.0)
    z = [h.addVariable(lb=0, ub=1, type=integer) for _ in pieces]
    n = [h.addVariable(lb=0, ub=num_ranks, type=integer) for _ in patterns]
    u = [h.addVariable(lb=0, ub=1, type=integer) for _ in patterns]
    for e in range(num_e):
        h.addConstr(sum(z[i] for i, (f, _) in enumerate(pieces) if f == e) == 1)
    uses = [dict() for _ in pieces]
    for j, combo in enumerate(patterns):
        for i in combo:
            uses[i][j] = uses[i].get(j, 0) + 1
    for i, (_, k) in enumerate(pieces):
        h.addConstr(sum(m * n[j] for j, m in uses[i].items()) - k * z[i] == 0)
    h.addConstr(sum(n) == num_ranks)
    for j, load in enumerate(loads):
        h.addConstr(n[j] - num_ranks * u[j] <= 0)
        h.addConstr(t - load * u[j] >= 0)
    h.addConstr(t >= float(row_bound(w[None], num_slots, num_ranks)[0]))  # a valid cut
    h.run()
    status = h.getModelStatus()
    sol = np.asarray(h.getSolution().col_value)
    ok = status == highspy.HighsModelStatus.kOptimal
    counts = np.zeros(num_e, dtype=np.int64)
    for i, (e, k) in enumerate(pieces):
        if sol[z[i].index] > 0.5:
            counts[e] = k
    ranks = []
    for j, combo in enumerate(patterns):
        ranks += [[pieces[i][0] for i in combo]] * int(round(sol[n[j].index]))
    ranks = np.array(ranks, dtype=np.int64).reshape(-1, slots_per_rank)
    value = float(sol[t.index])
    bound = value if ok else float(h.getInfo().mip_dual_bound)
    if status == highspy.HighsModelStatus.kInfeasible:
        return Exact("infeasible", np.inf, np.inf, counts, ranks, float(h.getRunTime()))
    return Exact("optimal" if ok else "time_limit", value, bound, counts, ranks, float(h.getRunTime()))


@dataclass(frozen=True)
class MinMoves:
    """Fewest moved copies within a limit: ``status`` "optimal", "time_limit" or "infeasible";
    ``value`` the best found (``inf`` where none); ``bound`` the solver's lower bound (``==
    value`` when optimal); ``copies`` ``int[R, E]`` copies per rank of the best found."""

    status: str
    value: float
    bound: float
    copies: np.ndarray
    seconds: float


def min_moves(w, held, slots_per_rank: int, limit: float, time_limit: float = 20.0) -> MinMoves:
    """The fewest copies moved (a copy on a rank that did not hold its expert, as
    :func:`moeshard.eplb.copies_moved` counts) to place experts of load ``w`` ``float[E]`` on
    ranks that held ``held`` ``bool[R, E]``, ``slots_per_rank`` slots each, every slot filled,
    every expert at least one copy, with no rank's load above ``limit`` (two copies of an
    expert on a rank allowed, each carrying ``w[e] / count[e]``). One layer's node of the
    hierarchical policy (its groups fixed) or a whole global layer. Needs ``highspy``.

    Integer program: binary ``z[e, k]`` (expert ``e`` has ``k`` copies), integer ``y[r, e, k]``
    (copies of ``e`` on rank ``r`` when it has ``k``), ``sum_k z[e, k] = 1``, ``sum_r y[r, e,
    k] = k z[e, k]``, ``sum_{e,k} y[r, e, k] = slots_per_rank``, ``sum_{e,k} y[r, e, k] w[e] /
    k <= limit``; minimize ``sum y`` over the pairs ``(r, e)`` not held."""
    import highspy

    w = np.asarray(w, dtype=np.float64)
    held = np.asarray(held, dtype=bool)
    num_r, num_e = held.shape
    total = num_r * slots_per_rank
    lim = limit * (1 + 1e-12)
    kmin = np.maximum(1, np.ceil(w / lim - 1e-12)).astype(np.int64)
    if kmin.sum() > total:
        return MinMoves("infeasible", np.inf, np.inf, np.zeros((num_r, num_e), dtype=np.int64), 0.0)
    kmax = total - (kmin.sum() - kmin)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("threads", 1)
    integer = highspy.HighsVarType.kInteger
    z, y = {}, {}
    for e in range(num_e):
        for k in range(int(kmin[e]), int(kmax[e]) + 1):
            z[e, k] = h.addVariable(lb=0, ub=1, type=integer)
            for r in range(num_r):
                cost = 0.0 if held[r, e] else 1.0
                y[r, e, k] = h.addVariable(lb=0, ub=min(k, slots_per_rank), type=integer, obj=cost)
    for e in range(num_e):
        ks = range(int(kmin[e]), int(kmax[e]) + 1)
        h.addConstr(sum(z[e, k] for k in ks) == 1)
        for k in ks:
            h.addConstr(sum(y[r, e, k] for r in range(num_r)) - k * z[e, k] == 0)
    for r in range(num_r):
        mine = [(e, k, v) for (q, e, k), v in y.items() if q == r]
        h.addConstr(sum(v for _, _, v in mine) == slots_per_rank)
        h.addConstr(sum(v * (w[e] / k) for e, k, v in mine) <= lim)
    h.run()
    status = h.getModelStatus()
    seconds = float(h.getRunTime())
    if status == highspy.HighsModelStatus.kInfeasible:
        return MinMoves("infeasible", np.inf, np.inf, np.zeros((num_r, num_e), dtype=np.int64), seconds)
    sol = np.asarray(h.getSolution().col_value)
    copies = np.zeros((num_r, num_e), dtype=np.int64)
    for (r, e, _), v in y.items():
        copies[r, e] += int(round(sol[v.index]))
    info = h.getInfo()
    ok = status == highspy.HighsModelStatus.kOptimal
    value = float(info.objective_function_value) if copies.sum() == total else np.inf
    bound = value if ok else float(info.mip_dual_bound)
    return MinMoves("optimal" if ok else "time_limit", value, bound, copies, seconds)


def count_bound(w: np.ndarray, num_slots: int) -> np.ndarray:
    """``float[B]``: per row of ``w`` ``float[B, E]``, the smallest ``T`` with
    ``sum_e max(1, ceil(w[e] / T)) <= num_slots`` (every copy at most ``T``)."""
    num_b, num_e = w.shape
    extra = num_slots - num_e
    assert extra >= 0
    ks = np.arange(1, extra + 2)
    cand = (w[:, :, None] / ks).reshape(num_b, -1)  # T among the per-copy loads w / k
    cand = np.sort(cand, axis=1)
    lo, hi = np.zeros(num_b, dtype=np.int64), np.full(num_b, cand.shape[1] - 1)
    rows = np.arange(num_b)
    # smallest index i with need(cand[i]) <= num_slots (need is non-increasing in T)
    while (lo < hi).any():
        mid = (lo + hi) // 2
        tt = cand[rows, mid]
        need = np.maximum(1, np.ceil(w / np.maximum(tt, 1e-300)[:, None] - 1e-12)).sum(1)
        ok = need <= num_slots
        hi = np.where(ok & (lo < hi), mid, hi)
        lo = np.where(~ok & (lo < hi), mid + 1, lo)
    return cand[rows, lo]


def row_bound(w: np.ndarray, num_slots: int, num_ranks: int) -> np.ndarray:
    """``float[B]``: max of the mean rank load and :func:`count_bound`."""
    return np.maximum(w.sum(1) / num_ranks, count_bound(w, num_slots))


def _count_vectors(hot: int, extra: int) -> np.ndarray:
    """``int[M, hot]``: every copy-count vector ``c >= 1`` with ``sum(c) <= hot + extra``."""
    grids = np.meshgrid(*[np.arange(1, extra + 2)] * hot, indexing="ij")
    c = np.stack([g.ravel() for g in grids], 1)
    return c[c.sum(1) <= hot + extra]


def hot_bound(w: np.ndarray, num_slots: int, num_ranks: int, hot: int = 4) -> np.ndarray:
    """``float[B]``: per row of ``w`` ``float[B, E]``, a lower bound from the ``hot`` heaviest
    experts' copies alone: over every count vector ``c`` of them (each ``>= 1``, together at
    most ``hot + num_slots - E`` copies, since every other expert needs a slot), the smallest of
    the largest of (a) ``ceil(c[e] / num_ranks) * w[e] / c[e]`` (some rank holds that many
    copies of ``e``) and (b) the sum of the ``ceil(sum(c) / num_ranks)`` lightest of those
    copies (some rank holds that many hot copies). Both hold whatever else shares the rank,
    and every rank holding exactly ``num_slots / num_ranks`` copies is what caps ``sum(c)``."""
    num_b, num_e = w.shape
    hot = min(hot, num_e)
    extra = num_slots - num_e
    a = -np.sort(-w, axis=1)[:, :hot]  # [B, h] heaviest first
    c = _count_vectors(hot, extra)  # [M, h]
    copy = a[:, None, :] / c[None]  # [B, M, h]
    stack = (np.ceil(c / num_ranks)[None] * copy).max(2)
    q = np.ceil(c.sum(1) / num_ranks)[None, :, None]  # [1, M, 1]
    order = np.argsort(copy, axis=2)  # lightest copies first
    cs = np.take_along_axis(np.broadcast_to(c, copy.shape), order, 2)
    cp = np.take_along_axis(copy, order, 2)
    before = np.cumsum(cs, 2) - cs
    lightest = (np.clip(q - before, 0, cs) * cp).sum(2)
    return np.maximum(stack, lightest).min(1)


def node_bound(w: np.ndarray, num_slots: int, num_ranks: int) -> np.ndarray:
    """``float[B]``: the largest of :func:`row_bound` and :func:`hot_bound`."""
    return np.maximum(row_bound(w, num_slots, num_ranks), hot_bound(w, num_slots, num_ranks))


def _partitions(num_groups: int, num_nodes: int):
    """Every way to split ``range(num_groups)`` into ``num_nodes`` unordered parts of equal size."""
    size = num_groups // num_nodes

    def rec(rest):
        if not rest:
            yield []
            return
        first = rest[0]
        for others in itertools.combinations(rest[1:], size - 1):
            part = (first, *others)
            left = [g for g in rest if g not in part]
            for tail in rec(left):
                yield [part, *tail]

    yield from rec(list(range(num_groups)))


def lower_bound(
    w, num_physical: int, num_ranks: int, num_nodes: int = 1, num_groups: int | None = None, max_partitions: int = 5000
) -> np.ndarray:
    """``float[L]``: a lower bound on the heaviest rank's load of any placement of ``w``
    ``float[L, E]`` (module docstring)."""
    w = np.asarray(w, dtype=np.float64)
    num_layers, num_e = w.shape
    glob = row_bound(w, num_physical, num_ranks)
    if not num_groups or num_groups % num_nodes or num_nodes == 1:
        return glob
    parts = []
    for i, p in enumerate(_partitions(num_groups, num_nodes)):
        if i >= max_partitions:
            return glob
        parts.append(p)
    gsize = num_e // num_groups
    wg = w.reshape(num_layers, num_groups, gsize)
    best = np.full(num_layers, np.inf)
    per_node = {}  # a node's bound depends only on its groups
    for p in parts:
        worst = np.zeros(num_layers)
        for node in p:
            if node not in per_node:
                wn = wg[:, list(node)].reshape(num_layers, -1)
                per_node[node] = node_bound(wn, num_physical // num_nodes, num_ranks // num_nodes)
            worst = np.maximum(worst, per_node[node])
        best = np.minimum(best, worst)
    return np.maximum(best, glob)


def _pack(w: np.ndarray, counts: np.ndarray, num_ranks: int, slots_per_rank: int) -> float:
    """The heaviest rank of a greedy packing: copies heaviest first, each onto the lightest
    rank with a free slot that does not hold its expert yet (any free rank when none)."""
    copies = np.repeat(np.arange(len(w)), counts)
    order = np.argsort(-(w / counts)[copies], kind="stable")
    load = np.zeros(num_ranks)
    free = np.full(num_ranks, slots_per_rank)
    holds = np.zeros((num_ranks, len(w)), dtype=bool)
    for e in copies[order]:
        ok = (free > 0) & ~holds[:, e]
        if not ok.any():
            ok = free > 0
        r = int(np.flatnonzero(ok)[np.argmin(load[ok])])
        load[r] += w[e] / counts[e]
        free[r] -= 1
        holds[r, e] = True
    return float(load.max())


def node_upper(w: np.ndarray, num_ranks: int, slots_per_rank: int, hot: int = 4, below: float = np.inf) -> float:
    """A feasible heaviest rank for one node's experts ``w`` ``float[E]`` (every rank full,
    moeshard's rule kept where the greedy can): over the count vectors of the ``hot``
    heaviest experts in the order of :func:`hot_bound`'s value for them, the rest's extra
    copies by largest per-copy load, then :func:`_pack`; stops where that bound reaches the
    best found. ``below``: a known feasible value (returned when nothing beats it)."""
    num_e = len(w)
    hot = min(hot, num_e)
    extra = num_ranks * slots_per_rank - num_e
    idx = np.argsort(-w, kind="stable")
    a = w[idx[:hot]]
    c = _count_vectors(hot, extra)
    copy = a[None] / c
    bound = np.maximum((np.ceil(c / num_ranks) * copy).max(1), w.sum() / num_ranks)
    best = below
    for j in np.argsort(bound, kind="stable"):
        if bound[j] >= best * (1 - 1e-12):
            break
        counts = np.ones(num_e, dtype=np.int64)
        counts[idx[:hot]] = c[j]
        rest, spare = idx[hot:], extra - int(c[j].sum()) + hot
        if spare and not len(rest):
            continue  # every expert is hot: only full count vectors fill the ranks
        for _ in range(spare):
            e = rest[np.argmax(w[rest] / counts[rest])]
            counts[e] += 1
        best = min(best, _pack(w, counts, num_ranks, slots_per_rank))
    return best
