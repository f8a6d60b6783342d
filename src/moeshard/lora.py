"""``moeshard.lora``: peft LoRA adapters on an EP + FSDP2 model (the public names).

``load(model, base, adapter)`` loads the base checkpoint and then the adapter;
``load_adapter`` / ``save_adapter`` read and write peft's adapter files through moeshard's
planner and runner. The operations live in :mod:`moeshard.ops.lora`, the model side (expert
LoRA wrappers -> per-slot factors) in :mod:`moeshard.models.lora`.
"""

from .ops.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    AdapterReport,
    adapter_tensors,
    load,
    load_adapter,
    save_adapter,
)

__all__ = [
    "AdapterError",
    "AdapterReport",
    "ADAPTER_WEIGHTS",
    "ADAPTER_CONFIG",
    "adapter_tensors",
    "load",
    "load_adapter",
    "save_adapter",
]
