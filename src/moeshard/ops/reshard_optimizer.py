"""The optimizer's part of :func:`moeshard.reshard` besides the state tensors shaped like their
parameter (those are resharded as units of their own): the param groups' hyperparameters and
the scalar per-parameter states.

The first survivor records its old optimizer (:func:`record_optimizer`: small, picklable,
sent to every member); each member maps the new optimizer's param groups onto the old ones by
parameter name (:func:`map_groups`, which refuses what cannot be mapped) before anything is
written, and installs the whole new state only once the reshard has moved every tensor
(:func:`install`). Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = ["OPTIMIZER_SEP", "ScalarState", "OptimizerRecord", "record_optimizer", "map_groups", "install"]

# A unit of optimizer state is named "<parameter>::<state>" (AdamW's "...::exp_avg").
OPTIMIZER_SEP = "::"


class ScalarState(NamedTuple):
    """A scalar per-parameter state (AdamW's ``step``): its value (a 0-dim CPU tensor, or the
    plain Python value the optimizer kept), and whether the tensor lived on the parameter's
    device (``capturable`` / ``fused`` optimizers keep it there)."""

    value: Any
    on_device: bool


@dataclass(frozen=True)
class OptimizerRecord:
    """What an old optimizer holds besides its state tensors shaped like their parameter.

    Args:
        groups: per param group, in order: the names of its parameters (every alias of a tied
            one) and its hyperparameters (every key but ``params``; tensors on the CPU).
        scalars: per parameter name (every alias), its scalar states by state name.
    """

    groups: tuple[tuple[tuple[str, ...], dict], ...]
    scalars: dict[str, dict[str, ScalarState]]


def _names_by_tensor(params: Mapping[str, torch.Tensor]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, t in params.items():
        out.setdefault(id(t), []).append(name)
    return out


def _cpu(v):
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v


def record_optimizer(params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> OptimizerRecord:
    """Local: the param groups and scalar states of ``optimizer`` over the tensors ``params``
    (``{name: tensor}``, every alias of a tied parameter).

    Raises:
        ValueError: the optimizer holds a parameter ``params`` does not name, or a per-parameter
            state tensor that is neither a scalar nor shaped like its parameter (a factored
            state, which a reshard cannot cut).
    """
    names_of = _names_by_tensor(params)
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        names: list[str] = []
        for p in g["params"]:
            n = names_of.get(id(p))
            if n is None:
                raise ValueError(
                    f"param group {i} of old_optimizer holds a parameter of shape {list(p.shape)} that "
                    "old_tensors (the old model) does not name"
                )
            names += n
        groups.append((tuple(names), {k: _cpu(v) for k, v in g.items() if k != "params"}))
    scalars: dict[str, dict[str, ScalarState]] = {}
    for p, state in optimizer.state.items():
        names = names_of.get(id(p))
        if names is None:
            raise ValueError(f"old_optimizer holds state of a parameter of shape {list(p.shape)} not in old_tensors")
        mine: dict[str, ScalarState] = {}
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                if tuple(v.shape) != tuple(p.shape):
                    raise ValueError(
                        f"old_optimizer's state {k!r} of {names[0]} has shape {list(v.shape)}, neither a scalar "
                        f"nor its parameter's {list(p.shape)}: a reshard cannot carry it"
                    )
                continue  # resharded with its parameter
            on_device = isinstance(v, torch.Tensor) and v.device.type != "cpu"
            mine[k] = ScalarState(_cpu(v), on_device)
        for n in names:
            scalars[n] = mine
    return OptimizerRecord(tuple(groups), scalars)


def map_groups(
    record: OptimizerRecord, params: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer
) -> tuple[int, ...]:
    """Local: for each param group of ``optimizer`` (over the new model's tensors ``params``,
    ``{name: tensor}``) the old group (of ``record``) whose hyperparameters it takes: the one
    holding every one of its parameters, by name.

    Raises:
        ValueError: a new group holds a parameter no old group holds, or parameters of several
            old groups (the new optimizer must be built with the old one's group structure).
    """
    old_group = {n: j for j, (names, _) in enumerate(record.groups) for n in names}
    names_of = _names_by_tensor(params)
    out = []
    for i, g in enumerate(optimizer.param_groups):
        found: dict[int, str] = {}
        for p in g["params"]:
            names = names_of.get(id(p))
            if names is None:
                raise ValueError(f"param group {i} of optimizer holds a tensor that is not a parameter of the model")
            js = {old_group[n] for n in names if n in old_group}
            if not js:
                raise ValueError(
                    f"param group {i} of optimizer holds {names[0]}, which no param group of old_optimizer holds: "
                    "build the new optimizer over the parameters the old one trained"
                )
            for j in js:
                found.setdefault(j, names[0])
        if len(found) > 1:
            pairs = ", ".join(f"{n} (old group {j})" for j, n in sorted(found.items()))
            raise ValueError(
                f"param group {i} of optimizer holds parameters of several param groups of old_optimizer: {pairs}; "
                "build the new optimizer with the old one's param groups (the same parameters in each)"
            )
        out.append(next(iter(found)) if found else 0)
    return tuple(out)


def _like(v, old, device: torch.device):
    """``v`` (from a record) as the value to store where ``old`` was: a tensor keeps the old
    value's device, else goes to ``device``."""
    if not isinstance(v, torch.Tensor):
        return v
    return v.clone().to(old.device if isinstance(old, torch.Tensor) else device)


def install(
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, torch.Tensor],
    record: OptimizerRecord,
    group_map: Sequence[int],
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
) -> None:
    """Local: make ``optimizer``'s state the old one's: each group takes the hyperparameters of
    its old group (``group_map``, :func:`map_groups`), and each parameter (``params``: the new
    model's ``{name: tensor}``) its scalar states from ``record`` and its state tensors from
    ``tensors`` (``{parameter name: {state name: tensor}}``, already filled); a parameter with
    neither has no state. Called once everything is filled: nothing here can fail on valid
    inputs."""
    for g, j in zip(optimizer.param_groups, group_map):
        for k, v in record.groups[j][1].items():
            g[k] = _like(v, g.get(k), torch.device("cpu"))
    names_of = _names_by_tensor(params)
    for g in optimizer.param_groups:
        for p in g["params"]:
            names = names_of[id(p)]
            scalars = next((record.scalars[n] for n in names if n in record.scalars), {})
            moved = next((tensors[n] for n in names if n in tensors), {})
            dev = p.device
            state = {
                k: s.value.clone().to(dev if s.on_device else "cpu") if isinstance(s.value, torch.Tensor) else s.value
                for k, s in scalars.items()
            }
            state.update(moved)
            if state:
                optimizer.state[p] = state
            else:
                optimizer.state.pop(p, None)
