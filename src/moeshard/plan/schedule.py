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

__all__ = [
    "PlanCost",
    "Schedule",
    "RankSchedule",
    "PieceTable",
    "ReadTable",
    "SendTable",
    "BcastTable",
    "DeliveryTable",
    "ViewTable",
    "CopyTable",
]


def _i32() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


def _i64() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


class _Columns:
    """A frozen table of equal-length numpy columns (its dataclass fields; None: a column left
    to its default)."""

    def __post_init__(self) -> None:
        n = {len(getattr(self, f)) for f in self.__dataclass_fields__ if getattr(self, f) is not None}
        assert len(n) <= 1, f"{type(self).__name__}: columns of different lengths {sorted(n)}"

    def __len__(self) -> int:
        return len(getattr(self, next(iter(self.__dataclass_fields__))))


@dataclass(frozen=True, eq=False)
class PieceTable(_Columns):
    """``P`` pieces: ``key`` ``int32[P]`` (index into the schedule's keys), the box ``off``,
    ``len`` ``int64[P, D]``, ``bytes`` ``int64[P]``."""

    key: np.ndarray
    off: np.ndarray
    len: np.ndarray
    bytes: np.ndarray


@dataclass(frozen=True, eq=False)
class ReadTable(_Columns):
    """``R`` reads: ``rank`` reads ``piece`` (``int32[R]``) in ``round`` (``int64[R]``; -1: a
    piece only its reader needs, read straight into place, at any time)."""

    rank: np.ndarray = field(default_factory=_i32)
    piece: np.ndarray = field(default_factory=_i32)
    round: np.ndarray = field(default_factory=_i64)


@dataclass(frozen=True, eq=False)
class SendTable(_Columns):
    """``S`` P2P sends: ``src`` sends ``piece`` to ``dst`` (``int32[S]``) in ``round``
    (``int64[S]``), from ``view`` (``int32[S]``: the view it reads, -1: the sender's buffer of
    the piece; default all -1)."""

    src: np.ndarray = field(default_factory=_i32)
    dst: np.ndarray = field(default_factory=_i32)
    piece: np.ndarray = field(default_factory=_i32)
    round: np.ndarray = field(default_factory=_i64)
    view: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.view is None:
            object.__setattr__(self, "view", np.full(len(self.src), -1, dtype=np.int32))
        super().__post_init__()


@dataclass(frozen=True, eq=False)
class BcastTable(_Columns):
    """``B`` node broadcasts: ``root`` broadcasts ``piece`` to its ``node`` (``int32[B]``) in
    ``round`` (``int64[B]``)."""

    node: np.ndarray = field(default_factory=_i32)
    root: np.ndarray = field(default_factory=_i32)
    piece: np.ndarray = field(default_factory=_i32)
    round: np.ndarray = field(default_factory=_i64)


@dataclass(frozen=True, eq=False)
class DeliveryTable(_Columns):
    """``N`` deliveries, sorted by (piece, rank): ``rank`` puts ``piece`` (``int32[N]``) at
    ``off`` (``int64[N, D]``) in the local tensor of parameter ``param`` (``int32[N]``), in slot
    ``slot`` (``int64[N]``, -1: no expert slot), at the end of ``round`` (``int64[N]``: after
    every op of the round on that rank, a delivery may overwrite what a send of the same round
    reads; None: the round the piece arrives in on that rank, -1 for a piece read or copied in
    round -1)."""

    piece: np.ndarray
    rank: np.ndarray
    param: np.ndarray
    slot: np.ndarray
    off: np.ndarray
    round: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class ViewTable(_Columns):
    """``V`` views of local tensors as sources: ``rank`` holds a piece at ``off`` (``int64[V,
    D]``) in the local tensor of ``param`` (``int32[V]``; in ``slot``, ``int64[V]``), addressed
    like a delivery."""

    rank: np.ndarray
    param: np.ndarray
    slot: np.ndarray
    off: np.ndarray

    @staticmethod
    def empty(width: int) -> ViewTable:
        return ViewTable(_i32(), _i32(), _i64(), np.zeros((0, width), dtype=np.int64))


