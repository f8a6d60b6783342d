"""Storage modes: which ranks can read which part of a checkpoint.

``shared`` (every rank sees the files), ``node`` (some rank of every node does: node-local
disks), ``single`` (rank 0 only) and ``auto`` (chosen from which ranks can see the path). The
mode decides the planner's *readers* and *scope* (a piece is read once per job or once per
node); everything here is pure except :func:`resolve_sources`, which agrees on the mode and
ships the headers from one reader to every rank.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Literal

import numpy as np

from ..topology import Topology
from .index import CheckpointIndex

__all__ = ["Storage", "storage_sources", "sources_share", "resolve_sources", "reader_root"]

Storage = Literal["auto", "shared", "node", "single"]


def storage_sources(
    storage: Storage, can_read: Sequence[bool], topology: Topology, active: Sequence[bool] | np.ndarray | None = None
) -> tuple[str, np.ndarray, str]:
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


def sources_share(
    can_read: bool, storage: Storage, topology: Topology, active: Sequence[bool] | np.ndarray | None = None
) -> tuple:
    """What a rank contributes to :func:`resolve_sources`: whether it sees the checkpoint, and
    the arguments the storage mode is resolved from (its storage, ranks per node and a digest of
    ``active``), which every rank must pass alike. Pure."""
    digest = None if active is None else hashlib.sha1(np.packbits(np.asarray(active, dtype=bool)).tobytes()).hexdigest()
    return bool(can_read), storage, topology.local_world_size, digest


def _agreed_sources(
    everyone: Sequence[tuple], topology: Topology, active: Sequence[bool] | np.ndarray | None
) -> tuple[str, np.ndarray, str]:
    """:func:`storage_sources` from every rank's :func:`sources_share`, after checking that the
    ranks passed the same arguments (pure: every rank computes the same answer or error)."""
    for what, j in (("storage", 1), ("ranks per node (topology)", 2), ("active_ranks", 3)):
        values = [e[j] for e in everyone]
        if any(v != values[0] for v in values):
            differ = [r for r, v in enumerate(values) if v != values[0]][:16]
            raise ValueError(
                f"the ranks passed different {what}: rank 0 {values[0]!r}, ranks {differ} another "
                f"(rank {differ[0]}: {values[differ[0]]!r}); every rank must pass the same"
            )
    return storage_sources(everyone[0][1], [e[0] for e in everyone], topology, active)


def resolve_sources(
    path: str,
    storage: Storage,
    topology: Topology,
    can_read: bool,
    active: Sequence[bool] | np.ndarray | None = None,
    everyone: Sequence[tuple] | None = None,
) -> tuple[str, np.ndarray, str, CheckpointIndex]:
    """Collective (every rank): agree on the storage mode from which ranks can see ``path``;
    the first reader (the first active one, given ``active``; see :func:`storage_sources`)
    reads the headers and sends them to all ranks. ``everyone``: every rank's
    :func:`sources_share` when the caller has gathered it already (in its own first exchange:
    then the mode costs no exchange, and the headers one broadcast).

    Returns ``(mode, readers: bool[world], scope, index)``, the same on every rank.
    """
    from .. import collectives  # torch.distributed: only this collective needs it (storage_sources is pure)

    what = f"moeshard: storage of {path}"
    if everyone is None:
        everyone = collectives.all_gather_object(sources_share(can_read, storage, topology, active), what=what)
    # A pure function of what every rank now holds alike: its error is every rank's, no exchange.
    mode, readers, scope = collectives.unanimous(lambda: _agreed_sources(everyone, topology, active), what)
    live = readers if active is None else readers & np.asarray(active, dtype=bool)
    first = int(np.flatnonzero(live if live.any() else readers)[0])
    what = f"moeshard: reading the headers of {path}"
    # One broadcast: the headers, or the first reader's error on every rank.
    index = collectives.broadcast_result(lambda: CheckpointIndex.open(path), first, what)
    return mode, readers, scope, index


def reader_root(path: str) -> str:
    """Directory that a checkpoint's file names are relative to."""
    return path if os.path.isdir(path) else os.path.dirname(path) or "."
