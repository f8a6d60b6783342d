"""Expert-parallel load balancing (EPLB): where each logical expert's copies should live.

Pure numpy, no torch, no communication: every rank computes the same answer from the same
``load`` (tokens routed to each logical expert, ``float[num_layers, num_logical]``).

Policies
--------
*Oblivious* (``migration_aware=False``, or no current placement) re-implements
deepseek-ai/EPLB (``eplb.py``): **hierarchical** (``num_groups`` given, ``num_groups %
num_nodes == 0`` and every node has the same number of live ranks: expert groups onto nodes,
then replicas and their copies onto each node's live ranks) or **global** otherwise (one
group, one node), and improves it: per layer, the most balanced of the reference's steps,
the same with, per node, the lighter packing of *spread* replica counts (at most one copy per
live rank of a node until every expert has that many) and *hot-spread* counts (besides, a
node's few heaviest experts get at most one copy per live rank together) and the reference's
answer itself, each refined by a swap local search
that never raises the heaviest rank. So per layer it is never less balanced (max/mean rank
load) than the reference, by construction. One rule is added: a rank never holds two copies
of one expert when it can be avoided, unless keeping the rule would be less balanced than
the reference (then the reference's own duplicates are kept). Where a node has few slots (at most
64: small shapes, where the replica counts decide the balance), a joint search over replica
counts and packing replaces a layer's answer when it is lighter (:mod:`moeshard.eplb.joint`;
it reaches the optimum of FlashLB's example, 196.7 where the reference has 232). Slots of dead (or not yet
joined) ranks are ``-1``; slot ids stay those of the full job, so an elastic job never
renumbers. Details: :mod:`moeshard.eplb.oblivious`.

*Reference* (:func:`reference`): deepseek-ai/EPLB's exact answer (no moeshard rule; its
float32 arithmetic), to compare against without the reference installed.

*Migration-aware* (``migration_aware=True`` and a current placement): the oblivious answer
ignores where experts already are, so a rebalance after a small drift of the load can move
almost every copy. This policy is, per layer, never less balanced (max/mean rank load) than
the reference's answer, times ``(1 + tolerance)`` (default 0), while moving few copies: per
node it keeps copies on their ranks as far as that balance allows ("sticky packing"; where
groups must change node, also with the assignments of groups to nodes that move fewest
copies), else takes the oblivious answer's packing of the node with copies swapped back to their old ranks,
and per layer the candidate within the limit with the fewest moved copies (the oblivious and
the reference's answers always are ones); last, moved copies are replaced by copies of experts
their rank already holds, or shifted to ranks of their node that held them, where the limit
allows (nothing travels for those). It is not held
to the oblivious answer's balance (often better than the reference's): that would move 2-3.5x as many copies. Like the
reference, it may put two copies of an expert on one rank. With ``tolerance_scope="step"`` the
tolerance holds on the call's mean balance over layers instead (each layer solved under a few
limits, the slack spent where it saves most copies). Details: :mod:`moeshard.eplb.aware`.

In every candidate an expert that stays on a rank keeps its slot index; newcomers fill the
freed slots in order.

*Move caps* (a current placement): copies moved in all, per rank pair and received per rank,
and hysteresis (:mod:`moeshard.eplb.budget`); whole layers taken or left, or with ``partial``
single copies moved within the caps (:mod:`moeshard.eplb.partial`). :func:`rebalance_with_report`
says what moved and what the caps cost in balance (:class:`RebalanceReport`).

Metrics: :func:`rank_loads`, :func:`balance`, :func:`copies_moved`, :func:`move_pairs`,
:func:`slots_changed`.
:func:`balance` counts two copies of an expert on one rank as two loads (``load / logcnt``
each), as the reference's packing weighs them.

Modules, each built on those above it:

* ``inputs``: input checks and the validated shape of a call (``Shape``);
* ``metrics``: rank loads, balance, moved copies (public and array forms);
* ``refine``: the swap local search that lowers a packing's heaviest rank;
* ``oblivious``: deepseek-ai/EPLB's policy (replicate, balanced packing, hierarchical / global)
  and moeshard's improvement of it (spread counts, refinement, the most balanced per layer);
* ``sticky``: sticky packing of copies onto ranks, the swap repair, the restoring local search;
* ``joint``: the joint search over replica counts and packing (small nodes);
* ``moves``: the source rank of a moved copy, copies per rank pair (:func:`move_pairs`);
* ``partial``: the greedy search of single copy moves within the caps;
* ``budget``: move caps and hysteresis (how much of a new placement to take);
* ``replicas``: replica budgets per layer (:func:`rebalance_replicas`), global and hierarchical;
* ``report``: :class:`RebalanceReport`;
* ``fill``: moved copies replaced by copies of experts their rank held (the aware policy's
  last passes, and their shared rounds);
* ``shift``: moved copies shifted to ranks of their node that held them;
* ``aware``: the migration-aware policy (per node and layer, the candidate that moves fewest
  copies);
* here: :func:`rebalance`, the entry point, and :func:`reference`.
"""

