"""``moeshard demo``: the whole story on one host, in about a minute.

Builds a small Qwen3-MoE checkpoint with transformers' own ``save_pretrained`` (per-expert
keys, bf16, several shards), starts 8 local gloo ranks as 2 simulated nodes x 4, and on them:
parallelizes a meta-device model (EP=8 with redundant experts), loads it with each storage
mode, verifies every slice against the checkpoint, rebalances for a skewed load with the
migration-aware EPLB policy and relocates in place, loses a rank and recovers its experts
from live replicas (the checkpoint only for experts with no live copy), shows that ``verify``
catches the transformers #45662 bug (every rank holding rank 0's experts), trains a few AdamW
steps (fp32, each rank its own sequences, tokens dispatched to their experts' ranks) beside the
same steps on one process, and prints a report.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np

NUM_LAYERS, NUM_EXPERTS, NUM_REDUNDANT, EP = 4, 16, 8, 8
TRAIN_STEPS, TRAIN_LR, TRAIN_SEQ = 3, 1e-3, 32


def _config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=128,
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


def rebalance_plans(placement):
    """Pure, the same on every rank: a skewed load (a Zipf trace) -> the oblivious and the
    migration-aware EPLB placements; then rank 5 dies -> a placement on the live ranks."""
    from .. import eplb
    from .bench.traces import zipf_trace

    load = zipf_trace(NUM_LAYERS, NUM_EXPERTS, 1, seed=3)[0]
    kw = dict(num_physical=placement.num_physical, num_ranks=EP, num_nodes=2, num_groups=4)
    oblivious = eplb.rebalance(load, placement, migration_aware=False, **kw)
    aware = eplb.rebalance(load, placement, migration_aware=True, **kw)
    alive = np.ones(EP, dtype=bool)
    alive[5] = False
    dead = eplb.rebalance(load, aware, active_ranks=alive, **kw)
    stats = {
        "balance_before": float(eplb.balance(load, placement, EP).mean()),
        "balance_oblivious": float(eplb.balance(load, oblivious, EP).mean()),
        "balance_aware": float(eplb.balance(load, aware, EP).mean()),
        "moved_oblivious": eplb.copies_moved(placement, oblivious, EP),
        "moved_aware": eplb.copies_moved(placement, aware, EP),
    }
    return aware, alive, dead, stats


def train_batch():
    """The global batch: ``int64[EP, TRAIN_SEQ]`` token ids; rank r trains on row r."""
    import torch

    return torch.randint(0, _config().vocab_size, (EP, TRAIN_SEQ), generator=torch.Generator().manual_seed(0))


def train_one_process(ckpt: str) -> list[float]:
    """The reference: ``from_pretrained`` in fp32, the same AdamW steps on the whole batch."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
    ids, losses = train_batch(), []
    for _ in range(TRAIN_STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train(ckpt: str, mesh, placement) -> dict:
    """On every rank: a fresh fp32 model (the bf16 checkpoint is cast on load), EP with the
    rebalanced (redundant) placement, a few AdamW steps; the mean loss over ranks per step."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen3MoeForCausalLM

    import moeshard

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(_config())  # fp32: the default dtype
    moeshard.parallelize(model, mesh, placement)
    moeshard.load(model, ckpt, placement=placement)
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR)
    ids = train_batch()[dist.get_rank()].unsqueeze(0)
    losses, norms, t0 = [], [], time.perf_counter()
    for _ in range(TRAIN_STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # the copies of a hot expert: their gradients' sum in the first copy
        norms.append(float(moeshard.clip_grad_norm_(model, max_norm=1e9)))
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return {"losses": losses, "norms": norms, "wall_s": time.perf_counter() - t0}


def _rank_main(ckpt: str):
    import torch
    import torch.distributed as dist
    from transformers import Qwen3MoeForCausalLM

    import moeshard
    from moeshard.models.describe import expert_layers, local_tensor

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(_config())
    mesh = moeshard.make_mesh("cpu", ep=EP)
    placement = moeshard.Placement.contiguous(NUM_LAYERS, NUM_EXPERTS, EP, NUM_REDUNDANT)
    moeshard.parallelize(model, mesh, placement)
    out = {"loads": []}
    for storage in ("shared", "node", "single"):
        rep = moeshard.load(model, ckpt, placement=placement, storage=storage, report_minimal=True)
        ver = moeshard.verify(model, ckpt, placement=placement)
        out["loads"].append(
            {
                "storage": storage,
                "wall_s": rep.wall_seconds,
                "plan": rep.plan,
                "minimal": rep.minimal,
                "checked": ver.num_boxes_checked,
            }
        )
    new, alive, dead, stats = rebalance_plans(placement)
    out["train"] = _train(ckpt, mesh, new)
    rep = moeshard.relocate(model, placement, new)
    moeshard.verify(model, ckpt, placement=new)
    rank, spr = dist.get_rank(), new.slots_per_rank(EP)
    out["rebalance"] = {
        "wall_s": rep.wall_seconds,
        "copies": rep.copies,
        "sent": rep.network_bytes,
        "min_sent": rep.min_network_bytes,
        "policy": stats,
        "slots": new.phy2log[0, rank * spr : (rank + 1) * spr].tolist(),
    }
    rep = moeshard.relocate(model, new, dead, checkpoint=ckpt, active_ranks=alive)
    ver = moeshard.verify(model, ckpt, placement=dead)
    out["dead"] = {
        "wall_s": rep.wall_seconds,
        "copies": rep.copies,
        "disk_experts": rep.disk_experts,
        "checked": ver.num_boxes_checked,
        "slots": dead.phy2log[0, rank * spr : (rank + 1) * spr].tolist(),
    }
    new = dead
    # The transformers #45662 bug: every rank ends up with rank 0's experts.
    for _, module, spec, _ in expert_layers(model):
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


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="moeshard demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="keep the demo checkpoint in this directory")
    return run(parser.parse_args(argv).out)


def run(out_dir: str | None = None) -> int:
    from .._launch import run_local_ranks

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(out_dir or tmp, "qwen3-moe-tiny")
        nbytes = build_checkpoint(ckpt)
        print(
            f"checkpoint: {ckpt} ({_mib(nbytes).strip()}, {NUM_LAYERS} MoE layers x {NUM_EXPERTS} experts, "
            f"written by transformers save_pretrained)"
        )
        print(
            f"job: 8 gloo ranks = 2 nodes x 4, EP={EP}, {NUM_EXPERTS} logical + {NUM_REDUNDANT} redundant "
            "experts per layer, FSDP2 on everything else\n"
        )
        results = run_local_ranks(_rank_main, ckpt, world=8, local_world=4)
        reference = train_one_process(ckpt)
    r0 = results[0]
    print(
        f"{'storage':8} {'wall':>8} {'read total':>13} {'read max/rank':>14} {'sent total':>13} "
        f"{'minimal sent':>13} {'cross-node':>13} {'boxes verified':>15}"
    )
    for row in r0["loads"]:
        p, m = row["plan"], row["minimal"]
        checked = sum(res["loads"][r0["loads"].index(row)]["checked"] for res in results)
        print(
            f"{row['storage']:8} {row['wall_s']:7.2f}s {_mib(p['read_bytes_total']):>13} "
            f"{_mib(p['read_bytes_max_rank']):>14} {_mib(p['sent_bytes_total']):>13} "
            f"{_mib(m['network_bytes']):>13} {_mib(p['cross_node_bytes']):>13} {checked:>15}"
        )
    reb, st = r0["rebalance"], r0["rebalance"]["policy"]
    print(
        f"\nrebalance for a skewed load (EPLB, max/mean rank load averaged over layers): "
        f"{st['balance_before']:.2f} -> {st['balance_aware']:.2f} (oblivious policy: {st['balance_oblivious']:.2f});"
        f"\n  expert copies moved: migration-aware {st['moved_aware']}, oblivious {st['moved_oblivious']}"
    )
    c = reb["copies"]
    print(
        f"  relocate (P2P, in place): {reb['wall_s']:.2f}s, copies local {c['local']} / same node {c['same_node']}"
        f" / cross node {c['cross_node']} / disk {c['disk']}, sent {_mib(reb['sent']).strip()} "
        f"(minimum {_mib(reb['min_sent']).strip()}), verified"
    )
    d = r0["dead"]
    c = d["copies"]
    print(
        f"rank 5 dies: its experts move to live ranks in {d['wall_s']:.2f}s: from live replicas "
        f"{c['local'] + c['same_node'] + c['cross_node']}, from the checkpoint {c['disk']} "
        f"(experts with no live copy: {len(d['disk_experts'])}); "
        f"{sum(res['dead']['checked'] for res in results)} boxes verified"
    )
    for rank, res in enumerate(results):
        print(f"  rank {rank} (node {rank // 4}) layer 0 slots -> logical experts {res['dead']['slots']}")
    tr = r0["train"]
    print(
        f"\ntraining (fp32, AdamW lr={TRAIN_LR}, 8 ranks x 1 sequence, EP all-to-all, the rebalanced placement "
        f"with redundant experts) vs one process on the 8 sequences:"
    )
    print(f"  {'step':>4} {'loss, 8 ranks':>14} {'loss, 1 process':>16} {'rel. diff':>10} {'grad norm':>10}")
    worst = 0.0
    for step, (a, b, n) in enumerate(zip(tr["losses"], reference, tr["norms"])):
        worst = max(worst, abs(a - b) / abs(b))
        print(f"  {step:>4} {a:14.6f} {b:16.6f} {abs(a - b) / abs(b):10.1e} {n:10.4f}")
    caught = r0["bug_caught"]
    print(
        "\nsimulated transformers #45662 (all ranks hold rank 0's experts): "
        + ("verify caught it:\n    " + "\n    ".join(caught) if caught else "NOT CAUGHT")
    )
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f}s")
    ok = bool(caught) and worst < 1e-5
    print(json.dumps({"ok": ok, "train_loss_max_rel_diff": worst}))
    return 0 if ok else 1
