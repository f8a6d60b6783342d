"""The reshard planner: fill a model on a new mesh from the boxes live ranks still hold.

A reshard is a load whose sources are the live holders of each box: the survivors' (and, for a
planned resize, every old rank's) local tensors of the old model, described as *holdings*; the
new model's local tensors are described as *needs*. Both are rows over *units*: a dense tensor
(its global shape), or one logical expert of an expert parameter (its slice shape; every slot of
that expert, old or new, is a row of the same unit). The planner cuts each unit into *cells* at
every holding's and need's boundary, so that every cell lies wholly inside or outside each
holding; per cell and needing rank it picks a source:

* the rank itself, when it holds the cell (a copy from its old local tensor: ``copy_view``,
  round -1);
* else a live holder, same node first, the one that has sent the fewest bytes so far (a send
  from the holder's view: ``send_view``), in the first round whose budgets allow it;
* else storage: the cell is returned in :class:`StorageCells` (the caller reads it with the
  load planner), and when it is a dense unit's the plan names it in ``dense_from_storage`` (a
  checkpoint is older than the live weights: mixing training steps).

Pure and torch-free: every rank computes the same plan from the same tables. Ranks are the new
group's; a joiner holds nothing.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from ..topology import Topology
from .schedule import (
    CopyTable,
    DeliveryTable,
    PieceTable,
    PlanCost,
    ReadTable,
    Schedule,
    SendTable,
    ViewTable,
)

__all__ = ["Units", "BoxRows", "StorageCells", "ReshardPlan", "plan_reshard"]


@dataclass(frozen=True)
class Units:
    """The units of a reshard (``U`` of them).

    Args:
        keys: a name per unit (a dense tensor's name; ``"<param>[<expert>]"`` for an expert).
        ndim: ``int64[U]`` dims of each unit (an expert's: its slice's).
        itemsize: ``int64[U]`` bytes per element of the buffers that carry it (the holders' dtype).
        dense: ``bool[U]`` whether a unit is a dense tensor (not an expert).
    """

    keys: tuple[str, ...]
    ndim: np.ndarray
    itemsize: np.ndarray
    dense: np.ndarray

    def __post_init__(self) -> None:
        assert len(self.ndim) == len(self.itemsize) == len(self.dense) == len(self.keys)


@dataclass(frozen=True)
class BoxRows:
    """Rows ``(unit, rank, param, slot, box)`` (``N`` rows, ``D`` padded dims): rank ``rank[i]``
    holds (or needs) box ``(off[i], len[i])`` of unit ``unit[i]`` in its local tensor of parameter
    number ``param[i]``, in local slot ``slot[i]`` (-1: no slot), where the box starts at
    ``local[i]`` (local coordinates). ``int64`` arrays; ``off``, ``len``, ``local``: ``[N, D]``."""

    unit: np.ndarray
    rank: np.ndarray
    param: np.ndarray
    slot: np.ndarray
    off: np.ndarray
    len: np.ndarray
    local: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.unit)
        assert all(len(a) == n for a in (self.rank, self.param, self.slot, self.off, self.len, self.local))

    @staticmethod
    def empty(width: int) -> BoxRows:
        z = np.zeros(0, np.int64)
        zz = np.zeros((0, width), np.int64)
        return BoxRows(z, z, z, z, zz, zz, zz)


@dataclass(frozen=True)
class StorageCells:
    """The cells no live rank holds (``M`` rows, ``D`` padded dims), to be read from storage:
    rank ``rank[i]`` needs box ``(off[i], len[i])`` of unit ``unit[i]`` at ``dst[i]`` in its
    local tensor of new parameter ``param[i]`` (slot ``slot[i]``). ``int64`` arrays."""

    unit: np.ndarray
    rank: np.ndarray
    param: np.ndarray
    slot: np.ndarray
    off: np.ndarray
    len: np.ndarray
    dst: np.ndarray

    def __len__(self) -> int:
        return len(self.unit)


@dataclass(frozen=True, eq=False)
class ReshardPlan:
    """What a reshard does (the same on every rank).

    Args:
        schedule: the transfers from live holders (keys are the units'; ``view_*`` rows are
            boxes of the old local tensors, ``dlv_*`` rows boxes of the new ones).
        storage: the cells to read from storage.
        storage_boxes: ``(unit key, box)`` of every distinct cell in ``storage``, sorted.
        dense_from_storage: the dense units some of whose cells come from storage, sorted.
        peer_bytes, copy_bytes: job-wide bytes sent between ranks and copied within a rank (the
            holders' dtype).
        storage_bytes: bytes of the distinct boxes in ``storage_boxes`` (the units' itemsize):
            what a plan reading each box once reads.
    """

    schedule: Schedule
    storage: StorageCells
    storage_boxes: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]
    dense_from_storage: tuple[str, ...]
    peer_bytes: int
    copy_bytes: int
    storage_bytes: int
    fingerprint: str = field(default="")


def _unit_rows(units: np.ndarray, width: int, ndim: np.ndarray) -> np.ndarray:
    """``bool[len(units), width]``: which padded dims of each row (of unit ``units[i]``) are its unit's."""
    return np.arange(width)[None, :] < ndim[units][:, None]


def _ranges(start: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``int64[count.sum()]``: ``start[i], ..., start[i] + count[i] - 1`` for each ``i``, concatenated."""
    return np.repeat(start - (np.cumsum(count) - count), count) + np.arange(int(count.sum()), dtype=np.int64)


def _cells(units: Units, holds: BoxRows, needs: BoxRows, width: int) -> _Cells:
    """Every need box cut at every boundary of its unit's holdings and needs (so that a cell lies
    wholly inside or outside each holding), in the order: unit, need row, then the cells of a row
    in row-major order of their per-dim intervals (dim 0 outermost).

    Returns a :class:`_Cells`: ``int64[C]`` need row and unit of each cell, ``int64[C, width]`` its
    box (dims past the unit's ``ndim``: offset 0, length 1), ``bool[C, width]`` its unit's dims."""
    nd_all = units.ndim
    n_order = np.argsort(needs.unit, kind="stable")
    # Cut points as keys (unit, dim, point) encoded in one int64, sorted and distinct.
    pts, grp = [], []
    for rows in (holds, needs):
        valid = _unit_rows(rows.unit, width, nd_all)
        g = rows.unit[:, None] * width + np.arange(width)[None, :]
        for a in (rows.off, rows.off + rows.len):
            pts.append(a[valid])
            grp.append(g[valid])
    pts_a, grp_a = np.concatenate(pts), np.concatenate(grp)
    scale = int(pts_a.max(initial=0)) + 1
    if (int(grp_a.max(initial=0)) + 1) * scale >= 2**62:
        raise ValueError("tensor shapes too large to plan a reshard (cut keys overflow int64)")
    cuts = np.unique(grp_a * scale + pts_a)
    nu = needs.unit[n_order]
    valid = _unit_rows(nu, width, nd_all)
    g = nu[:, None] * width + np.arange(width)[None, :]
    a = needs.off[n_order]
    b = a + needs.len[n_order]
    lo = np.searchsorted(cuts, g * scale + a)  # the cut at a
    hi = np.searchsorted(cuts, g * scale + b)  # the cut at b
    count = np.where(valid, hi - lo, 1)  # intervals per dim
    per_row = np.prod(count, axis=1)
    total = int(per_row.sum())
    row = np.repeat(n_order, per_row)
    first = np.repeat(np.cumsum(per_row) - per_row, per_row)
    k = np.arange(total, dtype=np.int64) - first  # index of the cell within its row
    lo_r, cnt_r, val_r = np.repeat(lo, per_row, 0), np.repeat(count, per_row, 0), np.repeat(valid, per_row, 0)
    off = np.zeros((total, width), np.int64)
    ln = np.ones((total, width), np.int64)
    for d in range(width - 1, -1, -1):  # last dim fastest
        j = k % cnt_r[:, d]
        k = k // cnt_r[:, d]
        v = val_r[:, d]
        idx = lo_r[v, d] + j[v]
        off[v, d] = cuts[idx] % scale
        ln[v, d] = cuts[idx + 1] % scale - off[v, d]
    c_unit = needs.unit[row]
    return _Cells(row, c_unit, off, ln, _unit_rows(c_unit, width, nd_all))


@dataclass(frozen=True)
class _Cells:
    """The cells (``C`` rows, ``D`` padded dims): need row, unit, box and valid dims of each."""

    row: np.ndarray  # int64[C]
    unit: np.ndarray  # int64[C]
    off: np.ndarray  # int64[C, D]
    len: np.ndarray  # int64[C, D]
    valid: np.ndarray  # bool[C, D]


@dataclass(frozen=True)
class _Holdings:
    """Pairs (cell, holding) with the cell inside the holding (``P`` pairs), and which cells are held."""

    cell: np.ndarray  # int64[P], ascending (then holding row)
    hold: np.ndarray  # int64[P]
    held: np.ndarray  # bool[C]


@dataclass(frozen=True)
class _Runs:
    """Piece instances: a run of each travelling cell (``Q`` rows, ``D`` padded dims)."""

    cell: np.ndarray  # int64[Q] the cell of each run
    unit: np.ndarray  # int64[Q]
    off: np.ndarray  # int64[Q, D] (0 past the unit's dims)
    len: np.ndarray  # int64[Q, D] (1 past the unit's dims)
    len_p: np.ndarray  # int64[Q, D] (0 past the unit's dims)
    valid: np.ndarray  # bool[Q, D]


@dataclass(frozen=True)
class _DistinctPieces:
    """Distinct (unit, box) of the runs (``K`` pieces) and the piece of each run."""

    of_run: np.ndarray  # int64[Q]
    unit: np.ndarray  # int64[K]
    off: np.ndarray  # int64[K, D]
    len: np.ndarray  # int64[K, D]
    bytes: np.ndarray  # int64[K]
    cell: np.ndarray  # int64[K] the cell whose holders hold the piece


@dataclass(frozen=True)
class _Deliveries:
    """Deliveries (``E`` rows, by (piece, rank)) and the distinct (piece, receiver) pairs (``T``)."""

    pid: np.ndarray  # int64[E]
    rank: np.ndarray  # int64[E]
    row: np.ndarray  # int64[E] need row
    dst: np.ndarray  # int64[E, D] local offset in the receiver's tensor
    t_pid: np.ndarray  # int64[T]
    t_rank: np.ndarray  # int64[T]


@dataclass(frozen=True)
class _Holders:
    """Holders of each (piece, receiver) pair (``X`` rows) and the receiver's own holding."""

    t: np.ndarray  # int64[X] the pair
    hold: np.ndarray  # int64[X] holding row
    rank: np.ndarray  # int64[X] holder rank
    own: np.ndarray  # bool[X] held by the receiver
    t_own: np.ndarray  # int64[T] first own holding row (-1: none)


@dataclass(frozen=True)
class _Views:
    """Distinct (holding, piece) views (``V``) and the view of each (piece, receiver) pair."""

    of_t: np.ndarray  # int64[T]
    row: np.ndarray  # int64[V] holding row
    off: np.ndarray  # int64[V, D] local offset in the holder's tensor


@dataclass(frozen=True)
class _StorageSummary:
    """The distinct storage boxes (sorted), their bytes, and the dense units among them (sorted)."""

    boxes: tuple
    bytes: int
    dense: tuple[str, ...]


def _holdings(holds: BoxRows, cells: _Cells, num_units: int, width: int, ndim: np.ndarray) -> _Holdings:
    """Pairs cell x holding of its unit (``int64[P]`` each) where the cell lies inside the
    holding, in cell order, then holding row; ``bool[C]`` whether each cell is held."""
    c_unit, c_off, c_len = cells.unit, cells.off, cells.len
    h_order = np.argsort(holds.unit, kind="stable")
    h_start = np.searchsorted(holds.unit[h_order], np.arange(num_units + 1))
    n_h = (h_start[1:] - h_start[:-1])[c_unit]
    pair_cell = np.repeat(np.arange(len(cells.row)), n_h)
    pair_hold = h_order[_ranges(h_start[c_unit], n_h)]
    h_lo, h_hi = holds.off[pair_hold], holds.off[pair_hold] + holds.len[pair_hold]
    p_lo, p_hi = c_off[pair_cell], c_off[pair_cell] + c_len[pair_cell]
    pv = _unit_rows(c_unit[pair_cell], width, ndim)
    inside = np.all(~pv | ((h_lo <= p_lo) & (p_hi <= h_hi)), axis=1)
    pair_cell, pair_hold = pair_cell[inside], pair_hold[inside]  # cell order, then holding row
    held = np.zeros(len(cells.row), bool)
    held[pair_cell] = True
    return _Holdings(pair_cell, pair_hold, held)


def _storage(needs: BoxRows, cells: _Cells, held: np.ndarray) -> StorageCells:
    """The cells (``bool[C]`` ``held`` false) no live rank holds, as :class:`StorageCells`
    (``M`` rows; boxes ``int64[M, D]``, 0 past the unit's dims)."""
    row, c_off, c_len, valid_c = cells.row, cells.off, cells.len, cells.valid
    dst_c = np.where(valid_c, needs.local[row] + c_off - needs.off[row], 0)
    s = ~held
    return StorageCells(
        cells.unit[s],
        needs.rank[row[s]],
        needs.param[row[s]],
        needs.slot[row[s]],
        np.where(valid_c[s], c_off[s], 0),
        np.where(valid_c[s], c_len[s], 0),
        dst_c[s],
    )


def _runs(cells: _Cells, held: np.ndarray, itemsize: np.ndarray, staging_bytes: int) -> _Runs:
    """The held cells (``bool[C]``) cut to the staging budget along their first dim of length > 1
    (a run is at least one index: a larger index stays whole): ``Q`` runs, boxes ``[Q, D]``."""
    c_unit, c_off, c_len, valid_c = cells.unit, cells.off, cells.len, cells.valid
    cell = np.flatnonzero(held)
    u_c = c_unit[cell]
    ln = c_len[cell]
    nbytes = np.prod(ln, axis=1) * itemsize[u_c]
    max_cell = max(1, staging_bytes)
    big = (ln > 1) & valid_c[cell]
    has = big.any(axis=1)
    d_cut = np.argmax(big, axis=1)
    n_d = ln[np.arange(len(cell)), d_cut]
    cut = (nbytes > max_cell) & has
    step = np.where(cut, np.maximum(1, max_cell // np.maximum(1, nbytes // n_d)), n_d)
    n_runs = np.where(cut, -(-n_d // step), 1)
    q_cell = np.repeat(cell, n_runs)  # a piece instance per run of each travelling cell
    q_run = np.arange(len(q_cell)) - np.repeat(np.cumsum(n_runs) - n_runs, n_runs)
    q_d = np.repeat(d_cut, n_runs)
    q_step = np.repeat(step, n_runs)
    q_off = c_off[q_cell].copy()
    q_len = c_len[q_cell].copy()
    rr = np.arange(len(q_cell))
    base = q_off[rr, q_d]
    q_off[rr, q_d] = base + q_run * q_step
    q_len[rr, q_d] = np.minimum(q_step, c_len[q_cell, q_d] - q_run * q_step)
    q_unit = c_unit[q_cell]
    q_valid = valid_c[q_cell]
    q_off = np.where(q_valid, q_off, 0)
    q_len_p = np.where(q_valid, q_len, 0)
    return _Runs(q_cell, q_unit, q_off, q_len, q_len_p, q_valid)


def _first_numbering(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of ``key`` (``int64[N, k]``, ``N > 0``) numbered in order of first
    appearance: ``(number of each row int64[N], first row of each number int64[K])``."""
    _, first, inv = np.unique(key, axis=0, return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    order = np.argsort(first)
    num = np.empty(len(first), np.int64)
    num[order] = np.arange(len(first))
    return num[inv], first[order]


def _pieces(runs: _Runs, itemsize: np.ndarray) -> _DistinctPieces:
    """Pieces: distinct (unit, box) of the ``Q`` runs, numbered in order of first appearance
    (``K`` pieces; boxes ``int64[K, D]``, bytes ``int64[K]``)."""
    i64 = np.int64
    key = np.concatenate([runs.unit[:, None], runs.off, runs.len_p], axis=1)
    if len(key):
        q_pid, p_first = _first_numbering(key)
    else:
        q_pid, p_first = np.zeros(0, i64), np.zeros(0, i64)
    num = len(p_first)
    piece_unit = runs.unit[p_first]
    pbytes = np.prod(runs.len[p_first], axis=1) * itemsize[piece_unit] if num else np.zeros(0, i64)
    return _DistinctPieces(q_pid, piece_unit, runs.off[p_first], runs.len_p[p_first], pbytes, runs.cell[p_first])


def _deliveries(needs: BoxRows, row: np.ndarray, runs: _Runs, q_pid: np.ndarray) -> _Deliveries:
    """Deliveries of the ``Q`` runs (need row of each cell ``row`` ``int64[C]``, piece of each
    run ``q_pid`` ``int64[Q]``) by (piece, rank), then in order of appearance; the distinct
    pairs are the (piece, receiver) pairs to source."""
    q_rank = needs.rank[row[runs.cell]]
    d_order = np.lexsort((np.arange(len(q_pid)), q_rank, q_pid))
    d_pid, d_rank = q_pid[d_order], q_rank[d_order]
    d_row = row[runs.cell[d_order]]
    d_dst = np.where(runs.valid[d_order], needs.local[d_row] + runs.off[d_order] - needs.off[d_row], 0)
    new = np.ones(len(d_pid), bool)
    new[1:] = (d_pid[1:] != d_pid[:-1]) | (d_rank[1:] != d_rank[:-1])
    return _Deliveries(d_pid, d_rank, d_row, d_dst, d_pid[new], d_rank[new])


def _holders(holds: BoxRows, pairs: _Holdings, num_cells: int, piece_cell: np.ndarray, dl: _Deliveries) -> _Holders:
    """Holders of each of the ``T`` (piece, receiver) pairs: the pairs of its piece's cell
    (holding rows ascending), ``X`` rows; and the first holding of the receiver's own
    (``int64[T]``, -1: none)."""
    cell_start = np.searchsorted(pairs.cell, np.arange(num_cells + 1))
    t_cell = piece_cell[dl.t_pid]
    t_n = cell_start[t_cell + 1] - cell_start[t_cell]
    x_t = np.repeat(np.arange(len(dl.t_pid)), t_n)
    x_hold = pairs.hold[_ranges(cell_start[t_cell], t_n)]
    x_rank = holds.rank[x_hold]
    own = x_rank == dl.t_rank[x_t]
    t_own = np.full(len(dl.t_pid), -1, np.int64)
    ot, oi = np.unique(x_t[own], return_index=True)  # the first own holding of each pair
    t_own[ot] = x_hold[own][oi]
    return _Holders(x_t, x_hold, x_rank, own, t_own)


def _sources(x: _Holders, t_rank: np.ndarray, t_bytes: np.ndarray, node: np.ndarray, world: int) -> np.ndarray:
    """``int64[T]`` source holding row of each (piece, receiver) pair (receiver ``t_rank``,
    piece bytes ``t_bytes``, ``int64[T]``): its own holding, else, in pair order, the
    least-loaded holder on the receiver's node, else anywhere (ties: the lower rank, then the
    first holding)."""
    x_t, x_rank, own, t_own = x.t, x.rank, x.own, x.t_own
    num_t = len(t_rank)
    sent = [0] * world
    near = node[x_rank] == node[t_rank[x_t]]
    t_near = np.zeros(num_t, bool)
    t_near[x_t[near]] = True
    keep = (~own) & (t_own[x_t] < 0) & (near | ~t_near[x_t])
    kx = np.flatnonzero(keep)
    starts = np.searchsorted(x_t[kx], np.arange(num_t + 1))
    k_rank, k_hold = x_rank[kx].tolist(), x.hold[kx].tolist()
    pb = t_bytes.tolist()
    src_rows = t_own.copy().tolist()
    starts_l = starts.tolist()
    for t in np.flatnonzero(t_own < 0).tolist():
        best = None
        for j in range(starts_l[t], starts_l[t + 1]):
            r = k_rank[j]
            c = (sent[r], r)
            if best is None or c < best[0]:
                best = (c, k_hold[j])
        src_rows[t] = best[1]
        sent[best[0][1]] += pb[t]
    return np.asarray(src_rows, np.int64)


def _views(
    holds: BoxRows, t_src_row: np.ndarray, t_pid: np.ndarray, pieces: _DistinctPieces, width: int, ndim: np.ndarray
) -> _Views:
    """Views: distinct (holding, piece) of the ``T`` pairs (source ``t_src_row``, piece
    ``t_pid``), numbered in order of first use (``V`` views, offsets ``int64[V, D]``)."""
    if len(t_pid):
        t_view, v_first = _first_numbering(np.stack([t_src_row, t_pid], 1))
    else:
        t_view, v_first = np.zeros(0, np.int64), np.zeros(0, np.int64)
    v_row, v_pid = t_src_row[v_first], t_pid[v_first]
    v_valid = _unit_rows(pieces.unit[v_pid], width, ndim)
    v_off = np.where(v_valid, holds.local[v_row] + pieces.off[v_pid] - holds.off[v_row], 0)
    return _Views(t_view, v_row, v_off)


def _cost(
    src: np.ndarray, dst: np.ndarray, sb: np.ndarray, send_round: np.ndarray, node: np.ndarray, world: int
) -> PlanCost:
    """The :class:`PlanCost` of ``S`` sends (``int64[S]`` each: ``src``, ``dst``, bytes ``sb``,
    round ``send_round``); ``num_rounds`` is ``send_round.max() + 1``."""
    i64 = np.int64
    sent_b, recv_b = np.zeros(world, i64), np.zeros(world, i64)
    np.add.at(sent_b, src, sb)
    np.add.at(recv_b, dst, sb)
    num_rounds = int(send_round.max()) + 1 if len(send_round) else 0
    per = np.zeros((num_rounds, world), i64)
    np.add.at(per, (send_round, dst), sb)
    peak = per.max(axis=0) if num_rounds else np.zeros(world, i64)
    cross = int(sb[node[src] != node[dst]].sum())
    pairs = np.unique(np.concatenate([send_round * world + src, send_round * world + dst]))
    return PlanCost(
        read_bytes=np.zeros(world, i64),
        sent_bytes=sent_b,
        recv_bytes=recv_b,
        peak_staging_bytes=peak,
        cross_node_bytes=cross,
        num_p2p_ops=len(src),
        num_batches=len(pairs),
        num_broadcasts=0,
    )


def _schedule(
    units: Units,
    holds: BoxRows,
    needs: BoxRows,
    topology: Topology,
    staging_bytes: int,
    max_ops: int,
    pieces: _DistinctPieces,
    dl: _Deliveries,
    t_own: np.ndarray,
    t_src_row: np.ndarray,
    views: _Views,
) -> Schedule:
    """The :class:`Schedule`: the ``T`` (piece, receiver) pairs with an own holding
    (``t_own`` ``int64[T]`` >= 0) are copies in round -1, the others sends from their source
    holding (``t_src_row`` ``int64[T]``) in the first round whose budgets allow it."""
    i32, i64 = np.int32, np.int64
    world = topology.world_size
    node = np.asarray([topology.node_of(r) for r in range(world)], i64)
    pbytes, t_pid, t_view = pieces.bytes, dl.t_pid, views.of_t
    is_copy = t_own >= 0
    sends_src = holds.rank[t_src_row[~is_copy]]
    sends_dst, sends_pid, sends_view = dl.t_rank[~is_copy], t_pid[~is_copy], t_view[~is_copy]
    send_round = _rounds(sends_src, sends_dst, pbytes[sends_pid], world, staging_bytes, max_ops)
    cost = _cost(sends_src, sends_dst, pbytes[sends_pid], send_round, node, world)
    num_rounds = int(send_round.max()) + 1 if len(send_round) else 0
    v_row = views.row
    return Schedule(
        topology=topology,
        staging_bytes=staging_bytes,
        max_ops=max_ops,
        keys=units.keys,
        key_ndim=units.ndim.astype(np.int8),
        pieces=PieceTable(key=pieces.unit.astype(i32), off=pieces.off, len=pieces.len, bytes=pbytes.astype(i64)),
        reads=ReadTable(),
        sends=SendTable(
            src=sends_src.astype(i32),
            dst=sends_dst.astype(i32),
            piece=sends_pid.astype(i32),
            round=send_round.astype(i64),
            view=sends_view.astype(i32),
        ),
        deliveries=DeliveryTable(
            piece=dl.pid.astype(i32),
            rank=dl.rank.astype(i32),
            param=needs.param[dl.row].astype(i32),
            slot=needs.slot[dl.row].astype(i64),
            off=dl.dst.astype(i64),
        ),
        num_rounds=num_rounds,
        cost=cost,
        views=ViewTable(
            rank=holds.rank[v_row].astype(i32),
            param=holds.param[v_row].astype(i32),
            slot=holds.slot[v_row].astype(i64),
            off=views.off.astype(i64),
        ),
        copies=CopyTable(
            view=t_view[is_copy].astype(i32),
            piece=t_pid[is_copy].astype(i32),
            round=np.full(int(is_copy.sum()), -1, i64),
        ),
    )


def _storage_summary(
    units: Units, st: StorageCells, width: int, ndim: np.ndarray, itemsize: np.ndarray
) -> _StorageSummary:
    """The distinct storage boxes of the ``M`` storage cells, their bytes, and the dense units
    among them."""
    boxes: list = []
    store_bytes = 0
    if len(st):
        sk = np.concatenate([st.unit[:, None], st.off, st.len], axis=1)
        for r in np.unique(sk, axis=0).tolist():
            u, nd = r[0], int(ndim[r[0]])
            box = tuple(zip(r[1 : 1 + nd], r[1 + width : 1 + width + nd]))
            boxes.append((units.keys[u], box))
            store_bytes += math.prod(n for _, n in box) * int(itemsize[u])
    boxes.sort()
    dense = sorted({units.keys[u] for u in np.unique(st.unit).tolist() if units.dense[u]})
    return _StorageSummary(tuple(boxes), store_bytes, tuple(dense))


def plan_reshard(
    units: Units, holds: BoxRows, needs: BoxRows, topology: Topology, staging_bytes: int, max_ops: int
) -> ReshardPlan:
    """Plan a reshard (pure, deterministic; module docstring). Every rank calls it with the same
    tables and gets the same plan (vectorized over rows; the source choice and the rounds are a
    loop over sends).

    Args:
        units: the units (``U``).
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
    i64 = np.int64
    width = needs.off.shape[1]
    world = topology.world_size
    node = np.asarray([topology.node_of(r) for r in range(world)], i64)
    ndim, itemsize = units.ndim.astype(i64), units.itemsize.astype(i64)

    cells = _cells(units, holds, needs, width)
    row = cells.row
    pairs = _holdings(holds, cells, len(units.keys), width, ndim)
    st = _storage(needs, cells, pairs.held)
    runs = _runs(cells, pairs.held, itemsize, staging_bytes)
    pieces = _pieces(runs, itemsize)
    dl = _deliveries(needs, row, runs, pieces.of_run)
    x = _holders(holds, pairs, len(row), pieces.cell, dl)
    t_src_row = _sources(x, dl.t_rank, pieces.bytes[dl.t_pid], node, world)
    views = _views(holds, t_src_row, dl.t_pid, pieces, width, ndim)
    sched = _schedule(units, holds, needs, topology, staging_bytes, max_ops, pieces, dl, x.t_own, t_src_row, views)

    summary = _storage_summary(units, st, width, ndim, itemsize)
    copy_bytes = int(pieces.bytes[dl.t_pid[x.t_own >= 0]].sum())
    h = hashlib.sha256(sched.fingerprint.encode())
    for a in (st.unit, st.rank, st.param, st.slot, st.off, st.len, st.dst):
        h.update(np.ascontiguousarray(a, np.int64).tobytes())
    return ReshardPlan(
        sched,
        st,
        summary.boxes,
        summary.dense,
        int(sched.cost.sent_bytes.sum()),
        copy_bytes,
        summary.bytes,
        h.hexdigest()[:16],
    )


def _rounds(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, world: int, staging_bytes: int, max_ops: int
) -> np.ndarray:
    """``int64[S]``: the first round for each send (in order) whose budgets allow it: at most
    ``max_ops`` ops per rank and ``staging_bytes`` received per rank (a piece larger than the
    budget alone)."""
    ops: list[list[int]] = []
    staged: list[list[int]] = []
    out = [0] * len(src)
    first = [0] * world  # per receiver: rounds before it are full (a hint, monotone)
    for i, (s, d, b) in enumerate(zip(src.tolist(), dst.tolist(), nbytes.tolist())):
        t = first[d]
        while True:
            if t == len(ops):
                ops.append([0] * world)
                staged.append([0] * world)
            o, g = ops[t], staged[t]
            if o[s] < max_ops and o[d] < max_ops and (g[d] == 0 or g[d] + b <= staging_bytes):
                break
            t += 1
        o[s] += 1
        o[d] += 1
        g[d] += b
        out[i] = t
        if g[d] >= staging_bytes or o[d] >= max_ops:
            first[d] = max(first[d], t + 1)
    return np.asarray(out, np.int64)
