"""Input checks of :mod:`moeshard.eplb` and the validated shape of a call (``Shape``): the load,
the live ranks, the slot / rank / node / group counts and which policy (hierarchical or global)
they allow, and a current placement against that shape."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..placement import Placement


@dataclass(frozen=True)
class Shape:
    """Validated problem shape. ``node_alive``: ``int[num_nodes_used, live_per_node]`` rank ids
    (node-local index) of each used node's live ranks, in rank order."""

    num_layers: int
    num_logical: int
    num_physical: int
    num_ranks: int
    slots_per_rank: int
    active: np.ndarray  # bool[num_ranks]
    hierarchical: bool
    num_nodes: int  # nodes used by the policy (1 for global)
    num_groups: int  # groups used by the policy (1 for global)
    node_alive: np.ndarray

    @property
    def ranks_per_node(self) -> int:
        return self.num_ranks // self.num_nodes

    @property
    def live_per_node(self) -> int:
        return int(self.node_alive.shape[1])


def check_load(load) -> np.ndarray:
    w = np.asarray(load)
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"load must be float[num_layers, num_logical], got shape {w.shape}")
    if w.dtype == bool or not (np.issubdtype(w.dtype, np.integer) or np.issubdtype(w.dtype, np.floating)):
        raise ValueError(f"load must hold numbers of tokens, got dtype {w.dtype}")
    w = w.astype(np.float64)
    if not np.isfinite(w).all():
        layer, expert = np.argwhere(~np.isfinite(w))[0]
        raise ValueError(f"load[{layer}, {expert}] = {w[layer, expert]} is not finite")
    if (w < 0).any():
        layer, expert = np.argwhere(w < 0)[0]
        raise ValueError(f"load[{layer}, {expert}] = {w[layer, expert]} is negative")
    return w


def check_active(active_ranks, num_ranks: int) -> np.ndarray:
    if active_ranks is None:
        return np.ones(num_ranks, dtype=bool)
    a = np.asarray(active_ranks)
    if a.shape != (num_ranks,):
        raise ValueError(f"active_ranks must be bool[num_ranks={num_ranks}], got shape {a.shape}")
    if a.dtype != bool:
        if not np.isin(a, (0, 1)).all():
            raise ValueError("active_ranks must hold booleans (or 0/1)")
        a = a.astype(bool)
    if not a.any():
        raise ValueError("active_ranks: all ranks are dead; no rank can hold an expert")
    return a


def check_shape(w: np.ndarray, num_physical, num_ranks, num_nodes, num_groups, active_ranks) -> Shape:
    num_layers, num_logical = w.shape
    for name, v in (("num_physical", num_physical), ("num_ranks", num_ranks), ("num_nodes", num_nodes)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    num_physical, num_ranks, num_nodes = int(num_physical), int(num_ranks), int(num_nodes)
    if num_physical % num_ranks:
        raise ValueError(f"num_physical={num_physical} slots per layer is not divisible by num_ranks={num_ranks}")
    if num_ranks % num_nodes:
        raise ValueError(f"num_ranks={num_ranks} is not divisible by num_nodes={num_nodes}")
    if num_groups is not None:
        if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
            raise ValueError(f"num_groups must be a positive integer or None, got {num_groups!r}")
        if num_groups % num_nodes == 0 and num_logical % num_groups:  # the hierarchical policy needs it
            raise ValueError(f"num_logical={num_logical} experts cannot form num_groups={num_groups} equal groups")
    active = check_active(active_ranks, num_ranks)
    spr = num_physical // num_ranks
    live_slots = int(active.sum()) * spr
    if live_slots < num_logical:
        raise ValueError(
            f"{int(active.sum())} live rank(s) x {spr} slots = {live_slots} live slots cannot hold "
            f"num_logical={num_logical} experts (each needs at least one copy)"
        )
    per_node = active.reshape(num_nodes, -1)
    hier = (
        num_groups is not None
        and num_groups % num_nodes == 0
        and bool((per_node.sum(1) == per_node.sum(1)[0]).all())
    )
    nodes, groups = (num_nodes, int(num_groups)) if hier else (1, 1)
    alive = active.reshape(nodes, -1)
    node_alive = np.stack([np.flatnonzero(row) for row in alive])
    return Shape(num_layers, num_logical, num_physical, num_ranks, spr, active, hier, nodes, groups, node_alive)


def check_placement(placement, sh: Shape) -> None:
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a moeshard.Placement or None, got {type(placement).__name__}")
    if placement.num_logical != sh.num_logical:
        raise ValueError(f"placement has num_logical={placement.num_logical}, load has {sh.num_logical} experts")
    if placement.num_physical != sh.num_physical:
        raise ValueError(f"placement has num_physical={placement.num_physical}, expected {sh.num_physical}")
    if placement.num_layers != sh.num_layers:
        raise ValueError(f"placement has {placement.num_layers} layers, load has {sh.num_layers}")
    if placement.num_ranks is not None and placement.num_ranks != sh.num_ranks:
        raise ValueError(f"placement was made for num_ranks={placement.num_ranks}, expected {sh.num_ranks}")
