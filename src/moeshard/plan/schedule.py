"""The :class:`Schedule`: what every rank does to move pieces of tensors, as arrays.

A *piece* is one box of one source tensor (a checkpoint tensor). A schedule says, for every
piece: which rank reads it, which ranks receive it from whom (P2P sends, node broadcasts), in
which *round*, and where each receiver puts it (*deliveries*: a box of a local tensor).

Rounds are totally ordered. Every rank runs the rounds it takes part in, in that order; in one
round it posts all its P2P ops as one batch, waits, then joins the round's node broadcasts
(sorted by node and piece). Because every op of round ``t`` is posted by both of its ranks in
round ``t``, and every rank finishes its rounds before ``t`` first, the lowest unfinished round
can always complete: no deadlock, whatever the interleaving. A rank holds a buffer from the
round it reads or receives it to the last round it sends it from; ``cost.peak_staging_bytes``
is the exact maximum of that sum per rank, and the planners keep it within ``staging_bytes``
and the P2P ops of one rank in one round within ``max_ops``.

Pure and torch-free. Every rank computes the same schedule (compared by :attr:`fingerprint`)
and runs only its own rows (:meth:`Schedule.for_rank`).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np

from ..topology import Topology
from .needs import NeedTable

__all__ = ["PlanCost", "Schedule", "RankSchedule"]



def _i32() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


def _i64() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class PlanCost:
    """Cost counters of a schedule (bytes are source-dtype bytes). Arrays are per rank."""

    read_bytes: np.ndarray
    sent_bytes: np.ndarray
    recv_bytes: np.ndarray
    peak_staging_bytes: np.ndarray
    cross_node_bytes: int
    num_p2p_ops: int
    num_batches: int
    num_broadcasts: int

    def summary(self) -> dict:
        return {
            "read_bytes_total": int(self.read_bytes.sum()),
            "read_bytes_max_rank": int(self.read_bytes.max(initial=0)),
            "sent_bytes_total": int(self.sent_bytes.sum()),
            "sent_bytes_max_rank": int(self.sent_bytes.max(initial=0)),
            "recv_bytes_max_rank": int(self.recv_bytes.max(initial=0)),
            "cross_node_bytes": self.cross_node_bytes,
            "peak_staging_bytes_max_rank": int(self.peak_staging_bytes.max(initial=0)),
            "num_p2p_ops": self.num_p2p_ops,
            "num_batches": self.num_batches,
            "num_broadcasts": self.num_broadcasts,
        }


@dataclass(frozen=True, eq=False)
class Schedule:
    """Everything every rank does, in order (``P`` pieces, ``R`` reads, ``S`` sends, ``B``
    broadcasts, ``N`` deliveries; ``D`` padded box dims as in :class:`NeedTable`).

    Args:
        topology: world size and ranks per node (``rank`` 0: the schedule is the job's).
        staging_bytes, max_ops: the budgets it was planned for.
        keys, key_ndim: source tensor names and their ranks.
        piece_key: ``int32[P]``; piece_off, piece_len: ``int64[P, D]`` its box;
            piece_bytes: ``int64[P]``.
        read_rank, read_piece: ``int32[R]`` who reads which piece; read_round: ``int64[R]``
            the round it is read in (the first it is sent in), or -1 for a piece only its
            reader needs (read straight into place, at any time).
        send_src, send_dst, send_piece: ``int32[S]``; send_round: ``int64[S]``.
        bcast_node, bcast_root, bcast_piece: ``int32[B]``; bcast_round: ``int64[B]``.
        dlv_piece, dlv_rank, dlv_param: ``int32[N]``; dlv_slot: ``int64[N]`` (-1: no expert
            slot); dlv_off: ``int64[N, D]``: where rank ``dlv_rank`` puts the piece in the local
            tensor of parameter ``dlv_param`` (in slot ``dlv_slot``). Sorted by (piece, rank).
        num_rounds: rounds are ``0 .. num_rounds - 1``.
        cost: counters; ``cost.peak_staging_bytes`` follows the buffer lifetimes above.

    Local tensors as sources (relocation, save; a load has none):

        view_rank, view_param: ``int32[V]``; view_slot: ``int64[V]``; view_off: ``int64[V, D]``:
            rank ``view_rank`` holds a piece at ``view_off`` in the local tensor of
            ``view_param`` (in slot ``view_slot``), addressed like a delivery.
        send_view: ``int32[S]``: the view a send reads (-1: the sender's buffer of the piece,
            read, received or copied earlier). Default: all -1.
        copy_view, copy_piece: ``int32[C]``; copy_round: ``int64[C]``: the view's rank copies
            the piece into a buffer at the start of the round (before any send of the round
            and any delivery: a *stash* of a slot that a delivery overwrites before a later
            send, or a local copy from one slot into another). Round -1: no buffer; the
            rank's deliveries of that piece are made straight from the view, at any time
            (like a read of round -1).
        dlv_round: ``int64[N]``: the round whose end the delivery is made at (after every op
            of the round on that rank: a delivery may overwrite what a send of the same round
            reads). Default (None): the round the piece arrives in on that rank (read,
            received or copied; -1 for a piece read or copied in round -1).
        rank: None for the whole job's schedule; a rank for the schedule planned for that rank
            only (:func:`~moeshard.plan.load.plan_transfers` with ``rank``): every transfer,
            and of the local reads only that rank's (``cost`` still counts every rank's).
        basis: what :attr:`fingerprint` is, when the planner gives it (a schedule planned for
            one rank: the digest of what every rank plans alike); None: the arrays' digest.
    """

    topology: Topology
    staging_bytes: int
    max_ops: int
    keys: tuple[str, ...]
    key_ndim: np.ndarray
    piece_key: np.ndarray
    piece_off: np.ndarray
    piece_len: np.ndarray
    piece_bytes: np.ndarray
    read_rank: np.ndarray
    read_piece: np.ndarray
    read_round: np.ndarray
    send_src: np.ndarray
    send_dst: np.ndarray
    send_piece: np.ndarray
    send_round: np.ndarray
    bcast_node: np.ndarray
    bcast_root: np.ndarray
    bcast_piece: np.ndarray
    bcast_round: np.ndarray
    dlv_piece: np.ndarray
    dlv_rank: np.ndarray
    dlv_param: np.ndarray
    dlv_slot: np.ndarray
    dlv_off: np.ndarray
    num_rounds: int
    cost: PlanCost
    view_rank: np.ndarray = field(default_factory=_i32)
    view_param: np.ndarray = field(default_factory=_i32)
    view_slot: np.ndarray = field(default_factory=_i64)
    view_off: np.ndarray | None = None
    send_view: np.ndarray | None = None
    copy_view: np.ndarray = field(default_factory=_i32)
    copy_piece: np.ndarray = field(default_factory=_i32)
    copy_round: np.ndarray = field(default_factory=_i64)
    dlv_round: np.ndarray | None = None
    rank: int | None = None
    basis: str | None = None

    def __post_init__(self) -> None:
        # Defaults that depend on the other arrays' sizes (frozen: set once, here).
        d = self.piece_off.shape[1] if self.piece_off.ndim == 2 else 0
        if self.view_off is None:
            object.__setattr__(self, "view_off", np.zeros((len(self.view_rank), d), dtype=np.int64))
        if self.send_view is None:
            object.__setattr__(self, "send_view", np.full(len(self.send_src), -1, dtype=np.int32))
        assert len(self.send_view) == len(self.send_src)
        assert self.dlv_round is None or len(self.dlv_round) == len(self.dlv_piece)
        assert len(self.copy_view) == len(self.copy_piece) == len(self.copy_round)

    @property
    def num_pieces(self) -> int:
        return len(self.piece_key)

    @property
    def has_broadcasts(self) -> bool:
        return len(self.bcast_piece) > 0

    def piece_box(self, pid: int) -> tuple[tuple[int, int], ...]:
        """Box of piece ``pid`` in its tensor (its real dims, no padding)."""
        nd = int(self.key_ndim[self.piece_key[pid]])
        return tuple(zip(self.piece_off[pid, :nd].tolist(), self.piece_len[pid, :nd].tolist()))

    def piece_name(self, pid: int) -> str:
        return self.keys[int(self.piece_key[pid])]

    def delivery(self, i: int) -> tuple[int, int, tuple, str, tuple]:
        """Delivery row ``i`` as ``(rank, param, dest box, key, src box)`` (the fields of a
        :class:`~moeshard.models.layout.Need`; the dest box starts with ``(slot, 1)`` for a slot)."""
        pid = int(self.dlv_piece[i])
        src = self.piece_box(pid)
        dest = tuple(zip(self.dlv_off[i, : len(src)].tolist(), (n for _, n in src)))
        slot = int(self.dlv_slot[i])
        if slot >= 0:
            dest = ((slot, 1),) + dest
        return int(self.dlv_rank[i]), int(self.dlv_param[i]), dest, self.piece_name(pid), src

    @property
    def needs(self) -> NeedTable:
        """The deliveries as a need table (the needs the schedule meets, split as its pieces)."""
        return NeedTable(
            keys=self.keys, ndim=self.key_ndim, rank=self.dlv_rank, param=self.dlv_param,
            key=self.piece_key[self.dlv_piece], slot=self.dlv_slot,
            src_off=self.piece_off[self.dlv_piece], src_len=self.piece_len[self.dlv_piece], dst_off=self.dlv_off,
        )

    def piece_readers(self) -> np.ndarray:
        """``int32[P]``: the rank that reads each piece (for a schedule with one reader per
        piece, e.g. scope "job"; with several, the last)."""
        out = np.full(self.num_pieces, -1, dtype=np.int32)
        out[self.read_piece] = self.read_rank
        return out

    def rank_bytes(self, rank: int) -> int:
        """Bytes of the pieces ``rank`` reads or receives."""
        b = self.piece_bytes
        total = int(b[self.read_piece[self.read_rank == rank]].sum())
        total += int(b[self.send_piece[self.send_dst == rank]].sum())
        mine = (self.bcast_node == self.topology.node_of(rank)) & (self.bcast_root != rank)
        return total + int(b[self.bcast_piece[mine]].sum())

    def delivered_bytes(self, rank: int) -> int:
        """Bytes of the pieces ``rank`` delivers (each piece once, however many places it
        goes to): the total of the runner's ``progress`` calls on that rank."""
        return int(self.piece_bytes[np.unique(self.dlv_piece[self.dlv_rank == rank])].sum())

    def for_rank(self, rank: int) -> "RankSchedule":
        """This rank's rows (what :func:`moeshard.execute.execute_schedule` runs). ValueError
        for a rank other than the one a schedule was planned for (it lacks that rank's local
        reads)."""
        if self.rank is not None and rank != self.rank:
            raise ValueError(f"this schedule was planned for rank {self.rank} only, not rank {rank}")
        reads = np.flatnonzero(self.read_rank == rank)
        sends = np.flatnonzero((self.send_src == rank) | (self.send_dst == rank))
        bcasts = np.flatnonzero(self.bcast_node == self.topology.node_of(rank))
        dlv = np.flatnonzero(self.dlv_rank == rank)
        copies = np.flatnonzero(self.view_rank[self.copy_view] == rank)
        return RankSchedule(self, rank, reads, sends, bcasts, dlv, copies)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of everything the schedule makes ranks do (ranks compare it before data
        moves): the bytes of every array, the keys, the topology and the budgets; or the
        planner's ``basis``."""
        if self.basis is not None:
            return self.basis
        h = hashlib.sha256()
        h.update(repr((self.topology.world_size, self.topology.local_world_size, self.staging_bytes,
                       self.max_ops, self.num_rounds, self.keys)).encode())
        if self.topology.nodes is not None:  # uneven nodes (a process group of some ranks)
            h.update(repr(self.topology.nodes).encode())
        for name in _ARRAYS:
            if getattr(self, name) is None:
                continue  # dlv_round by default: derived from the other arrays
            a = np.ascontiguousarray(getattr(self, name))
            h.update(name.encode())
            h.update(repr((a.dtype.str, a.shape)).encode())
            h.update(a.tobytes())
        return h.hexdigest()[:16]


