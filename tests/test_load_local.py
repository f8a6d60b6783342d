"""Tier 1: load / verify in one process without torch.distributed (plain tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import moeshard
import tiny_moe


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("local")
    tiny_moe.write(d / "sharded")
    tensors = tiny_moe.checkpoint_tensors()
    from safetensors.torch import save_file

    save_file(tensors, str(d / "one.safetensors"))
    return d, tiny_moe.read_all(d / "sharded")


def _meta_model():
    with torch.device("meta"):
        return tiny_moe.TinyMoE()


@pytest.mark.parametrize("source", ["sharded", "one.safetensors"])
def test_load_plain_model(ckpt, source):
    root, values = ckpt
    model = _meta_model()
    rep = moeshard.load(model, root / source)
    assert rep.world_size == 1 and rep.storage == "shared"
    assert rep.bytes_read_rank == rep.checkpoint_bytes == sum(t.numel() * t.element_size() for t in values.values())
    assert tiny_moe.compare(model, values, moeshard.Placement.contiguous(2, tiny_moe.NUM_EXPERTS, 1)) == []
    # Each step's wall and calling-thread CPU seconds: the same steps; one thread's CPU time
    # cannot exceed the wall time (1 ms of slack for the clocks' resolutions).
    assert (
        list(rep.phase_cpu_seconds)
        == list(rep.phase_seconds)
        == ["materialize", "headers", "plan", "execute", "finish"]
    )
    assert all(0 <= rep.phase_cpu_seconds[k] <= rep.phase_seconds[k] + 1e-3 for k in rep.phase_seconds)
    assert rep.phase_cpu_seconds["plan"] > 0
    v = moeshard.verify(model, root / source)
    assert v.num_boxes_checked > 0


def test_load_plain_model_with_permuted_placement(ckpt):
    root, values = ckpt
    rng = np.random.default_rng(0)
    pl = moeshard.Placement(np.stack([rng.permutation(tiny_moe.NUM_EXPERTS) for _ in range(2)]))
    model = _meta_model()
    moeshard.load(model, root / "sharded", placement=pl)
    assert tiny_moe.compare(model, values, pl) == []
    moeshard.verify(model, root / "sharded", placement=pl)
    # The identity placement is not what the model holds.
    with pytest.raises(
        moeshard.VerificationError, match=r"rank 0: parameter layers\.0\.mlp\.experts\.\w+, physical slot"
    ):
        moeshard.verify(model, root / "sharded")
    # Corrupt one element of a dense parameter.
    with torch.no_grad():
        model.lm_head.weight[3, 1] += 1
    with pytest.raises(moeshard.VerificationError, match=r"parameter lm_head\.weight: .*'lm_head\.weight'"):
        moeshard.verify(model, root / "sharded", placement=pl)


def test_bf16_model_from_mixed_checkpoint(ckpt):
    root, values = ckpt
    model = _meta_model().to(torch.bfloat16)
    moeshard.load(model, root / "sharded")
    pl = moeshard.Placement.contiguous(2, tiny_moe.NUM_EXPERTS, 1)
    assert tiny_moe.compare(model, values, pl) == []
    moeshard.verify(model, root / "sharded")


def test_errors_without_process_group(ckpt, tmp_path):
    root, _ = ckpt
    with pytest.raises(ValueError, match="no rank can read the checkpoint"):
        moeshard.load(_meta_model(), tmp_path / "nope")
    with pytest.raises(ValueError, match="has 8 expert slots per layer, the placement has 9"):
        moeshard.load(
            _meta_model(), root / "sharded", placement=moeshard.Placement(np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0]] * 2))
        )


class _NoConfigRotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(4), persistent=False)


def test_materialize_needs_config_for_non_persistent_buffers():
    with torch.device("meta"):
        model = nn.Sequential(_NoConfigRotary())
    with pytest.raises(ValueError, match=r"module '0' \(_NoConfigRotary\) has non-persistent buffers \['inv_freq'\]"):
        moeshard.materialize(model, torch.device("cpu"))


class _WithScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(()))
        self.w = nn.Parameter(torch.empty(3, 2))


def test_load_scalar_parameter(tmp_path):
    moeshard.write_checkpoint(tmp_path, [("scale", torch.tensor(1.75)), ("w", torch.arange(6.0).reshape(3, 2))])
    with torch.device("meta"):
        model = _WithScalar()
    moeshard.load(model, tmp_path / "model.safetensors.index.json")
    assert model.scale.shape == () and model.scale.item() == 1.75
    assert torch.equal(model.w.detach(), torch.arange(6.0).reshape(3, 2))
    assert moeshard.verify(model, tmp_path).num_boxes_checked == 2


def test_relocate_plain_model_in_one_process(ckpt):
    # One process holds every slot: a rebalance is local copies only (stashes for cycles).
    root, values = ckpt
    model = _meta_model()
    E = tiny_moe.NUM_EXPERTS
    old = moeshard.Placement.contiguous(2, E, 1)
    moeshard.load(model, root / "sharded", placement=old)
    new = moeshard.Placement(np.stack([np.roll(np.arange(E), 3), np.arange(E)[::-1]]), num_ranks=1)
    rep = moeshard.relocate(model, old, new, staging_bytes=700)
    assert tiny_moe.compare(model, values, new) == []
    assert rep.copies["local"] > 0 and rep.network_bytes == 0 and rep.disk_experts == []
    assert rep.num_rounds > 1


def test_relocate_moves_optimizer_state_with_its_experts_or_refuses(ckpt):
    """relocate(optimizer=) moves each expert's AdamW moments with it (training goes on as if
    nothing moved); from_checkpoint=True would re-read older weights and zero the moments, so
    that combination is refused before anything changes."""
    root, values = ckpt
    model = _meta_model()
    E = tiny_moe.NUM_EXPERTS
    old = moeshard.Placement.contiguous(2, E, 1)
    moeshard.load(model, root / "sharded", placement=old)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    w = model.layers[0].mlp.experts.gate_up_proj
    weights, moments = w.detach().clone(), opt.state[w]["exp_avg"].clone()
    new = moeshard.Placement(np.stack([np.roll(np.arange(E), 3), np.arange(E)[::-1]]), num_ranks=1)
    with pytest.raises(ValueError, match="from_checkpoint=True with optimizer="):
        moeshard.relocate(model, old, new, checkpoint=root / "sharded", optimizer=opt, from_checkpoint=True)
    assert torch.equal(w.detach(), weights) and torch.equal(opt.state[w]["exp_avg"], moments)
    moeshard.relocate(model, old, new, checkpoint=root / "sharded", optimizer=opt)
    perm = torch.as_tensor(new.phy2log[0].copy())
    assert torch.equal(w.detach(), weights[perm]) and torch.equal(opt.state[w]["exp_avg"], moments[perm])


def test_relocate_refuses_undeclared_per_expert_param(ckpt):
    root, _ = ckpt
    model = _meta_model()
    moeshard.load(model, root / "sharded")
    experts = model.layers[0].mlp.experts
    experts.gate_up_proj_bias = nn.Parameter(torch.zeros(tiny_moe.NUM_EXPERTS, 2 * tiny_moe.INTER))
    old = moeshard.Placement.contiguous(2, tiny_moe.NUM_EXPERTS, 1)
    with pytest.raises(ValueError, match=r"layers.0.mlp.experts.gate_up_proj_bias of shape \[8, 12\] looks per-expert"):
        moeshard.relocate(model, old, old)


def test_verify_compares_bytes_in_wide_words():
    """verify's byte comparison (8, 4 or 2 bytes at a time where offsets allow): every changed
    byte is found, at any offset and length; NaNs with equal bits are equal."""
    from moeshard.ops.verify import bytes_differ

    base = torch.arange(256, dtype=torch.uint8)
    for start in range(0, 9):
        for length in (0, 1, 3, 8, 17, 64):
            a = base[start : start + length]
            assert not bool(bytes_differ(a, a.clone()))
            for pos in {0, length // 2, length - 1} if length else ():
                b = a.clone()
                b[pos] ^= 1
                assert bool(bytes_differ(a, b)), (start, length, pos)
    x = torch.full((4, 6), float("nan"), dtype=torch.bfloat16)
    assert not bool(bytes_differ(x[:, 1:5], x.clone()[:, 1:5]))


def test_grad_norm_refuses_other_norms():
    """grad_norm / clip_grad_norm_ take the 2-norm only: another norm_type is refused, not
    silently computed as the 2-norm."""
    with pytest.raises(ValueError, match="only the 2-norm is supported, got norm_type=1.0"):
        moeshard.grad_norm(nn.Linear(2, 2), norm_type=1.0)
