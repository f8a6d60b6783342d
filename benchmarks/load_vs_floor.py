"""moeshard.load against the read floor, alternating, in the same gloo ranks on one host.

The checkpoint: a Qwen3-MoE (8 layers, 64 experts, ~405 MiB bf16) written by transformers'
``save_pretrained`` (4 shards), built once under ``--ckpt``. The model: meta-built,
``moeshard.parallelize``-d with EP = world (expert FSDP 1), materialized once. Per run, in
alternating order: the floor (every rank ``preadv``-s its 1/W of the files' bytes, files in
name order concatenated and cut in W equal ranges, into fresh memory) and
``moeshard.load(storage="shared")``; each timed barrier to barrier, the max over ranks.
Also each one's CPU seconds (the rank's process, to the closing barrier; max over ranks): a
steadier comparison on a loaded host. ``--cold``: rank 0 evicts the checkpoint's pages
(``posix_fadvise(DONTNEED)``) before each.

    python benchmarks/load_vs_floor.py --world 4 --runs 9 [--cold] [--verify] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
CKPT = "/tmp/moeshard-floor-qwen3moe"


def build(path: str) -> None:
    import torch
    from transformers import Qwen3MoeForCausalLM

    sys.path.insert(0, ROOT)
    from benchmarks.bench_load import hf_config, model_dims

    d = model_dims(450)
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(hf_config(d)).to(torch.bfloat16)
    m.save_pretrained(path, max_shard_size="128MB")
    Path(path, "dims.json").write_text(json.dumps(d))


def files_of(path):
    return sorted(str(p) for p in Path(path).glob("*.safetensors"))


def evict(path):
    for f in files_of(path):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def floor_once(ckpt, rank, world):
    import torch

    files = files_of(ckpt)
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    lo, hi = total * rank // world, total * (rank + 1) // world
    buf = torch.empty(hi - lo, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    pos = 0
    start = 0
    for f, n in zip(files, sizes):
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            fd = os.open(f, os.O_RDONLY)
            done = 0
            while done < b - a:
                done += os.preadv(fd, [mv[pos + done : pos + b - a]], a - start + done)
            os.close(fd)
            pos += b - a
        start += n
    return buf


def rank_main(spec):
    import torch
    import torch.distributed as dist

    import moeshard

    sys.path.insert(0, ROOT)
    from benchmarks.bench_load import meta_model

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = spec["ckpt"]
    d = json.loads(Path(ckpt, "dims.json").read_text())
    model = meta_model(d, torch.bfloat16)
    mesh = moeshard.make_mesh("cpu", ep=world, efsdp=1)
    placement = moeshard.Placement.contiguous(d["num_layers"], d["num_experts"], world)
    moeshard.parallelize(model, mesh, placement)
    moeshard.materialize(model)
    out = {"floor": [], "load": [], "floor_cpu": [], "load_cpu": [], "phases": [], "read": []}
    prof = None
    if spec["profile"] and rank == 0:
        import cProfile

        prof = cProfile.Profile()
    for run in range(spec["runs"] + 1):
        for what in ("floor", "load") if run % 2 == 0 else ("load", "floor"):
            if spec["cold"]:
                if rank == 0:
                    evict(ckpt)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if what == "floor":
                b = floor_once(ckpt, rank, world)
            else:
                if prof is not None and run > 0:
                    prof.enable()
                rep = moeshard.load(model, ckpt, placement=placement, storage="shared")
                if prof is not None:
                    prof.disable()
            cpu = time.process_time() - c0  # this rank's own work, before waiting for the others
            dist.barrier()
            dt = time.perf_counter() - t0
            if run == 0:
                continue  # warm-up
            out[what].append(dt)
            out[what + "_cpu"].append(cpu)
            if what == "load":
                out["phases"].append(rep.phase_seconds)
                out["read"].append(rep.bytes_read_rank)
            else:
                del b
    if prof is not None:
        prof.dump_stats(spec["profile"])
    if spec["verify"]:
        moeshard.verify(model, ckpt, placement=placement)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--profile", default="", help="write rank 0's cProfile of the loads to this file")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--ckpt", default=CKPT)
    a = ap.parse_args()
    if not Path(a.ckpt, "dims.json").exists():
        build(a.ckpt)
    from moeshard._launch import run_local_ranks

    res = run_local_ranks(
        rank_main,
        {"ckpt": a.ckpt, "runs": a.runs, "cold": a.cold, "profile": a.profile, "verify": a.verify},
        world=a.world,
    )
    import statistics as st

    floor = [max(r["floor"][i] for r in res) for i in range(a.runs)]
    load = [max(r["load"][i] for r in res) for i in range(a.runs)]
    ratios = [t / f for t, f in zip(load, floor)]
    print(
        f"world {a.world} {'cold' if a.cold else 'warm'}: floor median {st.median(floor):.3f} s, "
        f"load median {st.median(load):.3f} s, ratio median {st.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f})"
    )
    fc = [max(r["floor_cpu"][i] for r in res) for i in range(a.runs)]
    lc = [max(r["load_cpu"][i] for r in res) for i in range(a.runs)]
    print(
        f"CPU seconds (max over ranks, up to the closing barrier): floor median {st.median(fc):.3f}, "
        f"load median {st.median(lc):.3f}, ratio of medians {st.median(lc) / st.median(fc):.2f}"
    )
    print("floor", " ".join(f"{x:.3f}" for x in floor))
    print("load ", " ".join(f"{x:.3f}" for x in load))
    ph = res[0]["phases"][len(res[0]["phases"]) // 2]
    print("rank0 phases (a middle run):", {k: round(v, 3) for k, v in ph.items()})
    print("bytes_read per rank:", [r["read"][0] for r in res])


if __name__ == "__main__":
    main()
