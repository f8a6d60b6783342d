"""transformers MoE families at EP=2 with redundant copies, on 2 gloo ranks: parallelize, load,
verify, and moeshard's EP forward gives the one-process model's logits (within 1e-4; fp32).

A subset of tests/family_sweep.py (which runs every family: 48 of 59 match on transformers
5.23), chosen for distinct expert layouts: per-expert on disk with gate/up/down or w1/w2/w3
names, renamed routers, fused on disk, shared experts, hybrid attention/SSM stacks, a
non-persistent buffer rebuilt by the model's own initializer (gemma4_text). A family moeshard's
EP forward does not cover fails loudly in the forward, never with wrong logits, after load and
verify passed (gpt_oss; hy_v4, whose renames transformers looks up by the FSDP-renamed class).
"""

from __future__ import annotations

import pytest

import family_sweep

pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

MATCH = ("qwen3_moe", "mixtral", "deepseek_v4", "dots1", "glm4_moe", "granitemoe", "zaya", "jamba", "phimoe",
         "lfm2_moe", "qwen3_next", "minimax_m2", "hunyuan_v1_moe", "ernie4_5_moe", "gemma4_text", "deepseek_v3")
LOUD = {"gpt_oss": "got mixed torch.Tensor and DTensor", "hy_v4": "got mixed torch.Tensor and DTensor"}


def test_ep2_logits_match_one_process(tmp_path):
    results = family_sweep.sweep((*MATCH, *LOUD), str(tmp_path))
    for family in MATCH:
        r = results[family]
        assert "err" in r, (family, r)
        assert r["err"] <= 1e-4 and r["boxes"] > 0, (family, r)
    for family, message in LOUD.items():
        assert message in results[family].get("error", ""), (family, results[family])
