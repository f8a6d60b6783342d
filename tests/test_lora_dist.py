"""Tier 3: peft LoRA adapters on an EP + FSDP2 Qwen3-MoE and DeepSeek-V3 (moeshard.lora).

For each family of ``tiny_hf.MATRIX`` a tiny fp32 checkpoint (``tiny_hf.save_checkpoint``; for
DeepSeek-V3: MLA, a dense first layer, a shared expert, ``e_score_correction_bias`` buffers) and a
peft adapter with random nonzero A and B on attention projections (``lora.Linear``: Qwen3-MoE's
q_proj / v_proj, DeepSeek-V3's q_b_proj / kv_b_proj) and on the fused expert parameters
(``target_parameters``: ``lora.ParamWrapper``, A ``[r*E, in]`` / B ``[out, r*E]``). On 4 gloo
ranks (EP=4; EP=2 x expert-FSDP=2; contiguous and redundant shuffled placements) the model is
built on meta, wrapped by peft, parallelized, loaded (base + adapter); then

* logits of a fixed batch equal the one-process ``PeftModel.from_pretrained`` logits;
* every loaded LoRA tensor, per logical expert and per copy, equals the adapter file's;
* ``save_adapter`` writes a byte-identical adapter that peft loads;
* two AdamW steps on the LoRA weights give the one-process losses and gradient norms;
* an adapter of another rank r, or with a missing key (strict or not), raises AdapterError on every rank;
* relocate refuses the model (expert LoRA) on every rank, weights and placement unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_hf
from mp import run_ranks
from training import one_process_steps

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.hf

WORLD, SEQ, NUM_LAYERS, NUM_EXPERTS, R, STEPS, LR = 4, 16, tiny_hf.NUM_LAYERS, 8, 4, 2, 1e-2
RTOL = 1e-5
ATTENTION = {"qwen3_moe": ["q_proj", "v_proj"], "deepseek_v3": ["q_b_proj", "kv_b_proj"]}  # MLA's


def _lora_config(family: str, r: int = R):
    return peft.LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=ATTENTION[family],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )


def _data() -> torch.Tensor:
    return torch.randint(0, 128, (WORLD, SEQ), generator=torch.Generator().manual_seed(0))


def _placement(kind: str, ep: int):
    import moeshard

    if kind == "contiguous":
        return moeshard.Placement.contiguous(NUM_LAYERS, NUM_EXPERTS, ep)
    rng = np.random.default_rng(ep)  # 12 slots: every expert once, hot ones twice or more, shuffled
    rows = [
        rng.permutation(np.concatenate([np.arange(NUM_EXPERTS), rng.integers(0, NUM_EXPERTS, 12 - NUM_EXPERTS)]))
        for _ in range(NUM_LAYERS)
    ]
    return moeshard.Placement(np.stack(rows), num_logical=NUM_EXPERTS, num_ranks=ep)


def _physical_to_file(name: str, full: torch.Tensor, pl, layer: int, factor: str) -> list[tuple[int, torch.Tensor]]:
    """(logical expert, its rows of A / columns of B) of every physical slot of a gathered factor."""
    num_physical, spr = pl.num_physical, pl.num_physical // pl.num_ranks
    out = []
    for p in range(num_physical):
        e = int(pl.phy2log[layer, p])
        if factor == "A":
            out.append((e, full[p * R : (p + 1) * R]))
        else:  # global columns (ep rank, r, slot)
            k, s = divmod(p, spr)
            out.append((e, full[:, [k * R * spr + j * spr + s for j in range(R)]]))
    return out


def lora_worker(all_paths: dict, scenarios: list) -> list:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    import moeshard
    import moeshard.lora as mlora

    rank = dist.get_rank()
    ids = _data()[rank : rank + 1]
    meshes, out = {}, []
    for i, (family, ep, efsdp, kind) in enumerate(scenarios):
        paths = all_paths[family]
        file = load_file(f"{paths['adapter']}/adapter_model.safetensors")
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(tiny_hf.config(family))
        model = peft.get_peft_model(model, _lora_config(family))
        if (ep, efsdp) not in meshes:
            meshes[(ep, efsdp)] = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp)
        pl = _placement(kind, ep)
        moeshard.parallelize(model, meshes[(ep, efsdp)], pl)
        # storage "single" (rank 0 reads, sends the rest) in every other scenario: plans with non-readers
        _, report = mlora.load(
            model, paths["base"], paths["adapter"], placement=pl, storage="single" if i % 2 else "auto"
        )
        moeshard.verify(model, paths["base"], placement=pl)
        rec = dict(
            scenario=(ep, efsdp, kind),
            boxes=report.num_boxes,
            all_dtensors=all(isinstance(p, DTensor) for p in model.parameters()),
            # DeepSeek-V3's routers' persistent buffers, loaded on every rank with the base.
            buffers={k.removeprefix("base_model.model."): v for k, v in tiny_hf.persistent_buffers(model).items()},
        )
        with torch.no_grad():
            rec["logits"] = model(input_ids=ids).logits[0].clone()
        # Every LoRA tensor, gathered: per logical expert (every copy) equal to the file's.
        experts = {
            id(t): (layer, f)
            for layer, (m, _) in enumerate(moeshard.models.ep.ep_layers(model))
            for lora in m.moeshard_lora
            for t, f in ((lora.a(), "A"), (lora.b(), "B"))
        }
        bad = []
        for t, p in mlora.adapter_tensors(model, pl):
            full = p.full_tensor().detach()
            want = file[t.key]
            if id(p) in experts:
                layer, f = experts[id(p)]
                for e, got in _physical_to_file(t.name, full, pl, layer, f):
                    ref = want[e * R : (e + 1) * R] if f == "A" else want[:, [j * NUM_EXPERTS + e for j in range(R)]]
                    if e >= 0 and not torch.equal(got, ref):
                        bad.append((t.key, e))
            elif not torch.equal(full, want):
                bad.append((t.key, None))
        rec["bad"] = bad
        rec["num_lora"] = len(file)
        saved = f"{paths['out']}/{i}"
        rec["save"] = mlora.save_adapter(model, saved, placement=pl).num_tensors
        if i == 0:  # bad adapters: every rank gets the same clear error
            errors = []
            for bad_dir in (paths["bad_r"], paths["bad_keys"]):
                try:
                    mlora.load_adapter(model, bad_dir, placement=pl)
                    errors.append(None)
                except ValueError as e:
                    errors.append((type(e).__name__, str(e)))
            try:  # a missing key is an error under strict=False too
                mlora.load_adapter(model, paths["bad_keys"], placement=pl, strict=False)
                errors.append(None)
            except ValueError as e:
                errors.append((type(e).__name__, str(e)))
            rec["errors"] = errors
            # relocate refuses a model with expert LoRA before anything moves
            held = {n: p.to_local().detach().clone() for n, p in model.named_parameters() if ".experts." in n}
            moved = moeshard.Placement(np.roll(pl.phy2log, 1, axis=1), num_logical=NUM_EXPERTS, num_ranks=ep)
            try:
                moeshard.relocate(model, pl, moved)
                rec["relocate_error"] = None
            except Exception as e:  # noqa: BLE001 - the test checks it
                rec["relocate_error"] = (type(e).__name__, str(e))
            rec["relocate_unchanged"] = model.moeshard_placement == pl and all(
                torch.equal(p.to_local(), held[n]) for n, p in model.named_parameters() if n in held
            )
        # Training: AdamW on the LoRA weights (the base is frozen, as peft leaves it).
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        losses, norms = [], []
        for _ in range(STEPS):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            moeshard.sync_redundant_grads(model)
            norms.append(float(moeshard.grad_norm(model)))
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / dist.get_world_size())
        rec.update(losses=losses, norms=norms)
        out.append(rec)
    return out


SCENARIOS = [  # (family, EP, expert FSDP, placement); scenario 0 also tries the bad adapters
    ("qwen3_moe", 4, 1, "contiguous"),
    ("qwen3_moe", 2, 2, "contiguous"),
    ("qwen3_moe", 4, 1, "shuffled"),
    ("qwen3_moe", 2, 2, "shuffled"),
    ("deepseek_v3", 4, 1, "contiguous"),
    ("deepseek_v3", 2, 2, "shuffled"),
]
IDS = [f"{f}-ep{e}-efsdp{d}-{k}" for f, e, d, k in SCENARIOS]


def _reference(paths):
    base = transformers.AutoModelForCausalLM.from_pretrained(paths["base"], dtype=torch.float32)
    buffers = tiny_hf.persistent_buffers(base)
    model = peft.PeftModel.from_pretrained(base, paths["adapter"], is_trainable=True)
    ids = _data()
    with torch.no_grad():
        logits = model(input_ids=ids).logits.clone()
    losses, norms = one_process_steps(model, ids, STEPS, LR)
    return logits, losses, norms, buffers


@pytest.fixture(scope="module")
def lora_results(tmp_path_factory):
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("lora")
    all_paths, refs = {}, {}
    for family in tiny_hf.MATRIX:
        paths = {k: str(root / family / k) for k in ("base", "adapter", "bad_r", "bad_keys", "out")}
        tiny_hf.save_checkpoint(family, paths["base"])
        for key, r in (("adapter", R), ("bad_r", 2)):
            torch.manual_seed(r)
            pm = peft.get_peft_model(
                transformers.AutoModelForCausalLM.from_config(tiny_hf.config(family)), _lora_config(family, r)
            )
            with torch.no_grad():  # peft initializes B to zero: make every factor nonzero
                for n, p in pm.named_parameters():
                    if "lora_" in n:
                        p.copy_(torch.randn_like(p) * 0.2)
            pm.save_pretrained(paths[key])
        shutil.copytree(paths["adapter"], paths["bad_keys"])
        tensors = load_file(f"{paths['bad_keys']}/adapter_model.safetensors")
        tensors.pop("base_model.model.model.layers.1.mlp.experts.lora_B.weight")
        save_file(tensors, f"{paths['bad_keys']}/adapter_model.safetensors", metadata={"format": "pt"})
        all_paths[family], refs[family] = paths, _reference(paths)
    results = run_ranks(lora_worker, all_paths, SCENARIOS, world=WORLD, local_world=2, timeout=400)
    return all_paths, refs, results


def test_adapter_targets_experts_and_attention(lora_results):
    from safetensors.torch import load_file

    all_paths, _, _ = lora_results
    for family, paths in all_paths.items():
        tensors = load_file(f"{paths['adapter']}/adapter_model.safetensors")
        for module in ATTENTION[family]:
            assert f"base_model.model.model.layers.0.self_attn.{module}.lora_A.weight" in tensors
        fused = [k for k in tensors if ".mlp.experts." in k]  # A and B of gate_up_proj and down_proj
        assert len(fused) == 4 * NUM_LAYERS, fused
        assert all(t.abs().max() > 0 for t in tensors.values())  # B randomized, not peft's zeros


@pytest.mark.parametrize("i", range(len(SCENARIOS)), ids=IDS)
def test_logits_and_loaded_tensors_match_peft(lora_results, i):
    _, refs, results = lora_results
    ref_logits, _, _, ref_buffers = refs[SCENARIOS[i][0]]
    if SCENARIOS[i][0] == "deepseek_v3":
        assert len(ref_buffers) == NUM_LAYERS, ref_buffers  # e_score_correction_bias of each MoE layer
    for rank, per_rank in enumerate(results):
        rec = per_rank[i]
        assert rec["all_dtensors"]
        assert rec["boxes"] > 0
        assert rec["buffers"].keys() == ref_buffers.keys()
        for k, want in ref_buffers.items():
            assert torch.equal(rec["buffers"][k], want), (rank, k)
        assert rec["bad"] == [], f"rank {rank}: loaded LoRA tensors differ from the file: {rec['bad'][:4]}"
        torch.testing.assert_close(
            rec["logits"], ref_logits[rank], rtol=RTOL, atol=RTOL * ref_logits.abs().max().item()
        )


@pytest.mark.parametrize("i", range(len(SCENARIOS)), ids=IDS)
def test_save_adapter_round_trip(lora_results, i):
    from safetensors.torch import load_file

    all_paths, refs, results = lora_results
    family = SCENARIOS[i][0]
    paths, ref_logits = all_paths[family], refs[family][0]
    assert results[0][i]["save"] == results[0][i]["num_lora"]
    want = load_file(f"{paths['adapter']}/adapter_model.safetensors")
    got = load_file(f"{paths['out']}/{i}/adapter_model.safetensors")
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    if i == next(j for j, s in enumerate(SCENARIOS) if s[0] == family):  # peft loads what moeshard wrote
        base = transformers.AutoModelForCausalLM.from_pretrained(paths["base"], dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(base, f"{paths['out']}/{i}")
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=_data()).logits, ref_logits, rtol=0, atol=0)


@pytest.mark.parametrize("i", range(len(SCENARIOS)), ids=IDS)
def test_training_matches_peft(lora_results, i):
    _, refs, results = lora_results
    _, ref_losses, ref_norms, _ = refs[SCENARIOS[i][0]]
    assert ref_losses[-1] < ref_losses[0]
    for per_rank in results:
        np.testing.assert_allclose(per_rank[i]["losses"], ref_losses, rtol=RTOL, atol=0)
        np.testing.assert_allclose(per_rank[i]["norms"], ref_norms, rtol=RTOL, atol=0)


def test_bad_adapter_fails_on_every_rank(lora_results):
    _, _, results = lora_results
    for per_rank in results:
        (kind_r, msg_r), (kind_k, msg_k), (kind_lax, msg_lax) = per_rank[0]["errors"]
        assert kind_r == kind_k == kind_lax == "AdapterError"
        assert "layers.1.mlp.experts.lora_B.weight" in msg_lax and "no tensor" in msg_lax, msg_lax
        assert "lora_A.weight" in msg_r and "expects" in msg_r and f"r={R}" in msg_r, msg_r
        assert "layers.1.mlp.experts.lora_B.weight" in msg_k and "no tensor" in msg_k, msg_k
        assert msg_r.count("rank ") >= WORLD  # every rank reports it


def test_relocate_refuses_expert_lora_with_nothing_changed(lora_results):
    _, _, results = lora_results
    for per_rank in results:
        kind, msg = per_rank[0]["relocate_error"]
        assert kind == "DistributedError" and msg.count("carries LoRA adapters") == WORLD, msg
        assert "carries LoRA adapters" in msg and "save_adapter" in msg, msg
        assert per_rank[0]["relocate_unchanged"]
