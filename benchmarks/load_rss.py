"""Peak resident memory of one process over a block, for the load benchmarks.

:class:`RssMonitor` measures how far this process's resident set size (RSS) rose above its
level at the start of a block: the larger of a psutil sampling thread's peak and the kernel's
exact high-water mark (Linux VmHWM, reset at entry by writing 5 to ``/proc/self/clear_refs``).
``moeshard.load`` resets VmHWM itself at its start, so inside a block that calls it the
kernel's mark covers only the part from that reset on; the sampler covers the whole block.
"""

from __future__ import annotations

import ctypes
import threading

from moeshard.ops.peak_rss import read_peak_rss, reset_peak_rss

__all__ = ["RssMonitor", "malloc_trim", "read_peak_rss", "reset_peak_rss", "rss_parts"]


def malloc_trim() -> None:
    """Hand freed heap back to the OS, so that the next block's RSS baseline is not inflated
    by what the previous one freed (glibc; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_parts() -> dict[str, int]:
    """This process's resident bytes by kind (Linux ``/proc/self/status``): ``anon`` (heap,
    tensors), ``file`` (mapped files, e.g. an mmap-ed checkpoint), ``shmem``; {} elsewhere."""
    names = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(None, 1)[0] if line.strip() else ""
                if key in names:
                    out[names[key]] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


class RssMonitor:
    """Peak RSS growth of this process over a ``with`` block (bytes): ``growth`` is the peak
    minus the RSS at entry; ``final_growth`` the RSS at exit minus the RSS at entry (what the
    block left resident, e.g. a loaded model's shard), and ``final_growth_parts`` the same by
    kind (:func:`rss_parts`: anonymous memory vs mapped files)."""

    def __init__(self, interval: float = 0.01):
        import psutil

        self.proc = psutil.Process()
        self.interval = interval
        self.before = self.after = self.peak_sampled = self.peak_hwm = 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_sampled = max(self.peak_sampled, self.proc.memory_info().rss)

    def __enter__(self) -> RssMonitor:
        self._hwm = reset_peak_rss()
        self._parts0 = rss_parts()
        self.before = self.peak_sampled = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self.proc.memory_info().rss
        parts = rss_parts()
        self.final_growth_parts = {k: v - self._parts0.get(k, 0) for k, v in parts.items()}
        self.peak_sampled = max(self.peak_sampled, self.after)
        self.peak_hwm = (read_peak_rss() or 0) if self._hwm else 0

    @property
    def growth(self) -> int:
        return max(self.peak_sampled, self.peak_hwm) - self.before

    @property
    def final_growth(self) -> int:
        return self.after - self.before
