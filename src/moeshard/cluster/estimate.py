"""Bandwidths and the time estimate: the slowest of storage reads, intra-node and inter-node
links, which names the bottleneck."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import StrategyCost

__all__ = ["Bandwidth", "parse_bandwidth", "estimate_time"]


@dataclass(frozen=True)
class Bandwidth:
    """Bandwidths in bytes/s: storage reads per node, per-rank intra-node and inter-node links."""

    storage: float
    intra: float
    inter: float


def parse_bandwidth(text: str) -> Bandwidth:
    """``"storage=5,intra=150,inter=25"`` (GB/s, 1 GB = 1e9 bytes) -> :class:`Bandwidth`."""
    vals: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in ("storage", "intra", "inter"):
            raise ValueError(f"--bandwidth: expected storage=GBps,intra=GBps,inter=GBps, got {text!r}")
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"--bandwidth: {name}={value!r} is not a number") from None
        if not v > 0 or not math.isfinite(v):
            raise ValueError(f"--bandwidth: {name} must be a positive number of GB/s, got {value}")
        vals[name] = v * 1e9
    missing = [k for k in ("storage", "intra", "inter") if k not in vals]
    if missing:
        raise ValueError(f"--bandwidth: missing {', '.join(missing)} (give storage=,intra=,inter= in GB/s)")
    return Bandwidth(**vals)


def estimate_time(cost: StrategyCost, bw: Bandwidth) -> tuple[float, str]:
    """Seconds and bottleneck: max of (storage bytes read per node / storage bandwidth, max
    per-rank intra-node bytes / intra bandwidth, max per-rank inter-node bytes / inter
    bandwidth). A lower bound: it assumes the three overlap perfectly and ignores latency."""
    terms = {
        "storage": cost.read_bytes_max_node / bw.storage,
        "intra-node": cost.intra_bytes_max_rank / bw.intra,
        "inter-node": cost.inter_bytes_max_rank / bw.inter,
    }
    name = max(terms, key=terms.__getitem__)
    return terms[name], name
