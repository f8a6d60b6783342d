"""Writing safetensors: a sharded checkpoint with its index (:func:`write_checkpoint`), and the
pieces of writers that place tensor data themselves (:func:`safetensors_header`,
:func:`pwrite_all`).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .index import INDEX_NAME, CheckpointIndex

if TYPE_CHECKING:
    import torch

__all__ = ["safetensors_header", "pwrite_all", "write_checkpoint"]


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
    written under a temporary name and renamed; an index already in ``directory`` is removed
    first and the new one is renamed last, so a crash never leaves a directory that looks
    complete.
    """
    from safetensors.torch import save_file

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    # An index already here would name files this call replaces: gone before the first one is.
    (root / INDEX_NAME).unlink(missing_ok=True)
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
