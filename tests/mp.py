"""Run a function on N local gloo ranks (processes forked from a forkserver) and collect results
per rank.

Starting a group still costs a rendezvous and each rank's set-up, so tests run many scenarios
per group.
The launcher itself is the package's (:mod:`moeshard._launch`); this keeps the tests' name.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time

from moeshard._launch import run_local_ranks

# What every forked rank would otherwise import itself: torch and transformers with the MoE
# modeling modules (several CPU-seconds per rank), moeshard's modules the workers use, the
# test helpers. multiprocessing starts one forkserver per pytest process, with the preload list
# of the first test that forks from it, and keeps it: a module missing here is imported by each
# rank of every later group (test_reshard_elastic8_dist on 2 cores: 45 s instead of 18 s when
# transformers was missing). So every test asks for all of it. A module that fails to import
# (an optional dependency) is skipped. transformers.trainer (it imports datasets) and trl: each
# rank of the Trainer tests' groups spent 5-9 s importing them. datasets imports pyarrow, whose
# jemalloc starts a background thread, and a process that forks should have none of its own:
# :func:`forkserver` turns that thread off (ARROW_JEMALLOC_CONF below).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "numpy",
    "pytest",
    "safetensors.torch",
    "transformers",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "peft",
    "accelerate",
    "transformers.trainer",
    "trl",
    "moeshard",
    "moeshard.ops.reshard",
    "moeshard.ops.save",
    "moeshard.ops.verify",
    "moeshard.ops.relocate",
    "moeshard.io.checkpoint",
    "moeshard.io.writer",
    "moeshard.io.quant",
    "moeshard.lora",
    "moeshard.models.parallel",
    "moeshard.plan.relocation",
    "moeshard.integrations.transformers",
    "moeshard.integrations.pretrained",
    "tiny_moe",
    "tiny_hf",
    "training",
)

ARROW_JEMALLOC_CONF = ("JE_ARROW_MALLOC_CONF", "background_thread:false")


def run_ranks(fn, *args, world: int = 4, local_world: int | None = None, timeout: float = 240):
    """Run ``fn(*args)`` on ``world`` gloo ranks; return the per-rank results.

    The ranks are forked from the forkserver (:func:`forkserver`), which imported
    :data:`PRELOAD` once, and ``fn``'s module: a spawned rank would import torch and
    transformers itself, seconds per rank for every group the suite starts.

    Raises RuntimeError with every failing rank's traceback, TimeoutError on a hang.
    """
    forkserver(fn.__module__)
    return run_local_ranks(
        call_gc_frozen, fn, *args, world=world, local_world=local_world, timeout=timeout, start_method="forkserver"
    )


def call_gc_frozen(fn, *args):
    """``fn(*args)`` in a forked rank, the objects it inherited (torch, transformers, ... from
    :data:`PRELOAD`: some 400,000) out of the garbage collector's reach (``gc.freeze``).

    Every full collection would walk them: accelerate's ``free_memory`` calls ``gc.collect()``
    after each Trainer run, about a second each on a loaded 2-core host (a fifth of the trainer
    group's time), and walking them writes their pages, copying them from the forkserver.
    """
    gc.freeze()
    return fn(*args)


def forkserver(*modules: str):
    """The forkserver context, its server (if this call starts it) having imported
    :data:`PRELOAD` and ``modules`` (the caller's module, whose function the ranks run); a
    module that fails to import is skipped."""
    # Read when pyarrow loads (the server's import of datasets): no jemalloc background thread in
    # the process the ranks fork from. Set before the server starts, which inherits it.
    os.environ.setdefault(*ARROW_JEMALLOC_CONF)
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
