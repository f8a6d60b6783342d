"""What every public operation returns: one report base.

Every operation (load, verify, relocate, save, LoRA load / save) runs the same skeleton on
every rank: *describe* the model or tensors -> *plan* (pure, the same on every rank) -> *agree*
on the plan's fingerprint (one exchange that also raises every rank's planning error on every
rank, before any byte moves) -> *run* the schedule with the one runner
(:func:`moeshard.execute.execute_schedule`) -> *report*. The report's common part is this
rank's view of the run; each operation adds its own fields.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

__all__ = ["OpReport", "Phases"]


@dataclass(frozen=True, kw_only=True)
class OpReport:
    """The fields every operation reports (keyword-only; ``*_rank``: this rank's).

    Args:
        rank, world_size: this rank and the job's size.
        wall_seconds, plan_seconds: the whole call, and its part before any data moves
            (materialize, storage and headers, describe + plan + agree).
        phase_seconds: this rank's wall seconds per step of the call, in order (e.g. load:
            ``materialize``, ``headers``, ``plan``, ``scales``, ``execute``, ``finish``); each
            step ends with its exchange, so a step's time includes waiting for the slowest rank.
        phase_cpu_seconds: the CPU seconds of the calling thread in each step (not the reader
            threads'): a step's wall time far above it is waiting (for peers, I/O, or a core
            when ranks outnumber the cores).
        fingerprint: the plan every rank agreed on.
        plan: the plan's job-wide cost counters (``cost.summary()``).
        bytes_read_rank, bytes_sent_rank, bytes_received_rank: storage reads, P2P / broadcast
            bytes sent and received (staging buffers) by this rank.
        peak_staging_bytes_rank: most staging bytes this rank held at once.
    """

    rank: int
    world_size: int = 1
    wall_seconds: float = 0.0
    plan_seconds: float = 0.0
    fingerprint: str = ""
    plan: dict = field(default_factory=dict)
    bytes_read_rank: int = 0
    bytes_sent_rank: int = 0
    bytes_received_rank: int = 0
    peak_staging_bytes_rank: int = 0
    phase_seconds: dict = field(default_factory=dict)
    phase_cpu_seconds: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Every field, for JSON (``json.dumps(report.to_dict())``)."""
        return asdict(self)


class Phases:
    """Wall and thread CPU seconds per step of one call (``OpReport.phase_seconds``,
    ``phase_cpu_seconds``): each :meth:`end` closes the step that began where the previous one
    ended (the first at ``t0``, its CPU time from this object's creation)."""

    def __init__(self, t0: float):
        self.last, self.seconds = t0, {}
        self.last_cpu, self.cpu_seconds = time.thread_time(), {}

    def end(self, name: str) -> float:
        """Close step ``name`` (started where the previous one ended); the time now."""
        now, cpu = time.perf_counter(), time.thread_time()
        self.seconds[name] = now - self.last
        self.cpu_seconds[name] = cpu - self.last_cpu
        self.last, self.last_cpu = now, cpu
        return now
