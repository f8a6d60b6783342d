"""The fingerprint of a relocation plan: a digest of what it is planned from (the planner is
pure and deterministic, so equal inputs give equal plans; ranks compare it before data moves).
"""

from __future__ import annotations

import hashlib

import numpy as np

from ...placement import Placement
from .plan import RelocationPlan
from .records import ExpertTensor

__all__ = ["fingerprint"]

# Part of every fingerprint: plans of another planning rule must not pass for equal ones.
_RULE = b"moeshard.relocation/components-1"


def fingerprint(
    plan: RelocationPlan,
    hkeys: list[bytes | None],
    old_p2l: np.ndarray,
    new: Placement,
    active: np.ndarray,
    readers: np.ndarray,
    from_checkpoint: bool,
) -> str:
    """sha256 of what the plan is planned from: the topology, budgets, tensors (their fields,
    and the digest of their holdings' bytes -- ``hkeys``: :func:`~.layouts.holdings_key` of
    each, one digest per distinct holdings; the repr of a tensor without), both placements,
    the live ranks and readers. The same for the whole job's plan and every rank's."""
    h = hashlib.sha256(_RULE)
    h.update(
        repr(
            (
                plan.topology.world_size,
                plan.topology.local_world_size,
                plan.staging_bytes,
                plan.max_ops,
                bool(from_checkpoint),
                new.num_logical,
                new.num_ranks,
            )
        ).encode()
    )
    if plan.topology.nodes is not None:  # uneven nodes (a process group of some ranks)
        h.update(repr(plan.topology.nodes).encode())
    held: dict[bytes, bytes] = {}  # holdings bytes -> their digest (layers share holdings)
    for i, t in enumerate(plan.tensors):
        hk = hkeys[i]
        if type(t) is not ExpertTensor or hk is None:
            h.update(repr(t).encode())
            continue
        digest = held.get(hk)
        if digest is None:
            digest = held[hk] = hashlib.sha256(hk).digest()
        h.update(repr((t.layer, t.name, t.slice_shape, t.itemsize)).encode())
        h.update(digest)
    for a in (old_p2l, new.phy2log, active, readers):
        a = np.ascontiguousarray(a)
        h.update(repr((a.dtype.str, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]
