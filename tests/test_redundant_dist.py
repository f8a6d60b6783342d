"""Tier 3, redundant expert copies in a STOCK training loop (no moeshard call in the loop).

A tiny fp32 Qwen3-MoE (and in two scenarios a DeepSeek-V3: a dense first layer, a shared expert,
grouped routing) written by ``save_pretrained`` is built on meta on 4 gloo ranks,
parallelized with a redundant, shuffled placement (8 logical experts in 12 slots: every expert
once plus 4 extra copies, permuted per layer) and loaded by moeshard. Then the loop a stock
Trainer runs, nothing else: forward, ``loss.backward()`` (two micro-batches of gradient
accumulation in some scenarios, each loss divided by 2 as the Trainer does), clipping over
``model.parameters()`` with a ``max_norm`` small enough that every step clips, AdamW
``step()``, ``zero_grad()``; 4 steps. No ``moeshard.sync_redundant_grads``, no moeshard
clipping: the EP forward sums the copies' gradients into the first copy in backward, and an
optimizer step hook copies the first copy over the others (:mod:`moeshard.models.copies`).

Compared with one process (``from_pretrained``, the whole global batch, torch's
``clip_grad_norm_``, AdamW): every step's loss and pre-clip gradient norm within 1e-6
relative; after the steps every copy of every expert equal (bit for bit) to its other copies
and equal to the one-process model's expert within ``WEIGHT_ATOL`` (see there); the AdamW
moments of every copy equal too. The old explicit path (``sync_redundant_grads`` +
``moeshard.clip_grad_norm_``) must match the same reference.

Clipping runs three ways: a norm per mesh combined (torch's public ``get_total_norm`` and
``clip_grads_with_norm_``, what the transformers Trainer's mixed-mesh path does), accelerate's
``Accelerator.clip_grad_norm_`` (its DTensor-aware path, the same algorithm, which a CPU
job, seen by accelerate as multi-CPU DDP, also reaches), and moeshard's. torch's own
``clip_grad_norm_(model.parameters())`` over the mixed meshes (dense parameters on FSDP's "dp"
mesh, experts on "ep" / "efsdp" x "ep") is tried too and what it does is checked
(``test_torch_clip_over_mixed_meshes``).

``test_stock_trainer_matches_one_process`` runs the real ``transformers.Trainer`` (AdamW,
constant lr, ``max_grad_norm``, two micro-batches; once with gradient checkpointing) on EP=4
and EP=2 x efsdp=2 with the same placement: its logged losses and grad norms within 1e-6
relative of one process, copies equal, experts within ``WEIGHT_ATOL``. The one shim is
accelerate's CPU quirk (see :func:`trainer_worker`).

``test_experts_gradients_per_slot`` calls one experts module directly with routing chosen so
that EP rank 0 has no tokens and receives no rows while holding first copies of experts whose
other copies, on the other ranks, see tokens: every slot's gradient must be the one-process
gradient of its logical expert (first copy; divided by the world size, the data-parallel mean)
or zero (other copies), and nothing may hang.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tiny_hf
from mp import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

STEPS, LR, WORLD, SEQ, ACC = 4, 1e-3, 4, 16, 2
MAX_NORM = 0.05  # the reference's pre-clip norms are ~1-3: every step clips
RTOL = 1e-6
NUM_LAYERS, NUM_EXPERTS, NUM_PHYSICAL = 2, 8, 12
# AdamW moves a weight by at most ~LR per step (m / sqrt(v) <= ~1); after 4 steps the
# distributed and one-process weights differ by rounding of those updates, where a gradient
# of rounding size (an element few tokens touch) can flip the sign of m / sqrt(v): bounded by
# 2 * LR * STEPS = 8e-3 in the worst case. Measured max difference: see the test (~1e-7);
# 1e-5 (1% of one step's largest update) fails on any wrong step, e.g. a copy's gradient lost.
WEIGHT_ATOL = 1e-5

# (name, family, EP, expert FSDP, gradient accumulation micro-batches, clipping)
SCENARIOS = [
    ("ep4-per-mesh", "qwen3_moe", 4, 1, 1, "per-mesh"),
    ("ep4-accelerate-acc2", "qwen3_moe", 4, 1, 2, "accelerate"),
    ("ep2-efsdp2-accelerate-acc2", "qwen3_moe", 2, 2, 2, "accelerate"),
    ("ep2-efsdp2-per-mesh", "qwen3_moe", 2, 2, 1, "per-mesh"),
    ("ep2-efsdp2-moeshard-explicit", "qwen3_moe", 2, 2, 1, "explicit"),
    ("ep4-moeshard-explicit-acc2", "qwen3_moe", 4, 1, 2, "explicit"),
    # DeepSeek-V3 (a dense first layer, a shared expert, grouped routing with its
    # e_score_correction_bias): the same stock loop.
    ("deepseek_v3-ep4-per-mesh", "deepseek_v3", 4, 1, 1, "per-mesh"),
    ("deepseek_v3-ep2-efsdp2-accelerate-acc2", "deepseek_v3", 2, 2, 2, "accelerate"),
]


def _config(family: str = "qwen3_moe"):
    return tiny_hf.config(family)


def _data(acc: int) -> torch.Tensor:
    """``[acc * WORLD, SEQ]``: micro-batch ``m`` of rank ``r`` is row ``m * WORLD + r``."""
    return torch.randint(0, 128, (acc * WORLD, SEQ), generator=torch.Generator().manual_seed(0))


def _placement(ep: int):
    from tiny_moe import shuffled_placement

    return shuffled_placement(NUM_LAYERS, NUM_EXPERTS, ep, NUM_PHYSICAL, seed=3)


def _accelerate_clip(params, max_norm):
    """accelerate's ``Accelerator.clip_grad_norm_`` as the Trainer reaches it on these meshes:
    the DTensor-aware path (FSDP2, and the fallthrough that CPU / DDP takes)."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    return acc.clip_grad_norm_(params, max_norm)


