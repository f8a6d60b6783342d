"""The relocation planner: old placement + new placement -> :class:`RelocationPlan` (pure).

Input: the expert tensors of every MoE layer as plain records (:class:`ExpertTensor`: which
rank holds which slots and which box of the per-expert slice), the old and new
:class:`~moeshard.placement.Placement`, the live ranks and the ranks that can read the
checkpoint. No communication, same answer on every rank, any world size. With ``rank``, only
the *component* that rank takes part in is planned (ranks holding slots of the same box
column of a layer move data only among themselves; see :class:`RelocationPlan`): what a rank
that runs the plan needs, at a cost that grows with its component, not with the world.

What moves. A rank *needs* logical expert ``e`` in slot ``s`` when the new placement puts
``e`` there and the old one did not. Each need is met, in this order of preference, by

1. a *local copy*: the rank already holds ``e`` in another slot;
2. a *same-node* send from a live holder on the rank's node (the least-loaded one, so the
   sending load spreads over all holders);
3. a *cross-node* send: one rank of the node receives it from a live holder elsewhere and
   relays it to the node's other needers, so each copy crosses between nodes once;
4. a *checkpoint read* (only the slices of experts no live rank holds), by a needer that can
   read, else by a reader on its node, else any reader; then sent as in 2 and 3.

The unit of transfer is a *move*: one logical expert's share of one *part* of a layer's
tensors (every expert tensor of the layer -- weights, biases, scales -- in the same box
column, split so that one part is at most a quarter of the staging budget).

Ordering. Moves run in *rounds*. In a round, a rank first reads, copies and sends old slot
contents, then receives into staging buffers, and only at the round's end writes the staged
data into its slots. A move that reads slot ``X`` must run no later than the move that
overwrites ``X``; a cycle of such constraints (experts swapping slots) is broken by
*stashing* one slot: its rank copies the old content aside before it is overwritten. Every
rank stages at most ``staging_bytes`` per round (stashes included), provided a part fits in a
quarter of it; a part is at least one element, so below four elements of budget a single move
may exceed it (it gets a round of its own) and a round may hold a stash beside a move
(``cost.peak_staging_bytes`` is the exact figure either way) and posts at most ``max_ops`` P2P ops
per phase (a single move's fan-out excepted).
"""

from __future__ import annotations

import functools
import hashlib
import marshal
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .._gc import paused_gc
from ..box import Box, box_numel, split_box
from ..placement import Placement
from ..topology import Topology
from .relocation_rounds import Keys, Round, Stash, pack_rounds
from .schedule import PlanCost, Schedule

