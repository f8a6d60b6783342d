"""Tier 3: the stock transformers Trainer (and TRL's SFTTrainer) with moeshard's Trainer mixin.

A tiny fp32 Qwen3-MoE is written by ``save_pretrained``. On 4 gloo ranks it is built on meta,
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
* TRL's SFTTrainer with the mixin (``moeshard_trainer(SFTTrainer)``), 3 steps, EP=4 shuffled:
  losses, gradient norms and the saved model as above;
* that checkpoint resumed on another mesh (EP=2 x efsdp=2): refused on every rank, naming the
  parameter and the mesh.

accelerate ignores its FSDP plugin on CPU and wraps the model in DDP (which fails on DTensor
parameters); on GPUs it takes the FSDP2 path, which passes the model's FSDPModule root through.
:func:`_accelerate_fsdp_on_cpu` makes the CPU take the GPU's path (test-only: the library
patches neither accelerate nor transformers).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from mp import run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.hf, pytest.mark.dist]

STEPS, LR, WORLD, SEQ, LAYERS, EXPERTS = 4, 1e-3, 4, 16, 2, 8
RTOL = 1e-6


def write_tiny(path: str) -> None:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # distinct values everywhere (norms start at ones): a misplaced expert shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, max_shard_size="20KB")
    if _has_trl():  # SFTTrainer loads the model's tokenizer: a word-level one over the 64 ids
        from tokenizers import Tokenizer, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
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
        self.ids = torch.randint(0, 64, (STEPS * WORLD, SEQ), generator=torch.Generator().manual_seed(0))

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


def _accelerate_fsdp_on_cpu() -> None:
    """Test shim: accelerate's state keeps MULTI_CPU and drops the FSDP plugin on CPU (it sets
    FSDP for GPU types only); do for CPU what it does for GPUs."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState, "_moeshard_test_shim", False):
        return
    orig = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        orig(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init
    AcceleratorState._moeshard_test_shim = True


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


def trainer_worker(ckpt: str, root: str) -> dict:
    import moeshard
    from moeshard.integrations.transformers import (
        MoeshardRebalanceCallback,
        MoeshardTrainerMixin,
        ResumeError,
        moeshard_trainer,
    )

    _accelerate_fsdp_on_cpu()
    meshes, out = {}, {}

    class MoeTrainer(MoeshardTrainerMixin, transformers.Trainer):
        pass

    def model_for(ep, efsdp, placement):
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(ckpt))
        if (ep, efsdp) not in meshes:
            meshes[(ep, efsdp)] = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp)
        moeshard.parallelize(model, meshes[(ep, efsdp)], placement)
        moeshard.load(model, ckpt)
        return model

    def run(name, model, resume=None, cls=MoeTrainer, callbacks=None, **kw):
        trainer = cls(
            model=model, args=_args(os.path.join(root, name), True, **kw), train_dataset=_Data(), callbacks=callbacks
        )
        trainer.train(resume_from_checkpoint=resume)
        out[f"{name}-mode"] = getattr(trainer, "moeshard_resumed", None)
        return trainer

    p1, p2 = _shuffled(4, 1), _shuffled(4, 2)
    assert not np.array_equal(p1.phy2log, p2.phy2log)
    t = run("ep4", model_for(4, 1, p1))
    out["ep4"] = _log(t)
    t.save_model(os.path.join(root, "ep4-final"))
    first = os.path.join(root, "ep4", "checkpoint-2")
    out["ep4-resume-same"] = _log(run("ep4-resume-same", model_for(4, 1, p1), first))
    # moeshard_trainer: the same class every call, a Trainer subclass with the mixin first.
    cls = moeshard_trainer(transformers.Trainer)
    assert cls is moeshard_trainer(transformers.Trainer) and cls.__mro__[1] is MoeshardTrainerMixin
    out["ep4-resume-other"] = _log(run("ep4-resume-other", model_for(4, 1, p2), first, cls))
    try:
        run("ep2x2-resume-refused", model_for(2, 2, _shuffled(2, 3)), first)
        out["refused"] = None
    except ResumeError as e:
        out["refused"] = str(e)
    # Rebalanced after every step from the router's counts (AdamW's state moving with its experts),
    # then saved under the last placement.
    cb = MoeshardRebalanceCallback(every_n_steps=1)
    t = run("ep4-rebalanced", model_for(4, 1, p1), callbacks=[cb], save_strategy="no")
    out["ep4-rebalanced"], out["rebalanced_moves"] = _log(t), cb.history
    out["rebalanced_placement"] = moeshard.models.ep.model_placement(t.model).phy2log.tolist()
    t.save_model(os.path.join(root, "ep4-rebalanced-final"))
    t = run("ep2x2", model_for(2, 2, _shuffled(2, 4)))
    out["ep2x2"] = _log(t)
    t.save_model(os.path.join(root, "ep2x2-final"))
    # Expert FSDP: the optimizer state's local shards are [slots, dim1 / efsdp, ...] boxes.
    out["ep2x2-resume-other"] = _log(
        run("ep2x2-resume-other", model_for(2, 2, _shuffled(2, 6)), os.path.join(root, "ep2x2", "checkpoint-2"))
    )
    # Redundant copies (12 slots for 8 experts): their gradients combined in backward, every
    # copy equal after each step (no moeshard call in the Trainer's loop); resumed under another
    # redundant placement, the optimizer state moving with its experts.
    t = run("ep4-redundant", model_for(4, 1, _redundant(4, 7)))
    out["ep4-redundant"] = _log(t)
    t.save_model(os.path.join(root, "ep4-redundant-final"))
    out["ep4-redundant-resume-other"] = _log(
        run(
            "ep4-redundant-resume-other",
            model_for(4, 1, _redundant(4, 8)),
            os.path.join(root, "ep4-redundant", "checkpoint-2"),
        )
    )
    if _has_trl():
        t = _sft(model_for(4, 1, _shuffled(4, 5)), ckpt, os.path.join(root, "sft"), True)
        out["sft"] = _log(t)
        t.save_model(os.path.join(root, "sft-final"))
    return out


