"""bench_quant's checkpoints and report, in one process: the quantized checkpoint is recognized
whole, its bf16 twin holds the values the format's INDEPENDENT dequantizer gives (transformers'
MXFP4 conversion, compressed-tensors' INT4 decompression), cast once to bf16, and every other
tensor is the same in both; the summary takes the slowest rank and the ratios."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks/ (a checkout, not an installed package)

from benchmarks.bench_quant import dims, ensure_checkpoints, format_report, summarize  # noqa: E402

pytest.importorskip("transformers")

TINY = {
    "mxfp4": dict(fmt="mxfp4", hidden=64, inter=64, experts=4, layers=2, vocab=128, version=1),
    "int4": dict(fmt="int4", hidden=64, inter=64, experts=4, layers=2, vocab=128, version=1),
}


def _reference(fmt: str, key: str, stored: dict) -> torch.Tensor:
    if fmt == "mxfp4":
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        return convert_moe_packed_tensors(stored[key + "_blocks"], stored[key + "_scales"], dtype=torch.float32)
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    assert ct
    pre = key[: -len("weight")]
    args = QuantizationArgs(group_size=32, num_bits=4, strategy="group", symmetric=True, type="int")
    return PackedQuantizationCompressor.decompress(
        {
            "weight_packed": stored[pre + "weight_packed"],
            "weight_scale": stored[pre + "weight_scale"].float(),
            "weight_shape": stored[pre + "weight_shape"],
        },
        QuantizationScheme(targets=["Linear"], weights=args),
    )["weight"]


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_twin_holds_the_independently_dequantized_values(tmp_path, fmt):
    from safetensors.torch import load_file

    from moeshard import CheckpointIndex

    quant, twin = ensure_checkpoints(TINY[fmt], tmp_path)
    packed = CheckpointIndex.open(quant).packed
    stored = {k: v for f in sorted(quant.glob("*.safetensors")) for k, v in load_file(f).items()}
    floats = {k: v for f in sorted(twin.glob("*.safetensors")) for k, v in load_file(f).items()}
    expected = 2 * 2 if fmt == "mxfp4" else 2 * 4 * 3  # layers x (gate_up, down) | layers x experts x 3
    assert len(packed) == expected
    consumed = {k for pw in packed.values() for k in pw.keys}
    assert consumed <= set(stored) and set(floats) == set(packed) | (set(stored) - consumed)
    for key in packed:
        want = _reference(fmt, key, stored).to(torch.bfloat16)
        assert floats[key].dtype == torch.bfloat16 and torch.equal(floats[key], want), key
    for key in set(floats) - set(packed):
        assert torch.equal(floats[key], stored[key]), key
    # Written once per dims: a second call finds them.
    t = quant / "model.safetensors.index.json"
    before = t.stat().st_mtime_ns
    assert ensure_checkpoints(TINY[fmt], tmp_path) == (quant, twin) and t.stat().st_mtime_ns == before


def test_dims_and_the_summary():
    d = dims("mxfp4", 256)
    assert d["hidden"] % 64 == 0 and d["inter"] == d["hidden"] and d["experts"] == 16
    assert dims("int4", 64)["hidden"] < dims("int4", 256)["hidden"]

    def row(fmt, ckpt, run, wall, read):
        return dict(fmt=fmt, ckpt=ckpt, run=run, wall=wall, read=read, sent=0, plan=0.0, differs=[])

    per_rank = []
    for rank in range(2):
        rows = []
        for run in range(3):
            slow = 1.0 + rank  # rank 1 is the slowest: its walls count
            rows += [row("mxfp4", "bf16", run, slow * (1 + run), 100), row("mxfp4", "mxfp4", run, slow * 1.2, 27)]
            rows += [row("int4", "bf16", run, slow, 100), row("int4", "int4", run, slow * 3, 30)]
        per_rank.append(rows)
    per_rank[0][-1]["differs"] = ["model.layers.0.mlp.experts.gate_up_proj"]
    sizes = {f: {"bf16": 200, f: 60} for f in ("mxfp4", "int4")}
    out = summarize(per_rank, 3, sizes)
    assert out["mxfp4"]["bf16"]["walls"] == [2.0, 4.0, 6.0] and out["mxfp4"]["bf16"]["wall_median"] == 4.0
    assert out["mxfp4"]["wall_ratio"] == pytest.approx(2.4 / 4.0)
    assert out["mxfp4"]["read_ratio"] == pytest.approx(54 / 200)
    assert out["mxfp4"]["mxfp4"]["equal_to_bf16"] and not out["int4"]["int4"]["equal_to_bf16"]
    assert out["int4"]["int4"]["differs"] == ["model.layers.0.mlp.experts.gate_up_proj"]
    for f in ("mxfp4", "int4"):
        out[f]["dims"] = TINY[f]
    text = format_report(out, 2, 3)
    assert "mxfp4 / bf16: wall 0.60x, bytes read 0.27x" in text and "int4 / bf16: wall 3.00x" in text
