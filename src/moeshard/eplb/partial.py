"""Partial rebalancing under move caps: a greedy search of single copy moves from the current
placement, across layers, that lowers each layer's heaviest rank the most per copy moved.

A layer's *moves* are slot writes from its current placement (``int[R, S]``):

* **replace**: a live rank ``b`` gets a copy of expert ``e`` (which it does not hold) in a slot
  whose expert ``x`` has another copy (or, where allowed, an empty slot): ``e`` gains a copy,
  ``x`` loses one (every holder's share changes). Tried where it can lower the heaviest rank
  ``p``: on ``p`` itself (``e`` among the experts that add least to it), and a copy of one of
  ``p``'s experts on one of the lightest ranks that may hold it;
* **swap**: ``p``'s copy of ``x`` and a light rank ``b``'s copy of ``y`` exchange ranks
  (two copies moved, replica counts unchanged).

Each move keeps every constraint of a valid answer: every expert keeps a copy, an expert goes
only to a live rank that may hold it (hierarchical: its group's node, ``allowed``), no rank
gets a second copy of an expert. Its cost is counted from the *original* placement, slot by
slot (a copy on a rank that held the expert costs nothing, removing a moved copy gives one
back), and each moved copy's rank pair is :mod:`.moves`'s. A move is feasible while its copies
fit in the caps (total, per rank pair, received per rank; a copy given back is not counted
until it is applied). The search takes, over all layers, the feasible move of highest gain
(drop of the layer's heaviest rank over its mean rank load; with ties at the top, fewer ranks
at it) per copy moved, lazily (a layer's best move is recomputed when it was taken or no
longer fits), until no feasible move lowers any layer. Deterministic: candidates in a fixed
order, ties to the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .metrics import count_last

_BIG = np.iinfo(np.int64).max
_EPS = 1e-12
# candidates per step: experts tried on the heaviest rank, light ranks tried per expert
_K_ADD, _K_LIGHT = 4, 2


@dataclass
class Caps:
    """Remaining caps of a call (``inf`` where none): ``total`` copies, ``pair``
    ``float[R, R]`` (source, receiver), ``recv`` ``float[R]``."""

    total: float
    pair: np.ndarray
    recv: np.ndarray

    @property
    def per_rank(self) -> bool:
        """A pair or a receiver cap is set."""
        return bool(np.isfinite(self.pair).any() or np.isfinite(self.recv).any())


@dataclass(frozen=True)
class _Move:
    score: float
    cost: int
    writes: tuple  # ((rank, slot, expert), ...)


class _Layer:
    """One layer's search state: slots ``q`` ``int[R, S]`` (empty slots as expert ``E``),
    copies per rank ``h`` ``int[R, E + 1]`` (and its transpose), copies ``cnt``
    ``int[E + 1]`` (``cnt[E] = 2``: an empty slot is removable and has no load), per-copy loads
    now (``wc``) and with one copy more (``wn``), rank loads ``L``."""

    def __init__(self, w, p2l, orig, allowed, key, fill_empty):
        num_e = len(w)
        self.num_e = num_e
        self.w = np.append(w, 0.0)
        self.q = np.where(p2l < 0, num_e, p2l)
        self.orig = np.concatenate([orig, np.ones((orig.shape[0], 1), dtype=bool)], axis=1)
        self.allowed = allowed
        self.key = key
        self.fill_empty = fill_empty
        self.h = count_last(p2l, num_e)
        self.hT = np.ascontiguousarray(self.h.T)
        self.cnt = self.h.sum(0)
        self.cnt[num_e] = 2
        self.mean = max(float(w.sum()) / max(int(allowed.any(1).sum()), 1), 1e-300)
        self._derived()

    @property
    def p2l(self) -> np.ndarray:
        return np.where(self.q == self.num_e, -1, self.q)

    def _derived(self) -> None:
        self.wc = self.w / self.cnt
        self.wn = self.w / (self.cnt + 1)
        self.rem = self.cnt >= 2
        self.rem[self.num_e] = self.fill_empty
        self.L = self.wc[self.q].sum(1)

    def src(self, e: int, dst: int) -> int:
        """Source rank of a copy of ``e`` onto ``dst``, -1 where none."""
        has = self.orig[:, e]
        if not has.any():
            return -1
        return int(np.where(has, self.key[dst], _BIG).argmin())

    def best(self, caps: Caps) -> _Move | None:
        """The feasible move of highest score under ``caps``, or None."""
        q, h, hT, w, wc, wn, L, rem = self.q, self.h, self.hT, self.w, self.wc, self.wn, self.L, self.rem
        num_e = self.num_e
        srt = np.argsort(-L, kind="stable")
        p = int(srt[0])
        peak = L[p]
        if peak <= 0:
            return None
        asc = L[srt[::-1]]
        n_peak = len(L) - int(np.searchsorted(asc, peak * (1 - _EPS)))
        xs = q[p]
        # replace on p: a removable x -> e among those adding least to p
        s1 = np.flatnonzero(rem[xs] & (xs < num_e))
        if len(s1):
            add = np.where(self.allowed[p] & (h[p, :num_e] == 0), wn[:num_e], np.inf)
            e1 = np.argsort(add, kind="stable")[:_K_ADD]
            e1 = e1[add[e1] < np.inf]
        else:
            e1 = s1
        # p's experts and, for each, the lightest ranks that may take it
        sx = np.flatnonzero(xs < num_e)
        xv = xs[sx]
        elig = self.allowed[:, xv].T & (hT[xv] == 0)  # [nx, R]
        light = np.argsort(np.where(elig, L, np.inf), axis=1, kind="stable")[:, :_K_LIGHT]
        okb = elig[np.arange(len(xv))[:, None], light][:, :, None]
        qb = q[light]  # [nx, K, S]
        differ = qb != xv[:, None, None]
        # replace on a light rank b: a removable x' -> one of p's experts
        i_x, i_k, i_s = np.nonzero(okb & differ & rem[qb])
        rb = np.concatenate([np.full(len(s1) * len(e1), p), light[i_x, i_k]])
        rs = np.concatenate([np.repeat(s1, len(e1)), i_s])
        re = np.concatenate([np.tile(e1, len(s1)), xv[i_x]])
        rx = np.concatenate([np.repeat(xs[s1], len(e1)), qb[i_x, i_k, i_s]])
        # swaps: p's x <-> b's y (only p and b change)
        yc = np.minimum(qb, num_e - 1)
        j_x, j_k, j_s = np.nonzero(okb & differ & ((qb == num_e) | (self.allowed[p, yc] & (h[p, yc] == 0))))
        wb, wx, wy = light[j_x, j_k], xv[j_x], qb[j_x, j_k, j_s]
        n_a, n_b = len(rb), len(wb)
        if n_a + n_b == 0:
            return None
        # the heaviest rank after each replace (the holders of x and e change)
        hx = self.cnt[rx] - 1
        new = L + hT[rx] * (w[rx] / hx - wc[rx])[:, None] + hT[re] * (wn[re] - wc[re])[:, None]
        new[np.arange(n_a), rb] += wn[re] - w[rx] / hx
        top_a = new.max(1)
        n_top_a = np.count_nonzero(new >= (top_a * (1 - _EPS))[:, None], axis=1)
        # after each swap: p, b and the heaviest other rank
        d = wc[wx] - wc[wy]
        lp, lb = peak - d, L[wb] + d
        if len(L) > 2:
            other = np.where(wb == srt[1], L[srt[2]], L[srt[1]])
        else:
            other = np.zeros(n_b)
        top_b = np.maximum(np.maximum(lp, lb), other)
        t_b = top_b * (1 - _EPS)
        n_top_b = len(L) - np.searchsorted(asc, t_b) + (lp >= t_b) + (lb >= t_b) - (peak >= t_b) - (L[wb] >= t_b)
        top = np.concatenate([top_a, top_b])
        n_top = np.concatenate([n_top_a, n_top_b])
        better = (top < peak * (1 - _EPS)) | ((top <= peak * (1 + _EPS)) & (n_top < n_peak))
        # cost from the original placement, slot by slot
        orig = self.orig
        cost = np.concatenate(
            [
                (~orig[rb, re]).astype(np.int64) - ~orig[rb, rx],
                (~orig[wb, wx]).astype(np.int64) + ~orig[p, wy] - ~orig[wb, wy] - ~orig[p, wx],
            ]
        )
        ok = better & (cost <= caps.total)
        if caps.per_rank and ok.any():
            # each copy added must fit in its pair's and its receiver's caps
            dst = np.concatenate([rb, wb, np.full(n_b, p)])
            exp = np.concatenate([re, wx, np.minimum(wy, num_e - 1)])
            add = np.concatenate([~self.orig[rb, re], ~self.orig[wb, wx], ~self.orig[p, wy]])
            has = self.orig[:, exp].T
            src = np.where(has, self.key[dst], _BIG).argmin(1)
            room = ~add | ~has.any(1) | ((caps.pair[src, dst] >= 1) & (caps.recv[dst] >= 1))
            ok &= np.concatenate([room[:n_a], room[n_a : n_a + n_b] & room[n_a + n_b :]])
        if not ok.any():
            return None
        gain = (peak - top) / self.mean + 1e-9 * (n_peak - n_top)
        i = int(np.where(ok, gain / np.maximum(cost, 0.25), -np.inf).argmax())
        if i < n_a:
            writes = ((int(rb[i]), int(rs[i]), int(re[i])),)
        else:
            j = i - n_a
            writes = ((p, int(sx[j_x[j]]), int(wy[j])), (int(wb[j]), int(j_s[j]), int(wx[j])))
        return _Move(float(gain[i] / max(cost[i], 0.25)), int(cost[i]), writes)

    def fits(self, move: _Move, caps: Caps) -> bool:
        if move.cost > caps.total:
            return False
        for b, _, e in move.writes:
            if not self.orig[b, e]:
                a = self.src(e, b)
                if a >= 0 and (caps.pair[a, b] < 1 or caps.recv[b] < 1):
                    return False
        return True

    def apply(self, move: _Move, caps: Caps) -> None:
        """Write the move's slots; the caps pay for the copies it adds and get back those it
        removes."""
        num_e = self.num_e
        for b, s, e in move.writes:
            x = int(self.q[b, s])
            for ex, sign in ((x, -1), (e, 1)):
                if not self.orig[b, ex]:
                    caps.total -= sign
                    a = self.src(ex, b)
                    if a >= 0:
                        caps.pair[a, b] -= sign
                        caps.recv[b] -= sign
            self.h[b, x] -= 1
            self.h[b, e] += 1
            self.hT[x, b] -= 1
            self.hT[e, b] += 1
            if x < num_e:
                self.cnt[x] -= 1
            if e < num_e:
                self.cnt[e] += 1
            self.q[b, s] = e
        self._derived()


def greedy_moves(
    w: np.ndarray,
    cur3: np.ndarray,
    orig_held: np.ndarray,
    allowed: np.ndarray,
    layers: np.ndarray,
    caps: Caps,
    key: np.ndarray,
    fill_empty: bool,
) -> np.ndarray:
    """The search (module docstring) on ``layers`` of ``cur3`` ``int[L, R, S]`` (the others
    untouched), ``w`` ``float[L, E]``, original holders ``orig_held`` ``bool[L, R, E]``,
    ``allowed`` ``bool[L, R, E]`` (live ranks that may hold an expert), :func:`.moves.source_key`
    ``key``; ``caps`` are spent in place. Returns ``int[L, R, S]``."""
    out = cur3.copy()
    state = {int(k): _Layer(w[k], cur3[k], orig_held[k], allowed[k], key, fill_empty) for k in layers}
    best = {k: st.best(caps) for k, st in state.items()}
    limit = 4 * cur3.shape[1] * cur3.shape[2] * max(len(state), 1)
    for _ in range(limit):
        live = [(m.score, -k) for k, m in best.items() if m is not None]
        if not live:
            break
        layer = -max(live)[1]
        st, m = state[layer], best[layer]
        if st.fits(m, caps):
            st.apply(m, caps)
        best[layer] = st.best(caps)
    for k, st in state.items():
        out[k] = st.p2l
    return out
