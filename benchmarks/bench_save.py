"""Save benchmark: moeshard.save on 4 gloo ranks against transformers' save_pretrained.

Uses the load benchmark's synthetic Qwen3-MoE checkpoint (bf16, per-expert keys; built once
and cached in ``bench_out/``), then:

* 4 gloo ranks (one host), for each layout (EP=4; EP=2 x expert-FSDP=2): build the model on
  meta, ``moeshard.parallelize``, ``moeshard.load``, then time ``moeshard.save`` (barrier before
  and after; wall = the slowest rank), with ``fsync=True`` (the default: every file and the
  directory are fsync-ed before the index is published) and ``fsync=False``;
* one process: the same model gathered (loaded whole), timed ``save_pretrained`` (which does
  not fsync; the time to fsync its files afterwards is reported beside it) and ``moeshard.save``
  without a process group.

Every saved directory is compared tensor by tensor, byte for byte, with the source checkpoint.
Per rank: bytes written, sent, received, and the peak RSS growth during the save (VmHWM reset
at the start of the save) beside the rank's bytes written. Median over ``--repeat`` runs.
Prints a table; writes ``bench_out/bench_save.json``.

Run from the repository root::

    python -m benchmarks.bench_save                 # ~384 MiB checkpoint, about a minute
    python -m benchmarks.bench_save --size-mib 64   # quick run
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_load import (  # noqa: E402
    MiB, json_default, checkpoint_path, malloc_trim, checkpoint_bytes, ensure_checkpoint, meta_model, model_dims,
)
from moeshard.ops.peak_rss import read_peak_rss, reset_peak_rss  # noqa: E402

WORLD = 4
DEFAULT_LAYOUTS = "4x1,2x2"


def rank_main(spec: dict) -> list[dict]:
    """Runs on every rank (collective): every layout, fsync on and off, ``repeat`` times."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import moeshard
    from moeshard.models.describe import local_tensor
    from moeshard.ops.save import save

    torch.set_num_threads(1)
    rank = dist.get_rank()
    dims = spec["dims"]
    rows = []
    for ep, efsdp in spec["layouts"]:
        model = meta_model(dims, torch.bfloat16)
        mesh = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp)
        placement = moeshard.Placement.contiguous(dims["num_layers"], dims["num_experts"], ep)
        moeshard.parallelize(model, mesh, placement)
        moeshard.load(model, spec["ckpt"], placement=placement)
        local_bytes = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
        for run in range(spec["repeat"]):
            # What a gather-then-save_pretrained job does first: every parameter made whole.
            dist.barrier()
            t0 = time.perf_counter()
            for p in model.parameters():
                if isinstance(p, DTensor):
                    p.full_tensor()
            dist.barrier()
            rows.append({"ep": ep, "efsdp": efsdp, "gather": True, "run": run, "rank": rank,
                         "wall_seconds": time.perf_counter() - t0})
            for fsync in (True, False):
                out = Path(spec["out_root"]) / f"ep{ep}x{efsdp}{'' if fsync else '-nofsync'}"
                if rank == 0:
                    shutil.rmtree(out, ignore_errors=True)
                gc.collect()
                malloc_trim()
                dist.barrier()
                t0 = time.perf_counter()
                rep = save(model, out, placement, max_shard_bytes=spec["shard_bytes"],
                           staging_bytes=spec["staging_bytes"], fsync=fsync)
                dist.barrier()
                rows.append({"ep": ep, "efsdp": efsdp, "fsync": fsync, "run": run, "rank": rank, "dir": str(out),
                             "wall_seconds": time.perf_counter() - t0, "local_param_bytes": local_bytes,
                             "report": dataclasses.asdict(rep)})
        del model, mesh
        gc.collect()
    return rows


