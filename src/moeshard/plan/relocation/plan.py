"""The relocation planner's result, :class:`RelocationPlan`, and the runner's view of it (its
:class:`~moeshard.plan.schedule.Schedule`, built on first use by :func:`as_schedule`). Pure.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from ...topology import Topology
from ..schedule import Schedule
from .records import DEFAULT_MAX_OPS, ExpertTensor, Move, RelocationCost, Round, Stash
from .schedule import ScheduleRows, moves_of_rank

__all__ = ["RelocationPlan", "as_schedule"]


@dataclass(frozen=True, eq=False)
class RelocationPlan:
    """Everything the ranks do, in order: the whole job's, or (``rank`` set) the part of the
    job that rank ``rank`` takes part in.

    *Components*: ranks that exchange or share slot data (the ranks of one box column of a
    layer, as a rule one expert-FSDP shard's EP group) relocate independently of the other
    components: their moves never meet, and each component's rounds are packed on their own
    (round ``k`` of the job = round ``k`` of every component). ``component``: ``int[world]``,
    each rank's component (0 .. ``num_components`` - 1, numbered by lowest rank; -1: a rank that
    holds no slots). When a component must read an expert from the checkpoint but none of its
    ranks can, the job is one component (its reads come from other ranks).

    A plan for one rank (:func:`plan_relocation` with ``rank``) holds its component's moves,
    stashes and rounds only, and its ``cost`` counts that component only (the job's counters
    are the sum over components, their maxima the maximum: :func:`job_summary`); its
    ``fingerprint`` and ``disk_experts`` are the job's. Every rank's plan is the job's plan
    restricted to its component, so the job's plan is checked by comparing the fingerprint.

    ``parts[(layer, column)]`` lists each part group's :class:`Part` s; ``columns[layer]`` maps
    each rank holding slots of the layer to ``(column, first_slot, num_slots)``.

    ``schedule`` is what the runner executes (:func:`moeshard.execute.execute_schedule`): its
    keys are the tensors (key ``t`` = ``tensors[t]``, of shape ``[num_logical, *slice_shape]``),
    a piece is one part of one logical expert (box ``[(expert, 1), *part box]``), views and
    deliveries address the local tensor ``[num_slots, *box]`` of a holder (slot -1, dim 0 the
    local slot). Round ``k`` of ``rounds`` is schedule rounds ``2k`` (stashes, copies, reads,
    sends from old slot contents) and ``2k + 1`` (relays), its writes at the end of ``2k + 1``.
    """

    topology: Topology
    tensors: tuple[ExpertTensor, ...]
    columns: tuple[dict, ...]
    parts: dict
    moves: tuple[Move, ...]
    stashes: tuple[Stash, ...]
    rounds: tuple[Round, ...]
    cost: RelocationCost
    staging_bytes: int
    max_ops: int = DEFAULT_MAX_OPS
    old_phy2log: np.ndarray | None = None
    rank: int | None = None
    component: np.ndarray | None = None
    read_experts: tuple[tuple[int, int], ...] = ()
    fingerprint: str = field(default="")

    @property
    def whole_job(self) -> bool:
        """Whether the plan holds every move of the job (planned without ``rank``, or the job
        is one component that every rank is in): its ``cost`` is the job's."""
        c = self.component
        return self.rank is None or c is None or bool((c == 0).all())

    @property
    def num_components(self) -> int:
        """How many independent parts the job's relocation has (1 without ``component``)."""
        return 1 if self.component is None else max(1, int(self.component.max(initial=-1)) + 1)

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The plan as the runner's :class:`Schedule`, every rank's rows (of the job, or of a
        rank's component for a plan with ``rank``; built on first use: evaluating policies or
        costing a plan does not need it). A rank that runs the plan needs only
        :meth:`schedule_for` its rank."""
        assert self.old_phy2log is not None
        return as_schedule(self, self.old_phy2log, self.max_ops)

    def schedule_for(self, rank: int) -> Schedule:
        """What rank ``rank`` runs of the plan: a :class:`Schedule` with ``rank`` set that
        holds only the pieces, views, copies, reads, sends and deliveries of that rank, in
        the plan's order (so both ends of every send post it at the same position of their
        round's batch); ``cost`` is the plan's and the fingerprint the plan's.
        Rounds keep the whole job's numbers. O(moves) to find the rank's moves, then
        O(the rank's rows): at 8,192 ranks a fraction of :attr:`schedule`'s time and memory.
        Not cached: the caller keeps it for the run."""
        assert self.old_phy2log is not None
        if not 0 <= rank < self.topology.world_size:
            raise ValueError(f"rank {rank} is outside the plan's {self.topology.world_size} ranks")
        return as_schedule(self, self.old_phy2log, self.max_ops, rank)

    @property
    def disk_experts(self) -> list[tuple[int, int]]:
        """``[(layer, logical expert)]`` read from the checkpoint (no live copy), on the whole
        job (also in a plan for one rank)."""
        return list(self.read_experts)


def as_schedule(plan: RelocationPlan, old_p2l: np.ndarray, max_ops: int, only: int | None = None) -> Schedule:
    """The plan as a :class:`Schedule` (see :class:`RelocationPlan` for its conventions): the
    whole job's, or with ``only`` only that rank's rows (its sends from other ranks' views
    keep view -1: only a send's source reads its view)."""
    rows = ScheduleRows(plan.tensors, only)
    mine = None if only is None else moves_of_rank(plan.moves, only)
    stashed: set[tuple] = set()  # (rank, layer, slot, part) stashed so far
    for k, rnd in enumerate(plan.rounds):
        for i in rnd.stashes:
            st = plan.stashes[i]
            if only is None or st.rank == only:
                stashed.add((st.rank, st.layer, st.slot, st.part))
                col = plan.columns[st.layer][st.rank][0]
                for part in plan.parts[(st.layer, col)][st.part]:
                    pid = rows.piece(part.tensor, int(old_p2l[st.layer, st.slot]), part.box, col)
                    rows.copies.append((rows.view(st.rank, part.tensor, st.slot, part.box), pid, 2 * k))
        for i in rnd.moves:
            if mine is None or i in mine:
                _move_rows(rows, plan, plan.moves[i], k, only, stashed)
    return rows.build(
        plan.topology,
        plan.staging_bytes,
        max_ops,
        2 * len(plan.rounds),
        plan.cost,
        only,
        None if only is None else plan.fingerprint,
    )


def _move_rows(rows: ScheduleRows, plan: RelocationPlan, m: Move, k: int, only: int | None, stashed: set) -> None:
    """The rows of move ``m`` in round ``k`` (schedule rounds ``2k`` and ``2k + 1``)."""
    a, b = 2 * k, 2 * k + 1
    for part in plan.parts[(m.layer, m.column)][m.part]:
        pid = rows.piece(part.tensor, m.expert, part.box, m.column)
        if m.read >= 0 and (only is None or m.read == only):
            rows.reads.append((m.read, pid, a))
        for r, s in m.copies:
            if (only is None or r == only) and (r, m.layer, s, m.part) not in stashed:
                # (a stash is already this piece's buffer)
                rows.copies.append((rows.view(r, part.tensor, s, part.box), pid, a))
        for src, s, dst in m.sends:
            if only is not None and only != src and only != dst:
                continue
            from_view = s >= 0 and (only is None or src == only) and (src, m.layer, s, m.part) not in stashed
            rows.sends.append((src, dst, pid, a, rows.view(src, part.tensor, s, part.box) if from_view else -1))
        for src, dst in m.relays:
            if only is None or only == src or only == dst:
                rows.sends.append((src, dst, pid, b, -1))
        for r, slots in m.writes:
            if only is None or r == only:
                for s in slots:
                    rows.dlv.append((pid, r, part.tensor, rows.local_off(r, part.tensor, s, part.box), b))
