"""Tier 1: ``moeshard.io.formats``, the one recognizer of MoE layouts on disk, from header-only
checkpoint indexes (no file, no tensor data): Qwen3-MoE, Mixtral, fused experts, DeepSeek-V3
with shared experts and FP8 scales, a dense model, and malformed layouts with the problems
``moeshard inspect`` reports."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from moeshard.io.formats import (
    MAX_LISTED,
    ExpertKey,
    ExpertTensorInfo,
    check,
    layer_of,
    parse_expert_key,
    recognize,
    scale_keys,
    scaled_weight,
)
from moeshard.io.header import TensorInfo
from moeshard.io.index import CheckpointIndex
from moeshard.models.adapters import ExpertParam, expert_params

ITEMSIZE = {"F32": 4, "BF16": 2, "F8_E4M3": 1}


def index_of(entries: dict[str, tuple[str, tuple[int, ...]]], per_file: int = 1000) -> CheckpointIndex:
    """A header-only index: ``{key: (dtype, shape)}`` laid out in order, ``per_file`` tensors a
    file (offsets as a writer would give them)."""
    tensors, sizes = {}, {}
    for i, (key, (dtype, shape)) in enumerate(entries.items()):
        f = f"model-{i // per_file:05d}.safetensors"
        off = sizes.get(f, 8)
        tensors[key] = TensorInfo(f, off, dtype, tuple(shape))
        sizes[f] = off + math.prod(shape) * ITEMSIZE[dtype]
    return CheckpointIndex("<test>", tensors, sizes)


def qwen3_moe(num_layers=2, num_experts=4, hidden=8, inter=4, drop=()) -> dict:
    """Qwen3-MoE's key names; ``drop``: keys containing any of these substrings left out."""
    d = {"model.embed_tokens.weight": ("BF16", (16, hidden))}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        d[f"{p}.self_attn.q_proj.weight"] = ("BF16", (hidden, hidden))
        d[f"{p}.mlp.gate.weight"] = ("BF16", (num_experts, hidden))
        for e in range(num_experts):
            d[f"{p}.mlp.experts.{e}.gate_proj.weight"] = ("BF16", (inter, hidden))
            d[f"{p}.mlp.experts.{e}.up_proj.weight"] = ("BF16", (inter, hidden))
            d[f"{p}.mlp.experts.{e}.down_proj.weight"] = ("BF16", (hidden, inter))
    d["model.norm.weight"] = ("BF16", (hidden,))
    d["lm_head.weight"] = ("BF16", (16, hidden))
    return {k: v for k, v in d.items() if not any(s in k for s in drop)}


def fused_moe(num_layers=2, num_experts=4) -> dict:
    d = {"model.embed_tokens.weight": ("F32", (8, 4))}
    for i in range(num_layers):
        d[f"model.layers.{i}.mlp.experts.gate_up_proj"] = ("F32", (num_experts, 6, 4))
        d[f"model.layers.{i}.mlp.experts.down_proj"] = ("F32", (num_experts, 4, 3))
    return d


def deepseek_v3(num_layers=5, num_dense=2, num_experts=8) -> dict:
    """DeepSeek-V3's FP8 release format at small scale: dense first layers, shared experts, a
    router with e_score_correction_bias, a weight_scale_inv beside every 2-D weight, and the
    multi-token-prediction layer ``num_layers`` (as the release has layer 61)."""
    d = {"model.embed_tokens.weight": ("BF16", (16, 8))}

    def linear(name, shape=(8, 8)):
        d[f"{name}.weight"] = ("F8_E4M3", shape)
        d[f"{name}.weight_scale_inv"] = ("F32", (1, 1))

    for i in range(num_layers + 1):
        p = f"model.layers.{i}"
        linear(f"{p}.self_attn.q_a_proj")
        d[f"{p}.input_layernorm.weight"] = ("BF16", (8,))
        if i < num_dense:
            for n in ("gate_proj", "up_proj", "down_proj"):
                linear(f"{p}.mlp.{n}")
            continue
        d[f"{p}.mlp.gate.weight"] = ("BF16", (num_experts, 8))
        d[f"{p}.mlp.gate.e_score_correction_bias"] = ("F32", (num_experts,))
        for n in ("gate_proj", "up_proj", "down_proj"):
            linear(f"{p}.mlp.shared_experts.{n}")
        for e in range(num_experts):
            linear(f"{p}.mlp.experts.{e}.gate_proj", (4, 8))
            linear(f"{p}.mlp.experts.{e}.up_proj", (4, 8))
            linear(f"{p}.mlp.experts.{e}.down_proj", (8, 4))
    d["lm_head.weight"] = ("BF16", (16, 8))
    return d


def kinds(problems) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in problems:
        out[p.kind] = out.get(p.kind, 0) + 1
    return out


