"""One-device load benchmark: how fast each loader fills one GPU (or the CPU) from a checkpoint
in the page cache, side by side in one process.

Rows (best of ``--repeat``, each after one untimed warm-up pass over the files):

* read floor: one ``CheckpointReader`` reads every tensor once into host memory;
* ``safetensors.torch.load_file(file, device=...)`` for every file;
* transformers ``from_pretrained(ckpt, device_map=..., dtype=bfloat16)`` (``--no-transformers``
  to skip);
* ``moeshard.load`` into a meta-built model ``parallelize``-d on a one-rank mesh of the device
  (EP = 1; NCCL on CUDA, gloo on the CPU), once per ``--threads`` value (``read_threads``), and
  with ``--direct-io`` also with ``direct_io=True`` (O_DIRECT: what cold storage costs);
  ``moeshard.verify`` checks every load, timed apart ("verify s");
* the fastest public loaders (``--external``, default both; ``benchmarks/external_loaders.py``):
  InstantTensor ``safe_open`` over every file (buffered and direct I/O; CUDA only) and
  fastsafetensors ``SafeTensorsFileLoader`` (nogds). Not dependencies: a row whose package is
  missing, or that cannot run on the device, is skipped with a note (``pip install --no-deps
  instanttensor==0.2.2 fastsafetensors==0.5.0`` installs both beside the host's torch). After its
  first pass, each is checked against safetensors' bytes on a sample of tensors; a row that
  raises is reported as failed, the other rows go on, and the exit status is 1.

On the CPU, ``load_file`` returns tensors backed by a memory map whose pages are read only when
touched, so its CPU row is not a full load; compare on CUDA, where it copies every byte.

Each row gives seconds, GiB/s of checkpoint bytes and the ratio to safetensors'. The checkpoint
is ``--ckpt`` (a Qwen3-MoE checkpoint directory with ``config.json``), else a synthetic
Qwen3-MoE one written once under ``bench_out/`` (default: Qwen3-30B-A3B's expert shape,
hidden 2048, moe_intermediate 768, 4 layers x 128 experts, ~4.9 GiB; ``--layers`` and
``--experts`` shrink it). Prints a table and writes ``bench_out/bench_gpu.json``.

    python -m benchmarks.bench_gpu                          # CUDA if present, else CPU
    python -m benchmarks.bench_gpu --layers 1 --experts 16 --device cpu --repeat 2   # quick
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_load import DIMS_VERSION, checkpoint_bytes, ensure_checkpoint, hf_config
from benchmarks.external_loaders import PACKAGES, check_sample, external_rows, parse_packages

GiB = 2**30


def dims(hidden: int, moe_intermediate: int, layers: int, experts: int) -> dict:
    """bench_load's dims dict for a Qwen3-MoE of this shape (head_dim 128, vocab 8 x hidden)."""
    heads = hidden // 128
    return dict(
        num_layers=layers,
        num_experts=experts,
        hidden=hidden,
        moe_intermediate=moe_intermediate,
        vocab=8 * hidden,
        head_dim=128,
        num_heads=heads,
        num_kv_heads=max(1, heads // 4),
        version=DIMS_VERSION,
    )


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.safetensors"))


def warm(ckpt: Path) -> None:
    """Read every file once so that every row starts from a warm page cache."""
    for f in _files(ckpt):
        with open(f, "rb") as fh:
            while fh.read(64 * 2**20):
                pass


def read_floor(ckpt: Path, device) -> float:
    from moeshard import CheckpointIndex, CheckpointReader

    index = CheckpointIndex.open(ckpt)
    keys = sorted(index.tensors, key=lambda k: (index.info(k).file, index.info(k).offset))
    t0 = time.perf_counter()
    with CheckpointReader(index, ckpt) as reader:
        for k in keys:
            reader.read(k)
    return time.perf_counter() - t0


def safetensors_load(ckpt: Path, device) -> float:
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    out = [load_file(str(f), device=str(device)) for f in _files(ckpt)]
    _sync(device)
    seconds = time.perf_counter() - t0
    del out
    return seconds


def transformers_load(ckpt: Path, device) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), device_map=str(device), dtype=torch.bfloat16)
    _sync(device)
    seconds = time.perf_counter() - t0
    del model
    return seconds


def moeshard_load(ckpt: Path, device, threads: int, direct_io: bool = False) -> tuple[float, dict]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import moeshard

    config = AutoConfig.from_pretrained(str(ckpt))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    mesh = moeshard.make_mesh(device.type, ep=1)
    moeshard.parallelize(model, mesh, moeshard.Placement.contiguous(config.num_hidden_layers, config.num_experts, 1))
    t0 = time.perf_counter()
    rep = moeshard.load(model, ckpt, read_threads=threads, storage="shared", direct_io=direct_io)
    _sync(device)
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()  # raises VerificationError on any wrong byte
    v = moeshard.verify(model, ckpt)
    _sync(device)
    verify_seconds = time.perf_counter() - t0
    del model
    return seconds, {
        "plan_seconds": rep.plan_seconds,
        "bytes_read": rep.bytes_read_rank,
        "verified_boxes": v.num_boxes_checked,
        "verify_seconds": verify_seconds,
        "phase_seconds": rep.phase_seconds,
    }


