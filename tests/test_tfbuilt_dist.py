"""Tier 3: a model transformers parallelized itself (``from_pretrained(path,
distributed_config=DistributedConfig(fsdp_size=4, ep_size=E))``, EP=4 and EP=2 x expert FSDP=2 on
4 gloo ranks): moeshard relocates it with the routing following the experts, and saves it.

Compared with one process (``from_pretrained(path)``): the logits before the relocation; after
relocating to a shuffled placement the logits and every gradient (an expert's at its new slot)
equal those before, when transformers' own forward ran, and ``moeshard.grad_norm`` is the norm of
the whole gradients; ``verify`` passes; ``save`` under the
identity placement and after the relocation, read back by ``from_pretrained`` in one process,
equals the original tensors exactly. Refused on every rank, with nothing moved: a redundant
placement, an old placement that is not the model's, and a custom expert-parallel experts module
whose forward moeshard cannot see (unless ``routing="caller"``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from mp import run_ranks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

NUM_LAYERS, NUM_EXPERTS, VOCAB = 2, 8, 128
EPS = (4, 2)
TOL = 1e-5  # fp32: the EP forwards sum each token's experts in another order than one process


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _shuffled(seed: int, ep: int):
    import moeshard

    rng = np.random.default_rng(seed)
    return moeshard.Placement(
        np.stack([rng.permutation(NUM_EXPERTS) for _ in range(NUM_LAYERS)]), num_logical=NUM_EXPERTS, num_ranks=ep
    )


class CustomExperts(nn.Module):
    """Expert-parallel by its owner (``[E/ep]`` local slots of a DTensor) with a dispatch of its own."""

    def __init__(self, mesh):
        from torch.distributed.tensor import DTensor, Shard

        super().__init__()
        g = torch.Generator().manual_seed(5)
        for name, shape in (("gate_up_proj", (NUM_EXPERTS, 8, 4)), ("down_proj", (NUM_EXPERTS, 4, 4))):
            full = torch.randn(shape, generator=g)
            local = full.chunk(mesh.size())[mesh.get_local_rank()].clone()
            setattr(self, name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False)))

    def forward(self, hidden, top_k_index, top_k_weights):  # routes to experts e // (E / ep) itself
        raise AssertionError("not called")


def _full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, whole (collective: DTensor.full_tensor)."""
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def _loss_grads(model, ids):
    """Every gradient of the rank's loss, whole, and moeshard.grad_norm's global norm beside the
    norm of those whole gradients (they must agree)."""
    import moeshard

    model(input_ids=ids, labels=ids).loss.backward()
    grads = _full_grads(model)
    norm = float(moeshard.grad_norm(model))
    whole = float(torch.stack([g.pow(2).sum() for g in grads.values()]).sum().sqrt())
    model.zero_grad(set_to_none=True)
    return grads, abs(norm - whole) / whole


def _grad_diff(before: dict, after: dict, new) -> float:
    """Largest difference of ``after`` (under placement ``new``) from ``before`` (identity), an
    expert's gradient compared at its new slot, relative to the largest gradient."""
    worst = 0.0
    for name, g in before.items():
        a = after[name]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            layer = int(name.split(".")[2])
            a = a[torch.as_tensor(new.log2phy[layer, :, 0])]  # logical order
        worst = max(worst, float((a - g).abs().max() / g.abs().max().clamp_min(1e-30)))
    return worst


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return f"{type(e).__name__}: {e}"
    return "no error"


def _local_experts(model) -> list[torch.Tensor]:
    return [p.to_local().clone() for n, p in model.named_parameters() if ".experts." in n]


def _unchanged(before: list, model) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, _local_experts(model)))


