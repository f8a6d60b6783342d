"""Joint search over replica counts and packing: the oblivious policy's answer improved where a
better choice of how many copies each expert gets lowers the heaviest rank.

deepseek-ai/EPLB fixes the replica counts first (each redundant slot to the expert of highest
load per copy) and packs the copies afterwards; with few slots per rank the counts decide the
balance (FlashLB's example, 8 experts ``[600, 560, 120, 120, 20, 10, 10, 10]`` on 8 ranks x 2
slots: those counts leave 240 or, refined, 232 on the busiest rank, while the counts
``[4, 3, 1, 3, 1, 1, 1, 2]`` reach 196.7, the optimum). Here counts and packing are searched
together, per node of a layer (the groups on each node stay those of the oblivious answer, so
node and group constraints hold; dead ranks have no packs):

* every count vector is packed by the reference's greedy (heaviest copy first onto the
  lightest rank with room, no two copies of an expert on a rank when avoidable) and refined by
  the swap local search (:func:`moeshard.eplb.refine.lower_peak`);
* **enumeration**: an expert needs at least ``ceil(w / U)`` copies for its copies to fit under
  the best heaviest rank ``U`` found so far; where the ways to spread the remaining slots over
  the experts are few (:data:`ENUMERATE`), every one is packed;
* **local search** elsewhere: moves of one copy from an expert to one on the heaviest rank
  (from the experts whose copy grows least), kept while the heaviest rank drops (or stays and
  the sum of squared rank loads drops), rounds bounded by :data:`ROUNDS`;
* rows already at the lower bound (the mean rank load, or the smallest ``T`` with
  ``sum max(1, ceil(w / T)) <= slots``) are left alone.

A layer takes the search's answer only where its heaviest rank is lighter than the oblivious
answer's, so the policy stays never less balanced than the reference. Arrays are batched over
rows ``[B, ...]`` (one node of one layer each).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from .inputs import Shape
from .metrics import count_last, load_per_copy
from .oblivious import ObliviousAnswer, balanced_pack, per_rank_cap, repair_duplicates, replicate_nodes, scatter_packs
from .refine import lower_peak

# Most count vectors packed by the enumeration per call (spread over the rows that need it,
# at least ENUMERATE_ROW per row; rows with more ways go to the local search).
ENUMERATE = 4096
ENUMERATE_ROW = 64
# Most rows x count vectors packed in one batch of the enumeration (memory).
BATCH = 16384
# Local search rounds, and the most experts whose copy is taken per round.
ROUNDS = 6
NUM_DONORS = 6
# Most count vectors packed per local search round (fewer donors per row when many rows).
ROUND_BUDGET = 512
# Nodes of more slots than this are left to the oblivious policy: the search repacks whole
# rows many times (seconds at DeepSeek-V3's shape), and there it found no lighter rank (nine
# slots per rank leave the packing room to even out the counts' choice).
SEARCH_SLOTS = 64
# Relative margin of "lighter" (sums of the same copies in another order differ by ulps).
_TIE = 1e-12


def count_bound(w: np.ndarray, num_slots: int) -> np.ndarray:
    """``float[B]``: per row of ``w`` ``float[B, n]``, the smallest ``T`` with
    ``sum_e max(1, ceil(w[e] / T)) <= num_slots``: no placement puts every copy under it."""
    num_b, n = w.shape
    ks = np.arange(1, num_slots - n + 2)
    cand = np.sort((w[:, :, None] / ks).reshape(num_b, -1), axis=1)
    rows = np.arange(num_b)
    lo, hi = np.zeros(num_b, dtype=np.int64), np.full(num_b, cand.shape[1] - 1)
    while (lo < hi).any():
        mid = (lo + hi) // 2
        t = np.maximum(cand[rows, mid], 1e-300)
        ok = np.maximum(1, np.ceil(w / t[:, None] * (1 - 1e-12))).sum(1) <= num_slots
        hi = np.where(ok & (lo < hi), mid, hi)
        lo = np.where(~ok & (lo < hi), mid + 1, lo)
    return cand[rows, lo]


def row_bound(w: np.ndarray, num_slots: int, num_ranks: int) -> np.ndarray:
    """``float[B]``: a lower bound on a row's heaviest rank: the mean rank load or
    :func:`count_bound`, the larger."""
    return np.maximum(w.sum(1) / num_ranks, count_bound(w, num_slots))


def pack_counts(
    w: np.ndarray, cnt: np.ndarray, num_ranks: int, num_s: int, duplicates: bool = False, repair: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``cnt`` ``int[B, n]`` copies (sum ``num_ranks * num_s`` per row) of items of load
    ``w`` ``float[B, n]`` onto ``num_ranks`` ranks of ``num_s`` slots: the reference's greedy
    with moeshard's rule, the swap repair, the swap local search. ``duplicates``: also without
    the rule, taken per row where strictly lighter (a rank with two copies of an expert
    carries both shares; with few slots that can lower the heaviest rank). ``repair``: the
    swap repair of the rule's rare dead ends (a loop over rows: the search scores count
    vectors without it and repairs its final answer). Returns packs
    ``int[B, num_ranks, num_s]`` item ids and rank loads ``float[B, num_ranks]``."""
    num_b, n = w.shape
    phy = np.repeat(np.tile(np.arange(n), num_b), cnt.ravel()).reshape(num_b, -1)
    wc = load_per_copy(w, cnt)
    rows = np.arange(num_b)[:, None]
    bi = np.arange(num_b)[:, None, None]
    out = []
    for rule in (True, False) if duplicates else (True,):
        slots = balanced_pack(wc[rows, phy], phy if rule else None, n, num_ranks, num_s)
        packs = phy[bi, slots]
        cap = per_rank_cap(cnt, np.full(num_b, num_ranks))
        if rule and repair:
            repair_duplicates(packs, wc, cap)
        else:
            cap = np.maximum(cap, count_last(packs, n)[..., :n].max(1))
        lower_peak(packs[:, None], wc, cap)
        out.append((packs, wc[bi, packs].sum(-1)))
    packs, loads = out[0]
    if duplicates:
        take = out[1][1].max(1) < loads.max(1) * (1 - _TIE)
        packs[take], loads[take] = out[1][0][take], out[1][1][take]
    return packs, loads


