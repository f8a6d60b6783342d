"""This process's peak resident set size during one operation (``OpReport.peak_rss_bytes``).

On Linux the kernel's high-water mark (VmHWM) can be reset (write 5 to
``/proc/self/clear_refs``) and read back, so an operation measures its own peak: reset at its
start, read at its end. Where it cannot be reset (not Linux, /proc not writable) the fallback is
``ru_maxrss``: the peak over the whole process's life, which may be an earlier operation's.
Local to this process: no rank talks to another here.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

__all__ = ["PeakRss", "reset_peak_rss", "read_peak_rss", "ru_maxrss_bytes"]


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux VmHWM: write 5 to /proc/self/clear_refs);
    False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def read_peak_rss() -> int | None:
    """VmHWM of this process in bytes (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def ru_maxrss_bytes() -> int:
    """Peak RSS over the process's life (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass(frozen=True)
class PeakRss:
    """A peak RSS and where it comes from: ``source`` ``"vmhwm"`` (this operation's, the
    high-water mark reset at its start) or ``"ru_maxrss"`` (the process's whole life)."""

    bytes: int
    source: str

    @classmethod
    def since(cls, was_reset: bool) -> PeakRss:
        """The peak since :func:`reset_peak_rss` returned ``was_reset`` (True: VmHWM, if it can
        still be read; else ``ru_maxrss``)."""
        peak = read_peak_rss() if was_reset else None
        if peak is not None:
            return cls(peak, "vmhwm")
        return cls(ru_maxrss_bytes(), "ru_maxrss")