# -- well-formed layouts ----------------------------------------------------------------------


def test_qwen3_moe_per_expert_keys():
    entries = qwen3_moe(num_layers=12, num_experts=4)
    index = index_of(entries, per_file=50)
    fmt = recognize(index.tensors)
    assert [m.module for m in fmt.modules] == [f"model.layers.{i}.mlp.experts" for i in range(12)]  # 10 after 9
    assert [m.layer for m in fmt.modules] == list(range(12))
    m = fmt.modules[3]
    assert not m.fused and not m.mixed and m.experts == (0, 1, 2, 3) and m.scales == {}
    assert [g.name for g in m.tensors] == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    g = m.group("down_proj.weight")
    assert g.experts == (0, 1, 2, 3) and not g.fused and g.scale_of is None
    assert g.infos == tuple(index.info(f"model.layers.3.mlp.experts.{e}.down_proj.weight") for e in range(4))
    assert g.key(m.module, 2) == "model.layers.3.mlp.experts.2.down_proj.weight"
    assert fmt.num_experts == 4
    assert fmt.expert_tensors == (
        ExpertTensorInfo("gate_proj.weight", (4, 8), "BF16", 64, False),
        ExpertTensorInfo("up_proj.weight", (4, 8), "BF16", 64, False),
        ExpertTensorInfo("down_proj.weight", (8, 4), "BF16", 64, False),
    )
    expert_keys = {k for k in entries if ".mlp.experts." in k}
    assert fmt.dense_keys == tuple(k for k in entries if k not in expert_keys)
    assert fmt.expert_bytes == sum(index.info(k).nbytes for k in expert_keys) == 12 * 4 * 3 * 64
    assert check(fmt) == ()


def test_mixtral_w1_w2_w3():
    entries = {}
    for i in range(2):
        entries[f"model.layers.{i}.block_sparse_moe.gate.weight"] = ("BF16", (8, 16))
        for e in range(8):
            entries[f"model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"] = ("BF16", (32, 16))
            entries[f"model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight"] = ("BF16", (16, 32))
            entries[f"model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"] = ("BF16", (32, 16))
    fmt = recognize(index_of(entries).tensors)
    assert [m.module for m in fmt.modules] == [f"model.layers.{i}.block_sparse_moe.experts" for i in range(2)]
    assert [r.name for r in fmt.expert_tensors] == ["w1.weight", "w2.weight", "w3.weight"]
    assert fmt.num_experts == 8 and check(fmt) == ()
    assert fmt.dense_keys == tuple(f"model.layers.{i}.block_sparse_moe.gate.weight" for i in range(2))
    # The model's parameters, as transformers fuses Mixtral's experts (w1 + w3, w2).
    m = fmt.modules[0]
    assert expert_params({g.name: g.infos[0] for g in m.tensors}) == (
        ExpertParam("gate_up_proj", ("{e}.w1.weight", "{e}.w3.weight")),
        ExpertParam("down_proj", ("{e}.w2.weight",)),
    )


def test_fused_gate_up_proj_and_down_proj():
    fmt = recognize(index_of(fused_moe(num_layers=2, num_experts=4)).tensors)
    assert [m.module for m in fmt.modules] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for m in fmt.modules:
        assert m.fused and not m.mixed and m.experts == (0, 1, 2, 3) and m.extent == 4
        assert [(g.name, g.fused, g.experts) for g in m.tensors] == [
            ("gate_up_proj", True, (0, 1, 2, 3)),
            ("down_proj", True, (0, 1, 2, 3)),
        ]
        assert m.group("gate_up_proj", fused=True).key(m.module) == f"{m.module}.gate_up_proj"
    # The expected slices are one expert's: the expert dim left out.
    assert fmt.expert_tensors == (
        ExpertTensorInfo("gate_up_proj", (6, 4), "F32", 96, True),
        ExpertTensorInfo("down_proj", (4, 3), "F32", 48, True),
    )
    assert fmt.num_experts == 4 and fmt.dense_keys == ("model.embed_tokens.weight",)
    assert fmt.expert_bytes == 2 * 4 * (96 + 48)
    assert check(fmt) == ()


