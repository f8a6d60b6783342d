"""Tier 1: the boxes of peft LoRA weights under EP (+ expert FSDP) that load_adapter and
save_adapter plan from (moeshard.models.lora), against their element-by-element definition.

peft's fused expert factors: A ``[r*E, in]`` (rows expert-major), B ``[out, r*E]`` (columns
``(r, E)``, the expert fastest). Under EP the DTensors are A ``[r*P, in]`` (slot ``p``: rows
``p*r ..``) and B ``[out, r*P]`` (EP rank ``k``'s block ``k*r*S ..``, inside it ``(r, slot)``).
For random placements (redundant copies, empty slots), meshes and r, every element a rank holds
is mapped to the file element of its slot's logical expert, and nothing else; a save's boxes
take each logical expert from its first copy once; rows of one box on two ranks are equal or
disjoint (the load's ``alone`` hint relies on it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeshard.models.describe import ParamDesc
from moeshard.models.lora import AdapterTensor, distinct_boxes, factor_boxes, local_view, plan_shape
from moeshard.models.shards import param_boxes
from moeshard.placement import Placement


def _random_placement(rng, layers: int, num_logical: int, ep: int) -> Placement:
    spr = int(rng.integers(1, 4)) * max(1, -(-num_logical // ep))
    rows = []
    for _ in range(layers):
        extra = ep * spr - num_logical
        fill = rng.integers(0, num_logical, extra) if rng.random() < 0.7 else np.full(extra, -1)
        rows.append(rng.permutation(np.concatenate([np.arange(num_logical), fill])))
    return Placement(np.stack(rows), num_logical=num_logical, num_ranks=ep)


def _factor(rng, factor: str, pl: Placement, ep: int, efsdp: int, r: int):
    """An expert factor's AdapterTensor and ParamDesc on an (efsdp, ep) mesh, as parallelize
    shards it: A ``(Shard(1), Shard(0))``, B ``(Shard(0), Shard(1))``."""
    other = int(rng.integers(1, 4)) * efsdp + int(rng.integers(0, 2))  # uneven FSDP shards too
    layer = int(rng.integers(pl.num_layers))
    mesh = np.arange(ep * efsdp).reshape(efsdp, ep)
    if factor == "A":
        t = AdapterTensor("a", "a", (r * pl.num_logical, other), "A", layer, r)
        d = ParamDesc("a", (r * pl.num_physical, other), torch.float32, mesh, (1, 0))
    else:
        t = AdapterTensor("b", "b", (other, r * pl.num_logical), "B", layer, r)
        d = ParamDesc("b", (other, r * pl.num_physical), torch.float32, mesh, (0, 1))
    return t, d


def _reference(t: AdapterTensor, d: ParamDesc, pl: Placement, world: int, first_only: bool) -> set:
    """``{(rank, local row, local col, file row, file col)}`` element by element (2-D)."""
    r, spr, num_logical = t.rank, pl.num_physical // pl.num_ranks, pl.num_logical
    phy2log = pl.phy2log[t.layer]
    out = set()
    for rank, box in zip(*param_boxes(d, world)):
        (r0, nr), (c0, nc) = box.tolist()
        for g_row in range(r0, r0 + nr):
            for g_col in range(c0, c0 + nc):
                if t.factor == "A":
                    p, j = divmod(g_row, r)
                else:
                    k, within = divmod(g_col, r * spr)
                    j, s = divmod(within, spr)
                    p = k * spr + s
                e = int(phy2log[p])
                if e < 0 or (first_only and pl.log2phy[t.layer, e, 0] != p):
                    continue
                f = (e * r + j, g_col) if t.factor == "A" else (g_row, j * num_logical + e)
                out.add((int(rank), g_row - r0, g_col - c0, *f))
    return out


def _expand(t: AdapterTensor, b, pl: Placement) -> list:
    """The elements of ``b``'s boxes as ``(rank, local row, local col, file row, file col)``
    (3-D B boxes mapped back to 2-D), with repeats."""
    num_logical, spr = pl.num_logical, pl.num_physical // pl.num_ranks
    out = []
    for rank, lo, off, ln in zip(b.rank.tolist(), b.local_off.tolist(), b.off.tolist(), b.len.tolist()):
        for idx in np.ndindex(*ln):
            loc = [a + i for a, i in zip(lo, idx)]
            fil = [a + i for a, i in zip(off, idx)]
            if t.factor == "B":  # [out, r, S] -> [out, r*S]; [out, r, E] -> [out, r*E]
                loc = [loc[0], loc[1] * spr + loc[2]]
                fil = [fil[0], fil[1] * num_logical + fil[2]]
            out.append((rank, *loc, *fil))
    return out


@pytest.mark.parametrize("factor", ["A", "B"])
def test_factor_boxes_are_the_layout(factor):
    for seed in range(60):
        rng = np.random.default_rng(seed)
        ep, efsdp, r = int(rng.integers(1, 5)), int(rng.integers(1, 3)), int(rng.integers(1, 4))
        pl = _random_placement(rng, 2, int(rng.integers(1, 9)), ep)
        t, d = _factor(rng, factor, pl, ep, efsdp, r)
        for first_only in (False, True):
            b = factor_boxes(t, d, pl, ep * efsdp, first_copy_only=first_only)
            got = _expand(t, b, pl)
            assert len(got) == len(set(got)), (seed, first_only)  # no element twice
            assert set(got) == _reference(t, d, pl, ep * efsdp, first_only), (seed, first_only)
            if first_only:  # a save: the file tensor exactly once
                assert sorted(x[3:] for x in got) == sorted(np.ndindex(*t.shape)), seed
        # The load's boxes: two ranks' boxes are equal or disjoint.
        b = factor_boxes(t, d, pl, ep * efsdp)
        boxes = sorted({(tuple(o), tuple(n)) for o, n in zip(b.off.tolist(), b.len.tolist())})
        for i, (o1, n1) in enumerate(boxes):
            for o2, n2 in boxes[i + 1 :]:
                overlap = all(a < c + m and c < a + n for a, n, c, m in zip(o1, n1, o2, n2))
                assert not overlap, (seed, (o1, n1), (o2, n2))


def test_contiguous_slots_are_one_box_per_rank():
    pl = Placement.contiguous(1, 16, 4)  # 4 slots per rank, experts in order
    for factor in "AB":
        t, d = _factor(np.random.default_rng(0), factor, pl, 4, 2, 3)
        b = factor_boxes(t, d, pl, 8)
        assert sorted(b.rank.tolist()) == list(range(8)), factor


def test_local_view_addresses_the_parameter():
    t = AdapterTensor("b", "b", (5, 3 * 8), "B", 0, 3)
    local = torch.arange(5 * 3 * 2, dtype=torch.float32).reshape(5, 6)  # r=3, 2 slots: columns (j, s)
    v = local_view(t, local)
    assert v.shape == (5, 3, 2) and v.data_ptr() == local.data_ptr()
    assert torch.equal(v[:, 2, 1], local[:, 2 * 2 + 1])
    assert plan_shape(t) == (5, 3, 8) and plan_shape(AdapterTensor("a", "a", (24, 7), "A", 0, 3)) == (24, 7)


def test_misaligned_sharding_is_refused():
    pl = Placement.contiguous(1, 4, 2)
    t = AdapterTensor("a", "a", (3 * 4, 6), "A", 0, 3)
    d = ParamDesc("a", (3 * 4, 6), torch.float32, np.arange(8).reshape(4, 2), (0, 0))  # 12 rows in blocks of 2
    with pytest.raises(ValueError, match="splits the 3 rows of one slot"):
        factor_boxes(t, d, pl, 8)


def test_distinct_boxes_tile_once_from_first_holders():
    mesh = np.arange(6).reshape(2, 3)  # rows sharded over 3 ranks, replicated over 2
    d = ParamDesc("q", (7, 4), torch.float32, mesh, (None, 0))
    b = distinct_boxes(d, 6)
    assert b.rank.tolist() == [0, 1, 2]
    assert b.off.tolist() == [[0, 0], [3, 0], [6, 0]] and b.len.tolist() == [[3, 4], [3, 4], [1, 4]]
    plain = distinct_boxes(ParamDesc("x", (2, 3), torch.float32, None), 4)
    assert plain.rank.tolist() == [0] and plain.len.tolist() == [[2, 3]]


@pytest.mark.parametrize(
    "variant",
    [dict(use_dora=True), dict(lora_bias=True), dict(target_modules=["embed_tokens"])],
    ids=["dora", "lora_bias", "embedding"],
)
def test_lora_variants_are_refused(variant):
    """moeshard.lora's promise: LoRA variants (DoRA, biases, embeddings) are refused, by the
    walk over the adapter's weights that load_adapter and save_adapter both plan from."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from moeshard.lora import adapter_tensors

    config = transformers.Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=16,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )

    def peft_model(**kw):
        args = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], **kw}
        return peft.get_peft_model(transformers.Qwen3MoeForCausalLM(config), peft.LoraConfig(**args))

    assert len(adapter_tensors(peft_model(), None)) == 2  # plain LoRA A/B: accepted
    with pytest.raises(ValueError, match=r"only LoRA A/B weights are supported \(no DoRA, embeddings, biases\)"):
        adapter_tensors(peft_model(**variant), None)