SFT_STEPS = 3


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
    ckpt = str(root / "tiny")
    write_tiny(ckpt)
    refs = {"trainer": _reference(ckpt, str(root / "reference"))}
    if _has_trl():
        refs["sft"] = _reference(ckpt, str(root / "reference-sft"), sft=True)
    results = run_ranks(trainer_worker, ckpt, str(root), world=WORLD, timeout=280)
    return root, refs, results


def _check_log(got, want, steps):
    # A resumed Trainer's history starts with the checkpoint's (steps 1-2), then its own steps.
    got = [g for g in got if g[0] in steps]
    assert [s for s, _, _ in got] == steps
    want = {s: (loss, norm) for s, loss, norm in want}
    np.testing.assert_allclose([loss for _, loss, _ in got], [want[s][0] for s in steps], rtol=RTOL, atol=0)
    np.testing.assert_allclose([norm for _, _, norm in got], [want[s][1] for s in steps], rtol=RTOL, atol=0)


@pytest.mark.parametrize("name", ["ep4", "ep2x2", "ep4-rebalanced", "ep4-redundant", "sft"])
def test_losses_grad_norms_and_saved_model_match_one_process(runs, name):
    root, refs, results = runs
    if name == "sft" and "sft" not in refs:
        pytest.skip("trl / datasets not installed")
    ref_log, ref_params = refs["sft" if name == "sft" else "trainer"]
    if name == "ep4-rebalanced":  # a rebalance after every step, and experts moved between ranks
        assert all([s for s, _ in r["rebalanced_moves"]] == list(range(1, STEPS + 1)) for r in results)
        assert any(moved for r in results for _, moved in r["rebalanced_moves"])
        assert results[0]["rebalanced_placement"] != _shuffled(4, 1).phy2log.tolist()
    assert ref_log[-1][1] < ref_log[0][1], "the reference must actually train"
    assert max(n for _, _, n in ref_log) > 1.0, "clipping must be active (max_grad_norm=1.0)"
    for rank_results in results:
        _check_log(rank_results[name], ref_log, list(range(1, len(ref_log) + 1)))
    saved = transformers.AutoModelForCausalLM.from_pretrained(str(root / f"{name}-final"), dtype=torch.float32)
    got = dict(saved.named_parameters())
    assert got.keys() == ref_params.keys()
    for n, p in ref_params.items():
        torch.testing.assert_close(got[n], p, rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    assert (root / f"{name}-final" / "moeshard_placement.json").is_file()


@pytest.mark.parametrize(
    "name", ["ep4-resume-same", "ep4-resume-other", "ep2x2-resume-other", "ep4-redundant-resume-other"]
)
def test_resume_continues_exactly(runs, name):
    root, refs, results = runs
    run = name.split("-resume")[0]
    for rank_results in results:
        assert rank_results[f"{name}-mode"] == ("same" if name.endswith("same") else "relocated")
        _check_log(rank_results[name], refs["trainer"][0], [3, 4])
        _check_log(rank_results[name], rank_results[run], [3, 4])
    ckpt = root / run / "checkpoint-2"
    assert sorted(os.listdir(ckpt / "moeshard_optimizer")) == [f"rank-{r:05d}-of-{WORLD:05d}.pt" for r in range(WORLD)]


def test_resume_on_another_mesh_is_refused_on_every_rank(runs):
    _, _, results = runs
    for rank_results in results:
        msg = rank_results["refused"]
        assert msg is not None, "resuming EP=4 optimizer state on EP=2 x efsdp=2 must raise"
        assert "sharded otherwise" in msg and "mesh [4] -> [2, 2]" in msg and "save_only_model=True" in msg, msg


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