def _torch_clip_probe(model) -> dict:
    """What ``torch.nn.utils.clip_grad_norm_`` does over the model's mixed meshes, on copies of
    the gradients (the model's are left as they are)."""
    from torch.distributed.tensor import DTensor

    saved = [(p, p.grad.clone()) for p in model.parameters() if p.grad is not None]
    meshes = {str(p.grad.device_mesh.mesh_dim_names) for p, _ in saved if isinstance(p.grad, DTensor)}
    try:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        out = dict(ok=True, norm=float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        out = dict(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    for p, g in saved:
        p.grad = g
    out["meshes"] = sorted(meshes)
    return out


def stock_worker(ckpts: dict, scenarios: list) -> list:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import moeshard

    rank = dist.get_rank()
    meshes, out = {}, []
    for _name, family, ep, efsdp, acc, clip in scenarios:
        ids = _data(acc)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(_config(family))
        if (ep, efsdp) not in meshes:
            meshes[(ep, efsdp)] = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp)
        pl = _placement(ep)
        moeshard.parallelize(model, meshes[(ep, efsdp)], pl)
        moeshard.load(model, ckpts[family], placement=pl)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, norms, probe = [], [], None
        for step in range(STEPS):
            total = torch.zeros(())
            for m in range(acc):
                row = ids[m * WORLD + rank : m * WORLD + rank + 1]
                loss = model(input_ids=row, labels=row).loss / acc
                loss.backward()
                total += loss.detach()
            if step == 0 and clip == "per-mesh":
                probe = _torch_clip_probe(model)
            if clip == "per-mesh":
                norm = _per_mesh_clip(model, MAX_NORM)
            elif clip == "accelerate":
                norm = _accelerate_clip(model.parameters(), MAX_NORM)
            else:
                assert moeshard.sync_redundant_grads(model) == NUM_LAYERS
                norm = moeshard.clip_grad_norm_(model, MAX_NORM)
            norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
            opt.step()
            opt.zero_grad()
            dist.all_reduce(total)
            losses.append(float(total) / WORLD)
        out.append(dict(losses=losses, norms=norms, probe=probe, experts=_experts(model, opt), phy2log=pl.phy2log))
    return out


def _experts(model, opt) -> dict:
    """Every slot's expert, gathered (kept on rank 0, for the reference to judge), and whether
    every copy of each expert equals its first copy bit for bit, weights and AdamW moments."""
    import torch.distributed as dist

    from moeshard.models.ep import ep_layers

    experts = {}
    for layer, (module, lay) in enumerate(ep_layers(model)):
        for pname in ("gate_up_proj", "down_proj"):
            p = getattr(module, pname)
            full = p.full_tensor().detach()
            st = opt.state[p]
            moments = [st[k].full_tensor() for k in ("exp_avg", "exp_avg_sq")]
            copies_equal = all(
                torch.equal(t[s], t[int(lay.log2phy[e, 0])])
                for t in (full, *moments)
                for s, e in enumerate(lay.phy2log.tolist())
                if e >= 0
            )
            experts[(layer, pname)] = dict(full=full if dist.get_rank() == 0 else None, copies_equal=copies_equal)
    return experts


def _per_mesh_clip(model, max_norm):
    """The per-mesh norm (what accelerate and the Trainer do when gradients live on several
    meshes), written with torch's public functions only."""
    from torch.distributed.tensor import DTensor

    groups = {}
    for p in model.parameters():
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in ps]) for ps in groups.values()]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    for ps in groups.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def _reference(ckpt: str, acc: int, weight_decay: float = 0.01, family: str = "qwen3_moe"):
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    ids = _data(acc)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=weight_decay)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    experts = {}
    for layer, block in enumerate(tiny_hf.moe_blocks(family)):
        for pname in ("gate_up_proj", "down_proj"):
            experts[(layer, pname)] = getattr(model.model.layers[block].mlp.experts, pname).detach().clone()
    return losses, norms, experts


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("redundant")
    out = {}
    for family in tiny_hf.MATRIX:  # distinct values everywhere (norms start at ones, biases at zero)
        out[family] = str(root / family)
        tiny_hf.save_checkpoint(family, out[family])
    return out


