"""The planner: needs + sources -> :class:`TransferPlan` (pure, deterministic, any world size).

A *piece* is one box of one checkpoint tensor that at least one rank needs. Every piece is
read from storage by exactly one rank per *read scope* ("job": once in the whole job;
"node": once per node that needs it) and then delivered:

* to needers on the reader's node directly (phase A);
* to each other node that needs it: once across nodes, to one needer there (phase A), which
  relays it to the rest of its node (phase B).

Where every rank of a node needs a piece (and the node has >= 3 ranks) the in-node fan-out is
one node-group broadcast instead of P2P sends. Pieces needed only by the rank that reads
them are *local reads*: straight from storage into the destination, never staged.

Transfers are packed into *chunks*: in each chunk every rank stages at most
``staging_bytes`` (pieces it reads for others, pieces it receives) and posts at most
``max_ops`` P2P ops per phase, so memory stays bounded and NCCL batches stay small. Pieces
larger than a quarter of the budget are split along their first dim.
"""

from __future__ import annotations

import functools
import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from ._gc import paused_gc
from .box import Box, box_numel, split_box
from .checkpoint import CheckpointIndex
from .layout import Need
from .topology import Topology

__all__ = ["Piece", "Send", "Broadcast", "Phase", "Chunk", "PlanCost", "TransferPlan", "plan_transfers", "minimal_cost"]

Scope = Literal["job", "node"]
DEFAULT_STAGING_BYTES = 256 * 2**20
DEFAULT_MAX_OPS = 64


@dataclass(frozen=True)
class Piece:
    """Box ``src`` of checkpoint tensor ``key`` (``nbytes`` in the checkpoint's dtype) and
    the needs it satisfies (indices into the plan's needs), per receiving rank."""

    key: str
    src: Box
    nbytes: int
    needs: tuple[tuple[int, tuple[int, ...]], ...]  # ((rank, (need index, ...)), ...)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.needs)


@dataclass(frozen=True)
class Send:
    src: int
    dst: int
    piece: int


@dataclass(frozen=True)
class Broadcast:
    """``root`` broadcasts ``piece`` to every rank of ``node`` (over the node's group)."""

    node: int
    root: int
    piece: int


@dataclass(frozen=True)
class Phase:
    sends: tuple[Send, ...] = ()
    broadcasts: tuple[Broadcast, ...] = ()


@dataclass(frozen=True)
class Chunk:
    """Pieces read for others (``reads``: (reader, piece)), then phase A, then phase B.

    A phase in which some rank would post more than ``max_ops`` P2P ops (one piece fanned
    out to many nodes) is split into consecutive phases, so ``phases`` holds at least two.
    """

    reads: tuple[tuple[int, int], ...]
    phases: tuple[Phase, ...]


