"""Run a function on N local gloo ranks (spawned processes) and collect results per rank.

Spawning costs seconds (torch import), so tests run many scenarios per spawned group.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, local_world, port, fn, args, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank % local_world), LOCAL_WORLD_SIZE=str(local_world))
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        result = ("ok", fn(*args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(fn, *args, world: int = 4, local_world: int | None = None, timeout: float = 240):
    """Run ``fn(*args)`` on ``world`` gloo ranks; return the list of per-rank results.

    Raises RuntimeError with every failing rank's traceback.
    """
    local_world = local_world or world
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world, local_world, _free_port(), fn, args, out_dir),
                                 nprocs=world, join=False, start_method="spawn")
        import time

        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks did not finish within {timeout}s (hang)")
        results = []
        for r in range(world):
            with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    errors = [f"rank {r}: {v}" for r, (k, v) in enumerate(results) if k == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [v for _, v in results]
