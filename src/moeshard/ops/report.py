"""What every public operation returns: one report base.

Every operation (load, verify, relocate, save, LoRA load / save) runs the same skeleton on
every rank: *describe* the model or tensors -> *plan* (pure, the same on every rank) -> *agree*
on the plan's fingerprint (one exchange that also raises every rank's planning error on every
rank, before any byte moves) -> *run* the schedule with the one runner
(:func:`moeshard.execute.execute_schedule`) -> *report*. The report's common part is this
rank's view of the run; each operation adds its own fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["OpReport"]


@dataclass(frozen=True, kw_only=True)
class OpReport:
    """The fields every operation reports (keyword-only; ``*_rank``: this rank's).

    Args:
        rank, world_size: this rank and the job's size.
        wall_seconds, plan_seconds: the whole call, and its describe + plan + agree part.
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

    def to_dict(self) -> dict:
        """Every field, for JSON (``json.dumps(report.to_dict())``)."""
        return asdict(self)
