"""What ``moeshard inspect`` and ``moeshard plan`` say about a checkpoint's quantized weights
(:mod:`moeshard.io.quant`): their format, group size and bytes, by key pattern. Pure, torch-free,
from the config files and headers alone."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError
from .header import TensorInfo
from .quant import PackedWeight, consumed_keys, describe, quant_method, read_quant_configs, recognize

__all__ = ["QuantRow", "QuantSummary", "summarize", "summarize_checkpoint"]

_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)")


@dataclass(frozen=True)
class QuantRow:
    """The quantized weights of one key pattern (numbers as ``*``: ``model.layers.*.mlp.experts.*.
    gate_proj.weight``) and one format: ``format`` (:func:`~moeshard.io.quant.describe`),
    ``scheme`` / ``group`` (values per scale; per channel: the row length; per tensor: 0),
    ``shape`` (the logical shape of one), ``num_weights``, and totals over them: ``packed_bytes``
    (the values as stored), ``scale_bytes`` (scales and global scales), ``ignored_bytes``
    (``weight_shape``, input scales: on disk, not read), ``bf16_bytes`` (dequantized to bf16:
    what a bf16 model holds)."""

    pattern: str
    format: str
    scheme: str
    group: int
    shape: tuple[int, ...]
    num_weights: int
    packed_bytes: int
    scale_bytes: int
    ignored_bytes: int
    bf16_bytes: int


@dataclass(frozen=True)
class QuantSummary:
    """A checkpoint's quantized weights: ``method`` (the declared quantization, e.g.
    ``"mxfp4"``, ``"compressed-tensors/pack-quantized"``, ``"modelopt/NVFP4"``; None when
    nothing is declared), ``rows`` by pattern, their totals, and ``error``: why the weights
    cannot be read (the key and the reason), else None."""

    method: str | None
    num_weights: int
    packed_bytes: int
    scale_bytes: int
    ignored_bytes: int
    bf16_bytes: int
    rows: tuple[QuantRow, ...]
    error: str | None = None


def summarize(
    config: Mapping | None, hf_quant: Mapping | None, tensors: Mapping[str, TensorInfo]
) -> QuantSummary | None:
    """:class:`QuantSummary` of a checkpoint (config.json or its quantization_config,
    hf_quant_config.json, headers); None when it declares no quantization and holds no packed
    weight. A recognition error is returned in ``error``, not raised."""
    return _summarize(config, hf_quant, tensors)[0]


def _summarize(config, hf_quant, tensors) -> tuple[QuantSummary | None, frozenset[str]]:
    try:
        method = quant_method(config, hf_quant)
        packed = recognize(config, hf_quant, tensors)
    except CheckpointError as e:
        return QuantSummary(_safe_method(config, hf_quant), 0, 0, 0, 0, 0, (), str(e)), frozenset()
    if not packed and method in (None, "fp8"):  # block FP8 is moeshard.io.fp8's report
        return None, frozenset()
    groups: dict[tuple[str, str], list[PackedWeight]] = {}
    for key in sorted(packed):
        pw = packed[key]
        groups.setdefault((_NUMBER.sub("*", key), describe(pw)), []).append(pw)
    rows = []
    for (pattern, fmt), pws in groups.items():
        first = pws[0]
        rows.append(
            QuantRow(
                pattern=pattern,
                format=fmt,
                scheme=first.scheme.name,
                group=first.scheme.group,
                shape=first.shape,
                num_weights=len(pws),
                packed_bytes=sum(tensors[pw.values].nbytes for pw in pws),
                scale_bytes=sum(
                    tensors[pw.scale].nbytes + (tensors[pw.global_scale].nbytes if pw.global_scale else 0) for pw in pws
                ),
                ignored_bytes=sum(tensors[k].nbytes for pw in pws for k in pw.ignored),
                bf16_bytes=sum(2 * math.prod(pw.shape) for pw in pws),
            )
        )
    summary = QuantSummary(
        method=method,
        num_weights=len(packed),
        packed_bytes=sum(r.packed_bytes for r in rows),
        scale_bytes=sum(r.scale_bytes for r in rows),
        ignored_bytes=sum(r.ignored_bytes for r in rows),
        bf16_bytes=sum(r.bf16_bytes for r in rows),
        rows=tuple(rows),
    )
    return summary, consumed_keys(packed)


def _safe_method(config, hf_quant) -> str | None:
    try:
        return quant_method(config, hf_quant)
    except CheckpointError:
        return None


def summarize_checkpoint(
    root: str | Path, tensors: Mapping[str, TensorInfo]
) -> tuple[QuantSummary | None, frozenset[str]]:
    """``(summary, consumed keys)`` of the checkpoint directory ``root`` with headers
    ``tensors``: the config files read there (an unreadable one is the summary's ``error``)."""
    try:
        config, hf_quant = read_quant_configs(root)
    except CheckpointError as e:
        return QuantSummary(None, 0, 0, 0, 0, 0, (), str(e)), frozenset()
    return _summarize(config, hf_quant, tensors)
