"""What a layer's expert tensors give the relocation planner: its *columns* (ranks grouped by
the boxes they hold), each column's *part groups* (the unit of a move), the (rank, slot) rows
it holds (:class:`Layout`, shared by the layers that hold alike), and the *components* of the
job (ranks that exchange slot data only among themselves). Pure.
"""

from __future__ import annotations

import marshal
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...box import Box, box_numel, split_box
from .records import ExpertTensor, Part

__all__ = [
    "Layout",
    "LayerLayouts",
    "layer_layouts",
    "columns_of",
    "part_groups",
    "holdings_key",
    "components",
    "unread",
    "rank_of_slot",
    "layer_parts",
]


def rank_of_slot(num_physical: int, num_ranks: int) -> np.ndarray:
    """``int[num_physical]``: EP rank of every slot (slot p on rank p // slots_per_rank)."""
    return np.arange(num_physical) // (num_physical // num_ranks)


def columns_of(tensors: Sequence[ExpertTensor], layer_tensors: list[int], world: int) -> tuple[dict, list[list[Box]]]:
    """Group the ranks holding a layer by the boxes they hold (one *column* per distinct tuple
    of boxes); every tensor of a layer must give a rank the same slots.

    Returns ``({rank: (column, first_slot, num_slots)}, [each column's boxes, in tensor order])``.
    """
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


def part_groups(
    tensors: Sequence[ExpertTensor], layer_tensors: list[int], boxes: list[Box], max_part: int
) -> list[tuple[Part, ...]]:
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


class Layout:
    """What a layer's tensors give the planner; layers whose tensors hold the same slots and
    boxes with the same itemsizes share one (every MoE layer of a model, as a rule), so
    :func:`columns_of` and :func:`part_groups` run once per distinct layer, not per layer.

    ``cols`` as :func:`columns_of`; ``groups[c]``: column ``c``'s part groups as
    ``((k, box), ...)`` with ``k`` the tensor's position among the layer's tensors;
    ``sizes[c]``: their bytes, ``totals[c]`` their sum. One row per (rank, slot) the layer's
    ranks hold, in ``cols`` order (ranks ascending, then slots): ``rank``, ``col``, ``slot``
    (``int64[n]``) and ``live`` (``bool[n]``: the rank is active). ``rank_objs``: ``{int: rank}``
    where the holdings give ranks that are not ``int`` (numpy ints: records keep them), else None.
    """

    __slots__ = ("cols", "groups", "sizes", "totals", "rank", "col", "slot", "live", "rank_objs")

    def __init__(self, tensors, layer_tensors: list[int], world: int, max_part: int, active: np.ndarray):
        cols, col_boxes = columns_of(tensors, layer_tensors, world)
        pos = {ti: k for k, ti in enumerate(layer_tensors)}
        self.cols = cols
        self.groups, self.sizes = [], []
        for boxes in col_boxes:
            groups = part_groups(tensors, layer_tensors, boxes, max_part)
            self.groups.append([tuple((pos[p.tensor], p.box) for p in g) for g in groups])
            self.sizes.append([sum(box_numel(p.box) * tensors[p.tensor].itemsize for p in g) for g in groups])
        self.totals = [sum(s) for s in self.sizes]
        held = list(cols.items())
        counts = [ns for _, (_, _, ns) in held]
        self.rank = np.repeat(np.asarray([r for r, _ in held], dtype=np.int64), counts)
        self.col = np.repeat(np.asarray([c for _, (c, _, _) in held], dtype=np.int64), counts)
        self.slot = (
            np.concatenate([np.arange(s0, s0 + ns, dtype=np.int64) for _, (_, s0, ns) in held])
            if held
            else np.zeros(0, dtype=np.int64)
        )
        self.live = active[self.rank]
        self.rank_objs = None if all(type(r) is int for r in cols) else {int(r): r for r in cols}


def holdings_key(t: ExpertTensor) -> bytes | None:
    """Exact bytes of ``t.holdings`` (None if it holds anything but tuples and ints): equal keys
    mean equal holdings of the same types, so their ``repr`` and layout can be shared."""
    try:
        return marshal.dumps(t.holdings, 2)  # version 2: no back-references, same bytes for equal values
    except ValueError:  # numpy ints, subclasses: no sharing
        return None


@dataclass(frozen=True)
class LayerLayouts:
    """Every layer's :class:`Layout`. ``order``: the layers with tensors, ascending;
    ``of[layer]``: its layout, for the layers before the first inconsistent one (``failed``:
    the error that layer raised, None if every layer has one); ``same[id(layout)]``:
    ``(layout, [its layers, ascending])``."""

    order: list[int]
    of: dict[int, Layout]
    same: dict[int, tuple[Layout, list[int]]]
    failed: Exception | None


def layer_layouts(
    tensors: Sequence[ExpertTensor],
    by_layer: dict[int, list[int]],
    hkeys: list[bytes | None],
    world: int,
    max_part: int,
    active: np.ndarray,
) -> LayerLayouts:
    """The layouts of the layers ``by_layer`` (``{layer: [its tensors' indices]}``), one per
    distinct layer (``hkeys``: :func:`holdings_key` of each tensor). A layer whose tensors are
    inconsistent stops the walk: its error is raised once the checks reach it, so that errors
    of the layers before it come first."""
    order = sorted(by_layer)
    shared: dict[tuple, Layout] = {}
    of: dict[int, Layout] = {}
    failed: Exception | None = None
    for layer in order:
        lt = by_layer[layer]
        lkey = tuple((hkeys[ti], type(tensors[ti].itemsize), tensors[ti].itemsize) for ti in lt)
        lay = shared.get(lkey)
        if lay is None:
            try:
                lay = Layout(tensors, lt, world, max_part, active)
            except Exception as err:  # noqa: BLE001 - kept in LayerLayouts.failed, raised by the planner after the layers before it
                failed = err
                break
            if all(hkeys[ti] is not None for ti in lt):
                shared[lkey] = lay
        of[layer] = lay
    same: dict[int, tuple[Layout, list[int]]] = {}
    for layer, lay in of.items():
        same.setdefault(id(lay), (lay, []))[1].append(layer)
    return LayerLayouts(order, of, same, failed)


def components(same_layout: dict, world: int) -> tuple[np.ndarray, dict[int, list[int]]]:
    """``(component int64[world], {id(layout): [a rank of each column]})``: the connected
    components of ranks joined by holding slots in the same column of some layer, numbered by
    lowest rank (-1 for ranks holding nothing). ``same_layout`` as :attr:`LayerLayouts.same`."""
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


def unread(
    comp: np.ndarray, firsts: dict[int, list[int]], read_cols: set[tuple[int, int]], readers: np.ndarray
) -> bool:
    """Whether a column in ``read_cols`` ((id(layout), column) that reads from the checkpoint)
    has no reader (``readers``: ``bool[world]``) in its component: a reader elsewhere must
    serve it, and the job is then planned as one component."""
    return any(not readers[comp == comp[firsts[key][c]]].any() for key, c in read_cols)


def layer_parts(
    layer: int, lay: Layout, layer_tensors: list[int]
) -> dict[tuple[int, int], tuple[tuple[Part, ...], ...]]:
    """``{(layer, column): part groups}`` of ``layer`` (``layer_tensors``: its tensors' indices)."""
    return {
        (layer, c): tuple(tuple(Part(layer_tensors[k], box) for k, box in g) for g in groups)
        for c, groups in enumerate(lay.groups)
    }
