"""Emptying the page cache before a cold-read measurement (the benchmarks' ``--cache cold``)."""

from __future__ import annotations

import os

__all__ = ["DROP_CACHES", "cold_cache_problem", "drop_page_cache", "drop_file_cache"]

DROP_CACHES = "/proc/sys/vm/drop_caches"


def cold_cache_problem() -> str | None:
    """Why this process cannot drop the page cache (not root, or the file not writable), or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not running as root"
    if not os.path.exists(DROP_CACHES):
        return f"{DROP_CACHES} does not exist (not Linux?)"
    if not os.access(DROP_CACHES, os.W_OK):
        return f"{DROP_CACHES} is not writable (a read-only /proc in this container?)"
    return None


def drop_page_cache() -> None:
    """Write dirty pages, then drop the host's page cache, dentries and inodes (every process
    on the host reads from storage again afterwards). Raises OSError where not permitted."""
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3")


def drop_file_cache(directory: str, suffix: str = ".safetensors") -> None:
    """Best effort without root: ``posix_fadvise(DONTNEED)`` on the files of ``directory``
    ending in ``suffix`` (pages another process maps or dirties may stay)."""
    for name in os.listdir(directory):
        if name.endswith(suffix):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
