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
references come from ``quant_fixtures``. Each family also runs stored in bf16 (the same tiny
model, ``save_pretrained`` in bf16; reference: transformers' own upcast to float32). All run in
one spawned group.
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
# Parameters: AdamW divides by the root of the squared gradients, so an element whose gradients
# are tiny moves by ~1e-6 on a sum in another order; a misplaced expert is off by ~0.1.
RTOL, ATOL = 1e-6, 1e-5
# (ep, efsdp) per family. gpt-oss: EP alone, since parallelize refuses expert FSDP for an experts
# module with parameters that are not sliced per expert (gpt-oss's biases, whose gradients expert
# FSDP would reduce over "efsdp" only).
MESH = {"gpt_oss": (4, 1), "deepseek_v3": (2, 2), "qwen3_moe": (2, 2)}

# (scenario, family, format): "bf16" is the tiny model stored in bf16; the others are quant_fixtures'.
SCENARIOS = (
    ("gpt_oss-bf16", "gpt_oss", "bf16"),
    ("deepseek_v3-bf16", "deepseek_v3", "bf16"),
    ("qwen3_moe-bf16", "qwen3_moe", "bf16"),
)


def _config(family: str):
    if family == "gpt_oss":
        import hf_families

        return hf_families.tiny_config("gpt_oss")
    return tiny_hf.config(family)


def write_bf16(family: str, path: str) -> None:
    """The tiny ``family`` model with distinct values everywhere, saved in bf16."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="50KB")


def write_plain(config: dict, tensors: dict[str, torch.Tensor], path: str) -> None:
    """A plain float32 checkpoint of ``tensors`` (checkpoint keys, as a float checkpoint of
    the model names them) with ``config`` minus any quantization, for transformers to read."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config["dtype"] = "float32"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(
        {k: v.to(torch.float32).contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors")
    )


def write_scenario(family: str, fmt: str, path: str, reference: str) -> None:
    """The checkpoint of one scenario at ``path`` and, at ``reference``, the checkpoint
    transformers reads for the one-process run (the same weights, dequantized independently)."""
    if fmt == "bf16":
        write_bf16(family, path)
        os.symlink(path, reference)  # transformers' upcast of bf16 to float32 is exact
        return
    import quant_fixtures

    tensors = quant_fixtures.write(family, fmt, path)
    with open(os.path.join(path, "config.json")) as f:
        write_plain(json.load(f), tensors, reference)


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
        model = moeshard.from_pretrained(ckpt, ep=ep, efsdp=efsdp, dtype=torch.float32, placement=placement)
        trainer = cls(model=model, args=_args(os.path.join(root, name), True), train_dataset=_Data(_vocab(ckpt)))
        trainer.train()
        params = tiny_hf.full_params(model, model.moeshard_placement)
        out[name] = (_log(trainer), params if dist.get_rank() == 0 else None)
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
    for name, family, fmt in SCENARIOS:
        ckpts[name] = (str(root / name), family)
        write_scenario(family, fmt, ckpts[name][0], str(root / f"{name}-reference"))
        refs[name] = _reference(str(root / f"{name}-reference"), str(root / f"{name}-reference-run"))
    results = run_ranks(train_worker, ckpts, str(root / "runs"), world=WORLD, timeout=500)
    return refs, results


@pytest.mark.parametrize("name", [s[0] for s in SCENARIOS])
def test_two_steps_match_one_process_on_the_independently_dequantized_weights(runs, name):
    refs, results = runs
    ref_log, ref_params, moved = refs[name]
    assert [s for s, _, _ in ref_log] == list(range(1, STEPS + 1))
    assert moved > 10 * ATOL, f"the reference must train every parameter (one moved by {moved:.1e} only)"
    for rank, r in enumerate(results):
        log = r[name][0]
        assert [s for s, _, _ in log] == [s for s, _, _ in ref_log], (rank, log)
        np.testing.assert_allclose([x[1] for x in log], [x[1] for x in ref_log], rtol=RTOL, atol=0, err_msg="loss")
        np.testing.assert_allclose([x[2] for x in log], [x[2] for x in ref_log], rtol=RTOL, atol=0, err_msg="norm")
    got = results[0][name][1]
    assert got.keys() == ref_params.keys()
    for n, p in ref_params.items():
        torch.testing.assert_close(got[n], p, rtol=0, atol=ATOL, msg=lambda m, n=n: f"{n}: {m}")
