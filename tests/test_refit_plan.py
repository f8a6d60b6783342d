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
