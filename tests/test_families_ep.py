"""transformers MoE families at EP=2 with redundant copies, on 2 gloo ranks: parallelize, load,
verify, and moeshard's EP forward gives the one-process model's logits (within 1e-4; fp32).

A subset of tests/family_sweep.py (which runs every family: 63 of 68 match on transformers
5.24; the 5 of hf_families.REFUSED are refused on purpose, before any read), chosen for distinct expert
layouts: per-expert on disk with gate/up/down or w1/w2/w3 names, renamed routers, fused on disk,
shared experts, hybrid attention/SSM stacks, a dense tensor split into parts on disk
(kimi_linear's conv1d), a non-persistent buffer rebuilt by the model's own initializer
(gemma4_text), and the experts forwards moeshard drives through the family's own code: gpt_oss
(interleaved gate/up, biases kept whole per logical expert, clamped activation, ``[E, in, out]``),
aria_text (``[E, in, out]``), nemotron_h (ungated ``up_proj``, a spec of its own), llama4_text
(pre-routed: the router scales the experts' input), longcat_flash (identity "zero experts"),
jetmoe (grouped rows), dbrx (experts merged into dim 0, run by the parent module) and doge
(embedding rows as experts). For the last four the backward is checked too, and longcat_flash's
EP save (its identity experts' rows written as zeros).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import family_sweep
import hf_families

pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

MATCH = (
    "qwen3_moe",
    "mixtral",
    "deepseek_v4",
    "dots1",
    "glm4_moe",
    "granitemoe",
    "zaya",
    "jamba",
    "phimoe",
    "lfm2_moe",
    "qwen3_next",
    "minimax_m2",
    "hunyuan_v1_moe",
    "ernie4_5_moe",
    "gemma4_text",
    "deepseek_v3",
    "gpt_oss",
    "aria_text",
    "nemotron_h",
    "llama4_text",
    "longcat_flash",
    "kimi_linear",
    "jetmoe",
    "dbrx",
    "doge",
    # added by transformers 5.24: DeepSeek-V3's model under qwen2_moe's names, an image-text-to-text
    # model (its text tower hy_v4's)
    "sarvam_mla",
    "hy_v4_vl",
)
# Refused on purpose, at planning on every rank, before any read: a converter moeshard cannot
# express as box reads (gate and up rows interleaved; one checkpoint tensor split into several
# model tensors), named with the reason hf_families.REFUSED records.
LOUD = tuple(sorted(hf_families.REFUSED))


def test_ep2_logits_match_one_process(tmp_path):
    match = [f for f in MATCH if hf_families.installed(f)]
    loud = [f for f in LOUD if hf_families.installed(f)]
    results = family_sweep.sweep((*match, *loud), str(tmp_path))
    for family in match:
        r = results[family]
        assert "err" in r, (family, r)
        assert r["err"] <= 1e-4 and r["boxes"] > 0, (family, r)
    for family in loud:
        error = results[family].get("error", "")
        assert "converter moeshard cannot express as box reads" in error, (family, results[family])
        assert hf_families.REFUSED[family] in error, (family, results[family])


def test_experts_kinds():
    """Which EP forward each experts class gets (built on meta, no process group)."""
    import hf_families
    from moeshard.models.ep import GROUPED, LOOKUP, PREROUTED, ROUTED, experts_kind

    for family, kind in (
        ("qwen3_moe", ROUTED),
        ("gpt_oss", ROUTED),
        ("nemotron_h", ROUTED),
        ("llama4_text", PREROUTED),
        ("longcat_flash", ROUTED),
        ("jetmoe", GROUPED),
        ("dbrx", ROUTED),
        ("doge", LOOKUP),
    ):
        model = hf_families.build(family, device="meta")
        experts = next(m for n, m in model.named_modules() if n.endswith((".experts", ".input_linear", ".down_embed")))
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


ROUTERS = {"jetmoe": 4, "doge": 2}  # routers of the tiny models: 2 decoder layers (MoA + MoE each for jetmoe)


def _router_placement(n: int, layers: int, seed: int):
    import moeshard

    rng = np.random.default_rng(seed)
    rows = [rng.permutation(np.concatenate([np.arange(n), rng.integers(0, n, 2)])) for _ in range(layers)]
    return moeshard.Placement(np.stack(rows), num_logical=n, num_ranks=2)


def _save_worker(root: str) -> dict:
    """longcat_flash: load and save at EP=2. jetmoe and doge (several expert tensors per router)
    with a placement of one row per router: parallelize, load, verify, relocate P2P to another
    placement (weights and routing), verify, forward, save; a placement with a row per expert
    tensor refused by parallelize and relocate."""
    import torch

    import hf_families
    import moeshard

    mesh = moeshard.make_mesh("cpu", ep=2, efsdp=1)
    model = hf_families.build("longcat_flash", device="meta")
    ref = torch.load(os.path.join(root, "longcat_flash", "ref.pt"))
    rng = np.random.default_rng(5)
    rows = [rng.permutation(np.concatenate([np.arange(4), rng.integers(0, 4, 2)])) for _ in range(ref["n_layers"])]
    pl = moeshard.Placement(np.stack(rows), num_logical=4, num_ranks=2)
    moeshard.parallelize(model, mesh, pl)
    moeshard.load(model, os.path.join(root, "longcat_flash", "ckpt"), placement=pl)
    moeshard.save(model, os.path.join(root, "saved"), placement=pl, max_shard_bytes=40_000)
    out = {}
    for family in ROUTERS:
        ref = torch.load(os.path.join(root, family, "ref.pt"))
        ckpt = os.path.join(root, family, "ckpt")
        n, layers = ref["n_experts"], ref["n_layers"]
        tensors = sum(
            1
            for name, _ in hf_families.build(family, device="meta").named_parameters()
            if "_linear" in name or "_embed" in name
        )
        per_tensor = _router_placement(n, tensors, 9)
        refused = []
        with pytest.raises(ValueError, match="one row per MoE layer") as e:
            moeshard.parallelize(hf_families.build(family, device="meta"), mesh, per_tensor)
        refused.append(str(e.value))
        model = hf_families.build(family, device="meta")
        old, new = _router_placement(n, layers, 3), _router_placement(n, layers, 4)
        moeshard.parallelize(model, mesh, old)
        moeshard.load(model, ckpt, placement=old)
        checked = moeshard.verify(model, ckpt, placement=old).num_boxes_checked
        with pytest.raises(moeshard.DistributedError, match="one row per MoE layer") as e:  # on every rank
            moeshard.relocate(model, old, per_tensor)
        refused.append(str(e.value))
        moved = moeshard.relocate(model, old, new)  # P2P: no checkpoint
        checked += moeshard.verify(model, ckpt, placement=new).num_boxes_checked
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ref["ids"], use_cache=False).logits
        moeshard.save(model, os.path.join(root, f"{family}_saved"), placement=new)
        placement = moeshard.models.ep.model_placement(model)
        out[family] = dict(
            layers=layers,
            tensors=tensors,
            refused=refused,
            checked=checked,
            sent=moved.bytes_sent_rank,
            routed=placement.phy2log,
            new=new.phy2log,
            names=moeshard.models.ep.ep_layer_names(model),
            err=float((logits - ref["logits"]).abs().max()),
        )
    return out


@pytest.fixture(scope="module")
def ep_saves(tmp_path_factory):
    """One spawn of 2 ranks for the tests below (:func:`_save_worker`)."""
    from mp import run_ranks

    root = tmp_path_factory.mktemp("ep_saves")
    for family in ("longcat_flash", *ROUTERS):
        assert family_sweep.reference(family, str(root)) is None
    return root, run_ranks(_save_worker, str(root), world=2, local_world=2)


def test_longcat_identity_experts_saved_from_ep(ep_saves):
    """longcat_flash at EP=2 with redundant copies: its EP model holds the 4 routed experts only
    (not the gate_up_proj rows of the 2 identity "zero experts", which no forward reads); its save
    writes those rows as zeros, so from_pretrained reads it with no missing or mismatched key,
    every other tensor bit for bit, and the same logits."""
    import torch
    import transformers

    tmp_path, _ = ep_saves
    want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "longcat_flash" / "ckpt", dtype=torch.float32)
    back, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "saved", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    got, ref = back.state_dict(), want.state_dict()
    zero_rows = 0
    for name, t in ref.items():
        if name.endswith("experts.gate_up_proj"):
            assert t.shape[0] == 6 and torch.equal(got[name][:4], t[:4]), name
            assert not got[name][4:].any(), name
            zero_rows += 2
        else:
            assert torch.equal(got[name], t), name
    assert zero_rows == 2 * sum(name.endswith("experts.gate_up_proj") for name in ref) > 0
    ids = torch.load(tmp_path / "longcat_flash" / "ref.pt")["ids"]
    with torch.no_grad():
        assert torch.equal(
            back.eval()(input_ids=ids, use_cache=False).logits, want.eval()(input_ids=ids, use_cache=False).logits
        )


def test_one_placement_row_per_router(ep_saves):
    """jetmoe (a router per mixture of attention heads and per MoE MLP, each driving an
    ``input_linear`` and an ``output_linear``) and doge (a router per block for two embedding
    tables) at EP=2 with a redundant placement of one row per router (what EPLB's per-router
    counts give): load and verify; relocate P2P moves the experts and the routing together (the
    EP forward then gives the one-process logits, and the model routes by the new placement);
    the save round-trips through from_pretrained bit for bit. A placement with one row per
    expert tensor is refused, naming the rule."""
    import torch
    import transformers

    tmp_path, per_rank = ep_saves
    for family, routers in ROUTERS.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family / "ckpt", dtype=torch.float32)
        # The routers, counted apart from moeshard: what a placement built from router counts has.
        gates = [n for n, m in model.named_modules() if n.endswith((".router", ".router_gate"))]
        assert len(gates) == routers
        for r in per_rank:
            got = r[family]
            assert got["layers"] == routers and got["tensors"] == 2 * routers, got
            # Each MoE layer named by the block its router sits in.
            assert [f"{n}.{gates[0].rpartition('.')[2]}" for n in got["names"]] == gates, got["names"]
            parallelize, relocate = got["refused"]
            assert f"the model has {routers} MoE layers, the placement describes {2 * routers}" in parallelize
            assert f"the new placement has {2 * routers} layers, the experts have {routers} MoE layers" in relocate
            assert np.array_equal(got["routed"], got["new"])  # the routing moved with the experts
            assert got["checked"] > 0 and got["err"] <= 1e-4, got
        assert sum(r[family]["sent"] for r in per_rank) > 0  # experts moved between the ranks
        back, info = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / f"{family}_saved", dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        want = model.state_dict()
        assert back.state_dict().keys() == want.keys()
        for name, t in back.state_dict().items():
            assert torch.equal(t, want[name]), (family, name)


GRADS = ("longcat_flash", "jetmoe", "dbrx", "doge")  # identity experts, grouped, held by a child, lookup


def _grads_worker(root: str, families) -> dict:
    import torch
    from torch.distributed.tensor import DTensor

    import hf_families
    import moeshard
    from moeshard.models.describe import expert_layers

    mesh = moeshard.make_mesh("cpu", ep=2, efsdp=1)
    out = {}
    for family in families:
        ref = torch.load(os.path.join(root, family, "ref.pt"))
        model = hf_families.build(family, device="meta")
        rng = np.random.default_rng(3)
        n = ref["n_experts"]
        rows = [rng.permutation(np.concatenate([np.arange(n), rng.integers(0, n, 2)])) for _ in range(ref["n_layers"])]
        pl = moeshard.Placement(np.stack(rows), num_logical=n, num_ranks=2)
        layers = {e.name: e.layer for e in expert_layers(model)}
        moeshard.parallelize(model, mesh, pl)
        moeshard.load(model, os.path.join(root, family, "ckpt"), placement=pl)
        model.train()
        model(input_ids=ref["ids"], labels=ref["ids"], use_cache=False).loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            module = name.rpartition(".")[0]
            layer = layers.get(module)
            grads[name] = (g, None if layer is None else (pl.phy2log[layer].tolist(), pl.log2phy[layer, :, 0].tolist()))
        out[family] = grads
    return out


def test_ep_gradients_match_one_process(tmp_path):
    """The backward of the EP forwards added for these families (every rank runs the whole batch,
    so the data-parallel mean is the one-process gradient): in backward the copies of a redundant
    expert are combined into its first copy, which holds the logical expert's one-process
    gradient, the other copies zero; every other parameter holds its own."""
    import torch
    import transformers

    from mp import run_ranks

    for family in GRADS:
        assert family_sweep.reference(family, str(tmp_path)) is None
    got = run_ranks(_grads_worker, str(tmp_path), GRADS, world=2, local_world=2)[0]
    for family in GRADS:
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family / "ckpt", dtype=torch.float32)
        ids = torch.load(tmp_path / family / "ref.pt")["ids"]
        model.train()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        checked = 0
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            g, layout = got[family][name]
            want = p.grad
            if layout is not None:
                phy2log, first = layout
                want = want.reshape(-1, *g.shape[1:])[torch.as_tensor(phy2log)].clone()
                want[torch.as_tensor([first[e] != s for s, e in enumerate(phy2log)])] = 0
            assert torch.allclose(g, want, rtol=1e-4, atol=1e-7), (family, name, float((g - want).abs().max()))
            checked += layout is not None
        assert checked, family
