"""``moeshard inspect CKPT``: what a checkpoint holds and what is wrong with it, from headers.

Reads the index (``model.safetensors.index.json``) and the safetensors header of every file
it names; never a byte of tensor data, so a 700 GB checkpoint is inspected in seconds. It
reports tensor counts and bytes (per dtype, per file), the Mixture-of-Experts layout found in
the key names (experts modules in layer order, experts per layer, the per-expert tensors with
shape, dtype and bytes, expert vs dense bytes), and the problems a load would trip over or
silently get wrong: missing experts, per-expert tensors that differ between experts or layers,
mixed floating dtypes, tensors and files the index does not name, files it names that are
missing. The MoE layout and its problems come from :mod:`moeshard.io.formats`, the recognizer
``moeshard plan`` and ``moeshard.load`` use too.

Exit codes: 0 no problems; 1 problems found (listed); 2 the input is not a readable
checkpoint (one line on stderr). A checkpoint with no MoE layers is reported as a problem
(exit 1): moeshard exists to place experts, and a dense checkpoint given to it is most likely
the wrong path or an unsupported naming scheme, which a script should notice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from .._gc import paused_gc
from ..io.errors import CheckpointError
from ..io.formats import MAX_LISTED, ExpertTensorInfo, Problem, check, id_ranges, recognize, shape_str
from ..io.fp8 import Quantization, quantization
from ..io.header import DTYPES, TensorInfo, read_header
from ..io.index import INDEX_NAME, CheckpointIndex, read_index
from ..io.quant_report import QuantSummary, summarize_checkpoint

__all__ = [
    "CheckpointSummary",
    "DtypeStat",
    "ExpertTensorInfo",
    "FileStat",
    "MAX_LISTED",
    "MoeLayer",
    "MoeSummary",
    "Problem",
    "inspect_checkpoint",
    "format_summary",
    "main",
]

_FLOATING = frozenset(name for name, dt in DTYPES.items() if dt.is_floating_point)


@dataclass(frozen=True)
class DtypeStat:
    dtype: str
    num_tensors: int
    nbytes: int


@dataclass(frozen=True)
class FileStat:
    """A file the checkpoint is made of: the tensors the index maps to it, their bytes, and
    the file's size on disk (headers included)."""

    name: str
    num_tensors: int
    nbytes: int
    file_size: int


@dataclass(frozen=True)
class MoeLayer:
    """One experts module: its prefix, how many experts it holds, their bytes."""

    module: str
    num_experts: int
    nbytes: int
    fused: bool


@dataclass(frozen=True)
class MoeSummary:
    layers: tuple[MoeLayer, ...]
    num_experts: int  # the most experts any layer has: what every layer should have
    expert_tensors: tuple[ExpertTensorInfo, ...]
    bytes_per_expert: int
    expert_bytes: int
    dense_bytes: int


@dataclass(frozen=True)
class CheckpointSummary:
    """Everything ``moeshard inspect`` reports. ``index`` is None for a single-file checkpoint.
    Counts and bytes cover the tensors the index maps to files that hold them."""

    root: str
    index: str | None
    num_tensors: int
    total_bytes: int
    dtypes: tuple[DtypeStat, ...]
    files: tuple[FileStat, ...]
    moe: MoeSummary | None
    problems: tuple[Problem, ...]
    quantization: Quantization | None = None
    quantized: QuantSummary | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


# ---------------------------------------------------------------------------------------------
# Reading: index + headers, tolerant of the problems we want to report


@dataclass(frozen=True)
class _Headers:
    root: Path
    index: str | None
    tensors: dict[str, TensorInfo]  # indexed keys found in their file
    file_sizes: dict[str, int]  # files read (index order)
    problems: tuple[Problem, ...]


def _read_headers(path: str | os.PathLike) -> _Headers:
    """Index + every header it names. Missing files and keys become problems (not errors) so
    the rest of the checkpoint is still summarized; anything unreadable raises
    CheckpointError."""
    p = Path(path)
    if p.name == INDEX_NAME and p.is_file():
        p = p.parent
    if not p.exists():
        raise CheckpointError(f"{p}: no such file or directory")
    if p.is_dir() and (p / INDEX_NAME).is_file():
        return _read_sharded(p)
    # A single file (or a directory holding exactly one): CheckpointIndex.open validates it
    # and says clearly what is wrong when it is neither.
    index = CheckpointIndex.open(p)
    return _Headers(Path(index.root), None, index.tensors, index.file_sizes, ())


