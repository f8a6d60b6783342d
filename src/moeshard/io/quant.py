"""Quantized weights of a checkpoint, recognized from its config and safetensors headers.

Pure and torch-free (``moeshard inspect`` / ``plan`` use it without torch). The formats read:

* **MXFP4** (gpt-oss; config.json ``quantization_config.quant_method == "mxfp4"``): fused experts
  ``<mod>.experts.<proj>_blocks`` U8 ``[E, R, C/32, 16]`` (two FP4 E2M1 codes per byte, low
  nibble first) and ``<proj>_scales`` U8 ``[E, R, C/32]`` (E8M0: ``2^(s - 127)``). The model's
  parameter ``<mod>.experts.<proj>`` is the TRANSPOSE of the last two dims of the decoded
  ``[E, R, C]`` (transformers' ``convert_moe_packed_tensors``).
* **compressed-tensors** (``quant_method == "compressed-tensors"``, ``format`` per config group
  or global): ``pack-quantized`` INT4 (``weight_packed`` I32 ``[R, C/8]``, eight codes per word
  stored ``code + 8``, ``weight_scale`` ``[R, C/g]``, ``weight_shape``), ``nvfp4-pack-quantized``
  (``weight_packed`` U8 ``[R, C/2]``, ``weight_scale`` F8_E4M3 ``[R, C/16]``,
  ``weight_global_scale`` F32 ``[1]``), ``float-quantized`` FP8 (``weight`` F8_E4M3 ``[R, C]``,
  ``weight_scale`` ``[R, 1]`` per channel or ``[1]`` / ``[]`` per tensor).
* **ModelOpt NVFP4** (``hf_quant_config.json`` ``quantization.quant_algo == "NVFP4"``, or
  config.json ``quantization_config.quant_method == "modelopt"``): ``weight`` U8 ``[R, C/2]``,
  ``weight_scale`` F8_E4M3 ``[R, C/16]``, ``weight_scale_2`` F32 ``[]``.

Any leading dims (fused experts ``[E, ...]``) are allowed. Block FP8 (DeepSeek-V3's
``weight_scale_inv``, compressed-tensors' ``block`` strategy) is :mod:`moeshard.io.fp8`'s.
The dequantization of each scheme is :mod:`moeshard.io.codecs`'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._gc import paused_gc
from ..box import Box
from .errors import CheckpointError
from .header import TensorInfo
from .strict_json import load_json

__all__ = [
    "Scheme",
    "PackedWeight",
    "QUANT_CONFIG_NAME",
    "read_quant_configs",
    "quant_method",
    "recognize",
    "value_box",
    "check_weight_shape",
    "describe",
    "consumed_keys",
    "explain",
]

QUANT_CONFIG_NAME = "hf_quant_config.json"

_FLOAT_SCALES = frozenset({"F32", "BF16", "F16"})
# Methods whose weights moeshard reads elsewhere (block FP8: io.fp8) or that hold no packed weight.
_OTHER_METHODS = frozenset({"fp8"})


@dataclass(frozen=True)
class Scheme:
    """How one weight is quantized.

    ``name``: "mxfp4" | "nvfp4" | "int4" | "fp8" (reports); ``method``: "mxfp4" |
    "compressed-tensors/pack-quantized" | "compressed-tensors/nvfp4-pack-quantized" |
    "compressed-tensors/float-quantized" | "modelopt/NVFP4"; ``code``: the element code
    "e2m1" | "int4" | "f8_e4m3"; ``bits`` per element (4 | 8); ``group``: values per scale along
    the last dim (per channel: C; per tensor: 0); ``scale_dtype``: safetensors dtype name of the
    scale ("U8" is E8M0); ``global_scale``: "" | "divide" (compressed-tensors
    ``weight_global_scale``: ``q * (scale / global)``) | "multiply" (ModelOpt ``weight_scale_2``:
    ``q * scale * global``)."""

    name: str
    method: str
    code: str
    bits: int
    group: int
    scale_dtype: str
    global_scale: str


@dataclass(frozen=True)
class PackedWeight:
    """One quantized weight of a checkpoint.

    ``key``: the LOGICAL key a float model reads (gpt-oss ``<mod>.experts.gate_up_proj``;
    compressed-tensors / ModelOpt ``<prefix>.weight``, even where that key holds the packed bytes);
    ``shape``: the logical tensor's shape (gpt-oss: ``[E, H, 2I]``, transposed);
    ``values`` / ``scale`` / ``global_scale``: keys of the packed values, the scale and the global
    scale (None without one); ``ignored``: keys of this weight consumed knowingly and not used
    (``weight_shape``, ``input_scale``, ``input_global_scale``); ``shape_key``: the
    ``weight_shape`` key when there is one (its value must equal :attr:`value_shape`'s last two
    dims: :func:`check_weight_shape`); ``transposed``: logical = decoded.transpose(-1, -2).

    The value-oriented shape :attr:`value_shape` ``[..., R, C]`` is ``shape`` with the last two
    dims swapped when ``transposed``; the values tensor holds exactly its elements row-major at
    ``bits / 8`` bytes each, whatever its stored shape; the scale is ``[..., R, C // group]``
    (per channel ``[..., R, 1]``, per tensor one value)."""

    key: str
    shape: tuple[int, ...]
    values: str
    scale: str
    global_scale: str | None
    ignored: tuple[str, ...]
    scheme: Scheme
    transposed: bool
    shape_key: str | None = None

    @property
    def value_shape(self) -> tuple[int, ...]:
        if self.transposed:
            return (*self.shape[:-2], self.shape[-1], self.shape[-2])
        return self.shape

    @property
    def keys(self) -> tuple[str, ...]:
        """Every checkpoint key this weight accounts for (read or knowingly ignored)."""
        own = (self.values, self.scale) + ((self.global_scale,) if self.global_scale else ())
        return own + self.ignored

    @property
    def step(self) -> int:
        """Columns (of the value-oriented last dim) a box must start and end on: its group, or
        for a per-channel / per-tensor scale the elements of one stored unit (an I32 holds 8)."""
        s = self.scheme
        if s.name == "mxfp4":
            return 32  # whole 16-byte blocks
        if 0 < s.group < self.value_shape[-1]:
            return s.group
        return 8 if s.code == "int4" else (2 if s.bits == 4 else 1)


_SCHEMES: dict[tuple, Scheme] = {}


def _scheme(*fields) -> Scheme:
    """One shared :class:`Scheme` per distinct value (a checkpoint has ~70,000 weights of a few)."""
    scheme = _SCHEMES.get(fields)
    if scheme is None:
        scheme = _SCHEMES[fields] = Scheme(*fields)
    return scheme


def read_quant_configs(path: str | Path) -> tuple[Mapping | None, Mapping | None]:
    """``(config.json's quantization_config, hf_quant_config.json)`` of checkpoint directory
    ``path``: None for a file that is absent or a config without a quantization_config."""
    root = Path(path)
    config = hf_quant = None
    if (root / "config.json").is_file():
        cfg = load_json(root / "config.json", "config")
        if isinstance(cfg, Mapping):
            config = cfg.get("quantization_config")
    if (root / QUANT_CONFIG_NAME).is_file():
        hf_quant = load_json(root / QUANT_CONFIG_NAME, "ModelOpt quantization config")
    return config, hf_quant


def _qc(config: Mapping | None) -> Mapping | None:
    """The quantization_config of ``config`` (a whole config.json or its quantization_config)."""
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise CheckpointError(f"quantization_config: expected a JSON object, got {type(config).__name__}")
    inner = config.get("quantization_config")
    if inner is not None:
        if not isinstance(inner, Mapping):
            raise CheckpointError("config.json: quantization_config is not a JSON object")
        return inner
    return config if "quant_method" in config else None


def _modelopt(config: Mapping | None, hf_quant: Mapping | None) -> Mapping | None:
    """ModelOpt's quantization section (``quant_algo``, ``group_size``...), or None."""
    if hf_quant is not None:
        if not isinstance(hf_quant, Mapping) or not isinstance(hf_quant.get("quantization"), Mapping):
            raise CheckpointError(f"{QUANT_CONFIG_NAME}: no 'quantization' object")
        return hf_quant["quantization"]
    qc = _qc(config)
    if qc is not None and qc.get("quant_method") == "modelopt":
        return qc
    return None


def quant_method(config: Mapping | None, hf_quant: Mapping | None) -> str | None:
    """The quantization a checkpoint declares, as reports name it ("mxfp4",
    "compressed-tensors/pack-quantized", "modelopt/NVFP4", "fp8"...), or None."""
    mo = _modelopt(config, hf_quant)
    if mo is not None:
        return f"modelopt/{mo.get('quant_algo')}"
    qc = _qc(config)
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        formats = sorted({str(f) for f in _ct_formats(qc)})
        return "compressed-tensors/" + "+".join(formats) if formats else "compressed-tensors"
    return str(method)


def _fail(key: str, reason: str) -> CheckpointError:
    return CheckpointError(f"{key}: {reason}")


def _shape(info: TensorInfo) -> tuple[int, ...]:
    return tuple(info.shape)


# -- MXFP4 (gpt-oss) ---------------------------------------------------------------------------


def _mxfp4(tensors: Mapping[str, TensorInfo]) -> dict[str, PackedWeight]:
    out = {}
    for key, info in tensors.items():
        if not key.endswith("_blocks"):
            continue
        logical = key[: -len("_blocks")]
        skey = logical + "_scales"
        shape = _shape(info)
        if info.dtype != "U8" or len(shape) != 4 or shape[-1] != 16:
            raise _fail(
                key,
                f"MXFP4 blocks must be U8 [E, R, C/32, 16] (gpt-oss's fused experts), got {info.dtype} {list(shape)}",
            )
        if skey not in tensors:
            raise _fail(key, f"MXFP4 blocks without their scale: the checkpoint has no tensor {skey}")
        s = tensors[skey]
        if s.dtype != "U8" or _shape(s) != shape[:-1]:
            raise _fail(
                skey,
                f"MXFP4 scale must be U8 {list(shape[:-1])} (one E8M0 per 32 values of {key}), "
                f"got {s.dtype} {list(_shape(s))}",
            )
        e, r, g, _ = shape
        scheme = _scheme("mxfp4", "mxfp4", "e2m1", 4, 32, "U8", "")
        out[logical] = PackedWeight(logical, (e, g * 32, r), key, skey, None, (), scheme, True)
    for key in tensors:
        if key.endswith("_scales") and key[: -len("_scales")] not in out:
            raise _fail(
                key, f"MXFP4 scale without its blocks: the checkpoint has no tensor {key[: -len('_scales')]}_blocks"
            )
    return out


# -- compressed-tensors --------------------------------------------------------------------------

_CT_PACKED = "pack-quantized"
_CT_NVFP4 = "nvfp4-pack-quantized"
_CT_FLOAT = "float-quantized"
_CT_KNOWN = frozenset({_CT_PACKED, _CT_NVFP4, _CT_FLOAT, "naive-quantized", "dense"})


@dataclass(frozen=True)
class _Group:
    name: str
    format: str
    targets: tuple[str, ...]
    num_bits: int
    type: str
    strategy: str
    group_size: int | None
    symmetric: bool


def _ct_groups(qc: Mapping) -> list[_Group]:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise CheckpointError("quantization_config.config_groups is not a JSON object")
    fmt = qc.get("format")
    out = []
    for name, g in groups.items():
        if not isinstance(g, Mapping):
            raise CheckpointError(f"quantization_config.config_groups.{name} is not a JSON object")
        w = g.get("weights")
        if not isinstance(w, Mapping):
            continue  # activation-only group: no weight quantized
        gfmt = g.get("format") or fmt
        if gfmt in (None, "mixed-precision"):
            raise CheckpointError(f"quantization_config.config_groups.{name}: no format (global format is {fmt!r})")
        out.append(
            _Group(
                str(name),
                str(gfmt),
                tuple(str(t) for t in (g.get("targets") or ())),
                int(w.get("num_bits", 0)),
                str(w.get("type")),
                str(w.get("strategy")),
                w.get("group_size"),
                bool(w.get("symmetric", True)),
            )
        )
    return out


def _ct_formats(qc: Mapping) -> list[str]:
    try:
        return [g.format for g in _ct_groups(qc)] or [str(qc.get("format"))]
    except CheckpointError:
        return [str(qc.get("format"))]


def _targets(group: _Group, module: str) -> bool:
    """Whether ``group``'s targets may name module ``module``: a regex ("re:...") or a module
    name is checked; a class name (``Linear``) is not known from keys and matches any module."""
    if not group.targets:
        return True
    for t in group.targets:
        if t.startswith("re:"):
            if re.match(t[3:], module):
                return True
        elif "." in t:
            if module == t or module.endswith("." + t):
                return True
        else:
            return True  # a class name
    return False


def _matches_any_module(group: _Group) -> bool:
    return not group.targets or any(not t.startswith("re:") and "." not in t for t in group.targets)


def _ct_group(groups, module: str, formats: tuple[str, ...], key: str, cache: dict | None = None) -> _Group:
    """The config group describing ``module``, whose weights are stored in one of ``formats``.
    ``cache``: a dict to remember the answer per ``formats`` in, when every group matches any
    module (class-name targets such as ``Linear``, the usual case), else None."""
    if cache is not None and formats in cache:
        return cache[formats]
    found = [g for g in groups if g.format in formats and _targets(g, module)]
    kinds = {(g.format, g.num_bits, g.type, g.strategy, g.group_size, g.symmetric) for g in found}
    if not found:
        seen = ", ".join(f"{g.name}: {g.format}" for g in groups) or "none"
        raise _fail(
            key,
            f"no compressed-tensors config group in format {' or '.join(formats)} targets {module} (groups: {seen})",
        )
    if len(kinds) > 1:
        raise _fail(
            key,
            f"compressed-tensors config groups {[g.name for g in found]} all target {module} with different schemes",
        )
    if cache is not None:
        cache[formats] = found[0]
    return found[0]


def _scale_cols(key: str, skey: str, s: TensorInfo, rows: tuple[int, ...], what: str) -> int:
    """Columns of scale ``s`` of a weight of leading shape ``rows`` ([..., R])."""
    shape = _shape(s)
    if len(shape) != len(rows) + 1 or shape[:-1] != rows:
        raise _fail(skey, f"{what} scale of {key} must be {[*rows, 'groups']}, got {list(shape)}")
    return shape[-1]


def _present(tensors: Mapping[str, TensorInfo], prefix: str, names: Sequence[str]) -> tuple[str, ...]:
    return tuple(prefix + n for n in names if prefix + n in tensors)


def _ct_pack(tensors, groups, module: str, key: str, cache: dict | None) -> PackedWeight:
    info = tensors[key]
    prefix = module + "."
    logical = prefix + "weight"
    skey = prefix + "weight_scale"
    zp = prefix + "weight_zero_point"
    if info.dtype == "I32":
        g = _ct_group(groups, module, (_CT_PACKED,), key, cache)
        if g.type != "int" or g.num_bits != 4:
            raise _fail(
                key, f"pack-quantized {g.type}{g.num_bits} is not read (only 4-bit int, as INT4 checkpoints store it)"
            )
        if not g.symmetric or zp in tensors:
            raise _fail(key, "pack-quantized INT4 with a zero point (asymmetric) is not read")
        if g.strategy not in ("group", "channel"):
            raise _fail(key, f"pack-quantized INT4 with strategy {g.strategy!r} is not read (group or channel)")
        shape = _shape(info)
        if len(shape) < 2:
            raise _fail(key, f"pack-quantized values must be I32 [..., R, C/8], got {list(shape)}")
        if skey not in tensors:
            raise _fail(key, f"no scale: the checkpoint has no tensor {skey}")
        s = tensors[skey]
        if s.dtype not in _FLOAT_SCALES:
            raise _fail(skey, f"INT4 scale must be a float tensor (F32/BF16/F16), got {s.dtype}")
        ncol = _scale_cols(key, skey, s, shape[:-1], "INT4")
        if g.strategy == "group":
            gs = g.group_size
            if not isinstance(gs, int) or gs <= 0 or gs % 8:
                raise _fail(key, f"pack-quantized group_size {gs!r} is not a positive multiple of 8")
            cols = ncol * gs
        else:
            if ncol != 1:
                raise _fail(skey, f"per-channel INT4 scale of {key} must have one column, got {list(_shape(s))}")
            cols = shape[-1] * 8
            gs = cols
        if cols != shape[-1] * 8:
            raise _fail(
                key,
                f"INT4 values {list(shape)} hold {shape[-1] * 8} columns but the scale {skey} "
                f"{list(_shape(s))} x group {gs} says {cols}",
            )
        shape_key = prefix + "weight_shape"
        sk = None
        if shape_key in tensors:
            ws = tensors[shape_key]
            if ws.dtype not in ("I32", "I64") or _shape(ws) != (2,):
                raise _fail(shape_key, f"weight_shape must be I32/I64 [2], got {ws.dtype} {list(_shape(ws))}")
            sk = shape_key
        if len(shape) > 2 and sk is not None:
            raise _fail(shape_key, f"weight_shape [2] cannot describe {len(shape)}-dim values {key} {list(shape)}")
        scheme = _scheme("int4", "compressed-tensors/" + _CT_PACKED, "int4", 4, gs, s.dtype, "")
        return PackedWeight(
            logical,
            (*shape[:-1], cols),
            key,
            skey,
            None,
            _present(tensors, prefix, ("weight_shape", "input_scale")),
            scheme,
            False,
            sk,
        )
    if info.dtype == "U8":
        g = _ct_group(groups, module, (_CT_NVFP4,), key, cache)
        if g.type != "float" or g.num_bits != 4 or g.group_size != 16:
            raise _fail(
                key,
                f"nvfp4-pack-quantized with {g.type}{g.num_bits} group {g.group_size} is not NVFP4 (float4, group 16)",
            )
        if zp in tensors:
            raise _fail(key, "NVFP4 with a zero point is not read")
        return _nvfp4(
            tensors,
            key,
            prefix,
            logical,
            "compressed-tensors/" + _CT_NVFP4,
            16,
            "weight_global_scale",
            "divide",
            ("input_global_scale", "weight_shape"),
        )
    raise _fail(
        key, f"weight_packed of dtype {info.dtype} is neither pack-quantized (I32) nor nvfp4-pack-quantized (U8)"
    )


def _nvfp4(tensors, key, prefix, logical, method, group, global_name, global_kind, ignorable) -> PackedWeight:
    info = tensors[key]
    shape = _shape(info)
    skey = prefix + "weight_scale"
    gkey = prefix + global_name
    if len(shape) < 2:
        raise _fail(key, f"NVFP4 values must be U8 [..., R, C/2], got {list(shape)}")
    if skey not in tensors:
        raise _fail(key, f"no scale: the checkpoint has no tensor {skey}")
    s = tensors[skey]
    if s.dtype != "F8_E4M3":
        raise _fail(skey, f"NVFP4 scale must be F8_E4M3, got {s.dtype}")
    ncol = _scale_cols(key, skey, s, shape[:-1], "NVFP4")
    if ncol * group != shape[-1] * 2:
        raise _fail(
            skey,
            f"NVFP4 scale {list(_shape(s))} of {key} {list(shape)} is not one per {group} values "
            f"({shape[-1] * 2} columns)",
        )
    if gkey not in tensors:
        raise _fail(key, f"no global scale: the checkpoint has no tensor {gkey}")
    gs = tensors[gkey]
    if gs.dtype not in _FLOAT_SCALES or math.prod(_shape(gs)) != 1:
        raise _fail(gkey, f"NVFP4 global scale must be one float value, got {gs.dtype} {list(_shape(gs))}")
    scheme = _scheme("nvfp4", method, "e2m1", 4, group, "F8_E4M3", global_kind)
    return PackedWeight(
        logical, (*shape[:-1], shape[-1] * 2), key, skey, gkey, _present(tensors, prefix, ignorable), scheme, False
    )


def _ct_float(tensors, groups, module: str, key: str, cache: dict | None) -> PackedWeight | None:
    prefix = module + "."
    skey = prefix + "weight_scale"
    info = tensors[key]
    shape = _shape(info)
    g = _ct_group(groups, module, (_CT_FLOAT, "naive-quantized"), key, cache)
    if g.strategy == "block":
        return None  # block FP8: moeshard.io.fp8
    if g.type != "float" or g.num_bits != 8:
        raise _fail(key, f"float-quantized {g.type}{g.num_bits} is not read (only FP8 E4M3)")
    if prefix + "weight_zero_point" in tensors:
        raise _fail(key, "FP8 with a zero point is not read")
    s = tensors[skey]
    if s.dtype not in _FLOAT_SCALES:
        raise _fail(skey, f"FP8 scale must be a float tensor (F32/BF16/F16), got {s.dtype}")
    sshape = _shape(s)
    if g.strategy == "channel":
        if sshape != (*shape[:-1], 1):
            raise _fail(
                skey, f"per-channel FP8 scale of {key} {list(shape)} must be {[*shape[:-1], 1]}, got {list(sshape)}"
            )
        group = shape[-1]
    elif g.strategy == "tensor":
        if math.prod(sshape) != 1 or len(sshape) > 1:
            raise _fail(skey, f"per-tensor FP8 scale of {key} must be one value ([1] or []), got {list(sshape)}")
        group = 0
    else:
        raise _fail(
            key,
            f"float-quantized FP8 with strategy {g.strategy!r} is not read "
            "(channel, tensor; block is read as block FP8)",
        )
    scheme = _scheme("fp8", "compressed-tensors/" + _CT_FLOAT, "f8_e4m3", 8, group, s.dtype, "")
    return PackedWeight(key, shape, key, skey, None, _present(tensors, prefix, ("input_scale",)), scheme, False)


def _compressed_tensors(qc: Mapping, tensors: Mapping[str, TensorInfo]) -> dict[str, PackedWeight]:
    fmt = qc.get("format")
    groups = _ct_groups(qc)
    for g in groups:
        if g.format not in _CT_KNOWN:
            raise CheckpointError(
                f"quantization_config.config_groups.{g.name}: compressed-tensors format {g.format!r} is not read "
                f"(read: {_CT_PACKED}, {_CT_NVFP4}, {_CT_FLOAT})"
            )
    if not groups and fmt not in (None, "dense"):
        raise CheckpointError(f"quantization_config: compressed-tensors format {fmt!r} without config_groups")
    out: dict[str, PackedWeight] = {}
    cache: dict | None = {} if all(_matches_any_module(g) for g in groups) else None
    for key, info in tensors.items():
        if key.endswith(".weight_packed"):
            module = key[: -len(".weight_packed")]
            pw = _ct_pack(tensors, groups, module, key, cache)
        elif key.endswith(".weight") and info.dtype in ("F8_E4M3", "F8_E5M2") and key + "_scale" in tensors:
            pw = _ct_float(tensors, groups, key[: -len(".weight")], key, cache)
            if pw is None:
                continue
        else:
            continue
        if pw.key in out or (pw.key != pw.values and pw.key in tensors):
            raise _fail(pw.key, f"stored both as a float tensor and as {pw.scheme.method} values {pw.values}")
        out[pw.key] = pw
    for key in tensors:
        if key.endswith(".weight_scale"):
            module = key[: -len(".weight_scale")]
            if (
                module + ".weight" not in out
                and module + ".weight_packed" not in tensors
                and module + ".weight" not in tensors
            ):
                raise _fail(
                    key, f"scale without values: the checkpoint has neither {module}.weight_packed nor {module}.weight"
                )
    return out


# -- ModelOpt ---------------------------------------------------------------------------------


def _modelopt_nvfp4(mo: Mapping, tensors: Mapping[str, TensorInfo]) -> dict[str, PackedWeight]:
    algo = mo.get("quant_algo")
    if algo != "NVFP4":
        raise CheckpointError(f"ModelOpt quant_algo {algo!r} is not read (read: 'NVFP4')")
    group = mo.get("group_size", 16)
    if group != 16:
        raise CheckpointError(f"ModelOpt NVFP4 group_size {group!r} is not read (16)")
    out = {}
    for key, info in tensors.items():
        if not key.endswith(".weight") or info.dtype != "U8":
            continue
        prefix = key[: -len("weight")]
        out[key] = _nvfp4(
            tensors, key, prefix, key, "modelopt/NVFP4", 16, "weight_scale_2", "multiply", ("input_scale",)
        )
    return out


# -- recognition ------------------------------------------------------------------------------


def _undeclared(tensors: Mapping[str, TensorInfo]) -> None:
    """Refuse packed tensors in a checkpoint that declares no quantization: decoding them
    needs the scheme the config would name."""
    for key, info in tensors.items():
        if key.endswith("_blocks") and info.dtype == "U8" and key[: -len("_blocks")] + "_scales" in tensors:
            raise _fail(key, "MXFP4 blocks, but config.json declares no quantization_config (quant_method 'mxfp4')")
        if key.endswith(".weight_packed"):
            raise _fail(
                key,
                "compressed-tensors packed values, but config.json declares no quantization_config "
                "(quant_method 'compressed-tensors')",
            )
        if key.endswith(".weight_scale_2"):
            raise _fail(key, f"ModelOpt NVFP4 scale, but the checkpoint has no {QUANT_CONFIG_NAME}")


def recognize(
    config: Mapping | None, hf_quant_config: Mapping | None, tensors: Mapping[str, TensorInfo]
) -> dict[str, PackedWeight]:
    """``{logical key: PackedWeight}`` of the quantized weights of a checkpoint: ``config`` is
    config.json (whole, or its ``quantization_config``), ``hf_quant_config`` ModelOpt's
    ``hf_quant_config.json`` (None when absent), ``tensors`` the checkpoint's ``{key:
    TensorInfo}``. Empty for a checkpoint with none of these formats (block FP8 included: that
    is :mod:`moeshard.io.fp8`'s).

    Raises :class:`~moeshard.io.errors.CheckpointError` (a ValueError) naming the key and the
    reason: an unknown quant_method / format / scheme, a missing scale or global scale, a scale or
    values tensor whose shape or dtype disagrees, a zero point (asymmetric), packed tensors that
    no config declares. Pure: the values of ``weight_shape`` tensors are checked by
    :func:`check_weight_shape` once read."""
    with paused_gc():  # ~70,000 weights of a large checkpoint, no reference cycles
        return _recognize(config, hf_quant_config, tensors)


def _recognize(config, hf_quant_config, tensors) -> dict[str, PackedWeight]:
    mo = _modelopt(config, hf_quant_config)
    if mo is not None:
        return _modelopt_nvfp4(mo, tensors)
    qc = _qc(config)
    if qc is None:
        _undeclared(tensors)
        return {}
    method = qc.get("quant_method")
    if method == "mxfp4":
        return _mxfp4(tensors)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, tensors)
    if method in _OTHER_METHODS:
        return {}
    raise CheckpointError(
        f"quantization_config.quant_method {method!r} is not read (read: 'mxfp4', 'compressed-tensors', "
        f"'modelopt' / {QUANT_CONFIG_NAME} NVFP4, and block 'fp8')"
    )


def check_weight_shape(pw: PackedWeight, value: Sequence[int]) -> None:
    """Raise naming the key when the ``weight_shape`` tensor's ``value`` disagrees with the
    packed values' shape."""
    want = tuple(pw.value_shape[-2:])
    got = tuple(int(v) for v in value)
    if got != want:
        raise _fail(
            pw.shape_key or pw.key,
            f"weight_shape {list(got)} disagrees with the packed values {pw.values}: they hold {list(want)}",
        )


def value_box(pw: PackedWeight, box: Box) -> Box:
    """The box of the value-oriented tensor (``pw.value_shape``) that logical ``box`` is."""
    if pw.transposed:
        return (*box[:-2], box[-1], box[-2])
    return tuple(box)


def describe(pw: PackedWeight) -> str:
    """One line naming a quantized weight's format: "nvfp4 (compressed-tensors/nvfp4-pack-quantized,
    group 16, F8_E4M3 scale, global scale)"."""
    s = pw.scheme
    group = (
        "per tensor"
        if s.group == 0
        else ("per channel" if s.group == pw.value_shape[-1] and s.name != "mxfp4" else f"group {s.group}")
    )
    scale = "E8M0" if s.scale_dtype == "U8" else s.scale_dtype
    extra = ", global scale" if s.global_scale else ""
    return f"{s.name} ({s.method}, {group}, {scale} scale{extra})"


def consumed_keys(packed: Mapping[str, PackedWeight]) -> frozenset[str]:
    """Every checkpoint key the quantized weights ``packed`` account for (values, scales, global
    scales, knowingly ignored ``weight_shape`` / input scales): what a strict check of unused
    keys counts as read."""
    return frozenset(k for pw in packed.values() for k in pw.keys)


def explain(packed: Mapping[str, PackedWeight], method: str | None, key: str) -> str | None:
    """What a float load's refusal of checkpoint key ``key`` (a tensor it found missing, or of a
    dtype it cannot cast) must add for a quantized checkpoint: the format it is stored in
    ("model.layers.0.mlp.experts.gate_up_proj is stored quantized as mxfp4 (mxfp4, group 32,
    E8M0 scale): model.layers.0.mlp.experts.gate_up_proj_blocks + ..._scales"), or, for a key
    of no quantized weight, that the checkpoint is quantized; None for a checkpoint with no
    quantized weight and no declared method. ``packed`` / ``method``: :func:`recognize` and
    :func:`quant_method` of the checkpoint."""
    pw = packed.get(key)
    if pw is None:
        pw = next((p for p in packed.values() if p.values == key or p.scale == key or p.global_scale == key), None)
    if pw is not None:
        parts = " + ".join([pw.values, pw.scale] + ([pw.global_scale] if pw.global_scale else []))
        return f"{pw.key} is stored quantized as {describe(pw)}: {parts}"
    if not packed and method in (None, "fp8"):
        return None
    some = next(iter(sorted(packed)), None)
    example = f", e.g. {describe(packed[some])} for {some}" if some else ""
    return f"the checkpoint is quantized ({method or 'undeclared'}: {len(packed)} quantized weights{example})"
