"""Jobs a test starts before its turn, beside the tests that run first.

Most of the suite runs one process at a time: a pure test keeps one of a 2-core host's cores
busy, and a spawned group's ranks leave a core idle whenever they wait on each other. A test
whose work is child processes that need nothing from the tests before it (torchrun jobs, a
child that parses a 100 MB header) says so with ``@pytest.mark.background(job)``: when
collection ends, conftest starts the jobs of every selected test, one after another in the
order collected, in one thread of the pytest process, so that they run beside the tests
ahead of them. The test itself then takes ``job.result()``: the job's return value, or its
exception raised again; a job nothing started yet (the test runs alone, or its turn came
first) runs then, in the test's own thread.

A job is ``fn(tmp)``, ``tmp`` a fresh directory removed when ``fn`` returns: it returns plain
data (exit codes, output), not paths into ``tmp``. Its work is done by child processes: Python
work in the job's thread would hold the GIL the tests need, and an import there races the
tests' own (transformers' lazy modules fail to import half the time).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["Job", "job", "start"]


class Job:
    """``fn(tmp)`` run once, here or in the background; see the module doc."""

    def __init__(self, fn: Callable[[Path], Any]):
        self.fn = fn
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self._lock = threading.Lock()
        self._started = False
        self._done = threading.Event()
        self._outcome: tuple[bool, Any] = (False, None)

    def run(self) -> None:
        """Run the job unless it already started (here or in another thread)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        tmp = tempfile.mkdtemp(prefix=f"moeshard-{self.fn.__name__}-")
        try:
            self._outcome = (True, self.fn(Path(tmp)))
        except BaseException as e:  # noqa: BLE001 - raised again in the test that asks
            self._outcome = (False, e)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            self._done.set()

    def result(self) -> Any:
        """The job's return value (running it now if nothing started it, waiting for it if it is
        running elsewhere); its exception if it raised."""
        self.run()
        self._done.wait()
        ok, value = self._outcome
        if not ok:
            raise value
        return value


def job(fn: Callable[[Path], Any]) -> Job:
    """Decorator: ``fn(tmp)`` as a :class:`Job`."""
    return Job(fn)


def start(jobs: Iterable[Job]) -> threading.Thread | None:
    """Run ``jobs`` one after another in a daemon thread (each at most once); the thread, or
    None when there is nothing to run."""
    todo = list(dict.fromkeys(jobs))
    if not todo:
        return None

    def run_all() -> None:
        for j in todo:
            j.run()

    thread = threading.Thread(target=run_all, name="test-background-jobs", daemon=True)
    thread.start()
    return thread
