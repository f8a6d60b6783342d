"""One safetensors header, read and validated: :func:`read_header` -> ``{key: TensorInfo}``.

Files are untrusted input: header offsets must lie inside the file and agree with dtype x
shape, and a truncated file is reported with its name.

A header is accepted only if the safetensors library itself (the Rust crate behind
``safe_open``, checked against safetensors 0.8) would accept it, so a file moeshard loads is
a file every other reader loads identically:

* the JSON is at most 100,000,000 bytes (the format's ``MAX_HEADER_SIZE``), UTF-8, and
  JSON as serde_json (safetensors' parser) reads it (:mod:`moeshard.io.strict_json`): no NaN /
  Infinity, no number beyond float range, no unpaired UTF-16 surrogate escape, at most 127
  levels of nesting. No object repeats a key: stricter than safetensors, which keeps the last
  of two entries for one tensor; which one a reader sees is ambiguous, so that is an error here;
* each entry has a dtype torch has (safetensors also knows U16 / U32 / U64 / F4...: loud
  here), a shape of integers >= 0 (not bools, floats or ``-0``) whose running product stays
  below 2**63, and ``data_offsets`` ``[begin, end]`` with ``end - begin`` = dtype x shape
  bytes; unknown fields are ignored, as safetensors ignores them; ``__metadata__`` maps
  strings to strings;
* sorted by ``(begin, end)``, the byte ranges tile the data section exactly: the first
  begins at 0, each begins where the previous one ends, the last ends at the end of the
  file. Zero-byte tensors are allowed (at a boundary). This is safetensors'
  ``Metadata::validate`` + ``MetadataIncompleteBuffer`` rule. It makes ranges disjoint, so
  two keys can never alias the same bytes (expert 1 silently loading expert 0's weights),
  and leaves no unexplained bytes (a file that grew or was concatenated).

Every error is a :class:`~moeshard.io.errors.CheckpointError` naming the file (and the keys or
byte range at fault).
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..dtypes import ITEMSIZE, LazyTable, torch_dtypes
from .errors import CheckpointError
from .strict_json import (
    JsonRejected,
    brief,
    check_depth,
    check_surrogates,
    decode_utf8,
    json_errors,
    object_items,
    serde_int,
    strict_decoder,
    unique_keys,
)

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "MAX_HEADER_BYTES", "TensorInfo", "read_header"]

MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit (MAX_HEADER_SIZE): bytes, not MiB
# Shapes and byte offsets are int64 in torch; safetensors itself refuses a shape whose product
# overflows its usize (checked dim by dim, in order).
_MAX_INT = 2**63

# Safetensors dtype name -> torch dtype, and back: built on first use (importing this module
# must not import torch: ``moeshard plan`` reads headers without it; :mod:`moeshard.dtypes`).
DTYPES: Mapping[str, torch.dtype] = LazyTable(torch_dtypes)
DTYPE_NAMES: Mapping[torch.dtype, str] = LazyTable(lambda: {v: k for k, v in torch_dtypes().items()})
_ITEMSIZE = ITEMSIZE  # a plain dict: 3x faster than dtype.itemsize


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where a tensor lives: ``file`` (relative to the checkpoint root), absolute byte
    ``offset`` of its first element, dtype name (safetensors spelling) and shape.

    Slotted: a maximal header holds about a million of them (64 bytes each instead of ~180)."""

    file: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtypes()[self.dtype]

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


class _BadEntry(dict):
    """A header object that looked like a tensor entry but is not valid; ``reason`` says why
    (reported with its key by the caller, which knows it)."""

    reason = ""


class _EntryParser:
    """``object_pairs_hook`` turning each tensor entry of one header into its TensorInfo
    the moment it is parsed, so a million-entry header never exists as dicts of lists.
    dtype names, shapes (tuples) and the file name are shared between entries."""

    def __init__(self, name: str, data_start: int, data_len: int):
        self.name, self.data_start, self.data_len = name, data_start, data_len
        self.dtypes = {k: k for k in ITEMSIZE}  # the canonical (shared) str of each dtype name
        self.shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.has_extra_fields = False  # fields safetensors ignores (they may nest deep)

    def __call__(self, pairs: list[tuple[str, object]]) -> object:
        obj = unique_keys(pairs)
        if len(obj) < 3 or "data_offsets" not in obj:
            return obj  # __metadata__ or an entry lacking fields (reported by the caller)
        self.has_extra_fields |= len(obj) > 3
        try:
            return self._info(obj)
        except JsonRejected as e:
            bad = _BadEntry(obj)
            bad.reason = str(e)
            return bad

    def _info(self, obj: dict) -> TensorInfo:
        dtype, shape, offsets = obj.get("dtype"), obj.get("shape"), obj["data_offsets"]
        if not (isinstance(dtype, str) and isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2):
            raise JsonRejected("lacks dtype/shape/data_offsets (a string, a list and [begin, end])")
        canonical = self.dtypes.get(dtype)
        if canonical is None:
            raise JsonRejected(f"has unsupported dtype {brief(dtype)}")
        numel = _numel(shape)
        begin, end = offsets
        if not (type(begin) is int and type(end) is int):
            raise JsonRejected(f"has a malformed shape or offsets: data_offsets {brief(offsets)} are not integers")
        nbytes = numel * _ITEMSIZE[canonical]
        if not 0 <= begin <= end <= self.data_len or end - begin != nbytes:
            raise JsonRejected(
                f"has data_offsets [{begin}, {end}] but dtype {dtype} x shape {brief(shape)} needs {nbytes} bytes "
                f"inside a data section of {self.data_len} bytes (truncated or corrupt file)"
            )
        key = tuple(shape)
        return TensorInfo(self.name, self.data_start + begin, canonical, self.shapes.setdefault(key, key))


