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

Local reads take part in none of this: so a rank can plan its own schedule without the other
ranks' local reads (``plan_transfers(rank=)``), from their bytes alone, and get its rows of the
whole job's schedule.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

from .._gc import paused_gc
from ..io.index import CheckpointIndex
from ..io.packed import blob_nbytes
from ..topology import Topology
from .arrays import dense_rank, expand_runs, lex_order, run_starts, seg_excl_cumsum
from .needs import NeedTable
from .pieces import STAGING_PARTS, Pieces, cut_pieces
from .schedule import BcastTable, DeliveryTable, PieceTable, PlanCost, ReadTable, Schedule, SendTable

__all__ = ["plan_transfers", "minimal_cost", "DEFAULT_STAGING_BYTES", "DEFAULT_MAX_OPS", "STAGING_PARTS"]

Scope = Literal["job", "node"]
DEFAULT_STAGING_BYTES = 256 * 2**20
DEFAULT_MAX_OPS = 64


def plan_transfers(
    needs: NeedTable | Pieces | Sequence,
    index: CheckpointIndex,
    topology: Topology,
    readers: Sequence[bool] | np.ndarray,
    scope: Scope = "job",
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    max_ops: int = DEFAULT_MAX_OPS,
    rank: int | None = None,
) -> Schedule:
    """Plan reads and transfers so every need is met exactly once (pure, deterministic).

    Args:
        needs: every rank's needs (a :class:`NeedTable`, or :class:`~moeshard.plan.needs.Need`
            rows), or their :class:`~moeshard.plan.pieces.Pieces` cut for ``staging_bytes``
            (to plan several storage modes from one cut: the schedule is the same).
        index: checkpoint headers (dtypes and file offsets of the keys).
        topology: world size and ranks per node.
        readers: ``bool[world_size]``: which ranks can read the checkpoint.
        scope: "job" reads each piece once in the job; "node" once per node needing it.
        staging_bytes: per-rank budget for pieces in flight.
        max_ops: at most this many P2P ops per rank in one round.
        rank: None: the whole job's schedule. A rank: the schedule that rank runs
            (:meth:`Schedule.for_rank` of that rank only): every transfer between ranks, and of
            the pieces read for one rank only (local reads) that rank's. Other ranks' local
            reads are counted in ``cost`` but not planned: with a :class:`NeedTable` whose
            ``alone`` hint is set, what is planned for the whole job is only the rows not
            alone (replicated tensors, redundant experts) and those of ranks that cannot read.
            This rank's rows are those of the whole job's schedule (the same pieces, the
            transfers' first and this rank's local reads after them; the same counts); its
            fingerprint is the same on every rank: a digest of the transfers, every rank's
            local bytes and the need table (``NeedTable.digest``, else its rows). ``needs`` may
            then be a table built for this rank (``need_table(keep_ranks=)``).

    Cost: ``O(n log n)`` in the number of needs ``n`` (sorts), on every rank that calls it;
    with ``rank`` and the ``alone`` hint, ``O(n)`` plus the sorts of the rows not alone and of
    this rank's.

    Raises:
        ValueError: no rank can read (or, for scope "node", a node that needs data has no
            reader), the budget is too small for the elements of some tensor, ``needs``
            are pieces cut for another budget, or a need table built for one rank's plan
            (``need_table(keep_ranks=)``) is planned for another rank or the whole job, or
            lacks the needs of a rank that cannot read.
    """
    with paused_gc():
        readers = _check_args(topology, readers, scope)
        if staging_bytes < 1 or max_ops < 2:
            raise ValueError(f"staging_bytes must be >= 1 and max_ops >= 2, got {staging_bytes}, {max_ops}")
        if isinstance(needs, NeedTable) and needs.full is not None:
            _check_partial(needs, readers, rank)
        if rank is not None:
            if not 0 <= rank < topology.world_size:
                raise ValueError(f"rank must be in [0, {topology.world_size}), got {rank}")
            if not isinstance(needs, Pieces):
                table = needs if isinstance(needs, NeedTable) else NeedTable.from_needs(needs)
                return _plan_rank(table, index, topology, readers, scope, staging_bytes, max_ops, rank)
        pieces = _pieces(needs, index, staging_bytes)
        plan = plan_pieces(pieces, topology, readers, scope, staging_bytes, max_ops)
        return plan if rank is None else dataclasses.replace(plan, rank=rank)


def _check_partial(table: NeedTable, readers: np.ndarray, rank: int | None) -> None:
    """ValueError unless a table built for one rank (``table.full``) can be planned for ``rank``:
    it has all of that rank's rows and all of every rank's that cannot read (whose needs are
    transfers, not local reads)."""
    full = table.full
    assert full is not None
    if full.shape != readers.shape:
        raise ValueError(f"the need table was built for {len(full)} ranks, the topology has {len(readers)}")
    if rank is None or not full[rank]:
        target = "the whole job" if rank is None else f"rank {rank}"
        raise ValueError(
            "the need table has only some ranks' needs (built for one rank's plan: "
            f"need_table(keep_ranks=)); it cannot be planned for {target}"
        )
    missing = np.flatnonzero(~full & ~readers)
    if len(missing):
        raise ValueError(
            f"the need table lacks some needs of ranks {missing[:8].tolist()}, which cannot read the "
            "checkpoint (keep_ranks must include every rank that cannot read)"
        )


