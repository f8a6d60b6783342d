"""``moeshard demo``: the whole story on one host, in about a minute.

Builds a small Qwen3-MoE checkpoint with transformers' own ``save_pretrained`` (per-expert
keys, bf16, several shards), starts 8 local gloo ranks as 2 simulated nodes x 4, and on them:
parallelizes a meta-device model (EP=8 with redundant experts), loads it with each storage
mode, verifies every slice against the checkpoint, moves to a rebalanced placement, shows
that ``verify`` catches the transformers #45662 bug (every rank holding rank 0's experts),
and prints a report.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np

NUM_LAYERS, NUM_EXPERTS, NUM_REDUNDANT, EP = 4, 16, 8, 8


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=NUM_EXPERTS, num_experts_per_tok=2, max_position_embeddings=128,
        tie_word_embeddings=False,
    )


def build_checkpoint(path: str) -> int:
    """Write the demo checkpoint with transformers; returns its tensor bytes."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_config()).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="256KB")
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def rebalanced_placement(seed: int = 0):
    """A skewed load -> hot experts get the redundant slots, experts shuffled over ranks."""
    from .placement import Placement

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(NUM_LAYERS):
        load = rng.zipf(1.5, NUM_EXPERTS).astype(float)
        hot = np.argsort(-load)[:NUM_REDUNDANT]
        rows.append(rng.permutation(np.concatenate([np.arange(NUM_EXPERTS), hot])))
    return Placement(np.stack(rows), num_logical=NUM_EXPERTS, num_ranks=EP)


def _rank_main(ckpt: str):
    import torch
    import torch.distributed as dist
    from transformers import Qwen3MoeForCausalLM

    import moeshard
    from moeshard.layout import expert_layers, local_tensor

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(_config())
    mesh = moeshard.make_mesh("cpu", ep=EP)
    placement = moeshard.Placement.contiguous(NUM_LAYERS, NUM_EXPERTS, EP, NUM_REDUNDANT)
    moeshard.parallelize(model, mesh, placement)
    out = {"loads": []}
    for storage in ("shared", "node", "single"):
        rep = moeshard.load(model, ckpt, placement=placement, storage=storage)
        ver = moeshard.verify(model, ckpt, placement=placement)
        out["loads"].append({"storage": storage, "wall_s": rep.wall_seconds, "plan": rep.plan,
                             "minimal": rep.minimal, "checked": ver.num_boxes_checked})
    new = rebalanced_placement()
    rep = moeshard.load(model, ckpt, placement=new, storage="shared")
    moeshard.verify(model, ckpt, placement=new)
    rank, spr = dist.get_rank(), new.slots_per_rank(EP)
    out["rebalance"] = {"wall_s": rep.wall_seconds, "plan": rep.plan,
                        "slots": new.phy2log[0, rank * spr:(rank + 1) * spr].tolist()}
    # The transformers #45662 bug: every rank ends up with rank 0's experts.
    for _, module, spec in expert_layers(model):
        for p in spec.params:
            t = local_tensor(getattr(module, p.name))
            dist.broadcast(t, src=0)
    try:
        moeshard.verify(model, ckpt, placement=new)
        out["bug_caught"] = None
    except moeshard.DistributedError as e:
        out["bug_caught"] = str(e).splitlines()[:3]
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:8.2f} MiB"


def main(out_dir: str | None = None) -> int:
    from ._launch import run_local_ranks

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(out_dir or tmp, "qwen3-moe-tiny")
        nbytes = build_checkpoint(ckpt)
        print(f"checkpoint: {ckpt} ({_mib(nbytes).strip()}, {NUM_LAYERS} MoE layers x {NUM_EXPERTS} experts, "
              f"written by transformers save_pretrained)")
        print(f"job: 8 gloo ranks = 2 nodes x 4, EP={EP}, {NUM_EXPERTS} logical + {NUM_REDUNDANT} redundant "
              "experts per layer, FSDP2 on everything else\n")
        results = run_local_ranks(_rank_main, ckpt, world=8, local_world=4)
    r0 = results[0]
    print(f"{'storage':8} {'wall':>8} {'read total':>13} {'read max/rank':>14} {'sent total':>13} "
          f"{'minimal sent':>13} {'cross-node':>13} {'boxes verified':>15}")
    for row in r0["loads"]:
        p, m = row["plan"], row["minimal"]
        checked = sum(res["loads"][r0["loads"].index(row)]["checked"] for res in results)
        print(f"{row['storage']:8} {row['wall_s']:7.2f}s {_mib(p['read_bytes_total']):>13} "
              f"{_mib(p['read_bytes_max_rank']):>14} {_mib(p['sent_bytes_total']):>13} "
              f"{_mib(m['network_bytes']):>13} {_mib(p['cross_node_bytes']):>13} {checked:>15}")
    print("\nrebalanced placement (hot experts replicated, experts shuffled), loaded and verified:")
    for rank, res in enumerate(results):
        print(f"  rank {rank} (node {rank // 4}) layer 0 slots -> logical experts {res['rebalance']['slots']}")
    caught = r0["bug_caught"]
    print("\nsimulated transformers #45662 (all ranks hold rank 0's experts): "
          + ("verify caught it:\n    " + "\n    ".join(caught) if caught else "NOT CAUGHT"))
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f}s")
    print(json.dumps({"ok": bool(caught)}))
    return 0 if caught else 1
