"""Requantization on save: a float model loaded from a quantized checkpoint (MXFP4, NVFP4, INT4,
FP8 per channel) written back in the format it came from, with the same scheme and group size
(``moeshard.save(model, out_dir, quantize="source", reference=<the source checkpoint>)``).

:func:`requantization` reads what to write from the source (its quantized weights, recognized by
:func:`moeshard.io.quant.recognize`, and its config files); :func:`check_outputs` refuses, before
anything is written, a save whose tensors cannot be requantized; :func:`convert_file` turns one
written shard's float tensors into the source's packed values, scales, global scales and
``weight_shape`` (:func:`moeshard.io.codecs.encode`), under the source's keys and dtypes, and
measures the error of the requantized values against the float ones. Local (any rank): the save
runs these on the ranks that wrote each shard.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..io.codecs import decode, encode
from ..io.header import TensorInfo
from ..io.index import CheckpointIndex
from ..io.quant import PackedWeight, read_quant_configs, recognize

__all__ = [
    "QUANTIZE_MODES",
    "Requantization",
    "ConvertedFile",
    "requantization",
    "check_outputs",
    "logical_index",
    "convert_file",
]

QUANTIZE_MODES = ("source",)
_FLOATS = frozenset({"F32", "BF16", "F16"})
HF_QUANT_CONFIG = "hf_quant_config.json"


@dataclass(frozen=True)
class Requantization:
    """What a requantizing save writes: ``packed``, the source's quantized weights by logical key
    (the key the float model's tensor is saved under); ``index``, the source's tensors (their
    keys, dtypes and stored shapes); ``config`` / ``hf_quant``, its ``quantization_config`` and
    ``hf_quant_config.json`` (None where it has none)."""

    packed: Mapping[str, PackedWeight]
    index: CheckpointIndex
    config: Mapping | None
    hf_quant: Mapping | None


@dataclass(frozen=True)
class ConvertedFile:
    """One shard after requantization: its tensors' keys and bytes, how many weights were
    requantized, and their largest error against the float values (absolute, and relative to
    the largest magnitude of the weight)."""

    keys: tuple[str, ...]
    nbytes: int
    num_requantized: int
    max_abs_error: float
    max_rel_error: float


def requantization(source: str | os.PathLike, index: CheckpointIndex) -> Requantization:
    """The quantization of checkpoint ``source`` (its ``index``). Raises ValueError when it holds
    no quantized weight of a format :mod:`moeshard.io.quant` recognizes (block FP8 is not
    requantized)."""
    config, hf_quant = read_quant_configs(source)
    packed = recognize(config, hf_quant, index.tensors)
    if not packed:
        raise ValueError(
            f"quantize='source': {os.fspath(source)} holds no MXFP4, NVFP4, INT4 or FP8-channel "
            "weights to requantize into"
        )
    return Requantization(packed, index, config, hf_quant)


def logical_index(req: Requantization) -> CheckpointIndex:
    """The source's index as a float model of it reads it: each quantized weight under its
    logical key with its logical shape (in place of its packed values, scales and the rest),
    so that a save mirrors the source's names, fused or per expert, and part sizes."""
    tensors = dict(req.index.tensors)
    for pw in req.packed.values():
        info = tensors[pw.values]
        for key in pw.keys:
            tensors.pop(key, None)
        tensors[pw.key] = TensorInfo(info.file, info.offset, "F32", tuple(pw.shape))
    return CheckpointIndex(req.index.root, tensors, req.index.file_sizes)


def check_outputs(req: Requantization, outputs: Sequence[tuple[str, tuple[int, ...], str]]) -> None:
    """Refuse a save whose tensors (``(key, shape, dtype)`` of each) cannot be written in the
    source's format: a quantized weight of the source that the model does not write, of another
    shape, or not in a float dtype (a model that keeps it packed saves it as it is, without
    ``quantize``). Pure; raises ValueError naming the key."""
    have = {key: (tuple(shape), dtype) for key, shape, dtype in outputs}
    for key, pw in sorted(req.packed.items()):
        if key not in have:
            raise ValueError(f"quantize='source': the model writes no tensor {key}, which the source stores quantized")
        shape, dtype = have[key]
        if shape != tuple(pw.shape):
            raise ValueError(
                f"quantize='source': {key} has shape {list(shape)}, the source's {pw.scheme.name} "
                f"weight {list(pw.shape)}"
            )
        if dtype not in _FLOATS:
            raise ValueError(
                f"quantize='source': {key} is {dtype}, not a float tensor; only float weights are requantized "
                f"(a model keeping its weights packed saves them as they are: drop quantize)"
            )


def _stored(req: Requantization, key: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` in the shape the source stores ``key`` in (same elements)."""
    return t.reshape(req.index.tensors[key].shape)


def _copy_of(req: Requantization, key: str) -> torch.Tensor:
    """Tensor ``key`` of the source as stored (an activation scale the model does not hold)."""
    from safetensors import safe_open

    info = req.index.tensors[key]
    with safe_open(os.path.join(req.index.root, info.file), "pt") as f:
        return f.get_tensor(key)


def _requantize(req: Requantization, pw: PackedWeight, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], float, float]:
    """The source's tensors of weight ``pw`` for float ``w`` (the logical tensor), and the
    largest absolute and relative error of their decoded values against ``w``."""
    v = w.transpose(-1, -2) if pw.transposed else w  # value-oriented [..., R, C]
    enc = encode(pw.scheme, v.contiguous())
    out = {pw.values: _stored(req, pw.values, enc.values), pw.scale: _stored(req, pw.scale, enc.scale)}
    if pw.global_scale is not None:
        if enc.global_scale is None:
            raise ValueError(f"{pw.key}: the {pw.scheme.name} encoding gave no global scale for {pw.global_scale}")
        out[pw.global_scale] = _stored(req, pw.global_scale, enc.global_scale)
    for key in pw.ignored:
        if key == pw.shape_key:
            info = req.index.tensors[key]
            out[key] = torch.tensor(pw.value_shape[-2:], dtype=info.torch_dtype).reshape(info.shape)
        else:  # activation scales: calibration data the weights' training does not change
            out[key] = _copy_of(req, key)
    back = decode(pw.scheme, enc.values, enc.scale, enc.global_scale)
    err = (back - v.float()).abs().max().item() if v.numel() else 0.0
    peak = v.float().abs().max().item() if v.numel() else 0.0
    return out, err, (err / peak if peak > 0 else err)


def convert_file(req: Requantization, path: Path) -> ConvertedFile:
    """Replace shard ``path`` (written by the save, float) by the same tensors with every
    quantized weight of the source in the source's format (values, scales, global scale,
    ``weight_shape``, activation scales), and every other float tensor the source holds cast to
    its dtype there. Local."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    out: dict[str, torch.Tensor] = {}
    n, max_abs, max_rel = 0, 0.0, 0.0
    for key, t in tensors.items():
        pw = req.packed.get(key)
        if pw is None:
            src = req.index.tensors.get(key)
            if src is not None and t.is_floating_point() and src.torch_dtype.is_floating_point:
                t = t.to(src.torch_dtype)  # the source's dtype (bf16 beside the packed experts)
            out[key] = t
            continue
        packed, err, rel = _requantize(req, pw, t)
        out.update(packed)
        n += 1
        max_abs, max_rel = max(max_abs, err), max(max_rel, rel)
    for key, t in out.items():
        want = req.index.tensors.get(key)
        if key not in tensors and want is not None and t.dtype != want.torch_dtype:
            raise ValueError(f"{key}: requantized as {t.dtype}, the source stores {want.dtype}")
    tmp = path.with_name(path.name + ".requantized")
    save_file({k: v.contiguous() for k, v in out.items()}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    nbytes = sum(v.numel() * v.element_size() for v in out.values())
    return ConvertedFile(tuple(out), nbytes, n, max_abs, max_rel)
