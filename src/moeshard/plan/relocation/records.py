"""The relocation planner's records: its inputs (:class:`ExpertTensor`), what it plans
(:class:`Part`, :class:`Move`, :class:`Stash`, :class:`Round`) and its counters
(:class:`RelocationCost`, :data:`COUNTERS`, :func:`job_summary`). Pure data, no planning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ...box import Box

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "DEFAULT_MAX_OPS",
    "LOCAL",
    "SAME_NODE",
    "CROSS_NODE",
    "DISK",
    "CLASSES",
    "ExpertTensor",
    "Part",
    "Move",
    "Stash",
    "Round",
    "Keys",
    "GroupOps",
    "MoveTable",
    "RelocationCost",
    "COUNTERS",
    "job_summary",
]

DEFAULT_STAGING_BYTES = 256 * 2**20
DEFAULT_MAX_OPS = 64
LOCAL, SAME_NODE, CROSS_NODE, DISK = "local", "same_node", "cross_node", "disk"
CLASSES = (LOCAL, SAME_NODE, CROSS_NODE, DISK)


@dataclass(frozen=True)
class ExpertTensor:
    """One expert tensor of one MoE layer (global shape ``[num_physical, *slice_shape]``).

    Args:
        layer: MoE layer index (the placement's row).
        name: for messages (parameter name, or ``layer/tensor`` for plain tensors).
        slice_shape: shape of one expert's slice (the expert dim excluded).
        itemsize: bytes per element in memory.
        holdings: ``((rank, first_slot, num_slots, slice_box), ...)``: each rank's local
            tensor ``[num_slots, *box_shape(slice_box)]`` holds global slots
            ``first_slot .. first_slot + num_slots - 1``, box ``slice_box`` of each slice.
    """

    layer: int
    name: str
    slice_shape: tuple[int, ...]
    itemsize: int
    holdings: tuple[tuple[int, int, int, Box], ...]


@dataclass(frozen=True)
class Part:
    """``box`` (slice coordinates) of tensor number ``tensor`` (index into the plan's tensors)."""

    tensor: int
    box: Box


@dataclass(frozen=True)
class Move:
    """Logical expert ``expert``'s part group ``part`` of box column ``column`` of ``layer``.

    Sources are old slot contents ``(rank, slot)``; ``read`` is the rank that reads it from
    the checkpoint (-1: a live copy exists). Phase A: ``copies`` (rank, src slot) are local
    clones, ``sends`` (src rank, src slot, dst rank) go from a holder's slot (src slot -1:
    from the read buffer). Phase B: ``relays`` (src rank, dst rank) forward a buffer received
    in phase A. ``writes`` (rank, slots) put the result into the new slots at the round end.
    """

    layer: int
    column: int
    part: int
    expert: int
    nbytes: int
    read: int
    copies: tuple[tuple[int, int], ...]
    sends: tuple[tuple[int, int, int], ...]
    relays: tuple[tuple[int, int], ...]
    writes: tuple[tuple[int, tuple[int, ...]], ...]

    def reads(self) -> list[tuple[int, int]]:
        """Old slot contents this move reads: ``[(rank, slot)]``."""
        return [(r, s) for r, s in self.copies] + [(r, s) for r, s, _ in self.sends if s >= 0]

    def ranks(self) -> set[int]:
        out = {r for r, _ in self.copies} | {r for r, _ in self.writes}
        out |= {r for r, _, d in self.sends} | {d for _, _, d in self.sends}
        out |= {r for r, d in self.relays} | {d for _, d in self.relays}
        if self.read >= 0:
            out.add(self.read)
        return out


@dataclass(frozen=True)
class Stash:
    """At the start of round ``round``, ``rank`` copies the old content of its ``slot`` (part
    group ``part`` of ``layer``) aside; later reads of that slot use the copy."""

    round: int
    rank: int
    layer: int
    slot: int
    part: int
    nbytes: int


@dataclass(frozen=True)
class Round:
    moves: tuple[int, ...]  # indices into the plan's moves
    stashes: tuple[int, ...] = ()  # indices into the plan's stashes created this round


class Keys:
    """Old slot contents ``(rank, layer, slot, part group)`` as one int (hashing an int is
    cheaper than a tuple): ``part * per_part + (layer * world + rank) * num_physical + slot``."""

    __slots__ = ("world", "num_physical", "per_part")

    def __init__(self, num_layers: int, world: int, num_physical: int):
        self.world, self.num_physical = world, num_physical
        self.per_part = num_layers * world * num_physical

    def key(self, layer: int, rank: int, slot: int) -> int:
        return (layer * self.world + rank) * self.num_physical + slot

    def rank(self, key: int) -> int:
        return key % self.per_part // self.num_physical % self.world


@dataclass(frozen=True)
class RelocationCost:
    """Counters of a relocation plan (bytes are in-memory bytes). Arrays are per rank.

    ``copies`` and ``bytes`` count, per class (local / same_node / cross_node / disk), the
    slot boxes written: one per (rank, layer, slot, part group) -- with expert FSDP an expert
    copy is several boxes. ``min_network_bytes`` / ``min_cross_node_bytes`` are lower bounds
    for any plan (each needer without a local copy receives once; each node without a holder
    receives once) given the same live holders.
    """

    copies: dict
    bytes: dict
    sent_bytes: np.ndarray
    recv_bytes: np.ndarray
    read_bytes: np.ndarray
    peak_staging_bytes: np.ndarray
    network_bytes: int
    cross_node_bytes: int
    min_network_bytes: int
    min_cross_node_bytes: int
    num_p2p_ops: int
    num_rounds: int
    num_stashes: int

    def summary(self) -> dict:
        return {
            "copies": dict(self.copies),
            "bytes": dict(self.bytes),
            "network_bytes": self.network_bytes,
            "cross_node_bytes": self.cross_node_bytes,
            "min_network_bytes": self.min_network_bytes,
            "min_cross_node_bytes": self.min_cross_node_bytes,
            "read_bytes_total": int(self.read_bytes.sum()),
            "sent_bytes_max_rank": int(self.sent_bytes.max(initial=0)),
            "recv_bytes_max_rank": int(self.recv_bytes.max(initial=0)),
            "peak_staging_bytes_max_rank": int(self.peak_staging_bytes.max(initial=0)),
            "num_p2p_ops": self.num_p2p_ops,
            "num_rounds": self.num_rounds,
            "num_stashes": self.num_stashes,
        }

    def counters(self) -> np.ndarray:
        """``int64[len(COUNTERS)]``: the figures of :meth:`summary` (summed over components,
        then those maximized over them: :data:`COUNTERS`)."""
        d = self.summary()
        return np.asarray(
            [d["copies"][k] for k in CLASSES]
            + [d["bytes"][k] for k in CLASSES]
            + [d[k] for k in COUNTERS[2 * len(CLASSES) :]],
            dtype=np.int64,
        )


# RelocationCost.counters(): per class copies, per class bytes, then the summed figures, then
# (_MAXED) the figures that are a maximum over ranks or over rounds in parallel.
_SUMMED = (
    "network_bytes",
    "cross_node_bytes",
    "min_network_bytes",
    "min_cross_node_bytes",
    "read_bytes_total",
    "num_p2p_ops",
    "num_stashes",
)
_MAXED = ("sent_bytes_max_rank", "recv_bytes_max_rank", "peak_staging_bytes_max_rank", "num_rounds")
COUNTERS = tuple(f"copies.{k}" for k in CLASSES) + tuple(f"bytes.{k}" for k in CLASSES) + _SUMMED + _MAXED


def job_summary(table: np.ndarray) -> dict:
    """The job's :meth:`RelocationCost.summary` from ``table`` (``int64[num_components,
    len(COUNTERS)]``: each component's :meth:`RelocationCost.counters`, zeros for none):
    components share no rank, so the job's figures are their sums, or maxima for those per
    rank and the number of rounds (components run their rounds side by side)."""
    n = len(CLASSES)
    tot = table.sum(axis=0).tolist()
    top = table.max(axis=0, initial=0).tolist()
    out = {"copies": dict(zip(CLASSES, tot[:n])), "bytes": dict(zip(CLASSES, tot[n : 2 * n]))}
    out.update(zip(_SUMMED, tot[2 * n : 2 * n + len(_SUMMED)]))
    out.update(zip(_MAXED, top[2 * n + len(_SUMMED) :]))
    return {
        k: out[k]
        for k in (
            "copies",
            "bytes",
            "network_bytes",
            "cross_node_bytes",
            "min_network_bytes",
            "min_cross_node_bytes",
            "read_bytes_total",
            "sent_bytes_max_rank",
            "recv_bytes_max_rank",
            "peak_staging_bytes_max_rank",
            "num_p2p_ops",
            "num_rounds",
            "num_stashes",
        )
    }


class GroupOps(NamedTuple):
    """P2P ops of a move group per part: ``{rank: ops}`` in phase A and in phase B, and the
    number of links (sends and relays)."""

    phase_a: dict[int, int]
    phase_b: dict[int, int]
    links: int


@dataclass(frozen=True)
class MoveTable:
    """The moves of a plan and what round packing reads of each (equal-length columns, one row
    per move; filled by the router, then read only).

    Per move ``i``: ``component[i]`` its column's component; ``read_keys[i]`` /
    ``write_keys[i]`` the :class:`Keys` of the old slot contents it reads (once per read) /
    overwrites; ``group[i]`` its *group* (the moves of one expert's column: they share who
    stages and posts what); ``num_parts[i]`` its parts. Per group ``g``: ``group_stage[g]``
    ``{rank: buffers}`` staged (of the move's ``nbytes`` each), ``group_ops[g]`` its ops.
    """

    moves: list[Move] = field(default_factory=list)
    component: list[int] = field(default_factory=list)
    read_keys: list[list[int]] = field(default_factory=list)
    write_keys: list[list[int]] = field(default_factory=list)
    group: list[int] = field(default_factory=list)
    num_parts: list[int] = field(default_factory=list)
    group_stage: list[dict[int, int]] = field(default_factory=list)
    group_ops: list[GroupOps] = field(default_factory=list)

    def select(self, rows: list[int]) -> MoveTable:
        """The moves ``rows`` (ascending) as a table of their own, their groups renumbered in
        order of first use."""
        gid: dict[int, int] = {}
        group = [gid.setdefault(self.group[i], len(gid)) for i in rows]
        return MoveTable(
            moves=[self.moves[i] for i in rows],
            component=[self.component[i] for i in rows],
            read_keys=[self.read_keys[i] for i in rows],
            write_keys=[self.write_keys[i] for i in rows],
            group=group,
            num_parts=[self.num_parts[i] for i in rows],
            group_stage=[self.group_stage[g] for g in gid],
            group_ops=[self.group_ops[g] for g in gid],
        )
