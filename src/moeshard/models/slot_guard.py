"""Keep torch's state-dict paths from reading or writing expert slots as if they were experts.

After :func:`moeshard.parallelize` an expert parameter is a DTensor ``[num_physical, ...]`` in
*slot* order: row ``p`` holds logical expert ``phy2log[layer, p]``. Every saver and loader a user
reaches through torch works on that tensor as it is: ``model.state_dict()`` /
``load_state_dict()`` (``torch.save``, ``save_pretrained``, safetensors' ``save_model``), DCP's
``get_model_state_dict`` / ``set_model_state_dict`` (accelerate, the transformers Trainer,
torchtitan), and the optimizer's state of those parameters (``optimizer.state_dict()``, DCP's
``get/set_optimizer_state_dict``). With a placement other than the identity they would write
experts in slot order (a shuffled save that ``from_pretrained`` loads silently wrong, 12
"experts" for 8 with redundant copies) or read a logical checkpoint into the wrong slots.

Producing logical order needs communication (a rank's slots hold other ranks' logical rows),
and ``state_dict()`` is not collective in torch (a rank-0-only call must not hang), so this
module makes those paths *loud* instead: every one raises ``ValueError`` on every rank, naming
the parameter, the layer's placement and :func:`moeshard.save` (:func:`moeshard.lora.save_adapter`
for LoRA factors). The identity placement (``phy2log[layer] == arange(num_logical)``: what
``Placement.contiguous(..., num_redundant=0)`` gives) is logical order already, and passes
untouched. The check reads the model's *current* placement from the layer's routing table (the
``moeshard_ep`` of the module running the experts, :func:`moeshard.models.ep.routing_tables`),
which :func:`moeshard.models.ep.set_placement` (hence :func:`moeshard.relocate`) changes: a guard
keeps no placement of its own.

How each path is reached (public torch hooks only):

* modules: a ``state_dict`` pre-hook and a ``load_state_dict`` pre-hook on every module that owns
  a slot-ordered parameter (each experts module; the ``lora_A`` / ``lora_B`` linears of expert
  LoRA adapters). ``Module.state_dict`` / ``load_state_dict`` run them for any ancestor's call,
  and DCP's ``get_model_state_dict`` / ``set_model_state_dict`` call those (full and sharded).
  The parallelized model itself gets a ``load_state_dict`` pre-hook checking them all first, so
  a refused load copies nothing (:func:`guard_model`). A load raises when the incoming dict holds
  the parameter's key, whatever its value (a partial ``strict=False`` load of other keys is
  fine), even a value that *is* the parameter: DCP's full-state load puts the parameter itself
  under every key, both for keys it was not given and, with ``broadcast_from_rank0``, for keys
  whose rows it has already copied into it (that copy precedes every hook: the load still
  raises, but the experts must be reloaded).
* optimizers: torch has no hook on an optimizer's creation, so a global step pre-hook
  (``torch.optim.optimizer.register_optimizer_step_pre_hook``) meets each optimizer at its first
  ``step()`` (DCP's ``get/set_optimizer_state_dict`` take one to initialize the state) and
  installs a ``state_dict`` pre-hook and a ``load_state_dict`` pre-hook on those holding slot
  parameters. State that is already there at that first step came from a ``load_state_dict``
  nobody checked: the step raises before it updates anything. :func:`guard_optimizer` installs
  the hooks at once (a resume then fails at ``load_state_dict`` itself). Until its first step an
  optimizer's own ``state_dict()`` is unchecked: it can only hold state loaded unchecked.

Code that knowingly keeps slot order (it saves the placement beside the tensors and restores
them under that placement, e.g. a Trainer integration) runs inside :func:`allow_slot_order`.
:func:`moeshard.logical_state_dict` gathers the logical state dict explicitly (collective).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = [
    "SlotGuard",
    "allow_slot_order",
    "guard_model",
    "guard_optimizer",
    "guard_slots",
    "slot_order_problem",
]

# Modules owning a guarded parameter (the optimizer hooks look their parameters up here: FSDP2
# replaces parameter objects when it shards, so they are read from the module when needed).
_OWNERS: weakref.WeakSet[nn.Module] = weakref.WeakSet()
# Optimizers the global step hook has met (each is looked at once).
_SEEN: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_STEP_HOOK = None
_ALLOW = threading.local()


@dataclass(frozen=True, eq=False)
class SlotGuard:
    """What the hooks on one module check.

    Args:
        host: the module whose ``moeshard_ep`` (a :class:`moeshard.models.ep.EPLayer`) is this
            layer's routing table: the placement the slots hold now is read from it at every
            check (:attr:`table`).
        layer: MoE layer index (the placement's row).
        params: the module's parameters whose dim ``dim`` runs over slots.
        where: the module's name in the model (for optimizer messages; state-dict messages use
            the key being read or written).
        lora_rank: for a LoRA ``lora_B`` ``[out, r*num_physical]``: ``r``. Each EP rank's block
            of columns is ``(r, slots)``, slot fastest, so the global columns are not peft's
            ``(r, experts)`` order unless EP is 1 (or r is 1). 0 for parameters whose rows are
            whole slots (expert weights ``[P, ...]``, LoRA A ``[P*r, in]``, slot-major).
        saver: the call that writes these tensors right (for messages).
    """

    host: nn.Module
    layer: int
    params: tuple[str, ...]
    where: str
    lora_rank: int = 0
    saver: str = "moeshard.save(model, dir, placement=placement)"

    @property
    def table(self):
        """The layer's routing table now (``phy2log int[num_physical]``, ``log2phy
        int[num_logical, max_copies]``, ``logcnt int[num_logical]``, ``ep_size``)."""
        return self.host.moeshard_ep


def slot_order_problem(guard: SlotGuard) -> str | None:
    """None when ``guard``'s parameters are in logical order under the current placement (the
    identity placement); else what is wrong, for messages."""
    table = guard.table
    row = table.phy2log
    n = len(table.logcnt)
    if len(row) == n and np.array_equal(row, np.arange(n)):
        if guard.lora_rank > 1 and table.ep_size > 1:
            return (
                f"its columns are (r={guard.lora_rank}, slots) per EP rank over {table.ep_size} EP ranks, "
                "not peft's (r, experts) order"
            )
        return None
    empty = int((row < 0).sum())
    kind = "with empty slots" if empty else "redundant" if len(row) > n else "shuffled"
    shown = ", ".join(str(int(x)) for x in row[:16]) + (", ..." if len(row) > 16 else "")
    extra = f", {empty} empty" if empty else ""
    return (
        f"MoE layer {guard.layer}'s placement is {kind} ({len(row)} slots for {n} logical experts{extra}; "
        f"slot -> logical expert: [{shown}])"
    )


def _allowed() -> bool:
    return getattr(_ALLOW, "depth", 0) > 0


@contextlib.contextmanager
def allow_slot_order() -> Iterator[None]:
    """Within this block (this thread), torch's state-dict paths read and write expert
    parameters and their optimizer state in slot order, unchecked: for code that stores the
    placement beside them and restores them under that same placement only (then
    :func:`moeshard.relocate` with ``optimizer=`` to move on). Nothing else should use it."""
    _ALLOW.depth = getattr(_ALLOW, "depth", 0) + 1
    try:
        yield
    finally:
        _ALLOW.depth -= 1


def _error(guard: SlotGuard, key: str, problem: str, action: str) -> ValueError:
    if guard.where and guard.where not in key:
        key = f"{key} (of {guard.where})"  # a submodule's own state dict: name it in the model
    return ValueError(
        f"{key}: a moeshard expert parameter holds expert slots, not logical experts in order: {problem}. "
        f"{action} Use {guard.saver} (each logical expert once, in the checkpoint's order) and moeshard.load "
        "(or moeshard.relocate) to read it back. torch state dicts of a moeshard model are in logical order only "
        "for the identity placement (Placement.contiguous(..., num_redundant=0))."
    )


def _state_dict_pre_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    guard: SlotGuard = module.moeshard_slot_guard
    problem = None if _allowed() else slot_order_problem(guard)
    if problem is not None:
        raise _error(
            guard,
            prefix + guard.params[0],
            problem,
            "Its state dict (model.state_dict(), DCP's get_model_state_dict, a Trainer's or accelerate's "
            "save) would write the rows in slot order.",
        )


def _load_pre_hook(
    module: nn.Module, state_dict, prefix: str, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    guard: SlotGuard = module.moeshard_slot_guard
    if _allowed():
        return
    for name in guard.params:
        if prefix + name in state_dict:
            key = prefix + name
            problem = slot_order_problem(guard)
            if problem is not None:
                raise _error(
                    guard,
                    key,
                    problem,
                    "load_state_dict (or DCP's set_model_state_dict) would copy row p of the given tensor "
                    "into slot p, whichever expert the slot holds. (DCP's broadcast_from_rank0 copies "
                    "into the parameters before this check: reload them.)",
                )


def guard_slots(module: nn.Module, guard: SlotGuard) -> None:
    """Install the state-dict and load-state-dict pre-hooks on ``module`` (the owner of
    ``guard.params``), and the global optimizer step hook (once per process). Called by
    :func:`moeshard.parallelize`."""
    global _STEP_HOOK
    if getattr(module, "moeshard_slot_guard", None) is None:
        module.register_state_dict_pre_hook(_state_dict_pre_hook)
        module.register_load_state_dict_pre_hook(_load_pre_hook)
    module.moeshard_slot_guard = guard
    _OWNERS.add(module)
    if _STEP_HOOK is None:
        _STEP_HOOK = register_optimizer_step_pre_hook(_first_step_hook)


def guard_model(model: nn.Module, owners: dict[str, nn.Module]) -> None:
    """Install a ``load_state_dict`` pre-hook on ``model`` (the module :func:`moeshard.parallelize`
    was given) that checks every guarded module below it before anything is copied:
    ``Module.load_state_dict`` copies each module's tensors as it walks the tree, so the guarded
    module's own hook alone would leave the modules before it loaded when it raises. ``owners``:
    guarded modules by their names relative to ``model`` (module hooks stay for loads called on
    a submodule)."""
    owners = dict(owners)

    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name, owner in owners.items():
            _load_pre_hook(
                owner,
                state_dict,
                f"{prefix}{name}." if name else prefix,
                local_metadata,
                strict,
                missing_keys,
                unexpected_keys,
                error_msgs,
            )

    model.register_load_state_dict_pre_hook(hook)


# -- optimizers ------------------------------------------------------------------------------


def _slot_params(optimizer: torch.optim.Optimizer) -> list[tuple[int, torch.Tensor, SlotGuard, str]]:
    """``(position, parameter, guard, name)`` for each guarded parameter ``optimizer`` holds;
    position counts the parameters over its param groups in order (load_state_dict's pairing)."""
    owned = {}
    for module in list(_OWNERS):
        guard = module.moeshard_slot_guard
        for name in guard.params:
            p = module._parameters.get(name)
            if p is not None:
                owned[id(p)] = (guard, f"{guard.where}.{name}" if guard.where else name)
    out = []
    pos = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in owned:
                out.append((pos, p, *owned[id(p)]))
            pos += 1
    return out


def _per_element(state) -> bool:
    """Whether an optimizer's state of one parameter holds per-element tensors (moments)."""
    return any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in (state or {}).values())