__all__ = [
    "ExpertTensor", "Part", "Move", "Stash", "Round", "RelocationCost", "RelocationPlan",
    "plan_relocation", "rank_of_slot", "COUNTERS", "job_summary",
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

    # _plan formats repr(Move) itself for the fingerprint: keep it in step with these fields.
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
        return np.asarray([d["copies"][k] for k in CLASSES] + [d["bytes"][k] for k in CLASSES]
                          + [d[k] for k in COUNTERS[2 * len(CLASSES):]], dtype=np.int64)


# RelocationCost.counters(): per class copies, per class bytes, then the summed figures, then
# (_MAXED) the figures that are a maximum over ranks or over rounds in parallel.
_SUMMED = ("network_bytes", "cross_node_bytes", "min_network_bytes", "min_cross_node_bytes", "read_bytes_total",
           "num_p2p_ops", "num_stashes")
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
    out = {"copies": dict(zip(CLASSES, tot[:n])), "bytes": dict(zip(CLASSES, tot[n:2 * n]))}
    out.update(zip(_SUMMED, tot[2 * n:2 * n + len(_SUMMED)]))
    out.update(zip(_MAXED, top[2 * n + len(_SUMMED):]))
    return {k: out[k] for k in ("copies", "bytes", "network_bytes", "cross_node_bytes", "min_network_bytes",
                                "min_cross_node_bytes", "read_bytes_total", "sent_bytes_max_rank",
                                "recv_bytes_max_rank", "peak_staging_bytes_max_rank", "num_p2p_ops", "num_rounds",
                                "num_stashes")}


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
        return _as_schedule(self, self.old_phy2log, self.max_ops)

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
        return _as_schedule(self, self.old_phy2log, self.max_ops, rank)

    @property
    def disk_experts(self) -> list[tuple[int, int]]:
        """``[(layer, logical expert)]`` read from the checkpoint (no live copy), on the whole
        job (also in a plan for one rank)."""
        return list(self.read_experts)


def _components(same_layout: dict, world: int) -> tuple[np.ndarray, dict[int, list[int]]]:
    """``(component int64[world], {id(layout): [a rank of each column]})``: the connected
    components of ranks joined by holding slots in the same column of some layer, numbered by
    lowest rank (-1 for ranks holding nothing)."""
    parent = list(range(world))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    held = np.zeros(world, dtype=bool)
    firsts: dict[int, list[int]] = {}
    for key, (lay, _) in same_layout.items():
        firsts[key] = []
        if len(lay.rank):
            held[lay.rank] = True
        for c in range(len(lay.groups)):
            ranks = np.unique(lay.rank[lay.col == c]).tolist()
            firsts[key].append(ranks[0])
            a = find(ranks[0])
            for r in ranks[1:]:
                b = find(r)
                if a != b:  # union by lowest rank: roots are the components' lowest ranks
                    a, b = min(a, b), max(a, b)
                    parent[b] = a
    root = np.asarray([find(r) for r in range(world)], dtype=np.int64)
    comp = np.full(world, -1, dtype=np.int64)
    comp[held] = np.searchsorted(np.unique(root[held]), root[held])
    return comp, firsts


def _unread(comp: np.ndarray, firsts: dict[int, list[int]], read_cols: set[tuple[int, int]],
            readers: np.ndarray) -> bool:
    """Whether a column in ``read_cols`` ((id(layout), column) that reads from the checkpoint)
    has no reader (``readers``: ``bool[world]``) in its component: a reader elsewhere must
    serve it, and the job is then planned as one component."""
    return any(not readers[comp == comp[firsts[key][c]]].any() for key, c in read_cols)


def _pack_components(moves: list[Move], move_comp: list[int], keys: Keys, read_keys, write_keys, group_of,
                     num_parts, group_stage, group_ops, world: int, budget: int, max_ops: int):
    """:func:`~.relocation_rounds.pack_rounds` per component (``move_comp``: each move's), its
    rounds merged by number (components share no rank: budgets per rank hold, and no op of
    one component waits for another's). One component: ``pack_rounds`` itself."""
    comps = sorted(set(move_comp))
    if len(comps) <= 1:
        return pack_rounds(moves, keys, read_keys, write_keys, group_of, num_parts, group_stage, group_ops,
                           world, budget, max_ops)
    by_comp: dict[int, list[int]] = {k: [] for k in comps}
    for i, k in enumerate(move_comp):
        by_comp[k].append(i)
    round_moves: list[list[int]] = []
    round_stashes: list[list[Stash]] = []
    peak = np.zeros(world, dtype=np.int64)
    total_ops = 0
    for k in comps:
        sel = by_comp[k]
        gid: dict[int, int] = {}  # the component's groups, renumbered
        g_of = [gid.setdefault(group_of[i], len(gid)) for i in sel]
        groups = list(gid)
        rounds, stashes, pk, ops = pack_rounds(
            [moves[i] for i in sel], keys, [read_keys[i] for i in sel], [write_keys[i] for i in sel], g_of,
            [num_parts[i] for i in sel], [group_stage[g] for g in groups], [group_ops[g] for g in groups],
            world, budget, max_ops)
        peak += pk  # ranks of other components stage nothing here
        total_ops += ops
        for t, rnd in enumerate(rounds):
            if t == len(round_moves):
                round_moves.append([])
                round_stashes.append([])
            round_moves[t].extend(sel[i] for i in rnd.moves)
            round_stashes[t].extend(stashes[j] for j in rnd.stashes)
    out_rounds: list[Round] = []
    out_stashes: list[Stash] = []
    for mv, st in zip(round_moves, round_stashes):
        out_rounds.append(Round(tuple(sorted(mv)), tuple(range(len(out_stashes), len(out_stashes) + len(st)))))
        out_stashes.extend(st)
    return out_rounds, out_stashes, peak, total_ops


def rank_of_slot(num_physical: int, num_ranks: int) -> np.ndarray:
    """``int[num_physical]``: EP rank of every slot (slot p on rank p // slots_per_rank)."""
    return np.arange(num_physical) // (num_physical // num_ranks)


def _columns(tensors: Sequence[ExpertTensor], layer_tensors: list[int], world: int) -> tuple[dict, list[list[Box]]]:
    """Group the ranks holding a layer by the boxes they hold (one *column* per distinct tuple
    of boxes); every tensor of a layer must give a rank the same slots."""
    per_rank: dict[int, tuple[int, int, list[Box]]] = {}
    for k, ti in enumerate(layer_tensors):
        t = tensors[ti]
        seen = set()
        for rank, s0, ns, box in t.holdings:
            if not 0 <= rank < world:
                raise ValueError(f"{t.name}: rank {rank} outside the world of {world} ranks")
            if rank in seen:
                raise ValueError(f"{t.name}: rank {rank} is listed twice")
            seen.add(rank)
            if k == 0:
                per_rank[rank] = (s0, ns, [box])
            else:
                first = per_rank.get(rank)
                if first is None or first[:2] != (s0, ns):
                    raise ValueError(
                        f"{t.name}: rank {rank} holds slots {s0}..{s0 + ns - 1}, but "
                        f"{tensors[layer_tensors[0]].name} of the same layer gives it "
                        f"{'no slots' if first is None else f'slots {first[0]}..{first[0] + first[1] - 1}'}"
                    )
                first[2].append(box)
        if seen != set(per_rank):
            missing = sorted(set(per_rank) - seen)
            raise ValueError(f"{t.name}: ranks {missing} hold other tensors of its layer but not this one")
    col_ids: dict[tuple, int] = {}
    col_boxes: list[list[Box]] = []
    cols: dict[int, tuple[int, int, int]] = {}
    for rank in sorted(per_rank):
        s0, ns, boxes = per_rank[rank]
        if ns == 0 or all(box_numel(b) == 0 for b in boxes):
            continue  # holds nothing of this layer (an empty box of one tensor is no reason)
        key = tuple(boxes)
        if key not in col_ids:
            col_ids[key] = len(col_boxes)
            col_boxes.append(list(boxes))
        cols[rank] = (col_ids[key], s0, ns)
    return cols, col_boxes


def _part_groups(tensors: Sequence[ExpertTensor], layer_tensors: list[int], boxes: list[Box], max_part: int) -> list[tuple[Part, ...]]:
    """Split one column's boxes into part groups of at most ``max_part`` bytes (big boxes
    split along their first dim; small ones packed together, in tensor order)."""
    groups: list[list[Part]] = [[]]
    size = 0
    for ti, box in zip(layer_tensors, boxes):
        item = tensors[ti].itemsize
        if box_numel(box) == 0:
            continue  # this column holds nothing of this tensor
        for sub in split_box(box, max(1, max_part // item)):
            nbytes = box_numel(sub) * item
            if groups[-1] and size + nbytes > max_part:
                groups.append([])
                size = 0
            groups[-1].append(Part(ti, sub))
            size += nbytes
    return [tuple(g) for g in groups if g]


def plan_relocation(
    tensors: Sequence[ExpertTensor],
    old: Placement | None,
    new: Placement,
    topology: Topology,
    active: Sequence[bool] | np.ndarray | None = None,
    readers: Sequence[bool] | np.ndarray | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    max_ops: int = DEFAULT_MAX_OPS,
    from_checkpoint: bool = False,
    rank: int | None = None,
) -> RelocationPlan:
    """Plan moving expert tensors from placement ``old`` to ``new`` (pure, deterministic).

    Args:
        tensors: every expert tensor of every MoE layer (see :class:`ExpertTensor`).
        old, new: placements of the same shape; a rank that is not ``active`` must hold only
            empty slots in ``new``. ``old=None``: nothing is held yet (an initial fill from
            the checkpoint).
        topology: world size and ranks per node.
        active: ``bool[world_size]``: live ranks (None: all). Dead ranks' memory is lost.
        readers: ``bool[world_size]``: ranks that can read the checkpoint (None: nobody).
        staging_bytes: per-rank budget for staged data in one round.
        max_ops: P2P ops per rank and phase before a round is closed.
        from_checkpoint: ignore live copies and read every changed slot from the checkpoint
            (what engines without P2P relocation do; a baseline, or for suspect peers).
        rank: plan only the component of the job that this rank takes part in (what a rank
            that runs the plan needs: see :class:`RelocationPlan`); None: the whole job.

    Raises:
        ValueError: placements that disagree in shape, a new slot on a dead rank, an expert
            with no live copy when no rank can read the checkpoint, or inconsistent tensors.
    """
    with paused_gc():
        return _plan(tensors, old, new, topology, active, readers, staging_bytes, max_ops, from_checkpoint, rank)


class _Layout:
    """What a layer's tensors give the planner; layers whose tensors hold the same slots and
    boxes with the same itemsizes share one (every MoE layer of a model, as a rule), so
    :func:`_columns` and :func:`_part_groups` run once per distinct layer, not per layer.

    ``cols`` / ``col_boxes`` as :func:`_columns`; ``groups[c]``: column ``c``'s part groups as
    ``((k, box), ...)`` with ``k`` the tensor's position among the layer's tensors;
    ``sizes[c]``: their bytes, ``totals[c]`` their sum. One row per (rank, slot) the layer's
    ranks hold, in ``cols`` order (ranks ascending, then slots): ``rank``, ``col``, ``slot``
    (``int64[n]``) and ``live`` (``bool[n]``: the rank is active). ``rank_objs``: ``{int: rank}``
    where the holdings give ranks that are not ``int`` (numpy ints: records keep them, as they
    always did), else None.
    """

    __slots__ = ("cols", "groups", "sizes", "totals", "rank", "col", "slot", "live", "rank_objs")

    def __init__(self, tensors, layer_tensors: list[int], world: int, max_part: int, active: np.ndarray):
        cols, col_boxes = _columns(tensors, layer_tensors, world)
        pos = {ti: k for k, ti in enumerate(layer_tensors)}
        self.cols = cols
        self.groups, self.sizes = [], []
        for boxes in col_boxes:
            groups = _part_groups(tensors, layer_tensors, boxes, max_part)
            self.groups.append([tuple((pos[p.tensor], p.box) for p in g) for g in groups])
            self.sizes.append([sum(box_numel(p.box) * tensors[p.tensor].itemsize for p in g) for g in groups])
        self.totals = [sum(s) for s in self.sizes]
        held = list(cols.items())
        counts = [ns for _, (_, _, ns) in held]
        self.rank = np.repeat(np.asarray([r for r, _ in held], dtype=np.int64), counts)
        self.col = np.repeat(np.asarray([c for _, (c, _, _) in held], dtype=np.int64), counts)
        self.slot = (np.concatenate([np.arange(s0, s0 + ns, dtype=np.int64) for _, (_, s0, ns) in held])
                     if held else np.zeros(0, dtype=np.int64))
        self.live = active[self.rank]
        self.rank_objs = None if all(type(r) is int for r in cols) else {int(r): r for r in cols}


def _holdings_key(t: ExpertTensor) -> bytes | None:
    """Exact bytes of ``t.holdings`` (None if it holds anything but tuples and ints): equal keys
    mean equal holdings of the same types, so their ``repr`` and layout can be shared."""
    try:
        return marshal.dumps(t.holdings, 2)  # version 2: no back-references, same bytes for equal values
    except ValueError:  # numpy ints, subclasses: no sharing
        return None


def _layer_needs(lay: _Layout, layers: list[int], new_p2l: np.ndarray, old_p2l: np.ndarray, num_experts: int,
                 keys: "Keys", holders: bool, col_ok: np.ndarray | None = None) -> list[tuple]:
    """What the layers ``layers`` (all of layout ``lay``) need, one numpy pass for all of them.

    A (rank, slot) row of ``lay`` *needs* its new expert when that differs from the old one; its
    key is ``column * num_experts + expert``. Per layer, a tuple of

    - ``bad``: ``(expert, slot, rank)`` of the first row (in ``lay`` order) that puts an expert
      on a dead rank, else None;
    - ``key``, ``rank``, ``slot``, ``write``: lists over the needing rows, by key, then rank and
      slot ascending; ``write`` the :class:`Keys` key of the slot (its part group 0);
    - ``(key, rank, slot)``: lists over the rows of live ranks holding a needed key in the old
      placement (in ``lay`` order); empty with ``holders=False``;
    - ``lost``: the needed keys no live rank holds, ascending (of every column).

    ``col_ok`` (``bool[columns]``): keep only the needs and holders of these columns.
    """
    rows = np.asarray(layers, dtype=np.int64)
    new_e = new_p2l[rows][:, lay.slot]  # int[len(layers), n]
    old_e = old_p2l[rows][:, lay.slot]
    filled = new_e >= 0
    dead = filled & ~lay.live
    first_dead = np.where(dead.any(axis=1), dead.argmax(axis=1), -1).tolist()
    span = len(lay.groups) * num_experts  # keys per layer
    li, j = np.nonzero(filled & (new_e != old_e))  # layer-major, then lay order
    key = lay.col[j] * num_experts + new_e[li, j]
    order = np.argsort(li * span + key, kind="stable")  # stable: ranks, then slots ascending per key
    li, j, key = li[order], j[order], key[order]
    write = (rows[li] * keys.world + lay.rank[j]) * keys.num_physical + lay.slot[j]
    cut = np.searchsorted(li, np.arange(len(layers) + 1)).tolist()
    if holders:
        hli, hj = np.nonzero(lay.live & (old_e >= 0))
        hkey = lay.col[hj] * num_experts + old_e[hli, hj]
        wanted = np.zeros(len(layers) * span, dtype=bool)
        wanted[li * span + key] = True
        keep = wanted[hli * span + hkey]
        hli, hj, hkey = hli[keep], hj[keep], hkey[keep]
    else:
        hli = hj = hkey = np.zeros(0, dtype=np.int64)
    lost = np.setdiff1d(li * span + key, hli * span + hkey)  # unique, ascending: layer-major
    lcut = np.searchsorted(lost, np.arange(len(layers) + 1) * span).tolist()
    lost = (lost % span).tolist()
    if col_ok is not None:
        ok = col_ok[lay.col[j]]
        li, j, key, write = li[ok], j[ok], key[ok], write[ok]
        cut = np.searchsorted(li, np.arange(len(layers) + 1)).tolist()
        ok = col_ok[lay.col[hj]]
        hli, hj, hkey = hli[ok], hj[ok], hkey[ok]
    hcut = np.searchsorted(hli, np.arange(len(layers) + 1)).tolist()
    key_l, rank_l, slot_l, write_l = key.tolist(), lay.rank[j].tolist(), lay.slot[j].tolist(), write.tolist()
    hkey_l, hrank_l, hslot_l = hkey.tolist(), lay.rank[hj].tolist(), lay.slot[hj].tolist()
    out = []
    for x, fd in enumerate(first_dead):
        bad = None if fd < 0 else (int(new_e[x, fd]), int(lay.slot[fd]), int(lay.rank[fd]))
        a, b = cut[x], cut[x + 1]
        ha, hb = hcut[x], hcut[x + 1]
        out.append((bad, key_l[a:b], rank_l[a:b], slot_l[a:b], write_l[a:b],
                    (hkey_l[ha:hb], hrank_l[ha:hb], hslot_l[ha:hb]), lost[lcut[x]:lcut[x + 1]]))
    return out


def _plan(tensors, old, new, topology, active, readers, staging_bytes, max_ops, from_checkpoint,
          rank: int | None) -> RelocationPlan:
    world = topology.world_size
    if rank is not None and not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the world of {world} ranks")
    node = topology.nodes_array()
    active = np.ones(world, dtype=bool) if active is None else np.asarray(active, dtype=bool)
    readers = np.zeros(world, dtype=bool) if readers is None else np.asarray(readers, dtype=bool)
    if active.shape != (world,) or readers.shape != (world,):
        raise ValueError(f"active and readers must be bool[{world}], got shapes {active.shape} and {readers.shape}")
    if not active.any():
        raise ValueError("no rank is active")
    dead_readers = np.flatnonzero(readers & ~active).tolist()  # named when an expert has no source
    readers = readers & active  # a dead rank reads nothing
    if old is None:
        old_p2l = np.full_like(new.phy2log, -1)
        from_checkpoint = True
    elif old.phy2log.shape != new.phy2log.shape or old.num_logical != new.num_logical:
        raise ValueError(
            f"old placement has {old.num_layers} layers x {old.num_physical} slots and {old.num_logical} "
            f"experts, the new one {new.num_layers} x {new.num_physical} and {new.num_logical}"
        )
    else:
        old_p2l = old.phy2log
    if staging_bytes < 1 or max_ops < 2:
        raise ValueError(f"staging_bytes must be >= 1 and max_ops >= 2, got {staging_bytes}, {max_ops}")
    by_layer: dict[int, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        if not 0 <= t.layer < new.num_layers:
            raise ValueError(f"{t.name}: MoE layer {t.layer} outside the placement's {new.num_layers} layers")
        by_layer[t.layer].append(i)
    max_part = max(1, staging_bytes // 4)
    hkeys = [_holdings_key(t) for t in tensors]

    columns: list[dict] = [{} for _ in range(new.num_layers)]
    parts: dict[tuple[int, int], tuple[tuple[Part, ...], ...]] = {}
    moves: list[Move] = []
    # Python ints and lists in the per-move loop: numpy scalars cost more than they save there.
    node_l = node.tolist()
    readers_l = readers.tolist()
    reader_list = np.flatnonzero(readers).tolist()
    read_load, sent, recv = [0] * world, [0] * world, [0] * world
    n_copies, n_bytes = [0] * len(CLASSES), [0] * len(CLASSES)  # per class, in CLASSES order
    min_net = min_cross = net = cross = 0
    num_experts = max(1, new.num_logical)  # key of (column, expert): column * num_experts + expert
    num_physical = new.num_physical
    # Scheduling keys of old slot contents (rank, layer, slot, part group) as one int, see Keys.
    keys = Keys(new.num_layers, world, num_physical)
    # Per move, for _schedule: keys read and overwritten, its group (the moves of one expert's
    # column share who stages and posts what: group_stage / group_ops) and its part count.
    read_keys: list[list[int]] = []
    write_keys: list[list[int]] = []
    group_of: list[int] = []
    num_parts: list[int] = []
    group_stage: list[dict[int, int]] = []  # rank -> buffers staged (read, local clones, received)
    group_ops: list[tuple[dict[int, int], dict[int, int], int]] = []  # phase A / B ops per rank and part, links
    layouts: dict[tuple, _Layout] = {}
    move_comp: list[int] = []  # per move: the component of its column

    # Layouts, in layer order. A layer whose tensors are inconsistent raises once the loop
    # below reaches it, so that errors of the layers before it come first.
    layer_order = sorted(by_layer)
    lay_of: dict[int, _Layout] = {}
    failed: Exception | None = None
    for layer in layer_order:
        lt = by_layer[layer]
        lkey = tuple((hkeys[ti], type(tensors[ti].itemsize), tensors[ti].itemsize) for ti in lt)
        lay = layouts.get(lkey)
        if lay is None:
            try:
                lay = _Layout(tensors, lt, world, max_part, active)
            except Exception as err:
                failed = err
                break
            if all(hkeys[ti] is not None for ti in lt):
                layouts[lkey] = lay
        lay_of[layer] = lay
    # Needs and live holders of all the layers of a layout at once.
    same_layout: dict[int, tuple[_Layout, list]] = {}
    for layer, lay in lay_of.items():
        same_layout.setdefault(id(lay), (lay, []))[1].append(layer)
    comp, firsts = _components(same_layout, world)

    def needs(keep: int | None) -> dict[int, tuple]:
        # keep: only the columns of that component (a plan for one rank), None: all.
        out: dict[int, tuple] = {}
        for key, (lay, layers) in same_layout.items():
            col_ok = None if keep is None else comp[firsts[key]] == keep
            out.update(zip(layers, _layer_needs(lay, layers, new.phy2log, old_p2l, num_experts, keys,
                                                not from_checkpoint, col_ok)))
        return out

    needs_of = needs(None if rank is None else int(comp[rank]))

    # Every check of every layer, in layer order, before any planning: a plan for one rank
    # raises what the whole job's raises. Experts that no live rank holds are read.
    read_cols: set[tuple[int, int]] = set()  # (id(layout), column) with an expert to read
    disk: set[tuple[int, int]] = set()  # (layer, logical expert) read from the checkpoint
    for layer in layer_order:
        if layer not in lay_of:
            raise failed
        lay = lay_of[layer]
        bad, _, _, _, _, _, lost = needs_of[layer]
        if bad is not None:
            e, s, r = bad
            raise ValueError(
                f"the new placement puts logical expert {e} in slot {s} of layer {layer}, "
                f"which rank {r} holds, but rank {r} is not active"
            )
        if lost and not reader_list:
            c, e = divmod(lost[0], num_experts)
            old_row = old_p2l[layer]
            dead = sorted({r for r, (cc, s0, ns) in lay.cols.items() if cc == c and not active[r]
                           and (old_row[s0:s0 + ns] == e).any()})
            why = "no checkpoint to read it from"
            if dead_readers:  # a checkpoint was given, but every rank that sees it died
                who = f"rank {dead_readers[0]}" if len(dead_readers) == 1 else f"ranks {dead_readers}"
                why = f"the only rank(s) that can read the checkpoint ({who}) are not active"
            raise ValueError(
                f"logical expert {e} of layer {layer} has no live copy (held only by dead "
                f"ranks {dead}) and {why}"
            )
        for k in lost:
            c, e = divmod(k, num_experts)
            read_cols.add((id(lay), c))
            disk.add((int(layer), int(e)))
    if _unread(comp, firsts, read_cols, readers):
        comp[:] = 0  # one component: its needs are every column's
        if rank is not None:
            needs_of = needs(None)
    col_comp = {key: comp[f].tolist() for key, f in firsts.items()}
    comp_l = comp.tolist()
    comp_readers: dict[int, list[int]] = {}
    for r in reader_list:
        comp_readers.setdefault(comp_l[r], []).append(r)

    for layer in layer_order:
        lay, lt = lay_of[layer], by_layer[layer]
        cols = lay.cols
        columns[layer] = cols  # shared by the layers of a layout (read only)
        for c, groups in enumerate(lay.groups):
            parts[(layer, c)] = tuple(tuple(Part(lt[k], box) for k, box in g) for g in groups)
        _, nk, nr, ns_, wk, hold, _ = needs_of[layer]  # with rank: its component's columns only
        ccomp = col_comp[id(lay)]  # component of each column
        if lay.rank_objs is not None:
            nr = [lay.rank_objs[r] for r in nr]
            hold = (hold[0], [lay.rank_objs[r] for r in hold[1]], hold[2])
        if not nk:
            continue
        base = keys.key(int(layer), 0, 0)  # int: numpy layer ids would make every key a numpy int
        # Live holders of the needed (column, expert)s: key -> {rank: its first slot}, ranks ascending.
        holders: dict[int, dict[int, int]] = {}
        for k, r, s in zip(*hold):
            hb = holders.get(k)
            if hb is None:
                holders[k] = {r: s}
            elif r not in hb:
                hb[r] = s
        i, n = 0, len(nk)
        while i < n:
            # One (column, expert): its needers (ascending) and their slots (ascending).
            key, i0 = nk[i], i
            ranks, slots = [nr[i]], [[ns_[i]]]
            i += 1
            while i < n and nk[i] == key:
                if nr[i] == ranks[-1]:
                    slots[-1].append(ns_[i])
                else:
                    ranks.append(nr[i])
                    slots.append([ns_[i]])
                i += 1
            c, e = divmod(key, num_experts)
            sizes = lay.sizes[c]
            num_groups = len(sizes)
            total = lay.totals[c]
            held_by = holders.get(key)
            local: list[tuple[int, int]] = []
            reads0: list[int] = []  # keys of the old slot contents read
            stage: dict[int, int] = {}
            if held_by:
                remote, remote_n = [], []  # needers without a local copy, the slots they write
                for r, sl in zip(ranks, slots):
                    s = held_by.get(r)
                    if s is None:
                        remote.append(r)
                        remote_n.append(len(sl))
                    else:
                        local.append((r, s))
                        reads0.append(base + r * num_physical + s)
                        stage[r] = 1  # ranks are distinct
                        n_copies[0] += len(sl) * num_groups
                        n_bytes[0] += len(sl) * total
                srcs = list(held_by)  # ascending
            else:
                remote, remote_n, srcs = ranks, [len(sl) for sl in slots], []
            read = -1
            if remote and not srcs:
                # No live copy anywhere: one checkpoint read per job, near the needers, by a
                # reader of the column's component (_components makes sure there is one).
                cands = [r for r in remote if readers_l[r]]
                if not cands:
                    rem_nodes = {node_l[r] for r in remote}
                    cands = [r for r in comp_readers[ccomp[c]] if node_l[r] in rem_nodes]
                if not cands:
                    cands = comp_readers[ccomp[c]]
                read = int(min(cands, key=read_load.__getitem__))  # the first least-loaded (cands ascending)
                read_load[read] += total
                srcs = [read]
                held_by = {read: -1}
                stage[read] = 1
            sends: list[tuple[int, int, int]] = []
            relays: list[tuple[int, int]] = []
            ops_a: dict[int, int] = {}
            ops_b: dict[int, int] = {}
            if remote:
                src_nodes = {node_l[h] for h in srcs}

                def send(h: int, r: int) -> None:
                    """Source ``h`` sends its copy (old slot ``held_by[h]``; -1: its read) to
                    ``r``, a needer that holds no source (needers are distinct)."""
                    s = held_by[h]
                    sends.append((h, s, r))
                    if s >= 0:
                        reads0.append(base + h * num_physical + s)
                    sent[h] += total
                    recv[r] += total
                    stage[r] = 1
                    ops_a[h] = ops_a.get(h, 0) + 1
                    ops_a[r] = ops_a.get(r, 0) + 1

                # Sources and needers ascending: min() by load alone picks the lowest rank among
                # the least loaded.
                for nd in sorted({node_l[r] for r in remote}) if len(remote) > 1 else (node_l[remote[0]],):
                    on_node = [r for r in remote if node_l[r] == nd] if len(remote) > 1 else remote
                    if nd in src_nodes:
                        here = [h for h in srcs if node_l[h] == nd] if len(srcs) > 1 else srcs
                        for r in on_node:
                            if r == read:
                                continue  # the reader needs it itself: no transfer
                            send(min(here, key=sent.__getitem__) if len(here) > 1 else here[0], r)
                        continue
                    # No source on the node: one needer receives across and relays it on.
                    relay = min(on_node, key=recv.__getitem__) if len(on_node) > 1 else on_node[0]
                    send(min(srcs, key=sent.__getitem__) if len(srcs) > 1 else srcs[0], relay)
                    cross += total
                    for r in on_node:
                        if r != relay:
                            relays.append((relay, r))
                            sent[relay] += total
                            recv[r] += total
                            stage[r] = 1
                            ops_b[relay] = ops_b.get(relay, 0) + 1
                            ops_b[r] = 1
                net += total * (len(sends) + len(relays))
                # Lower bounds: every remote needer receives once, except a needer that reads it
                # itself; every node with needers and without a source receives across once.
                min_net += total * (len(remote) - int(read in remote))
                for r, cnt in zip(remote, remote_n):
                    if read >= 0:
                        k = 3  # DISK
                    elif node_l[r] in src_nodes:
                        k = 1  # SAME_NODE
                    else:
                        k = 2  # CROSS_NODE
                    n_copies[k] += cnt * num_groups
                    n_bytes[k] += cnt * total
                min_cross += total * len({node_l[r] for r in remote} - src_nodes)
            writes = tuple(zip(ranks, map(tuple, slots)))
            local_t, sends_t, relays_t = tuple(local), tuple(sends), tuple(relays)
            writes0 = wk[i0:i]  # in the order of writes
            g = len(group_stage)
            group_stage.append(stage)
            group_ops.append((ops_a, ops_b, len(sends) + len(relays)))
            kc = ccomp[c]
            for k, size in enumerate(sizes):
                moves.append(Move(layer, c, k, e, size, read, local_t, sends_t, relays_t, writes))
                move_comp.append(kc)
                if k:
                    off = k * keys.per_part
                    read_keys.append([x + off for x in reads0])
                    write_keys.append([x + off for x in writes0])
                else:
                    read_keys.append(reads0)
                    write_keys.append(writes0)
                group_of.append(g)
                num_parts.append(len(lay.groups[c][k]))

    rounds, stashes, peak, total_ops = _pack_components(moves, move_comp, keys, read_keys, write_keys, group_of,
                                                        num_parts, group_stage, group_ops, world, staging_bytes,
                                                        max_ops)
    cost = RelocationCost(
        copies=dict(zip(CLASSES, n_copies)),
        bytes=dict(zip(CLASSES, n_bytes)),
        sent_bytes=np.asarray(sent, dtype=np.int64),
        recv_bytes=np.asarray(recv, dtype=np.int64),
        read_bytes=np.asarray(read_load, dtype=np.int64),
        peak_staging_bytes=peak,
        network_bytes=net,
        cross_node_bytes=cross,
        min_network_bytes=min_net,
        min_cross_node_bytes=min_cross,
        num_p2p_ops=total_ops,
        num_rounds=len(rounds),
        num_stashes=len(stashes),
    )
    plan = RelocationPlan(
        topology=topology.with_rank(0),
        tensors=tuple(tensors),
        columns=tuple(columns),
        parts=parts,
        moves=tuple(moves),
        stashes=tuple(stashes),
        rounds=tuple(rounds),
        cost=cost,
        staging_bytes=staging_bytes,
        max_ops=max_ops,
        old_phy2log=old_p2l,
        rank=rank,
        component=comp,
        read_experts=tuple(sorted(disk)),
    )
    object.__setattr__(plan, "fingerprint", _fingerprint(plan, hkeys, old_p2l, new, active, readers, from_checkpoint))
    return plan


def _as_schedule(plan: RelocationPlan, old_p2l: np.ndarray, max_ops: int, only: int | None = None) -> Schedule:
    """The plan as a :class:`Schedule` (see :class:`RelocationPlan` for its conventions): the
    whole job's, or with ``only`` only that rank's rows (its sends from other ranks' views
    keep view -1: only a send's source reads its view)."""
    tensors = plan.tensors
    width = 1 + max((len(x.slice_shape) for x in tensors), default=0)
    # Each rank's holding of each tensor: (first slot, slice box).
    held = [{r: (s0, box) for r, s0, _, box in x.holdings if only is None or r == only} for x in tensors]
    pieces: dict[tuple, int] = {}
    p_key, p_off, p_len, p_bytes = [], [], [], []
    views: dict[tuple, int] = {}
    v_rank, v_param, v_off = [], [], []
    reads, sends, copies, dlv = [], [], [], []

    def piece(ti: int, expert: int, box: Box, column: int) -> int:
        # Per column: columns may share a box of a tensor (a tensor whole on every expert-FSDP
        # rank), but each column's move is its own, with its own buffers.
        k = (ti, expert, box, column)
        pid = pieces.get(k)
        if pid is None:
            pid = pieces[k] = len(p_key)
            pad = width - 1 - len(box)
            p_key.append(ti)
            p_off.append([expert, *(o for o, _ in box)] + [0] * pad)
            p_len.append([1, *(n for _, n in box)] + [1] * pad)
            p_bytes.append(box_numel(box) * tensors[ti].itemsize)
        return pid

    def local_off(rank: int, ti: int, slot: int, box: Box) -> list[int]:
        s0, mine = held[ti][rank]
        return [slot - s0, *(o - mo for (o, _), (mo, _) in zip(box, mine))] + [0] * (width - 1 - len(box))

    def view(rank: int, ti: int, slot: int, box: Box) -> int:
        k = (rank, ti, slot, box)
        v = views.get(k)
        if v is None:
            v = views[k] = len(v_rank)
            v_rank.append(rank)
            v_param.append(ti)
            v_off.append(local_off(rank, ti, slot, box))
        return v

    moves = plan.moves
    if only is None:
        mine = None
    else:
        # The moves rank ``only`` takes part in. The part groups of one expert's column share
        # their tuples (the planner builds them once): each distinct combination is tested once
        # (the moves hold the tuples, so their ids stay unique for the loop).
        seen: dict[tuple, bool] = {}
        mine = set()
        for i, m in enumerate(moves):
            k = (id(m.copies), id(m.writes), id(m.sends), id(m.relays), m.read)
            hit = seen.get(k)
            if hit is None:
                hit = seen[k] = only in m.ranks()
            if hit:
                mine.add(i)

    stashed: set[tuple] = set()  # (rank, layer, slot, part) stashed so far
    for k, rnd in enumerate(plan.rounds):
        a, b = 2 * k, 2 * k + 1
        for i in rnd.stashes:
            st = plan.stashes[i]
            if only is not None and st.rank != only:
                continue
            stashed.add((st.rank, st.layer, st.slot, st.part))
            col = plan.columns[st.layer][st.rank][0]
            for part in plan.parts[(st.layer, col)][st.part]:
                pid = piece(part.tensor, int(old_p2l[st.layer, st.slot]), part.box, col)
                copies.append((view(st.rank, part.tensor, st.slot, part.box), pid, a))
        for i in rnd.moves:
            if mine is not None and i not in mine:
                continue
            m = moves[i]
            for part in plan.parts[(m.layer, m.column)][m.part]:
                pid = piece(part.tensor, m.expert, part.box, m.column)
                if m.read >= 0 and (only is None or m.read == only):
                    reads.append((m.read, pid, a))
                for r, s in m.copies:
                    if (only is None or r == only) and (r, m.layer, s, m.part) not in stashed:
                        # (a stash is already this piece's buffer)
                        copies.append((view(r, part.tensor, s, part.box), pid, a))
                for src, s, dst in m.sends:
                    if only is not None and only != src and only != dst:
                        continue
                    from_view = s >= 0 and (only is None or src == only) and (src, m.layer, s, m.part) not in stashed
                    sends.append((src, dst, pid, a, view(src, part.tensor, s, part.box) if from_view else -1))
                for src, dst in m.relays:
                    if only is None or only == src or only == dst:
                        sends.append((src, dst, pid, b, -1))
                for r, slots in m.writes:
                    if only is None or r == only:
                        for s in slots:
                            dlv.append((pid, r, part.tensor, local_off(r, part.tensor, s, part.box), b))

    def col(rows: list, j: int, dtype) -> np.ndarray:
        return np.asarray([x[j] for x in rows], dtype=dtype)

    dlv.sort(key=lambda x: (x[0], x[1]))
    c = plan.cost
    cost = PlanCost(read_bytes=c.read_bytes, sent_bytes=c.sent_bytes, recv_bytes=c.recv_bytes,
                    peak_staging_bytes=c.peak_staging_bytes, cross_node_bytes=c.cross_node_bytes,
                    num_p2p_ops=c.num_p2p_ops, num_batches=2 * len(plan.rounds), num_broadcasts=0)
    i64 = np.int64
    return Schedule(
        topology=plan.topology, staging_bytes=plan.staging_bytes, max_ops=max_ops,
        keys=tuple(x.name for x in tensors), key_ndim=np.asarray([1 + len(x.slice_shape) for x in tensors], np.int8),
        piece_key=np.asarray(p_key, np.int32), piece_off=np.asarray(p_off, i64).reshape(-1, width),
        piece_len=np.asarray(p_len, i64).reshape(-1, width), piece_bytes=np.asarray(p_bytes, i64),
        read_rank=col(reads, 0, np.int32), read_piece=col(reads, 1, np.int32), read_round=col(reads, 2, i64),
        send_src=col(sends, 0, np.int32), send_dst=col(sends, 1, np.int32), send_piece=col(sends, 2, np.int32),
        send_round=col(sends, 3, i64), send_view=col(sends, 4, np.int32),
        bcast_node=np.zeros(0, np.int32), bcast_root=np.zeros(0, np.int32), bcast_piece=np.zeros(0, np.int32),
        bcast_round=np.zeros(0, i64),
        dlv_piece=col(dlv, 0, np.int32), dlv_rank=col(dlv, 1, np.int32), dlv_param=col(dlv, 2, np.int32),
        dlv_slot=np.full(len(dlv), -1, i64), dlv_off=np.asarray([x[3] for x in dlv], i64).reshape(-1, width),
        dlv_round=col(dlv, 4, i64), num_rounds=2 * len(plan.rounds), cost=cost,
        view_rank=np.asarray(v_rank, np.int32), view_param=np.asarray(v_param, np.int32),
        view_slot=np.full(len(v_rank), -1, i64), view_off=np.asarray(v_off, i64).reshape(-1, width),
        copy_view=col(copies, 0, np.int32), copy_piece=col(copies, 1, np.int32), copy_round=col(copies, 2, i64),
        rank=only, basis=None if only is None else plan.fingerprint,
    )


# Part of every fingerprint: plans of another planning rule must not pass for equal ones.
_RULE = b"moeshard.relocation/components-1"


def _fingerprint(plan: RelocationPlan, hkeys: list[bytes | None], old_p2l: np.ndarray, new: Placement,
                 active: np.ndarray, readers: np.ndarray, from_checkpoint: bool) -> str:
    """sha256 of what the plan is planned from: the topology, budgets, tensors (their fields,
    and the digest of their holdings' bytes -- ``hkeys``: :func:`_holdings_key` of each, one
    digest per distinct holdings; the repr of a tensor without), both placements, the live
    ranks and readers (the planner is pure and deterministic: equal inputs give equal plans).
    The same for the whole job's plan and every rank's."""
    h = hashlib.sha256(_RULE)
    h.update(repr((plan.topology.world_size, plan.topology.local_world_size, plan.staging_bytes, plan.max_ops,
                   bool(from_checkpoint), new.num_logical, new.num_ranks)).encode())
    if plan.topology.nodes is not None:  # uneven nodes (a process group of some ranks)
        h.update(repr(plan.topology.nodes).encode())
    held: dict[bytes, bytes] = {}  # holdings bytes -> their digest (layers share holdings)
    for i, t in enumerate(plan.tensors):
        hk = hkeys[i]
        if type(t) is not ExpertTensor or hk is None:
            h.update(repr(t).encode())
            continue
        digest = held.get(hk)
        if digest is None:
            digest = held[hk] = hashlib.sha256(hk).digest()
        h.update(repr((t.layer, t.name, t.slice_shape, t.itemsize)).encode())
        h.update(digest)
    for a in (old_p2l, new.phy2log, active, readers):
        a = np.ascontiguousarray(a)
        h.update(repr((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]
