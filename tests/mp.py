"""Run a function on N local gloo ranks (spawned processes) and collect results per rank.

Spawning costs seconds (torch import), so tests run many scenarios per spawned group.
The launcher itself is the package's (:mod:`moeshard._launch`); this keeps the tests' name.
"""

from __future__ import annotations

from moeshard._launch import run_local_ranks


def run_ranks(fn, *args, world: int = 4, local_world: int | None = None, timeout: float = 240):
    """Run ``fn(*args)`` on ``world`` gloo ranks; return the per-rank results.

    Raises RuntimeError with every failing rank's traceback, TimeoutError on a hang.
    """
    return run_local_ranks(fn, *args, world=world, local_world=local_world, timeout=timeout)