def _optimizer_error(guard: SlotGuard, name: str, problem: str, what: str) -> ValueError:
    table = guard.table
    relocate = (
        "relocate to the identity placement first (moeshard.relocate(model, old, Placement.contiguous(..., "
        "num_redundant=0), optimizer=optimizer)) or, "
        if len(table.phy2log) == len(table.logcnt)
        else ""
    )
    return ValueError(
        f"optimizer state of {name}: a moeshard expert parameter holds expert slots, not logical experts in order: "
        f"{problem}. {what} To save it, {relocate}to restore it only under this same placement, save and load it "
        "together with the placement inside moeshard.allow_slot_order()."
    )


def _check_state(optimizer: torch.optim.Optimizer, what: str) -> None:
    if _allowed():
        return
    for _, p, guard, name in _slot_params(optimizer):
        if _per_element(optimizer.state.get(p)):
            problem = slot_order_problem(guard)
            if problem is not None:
                raise _optimizer_error(guard, name, problem, what)


def _optimizer_state_dict_pre_hook(optimizer: torch.optim.Optimizer) -> None:
    _check_state(
        optimizer,
        "Its state dict (optimizer.state_dict(), DCP's get_optimizer_state_dict) would write "
        "the moments in slot order.",
    )


def _optimizer_load_pre_hook(optimizer: torch.optim.Optimizer, state_dict: dict):
    if _allowed():
        return None
    saved = [k for g in state_dict.get("param_groups", ()) for k in g.get("params", ())]
    states = state_dict.get("state", {})
    for pos, _, guard, name in _slot_params(optimizer):
        if pos < len(saved) and _per_element(states.get(saved[pos])):
            problem = slot_order_problem(guard)
            if problem is not None:
                raise _optimizer_error(
                    guard,
                    name,
                    problem,
                    "optimizer.load_state_dict (or DCP's set_optimizer_state_dict) would give slot "
                    "p the moments of row p, whichever expert it holds.",
                )
    return None


def guard_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Check ``optimizer``'s state dict and load_state_dict against the placement of the
    moeshard expert parameters it holds, from now on (otherwise from its first step). Local.
    Returns whether it holds any.

    Raises:
        ValueError: it already holds per-element state of an expert parameter whose placement
            is not the identity (state that was loaded unchecked).
    """
    if getattr(optimizer, "_moeshard_guarded", False):
        return True
    if not _slot_params(optimizer):
        _SEEN.add(optimizer)
        return False
    # Checked before it counts as met: a step that raises here raises again at the next one.
    _check_state(
        optimizer,
        "It was set before the optimizer was checked (an unchecked optimizer.load_state_dict?) "
        "in an order nothing here knows.",
    )
    optimizer.register_state_dict_pre_hook(_optimizer_state_dict_pre_hook)
    optimizer.register_load_state_dict_pre_hook(_optimizer_load_pre_hook)
    optimizer._moeshard_guarded = True
    _SEEN.add(optimizer)
    return True


def _first_step_hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Global step pre-hook: an optimizer's first step installs its guard (see module doc)."""
    if optimizer not in _SEEN:
        guard_optimizer(optimizer)
    return None