@dataclass(frozen=True)
class PlanCost:
    """Cost counters of a plan (bytes are checkpoint-dtype bytes). Arrays are per rank."""

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
class TransferPlan:
    """Everything every rank does, in order. Identical on every rank."""

    topology: Topology
    needs: tuple[Need, ...]
    pieces: tuple[Piece, ...]
    local_reads: tuple[tuple[int, ...], ...]  # per rank: pieces it reads for itself only
    chunks: tuple[Chunk, ...]
    cost: PlanCost
    staging_bytes: int

    def piece_readers(self) -> list[int]:
        """The rank that reads each piece (a plan of scope "job" has one reader per piece)."""
        reader_of = [-1] * len(self.pieces)
        for r, pids in enumerate(self.local_reads):
            for pid in pids:
                reader_of[pid] = r
        for chunk in self.chunks:
            for r, pid in chunk.reads:
                reader_of[pid] = r
        return reader_of

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of everything the plan makes ranks do (ranks compare it before data moves).
        Computed on first use: ``moeshard plan`` never needs it, and it costs ~10% of planning."""
        return _fingerprint(self)


def plan_transfers(
    needs: Sequence[Need],
    index: CheckpointIndex,
    topology: Topology,
    readers: Sequence[bool] | np.ndarray,
    scope: Scope = "job",
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    max_ops: int = DEFAULT_MAX_OPS,
) -> TransferPlan:
    """Plan reads and transfers so every need is met exactly once (pure).

    Args:
        needs: every rank's needs (:func:`~moeshard.layout.compute_needs`).
        index: checkpoint headers (dtypes and file offsets of the keys).
        topology: world size and ranks per node.
        readers: ``bool[world_size]``: which ranks can read the checkpoint.
        scope: "job" reads each piece once in the job; "node" once per node needing it.
        staging_bytes: per-rank staging budget for pieces in flight.
        max_ops: at most this many P2P ops per rank in one batch.

    Raises:
        ValueError: no rank can read (or, for scope "node", a node that needs data has no
            reader), or the budget is too small for a single element.
    """
    with paused_gc():
        return _plan_transfers(needs, index, topology, readers, scope, staging_bytes, max_ops)


def _plan_transfers(needs, index, topology, readers, scope, staging_bytes, max_ops) -> TransferPlan:
    world, lws = topology.world_size, topology.local_world_size
    readers = np.asarray(readers, dtype=bool)
    if readers.shape != (world,):
        raise ValueError(f"readers must be bool[{world}], got shape {readers.shape}")
    if not readers.any():
        raise ValueError("no rank can read the checkpoint")
    if staging_bytes < 1 or max_ops < 2:
        raise ValueError(f"staging_bytes must be >= 1 and max_ops >= 2, got {staging_bytes}, {max_ops}")
    max_piece = max(1, staging_bytes // 4)

    # 1. Pieces: unique (key, box), split to fit the budget, in file order for sequential reads.
    grouped: dict[tuple[str, Box], list[int]] = {}
    for i, n in enumerate(needs):
        k = (n.key, n.src)
        idx = grouped.get(k)
        if idx is None:
            grouped[k] = [i]
        else:
            idx.append(i)
    infos = {key: index.info(key) for key in {key for key, _ in grouped}}

    def file_order(item):
        (key, src), _ = item
        info = infos[key]
        return (info.file, info.offset, src)

    pieces: list[Piece] = []
    for (key, src), idx in sorted(grouped.items(), key=file_order):
        info = infos[key]
        itemsize = info.itemsize
        if itemsize > staging_bytes:
            raise ValueError(f"staging budget of {staging_bytes} bytes cannot hold one element of {key!r}")
        per_rank: dict[int, list[int]] = {}
        for i in idx:
            r = needs[i].rank
            v = per_rank.get(r)
            if v is None:
                per_rank[r] = [i]
            else:
                v.append(i)
        piece_needs = tuple((r, tuple(per_rank[r])) for r in sorted(per_rank))
        subs = split_box(src, max(1, max_piece // itemsize))
        for sub in subs:
            pieces.append(Piece(key, sub, box_numel(sub) * itemsize, piece_needs))
    pieces, needs_out = _split_needs(pieces, needs)

    # Pure-Python bookkeeping: most pieces have a handful of needers, where numpy's per-call
    # overhead would dominate. Ties go to the lowest rank, as np.argmin would.
    read_load = [0] * world
    recv_load = [0] * world
    local_reads: list[list[int]] = [[] for _ in range(world)]
    trees: list[tuple[int, list[int], list[tuple[int, int]], list[tuple[int, int]], list[Broadcast], list[Broadcast]]] = []
    can_read = readers.tolist()
    reader_idx = [r for r in range(world) if can_read[r]]
    whole_nodes = lws >= 3
    load_of = read_load.__getitem__

    def by_node(ranks: Sequence[int]) -> list[tuple[int, list[int]]]:
        """``ranks`` (ascending) grouped by node, nodes ascending."""
        out: list[tuple[int, list[int]]] = []
        last = -1
        for r in ranks:
            n = r // lws
            if n != last:
                out.append((n, [r]))
                last = n
            else:
                out[-1][1].append(r)
        return out

    for pid, piece in enumerate(pieces):
        nbytes = piece.nbytes
        ranks = [r for r, _ in piece.needs]  # ascending
        groups = [ranks] if scope == "job" else [g for _, g in by_node(ranks)]
        for grp in groups:
            cands = [r for r in grp if can_read[r]]
            if cands:
                reader = min(cands, key=load_of)
            else:
                first_node = grp[0] // lws
                pool = reader_idx if scope == "job" else [r for r in reader_idx if r // lws == first_node]
                if not pool:
                    raise ValueError(
                        f"storage scope 'node': node {first_node} needs {piece.key!r} but none of its "
                        "ranks can read the checkpoint"
                    )
                grp_nodes = {r // lws for r in grp}
                near = [r for r in pool if r // lws in grp_nodes]
                reader = min(near or pool, key=load_of)
            read_load[reader] += nbytes
            if len(grp) == 1 and grp[0] == reader:
                local_reads[reader].append(pid)
                continue
            phase_a: list[tuple[int, int]] = []
            phase_b: list[tuple[int, int]] = []
            bc_a: list[Broadcast] = []
            bc_b: list[Broadcast] = []
            reader_node = reader // lws
            for n, on_node in by_node(grp):
                if n == reader_node:
                    holder = reader
                else:
                    holder = min(on_node, key=lambda r: (recv_load[r], r))
                    phase_a.append((reader, holder))
                    recv_load[holder] += nbytes
                rest = [r for r in on_node if r != holder]
                if not rest:
                    continue
                bc_list, p2p = (bc_a, phase_a) if holder == reader else (bc_b, phase_b)
                if whole_nodes and len(on_node) == lws:
                    bc_list.append(Broadcast(n, holder, pid))
                else:
                    p2p.extend((holder, r) for r in rest)
                for r in rest:
                    recv_load[r] += nbytes
            trees.append((pid, [reader], phase_a, phase_b, bc_a, bc_b))

    # 2. Chunks within the staging budget and op limit.
    chunks, cost = _pack(pieces, trees, topology, staging_bytes, max_ops)
    cost.read_bytes[:] = np.asarray(read_load, dtype=np.int64)
    plan = TransferPlan(
        topology=topology.with_rank(0),
        needs=tuple(needs_out),
        pieces=tuple(pieces),
        local_reads=tuple(tuple(v) for v in local_reads),
        chunks=tuple(chunks),
        cost=cost,
        staging_bytes=staging_bytes,
    )
    return plan


def _split_needs(pieces: list[Piece], needs: Sequence[Need]) -> tuple[list[Piece], list[Need]]:
    """Renumber needs piece by piece; a sub-piece's needs get dest boxes covering just it."""
    out_pieces: list[Piece] = []
    out_needs: list[Need] = []
    for p in pieces:
        new_needs = []
        for rank, idx in p.needs:
            new_idx = []
            for i in idx:
                n = needs[i]
                if n.src != p.src:
                    # Source dims map to the trailing dest dims (an expert slot adds a leading 1).
                    delta = len(n.dest) - len(n.src)
                    dest = list(n.dest)
                    for d, ((so, _), (po, pl)) in enumerate(zip(n.src, p.src)):
                        dest[d + delta] = (n.dest[d + delta][0] + po - so, pl)
                    n = Need(n.rank, n.param, tuple(dest), n.key, p.src)
                out_needs.append(n)
                new_idx.append(len(out_needs) - 1)
            new_needs.append((rank, tuple(new_idx)))
        out_pieces.append(Piece(p.key, p.src, p.nbytes, tuple(new_needs)))
    return out_pieces, out_needs