def tf_worker(ckpt: str, out: str, ids_all: torch.Tensor) -> list:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import moeshard

    rank = dist.get_rank()
    ids = ids_all[rank]
    res = []
    for ep in EPS:
        model = AutoModelForCausalLM.from_pretrained(
            ckpt, distributed_config=DistributedConfig(fsdp_size=4, ep_size=ep), dtype=torch.float32
        )
        rec = {"ep": ep}
        ident = moeshard.Placement.contiguous(NUM_LAYERS, NUM_EXPERTS, ep)
        with torch.no_grad():
            rec["logits"] = before = model(input_ids=ids).logits.clone()
        grads_before, rec["norm_diff_before"] = _loss_grads(model, ids)
        moeshard.save(model, f"{out}/ident-ep{ep}", placement=ident)

        local = _local_experts(model)
        rng = np.random.default_rng(0)
        redundant = moeshard.Placement(
            np.stack([rng.permutation(np.r_[np.arange(NUM_EXPERTS), 0, 1, 2, 3]) for _ in range(NUM_LAYERS)]),
            num_logical=NUM_EXPERTS,
            num_ranks=ep,
        )
        rec["redundant"] = _error(lambda: moeshard.relocate(model, ident, redundant))
        rec["not_old"] = _error(lambda: moeshard.relocate(model, _shuffled(7, ep), _shuffled(8, ep)))
        rec["unchanged"] = _unchanged(local, model)

        new = _shuffled(ep, ep)
        spr = NUM_EXPERTS // ep
        mine = slice((rank % ep) * spr, (rank % ep + 1) * spr)
        rec["moves_here"] = not np.array_equal(new.phy2log[:, mine], ident.phy2log[:, mine])
        moeshard.relocate(model, ident, new)
        rec["verified"] = moeshard.verify(model, ckpt, placement=new).num_boxes_checked
        # The slots now hold a shuffled placement: torch's state dict would be slot order.
        rec["state_dict"] = _error(model.state_dict)
        with torch.no_grad():
            rec["logits_diff"] = float((model(input_ids=ids).logits - before).abs().max() / before.abs().max())
        grads_after, rec["norm_diff_after"] = _loss_grads(model, ids)
        rec["grad_diff"] = _grad_diff(grads_before, grads_after, new)
        moeshard.save(model, f"{out}/moved-ep{ep}", placement=new)
        # Once more, from moeshard's own routing (the modules it took over).
        again = _shuffled(10 + ep, ep)
        moeshard.relocate(model, new, again)
        with torch.no_grad():
            rec["again_diff"] = float((model(input_ids=ids).logits - before).abs().max() / before.abs().max())
        res.append(rec)

    # A custom experts module, expert-parallel already, with a dispatch moeshard cannot see.
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    custom = nn.Module()
    custom.layers = nn.ModuleList([nn.Module()])
    custom.layers[0].mlp = nn.Module()
    custom.layers[0].mlp.experts = CustomExperts(mesh)
    exp = custom.layers[0].mlp.experts
    full = {n: p.full_tensor() for n, p in exp.named_parameters()}
    ident1 = moeshard.Placement.contiguous(1, NUM_EXPERTS, 4)
    moved = moeshard.Placement(np.roll(np.arange(NUM_EXPERTS), 3)[None], num_logical=NUM_EXPERTS, num_ranks=4)
    local = [p.to_local().clone() for p in exp.parameters()]
    custom_rec = {"refused": _error(lambda: moeshard.relocate(custom, ident1, moved))}
    custom_rec["unchanged"] = all(torch.equal(a, p.to_local()) for a, p in zip(local, exp.parameters()))
    moeshard.relocate(custom, ident1, moved, routing="caller")
    custom_rec["caller_moved"] = all(
        torch.equal(p.full_tensor(), full[n][torch.as_tensor(moved.phy2log[0])]) for n, p in exp.named_parameters()
    )
    return [{k: v for k, v in r.items()} for r in res] + [custom_rec]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from transformers import Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("tfbuilt") / "ckpt"
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(_config()).save_pretrained(path)
    return path


@pytest.mark.dist
def test_transformers_built_model_relocates_and_saves(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    ids_all = torch.randint(0, VOCAB, (4, 2, 8), generator=torch.Generator().manual_seed(1))
    one = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        ref = [one(input_ids=ids_all[r]).logits for r in range(4)]
    results = run_ranks(tf_worker, str(ckpt), str(tmp_path), ids_all, world=4, timeout=900)
    want = one.state_dict()
    for rank, per_rank in enumerate(results):
        for rec in per_rank[: len(EPS)]:
            ep = rec["ep"]
            where = f"rank {rank} ep={ep}"
            # transformers' own EP forward: the one-process logits.
            assert float((rec["logits"] - ref[rank]).abs().max() / ref[rank].abs().max()) < TOL, where
            # Relocated (experts moved on this rank too): logits and gradients unchanged.
            assert rec["moves_here"], where
            assert rec["logits_diff"] < TOL, (where, rec["logits_diff"])
            assert rec["grad_diff"] < TOL, (where, rec["grad_diff"])
            # moeshard.grad_norm counts every element once (transformers' expert FSDP shards dim 0).
            assert rec["norm_diff_before"] < TOL and rec["norm_diff_after"] < TOL, where
            assert rec["again_diff"] < TOL, (where, rec["again_diff"])
            assert rec["verified"] > 0, where
            assert rec["state_dict"].startswith("ValueError") and "moeshard.save" in rec["state_dict"], (
                where,
                rec["state_dict"],
            )
            assert "DistributedError" in rec["redundant"] and "one slot per logical expert" in rec["redundant"], (
                where,
                rec["redundant"],
            )
            assert "DistributedError" in rec["not_old"] and "Placement.contiguous" in rec["not_old"], (
                where,
                rec["not_old"],
            )
            assert rec["unchanged"], where
        custom = per_rank[-1]
        assert "DistributedError" in custom["refused"], custom["refused"]
        assert "layers.0.mlp.experts" in custom["refused"] and 'routing="caller"' in custom["refused"], custom[
            "refused"
        ]
        assert custom["unchanged"] and custom["caller_moved"], (rank, custom)
    # Saved under the identity placement and after the relocation: the original tensors exactly.
    for ep in EPS:
        for kind in ("ident", "moved"):
            got = AutoModelForCausalLM.from_pretrained(tmp_path / f"{kind}-ep{ep}", dtype=torch.float32).state_dict()
            assert got.keys() == want.keys(), (kind, ep)
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            assert not bad, (kind, ep, bad)


def test_one_process_transformers_model_is_not_relocated_silently(ckpt):
    """Its experts forward indexes experts by logical id: a shuffle would go unseen, so relocate
    refuses (nothing moved) unless the caller routes; a routing mode it does not know is refused."""
    from transformers import AutoModelForCausalLM

    import moeshard

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ident = moeshard.Placement.contiguous(NUM_LAYERS, NUM_EXPERTS, 1)
    with pytest.raises(ValueError, match=r'model\.layers\.0\.mlp\.experts: .*routing="caller"'):
        moeshard.relocate(model, ident, _shuffled(0, 1))
    with pytest.raises(ValueError, match="routing='bogus'"):
        moeshard.relocate(model, ident, _shuffled(0, 1), routing="bogus")
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    moeshard.relocate(model, ident, _shuffled(0, 1), routing="caller")
    moved = model.model.layers[1].mlp.experts.down_proj
    want = before["model.layers.1.mlp.experts.down_proj"][torch.as_tensor(_shuffled(0, 1).phy2log[1])]
    assert torch.equal(moved.detach(), want)