@pytest.fixture(scope="module")
def ckpt(ckpts):
    return ckpts["qwen3_moe"]


@pytest.fixture(scope="module")
def stock(ckpts):
    refs = {
        (family, acc): _reference(ckpts[family], acc, family=family)
        for family, acc in sorted({(s[1], s[4]) for s in SCENARIOS})
    }
    results = run_ranks(stock_worker, ckpts, SCENARIOS, world=WORLD, local_world=2, timeout=360)
    return refs, results


@pytest.mark.parametrize("i", range(len(SCENARIOS)), ids=[s[0] for s in SCENARIOS])
def test_stock_loop_matches_one_process(stock, i):
    refs, results = stock
    name, family, ep, efsdp, acc, clip = SCENARIOS[i]
    ref_losses, ref_norms, ref_experts = refs[family, acc]
    assert ref_losses[-1] < ref_losses[0], "the reference must actually train"
    assert min(ref_norms) > 2 * MAX_NORM, "every step must clip"
    for rank, rank_results in enumerate(results):
        got = rank_results[i]
        np.testing.assert_allclose(got["losses"], ref_losses, rtol=RTOL, atol=0, err_msg=f"{name} rank {rank} losses")
        np.testing.assert_allclose(got["norms"], ref_norms, rtol=RTOL, atol=0, err_msg=f"{name} rank {rank} norms")
        for key, rec in got["experts"].items():
            assert rec["copies_equal"], (
                f"{name} rank {rank} {key}: copies of an expert (weights or AdamW moments) differ"
            )
    worst = _worst_expert(results[0][i], ref_experts)
    assert worst < WEIGHT_ATOL, f"{name}: experts differ from the one-process model's by {worst:.3g}"
    rel = max(
        max(abs(g - w) / w for g, w in zip(r[i][k], ref))
        for r in results
        for k, ref in (("losses", ref_losses), ("norms", ref_norms))
    )
    print(f"{name}: max |expert - one process| = {worst:.3g}, losses/norms max relative {rel:.3g}")


def _worst_expert(got: dict, ref_experts: dict) -> float:
    """Largest |slot's expert - one-process expert| over every slot of every layer."""
    worst = 0.0
    for (layer, pname), rec in got["experts"].items():
        want = ref_experts[(layer, pname)][torch.as_tensor(got["phy2log"][layer])]  # [num_physical, ...] slot order
        worst = max(worst, float((rec["full"] - want).abs().max()))
    return worst


