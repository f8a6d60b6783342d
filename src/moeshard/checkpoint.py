"""Safetensors checkpoints: validated headers, lazy box reads, and a sharded writer.

This is the only module that touches checkpoint files. Files are untrusted input: the index
may only name files inside its directory, header offsets must lie inside the file and agree
with dtype x shape, and a truncated file is reported with its name. Data is read with
``pread`` into bounded buffers (never mmap-ed whole, never unpickled), so a rank's memory
grows by what it reads, not by the files it touches.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from .box import Box, box_numel, box_shape, check_box, full_box

__all__ = ["TensorInfo", "CheckpointIndex", "CheckpointReader", "CheckpointError", "write_checkpoint",
           "safetensors_header", "pwrite_all"]

INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file, index or header is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives: ``file`` (relative to the checkpoint root), absolute byte
    ``offset`` of its first element, dtype name (safetensors spelling) and shape."""

    file: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class CheckpointIndex:
    """Headers of a checkpoint: every tensor's file, offset, dtype and shape.

    Plain data (picklable), so one rank can read the headers and send them to ranks that
    cannot see the files. ``file_sizes`` lets a reader detect a different copy of a file.
    """

    root: str
    tensors: dict[str, TensorInfo]
    file_sizes: dict[str, int]

    @classmethod
    def open(cls, path: str | os.PathLike) -> "CheckpointIndex":
        """Read the index (a directory with ``model.safetensors.index.json`` or that file
        itself, a directory with one ``.safetensors`` file, or a ``.safetensors`` file) and
        every header."""
        p = Path(path)
        if p.name == INDEX_NAME and p.is_file():
            p = p.parent  # the index file stands for its checkpoint directory
        if p.is_file():
            root, files = p.parent, {p.name: None}
        elif (p / INDEX_NAME).is_file():
            root, files = p, _read_index(p)
        elif p.is_dir():
            singles = sorted(x.name for x in p.glob("*.safetensors"))
            if len(singles) != 1:
                raise CheckpointError(
                    f"{p}: expected {INDEX_NAME} or exactly one .safetensors file, found {len(singles)}"
                )
            root, files = p, {singles[0]: None}
        else:
            raise CheckpointError(f"{p}: no such checkpoint file or directory")
        tensors: dict[str, TensorInfo] = {}
        sizes: dict[str, int] = {}
        for name, expected_keys in files.items():
            header, size = _read_header(root / name)
            sizes[name] = size
            if expected_keys is None:
                expected_keys = list(header)
            for key in expected_keys:
                if key not in header:
                    raise CheckpointError(f"{INDEX_NAME} places {key!r} in {name}, but {name} has no such tensor")
                tensors[key] = TensorInfo(name, *header[key])
        return cls(str(root), tensors, sizes)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def info(self, key: str) -> TensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.root} has no tensor {key!r}") from None


def _read_index(root: Path, require_files: bool = True) -> dict[str, list[str]]:
    """The index's ``weight_map`` as ``{normalized file name: [keys]}``, every file name
    validated; ``require_files=False`` accepts names of files that do not exist (for a
    report that lists them rather than stopping at the first)."""
    try:
        with open(root / INDEX_NAME, "rb") as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{root / INDEX_NAME}: unreadable index: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{root / INDEX_NAME}: no 'weight_map' object")
    files: dict[str, list[str]] = {}
    # Each distinct file name is validated (and stat-ed) once, not once per key: a large
    # MoE index maps ~100,000 keys to a few dozen files.
    checked: dict[str, list[str]] = {}  # name as written -> its keys (in files[normalized])
    for key, name in weight_map.items():
        keys = checked.get(name) if isinstance(name, str) else None
        if keys is None:
            keys = checked[name] = files.setdefault(_check_index_name(root, key, name, require_files), [])
        keys.append(key)
    return files


def _check_index_name(root: Path, key: str, name: object, require_file: bool = True) -> str:
    """Validate one file name of an index (first named by ``key``); its normalized form."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{root / INDEX_NAME}: key {key!r} maps to {name!r}, not a file name")
    # Untrusted index: "../x" or an absolute path must not escape the checkpoint directory.
    # The check is on the name, not on the resolved file: the directory's own symlinks
    # (a Hugging Face cache snapshot links every file to ../../blobs/) are followed.
    norm = os.path.normpath(name)
    if os.path.isabs(norm) or norm == os.pardir or norm.startswith(os.pardir + os.sep):
        raise CheckpointError(
            f"{root / INDEX_NAME}: key {key!r} names {name!r}, which is outside the checkpoint directory"
        )
    if require_file and not (root / norm).is_file():
        raise CheckpointError(f"{root / INDEX_NAME}: key {key!r} names {name!r}, which does not exist")
    return norm


def _read_header(path: Path) -> tuple[dict[str, tuple[int, str, tuple[int, ...]]], int]:
    """Parse and validate a safetensors header -> {key: (abs offset, dtype, shape)}, file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated file ({size} bytes), no safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path}: header length {n} does not fit in the file ({size} bytes): truncated or not safetensors"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    out: dict[str, tuple[int, str, tuple[int, ...]]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: header entry {key!r} lacks dtype/shape/data_offsets") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {key!r} has unsupported dtype {dtype!r}")
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not all(
            isinstance(o, int) for o in (begin, end)
        ):
            raise CheckpointError(f"{path}: tensor {key!r} has a malformed shape or offsets")
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if not 0 <= begin <= end <= data_len or end - begin != nbytes:
            raise CheckpointError(
                f"{path}: tensor {key!r} has data_offsets [{begin}, {end}] but dtype {dtype} x shape "
                f"{list(shape)} needs {nbytes} bytes inside a data section of {data_len} bytes "
                "(truncated or corrupt file)"
            )
        out[key] = (data_start + begin, dtype, shape)
    return out, size


