"""Box reads from a checkpoint's files: :class:`CheckpointReader`.

Data is read with ``pread`` into bounded buffers (never mmap-ed whole, never unpickled), so a
rank's memory grows by what it reads, not by the files it touches.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..box import Box, box_numel, box_shape, check_box, full_box
from .errors import CheckpointError
from .index import CheckpointIndex

if TYPE_CHECKING:
    import torch

__all__ = ["DIRECT_ALIGN", "DIRECT_BOUNCE_BYTES", "IOV_MAX", "CheckpointReader", "FileExtent", "ExtentPart"]


class ExtentPart(Protocol):
    """One part of a :class:`FileExtent`: ``nbytes`` bytes into segment ``seg`` (-1: a gap)."""

    @property
    def seg(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class FileExtent(Protocol):
    """What :meth:`CheckpointReader.read_extent` reads: a :class:`~moeshard.io.extents.Extent`
    (built on this module, which therefore does not import it): ``nbytes`` bytes of ``file``
    from ``offset`` on, as ``parts`` in order, ``gap_bytes`` of them in gaps."""

    @property
    def file(self) -> str: ...

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def parts(self) -> Sequence[ExtentPart]: ...

    @property
    def gap_bytes(self) -> int: ...


# O_DIRECT reads: offsets and lengths in whole blocks of this size (the largest logical block
# size of common devices), through a bounce buffer of this many bytes per reading thread.
DIRECT_ALIGN = 4096
DIRECT_BOUNCE_BYTES = 8 * 2**20
# Buffers one preadv fills at most (the system's IOV_MAX; POSIX guarantees 16, Linux has 1024).
IOV_MAX = max(16, os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 16)


class CheckpointReader:
    """Reads boxes of tensors from a checkpoint this rank can see; counts bytes read.

    Files are opened lazily and checked against the index's recorded size (a node-local copy
    that differs is an error, not a silent misread). Safe to read from several threads at once
    (:class:`~moeshard.io.readpool.ReadPool`): reads are positional, opening a file and counting
    bytes take a lock.

    ``direct_io``: open the files with ``O_DIRECT`` (Linux), bypassing the page cache: for
    cold storage read once, or a checkpoint larger than host memory. Direct reads must be
    aligned to the device's blocks, so each read goes through an aligned bounce buffer of
    :data:`DIRECT_BOUNCE_BYTES` per thread (reading whole 4 KiB blocks around the wanted
    bytes). A file system without direct I/O (tmpfs) is a CheckpointError naming the file.
    """

    def __init__(self, index: CheckpointIndex, root: str | os.PathLike | None = None, direct_io: bool = False):
        if direct_io and not hasattr(os, "O_DIRECT"):
            raise ValueError("direct_io needs O_DIRECT, which this platform does not have (Linux does)")
        self.index = index
        self.root = Path(index.root if root is None else root)
        self.direct_io = direct_io
        self.bytes_read = 0
        self.gap_bytes_read = 0
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._bounce = threading.local()
        self._shapes_checked: set[str] = set()  # packed weights whose weight_shape was checked

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        with self._lock:
            return self._open(name)

    def _open(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            path = self.root / name
            try:
                fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct_io else 0))
            except OSError as e:
                why = " with O_DIRECT (does its file system support direct I/O?)" if self.direct_io else ""
                raise CheckpointError(f"{path}: cannot open{why}: {e}") from None
            size = os.fstat(fd).st_size
            if size != self.index.file_sizes[name]:
                os.close(fd)
                raise CheckpointError(
                    f"{path}: {size} bytes, but the checkpoint index was built from a copy of "
                    f"{self.index.file_sizes[name]} bytes (truncated or different file)"
                )
            self._fds[name] = fd
        return fd

    def check_files(self, names: Iterable[str]) -> None:
        """Open (and size-check) these files now, so errors surface before data moves."""
        for name in sorted(set(names)):
            self._fd(name)

    def check_keys(self, keys: Iterable[str]) -> None:
        """Before data moves (in a plan's agreed step, on each rank that will read ``keys``): open
        and size-check their files, and check the ``weight_shape`` value of each packed weight
        among them (compressed-tensors: a few bytes each, once per reader). CheckpointError
        naming the key."""
        keys = sorted(set(keys))
        self.check_files({self.index.info(k).file for k in keys})
        for k in keys:
            pw = self.index.packed.get(k)
            if pw is not None and pw.shape_key:
                self._check_weight_shape(pw)

    def _check_weight_shape(self, pw) -> None:
        """:func:`~moeshard.io.quant.check_weight_shape` of packed weight ``pw`` (it has a
        ``shape_key``), read now (not counted in ``bytes_read``: no plan reads it), once."""
        if pw.key in self._shapes_checked:
            return
        from .quant import check_weight_shape

        info = self.index.tensors[pw.shape_key]
        if info.dtype not in ("I32", "I64") or info.nbytes > 64:
            raise CheckpointError(f"{info.file}: a weight_shape of dtype {info.dtype} and {info.nbytes} bytes")
        path = self.root / info.file
        with open(path, "rb") as f:  # not the reader's descriptor, which may be O_DIRECT
            f.seek(info.offset)
            data = f.read(info.nbytes)
        if len(data) != info.nbytes:
            raise CheckpointError(f"{path}: unexpected end of file at byte {info.offset + len(data)}")
        width = 4 if info.dtype == "I32" else 8
        value = [int.from_bytes(data[i : i + width], "little", signed=True) for i in range(0, len(data), width)]
        try:
            check_weight_shape(pw, value)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {self.index.root}: {e}") from None
        self._shapes_checked.add(pw.key)

    def _pread(self, fd: int, buf, offset: int, name: str) -> None:
        """Fill ``buf`` from file byte ``offset`` on: a tensor (its bytes), or a list of
        writable byte buffers filled in order (one ``preadv`` with several iovecs: an extent).
        Short reads continue where they stopped; the end of the file is a CheckpointError."""
        views = [memoryview(buf.numpy()).cast("B")] if not isinstance(buf, list) else list(buf)
        total = sum(len(v) for v in views)
        done = 0
        first = 0  # views[first] is the first not yet full
        while done < total:
            if self.direct_io:
                n = self._pread_direct(fd, views[first], offset + done)
            else:
                n = os.preadv(fd, views[first : first + IOV_MAX], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self.root / name}: unexpected end of file at byte {offset + done}")
            done += n
            while first < len(views) and n >= len(views[first]):
                n -= len(views[first])
                first += 1
            if n:  # a short read inside one buffer: its rest next
                views[first] = views[first][n:]

    def _pread_direct(self, fd: int, view: memoryview, offset: int) -> int:
        """One aligned ``O_DIRECT`` read of the blocks around the first bytes of ``view`` (at
        file ``offset``) into this thread's bounce buffer, copied out; the bytes copied (0 at
        the end of the file)."""
        bounce = getattr(self._bounce, "buf", None)
        if bounce is None:
            bounce = self._bounce.buf = mmap.mmap(-1, DIRECT_BOUNCE_BYTES)  # page-aligned
        skip = offset % DIRECT_ALIGN
        want = min(len(view), DIRECT_BOUNCE_BYTES - skip)
        span = -(-(skip + want) // DIRECT_ALIGN) * DIRECT_ALIGN
        got = os.preadv(fd, [memoryview(bounce)[:span]], offset - skip) - skip  # short at the end of the file
        n = max(0, min(got, want))
        view[:n] = memoryview(bounce)[skip : skip + n]
        return n

    def read(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read ``box`` of tensor ``key`` (whole tensor if None).

        Returns a CPU tensor of the checkpoint's dtype and shape ``box_shape(box)``, or, with
        ``out`` (any device/dtype, that shape), casts into ``out`` and returns it. A packed
        weight's logical key (``index.packed``, :mod:`moeshard.io.packed`) reads the packed
        values and scales of the box and returns it decoded, float32 (cast once into ``out``).
        """
        info = self.index.info(key)
        box = full_box(info.shape) if box is None else box
        check_box(box, info.shape, f"{key}")
        shape = box_shape(box)
        if out is not None and tuple(out.shape) != shape:
            raise ValueError(f"{key}: destination of shape {list(out.shape)} for a box of shape {list(shape)}")
        pw = self.index.packed.get(key)
        if pw is not None:
            from .packed import decode_blob, misaligned, read_blob

            why = misaligned(pw, box)
            if why is not None:
                raise ValueError(why)
            if pw.shape_key:
                self._check_weight_shape(pw)
            data = decode_blob(pw, box, read_blob(self, pw, box), self.index.tensors)
            return data if out is None else out.copy_(data)
        return self.read_info(key, info, box, out)

    def read_info(self, key: str, info, box: Box, out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`read` of a tensor described by ``info`` (a :class:`~moeshard.io.header.TensorInfo`
        of the index's files, e.g. a byte view of a stored tensor), named ``key`` in errors."""
        import torch  # the reader allocates tensors; the headers (above) need no torch

        shape = box_shape(box)
        direct = out is not None and out.device.type == "cpu" and out.dtype == info.torch_dtype and out.is_contiguous()
        buf = out if direct else torch.empty(shape, dtype=info.torch_dtype)
        if box_numel(box):
            flat = buf.view(-1).view(torch.uint8)
            fd = self._fd(info.file)
            pos = 0
            for start, n in self.info_runs(info, box):
                self._pread(fd, flat[pos : pos + n], start, info.file)
                pos += n
            with self._lock:
                self.bytes_read += pos
        if out is None or direct:
            return buf
        return out.copy_(buf)

    def reads_straight_into(self, key: str, out: torch.Tensor) -> bool:
        """Whether a read of ``key`` lands in ``out`` itself (a contiguous CPU tensor of the
        checkpoint's dtype), rather than in a buffer copied (and cast) into it; never for a
        packed weight's logical key (decoded)."""
        if key in self.index.packed:
            return False
        return out.device.type == "cpu" and out.dtype == self.index.info(key).torch_dtype and out.is_contiguous()

    def runs(self, key: str, box: Box) -> list[tuple[int, int]]:
        """The file byte ranges ``(offset, nbytes)`` that ``box`` of ``key`` is made of, in the
        box's row-major order (its bytes, concatenated, are the box as a contiguous tensor):
        one range unless the box is cut along a dim after its first cut one. Empty for an
        empty box. The box must lie inside the tensor (:func:`~moeshard.box.check_box`)."""
        return self.info_runs(self.index.info(key), box)

    def info_runs(self, info, box: Box) -> list[tuple[int, int]]:
        """:meth:`runs` of a tensor described by ``info``."""
        shape, item = info.shape, info.itemsize
        if not box_numel(box):
            return []
        if not shape:  # a 0-dim tensor: one element
            return [(info.offset, item)]
        # Collapse trailing dims the box covers fully: each run is then one contiguous range.
        k = len(shape) - 1
        while k > 0 and box[k] == (0, shape[k]):
            k -= 1
        inner = math.prod(shape[k + 1 :])
        run = box[k][1] * inner * item
        strides = [math.prod(shape[d + 1 :]) * item for d in range(k)]
        outer = box[:k]
        base = info.offset + box[k][0] * inner * item
        # Row-major over the outer dims: the first outer dim varies slowest.
        starts = [base]
        for d in range(k):
            o, n = outer[d]
            starts = [s + (o + i) * strides[d] for s in starts for i in range(n)]
        return [(s, run) for s in starts]

    def read_extent(self, extent: FileExtent, views: Sequence[memoryview], scratch: memoryview) -> None:
        """One :class:`~moeshard.io.extents.Extent` of a file with one ``preadv`` (several when
        it has more parts than the system's iovec limit, or when reads come back short):
        part ``i`` lands in ``views[extent.parts[i].seg]``, its gaps in ``scratch`` (a throwaway
        buffer at least as long as the longest gap). Counts the parts' bytes in ``bytes_read``,
        the gaps' in ``gap_bytes_read``."""
        iovs = [views[p.seg] if p.seg >= 0 else scratch[: p.nbytes] for p in extent.parts]
        self._pread(self._fd(extent.file), iovs, extent.offset, extent.file)
        with self._lock:
            self.bytes_read += extent.nbytes - extent.gap_bytes
            self.gap_bytes_read += extent.gap_bytes

    def advise(self, file: str, offset: int, nbytes: int) -> None:
        """Hint that ``nbytes`` of ``file`` from ``offset`` on will be read soon
        (``posix_fadvise(WILLNEED)``: the kernel starts reading them into the page cache).
        Nothing where the platform lacks it or with ``direct_io`` (no page cache)."""
        if self.direct_io or not hasattr(os, "posix_fadvise") or nbytes <= 0:
            return
        try:
            os.posix_fadvise(self._fd(file), offset, nbytes, os.POSIX_FADV_WILLNEED)
        except OSError:  # a hint: a file system without it reads on demand, as without the hint
            pass

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
