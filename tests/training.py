"""The one-process reference of the parity tests: AdamW steps on the whole batch."""

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
