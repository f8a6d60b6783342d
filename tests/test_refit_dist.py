"""Tier 3: ``moeshard.refit`` on 4 gloo ranks (2 nodes x 2), the tiny float32 Qwen3-MoE and
DeepSeek-V3 (MLA, a dense first layer, a shared expert, ``e_score_correction_bias`` buffers)
trained one AdamW step, into vLLM-shaped engine tensors (:mod:`moeshard.plan.engines`).

One spawned group runs, per family:

1. colocated: the trainer on all 4 ranks (EP=2 x expert-FSDP=2, a redundant placement), the
   engine on the same 4 ranks: TP=2 x DP=2 with experts TP-split (bf16: cast on the way), and
   TP=2 with EP=4 and a redundant placement of its own (fp32, ``verify=True``);
2. disjoint 2+2: the trainer on ranks 0-1 (EP=2), the engine on ranks 2-3 (TP=2, EP=2, a
   redundant placement); a second training step, the engine's placement changed, refit again;
3. (Qwen3-MoE) a failure on one rank during the third install group: every rank raises, the
   groups before are new, the others old; a corrupted delivery: ``verify`` names its box;
4. sglang's layout in block FP8 (float32 scales; UE8M0 scales as e8m0 bytes, DeepSeek-V3's
   shared expert fused as the last expert slot, on a placement without redundant slots as sglang
   requires), and faults in block-FP8 tensors that
   ``verify`` names on every rank.

Every engine tensor is compared bit for bit with the same fusion and sharding built in one
process (:func:`_expected`, written from vLLM's rules, not from the planner) from the trainer's
full logical weights; bytes sent equal the plan's and the least any plan sends.

A real process killed mid-refit (a trainer rank, then an engine rank) runs in 4-rank groups of
its own (a dead rank breaks its group): see "a rank lost during a refit" below.
"""

from __future__ import annotations

import time
from unittest import mock

import numpy as np
import pytest
import torch

import tiny_hf
from mp import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

WORLD, LWS, NUM_EXPERTS, PAD = 4, 2, 8, 64
FIRST_MOE = {"qwen3_moe": 0, "deepseek_v3": 1}


def _error_of(call, errors) -> str | None:
    """The message of the error of type ``errors`` that ``call()`` raised, or None."""
    try:
        call()
    except errors as e:
        return str(e)
    return None


def _engine_placement(seed: int, ep: int):
    """``int64[NUM_LAYERS, P]``: every expert once plus redundant copies, shuffled (EPLB-like)."""
    return np.asarray(tiny_hf.shuffled_redundant(NUM_EXPERTS, ep, seed).phy2log, np.int64)


