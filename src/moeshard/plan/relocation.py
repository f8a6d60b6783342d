"""The relocation planner: old placement + new placement -> :class:`RelocationPlan` (pure).

Input: the expert tensors of every MoE layer as plain records (:class:`ExpertTensor`: which
rank holds which slots and which box of the per-expert slice), the old and new
:class:`~moeshard.placement.Placement`, the live ranks and the ranks that can read the
checkpoint. No communication, same answer on every rank, any world size.

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
import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .._gc import paused_gc
from ..box import Box, box_numel, split_box
from ..placement import Placement
from ..topology import Topology
from .schedule import PlanCost, Schedule

__all__ = [
    "ExpertTensor", "Part", "Move", "Stash", "Round", "RelocationCost", "RelocationPlan",
    "plan_relocation", "live_holders", "rank_of_slot",
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


@dataclass(frozen=True, eq=False)
class RelocationPlan:
    """Everything every rank does, in order. Identical on every rank.

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
    fingerprint: str = field(default="")

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The plan as the runner's :class:`Schedule` (built on first use: evaluating
        policies or costing a plan does not need it)."""
        assert self.old_phy2log is not None
        return _as_schedule(self, self.old_phy2log, self.max_ops)

    @property
    def disk_experts(self) -> list[tuple[int, int]]:
        """``[(layer, logical expert)]`` read from the checkpoint (no live copy)."""
        return sorted({(m.layer, m.expert) for m in self.moves if m.read >= 0})


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


def live_holders(phy2log_row: np.ndarray, cols: dict, active: np.ndarray) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """``{(column, logical expert): [(rank, slot), ...]}`` of live ranks in one layer."""
    row = phy2log_row.tolist()
    out: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for rank, (c, s0, ns) in cols.items():
        if not active[rank]:
            continue
        for s in range(s0, s0 + ns):
            if row[s] >= 0:
                out[(c, row[s])].append((rank, s))
    return out


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

    Raises:
        ValueError: placements that disagree in shape, a new slot on a dead rank, an expert
            with no live copy when no rank can read the checkpoint, or inconsistent tensors.
    """
    with paused_gc():
        return _plan(tensors, old, new, topology, active, readers, staging_bytes, max_ops, from_checkpoint)


