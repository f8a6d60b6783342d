"""Tier 3: ``moeshard.reshard`` on 4 gloo ranks (2 nodes x 2), tiny float32 Qwen3-MoE and
DeepSeek-V3 (MLA, a dense first layer, a shared expert, ``e_score_correction_bias`` buffers).

The old model of each family: EP=4 with redundant experts, HSDP dense (2 replica groups, one per
node), loaded and trained 2 AdamW steps with two param groups (decay / no decay), betas and
weight decay of its own and an lr a scheduler set (its weights and moments differ from the
checkpoint's). Then:

1. planned resizes with every rank holding its shards (EP=2 x expert-FSDP=2 FSDP, contiguous
   placement; for Qwen3-MoE also EP=4 FSDP with another redundant placement): every new tensor
   equals the old model's, bit for bit; 0 bytes read from storage; the optimizer's moments move
   with their parameters and its param groups' hyperparameters with their groups (no buffer
   gets optimizer state; for DeepSeek-V3 from a layout described at start-up, before the
   optimizer had state), so 2 more steps give the losses the old model gives (within 1e-6);
2. node 1's shards lost (ranks 2 and 3 pass ``old=None``, as joiners): dense weights and buffers
   come from node 0's HSDP replica, experts with a copy on node 0 from it, and exactly the
   experts whose every copy was on node 1 from the checkpoint (their bytes read, once; logged);
3. the same loss under training (an optimizer passed): every rank raises StaleStateError naming
   the lost experts, and the new model and optimizer are exactly as before (DeepSeek-V3); with
   ``experts_from_storage="warn"`` the experts are read and their moments start at zero;
   a new optimizer whose param groups do not match the old one's is refused, nothing changed;
4. (Qwen3-MoE) the same loss without HSDP: a dense box has no live holder, and every rank raises
   StaleStateError (nothing read); with ``dense_from_storage="warn"`` the box is read;
5. (Qwen3-MoE) one rank's bad input at each check that can fail locally: every rank raises
   within seconds.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

import tiny_hf
from mp import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

WORLD, LWS, LR, STEPS = 4, 2, 1e-3, 2
NUM_EXPERTS = 8
OLD_LR = 5e-4  # what the old optimizer's scheduler sets (LR x 0.5)
OLD_BETAS, OLD_DECAY = (0.85, 0.99), 0.1
FIRST_MOE = {"qwen3_moe": 0, "deepseek_v3": 1}  # the decoder layer of MoE layer 0
BAD_WITHIN_S = 10  # one rank's bad input: every rank raises within this


def _placement(seed: int, ep: int = 4):
    return tiny_hf.shuffled_redundant(NUM_EXPERTS, ep, seed)


def _full(model, pl) -> dict:
    return {k: v.numpy() for k, v in tiny_hf.full_params(model, pl).items()}


def _buffers(model) -> dict:
    return {k: v.detach().clone().numpy() for k, v in model.named_buffers() if k.endswith("e_score_correction_bias")}


def _adamw(model, **kw):
    """AdamW over two param groups: weight matrices (decayed) and the rest (not)."""
    ps = list(model.named_parameters())
    decay = [p for n, p in ps if p.dim() >= 2]
    rest = [p for n, p in ps if p.dim() < 2]
    wd = kw.pop("weight_decay", 0.01)
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}], **kw)


def _hyper(opt) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _snapshot(model, opt) -> dict:
    """This rank's local tensors of ``model`` (None while on the meta device) and ``opt``'s state."""
    from moeshard.models.describe import local_tensor

    tensors = {n: local_tensor(t).detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    state = {
        (i, k): (local_tensor(v).clone() if isinstance(v, torch.Tensor) else v)
        for i, p in enumerate(model.parameters())
        for k, v in opt.state.get(p, {}).items()
    }
    return dict(tensors=tensors, state=state, hyper=_hyper(opt))


def _same_snapshot(a: dict, b: dict) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return (
                isinstance(y, torch.Tensor)
                and x.shape == y.shape
                and x.dtype == y.dtype
                and (x.is_meta or torch.equal(x, y))
            )
        return x == y

    return (
        a["hyper"] == b["hyper"]
        and a["state"].keys() == b["state"].keys()
        and all(eq(a["state"][k], b["state"][k]) for k in a["state"])
        and a["tensors"].keys() == b["tensors"].keys()
        and all(eq(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
    )


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _family(family: str, ckpt: str, log: _Log) -> dict:
    import torch.distributed as dist

    import moeshard

    rank = dist.get_rank()
    ids = tiny_hf.data(WORLD)[rank : rank + 1]
    pl0 = _placement(1)
    old = tiny_hf.meta_model(family, 4, pl0, replicate=2)
    moeshard.load(old, ckpt, placement=pl0)
    early = moeshard.describe_shards(old)  # at start-up: no optimizer state yet
    opt0 = _adamw(old, lr=LR, betas=OLD_BETAS, weight_decay=OLD_DECAY)
    torch.optim.lr_scheduler.LambdaLR(opt0, lambda step: 0.5)
    tiny_hf.train_steps(old, opt0, ids, STEPS)
    layout = moeshard.describe_shards(old, opt0)
    old_full = _full(old, pl0)
    old_buffers = _buffers(old)
    out: dict = {"layout_digest": layout.digest(), "resize": [], "old_hyper": _hyper(opt0)}

    # 1. planned resizes, every rank holding its shards
    targets = [(2, 2, 1, moeshard.Placement.contiguous(tiny_hf.NUM_LAYERS, NUM_EXPERTS, 2))]
    if family == "qwen3_moe":
        targets.append((4, 1, 1, _placement(7)))
    for ep, efsdp, replicate, pl in targets:
        new = tiny_hf.meta_model(family, ep, pl, efsdp=efsdp, replicate=replicate)
        opt = _adamw(new, lr=LR)
        # DeepSeek-V3 reshards from the layout taken at start-up: the state old_optimizer holds
        # now is what is carried
        rep = moeshard.reshard(
            new, early if family == "deepseek_v3" else layout, old, optimizer=opt, old_optimizer=opt0
        )
        full = _full(new, pl)
        same = sorted(k for k in old_full if np.array_equal(full[k], old_full[k]))
        buffers = _buffers(new)
        out["resize"].append(
            dict(
                same=same,
                buffers_same=buffers.keys() == old_buffers.keys()
                and all(np.array_equal(buffers[k], old_buffers[k]) for k in buffers),
                stateful_buffers=sorted(n for n, b in new.named_buffers() if b in opt.state),
                num_state=len(opt.state),
                num_params=len(list(new.parameters())),
                hyper=_hyper(opt),
                read=rep.bytes_read_rank,
                storage=rep.storage_bytes,
                boxes=rep.storage_boxes,
                peer=rep.peer_bytes,
                received=rep.bytes_received_rank,
                staged=rep.peak_staging_bytes_rank,
                losses=tiny_hf.train_steps(new, opt, ids, STEPS),
            )
        )

    # 2. node 1's shards lost: dense from the node-0 replica, experts from live copies or storage
    lost = rank >= 2
    new = tiny_hf.meta_model(family, 4, pl0, replicate=2)
    log.lines.clear()
    rep = moeshard.reshard(new, None if lost else layout, None if lost else old, ckpt)
    full = _full(new, pl0)  # collective
    buffers = _buffers(new)
    out["lost"] = dict(
        full=full if rank == 0 else None,
        buffers_same=all(np.array_equal(buffers[k], old_buffers[k]) for k in old_buffers),
        boxes=rep.storage_boxes,
        experts=rep.experts_from_storage,
        read=rep.bytes_read_rank,
        storage=rep.storage_bytes,
        dense=rep.dense_from_storage,
        joined=rep.joined,
        log=list(log.lines),
    )

    # 3. (DeepSeek-V3) the same loss under training: lost experts refused by default, nothing
    # changed; or read
    if family == "deepseek_v3":
        _training_loss(out, family, ckpt, log, (layout, old, opt0), ids)

    # the reference: the old model's next steps
    out["ref_losses"] = tiny_hf.train_steps(old, opt0, ids, STEPS)
    out["old_full"] = old_full if rank == 0 else None
    out["old"], out["opt0"], out["layout"] = old, opt0, layout
    return out


def _training_loss(out: dict, family: str, ckpt: str, log: _Log, olds: tuple, ids) -> None:
    import torch.distributed as dist

    import moeshard

    layout, old, opt0 = olds
    lost = dist.get_rank() >= 2
    pl0 = _placement(1)
    new = tiny_hf.meta_model(family, 4, pl0, replicate=2)
    moeshard.load(new, ckpt, placement=pl0)  # real tensors, to compare after the refusal
    opt = _adamw(new, lr=LR)
    before = _snapshot(new, opt)
    args = (None, None) if lost else (layout, old)
    kw = dict(optimizer=opt, old_optimizer=None if lost else opt0)
    try:
        moeshard.reshard(new, *args, ckpt, **kw)
        out["train_refused"] = None
    except moeshard.DistributedError as e:
        out["train_refused"] = (type(e).__name__, str(e))
    out["train_unchanged"] = _same_snapshot(before, _snapshot(new, opt))
    # a new optimizer whose groups the old one's cannot give: refused, nothing changed
    one_group = torch.optim.AdamW(new.parameters(), lr=LR)
    before = _snapshot(new, one_group)
    try:
        moeshard.reshard(
            new, *args, ckpt, optimizer=one_group, old_optimizer=kw["old_optimizer"], experts_from_storage="warn"
        )
        out["groups_refused"] = None
    except moeshard.DistributedError as e:
        out["groups_refused"] = str(e)
    out["groups_unchanged"] = _same_snapshot(before, _snapshot(new, one_group))
    log.lines.clear()
    rep = moeshard.reshard(new, *args, ckpt, **kw, experts_from_storage="warn")
    moments = [
        {k: v.numpy() for k, v in tiny_hf.full_params(m, pl0, of=lambda p, o=o: o.state[p]["exp_avg"]).items()}
        for m, o in ((new, opt), (old, opt0))
    ]
    out["train_warned"] = dict(
        moments=moments if dist.get_rank() == 0 else None,
        experts=rep.experts_from_storage,
        zeroed=rep.states_zeroed,
        log=list(log.lines),
        hyper=_hyper(opt),
        steps=tiny_hf.train_steps(new, opt, ids, 1),
    )


def _timed(fn) -> tuple:
    t0 = time.monotonic()
    try:
        fn()
        return (None, None, time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return (type(e).__name__, str(e), time.monotonic() - t0)


def _bad_inputs(f: dict, ckpt: str) -> dict:
    """Each case: rank 3's input is bad at one check that can fail locally, the others' right."""
    import torch.distributed as dist

    import moeshard

    rank = dist.get_rank()
    bad = rank == 3
    old, opt0, layout = f["old"], f["opt0"], f["layout"]
    pl = moeshard.Placement.contiguous(tiny_hf.NUM_LAYERS, NUM_EXPERTS, 2)
    new = tiny_hf.meta_model("qwen3_moe", 2, pl, efsdp=2)
    opt = _adamw(new, lr=LR)
    full = dict(optimizer=opt, old_optimizer=opt0)
    other = tiny_hf.meta_model("qwen3_moe", 2, _placement(3, 2) if bad else pl, efsdp=2)
    other_layout = moeshard.describe_shards(new) if bad else layout
    missing_param = dict(old.named_parameters())
    missing_param.pop("model.layers.1.mlp.experts.down_proj")
    cases = {
        "dense_from_storage": lambda: moeshard.reshard(
            new, layout, old, ckpt, **full, dense_from_storage="bogus" if bad else "raise"
        ),
        "experts_from_storage": lambda: moeshard.reshard(
            new, layout, old, ckpt, **full, experts_from_storage="sometimes" if bad else None
        ),
        "optimizer without old_optimizer": lambda: moeshard.reshard(
            new, layout, old, ckpt, optimizer=opt, old_optimizer=None if bad else opt0
        ),
        "optimizer on one rank": lambda: moeshard.reshard(new, layout, old, ckpt, **(full if bad else {})),
        "old_tensors missing a parameter": lambda: moeshard.reshard(
            new, layout, missing_param if bad else old, ckpt, **full
        ),
        "old_tensors not given": lambda: moeshard.reshard(new, layout, None if bad else old, ckpt, **full),
        "new optimizer missing a parameter": lambda: moeshard.reshard(
            new,
            layout,
            old,
            ckpt,
            optimizer=torch.optim.AdamW(list(new.parameters())[1:]) if bad else opt,
            old_optimizer=opt0,
        ),
        "checkpoint not a path": lambda: moeshard.reshard(new, layout, old, 17 if bad else ckpt, **full),
        "topology of another size": lambda: moeshard.reshard(
            new, layout, old, ckpt, **full, topology=moeshard.Topology(2, 1) if bad else None
        ),
        "storage mode": lambda: moeshard.reshard(new, layout, old, ckpt, **full, storage="single" if bad else "auto"),
        "another placement": lambda: moeshard.reshard(other, layout, old, ckpt),
        "another old layout": lambda: moeshard.reshard(new, other_layout, old, ckpt),
    }
    return {name: _timed(fn) for name, fn in cases.items()}


def _worker(ckpts: dict) -> dict:
    log = _Log()
    logging.getLogger("moeshard").addHandler(log)
    out = {family: _family(family, ckpt, log) for family, ckpt in ckpts.items()}
    out["bad"] = _bad_inputs(out["qwen3_moe"], ckpts["qwen3_moe"])
    out["qwen3_moe"]["plain"] = _plain(ckpts["qwen3_moe"])
    for f in tiny_hf.MATRIX:
        for k in ("old", "opt0", "layout"):
            out[f].pop(k)
    return out


def _plain(ckpt: str) -> dict:
    """4. without HSDP: a dense box with no live holder is refused on every rank, or read with "warn"."""
    import torch.distributed as dist

    import moeshard

    lost = dist.get_rank() >= 2
    pl0 = _placement(1)
    plain = tiny_hf.meta_qwen3(4, pl0)
    moeshard.load(plain, ckpt, placement=pl0)
    plain_layout = moeshard.describe_shards(plain)
    new = tiny_hf.meta_qwen3(4, pl0)
    out = {}
    try:
        moeshard.reshard(new, None if lost else plain_layout, None if lost else plain, ckpt)
        out["refused"] = None
    except moeshard.StaleStateError as e:
        out["refused"] = str(e)
    rep = moeshard.reshard(
        new, None if lost else plain_layout, None if lost else plain, ckpt, dense_from_storage="warn"
    )
    full = _full(new, pl0)
    out["warned"] = dict(
        dense=rep.dense_from_storage, read=rep.bytes_read_rank, full=full if dist.get_rank() == 0 else None
    )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    ckpts, references = {}, {}
    for family in tiny_hf.MATRIX:
        ckpts[family] = str(root / family)
        tiny_hf.save_checkpoint(family, ckpts[family])
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpts[family], dtype=torch.float32)
        references[family] = {k: v.detach().clone().numpy() for k, v in model.named_parameters()}
    return references, run_ranks(_worker, ckpts, world=WORLD, local_world=LWS, timeout=280)


def _only_on(pl, ranks: set[int]) -> list[tuple[int, int]]:
    """``(MoE layer, expert)`` whose every copy is on ``ranks`` (EP=4)."""
    spr = pl.num_physical // 4
    out = []
    for layer, row in enumerate(pl.phy2log):
        for e in range(NUM_EXPERTS):
            if {int(p) // spr for p in np.flatnonzero(row == e)} <= ranks:
                out.append((layer, e))
    return out


def _lost_experts(family: str) -> list[str]:
    missing = _only_on(_placement(1), {2, 3})
    assert missing, "the placement must leave some experts only on node 1"
    first = FIRST_MOE[family]
    return sorted(
        f"model.layers.{first + layer}.mlp.experts.{p}[{e}]"
        for layer, e in missing
        for p in ("down_proj", "gate_up_proj")
    )


@pytest.mark.parametrize("family", tiny_hf.MATRIX)
def test_planned_resize_moves_live_state(runs, family):
    references, results = runs
    first = results[0][family]
    names = sorted(first["old_full"])
    reference = references[family]
    assert any(not np.array_equal(first["old_full"][k], reference[k]) for k in names), "the old model must train"
    for res in results:
        r = res[family]
        assert r["layout_digest"] == first["layout_digest"]
        assert r["old_hyper"][0]["lr"] == OLD_LR and r["old_hyper"][0]["betas"] == OLD_BETAS
        for res in r["resize"]:
            assert res["same"] == names, f"tensors differ: {sorted(set(names) - set(res['same']))[:4]}"
            assert res["buffers_same"] and res["stateful_buffers"] == []
            assert res["num_state"] == res["num_params"]  # every parameter's state, nothing else's
            assert res["hyper"] == r["old_hyper"]  # lr as the scheduler set it, betas, weight decay
            assert res["read"] == 0 and res["storage"] == 0 and res["boxes"] == ()
            assert res["peer"] > 0
            np.testing.assert_allclose(res["losses"], r["ref_losses"], rtol=0, atol=1e-6)
        # The contiguous EP=2 x expert-FSDP=2 target has one delivery per received piece, each a
        # contiguous box: every piece lands straight in the new tensor, none is staged.
        assert r["resize"][0]["staged"] == 0
    assert sum(res[family]["resize"][0]["received"] for res in results) > 0


@pytest.mark.parametrize("family", tiny_hf.MATRIX)
def test_lost_node_recovers_dense_from_replica_and_reads_only_lost_experts(runs, family):
    references, results = runs
    reference = references[family]
    want = _lost_experts(family)
    for res in results:
        lost = res[family]["lost"]
        assert lost["dense"] == () and lost["buffers_same"]
        assert sorted({k for k, _ in lost["boxes"]}) == want == list(lost["experts"])
    # each missing expert's bytes read once (float32 on disk and in the model)
    expert_bytes = 4 * (2 * 16 * 32 + 32 * 16)
    lost0 = results[0][family]["lost"]
    assert sum(r[family]["lost"]["read"] for r in results) == len(want) // 2 * expert_bytes == lost0["storage"]
    assert [r[family]["lost"]["joined"] for r in results] == [False, False, True, True]
    # rank 0 logs what it read (serving: allowed, never silent)
    assert any("from the checkpoint" in line and str(lost0["storage"]) in line for line in lost0["log"]), lost0["log"]
    full, old_full = lost0["full"], results[0][family]["old_full"]
    gone = {(k.rsplit(".", 1)[0], int(k.rsplit("[", 1)[1][:-1])) for k in want}
    for name, t in full.items():
        if ".mlp.experts." not in name:
            np.testing.assert_array_equal(t, old_full[name], err_msg=name)  # live dense state, not the checkpoint's
            continue
        module = name.rsplit(".", 1)[0]
        for e in range(NUM_EXPERTS):
            src = reference if (module, e) in gone else old_full
            np.testing.assert_array_equal(t[e], src[name][e], err_msg=f"{name}[{e}]")


def test_lost_experts_under_training_are_refused_and_nothing_changes(runs):
    _, results = runs
    family = "deepseek_v3"
    want = _lost_experts(family)
    for res in results:
        r = res[family]
        kind, text = r["train_refused"]
        assert kind == "StaleStateError", text
        assert "experts have no live copy" in text and "experts_from_storage='warn'" in text
        module, e = want[0].rsplit("[", 1)
        assert module in text
        assert r["train_unchanged"], "a refused reshard changed the new model or optimizer"
        assert r["groups_refused"] is not None and "several param groups of old_optimizer" in r["groups_refused"]
        assert r["groups_unchanged"]
        warned = r["train_warned"]
        assert list(warned["experts"]) == want
        zeroed = {k.replace("::exp_avg_sq", "").replace("::exp_avg", "") for k in warned["zeroed"]}
        assert zeroed == set(want) and len(warned["zeroed"]) == 2 * len(want)
        assert warned["hyper"] == r["old_hyper"]
        assert np.isfinite(warned["steps"]).all()
    # the lost experts' moments start at zero, every other moment is the live one
    new_m, old_m = results[0][family]["train_warned"]["moments"]
    gone = {(k.rsplit(".", 1)[0], int(k.rsplit("[", 1)[1][:-1])) for k in want}
    for name, t in new_m.items():
        if ".mlp.experts." not in name:
            np.testing.assert_array_equal(t, old_m[name], err_msg=name)
            continue
        for e in range(NUM_EXPERTS):
            lost = (name.rsplit(".", 1)[0], e) in gone
            np.testing.assert_array_equal(t[e], np.zeros_like(t[e]) if lost else old_m[name][e], err_msg=f"{name}[{e}]")
    log = results[0][family]["train_warned"]["log"]
    assert any("experts have no live copy" in line for line in log), log
    assert any("reading" in line and "from the checkpoint" in line for line in log), log


def test_one_rank_bad_input_raises_on_every_rank_within_seconds(runs):
    _, results = runs
    cases = results[0]["bad"].keys()
    for case in cases:
        got = [r["bad"][case] for r in results]
        for rank, (kind, text, seconds) in enumerate(got):
            assert kind is not None, f"{case}: rank {rank} did not raise"
            assert kind in ("DistributedError", "PlanMismatchError"), (case, rank, kind, text)
            assert seconds < BAD_WITHIN_S, (case, rank, seconds)
        assert "rank 3" in got[0][1] or got[0][0] == "PlanMismatchError", (case, got[0][1])


def test_dense_box_without_live_holder_is_refused_or_warned(runs):
    references, results = runs
    reference = references["qwen3_moe"]
    for res in results:
        r = res["qwen3_moe"]["plain"]
        assert r["refused"] is not None and "dense tensors have boxes no live rank holds" in r["refused"]
        assert "model.embed_tokens.weight" in r["refused"]
        assert "model.embed_tokens.weight" in r["warned"]["dense"]
    assert sum(res["qwen3_moe"]["plain"]["warned"]["read"] for res in results) > 0
    full = results[0]["qwen3_moe"]["plain"]["warned"]["full"]
    for name, t in full.items():  # the old model was the checkpoint's: everything equals it
        np.testing.assert_array_equal(t, reference[name], err_msg=name)