def _permuted_placement(seed: int):
    """``int64[NUM_LAYERS, NUM_EXPERTS]``: every expert once, shuffled (EPLB without redundant
    slots, the only placement sglang loads a fused shared expert into)."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(NUM_EXPERTS) for _ in range(tiny_hf.NUM_LAYERS)]).astype(np.int64)


def _layout(family: str, ranks, tp: int, ep: int, p2l, dtype=None):
    from moeshard.plan.engines import vllm_deepseek_v3, vllm_qwen3_moe

    if family == "qwen3_moe":
        return vllm_qwen3_moe(tiny_hf.NUM_LAYERS, ranks, tp=tp, ep=ep, phy2log=p2l, dtype=dtype)
    return vllm_deepseek_v3(tiny_hf.NUM_LAYERS + 1, ranks, tp=tp, ep=ep, phy2log=p2l, first_k_dense=1, dtype=dtype)


# -- the reference: vLLM's fusion and sharding in one process --------------------------------


def _tp(w: torch.Tensor, tp: int, r: int, dim: int) -> torch.Tensor:
    return w.chunk(tp, dim)[r]


def _expected(family: str, name: str, full: dict, tp: int, ep: int, p2l, erank: int, dtype):
    """Engine rank ``erank``'s tensor ``name`` (engine ranks 0..n-1; TP rank ``erank % tp``) from
    the trainer's logical weights ``full``; for the vocabulary, only its first rows (the rest is
    the engine's padding)."""
    r = erank % tp
    trainer = name.replace("block_sparse_moe", "mlp")
    if name.endswith("qkv_proj.weight"):
        p = name.rsplit(".", 2)[0]
        w = torch.cat([_tp(full[f"{p}.{x}_proj.weight"], tp, r, 0) for x in "qkv"])
    elif name.endswith("fused_qkv_a_proj.weight"):
        p = name.rsplit(".", 2)[0]
        w = torch.cat([full[f"{p}.q_a_proj.weight"], full[f"{p}.kv_a_proj_with_mqa.weight"]])
    elif name.endswith(("o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight")):
        w = _tp(full[trainer], tp, r, 1)
    elif name.endswith(("q_b_proj.weight", "kv_b_proj.weight")):
        w = _tp(full[trainer], tp, r, 0)
    elif name.endswith("gate_up_proj.weight"):
        p = name.rsplit(".", 2)[0]
        w = torch.cat([_tp(full[f"{p}.gate_proj.weight"], tp, r, 0), _tp(full[f"{p}.up_proj.weight"], tp, r, 0)])
    elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
        v = full[trainer]
        per = -(-v.shape[0] // PAD) * PAD // tp
        w = v[r * per : (r + 1) * per]
    elif name.endswith(("w13_weight", "w2_weight")):
        layer = int(name.split(".")[2]) - FIRST_MOE[family]
        row = np.asarray(p2l)[layer]
        spr = len(row) // ep
        slots = row if ep == 1 else row[erank * spr : (erank + 1) * spr]
        p = name.rsplit(".", 1)[0]
        out = []
        for e in slots.tolist():
            if name.endswith("w13_weight"):
                gate, up = full[f"{p}.gate_up_proj"][e].chunk(2)
                out.append(torch.cat([gate, up]) if ep > 1 else torch.cat([_tp(gate, tp, r, 0), _tp(up, tp, r, 0)]))
            else:
                d = full[f"{p}.down_proj"][e]
                out.append(d if ep > 1 else _tp(d, tp, r, 1))
        w = torch.stack(out)
    else:
        w = full[trainer]
    if name.endswith("e_score_correction_bias"):
        return w.clone()
    return w.to(dtype) if dtype is not None else w.clone()


def _engine_tensors(family, layout, full, erank, dtype):
    """Fresh engine tensors of the layout's shapes (from the reference), filled with a marker
    so that a write anywhere shows."""
    out = {}
    for t in layout.tensors:
        ref = _expected(family, t.name, full, layout.tp, layout.ep, layout.phy2log, erank, dtype)
        shape = list(ref.shape)
        if t.pad_to > 1:
            shape[0] = -(-full[t.segments[0].source].shape[0] // PAD) * PAD // layout.tp
        out[t.name] = torch.full(shape, -7.0, dtype=ref.dtype)
    return out


def _mismatches(family, layout, dst, full, erank, dtype) -> list[str]:
    bad = []
    for t in layout.tensors:
        ref = _expected(family, t.name, full, layout.tp, layout.ep, layout.phy2log, erank, dtype)
        got = dst[t.name]
        n = ref.shape[0]
        if got.dtype != ref.dtype or not torch.equal(got[:n], ref):
            bad.append(t.name)
        if t.pad_to > 1 and not bool((got[n:] == -7.0).all()):
            bad.append(f"{t.name} padding written")
    return bad


def _full(model, pl) -> dict:
    full = tiny_hf.full_params(model, pl)
    full.update(tiny_hf.persistent_buffers(model))
    return full


def _train(model, ids, group):
    """One AdamW step on this trainer rank's ``ids`` (collective over the trainer's ranks)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _colocated(family: str, ckpt: str) -> dict:
    import torch.distributed as dist

    import moeshard

    rank = dist.get_rank()
    pl = tiny_hf.shuffled_redundant(NUM_EXPERTS, 2, 3)
    model = tiny_hf.meta_model(family, 2, pl, efsdp=2)
    moeshard.load(model, ckpt, placement=pl)
    _train(model, tiny_hf.data(WORLD)[rank : rank + 1], None)
    full = _full(model, pl)
    out = {}
    # TP=2 x DP=2, experts TP-split, bf16 engine (fp32 trainer: cast before sending).
    lay = _layout(family, range(4), 2, 1, _engine_placement(5, 1), dtype="bfloat16")
    dst = _engine_tensors(family, lay, full, rank, torch.bfloat16)
    rep = moeshard.refit(model, dst, lay)
    out["tp_bf16"] = dict(bad=_mismatches(family, lay, dst, full, rank, torch.bfloat16), rep=rep)
    # TP=2 with EP=4 and the engine's redundant placement, fp32, verified.
    lay = _layout(family, range(4), 2, 4, _engine_placement(7, 4))
    dst = _engine_tensors(family, lay, full, rank, None)
    rep = moeshard.refit(model, dst, lay, verify=True)
    out["ep4"] = dict(bad=_mismatches(family, lay, dst, full, rank, None), rep=rep)
    if family == "qwen3_moe":
        out.update(_failures(model, pl, lay, dst, full, rank))
        out.update(_batches(model, pl, lay, dst, rank))
    out["sglang_fp8"] = _sglang_fp8(family, model, pl, rank)
    out["ue8m0"] = _ue8m0_fused_and_verified(family, model, pl, rank)
    return out


class _OnFire:
    """A local tensor whose every view raises: a failure injected into a refit's exchange."""

    def __init__(self, message: str):
        self.message = message

    def __getitem__(self, index):
        raise RuntimeError(self.message)


def _failures(model, pl, lay, dst, full, rank) -> dict:
    """A rank failing in the third install group, then a corrupted delivery under verify."""

    import moeshard
    import moeshard.ops.refit as refit_mod

    out = {}
    # A staging budget of the smallest install group's engine bytes: one group per batch.
    one = min(_group_bytes(lay, dst).values())
    old = {k: v.clone() for k, v in dst.items()}
    _train(model, tiny_hf.data(WORLD)[rank : rank + 1], None)
    new_full = _full(model, pl)
    real = refit_mod.ViewExchange
    calls = [0]

    class Failing(real):
        """Rank 3's deliveries fail in the third install group."""

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            calls[0] += 1
            if rank == 3 and calls[0] == 3:
                self.targets = [_OnFire("disk on fire")] * len(self.targets)

    with mock.patch.object(refit_mod, "ViewExchange", Failing):
        out["fail"] = _error_of(lambda: moeshard.refit(model, dst, lay, staging_bytes=one), moeshard.DistributedError)
    groups = sorted({t.group for t in lay.tensors})
    done = set(groups[:2])
    wrong = []
    for t in lay.tensors:
        want_new = t.group in done
        if want_new:
            ref = _expected("qwen3_moe", t.name, new_full, lay.tp, lay.ep, lay.phy2log, rank, None)
            ok = torch.equal(dst[t.name][: ref.shape[0]], ref)
        else:
            ok = torch.equal(dst[t.name], old[t.name])
        if not ok:
            wrong.append((t.name, "new" if want_new else "old"))
    out["after_fail"] = wrong
    out["changed_groups"] = sorted({t.group for t in lay.tensors if not torch.equal(dst[t.name], old[t.name])})

    # A delivery corrupted on engine rank 1 (one element of layer 1's o_proj): verify names it.
    o_proj = next(j for j, t in enumerate(lay.tensors) if t.name == "model.layers.1.self_attn.o_proj.weight")

    class Corrupt(real):
        def install(self):
            super().install()
            if rank == 1 and self.held[o_proj]:
                self.targets[o_proj].view(-1)[0] += 1.0

    with mock.patch.object(refit_mod, "ViewExchange", Corrupt):
        out["verify"] = _error_of(lambda: moeshard.refit(model, dst, lay, verify=True), refit_mod.RefitVerifyError)

    # Rank 2's views of its trainer shards fail in the second install group (it sends from
    # them): every rank raises within seconds (not at the backend's timeout), only the first
    # group installed.
    _train(model, tiny_hf.data(WORLD)[rank : rank + 1], None)
    before = {k: v.clone() for k, v in dst.items()}
    made = [0]

    class BadView(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made[0] += 1
            if rank == 2 and made[0] == 2:
                self.sources = [_OnFire("view on fire")] * len(self.sources)

    t0 = time.monotonic()
    with mock.patch.object(refit_mod, "ViewExchange", BadView):
        out["bad_view"] = _error_of(
            lambda: moeshard.refit(model, dst, lay, staging_bytes=one), moeshard.DistributedError
        )
    out["bad_view_s"] = time.monotonic() - t0
    out["bad_view_changed"] = sorted({t.group for t in lay.tensors if not torch.equal(dst[t.name], before[t.name])})
    return out


# -- sglang's layout with block FP8 ------------------------------------------------------------

FP8_BLOCK = (8, 8)  # the tiny models' TP parts are whole blocks of 8 (128 in a real model)


def _sglang_layout(family: str, ranks, tp: int, ep: int, p2l):
    from moeshard.plan.engines import sglang_deepseek_v3, sglang_qwen3_moe

    kw = dict(tp=tp, ep=ep, phy2log=p2l, dtype="bfloat16", quant="fp8", block=FP8_BLOCK)
    if family == "qwen3_moe":
        return sglang_qwen3_moe(tiny_hf.NUM_LAYERS, ranks, **kw)
    return sglang_deepseek_v3(tiny_hf.NUM_LAYERS + 1, ranks, first_k_dense=1, **kw)


def _expected_sglang(family, t, full, lay, erank):
    """Engine rank ``erank``'s tensor ``t`` of an sglang layout from the trainer's logical
    weights: the same fusion and sharding as vLLM's (:func:`_expected`; sglang's DeepSeek-V3
    calls the fused projection ``fused_qkv_a_proj_with_mqa``), in bf16, then for a quantized
    tensor moeshard's block quantizer (checked against vLLM's formula in test_engine_quant)
    computed here in one process: ``(values, scale)``. Also the float32 assembly."""
    from moeshard.ops.engine_quant import block_fp8

    name = t.name.replace("fused_qkv_a_proj_with_mqa", "fused_qkv_a_proj")
    x32 = _expected(family, name, full, lay.tp, lay.ep, lay.phy2log, erank, None)
    if name.endswith("e_score_correction_bias"):
        return x32, None, x32
    ref = _expected(family, name, full, lay.tp, lay.ep, lay.phy2log, erank, torch.bfloat16)
    if t.quant is None:
        return ref, None, x32
    q, scale = block_fp8(ref, t.block)
    return q, scale, x32


def _sglang_fp8(family: str, model, pl, rank: int) -> dict:
    """sglang's layout, block FP8 (8 x 8) on TP=2 x DP=2 with experts TP-split, boxes staged in
    bf16: every quantized tensor bit for bit the one-process assembly + quantization, within the
    quantizer's bound of the float32 weights; every other tensor bit for bit."""
    import moeshard

    full = _full(model, pl)
    lay = _sglang_layout(family, range(4), 2, 1, _engine_placement(5, 1))
    dst, want = {}, {}
    for t in lay.tensors:
        ref, scale, x32 = _expected_sglang(family, t, full, lay, rank)
        shape = list(ref.shape)
        if t.pad_to > 1:
            shape[0] = -(-full[t.segments[0].source].shape[0] // PAD) * PAD // lay.tp
        dst[t.name] = torch.full(shape, -7.0).to(ref.dtype)
        if scale is not None:
            dst[t.scale_name] = torch.full(scale.shape, -7.0)
        want[t.name] = (ref, scale, x32)
    rep = moeshard.refit(model, dst, lay, verify=True)
    bad, loose = [], []
    for t in lay.tensors:
        ref, scale, x32 = want[t.name]
        got = dst[t.name]
        n = ref.shape[0]
        if scale is None:
            if got.dtype != ref.dtype or not torch.equal(got[:n], ref) or not bool((got[n:] == -7.0).all()):
                bad.append(t.name)
            continue
        if got.dtype != torch.float8_e4m3fn or not torch.equal(got.view(torch.uint8), ref.view(torch.uint8)):
            bad.append(t.name)
        if not torch.equal(dst[t.scale_name], scale):
            bad.append(t.scale_name)
        # Dequantized, within bf16's rounding (2^-9) plus E4M3's (2^-4 of a normal value, 2^-10 of
        # the block's scale for a subnormal one) of the trainer's float32 weights.
        s = dst[t.scale_name].repeat_interleave(t.block[0], -2).repeat_interleave(t.block[1], -1)
        s = s[..., : got.shape[-2], : got.shape[-1]]
        err = (got.float() * s - x32).abs()
        if not bool((err <= (x32.abs() * (2.0**-4 + 2.0**-8) + s * 2.0**-10)).all()) or not err.max() > 0:
            loose.append(t.name)
    # Bad engine tensors on one rank raise on every rank before anything is written: a missing
    # scale on rank 2, a bf16 tensor where the layout says block FP8 on rank 1.
    errors = {}
    before = {k: v.clone() for k, v in dst.items()}
    o = "model.layers.1.self_attn.o_proj.weight"
    for case, bad_rank, broken in (
        ("no_scale", 2, {k: v for k, v in dst.items() if k != o + "_scale_inv"}),
        ("bf16", 1, {**dst, o: dst[o].to(torch.bfloat16)}),
    ):
        try:
            moeshard.refit(model, broken if rank == bad_rank else dst, lay)
            errors[case] = None
        except moeshard.DistributedError as e:
            errors[case] = str(e)
    unchanged = all(torch.equal(v.view(torch.uint8), before[k].view(torch.uint8)) for k, v in dst.items())
    return dict(
        bad=bad,
        loose=loose,
        rep=rep,
        quantized=sum(t.quant is not None for t in lay.tensors),
        errors=errors,
        unchanged=unchanged,
    )


def _disjoint(family: str, ckpt: str, trainer_group, mesh) -> dict:
    import torch.distributed as dist

    import moeshard

    rank = dist.get_rank()
    model = full = None
    pl = moeshard.Placement.contiguous(num_layers=tiny_hf.NUM_LAYERS, num_logical=NUM_EXPERTS, num_ranks=2)
    if rank < 2:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(tiny_hf.config(family))
        moeshard.parallelize(model, mesh, pl)
        moeshard.load(model, ckpt, placement=pl, group=trainer_group)
        _train(model, tiny_hf.data(WORLD)[rank : rank + 1], trainer_group)
        full = _full(model, pl)
    full = moeshard.collectives.broadcast_object(full, src=0)
    out = {"rounds": []}
    p2l = _engine_placement(11, 2)
    lay = _layout(family, (2, 3), 2, 2, p2l)
    dst = _engine_tensors(family, lay, full, rank - 2, None) if rank >= 2 else None
    for step in range(2):
        rep = moeshard.refit(model, dst, lay, verify=True)
        bad = _mismatches(family, lay, dst, full, rank - 2, None) if rank >= 2 else []
        out["rounds"].append(dict(bad=bad, rep=rep))
        if step == 0:
            if rank < 2:
                _train(model, tiny_hf.data(WORLD)[rank : rank + 1], trainer_group)
                full = _full(model, pl)
            full = moeshard.collectives.broadcast_object(full, src=0)
            # The engine rebalanced: the same slots, other experts in them.
            new = _engine_placement(12, 2)
            assert not np.array_equal(new, p2l)
            lay = lay.with_placement(new)
    return out


def _worker(ckpts: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    out = {f: dict(colocated=_colocated(f, ckpts[f])) for f in tiny_hf.MATRIX}
    # The trainer's ranks 0-1 (made once, last: a mesh of some ranks creates its process groups
    # on those ranks only, so no group is created on every rank after it).
    trainer_group = dist.new_group([0, 1])
    mesh = DeviceMesh("cpu", torch.tensor([[0, 1]]), mesh_dim_names=("efsdp", "ep"))
    for f in tiny_hf.MATRIX:
        out[f]["disjoint"] = _disjoint(f, ckpts[f], trainer_group, mesh)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("refit")
    ckpts = {}
    for family in tiny_hf.MATRIX:
        ckpts[family] = str(root / family)
        tiny_hf.save_checkpoint(family, ckpts[family])
    return run_ranks(_worker, ckpts, world=WORLD, local_world=LWS, timeout=400)


@pytest.mark.parametrize("family", tiny_hf.MATRIX)
def test_colocated_refit_equals_one_process_fusion(runs, family):
    for case in ("tp_bf16", "ep4"):
        reps = [r[family]["colocated"][case]["rep"] for r in runs]
        assert [r[family]["colocated"][case]["bad"] for r in runs] == [[]] * WORLD, case
        # Bytes sent are the plan's (each cell once per receiving rank that lacks it).
        assert sum(r.bytes_sent_rank for r in reps) == reps[0].peer_bytes > 0
        assert sum(r.bytes_received_rank for r in reps) == reps[0].peer_bytes
        assert all(
            r.engine_tensors_rank == len(_layout(family, range(4), 2, 1, _engine_placement(5, 1)).tensors) for r in reps
        )
    assert sum(r[family]["colocated"]["ep4"]["rep"].verified_boxes_rank for r in runs) > 0


@pytest.mark.parametrize("family", tiny_hf.MATRIX)
def test_disjoint_refit_follows_the_engines_placement(runs, family):
    for step in range(2):
        rounds = [r[family]["disjoint"]["rounds"][step] for r in runs]
        assert [x["bad"] for x in rounds] == [[]] * WORLD, step
        reps = [x["rep"] for x in rounds]
        # Disjoint: nothing is copied within a rank; the trainer ranks send, the engine receives.
        assert reps[0].copy_bytes == 0
        assert sum(r.bytes_sent_rank for r in reps[:2]) == reps[0].peer_bytes > 0
        assert sum(r.bytes_received_rank for r in reps[2:]) == reps[0].peer_bytes
        assert all(r.bytes_sent_rank == 0 for r in reps[2:])


def test_failure_mid_refit_leaves_each_layer_all_old_or_all_new(runs):
    outs = [r["qwen3_moe"]["colocated"] for r in runs]
    assert all(o["fail"] is not None and "disk on fire" in o["fail"] for o in outs)
    assert [o["after_fail"] for o in outs] == [[]] * WORLD
    assert all(o["changed_groups"] == [-1, 0] for o in outs)


def test_a_failing_send_view_raises_on_every_rank_within_seconds(runs):
    outs = [r["qwen3_moe"]["colocated"] for r in runs]
    assert all(o["bad_view"] is not None and "view on fire" in o["bad_view"] for o in outs)
    assert all(o["bad_view_s"] < 60 for o in outs)  # the process group's timeout is 120 s
    assert all(o["bad_view_changed"] == [-1] for o in outs)


def test_verify_names_the_corrupted_box(runs):
    outs = [r["qwen3_moe"]["colocated"]["verify"] for r in runs]
    assert all(o is not None and "model.layers.1.self_attn.o_proj.weight" in o and "rank 1" in o for o in outs)


@pytest.mark.parametrize("family", tiny_hf.MATRIX)
def test_sglang_block_fp8_refit_equals_one_process_quantization(runs, family):
    outs = [r[family]["colocated"]["sglang_fp8"] for r in runs]
    assert [o["bad"] for o in outs] == [[]] * WORLD
    assert [o["loose"] for o in outs] == [[]] * WORLD
    assert outs[0]["quantized"] > 0
    reps = [o["rep"] for o in outs]
    assert sum(r.bytes_sent_rank for r in reps) == reps[0].peer_bytes > 0
    # Boxes travel in bf16, the staging dtype: the same bytes as the bf16 refit of the same boxes
    # (vLLM's names, the same TP, DP and placement), half the float32 trainer's.
    assert reps[0].peer_bytes == runs[0][family]["colocated"]["tp_bf16"]["rep"].peer_bytes
    assert sum(r.verified_boxes_rank for r in reps) > 0  # the unquantized tensors' boxes


@pytest.mark.parametrize("family", tiny_hf.MATRIX)
def test_bad_block_fp8_engine_tensors_raise_on_every_rank(runs, family):
    outs = [r[family]["colocated"]["sglang_fp8"] for r in runs]
    o = "model.layers.1.self_attn.o_proj.weight"
    assert all(f"lacks engine tensor {o}_scale_inv" in x["errors"]["no_scale"] for x in outs)
    assert all(f"{o}: [32, 16] torch.bfloat16 here" in x["errors"]["bf16"] for x in outs)
    assert all(x["unchanged"] for x in outs)


# -- a rank lost during a refit ------------------------------------------------------------------
#
# A real process dies mid-refit (SIGKILL from a hook in its own refit), once a trainer rank and
# once an engine rank, the trainer and the engine on 2 + 2 disjoint ranks (engine TP=2 x EP=2):
# every survivor raises PeerLostError within seconds, and every surviving engine rank holds, per
# install group, either the old weights or the new, never a mix (each compared with the fusion
# built in one process, :func:`_expected`). One 4-rank group per scenario, since a dead rank
# breaks its group; the ranks are forked from a forkserver that has imported torch, transformers
# and moeshard. As a crashing job does, survivors record what they raised and exit at once,
# which is also what unblocks survivors waiting on them: gloo tells only a dead rank's direct
# peers (as in test_lost_rank.py).

LOST_VICTIM = 3
LOST_BACKSTOP_S = 60  # the process group's timeout: a backstop the survivors must fail well before
LOST_WITHIN_S = 20
# scenario -> (trainer ranks, engine ranks, the install agreement the victim dies at, and when:
# "agreed" as it returns, before any of the next group's transfers; "staged" after its part of
# that group's transfers, the group's staging filled, before the agreement), and the install
# groups every surviving engine rank must then hold new (the plan's first ones; the rest old).
LOST = {
    "trainer": ((2, 3), (0, 1), 1, "agreed", 1),
    "engine": ((0, 1), (2, 3), 3, "staged", 2),
}


def _die_in_refit(at: int, when: str) -> None:
    """Make this process SIGKILL itself at its ``at``-th refit install agreement (``when``: see
    :data:`LOST`)."""
    import os
    import signal

    from moeshard import collectives

    real = collectives.agree
    seen = [0]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def agree(step, what, *args, **kwargs):
        if not what.startswith("moeshard.refit: install"):
            return real(step, what, *args, **kwargs)
        seen[0] += 1
        if seen[0] == at and when == "staged":
            run = step

            def step():
                run()
                die()

        out = real(step, what, *args, **kwargs)
        if seen[0] == at and when == "agreed":
            die()
        return out

    collectives.agree = agree


def _lost_scenario(scenario: str, rank: int, ckpt: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import moeshard
    from moeshard.models.describe import local_tensor

    trainers, engines, at, when, _ = LOST[scenario]
    family = "qwen3_moe"
    trainer_group = dist.new_group(list(trainers))
    mesh = DeviceMesh("cpu", torch.tensor([list(trainers)]), mesh_dim_names=("efsdp", "ep"))
    pl = moeshard.Placement.contiguous(num_layers=tiny_hf.NUM_LAYERS, num_logical=NUM_EXPERTS, num_ranks=2)
    model = full = None
    if rank in trainers:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(tiny_hf.config(family))
        moeshard.parallelize(model, mesh, pl)
        moeshard.load(model, ckpt, placement=pl, group=trainer_group)
        full = _full(model, pl)
    old = moeshard.collectives.broadcast_object(full, src=trainers[0])
    lay = _layout(family, engines, 2, 2, _engine_placement(11, 2))
    erank = engines.index(rank) if rank in engines else None
    dst = _engine_tensors(family, lay, old, erank, None) if erank is not None else None
    out = {"first": []}
    # One install group per batch (as the staging budget of a larger model gives), so that the
    # victim dies between the install agreements of one refit.
    one = moeshard.collectives.broadcast_object(
        min(_group_bytes(lay, dst).values()) if dst is not None else None, src=engines[0]
    )
    moeshard.refit(model, dst, lay, staging_bytes=one)
    if dst is not None:
        out["first"] = _mismatches(family, lay, dst, old, erank, None)
    if model is not None:  # a training step's worth of change: every parameter moves
        with torch.no_grad():
            for p in model.parameters():
                local_tensor(p).add_(0.5)
        full = _full(model, pl)
    new = moeshard.collectives.broadcast_object(full, src=trainers[0])
    if rank == LOST_VICTIM:
        _die_in_refit(at, when)
    t0 = time.monotonic()
    try:
        moeshard.refit(model, dst, lay, staging_bytes=one)
        out["raised"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["raised"] = (type(e).__name__, str(e))
    out["seconds"] = time.monotonic() - t0
    if dst is not None:
        # Per install group (in the plan's order), what its engine tensors on this rank hold.
        held: dict[int, set] = {}
        for t in lay.tensors:
            got = dst[t.name]
            was = _expected(family, t.name, old, lay.tp, lay.ep, lay.phy2log, erank, None)
            now = _expected(family, t.name, new, lay.tp, lay.ep, lay.phy2log, erank, None)
            n = was.shape[0]
            state = "new" if torch.equal(got[:n], now) else "old" if torch.equal(got[:n], was) else f"{t.name}: a mix"
            if t.pad_to > 1 and not bool((got[n:] == -7.0).all()):
                state = f"{t.name}: padding written"
            held.setdefault(t.group, set()).add(state)
        out["groups"] = [(g, sorted(held[g])) for g in sorted(held)]
    return out


def _lost_main(scenario: str, rank: int, port: int, ckpt: str, out_dir: str) -> None:
    import datetime
    import os
    import pickle

    from mp import set_rank_env

    set_rank_env(rank, WORLD, LWS, port)
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=LOST_BACKSTOP_S)
    )
    try:
        result = ("ok", _lost_scenario(scenario, rank, ckpt))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)  # at once, as a crashing job does: no teardown beside a dead peer


@pytest.fixture(scope="module")
def lost_refits(tmp_path_factory):
    import pickle
    import signal

    from moeshard._launch import free_port
    from mp import forkserver, start_and_join

    root = tmp_path_factory.mktemp("refit_lost")
    ckpt = str(root / "ckpt")
    tiny_hf.save_checkpoint("qwen3_moe", ckpt)
    ctx = forkserver(__name__)
    results = {}
    for scenario in LOST:
        out_dir = root / scenario
        out_dir.mkdir()
        port = free_port()
        procs = [
            ctx.Process(target=_lost_main, args=(scenario, r, port, ckpt, str(out_dir)), daemon=True)
            for r in range(WORLD)
        ]
        alive = start_and_join(procs, 3 * LOST_BACKSTOP_S)
        assert not alive, f"{scenario}: ranks {alive} still running (a hang)"
        assert procs[LOST_VICTIM].exitcode == -signal.SIGKILL, (
            f"{scenario}: the victim exited {procs[LOST_VICTIM].exitcode}"
        )
        results[scenario] = {}
        for r in range(WORLD):
            if r == LOST_VICTIM:
                continue
            with open(out_dir / f"{r}.pkl", "rb") as f:
                kind, value = pickle.load(f)
            assert kind == "ok", f"{scenario}: rank {r} failed outside the refit:\n{value}"
            results[scenario][r] = value
    return results


@pytest.mark.dist
@pytest.mark.parametrize("scenario", list(LOST))
def test_a_rank_lost_mid_refit_raises_everywhere_and_leaves_each_layer_old_or_new(lost_refits, scenario):
    trainers, engines, _, _, num_new = LOST[scenario]
    for rank, got in lost_refits[scenario].items():
        assert got["first"] == [], f"rank {rank}: the first refit wrote {got['first']}"
        assert got["raised"] is not None, f"{scenario}: rank {rank} did not raise"
        kind, text = got["raised"]
        assert kind == "PeerLostError", f"{scenario}: rank {rank} raised {kind}: {text}"
        assert text.startswith("moeshard.refit: install group"), text
        assert got["seconds"] < LOST_WITHIN_S, f"{scenario}: rank {rank} raised after {got['seconds']:.1f}s"
        if rank in engines:
            groups = [g for g, _ in got["groups"]]
            want = [(g, ["new"] if i < num_new else ["old"]) for i, g in enumerate(groups)]
            assert got["groups"] == want, f"{scenario}: engine rank {rank}"


# -- install batches and packed messages (several install groups per schedule) -------------


def _group_bytes(lay, dst) -> dict:
    """One engine rank's staged bytes per install group (every engine rank's alike)."""
    out: dict = {}
    for t in lay.tensors:
        x = dst[t.name]
        out[t.group] = out.get(t.group, 0) + x.numel() * x.element_size()
    return out


def _batches(model, pl, lay, dst, rank) -> dict:
    """(Qwen3-MoE, EP=4 engine) The tensors outside the layers and layer 0 in one install
    batch, layer 1 in the next; rank 3's deliveries into layer 0's tensors fail: every tensor of
    the batch stays old (those outside the layers too, which arrived whole), and the next batch
    never runs. Then a refit with the default budget: one batch, and the small
    pieces between two ranks in a round go as one message."""
    import moeshard
    import moeshard.ops.refit as refit_mod
    from moeshard.plan.refit import install_batches

    out = {}
    per = _group_bytes(lay, dst)
    budget = per[-1] + per[0]
    group_of = np.asarray([t.group for t in lay.tensors])
    nbytes = np.asarray([dst[t.name].numel() * dst[t.name].element_size() for t in lay.tensors])
    out["batches"] = install_batches(group_of, nbytes, budget)
    _train(model, tiny_hf.data(WORLD)[rank : rank + 1], None)
    new_full = _full(model, pl)
    before = {k: v.clone() for k, v in dst.items()}
    real = refit_mod.ViewExchange

    class FailsInLayer0(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            if rank == 3:
                fire = _OnFire("layer 0 on fire")
                self.targets = [fire if t.group == 0 else x for t, x in zip(lay.tensors, self.targets)]

    with mock.patch.object(refit_mod, "ViewExchange", FailsInLayer0):
        out["batch_fail"] = _error_of(
            lambda: moeshard.refit(model, dst, lay, staging_bytes=budget), moeshard.DistributedError
        )
    out["batch_changed"] = sorted({t.group for t in lay.tensors if not torch.equal(dst[t.name], before[t.name])})

    # The default budget: one batch; count the P2P messages this rank posts.
    posted = [0]
    p2p = moeshard.collectives.p2p

    def counting(*a, **k):
        posted[0] += 1
        return p2p(*a, **k)

    moeshard.collectives.p2p = counting
    try:
        rep = moeshard.refit(model, dst, lay)
    finally:
        moeshard.collectives.p2p = p2p
    plan = next(iter(refit_mod._PLANS.values()))
    s = plan.plans[0].schedule
    out["one_batch"] = dict(
        rep=rep,
        messages=posted[0],
        piece_ops=int(((s.sends.src == rank) | (s.sends.dst == rank)).sum()),
        rounds=plan.num_rounds,
        bad=_mismatches("qwen3_moe", lay, dst, new_full, rank, None),
    )

    # A repeated refit agrees on the kept plans inside the argument exchange: one all-gather and
    # the install's all-reduce. A kept plan whose pair check differs on one rank is not taken:
    # planned and agreed again, it raises on every rank, and nothing is written.
    import dataclasses

    import torch.distributed as dist

    counts = {"all_gather": 0, "all_reduce": 0, "broadcast": 0}
    real_calls = {k: getattr(dist, k) for k in counts}

    def counting(name):
        def call(*a, **k):
            counts[name] += 1
            return real_calls[name](*a, **k)

        return call

    for k in counts:
        setattr(dist, k, counting(k))
    try:
        moeshard.refit(model, dst, lay)
    finally:
        for k, f in real_calls.items():
            setattr(dist, k, f)
    out["repeat_collectives"] = dict(counts)
    ((key, kept),) = refit_mod._PLANS.items()
    if rank == 1:
        refit_mod._PLANS[key] = dataclasses.replace(kept, check=(kept.check + 1) % 2**64)
    _train(model, tiny_hf.data(WORLD)[rank : rank + 1], None)
    before = {k: v.clone() for k, v in dst.items()}
    try:
        moeshard.refit(model, dst, lay)
        out["tampered"] = None
    except moeshard.DistributedError as e:
        out["tampered"] = str(e)
    finally:
        refit_mod._PLANS.clear()
        refit_mod._PLANS[key] = kept
    out["tampered_changed"] = [k for k, v in dst.items() if not torch.equal(v, before[k])]
    return out


def test_a_failure_in_a_batch_leaves_every_layer_of_the_batch_old(runs):
    outs = [r["qwen3_moe"]["colocated"] for r in runs]
    assert outs[0]["batches"] == ((-1, 0), (1,))
    assert all(o["batch_fail"] is not None and "layer 0 on fire" in o["batch_fail"] for o in outs)
    # The tensors outside the layers arrived whole on every rank, but their batch failed: they
    # stay old with layer 0 (and layer 1, whose batch never ran), on every rank.
    assert all(o["batch_changed"] == [] for o in outs)


def test_one_batch_packs_the_pieces_of_a_pair_into_one_message(runs):
    outs = [r["qwen3_moe"]["colocated"]["one_batch"] for r in runs]
    assert [o["bad"] for o in outs] == [[]] * WORLD
    reps = [o["rep"] for o in outs]
    assert all(r.batches == 1 and r.groups == 3 for r in reps)
    assert sum(r.bytes_sent_rank for r in reps) == reps[0].peer_bytes > 0
    # Every piece is small: at most one message per peer and direction in each round.
    for o in outs:
        assert o["messages"] <= 2 * (WORLD - 1) * o["rounds"] < o["piece_ops"]


# -- UE8M0 scales, sglang's fused shared expert, verify of block-FP8 tensors -------------------
#
# In the colocated group, per family: sglang's layout with power-of-two block scales held as
# e8m0 bytes (EP=4, TP=2; Qwen3-MoE on a redundant placement, DeepSeek-V3 with its shared expert
# fused as the last expert slot on a placement without redundant slots, as sglang requires),
# verified; for DeepSeek-V3 also the fused shared expert TP-split
# (EP=1) in bf16; then three faults under verify, each named on every rank: a wrong piece into
# a quantized tensor's staging, a scale and an FP8 value changed as they are installed.


def _sglang_fused_layout(family: str, ranks, tp: int, ep: int, p2l, **kw):
    from moeshard.plan.engines import sglang_deepseek_v3, sglang_qwen3_moe

    if family == "qwen3_moe":
        return sglang_qwen3_moe(tiny_hf.NUM_LAYERS, ranks, tp=tp, ep=ep, phy2log=p2l, **kw)
    return sglang_deepseek_v3(
        tiny_hf.NUM_LAYERS + 1, ranks, tp=tp, ep=ep, phy2log=p2l, first_k_dense=1, fuse_shared_experts=True, **kw
    )


def _expected_fused(family: str, t, full: dict, lay, erank: int, dtype):
    """Engine rank ``erank``'s tensor ``t`` of :func:`_sglang_fused_layout` in ``dtype``:
    :func:`_expected`'s fusion and sharding, and for ``w13_weight`` / ``w2_weight`` with a fused
    shared expert one more slot, the trainer's ``shared_experts`` (gate then up; whole under EP,
    TP-split like the other slots without), as sglang loads it."""
    name = t.name.replace("fused_qkv_a_proj_with_mqa", "fused_qkv_a_proj")
    w = _expected(family, name, full, lay.tp, lay.ep, lay.phy2log, erank, dtype)
    if not t.shared:
        return w
    r, sh = erank % lay.tp, name.rsplit(".", 2)[0] + ".shared_experts"
    if name.endswith("w13_weight"):
        parts = [full[f"{sh}.{n}_proj.weight"] for n in ("gate", "up")]
        extra = torch.cat(parts if lay.ep > 1 else [_tp(x, lay.tp, r, 0) for x in parts])
    else:
        down = full[f"{sh}.down_proj.weight"]
        extra = down if lay.ep > 1 else _tp(down, lay.tp, r, 1)
    return torch.cat([w, (extra if dtype is None else extra.to(dtype))[None]])


def _fused_tensors(family, lay, full, rank, dtype):
    """Fresh engine tensors (marker-filled, e8m0 scales too) and per tensor ``(values, scale or
    None, float32 assembly)`` expected on engine rank ``rank``: quantized ones by
    :func:`moeshard.ops.engine_quant.quantize` of the one-process assembly in ``dtype``."""
    from moeshard.ops import engine_quant

    dst, want = {}, {}
    for t in lay.tensors:
        x32 = _expected_fused(family, t, full, lay, rank, None)
        ref = x32 if t.name.endswith("e_score_correction_bias") else _expected_fused(family, t, full, lay, rank, dtype)
        scale = None
        if t.quant is not None:
            ref, scale = engine_quant.quantize(t, ref)
            dst[t.scale_name] = torch.full_like(scale.view(torch.uint8), 7).view(scale.dtype)
        shape = list(ref.shape)
        if t.pad_to > 1:
            shape[0] = -(-full[t.segments[0].source].shape[0] // PAD) * PAD // lay.tp
        dst[t.name] = torch.full(shape, -7.0).to(ref.dtype)
        want[t.name] = (ref, scale, x32)
    return dst, want


def _fused_mismatches(lay, dst, want) -> tuple[list, list]:
    """Engine tensors (or scales) not bit for bit the expected ones; quantized tensors whose
    dequantized values are not within bf16's and E4M3's rounding of the float32 weights."""
    bad, loose = [], []
    for t in lay.tensors:
        ref, scale, x32 = want[t.name]
        got, n = dst[t.name], ref.shape[0]
        if got.dtype != ref.dtype or not torch.equal(got[:n].view(torch.uint8), ref.view(torch.uint8)):
            bad.append(t.name)
        if t.pad_to > 1 and not bool((got[n:] == -7.0).all()):
            bad.append(f"{t.name} padding written")
        if scale is None:
            continue
        if not torch.equal(dst[t.scale_name].view(torch.uint8), scale.view(torch.uint8)):
            bad.append(t.scale_name)
        s = dst[t.scale_name].float().repeat_interleave(t.block[0], -2).repeat_interleave(t.block[1], -1)
        s = s[..., : got.shape[-2], : got.shape[-1]]
        err = (got.float() * s - x32).abs()
        if not bool((err <= (x32.abs() * (2.0**-4 + 2.0**-8) + s * 2.0**-10)).all()) or not err.max() > 0:
            loose.append(t.name)
    return bad, loose


def _ue8m0_fused_and_verified(family: str, model, pl, rank: int) -> dict:
    import moeshard
    import moeshard.ops.refit as refit_mod
    from moeshard.ops import engine_quant

    full = _full(model, pl)
    out = {}
    kw = dict(dtype="bfloat16", quant="fp8", block=FP8_BLOCK, scale_fmt="ue8m0", scale_dtype="float8_e8m0fnu")
    p2l = _engine_placement(7, 4) if family == "qwen3_moe" else _permuted_placement(7)
    lay = _sglang_fused_layout(family, range(4), 2, 4, p2l, **kw)
    dst, want = _fused_tensors(family, lay, full, rank, torch.bfloat16)
    rep = moeshard.refit(model, dst, lay, verify=True)
    bad, loose = _fused_mismatches(lay, dst, want)
    out["ep4"] = dict(bad=bad, loose=loose, rep=rep, shapes={t.name: tuple(dst[t.name].shape) for t in lay.tensors})
    if family != "deepseek_v3":
        return out
    # The shared expert TP-split with the other slots (EP=1), bf16, no quantization.
    lay1 = _sglang_fused_layout(family, range(4), 2, 1, _permuted_placement(5), dtype="bfloat16")
    dst1, want1 = _fused_tensors(family, lay1, full, rank, torch.bfloat16)
    moeshard.refit(model, dst1, lay1)
    out["tp"] = dict(
        bad=_fused_mismatches(lay1, dst1, want1)[0], shapes={t.name: tuple(dst1[t.name].shape) for t in lay1.tensors}
    )

    # Faults under verify (the EP=4 UE8M0 layout): every rank must name the box.
    o, w13, w2 = (
        f"model.layers.1.{n}" for n in ("self_attn.o_proj.weight", "mlp.experts.w13_weight", "mlp.experts.w2_weight")
    )
    real_ex, real_install = refit_mod.ViewExchange, engine_quant.install
    o_idx = next(j for j, t in enumerate(lay.tensors) if t.name == o)

    class WrongPiece(real_ex):
        """Rank 1's layer-1 o_proj (quantized) staged one element off once its pieces arrived."""

        def run(self):
            stats = super().run()
            if rank == 1 and self.targets[o_idx] is not None:
                self.targets[o_idx].view(-1)[0] += 1.0
            return stats

    def bad_scale(x, scale, staged):  # rank 2: the last slot's first scale doubled as installed
        real_install(x, scale, staged)
        if rank == 2 and x is dst[w13]:
            scale[-1].view(torch.uint8).view(-1)[0] += 1

    def bad_value(x, scale, staged):  # rank 3: one FP8 value of slot 0 changed as installed
        real_install(x, scale, staged)
        if rank == 3 and x is dst[w2]:
            x[0].view(torch.uint8).view(-1)[5] ^= 1

    for case, ex, install in (
        ("piece", WrongPiece, real_install),
        ("scale", real_ex, bad_scale),
        ("value", real_ex, bad_value),
    ):
        with mock.patch.object(refit_mod, "ViewExchange", ex), mock.patch.object(engine_quant, "install", install):
            out[case] = _error_of(lambda: moeshard.refit(model, dst, lay, verify=True), refit_mod.RefitVerifyError)
    return out


@pytest.mark.parametrize("family", tiny_hf.MATRIX)
def test_ue8m0_e8m0_refit_equals_one_process_quantization(runs, family):
    outs = [r[family]["colocated"]["ue8m0"]["ep4"] for r in runs]
    assert [o["bad"] for o in outs] == [[]] * WORLD
    assert [o["loose"] for o in outs] == [[]] * WORLD
    reps = [o["rep"] for o in outs]
    assert sum(r.bytes_sent_rank for r in reps) == reps[0].peer_bytes > 0
    # Every delivered box checked, the quantized tensors' too (the EP=4 experts are all quantized).
    assert all(r.verified_boxes_rank > 0 for r in reps)


def test_sglang_fused_shared_expert_equals_one_process_fusion(runs):
    w13 = "model.layers.1.mlp.experts.w13_weight"
    for case, slots in (("ep4", NUM_EXPERTS // 4), ("tp", NUM_EXPERTS)):
        outs = [r["deepseek_v3"]["colocated"]["ue8m0"][case] for r in runs]
        assert [o["bad"] for o in outs] == [[]] * WORLD, case
        assert all(o["shapes"][w13][0] == slots + 1 for o in outs), case  # the placement's slots + the shared one
        assert not any("shared_experts" in n for n in outs[0]["shapes"])


def test_verify_names_a_wrong_block_fp8_box_on_every_rank(runs):
    outs = [r["deepseek_v3"]["colocated"]["ue8m0"] for r in runs]
    e = "model.layers.1.mlp.experts"
    shared = NUM_EXPERTS // 4  # the shared expert's slot
    for o in outs:
        assert (
            o["piece"] is not None and "rank 1: engine tensor model.layers.1.self_attn.o_proj.weight at" in o["piece"]
        )
        assert "as staged before quantization (bfloat16), differs from box" in o["piece"]
        assert o["scale"] is not None and f"rank 2: engine tensor {e}.w13_weight slot {shared}: its scale" in o["scale"]
        assert f"{e}.w13_weight_scale_inv blocks [[0, " in o["scale"]
        assert o["value"] is not None and f"rank 3: engine tensor {e}.w2_weight slot 0 at" in o["value"]
        assert "its installed FP8 values differ from the quantization of what arrived" in o["value"]


def test_a_repeated_refit_agrees_in_one_exchange_and_a_kept_plan_mismatch_raises_everywhere(runs):
    outs = [r["qwen3_moe"]["colocated"] for r in runs]
    assert [o["repeat_collectives"] for o in outs] == [{"all_gather": 1, "all_reduce": 1, "broadcast": 0}] * WORLD
    assert all(o["tampered"] is not None and "pair check does not sum to 0" in o["tampered"] for o in outs)
    assert [o["tampered_changed"] for o in outs] == [[]] * WORLD
