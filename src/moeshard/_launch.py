"""Start N local ranks (spawned processes, gloo on CPU) and collect each rank's result; end a
process that used torch.distributed without the abort at exit that gloo can cause.

Used by ``moeshard demo`` and the benchmarks to simulate several nodes on one host: the
ranks see torchrun-style RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE variables and, like
torchrun's, one intra-op thread each unless ``OMP_NUM_THREADS`` is set.

Why processes end with :func:`exit_process`: a gloo worker thread ("pt_gloo_runloop") destroys a
finished collective's work object shortly *after* the caller's ``wait`` returned. Where that work
holds the last reference to a tensor whose Python object torch kept alive (torch's own
``all_gather_object`` leaves such tensors), the destruction takes the GIL. If the main thread
has meanwhile begun interpreter finalization, Python (3.11-3.13) ends the worker with
``pthread_exit``, whose unwinding through the noexcept destructor calls ``std::terminate``:
"terminate called without an active exception", SIGABRT, after the program succeeded. It is a
race (seen in 1 of 25 torchrun runs of ``moeshard verify`` on a loaded 2-core host; core dumps
show the worker in ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` ->
``pthread_exit``), and ``destroy_process_group`` does not close it: gloo has no shutdown that
joins its workers, only the process group's destructor does, which runs when the last reference
(FSDP modules hold them) goes. The order that avoids it: destroy the process group, flush the
standard streams, and leave with ``os._exit``, so finalization never runs beside the workers.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["exit_process", "run_local_ranks"]


def exit_process(code: int = 0) -> NoReturn:
    """End this process with ``code`` now: flush stdout and stderr, then ``os._exit``.

    For the end of a process that ran torch.distributed collectives (a rank of a job, a
    command under torchrun), after ``destroy_process_group``: it skips interpreter
    finalization, during which a gloo worker thread still releasing a finished collective
    can abort the process (module doc). Nothing after it runs: atexit handlers and
    ``finally`` blocks of callers are skipped, so call it last.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced streams: nothing to flush
            pass
    os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, local_world, port, backend, fn, args, out_dir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % local_world),
        LOCAL_WORLD_SIZE=str(local_world),
    )
    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does for several processes per host: one intra-op thread per rank, unless
        # the user says otherwise. With the default (every core per rank) the ranks' copies
        # oversubscribe the cores: 8 ranks on 2 cores copied 30 MiB in 0.57 s instead of 0.02 s.
        torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        result = ("ok", fn(*args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    code = 0
    try:
        # Let every rank finish its sends before any process group goes away.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - a peer lost at the end: this rank's exit code says so
        traceback.print_exc()
        code = 1
    exit_process(code)


def run_local_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world: int = 4,
    local_world: int | None = None,
    backend: str = "gloo",
    timeout: float = 600,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(*args)`` (a top-level, importable function) on ``world`` local ranks.

    ``start_method``: how the ranks start (a multiprocessing start method). ``"spawn"``: each
    rank starts a fresh interpreter and imports torch itself (seconds per rank);
    ``"forkserver"``: each rank is forked from multiprocessing's fork server, which imports its
    preload list (``set_forkserver_preload``) once, so a caller that starts many groups (a test
    suite) pays the imports once. Either way a rank sees the environment of the process that
    started it (spawn: the caller now; forkserver: the caller when the server started).

    Returns the per-rank results. Raises RuntimeError with every failing rank's traceback,
    TimeoutError if the ranks do not finish within ``timeout`` seconds.
    """
    import torch.multiprocessing as mp

    local_world = local_world or world
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world, local_world, free_port(), backend, fn, args, out_dir),
            nprocs=world,
            join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks did not finish within {timeout}s")
        results = []
        for r in range(world):
            with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    errors = [f"rank {r}: {v}" for r, (k, v) in enumerate(results) if k == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [v for _, v in results]