def _plan(tensors, old, new, topology, active, readers, staging_bytes, max_ops, from_checkpoint) -> RelocationPlan:
    world = topology.world_size
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

    columns: list[dict] = [{} for _ in range(new.num_layers)]
    parts: dict[tuple[int, int], list[tuple[Part, ...]]] = {}
    moves: list[Move] = []
    read_load = np.zeros(world, dtype=np.int64)
    sent = np.zeros(world, dtype=np.int64)
    recv = np.zeros(world, dtype=np.int64)
    copies = dict.fromkeys(CLASSES, 0)
    nbytes_cls = dict.fromkeys(CLASSES, 0)
    min_net = min_cross = net = cross = 0
    reader_idx = np.flatnonzero(readers)

    for layer in sorted(by_layer):
        cols, col_boxes = _columns(tensors, by_layer[layer], world)
        columns[layer] = cols
        for c, boxes in enumerate(col_boxes):
            parts[(layer, c)] = _part_groups(tensors, by_layer[layer], boxes, max_part)
        # Bytes of each part group of each column (the same for every expert of the layer).
        sizes_of = {c: [sum(box_numel(p.box) * tensors[p.tensor].itemsize for p in g) for g in parts[(layer, c)]]
                    for c in range(len(col_boxes))}
        old_row, new_row = old_p2l[layer], new.phy2log[layer]
        old_list, new_list = old_row.tolist(), new_row.tolist()
        # Needs: (column, expert) -> {rank: [slots]}
        needs: dict[tuple[int, int], dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for rank, (c, s0, ns) in cols.items():
            for s in range(s0, s0 + ns):
                e = new_list[s]
                if e < 0:
                    continue
                if not active[rank]:
                    raise ValueError(
                        f"the new placement puts logical expert {e} in slot {s} of layer {layer}, "
                        f"which rank {rank} holds, but rank {rank} is not active"
                    )
                if e != old_list[s]:
                    needs[(c, e)][rank].append(s)
        if not needs:
            continue
        holders = {} if from_checkpoint else live_holders(old_p2l[layer], cols, active)
        for (c, e) in sorted(needs):
            need = needs[(c, e)]
            held = holders.get((c, e), [])
            held_by = {}
            for r, s in held:
                held_by.setdefault(r, s)
            groups = parts[(layer, c)]
            sizes = sizes_of[c]
            total = sum(sizes)
            local = [(r, held_by[r]) for r in sorted(need) if r in held_by]
            remote = [r for r in sorted(need) if r not in held_by]
            for r, _ in local:
                copies[LOCAL] += len(need[r]) * len(groups)
                nbytes_cls[LOCAL] += len(need[r]) * total
            read = -1
            srcs = sorted(held_by)
            if remote and not srcs:
                # No live copy anywhere: one checkpoint read per job, near the needers.
                rem = np.asarray(remote)
                cands = rem[readers[rem]]
                if not len(cands):
                    cands = reader_idx[np.isin(node[reader_idx], node[rem])]
                if not len(cands):
                    cands = reader_idx
                if not len(cands):
                    dead = sorted({r for r, (cc, s0, ns) in cols.items() if cc == c and not active[r]
                                   and (old_row[s0:s0 + ns] == e).any()})
                    why = "no checkpoint to read it from"
                    if dead_readers:  # a checkpoint was given, but every rank that sees it died
                        who = f"rank {dead_readers[0]}" if len(dead_readers) == 1 else f"ranks {dead_readers}"
                        why = f"the only rank(s) that can read the checkpoint ({who}) are not active"
                    raise ValueError(
                        f"logical expert {e} of layer {layer} has no live copy (held only by dead "
                        f"ranks {dead}) and {why}"
                    )
                read = int(cands[np.argmin(read_load[cands])])
                read_load[read] += total
                srcs = [read]
                held_by = {read: -1}
            sends: list[tuple[int, int, int]] = []
            relays: list[tuple[int, int]] = []
            for n in sorted({int(node[r]) for r in remote}):
                on_node = [r for r in remote if node[r] == n]
                here = [h for h in srcs if node[h] == n]
                if here:
                    for r in on_node:
                        if r == read:
                            continue  # the reader needs it itself: no transfer
                        h = min(here, key=lambda h: (sent[h], h))
                        sends.append((h, held_by[h], r))
                        sent[h] += total
                        recv[r] += total
                    continue
                relay = min(on_node, key=lambda r: (recv[r], r))
                h = min(srcs, key=lambda h: (sent[h], h))
                sends.append((h, held_by[h], relay))
                sent[h] += total
                recv[relay] += total
                cross += total
                for r in on_node:
                    if r != relay:
                        relays.append((relay, r))
                        sent[relay] += total
                        recv[r] += total
            net += total * (len(sends) + len(relays))
            # Lower bounds: every remote needer receives once, except a needer that reads it
            # itself; every node with needers and without a source receives across once.
            min_net += total * (len(remote) - int(read in remote))
            src_nodes = {int(node[h]) for h in srcs}
            min_cross += total * len({int(node[r]) for r in remote} - src_nodes)
            cls = DISK if read >= 0 else None
            for r in remote:
                k = cls or (SAME_NODE if any(node[h] == node[r] for h in srcs) else CROSS_NODE)
                copies[k] += len(need[r]) * len(groups)
                nbytes_cls[k] += len(need[r]) * total
            writes = tuple((r, tuple(need[r])) for r in sorted(need))
            for k, size in enumerate(sizes):
                moves.append(Move(layer, c, k, e, size, read, tuple(local), tuple(sends), tuple(relays), writes))

    num_parts = [len(parts[(m.layer, m.column)][m.part]) for m in moves]
    rounds, stashes, peak, num_ops = _schedule(moves, num_parts, world, staging_bytes, max_ops)
    cost = RelocationCost(
        copies=copies,
        bytes=nbytes_cls,
        sent_bytes=sent,
        recv_bytes=recv,
        read_bytes=read_load,
        peak_staging_bytes=peak,
        network_bytes=net,
        cross_node_bytes=cross,
        min_network_bytes=min_net,
        min_cross_node_bytes=min_cross,
        num_p2p_ops=num_ops,
        num_rounds=len(rounds),
        num_stashes=len(stashes),
    )
    plan = RelocationPlan(
        topology=topology.with_rank(0),
        tensors=tuple(tensors),
        columns=tuple(columns),
        parts={k: tuple(v) for k, v in parts.items()},
        moves=tuple(moves),
        stashes=tuple(stashes),
        rounds=tuple(rounds),
        cost=cost,
        staging_bytes=staging_bytes,
        max_ops=max_ops,
        old_phy2log=old_p2l,
    )
    object.__setattr__(plan, "fingerprint", _fingerprint(plan))
    return plan


def _move_stage(m: Move) -> dict[int, int]:
    """Bytes each rank stages for a move: read buffer, local clones, received buffers."""
    stage: dict[int, int] = defaultdict(int)
    if m.read >= 0:
        stage[m.read] += m.nbytes
    for r, _ in m.copies:
        stage[r] += m.nbytes
    for _, _, d in m.sends:
        stage[d] += m.nbytes
    for _, d in m.relays:
        stage[d] += m.nbytes
    return stage


def _move_ops(m: Move, num_parts: int) -> tuple[dict[int, int], dict[int, int]]:
    a: dict[int, int] = defaultdict(int)
    b: dict[int, int] = defaultdict(int)
    for s, _, d in m.sends:
        a[s] += num_parts
        a[d] += num_parts
    for s, d in m.relays:
        b[s] += num_parts
        b[d] += num_parts
    return a, b


def _schedule(moves: list[Move], num_parts: list[int], world: int, budget: int, max_ops: int):
    """Pack moves into rounds (list scheduling in move order).

    A move becomes *ready* once every move reading the old content of a slot it overwrites
    is scheduled (in an earlier round or earlier in the same round: reads happen before the
    round's writes). If nothing is ready and nothing was scheduled in the round, the first
    blocked move's slots are stashed, which breaks the cycle it sits on.
    """
    # Keys (rank, layer, slot, part) of old slot contents read / overwritten.
    readers_of: dict[tuple, int] = defaultdict(int)
    key_readers: dict[tuple, list[int]] = defaultdict(list)
    read_keys = [[(r, m.layer, s, m.part) for r, s in m.reads()] for m in moves]
    for i, keys in enumerate(read_keys):
        for key in keys:
            readers_of[key] += 1
            key_readers[key].append(i)
    scheduled: set[int] = set()
    writer_keys: list[list[tuple]] = [
        [(r, m.layer, s, m.part) for r, slots in m.writes for s in slots] for m in moves
    ]
    writer_of = {k: i for i, ks in enumerate(writer_keys) for k in ks}
    blocked = [sum(1 for k in ks if readers_of.get(k, 0)) for ks in writer_keys]
    ready = [i for i, b in enumerate(blocked) if b == 0]
    heapq.heapify(ready)
    stage_cost = [_move_stage(m) for m in moves]
    ops_cost = [_move_ops(m, n) for m, n in zip(moves, num_parts)]

    rounds: list[Round] = []
    stashes: list[Stash] = []
    stash_live: dict[int, int] = defaultdict(int)  # rank -> bytes of stashes still needed
    stash_left: dict[tuple, int] = {}  # stashed key -> readers not yet scheduled
    peak = np.zeros(world, dtype=np.int64)
    num_ops = 0
    done = 0
    first_waiting = 0
    while done < len(moves):
        cur: list[int] = []
        new_stashes: list[int] = []
        stage: dict[int, int] = defaultdict(int)
        ops_a: dict[int, int] = defaultdict(int)
        ops_b: dict[int, int] = defaultdict(int)
        deferred: list[int] = []
        released: list[tuple] = []
        while True:
            while ready:
                i = heapq.heappop(ready)
                add = stage_cost[i]
                a, b = ops_cost[i]
                fits = not cur or (
                    all(stage[r] + v + stash_live[r] <= budget for r, v in add.items())
                    and all(ops_a[r] + v <= max_ops for r, v in a.items())
                    and all(ops_b[r] + v <= max_ops for r, v in b.items())
                )
                if not fits:
                    deferred.append(i)
                    continue
                cur.append(i)
                scheduled.add(i)
                done += 1
                for r, v in add.items():
                    stage[r] += v
                for r, v in a.items():
                    ops_a[r] += v
                for r, v in b.items():
                    ops_b[r] += v
                m = moves[i]
                num_ops += (len(m.sends) + len(m.relays)) * num_parts[i]
                for key in read_keys[i]:
                    if key in stash_left:
                        stash_left[key] -= 1
                        if stash_left[key] == 0:
                            released.append(key)
                        continue
                    readers_of[key] -= 1
                    if readers_of[key] == 0 and key in writer_of:
                        w = writer_of[key]
                        blocked[w] -= 1
                        if blocked[w] == 0:
                            heapq.heappush(ready, w)
            if deferred or done == len(moves):
                break
            # Deadlock: every remaining move waits for a reader that is itself blocked. Walk
            # along "waits for" until a move repeats: that move sits on a cycle, and stashing
            # the slots it overwrites breaks the cycle. Start from a move that reads a live
            # stash (finishing it frees memory), else from the first blocked move.
            frees = [j for k in stash_left for j in key_readers[k] if j not in scheduled and blocked[j] > 0]
            while blocked[first_waiting] == 0:  # blocked counts only decrease
                first_waiting += 1
            first = min(frees) if frees else first_waiting
            seen: set[int] = set()
            while first not in seen:
                seen.add(first)
                key = next(k for k in writer_keys[first] if readers_of.get(k, 0) > 0)
                first = next(j for j in key_readers[key] if j not in scheduled)
            m = moves[first]
            keys = [k for k in writer_keys[first] if readers_of.get(k, 0) > 0]
            extra: dict[int, int] = defaultdict(int)
            for k in keys:
                extra[k[0]] += m.nbytes
            if cur and any(stage[r] + stash_live[r] + v > budget for r, v in extra.items()):
                break  # no room for the stash in this round: next round
            for key in keys:
                r, layer, s, part = key
                stashes.append(Stash(len(rounds), r, layer, s, part, m.nbytes))
                new_stashes.append(len(stashes) - 1)
                stash_left[key] = readers_of[key]
                stash_live[r] += m.nbytes
                readers_of[key] = 0
            blocked[first] = 0
            heapq.heappush(ready, first)
        for r, v in stage.items():
            peak[r] = max(peak[r], v + stash_live[r])
        for r, v in stash_live.items():
            peak[r] = max(peak[r], v)
        rounds.append(Round(tuple(sorted(cur)), tuple(new_stashes)))
        for key in released:
            stash_live[key[0]] -= moves[writer_of[key]].nbytes
            del stash_left[key]
        for i in deferred:
            heapq.heappush(ready, i)
    return rounds, stashes, peak, num_ops


def _as_schedule(plan: RelocationPlan, old_p2l: np.ndarray, max_ops: int) -> Schedule:
    """The plan as a :class:`Schedule` (see :class:`RelocationPlan` for its conventions)."""
    tensors = plan.tensors
    width = 1 + max((len(x.slice_shape) for x in tensors), default=0)
    # Each rank's holding of each tensor: (first slot, slice box).
    held = [{r: (s0, box) for r, s0, _, box in x.holdings} for x in tensors]
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

    stashed: set[tuple] = set()  # (rank, layer, slot, part) stashed so far
    for k, rnd in enumerate(plan.rounds):
        a, b = 2 * k, 2 * k + 1
        for i in rnd.stashes:
            st = plan.stashes[i]
            stashed.add((st.rank, st.layer, st.slot, st.part))
            col = plan.columns[st.layer][st.rank][0]
            for part in plan.parts[(st.layer, col)][st.part]:
                pid = piece(part.tensor, int(old_p2l[st.layer, st.slot]), part.box, col)
                copies.append((view(st.rank, part.tensor, st.slot, part.box), pid, a))
        for i in rnd.moves:
            m = plan.moves[i]
            for part in plan.parts[(m.layer, m.column)][m.part]:
                pid = piece(part.tensor, m.expert, part.box, m.column)
                if m.read >= 0:
                    reads.append((m.read, pid, a))
                for r, s in m.copies:
                    if (r, m.layer, s, m.part) not in stashed:  # a stash is already this piece's buffer
                        copies.append((view(r, part.tensor, s, part.box), pid, a))
                for src, s, dst in m.sends:
                    from_view = s >= 0 and (src, m.layer, s, m.part) not in stashed
                    sends.append((src, dst, pid, a, view(src, part.tensor, s, part.box) if from_view else -1))
                for src, dst in m.relays:
                    sends.append((src, dst, pid, b, -1))
                for r, slots in m.writes:
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
    )


def _fingerprint(plan: RelocationPlan) -> str:
    h = hashlib.sha256()
    h.update(repr((plan.topology.world_size, plan.topology.local_world_size, plan.staging_bytes)).encode())
    if plan.topology.nodes is not None:  # uneven nodes (a process group of some ranks)
        h.update(repr(plan.topology.nodes).encode())
    h.update(repr(plan.tensors).encode())
    h.update(repr(plan.moves).encode())
    h.update(repr(plan.stashes).encode())
    h.update(repr(plan.rounds).encode())
    return h.hexdigest()[:16]
