"""Progress of a load or relocation: bytes done / total, rate and ETA.

Quiet by default in library use. With ``progress=True`` (or ``MOESHARD_PROGRESS=1`` in the
environment) local rank 0 of each node reports for its own rank: a tqdm bar when stderr is a
terminal, otherwise structured lines on the ``moeshard`` logger (INFO, at most one every
``interval`` seconds, and one at the end). One rank per node keeps a 256-rank job's output
readable; the ranks of a node move similar amounts.
"""

from __future__ import annotations

import logging
import os
import sys
import time

__all__ = ["Progress", "progress_enabled", "logger"]

logger = logging.getLogger("moeshard")
logger.addHandler(logging.NullHandler())  # a library stays quiet unless the user configures logging


def progress_enabled(progress: bool | None) -> bool:
    """``progress`` if given, else the ``MOESHARD_PROGRESS`` environment variable."""
    if progress is not None:
        return bool(progress)
    return os.environ.get("MOESHARD_PROGRESS", "0").lower() in ("1", "true", "yes")


class Progress:
    """Counts bytes for one operation on one rank (call :meth:`update`, then :meth:`close`)."""

    def __init__(
        self, what: str, total: int, *, enabled: bool, local_rank: int, node: int, interval: float = 2.0, stream=None
    ):
        self.what, self.total, self.node, self.interval = what, int(total), node, interval
        self.done = 0
        self.active = enabled and local_rank == 0 and self.total > 0
        self.t0 = self._last = time.perf_counter()
        self.bar = None
        stream = sys.stderr if stream is None else stream
        if self.active and getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=stream,
                desc=f"moeshard {what} (node {node})",
                leave=False,
            )

    def update(self, nbytes: int) -> None:
        if not self.active:
            return
        self.done += int(nbytes)
        if self.bar is not None:
            self.bar.update(int(nbytes))
            return
        now = time.perf_counter()
        if now - self._last >= self.interval:
            self._last = now
            self._log(now)

    def _log(self, now: float, final: bool = False) -> None:
        elapsed = max(now - self.t0, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        logger.info(
            "moeshard %s node=%d bytes_done=%d bytes_total=%d percent=%.1f rate_mib_s=%.1f %s",
            self.what,
            self.node,
            self.done,
            self.total,
            100.0 * self.done / self.total,
            rate / 2**20,
            f"elapsed_s={elapsed:.2f}" if final else f"eta_s={eta:.1f}",
        )

    def close(self) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.close()
        self._log(time.perf_counter(), final=True)
