"""The load planner: needs + readers -> :class:`~moeshard.plan.schedule.Schedule` (pure,
vectorized: numpy over needs, pieces and transfers; Python only per piece that must be split
and per piece with several candidate readers).

A *piece* is one box of one checkpoint tensor that at least one rank needs. Every piece is read
from storage by exactly one rank per *read scope* ("job": once in the whole job; "node": once
per node that needs it) and then delivered:

* to needers on the reader's node directly (level 0);
* to each other node that needs it: once across nodes, to one needer there (the *holder*,
  level 0), which relays it to the rest of its node (level 1).

Where every rank of a node needs a piece (and the node has >= 3 ranks) the in-node fan-out is
one node-group broadcast instead of P2P sends. A piece needed only by the rank that reads it is
a *local read*: straight from storage into the destination, never staged.

Rounds come from per-rank *streams*, not from a walk over all transfers. Each reader's level-0
sends are a stream in piece order, cut into windows of ``staging_bytes / 11`` bytes and
``max_ops / 2`` ops (a window index is ``bytes before // window + ops before // (max_ops / 2)``);
so are each rank's receipts (and each node's broadcasts) from the senders of one window index.
A level-0 transfer runs in round ``(sender's window, receiver's window)``; a relay in round
``(that of the transfer that brought the piece to the holder, 1, relayer's window, receiver's
window)``; rounds run in lexicographic order. Pieces are at most ``staging_bytes / 11``, so a rank holds
at most ``2 x window + piece`` of reads it sends, and ``window + piece`` in each of four kinds
of receipt at once: ``<= staging_bytes``; and it posts ``<= max_ops`` P2P ops per round.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

from .._gc import paused_gc
from ..box import split_box
from ..io.checkpoint import CheckpointIndex
from ..topology import Topology
from .arrays import expand_runs, run_starts, seg_excl_cumsum
from .needs import NeedTable
from .schedule import PlanCost, Schedule

__all__ = ["plan_transfers", "minimal_cost", "DEFAULT_STAGING_BYTES", "DEFAULT_MAX_OPS", "STAGING_PARTS"]

Scope = Literal["job", "node"]
DEFAULT_STAGING_BYTES = 256 * 2**20
DEFAULT_MAX_OPS = 64
# The staging budget in parts: a piece is at most one part; a rank's windows share what its
# pieces leave of the budget (see the module doc).
STAGING_PARTS = 11


def plan_transfers(
    needs: NeedTable | Sequence,
    index: CheckpointIndex,
    topology: Topology,
    readers: Sequence[bool] | np.ndarray,
    scope: Scope = "job",
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    max_ops: int = DEFAULT_MAX_OPS,
) -> Schedule:
    """Plan reads and transfers so every need is met exactly once (pure, deterministic).

    Args:
        needs: every rank's needs (a :class:`NeedTable`, or :class:`~moeshard.layout.Need` rows).
        index: checkpoint headers (dtypes and file offsets of the keys).
        topology: world size and ranks per node.
        readers: ``bool[world_size]``: which ranks can read the checkpoint.
        scope: "job" reads each piece once in the job; "node" once per node needing it.
        staging_bytes: per-rank budget for pieces in flight.
        max_ops: at most this many P2P ops per rank in one round.

    Cost: ``O(n log n)`` in the number of needs ``n`` (sorts), on every rank that calls it.

    Raises:
        ValueError: no rank can read (or, for scope "node", a node that needs data has no
            reader), or the budget is too small for the elements of some tensor.
    """
    with paused_gc():
        return _plan(needs, index, topology, readers, scope, staging_bytes, max_ops)


# -- windows --------------------------------------------------------------------------------


def _windows(stream: Sequence[np.ndarray], order: Sequence[np.ndarray], nbytes: np.ndarray, ops: np.ndarray,
             window, ops_window) -> np.ndarray:
    """Window index of each element of the sequences that the columns ``stream`` name (one
    sequence per distinct row), each ordered by ``order`` (most significant first):
    ``bytes before // window + ops before // ops_window`` (scalars, or one value per element,
    the same within a sequence)."""
    if not len(stream[0]):
        return np.zeros(0, dtype=np.int64)
    perm = np.lexsort(tuple(reversed((*stream, *order))))
    start = run_starts(*(c[perm] for c in stream))
    window = window[perm] if isinstance(window, np.ndarray) else window
    ops_window = ops_window[perm] if isinstance(ops_window, np.ndarray) else ops_window
    k = seg_excl_cumsum(start, nbytes[perm]) // window + seg_excl_cumsum(start, ops[perm]) // ops_window
    out = np.empty(len(perm), dtype=np.int64)
    out[perm] = k
    return out


# -- pieces ---------------------------------------------------------------------------------


def _key_columns(table: NeedTable, index: CheckpointIndex) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key of ``table``: file number (files in name order), byte offset, item size."""
    infos = [index.info(k) for k in table.keys]
    files = {f: i for i, f in enumerate(sorted({i.file for i in infos}))}
    return (np.asarray([files[i.file] for i in infos], dtype=np.int64),
            np.asarray([i.offset for i in infos], dtype=np.int64),
            np.asarray([i.itemsize for i in infos], dtype=np.int64))


