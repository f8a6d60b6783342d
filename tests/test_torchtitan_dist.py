"""A model sharded the torchtitan way, on 4 gloo ranks (mesh efsdp=2 x ep=2): experts ``w1/w2/w3
[E, ...]`` (an ExpertsSpec of the model's own) get EP's Shard(0), then FSDP2 with Shard(0) on the
expert dim (torchtitan/distributed/fsdp.py when efsdp x ep <= num_experts), which torch writes as
``(_StridedShard(0, split_factor=ep), Shard(0))``; the rest is FSDP2 over all 4 ranks. moeshard
loads a per-expert checkpoint into it, verify passes, a relocation to a shuffled placement moves
the right experts, and every element is compared with the checkpoint's.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

from mp import run_ranks

pytestmark = pytest.mark.dist

E, H, FFN, LAYERS = 8, 6, 4, 2
MODULE = "layers.{}.moe.experts"


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(E, FFN, H))
        self.w2 = nn.Parameter(torch.empty(E, H, FFN))
        self.w3 = nn.Parameter(torch.empty(E, FFN, H))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.Linear(H, H)
        self.moe = nn.Module()
        self.moe.experts = Experts()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))


def spec():
    import moeshard

    return moeshard.ExpertsSpec(
        module=r"moe\.experts$",
        params=tuple(moeshard.ExpertParam(n, (f"{{e}}.{n}.weight",)) for n in ("w1", "w2", "w3")),
    )


def checkpoint_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in range(LAYERS):
        out[f"layers.{layer}.norm.weight"] = torch.randn(H, H, generator=g)
        out[f"layers.{layer}.norm.bias"] = torch.randn(H, generator=g)
        for e in range(E):
            for n, shape in (("w1", (FFN, H)), ("w2", (H, FFN)), ("w3", (FFN, H))):
                out[f"{MODULE.format(layer)}.{e}.{n}.weight"] = torch.randn(*shape, generator=g)
    return out


def titan_worker(path: str) -> list:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    import moeshard

    want = checkpoint_tensors()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    with torch.device("meta"):
        model = Model()
    experts = []
    for block in model.layers:
        mod = block.moe.experts
        for n in ("w1", "w2", "w3"):  # EP first: Shard(0) over the ep mesh dim
            old = getattr(mod, n)
            setattr(
                mod,
                n,
                nn.Parameter(
                    DTensor.from_local(
                        torch.empty(E // 2, *old.shape[1:], device="meta"),
                        mesh["ep"],
                        [Shard(0)],
                        run_check=False,
                        shape=old.shape,
                        stride=old.stride(),
                    )
                ),
            )
        fully_shard(mod, mesh=mesh["efsdp"], shard_placement_fn=lambda p: Shard(0))
        experts.append(mod)
    for block in model.layers:
        fully_shard(block, mesh=dp, ignored_params=set(p for m in experts for p in m.parameters()))
    w1 = model.layers[0].moe.experts.w1
    placements = [(type(x).__name__, getattr(x, "dim", None), getattr(x, "split_factor", None)) for x in w1.placements]
    pl = moeshard.Placement.contiguous(LAYERS, E, 2)
    moeshard.load(model, path, placement=pl, specs=(spec(),))
    checked = moeshard.verify(model, path, placement=pl, specs=(spec(),)).num_boxes_checked
    rng = np.random.default_rng(1)
    new = moeshard.Placement(np.stack([rng.permutation(E) for _ in range(LAYERS)]), num_logical=E, num_ranks=2)
    moeshard.relocate(model, pl, new, specs=(spec(),))
    bad = []
    for name, p in model.named_parameters():
        full = p.full_tensor()
        if ".experts." in name:
            layer, n = int(name.split(".")[1]), name.rsplit(".", 1)[1]
            for slot in range(E):
                key = f"{MODULE.format(layer)}.{int(new.phy2log[layer, slot])}.{n}.weight"
                if not torch.equal(full[slot], want[key]):
                    bad.append(f"{name} slot {slot}")
        elif not torch.equal(full, want[name]):
            bad.append(name)
    return [dist.get_rank(), placements, checked, bad]


def test_torchtitan_strided_expert_fsdp(tmp_path):
    import moeshard

    path = os.path.join(str(tmp_path), "ckpt")
    moeshard.write_checkpoint(path, list(checkpoint_tensors().items()), max_shard_bytes=4096)
    results = run_ranks(titan_worker, path, world=4, local_world=2, timeout=240)
    for rank, placements, checked, bad in results:
        assert placements == [("_StridedShard", 0, 2), ("Shard", 0, None)], placements
        assert checked > 0 and bad == [], (rank, bad[:5])
