"""Per-rank transfer planning: the transfers one rank takes part in, from declarative holdings
and needs, without the rest of the job's plan.

The holdings (rows over *units*, as :class:`~moeshard.plan.reshard.BoxRows`) of a unit are
boxes that are equal or disjoint (a DTensor's shards, replicated or not); the ranks that hold one
box alike form its *class*. A need row of receiver ``R`` is cut at the classes of its unit (its
intersection with each), and each intersection gets its source from the class and ``R`` alone:

* ``R`` itself, when it holds the class (a copy from its own tensor);
* else one of the class's holders on ``R``'s node if any, else any holder: the holder at
  ``(R + unit) mod n`` among those ``n`` (holders in rank order), which spreads the receivers of
  a replicated box over its holders.

So both ends of a transfer derive it alone: the receiver from its own needs and the classes of
the units it needs; the sender from the classes it holds and the other receivers' needs of
those units. A transfer is cut to the staging budget along its first dim longer than one, the
same way on both ends; the transfers of a sender-receiver pair are ordered by unit and box, and
the ``k``-th chunk of ``q`` of them goes in round ``k * B' + (δ - 1) // B`` (``δ = (receiver -
sender) mod world``, ``B`` peers per round block, ``B'`` blocks): per round a rank sends to at
most ``B`` ranks and receives from at most ``B``, at most ``q`` pieces each, so it posts at most
``max_ops`` ops and receives at most ``staging_bytes``.

Pure and torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..topology import Topology
from .arrays import dense_rank, lex_order, row_prod, run_starts
from .reshard import BoxRows
from .schedule import CopyTable, DeliveryTable, PieceTable, PlanCost, ReadTable, Schedule, SendTable, ViewTable

__all__ = ["PairRounds", "Transfers", "RankPart", "plan_transfers_of", "pair_rounds", "rank_schedule"]

_I64 = np.int64


@dataclass(frozen=True)
class PairRounds:
    """The round rule of a world (:func:`pair_rounds`): ``peers`` ranks per round block,
    ``blocks`` blocks, ``per_pair`` pieces of one pair per round, ``piece_bytes`` the most bytes
    a piece carries (a larger index of a dim travels whole, alone in its round)."""

    world: int
    peers: int
    blocks: int
    per_pair: int
    piece_bytes: int

    def rounds(self, src: np.ndarray, dst: np.ndarray, k: np.ndarray) -> np.ndarray:
        """``int64[S]``: the round of the ``k[i]``-th piece of pair ``(src[i], dst[i])``."""
        delta = (dst - src) % self.world
        return (k // self.per_pair) * self.blocks + (delta - 1) // self.peers


def pair_rounds(world: int, staging_bytes: int, max_ops: int) -> PairRounds:
    """The round rule for ``world`` ranks and the budgets (``staging_bytes`` >= 1, ``max_ops`` >= 2)."""
    peers = max(1, min(world - 1, max_ops // 2))
    per_pair = max(1, max_ops // (2 * peers))
    blocks = -(-max(world - 1, 1) // peers)
    return PairRounds(world, peers, blocks, per_pair, max(1, staging_bytes // (peers * per_pair)))


@dataclass(frozen=True)
class Transfers:
    """One rank's transfers (``M`` rows, ``D`` padded dims): box ``(off, len)`` of unit ``unit``
    goes from rank ``src`` to rank ``dst`` (``src == dst``: a copy within the rank) for need row
    ``need``, out of holding row ``hold`` (the source's; indices into the tables planned from);
    ``piece``: its box's number among the distinct (unit, box) of the rows, in an order every
    rank derives alike from the boxes.
    ``uncovered``: this rank's need rows whose boxes its unit's holdings do not cover exactly
    (``over``: covered more than once: holdings that overlap without being equal)."""

    src: np.ndarray
    dst: np.ndarray
    unit: np.ndarray
    need: np.ndarray
    hold: np.ndarray
    off: np.ndarray
    len: np.ndarray
    piece: np.ndarray
    uncovered: np.ndarray
    over: np.ndarray


def _ranges(start: np.ndarray, count: np.ndarray) -> np.ndarray:
    return np.repeat(start - (np.cumsum(count) - count), count) + np.arange(int(count.sum()), dtype=_I64)


def plan_transfers_of(
    rank: int,
    holds: BoxRows,
    needs: BoxRows,
    shape: np.ndarray,
    itemsize: np.ndarray,
    node: np.ndarray,
    rule: PairRounds,
) -> Transfers:
    """The transfers rank ``rank`` sends, receives or copies (pure; module docstring).

    Args:
        holds: holdings of the units the rank needs or holds (every holder's rows of them; more
            rows are ignored).
        needs: the rank's own need rows and the other receivers' need rows of the units it
            holds (more rows are ignored).
        shape: ``int64[U, D]`` each unit's shape (1 past its dims).
        itemsize: ``int64[U]`` bytes per element of each unit as it travels.
        node: ``int64[world]`` the node of each rank.
        rule: the round rule (its ``piece_bytes`` cuts the transfers between ranks).
    """
    num_u = len(itemsize)
    world = len(node)
    mine_n = needs.rank == rank
    need_u = np.zeros(num_u, bool)
    need_u[needs.unit[mine_n]] = True
    hold_u = np.zeros(num_u, bool)
    hold_u[holds.unit[holds.rank == rank]] = True
    hs = np.flatnonzero(need_u[holds.unit] | hold_u[holds.unit])
    h_unit, h_rank = holds.unit[hs], holds.rank[hs]
    h_off, h_len = holds.off[hs], holds.len[hs]
    # Classes: distinct (unit, box), numbered in that order (one key per box start: the unit's
    # first element in the whole model plus the start's flat index in the unit, unless two
    # boxes start alike and differ).
    cls, num_c = _classes(h_unit, h_off, h_len, shape)
    h_node = node[h_rank]
    # Holders in (class, node, rank) order, then by their tensor and slot: which row of a rank
    # holding a box twice is read does not depend on the rows' order.
    order = lex_order(cls, h_node, h_rank, holds.param[hs], holds.slot[hs])
    c_sorted, r_sorted = cls[order], h_rank[order]
    c_start = np.searchsorted(c_sorted, np.arange(num_c + 1))
    c_unit = h_unit[order][c_start[:-1]]
    c_off, c_len = h_off[order][c_start[:-1]], h_len[order][c_start[:-1]]
    num_nodes = int(node.max(initial=0)) + 1
    kk = (c_sorted * num_nodes + h_node[order]) * world + r_sorted
    u_start = np.searchsorted(c_unit, np.arange(num_u + 1))
    # Pairs (need row, class) to cut: this rank's rows with every class of their unit; the other
    # receivers' rows of the units this rank holds with the classes it holds.
    mine = np.flatnonzero(mine_n)
    cnt = u_start[needs.unit[mine] + 1] - u_start[needs.unit[mine]]
    pn = [np.repeat(mine, cnt)]
    pc = [_ranges(u_start[needs.unit[mine]], cnt)]
    my_cls = np.unique(cls[h_rank == rank])
    others = np.flatnonzero(~mine_n & hold_u[needs.unit])
    if len(my_cls) and len(others):
        mu = c_unit[my_cls]  # ascending with my_cls
        m_start = np.searchsorted(mu, np.arange(num_u + 1))
        ou = needs.unit[others]
        cnt = m_start[ou + 1] - m_start[ou]
        pn.append(np.repeat(others, cnt))
        pc.append(my_cls[_ranges(m_start[ou], cnt)])
    pn_a, pc_a = np.concatenate(pn), np.concatenate(pc)
    n_off, n_end = needs.off[pn_a], needs.off[pn_a] + needs.len[pn_a]
    lo = np.maximum(n_off, c_off[pc_a])
    hi = np.minimum(n_end, c_off[pc_a] + c_len[pc_a])
    keep = (hi > lo).all(axis=1)
    pn_a, pc_a, lo, ln = pn_a[keep], pc_a[keep], lo[keep], (hi - lo)[keep]
    # Exactness of this rank's own rows: the intersections tile each row once.
    got = np.zeros(len(needs.unit), _I64)
    own_rows = mine_n[pn_a]
    np.add.at(got, pn_a[own_rows], row_prod(ln[own_rows]))
    want = row_prod(needs.len[mine])
    uncovered = mine[got[mine] < want]
    over = mine[got[mine] > want]
    # The source of each (row, class): the receiver itself, else a holder picked from the class
    # and the receiver only.
    recv = needs.rank[pn_a]
    r_node = node[recv]
    base = (pc_a * num_nodes + r_node) * world
    pos = np.searchsorted(kk, base + recv)
    own = pos < len(kk)
    own[own] = kk[pos[own]] == (base + recv)[own]
    lo_n = np.searchsorted(kk, base)
    near = np.searchsorted(kk, base + world) - lo_n
    size = c_start[pc_a + 1] - c_start[pc_a]
    salt = recv + c_unit[pc_a]
    pick = np.where(near > 0, lo_n + salt % np.maximum(near, 1), c_start[pc_a] + salt % size)
    pick = np.where(own, pos, pick)
    src = r_sorted[pick]
    hold_row = hs[order[pick]]
    take = (src == rank) | (recv == rank)
    src, recv, pn_a, hold_row, lo, ln = src[take], recv[take], pn_a[take], hold_row[take], lo[take], ln[take]
    unit = needs.unit[pn_a]
    # Cut what travels between ranks to the piece budget (a copy stays whole).
    move = src != recv
    src, recv, pn_a, hold_row, unit, lo, ln = _cut(
        move, rule.piece_bytes, itemsize, src, recv, pn_a, hold_row, unit, lo, ln
    )
    piece = _box_ids(unit, lo, ln, shape)
    return Transfers(src, recv, unit, pn_a, hold_row, lo, ln, piece, uncovered, over)


def _classes(unit: np.ndarray, off: np.ndarray, ln: np.ndarray, shape: np.ndarray) -> tuple[np.ndarray, int]:
    """``(class of each row int64[n], number of classes)``: the distinct (unit, box) of the rows,
    numbered in (unit, box) order."""
    numel = row_prod(shape)
    if int(numel.sum()) >= 2**62:
        return dense_rank(unit, *off.T, *ln.T)
    stride = np.ones_like(shape)
    for d in range(shape.shape[1] - 2, -1, -1):
        stride[:, d] = stride[:, d + 1] * shape[:, d + 1]
    start = np.cumsum(numel) - numel
    key = start[unit] + (off * stride[unit]).sum(axis=1)
    uniq, cls = np.unique(key, return_inverse=True)
    cls = cls.reshape(-1).astype(_I64)
    first = np.zeros(len(uniq), _I64)
    first[cls[::-1]] = np.arange(len(cls) - 1, -1, -1)
    if not (ln == ln[first[cls]]).all():  # boxes that start alike but differ: by every column
        return dense_rank(unit, *off.T, *ln.T)
    return cls, len(uniq)


def _box_ids(unit: np.ndarray, off: np.ndarray, ln: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """``int64[n]``: each row's number among the distinct (unit, box) of the rows, ordered by
    (the box's first element in the whole model, its extent)."""
    numel = row_prod(shape)
    if not len(unit):
        return np.zeros(0, _I64)
    if int(numel.sum()) >= 2**62:
        return dense_rank(unit, *off.T, *ln.T)[0]
    stride = np.ones_like(shape)
    for d in range(shape.shape[1] - 2, -1, -1):
        stride[:, d] = stride[:, d + 1] * shape[:, d + 1]
    start = np.cumsum(numel) - numel
    st = stride[unit]
    return dense_rank(start[unit] + (off * st).sum(axis=1), (ln * st).sum(axis=1))[0]


def _cut(move, piece_bytes, itemsize, src, dst, need, hold, unit, off, ln):
    """The rows with ``move`` set cut to ``piece_bytes`` along their first dim longer than one
    (an index of it larger than the budget stays whole); rows in order, cut runs in order."""
    nbytes = row_prod(ln) * itemsize[unit]
    big = ln > 1
    d_cut = np.argmax(big, axis=1)
    idx = np.arange(len(unit))
    n_d = ln[idx, d_cut]
    cut = move & (nbytes > piece_bytes) & big.any(axis=1)
    step = np.where(cut, np.maximum(1, piece_bytes // np.maximum(1, nbytes // n_d)), n_d)
    n_runs = np.where(cut, -(-n_d // step), 1)
    if not cut.any():
        return src, dst, need, hold, unit, off, ln
    q = np.repeat(idx, n_runs)
    run = np.arange(len(q), dtype=_I64) - np.repeat(np.cumsum(n_runs) - n_runs, n_runs)
    d = d_cut[q]
    st = step[q]
    q_off, q_len = off[q].copy(), ln[q].copy()
    rr = np.arange(len(q))
    q_off[rr, d] = off[q, d] + run * st
    q_len[rr, d] = np.minimum(st, ln[q, d] - run * st)
    return src[q], dst[q], need[q], hold[q], unit[q], q_off, q_len


@dataclass(frozen=True, eq=False)
class RankPart:
    """One selection of a rank's transfers as the schedule it runs (:func:`rank_schedule`).

    Args:
        schedule: the rank's :class:`~moeshard.plan.schedule.Schedule` (``rank`` set: only the
            rows it takes part in; ``cost`` counts this rank only).
        sent_bytes, copy_bytes: bytes this rank sends to other ranks and copies within itself.
        check: this rank's term of the pair check: the sum (mod 2**64) of a hash of every
            transfer it sends minus that of every transfer it receives (round, place in its
            pair, unit, box). Summed over every rank it is 0 when each pair's two ends planned
            the same transfers.
        send_param: ``int64[S]`` per send row of the schedule, the receiver's engine tensor
            (``param`` of a need row it fills; -1 for a row this rank receives).
    """

    schedule: Schedule
    sent_bytes: int
    copy_bytes: int
    check: int
    send_param: np.ndarray


_MUL = np.uint64(0x9E3779B97F4A7C15)


def _hash(cols) -> np.ndarray:
    """``uint64[n]``: a hash of each row of the int64 columns ``cols``."""
    with np.errstate(over="ignore"):
        h = np.full(len(cols[0]), 0xCBF29CE484222325, np.uint64)
        for c in cols:
            h = (h ^ c.astype(np.uint64)) * _MUL
            h ^= h >> np.uint64(29)
        return h


def rank_schedule(
    tr: Transfers,
    sel: np.ndarray,
    rank: int,
    holds: BoxRows,
    needs: BoxRows,
    keys: tuple[str, ...],
    key_ndim: np.ndarray,
    itemsize: np.ndarray,
    topology: Topology,
    node: np.ndarray,
    rule: PairRounds,
    staging_bytes: int,
    max_ops: int,
    tag: int,
) -> RankPart:
    """The schedule of ``rank`` for the transfers ``sel`` (``bool[M]``) selects (pure).

    Pieces are the distinct (unit, box) of the rows; a box goes to a receiver once however
    many of its rows need it; the P2P rows of a pair are ordered by (unit, box), their rounds
    :meth:`PairRounds.rounds`. ``node``: ``int64[world]`` each rank's node; ``tag`` (the
    selection's number) enters the pair check."""
    world = topology.world_size
    i = np.flatnonzero(sel)
    src, dst, unit, need, hold = tr.src[i], tr.dst[i], tr.unit[i], tr.need[i], tr.hold[i]
    off, ln = tr.off[i], tr.len[i]
    width = off.shape[1]
    num_r = len(i)
    uniq, pid = np.unique(tr.piece[i], return_inverse=True)
    pid = pid.reshape(-1).astype(_I64)
    num_p = len(uniq)
    rep = np.zeros(num_p, _I64)
    rep[pid] = np.arange(num_r)
    p_unit = unit[rep]
    valid = np.arange(width)[None, :] < key_ndim[p_unit].astype(_I64)[:, None]
    p_off = np.where(valid, off[rep], 0)
    p_len = np.where(valid, ln[rep], 0)
    p_bytes = row_prod(ln[rep]) * itemsize[p_unit]
    r_valid = valid[pid]
    # Deliveries: every row this rank receives or copies, by piece.
    dl = np.flatnonzero(dst == rank)
    dl = dl[np.argsort(pid[dl], kind="stable")]
    d_off = np.where(r_valid[dl], needs.local[need[dl]] + off[dl] - needs.off[need[dl]], 0)
    # Views: the boxes this rank reads from its own tensors (copies and sends).
    vr = np.flatnonzero(src == rank)
    if len(vr):
        v_of, num_v = dense_rank(pid[vr], holds.param[hold[vr]], holds.slot[hold[vr]])
    else:
        v_of, num_v = np.zeros(0, _I64), 0
    v_rep = np.zeros(num_v, _I64)
    v_rep[v_of] = vr
    view_of = np.full(num_r, -1, _I64)
    view_of[vr] = v_of
    v_hold = hold[v_rep]
    v_off = np.where(r_valid[v_rep], holds.local[v_hold] + off[v_rep] - holds.off[v_hold], 0)
    cp = np.flatnonzero((src == rank) & (dst == rank))
    cp = cp[np.argsort(pid[cp], kind="stable")]
    cp = cp[run_starts(pid[cp])] if len(cp) else cp  # a copy per piece
    pp, k, rnd = _pair_order(src, dst, pid, rule)
    s_src, s_dst, s_pid = src[pp], dst[pp], pid[pp]
    outgoing = s_src == rank
    h = _hash([np.full(len(pp), tag, _I64), s_src, s_dst, rnd, k, unit[pp], *off[pp].T, *ln[pp].T])
    with np.errstate(over="ignore"):
        check = int(h[outgoing].sum(dtype=np.uint64) - h[~outgoing].sum(dtype=np.uint64))
    cost = _rank_cost(rank, world, node, s_dst, rnd, outgoing, p_bytes[s_pid])
    i32 = np.int32
    sched = Schedule(
        topology=topology,
        staging_bytes=staging_bytes,
        max_ops=max_ops,
        keys=keys,
        key_ndim=key_ndim.astype(np.int8),
        pieces=PieceTable(key=p_unit.astype(i32), off=p_off, len=p_len, bytes=p_bytes.astype(_I64)),
        reads=ReadTable(),
        sends=SendTable(
            src=s_src.astype(i32),
            dst=s_dst.astype(i32),
            piece=s_pid.astype(i32),
            round=rnd.astype(_I64),
            view=np.where(outgoing, view_of[pp], -1).astype(i32),
        ),
        deliveries=DeliveryTable(
            piece=pid[dl].astype(i32),
            rank=np.full(len(dl), rank, i32),
            param=needs.param[need[dl]].astype(i32),
            slot=needs.slot[need[dl]].astype(_I64),
            off=d_off.astype(_I64),
        ),
        num_rounds=int(rnd.max()) + 1 if len(rnd) else 0,
        cost=cost,
        views=ViewTable(
            rank=np.full(num_v, rank, i32),
            param=holds.param[v_hold].astype(i32),
            slot=holds.slot[v_hold].astype(_I64),
            off=v_off.astype(_I64),
        ),
        copies=CopyTable(view=view_of[cp].astype(i32), piece=pid[cp].astype(i32), round=np.full(len(cp), -1, _I64)),
        rank=rank,
    )
    copied = int(p_bytes[pid[cp]].sum())
    send_param = np.where(outgoing, needs.param[need[pp]], -1)
    return RankPart(sched, int(cost.sent_bytes[rank]), copied, check % 2**64, send_param)


def _pair_order(
    src: np.ndarray, dst: np.ndarray, pid: np.ndarray, rule: PairRounds
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The P2P rows (``src != dst``) of distinct (sender, receiver, piece), as ``(rows, place in
    their pair, round)``, ``int64[S]`` each, in the schedule's order (round, sender, receiver,
    place): within a pair by piece number, which follows (unit, box) on both ends."""
    pp = np.flatnonzero(src != dst)
    pp = pp[lex_order(src[pp], dst[pp], pid[pp])]
    if len(pp):
        pp = pp[run_starts(src[pp], dst[pp], pid[pp])]
    first = np.flatnonzero(run_starts(src[pp], dst[pp])) if len(pp) else np.zeros(0, _I64)
    k = np.arange(len(pp), dtype=_I64) - np.repeat(first, np.diff(np.append(first, len(pp))))
    rnd = rule.rounds(src[pp], dst[pp], k)
    o = lex_order(rnd, src[pp], dst[pp], k)
    return pp[o], k[o], rnd[o]


def _rank_cost(
    rank: int, world: int, node: np.ndarray, dst: np.ndarray, rnd: np.ndarray, outgoing: np.ndarray, nbytes: np.ndarray
) -> PlanCost:
    """This rank's :class:`PlanCost` (the other ranks' entries 0) of its P2P rows (receiver
    ``dst``, round ``rnd``, whether it sends them, bytes)."""
    sent_b, recv_b, peak = np.zeros(world, _I64), np.zeros(world, _I64), np.zeros(world, _I64)
    sent_b[rank] = int(nbytes[outgoing].sum())
    recv_b[rank] = int(nbytes[~outgoing].sum())
    if (~outgoing).any():
        peak[rank] = int(np.bincount(rnd[~outgoing], weights=nbytes[~outgoing]).max())
    return PlanCost(
        read_bytes=np.zeros(world, _I64),
        sent_bytes=sent_b,
        recv_bytes=recv_b,
        peak_staging_bytes=peak,
        cross_node_bytes=int(nbytes[outgoing & (node[dst] != node[rank])].sum()),
        num_p2p_ops=len(dst),
        num_batches=len(np.unique(rnd)),
        num_broadcasts=0,
    )