from __future__ import annotations

import numpy as np

from ..placement import Placement, slots_changed
from .aware import aware_policy, step_policy
from .budget import check_budget, within_budget
from .inputs import check_load, check_placement, check_shape
from .joint import joint_improve
from .metrics import balance, copies_moved, rank_loads
from .moves import move_pairs
from .oblivious import oblivious_policy, reference_answer
from .replicas import replica_policy
from .report import RebalanceReport, build_report

__all__ = [
    "rebalance",
    "rebalance_with_report",
    "RebalanceReport",
    "rebalance_replicas",
    "reference",
    "rank_loads",
    "balance",
    "copies_moved",
    "move_pairs",
    "slots_changed",
]


def _solve(
    load,
    placement,
    num_physical,
    num_ranks,
    num_nodes,
    num_groups,
    active_ranks,
    migration_aware,
    tolerance,
    relative_to,
    budget_args,
    partial,
    tolerance_scope="layer",
):
    """The validated call and its answer: ``(w, sh, old3 or None, BudgetAnswer or None, new3)``."""
    w = check_load(load)
    sh = check_shape(w, num_physical, num_ranks, num_nodes, num_groups, active_ranks)
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if relative_to not in ("reference", "oblivious"):
        raise ValueError(f"relative_to must be 'reference' or 'oblivious', got {relative_to!r}")
    if not isinstance(partial, (bool, np.bool_)):
        raise ValueError(f"partial must be a bool, got {partial!r}")
    if tolerance_scope not in ("layer", "step"):
        raise ValueError(f"tolerance_scope must be 'layer' or 'step', got {tolerance_scope!r}")
    budget = check_budget(*budget_args, has_placement=placement is not None)
    if placement is not None:
        check_placement(placement, sh)
    ref = reference_answer(w, sh)
    obl = joint_improve(w, sh, oblivious_policy(w, sh, ref))
    if not migration_aware or placement is None:
        new = obl.phy2log
    elif tolerance_scope == "step" and tolerance > 0:
        new = step_policy(w, placement, obl, ref, sh, float(tolerance), relative_to)
    else:
        limit = obl.max_load * (1 + tolerance) if relative_to == "oblivious" else None
        new = aware_policy(w, placement, obl, ref, sh, float(tolerance), limit)
    if placement is None:
        return w, sh, None, None, new
    old3 = np.where(sh.active[None, :, None], placement.phy2log.reshape(new.shape), -1)
    ans = within_budget(w, old3, new, sh, int(num_nodes), budget, bool(partial))
    return w, sh, old3, ans, ans.phy2log


