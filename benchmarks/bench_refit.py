"""Refit against what RL frameworks do today, on the same trainer and engine, alternated rounds.

The trainer: a Qwen3-MoE (transformers, float32, hidden 256, 16 experts, 4 layers: 58 MiB;
``--hidden`` and ``--layers`` scale it) on all W ranks (EP=W, FSDP over W). The engine: the
same W ranks (colocated), vLLM's layout (:func:`moeshard.plan.engines.vllm_qwen3_moe`), TP=2 x
DP=W/2 for the dense tensors, EP=W for the experts with a redundant slot per rank, bf16.
Strategies, each ending with every engine tensor filled (checked equal across strategies):

* ``refit``: ``moeshard.refit`` (P2P from the live shards; cast to bf16 at the sender);
* ``gather_bcast``: per trainer tensor, gather the shards on rank 0, broadcast the whole tensor
  to every rank, each rank slices and fuses its engine tensors;
* ``allgather``: per trainer tensor, an all-gather of the shards on every rank, then the same.

Bytes: what each rank sends (sums over ranks); wall: the slowest rank per round, after a first
round of warm-up (planning) that is not counted. Run from the repository root::

    python -m benchmarks.bench_refit --world 8 --rounds 7
    python -m benchmarks.bench_refit --world 8 --rounds 5 --hidden 512 --layers 8  # 0.45 GiB
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch


def _config(hidden: int = 256, layers: int = 4):
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        num_experts=16,
        num_experts_per_tok=2,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64,
        head_dim=32,
        tie_word_embeddings=False,
    )


def _fill_from_full(plan, rank: int, full: dict, dst: list) -> None:
    """Engine tensors from whole trainer tensors, by the layout's need rows (slice and fuse)."""
    rows = plan.needs.rows
    keys = plan.needs.keys
    for i in np.flatnonzero(rows.rank == rank).tolist():
        key = keys[int(rows.unit[i])]
        name, _, e = key.partition("[")
        src = full[name] if not e else full[name][int(e.rstrip("]"))]
        nd = src.dim()
        box = tuple(slice(o, o + n) for o, n in zip(rows.off[i, :nd].tolist(), rows.len[i, :nd].tolist()))
        loc = tuple(slice(o, o + n) for o, n in zip(rows.local[i, :nd].tolist(), rows.len[i, :nd].tolist()))
        t = dst[int(rows.param[i])]
        if int(rows.slot[i]) >= 0:
            t = t[int(rows.slot[i])]
        t[loc].copy_(src[box])


def _chunks(local: torch.Tensor, shape, world: int) -> torch.Tensor:
    """This rank's dim-0 shard padded to the largest one (FSDP2's chunks), for a collective."""
    per = -(-shape[0] // world)
    out = torch.zeros((per, *shape[1:]), dtype=local.dtype)
    out[: local.shape[0]] = local
    return out


def _gathered(parts: list[torch.Tensor], shape) -> torch.Tensor:
    return torch.cat(parts)[: shape[0]]


def _baseline(kind: str, shared, shards, plan, rank: int, world: int, dst: list) -> int:
    """``gather_bcast`` or ``allgather`` of every trainer tensor, then slicing; bytes this rank sent."""
    import torch.distributed as dist

    sent = 0
    full = {}
    for t, local in zip(shared.tensors, shards):
        shape = t.shape
        if t.mesh is None:
            full[t.name] = local
            continue
        mine = _chunks(local, shape, world)
        if kind == "allgather":
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine)
            sent += mine.numel() * mine.element_size() * (world - 1)
            whole = _gathered(parts, shape)
        else:
            parts = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
            dist.gather(mine, parts, dst=0)
            if rank != 0:
                sent += mine.numel() * mine.element_size()
            whole = _gathered(parts, shape) if rank == 0 else torch.empty(shape, dtype=local.dtype)
            dist.broadcast(whole, src=0)
            if rank == 0:
                sent += whole.numel() * whole.element_size() * (world - 1)
        full[t.name] = whole
    _fill_from_full(plan, rank, full, dst)
    return sent