def _check_args(topology: Topology, readers, scope: str) -> np.ndarray:
    """``readers`` as ``bool[world_size]``; ValueError for a bad shape, no reader or a bad scope."""
    readers = np.asarray(readers, dtype=bool)
    if readers.shape != (topology.world_size,):
        raise ValueError(f"readers must be bool[{topology.world_size}], got shape {readers.shape}")
    if not readers.any():
        raise ValueError("no rank can read the checkpoint")
    if scope not in ("job", "node"):
        raise ValueError(f"scope must be 'job' or 'node', got {scope!r}")
    if (np.diff(topology.nodes_array()) < 0).any():
        # The trees group a piece's needers by node as runs of ascending ranks.
        raise ValueError(
            f"the ranks of each node must be contiguous, got nodes {list(topology.nodes or ())[:16]}; "
            "number the group's ranks node by node"
        )
    return readers


def _pieces(needs, index: CheckpointIndex, staging_bytes: int | None) -> Pieces:
    """The pieces of ``needs`` cut for ``staging_bytes`` (given pieces: checked, as they are)."""
    if isinstance(needs, Pieces):
        if staging_bytes is not None and needs.staging_bytes != staging_bytes:
            raise ValueError(
                f"the pieces were cut for a staging budget of {needs.staging_bytes} bytes, not {staging_bytes}"
            )
        return needs
    table = needs if isinstance(needs, NeedTable) else NeedTable.from_needs(needs)
    return cut_pieces(table, index, staging_bytes)


# -- windows --------------------------------------------------------------------------------


