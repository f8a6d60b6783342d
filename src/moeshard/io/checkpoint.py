"""Safetensors checkpoints: validated headers, lazy box reads, and a sharded writer.

This is the only module that touches checkpoint files. Files are untrusted input: the index
may only name files inside its directory, header offsets must lie inside the file and agree
with dtype x shape, and a truncated file is reported with its name. Data is read with
``pread`` into bounded buffers (never mmap-ed whole, never unpickled), so a rank's memory
grows by what it reads, not by the files it touches.

A header is accepted only if the safetensors library itself (the Rust crate behind
``safe_open``, checked against safetensors 0.8) would accept it, so a file moeshard loads is
a file every other reader loads identically:

* the JSON is at most 100,000,000 bytes (the format's ``MAX_HEADER_SIZE``), UTF-8, and
  JSON as serde_json (safetensors' parser) reads it: no NaN / Infinity, no number beyond
  float range, no unpaired UTF-16 surrogate escape, at most 127 levels of nesting. No
  object repeats a key: stricter than safetensors, which keeps the last of two entries for
  one tensor; which one a reader sees is ambiguous, so that is an error here;
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

Every error is a :class:`CheckpointError` naming the file (and the keys or byte range at
fault); JSON nested too deeply or holding a number too long to parse included. JSON read
from checkpoint directories elsewhere (``config.json``) goes through :func:`load_json`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import mmap
import operator
import os
import re
import reprlib
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from json.decoder import WHITESPACE, JSONDecodeError, scanstring
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..box import Box, box_numel, box_shape, check_box, full_box
from ..dtypes import ITEMSIZE, LazyTable, torch_dtypes

if TYPE_CHECKING:
    import torch

    from .extents import Extent

__all__ = [
    "TensorInfo",
    "CheckpointIndex",
    "CheckpointReader",
    "CheckpointError",
    "write_checkpoint",
    "safetensors_header",
    "pwrite_all",
    "load_json",
]

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit (MAX_HEADER_SIZE): bytes, not MiB
# Shapes and byte offsets are int64 in torch; safetensors itself refuses a shape whose product
# overflows its usize (checked dim by dim, in order).
_MAX_INT = 2**63

# Safetensors dtype name -> torch dtype, and back: built on first use (importing this module
# must not import torch: ``moeshard plan`` reads headers without it; :mod:`moeshard.dtypes`).
DTYPES: Mapping[str, torch.dtype] = LazyTable(torch_dtypes)
DTYPE_NAMES: Mapping[torch.dtype, str] = LazyTable(lambda: {v: k for k, v in torch_dtypes().items()})
_ITEMSIZE = ITEMSIZE  # a plain dict: 3x faster than dtype.itemsize


class CheckpointError(ValueError):
    """A checkpoint file, index or header is missing, malformed or inconsistent."""


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
    def open(cls, path: str | os.PathLike) -> CheckpointIndex:
        """Read the index (a directory with ``model.safetensors.index.json`` or that file
        itself, a directory with one ``.safetensors`` file, or a ``.safetensors`` file) and
        every header."""
        p = Path(path)
        if p.name == INDEX_NAME and p.is_file():
            p = p.parent  # the index file stands for its checkpoint directory
        if p.is_file():
            root, files = p.parent, {p.name: None}
        elif (p / INDEX_NAME).is_file():
            root, files = p, read_index(p)
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
            header, size = read_header(root / name, name)
            sizes[name] = size
            if expected_keys is None:  # the only file: its header is the index (no copy)
                tensors = header
                continue
            for key in expected_keys:
                info = header.get(key)
                if info is None:
                    raise CheckpointError(f"{INDEX_NAME} places {key!r} in {name}, but {name} has no such tensor")
                tensors[key] = info
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

    def key_columns(self, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(itemsize, order)``, ``int64[len(keys)]``: each key's item size and its position
        in file order (files by name, then byte offset) among all the checkpoint's tensors.
        CheckpointError for a key it lacks. Cost: a dict lookup per key (the columns of all
        tensors are built once per index)."""
        position, itemsize, order = self._columns
        try:
            at = np.fromiter(map(position.__getitem__, keys), dtype=np.int64, count=len(keys))
        except KeyError as e:
            self.info(e.args[0])  # raises, naming the key
            raise
        return itemsize[at], order[at]

    def key_kinds(self, keys: Sequence[str]) -> np.ndarray:
        """``int64[len(keys)]``: a number per key, equal for tensors of one dtype and shape, -1
        for a key the checkpoint lacks (what tells, in one pass, which of many tensors differ
        from one they should match). Cost: a dict lookup per key."""
        position = self._columns[0]
        at = np.fromiter(map(position.get, keys, itertools.repeat(-1)), dtype=np.int64, count=len(keys))
        return np.where(at >= 0, self._kinds[at], -1)

    @functools.cached_property
    def dtypes(self) -> frozenset[str]:
        """The safetensors dtype names of the checkpoint's tensors (e.g. ``{"BF16", "F8_E4M3"}``;
        computed once per index)."""
        return frozenset(t.dtype for t in self.tensors.values())

    @functools.cached_property
    def _columns(self) -> tuple[dict[str, int], np.ndarray, np.ndarray]:
        # Built on every rank for every load (the index is fresh each time): map() over the
        # infos, not a Python loop per tensor.
        infos = list(self.tensors.values())
        n = len(infos)
        dtypes = list(map(operator.attrgetter("dtype"), infos))
        file_names = list(map(operator.attrgetter("file"), infos))
        files = {f: i for i, f in enumerate(sorted(set(file_names)))}
        file_no = np.fromiter(map(files.__getitem__, file_names), dtype=np.int64, count=n)
        offset = np.fromiter(map(operator.attrgetter("offset"), infos), dtype=np.int64, count=n)
        order = np.empty(n, dtype=np.int64)
        order[np.lexsort((offset, file_no))] = np.arange(n)
        itemsize = np.fromiter(map(_ITEMSIZE.__getitem__, dtypes), dtype=np.int64, count=n)
        return dict(zip(self.tensors, range(n))), itemsize, order

    @functools.cached_property
    def _kinds(self) -> np.ndarray:
        # A tensor's kind: the position of the first tensor of its dtype and shape.
        infos = self.tensors.values()
        kinds: dict[tuple, int] = {}
        pairs = zip(map(operator.attrgetter("dtype"), infos), map(operator.attrgetter("shape"), infos))
        return np.fromiter(map(kinds.setdefault, pairs, itertools.count()), dtype=np.int64, count=len(self.tensors))

    def __reduce__(self):
        # One rank reads the headers and sends them to every rank (moeshard.load): pickled as
        # columns, not as a TensorInfo object per key, which costs ~20x more to pickle and to
        # unpickle (DeepSeek-V3's 45,000 keys: ~1 s on every rank). Shapes and dtype names are
        # shared objects, so pickle writes each distinct one once.
        infos = self.tensors.values()
        files = {f: i for i, f in enumerate(dict.fromkeys(t.file for t in infos))}
        columns = (
            tuple(self.tensors),
            tuple(files),
            [files[t.file] for t in infos],
            [t.offset for t in infos],
            [t.dtype for t in infos],
            [t.shape for t in infos],
        )
        return _index_from_columns, (self.root, columns, self.file_sizes)