@dataclass(frozen=True, eq=False)
class CopyTable(_Columns):
    """``C`` copies: the rank of ``view`` copies ``piece`` (``int32[C]``) into a buffer at the
    start of ``round`` (``int64[C]``; before any send of the round and any delivery: a *stash*
    of a slot that a delivery overwrites before a later send, or a local copy from one slot into
    another). Round -1: no buffer; the rank's deliveries of that piece are made straight from
    the view, at any time (like a read of round -1)."""

    view: np.ndarray = field(default_factory=_i32)
    piece: np.ndarray = field(default_factory=_i32)
    round: np.ndarray = field(default_factory=_i64)


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
    broadcasts, ``N`` deliveries, ``V`` views, ``C`` copies; ``D`` padded box dims as in
    :class:`NeedTable`), as tables of columns.

    Args:
        topology: world size and ranks per node (``rank`` 0: the schedule is the job's).
        staging_bytes, max_ops: the budgets it was planned for.
        keys, key_ndim: source tensor names and their ranks (``int8[len(keys)]``).
        pieces: :class:`PieceTable`, the boxes of the source tensors that move.
        reads: :class:`ReadTable`, who reads which piece (in the first round it is sent in).
        sends: :class:`SendTable`; bcasts: :class:`BcastTable` (default: none).
        deliveries: :class:`DeliveryTable`, where each receiver puts a piece.
        num_rounds: rounds are ``0 .. num_rounds - 1``.
        cost: counters; ``cost.peak_staging_bytes`` follows the buffer lifetimes above.
        views, copies: local tensors as sources (relocation, save; a load has none):
            :class:`ViewTable` (default: none) and :class:`CopyTable` (default: none).
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
    pieces: PieceTable
    reads: ReadTable
    sends: SendTable
    deliveries: DeliveryTable
    num_rounds: int
    cost: PlanCost
    bcasts: BcastTable = field(default_factory=BcastTable)
    views: ViewTable | None = None
    copies: CopyTable = field(default_factory=CopyTable)
    rank: int | None = None
    basis: str | None = None

    def __post_init__(self) -> None:
        if self.views is None:  # the default depends on the pieces' width (frozen: set once, here)
            off = self.pieces.off
            object.__setattr__(self, "views", ViewTable.empty(off.shape[1] if off.ndim == 2 else 0))

    def arrays(self):
        """``(name, array or None)`` of every array, in the fingerprint's order and under its
        names (e.g. ``send_src`` for ``sends.src``)."""
        for name, table, column in _ARRAYS:
            yield name, getattr(self if table is None else getattr(self, table), column)

    @property
    def num_pieces(self) -> int:
        return len(self.pieces.key)

    @property
    def has_broadcasts(self) -> bool:
        return len(self.bcasts.piece) > 0

    def piece_box(self, pid: int) -> tuple[tuple[int, int], ...]:
        """Box of piece ``pid`` in its tensor (its real dims, no padding)."""
        nd = int(self.key_ndim[self.pieces.key[pid]])
        return tuple(zip(self.pieces.off[pid, :nd].tolist(), self.pieces.len[pid, :nd].tolist()))

    def piece_name(self, pid: int) -> str:
        return self.keys[int(self.pieces.key[pid])]

    def delivery(self, i: int) -> tuple[int, int, tuple, str, tuple]:
        """Delivery row ``i`` as ``(rank, param, dest box, key, src box)`` (the fields of a
        :class:`~moeshard.plan.needs.Need`; the dest box starts with ``(slot, 1)`` for a slot)."""
        pid = int(self.deliveries.piece[i])
        src = self.piece_box(pid)
        dest = tuple(zip(self.deliveries.off[i, : len(src)].tolist(), (n for _, n in src)))
        slot = int(self.deliveries.slot[i])
        if slot >= 0:
            dest = ((slot, 1),) + dest
        return int(self.deliveries.rank[i]), int(self.deliveries.param[i]), dest, self.piece_name(pid), src

    @property
    def needs(self) -> NeedTable:
        """The deliveries as a need table (the needs the schedule meets, split as its pieces)."""
        return NeedTable(
            keys=self.keys,
            ndim=self.key_ndim,
            rank=self.deliveries.rank,
            param=self.deliveries.param,
            key=self.pieces.key[self.deliveries.piece],
            slot=self.deliveries.slot,
            src_off=self.pieces.off[self.deliveries.piece],
            src_len=self.pieces.len[self.deliveries.piece],
            dst_off=self.deliveries.off,
        )

    def piece_readers(self) -> np.ndarray:
        """``int32[P]``: the rank that reads each piece (for a schedule with one reader per
        piece, e.g. scope "job"; with several, the last)."""
        out = np.full(self.num_pieces, -1, dtype=np.int32)
        out[self.reads.piece] = self.reads.rank
        return out

    def rank_bytes(self, rank: int) -> int:
        """Bytes of the pieces ``rank`` reads or receives."""
        b = self.pieces.bytes
        total = int(b[self.reads.piece[self.reads.rank == rank]].sum())
        total += int(b[self.sends.piece[self.sends.dst == rank]].sum())
        mine = (self.bcasts.node == self.topology.node_of(rank)) & (self.bcasts.root != rank)
        return total + int(b[self.bcasts.piece[mine]].sum())

    def delivered_bytes(self, rank: int) -> int:
        """Bytes of the pieces ``rank`` delivers (each piece once, however many places it
        goes to): the total of the runner's ``progress`` calls on that rank."""
        return int(self.pieces.bytes[np.unique(self.deliveries.piece[self.deliveries.rank == rank])].sum())

    def for_rank(self, rank: int) -> RankSchedule:
        """This rank's rows (what :func:`moeshard.execute.execute_schedule` runs). ValueError
        for a rank other than the one a schedule was planned for (it lacks that rank's local
        reads)."""
        if self.rank is not None and rank != self.rank:
            raise ValueError(f"this schedule was planned for rank {self.rank} only, not rank {rank}")
        reads = np.flatnonzero(self.reads.rank == rank)
        sends = np.flatnonzero((self.sends.src == rank) | (self.sends.dst == rank))
        bcasts = np.flatnonzero(self.bcasts.node == self.topology.node_of(rank))
        dlv = np.flatnonzero(self.deliveries.rank == rank)
        copies = np.flatnonzero(self.views.rank[self.copies.view] == rank)
        return RankSchedule(self, rank, reads, sends, bcasts, dlv, copies)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of everything the schedule makes ranks do (ranks compare it before data
        moves): the bytes of every array, the keys, the topology and the budgets; or the
        planner's ``basis``."""
        if self.basis is not None:
            return self.basis
        h = hashlib.sha256()
        h.update(
            repr(
                (
                    self.topology.world_size,
                    self.topology.local_world_size,
                    self.staging_bytes,
                    self.max_ops,
                    self.num_rounds,
                    self.keys,
                )
            ).encode()
        )
        if self.topology.nodes is not None:  # uneven nodes (a process group of some ranks)
            h.update(repr(self.topology.nodes).encode())
        for name, a in self.arrays():
            if a is None:
                continue  # deliveries.round by default: derived from the other arrays
            a = np.ascontiguousarray(a)
            h.update(name.encode())
            h.update(repr((a.dtype.str, a.shape)).encode())
            h.update(a.tobytes())
        return h.hexdigest()[:16]


# The schedule's arrays as the fingerprint names them: (name, table or None, column).
_ARRAYS = (("key_ndim", None, "key_ndim"),) + tuple(
    (f"{prefix}_{column}", table, column)
    for prefix, table, columns in (
        ("piece", "pieces", ("key", "off", "len", "bytes")),
        ("read", "reads", ("rank", "piece", "round")),
        ("send", "sends", ("src", "dst", "piece", "round")),
        ("bcast", "bcasts", ("node", "root", "piece", "round")),
        ("dlv", "deliveries", ("piece", "rank", "param", "slot", "off")),
        ("view", "views", ("rank", "param", "slot", "off")),
        ("send", "sends", ("view",)),
        ("copy", "copies", ("view", "piece", "round")),
        ("dlv", "deliveries", ("round",)),
    )
    for column in columns
)


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
        is made (the schedule's ``deliveries.round``, or by default the round the piece arrives)."""
        s = self.schedule
        if s.deliveries.round is not None:
            return s.deliveries.round[self.deliveries]
        into = self.sends[s.sends.dst[self.sends] == self.rank]
        bc = self.bcasts[s.bcasts.root[self.bcasts] != self.rank]
        pieces = np.concatenate(
            [s.reads.piece[self.reads], s.sends.piece[into], s.bcasts.piece[bc], s.copies.piece[self.copies]]
        )
        rounds = np.concatenate(
            [s.reads.round[self.reads], s.sends.round[into], s.bcasts.round[bc], s.copies.round[self.copies]]
        )
        arrival = dict(zip(pieces.tolist(), rounds.tolist()))
        return np.asarray([arrival[p] for p in s.deliveries.piece[self.deliveries].tolist()], dtype=np.int64)

    @property
    def rounds(self) -> np.ndarray:
        """The rounds this rank takes part in, ascending."""
        s = self.schedule
        every = np.concatenate(
            [
                s.reads.round[self.reads],
                s.sends.round[self.sends],
                s.bcasts.round[self.bcasts],
                s.copies.round[self.copies],
                self.delivery_rounds,
            ]
        )
        return np.unique(every[every >= 0])

    def local_reads(self) -> np.ndarray:
        """Pieces this rank reads for itself only (round -1), in schedule order."""
        s = self.schedule
        return s.reads.piece[self.reads[s.reads.round[self.reads] < 0]]

    def local_copies(self) -> np.ndarray:
        """Copy rows of round -1 (deliveries straight from a view), in schedule order."""
        s = self.schedule
        return self.copies[s.copies.round[self.copies] < 0]
