"""The one-process reference of the parity tests (AdamW steps on the whole batch), and the
test-only shim that lets accelerate take its FSDP2 path on the CPU for the Trainer tests."""

from __future__ import annotations

import torch


def one_process_steps(model, ids: torch.Tensor, steps: int, lr: float) -> tuple[list[float], list[float]]:
    """``steps`` AdamW steps of ``model`` (its trainable parameters) on ``ids [B, T]`` (labels =
    ids). Returns the loss and the global gradient norm of every step."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses, norms = [], []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def accelerate_fsdp_on_cpu() -> None:
    """Test shim: accelerate's state keeps MULTI_CPU and drops the FSDP plugin on CPU (it sets
    FSDP for GPU types only); do for CPU what it does for GPUs."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState, "_moeshard_test_shim", False):
        return
    orig = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        orig(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init
    AcceleratorState._moeshard_test_shim = True
