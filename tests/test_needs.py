"""Tier 1: the array builder of needs (layout.need_table, layout.shard_boxes), pure.

* ``shard_boxes`` (numpy) gives torch's own boxes (``_compute_local_shape_and_global_offset``)
  on random shapes, meshes and placements, uneven and empty shards included.
* ``need_table`` gives the same set of needs as the per-need implementation it replaced (kept
  below as the reference) on the synthetic models of test_plan.py and the synthetic
  DeepSeek-V3 / Mixtral / Qwen checkpoints of test_cluster_plan.py, and raises its errors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from moeshard import Placement
from moeshard.box import Box, full_box
from moeshard.cluster import ClusterSpec, find_experts, make_placement, synthesize_descs, synthetic_index
from moeshard.io.header import TensorInfo
from moeshard.io.index import CheckpointIndex
from moeshard.models.adapters import ExpertParam, expert_parts
from moeshard.models.describe import ExpertRef, ParamDesc
from moeshard.models.layout import Need, check_cast, compute_needs, find_key, need_table
from moeshard.models.shards import param_boxes, rank_boxes, shard_boxes
from moeshard.plan.needs import NeedTable
from test_cluster_plan import DEEPSEEK_V3, MIXTRAL, QWEN2_MOE
from test_plan import DOWN, SMALL, build_case

# -- the reference: the per-need implementation need_table replaced -----------------------------


def _torch_boxes(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple) -> list[Box]:
    """Every mesh coordinate's box by torch itself, in row-major order (placements spelled
    torch-free, as ``moeshard plan`` synthesizes them, become torch's: int -> Shard, None ->
    Replicate)."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements = tuple(Replicate() if p is None else Shard(p) if isinstance(p, int) else p for p in placements)
    out = []
    for coord in np.ndindex(*mesh_shape):
        lshape, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        out.append(tuple(zip(offset, lshape)))
    return out


def _reference_rank_boxes(d: ParamDesc, world_size: int) -> list[tuple[int, Box]]:
    if d.mesh is None:
        return [(r, full_box(d.shape)) for r in range(world_size)]
    out = []
    for rank, box in zip(d.mesh.reshape(-1).tolist(), _torch_boxes(d.shape, d.mesh.shape, d.placements)):
        if rank >= world_size:
            raise ValueError(f"parameter {d.name}: its mesh names rank {rank} >= world size {world_size}")
        out.append((rank, box))
    return out


def compute_needs_reference(
    descs: Sequence[ParamDesc], index: CheckpointIndex, placement: Placement | None, world_size: int
) -> list[Need]:
    """compute_needs as it was: one Need at a time."""
    needs: list[Need] = []
    num_layers = 1 + max((d.expert.layer for d in descs if d.expert), default=-1)
    if placement is not None and num_layers:
        placement.check_layers(num_layers)
    for i, d in enumerate(descs):
        per_rank = [(rank, box, tuple(o for o, _ in box)) for rank, box in _reference_rank_boxes(d, world_size)]
        if d.expert is None:
            key = find_key(d, index)
            info = index.info(key)
            check_cast(f"parameter {d.name}", key, index, d.dtype)
            if tuple(info.shape) != d.shape:
                raise ValueError(
                    f"parameter {d.name}: checkpoint tensor {key!r} has shape {list(info.shape)}, "
                    f"the model expects {list(d.shape)}"
                )
            for rank, box, origin in per_rank:
                if all(n for _, n in box):
                    needs.append(Need(rank, i, _shift(box, origin), key, box))
        else:
            _reference_expert_needs(i, d, index, placement, per_rank, needs)
    return needs


def _shift(box: Box, origin: Sequence[int]) -> Box:
    return tuple((off - o, n) for (off, n), o in zip(box, origin))


