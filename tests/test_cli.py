"""The ``moeshard`` command: dispatch, ``verify`` under a (simulated) torchrun job, bad input.

``moeshard verify`` runs on 4 gloo ranks (2 simulated nodes) against a transformers
checkpoint and a saved placement; its ``--report`` prints every rank's slots with checksums
compared against the checkpoint. Hostile input (overlapping header offsets, JSON nested
50,000 levels, absurd config values) given to ``inspect`` and ``plan`` ends with exit 2 and
one line on stderr naming the file, never a traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct

import numpy as np
import pytest

from mp import run_ranks


def write_tiny(path: str) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path, max_shard_size="20KB")


def verify_worker(argvs: list[list[str]]) -> list:
    from moeshard.cli import verify as verify_cli

    out = []
    for argv in argvs:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = verify_cli.main(argv)
        out.append((rc, stdout.getvalue(), stderr.getvalue()))
    return out


def test_verify_command(tmp_path):
    pytest.importorskip("transformers")
    ckpt = str(tmp_path / "tiny")
    write_tiny(ckpt)
    rng = np.random.default_rng(0)
    placement = np.stack([rng.permutation(np.concatenate([np.arange(8), [1, 2, 3, 4]])) for _ in range(2)])
    np.save(tmp_path / "placement.npy", placement)
    np.save(tmp_path / "wrong.npy", placement[:, :10])
    argvs = [
        [ckpt, "--ep", "4", "--placement", str(tmp_path / "placement.npy"), "--report"],
        [ckpt, "--ep", "2", "--efsdp", "2", "--redundant", "2"],
        [ckpt, "--ep", "4", "--placement", str(tmp_path / "wrong.npy")],
        [str(tmp_path / "nope"), "--ep", "4"],
    ]
    results = run_ranks(verify_worker, argvs, world=4, local_world=2)
    (rc, out, _), (rc2, out2, _), (rc3, _, err3), (rc4, _, err4) = results[0]
    assert rc == 0 and rc2 == 0
    assert "4 ranks (EP=4 x efsdp=1)" in out and "verified against the checkpoint: OK" in out
    assert "EP=2 x efsdp=2" in out2
    # Every slot of every rank listed with its logical expert and a checksum, none wrong.
    for r in range(4):
        line = [ln for ln in out.split(f"rank {r}:")[1].splitlines() if "layer 0" in ln][0]
        want = [f"{3 * r + k}:{placement[0, 3 * r + k]}[" for k in range(3)]
        assert all(w in line for w in want), (line, want)
    assert "WRONG" not in out
    assert rc3 == 2 and "placement file" in err3 and "expected [2, num_physical]" in err3
    assert err3.count("\n") == 1 and "Traceback" not in err3
    assert rc4 == 2 and "does not exist" in err4
    for res in results[1:]:  # every rank exits alike; only rank 0 prints
        assert [r[0] for r in res] == [0, 0, 2, 2]


def test_cli_dispatch_and_bad_input(tmp_path, capsys):
    from moeshard.cli import main

    assert main(["inspect", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["bench"])


def test_bench_reshard_refuses_bad_cache_and_layout():
    from moeshard.cli.bench.reshard import best_and_median, main

    with pytest.raises(ValueError, match="--cache: expected cold, warm or cold,warm, got 'hot'"):
        main(["--cache", "hot"])
    with pytest.raises(ValueError, match="--world 3 must be 2 or more nodes"):
        main(["--world", "3", "--local-world", "2"])
    rows = [dict(seconds=s, read_bytes=i) for i, s in enumerate((0.3, 0.1, 0.2))]
    assert best_and_median(rows) == dict(seconds=0.1, read_bytes=1, median_seconds=0.2, all_seconds=[0.3, 0.1, 0.2])


# -- hostile input: one line, exit 2 ----------------------------------------------------------

NESTED = b"[" * 50_000 + b"]" * 50_000
CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": 8,
    "vocab_size": 13,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 4,
    "num_experts": 4,
    "moe_intermediate_size": 6,
    "intermediate_size": 24,
    "torch_dtype": "bfloat16",
}
CLUSTER = ["--nodes", "1", "--ranks-per-node", "2", "--ep", "2"]


def _one_line_exit_2(capsys, argv: list[str], *expected: str) -> str:
    from moeshard.cli import main

    assert main(argv) == 2, argv
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, (text, err)
    return err


def _moe_checkpoint(root) -> None:
    import torch

    from moeshard import write_checkpoint

    tensors = {"model.embed_tokens.weight": torch.zeros(13, 8)}
    for i in range(2):
        for e in range(4):
            for name, shape in (("gate_proj", (6, 8)), ("up_proj", (6, 8)), ("down_proj", (8, 6))):
                tensors[f"model.layers.{i}.mlp.experts.{e}.{name}.weight"] = torch.full(shape, float(e))
    write_checkpoint(root, tensors.items(), max_shard_bytes=1000)
    (root / "config.json").write_text(json.dumps(CONFIG))


def _overlapping_file(path) -> None:
    """Two experts' keys over the same 16 bytes: a load gave expert 1 expert 0's weights."""
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    raw = json.dumps(
        {"model.layers.0.mlp.experts.0.w1.weight": entry, "model.layers.0.mlp.experts.1.w1.weight": entry}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))


def test_inspect_hostile_headers(tmp_path, capsys):
    f = tmp_path / "overlap.safetensors"
    _overlapping_file(f)
    _one_line_exit_2(capsys, ["inspect", str(f)], str(f), "experts.0.w1.weight", "experts.1.w1.weight", "overlap")
    g = tmp_path / "nested.safetensors"
    raw = b'{"__metadata__": ' + NESTED + b"}"
    g.write_bytes(struct.pack("<Q", len(raw)) + raw)
    _one_line_exit_2(capsys, ["inspect", str(g)], str(g), "nested too deeply")


def test_plan_hostile_checkpoint_and_config(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _moe_checkpoint(ckpt)
    from moeshard.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["plan", str(ckpt), *CLUSTER]) == 0  # the clean checkpoint plans
    capsys.readouterr()
    # config.json beside the checkpoint, nested 50,000 levels
    (ckpt / "config.json").write_bytes(b'{"num_hidden_layers": ' + NESTED + b"}")
    _one_line_exit_2(capsys, ["plan", str(ckpt), *CLUSTER], str(ckpt / "config.json"), "nested too deeply")
    _one_line_exit_2(
        capsys,
        ["plan", "--synthetic-from-config", str(ckpt / "config.json"), *CLUSTER],
        "config.json",
        "nested too deeply",
    )
    # a shard whose keys overlap
    (ckpt / "config.json").write_text(json.dumps(CONFIG))
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    _overlapping_file(shard)
    _one_line_exit_2(capsys, ["plan", str(ckpt), *CLUSTER], shard.name, "overlap")
    # the index, nested
    (ckpt / "model.safetensors.index.json").write_bytes(b'{"weight_map": ' + NESTED + b"}")
    _one_line_exit_2(capsys, ["plan", str(ckpt), *CLUSTER], "model.safetensors.index.json", "nested too deeply")
    _one_line_exit_2(capsys, ["inspect", str(ckpt)], "model.safetensors.index.json", "nested too deeply")


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"num_key_value_heads": 2**64, "head_dim": []}, "num_key_value_heads=18446744073709551616 is not"),
        ({"head_dim": "x"}, "head_dim='x' is not a non-negative integer"),
        ({"mlp_only_layers": 3}, "mlp_only_layers=3 is not a list of integers"),
        ({"num_hidden_layers": 10**9}, "more than 1,000,000 tensors"),  # would plan for hours
        ({"hidden_size": 2**31 - 1, "vocab_size": 2**31 - 1}, "more than 2**48 bytes"),  # int64 byte counts
        ({"num_experts": True}, "num_experts=True is not"),
    ],
)
def test_plan_absurd_config_values(tmp_path, capsys, change, expected):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**CONFIG, **change}))
    _one_line_exit_2(capsys, ["plan", "--synthetic-from-config", str(cfg), *CLUSTER], expected)
    cfg.write_bytes(b'{"hidden_size": ' + b"9" * 5000 + b"}")
    _one_line_exit_2(capsys, ["plan", "--synthetic-from-config", str(cfg), *CLUSTER], str(cfg), "number too long")


def test_verify_reads_config_strictly(tmp_path):
    """``moeshard verify`` builds the model from config.json with transformers, whose own
    json.load would raise a bare RecursionError: the file is parsed strictly first."""
    pytest.importorskip("transformers")
    from moeshard import CheckpointError
    from moeshard.models.build import read_config

    (tmp_path / "config.json").write_bytes(b'{"model_type": ' + NESTED + b"}")
    with pytest.raises(CheckpointError, match=r"config\.json: cannot read a transformers config\.json: JSON nested"):
        read_config(str(tmp_path))