def _pack(pieces, trees, topology: Topology, budget: int, max_ops: int) -> tuple[list[Chunk], PlanCost]:
    world = topology.world_size
    node = topology.nodes_array()
    sent = np.zeros(world, dtype=np.int64)
    recv = np.zeros(world, dtype=np.int64)
    peak = np.zeros(world, dtype=np.int64)
    cross = 0
    num_ops = num_batches = num_bc = 0
    chunks: list[Chunk] = []
    cur: list = []
    stage: dict[int, int] = defaultdict(int)
    ops_a: dict[int, int] = defaultdict(int)
    ops_b: dict[int, int] = defaultdict(int)

    def flush():
        nonlocal num_batches
        if not cur:
            return
        reads = tuple((readers[0], pid) for pid, readers, *_ in cur)
        pa = _split_phase([Send(s, d, pid) for pid, _, a, *_ in cur for s, d in a], [b for *_, ba, _ in cur for b in ba], max_ops)
        pb = _split_phase([Send(s, d, pid) for pid, _, _, b, *_ in cur for s, d in b], [b for *_, bb in cur for b in bb], max_ops)
        num_batches += sum(bool(ph.sends) for ph in pa + pb)
        chunks.append(Chunk(reads, tuple(pa + pb)))
        for r, v in stage.items():
            peak[r] = max(peak[r], v)
        cur.clear()
        stage.clear()
        ops_a.clear()
        ops_b.clear()

    for tree in trees:
        pid, (reader,), a, b, bca, bcb = tree
        nbytes = pieces[pid].nbytes
        add_stage: dict[int, int] = defaultdict(int)
        add_a: dict[int, int] = defaultdict(int)
        add_b: dict[int, int] = defaultdict(int)
        add_stage[reader] += nbytes
        for s, d in a:
            add_stage[d] += nbytes
            add_a[s] += 1
            add_a[d] += 1
        for s, d in b:
            add_stage[d] += nbytes
            add_b[s] += 1
            add_b[d] += 1
        for bc in bca + bcb:
            for r in topology.node_ranks(bc.node):
                if r != bc.root:
                    add_stage[r] += nbytes
        fits = all(stage[r] + v <= budget for r, v in add_stage.items()) and all(
            ops_a[r] + v <= max_ops for r, v in add_a.items()
        ) and all(ops_b[r] + v <= max_ops for r, v in add_b.items())
        if not fits:
            flush()
        cur.append(tree)
        for r, v in add_stage.items():
            stage[r] += v
        for r, v in add_a.items():
            ops_a[r] += v
        for r, v in add_b.items():
            ops_b[r] += v
        for s, d in a + b:
            sent[s] += nbytes
            recv[d] += nbytes
            num_ops += 1
            if node[s] != node[d]:
                cross += nbytes
        for bc in bca + bcb:
            num_bc += 1
            k = topology.local_world_size - 1
            sent[bc.root] += k * nbytes
            for r in topology.node_ranks(bc.node):
                if r != bc.root:
                    recv[r] += nbytes
    flush()
    cost = PlanCost(
        read_bytes=np.zeros(world, dtype=np.int64),
        sent_bytes=sent,
        recv_bytes=recv,
        peak_staging_bytes=peak,
        cross_node_bytes=cross,
        num_p2p_ops=num_ops,
        num_batches=num_batches,
        num_broadcasts=num_bc,
    )
    return chunks, cost


