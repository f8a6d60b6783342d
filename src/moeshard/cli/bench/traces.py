"""Synthetic expert-load traces for the EPLB benchmark and tests (pure numpy, deterministic)."""

from __future__ import annotations

import numpy as np

__all__ = ["zipf_trace"]


def zipf_trace(
    num_layers: int,
    num_logical: int,
    steps: int,
    seed: int = 0,
    alpha: float = 1.2,
    drift: float = 0.1,
    noise: float = 0.05,
    tokens_per_expert: float = 1000.0,
) -> np.ndarray:
    """Tokens routed to each logical expert, per step, drifting over time.

    Per layer, expert popularity is Zipf-skewed over a random permutation of the experts: the
    expert of popularity rank ``r`` (0 = hottest) gets weight ``(r + 1) ** -alpha``. Each step
    after the first, ``round(drift * num_logical)`` experts (rounded down to an even number)
    are paired at random and each pair swaps popularity ranks (cumulative: the popularity keeps
    drifting), and the step's loads get independent multiplicative log-normal noise of sigma
    ``noise``. Every layer routes ``tokens_per_expert * num_logical`` tokens per step (before
    noise).

    Returns:
        ``float[steps, num_layers, num_logical]``; the same for the same arguments.
    """
    if min(num_layers, num_logical, steps) < 1:
        raise ValueError(f"need num_layers, num_logical, steps >= 1; got {num_layers}, {num_logical}, {steps}")
    if not 0 <= drift <= 1 or alpha < 0 or noise < 0:
        raise ValueError(f"need 0 <= drift <= 1, alpha >= 0, noise >= 0; got {drift}, {alpha}, {noise}")
    rng = np.random.default_rng(seed)
    weight_of_rank = (np.arange(num_logical) + 1.0) ** -alpha
    weight_of_rank *= tokens_per_expert * num_logical / weight_of_rank.sum()
    # popularity[l, e] = popularity rank of expert e in layer l
    popularity = np.argsort(rng.random((num_layers, num_logical)), axis=1)
    num_swap = int(round(drift * num_logical)) // 2 * 2
    out = np.empty((steps, num_layers, num_logical))
    for t in range(steps):
        if t and num_swap:
            for layer in range(num_layers):
                pick = rng.choice(num_logical, size=num_swap, replace=False)
                a, b = pick[: num_swap // 2], pick[num_swap // 2 :]
                popularity[layer, a], popularity[layer, b] = popularity[layer, b], popularity[layer, a].copy()
        out[t] = weight_of_rank[popularity] * rng.lognormal(0.0, noise, size=(num_layers, num_logical))
    return out
