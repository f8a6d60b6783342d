"""The reshard planner as it was before vectorizing (a Python loop per need row and cell): the
reference that tests/test_reshard_plan.py checks :func:`moeshard.plan.reshard.plan_reshard`
against (the same schedule arrays, storage cells and fingerprint on random cases)."""

from __future__ import annotations

import hashlib
import math

import numpy as np

from moeshard.plan.reshard import BoxRows, ReshardPlan, StorageCells, Units
from moeshard.plan.schedule import (
    CopyTable,
    DeliveryTable,
    PieceTable,
    PlanCost,
    ReadTable,
    Schedule,
    SendTable,
    ViewTable,
)
from moeshard.topology import Topology

__all__ = ["plan_reshard"]


def _cells(
    holds: list[np.ndarray], needs_off: np.ndarray, needs_len: np.ndarray, nd: int
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``[(need row, cell off, cell len)]``: each need box cut at every boundary of the unit's
    holdings and needs (``holds``: ``[off, len]`` arrays)."""
    cuts = []
    for d in range(nd):
        pts = [needs_off[:, d], needs_off[:, d] + needs_len[:, d]]
        pts += [h[:, d] for h in holds]
        cuts.append(np.unique(np.concatenate(pts)))
    out = []
    for i in range(len(needs_off)):
        axes = []
        for d in range(nd):
            a, b = int(needs_off[i, d]), int(needs_off[i, d] + needs_len[i, d])
            c = cuts[d]
            inner = c[(c > a) & (c < b)].tolist()
            bounds = [a, *inner, b]
            axes.append(list(zip(bounds[:-1], bounds[1:])))
        for combo in _product(axes):
            off = np.asarray([lo for lo, _ in combo], np.int64)
            ln = np.asarray([hi - lo for lo, hi in combo], np.int64)
            out.append((i, off, ln))
    return out


def _product(axes: list[list[tuple[int, int]]]):
    if not axes:
        yield ()
        return
    for head in axes[0]:
        for rest in _product(axes[1:]):
            yield (head, *rest)


def _split(off: np.ndarray, ln: np.ndarray, max_cell: int, itemsize: int):
    """The cell, cut along its first dim of length > 1 into runs of at most ``max_cell`` bytes
    (a run is at least one index: a larger index stays whole)."""
    nbytes = math.prod(ln.tolist()) * itemsize
    if nbytes <= max_cell:
        yield off, ln
        return
    dims = np.flatnonzero(ln > 1)
    if not len(dims):
        yield off, ln
        return
    d = int(dims[0])
    step = max(1, max_cell // (nbytes // int(ln[d])))
    for s in range(0, int(ln[d]), step):
        o, n = off.copy(), ln.copy()
        o[d] += s
        n[d] = min(step, int(ln[d]) - s)
        yield o, n


def plan_reshard(
    units: Units, holds: BoxRows, needs: BoxRows, topology: Topology, staging_bytes: int, max_ops: int
) -> ReshardPlan:
    """Plan a reshard (pure, deterministic; module docstring).

    Args:
        units: the units.
        holds: the live ranks' holdings (``param`` indexes the old tensors).
        needs: the new local tensors' needs (``param`` indexes the new tensors); ranks and
            nodes are ``topology``'s.
        staging_bytes: per-rank budget for received pieces in one round (a cell is cut to fit;
            one index of a dim larger than the budget is sent whole, alone in its round).
        max_ops: at most this many P2P ops per rank in one round.

    Raises ValueError for budgets below 1 byte or 2 ops.
    """
    if staging_bytes < 1 or max_ops < 2:
        raise ValueError(f"staging_bytes must be >= 1 and max_ops >= 2, got {staging_bytes}, {max_ops}")
    width = needs.off.shape[1]
    world = topology.world_size
    node = np.asarray([topology.node_of(r) for r in range(world)], np.int64)
    h_by_unit = _group(holds.unit, len(units.keys))
    n_by_unit = _group(needs.unit, len(units.keys))

    pieces: list[tuple[int, np.ndarray, np.ndarray]] = []  # (unit, off, len)
    holders_of: dict[int, np.ndarray] = {}  # piece -> rows of holds that hold it
    piece_of: dict[tuple, int] = {}
    # (piece, rank) -> rows of needs with the local offset of the piece
    dlv: dict[tuple[int, int], list[tuple[int, int, np.ndarray]]] = {}
    storage = []
    for u in range(len(units.keys)):
        nrows = n_by_unit[u]
        if not len(nrows):
            continue
        nd = int(units.ndim[u])
        hrows = h_by_unit[u]
        h_off, h_len = holds.off[hrows, :nd], holds.len[hrows, :nd]
        cells = _cells([h_off, h_off + h_len], needs.off[nrows, :nd], needs.len[nrows, :nd], nd)
        for i, cell_off, cell_len in cells:
            row = int(nrows[i])
            rank = int(needs.rank[row])
            inside = (
                np.all((h_off <= cell_off) & (cell_off + cell_len <= h_off + h_len), axis=1)
                if len(hrows)
                else np.zeros(0, bool)
            )
            if not inside.any():
                dst = needs.local[row, :nd] + cell_off - needs.off[row, :nd]
                storage.append((u, rank, int(needs.param[row]), int(needs.slot[row]), cell_off, cell_len, dst))
                continue
            # A cell that travels is cut to the staging budget (storage cells are the load planner's).
            for off, ln in _split(cell_off, cell_len, max(1, staging_bytes), int(units.itemsize[u])):
                dst = needs.local[row, :nd] + off - needs.off[row, :nd]
                key = (u, off.tobytes(), ln.tobytes())
                pid = piece_of.get(key)
                if pid is None:
                    pid = piece_of[key] = len(pieces)
                    pieces.append((u, off, ln))
                    holders_of[pid] = hrows[inside]  # those holding the cell hold each of its pieces
                dlv.setdefault((pid, rank), []).append((int(needs.param[row]), int(needs.slot[row]), dst))

    # Sources, per (piece, rank) in a fixed order: the rank's own copy, else the least-loaded
    # holder on its node, else anywhere.
    sent = np.zeros(world, np.int64)
    views: list[tuple[int, int, int, np.ndarray]] = []  # (rank, param, slot, local off)
    view_of: dict[tuple[int, int], int] = {}
    copies: list[tuple[int, int]] = []  # (view, piece)
    sends: list[tuple[int, int, int, int]] = []  # (src, dst, piece, view)
    pbytes = np.asarray([int(np.prod(ln)) * int(units.itemsize[u]) for u, _, ln in pieces], np.int64)
    for pid, rank in sorted(dlv):
        u, off, _ = pieces[pid]
        hs = holders_of[pid]
        ranks = holds.rank[hs]
        own = hs[ranks == rank]
        if len(own):
            copies.append((_view(views, view_of, holds, int(own[0]), off, pid), pid))
            continue
        near = hs[node[ranks] == node[rank]]
        pool = near if len(near) else hs
        load = sent[holds.rank[pool]]
        pick = int(pool[np.lexsort((holds.rank[pool], load))[0]])
        src = int(holds.rank[pick])
        sent[src] += pbytes[pid]
        sends.append((src, rank, pid, _view(views, view_of, holds, pick, off, pid)))

    send_round = _rounds(sends, pbytes, world, staging_bytes, max_ops)
    sched = _schedule(
        units, pieces, pbytes, width, views, copies, sends, send_round, dlv, topology, staging_bytes, max_ops, node
    )
    st = _storage(storage, width)
    boxes = sorted({(units.keys[u], tuple(zip(off.tolist(), ln.tolist()))) for u, _, _, _, off, ln, _ in storage})
    dense = sorted({units.keys[u] for u, *_ in storage if units.dense[u]})
    by_key = {k: u for u, k in enumerate(units.keys)}
    store_bytes = sum(int(np.prod([n for _, n in box])) * int(units.itemsize[by_key[k]]) for k, box in boxes)
    copy_bytes = int(sum(pbytes[p] for _, p in copies))
    h = hashlib.sha256(sched.fingerprint.encode())
    for a in (st.unit, st.rank, st.param, st.slot, st.off, st.len, st.dst):
        h.update(np.ascontiguousarray(a).tobytes())
    return ReshardPlan(
        sched,
        st,
        tuple(boxes),
        tuple(dense),
        int(sched.cost.sent_bytes.sum()),
        copy_bytes,
        store_bytes,
        h.hexdigest()[:16],
    )


def _group(values: np.ndarray, n: int) -> list[np.ndarray]:
    order = np.argsort(values, kind="stable")
    bounds = np.searchsorted(values[order], np.arange(n + 1))
    return [order[bounds[i] : bounds[i + 1]] for i in range(n)]


def _view(views: list, view_of: dict, holds: BoxRows, row: int, off: np.ndarray, pid: int) -> int:
    key = (row, pid)
    v = view_of.get(key)
    if v is None:
        nd = len(off)
        local = holds.local[row, :nd] + off - holds.off[row, :nd]
        v = view_of[key] = len(views)
        views.append((int(holds.rank[row]), int(holds.param[row]), int(holds.slot[row]), local))
    return v


def _rounds(sends: list, pbytes: np.ndarray, world: int, staging_bytes: int, max_ops: int) -> np.ndarray:
    """The first round for each send whose budgets allow it: at most ``max_ops`` ops per rank and
    ``staging_bytes`` received per rank (a piece larger than the budget alone)."""
    ops: list[np.ndarray] = []
    staged: list[np.ndarray] = []
    out = np.zeros(len(sends), np.int64)
    first = np.zeros(world, np.int64)  # per receiver: rounds before it are full (a hint, monotone)
    for i, (src, dst, pid, _) in enumerate(sends):
        b = int(pbytes[pid])
        t = int(first[dst])
        while True:
            if t == len(ops):
                ops.append(np.zeros(world, np.int64))
                staged.append(np.zeros(world, np.int64))
            fits = staged[t][dst] == 0 or staged[t][dst] + b <= staging_bytes
            if ops[t][src] < max_ops and ops[t][dst] < max_ops and fits:
                break
            t += 1
        ops[t][src] += 1
        ops[t][dst] += 1
        staged[t][dst] += b
        out[i] = t
        if staged[t][dst] >= staging_bytes or ops[t][dst] >= max_ops:
            first[dst] = max(first[dst], t + 1)
    return out


def _schedule(
    units: Units,
    pieces: list,
    pbytes: np.ndarray,
    width: int,
    views: list,
    copies: list,
    sends: list,
    send_round: np.ndarray,
    dlv: dict,
    topology: Topology,
    staging_bytes: int,
    max_ops: int,
    node: np.ndarray,
) -> Schedule:
    world = topology.world_size
    i32, i64 = np.int32, np.int64

    def pad(a) -> np.ndarray:
        out = np.zeros(width, i64)
        out[: len(a)] = a
        return out

    num = len(pieces)
    piece_off = np.stack([pad(o) for _, o, _ in pieces]) if num else np.zeros((0, width), i64)
    piece_len = np.stack([pad(n) for _, _, n in pieces]) if num else np.zeros((0, width), i64)
    rows = [(pid, rank, p, s, d) for (pid, rank), items in sorted(dlv.items()) for p, s, d in items]
    src = np.asarray([s for s, _, _, _ in sends], i32)
    dst = np.asarray([d for _, d, _, _ in sends], i32)
    spiece = np.asarray([p for _, _, p, _ in sends], i32)
    sb = pbytes[spiece] if len(sends) else np.zeros(0, i64)
    sent, recv = np.zeros(world, i64), np.zeros(world, i64)
    np.add.at(sent, src, sb)
    np.add.at(recv, dst, sb)
    num_rounds = int(send_round.max()) + 1 if len(sends) else 0
    peak = np.zeros(world, i64)
    for t in range(num_rounds):
        per = np.zeros(world, i64)
        m = send_round == t
        np.add.at(per, dst[m], sb[m])
        peak = np.maximum(peak, per)
    cross = int(sb[node[src] != node[dst]].sum()) if len(sends) else 0
    cost = PlanCost(
        read_bytes=np.zeros(world, i64),
        sent_bytes=sent,
        recv_bytes=recv,
        peak_staging_bytes=peak,
        cross_node_bytes=cross,
        num_p2p_ops=len(sends),
        num_batches=int(
            sum(len(np.unique(np.concatenate([src[send_round == t], dst[send_round == t]]))) for t in range(num_rounds))
        ),
        num_broadcasts=0,
    )
    return Schedule(
        topology=topology,
        staging_bytes=staging_bytes,
        max_ops=max_ops,
        keys=units.keys,
        key_ndim=units.ndim.astype(np.int8),
        pieces=PieceTable(
            key=np.asarray([u for u, _, _ in pieces], i32), off=piece_off, len=piece_len, bytes=pbytes.astype(i64)
        ),
        reads=ReadTable(),
        sends=SendTable(
            src=src,
            dst=dst,
            piece=spiece,
            round=send_round.astype(i64),
            view=np.asarray([v for _, _, _, v in sends], i32),
        ),
        deliveries=DeliveryTable(
            piece=np.asarray([r[0] for r in rows], i32),
            rank=np.asarray([r[1] for r in rows], i32),
            param=np.asarray([r[2] for r in rows], i32),
            slot=np.asarray([r[3] for r in rows], i64),
            off=np.stack([pad(r[4]) for r in rows]) if rows else np.zeros((0, width), i64),
        ),
        num_rounds=num_rounds,
        cost=cost,
        views=ViewTable(
            rank=np.asarray([v[0] for v in views], i32),
            param=np.asarray([v[1] for v in views], i32),
            slot=np.asarray([v[2] for v in views], i64),
            off=np.stack([pad(v[3]) for v in views]) if views else np.zeros((0, width), i64),
        ),
        copies=CopyTable(
            view=np.asarray([v for v, _ in copies], i32),
            piece=np.asarray([p for _, p in copies], i32),
            round=np.full(len(copies), -1, i64),
        ),
    )


def _storage(rows: list, width: int) -> StorageCells:
    def col(j):
        return np.asarray([r[j] for r in rows], np.int64)

    def box(j):
        out = np.zeros((len(rows), width), np.int64)
        for i, r in enumerate(rows):
            out[i, : len(r[j])] = r[j]
        return out

    return StorageCells(col(0), col(1), col(2), col(3), box(4), box(5), box(6))
