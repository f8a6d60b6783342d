"""Storage modes: which ranks can read which part of a checkpoint.

``shared`` (every rank sees the files), ``node`` (some rank of every node does: node-local
disks), ``single`` (rank 0 only) and ``auto`` (chosen from which ranks can see the path). The
mode decides the planner's *readers* and *scope* (a piece is read once per job or once per
node); everything here is pure except :func:`resolve_sources`, which agrees on the mode and
ships the headers from one reader to every rank.
"""

from __future__ import annotations

import os
from typing import Literal, Sequence

import numpy as np

from ..topology import Topology
from .checkpoint import CheckpointIndex

__all__ = ["Storage", "storage_sources", "resolve_sources", "reader_root"]

Storage = Literal["auto", "shared", "node", "single"]


def storage_sources(storage: Storage, can_read: Sequence[bool], topology: Topology,
                    active: Sequence[bool] | np.ndarray | None = None) -> tuple[str, np.ndarray, str]:
    """Resolve a storage mode from which ranks can see the checkpoint (pure).

    ``active`` (relocation: ``bool[world]``, the live ranks; None: all): a rank that is not
    active reads nothing, so what it sees does not matter to the mode's checks. "single" means
    "only rank 0 reads while it is alive": with rank 0 not active, the ranks that can read take
    its place. The readers returned may include inactive ranks (the relocation planner drops
    them, and names them when an expert then has no live source).

    Returns ``(mode, readers: bool[world], scope)``. Raises ValueError when the mode's
    assumption is false (e.g. "shared" but some ranks cannot read), naming the ranks.
    """
    can = np.asarray(can_read, dtype=bool)
    if not can.any():
        raise ValueError("no rank can read the checkpoint")
    if active is None:
        return _storage_mode(storage, can, topology)
    live = np.asarray(active, dtype=bool)
    mode, readers, scope = _storage_mode(storage, can | ~live, topology)
    if mode == "single" and not live[0]:
        return mode, can, scope
    return mode, readers & can, scope


def _storage_mode(storage: Storage, can: np.ndarray, topology: Topology) -> tuple[str, np.ndarray, str]:
    """:func:`storage_sources` given which ranks can read (``can``: some rank can)."""
    blind = np.flatnonzero(~can).tolist()
    if storage == "auto":
        if can.all():
            storage = "shared"
        elif can.sum() == 1 and can[0]:
            storage = "single"
        elif all(can[list(topology.node_ranks(n))].any() for n in range(topology.num_nodes)):
            storage = "node"
        else:
            return "shared", can, "job"
    if storage == "shared":
        if blind:
            raise ValueError(f"storage='shared' but ranks {blind[:16]} cannot read the checkpoint")
        return "shared", can, "job"
    if storage == "single":
        if not can[0]:
            raise ValueError("storage='single' but rank 0 cannot read the checkpoint")
        only0 = np.zeros_like(can)
        only0[0] = True
        return "single", only0, "job"
    if storage == "node":
        for n in range(topology.num_nodes):
            if not can[list(topology.node_ranks(n))].any():
                raise ValueError(f"storage='node' but no rank of node {n} can read the checkpoint")
        return "node", can, "node"
    raise ValueError(f"storage must be 'auto', 'shared', 'node' or 'single', got {storage!r}")


def resolve_sources(path: str, storage: Storage, topology: Topology, can_read: bool,
                    active: Sequence[bool] | np.ndarray | None = None,
                    everyone: Sequence[bool] | None = None) -> tuple[str, np.ndarray, str, CheckpointIndex]:
    """Collective (every rank): agree on the storage mode from which ranks can see ``path``;
    the first reader (the first active one, given ``active``; see :func:`storage_sources`)
    reads the headers and sends them to all ranks. ``everyone``: every rank's ``can_read``
    when the caller has gathered it already (one exchange fewer).

    Returns ``(mode, readers: bool[world], scope, index)``, the same on every rank.
    """
    from .. import _dist  # torch.distributed: only this collective needs it (storage_sources is pure)

    what = f"moeshard: storage of {path}"
    if everyone is None:
        everyone = _dist.all_gather_object(can_read, what=what)
    mode, readers, scope = _dist.agree(lambda: storage_sources(storage, everyone, topology, active), what)
    live = readers if active is None else readers & np.asarray(active, dtype=bool)
    first = int(np.flatnonzero(live if live.any() else readers)[0])
    what = f"moeshard: reading the headers of {path}"
    # One broadcast: the headers, or the first reader's error on every rank.
    index = _dist.broadcast_result(lambda: CheckpointIndex.open(path), first, what)
    return mode, readers, scope, index


def reader_root(path: str) -> str:
    """Directory that a checkpoint's file names are relative to."""
    return path if os.path.isdir(path) else os.path.dirname(path) or "."
