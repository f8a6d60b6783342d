"""Tier 3: the stock transformers Trainer (and TRL's SFTTrainer) with moeshard's Trainer mixin.

A tiny fp32 Qwen3-MoE and a tiny DeepSeek-V3 (:mod:`tiny_hf`, ``tiny_hf.MATRIX``) are written
by ``save_pretrained``. On 4 gloo ranks each is built on meta,
parallelized by hand (EP=4, or EP=2 x expert-FSDP=2) with a SHUFFLED placement (every expert
once, in another slot), loaded by moeshard and trained 4 steps by the stock ``Trainer`` with
:class:`~moeshard.integrations.transformers.MoeshardTrainerMixin` (clipping on, a checkpoint
every 2 steps), each rank on its quarter of every global batch. Compared against the same
Trainer setup in one process on ``from_pretrained`` with the whole batch:

* every step's loss and gradient norm (``trainer.state.log_history``), 1e-6 relative;
* ``trainer.save_model`` -> ``from_pretrained`` in one process: every parameter equal to the
  one-process trained model's (1e-6 absolute; a misplaced expert is off by ~0.1);
* the step-2 checkpoint resumed by a fresh Trainer under the same placement and under another
  one (weights and AdamW state relocated; EP=4, and EP=2 x efsdp=2 under another placement):
  steps 3-4 equal to the uninterrupted run's (1e-6 relative; a resume on wrong experts or a
  fresh optimizer is off by 1e-4 or more);
* :class:`~moeshard.integrations.transformers.MoeshardRebalanceCallback` rebalancing after
  every step from the router's counts (experts and their AdamW state relocated): losses,
  gradient norms and the saved model (under the last placement) as above;
* a REDUNDANT shuffled placement (12 slots for 8 experts, EP=4): the same checks with no
  moeshard call in the Trainer's loop (copies' gradients combined in backward, copies equal
  after each step), and its step-2 checkpoint resumed under another redundant placement;
* TRL's SFTTrainer with the mixin (``moeshard_trainer(SFTTrainer)``), EP=4 shuffled: losses,
  gradient norms and the saved model as above;
* that checkpoint resumed on another mesh (EP=2 x efsdp=2): refused on every rank, naming the
  parameter and the mesh.

Both families run EP=4 and EP=2 x efsdp=2 training, saving, rebalancing and resuming under
another placement; the redundant placement, SFT and the same-placement resume run on
Qwen3-MoE. Then (Qwen3-MoE): ``bf16=True`` on a float32 model without a mixed-precision policy
is refused on every rank (the stock Trainer, SFTTrainer's default SFTConfig, one rank alone),
and with FSDP2's bf16 policy the model trains computing in bf16; and exactly one rank's bad
input at each save and resume step (an unwritable directory, a file in the way, a damaged or
missing file in that rank's copy of the checkpoint, another placement file or last checkpoint)
raises on every rank within seconds.

accelerate ignores its FSDP plugin on CPU and wraps the model in DDP (which fails on DTensor
parameters); on GPUs it takes the FSDP2 path, which passes the model's FSDPModule root through.
training's :func:`accelerate_fsdp_on_cpu` makes the CPU take the GPU's path (test-only: the library
patches neither accelerate nor transformers).
"""

from __future__ import annotations

import glob
import os
import shutil
import time

import numpy as np
import pytest
import torch

import tiny_hf
from mp import run_ranks
from training import accelerate_fsdp_on_cpu

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

# The spawned group (both families, the bf16 and one-rank-bad scenarios) runs in the first test's setup.
pytestmark = [pytest.mark.hf, pytest.mark.dist, pytest.mark.timeout(900)]

STEPS, LR, WORLD, SEQ, LAYERS = 4, 1e-3, 4, tiny_hf.SEQ, tiny_hf.NUM_LAYERS
EXPERTS, VOCAB = 8, tiny_hf.VOCAB
assert all(tiny_hf.FAMILIES[f] == EXPERTS for f in tiny_hf.MATRIX)
RTOL = 1e-6
# The collective timeout of the test's process group (moeshard._launch): one rank's bad input must
# raise on every rank in far less.
PG_TIMEOUT = 120
FAST = 30


