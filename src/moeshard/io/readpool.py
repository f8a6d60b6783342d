"""Parallel checkpoint reads: a pool of threads issuing ``preadv`` into their destinations.

``os.preadv`` releases the GIL, so a few threads keep several reads in flight per rank: on a
node with many cores per GPU, one rank's serial reads leave most of the storage bandwidth (and
of the page cache's memcpy bandwidth) unused. Where each read lands:

* a CPU destination of the checkpoint's dtype, contiguous: ``preadv`` straight into it;
* a CUDA destination: ``preadv`` into a *pinned* host buffer, then a non-blocking
  host-to-device copy (cast on the way) on the worker's own side stream, ordered after the
  submitter's stream, so the copy overlaps the next reads. The pinned bytes whose copies may
  still run are bounded by ``buffer_bytes`` (plus the reads in progress, one per thread): a
  worker that would exceed it first waits for the oldest copies' events (never a device
  synchronize);
* anything else (a cast on the CPU, another accelerator): the reader's own path (a staging
  buffer, then ``copy_``), on the worker.

Pinned memory is used only for CUDA destinations, so the CPU path allocates nothing extra.
:meth:`ReadPool.drain` makes the caller's current stream wait for every side stream before
the destinations are used. Which ranks call what: each rank that reads owns its pool; nothing
here communicates.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..box import Box, box_numel, box_shape
from .reader import CheckpointReader

__all__ = ["ReadPool", "default_read_threads"]

# Pinned host bytes in flight per rank when nothing else is said (reads of CUDA destinations).
DEFAULT_BUFFER_BYTES = 256 * 2**20


def default_read_threads(local_world_size: int, device_type: str = "cpu") -> int:
    """Reader threads per rank: ``MOESHARD_READ_THREADS`` if set, else this host's cores shared
    among its ranks, at most 8 for CPU destinations and at most 4 for accelerator ones (1, i.e.
    no pool, where a rank has one core or less).

    Why 4 on a GPU: on an H200 host (16 cores, one rank, a 4.7 GiB checkpoint in the page cache,
    ``benchmarks/bench_gpu.py``) the pinned-buffer path loaded at 7.9 GiB/s with 4 threads, 7.1
    with 8 and 3.8 with 1 (safetensors ``load_file(device="cuda")``: 5.7)."""
    env = os.environ.get("MOESHARD_READ_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"MOESHARD_READ_THREADS must be a positive integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"MOESHARD_READ_THREADS must be a positive integer, got {env!r}")
        return n
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8 if device_type == "cpu" else 4, cores // max(local_world_size, 1)))


class _PinnedBudget:
    """Bounds the pinned bytes whose host-to-device copies may still be running: each entry is
    ``(event, nbytes)`` in record order; a reservation beyond the bound waits for the oldest
    events. The buffers themselves come from torch's caching host allocator, which does not
    hand a block out again before the copies recorded on it have finished."""

    def __init__(self, limit: int):
        self.limit = limit
        self.lock = threading.Lock()
        self.pending: collections.deque = collections.deque()
        self.held = 0

    def reserve(self, nbytes: int) -> None:
        while True:
            with self.lock:
                # Nothing left to wait for (a read larger than the whole bound runs alone).
                if self.held + nbytes <= self.limit or not self.pending:
                    self.held += nbytes
                    return
                event, n = self.pending.popleft()
            event.synchronize()  # that copy's event only: the device goes on with the rest
            with self.lock:
                self.held -= n

    def recorded(self, event, nbytes: int) -> None:
        with self.lock:
            self.pending.append((event, nbytes))


class ReadPool:
    """Reads boxes of checkpoint tensors into destination tensors on ``threads`` worker threads.

    ``submit`` returns at once; :meth:`drain` waits for everything submitted and returns the
    errors of the reads that failed (each naming its file and offset, as the reader raises
    them), so a caller can report them on every rank instead of raising on one. ``bytes_done``
    counts the bytes of reads that completed. Use one pool per reader; close it (or use it as a
    context manager) to stop the threads.
    """

    def __init__(self, reader: CheckpointReader, threads: int, buffer_bytes: int = DEFAULT_BUFFER_BYTES):
        if threads < 1:
            raise ValueError(f"read threads must be >= 1, got {threads}")
        self.reader = reader
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moeshard-read")
        self._futures: list[Future] = []
        self._lock = threading.Lock()
        self._budget = _PinnedBudget(buffer_bytes)
        self._streams: dict[int, object] = {}  # worker thread id -> its CUDA side stream
        self.bytes_done = 0

    def submit(self, key: str, box: Box, out: torch.Tensor) -> None:
        """Read ``box`` of checkpoint tensor ``key`` into ``out`` (shape ``box_shape(box)``, any
        dtype the cast rule allows, any device) on a worker thread; :meth:`drain` waits for it,
        and its bytes count in ``bytes_done``."""
        self._futures.append(self._start(key, box, out, counted=True))

    def run(self, read: Callable[[], int]) -> None:
        """Call ``read`` (a read straight into CPU destinations, e.g. one extent of
        :class:`~moeshard.io.extents.ExtentReads`) on a worker thread; it returns the bytes it
        landed, counted in ``bytes_done``; :meth:`drain` waits for it and returns its error."""
        self._futures.append(self._pool.submit(self._run, read))

    def _run(self, read: Callable[[], int]) -> None:
        nbytes = read()
        with self._lock:
            self.bytes_done += nbytes

    def read_ahead(self, key: str, box: Box, out: torch.Tensor) -> Callable[[], None]:
        """Start reading ``box`` of ``key`` into ``out`` (as :meth:`submit`) for a caller that
        waits for this read itself: returns the wait, which raises the read's error and makes
        the caller's current CUDA stream wait for the copy. Not in :meth:`drain` nor in
        ``bytes_done``."""
        future = self._start(key, box, out, counted=False)

        def wait() -> None:
            event = future.result()
            if event is not None:
                torch.cuda.current_stream(out.device).wait_event(event)

        return wait

    def _start(self, key: str, box: Box, out: torch.Tensor, counted: bool) -> Future:
        if tuple(out.shape) != box_shape(box):
            raise ValueError(f"{key}: destination of shape {list(out.shape)} for a box of shape {list(box_shape(box))}")
        # The destination may be fresh memory of the submitter's stream: copies are ordered after it.
        after = torch.cuda.current_stream(out.device) if out.device.type == "cuda" else None
        return self._pool.submit(self._read, key, box, out, after, counted)

    def _read(self, key: str, box: Box, out: torch.Tensor, after, counted: bool):
        """One read on a worker thread; the CUDA event of its copy (None: no copy pending)."""
        info = self.reader.index.info(key)
        nbytes = box_numel(box) * info.itemsize
        event = None
        if out.device.type == "cuda" and nbytes:
            self._budget.reserve(nbytes)
            stream = self._stream(out.device)
            host = torch.empty(box_shape(box), dtype=info.torch_dtype, pin_memory=True)
            try:
                self.reader.read(key, box, out=host)
            except BaseException:
                self._budget.recorded(_DoneEvent(), nbytes)
                raise
            with torch.cuda.stream(stream):
                stream.wait_stream(after)
                if out.dtype == host.dtype:
                    out.copy_(host, non_blocking=True)
                else:  # the checkpoint's bytes to the device, cast there (torch would cast on the host)
                    out.copy_(host.to(out.device, non_blocking=True))
                event = torch.cuda.Event()
                event.record(stream)
            self._budget.recorded(event, nbytes)
        else:
            self.reader.read(key, box, out=out)
        if counted:
            with self._lock:
                self.bytes_done += nbytes
        return event

    def _stream(self, device: torch.device):
        tid = threading.get_ident()
        with self._lock:
            stream = self._streams.get(tid)
            if stream is None:
                stream = self._streams[tid] = torch.cuda.Stream(device=device)
        return stream

    def drain(self) -> list[BaseException]:
        """Wait for every read submitted so far; the errors of those that failed, in submission
        order. The caller's current CUDA stream then waits for the side streams' copies."""
        futures, self._futures = self._futures, []
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        return errors

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ReadPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _DoneEvent:
    """Stands for the event of a copy that never started (its read failed)."""

    def synchronize(self) -> None:
        pass