def _split_phase(sends: list[Send], broadcasts: list[Broadcast], max_ops: int) -> list[Phase]:
    """One phase, or several in a row where a rank would post more than ``max_ops`` ops
    (a single piece's fan-out can exceed the limit on its own). Broadcasts go last."""
    phases: list[Phase] = []
    cur: list[Send] = []
    ops: dict[int, int] = defaultdict(int)
    for s in sends:
        if cur and (ops[s.src] >= max_ops or ops[s.dst] >= max_ops):
            phases.append(Phase(tuple(cur)))
            cur, ops = [], defaultdict(int)
        cur.append(s)
        ops[s.src] += 1
        ops[s.dst] += 1
    phases.append(Phase(tuple(cur), tuple(broadcasts)))
    return phases


def _fingerprint(plan: TransferPlan) -> str:
    """A digest of everything the plan makes ranks do. Built from plain tuples, whose repr
    is computed in C (the dataclasses' and NamedTuples' generated reprs are Python code)."""
    h = hashlib.sha256()
    h.update(repr((plan.topology.world_size, plan.topology.local_world_size, plan.staging_bytes)).encode())
    h.update(repr([tuple(n) for n in plan.needs]).encode())
    h.update(repr([(p.key, p.src, p.needs) for p in plan.pieces]).encode())
    h.update(repr(plan.local_reads).encode())
    h.update(repr([
        (c.reads, [([(s.src, s.dst, s.piece) for s in ph.sends], [(b.node, b.root, b.piece) for b in ph.broadcasts])
                   for ph in c.phases])
        for c in plan.chunks
    ]).encode())
    return h.hexdigest()[:16]


