"""Expert tensors whose values say what they are, for the relocation tests.

Element ``i`` of tensor ``j`` of logical expert ``e`` of MoE layer ``l`` is
``l * 1e7 + e * 1e4 + j * 1e3 + i`` (float64, exact), as the serving engines' relocation tests
do: a slot holding the wrong expert, a stale value or a half-written part cannot pass.
"""

from __future__ import annotations

import numpy as np
import torch


def encode(layer: int, expert: int, tensor: int, shape) -> torch.Tensor:
    """Tensor ``tensor`` of logical expert ``expert`` of MoE layer ``layer``, of ``shape``."""
    n = int(np.prod(shape))
    return (layer * 1e7 + expert * 1e4 + tensor * 1e3 + torch.arange(n, dtype=torch.float64)).reshape(shape)


def params(num_tensors: int) -> list:
    """The :class:`moeshard.ExpertParam` of each tensor of an expert: keys ``{e}.w{j}``."""
    from moeshard import ExpertParam

    return [ExpertParam(f"w{j}", (f"{{e}}.w{j}",)) for j in range(num_tensors)]


def checkpoint_pairs(module: str, layers: int, num_logical: int, shapes) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of every expert tensor of ``layers`` MoE layers (``module`` formats a
    layer into its experts module's name), for ``moeshard.write_checkpoint``."""
    return [
        (f"{module.format(layer=layer)}.{e}.w{j}", encode(layer, e, j, shape))
        for layer in range(layers)
        for e in range(num_logical)
        for j, shape in enumerate(shapes)
    ]


def check(tensors: dict, phy2log: np.ndarray, ep_rank: int, slots: int, shapes, what: str = "") -> list[str]:
    """Every slot of EP rank ``ep_rank`` (``tensors``: ``{layer: [tensor[slots, *shapes[j]], ...]}``)
    that does not hold its expert under ``phy2log`` (``int[layers, num_physical]``; empty slots
    are not checked), one message each."""
    bad = []
    for layer, ts in tensors.items():
        for j, t in enumerate(ts):
            for k in range(slots):
                e = int(phy2log[layer, ep_rank * slots + k])
                if e >= 0 and not torch.equal(t[k], encode(layer, e, j, shapes[j])):
                    bad.append(
                        f"{what}{': ' if what else ''}EP rank {ep_rank} layer {layer} tensor {j} slot "
                        f"{ep_rank * slots + k}: want expert {e}"
                    )
    return bad