def single_process(ckpt: Path, dims: dict, out_root: Path, shard_bytes: int, repeat: int) -> dict:
    """The whole model in this process: transformers' save_pretrained and moeshard.save."""
    import torch

    import moeshard
    from moeshard.ops.save import save

    model = meta_model(dims, torch.bfloat16)
    moeshard.load(model, ckpt)  # no process group: the whole model, plain tensors
    res: dict = {"save_pretrained": [], "moeshard_single": []}
    for _ in range(repeat):
        out = out_root / "hf"
        shutil.rmtree(out, ignore_errors=True)
        gc.collect()
        malloc_trim()
        hwm = reset_peak_rss()
        rss0 = _rss()
        t0 = time.perf_counter()
        model.save_pretrained(out, max_shard_size=shard_bytes)
        wall = time.perf_counter() - t0
        peak = read_peak_rss() if hwm else None
        t1 = time.perf_counter()
        for p in sorted(out.iterdir()):
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        res["save_pretrained"].append({"wall_seconds": wall, "fsync_after_seconds": time.perf_counter() - t1,
                                       "rss_growth": (peak - rss0) if peak else None, "dir": str(out)})
        out = out_root / "single"
        shutil.rmtree(out, ignore_errors=True)
        gc.collect()
        malloc_trim()
        t0 = time.perf_counter()
        rep = save(model, out, max_shard_bytes=shard_bytes)
        res["moeshard_single"].append({"wall_seconds": time.perf_counter() - t0, "dir": str(out),
                                       "rss_growth": rep.peak_rss_bytes - rep.rss_before_bytes})
    return res


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def same_tensors(ckpt: Path, out: Path) -> tuple[bool, str]:
    """Every tensor of ``ckpt`` in ``out`` with the same bytes, and nothing else."""
    import torch
    from safetensors import safe_open

    def tensors(path: Path) -> dict:
        if not (path / "model.safetensors.index.json").is_file():  # one file, as save_pretrained writes it
            with safe_open(path / "model.safetensors", "pt") as f:
                return {k: path / "model.safetensors" for k in f.keys()}
        with open(path / "model.safetensors.index.json") as f:
            weight_map = json.load(f)["weight_map"]
        return {k: path / v for k, v in weight_map.items()}

    a, b = tensors(ckpt), tensors(out)
    if set(a) != set(b):
        return False, f"key sets differ: {sorted(set(a) ^ set(b))[:5]}"
    for key in sorted(a):
        with safe_open(a[key], "pt") as fa, safe_open(b[key], "pt") as fb:
            x, y = fa.get_tensor(key), fb.get_tensor(key)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bytes_view(x), _bytes_view(y)):
            return False, f"{key} differs"
    return True, ""


def _bytes_view(t):
    import torch

    return t.reshape(-1).view(torch.uint8)


def aggregate(rows: list[dict], total: int) -> list[dict]:
    gathers = [r for r in rows if r.get("gather")]
    rows = [r for r in rows if not r.get("gather")]
    out = []
    keys = sorted({(r["ep"], r["efsdp"], r["fsync"]) for r in rows}, key=lambda k: (-k[0], not k[2]))
    for ep, efsdp, fsync in keys:
        mine = [r for r in rows if (r["ep"], r["efsdp"], r["fsync"]) == (ep, efsdp, fsync)]
        runs = sorted({r["run"] for r in mine})
        walls = [max(r["wall_seconds"] for r in mine if r["run"] == k) for k in runs]
        ranks = sorted({r["rank"] for r in mine})
        per_rank = []
        for rank in ranks:
            rr = [r for r in mine if r["rank"] == rank]
            rep = rr[-1]["report"]
            per_rank.append({
                "rank": rank, "bytes_written": rep["bytes_written_rank"], "files": len(rep["files"]),
                "bytes_sent": rep["bytes_sent_rank"], "bytes_received": rep["bytes_received_rank"],
                "local_param_bytes": rr[-1]["local_param_bytes"],
                "rss_growth_max": max(r["report"]["peak_rss_bytes"] - r["report"]["rss_before_bytes"] for r in rr),
                "plan_seconds": statistics.median(r["report"]["plan_seconds"] for r in rr),
            })
        wall = statistics.median(walls)
        gather = statistics.median(max(r["wall_seconds"] for r in gathers if (r["ep"], r["efsdp"], r["run"]) ==
                                       (ep, efsdp, k)) for k in runs)
        out.append({"ep": ep, "efsdp": efsdp, "fsync": fsync, "wall_seconds": wall, "walls": walls,
                    "full_tensor_gather_seconds": gather,
                    "MiB_per_s": total / MiB / wall, "dir": mine[-1]["dir"], "per_rank": per_rank,
                    "num_files": mine[-1]["report"]["num_files"], "plan": mine[-1]["report"]["plan"]})
    return out


