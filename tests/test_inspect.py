"""Tier 1 (plus one tier-3 model): ``moeshard inspect`` — summary, MoE layout, problems,
bad input, JSON, and that only headers are read."""

from __future__ import annotations

import builtins
import io
import json
import math
import mmap
import os
import re
import struct
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import background
from moeshard import write_checkpoint
from moeshard.cli.inspect import MAX_LISTED, inspect_checkpoint, main

INDEX = "model.safetensors.index.json"
ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


# -- helpers ----------------------------------------------------------------------------------


def moe_tensors(num_layers=2, num_experts=4, hidden=4, inter=3, dtype=torch.float32, skip=()):
    """A small HF-style MoE state dict (per-expert keys); ``skip`` drops keys containing any of
    these substrings."""
    out = {
        "model.embed_tokens.weight": torch.zeros(8, hidden, dtype=dtype),
        "model.norm.weight": torch.ones(hidden, dtype=dtype),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}"
        out[f"{p}.self_attn.q_proj.weight"] = torch.zeros(hidden, hidden, dtype=dtype)
        out[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=dtype)
        out[f"{p}.mlp.gate.weight"] = torch.zeros(num_experts, hidden, dtype=dtype)
        for e in range(num_experts):
            out[f"{p}.mlp.experts.{e}.gate_proj.weight"] = torch.zeros(inter, hidden, dtype=dtype)
            out[f"{p}.mlp.experts.{e}.up_proj.weight"] = torch.zeros(inter, hidden, dtype=dtype)
            out[f"{p}.mlp.experts.{e}.down_proj.weight"] = torch.zeros(hidden, inter, dtype=dtype)
    return {k: v for k, v in out.items() if not any(s in k for s in skip)}


def write(root: Path, tensors: dict, shard_bytes: int = 400) -> Path:
    write_checkpoint(root, tensors.items(), max_shard_bytes=shard_bytes)
    return root


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def kinds(summary) -> Counter:
    return Counter(p.kind for p in summary.problems)


