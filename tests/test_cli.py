"""The ``moeshard`` command: dispatch, ``verify`` under a (simulated) torchrun job, bad input.

``moeshard verify`` runs on 4 gloo ranks (2 simulated nodes) against a transformers
checkpoint and a saved placement; its ``--report`` prints every rank's slots with checksums
compared against the checkpoint.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest

from mp import run_ranks

transformers = pytest.importorskip("transformers")


def _write_tiny(path: str) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path, max_shard_size="20KB")


def verify_worker(argvs: list[list[str]]) -> list:
    from moeshard import verify_cli

    out = []
    for argv in argvs:
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = verify_cli.main(argv)
        out.append((rc, stdout.getvalue(), stderr.getvalue()))
    return out


def test_verify_command(tmp_path):
    ckpt = str(tmp_path / "tiny")
    _write_tiny(ckpt)
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
