"""The report of a rebalance under move budgets: what moved, per layer and rank pair, and what
the budget cost in balance (:func:`moeshard.eplb.rebalance_with_report`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..placement import Placement
from .budget import FORCED, LEFT, PARTIAL, TAKEN, BudgetAnswer
from .inputs import Shape
from .metrics import copy_counts, held_by_rank, max_over_mean, moves3, rank_loads3
from .moves import pair_moves3, rank_nodes, source_key

STATUS = {LEFT: "left", TAKEN: "taken", PARTIAL: "partial", FORCED: "forced"}


def _ro(a: np.ndarray) -> np.ndarray:
    a = np.array(a)
    a.setflags(write=False)
    return a


@dataclass(frozen=True)
class RebalanceReport:
    """A rebalance under move budgets and what it cost (arrays read-only).

    Attributes:
        placement: the answer (``Placement``, as :func:`~moeshard.eplb.rebalance` returns).
        moved: ``int[L]`` copies moved per layer (:func:`~moeshard.eplb.copies_moved`).
        pair_moves: ``int[L, R, R]`` copies fetched from rank ``a`` (axis 1) onto rank ``b``
            (axis 2) per layer (:func:`~moeshard.eplb.move_pairs`); copies no live rank
            held (read from storage) are in ``moved`` only.
        balance: ``float[L]`` max / mean rank load of the answer (:func:`~moeshard.eplb.balance`).
        balance_unconstrained: ``float[L]`` the same of the answer without move caps (same
            policy and hysteresis).
        balance_old: ``float[L]`` the same of the current placement (dead ranks' slots empty).
        status: ``tuple[str]`` per layer: ``"taken"`` (the unconstrained answer's layer),
            ``"partial"`` (the current layer with some copies moved), ``"left"`` (as it
            was), ``"forced"`` (taken beyond the caps: the current one lost an expert or split
            a group to a dead rank).
    """

    placement: Placement
    moved: np.ndarray
    pair_moves: np.ndarray
    balance: np.ndarray
    balance_unconstrained: np.ndarray
    balance_old: np.ndarray
    status: tuple

    @property
    def copies_moved(self) -> int:
        """Copies moved in all layers."""
        return int(self.moved.sum())

    @property
    def max_pair_moves(self) -> np.ndarray:
        """``int[L]``: per layer, the most copies one ordered rank pair exchanged."""
        return self.pair_moves.max((1, 2))

    @property
    def budget_cost(self) -> np.ndarray:
        """``float[L]``: balance lost to the caps, ``balance - balance_unconstrained`` (<= 0
        where a partial answer beats the unconstrained one)."""
        return self.balance - self.balance_unconstrained

    @property
    def budget_cost_ratio(self) -> float:
        """Mean balance over the mean unconstrained balance (1.0: the caps cost nothing)."""
        return float(self.balance.mean() / self.balance_unconstrained.mean())


def _balance(w: np.ndarray, p2l: np.ndarray, active: np.ndarray) -> np.ndarray:
    return max_over_mean(rank_loads3(w, p2l, copy_counts(p2l, w.shape[1]))[:, active])


def build_report(w: np.ndarray, sh: Shape, old3: np.ndarray, ans: BudgetAnswer, num_nodes: int) -> RebalanceReport:
    """The report of ``ans`` from ``old3`` ``int[L, R, S]`` (dead ranks' slots -1) under ``w``."""
    held = held_by_rank(old3, sh.num_logical)
    key = source_key(rank_nodes(sh.num_ranks, num_nodes))
    pl = Placement(ans.phy2log.reshape(sh.num_layers, -1), num_logical=sh.num_logical, num_ranks=sh.num_ranks)
    return RebalanceReport(
        placement=pl,
        moved=_ro(moves3(held, ans.phy2log)),
        pair_moves=_ro(pair_moves3(held, ans.phy2log, key)),
        balance=_ro(_balance(w, ans.phy2log, sh.active)),
        balance_unconstrained=_ro(_balance(w, ans.free, sh.active)),
        balance_old=_ro(_balance(w, old3, sh.active)),
        status=tuple(STATUS[int(s)] for s in ans.status),
    )