def _numel(shape: list) -> int:
    """Elements of ``shape``; every dim an int >= 0 (not a bool, not a float) and the running
    product below 2**63, as safetensors checks it (so no product of huge dims is ever built)."""
    n = 1
    for d in shape:
        if type(d) is not int or not 0 <= d < _MAX_INT:
            raise JsonRejected(
                f"has a malformed shape or offsets: shape {brief(shape)} is not non-negative integers below 2**63"
            )
        n *= d
        if n >= _MAX_INT:
            raise JsonRejected(f"has a malformed shape or offsets: shape {brief(shape)} has 2**63 elements or more")
    return n


def read_header(path: Path, name: str | None = None) -> tuple[dict[str, TensorInfo], int]:
    """Parse and validate a safetensors header -> ``({key: TensorInfo}, file size)``; ``name``
    (default: the file's own name) is the ``file`` the TensorInfos carry. The rules are the
    module docstring's; any violation is a CheckpointError naming ``path``."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated file ({size} bytes), no safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path}: header length {n} does not fit in the file ({size} bytes) or exceeds the format's "
                    f"{MAX_HEADER_BYTES:,}-byte limit: truncated or not safetensors"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    what = "corrupt safetensors header"
    text = decode_utf8(raw, path, what)
    del raw  # up to 100 MB, not kept while parsing
    data_len = size - 8 - n
    parser = _EntryParser(path.name if name is None else name, 8 + n, data_len)
    # parse_int costs a Python call per number: only where a "-0" may hide.
    decoder = strict_decoder(parser, serde_int if "-0" in text else None)
    header: dict[str, TensorInfo] = {}
    meta: object = None
    with json_errors(path, what):
        check_surrogates(text)
        for key, value in object_items(text, decoder):
            if key in header or (key == "__metadata__" and meta is not None):
                raise JsonRejected(f"key {brief(key)} appears twice in the header")
            if key == "__metadata__":
                meta = value
            elif type(value) is TensorInfo:
                header[key] = value
            else:
                why = value.reason if isinstance(value, _BadEntry) else "lacks dtype/shape/data_offsets"
                raise CheckpointError(f"{path}: tensor {brief(key)} {why}")
        if parser.has_extra_fields:
            check_depth(text)
    del text
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: {what}: __metadata__ must map strings to strings")
    _check_tiling(path, header, 8 + n, data_len)
    return header, size


def _check_tiling(path: Path, header: dict[str, TensorInfo], data_start: int, data_len: int) -> None:
    """The tensors' byte ranges, sorted by (begin, end), tile ``[0, data_len)`` exactly."""
    num = len(header)
    if not num:
        if data_len:
            raise CheckpointError(
                f"{path}: a header with no tensors, but {data_len} data bytes follow it: corrupt file"
            )
        return
    begin = np.fromiter((t.offset for t in header.values()), dtype=np.int64, count=num) - data_start
    end = begin + np.fromiter((t.nbytes for t in header.values()), dtype=np.int64, count=num)
    order = np.lexsort((end, begin))
    begin, end = begin[order], end[order]
    # prev_end[i]: where the bytes before range i end (0 for the first range).
    prev_end = np.concatenate(([0], end[:-1]))
    bad = np.flatnonzero(begin != prev_end)
    if bad.size:
        i = int(bad[0])
        if i == 0:
            first = brief(_key_at(header, order[0]))
            raise CheckpointError(
                f"{path}: bytes [0, {begin[0]}) of the data section belong to no tensor "
                f"(the first, {first}, begins at {begin[0]}): corrupt file"
            )
        a, b = brief(_key_at(header, order[i - 1])), brief(_key_at(header, order[i]))
        if begin[i] < prev_end[i]:
            raise CheckpointError(
                f"{path}: tensors {a} (data bytes [{begin[i - 1]}, {end[i - 1]})) and {b} "
                f"([{begin[i]}, {end[i]})) overlap: corrupt file"
            )
        raise CheckpointError(
            f"{path}: bytes [{prev_end[i]}, {begin[i]}) of the data section, between tensors "
            f"{a} and {b}, belong to no tensor: corrupt file"
        )
    last = int(end[-1])
    if last != data_len:
        raise CheckpointError(
            f"{path}: bytes [{last}, {data_len}) at the end of the data section belong to no "
            "tensor (safetensors requires the tensors to cover the file): corrupt or appended file"
        )


def _key_at(header: dict, position: int) -> str:
    """The key at ``position`` in ``header``'s order (only on the error path: O(n))."""
    return next(itertools.islice(header, int(position), None))
