"""Tier 1: the refit's destination side (:mod:`moeshard.plan.refit`, :mod:`moeshard.plan.engines`),
pure: need rows of a fused, TP-split, padded and expert-parallel engine layout against boxes
written out by hand; a plan from holders that cover everything sends each missing cell once;
bad layouts raise ValueError naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest

from moeshard.plan.engines import vllm_qwen3_moe
from moeshard.plan.refit import EngineLayout, EngineTensor, Segment, UnitInfo, engine_needs

INFO = UnitInfo(
    shapes={"q": (8, 4), "k": (4, 4), "v": (4, 4), "o": (6, 8), "emb": (100, 4), "gu": (6, 4), "down": (4, 3)},
    dtypes={n: "float32" for n in ("q", "k", "v", "o", "emb", "gu", "down")},
    experts=frozenset({"gu", "down"}),
    num_logical=3,
)


def _rows(needs, rank, param):
    r = needs.rows
    sel = np.flatnonzero((r.rank == rank) & (r.param == param))
    return sorted(
        (
            needs.keys[int(r.unit[i])],
            int(r.slot[i]),
            r.off[i, :2].tolist(),
            r.len[i, :2].tolist(),
            r.local[i, :2].tolist(),
        )
        for i in sel
    )


def test_fused_tp_split_padded_and_expert_rows():
    p2l = np.array([[2, 0, 1, 2]])  # 4 slots over ep=2: expert 2 twice
    lay = EngineLayout(
        (
            EngineTensor("qkv", (Segment("q"), Segment("k"), Segment("v")), shard_dim=0),
            EngineTensor("o", (Segment("o"),), shard_dim=1),
            EngineTensor("emb", (Segment("emb"),), shard_dim=0, pad_to=64),
            EngineTensor("w13", (Segment("gu", (0, 2)), Segment("gu", (1, 2))), shard_dim=0, moe_layer=0),
            EngineTensor("w2", (Segment("down"),), shard_dim=1, moe_layer=0),
        ),
        ranks=(5, 6),
        tp=2,
        ep=2,
        phy2log=p2l,
    )
    needs = engine_needs(lay, INFO, 2)
    # qkv on TP rank 1 (refit rank 6): [q rows 4:8; k rows 2:4; v rows 2:4].
    assert _rows(needs, 6, 0) == [
        ("k", -1, [2, 0], [2, 4], [4, 0]),
        ("q", -1, [4, 0], [4, 4], [0, 0]),
        ("v", -1, [2, 0], [2, 4], [6, 0]),
    ]
    assert needs.local_shapes[0] == (8, 4)
    # o: row-parallel, columns 4:8 on TP rank 1.
    assert _rows(needs, 6, 1) == [("o", -1, [0, 4], [6, 4], [0, 0])]
    assert needs.local_shapes[1] == (6, 4)
    # emb: 100 rows padded to 128, 64 per rank: rank 1 holds rows 64:100 (the rest padding).
    assert _rows(needs, 6, 2) == [("emb", -1, [64, 0], [36, 4], [0, 0])]
    assert needs.local_shapes[2] == (64, 4)
    # w13 under EP: engine rank 1 holds slots 2, 3 = experts 1, 2, whole; gate then up.
    assert _rows(needs, 6, 3) == [
        ("gu[1]", 0, [0, 0], [3, 4], [0, 0]),
        ("gu[1]", 0, [3, 0], [3, 4], [3, 0]),
        ("gu[2]", 1, [0, 0], [3, 4], [0, 0]),
        ("gu[2]", 1, [3, 0], [3, 4], [3, 0]),
    ]
    assert needs.local_shapes[3] == (2, 6, 4) and needs.local_shapes[4] == (2, 4, 3)


def test_experts_split_by_tp_without_ep():
    lay = EngineLayout(
        (EngineTensor("w13", (Segment("gu", (0, 2)), Segment("gu", (1, 2))), shard_dim=0, moe_layer=0),),
        ranks=(0, 1, 2),
        tp=1,
        ep=1,
        phy2log=np.array([[1, 0]]),
    )
    needs = engine_needs(lay, INFO, 2)
    assert needs.local_shapes == ((2, 6, 4),)
    assert _rows(needs, 2, 0)[0] == ("gu[0]", 1, [0, 0], [3, 4], [0, 0])


@pytest.mark.parametrize(
    "tensor, match",
    [
        (EngineTensor("x", (Segment("nope"),)), "no tensor nope"),
        (EngineTensor("x", (Segment("q"), Segment("o"))), "does not concatenate"),
        (EngineTensor("x", (Segment("k"),), shard_dim=0), None),  # 4 rows over tp=2: fine
        (EngineTensor("x", (Segment("down"),), shard_dim=1, moe_layer=0), "splits unevenly"),
        (EngineTensor("x", (Segment("q"),), moe_layer=0), "is an expert tensor"),
        (EngineTensor("x", (Segment("gu", (0, 4)),), moe_layer=0), "4 equal parts"),
    ],
)
def test_bad_layouts_raise_naming_the_tensor(tensor, match):
    lay = EngineLayout((tensor,), ranks=(0, 1), tp=2, ep=1, phy2log=np.array([[0, 1, 2]]))
    if match is None:
        engine_needs(lay, INFO, 2)
        return
    with pytest.raises(ValueError, match=match):
        engine_needs(lay, INFO, 2)


def test_layout_checks_its_placement_and_ranks():
    t = (EngineTensor("w2", (Segment("down"),), moe_layer=0),)
    with pytest.raises(ValueError, match="no placement"):
        EngineLayout(t, ranks=(0, 1), ep=2)
    with pytest.raises(ValueError, match="split evenly"):
        EngineLayout(t, ranks=(0, 1), ep=2, phy2log=np.array([[0, 1, 2]]))
    with pytest.raises(ValueError, match="tp=3"):
        EngineLayout(t, ranks=(0, 1), tp=3, phy2log=np.array([[0, 1]]))
    with pytest.raises(ValueError, match="placement row 0 names experts"):
        engine_needs(EngineLayout(t, ranks=(0,), phy2log=np.array([[0, 7]])), INFO, 2)


def test_vllm_qwen3_moe_names():
    lay = vllm_qwen3_moe(2, range(4), tp=2, ep=4, phy2log=np.zeros((2, 8), np.int64), dtype="bfloat16")
    names = {t.name for t in lay.tensors}
    assert {
        "model.layers.1.self_attn.qkv_proj.weight",
        "model.layers.1.mlp.experts.w13_weight",
        "model.layers.1.mlp.experts.w2_weight",
        "lm_head.weight",
    } <= names
    assert {t.group for t in lay.tensors} == {-1, 0, 1}


def _o_plan(monkeypatch=None, widen: int = 0):
    """The refit plan of a row-parallel ``o`` (6 x 8, FSDP rows over 2 trainer ranks) into TP=2
    engine ranks; ``widen``: rows this process's planner adds to o's engine local shape (as a
    rank running other code would)."""
    from moeshard.ops.refit import plan_for
    from moeshard.ops.reshard import ShardLayout, TensorLayout
    from moeshard.plan import refit as planner
    from moeshard.topology import Topology

    if widen:
        real = planner.engine_needs

        def skewed(layout, info, width):
            n = real(layout, info, width)
            shapes = tuple((s[0] + widen, *s[1:]) for s in n.local_shapes)
            return planner.EngineNeeds(n.rows, n.keys, shapes, n.dtypes)

        monkeypatch.setattr(planner, "engine_needs", skewed)
    shared = ShardLayout((TensorLayout("o", (6, 8), "float32", np.arange(2), (0,)),), None, 0, 2, -1)
    lay = EngineLayout((EngineTensor("o", (Segment("o"),), shard_dim=1, dtype="bfloat16"),), ranks=(0, 1), tp=2)
    return plan_for(shared, [0, 1], lay, Topology(world_size=2, local_world_size=2))


def test_fingerprint_covers_the_engine_local_shapes(monkeypatch):
    """Ranks whose planners give an engine tensor another local shape (each checks its engine
    tensors against its own plan, and its deliveries address them) must disagree at planning,
    not fail mid-transfer on a view outside the tensor."""
    base = _o_plan()
    assert base.needs.local_shapes == ((6, 4),)
    wide = _o_plan(monkeypatch, widen=2)
    assert wide.needs.local_shapes == ((8, 4),)
    assert [p.fingerprint for p in wide.plans] == [p.fingerprint for p in base.plans]  # same transfers
    assert wide.fingerprint != base.fingerprint


def test_need_rows_outside_the_local_shape_are_an_invariant_error(monkeypatch):
    with pytest.raises(AssertionError, match="engine tensor o: a need row outside its shape"):
        _o_plan(monkeypatch, widen=-2)


# -- sglang's layouts and block-FP8 declarations ------------------------------------------------

# DeepSeek-V3-like logical tensors: H=32, q_lora=24, kv_lora=16, rope=4, 4 heads of nope 4 + v 8
# (q_b 4 x (4 + 4) = 32 rows, kv_b 4 x (4 + 8) = 48 rows), a dense layer 0 (I=64), MoE layer 1
# (moe I=16, one shared expert).
DSV3 = {
    **{
        f"model.layers.{i}.self_attn.{n}": s
        for i in (0, 1)
        for n, s in {
            "q_a_proj.weight": (24, 32),
            "q_a_layernorm.weight": (24,),
            "q_b_proj.weight": (32, 24),
            "kv_a_proj_with_mqa.weight": (20, 32),
            "kv_a_layernorm.weight": (16,),
            "kv_b_proj.weight": (48, 16),
            "o_proj.weight": (32, 32),
        }.items()
    },
    **{f"model.layers.{i}.{n}.weight": (32,) for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")},
    "model.layers.0.mlp.gate_proj.weight": (64, 32),
    "model.layers.0.mlp.up_proj.weight": (64, 32),
    "model.layers.0.mlp.down_proj.weight": (32, 64),
    "model.layers.1.mlp.gate.weight": (8, 32),
    "model.layers.1.mlp.gate.e_score_correction_bias": (8,),
    "model.layers.1.mlp.experts.gate_up_proj": (32, 32),
    "model.layers.1.mlp.experts.down_proj": (32, 16),
    "model.layers.1.mlp.shared_experts.gate_proj.weight": (16, 32),
    "model.layers.1.mlp.shared_experts.up_proj.weight": (16, 32),
    "model.layers.1.mlp.shared_experts.down_proj.weight": (32, 16),
    "model.embed_tokens.weight": (128, 32),
    "model.norm.weight": (32,),
    "lm_head.weight": (128, 32),
}
DSV3_INFO = UnitInfo(
    shapes=DSV3,
    dtypes={n: "float32" for n in DSV3},
    experts=frozenset({"model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}),
    num_logical=8,
)


def _sgl_dsv3(**kw):
    from moeshard.plan.engines import sglang_deepseek_v3

    return sglang_deepseek_v3(2, range(2), tp=2, first_k_dense=1, phy2log=np.arange(8)[None] % 8, **kw)


def test_sglang_deepseek_v3_names_shapes_and_segments():
    """sglang's DeepseekV2AttentionMLA: ``fused_qkv_a_proj_with_mqa`` (ReplicatedLinear of
    q_lora + kv_lora + rope rows: q_a_proj then kv_a_proj_with_mqa), ``q_b_proj`` /
    ``kv_b_proj`` ColumnParallelLinear, ``o_proj`` RowParallelLinear; no ``w_kc`` / ``w_vc``
    (derived by post_load_weights); MoEGate's float32 ``e_score_correction_bias``; the unfused
    shared expert; FusedMoE's ``w13_weight`` / ``w2_weight``."""
    lay = _sgl_dsv3(dtype="bfloat16")
    needs = engine_needs(lay, DSV3_INFO, 2)
    shape = {t.name: s for t, s in zip(lay.tensors, needs.local_shapes)}
    dtype = {t.name: d for t, d in zip(lay.tensors, needs.dtypes)}
    a = "model.layers.1.self_attn"
    assert shape[f"{a}.fused_qkv_a_proj_with_mqa.weight"] == (44, 32)
    assert shape[f"{a}.q_b_proj.weight"] == (16, 24)
    assert shape[f"{a}.kv_b_proj.weight"] == (24, 16)
    assert shape[f"{a}.o_proj.weight"] == (32, 16)
    assert shape["model.layers.1.mlp.experts.w13_weight"] == (8, 16, 32)  # ep=1: every slot, I split
    assert shape["model.layers.1.mlp.experts.w2_weight"] == (8, 32, 8)
    assert shape["model.layers.1.mlp.shared_experts.gate_up_proj.weight"] == (16, 32)
    assert shape["model.layers.0.mlp.gate_up_proj.weight"] == (64, 32)
    assert dtype["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"
    assert dtype["model.layers.1.mlp.gate.weight"] == "bfloat16"
    names = set(shape)
    assert not any("w_kc" in n or "w_vc" in n or n.endswith("fused_qkv_a_proj.weight") for n in names)
    j = [t.name for t in lay.tensors].index(f"{a}.fused_qkv_a_proj_with_mqa.weight")
    assert _rows(needs, 1, j) == [
        (f"{a}.kv_a_proj_with_mqa.weight", -1, [0, 0], [20, 32], [24, 0]),
        (f"{a}.q_a_proj.weight", -1, [0, 0], [24, 32], [0, 0]),
    ]
    j = [t.name for t in lay.tensors].index(f"{a}.kv_b_proj.weight")
    assert _rows(needs, 1, j) == [(f"{a}.kv_b_proj.weight", -1, [24, 0], [24, 16], [0, 0])]


def test_sglang_qwen3_moe_and_mixtral_have_vllms_tensors():
    from moeshard.plan.engines import sglang_mixtral, sglang_qwen3_moe, vllm_mixtral, vllm_qwen3_moe

    p2l = np.zeros((2, 8), np.int64)
    for sgl, vllm in ((sglang_qwen3_moe, vllm_qwen3_moe), (sglang_mixtral, vllm_mixtral)):
        a = sgl(2, range(4), tp=2, ep=4, phy2log=p2l, dtype="bfloat16", quant="fp8")
        b = vllm(2, range(4), tp=2, ep=4, phy2log=p2l, dtype="bfloat16", quant="fp8")
        assert a.tensors == b.tensors
    names = {t.name for t in sglang_mixtral(1, range(2), tp=2, phy2log=p2l).tensors}
    assert {
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.block_sparse_moe.experts.w13_weight",
        "model.layers.0.self_attn.qkv_proj.weight",
    } <= names


def test_fp8_layouts_quantize_linear_layers_and_experts_only():
    """vLLM's and sglang's Fp8Config quantize LinearBase layers and FusedMoE; the routers are
    built with quant_config=None, embeddings / lm_head are not LinearBase, norms and the
    router's bias are not weights of a linear layer."""
    from moeshard.plan.engines import vllm_deepseek_v3, vllm_qwen3_moe

    lay = vllm_deepseek_v3(2, range(2), tp=2, first_k_dense=1, phy2log=np.zeros((1, 8), np.int64), quant="fp8")
    quant = {t.name.split(".", 3)[-1] if t.group >= 0 else t.name for t in lay.tensors if t.quant}
    assert quant == {
        "self_attn.fused_qkv_a_proj.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_up_proj.weight",
        "mlp.down_proj.weight",
        "mlp.experts.w13_weight",
        "mlp.experts.w2_weight",
        "mlp.shared_experts.gate_up_proj.weight",
        "mlp.shared_experts.down_proj.weight",
    }
    assert all(t.quant == "fp8_block" and t.block == (128, 128) for t in lay.tensors if t.quant)
    w13 = next(t for t in lay.tensors if t.name.endswith("w13_weight"))
    assert w13.scale_name == "model.layers.1.mlp.experts.w13_weight_scale_inv"
    lay = vllm_qwen3_moe(1, range(2), tp=2, phy2log=np.zeros((1, 8), np.int64), quant="fp8", scale_suffix="_scale")
    assert {t.name.split(".", 3)[-1] for t in lay.tensors if t.quant} == {
        "self_attn.qkv_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.experts.w13_weight",
        "mlp.experts.w2_weight",
    }
    assert next(t for t in lay.tensors if t.quant).scale_name.endswith(".weight_scale")
    with pytest.raises(ValueError, match="quant='int8'"):
        vllm_qwen3_moe(1, range(2), tp=2, phy2log=np.zeros((1, 8), np.int64), quant="int8")


@pytest.mark.parametrize(
    "block, tp, ep, match",
    [
        ((8, 8), 2, 1, None),  # every TP part and every fused part whole blocks of 8
        ((8, 8), 2, 2, None),
        # q_a_proj's 24 rows are not whole blocks of 16: fused_qkv_a's blocks straddle q_a / kv_a
        ((16, 8), 1, 1, r"fused_qkv_a_proj_with_mqa.weight: segment .*q_a_proj.weight has 24 along dim 0 \(it\)"),
        # q_b_proj column-parallel: 16 rows per rank, not whole blocks of 24
        ((24, 8), 2, 2, r"q_b_proj.weight: segment .* has 16 along dim 0 \(its part on each of tp=2 ranks\)"),
        # o_proj row-parallel: 16 columns per rank, not whole blocks of 32
        ((8, 32), 2, 2, r"o_proj.weight: segment .* has 16 along dim 1 \(its part on each of tp=2 ranks\)"),
        # experts TP-split (ep=1): down_proj's I=16 -> 8 columns per rank, not whole blocks of 16
        ((8, 16), 2, 1, r"experts.w2_weight: segment .* has 8 along dim 1"),
    ],
)
def test_block_fp8_refuses_blocks_that_straddle_tp_ranks_or_segments(block, tp, ep, match):
    from moeshard.plan.engines import sglang_deepseek_v3

    lay = sglang_deepseek_v3(
        2, range(2), tp=tp, ep=ep, first_k_dense=1, phy2log=np.zeros((1, 8), np.int64), quant="fp8", block=block
    )
    if match is None:
        engine_needs(lay, DSV3_INFO, 2)
        return
    with pytest.raises(ValueError, match=match):
        engine_needs(lay, DSV3_INFO, 2)


def test_block_fp8_allows_a_partial_last_part_of_a_replicated_fusion():
    """fused_qkv_a is not TP-split: its last part (kv_a, 20 rows) may end in a partial block
    (DeepSeek-V3's 576 rows in 128-blocks); the same rows split over TP must be whole blocks."""
    t = EngineTensor("f", (Segment("q"), Segment("k")), quant="fp8_block", block=(8, 4))
    engine_needs(EngineLayout((t,), ranks=(0, 1), tp=2), INFO, 2)  # q 8 rows, k 4: k is last
    t = EngineTensor("f", (Segment("q"), Segment("k")), shard_dim=0, quant="fp8_block", block=(4, 4))
    with pytest.raises(ValueError, match="segment k has 2 along dim 0"):
        engine_needs(EngineLayout((t,), ranks=(0, 1), tp=2), INFO, 2)
    t = EngineTensor("f", (Segment("gu"),), moe_layer=0, quant="fp8_block", block=(4, 4))
    with pytest.raises(ValueError, match="2-D"):
        engine_needs(
            EngineLayout((t,), ranks=(0,), phy2log=np.array([[0]])),
            UnitInfo(shapes={"gu": (6, 4, 2)}, dtypes={"gu": "float32"}, experts=frozenset({"gu"}), num_logical=1),
            3,
        )


# -- the per-rank planner against the job-wide one, and run on paper ---------------------------


def _trainer_layout(family: str, trainers, world: int, ep: int, rng):
    """A tiny trainer of ``family``'s shapes on refit-group ranks ``trainers``: dense tensors
    FSDP over them (some replicated twice, HSDP; some whole on every trainer rank), experts
    EP=``ep`` x expert-FSDP over them with a redundant placement of the trainer's own."""
    from moeshard.ops.reshard import ShardLayout, TensorLayout

    h, v, e = 8, 70, 4
    tr = np.asarray(trainers, np.int64)
    f = len(tr) // ep
    t = []

    def dense(name, shape, dtype="float32"):
        kind = rng.integers(0, 3) if len(tr) % 2 == 0 else rng.integers(0, 2) * 2
        if kind == 0:  # HSDP: two replicas, each sharded
            mesh, pl = tr.reshape(2, -1), (None, 0)
        elif kind == 1:
            mesh, pl = None, ()
        else:
            mesh, pl = tr, (0,)
        t.append(TensorLayout(name, shape, dtype, mesh, pl))

    dense("model.embed_tokens.weight", (v, h))
    dense("model.norm.weight", (h,))
    dense("lm_head.weight", (v, h))
    first = 0 if family == "qwen3_moe" else 1
    layers = 2 if family == "qwen3_moe" else 3
    slots = e + ep  # one redundant slot per EP rank
    for i in range(layers):
        a = f"model.layers.{i}.self_attn"
        if family == "qwen3_moe":
            for n, s in (("q_proj", (8, h)), ("k_proj", (4, h)), ("v_proj", (4, h)), ("o_proj", (h, 8))):
                dense(f"{a}.{n}.weight", s)
            dense(f"{a}.q_norm.weight", (2,))
            dense(f"{a}.k_norm.weight", (2,))
        else:
            for n, s in (
                ("q_a_proj", (6, h)),
                ("q_a_layernorm", (6,)),
                ("q_b_proj", (6, 6)),
                ("kv_a_proj_with_mqa", (5, h)),
                ("kv_a_layernorm", (4,)),
                ("kv_b_proj", (8, 4)),
                ("o_proj", (h, 4)),
            ):
                dense(f"{a}.{n}.weight", s)
        dense(f"model.layers.{i}.input_layernorm.weight", (h,))
        dense(f"model.layers.{i}.post_attention_layernorm.weight", (h,))
        p = f"model.layers.{i}.mlp"
        if i < first:
            for n, s in (("gate_proj", (8, h)), ("up_proj", (8, h)), ("down_proj", (h, 8))):
                dense(f"{p}.{n}.weight", s)
            continue
        dense(f"{p}.gate.weight", (e, h))
        mesh = tr.reshape(ep, f)
        t.append(TensorLayout(f"{p}.experts.gate_up_proj", (slots, 8, h), "float32", mesh, (0, 1), i - first))
        t.append(TensorLayout(f"{p}.experts.down_proj", (slots, h, 4), "float32", mesh, (0, 1), i - first))
        if family == "deepseek_v3":
            t.append(TensorLayout(f"{p}.gate.e_score_correction_bias", (e,), "float32", None, ()))
            for n, s in (("gate_proj", (4, h)), ("up_proj", (4, h)), ("down_proj", (h, 4))):
                dense(f"{p}.shared_experts.{n}.weight", s)
    p2l = np.stack(
        [rng.permutation(np.concatenate([np.arange(e), rng.integers(0, e, ep)])) for _ in range(layers - first)]
    )
    return ShardLayout(tuple(t), p2l, e, world, -1), layers


def _engine_layout(family: str, layers: int, engine, tp: int, ep: int, rng):
    from moeshard.plan.engines import vllm_deepseek_v3

    n_moe = layers - (0 if family == "qwen3_moe" else 1)
    slots = len(engine) * (2 if len(engine) > 2 else 3) if ep > 1 else 6
    p2l = np.stack(
        [rng.permutation(np.concatenate([np.arange(4), rng.integers(0, 4, slots - 4)])) for _ in range(n_moe)]
    )
    if family == "qwen3_moe":
        return vllm_qwen3_moe(layers, engine, tp=tp, ep=ep, phy2log=p2l, dtype="bfloat16")
    return vllm_deepseek_v3(layers, engine, tp=tp, ep=ep, phy2log=p2l, first_k_dense=1)


# (family, world, trainer ranks, trainer EP, engine ranks, engine TP, engine EP)
CASES = [
    ("qwen3_moe", 4, (0, 1, 2, 3), 2, (0, 1, 2, 3), 2, 1),
    ("qwen3_moe", 4, (0, 1, 2, 3), 2, (0, 1, 2, 3), 2, 4),
    ("deepseek_v3", 4, (0, 1, 2, 3), 4, (0, 1, 2, 3), 1, 4),
    ("qwen3_moe", 5, (0, 1), 2, (2, 3, 4), 1, 3),  # disjoint, odd world
    ("deepseek_v3", 7, (1, 2, 3, 4), 2, (5, 6), 2, 1),  # rank 0 neither (dead)
    ("deepseek_v3", 6, (0, 1, 2, 3), 2, (2, 3, 4, 5), 2, 4),  # half colocated
    ("qwen3_moe", 8, (0, 1, 2, 3, 4, 5), 3, (2, 3, 4, 5, 6, 7), 2, 1),
]


def _setup(case, seed):
    from moeshard.ops.refit import refit_inputs
    from moeshard.topology import Topology

    family, world, trainers, t_ep, engine, tp, ep = case
    rng = np.random.default_rng(seed)
    shared, layers = _trainer_layout(family, trainers, world, t_ep, rng)
    layout = _engine_layout(family, layers, engine, tp, ep, rng)
    got = refit_inputs(shared, trainers, layout)
    topo = Topology(world_size=world, local_world_size=2 if world % 2 == 0 else 1)
    return shared, layout, got.info, got.holds, got.itemsize, topo


def _values(info):
    """Every unit's values: distinct integers (exact in float64)."""
    out = {}
    for k, name in enumerate(info.shapes):
        shape = info.shapes[name]
        n = int(np.prod(shape))
        if name in info.experts:
            for e in range(info.num_logical):
                out[f"{name}[{e}]"] = (np.arange(n) + 1000 * (100 * k + e)).reshape(shape).astype(np.float64)
        else:
            out[name] = (np.arange(n) + 100000 * (k + 1)).reshape(shape).astype(np.float64)
    return out


def _run_on_paper(plans, holds, needs, keys, values, world):
    """Every rank's schedules run as the executor pairs them: in each round, the sends of a
    pair in the sender's row order against the receives in the receiver's. Returns the engine
    tensors ``{(rank, param): array}`` and a count of writes per element."""
    # The trainer ranks' local tensors, from their holdings.
    local = {}
    for i in range(len(holds.unit)):
        r, j, slot = int(holds.rank[i]), int(holds.param[i]), int(holds.slot[i])
        key = keys[int(holds.unit[i])]
        nd = values[key].ndim
        box = tuple(slice(o, o + n) for o, n in zip(holds.off[i, :nd], holds.len[i, :nd]))
        local[(r, j, slot)] = values[key][box]
    out, hits = {}, {}
    for j, shape in enumerate(needs.local_shapes):
        for r in set(needs.rows.rank[needs.rows.param == j].tolist()):
            out[(r, j)] = np.full(shape, np.nan)
            hits[(r, j)] = np.zeros(shape, np.int64)
    for g in range(len(plans[0].groups)):
        wire = {}  # (round, src, dst) -> [(unit, box, data)] in the sender's order
        for r in range(world):
            s = plans[r].plans[g].schedule
            for row in np.flatnonzero(s.sends.src == r):
                v, pid = int(s.sends.view[row]), int(s.sends.piece[row])
                nd = int(s.key_ndim[s.pieces.key[pid]])
                at = tuple(slice(o, o + n) for o, n in zip(s.views.off[v, :nd], s.pieces.len[pid, :nd]))
                data = local[(r, int(s.views.param[v]), int(s.views.slot[v]))][at]
                key = (int(s.sends.round[row]), r, int(s.sends.dst[row]))
                wire.setdefault(key, []).append((int(s.pieces.key[pid]), s.piece_box(pid), data))
        for r in range(world):
            s = plans[r].plans[g].schedule
            got = {}
            seen = {}
            for row in np.flatnonzero(s.sends.dst == r):
                pid = int(s.sends.piece[row])
                key = (int(s.sends.round[row]), int(s.sends.src[row]), r)
                k = seen[key] = seen.get(key, -1) + 1
                unit, box, data = wire[key][k]
                assert (unit, box) == (int(s.pieces.key[pid]), s.piece_box(pid)), "the ends of a pair disagree"
                got[pid] = data
            for key, n in seen.items():
                assert len(wire[key]) == n + 1, "a send without its receive"
            for c in range(len(s.copies.piece)):
                v, pid = int(s.copies.view[c]), int(s.copies.piece[c])
                nd = int(s.key_ndim[s.pieces.key[pid]])
                at = tuple(slice(o, o + n) for o, n in zip(s.views.off[v, :nd], s.pieces.len[pid, :nd]))
                got[pid] = local[(r, int(s.views.param[v]), int(s.views.slot[v]))][at]
            dl = s.deliveries
            for row in range(len(dl.piece)):
                pid, j, slot = int(dl.piece[row]), int(dl.param[row]), int(dl.slot[row])
                nd = int(s.key_ndim[s.pieces.key[pid]])
                at = tuple(slice(o, o + n) for o, n in zip(dl.off[row, :nd], s.pieces.len[pid, :nd]))
                at = ((slot,) if slot >= 0 else ()) + at
                out[(r, j)][at] = got[pid]
                hits[(r, j)][at] += 1
    return out, hits


def _expected(needs, keys, values):
    out = {}
    rows = needs.rows
    for i in range(len(rows.unit)):
        r, j, slot = int(rows.rank[i]), int(rows.param[i]), int(rows.slot[i])
        x = out.setdefault((r, j), np.full(needs.local_shapes[j], np.nan))
        key = keys[int(rows.unit[i])]
        nd = values[key].ndim
        src = tuple(slice(o, o + n) for o, n in zip(rows.off[i, :nd], rows.len[i, :nd]))
        at = ((slot,) if slot >= 0 else ()) + tuple(
            slice(o, o + n) for o, n in zip(rows.local[i, :nd], rows.len[i, :nd])
        )
        x[at] = values[key][src]
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_per_rank_plans_deliver_every_need_once_and_match_the_job_wide_plan(case, seed):
    """Each rank plans alone; run together (sends paired with receives in the order each end
    planned them), every engine tensor gets exactly the trainer's values, every need element
    once; bytes sent and copied equal the job-wide planner's (each box once to each rank that
    needs it); the pair check sums to 0."""
    from moeshard.plan.refit import plan_refit
    from moeshard.plan.reshard import BoxRows, Units, plan_reshard

    shared, layout, info, holds, sizes, topo = _setup(case, seed)
    world = topo.world_size
    staging, ops = 96, 6  # small budgets: pieces cut, rounds spread
    plans = [plan_refit(layout, info, holds, sizes, topo, staging, ops, r) for r in range(world)]
    assert len({p.fingerprint for p in plans}) == 1
    assert sum(p.check for p in plans) % 2**64 == 0
    needs = plans[0].needs
    keys = needs.keys
    values = _values(info)
    got, hits = _run_on_paper(plans, holds, needs, keys, values, world)
    want = _expected(needs, keys, values)
    assert set(got) == set(want)
    for k in want:
        filled = ~np.isnan(want[k])
        np.testing.assert_array_equal(got[k][filled], want[k][filled])
        assert (hits[k][filled] == 1).all() and (hits[k][~filled] == 0).all()
    # The job-wide planner on the same tables, group by group.
    ndim, _ = info.unit_columns()
    wire = np.asarray([sizes[d] for d in plans[0].wire_dtypes], np.int64)
    units = Units(keys, ndim, wire, np.zeros(len(keys), bool))
    rows = needs.rows
    group_of = np.asarray([t.group for t in layout.tensors])
    peer = copy = 0
    for g in plans[0].groups:
        sel = group_of[rows.param] == g
        n_g = BoxRows(*(a[sel] for a in (rows.unit, rows.rank, rows.param, rows.slot, rows.off, rows.len, rows.local)))
        old = plan_reshard(units, holds, n_g, topo, staging, ops)
        peer += old.peer_bytes
        copy += old.copy_bytes
    assert sum(p.sent_bytes for p in plans) == peer > 0
    assert sum(p.copy_bytes for p in plans) == copy
    # Budgets: per rank and round at most max_ops P2P ops and staging_bytes received (a piece
    # is cut to fit: no index here is larger).
    for p in plans:
        for rp in p.plans:
            s = rp.schedule
            mine = (s.sends.src == p.rank) | (s.sends.dst == p.rank)
            assert np.bincount(s.sends.round[mine]).max(initial=0) <= ops
            into = s.sends.dst == p.rank
            if into.any():
                assert np.bincount(s.sends.round[into], weights=s.pieces.bytes[s.sends.piece[into]]).max() <= staging


def test_a_rank_plans_from_its_own_rows_only():
    """A rank's plan reads only the holdings of the units it needs or holds: the other units'
    holdings dropped and the rows shuffled, its schedules are the same."""
    from moeshard.plan.refit import plan_refit
    from moeshard.plan.reshard import BoxRows

    shared, layout, info, holds, sizes, topo = _setup(CASES[5], 3)
    for rank in (0, 2, 5):
        base = plan_refit(layout, info, holds, sizes, topo, 96, 6, rank)
        needs = base.needs.rows
        rel = np.zeros(len(info.unit_keys()), bool)
        rel[needs.unit[needs.rank == rank]] = True
        rel[holds.unit[holds.rank == rank]] = True
        keep = np.flatnonzero(rel[holds.unit])[::-1]
        other = BoxRows(
            *(a[keep] for a in (holds.unit, holds.rank, holds.param, holds.slot, holds.off, holds.len, holds.local))
        )
        assert len(other.unit) < len(holds.unit)
        alone = plan_refit(layout, info, other, sizes, topo, 96, 6, rank)
        assert [p.schedule.fingerprint for p in alone.plans] == [p.schedule.fingerprint for p in base.plans]
        assert (alone.sent_bytes, alone.copy_bytes, alone.check) == (base.sent_bytes, base.copy_bytes, base.check)


def test_ends_that_plan_a_pair_differently_fail_the_pair_check(monkeypatch):
    """Two ranks whose round rules differ (as ranks running other code would) plan from the same
    inputs (same fingerprint) but the pair check's terms no longer sum to 0: refit raises on
    every rank before any data moves."""
    from moeshard.plan import pairs
    from moeshard.plan.refit import check_pairs, plan_refit

    shared, layout, info, holds, sizes, topo = _setup(CASES[3], 0)
    plans = [plan_refit(layout, info, holds, sizes, topo, 96, 6, r) for r in range(topo.world_size)]
    shares = [(p.fingerprint, p.check, p.sent_bytes, p.copy_bytes) for p in plans]
    check_pairs(shares)
    monkeypatch.setattr(pairs.PairRounds, "rounds", lambda self, src, dst, k: k)  # another round rule
    skewed = plan_refit(layout, info, holds, sizes, topo, 96, 6, 0)
    assert skewed.fingerprint == plans[0].fingerprint
    with pytest.raises(ValueError, match="pair check"):
        check_pairs([(skewed.fingerprint, skewed.check, 0, 0)] + shares[1:])
    with pytest.raises(ValueError, match="different inputs"):
        check_pairs([("x", 0, 0, 0)] + shares[1:])


def test_a_box_no_trainer_rank_holds_or_holdings_that_overlap_raise_naming_it():
    """A hole in the trainer's holdings (a shard dropped) raises on the rank that needs it,
    naming the box, the unit and the engine tensor; holdings that overlap without being equal
    (two shards of one tensor sharing rows) raise too: no box is sent twice or not at all."""
    from moeshard.plan.refit import plan_refit
    from moeshard.plan.reshard import BoxRows

    shared, layout, info, holds, sizes, topo = _setup(CASES[3], 0)  # disjoint: ranks 0-1 train
    keys = info.unit_keys()
    o = keys.index("model.layers.1.self_attn.o_proj.weight")
    rows = np.flatnonzero(holds.unit == o)
    assert len(rows) >= 2
    cols = (holds.unit, holds.rank, holds.param, holds.slot, holds.off, holds.len, holds.local)
    hole = np.setdiff1d(np.arange(len(holds.unit)), rows[:1])
    holey = BoxRows(*(a[hole] for a in cols))
    with pytest.raises(ValueError, match=r"no trainer rank holds all of box .* of model.layers.1.self_attn.o_proj"):
        plan_refit(layout, info, holey, sizes, topo, 96, 6, 2)
    wide = [a.copy() for a in cols]
    r = rows[0]
    wide[5][r, 0] += 1  # the first shard one row longer: it overlaps the next one
    with pytest.raises(ValueError, match="overlap in box"):
        plan_refit(layout, info, BoxRows(*wide), sizes, topo, 96, 6, 2)


# -- sglang's fused shared expert; UE8M0 scales ---------------------------------------------------


@pytest.mark.parametrize("ep", [1, 2])
def test_sglang_fused_shared_expert_is_the_last_slot_on_every_engine_rank(ep):
    """sglang with shared-experts fusion (``num_fused_shared_experts = 1``) loads
    ``mlp.shared_experts.*`` as expert ``n_routed_experts`` of ``FusedMoE``, which maps it on
    every EP rank to the local slot after its routed ones (``_num_local_routed``); gate then up
    in ``w13_weight``, whole under EP, TP-split like the routed slots without."""
    from moeshard.plan.engines import sglang_deepseek_v3

    p2l = np.array([[3, 1, 4, 7, 5, 0, 2, 6]])  # an EPLB permutation (no redundant slot: sglang's rule)
    lay = sglang_deepseek_v3(2, range(2), tp=2, ep=ep, first_k_dense=1, phy2log=p2l, fuse_shared_experts=True)
    names = [t.name for t in lay.tensors]
    assert not any("shared_experts" in n for n in names)
    needs = engine_needs(lay, DSV3_INFO, 2)
    e, sh = "model.layers.1.mlp.experts", "model.layers.1.mlp.shared_experts"
    j13, j2 = names.index(f"{e}.w13_weight"), names.index(f"{e}.w2_weight")
    last = 8 if ep == 1 else 4
    if ep == 1:  # TP rank r: rows 8r:8r+8 of gate and of up, columns 8r:8r+8 of down
        assert needs.local_shapes[j13] == (9, 16, 32) and needs.local_shapes[j2] == (9, 32, 8)
    else:
        assert needs.local_shapes[j13] == (5, 32, 32) and needs.local_shapes[j2] == (5, 32, 16)
    for rank in (0, 1):
        at, n = (8 * rank, 8) if ep == 1 else (0, 16)
        rows13, rows2 = _rows(needs, rank, j13), _rows(needs, rank, j2)
        assert [r for r in rows13 if r[1] == last] == [
            (f"{sh}.gate_proj.weight", last, [at, 0], [n, 32], [0, 0]),
            (f"{sh}.up_proj.weight", last, [at, 0], [n, 32], [n, 0]),
        ]
        assert [r for r in rows2 if r[1] == last] == [(f"{sh}.down_proj.weight", last, [0, at], [32, n], [0, 0])]
        # The routed slots still follow the placement: slot 0 holds physical slot 0 (ep=1) or
        # the rank's first (ep=2: rank 1's slot 0 is physical 4, expert 5).
        first = 3 if ep == 1 or rank == 0 else 5
        assert {r[0] for r in rows13 if r[1] == 0} == {f"{e}.gate_up_proj[{first}]"}
    # The trainer's shared expert goes into that slot of w13 / w2 only.
    rows = needs.rows
    on = np.isin(rows.unit, [u for u, k in enumerate(needs.keys) if k.startswith(sh)])
    assert set(rows.param[on].tolist()) == {j13, j2} and set(rows.slot[on].tolist()) == {last}


def test_a_fused_shared_expert_must_fit_an_expert_slot():
    gu, down = (Segment("gu", (0, 2)), Segment("gu", (1, 2))), (Segment("down"),)
    with pytest.raises(ValueError, match="one segment per segment"):
        EngineTensor("w13", gu, moe_layer=0, shared=(Segment("q"),))
    with pytest.raises(ValueError, match="for an expert tensor"):
        EngineTensor("o", (Segment("o"),), shared=(Segment("o"),))
    p2l = np.array([[0, 2, 1]])
    bad = {
        "is an expert parameter": EngineTensor("w2", down, moe_layer=0, shared=(Segment("down"),)),
        r"shared expert segment o \[6, 8\] is not the shape of an expert's \[4, 3\]": EngineTensor(
            "w2", down, moe_layer=0, shared=(Segment("o"),)
        ),
    }
    for match, t in bad.items():
        with pytest.raises(ValueError, match=match):
            engine_needs(EngineLayout((t,), ranks=(0,), phy2log=p2l), INFO, 2)
    # An expert-shaped dense tensor fits: [3 slots of the placement + 1, 4, 3].
    info = UnitInfo({**INFO.shapes, "sd": (4, 3)}, {**INFO.dtypes, "sd": "float32"}, INFO.experts, 3)
    t = EngineTensor("w2", down, moe_layer=0, shared=(Segment("sd"),))
    assert engine_needs(EngineLayout((t,), ranks=(0,), phy2log=p2l), info, 2).local_shapes == ((4, 4, 3),)


def _sglang_load_fused_experts(values, p2l_row, num_logical, ep, tp, erank):
    """Engine rank ``erank``'s ``w13_weight`` / ``w2_weight`` of MoE layer 1 as sglang loads
    them with the shared expert fused, in one process, following sglang's code (python/sglang/
    srt/): ``DeepseekV2WeightLoaderMixin.do_load_weights`` (models/deepseek_common/
    deepseek_weight_loader.py) loads ``mlp.shared_experts`` as expert ``n_routed_experts``;
    ``DeepseekV2MoE`` builds ``FusedMoE(num_experts=n_routed + 1 + ep_num_redundant_experts)``
    (layers/moe/fused_moe_triton/layer.py): ``_num_global_routed`` = the physical slots,
    ``_num_local_routed`` = those // ep, ``num_local_experts`` = that + 1; ``weight_loader``
    takes an id ``>= _num_global_routed`` for the shared expert, any other through
    ``ExpertLocationMetadata.logical_to_all_physical`` (eplb/expert_location.py: a map over the
    ``n_routed`` logical experts); ``_map_global_expert_id_to_local_expert_id`` puts a physical
    slot of this rank at its offset and the shared expert after the routed slots, on every rank;
    ``_load_w13`` / ``_load_w2`` split I over moe TP (``tp`` without EP, 1 with)."""
    e, sh = "model.layers.1.mlp.experts", "model.layers.1.mlp.shared_experts"
    global_routed = len(p2l_row)
    local_routed = global_routed // ep
    ep_rank = erank if ep > 1 else 0
    moe_tp, tp_rank = (tp, erank % tp) if ep == 1 else (1, 0)
    logical_to_all = [np.flatnonzero(p2l_row == x).tolist() for x in range(num_logical)]
    size = values[f"{sh}.gate_proj.weight"].shape[0] // moe_tp  # I per moe TP rank
    part = slice(size * tp_rank, size * (tp_rank + 1))
    h = values[f"{sh}.gate_proj.weight"].shape[1]
    w13 = np.full((local_routed + 1, 2 * size, h), np.nan)
    w2 = np.full((local_routed + 1, h, size), np.nan)
    for x in range(num_logical + 1):  # the checkpoint's experts, then the renamed shared expert
        if x == num_logical:
            gate, up, down = (values[f"{sh}.{n}_proj.weight"] for n in ("gate", "up", "down"))
        else:
            gu = values[f"{e}.gate_up_proj[{x}]"]
            gate, up, down = gu[: len(gu) // 2], gu[len(gu) // 2 :], values[f"{e}.down_proj[{x}]"]
        physical = [x] if x >= global_routed else logical_to_all[x]  # IndexError: x is no logical expert
        for p in physical:
            if ep_rank * local_routed <= p < (ep_rank + 1) * local_routed:
                slot = p - ep_rank * local_routed
            elif p >= global_routed:
                slot = p - global_routed + local_routed
            else:
                continue
            w13[slot, :size], w13[slot, size:], w2[slot] = gate[part], up[part], down[:, part]
    return w13, w2


@pytest.mark.parametrize("ep", [1, 2])
def test_sglang_fused_shared_expert_is_what_sglangs_loader_builds(ep):
    """Every engine rank's ``w13_weight`` / ``w2_weight`` assembled in one process from moeshard's
    need rows equals the one sglang's own loading rule builds from the same (distinct) values:
    the placement's slots, then the shared expert; every element written."""
    from moeshard.plan.engines import sglang_deepseek_v3

    p2l = np.array([[3, 1, 4, 7, 5, 0, 2, 6]])
    lay = sglang_deepseek_v3(2, range(2), tp=2, ep=ep, first_k_dense=1, phy2log=p2l, fuse_shared_experts=True)
    needs = engine_needs(lay, DSV3_INFO, 2)
    values = _values(DSV3_INFO)
    got = _expected(needs, needs.keys, values)
    names = [t.name for t in lay.tensors]
    j13, j2 = names.index("model.layers.1.mlp.experts.w13_weight"), names.index("model.layers.1.mlp.experts.w2_weight")
    for rank in (0, 1):
        w13, w2 = _sglang_load_fused_experts(values, p2l[0], DSV3_INFO.num_logical, ep, 2, rank)
        assert not np.isnan(w13).any() and not np.isnan(w2).any()
        np.testing.assert_array_equal(got[(rank, j13)], w13)
        np.testing.assert_array_equal(got[(rank, j2)], w2)


def test_a_fused_shared_expert_with_redundant_expert_slots_is_refused():
    """sglang takes an id for its fused shared expert only from ``_num_global_routed`` = the
    physical slots up; the shared expert is loaded as ``n_routed_experts``, so with EPLB's
    redundant slots (``--ep-num-redundant-experts``) its loader looks it up as a routed expert
    and fails (its rule, run here, raises IndexError): no slot of such an engine holds the
    shared expert. moeshard refuses the layout, at construction and on a new placement, rather
    than write a slot sglang never reads; the planner refuses a placement of another number
    of slots than the trainer's experts."""
    from moeshard.plan.engines import sglang_deepseek_v3

    dup = np.array([[3, 1, 4, 7, 5, 0, 2, 6, 1, 3]])  # 10 slots: experts 1 and 3 twice
    with pytest.raises(IndexError):
        _sglang_load_fused_experts(_values(DSV3_INFO), dup[0], DSV3_INFO.num_logical, 2, 2, 0)
    kw = dict(tp=2, ep=2, first_k_dense=1, fuse_shared_experts=True)
    redundant = r"phy2log row 0 places expert 1 more than once.*--ep-num-redundant-experts"
    with pytest.raises(ValueError, match=redundant):
        sglang_deepseek_v3(2, range(2), phy2log=dup, **kw)
    lay = sglang_deepseek_v3(2, range(2), phy2log=dup[:, :8], **kw)
    with pytest.raises(ValueError, match=redundant):
        lay.with_placement(dup)
    short = sglang_deepseek_v3(2, range(2), phy2log=np.array([[3, 1, 4, 0, 5, 2]]), **kw)
    with pytest.raises(ValueError, match=r"w13_weight: a fused shared expert needs a placement of the 8 experts"):
        engine_needs(short, DSV3_INFO, 2)
    # Unfused, the shared expert is a dense tensor and redundant slots are the placement's.
    assert engine_needs(sglang_deepseek_v3(2, range(2), tp=2, ep=2, first_k_dense=1, phy2log=dup), DSV3_INFO, 2)


def test_ue8m0_scales_are_declared_on_every_quantized_tensor():
    from moeshard.plan.engines import vllm_qwen3_moe

    lay = _sgl_dsv3(quant="fp8", scale_fmt="ue8m0", scale_dtype="float8_e8m0fnu")
    quant = [t for t in lay.tensors if t.quant]
    assert quant and all(t.scale_fmt == "ue8m0" and t.scale_dtype == "float8_e8m0fnu" for t in quant)
    assert all(t.scale_fmt is None and t.scale_dtype == "float32" for t in _sgl_dsv3(quant="fp8").tensors)
    # Layouts that differ only in the scales' format differ for the refit's agreement.
    assert _sgl_dsv3(quant="fp8").digest() != _sgl_dsv3(quant="fp8", scale_fmt="ue8m0").digest()
    with pytest.raises(ValueError, match="for quant='fp8' only"):
        vllm_qwen3_moe(1, range(2), tp=2, phy2log=np.zeros((1, 8), np.int64), scale_fmt="ue8m0")
    with pytest.raises(ValueError, match="scale_fmt 'e4m3'"):
        EngineTensor("o", (Segment("o"),), quant="fp8_block", scale_fmt="e4m3")
    with pytest.raises(ValueError, match="scale_dtype 'float8_e8m0fnu'"):
        EngineTensor("o", (Segment("o"),), quant="fp8_block", scale_dtype="float8_e8m0fnu")
    with pytest.raises(ValueError, match="a scale format without quant"):
        EngineTensor("o", (Segment("o"),), scale_fmt="ue8m0")