_ARRAYS = ("key_ndim", "piece_key", "piece_off", "piece_len", "piece_bytes", "read_rank", "read_piece", "read_round",
           "send_src", "send_dst", "send_piece", "send_round", "bcast_node", "bcast_root", "bcast_piece",
           "bcast_round", "dlv_piece", "dlv_rank", "dlv_param", "dlv_slot", "dlv_off", "view_rank", "view_param",
           "view_slot", "view_off", "send_view", "copy_view", "copy_piece", "copy_round", "dlv_round")


@dataclass(frozen=True, eq=False)
class RankSchedule:
    """One rank's rows of a :class:`Schedule` (indices into its arrays)."""

    schedule: Schedule
    rank: int
    reads: np.ndarray
    sends: np.ndarray
    bcasts: np.ndarray
    deliveries: np.ndarray
    copies: np.ndarray

    @functools.cached_property
    def delivery_rounds(self) -> np.ndarray:
        """``int64[len(deliveries)]``: the round at whose end each of this rank's deliveries
        is made (the schedule's ``dlv_round``, or by default the round the piece arrives)."""
        s = self.schedule
        if s.dlv_round is not None:
            return s.dlv_round[self.deliveries]
        into = self.sends[s.send_dst[self.sends] == self.rank]
        bc = self.bcasts[s.bcast_root[self.bcasts] != self.rank]
        pieces = np.concatenate([s.read_piece[self.reads], s.send_piece[into], s.bcast_piece[bc],
                                 s.copy_piece[self.copies]])
        rounds = np.concatenate([s.read_round[self.reads], s.send_round[into], s.bcast_round[bc],
                                 s.copy_round[self.copies]])
        arrival = dict(zip(pieces.tolist(), rounds.tolist()))
        return np.asarray([arrival[p] for p in s.dlv_piece[self.deliveries].tolist()], dtype=np.int64)

    @property
    def rounds(self) -> np.ndarray:
        """The rounds this rank takes part in, ascending."""
        s = self.schedule
        every = np.concatenate([s.read_round[self.reads], s.send_round[self.sends], s.bcast_round[self.bcasts],
                                s.copy_round[self.copies], self.delivery_rounds])
        return np.unique(every[every >= 0])

    def local_reads(self) -> np.ndarray:
        """Pieces this rank reads for itself only (round -1), in schedule order."""
        s = self.schedule
        return s.read_piece[self.reads[s.read_round[self.reads] < 0]]

    def local_copies(self) -> np.ndarray:
        """Copy rows of round -1 (deliveries straight from a view), in schedule order."""
        s = self.schedule
        return self.copies[s.copy_round[self.copies] < 0]
