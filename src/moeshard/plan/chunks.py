"""Chunked relocation: old placement -> new one a few layers at a time (pure, torch-free).

A serving engine cannot stop for a whole-model relocation; it rebalances a few layers between
forward steps (sglang ``--eplb-rebalance-layers-per-chunk``, vLLM's asynchronous EPLB). Every
intermediate placement here is a valid placement: each layer's row is either its old row (not
moved yet) or its new row (moved), so a forward between two chunks routes every layer to the
slots that hold its experts at that moment. Layers whose row does not change take no chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..placement import Placement, slots_changed

__all__ = ["relocation_chunks"]


def relocation_chunks(
    old: Placement,
    new: Placement,
    *,
    layers_per_chunk: int | None = None,
    max_bytes: int | None = None,
    slot_bytes: int | Sequence[int] | np.ndarray | None = None,
) -> list[tuple[tuple[int, ...], Placement]]:
    """Cut the move from ``old`` to ``new`` into chunks of whole layers, in layer order.

    Args:
        layers_per_chunk: at most this many changed layers per chunk.
        max_bytes: at most this many bytes written per chunk (a layer's bytes: its changed
            slots times ``slot_bytes``); a layer above it gets a chunk of its own.
        slot_bytes: bytes of one expert slot (every tensor of an expert: weights, scales,
            optimizer state), one number or one per layer; needed with ``max_bytes``.

    Returns ``[(layers, placement)]``: the MoE layers each chunk moves and the placement in
    force after it (``new``'s rows for the layers moved so far, ``old``'s for the others); the
    last placement equals ``new``. Empty when no layer changes.

    Raises:
        ValueError: placements of different shapes or expert counts, no bound or a bound
            below 1, ``max_bytes`` without ``slot_bytes``.
    """
    if old.num_logical != new.num_logical:
        raise ValueError(f"the old placement has {old.num_logical} logical experts, the new one {new.num_logical}")
    changed = slots_changed(old, new, per_layer=True)
    if layers_per_chunk is None and max_bytes is None:
        raise ValueError("pass layers_per_chunk or max_bytes (or both)")
    if layers_per_chunk is not None and layers_per_chunk < 1:
        raise ValueError(f"layers_per_chunk must be >= 1, got {layers_per_chunk}")
    if max_bytes is not None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if slot_bytes is None:
            raise ValueError("max_bytes needs slot_bytes (the bytes of one expert slot)")
    per_slot = np.broadcast_to(np.asarray(0 if slot_bytes is None else slot_bytes, dtype=np.int64), changed.shape)
    layer_bytes = changed * per_slot
    moving = np.flatnonzero(np.any(new.phy2log != old.phy2log, axis=1))
    chunks: list[list[int]] = []
    size = 0
    for layer in moving.tolist():
        full = chunks and (
            (layers_per_chunk is not None and len(chunks[-1]) >= layers_per_chunk)
            or (max_bytes is not None and size + int(layer_bytes[layer]) > max_bytes)
        )
        if not chunks or full:
            chunks.append([])
            size = 0
        chunks[-1].append(layer)
        size += int(layer_bytes[layer])
    out = []
    rows = old.phy2log.copy()
    for layers in chunks:
        rows[layers] = new.phy2log[layers]
        out.append((tuple(layers), Placement(rows.copy(), num_logical=new.num_logical, num_ranks=new.num_ranks)))
    return out
