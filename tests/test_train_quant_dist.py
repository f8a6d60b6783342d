"""Tier 3: the quantized MoE checkpoints people download, fine-tuned: one ``moeshard.from_pretrained``
(float32 masters, EP=2 x efsdp=2 on 4 gloo ranks, gpt-oss EP=4: :data:`MESH`; a shuffled
redundant placement) and the stock
transformers Trainer with :class:`~moeshard.integrations.transformers.MoeshardTrainerMixin`, 2
steps, each rank on its quarter of every global batch. Against one process: a plain transformers
model (no quantizer) holding the weights the fixture dequantized INDEPENDENTLY of moeshard (its
reference state dict, written as a plain float32 checkpoint and read by transformers'
``from_pretrained``), trained by the same Trainer on the whole batch:

* every step's loss and gradient norm (``trainer.state.log_history``), 1e-6 relative;
* every parameter after the 2 steps, gathered whole in logical expert order (every redundant
  copy checked equal), 1e-5 absolute (a misplaced expert or a wrongly dequantized block is off
  by far more), every one of them moved by the reference's training.

Scenarios (:data:`SCENARIOS`): gpt-oss with MXFP4 experts, DeepSeek-V3 with INT4
pack-quantized routed experts (Kimi-K2-Thinking's layout), Qwen3-MoE with NVFP4 experts
(compressed-tensors and ModelOpt) and with FP8 per-channel experts; the checkpoints and their
references come from ``quant_fixtures``. All run in one spawned group.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import tiny_hf
from mp import run_ranks
from training import accelerate_fsdp_on_cpu

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.hf, pytest.mark.dist, pytest.mark.timeout(600)]

STEPS, LR, WORLD, SEQ = 2, 1e-3, 4, tiny_hf.SEQ
# Losses and gradient norms: 1e-6 relative (the step-1 loss checks every loaded weight). Parameters:
# AdamW's first steps move an element by about the learning rate whatever its gradient's size, so
# one whose gradient is near zero moves by ~1e-5 on sums in another order; a misplaced expert or a
# wrongly dequantized group is off by 1e-2 or more.
RTOL, ATOL = 1e-6, 1e-4
# (ep, efsdp) per family. gpt-oss: EP alone, since parallelize refuses expert FSDP for an experts
# module with parameters that are not sliced per expert (gpt-oss's biases, whose gradients expert
# FSDP would reduce over "efsdp" only).
MESH = {"gpt_oss": (4, 1), "deepseek_v3": (2, 2), "qwen3_moe": (2, 2)}

# (scenario, quant_fixtures format)
SCENARIOS = (
    ("gpt_oss-mxfp4", "mxfp4"),
    ("deepseek_v3-int4", "int4"),
    ("qwen3_moe-nvfp4", "nvfp4"),
    ("qwen3_moe-modelopt-nvfp4", "modelopt-nvfp4"),
    ("qwen3_moe-fp8", "fp8"),
)


def write_scenario(fmt: str, path: str, reference: str) -> str:
    """The checkpoint of one scenario at ``path`` and, at ``reference``, the plain float32
    checkpoint transformers reads for the one-process run: the weights dequantized by the format's
    independent dequantizer (quant_fixtures). Returns the model's family."""
    import quant_fixtures

    fx = quant_fixtures.WRITERS[fmt](path)
    quant_fixtures.write_reference(fx, reference, torch.float32)
    return fx.config.model_type


class _Data(torch.utils.data.Dataset):
    """STEPS global batches of WORLD sequences (labels = input ids)."""

    def __init__(self, vocab: int):
        self.ids = torch.randint(0, vocab, (STEPS * WORLD, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out: str, distributed: bool):
    # What `accelerate launch` with an FSDP2 config gives (fsdp_version 2, no auto wrap; gloo on CPU).
    fsdp = (
        dict(
            fsdp=True, fsdp_config={"fsdp_version": 2, "auto_wrap_policy": "NO_WRAP"}, use_cpu=True, ddp_backend="gloo"
        )
        if distributed
        else {}
    )
    return transformers.TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=1 if distributed else WORLD,
        learning_rate=LR,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        disable_tqdm=True,
        **fsdp,
    )


