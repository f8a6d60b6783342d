"""Who routes each experts module's tokens to its slots: what a relocation must update with the weights.

A relocation moves experts between slots; a token must then reach its expert's new slot, or the
model computes with the wrong expert and no error. :func:`experts_routing` says, per experts
module of a model, who sends tokens to its slots (:class:`ExpertsRouting`'s ``kind``):

* ``"moeshard"``: moeshard's EP forward (:func:`moeshard.parallelize` installed it); it routes by
  the placement, and :func:`moeshard.models.ep.set_placement` points it at the new one.
* ``"transformers"``: an experts module transformers made expert-parallel itself
  (``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=W, ep_size=E))``). Its
  forward (``EpDispatchExpertsParallel`` with an ``EPImplementation``: ``AllToAllEP``,
  ``AllReduceEP``) sends logical expert ``e`` to EP rank ``e // S``, local expert ``e % S`` (``S =
  num_experts / ep_size``, which it also stores as the module's ``num_experts``): contiguous
  logical experts per rank, with no placement it could follow. Its expert parameters are DTensors
  ``[num_experts, ...]`` on transformers' expert mesh ``(efsdp, ep)``, ``Shard(0)`` on "ep" (and
  FSDP2's ``_StridedShard(0)`` on "efsdp"), so slot ``p`` lives on EP rank ``p // S``: moeshard's
  own layout with one slot per logical expert. :func:`take_over` gives it moeshard's EP forward
  (the class's own experts math on the local slots, tokens exchanged inside the parameters' "ep"
  group), which routes by the placement.
* ``"none"``: no forward that routes tokens (a module that only holds weights, or the forward
  moeshard installs to raise NotImplementedError): nothing to update.
* ``"unknown"``: any other forward (a custom or torchtitan dispatch, a transformers experts module
  in one process indexing its experts by logical id, transformers' EP over a TP group): moeshard
  cannot see how it routes, so :func:`check_routing` refuses to relocate it unless the caller
  routes tokens itself (``routing="caller"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import nn

from .adapters import DEFAULT_SPECS, ExpertsSpec
from .describe import expert_layers
from .ep import (
    ROUTED,
    EPLayer,
    ep_forward_installed,
    ep_host,
    experts_kind,
    install_ep_forward,
    model_placement,
    unsupported_forward,
)
from .slot_guard import SlotGuard, guard_slots

__all__ = [
    "ExpertsRouting",
    "ROUTING_MODES",
    "experts_routing",
    "check_routing",
    "take_over",
    "declared_experts",
    "resolve_placement",
]

ROUTING_MODES = ("auto", "caller")


@dataclass(frozen=True, eq=False)
class ExpertsRouting:
    """Who routes tokens to one experts module's slots (module doc).

    Args:
        name: the module's qualified name.
        module: the experts module.
        layer: its MoE layer (the placement's row).
        kind: "moeshard", "transformers", "none" or "unknown".
        why: for "unknown", what moeshard sees of its forward.
    """

    name: str
    module: nn.Module
    layer: int
    kind: str
    why: str = ""


def _ep_sharded(module: nn.Module, spec: ExpertsSpec) -> bool:
    """Whether every expert parameter of the module is a DTensor sharded on dim 0 over a mesh dim
    named "ep" (transformers' ``grouped_gemm`` style)."""
    for p in spec.params:
        t = module._parameters.get(p.name)
        names = getattr(getattr(t, "device_mesh", None), "mesh_dim_names", None) or ()
        if "ep" not in names:
            return False
        shard = t.placements[names.index("ep")]
        if type(shard).__name__ != "Shard" or shard.dim != 0:
            return False
    return True


def _tp_size(model: nn.Module) -> int:
    return int(getattr(getattr(getattr(model, "config", None), "distributed_config", None), "tp_size", 1) or 1)


def _classify(model: nn.Module, module: nn.Module, spec: ExpertsSpec, host: nn.Module) -> tuple[str, str]:
    """``(kind, why)`` of one experts module (module doc); ``host``: the module whose forward runs
    its experts (:func:`moeshard.models.ep.ep_host`: itself, or DBRX's parent)."""
    if ep_forward_installed(host):
        return "moeshard", ""
    own = module.__dict__.get("forward")
    if own is not None and getattr(own, "__func__", None) is unsupported_forward:
        return "none", ""
    if own is None and type(module).forward is nn.Module.forward:
        return "none", ""
    cls = type(module).__name__
    if getattr(module, "_is_expert_parallel", False) and _ep_sharded(module, spec):
        # transformers' EP (module doc); what moeshard's EP forward cannot stand in for:
        if experts_kind(module) != ROUTED:
            return "unknown", f"{cls} is expert-parallel (transformers) with a forward that is not the routed one"
        if _tp_size(model) > 1:
            return "unknown", (
                f"{cls} is expert-parallel (transformers) over a TP group of {_tp_size(model)} ranks "
                "sharing one batch, which moeshard's EP forward does not slice"
            )
        if getattr(getattr(module, "config", None), "_experts_implementation", None) == "deepgemm_megamoe":
            return "unknown", f"{cls} runs DeepGEMM Mega MoE, whose kernel exchanges the tokens itself"
        extra = sorted(set(n for n, p in module._parameters.items() if p is not None) - {p.name for p in spec.params})
        if extra:
            return "unknown", (
                f"{cls} is expert-parallel (transformers) with parameters {extra} outside its experts spec"
            )
        return "transformers", ""
    if own is not None:
        return "unknown", f"{cls} has a forward of its own ({getattr(own, '__qualname__', own)!r})"
    return "unknown", f"{cls}.forward routes tokens itself"


def experts_routing(model: nn.Module, specs: Sequence[ExpertsSpec] = DEFAULT_SPECS) -> list[ExpertsRouting]:
    """Who routes each experts module of ``model`` (module doc), in MoE layer order. Local."""
    return [
        ExpertsRouting(name, mod, layer, *_classify(model, mod, spec, ep_host(model, name, mod)))
        for name, mod, spec, layer in expert_layers(model, specs)
    ]


def _num_slots(module: nn.Module) -> int:
    return int(next(p for p in module._parameters.values() if p is not None).shape[0])


def check_routing(
    model: nn.Module, old, new, routing: str = "auto", specs: Sequence[ExpertsSpec] = DEFAULT_SPECS
) -> list[ExpertsRouting]:
    """Whether ``model``'s routing can follow a relocation from placement ``old`` (None: a fill)
    to ``new``: every experts module's tokens must reach the new slots after it. Local and pure
    (the same answer on every rank); :func:`moeshard.relocate` runs it before anything moves.

    ``routing="auto"``: moeshard updates the routing (kinds "moeshard", "transformers", "none");
    ``"caller"``: the caller routes tokens by ``new`` itself (its own dispatch, a serving engine),
    and moeshard only moves weights. Returns :func:`experts_routing`'s list.

    Raises:
        ValueError: naming the module, for an "unknown" one under "auto" (and the keyword that
            lets it through); for a transformers one under "auto", a placement it cannot hold
            (redundant copies: its parameters have one slot per logical expert) or an ``old``
            that is not transformers' contiguous layout (then its weights are not where its own
            forward sends the tokens).
    """
    if routing not in ROUTING_MODES:
        raise ValueError(f"routing={routing!r}: expected one of {list(ROUTING_MODES)}")
    entries = experts_routing(model, specs)
    if routing == "caller":
        return entries
    for e in entries:
        if e.kind == "unknown":
            raise ValueError(
                f"experts module {e.name}: moeshard cannot see how its tokens are routed ({e.why}), so relocating "
                f'its experts would leave its tokens going to the old slots. Pass routing="caller" to relocate '
                "if your code routes its tokens by the new placement (the placement's phy2log / log2phy), or "
                "parallelize the model with moeshard.parallelize, whose EP forward follows the placement"
            )
        if e.kind != "transformers":
            continue
        slots = _num_slots(e.module)
        for p, what in ((old, "old"), (new, "new")):
            if p is not None and p.num_physical != slots:
                raise ValueError(
                    f"experts module {e.name}: transformers built it expert-parallel with one slot per logical "
                    f"expert ({slots} per layer); the {what} placement has {p.num_physical} slots per layer "
                    "(redundant copies need a model parallelized by moeshard.parallelize)"
                )
        if old is not None and not old.is_identity(e.layer):
            raise ValueError(
                f"experts module {e.name}: transformers' EP forward holds logical expert e in slot e (contiguous "
                f"per EP rank), but the old placement's layer {e.layer} is {old.phy2log[e.layer].tolist()}: pass "
                "the placement the model holds (Placement.contiguous for a model transformers just built)"
            )
    return entries


def take_over(entries: Sequence[ExpertsRouting], placement) -> int:
    """Give every "transformers" experts module of ``entries`` moeshard's EP forward, routing by
    ``placement`` (after :func:`check_routing`). Local, no communication; every rank does it with
    the same placement. Returns the number of modules taken over.

    The EP group is the expert parameters' mesh dim "ep" (transformers' expert mesh), with
    ``num_experts / ep_size`` slots per rank. Gradients keep transformers' convention: its FSDP
    divides the expert gradients by the data-parallel size itself
    (``set_gradient_divide_factor``), so the EP forward leaves them unscaled (``grad_scale`` 1),
    as transformers' own all-to-all does: training goes on with the gradients it had.
    """
    done = 0
    for e in entries:
        if e.kind != "transformers":
            continue
        # Every parameter is an expert parameter of the module's spec (_classify checked it).
        names = tuple(n for n, p in e.module._parameters.items() if p is not None)
        ep_mesh = e.module._parameters[names[0]].device_mesh["ep"]
        ep_layer = EPLayer(
            e.layer,
            placement.phy2log[e.layer],
            placement.log2phy[e.layer],
            placement.logcnt[e.layer],
            _num_slots(e.module) // ep_mesh.size(),
            ep_mesh.get_local_rank(),
            ep_mesh.get_group(),
            1.0,
            names,
        )
        if not install_ep_forward(e.module, ep_layer):
            raise AssertionError(f"{e.name}: the routed EP forward was not installed")  # _classify checked its kind
        # Its slots may now hold a shuffled placement: its state dict would be slot order (the
        # guard reads the routing table just installed, which set_placement then changes).
        guard_slots(e.module, SlotGuard(e.module, e.layer, names, e.name))
        done += 1
    return done


def declared_experts(module: nn.Module) -> int | None:
    """The number of logical experts experts module ``module`` declares (its ``num_experts``), or
    None. transformers' EP (module doc) sets ``num_experts`` to this rank's count: the logical
    count is then its expert parameters' global dim 0."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int):
        return None
    if getattr(module, "_is_expert_parallel", False):
        t = next((p for p in module._parameters.values() if p is not None and hasattr(p, "device_mesh")), None)
        return None if t is None else int(t.shape[0])
    return n


def resolve_placement(model: nn.Module, placement, what: str, specs: Sequence[ExpertsSpec] = DEFAULT_SPECS):
    """The placement an operation on ``model`` must use: the model's own
    (:func:`moeshard.models.ep.model_placement`) when ``placement`` is None, ``placement`` when
    nothing in the model routes by one. Local and pure (the same answer on every rank).

    Raises:
        ValueError: ``placement`` differs from the one the model routes tokens by (moeshard's EP
            forward's, or for experts transformers made expert-parallel, logical expert e in
            slot e): loading, verifying or saving by it would put or read experts in other slots
            than the forward uses (``what`` names the operation).
    """
    own = model_placement(model)
    if own is None:
        if placement is not None:
            theirs = [e for e in experts_routing(model, specs) if e.kind == "transformers"]
            bad = [e.layer for e in theirs if not placement.is_identity(e.layer)]
            if bad:
                raise ValueError(
                    f"{what}: {theirs[0].name} is routed by transformers' EP forward (logical expert e in slot e); "
                    f"the placement given puts other experts in its slots (MoE layer {bad[0]} first): pass none, "
                    "or relocate the model first (moeshard.relocate gives it placement-aware routing)"
                )
        return placement
    if placement is None:
        return own
    if placement.phy2log.shape != own.phy2log.shape or not np.array_equal(placement.phy2log, own.phy2log):
        layer = _first_difference(placement.phy2log, own.phy2log)
        raise ValueError(
            f"{what}: the placement given (phy2log {list(placement.phy2log.shape)}) differs from the one the "
            f"model routes tokens by (phy2log {list(own.phy2log.shape)}{layer}): pass the placement the model "
            "was parallelized with or last relocated to, or none (the model's own is used)"
        )
    return placement


def _first_difference(a: np.ndarray, b: np.ndarray) -> str:
    if a.shape != b.shape:
        return ""
    rows = np.flatnonzero((a != b).any(axis=1))
    return f"; MoE layer {int(rows[0])} first differs" if len(rows) else ""