def _stream_order(stream: Sequence[np.ndarray], order: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(perm, start)``: the elements sorted by sequence (the distinct rows of the columns
    ``stream``), each sequence ordered by ``order`` (most significant first), and ``bool``:
    where a sequence begins in that order."""
    perm = lex_order(*stream, *order)
    return perm, run_starts(*(c[perm] for c in stream))


def _windows(
    perm: np.ndarray, start: np.ndarray, nbytes: np.ndarray, ops: np.ndarray, window, ops_window
) -> np.ndarray:
    """Window index of each element of sequences sorted as ``perm`` says (``start``: where a
    sequence begins, :func:`_stream_order`): ``bytes before // window + ops before //
    ops_window`` within its sequence. ``nbytes``, ``ops`` and (arrays, or scalars) the windows
    are per element in sorted order."""
    out = np.empty(len(perm), dtype=np.int64)
    if len(perm):
        k = seg_excl_cumsum(start, nbytes) // window
        k += seg_excl_cumsum(start, ops) // ops_window
        out[perm] = k
    return out


def _window_of(
    stream: Sequence[np.ndarray], order: Sequence[np.ndarray], nbytes: np.ndarray, ops: np.ndarray, window, ops_window
) -> np.ndarray:
    """:func:`_windows` of elements given in their own order (``nbytes``, ``ops`` and array
    windows per element)."""
    perm, start = _stream_order(stream, order)

    def sort(x):
        return x[perm] if isinstance(x, np.ndarray) else x

    return _windows(perm, start, sort(nbytes), sort(ops), sort(window), sort(ops_window))


# -- readers and trees ------------------------------------------------------------------------


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


class _Trees(NamedTuple):
    """Who reads each piece and how it travels (``G`` read groups; ranks, nodes and pieces
    ``int32``).

    g_piece, reader: ``[G]`` each group's piece and reader; local: ``bool[G]``, the reader is
    the group's only needer. Level 0: P2P sends ``e0_*`` from readers, node broadcasts
    ``b0_*`` rooted at readers; level 1: relays ``e1_*`` / ``b1_*`` from the holder of a piece
    on another node.
    """

    g_piece: np.ndarray
    reader: np.ndarray
    local: np.ndarray
    e0_src: np.ndarray
    e0_dst: np.ndarray
    e0_piece: np.ndarray
    b0_root: np.ndarray
    b0_node: np.ndarray
    b0_piece: np.ndarray
    e1_src: np.ndarray
    e1_dst: np.ndarray
    e1_piece: np.ndarray
    b1_root: np.ndarray
    b1_node: np.ndarray
    b1_piece: np.ndarray


def _trees(
    pieces: Pieces, topology: Topology, readers: np.ndarray, scope: str, base_load: np.ndarray | None = None
) -> _Trees:
    """Read groups (a piece in "job" scope, (piece, node) in "node"), one reader each, and the
    trees that take each piece from its reader to its needers (module doc).

    Columns over (piece, rank) pairs are ``int32`` (ranks, nodes, pieces) and temporaries are
    dropped as soon as they are used: at 1,024 ranks there are ~860,000 pairs per column."""
    node_of = topology.nodes_array().astype(np.int32)
    node_size = topology.node_sizes()
    pair_piece, pair_rank = pieces.pairs()
    pair_node = node_of[pair_rank]
    gstart = run_starts(pair_piece, pair_node) if scope == "node" else run_starts(pair_piece)
    gid = np.cumsum(gstart, dtype=np.int64) - 1
    g_first = np.flatnonzero(gstart)
    del gstart
    g_piece = pair_piece[g_first]
    g_size = np.diff(np.append(g_first, len(pair_piece)))
    reader = _readers(pieces, topology, readers, scope, pair_rank, pair_node, gid, g_first, g_piece, g_size, base_load)

    # Local reads: groups whose only needer is their reader.
    local = (g_size == 1) & (pair_rank[g_first] == reader)
    del g_size, g_first
    p_idx = np.flatnonzero(~local[gid])
    # Subgroups: the pairs of one remote group on one node. A group's pairs are contiguous
    # (sorted by piece, then rank), so a subgroup's are pairs sub_first .. + sub_size - 1.
    sstart = run_starts(gid[p_idx], pair_node[p_idx])
    s_of_pair = np.cumsum(sstart, dtype=np.int64) - 1  # per remote pair
    sub_first = p_idx[sstart]
    del sstart
    sub_size = np.bincount(s_of_pair, minlength=len(sub_first))
    sub_node = pair_node[sub_first]
    sub_reader = reader[gid[sub_first]]
    del gid, pair_node
    sub_piece = pair_piece[sub_first]
    at_reader = sub_node == node_of[sub_reader]
    whole = (sub_size == node_size[sub_node]) & (node_size[sub_node] >= 3)
    # Holders spread over a node's needers by what the piece is (its key and box), not by its
    # number: a schedule planned for one rank numbers pieces differently (plan_transfers).
    spread = pieces.piece_key[sub_piece].astype(np.int64) + pieces.piece_off[sub_piece].sum(axis=1)
    holder = np.where(at_reader, sub_reader, pair_rank[sub_first + spread % sub_size])
    del spread
    del sub_size, sub_first
    # Level 0: the reader to the holder of each other node; to each needer on its own node, or
    # one broadcast there when the whole node needs it. Level 1: the holder of each other node
    # to the rest of it (P2P, or one broadcast).
    rest = (pair_rank[p_idx] != holder[s_of_pair]) & ~whole[s_of_pair]
    near = at_reader[s_of_pair]
    far = rest & ~near
    near &= rest
    del rest
    direct, relay = p_idx[near], p_idx[far]
    direct_sub, relay_sub = s_of_pair[near], s_of_pair[far]
    del p_idx, near, far, s_of_pair
    cross = np.flatnonzero(~at_reader)
    b0, b1 = np.flatnonzero(at_reader & whole), np.flatnonzero(~at_reader & whole)
    return _Trees(
        g_piece=g_piece,
        reader=reader,
        local=local,
        e0_src=np.concatenate([sub_reader[direct_sub], sub_reader[cross]]),
        e0_dst=np.concatenate([pair_rank[direct], holder[cross]]),
        e0_piece=np.concatenate([pair_piece[direct], sub_piece[cross]]),
        b0_root=sub_reader[b0],
        b0_node=sub_node[b0],
        b0_piece=sub_piece[b0],
        e1_src=holder[relay_sub],
        e1_dst=pair_rank[relay],
        e1_piece=pair_piece[relay],
        b1_root=holder[b1],
        b1_node=sub_node[b1],
        b1_piece=sub_piece[b1],
    )


def _readers(
    pieces: Pieces,
    topology: Topology,
    readers: np.ndarray,
    scope: str,
    pair_rank: np.ndarray,
    pair_node: np.ndarray,
    gid: np.ndarray,
    g_first: np.ndarray,
    g_piece: np.ndarray,
    g_size: np.ndarray,
    base_load: np.ndarray | None,
) -> np.ndarray:
    """``int32[G]``: one reader per group (pairs ``g_first[g] .. + g_size[g] - 1``, each pair's
    group ``gid``): a needer that can read if there is one (the least loaded of several), else a
    reader near the needers, spread over the pool by bytes. ``base_load``: ``int64[world]``
    bytes each rank reads besides these groups (local reads planned elsewhere), or None."""
    world, node_of = topology.world_size, topology.nodes_array()
    num_groups = len(g_first)
    g_bytes = pieces.piece_bytes[g_piece]
    cand = readers[pair_rank]
    ncand = np.bincount(gid, weights=cand, minlength=num_groups).astype(np.int64)
    reader = np.full(num_groups, -1, dtype=np.int32)
    only = cand & (ncand[gid] == 1)
    reader[gid[only]] = pair_rank[only]
    del only
    pool_all = np.flatnonzero(readers)
    node_pools = np.split(pool_all, np.searchsorted(node_of[pool_all], np.arange(1, topology.num_nodes)))
    none = np.flatnonzero(ncand == 0)
    if len(none):
        if scope == "node":
            near = pair_node[g_first[none]]
            empty = [n for n in np.unique(near).tolist() if not len(node_pools[n])]
            if empty:
                g = none[np.flatnonzero(near == empty[0])[0]]
                raise ValueError(
                    f"storage scope 'node': node {empty[0]} needs {pieces.keys[pieces.piece_key[g_piece[g]]]!r} but "
                    "none of its ranks can read the checkpoint"
                )
        else:
            has = np.asarray([len(p) > 0 for p in node_pools])[pair_node]
            big = np.iinfo(np.int64).max
            first_near = np.minimum.reduceat(np.where(has, np.arange(len(pair_node)), big), g_first)[none]
            near = np.where(first_near < big, pair_node[np.minimum(first_near, len(pair_node) - 1)], topology.num_nodes)
        reader[none] = _spread(near, g_bytes[none], node_pools + [pool_all])
    multi = np.flatnonzero(ncand >= 2)
    if len(multi):
        # Greedy, group by group: each takes its least loaded candidate (the first of equals),
        # whose load then grows. Sequential, so in plain Python over lists (numpy per group
        # costs ~10 us each; "node" scope at 1,024 ranks has ~7,000 such groups).
        load = np.bincount(reader[reader >= 0], weights=g_bytes[reader >= 0], minlength=world)
        if base_load is not None:
            load += base_load
        load = load.tolist()
        _, pos = expand_runs(g_first[multi], g_size[multi])
        ranks = pair_rank[pos[cand[pos]]].tolist()
        chosen = []
        i = 0
        for n, b in zip(ncand[multi].tolist(), g_bytes[multi].tolist()):
            r = min(ranks[i : i + n], key=load.__getitem__)
            i += n
            load[r] += b
            chosen.append(r)
        reader[multi] = chosen
    return reader


# -- rounds -----------------------------------------------------------------------------------


class _Rounds(NamedTuple):
    """The round of every transfer of :class:`_Trees` (``int64``), and ``brought``: for each
    level-1 transfer (P2P relays, then broadcasts) the level-0 P2P send that took its piece to
    its holder."""

    e0: np.ndarray
    b0: np.ndarray
    e1: np.ndarray
    b1: np.ndarray
    brought: np.ndarray
    num_rounds: int


def _rounds(t: _Trees, pbytes: np.ndarray, topology: Topology, staging_bytes: int, max_ops: int) -> _Rounds:
    """Rounds from streams (module doc). A rank's budget is shared only by the kinds of buffer
    it holds: a reader that receives nothing gets windows of 9 parts, not 1."""
    world = topology.world_size
    part = staging_bytes // STAGING_PARTS
    n0, n1, nb0, nb1 = len(t.e0_src), len(t.e1_src), len(t.b0_root), len(t.b1_root)
    bc_ranks, bc_of = _broadcast_receivers(
        np.concatenate([t.b0_node, t.b1_node]), np.concatenate([t.b0_root, t.b1_root]), topology
    )
    relayed_bc = bc_of >= nb0

    def has(*ranks: np.ndarray) -> np.ndarray:
        out = np.zeros(world, dtype=bool)
        for r in ranks:
            out[r] = True
        return out

    sends0, relays = has(t.e0_src, t.b0_root), has(t.e1_src, t.b1_root)
    recv0, recv1 = has(t.e0_dst), has(t.e1_dst)
    kinds = recv0.astype(np.int64) + has(bc_ranks[~relayed_bc]) + recv1 + has(bc_ranks[relayed_bc])
    del bc_ranks, bc_of, relayed_bc
    w_rank = (staging_bytes - (2 * sends0 + kinds) * part) // np.maximum(sends0 + kinds, 1)
    assert (w_rank >= part).all()
    w_node = np.full(topology.num_nodes, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(w_node, topology.nodes_array(), w_rank)
    half = max_ops // 2
    o_send0 = np.where(recv0, half, max_ops)
    o_recv0 = max_ops - np.where(sends0, half, 0)
    o_send1 = np.where(recv1, half, max_ops)
    o_recv1 = max_ops - np.where(relays, half, 0)

    # Level 0. A reader's stream counts a piece's bytes once (on its last item) and one op per
    # send (broadcasts after sends of the same piece).
    l0_src = np.concatenate([t.e0_src, t.b0_root])
    l0_piece = np.concatenate([t.e0_piece, t.b0_piece])
    l0_kind = np.repeat(np.array([0, 1], np.int64), [n0, nb0])
    l0_dst = np.concatenate([t.e0_dst, np.full(nb0, -1, np.int64)])
    perm, start = _stream_order((l0_src,), (l0_piece, l0_kind, l0_dst))
    src_s, piece_s = l0_src[perm], l0_piece[perm]
    last = np.append(run_starts(src_s, piece_s)[1:], True)
    k_send = _windows(perm, start, np.where(last, pbytes[piece_s], 0), 1 - l0_kind[perm], w_rank[src_s], o_send0[src_s])
    del l0_src, l0_piece, l0_kind, l0_dst, perm, start, src_s, piece_s, last
    # A receiver's windows restart with each sender window: one sender's window of sends to
    # it is one round, not one per position in the receiver's own stream.
    e0_a, b0_a = k_send[:n0], k_send[n0:]
    k_recv0 = _window_of(
        (t.e0_dst, e0_a),
        (t.e0_src, t.e0_piece),
        pbytes[t.e0_piece],
        np.ones(n0, np.int64),
        w_rank[t.e0_dst],
        o_recv0[t.e0_dst],
    )
    k_b0 = _window_of(
        (t.b0_node, b0_a), (t.b0_root, t.b0_piece), pbytes[t.b0_piece], np.zeros(nb0, np.int64), w_node[t.b0_node], 1
    )
    l0_b = np.concatenate([k_recv0, k_b0])
    del k_recv0, k_b0

    # Level 1: the level-0 transfer that brought each relayed piece to its holder.
    l1_src = np.concatenate([t.e1_src, t.b1_root])
    l1_piece = np.concatenate([t.e1_piece, t.b1_piece])
    if len(l1_src):
        e0_code = t.e0_piece.astype(np.int64) * world + t.e0_dst
        e0_sort = np.argsort(e0_code, kind="stable")
        brought = e0_sort[np.searchsorted(e0_code[e0_sort], l1_piece.astype(np.int64) * world + l1_src)]
        del e0_code, e0_sort
    else:
        brought = np.zeros(0, np.int64)
    l1_kind = np.repeat(np.array([0, 1], np.int64), [n1, nb1])
    l1_dst = np.concatenate([t.e1_dst, np.full(nb1, -1, np.int64)])
    k_relay = _window_of(
        (l1_src,), (l1_piece, l1_kind, l1_dst), np.zeros(len(l1_src), np.int64), 1 - l1_kind, 1, o_send1[l1_src]
    )
    del l1_src, l1_piece, l1_kind, l1_dst
    fam_x, fam_b = k_send[brought], l0_b[brought]  # (x, b) of each relay's family
    e1, b1 = slice(0, n1), slice(n1, None)
    k_recv1 = _window_of(
        (t.e1_dst, fam_x[e1], fam_b[e1], k_relay[e1]),
        (t.e1_src, t.e1_piece),
        pbytes[t.e1_piece],
        np.ones(n1, np.int64),
        w_rank[t.e1_dst],
        o_recv1[t.e1_dst],
    )
    k_b1 = _window_of(
        (t.b1_node, fam_x[b1], fam_b[b1], k_relay[b1]),
        (t.b1_root, t.b1_piece),
        pbytes[t.b1_piece],
        np.zeros(nb1, np.int64),
        w_node[t.b1_node],
        1,
    )

    # Rounds: the distinct keys (x, b, level, relay window, relay receipt window), in order.
    num0, num1 = n0 + nb0, n1 + nb1
    rounds, num_rounds = dense_rank(
        np.concatenate([k_send, fam_x]),
        np.concatenate([l0_b, fam_b]),
        np.repeat(np.array([0, 1], np.int64), [num0, num1]),
        np.concatenate([np.zeros(num0, np.int64), k_relay]),
        np.concatenate([np.zeros(num0, np.int64), k_recv1, k_b1]),
    )
    return _Rounds(
        e0=rounds[:n0],
        b0=rounds[n0:num0],
        e1=rounds[num0 : num0 + n1],
        b1=rounds[num0 + n1 :],
        brought=brought,
        num_rounds=num_rounds,
    )


# -- the planner ------------------------------------------------------------------------------


def _plan_rank(
    table: NeedTable,
    index: CheckpointIndex,
    topology: Topology,
    readers: np.ndarray,
    scope: str,
    staging_bytes: int,
    max_ops: int,
    rank: int,
) -> Schedule:
    """:func:`plan_transfers` with ``rank`` (its doc): the whole-job plan of the rows that are
    not local reads, merged with this rank's local reads.

    Why the rows are the whole job's: a local read is a read group whose only needer reads it
    (``alone`` and a reader). It is in no tree and no stream, so the transfers, windows and
    rounds of the others do not change without it; it is read in round -1 and stages
    nothing. It enters the rest of the plan only through its reader's load in the greedy
    choice of readers (``base_load``) and ``cost.read_bytes``, which take every rank's local
    bytes (a bincount). A row wrongly taken as not alone only moves a local read into the
    whole-job part, where it is planned as one: the same rows again."""
    world = topology.world_size
    local = np.zeros(len(table), bool) if table.alone is None else table.alone & readers[table.rank]
    keys = index.key_columns(table.keys)
    local_bytes = table.bytes_per_rank(np.flatnonzero(local), keys[0], world)
    local_bytes += packed_bytes_delta(table, local, index, keys[0], world)
    if table.omitted_bytes is not None:  # other ranks' alone rows, left out of a table built for this rank
        local_bytes += table.omitted_bytes
    if local.all():  # every need a local read (FSDP-sharded parameters, shared storage): no transfers
        shared = no_transfers(table, topology, staging_bytes, max_ops)
    else:
        shared = plan_pieces(
            cut_pieces(table.take(~local), index, staging_bytes, keys),
            topology,
            readers,
            scope,
            staging_bytes,
            max_ops,
            base_load=local_bytes,
        )
    mine = cut_pieces(table.take(local & (table.rank == rank)), index, staging_bytes, keys)
    h = hashlib.sha256(shared.fingerprint.encode())
    h.update(local_bytes.tobytes())
    # The local reads themselves (two experts swapped between ranks: the same bytes, no transfer).
    h.update(table.digest if table.digest is not None else _table_digest(table))
    return _with_local_reads(shared, mine, rank, local_bytes, h.hexdigest()[:16])


def packed_bytes_delta(
    table: NeedTable, rows: np.ndarray, index: CheckpointIndex, itemsize: np.ndarray, world: int
) -> np.ndarray:
    """``int64[world]``: what the rows ``rows`` (``bool[N]``) of packed weights' logical keys
    read (packed values and scales, :func:`~moeshard.io.packed.blob_nbytes`) minus what
    ``table.bytes_per_rank`` counts for them (their logical elements at ``itemsize``)."""
    out = np.zeros(world, np.int64)
    if not index.packed:
        return out
    packed = {k: pw for k, key in enumerate(table.keys) if (pw := index.packed.get(key)) is not None}
    if not packed:
        return out
    for r in np.flatnonzero(rows & np.isin(table.key, list(packed))).tolist():
        k = int(table.key[r])
        nd = int(table.ndim[k])
        box = tuple(zip(table.src_off[r, :nd].tolist(), table.src_len[r, :nd].tolist()))
        out[table.rank[r]] += blob_nbytes(packed[k], box, index.tensors) - int(np.prod(table.src_len[r, :nd])) * int(
            itemsize[k]
        )
    return out


def no_transfers(table: NeedTable, topology: Topology, staging_bytes: int, max_ops: int) -> Schedule:
    """What :func:`plan_pieces` makes of no pieces (over ``table``'s keys), without its ~100 numpy
    calls on empty columns: no reads, sends or rounds, zero cost (the same arrays, dtypes and
    fingerprint, tests/test_pieces.py)."""
    world, d = topology.world_size, table.width
    i32, i64 = np.zeros(0, np.int32), np.zeros(0, np.int64)
    box = np.zeros((0, d), np.int64)
    zeros = np.zeros(world, np.int64)
    cost = PlanCost(
        read_bytes=zeros,
        sent_bytes=zeros.copy(),
        recv_bytes=zeros.copy(),
        peak_staging_bytes=zeros.copy(),
        cross_node_bytes=0,
        num_p2p_ops=0,
        num_batches=0,
        num_broadcasts=0,
    )
    return Schedule(
        topology=topology.with_rank(0),
        staging_bytes=staging_bytes,
        max_ops=max_ops,
        keys=table.keys,
        key_ndim=table.ndim,
        pieces=PieceTable(i32, box, box, i64),
        reads=ReadTable(i32, i32, i64),
        sends=SendTable(i32, i32, i32, i64),
        bcasts=BcastTable(i32, i32, i32, i64),
        deliveries=DeliveryTable(i32, i32, i32, i64, box),
        num_rounds=0,
        cost=cost,
    )


def _table_digest(table: NeedTable) -> bytes:
    """A digest of every row of ``table`` (its keys too) in a few numpy passes over the columns
    (0.16-0.2 s for DeepSeek-V3's 4.7 million rows at 8,192 ranks): each row's values mixed by
    multiply-adds in ``uint64``, rows weighted by their position. Ranks compare it to catch
    tables that differ (a different placement or model), not an adversary."""
    n = len(table)
    odd = np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        mix = table.rank.astype(np.uint64)
        for col in (table.param, table.key):
            mix *= odd
            mix += col.astype(np.uint64)
        for col in (table.slot[:, None], table.src_off, table.src_len, table.dst_off):
            # A box's dims in one pass: a product with powers of ``odd``.
            w = np.cumprod(np.full(col.shape[1], odd, dtype=np.uint64))
            mix *= w[-1]
            mix += col.view(np.uint64) @ w[::-1]
        mix ^= mix >> np.uint64(29)
        mix *= np.arange(1, 2 * n + 1, 2, dtype=np.uint64)  # row i weighs 2i + 1: order counts
        total = np.bitwise_xor.reduce(mix) if n else np.uint64(0)
    h = hashlib.sha256(np.asarray([n, int(mix.sum(dtype=np.uint64)) if n else 0, int(total)], np.uint64).tobytes())
    h.update(repr(table.keys).encode())
    return h.digest()


def _with_local_reads(shared: Schedule, mine: Pieces, rank: int, local_bytes: np.ndarray, basis: str) -> Schedule:
    """``shared`` with ``mine`` added as ``rank``'s local reads (round -1), their pieces after
    ``shared``'s (whose numbers, and so the order of every rank's transfers, stay as they are
    on every rank), and every rank's ``local_bytes`` added to ``cost.read_bytes``."""
    first = shared.num_pieces
    mid = np.arange(first, first + mine.num_pieces, dtype=np.int32)
    read_rank = np.concatenate([shared.reads.rank, np.full(len(mid), rank, np.int32)])
    read_piece = np.concatenate([shared.reads.piece, mid])
    rperm = lex_order(read_rank, read_piece)  # reads by reader, as in the whole job's schedule
    cost = dataclasses.replace(shared.cost, read_bytes=shared.cost.read_bytes + local_bytes)
    sp, sd = shared.pieces, shared.deliveries
    return dataclasses.replace(
        shared,
        pieces=PieceTable(
            np.concatenate([sp.key, mine.piece_key]),
            np.concatenate([sp.off, mine.piece_off]),
            np.concatenate([sp.len, mine.piece_len]),
            np.concatenate([sp.bytes, mine.piece_bytes]),
        ),
        reads=ReadTable(
            read_rank[rperm],
            read_piece[rperm],
            np.concatenate([shared.reads.round, np.full(len(mid), -1, np.int64)])[rperm],
        ),
        # Deliveries stay sorted by (piece, rank): ``mine``'s pieces come after.
        deliveries=DeliveryTable(
            np.concatenate([sd.piece, mine.dlv_piece + first]),
            np.concatenate([sd.rank, mine.dlv_rank]),
            np.concatenate([sd.param, mine.dlv_param]),
            np.concatenate([sd.slot, mine.dlv_slot]),
            np.concatenate([sd.off, mine.dlv_off]),
        ),
        cost=cost,
        rank=rank,
        basis=basis,
    )


def plan_pieces(
    pieces: Pieces,
    topology: Topology,
    readers: np.ndarray,
    scope: str,
    staging_bytes: int,
    max_ops: int,
    base_load: np.ndarray | None = None,
) -> Schedule:
    world = topology.world_size
    t = _trees(pieces, topology, readers, scope, base_load)
    r = _rounds(t, pieces.piece_bytes, topology, staging_bytes, max_ops)
    read_round, read_end = _read_rounds(t, r, world)
    sends = (
        np.concatenate([t.e0_src, t.e1_src]),
        np.concatenate([t.e0_dst, t.e1_dst]),
        np.concatenate([t.e0_piece, t.e1_piece]),
        np.concatenate([r.e0, r.e1]),
    )
    bcasts = (
        np.concatenate([t.b0_node, t.b1_node]),
        np.concatenate([t.b0_root, t.b1_root]),
        np.concatenate([t.b0_piece, t.b1_piece]),
        np.concatenate([r.b0, r.b1]),
    )
    cost = _cost(t, r, pieces.piece_bytes, read_round, read_end, sends, bcasts, topology)
    del read_end
    rperm = lex_order(t.reader, t.g_piece)  # reads in piece order per reader
    return Schedule(
        topology=topology.with_rank(0),
        staging_bytes=staging_bytes,
        max_ops=max_ops,
        keys=pieces.keys,
        key_ndim=pieces.key_ndim,
        pieces=PieceTable(pieces.piece_key, pieces.piece_off, pieces.piece_len, pieces.piece_bytes),
        reads=ReadTable(t.reader[rperm].astype(np.int32), t.g_piece[rperm].astype(np.int32), read_round[rperm]),
        sends=SendTable(sends[0].astype(np.int32), sends[1].astype(np.int32), sends[2].astype(np.int32), sends[3]),
        bcasts=BcastTable(
            bcasts[0].astype(np.int32), bcasts[1].astype(np.int32), bcasts[2].astype(np.int32), bcasts[3]
        ),
        deliveries=DeliveryTable(pieces.dlv_piece, pieces.dlv_rank, pieces.dlv_param, pieces.dlv_slot, pieces.dlv_off),
        num_rounds=r.num_rounds,
        cost=cost,
    )


def _read_rounds(t: _Trees, r: _Rounds, world: int) -> tuple[np.ndarray, np.ndarray]:
    """``(first, last)``, ``int64[G]``: the rounds each group's reader first and last sends its
    piece in (its buffer's lifetime); -1 for a local read (straight into place, any time)."""
    g_piece, reader = t.g_piece, t.reader
    r_groups = np.flatnonzero(~t.local)
    read_round = np.full(len(g_piece), -1, dtype=np.int64)
    read_end = np.full(len(g_piece), -1, dtype=np.int64)
    # Level-0 items of a group are those of its (reader, piece): their runs, in (piece,
    # reader) order, are the remote groups in order.
    code = np.concatenate([t.e0_piece, t.b0_piece]).astype(np.int64) * world + np.concatenate([t.e0_src, t.b0_root])
    srt = np.argsort(code, kind="stable")
    code = code[srt]
    first = np.flatnonzero(run_starts(code))
    assert np.array_equal(code[first], g_piece[r_groups].astype(np.int64) * world + reader[r_groups]), (
        "every remote group sends its piece, and only those send"
    )
    if len(first):
        l0_round = np.concatenate([r.e0, r.b0])[srt]
        read_round[r_groups] = np.minimum.reduceat(l0_round, first)
        read_end[r_groups] = np.maximum.reduceat(l0_round, first)
    return read_round, read_end


def _cost(
    t: _Trees,
    r: _Rounds,
    pbytes: np.ndarray,
    read_round: np.ndarray,
    read_end: np.ndarray,
    sends: tuple[np.ndarray, ...],
    bcasts: tuple[np.ndarray, ...],
    topology: Topology,
) -> PlanCost:
    """Counters of a schedule and its exact staging peak per rank. ``sends``: ``(src, dst,
    piece, round)``; ``bcasts``: ``(node, root, piece, round)``; ``read_round``, ``read_end``:
    each group's buffer lifetime (:func:`_read_rounds`)."""
    world = topology.world_size
    node_of = topology.nodes_array()
    src, dst, piece, rounds = sends
    bc_node, bc_root, bc_piece, bc_round = bcasts
    bc_ranks, bc_of = _broadcast_receivers(bc_node, bc_root, topology)
    sb = pbytes[piece]
    g_bytes = pbytes[t.g_piece]
    read_bytes = np.bincount(t.reader, weights=g_bytes, minlength=world).astype(np.int64)
    sent = (
        np.bincount(src, weights=sb, minlength=world)
        + np.bincount(bc_root, weights=pbytes[bc_piece] * (topology.node_sizes()[bc_node] - 1), minlength=world)
    ).astype(np.int64)
    recv = (
        np.bincount(dst, weights=sb, minlength=world)
        + np.bincount(bc_ranks, weights=pbytes[bc_piece[bc_of]], minlength=world)
    ).astype(np.int64)
    cross_node = int(sb[node_of[src] != node_of[dst]].sum())
    del sb
    # A holder keeps what it received until its last relay of it.
    relay_end = np.full(len(t.e0_src), -1, dtype=np.int64)
    np.maximum.at(relay_end, r.brought, np.concatenate([r.e1, r.b1]))
    np.maximum(relay_end, r.e0, out=relay_end)
    r_groups = np.flatnonzero(~t.local)

    def holds():  # one kind of buffer at a time: each is as long as the pieces
        yield t.reader[r_groups], g_bytes[r_groups], read_round[r_groups], read_end[r_groups]
        yield t.e0_dst, pbytes[t.e0_piece], r.e0, relay_end
        yield t.e1_dst, pbytes[t.e1_piece], r.e1, r.e1
        yield bc_ranks, pbytes[bc_piece[bc_of]], bc_round[bc_of], bc_round[bc_of]

    num = len(r_groups) + len(t.e0_dst) + len(t.e1_dst) + len(bc_ranks)
    return PlanCost(
        read_bytes=read_bytes,
        sent_bytes=sent,
        recv_bytes=recv,
        peak_staging_bytes=peak_held_bytes(world, r.num_rounds, num, holds()),
        cross_node_bytes=cross_node,
        num_p2p_ops=len(src),
        num_batches=int((np.bincount(rounds, minlength=r.num_rounds) > 0).sum()),
        num_broadcasts=len(bc_root),
    )


def _broadcast_receivers(node: np.ndarray, root: np.ndarray, topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    """``(rank, broadcast)``: every receiving rank of every broadcast (its node but the root)."""
    members = np.argsort(topology.nodes_array(), kind="stable")  # ranks, node by node
    size = topology.node_sizes()
    of, pos = expand_runs((np.cumsum(size) - size)[node], size[node])  # positions of each node's ranks
    ranks = members[pos]
    keep = ranks != root[of]
    return ranks[keep], of[keep]


def peak_held_bytes(world: int, num_rounds: int, num: int, holds) -> np.ndarray:
    """``int64[world]``: the most bytes each rank holds at once, given ``num`` buffers as
    ``(rank, bytes, first round, last round)`` column groups (``holds``: an iterable of them;
    rounds ``0 .. num_rounds - 1``). A buffer is held from the start of its first round to the
    end of its last: in a round, releases come before acquisitions.

    What a rank holds right after its acquisitions at round ``t`` is what it acquired at
    rounds ``<= t`` minus what it released at rounds ``<= t`` (last round ``< t``); its peak is
    the largest of these. Both are running sums over events sorted by (rank, round): two sorts
    of ``num`` events rather than one of ``2 x num`` tagged ones."""
    if not num:
        return np.zeros(world, dtype=np.int64)
    span = num_rounds + 1  # event times are rounds 0 .. num_rounds
    acq = np.empty(num, dtype=np.int64)  # (rank, time) codes
    rel = np.empty(num, dtype=np.int64)
    nbytes = np.empty(num, dtype=np.int64)
    pos = 0
    for rank, b, first, last in holds:
        s = slice(pos, pos + len(rank))
        acq[s] = rank
        acq[s] *= span
        rel[s] = acq[s]
        acq[s] += first
        rel[s] += last
        rel[s] += 1
        nbytes[s] = b
        pos = s.stop
    assert pos == num
    order = np.argsort(acq)  # any order of equal codes gives the same sums at a code's last event
    acq = acq[order]
    held = nbytes[order]
    np.cumsum(held, out=held)
    order = np.argsort(rel)
    rel = rel[order]
    freed = nbytes[order]
    del order, nbytes
    np.cumsum(freed, out=freed)
    # At the last acquisition of each (rank, round): bytes acquired so far, minus bytes released
    # so far (earlier ranks' buffers are all acquired and released before: they cancel out).
    ends = np.flatnonzero(np.append(acq[1:] != acq[:-1], True))
    k = np.searchsorted(rel, acq[ends], side="right")
    value = held[ends] - np.where(k > 0, freed[np.maximum(k - 1, 0)], 0)
    rank = acq[ends] // span
    first = np.flatnonzero(run_starts(rank))
    out = np.zeros(world, dtype=np.int64)
    out[rank[first]] = np.maximum.reduceat(value, first)
    return out


def minimal_cost(
    needs: NeedTable | Pieces | Sequence, index: CheckpointIndex, topology: Topology, readers, scope: Scope = "job"
) -> dict:
    """Lower bounds for any plan of these needs (pure): storage bytes (each needed byte once
    per scope), network bytes (every needer that is not the one reader of its scope) and bytes
    crossing nodes. Numpy over (piece, rank) and (piece, node) pairs. ``needs`` may be the
    :class:`~moeshard.plan.pieces.Pieces` a plan was made from (cut pieces give the same
    bounds: a piece's children have its needers and share its bytes)."""
    readers = np.asarray(readers, dtype=bool)
    world = topology.world_size
    if readers.shape != (world,):
        raise ValueError(f"readers must be bool[{world}], got shape {readers.shape}")
    if scope not in ("job", "node"):
        raise ValueError(f"scope must be 'job' or 'node', got {scope!r}")
    if isinstance(needs, NeedTable) and needs.full is not None:
        raise ValueError("lower bounds need every rank's needs, not a table built for one rank's plan")
    with paused_gc():
        pieces = _pieces(needs, index, None)
        if not len(pieces.dlv_piece):
            return {"read_bytes": 0, "network_bytes": 0, "cross_node_bytes": 0}
        return _minimal(pieces, topology, readers, scope)


def _minimal(pieces: Pieces, topology: Topology, readers: np.ndarray, scope: str) -> dict:
    num_nodes = topology.num_nodes
    node_of = topology.nodes_array()
    nbytes = pieces.piece_bytes
    num_pieces = pieces.num_pieces
    p_pid, p_rank = pieces.pairs()
    p_node = node_of[p_rank]
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
        node_has_reader = np.bincount(node_of[np.flatnonzero(readers)], minlength=num_nodes) > 0
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