def format_report(res: dict) -> str:
    total = res["checkpoint"]["bytes"]
    load = res["host"]["loadavg_before"][0], res["host"]["loadavg_after"][0]
    lines = [f"checkpoint: {total / MiB:,.1f} MiB bf16, {res['checkpoint']['num_tensors']:,} tensors; "
             f"shards of at most {res['config']['shard_bytes'] / MiB:g} MiB; {res['host']['cpus']} CPUs "
             f"(load average {load[0]:.1f} before, {load[1]:.1f} after); median and best of {res['config']['repeat']}",
             "",
             f"{'what':50} {'wall s':>7} {'MiB/s':>8} {'best s':>7} {'files':>6} {'same bytes':>10}"]
    for lay in res["layouts"]:
        what = f"moeshard.save, 4 ranks EP={lay['ep']} x efsdp={lay['efsdp']}, fsync {'on' if lay['fsync'] else 'off'}"
        lines.append(f"{what:50} {lay['wall_seconds']:7.2f} {lay['MiB_per_s']:8.0f} {min(lay['walls']):7.2f} "
                     f"{lay['num_files']:6d} {'ok' if lay['same'] else 'NO':>10}")
    sp = res["single_process"]
    for name, label in (("save_pretrained", "transformers save_pretrained, 1 process"),
                        ("moeshard_single", "moeshard.save, 1 process, fsync on")):
        r = sp[name]
        lines.append(f"{label:50} {r['wall_seconds']:7.2f} {total / MiB / r['wall_seconds']:8.0f} "
                     f"{min(r['walls']):7.2f} {r['num_files']:6d} {'ok' if r['same'] else 'NO':>10}")
    hf = sp["save_pretrained"]
    lines.append(f"{'  + fsync of its files afterwards':50} {hf['wall_seconds'] + hf['fsync_after_seconds']:7.2f} "
                 f"{total / MiB / (hf['wall_seconds'] + hf['fsync_after_seconds']):8.0f}")
    for lay in res["layouts"]:
        if lay["fsync"]:
            g = lay["full_tensor_gather_seconds"]
            what = f"  + gather first (full_tensor, EP={lay['ep']} x {lay['efsdp']})"
            lines.append(f"{what:50} {hf['wall_seconds'] + g:7.2f} {total / MiB / (hf['wall_seconds'] + g):8.0f}"
                         f"   (gather alone {g:.2f} s)")
    lines += ["", "per rank (fsync on): bytes written / sent / received, peak RSS growth during the save",
              f"{'layout':10} {'rank':>4} {'written MiB':>11} {'files':>5} {'sent MiB':>8} {'recv MiB':>8} "
              f"{'params MiB':>10} {'RSS+ MiB':>8}"]
    for lay in res["layouts"]:
        if not lay["fsync"]:
            continue
        for pr in lay["per_rank"]:
            lines.append(f"{'EP%dx%d' % (lay['ep'], lay['efsdp']):10} {pr['rank']:4d} {pr['bytes_written'] / MiB:11.1f} "
                         f"{pr['files']:5d} {pr['bytes_sent'] / MiB:8.1f} {pr['bytes_received'] / MiB:8.1f} "
                         f"{pr['local_param_bytes'] / MiB:10.1f} {pr['rss_growth_max'] / MiB:8.1f}")
    lines.append(f"{'1 process':10} {'':4} {total / MiB:11.1f} {'':5} {'':8} {'':8} {total / MiB:10.1f} "
                 f"{(hf['rss_growth'] or 0) / MiB:8.1f}  (save_pretrained; moeshard.save: "
                 f"{sp['moeshard_single']['rss_growth'] / MiB:.1f})")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_save", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=float, default=384, help="checkpoint size to aim for (default 384)")
    p.add_argument("--ckpt", default=None, help="checkpoint directory (default bench_out/ckpt_<size>mib)")
    p.add_argument("--out", default="bench_out/bench_save.json", help="JSON report path")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="comma list of EPxEFSDP, ep x efsdp = 4")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each (median; default 3)")
    p.add_argument("--shard-mib", type=float, default=64, help="max shard file size, both savers (default 64)")
    p.add_argument("--staging-mib", type=float, default=256, help="moeshard staging budget per rank (default 256)")
    p.add_argument("--keep", action="store_true", help="keep the saved directories (bench_out/save_out)")
    p.add_argument("--timeout", type=float, default=900, help="seconds before the ranks are killed")
    args = p.parse_args(argv)
    layouts = []
    for part in args.layouts.split(","):
        ep, _, efsdp = part.strip().lower().partition("x")
        layouts.append((int(ep), int(efsdp or 1)))
        if layouts[-1][0] * layouts[-1][1] != WORLD:
            p.error(f"--layouts: {part}: ep x efsdp must be {WORLD}")
    args.layouts = layouts
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    import torch

    from moeshard import CheckpointIndex
    from moeshard._launch import run_local_ranks

    from benchmarks.bench_save import rank_main  # importable by name in the spawned ranks

    dims = model_dims(args.size_mib)
    ckpt = checkpoint_path(args.ckpt, args.size_mib)
    print(f"[bench_save] checkpoint {ckpt} (~{checkpoint_bytes(dims) / MiB:,.0f} MiB) ...", flush=True)
    built, build_s = ensure_checkpoint(ckpt, dims)
    index = CheckpointIndex.open(ckpt)
    total = index.total_bytes
    out_root = Path("bench_out") / "save_out"
    shutil.rmtree(out_root, ignore_errors=True)
    out_root.mkdir(parents=True)
    load_before = os.getloadavg()
    spec = {"ckpt": str(ckpt.resolve()), "dims": dims, "layouts": args.layouts, "repeat": max(1, args.repeat),
            "out_root": str(out_root.resolve()), "shard_bytes": int(args.shard_mib * MiB),
            "staging_bytes": int(args.staging_mib * MiB)}
    print(f"[bench_save] {total / MiB:,.1f} MiB; {WORLD} gloo ranks, layouts {args.layouts} ...", flush=True)
    saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        rows = [r for per_rank in run_local_ranks(rank_main, spec, world=WORLD, timeout=args.timeout) for r in per_rank]
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    layouts = aggregate(rows, total)
    for lay in layouts:
        lay["same"], lay["mismatch"] = same_tensors(ckpt, Path(lay["dir"]))
    print("[bench_save] one process: save_pretrained and moeshard.save ...", flush=True)
    sp_runs = single_process(ckpt, dims, out_root, spec["shard_bytes"], spec["repeat"])
    sp = {}
    for name, runs in sp_runs.items():
        wall = statistics.median(r["wall_seconds"] for r in runs)
        d = Path(runs[-1]["dir"])
        same, why = same_tensors(ckpt, d)
        sp[name] = {"wall_seconds": wall, "walls": [r["wall_seconds"] for r in runs], "same": same, "mismatch": why,
                    "rss_growth": max((r["rss_growth"] or 0) for r in runs),
                    "num_files": len(list(d.glob("*.safetensors")))}
        if name == "save_pretrained":
            sp[name]["fsync_after_seconds"] = statistics.median(r["fsync_after_seconds"] for r in runs)
    res = {
        "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.bench_save",
                             *(argv if argv is not None else sys.argv[1:])]),
        "checkpoint": {"path": str(ckpt), "bytes": total, "num_tensors": len(index.tensors), "dims": dims,
                       "built": built, "build_seconds": build_s},
        "config": {"world_size": WORLD, "backend": "gloo", "layouts": args.layouts, "repeat": spec["repeat"],
                   "shard_bytes": spec["shard_bytes"], "staging_bytes": spec["staging_bytes"]},
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                 "platform": platform.platform(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "layouts": layouts,
        "single_process": sp,
        "total_seconds": time.perf_counter() - t_start,
    }
    if not args.keep:
        shutil.rmtree(out_root, ignore_errors=True)
    print()
    print(format_report(res))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(res, indent=2, default=json_default))
    os.replace(tmp, out)
    print(f"\n[bench_save] wrote {out}; total {res['total_seconds']:.0f} s", flush=True)
    return res


if __name__ == "__main__":
    main()
