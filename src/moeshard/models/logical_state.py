"""``moeshard.logical_state_dict``: a moeshard model's state dict in logical expert order, gathered.

The state dict torch's own paths refuse for a shuffled or redundant placement
(:mod:`moeshard.models.slot_guard`), produced explicitly: DCP's full state dict of the model
(every tensor unsharded; on rank 0 only with ``cpu_offload``), in which each slot-ordered tensor
is then put in the checkpoint's order, one row per logical expert (its first copy). This is a
gather of the whole model, as accelerate's and the Trainer's full saves are; for large models
:func:`moeshard.save` writes the same tensors in HF format without gathering them anywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from .slot_guard import SlotGuard, allow_slot_order

__all__ = ["logical_state_dict"]


def logical_state_dict(model: nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Collective (every rank): ``model``'s full state dict with every expert tensor in logical
    order, as a one-process model of the checkpoint's class would return it.

    Expert weights ``[num_physical, ...]`` become ``[num_logical, ...]`` (row ``e`` from the first
    slot holding expert ``e``); expert LoRA factors become peft's layout, ``lora_A [r*E, in]`` and
    ``lora_B [out, r*E]``. Other tensors are DCP's full tensors.

    Args:
        model: a model prepared by :func:`moeshard.parallelize` (any placement).
        cpu_offload: True: the tensors are on the CPU of rank 0, and the other ranks get ``{}``
            (DCP's ``StateDictOptions(full_state_dict=True, cpu_offload=True)``); False: every
            rank gets every tensor on the model's device.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with allow_slot_order():  # the slot-ordered tensors are put right below
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
    if not state:
        return state
    for name, module in model.named_modules():
        guard = getattr(module, "moeshard_slot_guard", None)
        if not isinstance(guard, SlotGuard):
            continue
        for param in guard.params:
            key = f"{name}.{param}" if name else param
            if key in state:
                state[key] = _logical(state[key], guard)
    return state


def _logical(t: torch.Tensor, guard: SlotGuard) -> torch.Tensor:
    """One full slot-ordered tensor -> logical order (module doc of :class:`SlotGuard` for the
    layouts)."""
    table = guard.table  # the layer's routing table: the placement the slots hold now
    num_physical, num_logical = len(table.phy2log), len(table.logcnt)
    first = torch.as_tensor(table.log2phy[:, 0].copy(), device=t.device)  # [E] first copy's slot
    if guard.lora_rank:  # LoRA B [out, r*P]: columns (EP rank, r, slot) -> (r, expert)
        ep, r = table.ep_size, guard.lora_rank
        spr = num_physical // ep
        cols = t.reshape(t.shape[0], ep, r, spr).permute(0, 2, 1, 3).reshape(t.shape[0], r, num_physical)
        return cols[:, :, first].reshape(t.shape[0], r * num_logical).contiguous()
    rows = t.reshape(num_physical, -1, *t.shape[1:])  # [P, k, ...]: LoRA A has r rows per slot
    return rows[first].reshape(-1, *t.shape[1:]).contiguous()
