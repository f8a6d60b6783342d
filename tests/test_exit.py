"""A process that used moeshard exits 0 after success, every time (tier 2, real torchrun).

gloo can abort a process at interpreter exit after it succeeded ("terminate called without an
active exception", SIGABRT): a thread that still has a gloo wait or a finished collective to
release takes the GIL while Python finalizes, and Python ends it with ``pthread_exit`` through
C++ frames that may not unwind (see :mod:`moeshard._launch`). ``moeshard`` commands and the local
launcher end with :func:`moeshard._launch.exit_process` instead. Here: a deterministic form of the
hazard aborts a plain exit and not ``exit_process``; ``moeshard verify`` under torchrun exits 0
on every run and 2 on bad input, its output complete. The torchrun jobs run in the background
(tests/background.py): fresh interpreters importing torch, beside the tests collected before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import background
from moeshard._launch import free_port

pytestmark = pytest.mark.dist

RUNS = 3


def _torchrun(*runs: list[str], nproc: int = 2, timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """Each of ``runs`` (a script or ``-m module`` and its arguments) under torchrun with ``nproc``
    ranks, all at once (each job's interpreters import torch for seconds; at once the imports
    overlap the others' waits); their results in order."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    ports = set()
    while len(ports) < len(runs):
        ports.add(free_port())
    procs = []
    for args, port in zip(runs, sorted(ports)):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={port}",
            *args,
        ]
        procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)))
    out = []
    try:
        for cmd, p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr))
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


# Rank 1 joins a collective 3 s late; rank 0 leaves while a thread still waits in it, and its
# finalization lasts 6 s (an object freed then sleeps): the wait ends during finalization, with
# seconds of margin on either side for a loaded machine.
HAZARD = textwrap.dedent("""
    import sys, threading, time
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = [None, None]
    if dist.get_rank() == 1:
        time.sleep(3.0)
        try:  # rank 0 may be gone (exit_process): this rank's part does not matter
            dist.all_gather_object(out, 1)
        except RuntimeError:
            pass
        time.sleep(1.0)
        import os

        os._exit(0)

    class SlowTeardown:
        def __del__(self, sleep=time.sleep):  # bound now: finalization may clear the module first
            sleep(6.0)

    keep = SlowTeardown()
    threading.Thread(target=dist.all_gather_object, args=(out, 0), daemon=True).start()
    time.sleep(0.3)
    print("rank 0 done", flush=True)
    if sys.argv[1] == "exit_process":
        from moeshard._launch import exit_process

        exit_process(0)
""")


@background.job
def hazard_runs(tmp: Path) -> list[subprocess.CompletedProcess]:
    script = tmp / "hazard.py"
    script.write_text(HAZARD)
    return _torchrun([str(script), "plain"], [str(script), "exit_process"])


@pytest.mark.background(hazard_runs)
def test_exit_process_ends_where_a_plain_exit_aborts():
    plain, ours = hazard_runs.result()
    # The hazard is real (torch 2.13, Python 3.11): without exit_process the rank aborts.
    assert plain.returncode != 0 and "terminate called without an active exception" in plain.stderr, (
        "a plain exit no longer aborts here: torch or Python changed; the exit_process teardown may be unneeded\n"
        + plain.stderr[-2000:]
    )
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "rank 0 done" in ours.stdout and "terminate called" not in ours.stderr


@background.job
def verify_runs(tmp: Path) -> list[subprocess.CompletedProcess]:
    ckpt = str(tmp / "tiny")
    # In a child, as every step of a job: an import in this thread would race the tests' own.
    write = "import sys\nfrom test_cli import write_tiny\nwrite_tiny(sys.argv[1])\n"
    subprocess.run([sys.executable, "-c", write, ckpt], cwd=os.path.dirname(__file__), check=True, capture_output=True)
    verify = ["-m", "moeshard.cli", "verify", ckpt, "--ep", "2"]
    # Bad input: every rank exits 2 (torchrun reports 1), the one error line printed before the exit.
    return _torchrun(*[verify] * RUNS, [*verify, "--redundant", "-5"])


@pytest.mark.background(verify_runs)
def test_verify_under_torchrun_exits_zero_every_time():
    pytest.importorskip("transformers")
    *good, bad = verify_runs.result()
    for run, res in enumerate(good):
        assert res.returncode == 0, f"run {run}: exit {res.returncode}\n{res.stderr[-3000:]}"
        assert "2 ranks (EP=2 x efsdp=1)" in res.stdout and "verified against the checkpoint: OK" in res.stdout
        assert "terminate called" not in res.stderr
    assert bad.returncode != 0 and "moeshard verify: error:" in bad.stderr, bad.stderr[-3000:]
    assert "exitcode  : 2" in bad.stderr and "terminate called" not in bad.stderr