def _worker(world: int, rounds: int, hidden: int = 256, layers: int = 4) -> dict:
    import torch.distributed as dist
    import transformers

    import moeshard
    from moeshard.models.describe import local_tensor
    from moeshard.ops.refit import plan_for
    from moeshard.plan.engines import vllm_qwen3_moe
    from moeshard.topology import Topology

    rank = dist.get_rank()
    cfg = _config(hidden, layers)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    pl = moeshard.Placement.contiguous(num_layers=cfg.num_hidden_layers, num_logical=cfg.num_experts, num_ranks=world)
    moeshard.parallelize(model, moeshard.make_mesh("cpu", ep=world), pl)
    model.to_empty(device="cpu")
    with torch.no_grad():
        g = torch.Generator().manual_seed(rank)
        for p in model.parameters():
            loc = local_tensor(p)
            loc.copy_(torch.randn(loc.shape, generator=g) * 0.02)
    rng = np.random.default_rng(1)
    p2l = np.stack(
        [
            rng.permutation(np.concatenate([np.arange(cfg.num_experts), rng.integers(0, cfg.num_experts, world)]))
            for _ in range(cfg.num_hidden_layers)
        ]
    )
    layout = vllm_qwen3_moe(cfg.num_hidden_layers, range(world), tp=2, ep=world, phy2log=p2l, dtype="bfloat16")
    shared = moeshard.describe_shards(model)
    names = dict(model.named_parameters())
    names.update(model.named_buffers())
    shards = [local_tensor(names[t.name]) for t in shared.tensors]
    plan = plan_for(shared, list(range(world)), layout, Topology(world_size=world, local_world_size=world))
    dsts = {
        k: [torch.zeros(s, dtype=getattr(torch, d)) for s, d in zip(plan.needs.local_shapes, plan.needs.dtypes)]
        for k in ("refit", "gather_bcast", "allgather")
    }
    out = {k: {"wall": [], "sent": 0} for k in dsts}
    out["refit"]["phases"] = []
    for r in range(rounds + 1):  # round 0: warm-up (the refit plans), not counted
        order = ["refit", "gather_bcast", "allgather"]
        order = order[r % 3 :] + order[: r % 3]  # alternated
        for k in order:
            dist.barrier()
            t0 = time.perf_counter()
            if k == "refit":
                rep = moeshard.refit(model, {t.name: x for t, x in zip(layout.tensors, dsts[k])}, layout)
                sent = rep.bytes_sent_rank
            else:
                sent = _baseline(k, shared, shards, plan, rank, world, dsts[k])
            dist.barrier()
            if r:
                out[k]["wall"].append(time.perf_counter() - t0)
                if k == "refit":
                    out[k]["phases"].append(dict(rep.phase_seconds))
            out[k]["sent"] = sent
    out["refit"]["batches"] = rep.batches
    out["model_bytes"] = sum(x.numel() * x.element_size() for x in shards)
    same = all(torch.equal(a, b) for a, b in zip(dsts["refit"], dsts["allgather"])) and all(
        torch.equal(a, b) for a, b in zip(dsts["refit"], dsts["gather_bcast"])
    )
    out["same"] = same
    out["engine_bytes"] = sum(x.numel() * x.element_size() for x in dsts["refit"])
    return out


def main(argv=None) -> None:
    from moeshard._launch import run_local_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    load0 = os.getloadavg()
    res = run_local_ranks(_worker, a.world, a.rounds, a.hidden, a.layers, world=a.world, timeout=1800)
    summary = {
        "world": a.world,
        "rounds": a.rounds,
        "hidden": a.hidden,
        "layers": a.layers,
        "model_bytes": int(sum(r["model_bytes"] for r in res)),
        "load_avg_before_after": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
        "refit_batches": res[0]["refit"]["batches"],
        "same": all(r["same"] for r in res),
    }
    print(f"trainer model {summary['model_bytes'] / 2**20:.0f} MiB (float32); load average {load0[0]:.1f}")
    for k in ("refit", "gather_bcast", "allgather"):
        walls = np.max([r[k]["wall"] for r in res], axis=0)  # the slowest rank per round
        summary[k] = {
            "median_wall_s": float(np.median(walls)),
            "walls_s": [round(float(w), 4) for w in walls],
            "bytes_sent": int(sum(r[k]["sent"] for r in res)),
        }
        print(
            f"{k:13s} W={a.world}: median {summary[k]['median_wall_s']:.3f} s, "
            f"sent {summary[k]['bytes_sent'] / 2**20:.1f} MiB (rounds {summary[k]['walls_s']})"
        )
    phases = [p for r in res for p in r["refit"]["phases"]]
    summary["refit"]["phase_seconds_mean"] = {k: round(float(np.mean([p[k] for p in phases])), 4) for k in phases[0]}
    for k in ("gather_bcast", "allgather"):
        summary[f"{k}_over_refit"] = round(summary[k]["median_wall_s"] / summary["refit"]["median_wall_s"], 2)
    print(
        f"refit is {summary['gather_bcast_over_refit']}x faster than gather + broadcast, "
        f"{summary['allgather_over_refit']}x than all-gather (median walls); load average now "
        f"{os.getloadavg()[0]:.1f}; refit phases (mean over ranks and rounds, s): "
        f"{summary['refit']['phase_seconds_mean']}"
    )
    print(f"engine tensors equal across strategies: {summary['same']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