def _read_sharded(root: Path) -> _Headers:
    # Names validated as a load validates them; a missing file is reported, not fatal.
    weight_map = read_index(root, require_files=False)
    problems: list[Problem] = []
    present: dict[str, list[str]] = {}
    for name, keys in weight_map.items():
        if (root / name).is_file():
            present[name] = keys
        else:
            problems.append(
                Problem("missing_files", f"{INDEX_NAME} names {name}, which does not exist ({len(keys)} tensors)")
            )
    tensors: dict[str, TensorInfo] = {}
    sizes: dict[str, int] = {}
    for name, keys in present.items():
        # One file at a time through the validated reader: every key of the file (not only
        # the indexed ones), so keys the index forgot are found too.
        in_file, sizes[name] = read_header(root / name, name)
        missing = [k for k in keys if k not in in_file]
        if missing:
            problems.append(
                Problem(
                    "missing_keys",
                    f"{INDEX_NAME} places {len(missing)} tensors in {name}, which lacks them: {_some(missing)}",
                )
            )
        for k in keys:
            info = in_file.get(k)
            if info is not None:
                tensors[k] = info
        if len(in_file) > len(keys) - len(missing):
            indexed = set(keys)
            stray = [k for k in in_file if k not in indexed]
            problems.append(
                Problem(
                    "unindexed_keys",
                    f"{name} holds {len(stray)} tensors that {INDEX_NAME} does not name: {_some(stray)}",
                )
            )
    named = set(weight_map)
    for extra in sorted(x.name for x in root.glob("*.safetensors")):
        if extra not in named:
            problems.append(
                Problem("unindexed_files", f"{extra} is in the checkpoint directory but {INDEX_NAME} does not name it")
            )
    return _Headers(root, INDEX_NAME, tensors, sizes, tuple(problems))


# ---------------------------------------------------------------------------------------------
# Analysis: pure functions of the headers


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointSummary:
    """Summarize the checkpoint at ``path`` (a directory, its index file, or a .safetensors
    file) from its headers alone.

    Raises:
        CheckpointError (a ValueError): the path is not a readable checkpoint (missing, not
            safetensors, corrupt header or index).
    """
    # ~90,000 small objects and no reference cycles: the cyclic collector's passes would
    # cost as much as the parsing.
    with paused_gc():
        h = _read_headers(path)
        problems = list(h.problems)
        quantized, consumed = summarize_checkpoint(h.root, h.tensors)
        if quantized is not None and quantized.error:
            problems.append(Problem("quantization", quantized.error))
        # Scales and packed values of the quantized weights are in their format's dtypes, not
        # the model's, and are not block-FP8 weights.
        plain = {k: t for k, t in h.tensors.items() if k not in consumed} if consumed else h.tensors
        problems += _dtype_problems(plain)
        moe, moe_problems = _moe_layout(h.tensors)
        problems += moe_problems
        return CheckpointSummary(
            root=str(h.root),
            index=h.index,
            num_tensors=len(h.tensors),
            total_bytes=sum(t.nbytes for t in h.tensors.values()),
            dtypes=_dtype_stats(h.tensors),
            files=_file_stats(h.tensors, h.file_sizes),
            moe=moe,
            problems=tuple(problems),
            quantization=quantization(plain),
            quantized=quantized,
        )


def _dtype_stats(tensors: dict[str, TensorInfo]) -> tuple[DtypeStat, ...]:
    count: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for t in tensors.values():
        count[t.dtype] += 1
        nbytes[t.dtype] += t.nbytes
    return tuple(DtypeStat(d, count[d], nbytes[d]) for d in sorted(count, key=lambda d: -nbytes[d]))


def _file_stats(tensors: dict[str, TensorInfo], sizes: dict[str, int]) -> tuple[FileStat, ...]:
    count: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for t in tensors.values():
        count[t.file] += 1
        nbytes[t.file] += t.nbytes
    return tuple(FileStat(f, count[f], nbytes[f], sizes[f]) for f in sorted(sizes))


# Tensors that are routinely kept in another dtype than the model's: quantization scales and
# biases (e.g. DeepSeek-V3's F32 weight_scale_inv and e_score_correction_bias), and fp8
# weights beside bf16 norms in a quantized checkpoint.
_OWN_DTYPE_SUFFIXES = ("scale_inv", "_scale", "scale", "bias")


def _counts_for_dtype(key: str, t: TensorInfo) -> bool:
    return t.dtype in _FLOATING and not t.dtype.startswith("F8") and not key.endswith(_OWN_DTYPE_SUFFIXES)


