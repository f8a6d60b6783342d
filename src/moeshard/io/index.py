"""A checkpoint's index: every tensor's file, offset, dtype and shape (:class:`CheckpointIndex`).

The index (``model.safetensors.index.json``) may only name files inside its directory; each
file's header is read and validated by :func:`~moeshard.io.header.read_header`. Every error is
a :class:`~moeshard.io.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..dtypes import ITEMSIZE
from .errors import CheckpointError
from .header import TensorInfo, read_header
from .strict_json import load_json

__all__ = ["INDEX_NAME", "CheckpointIndex", "read_index"]

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class CheckpointIndex:
    """Headers of a checkpoint: every tensor's file, offset, dtype and shape.

    Plain data (picklable), so one rank can read the headers and send them to ranks that
    cannot see the files. ``file_sizes`` lets a reader detect a different copy of a file.
    """

    root: str
    tensors: dict[str, TensorInfo]
    file_sizes: dict[str, int]
    # Packed quantized weights (MXFP4, NVFP4, INT4, FP8 per channel / tensor) by logical key
    # (:func:`moeshard.io.quant.recognize`): :meth:`info`, ``in`` and the key columns present
    # each as its logical tensor (float32, logical shape; where a logical key is also a stored
    # key, as ModelOpt's ``weight``, the logical one), read decoded (:mod:`moeshard.io.packed`).
    # ``without_packed()``: the stored tensors only (a model that keeps them packed).
    packed: dict = field(default_factory=dict)
    # After ``without_packed(because)``: the packed weights now read as stored and why, kept only
    # so that a refusal of one of their keys names its format (:meth:`read_as_stored`).
    stored_packed: dict = field(default_factory=dict)
    stored_because: str = ""

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
        return cls(str(root), tensors, sizes, _recognized(root, tensors))

    def without_packed(self, because: str = "") -> CheckpointIndex:
        """This index with its stored tensors only: packed weights under their stored keys (a
        model whose parameters are the packed tensors, or a load asked not to dequantize);
        ``because`` says why, in a refusal of a packed weight's key (:meth:`read_as_stored`)."""
        return replace(self, packed={}, stored_packed=self.packed, stored_because=because) if self.packed else self

    def read_as_stored(self, key: str) -> str:
        """What a refusal of checkpoint key ``key`` (missing, or of a dtype that cannot be cast)
        adds after :meth:`without_packed` when ``key`` is a quantized weight's (its logical key,
        packed values or scale): "; <key> is stored quantized as <format>: <its keys>, read as
        stored (<because>)"; "" for any other key."""
        pw = next((p for p in self.stored_packed.values() if key in (p.key, p.values, p.scale, p.global_scale)), None)
        if pw is None:
            return ""
        from .quant import explain

        why = f" ({self.stored_because})" if self.stored_because else ""
        return f"; {explain(self.stored_packed, pw.scheme.method, key)}, read as stored{why}"

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.packed

    def info(self, key: str) -> TensorInfo:
        if self.packed:
            pw = self.packed.get(key)
            if pw is not None:
                return _logical_info(pw, self.tensors)
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
        infos = list(self.tensors.values()) + [_logical_info(pw, self.tensors) for pw in self.packed.values()]
        n = len(infos)
        dtypes = list(map(operator.attrgetter("dtype"), infos))
        file_names = list(map(operator.attrgetter("file"), infos))
        files = {f: i for i, f in enumerate(sorted(set(file_names)))}
        file_no = np.fromiter(map(files.__getitem__, file_names), dtype=np.int64, count=n)
        offset = np.fromiter(map(operator.attrgetter("offset"), infos), dtype=np.int64, count=n)
        order = np.empty(n, dtype=np.int64)
        order[np.lexsort((offset, file_no))] = np.arange(n)
        itemsize = np.fromiter(map(ITEMSIZE.__getitem__, dtypes), dtype=np.int64, count=n)
        # A logical key that is also a stored key (ModelOpt's ``weight``) is the logical one.
        return dict(zip([*self.tensors, *self.packed], range(n))), itemsize, order

    @functools.cached_property
    def _kinds(self) -> np.ndarray:
        # A tensor's kind: the position of the first tensor of its dtype and shape.
        infos = list(self.tensors.values()) + [_logical_info(pw, self.tensors) for pw in self.packed.values()]
        kinds: dict[tuple, int] = {}
        pairs = zip(map(operator.attrgetter("dtype"), infos), map(operator.attrgetter("shape"), infos))
        return np.fromiter(map(kinds.setdefault, pairs, itertools.count()), dtype=np.int64, count=len(infos))

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
        stored = (self.stored_packed, self.stored_because)
        return _index_from_columns, (self.root, columns, self.file_sizes, self.packed, stored)


def _index_from_columns(
    root: str, columns: tuple, file_sizes: dict[str, int], packed=None, stored=({}, "")
) -> CheckpointIndex:
    """The :class:`CheckpointIndex` that :meth:`CheckpointIndex.__reduce__` pickled."""
    keys, files, file_of, offsets, dtypes, shapes = columns
    tensors = {k: TensorInfo(files[f], o, d, s) for k, f, o, d, s in zip(keys, file_of, offsets, dtypes, shapes)}
    return CheckpointIndex(root, tensors, file_sizes, packed or {}, *stored)


def _logical_info(pw, tensors: dict[str, TensorInfo]) -> TensorInfo:
    """The :class:`TensorInfo` a float model sees for packed weight ``pw``: its values' file and
    offset (file order), float32 (what it decodes to) and its logical shape."""
    v = tensors[pw.values]
    return TensorInfo(v.file, v.offset, "F32", tuple(pw.shape))


def _recognized(root: Path, tensors: dict[str, TensorInfo]) -> dict:
    """The packed weights of a checkpoint (:func:`moeshard.io.quant.recognize` of its JSON
    configs and headers); CheckpointError naming the key and the reason for one it refuses.
    Headers only: the values of compressed-tensors' ``weight_shape`` tensors (one per packed
    weight, ~70,000 in a Kimi-K2-sized checkpoint) are checked by the reader of a plan that reads
    their weight (:meth:`~moeshard.io.reader.CheckpointReader.check_keys`)."""
    from .quant import read_quant_configs, recognize

    try:
        return recognize(*read_quant_configs(root), tensors)
    except ValueError as e:  # CheckpointError included: named with the checkpoint
        raise CheckpointError(f"checkpoint {root}: {e}") from None


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