def fill_counts(w: np.ndarray, cnt: np.ndarray, num_slots: int, num_ranks: int) -> np.ndarray:
    """``cnt`` ``int[B, n]`` with the remaining slots of each row given, one by one, to the
    item of highest load per copy among those with fewer than ``num_ranks`` copies (moeshard's
    spread counts)."""
    cnt = cnt.copy()
    rows = np.arange(len(cnt))
    for _ in range(int((num_slots - cnt.sum(1)).max(initial=0))):
        todo = cnt.sum(1) < num_slots
        pc = np.where(cnt < num_ranks, w / cnt, -np.inf)
        pc = np.where(np.isneginf(pc).all(1, keepdims=True), w / cnt, pc)
        j = pc.argmax(1)
        cnt[rows[todo], j[todo]] += 1
    return cnt


def _score(loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return loads.max(1), (loads * loads).sum(1)


def _better(peak, sq, best_peak, best_sq) -> np.ndarray:
    lower = peak < best_peak * (1 - _TIE)
    same = peak <= best_peak * (1 + _TIE)
    return lower | (same & (sq < best_sq * (1 - 1e-9)))


class _Best:
    """Per row, the best count vector found so far, its packs and score."""

    def __init__(self, w, cnt, num_ranks, num_s):
        self.cnt = cnt.copy()
        self.packs, loads = pack_counts(w, cnt, num_ranks, num_s, repair=False)
        self.peak, self.sq = _score(loads)

    def offer(self, rows: np.ndarray, cnt: np.ndarray, packs: np.ndarray, loads: np.ndarray) -> np.ndarray:
        """Candidates for ``rows`` (repeats allowed: the best per row wins); ``bool``: row improved."""
        peak, sq = _score(loads)
        order = np.lexsort((sq, peak, rows))
        first = order[np.r_[True, rows[order][1:] != rows[order][:-1]]]
        r = rows[first]
        take = _better(peak[first], sq[first], self.peak[r], self.sq[r])
        r, f = r[take], first[take]
        self.cnt[r], self.packs[r], self.peak[r], self.sq[r] = cnt[f], packs[f], peak[f], sq[f]
        out = np.zeros(len(self.peak), dtype=bool)
        out[r] = True
        return out


def _compositions(n: int, extra: int) -> np.ndarray:
    """``int[C, n]``: every way to give ``extra`` more copies to ``n`` items."""
    if extra == 0:
        return np.zeros((1, n), dtype=np.int64)
    combos = np.array(list(itertools.combinations_with_replacement(range(n), extra)), dtype=np.int64)
    return count_last(combos, n)[:, :n]


def _enumerate(w, best: _Best, rows: np.ndarray, num_ranks: int, num_s: int) -> None:
    """Every count vector within the best heaviest rank so far, for ``rows`` where they are few."""
    n = w.shape[1]
    num_slots = num_ranks * num_s
    kmin = np.maximum(1, np.ceil(w[rows] / best.peak[rows, None] * (1 - 1e-12))).astype(np.int64)
    extra = num_slots - kmin.sum(1)
    per_row = max(ENUMERATE_ROW, ENUMERATE // len(rows))
    for x in np.unique(extra):
        if x < 0 or math.comb(n + x - 1, x) > per_row:
            continue
        sel, kx = rows[extra == x], kmin[extra == x]
        comps = _compositions(n, int(x))
        per = max(1, BATCH // len(comps))
        for i in range(0, len(sel), per):
            r = sel[i : i + per]
            rr = np.repeat(r, len(comps))
            cnt = np.repeat(kx[i : i + per], len(comps), 0) + np.tile(comps, (len(r), 1))
            packs, loads = pack_counts(w[rr], cnt, num_ranks, num_s, repair=False)
            best.offer(rr, cnt, packs, loads)


def _local_search(w, best: _Best, rows: np.ndarray, lb: np.ndarray, num_ranks: int, num_s: int) -> None:
    """Moves of one copy from a donor (an expert whose copy grows least) to an expert on the
    heaviest rank, the best per row and round while it improves."""
    n = w.shape[1]
    for _ in range(ROUNDS):
        rows = rows[best.peak[rows] > lb[rows] * (1 + 1e-9)]
        if not len(rows):
            return
        num_d = max(1, min(NUM_DONORS, n, ROUND_BUDGET // (len(rows) * num_s)))
        cnt, wr = best.cnt[rows], w[rows]
        loads = load_per_copy(wr, cnt)[np.arange(len(rows))[:, None, None], best.packs[rows]].sum(-1)
        h = loads.argmax(1)
        takers = best.packs[rows, h]  # [m, S]
        grow = np.where(cnt > 1, wr / np.maximum(cnt - 1, 1) - wr / cnt, np.inf)
        donors = np.argsort(grow, axis=1, kind="stable")[:, :num_d]  # [m, D]
        ok = np.take_along_axis(np.isfinite(grow), donors, 1)[:, None, :] & (takers[:, :, None] != donors[:, None, :])
        m_, t_, d_ = np.nonzero(ok)
        if not len(m_):
            return
        cand = cnt[m_].copy()
        cand[np.arange(len(m_)), takers[m_, t_]] += 1
        cand[np.arange(len(m_)), donors[m_, d_]] -= 1
        packs, cl = pack_counts(wr[m_], cand, num_ranks, num_s, repair=False)
        improved = best.offer(rows[m_], cand, packs, cl)
        rows = rows[improved[rows]]


def search(
    w: np.ndarray, starts: list[np.ndarray], num_ranks: int, num_s: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The joint search on rows ``w`` ``float[B, n]`` (``num_ranks`` ranks of ``num_s`` slots
    each), from the count vectors ``starts`` (each ``int[B, n]``). Returns counts ``int[B, n]``,
    packs ``int[B, num_ranks, num_s]`` (item ids) and heaviest rank ``float[B]``."""
    num_slots = num_ranks * num_s
    best = _Best(w, starts[0], num_ranks, num_s)
    if num_slots > SEARCH_SLOTS:
        return best.cnt, best.packs, best.peak
    for c in starts[1:]:
        new = np.flatnonzero((c != starts[0]).any(1))
        if len(new):
            best.offer(new, c[new], *pack_counts(w[new], c[new], num_ranks, num_s, repair=False))
    lb = row_bound(w, num_slots, num_ranks)
    # counts just enough for every copy to fit under a few targets above the bound
    loaded = np.flatnonzero(lb > 0)  # a row with no load is balanced as it is
    for f in (1.0, 1.02, 1.05):
        c = np.maximum(1, np.ceil(w[loaded] / (lb[loaded] * f)[:, None] * (1 - 1e-12))).astype(np.int64)
        keep = c.sum(1) <= num_slots
        fits, c = loaded[keep], c[keep]
        if len(fits):
            c = fill_counts(w[fits], c, num_slots, num_ranks)
            best.offer(fits, c, *pack_counts(w[fits], c, num_ranks, num_s, repair=False))
    open_ = np.flatnonzero(best.peak > lb * (1 + 1e-9))
    if len(open_):
        _enumerate(w, best, open_, num_ranks, num_s)
    open_ = np.flatnonzero(best.peak > lb * (1 + 1e-9))
    if len(open_):
        _local_search(w, best, open_, lb, num_ranks, num_s)
    # the final counts packed again with the rule's repair (the search scored them without)
    packs, loads = pack_counts(w, best.cnt, num_ranks, num_s)
    return best.cnt, packs, loads.max(1)


def joint_improve(w: np.ndarray, sh: Shape, obl: ObliviousAnswer) -> ObliviousAnswer:
    """``obl`` (the oblivious answer) with the layers where the joint search, on the same groups
    per node, finds a lighter heaviest rank replaced by the search's answer."""
    num_layers, num_logical = w.shape
    n, live, s = sh.num_nodes, sh.live_per_node, sh.slots_per_rank
    if live * s > SEARCH_SLOTS:
        return obl
    mlog2log, _, spread_cnt, _ = replicate_nodes(w, obl.group_node, sh, spread=True)
    w_m = np.take_along_axis(np.repeat(w, n, axis=0), mlog2log, axis=1)
    own = np.take_along_axis(np.repeat(obl.cnt, n, axis=0), mlog2log, axis=1)
    cnt_m, packs_m, _ = search(w_m, [own, spread_cnt], live, s)
    packs = np.take_along_axis(mlog2log, packs_m.reshape(num_layers * n, -1), axis=1)
    packs = packs.reshape(num_layers, n, live, s)
    cnt = np.zeros((num_layers, num_logical), dtype=np.int64)
    np.put_along_axis(cnt, mlog2log.reshape(num_layers, -1), cnt_m.reshape(num_layers, -1), axis=1)
    p2l = scatter_packs(packs, sh)
    wc = load_per_copy(w, cnt)
    li = np.arange(num_layers)[:, None, None]
    max_load = np.where(p2l >= 0, wc[li, np.maximum(p2l, 0)], 0.0).sum(-1).max(1)
    # taken where lighter and keeping moeshard's rule (the repair may meet a dead end)
    per_rank = count_last(packs.reshape(num_layers, n * live, s), num_logical)[..., :num_logical]
    keeps = (per_rank <= per_rank_cap(cnt, np.full(num_layers, live))[:, None, :]).all((1, 2))
    take = keeps & (max_load < obl.max_load * (1 - _TIE))
    if not take.any():
        return obl
    fields = {f: getattr(obl, f).copy() for f in ObliviousAnswer.__dataclass_fields__}
    fields["packs"][take], fields["cnt"][take], fields["phy2log"][take] = packs[take], cnt[take], p2l[take]
    fields["max_load"][take] = max_load[take]
    return ObliviousAnswer(**fields)