class CheckpointReader:
    """Reads boxes of tensors from a checkpoint this rank can see; counts bytes read.

    Files are opened lazily and checked against the index's recorded size (a node-local copy
    that differs is an error, not a silent misread).
    """

    def __init__(self, index: CheckpointIndex, root: str | os.PathLike | None = None):
        self.index = index
        self.root = Path(index.root if root is None else root)
        self.bytes_read = 0
        self._fds: dict[str, int] = {}

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            path = self.root / name
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open: {e}") from None
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

    def _pread(self, fd: int, buf: torch.Tensor, offset: int, name: str) -> None:
        view = memoryview(buf.numpy()).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self.root / name}: unexpected end of file at byte {offset + done}")
            done += n
        self.bytes_read += done

    def read(self, key: str, box: Box | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read ``box`` of tensor ``key`` (whole tensor if None).

        Returns a CPU tensor of the checkpoint's dtype and shape ``box_shape(box)``, or, with
        ``out`` (any device/dtype, that shape), casts into ``out`` and returns it.
        """
        info = self.index.info(key)
        box = full_box(info.shape) if box is None else box
        check_box(box, info.shape, f"{key}")
        shape = box_shape(box)
        if out is not None and tuple(out.shape) != shape:
            raise ValueError(f"{key}: destination of shape {list(out.shape)} for a box of shape {list(shape)}")
        direct = out is not None and out.device.type == "cpu" and out.dtype == info.torch_dtype and out.is_contiguous()
        buf = out if direct else torch.empty(shape, dtype=info.torch_dtype)
        if box_numel(box):
            self._read_into(info, box, buf.view(-1).view(torch.uint8), key)
        if out is None or direct:
            return buf
        return out.copy_(buf)

    def _read_into(self, info: TensorInfo, box: Box, flat: torch.Tensor, key: str) -> None:
        fd = self._fd(info.file)
        shape, item = info.shape, info.itemsize
        if not shape:  # a 0-dim tensor: one element
            self._pread(fd, flat, info.offset, info.file)
            return
        # Collapse trailing dims the box covers fully: each run is then one contiguous read.
        k = len(shape) - 1
        while k > 0 and box[k] == (0, shape[k]):
            k -= 1
        inner = math.prod(shape[k + 1 :])
        run = box[k][1] * inner * item
        strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
        outer = box[:k]
        num_runs = math.prod(n for _, n in outer)
        base = info.offset + box[k][0] * inner * item
        if num_runs == 1:
            start = base + sum(o * strides[d] * item for d, (o, _) in enumerate(outer))
            self._pread(fd, flat, start, info.file)
            return
        # Several runs (a box cut along a later dim): one pread per run.
        idx = [0] * k
        pos = 0
        for _ in range(num_runs):
            start = base + sum((outer[d][0] + idx[d]) * strides[d] * item for d in range(k))
            self._pread(fd, flat[pos : pos + run], start, info.file)
            pos += run
            for d in reversed(range(k)):
                idx[d] += 1
                if idx[d] < outer[d][1]:
                    break
                idx[d] = 0

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def safetensors_header(entries: Iterable[tuple[str, str, Iterable[int], int, int]]) -> bytes:
    """The bytes a safetensors file starts with, for writers that place tensor data themselves:
    ``entries`` are ``(key, dtype name, shape, begin, end)`` with data offsets relative to the
    end of the header. Returns the 8-byte little-endian length + JSON padded with spaces to a
    multiple of 8 (as safetensors writes it)."""
    meta: dict = {"__metadata__": {"format": "pt"}}
    for key, dtype, shape, begin, end in entries:
        meta[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` (bytes-like) at ``offset`` of ``fd`` (``pwrite`` may write less)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        done += n


def write_checkpoint(
    directory: str | os.PathLike,
    tensors: Iterable[tuple[str, torch.Tensor]],
    max_shard_bytes: int = 5 * 2**30,
    metadata: dict[str, str] | None = None,
) -> CheckpointIndex:
    """Write ``(key, tensor)`` pairs as HF-style sharded safetensors + index.

    Tensors are consumed one shard at a time (memory stays at one shard). Every file is
    written under a temporary name and renamed; the index is renamed last, so a crash never
    leaves a directory that looks complete.
    """
    from safetensors.torch import save_file

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    shards: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0

    def flush(batch: dict[str, torch.Tensor]) -> None:
        name = f"model-{len(shards) + 1:05d}.safetensors"
        tmp = root / (name + ".tmp")
        save_file(batch, str(tmp), metadata={"format": "pt", **(metadata or {})})
        os.replace(tmp, root / name)
        shards.append(name)
        weight_map.update({k: name for k in batch})

    batch: dict[str, torch.Tensor] = {}
    batch_bytes = 0
    for key, t in _unique(tensors):
        nbytes = t.numel() * t.element_size()
        if batch and batch_bytes + nbytes > max_shard_bytes:
            flush(batch)
            batch, batch_bytes = {}, 0
        batch[key] = t.detach().contiguous().cpu()
        batch_bytes += nbytes
        total += nbytes
    if batch:
        flush(batch)
    # HF names shards "-of-N"; the count is only known now, so rename once at the end.
    final = {s: f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i, s in enumerate(shards)}
    for old, new in final.items():
        os.replace(root / old, root / new)
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}
    tmp = root / (INDEX_NAME + ".tmp")
    tmp.write_text(json.dumps(index, indent=2))
    os.replace(tmp, root / INDEX_NAME)
    return CheckpointIndex.open(root)


def _unique(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[str] = set()
    for key, t in pairs:
        if key in seen:
            raise ValueError(f"tensor {key!r} given twice")
        seen.add(key)
        yield key, t
