"""A small MoE model, its HF-style checkpoint, and an independent computation of what every
rank must hold after a load (used by the multi-process tests; importable by spawned ranks).

The expected local tensors are computed from the checkpoint files (read with safetensors
itself), the placement's phy2log and the DTensor's own mesh coordinate and placements, with
torch.chunk semantics: none of moeshard's layout, adapter or reader code is involved.
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch
from torch import nn

VOCAB, HIDDEN, INTER, NUM_EXPERTS = 13, 8, 6, 8
# Blocks 0 and 2 are MoE blocks (MoE layers 0 and 1); block 1 is dense.
MOE_BLOCKS = (0, 2)
NUM_BLOCKS = 3


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))


class MoEMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, NUM_EXPERTS, bias=False)  # router (dense)
        self.experts = Experts(NUM_EXPERTS, HIDDEN, INTER)


class DenseMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, 3 * HIDDEN)


class Block(nn.Module):
    def __init__(self, moe: bool):
        super().__init__()
        self.attn = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(HIDDEN))
        self.mlp = MoEMLP() if moe else DenseMLP()


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(i in MOE_BLOCKS) for i in range(NUM_BLOCKS)])
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(HIDDEN))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.register_buffer("pos_table", torch.empty(5, 3), persistent=True)


def checkpoint_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """HF per-expert keys; experts in bf16, everything else fp32. Values are distinct."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    t = {
        "embed.weight": rnd(VOCAB, HIDDEN),
        "norm.weight": rnd(HIDDEN),
        "lm_head.weight": rnd(VOCAB, HIDDEN),
        "pos_table": rnd(5, 3),
    }
    for b in range(NUM_BLOCKS):
        p = f"layers.{b}"
        t[f"{p}.attn.weight"] = rnd(HIDDEN, HIDDEN)
        t[f"{p}.attn.bias"] = rnd(HIDDEN)
        t[f"{p}.norm.weight"] = rnd(HIDDEN)
        if b in MOE_BLOCKS:
            t[f"{p}.mlp.gate.weight"] = rnd(NUM_EXPERTS, HIDDEN)
            for e in range(NUM_EXPERTS):
                q = f"{p}.mlp.experts.{e}"
                t[f"{q}.gate_proj.weight"] = rnd(INTER, HIDDEN, dtype=torch.bfloat16)
                t[f"{q}.up_proj.weight"] = rnd(INTER, HIDDEN, dtype=torch.bfloat16)
                t[f"{q}.down_proj.weight"] = rnd(HIDDEN, INTER, dtype=torch.bfloat16)
        else:
            t[f"{p}.mlp.fc.weight"] = rnd(3 * HIDDEN, HIDDEN)
            t[f"{p}.mlp.fc.bias"] = rnd(3 * HIDDEN)
    return t


def write(directory, max_shard_bytes: int = 3000) -> None:
    import moeshard

    moeshard.write_checkpoint(directory, checkpoint_tensors().items(), max_shard_bytes=max_shard_bytes)


def read_all(directory) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory, read with safetensors itself."""
    import json
    import os

    from safetensors import safe_open

    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for name in files:
        with safe_open(os.path.join(directory, name), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def shuffled_placement(num_layers: int, num_logical: int, ep: int, num_physical: int, seed: int):
    import moeshard

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_layers):
        row = np.concatenate([np.arange(num_logical), rng.integers(0, num_logical, num_physical - num_logical)])
        rows.append(rng.permutation(row))
    return moeshard.Placement(np.stack(rows), num_logical=num_logical, num_ranks=ep)


_EXPERT = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def expected_full(name: str, ckpt: dict[str, torch.Tensor], phy2log: np.ndarray | None, moe_layer_of: dict[str, int]):
    """Global (physical) tensor of parameter ``name``: slot p = logical expert phy2log[layer, p];
    gate rows then up rows."""
    m = _EXPERT.match(name)
    if m is None:
        return ckpt[name]
    module, param = m.groups()
    row = phy2log[moe_layer_of[module]]
    slots = []
    for e in row.tolist():
        if param == "gate_up_proj":
            slots.append(torch.cat([ckpt[f"{module}.{e}.gate_proj.weight"], ckpt[f"{module}.{e}.up_proj.weight"]], 0))
        else:
            slots.append(ckpt[f"{module}.{e}.down_proj.weight"])
    return torch.stack(slots)


def _chunk(n: int, k: int, i: int) -> slice:
    size = -(-n // k)
    start = min(i * size, n)
    return slice(start, min(start + size, n))


def local_box(t) -> tuple[slice, ...]:
    """This rank's region of a DTensor (torch.chunk semantics per Shard placement)."""
    from torch.distributed.tensor import DTensor, Shard

    sl = [slice(0, n) for n in t.shape]
    if not isinstance(t, DTensor):
        return tuple(sl)
    coord = t.device_mesh.get_coordinate()
    mesh_shape = t.device_mesh.mesh.shape
    for mesh_dim, p in enumerate(t.placements):
        if isinstance(p, Shard):
            assert sl[p.dim] == slice(0, t.shape[p.dim]), "one Shard per tensor dim in these tests"
            sl[p.dim] = _chunk(t.shape[p.dim], mesh_shape[mesh_dim], coord[mesh_dim])
    return tuple(sl)


def moe_layers(model: nn.Module) -> dict[str, int]:
    names = [n for n, _ in model.named_modules() if n.endswith(".experts")]
    return {n: i for i, n in enumerate(names)}


def local_of(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.data if isinstance(t, nn.Parameter) else t
    return t._local_tensor if isinstance(t, DTensor) else t


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def compare(model: nn.Module, ckpt: dict[str, torch.Tensor], placement) -> list[str]:
    """Mismatches between every local tensor of ``model`` and what the checkpoint says
    this rank must hold (empty list: every element of every local tensor is right)."""
    problems = []
    layers = moe_layers(model)
    for name, t in named_tensors(model).items():
        full = expected_full(name, ckpt, placement.phy2log, layers).to(t.dtype)
        if tuple(full.shape) != tuple(t.shape):
            problems.append(f"{name}: global shape {tuple(t.shape)} != expected {tuple(full.shape)}")
            continue
        want = full[local_box(t)]
        got = local_of(t)
        if got.shape != want.shape or not torch.equal(got, want):
            bad = (got != want).nonzero()[:3].tolist() if got.shape == want.shape else "shape"
            problems.append(f"{name}: local tensor differs from the checkpoint (first bad {bad})")
    return problems


def scramble(model: nn.Module) -> None:
    """Fill every local tensor with NaN, so a load that misses an element is caught."""
    with torch.no_grad():
        for t in named_tensors(model).values():
            if not t.is_meta:
                local_of(t).fill_(float("nan"))


def slot_origin(t) -> int:
    return local_box(t)[0].start


def num_elements(model) -> int:
    return sum(math.prod(local_of(t).shape) for t in named_tensors(model).values())
