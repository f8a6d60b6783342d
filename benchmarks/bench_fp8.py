"""FP8 load benchmark: a bf16 model loaded from its bf16 checkpoint and from the same checkpoint
block-quantized to FP8 (DeepSeek-V3's format: float8_e4m3fn expert weights + float32
``weight_scale_inv`` of 128 x 128 blocks), on 4 gloo ranks (EP=4), side by side in one run.

The bf16 checkpoint is bench_load's synthetic Qwen3-MoE (cached in ``bench_out/``); the FP8 one
quantizes its expert weights (``bench_out/fp8-<size>``). For each checkpoint, round-robin over
``--repeat`` runs: ``moeshard.load`` (wall = the slowest rank), bytes read and moved, then
``moeshard.verify`` (which dequantizes on its own) must pass. Prints a table; writes
``bench_out/bench_fp8.json``.

    python -m benchmarks.bench_fp8 --size-mib 128 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_load import MiB, checkpoint_path, ensure_checkpoint, meta_model, model_dims

WORLD = 4
BLOCK = 128


def quantize_checkpoint(src: Path, dst: Path) -> None:
    """Expert weights of ``src`` as FP8 with 128 x 128 block scales (written after the weights)."""
    import torch

    from moeshard import CheckpointIndex, CheckpointReader, write_checkpoint

    if (dst / "model.safetensors.index.json").is_file():
        return
    index = CheckpointIndex.open(src)

    def pairs():
        scales = []
        with CheckpointReader(index, str(src)) as reader:
            for key in sorted(index.tensors):
                t = reader.read(key)
                if ".experts." in key and t.dim() == 2:
                    r, c = t.shape
                    sr, sc = -(-r // BLOCK), -(-c // BLOCK)
                    pad = torch.zeros(sr * BLOCK, sc * BLOCK)
                    pad[:r, :c] = t.float().abs()
                    s = pad.reshape(sr, BLOCK, sc, BLOCK).amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
                    full = s.repeat_interleave(BLOCK, 0)[:r].repeat_interleave(BLOCK, 1)[:, :c]
                    yield key, (t.float() / full).to(torch.float8_e4m3fn)
                    scales.append((key + "_scale_inv", s))
                else:
                    yield key, t
        yield from scales

    write_checkpoint(dst, pairs(), max_shard_bytes=64 * MiB)


def rank_main(spec: dict) -> list[dict]:
    import torch
    import torch.distributed as dist

    import moeshard

    torch.set_num_threads(1)
    model = meta_model(spec["dims"], torch.bfloat16)
    mesh = moeshard.make_mesh("cpu", ep=WORLD)
    pl = moeshard.Placement.contiguous(spec["dims"]["num_layers"], spec["dims"]["num_experts"], WORLD)
    moeshard.parallelize(model, mesh, pl)
    rows = []
    for run in range(spec["repeat"]):
        for name in ("bf16", "fp8"):
            dist.barrier()
            t0 = time.perf_counter()
            rep = moeshard.load(model, spec[name], placement=pl)
            dist.barrier()
            wall = time.perf_counter() - t0
            ok = moeshard.verify(model, spec[name], placement=pl).num_boxes_checked > 0
            rows.append(
                dict(
                    ckpt=name,
                    run=run,
                    wall=wall,
                    read=rep.bytes_read_rank,
                    sent=rep.bytes_sent_rank,
                    dequantized=rep.dequantized_keys,
                    verified=ok,
                    plan=rep.plan_seconds,
                )
            )
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="FP8 (dequantized on load) vs bf16 checkpoint load, 4 gloo ranks")
    ap.add_argument("--size-mib", type=float, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    from moeshard import CheckpointIndex
    from moeshard._launch import run_local_ranks

    dims = model_dims(args.size_mib)
    bf16 = checkpoint_path(None, args.size_mib)
    ensure_checkpoint(bf16, dims)
    fp8 = Path("bench_out") / f"fp8-{bf16.name}"
    quantize_checkpoint(bf16, fp8)
    os.environ.update(OMP_NUM_THREADS="1")
    spec = dict(dims=dims, repeat=args.repeat, bf16=str(bf16.resolve()), fp8=str(fp8.resolve()))
    per_rank = run_local_ranks(rank_main, spec, world=WORLD, timeout=1800)
    out = {"size": {k: CheckpointIndex.open(p).total_bytes for k, p in (("bf16", bf16), ("fp8", fp8))}}
    for name in ("bf16", "fp8"):
        mine = [[r for r in rows if r["ckpt"] == name] for rows in per_rank]  # per rank, in run order
        walls = [max(rows[i]["wall"] for rows in mine) for i in range(args.repeat)]  # the slowest rank
        out[name] = dict(
            wall_median=statistics.median(walls),
            walls=walls,
            bytes_read=sum(rows[0]["read"] for rows in mine),
            bytes_sent=sum(rows[0]["sent"] for rows in mine),
            dequantized=mine[0][0]["dequantized"],
            verified=all(r["verified"] for rows in mine for r in rows),
        )
    print(
        f"checkpoint: bf16 {out['size']['bf16'] / MiB:,.1f} MiB, fp8 {out['size']['fp8'] / MiB:,.1f} MiB; "
        f"{WORLD} ranks, EP={WORLD}, median of {args.repeat}"
    )
    for name in ("bf16", "fp8"):
        r = out[name]
        print(
            f"  {name}: load {r['wall_median']:.3f} s, read {r['bytes_read'] / MiB:,.1f} MiB, "
            f"sent {r['bytes_sent'] / MiB:,.1f} MiB, dequantized weights {r['dequantized']}, verify ok {r['verified']}"
        )
    print(f"  fp8 / bf16 load wall: {out['fp8']['wall_median'] / out['bf16']['wall_median']:.2f}x")
    Path("bench_out").mkdir(exist_ok=True)
    Path("bench_out/bench_fp8.json").write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