def test_deepseek_v3_shared_experts_and_fp8_scales():
    entries = deepseek_v3(num_layers=5, num_dense=2, num_experts=8)
    fmt = recognize(index_of(entries, per_file=64).tensors)
    # Dense layers 0-1 and shared_experts (a dense MLP) are not experts; the MTP layer 5 is.
    assert [m.layer for m in fmt.modules] == [2, 3, 4, 5]
    assert all(".shared_experts." in k for k in fmt.dense_keys if "experts" in k)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in fmt.dense_keys
    m = fmt.modules[0]
    assert m.module == "model.layers.2.mlp.experts" and m.experts == tuple(range(8))
    assert m.scales == {
        "gate_proj.weight": "gate_proj.weight_scale_inv",
        "up_proj.weight": "up_proj.weight_scale_inv",
        "down_proj.weight": "down_proj.weight_scale_inv",
    }
    assert m.group("gate_proj.weight_scale_inv").scale_of == "gate_proj.weight"
    assert m.group("gate_proj.weight").scale_of is None
    refs = {r.name: r for r in fmt.expert_tensors}
    assert refs["gate_proj.weight"] == ExpertTensorInfo("gate_proj.weight", (4, 8), "F8_E4M3", 32, False)
    assert refs["down_proj.weight_scale_inv"] == ExpertTensorInfo("down_proj.weight_scale_inv", (1, 1), "F32", 4, False)
    assert check(fmt) == ()  # FP8 weights beside F32 scales: well-formed
    # The parameters a model has: the scales fused like their weights.
    first = sorted(((g.name, g.infos[0]) for g in m.tensors), key=lambda x: x[1].offset)
    assert [p.name for p in expert_params(dict(first))] == [
        "gate_up_proj",
        "gate_up_proj_weight_scale_inv",
        "down_proj",
        "down_proj_weight_scale_inv",
    ]


def test_dense_model_has_no_layout():
    entries = {
        "model.layers.0.mlp.gate_proj.weight": ("BF16", (4, 4)),
        "model.layers.0.mlp.shared_experts.up_proj.weight": ("BF16", (4, 4)),
        "model.layers.0.mlp.experts.scale": ("F32", ()),
    }  # a scalar holds no experts
    assert recognize(index_of(entries).tensors) is None
    assert recognize({}) is None
    (p,) = check(None)
    assert p.kind == "no_moe" and "<module>.experts.<e>.<name>" in p.message


# -- malformed layouts: the problems moeshard inspect reports --------------------------------


def test_missing_experts_gap_and_short_layer():
    entries = qwen3_moe(
        num_layers=3,
        num_experts=6,
        drop=(
            "layers.1.mlp.experts.2.",
            "layers.1.mlp.experts.3.",
            "layers.2.mlp.experts.4.",
            "layers.2.mlp.experts.5.",
        ),
    )
    fmt = recognize(index_of(entries).tensors)
    assert [m.experts for m in fmt.modules] == [tuple(range(6)), (0, 1, 4, 5), (0, 1, 2, 3)]
    problems = check(fmt)
    assert [(p.kind, p.message) for p in problems] == [
        ("missing_experts", "model.layers.1.mlp.experts: experts 2-3 missing (4 of 6 present)"),
        ("missing_experts", "model.layers.2.mlp.experts: experts 4-5 missing (4 of 6 present)"),
    ]


def test_expert_lacking_a_tensor():
    fmt = recognize(index_of(qwen3_moe(drop=("layers.0.mlp.experts.1.down_proj",))).tensors)
    assert fmt.modules[0].group("down_proj.weight").experts == (0, 2, 3)
    assert [(p.kind, p.message) for p in check(fmt)] == [
        ("missing_expert_tensors", "model.layers.0.mlp.experts: down_proj.weight missing for experts 1")
    ]


def test_mixed_per_expert_and_fused_in_one_layer():
    entries = qwen3_moe(num_layers=2, num_experts=4)
    entries["model.layers.1.mlp.experts.gate_up_proj"] = ("BF16", (4, 8, 8))
    fmt = recognize(index_of(entries).tensors)
    m = fmt.modules[1]
    assert m.mixed and not m.fused and m.experts == (0, 1, 2, 3)
    assert [g.name for g in m.tensors] == ["gate_proj.weight", "up_proj.weight", "down_proj.weight", "gate_up_proj"]
    assert [(p.kind, p.message) for p in check(fmt)] == [
        ("mixed_layout", "model.layers.1.mlp.experts: both per-expert keys and fused tensors (gate_up_proj)")
    ]


def test_fused_short_layer_and_mismatch():
    entries = fused_moe(num_layers=3, num_experts=4)
    entries["model.layers.1.mlp.experts.gate_up_proj"] = ("F32", (3, 6, 4))
    entries["model.layers.1.mlp.experts.down_proj"] = ("F32", (3, 4, 3))
    entries["model.layers.2.mlp.experts.down_proj"] = ("BF16", (4, 4, 3))
    del entries["model.layers.0.mlp.experts.down_proj"]
    problems = check(recognize(index_of(entries).tensors))
    assert [(p.kind, p.message) for p in problems] == [
        ("missing_experts", "model.layers.1.mlp.experts: fused tensors hold 3 experts, other layers 4"),
        ("missing_expert_tensors", "model.layers.0.mlp.experts: fused down_proj missing"),
        ("expert_mismatch", "model.layers.2.mlp.experts.down_proj: [4, 4, 3] BF16, other layers [4, 4, 3] F32"),
    ]


