"""Where the time of ``moeshard.from_pretrained`` goes on one rank, measured from outside the
library: wrappers installed for the duration of one call, no library code changed.

Two levels:

* :class:`PretrainedSteps` (always on in bench_load's ``moeshard-fresh`` rows, a few clock
  reads): the call's steps -- ``build`` (arguments, config.json, meta build, placement, mesh:
  everything before ``parallelize``), ``parallelize``, then ``moeshard.load``'s own
  ``LoadReport.phase_seconds`` (``materialize``, ``headers``, ``plan``, ``execute``,
  ``finish``), and ``after_load`` (the rest of the call).
* :class:`CallProfiler` (``--profile``, separate rounds kept out of the timed medians): the
  calling thread's seconds inside

  - ``reads``: ``ReaderSource.read`` / ``read_into`` / ``start_read_into`` / ``finish_reads``,
    the waits on read-ahead, and the runner's coalesced extent reads
    (:class:`moeshard.io.extents.ExtentReads`: ``read``, one ``preadv`` per extent straight into
    the parameters, and ``advise``, the read-ahead hints; ``ReaderSource.read_ranges``, which
    plans the extents): the reads that land straight in place, most of a load's bytes (with
    one read thread per rank, as on a host with fewer cores than ranks, every read runs here;
    with a read pool this is the time spent waiting for it);
  - ``p2p``: posting P2P batches (``torch.distributed.batch_isend_irecv``) and waiting on their
    work handles;
  - ``bcast``: node broadcasts (``torch.distributed.broadcast``);
  - ``deliver``: ``TensorSink.put`` / ``DequantSink.put`` (copies into the parameters);
  - ``collective``: the other collectives the library calls (``all_reduce``, ``all_gather``,
    ``all_gather_object``, ``broadcast_object_list``, ``barrier``): moeshard's agreement on
    errors and plan fingerprints, the shared headers, the config;

  each event attributed to the step it fell in. The remainder of a step is its own work (e.g.
  ``plan``'s planning, ``execute``'s bookkeeping) plus page faults of fresh memory outside the
  wrapped calls.

Not measurable from outside without library changes: the reader pool threads' own read
seconds (only the calling thread's waits on them), and how much of a collective's time is
waiting for a slower rank rather than moving bytes (the per-rank table shows the skew: the
rank with the least ``collective`` time is the one the others waited for).

Both are used on one rank at a time, in the process that calls ``from_pretrained``; neither is
collective.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EXEC_KINDS", "CallProfiler", "PretrainedSteps", "attribute", "profiled"]

EXEC_KINDS = ("reads", "p2p", "bcast", "deliver", "collective")


class PretrainedSteps:
    """Context manager: times the steps of ``moeshard.from_pretrained`` calls made inside it
    (the last call's) by wrapping the ``parallelize`` and ``load`` it calls, and keeps that
    call's :class:`moeshard.LoadReport` (``report``)."""

    def __init__(self) -> None:
        self.report = None
        self.t_parallelize = self.t_load = self.t_load_end = None

    def __enter__(self) -> PretrainedSteps:
        from moeshard.integrations import pretrained

        self._mod = pretrained
        self._orig = (pretrained.parallelize, pretrained.load)
        orig_par, orig_load = self._orig

        def parallelize(*args, **kwargs):
            self.t_parallelize = time.perf_counter()
            return orig_par(*args, **kwargs)

        def load(*args, **kwargs):
            self.t_load = time.perf_counter()
            self.report = orig_load(*args, **kwargs)
            self.t_load_end = time.perf_counter()
            return self.report

        pretrained.parallelize, pretrained.load = parallelize, load
        return self

    def __exit__(self, *exc) -> None:
        self._mod.parallelize, self._mod.load = self._orig

    def steps(self, t_call: float, t_return: float) -> dict[str, float]:
        """Seconds per step of the call that began at ``t_call`` and returned at ``t_return``
        (``perf_counter``), in order; they sum to the call's seconds."""
        assert self.report is not None and None not in (self.t_parallelize, self.t_load, self.t_load_end)
        out = {"build": self.t_parallelize - t_call, "parallelize": self.t_load - self.t_parallelize}
        phases = dict(self.report.phase_seconds)
        # load()'s own clock starts a moment after our wrapper's: that moment goes to materialize.
        first = next(iter(phases))
        phases[first] += (self.t_load_end - self.t_load) - sum(phases.values())
        out.update(phases)
        out["after_load"] = t_return - self.t_load_end
        return out

    def boundaries(self, t_call: float, t_return: float) -> list[tuple[str, float, float]]:
        """``(step, start, end)`` in ``perf_counter`` time, for :func:`attribute`."""
        out, t = [], t_call
        for name, s in self.steps(t_call, t_return).items():
            out.append((name, t, t + s))
            t += s
        return out


@dataclass
class CallProfiler:
    """Context manager: the calling thread's time inside the wrapped calls (module doc), as
    ``events`` ``(kind, start, end)``; calls nested inside a wrapped call are not counted again."""

    events: list[tuple[str, float, float]] = field(default_factory=list)

    def __enter__(self) -> CallProfiler:
        import torch.distributed as dist

        from moeshard.execute import DequantSink, ReaderSource, TensorSink
        from moeshard.io.extents import ExtentReads

        self._thread = threading.get_ident()
        self._depth = 0
        self._undo: list[tuple[Any, str, Any]] = []
        for name in ("read", "read_into", "start_read_into", "finish_reads"):
            self._wrap(ReaderSource, name, "reads")
        self._wrap(ReaderSource, "start_read", "reads", wrap_result=True)
        # Reads straight into place go by extents: their units call ExtentReads.read (looked up
        # on the class at each call, so the wrapper sees units made before or after it).
        self._wrap(ReaderSource, "read_ranges", "reads")
        for name in ("read", "advise"):
            self._wrap(ExtentReads, name, "reads")
        for cls in (TensorSink, DequantSink):
            self._wrap(cls, "put", "deliver", own=True)
        self._wrap(dist, "batch_isend_irecv", "p2p", wrap_result=True)
        self._wrap(dist, "broadcast", "bcast")
        for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast_object_list", "barrier"):
            self._wrap(dist, name, "collective")
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, orig in reversed(self._undo):
            setattr(obj, name, orig)
        self._undo.clear()

    @contextmanager
    def _timed(self, kind: str) -> Iterator[None]:
        if threading.get_ident() != self._thread or self._depth:
            yield
            return
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.events.append((kind, t0, time.perf_counter()))
            self._depth -= 1

    def _wrap(self, obj: Any, name: str, kind: str, wrap_result: bool = False, own: bool = False) -> None:
        """Replace ``obj.name`` by a timed wrapper (``own``: only if ``obj`` defines it itself;
        ``wrap_result``: the result is a callable (a read-ahead's wait) or a list of work
        handles (a P2P batch) whose waits are timed too)."""
        if own and name not in vars(obj):
            return
        orig = getattr(obj, name)

        def timed_result(result):
            if callable(result):

                def wait():
                    with self._timed(kind):
                        return result()

                return wait
            if isinstance(result, list):
                return [_TimedWork(w, self, kind) for w in result]
            return result

        def wrapper(*args, **kwargs):
            with self._timed(kind):
                result = orig(*args, **kwargs)
            return timed_result(result) if wrap_result else result

        self._undo.append((obj, name, orig))
        setattr(obj, name, wrapper)


class _TimedWork:
    """A work handle whose ``wait`` is timed as ``kind``."""

    def __init__(self, work, profiler: CallProfiler, kind: str):
        self._work, self._profiler, self._kind = work, profiler, kind

    def wait(self, *args, **kwargs):
        with self._profiler._timed(self._kind):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def attribute(
    events: list[tuple[str, float, float]], steps: list[tuple[str, float, float]], kinds: tuple[str, ...] = EXEC_KINDS
) -> dict[str, dict[str, float]]:
    """``{step: {kind: seconds, ..., "other": rest}}``: each event's seconds in the step whose
    interval holds its midpoint (pure); ``other`` is the step's seconds outside the events."""
    out: dict[str, dict[str, float]] = {}
    for name, a, b in steps:
        row = {k: 0.0 for k in kinds}
        for kind, s, e in events:
            if a <= (s + e) / 2 < b:
                row[kind] = row.get(kind, 0.0) + (e - s)
        row["other"] = max(0.0, (b - a) - sum(row.values()))
        out[name] = row
    return out


def profiled(fn: Callable[[], Any]) -> tuple[Any, dict[str, float], dict[str, dict[str, float]]]:
    """Run ``fn`` (one ``moeshard.from_pretrained`` call) under both wrappers:
    ``(result, steps, {step: {kind: seconds}})``."""
    with PretrainedSteps() as st, CallProfiler() as prof:
        t0 = time.perf_counter()
        result = fn()
        t1 = time.perf_counter()
    return result, st.steps(t0, t1), attribute(prof.events, st.boundaries(t0, t1))