def minimal_cost(needs: Sequence[Need], index: CheckpointIndex, topology: Topology, readers, scope: Scope = "job") -> dict:
    """Lower bounds for any plan of these needs (pure): storage bytes (each needed byte once
    per scope), network bytes (every needer that cannot read it itself... or that is not the
    one reader) and bytes crossing nodes.

    Vectorized: needs are grouped by (key, src box) once in Python, the per-piece counting is
    numpy over (piece, rank) and (piece, node) pairs.
    """
    readers = np.asarray(readers, dtype=bool)
    world = topology.world_size
    if readers.shape != (world,):
        raise ValueError(f"readers must be bool[{world}], got shape {readers.shape}")
    if scope not in ("job", "node"):
        raise ValueError(f"scope must be 'job' or 'node', got {scope!r}")
    lws = topology.local_world_size
    num_nodes = topology.num_nodes
    piece_of: dict[tuple[str, Box], int] = {}
    piece_ids = np.empty(len(needs), dtype=np.int64)
    ranks = np.empty(len(needs), dtype=np.int64)
    sizes: list[int] = []
    itemsize: dict[str, int] = {}
    for i, n in enumerate(needs):
        k = (n.key, n.src)
        pid = piece_of.get(k)
        if pid is None:
            pid = piece_of[k] = len(sizes)
            item = itemsize.get(n.key)
            if item is None:
                item = itemsize[n.key] = index.info(n.key).itemsize
            sizes.append(box_numel(n.src) * item)
        piece_ids[i] = pid
        ranks[i] = n.rank
    if not sizes:
        return {"read_bytes": 0, "network_bytes": 0, "cross_node_bytes": 0}
    nbytes = np.asarray(sizes, dtype=np.int64)
    num_pieces = len(sizes)
    # Distinct (piece, rank) pairs: a rank needing several boxes of one piece counts once.
    pairs = np.unique(piece_ids * world + ranks)
    p_pid, p_rank = pairs // world, pairs % world
    p_node = p_rank // lws
    p_reader = readers[p_rank]
    if scope == "job":
        count = np.bincount(p_pid, minlength=num_pieces)
        has_reader = np.bincount(p_pid, weights=p_reader, minlength=num_pieces) > 0
        read = int(nbytes.sum())
        net = int(((count - has_reader) * nbytes).sum())
        # Distinct (piece, node) pairs; a piece needs no crossing into a node holding a reader.
        pn = np.unique(p_pid * num_nodes + p_node)
        pn_pid, pn_node = pn // num_nodes, pn % num_nodes
        node_has_reader = np.bincount(np.flatnonzero(readers) // lws, minlength=num_nodes) > 0
        num_nodes_of = np.bincount(pn_pid, minlength=num_pieces)
        reader_node_of = np.bincount(pn_pid, weights=node_has_reader[pn_node], minlength=num_pieces) > 0
        cross = int(((num_nodes_of - reader_node_of) * nbytes).sum())
    else:
        pn_key = p_pid * num_nodes + p_node
        pn, inverse, count = np.unique(pn_key, return_inverse=True, return_counts=True)
        has_reader = np.bincount(inverse, weights=p_reader, minlength=len(pn)) > 0
        pn_bytes = nbytes[pn // num_nodes]
        read = int(pn_bytes.sum())
        net = int(((count - has_reader) * pn_bytes).sum())
        cross = 0
    return {"read_bytes": read, "network_bytes": net, "cross_node_bytes": cross}
