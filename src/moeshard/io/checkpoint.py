"""The public names of moeshard's safetensors I/O, re-exported for code that imports them from here.

Kept for users who import ``moeshard.io.checkpoint``; each name lives in a module with one job,
and moeshard's own code imports it from there:

* :mod:`moeshard.io.errors`: :class:`CheckpointError`;
* :mod:`moeshard.io.strict_json`: strict JSON for untrusted files (:func:`load_json`);
* :mod:`moeshard.io.header`: one safetensors header read and validated (:func:`read_header`,
  :class:`TensorInfo`, the dtype tables ``DTYPES`` / ``DTYPE_NAMES``);
* :mod:`moeshard.io.index`: :class:`CheckpointIndex` (every tensor's file, offset, dtype and
  shape), :func:`read_index`, ``INDEX_NAME``;
* :mod:`moeshard.io.reader`: :class:`CheckpointReader` (box reads, ``O_DIRECT`` optional);
* :mod:`moeshard.io.writer`: :func:`write_checkpoint`, :func:`safetensors_header`, :func:`pwrite_all`.
"""

from __future__ import annotations

from .errors import CheckpointError
from .header import DTYPE_NAMES, DTYPES, MAX_HEADER_BYTES, TensorInfo, read_header
from .index import INDEX_NAME, CheckpointIndex, read_index
from .reader import IOV_MAX, CheckpointReader
from .strict_json import load_json
from .writer import pwrite_all, safetensors_header, write_checkpoint

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "INDEX_NAME",
    "IOV_MAX",
    "MAX_HEADER_BYTES",
    "TensorInfo",
    "CheckpointIndex",
    "CheckpointReader",
    "CheckpointError",
    "write_checkpoint",
    "safetensors_header",
    "pwrite_all",
    "load_json",
    "read_header",
    "read_index",
]