def _index_from_columns(root: str, columns: tuple, file_sizes: dict[str, int]) -> CheckpointIndex:
    """The :class:`CheckpointIndex` that :meth:`CheckpointIndex.__reduce__` pickled."""
    keys, files, file_of, offsets, dtypes, shapes = columns
    tensors = {k: TensorInfo(files[f], o, d, s) for k, f, o, d, s in zip(keys, file_of, offsets, dtypes, shapes)}
    return CheckpointIndex(root, tensors, file_sizes)


def read_index(root: Path, require_files: bool = True) -> dict[str, list[str]]:
    """The index's ``weight_map`` as ``{normalized file name: [keys]}``, every file name
    validated; ``require_files=False`` accepts names of files that do not exist (for a
    report that lists them rather than stopping at the first)."""
    index = load_json(root / INDEX_NAME, "unreadable index")
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


class _JsonRejected(ValueError):
    """Valid for Python's json module, not for a strict JSON reader (serde_json, as
    safetensors uses): NaN / Infinity, 1e400, an unpaired surrogate, deep nesting; or
    ambiguous: a repeated key."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook``: the object as a dict; a key given twice is an error, since
    readers disagree on which value wins."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _JsonRejected(f"key {_brief(dup)} appears twice in one object")
    return obj


def _reject_constant(name: str) -> None:
    raise _JsonRejected(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    """``parse_float``: 1e400 is out of range for every reader but Python's (which makes it inf)."""
    value = float(text)
    if math.isinf(value):
        raise _JsonRejected(f"number {_brief(text)} is out of range")
    return value