def _group_pieces(table: NeedTable, file_no: np.ndarray, offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(order, piece)``: the rows in file order (file, offset, box) and the piece number of
    each row in that order (distinct (key, box) pairs are pieces)."""
    # Keys ranked in file order: one column instead of (file, offset, key).
    key_order = np.empty(len(table.keys), dtype=np.int64)
    key_order[np.lexsort((np.arange(len(table.keys)), offset, file_no))] = np.arange(len(table.keys))
    cols = (key_order[table.key], *_box_columns(table.src_off, table.src_len))
    order = np.lexsort(tuple(reversed(cols)))
    start = run_starts(*(c[order] for c in cols))
    return order, np.cumsum(start) - 1


def _box_columns(off: np.ndarray, ln: np.ndarray) -> list[np.ndarray]:
    """Columns that order boxes as ``(off[0], len[0], off[1], len[1], ...)`` does: one per dim
    (offset and length packed in one int64) where both fit in 31 bits, else two."""
    cols = []
    for d in range(off.shape[1]):
        if off.shape[0] and max(int(off[:, d].max()), int(ln[:, d].max())) < 2**31:
            cols.append((off[:, d] << 32) | ln[:, d])
        else:
            cols += [off[:, d], ln[:, d]]
    return cols


def _split(pkey, poff, plen, ndim, limit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(parent, off, len)``: pieces of more than ``limit[p]`` elements split along their
    first dims (:func:`~moeshard.box.split_box`), in order; ``parent`` maps new to old."""
    numel = plen.prod(axis=1)
    big = np.flatnonzero(numel > limit)
    counts = np.ones(len(pkey), dtype=np.int64)
    subs: dict[int, np.ndarray] = {}
    for p in big.tolist():
        nd = int(ndim[pkey[p]])
        box = tuple(zip(poff[p, :nd].tolist(), plen[p, :nd].tolist()))
        subs[p] = np.asarray(split_box(box, int(limit[p])), dtype=np.int64).reshape(-1, nd, 2)
        counts[p] = len(subs[p])
    parent = np.repeat(np.arange(len(pkey)), counts)
    off, ln = poff[parent], plen[parent]
    first = np.cumsum(counts) - counts
    for p, arr in subs.items():
        nd = arr.shape[1]
        off[first[p]:first[p] + len(arr), :nd] = arr[:, :, 0]
        ln[first[p]:first[p] + len(arr), :nd] = arr[:, :, 1]
    return parent, off, ln


# -- readers --------------------------------------------------------------------------------


def _spread(cls: np.ndarray, nbytes: np.ndarray, pools: list[np.ndarray]) -> np.ndarray:
    """A reader for each item: items of class ``c`` (in order) are split over ``pools[c]`` in
    contiguous runs of about equal bytes (a reader reads consecutive pieces: sequential I/O)."""
    out = np.empty(len(cls), dtype=np.int64)
    for c in np.unique(cls).tolist():
        idx = np.flatnonzero(cls == c)
        pool = pools[c]
        b = nbytes[idx]
        before = np.cumsum(b) - b
        total = max(int(b.sum()), 1)
        out[idx] = pool[np.minimum(before * len(pool) // total, len(pool) - 1)]
    return out


# -- the planner ------------------------------------------------------------------------------


def _plan(needs, index, topology, readers, scope, staging_bytes, max_ops) -> Schedule:
    world, lws = topology.world_size, topology.local_world_size
    readers = np.asarray(readers, dtype=bool)
    if readers.shape != (world,):
        raise ValueError(f"readers must be bool[{world}], got shape {readers.shape}")
    if not readers.any():
        raise ValueError("no rank can read the checkpoint")
    if scope not in ("job", "node"):
        raise ValueError(f"scope must be 'job' or 'node', got {scope!r}")
    if staging_bytes < 1 or max_ops < 2:
        raise ValueError(f"staging_bytes must be >= 1 and max_ops >= 2, got {staging_bytes}, {max_ops}")
    table = needs if isinstance(needs, NeedTable) else NeedTable.from_needs(needs)
    part = staging_bytes // STAGING_PARTS
    file_no, offset, itemsize = _key_columns(table, index)
    used = np.unique(table.key)
    too_big = used[itemsize[used] > part]
    if len(too_big):
        k = int(too_big[0])
        raise ValueError(
            f"staging budget of {staging_bytes} bytes cannot hold one element of {table.keys[k]!r} in each of its "
            f"{STAGING_PARTS} parts (at least {STAGING_PARTS * int(itemsize[k])} bytes)")
    node_of = np.arange(world) // lws

    # 1. Pieces: distinct (key, box) in file order, split to at most one part each.
    order, row_piece = _group_pieces(table, file_no, offset)
    first_row = order[np.flatnonzero(run_starts(row_piece))]
    pkey = table.key[first_row].astype(np.int64)
    parent, poff, plen = _split(pkey, table.src_off[first_row], table.src_len[first_row], table.ndim,
                                np.maximum(1, part // itemsize[pkey]))
    pkey = pkey[parent]
    pbytes = plen.prod(axis=1) * itemsize[pkey]
    # Deliveries: each need row once per piece of its (split) parent piece.
    counts = np.bincount(parent, minlength=len(first_row))
    owner, d_piece = expand_runs((np.cumsum(counts) - counts)[row_piece], counts[row_piece])
    rows = order[owner]
    d_off = table.dst_off[rows] + poff[d_piece] - table.src_off[rows]
    perm = np.lexsort((table.rank[rows], d_piece))
    d_piece, rows, d_off = d_piece[perm], rows[perm], d_off[perm]
    d_rank = table.rank[rows].astype(np.int64)

    # 2. (piece, rank) pairs and read groups (a piece in "job" scope, (piece, node) in "node").
    pair_start = run_starts(d_piece, d_rank)
    pair_piece, pair_rank = d_piece[pair_start], d_rank[pair_start]
    pair_node = node_of[pair_rank]
    gstart = run_starts(pair_piece, pair_node) if scope == "node" else run_starts(pair_piece)
    gid = np.cumsum(gstart) - 1
    g_first = np.flatnonzero(gstart)
    g_piece, g_node = pair_piece[g_first], pair_node[g_first]
    g_size = np.diff(np.append(g_first, len(pair_piece)))
    g_bytes = pbytes[g_piece]
    num_groups = len(g_first)

    # 3. One reader per group: a needer that can read if there is one (the least loaded of
    # several), else a reader near the needers, spread over the pool by bytes.
    cand = readers[pair_rank]
    ncand = np.bincount(gid, weights=cand, minlength=num_groups).astype(np.int64)
    reader = np.full(num_groups, -1, dtype=np.int64)
    only = cand & (ncand[gid] == 1)
    reader[gid[only]] = pair_rank[only]
    pool_all = np.flatnonzero(readers)
    node_pools = [pool_all[node_of[pool_all] == n] for n in range(topology.num_nodes)]
    none = np.flatnonzero(ncand == 0)
    if len(none):
        if scope == "node":
            near = g_node[none]
            empty = [n for n in np.unique(near).tolist() if not len(node_pools[n])]
            if empty:
                g = none[np.flatnonzero(near == empty[0])[0]]
                raise ValueError(
                    f"storage scope 'node': node {empty[0]} needs {table.keys[pkey[g_piece[g]]]!r} but none of its "
                    "ranks can read the checkpoint")
        else:
            has = np.asarray([len(p) > 0 for p in node_pools])[pair_node]
            big = np.iinfo(np.int64).max
            first_near = np.minimum.reduceat(np.where(has, np.arange(len(pair_node)), big), g_first)[none]
            near = np.where(first_near < big, pair_node[np.minimum(first_near, len(pair_node) - 1)], topology.num_nodes)
        reader[none] = _spread(near, g_bytes[none], node_pools + [pool_all])
    read_load = np.bincount(reader[reader >= 0], weights=g_bytes[reader >= 0], minlength=world)
    for g in np.flatnonzero(ncand >= 2).tolist():
        s = g_first[g]
        ranks = pair_rank[s:s + g_size[g]][cand[s:s + g_size[g]]]
        r = int(ranks[np.argmin(read_load[ranks])])
        reader[g] = r
        read_load[r] += g_bytes[g]

    # 4. Trees. Local reads: groups whose only needer is their reader.
    local = (g_size == 1) & (pair_rank[g_first] == reader)
    pair_reader = reader[gid]
    p_idx = np.flatnonzero(~local[gid])
    # Subgroups: the pairs of one remote group on one node. A group's pairs are contiguous
    # (sorted by piece, then rank), so a subgroup's are pairs sub_first .. + sub_size - 1.
    sstart = run_starts(gid[p_idx], pair_node[p_idx])
    s_of_pair = np.cumsum(sstart) - 1  # per remote pair
    sub_first = p_idx[sstart]
    sub_size = np.bincount(s_of_pair, minlength=len(sub_first))
    sub_node = pair_node[sub_first]
    sub_reader = pair_reader[sub_first]
    sub_piece = pair_piece[sub_first]
    at_reader = sub_node == node_of[sub_reader]
    whole = (sub_size == lws) & (lws >= 3)
    holder = np.where(at_reader, sub_reader, pair_rank[sub_first + sub_piece % sub_size])
    # Level 0: the reader to the holder of each other node; to each needer on its own node, or
    # one broadcast there when the whole node needs it.
    is_rest = pair_rank[p_idx] != holder[s_of_pair]
    near = at_reader[s_of_pair] & ~whole[s_of_pair] & is_rest
    far = ~at_reader[s_of_pair] & ~whole[s_of_pair] & is_rest
    direct = p_idx[near]
    cross = np.flatnonzero(~at_reader)
    e0_src = np.concatenate([pair_reader[direct], sub_reader[cross]])
    e0_dst = np.concatenate([pair_rank[direct], holder[cross]])
    e0_piece = np.concatenate([pair_piece[direct], sub_piece[cross]])
    b0 = np.flatnonzero(at_reader & whole)
    b0_root, b0_node, b0_piece = sub_reader[b0], sub_node[b0], sub_piece[b0]
    # Level 1: the holder of each other node to the rest of it (P2P, or one broadcast).
    relay = p_idx[far]
    e1_src, e1_dst, e1_piece = holder[s_of_pair[far]], pair_rank[relay], pair_piece[relay]
    b1 = np.flatnonzero(~at_reader & whole)
    b1_root, b1_node, b1_piece = holder[b1], sub_node[b1], sub_piece[b1]

    # 5. Rounds from streams (module doc). A rank's budget is shared only by the kinds of
    # buffer it holds: a reader that receives nothing gets windows of 9 parts, not 1.
    n0, n1 = len(e0_src), len(e1_src)
    bc_root = np.concatenate([b0_root, b1_root])
    bc_node = np.concatenate([b0_node, b1_node])
    bc_piece = np.concatenate([b0_piece, b1_piece])
    bc_ranks, bc_of = _broadcast_receivers(bc_node, bc_root, lws)
    relayed_bc = bc_of >= len(b0)

    def has(ranks: np.ndarray) -> np.ndarray:
        return np.bincount(ranks, minlength=world) > 0

    sends0, relays = has(np.concatenate([e0_src, b0_root])), has(np.concatenate([e1_src, b1_root]))
    recv0, recv1 = has(e0_dst), has(e1_dst)
    kinds = recv0.astype(np.int64) + has(bc_ranks[~relayed_bc]) + recv1 + has(bc_ranks[relayed_bc])
    w_rank = (staging_bytes - (2 * sends0 + kinds) * part) // np.maximum(sends0 + kinds, 1)
    assert (w_rank >= part).all()
    w_node = w_rank.reshape(-1, lws).min(axis=1)
    half = max_ops // 2
    o_send0 = np.where(recv0, half, max_ops)
    o_recv0 = max_ops - np.where(sends0, half, 0)
    o_send1 = np.where(recv1, half, max_ops)
    o_recv1 = max_ops - np.where(relays, half, 0)
    l0_src = np.concatenate([e0_src, b0_root])
    l0_piece = np.concatenate([e0_piece, b0_piece])
    l0_kind = np.concatenate([np.zeros(n0, np.int64), np.ones(len(b0), np.int64)])
    l0_dst = np.concatenate([e0_dst, np.full(len(b0), -1, np.int64)])
    # A reader's stream counts a piece's bytes once (on its last item) and one op per send.
    perm = np.lexsort((l0_dst, l0_kind, l0_piece, l0_src))
    last = np.zeros(len(perm), dtype=bool)
    if len(perm):
        last[perm] = np.append(run_starts(l0_src[perm], l0_piece[perm])[1:], True)
    k_send = _windows((l0_src,), (l0_piece, l0_kind, l0_dst), np.where(last, pbytes[l0_piece], 0), 1 - l0_kind,
                      w_rank[l0_src], o_send0[l0_src])
    # A receiver's windows restart with each sender window: one sender's window of sends to
    # it is one round, not one per position in the receiver's own stream.
    e0_a, b0_a = k_send[:n0], k_send[n0:]
    k_recv0 = _windows((e0_dst, e0_a), (e0_src, e0_piece), pbytes[e0_piece], np.ones(n0, np.int64),
                       w_rank[e0_dst], o_recv0[e0_dst])
    k_b0 = _windows((b0_node, b0_a), (b0_root, b0_piece), pbytes[b0_piece], np.zeros(len(b0), np.int64),
                    w_node[b0_node], 1)
    l0_key = np.stack([k_send, np.concatenate([k_recv0, k_b0])], axis=1)
    # The level-0 transfer that brought each relayed piece to its holder.
    e0_code = e0_piece * world + e0_dst
    e0_sort = np.argsort(e0_code, kind="stable")
    l1_src = np.concatenate([e1_src, b1_root])
    l1_piece = np.concatenate([e1_piece, b1_piece])
    l1_kind = np.concatenate([np.zeros(n1, np.int64), np.ones(len(b1), np.int64)])
    l1_dst = np.concatenate([e1_dst, np.full(len(b1), -1, np.int64)])
    brought = e0_sort[np.searchsorted(e0_code[e0_sort], l1_piece * world + l1_src)] if len(l1_src) else np.zeros(0, np.int64)
    k_relay = _windows((l1_src,), (l1_piece, l1_kind, l1_dst), np.zeros(len(l1_src), np.int64), 1 - l1_kind, 1,
                       o_send1[l1_src])
    fam = l0_key[brought]  # (x, b) of each relay's family
    e1_f, b1_f = slice(0, n1), slice(n1, None)
    k_recv1 = _windows((e1_dst, fam[e1_f, 0], fam[e1_f, 1], k_relay[e1_f]), (e1_src, e1_piece), pbytes[e1_piece],
                       np.ones(n1, np.int64), w_rank[e1_dst], o_recv1[e1_dst])
    k_b1 = _windows((b1_node, fam[b1_f, 0], fam[b1_f, 1], k_relay[b1_f]), (b1_root, b1_piece), pbytes[b1_piece],
                    np.zeros(len(b1), np.int64), w_node[b1_node], 1)
    keys = np.concatenate([
        np.concatenate([l0_key, np.zeros((len(l0_key), 3), np.int64)], axis=1),
        np.concatenate([fam, np.ones((len(l1_src), 1), np.int64), k_relay[:, None],
                        np.concatenate([k_recv1, k_b1])[:, None]], axis=1),
    ]).reshape(-1, 5)
    kperm = np.lexsort(keys.T[::-1])
    rstart = run_starts(*(keys[kperm, c] for c in range(5)))
    rounds = np.empty(len(keys), dtype=np.int64)
    rounds[kperm] = np.cumsum(rstart) - 1
    num_rounds = int(rstart.sum())
    l0_round, l1_round = rounds[:len(l0_src)], rounds[len(l0_src):]
    e0_round, b0_round = l0_round[:n0], l0_round[n0:]
    e1_round, b1_round = l1_round[:n1], l1_round[n1:]

    # 6. Reads: each group's reader, in the first round it sends the piece (-1: local).
    r_groups = np.flatnonzero(~local)
    read_round = np.full(num_groups, -1, dtype=np.int64)
    read_end = np.full(num_groups, -1, dtype=np.int64)
    # Level-0 items of a group are those of its (reader, piece): their runs, in (piece,
    # reader) order, are the remote groups in order.
    code = l0_piece * world + l0_src
    srt = np.argsort(code, kind="stable")
    first = np.flatnonzero(run_starts(code[srt]))
    assert np.array_equal(code[srt][first], g_piece[r_groups] * world + reader[r_groups]), \
        "every remote group sends its piece, and only those send"
    if len(first):
        read_round[r_groups] = np.minimum.reduceat(l0_round[srt], first)
        read_end[r_groups] = np.maximum.reduceat(l0_round[srt], first)

    # 7. Costs and the exact staging peak.
    sends_src = np.concatenate([e0_src, e1_src])
    sends_dst = np.concatenate([e0_dst, e1_dst])
    sends_piece = np.concatenate([e0_piece, e1_piece])
    sends_round = np.concatenate([e0_round, e1_round])
    bc_round = np.concatenate([b0_round, b1_round])
    sb = pbytes[sends_piece]
    read_bytes = np.bincount(reader, weights=g_bytes, minlength=world).astype(np.int64)
    sent = (np.bincount(sends_src, weights=sb, minlength=world)
            + np.bincount(bc_root, weights=pbytes[bc_piece] * (lws - 1), minlength=world)).astype(np.int64)
    recv = (np.bincount(sends_dst, weights=sb, minlength=world)
            + np.bincount(bc_ranks, weights=pbytes[bc_piece[bc_of]], minlength=world)).astype(np.int64)
    # A holder keeps what it received until its last relay of it.
    relay_end = np.full(n0, -1, dtype=np.int64)
    np.maximum.at(relay_end, brought, l1_round)
    peak = _peak(world, [
        (reader[r_groups], g_bytes[r_groups], read_round[r_groups], read_end[r_groups]),
        (e0_dst, pbytes[e0_piece], e0_round, np.maximum(e0_round, relay_end)),
        (e1_dst, pbytes[e1_piece], e1_round, e1_round),
        (bc_ranks, pbytes[bc_piece[bc_of]], bc_round[bc_of], bc_round[bc_of]),
    ])
    cost = PlanCost(
        read_bytes=read_bytes, sent_bytes=sent, recv_bytes=recv, peak_staging_bytes=peak,
        cross_node_bytes=int(sb[node_of[sends_src] != node_of[sends_dst]].sum()),
        num_p2p_ops=len(sends_src), num_batches=int((np.bincount(sends_round, minlength=num_rounds) > 0).sum()), num_broadcasts=len(bc_root),
    )
    rperm = np.lexsort((g_piece, reader))  # reads in piece order per reader
    return Schedule(
        topology=topology.with_rank(0), staging_bytes=staging_bytes, max_ops=max_ops,
        keys=table.keys, key_ndim=table.ndim, piece_key=pkey.astype(np.int32), piece_off=poff, piece_len=plen,
        piece_bytes=pbytes.astype(np.int64),
        read_rank=reader[rperm].astype(np.int32), read_piece=g_piece[rperm].astype(np.int32),
        read_round=read_round[rperm],
        send_src=sends_src.astype(np.int32), send_dst=sends_dst.astype(np.int32),
        send_piece=sends_piece.astype(np.int32), send_round=sends_round,
        bcast_node=bc_node.astype(np.int32), bcast_root=bc_root.astype(np.int32),
        bcast_piece=bc_piece.astype(np.int32), bcast_round=bc_round,
        dlv_piece=d_piece.astype(np.int32), dlv_rank=d_rank.astype(np.int32),
        dlv_param=table.param[rows].astype(np.int32), dlv_slot=table.slot[rows].astype(np.int64), dlv_off=d_off,
        num_rounds=num_rounds, cost=cost,
    )


def _broadcast_receivers(node: np.ndarray, root: np.ndarray, lws: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rank, broadcast)``: every receiving rank of every broadcast (its node but the root)."""
    ranks = (node[:, None] * lws + np.arange(lws)[None, :]).reshape(-1)
    of = np.repeat(np.arange(len(node)), lws)
    keep = ranks != root[of]
    return ranks[keep], of[keep]


def _peak(world: int, holds: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """``int64[world]``: the most bytes each rank holds at once, given ``(rank, bytes, first
    round, last round)`` of every buffer (held from the start of the first round to the end of
    the last)."""
    rank = np.concatenate([np.concatenate([r, r]) for r, *_ in holds])
    if not len(rank):
        return np.zeros(world, dtype=np.int64)
    time = np.concatenate([np.concatenate([a, e + 1]) for _, _, a, e in holds])
    delta = np.concatenate([np.concatenate([b, -b]) for _, b, *_ in holds]).astype(np.int64)
    # One sort key: (rank, round, releases before acquisitions in the same round).
    perm = np.argsort((rank * (int(time.max()) + 1) + time) * 2 + (delta > 0), kind="stable")
    running = np.cumsum(delta[perm])  # every rank's holds net to zero: no reset needed
    r = rank[perm]
    first = np.flatnonzero(run_starts(r))
    out = np.zeros(world, dtype=np.int64)
    out[r[first]] = np.maximum.reduceat(running, first)
    return out


def minimal_cost(needs: NeedTable | Sequence, index: CheckpointIndex, topology: Topology, readers,
                 scope: Scope = "job") -> dict:
    """Lower bounds for any plan of these needs (pure): storage bytes (each needed byte once
    per scope), network bytes (every needer that is not the one reader of its scope) and bytes
    crossing nodes. Numpy over (piece, rank) and (piece, node) pairs."""
    readers = np.asarray(readers, dtype=bool)
    world = topology.world_size
    if readers.shape != (world,):
        raise ValueError(f"readers must be bool[{world}], got shape {readers.shape}")
    if scope not in ("job", "node"):
        raise ValueError(f"scope must be 'job' or 'node', got {scope!r}")
    table = needs if isinstance(needs, NeedTable) else NeedTable.from_needs(needs)
    if not len(table):
        return {"read_bytes": 0, "network_bytes": 0, "cross_node_bytes": 0}
    lws, num_nodes = topology.local_world_size, topology.num_nodes
    file_no, offset, itemsize = _key_columns(table, index)
    order, piece = _group_pieces(table, file_no, offset)
    first = order[np.flatnonzero(run_starts(piece))]
    nbytes = table.src_len[first].prod(axis=1) * itemsize[table.key[first]]
    num_pieces = len(first)
    ranks = table.rank[order].astype(np.int64)
    # Distinct (piece, rank) pairs: a rank needing several boxes of one piece counts once.
    perm = np.lexsort((ranks, piece))
    pair = run_starts(piece[perm], ranks[perm])
    p_pid, p_rank = piece[perm][pair], ranks[perm][pair]
    p_node = p_rank // lws
    p_reader = readers[p_rank]
    if scope == "job":
        count = np.bincount(p_pid, minlength=num_pieces)
        has_reader = np.bincount(p_pid, weights=p_reader, minlength=num_pieces) > 0
        read = int(nbytes.sum())
        net = int(((count - has_reader) * nbytes).sum())
        # Distinct (piece, node) pairs (ranks ascend within a piece, so nodes do too); a piece
        # needs no crossing into a node holding a reader.
        pn = run_starts(p_pid, p_node)
        pn_pid, pn_node = p_pid[pn], p_node[pn]
        node_has_reader = np.bincount(np.flatnonzero(readers) // lws, minlength=num_nodes) > 0
        num_nodes_of = np.bincount(pn_pid, minlength=num_pieces)
        reader_node_of = np.bincount(pn_pid, weights=node_has_reader[pn_node], minlength=num_pieces) > 0
        cross = int(((num_nodes_of - reader_node_of) * nbytes).sum())
    else:
        start = run_starts(p_pid, p_node)
        inverse = np.cumsum(start) - 1
        count = np.bincount(inverse)
        has_reader = np.bincount(inverse, weights=p_reader, minlength=len(count)) > 0
        pn_bytes = nbytes[p_pid[start]]
        read = int(pn_bytes.sum())
        net = int(((count - has_reader) * pn_bytes).sum())
        cross = 0
    return {"read_bytes": read, "network_bytes": net, "cross_node_bytes": cross}