def write_deepseek_like(root: Path, num_layers=61, num_dense=3, num_experts=256, num_files=160, fp8=True) -> int:
    """DeepSeek-V3's key names (MLA attention, first ``num_dense`` layers dense, shared experts,
    gate with e_score_correction_bias; with ``fp8`` every 2-D weight has a ``weight_scale_inv``
    as in the released FP8 checkpoint: 61 layers -> 90,427 keys) with tiny tensors, in layer
    order over ``num_files`` equal files plus an index. Returns the number of keys."""
    wdt = torch.float8_e4m3fn if fp8 else torch.bfloat16

    def linear(d: dict, name: str) -> None:
        d[f"{name}.weight"] = torch.zeros(2, 2, dtype=wdt)
        if fp8:
            d[f"{name}.weight_scale_inv"] = torch.ones(1, dtype=torch.float32)

    def norm(d: dict, name: str) -> None:
        d[f"{name}.weight"] = torch.ones(2, dtype=torch.bfloat16)

    d: dict = {"model.embed_tokens.weight": torch.zeros(4, 2, dtype=torch.bfloat16)}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            linear(d, f"{p}.self_attn.{n}")
        for n in ("self_attn.q_a_layernorm", "self_attn.kv_a_layernorm", "input_layernorm", "post_attention_layernorm"):
            norm(d, f"{p}.{n}")
        if i < num_dense:
            for n in ("gate_proj", "up_proj", "down_proj"):
                linear(d, f"{p}.mlp.{n}")
            continue
        d[f"{p}.mlp.gate.weight"] = torch.zeros(num_experts, 2, dtype=torch.bfloat16)
        d[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(num_experts, dtype=torch.float32)
        for n in ("gate_proj", "up_proj", "down_proj"):
            linear(d, f"{p}.mlp.shared_experts.{n}")
        for e in range(num_experts):
            for n in ("gate_proj", "up_proj", "down_proj"):
                linear(d, f"{p}.mlp.experts.{e}.{n}")
    norm(d, "model.norm")
    d["lm_head.weight"] = torch.zeros(4, 2, dtype=torch.bfloat16)
    # Keys in layer order, cut into equal runs: a layer's experts span several files, as in
    # the released checkpoint.
    keys = list(d)
    per_file = math.ceil(len(keys) / num_files)
    weight_map = {}
    for j in range(num_files):
        name = f"model-{j + 1:05d}-of-{num_files:05d}.safetensors"
        chunk = keys[j * per_file : (j + 1) * per_file]
        save_file({k: d[k] for k in chunk}, str(root / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in chunk})
    (root / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return len(weight_map)


def header_sums(root: Path) -> dict:
    """Counts and bytes over the checkpoint's headers, computed with safetensors' own reader
    (independently of moeshard)."""
    per_dtype, per_file, experts = Counter(), Counter(), Counter()
    expert_layers: dict[str, set[int]] = {}
    num = total = 0
    pattern = re.compile(r"^(.*\.experts)\.(\d+)\.")
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                nbytes = math.prod(sl.get_shape()) * ITEMSIZE[sl.get_dtype()]
                num += 1
                total += nbytes
                per_dtype[sl.get_dtype()] += nbytes
                per_file[path.name] += nbytes
                m = pattern.match(key)
                if m:
                    experts[m[1]] += nbytes
                    expert_layers.setdefault(m[1], set()).add(int(m[2]))
    return dict(
        num=num, total=total, per_dtype=per_dtype, per_file=per_file, experts=experts, expert_layers=expert_layers
    )


# -- a real transformers checkpoint -----------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_ckpt(tmp_path_factory) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    root = tmp_path_factory.mktemp("qwen3") / "ckpt"
    model.save_pretrained(root, max_shard_size="20KB")
    return root


@pytest.mark.hf
def test_transformers_checkpoint_summary_matches_headers(qwen3_ckpt, capsys):
    s = inspect_checkpoint(qwen3_ckpt)
    ref = header_sums(qwen3_ckpt)
    assert s.problems == ()
    assert s.index == INDEX and len(s.files) > 1
    assert s.num_tensors == ref["num"]
    assert s.total_bytes == ref["total"]
    assert {d.dtype: d.nbytes for d in s.dtypes} == dict(ref["per_dtype"])
    assert {f.name: f.nbytes for f in s.files} == dict(ref["per_file"])
    assert all(f.file_size == (qwen3_ckpt / f.name).stat().st_size for f in s.files)
    moe = s.moe
    assert [layer.module for layer in moe.layers] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert set(ref["expert_layers"]) == {layer.module for layer in moe.layers}
    assert all(layer.num_experts == 8 and not layer.fused for layer in moe.layers)
    assert moe.num_experts == 8
    assert {layer.module: layer.nbytes for layer in moe.layers} == dict(ref["experts"])
    # Qwen3-MoE: gate/up [moe_intermediate, hidden], down [hidden, moe_intermediate], bf16.
    assert {(t.name, t.shape, t.dtype, t.nbytes) for t in moe.expert_tensors} == {
        ("gate_proj.weight", (16, 32), "BF16", 1024),
        ("up_proj.weight", (16, 32), "BF16", 1024),
        ("down_proj.weight", (32, 16), "BF16", 1024),
    }
    assert moe.bytes_per_expert == 3072
    assert moe.expert_bytes == sum(ref["experts"].values()) == 2 * 8 * 3072
    assert moe.dense_bytes == ref["total"] - moe.expert_bytes
    rc, out, err = run(capsys, qwen3_ckpt)
    assert rc == 0 and err == ""
    assert "MoE layout: 2 layers x 8 experts" in out and "problems: none" in out


def test_only_headers_are_read(tmp_path, monkeypatch):
    root = write(tmp_path / "ckpt", moe_tensors(num_experts=8, hidden=64, inter=64))
    header_len = {}
    for p in root.glob("*.safetensors"):
        with open(p, "rb") as f:
            header_len[p.name] = 8 + struct.unpack("<Q", f.read(8))[0]
    data_bytes = sum(p.stat().st_size for p in root.glob("*.safetensors")) - sum(header_len.values())
    assert data_bytes > 100_000  # the data is far larger than the headers
    reads: Counter = Counter()
    real_open = builtins.open

    class Counting:
        def __init__(self, f, name):
            self._f, self._name = f, name

        def read(self, n=-1):
            data = self._f.read(n)
            reads[self._name] += len(data)
            return data

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def __getattr__(self, attr):
            return getattr(self._f, attr)

    def counting_open(file, mode="r", *args, **kwargs):
        return Counting(real_open(file, mode, *args, **kwargs), os.path.basename(os.fspath(file)))

    def refuse(*args, **kwargs):
        raise AssertionError("tensor data read")

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    for name in ("read", "pread", "preadv", "readv"):
        monkeypatch.setattr(os, name, refuse)
    monkeypatch.setattr(mmap, "mmap", refuse)
    s = inspect_checkpoint(root)
    assert s.problems == () and s.moe.num_experts == 8
    for name, n in header_len.items():
        assert 0 < reads[name] <= n, name
    assert set(reads) - set(header_len) == {INDEX}


# -- layouts ----------------------------------------------------------------------------------


def test_clean_synthetic_checkpoint_exit_0(tmp_path, capsys):
    ts = moe_tensors(num_layers=3, num_experts=4)
    root = write(tmp_path / "ckpt", ts)
    s = inspect_checkpoint(root)
    assert s.problems == ()
    assert s.num_tensors == len(ts)
    assert s.total_bytes == sum(t.numel() * 4 for t in ts.values())
    assert [layer.module for layer in s.moe.layers] == [f"model.layers.{i}.mlp.experts" for i in range(3)]
    assert s.moe.bytes_per_expert == 3 * 12 * 4
    assert s.moe.expert_bytes == 3 * 4 * 3 * 12 * 4
    rc, out, err = run(capsys, root)
    assert rc == 0 and err == "" and "problems: none" in out
    # The index file and a single .safetensors file are checkpoints too.
    assert inspect_checkpoint(root / INDEX).num_tensors == len(ts)
    single = tmp_path / "single"
    single.mkdir()
    save_file(ts, str(single / "model.safetensors"))
    for path in (single, single / "model.safetensors"):
        s = inspect_checkpoint(path)
        assert s.index is None and s.problems == () and s.num_tensors == len(ts)
        assert s.moe.num_experts == 4


def test_layers_in_numeric_order_and_mixtral_names(tmp_path):
    ts = {}
    for i in range(12):
        for e in range(2):
            for w in ("w1", "w2", "w3"):
                ts[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"] = torch.zeros(2, 2)
    s = inspect_checkpoint(write(tmp_path / "ckpt", ts))
    assert [layer.module for layer in s.moe.layers] == [f"model.layers.{i}.block_sparse_moe.experts" for i in range(12)]
    assert [t.name for t in s.moe.expert_tensors] == ["w1.weight", "w2.weight", "w3.weight"]


def test_fused_experts(tmp_path, capsys):
    ts = {"model.embed_tokens.weight": torch.zeros(8, 4)}
    for i in range(2):
        ts[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.zeros(4, 6, 4)
        ts[f"model.layers.{i}.mlp.experts.down_proj"] = torch.zeros(4, 4, 3)
    s = inspect_checkpoint(write(tmp_path / "ok", ts))
    assert s.problems == ()
    assert all(layer.fused and layer.num_experts == 4 for layer in s.moe.layers)
    assert {(t.name, t.shape, t.fused) for t in s.moe.expert_tensors} == {
        ("gate_up_proj", (6, 4), True),
        ("down_proj", (4, 3), True),
    }
    assert s.moe.bytes_per_expert == (24 + 12) * 4
    assert s.moe.expert_bytes == 2 * 4 * (24 + 12) * 4
    rc, out, _ = run(capsys, tmp_path / "ok")
    assert rc == 0 and "gate_up_proj (fused)" in out
    # One layer with fewer experts.
    ts["model.layers.1.mlp.experts.gate_up_proj"] = torch.zeros(3, 6, 4)
    ts["model.layers.1.mlp.experts.down_proj"] = torch.zeros(3, 4, 3)
    s = inspect_checkpoint(write(tmp_path / "short", ts))
    assert kinds(s) == {"missing_experts": 1}
    assert "model.layers.1.mlp.experts: fused tensors hold 3 experts, other layers 4" in s.problems[0].message


def test_deepseek_like_layout(tmp_path, capsys):
    """DeepSeek naming at small scale: dense first layers and shared_experts are not MoE."""
    n = write_deepseek_like(tmp_path, num_layers=8, num_dense=3, num_experts=16, num_files=12, fp8=False)
    s = inspect_checkpoint(tmp_path)
    assert s.num_tensors == n
    # DeepSeek-V3 keeps the router's e_score_correction_bias in F32 in a BF16 checkpoint: a
    # bias in its own dtype is expected, not a problem.
    assert kinds(s) == {}
    assert [layer.module for layer in s.moe.layers] == [f"model.layers.{i}.mlp.experts" for i in range(3, 8)]
    assert s.moe.num_experts == 16
    rc, out, _ = run(capsys, tmp_path)
    assert rc == 0
    assert "model.layers.{3-7}.mlp.experts: 5 layers x 16 experts" in out


def test_non_moe_checkpoint(tmp_path, capsys):
    root = write(
        tmp_path / "ckpt",
        {
            "model.layers.0.mlp.gate_proj.weight": torch.zeros(2, 2),
            "model.layers.0.mlp.shared_experts.up_proj.weight": torch.zeros(2, 2),
        },
    )
    s = inspect_checkpoint(root)
    assert s.moe is None and kinds(s) == {"no_moe": 1}
    rc, out, err = run(capsys, root)
    assert rc == 1 and err == ""
    assert "MoE layout: no MoE layers found" in out


# -- problems ---------------------------------------------------------------------------------


def test_missing_experts_gap_and_short_layer(tmp_path, capsys):
    ts = moe_tensors(num_layers=3, num_experts=6, skip=("layers.1.mlp.experts.2.", "layers.1.mlp.experts.3."))
    ts = {k: v for k, v in ts.items() if not re.search(r"layers\.2\.mlp\.experts\.[45]\.", k)}
    s = inspect_checkpoint(write(tmp_path / "ckpt", ts))
    assert kinds(s) == {"missing_experts": 2}
    msgs = [p.message for p in s.problems]
    assert "model.layers.1.mlp.experts: experts 2-3 missing (4 of 6 present)" in msgs
    assert "model.layers.2.mlp.experts: experts 4-5 missing (4 of 6 present)" in msgs
    assert [layer.num_experts for layer in s.moe.layers] == [6, 4, 4]
    rc, out, _ = run(capsys, tmp_path / "ckpt")
    assert rc == 1 and "problems (2):" in out


def test_expert_lacking_a_tensor(tmp_path):
    ts = moe_tensors(skip=("layers.0.mlp.experts.1.down_proj",))
    s = inspect_checkpoint(write(tmp_path / "ckpt", ts))
    assert kinds(s) == {"missing_expert_tensors": 1}
    assert s.problems[0].message == "model.layers.0.mlp.experts: down_proj.weight missing for experts 1"


def test_expert_shape_and_dtype_mismatch(tmp_path):
    ts = moe_tensors(num_layers=2, num_experts=4)
    ts["model.layers.1.mlp.experts.3.up_proj.weight"] = torch.zeros(5, 4)
    ts["model.layers.0.mlp.experts.2.gate_proj.weight"] = torch.zeros(3, 4, dtype=torch.float16)
    s = inspect_checkpoint(write(tmp_path / "ckpt", ts))
    assert kinds(s) == {"expert_mismatch": 2, "mixed_dtypes": 1}
    msgs = {p.message for p in s.problems}
    assert "model.layers.1.mlp.experts.3.up_proj.weight: [5, 4] F32, other experts [3, 4] F32" in msgs
    assert "model.layers.0.mlp.experts.2.gate_proj.weight: [3, 4] F16, other experts [3, 4] F32" in msgs


def test_many_mismatches_are_capped(tmp_path):
    ts = moe_tensors(num_layers=1, num_experts=64)
    for e in range(30):  # 30 odd ones out of 64: the other 34 set the expected shape
        ts[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = torch.zeros(4, 2)
    s = inspect_checkpoint(write(tmp_path / "ckpt", ts, shard_bytes=10_000))
    assert kinds(s) == {"expert_mismatch": MAX_LISTED + 1}
    assert (
        s.problems[0].message == "model.layers.0.mlp.experts.0.down_proj.weight: [4, 2] F32, other experts [4, 3] F32"
    )
    assert s.problems[-1].message == f"... and {30 - MAX_LISTED} more expert_mismatch problems"


def test_mixed_floating_dtypes(tmp_path):
    ts = moe_tensors()
    ts["model.norm.weight"] = ts["model.norm.weight"].to(torch.bfloat16)
    ts["model.layers.0.extra_ids"] = torch.zeros(3, dtype=torch.int64)  # integers do not count
    s = inspect_checkpoint(write(tmp_path / "ckpt", ts))
    assert kinds(s) == {"mixed_dtypes": 1}
    assert "F32" in s.problems[0].message and "BF16 (1 tensors, 8 bytes)" in s.problems[0].message
    assert "model.norm.weight" in s.problems[0].message


def _edit_index(root: Path, edit) -> None:
    index = json.loads((root / INDEX).read_text())
    edit(index["weight_map"])
    (root / INDEX).write_text(json.dumps(index))


def test_keys_the_index_does_not_name(tmp_path):
    root = write(tmp_path / "ckpt", moe_tensors())
    _edit_index(root, lambda wm: wm.pop("model.norm.weight"))
    s = inspect_checkpoint(root)
    assert kinds(s) == {"unindexed_keys": 1}
    assert "model.norm.weight" in s.problems[0].message and "does not name" in s.problems[0].message


def test_keys_the_index_names_but_files_lack(tmp_path):
    root = write(tmp_path / "ckpt", moe_tensors())
    first = sorted(root.glob("*.safetensors"))[0].name
    _edit_index(root, lambda wm: wm.__setitem__("model.ghost.weight", first))
    s = inspect_checkpoint(root)
    assert kinds(s) == {"missing_keys": 1}
    assert f"places 1 tensors in {first}, which lacks them: model.ghost.weight" in s.problems[0].message


def test_files_the_index_does_not_name(tmp_path, capsys):
    root = write(tmp_path / "ckpt", moe_tensors())
    save_file({"x": torch.zeros(1)}, str(root / "stray.safetensors"))
    s = inspect_checkpoint(root)
    assert kinds(s) == {"unindexed_files": 1}
    assert s.problems[0].message.startswith("stray.safetensors is in the checkpoint directory")
    rc, out, _ = run(capsys, root)
    assert rc == 1 and "stray.safetensors" in out


def test_files_the_index_names_that_are_missing(tmp_path, capsys):
    ts = moe_tensors()
    root = write(tmp_path / "ckpt", ts)
    files = sorted(root.glob("*.safetensors"))
    gone = files[1]
    with safe_open(str(gone), framework="pt") as f:
        lost = len(list(f.keys()))
    gone.unlink()
    s = inspect_checkpoint(root)
    assert kinds(s)["missing_files"] == 1
    assert s.problems[0].message == f"{INDEX} names {gone.name}, which does not exist ({lost} tensors)"
    # The rest is still summarized.
    assert s.num_tensors == len(ts) - lost and len(s.files) == len(files) - 1
    rc, out, err = run(capsys, root)
    assert rc == 1 and err == "" and "which does not exist" in out


# -- bad input and JSON -----------------------------------------------------------------------


def _bad_inputs(tmp: Path) -> dict[str, Path]:
    out = {"missing": tmp / "nope"}
    empty = tmp / "empty"
    empty.mkdir()
    out["empty dir"] = empty
    (tmp / "notes.txt").write_text("hello, not a checkpoint")
    out["text file"] = tmp / "notes.txt"
    raw = b"{not json" + b" " * 7
    (tmp / "corrupt.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    out["corrupt header"] = tmp / "corrupt.safetensors"
    (tmp / "short.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    out["header past end"] = tmp / "short.safetensors"
    for name, index in (
        ("bad index", "{oops"),
        ("escaping index", json.dumps({"weight_map": {"a": "../x.safetensors"}})),
    ):
        d = tmp / name.replace(" ", "_")
        d.mkdir()
        (d / INDEX).write_text(index)
        out[name] = d
    d = tmp / "corrupt_shard"
    write(d, moe_tensors())
    shard = sorted(d.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1])  # truncated: offsets no longer fit
    out["truncated shard"] = d
    # Hostile headers: the safetensors library refuses each; so does inspect (a summary of
    # them would report "problems: none" for a file that loads wrong weights).
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    for name, raw in (
        ("overlapping offsets", json.dumps({"experts.0.w": entry, "experts.1.w": entry}).encode()),
        ("gap in data", json.dumps({"experts.0.w": {**entry, "data_offsets": [4, 20]}}).encode()),
        ("nested header", b'{"__metadata__": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
        ("huge integer", b'{"experts.0.w": {"dtype": "F32", "shape": [4], "data_offsets": [0, ' + b"9" * 5000 + b"]}}"),
    ):
        f = tmp / (name.replace(" ", "_") + ".safetensors")
        f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 20)
        out[name] = f
    d = tmp / "nested_index"
    write(d, moe_tensors())
    (d / INDEX).write_bytes(b'{"weight_map": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    out["nested index"] = d
    return out


def test_bad_inputs_exit_2_with_one_line(tmp_path, capsys):
    for what, path in _bad_inputs(tmp_path).items():
        rc, out, err = run(capsys, path)
        assert rc == 2, what
        assert out == "", what
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("moeshard inspect: error: "), (what, err)
        assert "Traceback" not in err
        if what in ("overlapping offsets", "gap in data", "nested header", "huge integer", "nested index"):
            assert str(path) in err, (what, err)  # the file is named
    err = run(capsys, tmp_path / "overlapping_offsets.safetensors")[2]
    assert "tensors 'experts.0.w' (data bytes [0, 16)) and 'experts.1.w' ([0, 16)) overlap" in err


@background.job
def maximal_header_inspect(tmp: Path) -> tuple[int, int, int, str, str]:
    """A header of the format's maximum size (100,000,000 bytes, ~1M per-expert tensors over a
    sparse ~8 GiB file) and ``moeshard inspect`` on it in its own process: (number of tensors,
    inspect's exit code, its peak RSS in KiB, its stdout, its stderr)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    f = tmp / "model.safetensors"
    # Written by a child (benchmarks/ is a checkout, not an installed package): seconds of
    # Python that would hold this process's GIL while the job runs beside other tests.
    writer = (
        "import sys\n"
        "from benchmarks.bench_inspect import write_max_header_file\n"
        "print(write_max_header_file(sys.argv[1])[0])\n"
    )
    num_tensors = int(
        subprocess.run(
            [sys.executable, "-c", writer, str(f)], cwd=root, capture_output=True, text=True, check=True
        ).stdout
    )
    # A child's ru_maxrss also counts the memory of the process it was forked from until its
    # exec (Linux keeps the old mm's high-water mark): a small launcher starts `moeshard inspect`
    # so that the figure is inspect's own, not this test process's (which grows over a suite).
    launcher = (
        "import os, subprocess, sys\n"
        "with open(sys.argv[1], 'w') as o, open(sys.argv[2], 'w') as e:\n"
        "    p = subprocess.Popen([sys.executable, '-m', 'moeshard.cli', 'inspect', sys.argv[3]], stdout=o, stderr=e)\n"
        "    _, status, usage = os.wait4(p.pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status), usage.ru_maxrss)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", launcher, str(tmp / "out"), str(tmp / "err"), str(f)],
        capture_output=True,
        text=True,
        check=True,
    )
    code, maxrss_kib = map(int, res.stdout.split())
    return num_tensors, code, maxrss_kib, (tmp / "out").read_text(), (tmp / "err").read_text()


@pytest.mark.background(maximal_header_inspect)
def test_maximal_header_memory():
    """``moeshard inspect`` on a header of the format's maximum size stays well under 1 GiB of
    peak RSS (1.2 GiB before compact TensorInfos and member-by-member parsing)."""
    num_tensors, code, maxrss_kib, out, err = maximal_header_inspect.result()
    assert num_tensors > 900_000
    assert code == 0, err
    assert f"{num_tensors:,} tensors" in out and "problems: none" in out
    assert maxrss_kib * 1024 < 2**30, f"peak RSS {maxrss_kib / 2**10:.0f} MiB"


def test_json_output(tmp_path, capsys):
    ts = moe_tensors(skip=("layers.1.mlp.experts.3.",))
    root = write(tmp_path / "ckpt", ts)
    rc, out, err = run(capsys, "--json", root)
    assert rc == 1 and err == ""
    data = json.loads(out)
    assert data["num_tensors"] == len(ts)
    assert data["moe"]["num_experts"] == 4
    assert [layer["num_experts"] for layer in data["moe"]["layers"]] == [4, 3]
    assert data["problems"] == [
        {"kind": "missing_experts", "message": "model.layers.1.mlp.experts: experts 3 missing (3 of 4 present)"}
    ]
    assert sum(f["nbytes"] for f in data["files"]) == data["total_bytes"]


def test_large_checkpoint_timing(tmp_path):
    """Not a test of speed (no timing is asserted): builds the DeepSeek-V3-sized checkpoint only
    when MOESHARD_INSPECT_BIG=1, prints the time, and checks the counts."""
    if os.environ.get("MOESHARD_INSPECT_BIG") != "1":
        pytest.skip("set MOESHARD_INSPECT_BIG=1 to build the 160-file, ~90,000-tensor checkpoint")
    n = write_deepseek_like(tmp_path)
    t0 = time.perf_counter()
    s = inspect_checkpoint(tmp_path)
    dt = time.perf_counter() - t0
    print(f"\ninspect: {n} tensors in {len(s.files)} files: {dt:.2f} s")
    assert s.num_tensors == n and len(s.files) == 160
    assert len(s.moe.layers) == 58 and s.moe.num_experts == 256
    assert kinds(s) == {}  # FP8 weights, F32 scales, BF16 norms: a quantized checkpoint