def test_torch_clip_over_mixed_meshes(stock):
    """torch.nn.utils.clip_grad_norm_ over dense ("dp") and expert ("ep", "efsdp" x "ep")
    DTensor gradients: recorded per mesh layout. Where it runs, its norm is the one-process
    norm; where it raises, the error is torch's (DTensor refuses an op across meshes), which
    is why accelerate and the Trainer take a norm per mesh and combine them."""
    refs, results = stock
    for i, (name, family, _ep, _efsdp, acc, clip) in enumerate(SCENARIOS):
        if clip != "per-mesh":
            continue
        probe = results[0][i]["probe"]
        assert len(probe["meshes"]) >= 2, probe  # the gradients do live on several meshes
        if probe["ok"]:
            np.testing.assert_allclose(probe["norm"], refs[family, acc][1][0], rtol=RTOL)
        else:
            assert "mesh" in probe["error"].lower(), probe
        print(f"{name}: torch.nn.utils.clip_grad_norm_: {probe}")


EXPERT_SCENARIOS = [(4, 1), (2, 2)]  # (EP, expert FSDP)


def _routing(pl, ep: int, ep_rank: int, global_rank: int, layer: int = 0):
    """This rank's tokens for experts module ``layer``: none on EP rank 0; elsewhere 6 tokens
    routed (top-2) only to experts with a copy on this EP rank or none on EP rank 0, so EP
    rank 0 receives no rows (a local copy is always preferred)."""
    g = torch.Generator().manual_seed(100 + global_rank)
    spr = pl.num_physical // ep
    on = [set(pl.phy2log[layer, r * spr : (r + 1) * spr].tolist()) for r in range(ep)]
    allowed = [e for e in range(NUM_EXPERTS) if e in on[ep_rank] or e not in on[0]]
    T = 0 if ep_rank == 0 else 6
    hidden = torch.randn(T, 32, generator=g)
    pick = (
        torch.stack([torch.randperm(len(allowed), generator=g)[:2] for _ in range(T)])
        if T
        else torch.zeros(0, 2, dtype=torch.long)
    )
    index = torch.as_tensor(allowed)[pick]
    weights = torch.rand(T, 2, generator=g)
    cotangent = torch.randn(T, 32, generator=g)
    return hidden, index, weights, cotangent


def experts_worker(ckpt: str, scenarios: list) -> list:
    import torch.distributed as dist

    import moeshard
    from moeshard.models.ep import ep_layers

    rank, out = dist.get_rank(), []
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    ref = ref_model.model.layers[0].mlp.experts
    for ep, efsdp in scenarios:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(_config())
        mesh = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp)
        pl = _placement(ep)
        moeshard.parallelize(model, mesh, pl)
        moeshard.load(model, ckpt, placement=pl)
        module, lay = ep_layers(model)[0]
        hidden, index, weights, cot = _routing(pl, ep, lay.ep_rank, rank)
        (module(hidden.requires_grad_(), index, weights) * cot).sum().backward()
        # One process: every rank's tokens through the reference experts module.
        ref.zero_grad()
        for r in range(WORLD):
            h, i, w, c = _routing(pl, ep, r % ep, r)
            (ref(h, i, w) * c).sum().backward()
        errors = {}
        for pname in ("gate_up_proj", "down_proj"):
            got = getattr(module, pname).grad.full_tensor()
            want = getattr(ref, pname).grad[torch.as_tensor(pl.phy2log[0])] / WORLD
            first = torch.as_tensor(pl.log2phy[0][pl.phy2log[0], 0] == np.arange(pl.num_physical))
            want[~first] = 0
            errors[pname] = float((got - want).abs().max() / want.abs().max())
        # The routing did what it says: EP rank 0 had no tokens, some copy of an expert whose
        # first copy is on EP rank 0 saw tokens elsewhere.
        spr = pl.num_physical // ep
        firsts_on_0 = {e for e in range(NUM_EXPERTS) if pl.log2phy[0, e, 0] < spr}
        used = {e for r in range(WORLD) for e in _routing(pl, ep, r % ep, r)[1].flatten().tolist()}
        out.append(dict(errors=errors, remote_sum=bool(firsts_on_0 & used)))
    return out


@pytest.fixture(scope="module")
def per_slot(ckpt):
    return run_ranks(experts_worker, ckpt, EXPERT_SCENARIOS, world=WORLD, local_world=2, timeout=200)


@pytest.mark.parametrize("i", range(len(EXPERT_SCENARIOS)), ids=[f"ep{e}-efsdp{d}" for e, d in EXPERT_SCENARIOS])
def test_experts_gradients_per_slot(per_slot, i):
    for rank, rank_results in enumerate(per_slot):
        got = rank_results[i]
        assert got["remote_sum"], "the routing must send some copy's gradient to EP rank 0"
        for pname, err in got["errors"].items():
            assert err < RTOL, f"rank {rank} {pname}: per-slot gradient off by {err:.3g} (relative to its max)"