def _dtype_problems(tensors: dict[str, TensorInfo]) -> list[Problem]:
    """Floating tensors in more than one dtype: usually a partial cast (a bf16 model with an
    fp32 layer doubles that layer's memory, and a load casting into one dtype hides it)."""
    count: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for key, t in tensors.items():
        if _counts_for_dtype(key, t):
            count[t.dtype] += 1
            nbytes[t.dtype] += t.nbytes
    if len(count) < 2:
        return []
    # The model's dtype is the one holding the most bytes; the others are the odd ones out.
    main = nbytes.most_common(1)[0][0]
    others = sorted(k for k, t in tensors.items() if _counts_for_dtype(k, t) and t.dtype != main)
    parts = ", ".join(f"{d} ({count[d]:,} tensors, {nbytes[d]:,} bytes)" for d, _ in nbytes.most_common())
    return [Problem("mixed_dtypes", f"floating tensors in {len(count)} dtypes: {parts}; not {main}: {_some(others)}")]


def _moe_layout(tensors: dict[str, TensorInfo]) -> tuple[MoeSummary | None, list[Problem]]:
    """The report's MoE section from the one recognizer (:mod:`moeshard.io.formats`), and the
    problems it finds."""
    fmt = recognize(tensors)
    problems = list(check(fmt))
    if fmt is None:
        return None, problems
    layers = tuple(MoeLayer(m.module, len(m.experts), m.nbytes, m.fused) for m in fmt.modules)
    expert_bytes = sum(layer.nbytes for layer in layers)
    moe = MoeSummary(
        layers=layers,
        num_experts=fmt.num_experts,
        expert_tensors=fmt.expert_tensors,
        bytes_per_expert=sum(r.nbytes for r in fmt.expert_tensors),
        expert_bytes=expert_bytes,
        dense_bytes=sum(t.nbytes for t in tensors.values()) - expert_bytes,
    )
    return moe, problems


def _some(keys: list[str], n: int = 3) -> str:
    shown = ", ".join(keys[:n])
    return shown if len(keys) <= n else f"{shown}, ... ({len(keys) - n:,} more)"


# ---------------------------------------------------------------------------------------------
# Text report


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _table(rows: list[tuple], header: tuple, indent: str = "  ") -> list[str]:
    """Left-aligned first column, right-aligned numbers."""
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return [
        indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in cells
    ]


def _layer_lines(layers: tuple[MoeLayer, ...]) -> list[str]:
    """Few layers: one line each. Many: grouped by name pattern with the layer numbers as
    ranges (``model.layers.{3-60}.mlp.experts``), so 58 layers fit on one line."""
    if len(layers) <= 4:
        return [
            f"    {layer.module}: {layer.num_experts} experts, {_fmt_bytes(layer.nbytes)}"
            + (" (fused)" if layer.fused else "")
            for layer in layers
        ]
    groups: dict[tuple[str, int, bool], list[int]] = defaultdict(list)
    loose = []
    for layer in layers:
        nums = re.findall(r"\d+", layer.module)
        if len(nums) == 1:
            template = re.sub(r"\d+", "{}", layer.module)
            groups[(template, layer.num_experts, layer.fused)].append(int(nums[0]))
        else:
            loose.append(f"    {layer.module}: {layer.num_experts} experts" + (" (fused)" if layer.fused else ""))
    lines = []
    for (template, n, is_fused), nums in groups.items():
        name = template.replace("{}", "{" + id_ranges(sorted(nums)) + "}")
        lines.append(f"    {name}: {len(nums)} layers x {n} experts" + (" (fused)" if is_fused else ""))
    return lines + loose