def _serde_int(text: str) -> int | float:
    """``parse_int`` of a safetensors header: serde reads ``-0`` as the float -0.0, so it is
    no shape dim or offset (and harmless in a field nobody reads)."""
    return -0.0 if text == "-0" else int(text)


# A UTF-16 surrogate escape (\uD800-\uDFFF) that really is an escape: not preceded by an odd
# run of backslashes (outside strings, valid JSON has none).
_SURROGATE_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u[dD]([89a-fA-F])[0-9a-fA-F]{2}")


def _check_surrogates(text: str) -> None:
    """An unpaired surrogate escape decodes (in Python only) to a str no encoder accepts:
    printing such a key ends ``moeshard inspect`` with a traceback; serde refuses the file."""
    if "\\u" not in text:  # the common case: one fast scan
        return
    low_at = None  # where the low half of a pair must start
    for m in _SURROGATE_ESCAPE.finditer(text):
        start, high = m.end() - 6, m.group(1) in "89abAB"
        if high and low_at is None:
            low_at = m.end()
        elif not high and start == low_at:
            low_at = None
        else:
            break
    else:
        if low_at is None:
            return
    raise _JsonRejected("an unpaired UTF-16 surrogate escape (\\uD800-\\uDFFF) is not a character")


# serde_json's recursion limit, which safetensors parses with: 127 levels (the header object
# itself is one) parse, 128 do not.
_MAX_DEPTH = 127
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def _check_depth(text: str) -> None:
    """Nesting deeper than safetensors reads (only an entry's unknown fields can nest)."""
    skeleton = np.frombuffer(_JSON_STRING.sub("", text).encode("latin-1", "replace"), dtype=np.uint8)
    step = np.isin(skeleton, (ord("["), ord("{"))).astype(np.int64) - np.isin(skeleton, (ord("]"), ord("}")))
    depth = int(np.cumsum(step).max()) if step.size else 0
    if depth > _MAX_DEPTH:
        raise _JsonRejected(f"JSON nested {depth} levels deep; safetensors reads at most {_MAX_DEPTH}")