# (EP, expert FSDP, gradient checkpointing); 2 micro-batches, max_grad_norm on
TRAINER_SCENARIOS = [(4, 1, False), (2, 2, False), (2, 2, True)]


class _Rows(torch.utils.data.IterableDataset):
    """The ``ACC * WORLD`` rows of :func:`_data` in order, once per step: accelerate gives
    process ``r`` item ``r`` of each global batch of ``WORLD``, so micro-batch ``m`` of rank
    ``r`` is row ``m * WORLD + r``, as in :func:`stock_worker`."""

    def __iter__(self):
        rows = _data(ACC)
        for k in range(STEPS * ACC * WORLD):
            yield {"input_ids": rows[k % len(rows)], "labels": rows[k % len(rows)]}


def trainer_worker(ckpt: str, scenarios: list, out_dir: str) -> list:
    """The stock ``transformers.Trainer`` (AdamW, constant lr, ``max_grad_norm``, two
    micro-batches) on the parallelized model. The one shim is accelerate's CPU quirk: on CPU
    it ignores an FSDP plugin and wraps the model in DDP, which cannot hold DTensors; its FSDP2
    prepare passes a model whose root is already an FSDPModule through untouched, and so does
    ``prepare_model`` here."""
    import accelerate

    import moeshard

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        self._models.append(model)
        return model

    accelerate.Accelerator.prepare_model = prepare_model
    out = []
    meshes = {}
    for ep, efsdp, checkpointing in scenarios:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(_config())
        pl = _placement(ep)
        if (ep, efsdp) not in meshes:
            meshes[(ep, efsdp)] = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp)
        moeshard.parallelize(model, meshes[(ep, efsdp)], pl)
        moeshard.load(model, ckpt, placement=pl)
        args = transformers.TrainingArguments(
            output_dir=f"{out_dir}/ep{ep}-efsdp{efsdp}-{checkpointing}",
            gradient_checkpointing=checkpointing,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=ACC,
            max_steps=STEPS,
            learning_rate=LR,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=MAX_NORM,
            optim="adamw_torch",
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows())
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
        opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        out.append(
            dict(
                losses=[h["loss"] for h in logs],
                norms=[h["grad_norm"] for h in logs],
                experts=_experts(model, opt),
                phy2log=pl.phy2log,
            )
        )
    return out


@pytest.fixture(scope="module")
def trainer_runs(ckpt, tmp_path_factory):
    pytest.importorskip("accelerate")
    out_dir = str(tmp_path_factory.mktemp("trainer"))
    ref = _reference(ckpt, ACC, weight_decay=0.0)
    return ref, run_ranks(trainer_worker, ckpt, TRAINER_SCENARIOS, out_dir, world=WORLD, local_world=2, timeout=280)


@pytest.mark.parametrize(
    "i",
    range(len(TRAINER_SCENARIOS)),
    ids=[f"ep{e}-efsdp{d}{'-checkpointing' if c else ''}" for e, d, c in TRAINER_SCENARIOS],
)
def test_stock_trainer_matches_one_process(trainer_runs, i):
    (ref_losses, ref_norms, ref_experts), results = trainer_runs
    assert min(ref_norms) > 2 * MAX_NORM, "every step must clip"
    for rank, rank_results in enumerate(results):
        got = rank_results[i]
        assert len(got["losses"]) == STEPS, got
        np.testing.assert_allclose(got["losses"], ref_losses, rtol=RTOL, atol=0, err_msg=f"rank {rank} losses")
        np.testing.assert_allclose(got["norms"], ref_norms, rtol=RTOL, atol=0, err_msg=f"rank {rank} grad norms")
        assert all(rec["copies_equal"] for rec in got["experts"].values()), f"rank {rank}: copies differ"
    worst = _worst_expert(results[0][i], ref_experts)
    assert worst < WEIGHT_ATOL, f"experts differ from the one-process model's by {worst:.3g}"
    rel = max(
        max(abs(g - w) / w for g, w in zip(r[i][k], ref))
        for r in results
        for k, ref in (("losses", ref_losses), ("norms", ref_norms))
    )
    print(
        f"Trainer {TRAINER_SCENARIOS[i]}: max |expert - one process| = {worst:.3g}, losses/norms max relative {rel:.3g}"
    )