def _reference_expert_needs(i, d, index, placement, per_rank, needs) -> None:
    ref = d.expert
    num_physical, slice_shape = d.shape[0], d.shape[1:]
    if placement is None:
        phy2log = np.arange(num_physical)
        num_logical = num_physical
    else:
        if placement.num_physical != num_physical:
            raise ValueError(
                f"parameter {d.name} has {num_physical} expert slots per layer, the placement has "
                f"{placement.num_physical} physical slots"
            )
        phy2log = placement.phy2log[ref.layer]
        num_logical = placement.num_logical
    if d.mesh is not None and placement is not None and placement.num_ranks is not None:
        spr = num_physical // placement.num_ranks
        for _, box, _ in per_rank:
            if box[0][1] and (box[0][0] // spr != (box[0][0] + box[0][1] - 1) // spr):
                raise ValueError(f"parameter {d.name}: local box {list(box)} spans several EP ranks' slots")
    part_sizes = _reference_part_sizes(d, index, 0, slice_shape)
    extra = ref.param.keys(ref.module, num_logical)
    if extra[0] in index:
        raise ValueError(
            f"parameter {d.name}: the checkpoint has expert {num_logical} ({extra[0]!r}) but the "
            f"placement has only {num_logical} logical experts"
        )
    checked: set[int] = {0}
    for rank, box, origin in per_rank:
        (s0, ns), rest = box[0], box[1:]
        if not ns or not all(n for _, n in rest):
            continue
        parts = [
            (j, part_box, _shift(sub, origin[1:])) for j, part_box, sub in expert_parts(rest, part_sizes, ref.param.dim)
        ]
        for slot in range(s0, s0 + ns):
            expert = int(phy2log[slot])
            if expert < 0:
                continue
            if expert not in checked:
                if _reference_part_sizes(d, index, expert, slice_shape) != part_sizes:
                    raise ValueError(
                        f"parameter {d.name}: checkpoint tensors {list(ref.param.keys(ref.module, expert))} of "
                        f"logical expert {expert} differ in shape from expert 0's"
                    )
                checked.add(expert)
            keys = ref.param.keys(ref.module, expert)
            lead = ((slot - origin[0], 1),)
            for j, part_box, tail in parts:
                needs.append(Need(rank, i, lead + tail, keys[j], part_box))


def _reference_part_sizes(d, index, expert, slice_shape) -> tuple[int, ...]:
    ref = d.expert
    sizes = []
    for key in ref.param.keys(ref.module, expert):
        if key not in index:
            raise ValueError(
                f"parameter {d.name}: checkpoint {index.root} has no tensor {key!r} (logical expert {expert})"
            )
        info = index.info(key)
        check_cast(f"parameter {d.name}", key, index, d.dtype)
        shape = list(info.shape)
        want = list(slice_shape)
        dim = ref.param.dim
        if len(shape) != len(want) or any(a != b for k, (a, b) in enumerate(zip(shape, want)) if k != dim):
            raise ValueError(
                f"parameter {d.name}: checkpoint tensor {key!r} has shape {shape}, which does not fit "
                f"an expert slice of shape {want} (parts concatenated along dim {dim})"
            )
        sizes.append(shape[dim])
    if sum(sizes) != slice_shape[ref.param.dim]:
        raise ValueError(
            f"parameter {d.name}: checkpoint tensors {list(ref.param.keys(ref.module, expert))} of logical "
            f"expert {expert} have sizes {sizes} along dim {ref.param.dim}, summing to {sum(sizes)}, "
            f"not {slice_shape[ref.param.dim]}"
        )
    return tuple(sizes)


def _check_same(descs, index, placement, world_size) -> NeedTable:
    """need_table's rows are the reference's needs (as a set; no duplicates), and the table is
    deterministic and well formed."""
    want = compute_needs_reference(descs, index, placement, world_size)
    table = need_table(descs, index, placement, world_size)
    got = table.to_needs()
    assert len(got) == len(want) == len(set(want))
    assert set(got) == set(want)
    again = need_table(descs, index, placement, world_size)
    for col in ("rank", "param", "key", "slot", "src_off", "src_len", "dst_off", "ndim"):
        assert np.array_equal(getattr(table, col), getattr(again, col)), col
    assert table.keys == again.keys
    assert set(table.keys) == {n.key for n in want}
    assert (table.ndim == [len(index.info(k).shape) for k in table.keys]).all()
    assert compute_needs(descs, index, placement, world_size) == got
    return table


# -- shard_boxes against torch --------------------------------------------------------------------


def test_shard_boxes_match_torch_on_random_layouts():
    rng = np.random.default_rng(0)
    seen_empty = seen_nested = 0
    for _ in range(600):
        ndim = int(rng.integers(0, 4))
        shape = tuple(int(n) for n in rng.integers(0, 10, ndim))
        mesh_shape = tuple(int(n) for n in rng.integers(1, 5, int(rng.integers(1, 4))))
        placements = tuple(
            Shard(int(rng.integers(0, ndim))) if ndim and rng.random() < 0.7 else Replicate() for _ in mesh_shape
        )
        got = shard_boxes(shape, mesh_shape, placements)
        assert got.shape == (int(np.prod(mesh_shape)), ndim, 2) and got.dtype == np.int64
        want = _torch_boxes(shape, mesh_shape, placements)
        assert [tuple(map(tuple, b)) for b in got.tolist()] == want, (shape, mesh_shape, placements)
        seen_empty += any(n == 0 for box in want for _, n in box)
        dims = [p.dim for p in placements if isinstance(p, Shard)]
        seen_nested += len(dims) != len(set(dims))
    assert seen_empty > 50 and seen_nested > 50  # the cases that matter were drawn


@pytest.mark.parametrize(
    "shape, mesh_shape, placements",
    [
        ((7, 5), (2, 3), (Shard(0), Shard(0))),  # nested: 7 -> 4 | 3 -> (2, 2, 0) | (1, 1, 1)
        ((3,), (4,), (Shard(0),)),  # an empty last shard
        ((5, 2), (3, 2), (Shard(1), Shard(0))),  # Shard(1) on the outer mesh dim, as expert-FSDP
        ((), (2, 2), (Replicate(), Replicate())),
        ((0, 4), (2,), (Shard(0),)),
        ((6, 6), (2, 2), (Shard(-1), Shard(0))),  # a negative dim counts from the end
    ],
)
def test_shard_boxes_match_torch_on_chosen_layouts(shape, mesh_shape, placements):
    got = shard_boxes(shape, mesh_shape, placements)
    assert [tuple(map(tuple, b)) for b in got.tolist()] == _torch_boxes(shape, mesh_shape, placements)
    assert not got.flags.writeable  # cached: nobody may change it


def test_strided_shard_boxes_match_torch():
    """FSDP2 over EP on the same dim (torchtitan's expert FSDP with Shard(0)) gives
    (_StridedShard(0, sf=ep), Shard(0)) on mesh (efsdp, ep): boxes as torch computes them."""
    from torch.distributed.tensor.placement_types import _StridedShard

    for efsdp, ep, n in ((2, 2, 8), (2, 4, 16), (4, 2, 8), (3, 2, 12), (2, 2, 4)):
        for extra in ((), (6,), (3, 5)):
            shape, placements = (n, *extra), (_StridedShard(0, split_factor=ep), Shard(0))
            got = shard_boxes(shape, (efsdp, ep), placements)
            assert [tuple(map(tuple, b)) for b in got.tolist()] == _torch_boxes(shape, (efsdp, ep), placements)
    # with a Shard(1) of another mesh dim in between (a 3-D mesh)
    shape, placements = (8, 6), (_StridedShard(0, split_factor=2), Shard(1), Shard(0))
    got = shard_boxes(shape, (2, 3, 2), placements)
    assert [tuple(map(tuple, b)) for b in got.tolist()] == _torch_boxes(shape, (2, 3, 2), placements)


def test_shard_boxes_refuse_partial_and_other_strided_shards():
    from torch.distributed.tensor.placement_types import _StridedShard

    with pytest.raises(ValueError, match=r"is not supported \(Shard, _StridedShard and Replicate are\)"):
        shard_boxes((4, 4), (2,), (Partial(),))
    with pytest.raises(ValueError, match="supported only before exactly one Shard of the same tensor dim"):
        shard_boxes((4, 4), (2,), (_StridedShard(0, split_factor=2),))
    with pytest.raises(ValueError, match="does not divide into 4 equal shards"):
        shard_boxes((6, 4), (2, 2), (_StridedShard(0, split_factor=2), Shard(0)))
    with pytest.raises(ValueError, match="shards dim 2 of a 2-dim tensor"):
        shard_boxes((4, 4), (2,), (Shard(2),))


def test_rank_boxes_and_param_boxes():
    d = ParamDesc("w", (5, 3), torch.float32, np.array([[3, 1], [0, 2]]), (Shard(0), Shard(1)), ("w",))
    want = list(zip([3, 1, 0, 2], _torch_boxes((5, 3), (2, 2), d.placements)))
    assert rank_boxes(d, 4) == want
    ranks, boxes = param_boxes(d, 4)
    assert ranks.tolist() == [3, 1, 0, 2] and [tuple(map(tuple, b)) for b in boxes.tolist()] == [b for _, b in want]
    plain = ParamDesc("p", (2,), torch.float32, None)
    assert rank_boxes(plain, 3) == [(r, ((0, 2),)) for r in range(3)]
    assert param_boxes(plain, 3)[1].tolist() == [[[0, 2]]] * 3
    with pytest.raises(ValueError, match="parameter w: its mesh names rank 3 >= world size 3"):
        param_boxes(d, 3)


# -- need_table against the reference -----------------------------------------------------------


@pytest.mark.parametrize("redundant", [True, False])
@pytest.mark.parametrize("eplace", ["shard", "replicate"])
@pytest.mark.parametrize("world, lws, ep, efsdp, _", SMALL)
def test_need_table_matches_reference_on_small_models(world, lws, ep, efsdp, _, eplace, redundant):
    case = build_case(world, lws, ep, efsdp, expert_placements=eplace, redundant=redundant, seed=world * 7 + ep)
    table = _check_same(case.descs, case.index, case.placement, world)
    assert table.width == 2
    # Without a placement: slot p holds expert p (the model's own experts, no redundancy).
    case = build_case(world, lws, ep, efsdp, expert_placements=eplace, num_logical=ep * 2, redundant=False, seed=world)
    _check_same(case.descs, case.index, None, world)


@pytest.mark.parametrize("world, ep, efsdp, eplace", [(4, 2, 2, "shard"), (8, 4, 2, "replicate"), (16, 8, 2, "shard")])
def test_need_table_with_empty_slots(world, ep, efsdp, eplace):
    """Slots whose phy2log is -1 (a dead or not-yet-joined rank) need nothing."""
    case = build_case(world, 2, ep, efsdp, expert_placements=eplace, num_logical=ep * 2, spr=3, seed=world)
    rng = np.random.default_rng(world)
    p2l = case.placement.phy2log.copy()
    for layer in range(p2l.shape[0]):
        for slot in rng.permutation(p2l.shape[1]):  # empty slots whose expert has another copy
            if (p2l[layer] == p2l[layer, slot]).sum() > 1:
                p2l[layer, slot] = -1
    assert (p2l == -1).sum() == ep * p2l.shape[0]
    _check_same(case.descs, case.index, Placement(p2l, num_logical=case.placement.num_logical, num_ranks=ep), world)


def test_need_table_plain_and_zero_dim_params():
    """Plain (mesh None) dense and expert params, 0-dim dense tensors, uneven and empty shards."""
    case = build_case(6, 2, 2, 3, inter=2, hidden=5, seed=3)
    descs = list(case.descs)
    t = dict(case.index.tensors)
    for name, mesh, place in (
        ("scalar_plain", None, ()),
        ("scalar_repl", np.arange(6), (Replicate(),)),
        ("scalar_mesh2", np.arange(6).reshape(2, 3), (Replicate(), Replicate())),
    ):
        descs.append(ParamDesc(name, (), torch.float32, mesh, place, (name,)))
        t[name] = TensorInfo("f", 8, "F32", ())
    descs.append(ParamDesc("short", (4,), torch.float32, np.arange(6), (Shard(0),), ("short",)))  # ranks 4, 5 empty
    t["short"] = TensorInfo("f", 8, "F32", (4,))
    descs.append(ParamDesc("empty", (0, 3), torch.float32, np.arange(6), (Shard(0),), ("empty",)))
    t["empty"] = TensorInfo("f", 8, "F32", (0, 3))
    module = "layers.0.mlp.experts"
    descs.append(
        ParamDesc(f"{module}.down_proj_plain", (4, 5, 2), torch.float32, None, (), expert=ExpertRef(0, module, DOWN))
    )
    index = CheckpointIndex("/nonexistent", t, case.index.file_sizes)
    table = _check_same(descs, index, case.placement, 6)
    assert ((table.ndim == 0) == [k.startswith("scalar") for k in table.keys]).all()


def test_need_table_zero_dim_expert_slices():
    """A per-expert scalar (a scale): one 0-dim part per slot (the reference could not do it)."""
    module = "layers.0.mlp.experts"
    scale = ExpertParam("down_proj_scale", ("{e}.down_proj.scale",))
    t = {f"{module}.{e}.down_proj.scale": TensorInfo("f", 8, "F32", ()) for e in range(3)}
    index = CheckpointIndex("/nonexistent", t, {"f": 100})
    pl = Placement(np.array([[2, 0, -1, 1]]), num_logical=3, num_ranks=2)
    d = ParamDesc(
        f"{module}.down_proj_scale",
        (4,),
        torch.float32,
        np.arange(4).reshape(2, 2),
        (Replicate(), Shard(0)),
        expert=ExpertRef(0, module, scale),
    )
    got = set(need_table([d], index, pl, 4).to_needs())
    key = f"{module}.{{}}.down_proj.scale".format
    # EP rank 0 (ranks 0 and 2) holds slots 0, 1; EP rank 1 (ranks 1, 3) slots 2 (empty), 3.
    want = {Need(r, 0, ((s, 1),), key(e), ()) for r in (0, 2) for s, e in ((0, 2), (1, 0))}
    want |= {Need(r, 0, ((1, 1),), key(1), ()) for r in (1, 3)}
    assert got == want
    # Two parts cannot make up a 0-dim slice.
    two = ExpertParam("both", ("{e}.down_proj.scale", "{e}.down_proj.scale"))
    with pytest.raises(ValueError, match=r"have sizes \[1, 1\] along dim 0, summing to 2, not 1"):
        need_table([ParamDesc("both", (4,), torch.float32, None, expert=ExpertRef(0, module, two))], index, pl, 4)


@pytest.mark.parametrize(
    "mesh, placements",
    [
        (None, ()),
        (np.arange(4), (Shard(0),)),
        (np.arange(4), (Shard(1),)),
        (np.arange(4).reshape(2, 2), (Shard(0), Shard(0))),
    ],
)
def test_need_table_dense_parts(mesh, placements):
    """A dense tensor stored as parts concatenated along a dim (transformers' Concatenate, e.g.
    q/k/v conv1d): each rank's box is read from the parts it overlaps, and the rows tile it."""
    shape, sizes, dim = (7, 3), (2, 4, 1), 0
    parts = ("a.q", "a.k", "a.v")
    t = {k: TensorInfo("f", 8, "F32", (n, 3)) for k, n in zip(parts, sizes)}
    index = CheckpointIndex("/nonexistent", t, {"f": 1000})
    d = ParamDesc("a.conv", shape, torch.float32, mesh, placements, ("a.conv",), parts=parts, part_dim=dim)
    table = need_table([d], index, None, 4)
    full = np.arange(21).reshape(shape)
    ckpt = dict(zip(parts, np.split(full, np.cumsum(sizes)[:-1], axis=dim)))
    for rank, box in rank_boxes(d, 4):
        local = np.full([n for _, n in box], -1)
        for n in table.to_needs():
            if n.rank == rank:
                src = ckpt[n.key][tuple(slice(o, o + k) for o, k in n.src)]
                local[tuple(slice(o, o + k) for o, k in zip((o for o, _ in n.dest), (k for _, k in n.src)))] = src
        assert (local == full[tuple(slice(o, o + k) for o, k in box)]).all(), (rank, box)
    # The whole tensor under its own name is read as it is; parts that do not add up are refused.
    whole = CheckpointIndex("/nonexistent", {**t, "a.conv": TensorInfo("f", 8, "F32", shape)}, {"f": 1000})
    assert set(need_table([d], whole, None, 4).keys) == {"a.conv"}
    bad = CheckpointIndex("/nonexistent", {**t, "a.v": TensorInfo("f", 8, "F32", (2, 3))}, {"f": 1000})
    with pytest.raises(ValueError, match=r"have sizes \[2, 4, 2\] along dim 0, summing to 8, not the model's 7"):
        need_table([d], bad, None, 4)
    gone = CheckpointIndex("/nonexistent", {k: v for k, v in t.items() if k != "a.k"}, {"f": 1000})
    with pytest.raises(ValueError, match=r"nor all the tensors transformers concatenates.*\['a.k'\] missing"):
        need_table([d], gone, None, 4)


def _synthetic(cfg, nodes, rpn, ep, efsdp, redundant, seed):
    index = synthetic_index(cfg)
    layout = find_experts(index)
    cluster = ClusterSpec.build(nodes, rpn, ep, efsdp, redundant)
    descs = synthesize_descs(layout, index, cluster)
    rng = np.random.default_rng(seed)
    num_physical = layout.num_logical + redundant
    rows = [
        rng.permutation(np.concatenate([np.arange(layout.num_logical), rng.integers(0, layout.num_logical, redundant)]))
        for _ in range(layout.num_layers)
    ]
    placements = [make_placement(layout, cluster), make_placement(layout, cluster, np.stack(rows))]
    assert placements[1].num_physical == num_physical
    return descs, index, placements


SMALL_DEEPSEEK = DEEPSEEK_V3 | {
    "num_hidden_layers": 5,
    "first_k_dense_replace": 2,
    "n_routed_experts": 16,
    "n_group": 4,
    "topk_group": 2,
    "vocab_size": 1000,
}
DEEPSEEK_V3_6_LAYERS = DEEPSEEK_V3 | {"num_hidden_layers": 6}  # 3 MoE layers of 256 experts
QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 100,
    "num_experts": 8,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(
    "cfg, nodes, rpn, ep, efsdp, redundant",
    [
        (SMALL_DEEPSEEK, 1, 8, 8, 1, 0),
        (SMALL_DEEPSEEK, 2, 8, 4, 4, 4),
        (SMALL_DEEPSEEK, 4, 8, 16, 2, 16),
        (DEEPSEEK_V3_6_LAYERS, 2, 8, 8, 2, 8),
        (DEEPSEEK_V3_6_LAYERS, 4, 8, 32, 1, 0),
        (MIXTRAL, 1, 4, 4, 1, 0),
        (MIXTRAL, 2, 4, 2, 4, 2),
        (QWEN2_MOE, 2, 8, 4, 4, 4),
        (QWEN3_MOE, 2, 4, 4, 2, 4),
        (QWEN3_MOE, 3, 4, 4, 3, 0),
    ],
)
def test_need_table_matches_reference_on_synthetic_checkpoints(cfg, nodes, rpn, ep, efsdp, redundant):
    descs, index, placements = _synthetic(cfg, nodes, rpn, ep, efsdp, redundant, seed=nodes * ep)
    for pl in placements:
        _check_same(descs, index, pl, nodes * rpn)


# -- errors: the reference's, each once ------------------------------------------------------------


def _both_raise(match, descs, index, placement, world):
    with pytest.raises(ValueError, match=match):
        compute_needs_reference(descs, index, placement, world)
    with pytest.raises(ValueError, match=match):
        need_table(descs, index, placement, world)


def test_need_table_errors_are_the_references():
    case = build_case(4, 2, 2, 2, seed=1)
    idx = case.index
    # A box covering slots of two EP ranks: the mesh has 2 EP ranks, the placement 4.
    pl4 = Placement(np.tile(np.arange(4), (2, 1)), num_logical=4, num_ranks=4)
    _both_raise(
        r"layers\.0\.mlp\.experts\.gate_up_proj: local box \[\(0, 2\), \(0, 3\), \(0, 4\)\] spans several "
        r"EP ranks' slots",
        case.descs,
        idx,
        pl4,
        4,
    )
    # A checkpoint tensor of a held expert other than 0 with a bad shape or dtype.
    t = dict(idx.tensors)
    t["layers.1.mlp.experts.3.down_proj.weight"] = TensorInfo("f", 8, "BF16", (4, 4))
    _both_raise(
        r"'layers\.1\.mlp\.experts\.3\.down_proj\.weight' has shape \[4, 4\]",
        case.descs,
        CheckpointIndex(idx.root, t, idx.file_sizes),
        case.placement,
        4,
    )
    t = dict(idx.tensors)
    t["layers.0.mlp.experts.2.gate_proj.weight"] = TensorInfo("f", 8, "F8_E4M3", (3, 4))
    _both_raise(
        r"'layers\.0\.mlp\.experts\.2\.gate_proj\.weight' has dtype F8_E4M3 \(FP8\)",
        case.descs,
        CheckpointIndex(idx.root, t, idx.file_sizes),
        case.placement,
        4,
    )
    # Another float dtype for one expert is a cast the rule allows: no error, same needs.
    t = dict(idx.tensors)
    t["layers.0.mlp.experts.2.gate_proj.weight"] = TensorInfo("f", 8, "F32", (3, 4))
    _check_same(case.descs, CheckpointIndex(idx.root, t, idx.file_sizes), case.placement, 4)