def test_expert_shape_and_dtype_mismatch_listed_by_expert_and_capped():
    entries = qwen3_moe(num_layers=2, num_experts=4)
    entries["model.layers.1.mlp.experts.3.up_proj.weight"] = ("BF16", (5, 8))
    entries["model.layers.0.mlp.experts.2.gate_proj.weight"] = ("F32", (4, 8))
    assert [p.message for p in check(recognize(index_of(entries).tensors))] == [
        "model.layers.0.mlp.experts.2.gate_proj.weight: [4, 8] F32, other experts [4, 8] BF16",
        "model.layers.1.mlp.experts.3.up_proj.weight: [5, 8] BF16, other experts [4, 8] BF16",
    ]
    entries = qwen3_moe(num_layers=1, num_experts=64)
    for e in range(30):  # 30 odd ones out of 64: the other 34 set the expected shape
        entries[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = ("BF16", (8, 2))
    problems = check(recognize(index_of(entries).tensors))
    assert kinds(problems) == {"expert_mismatch": MAX_LISTED + 1}
    assert problems[0].message == (
        "model.layers.0.mlp.experts.0.down_proj.weight: [8, 2] BF16, other experts [8, 4] BF16"
    )
    assert problems[-1].message == f"... and {30 - MAX_LISTED} more expert_mismatch problems"


# -- key grammar and purity -------------------------------------------------------------------


def test_key_grammar():
    assert parse_expert_key("model.layers.3.mlp.experts.17.gate_proj.weight") == ExpertKey(
        "model.layers.3.mlp.experts", 17, "gate_proj.weight"
    )
    assert parse_expert_key("experts.0.w1") == ExpertKey("experts", 0, "w1")
    assert parse_expert_key("model.layers.3.block_sparse_moe.experts.2.w2.weight").module.endswith("moe.experts")
    for key in (
        "model.layers.3.mlp.shared_experts.0.up_proj.weight",
        "model.layers.3.mlp.experts.gate_up_proj",
        "model.layers.3.mlp.gate.weight",
        "model.myexperts.0.w",
    ):
        assert parse_expert_key(key) is None, key
    assert layer_of("model.layers.12.mlp.experts.3.w1.weight") == ("model.layers", 12)
    assert layer_of("layers.0.attn.weight") == ("layers", 0)
    assert layer_of("model.norm.weight") is None and layer_of("model.sublayers.1.w") is None
    assert scaled_weight("mlp.experts.0.gate_proj.weight_scale_inv") == "mlp.experts.0.gate_proj.weight"
    assert scaled_weight("x.weight_scale") == "x.weight" and scaled_weight("x.weight") is None
    assert scale_keys("x.weight") == ("x.weight_scale_inv", "x.weight_scale")


def test_recognizer_does_not_import_torch():
    """formats.py alone (not the package's ``__init__``, which is not this module's to keep
    torch-free) imports no torch and recognizes a layout without it."""
    import moeshard.io.formats as formats

    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('formats', {formats.__file__!r})\n"
        "f = sys.modules['formats'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(f)\n"
        "assert f.recognize({}) is None\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("num_experts", [1, 3])
def test_single_layer_any_expert_count(num_experts):
    fmt = recognize(index_of(qwen3_moe(num_layers=1, num_experts=num_experts)).tensors)
    assert fmt.num_experts == num_experts and check(fmt) == ()


def test_plan_path_refuses_what_it_cannot_load():
    """``moeshard plan`` (find_experts) takes its layout from the recognizer: a dense, fused or
    broken checkpoint is a ValueError naming the checkpoint and the problem."""
    from moeshard.cluster import find_experts

    layout = find_experts(index_of(qwen3_moe(num_layers=3, num_experts=4)), num_hidden_layers=2)
    assert [em.module for em in layout.experts] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert [p.name for p in layout.experts[0].params] == ["gate_up_proj", "down_proj"]
    assert all(layer_of(k)[1] == 2 for k in layout.skipped_keys) and len(layout.skipped_keys) == 2 + 3 * 4
    for entries, message in (
        ({"model.layers.0.mlp.gate_proj.weight": ("BF16", (4, 4))}, "not a MoE checkpoint"),
        (fused_moe(), "model.layers.0.mlp.experts stores its experts fused (down_proj, gate_up_proj; 1 more"),
        (
            qwen3_moe(drop=("layers.1.mlp.experts.3.",)),
            "model.layers.1.mlp.experts: experts 3 missing (3 of 4 present)",
        ),
        (qwen3_moe(drop=("layers.0.mlp.experts.1.down_proj",)), "down_proj.weight missing for experts 1"),
    ):
        with pytest.raises(ValueError, match=f"^checkpoint <test>: .*{re.escape(message)}"):
            find_experts(index_of(entries))
