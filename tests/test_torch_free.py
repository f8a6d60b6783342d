"""Tier 1: planning needs no torch. ``moeshard plan`` (from a config or a checkpoint's headers,
loads or a rebalance) and the pure packages (``moeshard.plan``, ``moeshard.cluster``, the
need table of ``moeshard.models.layout``, headers in ``moeshard.io``) run without importing
torch, which costs ~270 MB and seconds; ``import moeshard`` still gives the whole API, each
name imported on first use. Every check runs in a fresh interpreter (this one has torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import background

CONFIG = {
    "model_type": "deepseek_v3",
    "hidden_size": 16,
    "vocab_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "q_lora_rank": 8,
    "kv_lora_rank": 8,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 8,
    "intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "torch_dtype": "bfloat16",
}
CLUSTER = ["--nodes", "2", "--ranks-per-node", "4", "--ep", "4", "--efsdp", "2"]

# Run in a child: ``body`` then fail if any torch module was imported.
_CHECK = """
import sys
{body}
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, f"torch was imported: {{loaded[:5]}}"
print("TORCH-FREE")
"""


def _torch_free(body: str) -> str:
    p = subprocess.run([sys.executable, "-c", _CHECK.format(body=body)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "TORCH-FREE" in p.stdout, p.stdout[-2000:] + p.stderr[-4000:]
    return p.stdout


def test_planning_packages_import_without_torch():
    _torch_free(
        "import moeshard, moeshard.plan, moeshard.plan.pieces, moeshard.plan.relocation, moeshard.cluster, "
        "moeshard.cli, moeshard.cli.plan, moeshard.models.layout, moeshard.models.describe, "
        "moeshard.models.shards, moeshard.models.unused, moeshard.io.checkpoint, moeshard.io.index, "
        "moeshard.io.header, moeshard.io.quant, moeshard.io.quant_report, moeshard.io.strict_json, moeshard.io.reader, "
        "moeshard.io.writer, moeshard.io.sources, "
        "moeshard.dtypes, moeshard.placement, moeshard.topology, moeshard.eplb"
    )


def test_plan_command_from_a_config_runs_without_torch(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG))
    loads = tmp_path / "loads.npy"
    np.save(loads, np.random.default_rng(0).random((2, 8)))
    out = _torch_free(f"""
from moeshard.cli import main
assert main(["plan", "--synthetic-from-config", {str(cfg)!r}, *{CLUSTER!r}]) == 0
assert main(["plan", "--synthetic-from-config", {str(cfg)!r}, *{CLUSTER!r}, "--json"]) == 0
assert main(["plan", "--synthetic-from-config", {str(cfg)!r}, *{CLUSTER!r}, "--rebalance", {str(loads)!r}]) == 0
""")
    assert "moeshard shared" in out and "rebalance" in out


def test_plan_command_from_checkpoint_headers_runs_without_torch(tmp_path):
    import torch

    from moeshard import write_checkpoint

    tensors = {"model.embed_tokens.weight": torch.zeros(13, 8, dtype=torch.bfloat16)}
    for i in range(2):
        for e in range(4):
            for name, shape in (("gate_proj", (6, 8)), ("up_proj", (6, 8)), ("down_proj", (8, 6))):
                tensors[f"model.layers.{i}.mlp.experts.{e}.{name}.weight"] = torch.zeros(shape, dtype=torch.bfloat16)
    write_checkpoint(tmp_path, tensors.items(), max_shard_bytes=1000)
    out = _torch_free(f"""
from moeshard.cli import main
assert main(["plan", {str(tmp_path)!r}, "--nodes", "1", "--ranks-per-node", "2", "--ep", "2"]) == 0
""")
    assert "moeshard node" in out


@pytest.mark.parametrize("name", ["load", "Placement", "CheckpointIndex", "lora", "plan_transfers", "Schedule"])
def test_public_names_resolve_on_first_use(name):
    import moeshard

    assert name in moeshard.__all__ and name in dir(moeshard)
    assert getattr(moeshard, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        moeshard.nothing_here  # noqa: B018


@background.job
def every_public_name(tmp: Path) -> subprocess.CompletedProcess:
    """A fresh interpreter resolves every public name (seconds of imports: run beside the
    tests before, tests/background.py)."""
    return subprocess.run(
        [
            sys.executable,
            "-c",
            """
import moeshard
for name in moeshard.__all__:
    assert getattr(moeshard, name) is not None, name
# An eager import bound the API's modules under their subpackages; so does first use.
assert moeshard.io.writer.write_checkpoint is moeshard.write_checkpoint
assert moeshard.ops.save.save is moeshard.save
print("OK")
""",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.background(every_public_name)
def test_every_public_name_resolves_and_subpackages_bind_their_api():
    out = every_public_name.result()
    assert "OK" in out.stdout, out.stderr[-3000:]
