"""torch.distributed helpers that never leave a rank hanging on another rank's error.

Pattern: every rank runs a step, catches its own exception, and all ranks exchange
(error, fingerprint) before anything else moves. If any rank failed, every rank raises one
:class:`DistributedError` that lists each failing rank's message; if fingerprints differ, the
ranks disagree about the plan and every rank raises. All functions here are collective: every
rank of ``group`` must call them, in the same order. Without an initialized process group
they run locally.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch.distributed as dist

__all__ = ["DistributedError", "is_dist", "rank_and_world", "agree", "all_gather_object", "broadcast_object"]

T = TypeVar("T")


class DistributedError(RuntimeError):
    """Raised on every rank when any rank failed a collective step."""


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(group=None) -> tuple[int, int]:
    if not is_dist():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_object(obj: Any, group=None) -> list[Any]:
    """Collective: every rank's ``obj`` (a list indexed by group rank)."""
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """Collective: ``obj`` of rank ``src`` (global rank) on every rank."""
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def agree(step: Callable[[], T], what: str, fingerprint: Callable[[T], str] | None = None, group=None) -> T:
    """Collective: run ``step`` on every rank; raise on every rank if any rank failed or if
    ``fingerprint(result)`` differs between ranks.

    Raises:
        ValueError: this rank's own error when no process group is initialized.
        DistributedError: on every rank, naming each failing rank and its message.
    """
    result: Any = None
    error: str | None = None
    try:
        result = step()
    except Exception as e:  # noqa: BLE001 - every error must reach the other ranks
        if not is_dist():
            raise
        error = f"{type(e).__name__}: {e}"
    fp = fingerprint(result) if (fingerprint is not None and error is None) else None
    gathered = all_gather_object((error, fp), group=group)
    failed = [(r, err) for r, (err, _) in enumerate(gathered) if err is not None]
    if failed:
        lines = "\n".join(f"  rank {r}: {err}" for r, err in failed)
        raise DistributedError(f"{what} failed on {len(failed)} of {len(gathered)} rank(s):\n{lines}")
    fps = {fp for _, fp in gathered}
    if len(fps) > 1:
        by = ", ".join(f"rank {r}: {fp}" for r, (_, fp) in enumerate(gathered))
        raise DistributedError(f"{what}: ranks disagree on the plan fingerprint ({by}); "
                               "every rank must build the same model, placement and checkpoint index")
    return result
