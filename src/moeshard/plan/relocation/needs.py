"""What each layer needs in a relocation (:class:`LayerNeeds`: the (rank, slot)s whose expert
changes, the live holders of those experts, the experts no live rank holds), computed in one
numpy pass per :class:`~.layouts.Layout`, and the checks that every need can be met. Pure.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .layouts import LayerLayouts, Layout
from .records import Keys

__all__ = ["DeadSlot", "LayerNeeds", "ReadNeeds", "layer_needs", "needs_of", "check_needs"]


class DeadSlot(NamedTuple):
    """The new placement puts ``expert`` in ``slot``, held by ``rank``, which is not active."""

    expert: int
    slot: int
    rank: int


class LayerNeeds(NamedTuple):
    """What one layer needs. A need's *key* is ``column * num_experts + expert``.

    - ``dead``: the first row (in layout order) that puts an expert on a dead rank, else None;
    - ``key``, ``rank``, ``slot``, ``write``: lists over the needing rows, by key, then rank
      and slot ascending; ``write`` the :class:`~.records.Keys` key of the slot (part group 0);
    - ``holder_key``, ``holder_rank``, ``holder_slot``: lists over the rows of live ranks
      holding a needed key in the old placement (in layout order);
    - ``lost``: the needed keys no live rank holds, ascending (of every column).
    """

    dead: DeadSlot | None
    key: list[int]
    rank: list[int]
    slot: list[int]
    write: list[int]
    holder_key: list[int]
    holder_rank: list[int]
    holder_slot: list[int]
    lost: list[int]


class ReadNeeds(NamedTuple):
    """What the checkpoint must provide: ``columns`` ``{(id(layout), column)}`` that read an
    expert, ``experts`` ``{(layer, logical expert)}`` read."""

    columns: set[tuple[int, int]]
    experts: set[tuple[int, int]]


def layer_needs(
    lay: Layout,
    layers: list[int],
    new_p2l: np.ndarray,
    old_p2l: np.ndarray,
    num_experts: int,
    keys: Keys,
    holders: bool,
    col_ok: np.ndarray | None = None,
) -> list[LayerNeeds]:
    """What the layers ``layers`` (all of layout ``lay``) need, one numpy pass for all of them.

    A (rank, slot) row of ``lay`` *needs* its new expert when that differs from the old one.
    ``holders=False``: no live holders (every need is read). ``col_ok`` (``bool[columns]``):
    keep only the needs and holders of these columns (``lost`` keeps every column's).
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
        bad = None if fd < 0 else DeadSlot(int(new_e[x, fd]), int(lay.slot[fd]), int(lay.rank[fd]))
        a, b = cut[x], cut[x + 1]
        ha, hb = hcut[x], hcut[x + 1]
        out.append(
            LayerNeeds(
                bad,
                key_l[a:b],
                rank_l[a:b],
                slot_l[a:b],
                write_l[a:b],
                hkey_l[ha:hb],
                hrank_l[ha:hb],
                hslot_l[ha:hb],
                lost[lcut[x] : lcut[x + 1]],
            )
        )
    return out


def needs_of(
    layouts: LayerLayouts,
    comp: np.ndarray,
    firsts: dict[int, list[int]],
    keep: int | None,
    new_p2l: np.ndarray,
    old_p2l: np.ndarray,
    num_experts: int,
    keys: Keys,
    holders: bool,
) -> dict[int, LayerNeeds]:
    """``{layer: LayerNeeds}`` of every layer with a layout; ``keep``: only the columns of that
    component (``comp``, ``firsts`` as :func:`~.layouts.components`; a plan for one rank), None: all."""
    out: dict[int, LayerNeeds] = {}
    for key, (lay, layers) in layouts.same.items():
        col_ok = None if keep is None else comp[firsts[key]] == keep
        out.update(zip(layers, layer_needs(lay, layers, new_p2l, old_p2l, num_experts, keys, holders, col_ok)))
    return out


def check_needs(
    layouts: LayerLayouts,
    needs: dict[int, LayerNeeds],
    old_p2l: np.ndarray,
    active: np.ndarray,
    readers: np.ndarray,
    dead_readers: list[int],
    num_experts: int,
) -> ReadNeeds:
    """Every check of every layer, in layer order (so that a plan for one rank raises what the
    whole job's raises): the layer's tensors are consistent, no new slot is on a dead rank, and
    an expert no live rank holds can be read (``readers``: ``bool[world]``, live readers;
    ``dead_readers``: the readers that died, named in the error). Returns what is read."""
    out = ReadNeeds(set(), set())
    for layer in layouts.order:
        if layer not in layouts.of:
            raise layouts.failed
        lay = layouts.of[layer]
        ln = needs[layer]
        if ln.dead is not None:
            e, s, r = ln.dead
            raise ValueError(
                f"the new placement puts logical expert {e} in slot {s} of layer {layer}, "
                f"which rank {r} holds, but rank {r} is not active"
            )
        if ln.lost and not readers.any():
            _raise_unreadable(layer, lay, ln.lost[0], old_p2l, active, dead_readers, num_experts)
        for k in ln.lost:
            c, e = divmod(k, num_experts)
            out.columns.add((id(lay), c))
            out.experts.add((int(layer), int(e)))
    return out


def _raise_unreadable(
    layer: int,
    lay: Layout,
    lost_key: int,
    old_p2l: np.ndarray,
    active: np.ndarray,
    dead_readers: list[int],
    num_experts: int,
) -> None:
    c, e = divmod(lost_key, num_experts)
    old_row = old_p2l[layer]
    dead = sorted(
        {r for r, (cc, s0, ns) in lay.cols.items() if cc == c and not active[r] and (old_row[s0 : s0 + ns] == e).any()}
    )
    why = "no checkpoint to read it from"
    if dead_readers:  # a checkpoint was given, but every rank that sees it died
        who = f"rank {dead_readers[0]}" if len(dead_readers) == 1 else f"ranks {dead_readers}"
        why = f"the only rank(s) that can read the checkpoint ({who}) are not active"
    raise ValueError(f"logical expert {e} of layer {layer} has no live copy (held only by dead ranks {dead}) and {why}")
