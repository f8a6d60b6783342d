"""Tier 1: the optimizer's part of a reshard (``moeshard.ops.reshard_optimizer``), in one process:
param groups mapped by parameter name and their hyperparameters carried, scalar states carried,
and the refusals (groups that cannot be mapped, a state a reshard cannot cut)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moeshard.ops.reshard_optimizer import install, map_groups, record_optimizer


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))


def _groups(model: nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if p.dim() >= 2]},
        {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


def _step(model: nn.Module, opt) -> None:
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_groups_and_scalars_carried_and_next_step_equal():
    old = _model(0)
    old_opt = torch.optim.AdamW(_groups(old), lr=1e-3, betas=(0.8, 0.95), weight_decay=0.2)
    sched = torch.optim.lr_scheduler.LambdaLR(old_opt, lambda s: 0.5)
    _step(old, old_opt)
    sched.step()
    new = _model(1)
    new.load_state_dict(old.state_dict())
    new_opt = torch.optim.AdamW(_groups(new), lr=1e-3)
    record = record_optimizer(dict(old.named_parameters()), old_opt)
    group_map = map_groups(record, dict(new.named_parameters()), new_opt)
    assert group_map == (0, 1)
    old_params, new_params = dict(old.named_parameters()), dict(new.named_parameters())
    moved = {n: {k: v.clone() for k, v in old_opt.state[p].items() if v.dim() > 0} for n, p in old_params.items()}
    install(new_opt, new_params, record, group_map, moved)
    for g_old, g_new in zip(old_opt.param_groups, new_opt.param_groups):
        assert {k: v for k, v in g_old.items() if k != "params"} == {k: v for k, v in g_new.items() if k != "params"}
    assert new_opt.param_groups[0]["lr"] == 5e-4 and new_opt.param_groups[0]["betas"] == (0.8, 0.95)
    for n, p in new_params.items():
        assert torch.equal(new_opt.state[p]["step"], old_opt.state[old_params[n]]["step"])
    _step(old, old_opt)
    _step(new, new_opt)
    for n, p in new_params.items():
        assert torch.equal(p, old_params[n]), n


def test_groups_that_cannot_be_mapped_are_refused():
    old = _model(0)
    old_opt = torch.optim.AdamW(_groups(old))
    record = record_optimizer(dict(old.named_parameters()), old_opt)
    new = _model(1)
    one = torch.optim.AdamW(new.parameters())
    with pytest.raises(ValueError, match="several param groups of old_optimizer"):
        map_groups(record, dict(new.named_parameters()), one)
    partial_old = torch.optim.AdamW(list(old.parameters())[:2])
    record = record_optimizer(dict(old.named_parameters()), partial_old)
    with pytest.raises(ValueError, match="which no param group of old_optimizer holds"):
        map_groups(record, dict(new.named_parameters()), torch.optim.AdamW(new.parameters()))


def test_state_a_reshard_cannot_cut_is_refused():
    old = _model(0)
    opt = torch.optim.AdamW(old.parameters())
    w = old[0].weight
    opt.state[w]["factored"] = torch.zeros(3)  # a row factor, as Adafactor keeps
    with pytest.raises(ValueError, match="neither a scalar nor its parameter's"):
        record_optimizer(dict(old.named_parameters()), opt)
    with pytest.raises(ValueError, match="does not name"):
        record_optimizer({}, opt)
