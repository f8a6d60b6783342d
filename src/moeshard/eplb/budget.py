"""Move budgets and hysteresis: how much of a new placement to take, given the current one.

A rebalance moves copies between ranks (network traffic, a pause of the layer's experts); a
serving engine bounds that per step (SwiftBalancer exchanges copies between rank pairs under a
cap, STAIR rebalances a layer only when the gain is worth it). :func:`within_budget` answers,
per layer, the current placement, the new one, or the current one with a few copies moved:

* a layer whose current placement is no longer valid (a dead rank held an expert's only live
  copy, or, hierarchical, a group left its node) is always taken, its moves counted first
  (they may exceed the caps);
* **hysteresis**: a layer is rebalanced only where the new heaviest rank is lighter than the
  current one's (under the same load) by more than the factor ``1 + hysteresis``;
* **caps**: copies moved in the call (``max_moves``), per ordered rank pair (source, receiver;
  :mod:`.moves` says which rank a copy comes from) and received per rank. Whole layers are
  taken in order of balance gained per copy moved (gain = drop of the heaviest rank over the
  layer's mean rank load) while their copies fit (a layer that moves no copy costs nothing;
  one that does not fit is skipped, a later smaller one may fit).
* **partial** answers (``partial``): the greedy search of :mod:`.partial` moves single copies
  within the caps, on every layer, from the current placement; then a layer whose whole new
  placement is lighter than its partial answer and fits in its place is taken whole. Where
  that is not lighter in all layers (sum of per-layer max / mean) than whole layers alone,
  whole layers first and the search on the others with the caps left, the lighter of the two
  kept. A partial layer that fails the hysteresis test is left as it is.

So per layer the answer is never less balanced than the current placement, and with
``partial`` in all layers together never less balanced than whole layers alone under the
same caps. With no caps it is the new placement on every layer that passes the hysteresis
test (every layer without hysteresis). With caps and no hysteresis, a layer is rebalanced
only where the new placement is lighter.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .aware import still_valid
from .inputs import Shape
from .metrics import copy_counts, held_by_rank, max_rank_load, moves3
from .moves import pair_moves3, rank_nodes, source_key
from .partial import Caps, greedy_moves

LEFT, TAKEN, PARTIAL, FORCED = 0, 1, 2, 3


@dataclass(frozen=True)
class Budget:
    """Caps of one call (None: no cap): copies moved in all, per ordered rank pair, received
    per rank; and the hysteresis threshold."""

    max_moves: int | None = None
    max_moves_per_pair: int | None = None
    max_moves_per_rank: int | None = None
    hysteresis: float = 0.0

    @property
    def capped(self) -> bool:
        return any(v is not None for v in (self.max_moves, self.max_moves_per_pair, self.max_moves_per_rank))


def check_budget(max_moves, max_moves_per_pair, max_moves_per_rank, hysteresis, has_placement: bool) -> Budget:
    """The validated :class:`Budget`; ValueError naming the argument otherwise."""
    for name, v in (
        ("max_moves", max_moves),
        ("max_moves_per_pair", max_moves_per_pair),
        ("max_moves_per_rank", max_moves_per_rank),
    ):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer or None, got {v!r}")
        if not has_placement:
            raise ValueError(f"{name} needs the current placement (moves are counted from it)")
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, (int, float, np.integer, np.floating)):
        raise ValueError(f"hysteresis must be a number >= 0, got {hysteresis!r}")
    if not hysteresis >= 0 or not np.isfinite(hysteresis):
        raise ValueError(f"hysteresis must be a finite number >= 0, got {hysteresis!r}")

    def opt(v):
        return None if v is None else int(v)

    return Budget(opt(max_moves), opt(max_moves_per_pair), opt(max_moves_per_rank), float(hysteresis))


@dataclass(frozen=True)
class BudgetAnswer:
    """``phy2log`` ``int[L, R, S]``; ``status`` ``int8[L]``: ``LEFT`` (current placement),
    ``TAKEN`` (new), ``PARTIAL``, ``FORCED`` (new, beyond the caps: the current one was
    invalid); ``free``: the answer without caps (same hysteresis)."""

    phy2log: np.ndarray
    status: np.ndarray
    free: np.ndarray


def _allowed(old3: np.ndarray, held: np.ndarray, sh: Shape) -> np.ndarray:
    """``bool[L, R, E]``: live ranks that may hold an expert in a partial answer (hierarchical:
    those of the node its group lives on in ``old3``)."""
    num_layers, num_ranks, _ = old3.shape
    live = np.broadcast_to(sh.active[None, :, None], held.shape)
    if not sh.hierarchical:
        return live.copy()
    node = np.arange(num_ranks) // sh.ranks_per_node
    g_held = held.reshape(num_layers, num_ranks, sh.num_groups, -1).any(-1)  # [L, R, G]
    on_node = np.zeros((num_layers, sh.num_nodes, sh.num_groups), dtype=bool)
    np.logical_or.at(on_node, (slice(None), node), g_held)
    gnode = on_node.argmax(1)  # [L, G]
    ok = node[None, :, None] == gnode[:, None, :]  # [L, R, G]
    return live & np.repeat(ok, sh.num_logical // sh.num_groups, axis=2)


def _caps(b: Budget, num_ranks: int) -> Caps:
    inf = float("inf")
    pair = np.full((num_ranks, num_ranks), inf if b.max_moves_per_pair is None else float(b.max_moves_per_pair))
    recv = np.full(num_ranks, inf if b.max_moves_per_rank is None else float(b.max_moves_per_rank))
    return Caps(inf if b.max_moves is None else float(b.max_moves), pair, recv)


def _pay(caps: Caps, moves: int, pairs: np.ndarray, sign: int = 1) -> None:
    caps.total -= sign * moves
    caps.pair -= sign * pairs
    caps.recv -= sign * pairs.sum(0)


def _fits(caps: Caps, moves: int, pairs: np.ndarray) -> bool:
    return moves <= caps.total and bool((pairs <= caps.pair).all()) and bool((pairs.sum(0) <= caps.recv).all())


def _peaks(w: np.ndarray, p2l: np.ndarray) -> np.ndarray:
    return max_rank_load(w, p2l, np.maximum(copy_counts(p2l, w.shape[1]), 1))


def within_budget(
    w: np.ndarray,
    old3: np.ndarray,
    new3: np.ndarray,
    sh: Shape,
    num_nodes: int,
    budget: Budget,
    partial: bool,
    fill_empty: bool = False,
) -> BudgetAnswer:
    """Per layer ``new3``, ``old3`` (``int[L, R, S]``, dead ranks' slots -1) or ``old3`` with
    copies moved, under the load ``w`` ``float[L, E]`` (module docstring); ``num_nodes``: the
    job's nodes (sources prefer the receiver's node); ``partial``: search partial answers
    (else whole layers only); ``fill_empty``: a partial answer may put copies into empty
    slots."""
    num_layers, num_logical = w.shape
    held = held_by_rank(old3, num_logical)
    moves = moves3(held, new3)
    old_max = _peaks(w, old3)
    new_max = _peaks(w, new3)
    must = ~still_valid(old3, sh)
    worth = ~must & (old_max > new_max * (1 + budget.hysteresis) * (1 + 1e-12))
    if budget.hysteresis == 0 and not budget.capped:  # every layer new, as without a placement
        return BudgetAnswer(new3, np.where(must, FORCED, TAKEN).astype(np.int8), new3)
    status = np.where(must, FORCED, np.where(worth, TAKEN, LEFT)).astype(np.int8)
    # the answer without caps: every layer new unless hysteresis leaves it
    free = np.where((must | worth)[:, None, None], new3, old3) if budget.hysteresis > 0 else new3
    if not budget.capped:
        return BudgetAnswer(free, status, free)
    key = source_key(rank_nodes(sh.num_ranks, num_nodes))
    pairs = pair_moves3(held, new3, key)
    caps = _caps(budget, sh.num_ranks)
    for layer in np.flatnonzero(must):
        _pay(caps, int(moves[layer]), pairs[layer])
    mean = np.maximum(w.sum(1) / int(sh.active.sum()), 1e-300)
    gain = (old_max - new_max) / mean
    cands = np.flatnonzero(worth)
    order = cands[np.argsort(-gain[cands] / np.maximum(moves[cands], 0.5), kind="stable")]

    # whole layers first, then the search on the others
    caps_w = Caps(caps.total, caps.pair.copy(), caps.recv.copy())
    whole = np.zeros(num_layers, dtype=bool)
    for layer in order:
        if _fits(caps_w, int(moves[layer]), pairs[layer]):
            whole[layer] = True
            _pay(caps_w, int(moves[layer]), pairs[layer])
    base = np.where((must | whole)[:, None, None], new3, old3)
    if not partial or whole[cands].all():
        return BudgetAnswer(base, np.where(worth & ~whole, LEFT, status).astype(np.int8), free)
    if min(caps.total, caps.pair.max(), caps.recv.max()) < 1:
        return BudgetAnswer(base, np.where(worth & ~whole, LEFT, status).astype(np.int8), free)
    allowed = _allowed(old3, held, sh)

    def settle(ans: np.ndarray) -> tuple[np.ndarray, float]:
        """Partial layers that fail the hysteresis test are left as they were; the answer and
        its sum of balance over the candidate layers."""
        peaks = _peaks(w, ans)
        changed = (ans != old3).any((1, 2)) & worth
        same_new = (ans == new3).all((1, 2))
        weak = changed & ~same_new & ~(old_max > peaks * (1 + budget.hysteresis) * (1 + 1e-12))
        ans = np.where(weak[:, None, None], old3, ans)
        return ans, float((np.where(weak, old_max, peaks)[cands] / mean[cands]).sum())

    # the search on every layer first, then whole layers where lighter and fitting
    second = greedy_moves(w, old3, held, allowed, cands, caps, key, fill_empty)
    part_max = _peaks(w, second)
    part_moves, part_pairs = moves3(held, second), pair_moves3(held, second, key)
    for layer in order:
        if new_max[layer] >= part_max[layer] * (1 - 1e-12):
            continue
        p_moves, p_pairs = int(part_moves[layer]), part_pairs[layer]
        _pay(caps, p_moves, p_pairs, -1)
        if _fits(caps, int(moves[layer]), pairs[layer]):
            _pay(caps, int(moves[layer]), pairs[layer])
            second[layer] = new3[layer]
        else:
            _pay(caps, p_moves, p_pairs)
    ans, cost = settle(second)
    if cost >= float(
        (new_max[cands] / mean[cands])[whole[cands]].sum() + (old_max[cands] / mean[cands])[~whole[cands]].sum()
    ) * (1 - 1e-12):
        # not lighter than whole layers alone: whole layers first, then the search on the others
        first, cost1 = settle(greedy_moves(w, base, held, allowed, cands[~whole[cands]], caps_w, key, fill_empty))
        if cost1 <= cost:
            ans = first
    same_new = (ans == new3).all((1, 2))
    same_old = (ans == old3).all((1, 2))
    st = np.where(same_new, TAKEN, np.where(same_old, LEFT, PARTIAL))
    st = np.where(must, FORCED, np.where(worth, st, LEFT)).astype(np.int8)
    return BudgetAnswer(ans, st, free)
