"""moeshard.save: EP (+ expert FSDP) + FSDP2 model -> Hugging Face checkpoint, on 4 gloo ranks.

Checkpoints are made by transformers' save_pretrained (tiny Qwen3-MoE fp32 / bf16, tied and
untied; Mixtral, whose checkpoints say ``block_sparse_moe`` and w1/w2/w3; LFM2-MoE and PhiMoE,
whose from_pretrained reads w1/w2/w3 too (PhiMoE's router renamed as well); DeepSeek-V3, with a
dense first layer, shared experts and the persistent ``e_score_correction_bias`` buffer). One
spawned group runs every scenario: build on meta -> parallelize -> moeshard.load -> moeshard.save,
with EP=4 and EP=2 x efsdp=2, contiguous and shuffled/redundant placements; then the error cases
(an existing checkpoint, a placement missing an expert, a rename or a write failing on one
rank, the index rename failing). The parent checks every saved directory: the same keys with
the same bytes as the original, a well-formed index, each key in one file, every box written
once, no temporary files, and from_pretrained loading it with no missing or unexpected keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import types

import numpy as np
import pytest
import torch

import hf_families
from mp import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.dist, pytest.mark.hf]

TMP_MARK = ".moeshard-save-"


# -- checkpoints ------------------------------------------------------------------------------


def config(family: str, tied: bool = False):
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    if family == "qwen":
        return Qwen3MoeConfig(
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
            tie_word_embeddings=tied,
        )
    if family == "mixtral":
        return MixtralConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=6,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        )
    if family != "dsv3":  # any other transformers MoE family, at the size tests/hf_families.py gives it
        return hf_families.tiny_config(family)
    return DeepseekV3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=6,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=64,
    )


# name -> (family, tied, dtype, MoE layers, logical experts)
CHECKPOINTS = {
    "qwen-fp32-untied": ("qwen", False, torch.float32, 2, 8),
    "qwen-bf16-tied": ("qwen", True, torch.bfloat16, 2, 8),
    "mixtral-bf16": ("mixtral", False, torch.bfloat16, 2, 6),
    "dsv3-fp32": ("dsv3", False, torch.float32, 2, 6),
    # transformers reads these families' experts as w1/w3/w2 (not gate/up/down_proj); PhiMoE also
    # renames its router (block_sparse_moe.gate <-> mlp.router).
    "lfm2-bf16": ("lfm2_moe", False, torch.bfloat16, 2, 4),
    "phimoe-fp32": ("phimoe", False, torch.float32, 2, 4),
}


def build(name: str, meta: bool):
    family, tied, dtype, _, _ = CHECKPOINTS[name]
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as from_pretrained(dtype=...) builds it
    try:
        if meta:
            with torch.device("meta"):
                return transformers.AutoModelForCausalLM.from_config(config(family, tied))
        return transformers.AutoModelForCausalLM.from_config(config(family, tied))
    finally:
        torch.set_default_dtype(old)


def placement(name: str, ep: int, kind: str, drop: int | None = None):
    """contiguous: slot p = expert p; shuffled: 12 slots (8 for 6 experts on EP=4), every expert
    at least once, some twice or more, in random order. ``drop``: that expert replaced by
    another one (a placement missing an expert)."""
    import moeshard

    _, _, _, layers, experts = CHECKPOINTS[name]
    if kind == "contiguous":
        return moeshard.Placement.contiguous(layers, experts, ep)
    rng = np.random.default_rng(7 * ep + experts)
    physical = 12 if experts == 8 else 8
    rows = [
        rng.permutation(np.concatenate([np.arange(experts), rng.integers(0, experts, physical - experts)]))
        for _ in range(layers)
    ]
    phy2log = np.stack(rows)
    if drop is not None:
        phy2log[phy2log == drop] = (drop + 1) % experts
        if drop == experts - 1:  # a valid Placement that infers num_logical one too small
            return moeshard.Placement(phy2log, num_ranks=ep)
        # Placement itself refuses this one: an engine's own table (duck-typed)
        return types.SimpleNamespace(phy2log=phy2log, num_logical=experts, num_ranks=ep)
    return moeshard.Placement(phy2log, num_logical=experts, num_ranks=ep)


# -- the spawned ranks ----------------------------------------------------------------------------


def listing(path: str) -> dict:
    if not os.path.isdir(path):
        return {}
    return {
        n: (os.stat(os.path.join(path, n)).st_size, os.stat(os.path.join(path, n)).st_mtime_ns)
        for n in sorted(os.listdir(path))
    }


def save_worker(ckpts: dict, out_root: str, scenarios: list) -> list:
    import importlib

    import torch.distributed as dist

    import moeshard

    # The module, even where the package exports a function of the same name (moeshard.save).
    msave = importlib.import_module("moeshard.ops.save")
    rank = dist.get_rank()
    meshes = {}
    results = []
    model = pl = None
    for sc in scenarios:
        kind, name = sc["kind"], sc["ckpt"]
        out = os.path.join(out_root, sc["out"])
        if kind == "unshared" and rank:  # a directory only rank 0 sees (each other rank its own, empty)
            out += f"-rank{rank}"
        if kind in ("save", "overwrite", "meta") or model is None:
            key = (sc["ep"], sc["efsdp"])
            if key not in meshes:
                meshes[key] = moeshard.make_mesh("cpu", ep=sc["ep"], efsdp=sc["efsdp"])
            model = build(name, meta=True)
            pl = placement(name, sc["ep"], sc["placement"])
            moeshard.parallelize(model, meshes[key], pl)
            if kind != "meta":  # "meta": parallelized, never loaded
                moeshard.load(model, ckpts[name], placement=pl)
        use_pl = placement(name, sc["ep"], "shuffled", drop=sc["drop"]) if kind == "missing" else pl
        patched = {}
        if kind == "crash_rename" and rank == 1:
            patched["_replace"] = msave._replace

            def boom(src, dst):
                raise OSError(f"simulated crash renaming {os.path.basename(str(dst))}")

            msave._replace = boom
        if kind == "crash_index" and rank == 0:
            patched["_replace"] = msave._replace
            real = msave._replace

            def boom_index(src, dst):
                if str(dst).endswith("index.json"):
                    raise OSError("simulated crash publishing the index")
                return real(src, dst)

            msave._replace = boom_index
        if kind == "crash_write" and rank == 2:
            patched["write"] = msave.ShardWriter.write

            def fail_write(self, *a):
                raise OSError(28, "No space left on device (simulated)")

            msave.ShardWriter.write = fail_write
        dist.barrier()
        before = listing(out) if rank == 0 else None
        rec = dict(scenario=sc, rank=rank)
        try:
            report = msave.save(
                model,
                out,
                use_pl,
                reference=ckpts[name] if sc.get("reference") else None,
                max_shard_bytes=sc.get("max_shard_bytes", 20_000),
                overwrite=kind == "overwrite",
                staging_bytes=sc.get("staging_bytes", 256 * 2**20),
            )
            rec["report"] = dataclasses.asdict(report)
        except Exception as e:  # noqa: BLE001 - the test checks it
            rec["error"] = (type(e).__name__, isinstance(e, ValueError), str(e))
        finally:
            if "_replace" in patched:
                msave._replace = patched["_replace"]
            if "write" in patched:
                msave.ShardWriter.write = patched["write"]
        dist.barrier()
        if rank == 0:
            rec["before"], rec["after"] = before, listing(out)
        rec["own_after"] = listing(out)
        results.append(rec)
    return results


SCENARIOS = [
    dict(kind="save", ckpt="qwen-fp32-untied", out="q32-ep4", ep=4, efsdp=1, placement="contiguous"),
    dict(
        kind="save",
        ckpt="qwen-fp32-untied",
        out="q32-ep2x2",
        ep=2,
        efsdp=2,
        placement="shuffled",
        reference=True,
        staging_bytes=4096,
    ),
    dict(kind="save", ckpt="qwen-bf16-tied", out="q16-ep4", ep=4, efsdp=1, placement="shuffled", max_shard_bytes=2**30),
    dict(kind="save", ckpt="qwen-bf16-tied", out="q16-ep2x2", ep=2, efsdp=2, placement="contiguous"),
    dict(kind="save", ckpt="mixtral-bf16", out="mixtral-ep2x2", ep=2, efsdp=2, placement="shuffled"),
    dict(kind="save", ckpt="mixtral-bf16", out="mixtral-ref-ep4", ep=4, efsdp=1, placement="shuffled", reference=True),
    dict(kind="save", ckpt="lfm2-bf16", out="lfm2-ep2x2", ep=2, efsdp=2, placement="shuffled"),
    dict(kind="save", ckpt="phimoe-fp32", out="phimoe-ep4", ep=4, efsdp=1, placement="shuffled"),
    dict(kind="save", ckpt="dsv3-fp32", out="dsv3-ep4", ep=4, efsdp=1, placement="shuffled"),
    # Error cases reuse the last model (DeepSeek-V3, EP=4, shuffled).
    dict(kind="exists", ckpt="dsv3-fp32", out="dsv3-ep4"),
    dict(kind="missing", ckpt="dsv3-fp32", out="missing-last", ep=4, drop=5),
    dict(kind="missing", ckpt="dsv3-fp32", out="missing-mid", ep=4, drop=2),
    dict(kind="crash_rename", ckpt="dsv3-fp32", out="crash-rename"),
    dict(kind="crash_write", ckpt="dsv3-fp32", out="crash-write"),
    dict(kind="crash_index", ckpt="dsv3-fp32", out="crash-index"),
    dict(kind="unshared", ckpt="dsv3-fp32", out="unshared"),
    dict(kind="meta", ckpt="dsv3-fp32", out="meta", ep=4, efsdp=1, placement="shuffled"),
    # overwrite: replaces a copy of the bf16 checkpoint (many small files) by a save with bigger
    # shards; the stale shards are removed.
    dict(
        kind="overwrite",
        ckpt="qwen-fp32-untied",
        out="overwritten",
        ep=2,
        efsdp=2,
        placement="shuffled",
        max_shard_bytes=100_000,
    ),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("save")
    ckpts = {}
    for i, name in enumerate(CHECKPOINTS):
        torch.manual_seed(i)
        model = build(name, meta=False)
        with torch.no_grad():  # every element distinct from its init (norms start at ones, biases at zeros)
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
            for n, b in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.add_(torch.randn_like(b))
        path = root / name
        model.save_pretrained(path, max_shard_size="20KB")
        ckpts[name] = str(path)
    out_root = root / "out"
    out_root.mkdir()
    shutil.copytree(ckpts["qwen-bf16-tied"], out_root / "overwritten")
    results = run_ranks(save_worker, ckpts, str(out_root), SCENARIOS, world=4, local_world=2, timeout=240)
    return ckpts, str(out_root), results


# -- checks ---------------------------------------------------------------------------------------


def read_checkpoint(path: str) -> tuple[dict, dict, dict]:
    """(tensors, index, {key: files holding it})"""
    from safetensors import safe_open

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors, holders = {}, {}
    for name in sorted(set(index["weight_map"].values())):
        with safe_open(os.path.join(path, name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
                holders.setdefault(key, []).append(name)
    return tensors, index, holders


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def records(results, i):
    return [per_rank[i] for per_rank in results]


@pytest.mark.parametrize("i", [i for i, s in enumerate(SCENARIOS) if s["kind"] in ("save", "overwrite")])
def test_saved_checkpoint_is_identical(saved, i):
    ckpts, out_root, results = saved
    sc = SCENARIOS[i]
    recs = records(results, i)
    for rec in recs:
        assert "error" not in rec, rec.get("error")
    out = os.path.join(out_root, sc["out"])
    want, want_index, _ = read_checkpoint(ckpts[sc["ckpt"]])
    got, index, holders = read_checkpoint(out)
    # Same keys, same bytes, same dtypes and shapes.
    assert set(got) == set(want), set(got) ^ set(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and got[key].shape == t.shape, key
        assert torch.equal(as_bytes(got[key]), as_bytes(t)), f"{key} differs"
    # A well-formed index: every key in exactly one file, the one the index names; totals.
    assert all(len(v) == 1 and v[0] == index["weight_map"][k] for k, v in holders.items())
    assert set(index["weight_map"]) == set(got)
    assert index["metadata"] == want_index["metadata"]
    files = sorted(set(index["weight_map"].values()))
    num = len(files)
    assert files == [f"model-{k:05d}-of-{num:05d}.safetensors" for k in range(1, num + 1)]
    for name in files:
        assert (
            os.path.getsize(os.path.join(out, name)) <= sc.get("max_shard_bytes", 20_000) + 8192
            or len([k for k, f in index["weight_map"].items() if f == name]) == 1
        )
    # Every box written once: the ranks' bytes add up to the checkpoint; files split among ranks.
    reports = [rec["report"] for rec in recs]
    total = sum(t.numel() * t.element_size() for t in want.values())
    assert sum(r["bytes_written_rank"] for r in reports) == total == reports[0]["total_bytes"]
    assert sorted(f for r in reports for f in r["files"]) == files
    assert all(r["num_files"] == num for r in reports)
    assert sum(r["bytes_sent_rank"] for r in reports) == sum(r["bytes_received_rank"] for r in reports)
    if sc["kind"] == "save" and sc.get("max_shard_bytes", 0) < 2**30:
        assert sum(bool(r["files"]) for r in reports) == 4, "every rank writes files"
    # Nothing else in the directory: no temporary files or stale shards.
    assert sorted(os.listdir(out)) == sorted(
        files + ["config.json", "generation_config.json", "model.safetensors.index.json"]
    )
    if sc["kind"] == "overwrite":
        assert len(recs[0]["before"]) > len(recs[0]["after"])


@pytest.mark.parametrize("i", [i for i, s in enumerate(SCENARIOS) if s["kind"] == "save"])
def test_from_pretrained_reads_it(saved, i):
    ckpts, out_root, _ = saved
    sc = SCENARIOS[i]
    dtype = CHECKPOINTS[sc["ckpt"]][2]
    cls = transformers.AutoModelForCausalLM
    ref = cls.from_pretrained(ckpts[sc["ckpt"]], dtype=dtype)
    model, info = cls.from_pretrained(os.path.join(out_root, sc["out"]), dtype=dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model) is type(ref)
    want = ref.state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    for key, t in want.items():
        assert torch.equal(as_bytes(got[key]), as_bytes(t)), key
    with (
        open(os.path.join(out_root, sc["out"], "config.json")) as f,
        open(os.path.join(ckpts[sc["ckpt"]], "config.json")) as g,
    ):
        assert json.load(f) == json.load(g)


def test_redundant_copies_are_written_by_several_ranks(saved):
    # In the shuffled EP=4 Qwen save, experts with several copies are written by one of them;
    # bytes are spread over the ranks.
    _, _, results = saved
    i = next(i for i, s in enumerate(SCENARIOS) if s["out"] == "q16-ep4")
    plan = records(results, i)[0]["report"]["plan"]
    assert plan["write_bytes_max_rank"] <= 1.5 * plan["write_bytes_min_rank"]


def errors(results, i):
    recs = records(results, i)
    for rec in recs:
        assert "error" in rec, f"rank {rec['rank']} did not raise"
    return [rec["error"] for rec in recs], recs[0]


def test_existing_checkpoint_is_refused_and_unchanged(saved):
    _, _, results = saved
    errs, rec0 = errors(results, SCENARIOS.index(next(s for s in SCENARIOS if s["kind"] == "exists")))
    for _name, is_value_error, msg in errs:
        assert is_value_error and "already holds a checkpoint" in msg and "overwrite=True" in msg
    assert rec0["before"] and rec0["before"] == rec0["after"]


@pytest.mark.parametrize("out", ["missing-last", "missing-mid"])
def test_placement_missing_an_expert(saved, out):
    _, out_root, results = saved
    i = next(i for i, s in enumerate(SCENARIOS) if s["out"] == out)
    errs, rec0 = errors(results, i)
    drop = SCENARIOS[i]["drop"]
    for _name, is_value_error, msg in errs:
        # The model routes by a placement with every expert: one missing an expert differs from
        # it, refused before planning (the planner's own "has no physical slot" check: test_placement).
        assert is_value_error and "moeshard.save: the placement given" in msg, msg
        assert "differs from the one the model routes tokens by" in msg and "MoE layer 0 first differs" in msg, msg
    assert drop is not None
    assert not os.path.exists(os.path.join(out_root, out))


@pytest.mark.parametrize(
    "kind,rank,what",
    [
        ("crash_rename", 1, "simulated crash renaming"),
        ("crash_write", 2, "No space left on device"),
        ("crash_index", 0, "simulated crash publishing the index"),
    ],
)
def test_failure_on_one_rank_leaves_nothing(saved, kind, rank, what):
    _, out_root, results = saved
    i = next(i for i, s in enumerate(SCENARIOS) if s["kind"] == kind)
    errs, rec0 = errors(results, i)
    for name, _is_value_error, msg in errs:
        assert name == "SaveError" and f"rank {rank}:" in msg and what in msg, msg
    # No index, no final-named files, no temporary files: an empty directory.
    assert rec0["after"] == {}, rec0["after"]


@pytest.mark.parametrize(
    "kind,what",
    [
        ("unshared", "is not shared with rank 0"),
        ("meta", "is on the meta device"),
    ],
)
def test_bad_input_is_refused_on_every_rank_and_leaves_nothing(saved, kind, what):
    """save's docstring: a directory some rank cannot see, a model on the meta device: SaveError
    (a ValueError) on every rank, and no file left behind on any rank."""
    _, _, results = saved
    i = next(i for i, s in enumerate(SCENARIOS) if s["kind"] == kind)
    errs, _ = errors(results, i)
    for name, is_value_error, msg in errs:
        assert name == "SaveError" and is_value_error and what in msg, msg
    for rec in records(results, i):
        assert rec["own_after"] == {}, (rec["rank"], rec["own_after"])


# -- single process and pure parts ------------------------------------------------------------------


def test_single_process_plain_model(tmp_path, caplog):
    """Without a process group, a plain model is written like save_pretrained writes it."""
    import logging

    from moeshard.ops.save import save

    torch.manual_seed(0)
    model = build("qwen-bf16-tied", meta=False)
    model.save_pretrained(tmp_path / "ref", max_shard_size="20KB")
    with caplog.at_level(logging.INFO, logger="moeshard"):
        report = save(model, tmp_path / "out", max_shard_bytes=30_000, progress=True)
    assert any(
        "moeshard save" in r.getMessage() and f"bytes_done={report.total_bytes}" in r.getMessage()
        for r in caplog.records
    )
    want, want_index, _ = read_checkpoint(str(tmp_path / "ref"))
    got, index, _ = read_checkpoint(str(tmp_path / "out"))
    assert "lm_head.weight" not in got and set(got) == set(want)
    assert all(torch.equal(as_bytes(got[k]), as_bytes(t)) for k, t in want.items())
    assert index["metadata"] == want_index["metadata"]
    assert report.bytes_written_rank == report.total_bytes == index["metadata"]["total_size"]
    assert report.bytes_sent_rank == 0 and len(report.files) == report.num_files > 1
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        save(model, tmp_path / "out")
    (tmp_path / "out" / f"{TMP_MARK}0123").mkdir()  # left by a crashed save
    (tmp_path / "out" / f"{TMP_MARK}0123" / "model-00001-of-00002.safetensors").write_bytes(b"x")
    save(model, tmp_path / "out", overwrite=True)  # one big file now: the stale shards are gone
    assert sorted(os.listdir(tmp_path / "out")) == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]


def test_failed_overwrite_leaves_no_complete_looking_checkpoint(tmp_path, monkeypatch):
    """save(overwrite=True) removes the old index before the first new file replaces an old
    one: a failure while moving files into place leaves a directory no reader takes for a
    checkpoint (no index), not the old index over a mix of old and new shards."""
    from moeshard.ops import save as msave

    torch.manual_seed(0)
    model = build("qwen-bf16-tied", meta=False)
    out = tmp_path / "out"
    msave.save(model, out, max_shard_bytes=30_000)
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*"))) > 2
    real, calls = msave._replace, []

    def fail_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("simulated crash moving the second file into place")
        return real(src, dst)

    monkeypatch.setattr(msave, "_replace", fail_second)
    with pytest.raises(OSError, match="simulated crash"):
        msave.save(model, out, max_shard_bytes=30_000, overwrite=True)
    assert len(calls) == 2 and not (out / "model.safetensors.index.json").exists()


def test_writer_boxes_any_order(tmp_path):
    """The streaming writer puts boxes cut along any dims, written in any order, in place."""
    from safetensors.torch import load_file

    from moeshard.ops.save import ShardWriter
    from moeshard.plan.save import plan_save
    from moeshard.plan.save_outputs import Output, Segment

    a = torch.arange(5 * 6 * 7, dtype=torch.float32).reshape(5, 6, 7)
    b = torch.arange(3, dtype=torch.bfloat16)
    c = torch.tensor(2.5, dtype=torch.float64)
    outs = [
        Output("a", (5, 6, 7), "F32", [Segment(0, 0, ((0, 5), (0, 6), (0, 7)))]),
        Output("b", (3,), "BF16", [Segment(0, 1, ((0, 3),))]),
        Output("c", (), "F64", [Segment(0, 2, ())]),
    ]
    plan = plan_save(outs, 1, max_shard_bytes=2**20, staging_bytes=2**20)
    w = ShardWriter(tmp_path / plan.files[0].name, plan, 0)
    boxes = [((1, 3), (2, 3), (4, 3)), ((0, 1), (0, 6), (0, 7)), ((4, 1), (0, 6), (0, 7))]
    for x0 in ((1, 3),):
        for x1 in ((0, 2), (2, 3), (5, 1)):
            for x2 in ((0, 4), (4, 3)):
                if not (x1 == (2, 3) and x2 == (4, 3)):
                    boxes.append((x0, x1, x2))
    for box in reversed(boxes):
        w.write(0, box, a[tuple(slice(o, o + n) for o, n in box)].contiguous())
    w.write(1, ((0, 3),), b)
    w.write(2, (), c)
    w.close(fsync=True)
    back = load_file(tmp_path / plan.files[0].name)
    assert torch.equal(back["a"], a) and torch.equal(back["b"], b) and torch.equal(back["c"], c)


def test_plan_balances_and_checks_tiling():
    from moeshard.plan.save import plan_save
    from moeshard.plan.save_outputs import Output, Segment

    # A [64, 8] tensor FSDP-sharded over 4 ranks, and 8 whole tensors each held by two ranks.
    outs = [
        Output("dense", (64, 8), "F32", [Segment(r, 0, ((16 * r, 16), (0, 8)), (), (-16 * r, 0)) for r in range(4)])
    ]
    for e in range(8):
        outs.append(
            Output(
                f"e{e}",
                (16, 8),
                "F32",
                [Segment(r, 1, ((0, 16), (0, 8)), ((e, 1),), (0, 0)) for r in (e % 4, (e + 1) % 4)],
            )
        )
    plan = plan_save(outs, 4, max_shard_bytes=1024, staging_bytes=1024)
    assert plan.cost.write_bytes.sum() == plan.total_bytes == (64 + 8 * 16) * 8 * 4
    # The dense tensor alone is the largest load; the experts fill the other ranks.
    assert plan.cost.write_bytes.max() == 64 * 8 * 4 and plan.cost.write_bytes.min() >= 2 * 16 * 8 * 4
    dense = plan.tensors[0]
    assert plan.cost.recv_bytes[dense.writer] == 48 * 8 * 4 and plan.cost.sent_bytes.sum() == 48 * 8 * 4
    assert all(x.nbytes <= 256 for b in plan.batches for x in b)  # pieces of a quarter of the budget
    assert all(f.data_bytes <= 1024 or len(f.tensors) == 1 for f in plan.files)
    assert plan.fingerprint == plan_save(outs, 4, max_shard_bytes=1024, staging_bytes=1024).fingerprint
    empty = plan_save([Output("z", (0, 4), "F32", [])], 2, 1024, 1024)  # a tensor with no elements
    assert empty.tensors[0].nbytes == 0 and len(empty.files) == 1 and not empty.local_writes[0]
    # A tensor of zeros (nobody holds it: identity experts' rows of an EP model) gets a writer and
    # no pieces; without zeros=True nobody holding it is an error.
    zeros = plan_save(
        [Output("a", (4,), "F32", [Segment(0, 0, ((0, 4),))]), Output("z", (3, 4), "F32", [], zeros=True)],
        2,
        1024,
        1024,
    )
    assert zeros.tensors[1].zeros and zeros.tensors[1].nbytes == 48
    assert sum(len(w) for w in zeros.local_writes) == 1 and not any(zeros.batches)
    with pytest.raises(ValueError, match="no rank holds any of it"):
        plan_save([Output("z", (3, 4), "F32", [])], 2, 1024, 1024)
    gap = [Output("g", (10,), "F32", [Segment(0, 0, ((0, 4),)), Segment(1, 0, ((5, 5),))])]
    with pytest.raises(ValueError, match="gap at offset 4"):
        plan_save(gap, 2, 1024, 1024)
    overlap = [Output("o", (10,), "F32", [Segment(0, 0, ((0, 6),)), Segment(1, 0, ((4, 6),))])]
    with pytest.raises(ValueError, match="overlapping"):
        plan_save(overlap, 2, 1024, 1024)