def format_summary(s: CheckpointSummary) -> str:
    """The human-readable report ``moeshard inspect`` prints."""
    lines = [f"checkpoint {s.root}" + (f" ({s.index})" if s.index else " (single file)")]
    lines.append(
        f"  {s.num_tensors:,} tensors, {_fmt_bytes(s.total_bytes)} ({s.total_bytes:,} bytes) in {len(s.files)} files"
    )
    lines += ["", "dtypes"]
    lines += _table([(d.dtype, f"{d.num_tensors:,}", f"{d.nbytes:,}") for d in s.dtypes], ("dtype", "tensors", "bytes"))
    lines += ["", "files"]
    lines += _table(
        [(f.name, f"{f.num_tensors:,}", f"{f.nbytes:,}", f"{f.file_size:,}") for f in s.files],
        ("file", "tensors", "tensor bytes", "file size"),
    )
    lines.append("")
    moe = s.moe
    if moe is None:
        lines.append("MoE layout: no MoE layers found")
    else:
        lines.append(f"MoE layout: {len(moe.layers)} layers x {moe.num_experts} experts")
        lines.append("  layers:")
        lines += _layer_lines(moe.layers)
        lines.append("  per-expert tensors:")
        lines += _table(
            [
                (t.name + (" (fused)" if t.fused else ""), shape_str(t.shape), t.dtype, f"{t.nbytes:,}")
                for t in moe.expert_tensors
            ],
            ("name", "shape", "dtype", "bytes"),
            indent="    ",
        )
        total = moe.expert_bytes + moe.dense_bytes
        pct = 100 * moe.expert_bytes / total if total else 0.0
        lines.append(f"  bytes per expert: {moe.bytes_per_expert:,}")
        lines.append(
            f"  expert bytes: {_fmt_bytes(moe.expert_bytes)} ({pct:.1f}%), dense bytes: {_fmt_bytes(moe.dense_bytes)}"
        )
    lines += _quantized_lines(s.quantized)
    q = s.quantization
    if q is not None:
        blocks = ", ".join("x".join(map(str, b)) for b in q.blocks) or "-"
        lines += [
            "",
            f"FP8: {q.num_scaled:,} weights with block scales (blocks {blocks}): "
            f"{_fmt_bytes(q.fp8_bytes)} + {_fmt_bytes(q.scale_bytes)} of scales on disk, "
            f"{_fmt_bytes(q.bf16_bytes)} dequantized to bf16 (what `load` gives a bf16 model)",
        ]
        if q.unscaled:
            more = f" ... ({len(q.unscaled)} in all)" if len(q.unscaled) > 5 else ""
            lines.append(
                f"  {len(q.unscaled):,} FP8 tensors with no fitting scale (a float model refuses them): "
                f"{list(q.unscaled[:5])}{more}"
            )
    lines.append("")
    if s.problems:
        lines.append(f"problems ({len(s.problems)}):")
        lines += [f"  - {p.message}" for p in s.problems]
    else:
        lines.append("problems: none")
    return "\n".join(lines)


def _quantized_lines(q: QuantSummary | None) -> list[str]:
    """The quantized weights: format, group size, packed and scale bytes per key pattern."""
    if q is None:
        return []
    lines = ["", f"quantized weights ({q.method or 'no quantization declared'}):"]
    if q.error:
        return lines + [f"  not readable: {q.error}"]
    lines.append(
        f"  {q.num_weights:,} weights: {_fmt_bytes(q.packed_bytes)} packed + {_fmt_bytes(q.scale_bytes)} of scales "
        f"on disk ({_fmt_bytes(q.ignored_bytes)} more not read), {_fmt_bytes(q.bf16_bytes)} dequantized to bf16"
    )
    lines += _table(
        [
            (r.pattern, r.format, shape_str(r.shape), f"{r.num_weights:,}", f"{r.packed_bytes:,}", f"{r.scale_bytes:,}")
            for r in q.rows[:MAX_LISTED]
        ],
        ("tensors", "format", "shape", "count", "packed bytes", "scale bytes"),
        indent="    ",
    )
    if len(q.rows) > MAX_LISTED:
        lines.append(f"    ... ({len(q.rows) - MAX_LISTED:,} more patterns)")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``moeshard inspect [--json] CKPT``: 0 no problems, 1 problems, 2 unreadable input."""
    parser = argparse.ArgumentParser(
        prog="moeshard inspect",
        description="Summarize a safetensors checkpoint from its headers (no tensor data is read): "
        "tensors, dtypes, files, the MoE layout, and problems. Exit code 0: no problems; "
        "1: problems found (a checkpoint without MoE layers is one); 2: not a readable checkpoint.",
    )
    parser.add_argument(
        "checkpoint", help="checkpoint directory, its model.safetensors.index.json, or a .safetensors file"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON instead of a report")
    args = parser.parse_args(argv)
    try:
        summary = inspect_checkpoint(args.checkpoint)
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        print(summary.to_json() if args.json else format_summary(summary))
        sys.stdout.flush()
    except BrokenPipeError:
        # ``moeshard inspect CKPT | head``: the reader left; no traceback. Point stdout at
        # devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1 if summary.problems else 0


if __name__ == "__main__":
    sys.exit(main())