def rebalance(
    load,
    placement: Placement | None = None,
    *,
    num_physical: int,
    num_ranks: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
    active_ranks=None,
    migration_aware: bool = True,
    tolerance: float = 0.0,
    relative_to: str = "reference",
    tolerance_scope: str = "layer",
    hysteresis: float = 0.0,
    max_moves: int | None = None,
    max_moves_per_pair: int | None = None,
    max_moves_per_rank: int | None = None,
    partial: bool = False,
) -> Placement:
    """A balanced placement of every MoE layer's experts for ``load``.

    Args:
        load: ``float[num_layers, num_logical]`` tokens routed to each logical expert.
        placement: the current placement (``num_layers x num_physical``), or None.
        num_physical: physical slots per layer (all ranks, dead ones included).
        num_ranks: EP size of the full job (dead ranks included); slot ``p`` is on rank
            ``p // (num_physical // num_ranks)``.
        num_nodes: nodes; ranks ``[k * num_ranks/num_nodes, (k+1) * num_ranks/num_nodes)``
            are node k.
        num_groups: expert groups (group-limited routing) for the hierarchical policy; None
            for the global policy.
        active_ranks: ``bool[num_ranks]`` live ranks (None: all). Slots of the others are -1.
        migration_aware: keep copies where they are as far as the balance allows (see the
            module docstring); False: moeshard's oblivious policy (also the answer when
            ``placement`` is None), never less balanced than the reference per layer.
        tolerance: per layer, the aware policy's max/mean rank load is at most
            ``(1 + tolerance)`` x the reference's (:func:`reference`; default 0: never less
            balanced than the reference), or the oblivious policy's (``relative_to``).
        relative_to: ``"reference"`` (default) or ``"oblivious"``: the answer whose balance
            ``tolerance`` is relative to (the oblivious answer is at least as balanced).
        tolerance_scope: ``"layer"`` (default): ``tolerance`` holds on every layer;
            ``"step"``: on the mean over layers of max/mean rank load (the call's mean is at
            most ``(1 + tolerance)`` x that of the ``relative_to`` answer), each layer at most
            ``1 + 8 x tolerance`` x its own, the slack spent on the layers where it saves most
            copies (fewer copies moved than ``"layer"``, never more; a few times its time).
        hysteresis: with a current placement, a layer is rebalanced only where the new
            heaviest rank is lighter than the current one's by more than ``1 + hysteresis``
            (0: any gain); layers whose current placement is invalid (dead ranks) always are.
        max_moves: with a current placement, at most this many copies moved in all (copies
            whose rank did not hold the expert, :func:`copies_moved`); layers in order of
            balance gained per copy moved, each either rebalanced or left as it is (``0``:
            nothing moves), or, with ``partial``, the best balance the greedy search of
            single copy moves finds within the caps. Only layers that a dead rank leaves
            without a live copy of an expert (or, hierarchical, split a group) are
            rebalanced beyond it. None: no cap.
        max_moves_per_pair: at most this many copies fetched from one rank onto another
            (ordered pair; the source of a copy is :func:`move_pairs`'s: a live holder on
            the receiver's node first). None: no cap.
        max_moves_per_rank: at most this many copies received by one rank. None: no cap.
        partial: with a cap, a layer whose whole new placement does not fit may move only
            some copies (:mod:`moeshard.eplb.budget`): never less balanced than the current
            placement per layer, nor in all layers than whole layers alone.

    Returns:
        ``Placement`` with ``phy2log`` ``int[num_layers, num_physical]``.

    Raises:
        ValueError: malformed ``load``, shapes that do not divide, fewer live slots than
            experts, bad ``active_ranks``, a ``placement`` of another shape, a cap that is not
            a non-negative integer or is given without ``placement``.
    """
    w, sh, _, _, new = _solve(
        load,
        placement,
        num_physical,
        num_ranks,
        num_nodes,
        num_groups,
        active_ranks,
        migration_aware,
        tolerance,
        relative_to,
        (max_moves, max_moves_per_pair, max_moves_per_rank, hysteresis),
        partial,
        tolerance_scope,
    )
    return Placement(new.reshape(sh.num_layers, -1), num_logical=sh.num_logical, num_ranks=sh.num_ranks)


def rebalance_with_report(
    load,
    placement: Placement,
    *,
    num_physical: int,
    num_ranks: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
    active_ranks=None,
    migration_aware: bool = True,
    tolerance: float = 0.0,
    relative_to: str = "reference",
    tolerance_scope: str = "layer",
    hysteresis: float = 0.0,
    max_moves: int | None = None,
    max_moves_per_pair: int | None = None,
    max_moves_per_rank: int | None = None,
    partial: bool = True,
) -> RebalanceReport:
    """:func:`rebalance` from the current ``placement`` (required), with what it moved and what
    the caps cost in balance. Arguments as :func:`rebalance`; ``partial`` defaults to True
    here (the best balance within the caps); ``report.placement`` is what :func:`rebalance`
    returns with the same arguments.

    Returns:
        :class:`RebalanceReport`: the placement; per layer copies moved, copies per rank
        pair, balance of the answer, of the answer without caps and of the current
        placement, and whether the layer was taken, partly moved, left or forced.

    Raises:
        ValueError: as :func:`rebalance`, and a ``placement`` of None.
    """
    if placement is None:
        raise ValueError("placement: rebalance_with_report needs the current placement (moves are counted from it)")
    w, sh, old3, ans, _ = _solve(
        load,
        placement,
        num_physical,
        num_ranks,
        num_nodes,
        num_groups,
        active_ranks,
        migration_aware,
        tolerance,
        relative_to,
        (max_moves, max_moves_per_pair, max_moves_per_rank, hysteresis),
        partial,
        tolerance_scope,
    )
    return build_report(w, sh, old3, ans, int(num_nodes))


