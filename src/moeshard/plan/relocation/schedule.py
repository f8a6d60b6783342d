"""The rows of a relocation's :class:`~moeshard.plan.schedule.Schedule` (see
:class:`~.plan.RelocationPlan` for its conventions): pieces, views of local slots, reads,
copies, sends and deliveries, collected by :class:`ScheduleRows` and built into a Schedule.
Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...box import Box, box_numel
from ...topology import Topology
from ..schedule import CopyTable, DeliveryTable, PieceTable, PlanCost, ReadTable, Schedule, SendTable, ViewTable
from .records import ExpertTensor, Move, RelocationCost

__all__ = ["ScheduleRows", "moves_of_rank"]


class ScheduleRows:
    """A relocation schedule's rows as they are planned. Pieces are keyed (tensor, expert,
    box, column), views (rank, tensor, slot, box); ``only``: the rows of that rank only (its
    holdings alone are indexed)."""

    def __init__(self, tensors: Sequence[ExpertTensor], only: int | None):
        self.tensors = tensors
        self.width = 1 + max((len(x.slice_shape) for x in tensors), default=0)
        # Each rank's holding of each tensor: (first slot, slice box).
        self.held = [{r: (s0, box) for r, s0, _, box in x.holdings if only is None or r == only} for x in tensors]
        self.pieces: dict[tuple, int] = {}
        self.p_key: list[int] = []
        self.p_off: list[list[int]] = []
        self.p_len: list[list[int]] = []
        self.p_bytes: list[int] = []
        self.views: dict[tuple, int] = {}
        self.v_rank: list[int] = []
        self.v_param: list[int] = []
        self.v_off: list[list[int]] = []
        self.reads: list[tuple[int, int, int]] = []  # (rank, piece, round)
        self.sends: list[tuple[int, int, int, int, int]] = []  # (src, dst, piece, round, view)
        self.copies: list[tuple[int, int, int]] = []  # (view, piece, round)
        self.dlv: list[tuple[int, int, int, list[int], int]] = []  # (piece, rank, tensor, offsets, round)

    def piece(self, ti: int, expert: int, box: Box, column: int) -> int:
        # Per column: columns may share a box of a tensor (a tensor whole on every expert-FSDP
        # rank), but each column's move is its own, with its own buffers.
        k = (ti, expert, box, column)
        pid = self.pieces.get(k)
        if pid is None:
            pid = self.pieces[k] = len(self.p_key)
            pad = self.width - 1 - len(box)
            self.p_key.append(ti)
            self.p_off.append([expert, *(o for o, _ in box)] + [0] * pad)
            self.p_len.append([1, *(n for _, n in box)] + [1] * pad)
            self.p_bytes.append(box_numel(box) * self.tensors[ti].itemsize)
        return pid

    def local_off(self, rank: int, ti: int, slot: int, box: Box) -> list[int]:
        s0, mine = self.held[ti][rank]
        return [slot - s0, *(o - mo for (o, _), (mo, _) in zip(box, mine))] + [0] * (self.width - 1 - len(box))

    def view(self, rank: int, ti: int, slot: int, box: Box) -> int:
        k = (rank, ti, slot, box)
        v = self.views.get(k)
        if v is None:
            v = self.views[k] = len(self.v_rank)
            self.v_rank.append(rank)
            self.v_param.append(ti)
            self.v_off.append(self.local_off(rank, ti, slot, box))
        return v

    def build(
        self,
        topology: Topology,
        staging_bytes: int,
        max_ops: int,
        num_rounds: int,
        c: RelocationCost,
        rank: int | None,
        basis: str | None,
    ) -> Schedule:
        """The rows as a :class:`Schedule` (deliveries sorted by piece, then rank)."""

        def col(rows: list, j: int, dtype) -> np.ndarray:
            return np.asarray([x[j] for x in rows], dtype=dtype)

        dlv, reads, sends, copies, width, tensors = (
            self.dlv,
            self.reads,
            self.sends,
            self.copies,
            self.width,
            self.tensors,
        )
        dlv.sort(key=lambda x: (x[0], x[1]))
        cost = PlanCost(
            read_bytes=c.read_bytes,
            sent_bytes=c.sent_bytes,
            recv_bytes=c.recv_bytes,
            peak_staging_bytes=c.peak_staging_bytes,
            cross_node_bytes=c.cross_node_bytes,
            num_p2p_ops=c.num_p2p_ops,
            num_batches=num_rounds,
            num_broadcasts=0,
        )
        i64 = np.int64
        return Schedule(
            topology=topology,
            staging_bytes=staging_bytes,
            max_ops=max_ops,
            keys=tuple(x.name for x in tensors),
            key_ndim=np.asarray([1 + len(x.slice_shape) for x in tensors], np.int8),
            pieces=PieceTable(
                np.asarray(self.p_key, np.int32),
                np.asarray(self.p_off, i64).reshape(-1, width),
                np.asarray(self.p_len, i64).reshape(-1, width),
                np.asarray(self.p_bytes, i64),
            ),
            reads=ReadTable(col(reads, 0, np.int32), col(reads, 1, np.int32), col(reads, 2, i64)),
            sends=SendTable(
                col(sends, 0, np.int32),
                col(sends, 1, np.int32),
                col(sends, 2, np.int32),
                col(sends, 3, i64),
                col(sends, 4, np.int32),
            ),
            deliveries=DeliveryTable(
                col(dlv, 0, np.int32),
                col(dlv, 1, np.int32),
                col(dlv, 2, np.int32),
                np.full(len(dlv), -1, i64),
                np.asarray([x[3] for x in dlv], i64).reshape(-1, width),
                col(dlv, 4, i64),
            ),
            num_rounds=num_rounds,
            cost=cost,
            views=ViewTable(
                np.asarray(self.v_rank, np.int32),
                np.asarray(self.v_param, np.int32),
                np.full(len(self.v_rank), -1, i64),
                np.asarray(self.v_off, i64).reshape(-1, width),
            ),
            copies=CopyTable(col(copies, 0, np.int32), col(copies, 1, np.int32), col(copies, 2, i64)),
            rank=rank,
            basis=basis,
        )


def moves_of_rank(moves: Sequence[Move], rank: int) -> set[int]:
    """Indices of the moves ``rank`` takes part in. The part groups of one expert's column
    share their tuples (the router builds them once): each distinct combination is tested once
    (the moves hold the tuples, so their ids stay unique for the loop)."""
    seen: dict[tuple, bool] = {}
    mine = set()
    for i, m in enumerate(moves):
        k = (id(m.copies), id(m.writes), id(m.sends), id(m.relays), m.read)
        hit = seen.get(k)
        if hit is None:
            hit = seen[k] = rank in m.ranks()
        if hit:
            mine.add(i)
    return mine
