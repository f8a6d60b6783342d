"""Dtypes by their safetensors names, without importing torch: item sizes, kinds, the torch
dtype each name stands for (built on first use) and the one cast rule for checkpoint data.

The planners and ``moeshard plan`` work from names (``"BF16"``); only code that allocates
tensors needs the torch dtype. A model's dtype may be given either way: a torch dtype (what
:func:`moeshard.models.describe.describe_model` records) or a safetensors name (what
``moeshard plan`` synthesizes, torch-free). A torch dtype is recognized by its ``str``
(``"torch.bfloat16"``), so no torch import is needed to name it either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ITEMSIZE", "TORCH_NAMES", "torch_dtypes", "dtype_name", "itemsize", "cast_refusal", "LazyTable"]

# Safetensors dtype name -> (item size in bytes, kind, torch's attribute name).
_TABLE = {
    "F64": (8, "float", "float64"),
    "F32": (4, "float", "float32"),
    "F16": (2, "float", "float16"),
    "BF16": (2, "float", "bfloat16"),
    "I64": (8, "int", "int64"),
    "I32": (4, "int", "int32"),
    "I16": (2, "int", "int16"),
    "I8": (1, "int", "int8"),
    "U8": (1, "int", "uint8"),
    "BOOL": (1, "bool", "bool"),
    "F8_E4M3": (1, "float", "float8_e4m3fn"),
    "F8_E5M2": (1, "float", "float8_e5m2"),
}
ITEMSIZE: dict[str, int] = {k: v[0] for k, v in _TABLE.items()}
TORCH_NAMES: dict[str, str] = {k: v[2] for k, v in _TABLE.items()}
_NAME_OF_STR = {f"torch.{v[2]}": k for k, v in _TABLE.items()}


@functools.lru_cache(maxsize=1)
def torch_dtypes() -> dict[str, torch.dtype]:
    """``{safetensors name: torch dtype}`` (imports torch)."""
    import torch

    return {k: getattr(torch, v) for k, v in TORCH_NAMES.items()}


class LazyTable(Mapping):
    """A read-only mapping built by ``build`` on first use (so that importing a module that
    exposes a torch-dtype table does not import torch)."""

    def __init__(self, build: Callable[[], dict]) -> None:
        self._build = build

    @functools.cached_property
    def _table(self) -> dict:
        return self._build()

    def __getitem__(self, key):
        return self._table[key]

    def __iter__(self) -> Iterator:
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, key) -> bool:
        return key in self._table

    def __repr__(self) -> str:
        return repr(self._table)


def dtype_name(dtype) -> str | None:
    """The safetensors name of ``dtype`` (a torch dtype or a name), or None for a torch dtype
    safetensors files here cannot hold (e.g. ``float8_e4m3fnuz``, ``complex64``)."""
    if isinstance(dtype, str):
        if dtype not in _TABLE:
            raise ValueError(f"unknown safetensors dtype name {dtype!r} (known: {sorted(_TABLE)})")
        return dtype
    return _NAME_OF_STR.get(str(dtype))


def itemsize(dtype) -> int:
    """Bytes per element of ``dtype`` (a torch dtype or a safetensors name)."""
    return ITEMSIZE[dtype] if isinstance(dtype, str) else dtype.itemsize


def _traits(dtype) -> tuple[str | None, bool, int, bool]:
    """``(name, is floating point, item size, is bool)`` of a torch dtype or a name."""
    name = dtype_name(dtype)
    if isinstance(dtype, str):
        size, kind, _ = _TABLE[name]
        return name, kind == "float", size, kind == "bool"
    return name, bool(dtype.is_floating_point), int(dtype.itemsize), str(dtype) == "torch.bool"


@functools.lru_cache(maxsize=256)
def cast_refusal(ckpt_dtype: str, dtype) -> str | None:
    """The one cast rule for checkpoint data: None when values of safetensors dtype
    ``ckpt_dtype`` may be cast to a model tensor of ``dtype`` (a torch dtype or a safetensors
    name), else why not ("kind", "from_fp8", "to_fp8", "fp8_formats").

    Allowed: the same dtype (FP8 -> the same FP8 included: a model keeping FP8 parameters),
    float <-> float and int <-> int. Refused: int/bool <-> float, bool <-> int, and every cast
    from or to a one-byte float: FP8 values are meaningful only with their scale (DESIGN.md),
    a cast to FP8 is a quantization that needs a scale, and e4m3 <-> e5m2 loses precision or
    overflows. Every path that reads checkpoint data into a tensor checks it before any data
    moves: load (dense and expert needs), verify (through load's plan), relocate's disk reads
    and LoRA adapters (:func:`moeshard.models.layout.check_cast`).
    """
    src_name, src_float, src_size, src_bool = _traits(ckpt_dtype)
    name, is_float, size, is_bool = _traits(dtype)
    if src_name == name:
        return None
    # One-byte floats (float8_e4m3fn, float8_e5m2, their fnuz variants): block-quantized
    # checkpoints store them scaled, so a value means something only with its scale.
    src_fp8, fp8 = src_float and src_size == 1, is_float and size == 1
    if src_fp8 and fp8:
        return "fp8_formats"
    if src_fp8:
        return "from_fp8"
    if fp8:
        return "to_fp8"
    if src_float != is_float or src_bool != is_bool:
        return "kind"
    return None
