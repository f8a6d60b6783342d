"""Run a function on N local gloo ranks (spawned processes) and collect results per rank.

Spawning costs seconds (torch import), so tests run many scenarios per spawned group.
The launcher itself is the package's (:mod:`moeshard._launch`); this keeps the tests' name.
"""

from __future__ import annotations

import multiprocessing
import os
import time

from moeshard._launch import run_local_ranks

# What every forkserver test's ranks import. multiprocessing starts one forkserver per pytest
# process, with the preload list of the first test that forks from it, and keeps it: a test
# asking for transformers after a tiny_moe test started the server would have each rank import
# transformers itself (test_reshard_elastic8_dist on 2 cores: 45 s instead of 18 s). So every
# test asks for all of it.
PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "moeshard",
    "moeshard.ops.reshard",
    "moeshard.models.parallel",
    "tiny_moe",
    "tiny_hf",
)


def run_ranks(fn, *args, world: int = 4, local_world: int | None = None, timeout: float = 240):
    """Run ``fn(*args)`` on ``world`` gloo ranks; return the per-rank results.

    Raises RuntimeError with every failing rank's traceback, TimeoutError on a hang.
    """
    return run_local_ranks(fn, *args, world=world, local_world=local_world, timeout=timeout)


def forkserver(*modules: str):
    """The forkserver context, its server (if this call starts it) having imported
    :data:`PRELOAD` and ``modules`` (the caller's module, whose function the ranks run); a
    module that fails to import is skipped."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *modules])
    return ctx


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


def set_rank_env(rank: int, world: int, local_world: int, port: int) -> None:
    """The environment torchrun gives rank ``rank`` of ``world`` (``local_world`` per simulated
    node, the rendezvous on 127.0.0.1:``port``), for a process a test starts itself."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % local_world),
        LOCAL_WORLD_SIZE=str(local_world),
    )