def _decode_utf8(raw: bytes, where: object, what: str) -> str:
    """``raw`` as text; not UTF-8 (what JSON and safetensors require) is a CheckpointError."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: {what}: not UTF-8 ({e})") from None


@contextlib.contextmanager
def _json_errors(where: object, what: str) -> Iterator[None]:
    """Turn every way parsing untrusted JSON can fail into a CheckpointError ``"{where}:
    {what}: why"``: nesting deeper than the recursion limit, an integer of more than 4,300
    digits (Python's int-conversion limit) and memory running out included."""
    try:
        yield
        return
    except CheckpointError:
        raise
    except json.JSONDecodeError as e:
        reason = str(e)
    except _JsonRejected as e:
        reason = str(e)
    except ValueError as e:  # json raises int()'s own error for a number of > 4,300 digits
        reason = f"a number too long to parse ({e})"
    except RecursionError:
        reason = "JSON nested too deeply"
    except MemoryError:
        reason = "out of memory while parsing"
    raise CheckpointError(f"{where}: {what}: {reason}") from None


def _decoder(object_pairs_hook=_unique_keys, parse_int=None) -> json.JSONDecoder:
    """Stricter than ``json.loads`` where other readers are: no duplicate keys, no NaN /
    Infinity, no number out of float range."""
    return json.JSONDecoder(
        object_pairs_hook=object_pairs_hook,
        parse_constant=_reject_constant,
        parse_float=_finite_float,
        parse_int=parse_int,
    )


def _parse_json(text: str, where: object, what: str) -> object:
    """Parse untrusted JSON text (see :func:`_decoder`, :func:`_json_errors`)."""
    with _json_errors(where, what):
        _check_surrogates(text)
        return _decoder().decode(text)


def load_json(path: str | os.PathLike, what: str) -> object:
    """Read and :func:`_parse_json` the file at ``path`` (a config.json, an index): an error
    is a CheckpointError (a ValueError) ``"{path}: {what}: why"``."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: {what}: {e}") from None
    except MemoryError:
        raise CheckpointError(f"{path}: {what}: out of memory reading the file") from None
    text = _decode_utf8(raw, path, what)
    del raw
    return _parse_json(text, path, what)


def _object_items(text: str, decoder: json.JSONDecoder) -> Iterator[tuple[str, object]]:
    """The members of the JSON object ``text`` holds, one at a time, values decoded by
    ``decoder``: unlike ``json.loads``, never a list of all the members' pairs and a dict of
    all their keys besides the caller's own structure (about 110 MB for a maximal header).
    The grammar is ``json.decoder.JSONObject``'s, the errors its JSONDecodeErrors."""

    def skip(pos: int) -> int:  # past any whitespace at pos (compact JSON has none: no regex call)
        return ws(text, pos).end() if text[pos : pos + 1] in _WS_CHARS else pos

    ws, scan = WHITESPACE.match, decoder.scan_once
    end = skip(0)
    if text[end : end + 1] != "{":
        raise JSONDecodeError("Expecting '{' (a safetensors header is a JSON object)", text, end)
    end = skip(end + 1)
    if text[end : end + 1] == "}":
        end += 1
    else:
        while True:
            if text[end : end + 1] != '"':
                raise JSONDecodeError("Expecting property name enclosed in double quotes", text, end)
            key, end = scanstring(text, end + 1)
            end = skip(end)
            if text[end : end + 1] != ":":
                raise JSONDecodeError("Expecting ':' delimiter", text, end)
            try:  # scan_once is raw_decode's C core, without its Python frame
                value, end = scan(text, skip(end + 1))
            except StopIteration as e:
                raise JSONDecodeError("Expecting value", text, e.value) from None
            yield key, value
            end = skip(end)
            sep = text[end : end + 1]
            end = skip(end + 1)
            if sep == "}":
                break
            if sep != ",":
                raise JSONDecodeError("Expecting ',' delimiter", text, end - 1)
    end = skip(end)
    if end != len(text):
        raise JSONDecodeError("Extra data", text, end)


_WS_CHARS = frozenset(" \t\n\r")  # JSON's whitespace


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
        obj = _unique_keys(pairs)
        if len(obj) < 3 or "data_offsets" not in obj:
            return obj  # __metadata__ or an entry lacking fields (reported by the caller)
        self.has_extra_fields |= len(obj) > 3
        try:
            return self._info(obj)
        except _JsonRejected as e:
            bad = _BadEntry(obj)
            bad.reason = str(e)
            return bad

    def _info(self, obj: dict) -> TensorInfo:
        dtype, shape, offsets = obj.get("dtype"), obj.get("shape"), obj["data_offsets"]
        if not (isinstance(dtype, str) and isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2):
            raise _JsonRejected("lacks dtype/shape/data_offsets (a string, a list and [begin, end])")
        canonical = self.dtypes.get(dtype)
        if canonical is None:
            raise _JsonRejected(f"has unsupported dtype {_brief(dtype)}")
        numel = _numel(shape)
        begin, end = offsets
        if not (type(begin) is int and type(end) is int):
            raise _JsonRejected(f"has a malformed shape or offsets: data_offsets {_brief(offsets)} are not integers")
        nbytes = numel * _ITEMSIZE[canonical]
        if not 0 <= begin <= end <= self.data_len or end - begin != nbytes:
            raise _JsonRejected(
                f"has data_offsets [{begin}, {end}] but dtype {dtype} x shape {_brief(shape)} needs {nbytes} bytes "
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
            raise _JsonRejected(
                f"has a malformed shape or offsets: shape {_brief(shape)} is not non-negative integers below 2**63"
            )
        n *= d
        if n >= _MAX_INT:
            raise _JsonRejected(f"has a malformed shape or offsets: shape {_brief(shape)} has 2**63 elements or more")
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
    text = _decode_utf8(raw, path, what)
    del raw  # up to 100 MB, not kept while parsing
    data_len = size - 8 - n
    parser = _EntryParser(path.name if name is None else name, 8 + n, data_len)
    # parse_int costs a Python call per number: only where a "-0" may hide.
    decoder = _decoder(parser, _serde_int if "-0" in text else None)
    header: dict[str, TensorInfo] = {}
    meta: object = None
    with _json_errors(path, what):
        _check_surrogates(text)
        for key, value in _object_items(text, decoder):
            if key in header or (key == "__metadata__" and meta is not None):
                raise _JsonRejected(f"key {_brief(key)} appears twice in the header")
            if key == "__metadata__":
                meta = value
            elif type(value) is TensorInfo:
                header[key] = value
            else:
                why = value.reason if isinstance(value, _BadEntry) else "lacks dtype/shape/data_offsets"
                raise CheckpointError(f"{path}: tensor {_brief(key)} {why}")
        if parser.has_extra_fields:
            _check_depth(text)
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
            first = _brief(_key_at(header, order[0]))
            raise CheckpointError(
                f"{path}: bytes [0, {begin[0]}) of the data section belong to no tensor "
                f"(the first, {first}, begins at {begin[0]}): corrupt file"
            )
        a, b = _brief(_key_at(header, order[i - 1])), _brief(_key_at(header, order[i]))
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


def _brief(value: object) -> str:
    """A short ``repr`` of ``value``: a hostile header's key or shape can be megabytes long,
    and an error message is one line (reprlib never builds the whole repr)."""
    return _BRIEF.repr(value)


_BRIEF = reprlib.Repr()
_BRIEF.maxstring, _BRIEF.maxlist, _BRIEF.maxlevel = 160, 8, 2


def _key_at(header: dict, position: int) -> str:
    """The key at ``position`` in ``header``'s order (only on the error path: O(n))."""
    return next(itertools.islice(header, int(position), None))


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
        ``out`` (any device/dtype, that shape), casts into ``out`` and returns it.
        """
        info = self.index.info(key)
        box = full_box(info.shape) if box is None else box
        check_box(box, info.shape, f"{key}")
        shape = box_shape(box)
        if out is not None and tuple(out.shape) != shape:
            raise ValueError(f"{key}: destination of shape {list(out.shape)} for a box of shape {list(shape)}")
        import torch  # the reader allocates tensors; the headers (above) need no torch

        direct = out is not None and self.reads_straight_into(key, out)
        buf = out if direct else torch.empty(shape, dtype=info.torch_dtype)
        if box_numel(box):
            flat = buf.view(-1).view(torch.uint8)
            fd = self._fd(info.file)
            pos = 0
            for start, n in self.runs(key, box):
                self._pread(fd, flat[pos : pos + n], start, info.file)
                pos += n
            with self._lock:
                self.bytes_read += pos
        if out is None or direct:
            return buf
        return out.copy_(buf)

    def reads_straight_into(self, key: str, out: torch.Tensor) -> bool:
        """Whether a read of ``key`` lands in ``out`` itself (a contiguous CPU tensor of the
        checkpoint's dtype), rather than in a buffer copied (and cast) into it."""
        return out.device.type == "cpu" and out.dtype == self.index.info(key).torch_dtype and out.is_contiguous()

    def runs(self, key: str, box: Box) -> list[tuple[int, int]]:
        """The file byte ranges ``(offset, nbytes)`` that ``box`` of ``key`` is made of, in the
        box's row-major order (its bytes, concatenated, are the box as a contiguous tensor):
        one range unless the box is cut along a dim after its first cut one. Empty for an
        empty box. The box must lie inside the tensor (:func:`~moeshard.box.check_box`)."""
        info = self.index.info(key)
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

    def read_extent(self, extent: Extent, views: Sequence[memoryview], scratch: memoryview) -> None:
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
