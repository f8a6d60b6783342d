"""transformers MoE families at EP=2 with redundant copies, on 2 gloo ranks: parallelize, load,
verify, and moeshard's EP forward gives the one-process model's logits (within 1e-4; fp32).

A subset of tests/family_sweep.py (which runs every family: 55 of 59 match on transformers
5.23; the other 4 are refused on purpose, before any forward), chosen for distinct expert
layouts: per-expert on disk with gate/up/down or w1/w2/w3 names, renamed routers, fused on disk,
shared experts, hybrid attention/SSM stacks, a non-persistent buffer rebuilt by the model's own
initializer (gemma4_text), and the experts forwards moeshard drives through the family's own
code: gpt_oss (interleaved gate/up, biases kept whole per logical expert, clamped activation,
``[E, in, out]``), aria_text (``[E, in, out]``), nemotron_h (ungated ``up_proj``, a spec of its
own) and llama4_text (pre-routed: the router scales the experts' input).
"""

from __future__ import annotations

import numpy as np
import pytest

import family_sweep

pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

MATCH = ("qwen3_moe", "mixtral", "deepseek_v4", "dots1", "glm4_moe", "granitemoe", "zaya", "jamba", "phimoe",
         "lfm2_moe", "qwen3_next", "minimax_m2", "hunyuan_v1_moe", "ernie4_5_moe", "gemma4_text", "deepseek_v3",
         "gpt_oss", "aria_text", "nemotron_h", "llama4_text")
LOUD = {"longcat_flash": "has 4 experts, the placement 6"}  # its identity "zero experts"


def test_ep2_logits_match_one_process(tmp_path):
    results = family_sweep.sweep((*MATCH, *LOUD), str(tmp_path))
    for family in MATCH:
        r = results[family]
        assert "err" in r, (family, r)
        assert r["err"] <= 1e-4 and r["boxes"] > 0, (family, r)
    for family, message in LOUD.items():
        assert message in results[family].get("error", ""), (family, results[family])


def test_experts_kinds():
    """Which EP forward each experts class gets (built on meta, no process group)."""
    import hf_families
    from moeshard.models.ep import PREROUTED, ROUTED, experts_kind

    for family, kind in (("qwen3_moe", ROUTED), ("gpt_oss", ROUTED), ("nemotron_h", ROUTED),
                         ("llama4_text", PREROUTED), ("longcat_flash", None)):
        model = hf_families.build(family, device="meta")
        experts = next(m for n, m in model.named_modules() if n.endswith(".experts"))
        assert experts_kind(experts) == kind, (family, type(experts).__name__)


def test_unsupported_transformers_experts_raise_naming_the_class():
    """A transformers experts module of an unknown kind never runs its own forward on the local
    slots (wrong logits): it raises, naming its class. A custom module keeps its forward."""
    import torch
    from torch import nn

    from moeshard.models.ep import EPLayer, install_ep_forward

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states

    ep = EPLayer(0, np.arange(4), np.arange(4)[:, None], np.ones(4, dtype=int), 2, 0, None, 0.5)
    unknown = type("WeirdExperts", (nn.Module,), {"forward": forward, "__module__": "transformers.models.weird"})()
    assert install_ep_forward(unknown, ep) is False
    with pytest.raises(NotImplementedError, match="transformers.models.weird.WeirdExperts"):
        unknown(torch.zeros(3, 2), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))
    custom = type("MyExperts", (nn.Module,), {"forward": forward, "__module__": "my_model"})()
    assert install_ep_forward(custom, ep) is False
    x = torch.zeros(3, 2)
    assert custom(x, None, None) is x