def _log(trainer) -> list[tuple[int, float, float]]:
    return [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def _vocab(ckpt: str) -> int:
    with open(os.path.join(ckpt, "config.json")) as f:
        return json.load(f)["vocab_size"]


def train_worker(ckpts: dict, root: str) -> dict:
    """Every scenario on this rank: ``out[name] = (log, errors)``; rank 0 also returns the
    trained parameters, gathered whole in logical expert order."""
    import torch.distributed as dist

    import moeshard
    from moeshard.integrations.transformers import moeshard_trainer

    accelerate_fsdp_on_cpu()
    cls = moeshard_trainer(transformers.Trainer)
    out = {}
    for name, (ckpt, family) in ckpts.items():
        with open(os.path.join(ckpt, "config.json")) as f:
            config = json.load(f)
        experts = next(config[k] for k in ("num_local_experts", "n_routed_experts", "num_experts") if k in config)
        ep, efsdp = MESH[family]
        placement = tiny_hf.shuffled_redundant(experts, ep, seed=len(name))
        try:  # moeshard's errors are raised on every rank alike: the next scenario runs
            model = moeshard.from_pretrained(ckpt, ep=ep, efsdp=efsdp, dtype=torch.float32, placement=placement)
            trainer = cls(model=model, args=_args(os.path.join(root, name), True), train_dataset=_Data(_vocab(ckpt)))
            trainer.train()
            params = tiny_hf.full_params(model, model.moeshard_placement)
            out[name] = (_log(trainer), params if dist.get_rank() == 0 else None)
        except Exception as e:  # noqa: BLE001 - each scenario's test reports its own
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _reference(ckpt: str, out: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = transformers.Trainer(model=model, args=_args(out, False), train_dataset=_Data(_vocab(ckpt)))
    trainer.train()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    # AdamW moves every parameter with a gradient by about the learning rate per step.
    moved = min(float((after[n] - before[n]).abs().max()) for n in after if before[n].numel() > 1)
    return _log(trainer), after, moved


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_quant")
    ckpts, refs = {}, {}
    for name, fmt in SCENARIOS:
        family = write_scenario(fmt, str(root / name), str(root / f"{name}-reference"))
        ckpts[name] = (str(root / name), family)
        refs[name] = _reference(str(root / f"{name}-reference"), str(root / f"{name}-reference-run"))
    results = run_ranks(train_worker, ckpts, str(root / "runs"), world=WORLD, timeout=500)
    return refs, results


@pytest.mark.parametrize("name", [s[0] for s in SCENARIOS])
def test_two_steps_match_one_process_on_the_independently_dequantized_weights(runs, name):
    refs, results = runs
    ref_log, ref_params, moved = refs[name]
    assert [s for s, _, _ in ref_log] == list(range(1, STEPS + 1))
    assert moved > 5 * ATOL, f"the reference must train every parameter (one moved by {moved:.1e} only)"
    for rank, r in enumerate(results):
        assert isinstance(r[name], tuple), f"rank {rank}: {r[name]}"
        log = r[name][0]
        assert [s for s, _, _ in log] == [s for s, _, _ in ref_log], (rank, log)
        np.testing.assert_allclose([x[1] for x in log], [x[1] for x in ref_log], rtol=RTOL, atol=0, err_msg="loss")
        np.testing.assert_allclose([x[2] for x in log], [x[2] for x in ref_log], rtol=RTOL, atol=0, err_msg="norm")
    got = results[0][name][1]
    assert got.keys() == ref_params.keys()
    for n, p in ref_params.items():
        torch.testing.assert_close(got[n], p, rtol=0, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
