"""Run a function on N local gloo ranks (spawned processes) and collect results per rank.

Spawning costs seconds (torch import), so tests run many scenarios per spawned group.
The launcher itself is the package's (:mod:`moeshard._launch`); this keeps the tests' name.
"""

from __future__ import annotations

import time

from moeshard._launch import run_local_ranks


def run_ranks(fn, *args, world: int = 4, local_world: int | None = None, timeout: float = 240):
    """Run ``fn(*args)`` on ``world`` gloo ranks; return the per-rank results.

    Raises RuntimeError with every failing rank's traceback, TimeoutError on a hang.
    """
    return run_local_ranks(fn, *args, world=world, local_world=local_world, timeout=timeout)


def start_and_join(procs: list, timeout: float) -> list[int]:
    """Start ``procs`` (multiprocessing processes), wait for all of them until ``timeout``
    seconds from now, kill those still running; returns their indices (a hang)."""
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    alive = [i for i, p in enumerate(procs) if p.is_alive()]
    for i in alive:
        procs[i].kill()
    return alive