def write_tiny(family: str, path: str) -> None:
    """The tiny ``family`` checkpoint (:func:`tiny_hf.save_checkpoint`: distinct values
    everywhere, so a misplaced expert shows) and, for TRL, a tokenizer."""
    tiny_hf.save_checkpoint(family, path)
    if _has_trl():  # SFTTrainer loads the model's tokenizer: a word-level one over the vocabulary
        from tokenizers import Tokenizer, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="t0", pad_token="t1", eos_token="t2"
        ).save_pretrained(path)


def _has_trl() -> bool:
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


class _Data(torch.utils.data.Dataset):
    """STEPS global batches of WORLD sequences (labels = input ids)."""

    def __init__(self):
        self.ids = torch.randint(0, VOCAB, (STEPS * WORLD, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(out: str, distributed: bool, cls=None, steps: int = STEPS, **kw):
    # What `accelerate launch` with an FSDP2 config gives (fsdp_version 2, no auto wrap; gloo on CPU).
    fsdp = (
        dict(
            fsdp=True, fsdp_config={"fsdp_version": 2, "auto_wrap_policy": "NO_WRAP"}, use_cpu=True, ddp_backend="gloo"
        )
        if distributed
        else {}
    )
    base = dict(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=1 if distributed else WORLD,
        learning_rate=LR,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        seed=0,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return (cls or transformers.TrainingArguments)(**{**base, **fsdp, **kw})


def _log(trainer) -> list[tuple[int, float, float]]:
    return [(h["step"], h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def _shuffled(ep: int, seed: int):
    import moeshard

    rng = np.random.default_rng(seed)
    rows = np.stack([rng.permutation(EXPERTS) for _ in range(LAYERS)])
    return moeshard.Placement(rows, num_logical=EXPERTS, num_ranks=ep)


def _redundant(ep: int, seed: int, extra: int = 4):
    """Every expert once plus ``extra`` copies of random experts, shuffled: ``EXPERTS + extra`` slots."""
    import moeshard

    rng = np.random.default_rng(seed)
    rows = np.stack(
        [rng.permutation(np.r_[np.arange(EXPERTS), rng.integers(0, EXPERTS, extra)]) for _ in range(LAYERS)]
    )
    return moeshard.Placement(rows, num_logical=EXPERTS, num_ranks=ep)


def trainer_worker(ckpts: dict, root: str) -> dict:
    import moeshard

    accelerate_fsdp_on_cpu()
    meshes, out = {}, {}
    for family in tiny_hf.MATRIX:
        _family_runs(family, ckpts[family], os.path.join(root, family), meshes, out)
    _precision_runs(ckpts["qwen3_moe"], os.path.join(root, "precision"), meshes, out)
    _one_rank_bad_runs(ckpts["qwen3_moe"], root, meshes, out)
    assert moeshard  # imported before the shim's first Trainer
    return out


def _model_for(ckpt: str, meshes: dict, ep: int, efsdp: int, placement, mp_policy=None):
    import moeshard

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(ckpt))
    if (ep, efsdp) not in meshes:
        meshes[(ep, efsdp)] = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp)
    moeshard.parallelize(model, meshes[(ep, efsdp)], placement, mp_policy=mp_policy)
    moeshard.load(model, ckpt)
    return model


def _trainer_cls():
    from moeshard.integrations.transformers import MoeshardTrainerMixin

    class MoeTrainer(MoeshardTrainerMixin, transformers.Trainer):
        pass

    return MoeTrainer


def _family_runs(family: str, ckpt: str, root: str, meshes: dict, out: dict) -> None:
    """The Trainer runs of one family, ``out[f"{family}/{run}"]``: every run for Qwen3-MoE, the
    ones of every model-specific path (EP and expert-FSDP training, save, resume under another
    placement, rebalancing) for DeepSeek-V3."""
    import moeshard
    from moeshard.integrations.transformers import (
        MoeshardRebalanceCallback,
        MoeshardTrainerMixin,
        ResumeError,
        moeshard_trainer,
    )

    MoeTrainer = _trainer_cls()
    full = family == "qwen3_moe"

    def model_for(ep, efsdp, placement):
        return _model_for(ckpt, meshes, ep, efsdp, placement)

    def run(name, model, resume=None, cls=MoeTrainer, callbacks=None, **kw):
        trainer = cls(
            model=model, args=_args(os.path.join(root, name), True, **kw), train_dataset=_Data(), callbacks=callbacks
        )
        trainer.train(resume_from_checkpoint=resume)
        out[f"{family}/{name}-mode"] = getattr(trainer, "moeshard_resumed", None)
        return trainer

    def final(name, trainer):
        out[f"{family}/{name}"] = _log(trainer)
        trainer.save_model(os.path.join(root, f"{name}-final"))

    p1, p2 = _shuffled(4, 1), _shuffled(4, 2)
    assert not np.array_equal(p1.phy2log, p2.phy2log)
    t = run("ep4", model_for(4, 1, p1))
    final("ep4", t)
    first = os.path.join(root, "ep4", "checkpoint-2")
    if full:
        out[f"{family}/ep4-resume-same"] = _log(run("ep4-resume-same", model_for(4, 1, p1), first))
    # moeshard_trainer: the same class every call, a Trainer subclass with the mixin first.
    cls = moeshard_trainer(transformers.Trainer)
    assert cls is moeshard_trainer(transformers.Trainer) and cls.__mro__[1] is MoeshardTrainerMixin
    out[f"{family}/ep4-resume-other"] = _log(run("ep4-resume-other", model_for(4, 1, p2), first, cls))
    if full:
        try:
            run("ep2x2-resume-refused", model_for(2, 2, _shuffled(2, 3)), first)
            out["refused"] = None
        except ResumeError as e:
            out["refused"] = str(e)
    # Rebalanced after every step from the router's counts (AdamW's state moving with its experts),
    # then saved under the last placement.
    cb = MoeshardRebalanceCallback(every_n_steps=1)
    t = run("ep4-rebalanced", model_for(4, 1, p1), callbacks=[cb], save_strategy="no")
    final("ep4-rebalanced", t)
    out[f"{family}/rebalanced_moves"] = cb.history
    out[f"{family}/rebalanced_placement"] = moeshard.models.ep.model_placement(t.model).phy2log.tolist()
    t = run("ep2x2", model_for(2, 2, _shuffled(2, 4)))
    final("ep2x2", t)
    # Expert FSDP: the optimizer state's local shards are [slots, dim1 / efsdp, ...] boxes.
    out[f"{family}/ep2x2-resume-other"] = _log(
        run("ep2x2-resume-other", model_for(2, 2, _shuffled(2, 6)), os.path.join(root, "ep2x2", "checkpoint-2"))
    )
    if not full:
        return
    # Redundant copies (12 slots for 8 experts): their gradients combined in backward, every
    # copy equal after each step (no moeshard call in the Trainer's loop); resumed under another
    # redundant placement, the optimizer state moving with its experts.
    t = run("ep4-redundant", model_for(4, 1, _redundant(4, 7)))
    final("ep4-redundant", t)
    out[f"{family}/ep4-redundant-resume-other"] = _log(
        run(
            "ep4-redundant-resume-other",
            model_for(4, 1, _redundant(4, 8)),
            os.path.join(root, "ep4-redundant", "checkpoint-2"),
        )
    )
    if _has_trl():
        t = _sft(model_for(4, 1, _shuffled(4, 5)), ckpt, os.path.join(root, "sft"), True)
        final("sft", t)


def _precision_runs(ckpt: str, root: str, meshes: dict, out: dict) -> None:
    """``bf16=True`` with a float32 model and no mixed-precision policy: refused on every rank
    at the Trainer's creation (the stock Trainer; TRL's SFTTrainer, whose SFTConfig defaults to
    bf16=True; one rank alone setting it). With FSDP2's bf16 policy: trained, computing in bf16.
    ``out[name] = (error type, message, seconds)``; ``out["bf16*"]``: the policy's run."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moeshard.integrations.transformers import moeshard_trainer

    MoeTrainer = _trainer_cls()
    rank = torch.distributed.get_rank()
    model = _model_for(ckpt, meshes, 4, 1, _shuffled(4, 1))

    def refused(name, make):
        torch.distributed.barrier()
        t0 = time.monotonic()
        try:
            make()
            out[name] = (None, None, time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - the test compares every rank's
            out[name] = (type(e).__name__, str(e), time.monotonic() - t0)

    def trainer(bf16, name):
        return MoeTrainer(
            model=model,
            args=_args(os.path.join(root, name), True, bf16=bf16, save_strategy="no"),
            train_dataset=_Data(),
        )

    refused("bf16-refused", lambda: trainer(True, "refused"))
    refused("bf16-one-rank-refused", lambda: trainer(rank == 2, "one-rank"))
    if _has_trl():
        import datasets
        import trl

        args = _args(os.path.join(root, "sft"), True, trl.SFTConfig, 1, save_strategy="no")
        out["sft-default-bf16"] = args.bf16
        refused(
            "sft-bf16-refused",
            lambda: moeshard_trainer(trl.SFTTrainer)(
                model=model,
                args=args,
                train_dataset=datasets.Dataset.from_dict({"input_ids": _Data().ids.tolist()}),
                processing_class=transformers.AutoTokenizer.from_pretrained(ckpt),
            ),
        )
    # FSDP2's bf16 policy: every matmul's inputs and weights in bf16, the parameters float32.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _model_for(ckpt, meshes, 4, 1, _shuffled(4, 1), mp_policy=policy)
    seen = set()
    layer = model.model.layers[0]
    layer.self_attn.q_proj.register_forward_hook(
        lambda m, a, o: seen.add(("q_proj", str(a[0].dtype), str(m.weight.dtype), str(o.dtype)))
    )
    layer.mlp.experts.register_forward_hook(lambda m, a, o: seen.add(("experts", str(a[0].dtype), str(o.dtype))))
    t = trainer(True, "bf16")
    t.train()
    out["bf16"], out["bf16-seen"] = _log(t), sorted(seen)
    out["bf16-param-dtypes"] = sorted({str(p.dtype) for p in model.parameters()})


def _one_rank_bad_runs(ckpt: str, root: str, meshes: dict, out: dict) -> None:
    """Exactly one rank's input bad at each check of the Trainer's save and resume that can fail
    on one rank: ``out[f"bad/{name}"] = (error type, message, seconds, bad rank)`` on every
    rank. Where a file is read, every rank reads its own copy of the checkpoint (a node-local
    disk), the bad rank's copy damaged."""
    import json

    import torch.distributed as dist

    from moeshard.integrations.transformers import OPTIMIZER_DIR, PLACEMENT_NAME

    MoeTrainer = _trainer_cls()
    rank = dist.get_rank()
    base = os.path.join(root, "bad")
    p1 = _shuffled(4, 1)
    saved = os.path.join(root, "qwen3_moe", "ep4")  # checkpoint-2 and -4, saved under p1

    def scenario(name, bad_rank, setup, act):
        d = os.path.join(base, name, f"rank-{rank}")
        os.makedirs(d)
        arg = setup(d, rank == bad_rank)
        dist.barrier()
        t0 = time.monotonic()
        try:
            act(arg)
            res = (None, None)
        except Exception as e:  # noqa: BLE001 - the test compares every rank's
            res = (type(e).__name__, str(e))
        out[f"bad/{name}"] = (*res, time.monotonic() - t0, bad_rank)
        dist.barrier()

    # -- save: a trained Trainer (optimizer state, scheduler) saving into a shared directory
    ts = MoeTrainer(
        model=_model_for(ckpt, meshes, 4, 1, p1),
        args=_args(os.path.join(base, "train"), True, steps=1, save_strategy="no"),
        train_dataset=_Data(),
    )
    ts.train()
    shared = os.path.join(base, "shared")

    def in_shared(name, *blocker):
        """Every rank saves into ``shared/name``; the bad rank makes ``blocker`` there a directory."""

        def setup(d, bad):
            out_dir = os.path.join(shared, name)
            if bad:
                os.makedirs(os.path.join(out_dir, *blocker))
            return out_dir

        return setup

    def unwritable(d, bad):
        if not bad:
            return os.path.join(shared, "unwritable")
        open(os.path.join(d, "a-file"), "w").close()
        return os.path.join(d, "a-file", "out")  # under a regular file

    def checkpoint(out_dir):
        ts.args.output_dir = out_dir
        ts._save_checkpoint(ts.model_wrapped, None)

    scenario("save-dir-unwritable", 2, unwritable, ts.save_model)
    scenario("save-placement-file", 0, in_shared("placement", PLACEMENT_NAME), ts.save_model)
    ck = "checkpoint-1"
    scenario(
        "checkpoint-optimizer-file",
        1,
        in_shared("optimizer", ck, OPTIMIZER_DIR, f"rank-00001-of-{WORLD:05d}.pt.tmp"),
        checkpoint,
    )
    scenario("checkpoint-scheduler", 0, in_shared("scheduler", ck, "scheduler.pt"), checkpoint)
    scenario("checkpoint-rng-state", 3, in_shared("rng", ck, "rng_state_3.pth"), checkpoint)
    scenario("checkpoint-trainer-state", 0, in_shared("state", ck, "trainer_state.json"), checkpoint)

    # -- resume: each rank its own copy of checkpoint-2, the bad rank's damaged
    model = _model_for(ckpt, meshes, 4, 1, p1)

    def copy(damage):
        def setup(d, bad):
            path = shutil.copytree(os.path.join(saved, "checkpoint-2"), os.path.join(d, "checkpoint-2"))
            if bad:
                damage(path)
            return d

        return setup

    def resume(d, checkpoint="checkpoint-2"):
        t = MoeTrainer(model=model, args=_args(os.path.join(d, "run"), True), train_dataset=_Data())
        t.train(resume_from_checkpoint=os.path.join(d, checkpoint) if checkpoint is not True else True)

    def garbage(*name):
        def damage(path):
            with open(os.path.join(path, *name), "wb") as f:
                f.write(b"not a torch file")

        return damage

    def other_placement(path):
        with open(os.path.join(path, PLACEMENT_NAME)) as f:
            doc = json.load(f)
        row = doc["layers"][0]["phy2log"]
        row[:2] = row[1::-1]  # two slots of layer 0 swapped
        with open(os.path.join(path, PLACEMENT_NAME), "w") as f:
            json.dump(doc, f)

    def later_checkpoint(d, bad):
        run = os.path.join(d, "run")
        shutil.copytree(os.path.join(saved, "checkpoint-2"), os.path.join(run, "checkpoint-2"))
        if bad:  # this rank's output directory also holds a later checkpoint
            shutil.copytree(os.path.join(saved, "checkpoint-4"), os.path.join(run, "checkpoint-4"))
        return d

    def shard_file(path):
        os.remove(sorted(glob.glob(os.path.join(path, "model-*.safetensors")))[1])

    scenario("resume-trainer-state", 1, copy(lambda p: os.remove(os.path.join(p, "trainer_state.json"))), resume)
    scenario("resume-optimizer-file", 2, copy(garbage(OPTIMIZER_DIR, f"rank-00002-of-{WORLD:05d}.pt")), resume)
    scenario("resume-scheduler", 3, copy(garbage("scheduler.pt")), resume)
    scenario("resume-rng-state", 2, copy(garbage("rng_state_2.pth")), resume)
    scenario("resume-placement-file", 3, copy(other_placement), resume)
    scenario("resume-model-file", 1, copy(shard_file), resume)
    scenario("resume-last-checkpoint", 2, later_checkpoint, lambda d: resume(d, True))


SFT_STEPS = STEPS


def _sft(model, ckpt: str, out: str, distributed: bool):
    """TRL's SFTTrainer as a user runs it (its defaults: gradient checkpointing on) on
    pre-tokenized sequences. Two defaults off: bf16 (mixed precision is not this test's), and
    the MoE load-balancing loss (TRL adds it for MoE models): it is a per-micro-batch statistic
    (each expert's token fraction times its mean router probability), so any data-parallel run,
    DDP's too, computes it per rank and differs from one process on the whole batch (3.5e-5
    relative here)."""
    import datasets
    import trl

    from moeshard.integrations.transformers import moeshard_trainer

    cls = moeshard_trainer(trl.SFTTrainer) if distributed else trl.SFTTrainer
    data = datasets.Dataset.from_dict({"input_ids": _Data().ids.tolist()})
    trainer = cls(
        model=model,
        args=_args(
            out, distributed, trl.SFTConfig, SFT_STEPS, bf16=False, save_strategy="no", router_aux_loss_coef=0.0
        ),
        train_dataset=data,
        processing_class=transformers.AutoTokenizer.from_pretrained(ckpt),
    )
    trainer.train()
    return trainer


def _reference(ckpt: str, out: str, sft: bool = False):
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    if sft:
        trainer = _sft(model, ckpt, out, False)
    else:
        trainer = transformers.Trainer(model=model, args=_args(out, False), train_dataset=_Data())
        trainer.train()
    return _log(trainer), {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer")
    ckpts, refs = {}, {}
    for family in tiny_hf.MATRIX:
        ckpts[family] = str(root / f"tiny-{family}")
        write_tiny(family, ckpts[family])
        refs[f"{family}/trainer"] = _reference(ckpts[family], str(root / f"reference-{family}"))
    if _has_trl():
        refs["qwen3_moe/sft"] = _reference(ckpts["qwen3_moe"], str(root / "reference-sft"), sft=True)
    results = run_ranks(trainer_worker, ckpts, str(root), world=WORLD, timeout=600)
    return root, refs, results


def _check_log(got, want, steps, rtol=RTOL):
    # A resumed Trainer's history starts with the checkpoint's (steps 1-2), then its own steps.
    got = [g for g in got if g[0] in steps]
    assert [s for s, _, _ in got] == steps
    want = {s: (loss, norm) for s, loss, norm in want}
    np.testing.assert_allclose([loss for _, loss, _ in got], [want[s][0] for s in steps], rtol=rtol, atol=0)
    np.testing.assert_allclose([norm for _, _, norm in got], [want[s][1] for s in steps], rtol=rtol, atol=0)


# (family, run): every run on Qwen3-MoE; EP, expert FSDP and rebalancing on DeepSeek-V3 too.
TRAINED = [
    *[("qwen3_moe", n) for n in ("ep4", "ep2x2", "ep4-rebalanced", "ep4-redundant", "sft")],
    *[("deepseek_v3", n) for n in ("ep4", "ep2x2", "ep4-rebalanced")],
]
RESUMED = [
    *[("qwen3_moe", n) for n in ("ep4-resume-same", "ep4-resume-other", "ep2x2-resume-other")],
    ("qwen3_moe", "ep4-redundant-resume-other"),
    *[("deepseek_v3", n) for n in ("ep4-resume-other", "ep2x2-resume-other")],
]
assert {f for f, _ in TRAINED} == {f for f, _ in RESUMED} == set(tiny_hf.MATRIX)


@pytest.mark.parametrize("family,name", TRAINED)
def test_losses_grad_norms_and_saved_model_match_one_process(runs, family, name):
    root, refs, results = runs
    if name == "sft" and f"{family}/sft" not in refs:
        pytest.skip("trl / datasets not installed")
    ref_log, ref_params = refs[f"{family}/{'sft' if name == 'sft' else 'trainer'}"]
    if name == "ep4-rebalanced":  # a rebalance after every step, and experts moved between ranks
        moves = [r[f"{family}/rebalanced_moves"] for r in results]
        assert all([s for s, _ in m] == list(range(1, STEPS + 1)) for m in moves)
        assert any(moved for m in moves for _, moved in m)
        assert results[0][f"{family}/rebalanced_placement"] != _shuffled(4, 1).phy2log.tolist()
    assert ref_log[-1][1] < ref_log[0][1], "the reference must actually train"
    assert max(n for _, _, n in ref_log) > 1.0, "clipping must be active (max_grad_norm=1.0)"
    for rank_results in results:
        _check_log(rank_results[f"{family}/{name}"], ref_log, list(range(1, len(ref_log) + 1)))
    final = root / family / f"{name}-final"
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32)
    got = dict(saved.named_parameters())
    assert got.keys() == ref_params.keys()
    for n, p in ref_params.items():
        torch.testing.assert_close(got[n], p, rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    assert (final / "moeshard_placement.json").is_file()


@pytest.mark.parametrize("family,name", RESUMED)
def test_resume_continues_exactly(runs, family, name):
    root, refs, results = runs
    run = name.split("-resume")[0]
    for rank_results in results:
        assert rank_results[f"{family}/{name}-mode"] == ("same" if name.endswith("same") else "relocated")
        _check_log(rank_results[f"{family}/{name}"], refs[f"{family}/trainer"][0], [3, 4])
        _check_log(rank_results[f"{family}/{name}"], rank_results[f"{family}/{run}"], [3, 4])
    ckpt = root / family / run / "checkpoint-2"
    assert sorted(os.listdir(ckpt / "moeshard_optimizer")) == [f"rank-{r:05d}-of-{WORLD:05d}.pt" for r in range(WORLD)]


def test_resume_on_another_mesh_is_refused_on_every_rank(runs):
    _, _, results = runs
    for rank_results in results:
        msg = rank_results["refused"]
        assert msg is not None, "resuming EP=4 optimizer state on EP=2 x efsdp=2 must raise"
        assert "sharded otherwise" in msg and "mesh [4] -> [2, 2]" in msg and "save_only_model=True" in msg, msg


@pytest.mark.parametrize("name", ["bf16-refused", "bf16-one-rank-refused", "sft-bf16-refused"])
def test_ignored_bf16_flag_is_refused_on_every_rank(runs, name):
    _, _, results = runs
    if name.startswith("sft") and name not in results[0]:
        pytest.skip("trl / datasets not installed")
    if name.startswith("sft"):
        assert all(r["sft-default-bf16"] is True for r in results), "SFTConfig's default is bf16=True"
    for rank, r in enumerate(results):
        kind, msg, seconds = r[name]
        assert kind == "MixedPrecisionError", (rank, kind, msg)
        assert "bf16=True" in msg and "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in msg, msg
        assert seconds < FAST, f"rank {rank} took {seconds:.1f} s"
        if name == "bf16-one-rank-refused":  # only rank 2 set it: every rank names it
            assert "failed on 1 of 4" in msg and "rank 2:" in msg, msg


def test_bf16_with_fsdp2_policy_trains_in_bf16(runs):
    """bf16=True with FSDP2's bf16 policy: accepted, and the model computes in bf16 (every
    q_proj's input, weight and output; the experts' input and output), the parameters stay
    float32, and the losses differ from the float32 run's by bf16 rounding only."""
    _, refs, results = runs
    fp32 = refs["qwen3_moe/trainer"][0]
    for r in results:
        assert r["bf16-seen"] == [
            ("experts", "torch.bfloat16", "torch.bfloat16"),
            ("q_proj", "torch.bfloat16", "torch.bfloat16", "torch.bfloat16"),
        ], r["bf16-seen"]
        assert r["bf16-param-dtypes"] == ["torch.float32"]
        losses = np.array([loss for _, loss, _ in r["bf16"]])
        want = np.array([loss for _, loss, _ in fp32])
        assert len(losses) == STEPS and losses[-1] < losses[0]
        np.testing.assert_allclose(losses, want, rtol=5e-2)
        # bf16 rounding moves them by ~1e-4 relative; an ignored flag leaves them bitwise float32's.
        assert np.abs(losses / want - 1).max() > 1e-5, "bf16 matmuls round: the losses cannot equal float32's"


# scenario -> the error every rank raises
BAD = {
    "save-dir-unwritable": "SaveError",
    "save-placement-file": "SaveError",
    "checkpoint-optimizer-file": "SaveError",
    "checkpoint-scheduler": "SaveError",
    "checkpoint-rng-state": "SaveError",
    "checkpoint-trainer-state": "SaveError",
    "resume-trainer-state": "ResumeError",
    "resume-optimizer-file": "ResumeError",
    "resume-scheduler": "ResumeError",
    "resume-rng-state": "ResumeError",
    "resume-placement-file": "ResumeError",
    "resume-model-file": "ResumeError",
    "resume-last-checkpoint": "ResumeError",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_one_ranks_bad_save_or_resume_raises_on_every_rank_within_seconds(runs, name):
    _, _, results = runs
    got = [r[f"bad/{name}"] for r in results]
    for rank, (kind, msg, seconds, bad) in enumerate(got):
        assert kind == BAD[name], (rank, kind, msg)
        assert f"rank {bad}" in msg, msg
        assert seconds < FAST, f"rank {rank} took {seconds:.1f} s (the collective timeout: {PG_TIMEOUT} s)"


# -- one process: the checks that need no job ------------------------------------------------


def test_ignored_mixed_precision_flag_is_refused():
    from types import SimpleNamespace

    from moeshard.integrations.transformers import check_mixed_precision

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"bf16=True .*MixedPrecisionPolicy\(param_dtype=torch.bfloat16"):
        check_mixed_precision(model, SimpleNamespace(bf16=True, fp16=False))
    with pytest.raises(ValueError, match="fp16=True"):
        check_mixed_precision(model, SimpleNamespace(bf16=False, fp16=True))
    check_mixed_precision(model, SimpleNamespace(bf16=False, fp16=False))
    check_mixed_precision(model.to(torch.bfloat16), SimpleNamespace(bf16=True, fp16=False))  # nothing to ignore
    # A policy parallelize applied (what it records on the model) computes in bf16: accepted; fp16: refused.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = torch.nn.Linear(4, 4)
    model.moeshard_mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    check_mixed_precision(model, SimpleNamespace(bf16=True, fp16=False))
    with pytest.raises(ValueError, match="fp16=True"):
        check_mixed_precision(model, SimpleNamespace(bf16=False, fp16=True))


def test_optimizer_state_of_another_world_size_or_the_trainers_own_is_refused(tmp_path):
    from types import SimpleNamespace

    from moeshard.integrations.transformers import MoeshardTrainerMixin, load_optimizer_state, moeshard_trainer

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    (tmp_path / "moeshard_optimizer").mkdir()
    (tmp_path / "moeshard_optimizer" / "rank-00000-of-00004.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="saved by 4 ranks, this job has 1.*save_only_model=True"):
        load_optimizer_state(model, opt, tmp_path)
    stock = tmp_path / "stock"
    stock.mkdir()
    (stock / "optimizer.pt").write_bytes(b"")
    trainer = SimpleNamespace(model=model, optimizer=opt, lr_scheduler=None)
    with pytest.raises(ValueError, match="Trainer's own optimizer.pt"):
        MoeshardTrainerMixin._load_optimizer_and_scheduler(trainer, str(stock))
    assert moeshard_trainer(transformers.Trainer) is moeshard_trainer(transformers.Trainer)
    assert moeshard_trainer(transformers.Trainer).__mro__[1:3] == (MoeshardTrainerMixin, transformers.Trainer)


def test_refused_resume_changes_nothing(tmp_path):
    """ResumeError 'before anything changed' (load_optimizer_state's and ResumeError's docstrings):
    another parameter layout, or param groups other than the saved ones, leave the optimizer's
    state and hyperparameters as they were."""
    from moeshard.integrations.transformers import load_optimizer_state, save_optimizer_state

    def stepped(shape, lr):
        torch.manual_seed(len(shape) + shape[0])
        model = torch.nn.Sequential(torch.nn.Linear(*shape), torch.nn.Linear(shape[1], 3))
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        model(torch.randn(2, shape[0])).sum().backward()
        opt.step()
        return model, opt

    saved_model, saved_opt = stepped((4, 4), 5e-4)
    save_optimizer_state(saved_model, saved_opt, tmp_path)
    other_layout = stepped((4, 6), 1e-3)  # weight [6, 4]: sharded otherwise
    model, opt = stepped((4, 4), 1e-3)
    other_groups = (model, torch.optim.AdamW([{"params": [p]} for p in model.parameters()], lr=1e-3))
    other_groups[1].step()  # the gradients stepped() left: state in every group
    for (m, o), match in ((other_layout, "sharded otherwise"), (other_groups, "param groups")):
        before = ([dict(g, params=None) for g in o.param_groups], {k: dict(v) for k, v in o.state.items()})
        snapshot = {id(p): {k: v.clone() for k, v in st.items()} for p, st in o.state.items()}
        with pytest.raises(ValueError, match=match):  # a ResumeError on every rank of a job
            load_optimizer_state(m, o, tmp_path)
        assert [dict(g, params=None) for g in o.param_groups] == before[0]
        assert o.state.keys() == before[1].keys()
        for p, st in o.state.items():
            assert all(torch.equal(v, snapshot[id(p)][k]) for k, v in st.items())


def test_callback_and_trainer_class_arguments_are_checked():
    from moeshard.integrations.transformers import MoeshardRebalanceCallback, moeshard_trainer

    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="every_n_steps must be a positive int"):
            MoeshardRebalanceCallback(every_n_steps=bad)
    with pytest.raises(ValueError, match="has no moeshard EP layers"):
        MoeshardRebalanceCallback(every_n_steps=1).on_train_begin(None, None, None, model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="expects a Trainer class"):
        moeshard_trainer("Trainer")


def _trainer_snippets() -> dict[str, str]:
    """The Python blocks of the Trainer / TRL sections of the README and docs/training.md."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = {}
    for doc, heading in (
        ("README.md", "## Training with the transformers Trainer / TRL"),
        ("docs/training.md", "## The transformers Trainer / TRL"),
    ):
        text = (root / doc).read_text()
        section = text[text.index(heading) :]
        section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else None]
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", section, re.S)):
            out[f"{doc}#{i}"] = block
    return out


def test_trainer_snippets_name_only_what_they_import_or_the_users_data():
    """Every name the README's and docs' Trainer / TRL snippets use is imported or assigned in
    the snippet, a builtin, or one of the user's own objects (checkpoint, dataset, tokenizer)."""
    import ast
    import builtins

    snippets = _trainer_snippets()
    assert len(snippets) >= 2
    users = {"ckpt", "ds", "tok"}
    for where, code in snippets.items():
        tree = ast.parse(code)
        bound, used = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                bound.add(node.name)
            elif isinstance(node, ast.Name):
                (bound if isinstance(node.ctx, ast.Store) else used).add(node.id)
        free = used - bound - set(dir(builtins)) - users
        assert not free, f"{where}: names neither imported nor defined: {sorted(free)}"