def reference(
    load,
    *,
    num_physical: int,
    num_ranks: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
    active_ranks=None,
) -> Placement:
    """deepseek-ai/EPLB's own answer (``eplb.py``'s ``rebalance_experts``), to compare against.

    The oblivious policy without moeshard's rule: a rank may hold two copies of one expert
    (each carries ``load / logcnt`` in :func:`rank_loads` and :func:`balance`, the weight the
    reference's packing gave it). Decisions are made in float32 like the reference's, so its
    ``phy2log`` is reproduced exactly (up to ties that ``torch.sort`` breaks in another order).
    Policy choice (hierarchical / global), dead ranks and arguments as in :func:`rebalance`;
    with dead ranks, the reference as if run on the live ranks only (their slots keep their
    ids, dead ranks' slots are -1).

    Returns:
        ``Placement`` with ``phy2log`` ``int[num_layers, num_physical]``.

    Raises:
        ValueError: as :func:`rebalance`.
    """
    w = check_load(load)
    sh = check_shape(w, num_physical, num_ranks, num_nodes, num_groups, active_ranks)
    ref = reference_answer(w, sh)
    return Placement(ref.phy2log.reshape(sh.num_layers, -1), num_logical=sh.num_logical, num_ranks=sh.num_ranks)


def rebalance_replicas(
    load,
    total_copies: int,
    placement: Placement | None = None,
    *,
    num_physical: int,
    num_ranks: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
    active_ranks=None,
    hysteresis: float = 0.0,
    max_moves: int | None = None,
    max_moves_per_pair: int | None = None,
    max_moves_per_rank: int | None = None,
    partial: bool = False,
) -> Placement:
    """Per-layer replica budgets: ``total_copies`` expert copies for all layers, skewed layers
    getting more (each copy beyond one per expert to the layer and expert whose copy carries
    the most load over its layer's mean rank load), the live slots a layer does not use empty
    (``-1``). Global (``num_groups`` None, or a shape the hierarchical policy does not take, as
    in :func:`rebalance`): each layer placed by the oblivious policy, any expert on any live
    rank. Hierarchical: expert groups onto nodes as the reference does, each node's share of
    the copies (at most its live slots) placed on its live ranks. Pure.

    With the current ``placement``, layers are taken from it as in :func:`rebalance`
    (``hysteresis``, the move caps and ``partial``; partial moves keep a layer's number of
    copies), so ``total_copies`` is exact where every layer is taken or the current
    placement has the same copies per layer, and layers left keep theirs.

    Args:
        load: ``float[num_layers, num_logical]`` tokens routed to each logical expert.
        total_copies: copies in all layers together, from ``num_layers * num_logical`` (one
            per expert) to ``num_layers`` x the live slots of a layer.
        placement: the current placement, or None.
        num_physical, num_ranks, num_nodes, num_groups, active_ranks, hysteresis, max_moves,
            max_moves_per_pair, max_moves_per_rank, partial: as :func:`rebalance`.

    Returns:
        ``Placement`` with ``phy2log`` ``int[num_layers, num_physical]``; without
        ``placement``, ``logcnt.sum(1)`` is each layer's share of ``total_copies``.

    Raises:
        ValueError: as :func:`rebalance`, and a ``total_copies`` out of that range.
    """
    w = check_load(load)
    sh = check_shape(w, num_physical, num_ranks, num_nodes, num_groups, active_ranks)
    live_slots = int(sh.active.sum()) * sh.slots_per_rank
    lo, hi = sh.num_layers * sh.num_logical, sh.num_layers * live_slots
    if (
        isinstance(total_copies, bool)
        or not isinstance(total_copies, (int, np.integer))
        or not lo <= total_copies <= hi
    ):
        raise ValueError(
            f"total_copies must be an integer in [{lo}, {hi}] (one copy per expert to every live slot), "
            f"got {total_copies!r}"
        )
    if not isinstance(partial, (bool, np.bool_)):
        raise ValueError(f"partial must be a bool, got {partial!r}")
    budget = check_budget(max_moves, max_moves_per_pair, max_moves_per_rank, hysteresis, placement is not None)
    if placement is not None:
        check_placement(placement, sh)
    new = replica_policy(w, sh, int(total_copies), int(num_nodes))
    if placement is not None:
        old3 = np.where(sh.active[None, :, None], placement.phy2log.reshape(new.shape), -1)
        new = within_budget(w, old3, new, sh, int(num_nodes), budget, bool(partial)).phy2log
    return Placement(new.reshape(sh.num_layers, -1), num_logical=sh.num_logical, num_ranks=sh.num_ranks)