def external_load(row, files: list[Path], device, check: bool) -> tuple[float, dict]:
    """Time ``row.load`` (every tensor on the device, synchronized); with ``check``, then
    compare a sample with safetensors' bytes (untimed)."""
    t0 = time.perf_counter()
    tensors = row.load(files, device)
    _sync(device)
    seconds = time.perf_counter() - t0
    info = {"tensors": len(tensors)}
    if check:
        info["checked_tensors"] = check_sample(tensors, files)
    del tensors
    return seconds, info


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, help="a Qwen3-MoE checkpoint directory (default: a synthetic one)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--threads", default="1,4,8", help="moeshard read_threads values, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument(
        "--direct-io",
        action="store_true",
        help="also moeshard.load with direct_io=True (O_DIRECT: page cache bypassed) per --threads value",
    )
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument(
        "--cache", type=Path, default=None, help="where the synthetic checkpoint is written (default: --out)"
    )
    ap.add_argument(
        "--external",
        default=",".join(PACKAGES),
        help=f"public loaders to compare, comma-separated, '' for none (default {','.join(PACKAGES)})",
    )
    args = ap.parse_args(argv)
    try:
        args.external = parse_packages(args.external)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    import torch
    import torch.distributed as dist

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    ckpt = args.ckpt
    if ckpt is None:
        d = dims(args.hidden, args.moe_intermediate, args.layers, args.experts)
        ckpt = (
            args.cache or args.out
        ) / f"gpu-{d['hidden']}-{d['moe_intermediate']}-{d['num_layers']}x{d['num_experts']}"
        print(f"[bench_gpu] checkpoint {ckpt} (~{checkpoint_bytes(d) / GiB:.2f} GiB) ...", flush=True)
        built, secs = ensure_checkpoint(ckpt, d)
        if built:
            hf_config(d).save_pretrained(str(ckpt))
            print(f"[bench_gpu] wrote it in {secs:.1f} s", flush=True)
    total = sum(f.stat().st_size for f in _files(ckpt))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    threads = [int(t) for t in args.threads.split(",") if t]
    externals = external_rows(args.external, device.type)
    skipped = {r.label: r.skipped for r in externals if r.load is None}
    for label, why in skipped.items():
        print(f"[bench_gpu] skipped {label}: {why}", flush=True)
    failed: dict[str, str] = {}

    rows: dict[str, list[float]] = {}
    extra: dict[str, dict] = {}
    verify_s: dict[str, list[float]] = {}

    def timed(name, fn):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out = fn()
        seconds, info = out if isinstance(out, tuple) else (out, None)
        rows.setdefault(name, []).append(seconds)
        if info is not None:
            extra[name] = {**extra.get(name, {}), **info}
            if "verify_seconds" in info:
                verify_s.setdefault(name, []).append(info["verify_seconds"])

    def timed_external(row, first: bool) -> None:
        if row.label in failed:
            return
        try:
            timed(row.label, lambda: external_load(row, files, device, check=first))
        except (ImportError, OSError, RuntimeError, ValueError) as e:  # noted, reported, exit status 1
            failed[row.label] = f"{type(e).__name__}: {e}"
            print(f"[bench_gpu] {row.label} failed: {failed[row.label]}", flush=True)

    files = _files(ckpt)
    warm(ckpt)
    for rep in range(args.repeat):  # round-robin, so drift on a shared host hits every row alike
        timed("read floor (one process, every tensor)", lambda: read_floor(ckpt, device))
        timed(f"safetensors load_file(device={device.type!r})", lambda: safetensors_load(ckpt, device))
        if not args.no_transformers:
            timed(f"transformers from_pretrained(device_map={device.type!r})", lambda: transformers_load(ckpt, device))
        for t in threads:
            timed(f"moeshard.load (read_threads={t})", lambda t=t: moeshard_load(ckpt, device, t))
            if args.direct_io:
                timed(f"moeshard.load (read_threads={t}, O_DIRECT)", lambda t=t: moeshard_load(ckpt, device, t, True))
        for row in externals:
            if row.load is not None:
                timed_external(row, first=rep == 0)
    dist.destroy_process_group()

    st = min(next(v for k, v in rows.items() if k.startswith("safetensors")))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"\ncheckpoint {ckpt}: {total / GiB:.2f} GiB in {len(_files(ckpt))} files; device {device} ({name}); "
        f"{os.cpu_count()} CPUs; torch {torch.__version__}; best of {args.repeat}, warm page cache"
    )
    print(f"{'loader':<48}{'seconds':>9}{'GiB/s':>8}{'vs safetensors':>16}{'verify s':>10}")
    result = []
    for label, secs in rows.items():
        best = min(secs)
        ver = f"{min(verify_s[label]):>10.3f}" if label in verify_s else ""
        print(f"{label:<48}{best:>9.3f}{total / GiB / best:>8.2f}{st / best:>15.2f}x{ver}")
        result.append(
            {
                "loader": label,
                "seconds": secs,
                "best_seconds": best,
                "GiB_per_s": total / GiB / best,
                "speedup_vs_safetensors": st / best,
                **extra.get(label, {}),
                "verify_seconds_all": verify_s.get(label, []),
            }
        )
    for label, why in {**skipped, **failed}.items():
        state = "skipped" if label in skipped else "FAILED"
        print(f"{label:<48}{state:>9}  {why}")
        result.append({"loader": label, state.lower(): why})
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "bench_gpu.json"
    out.write_text(
        json.dumps(
            {
                "checkpoint": str(ckpt),
                "bytes": total,
                "device": str(device),
                "device_name": name,
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "repeat": args.repeat,
                "rows": result,
            },
            indent=1,
        )
    )
    print(f"[bench_gpu] wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
