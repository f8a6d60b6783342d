"""Sizing-tool benchmark: wall time of ``moeshard inspect`` and ``moeshard plan`` at DeepSeek-V3's
shape, and the bytes ``moeshard plan`` predicts for every strategy.

1. ``moeshard inspect`` on header-only DeepSeek-V3 checkpoints: the safetensors files of
   ``docs/deepseek_v3_config.json`` (BF16, 45,395 tensors, 1.22 TiB) and of its FP8 release
   format (``quantization_config`` added: FP8 weights + F32 block scales, 90,000+ tensors),
   written with real headers and *sparse* data sections (the files have their full size but
   occupy a few MB on disk; inspect reads headers only).
2. ``moeshard plan --synthetic-from-config docs/deepseek_v3_config.json`` for 256 ranks
   (32 nodes x 8, EP 64 x expert-FSDP 4) and 1,024 ranks (128 x 8, EP 256 x expert-FSDP 4),
   every storage mode, with ``--bandwidth``.

Every command runs as its own process, one after the other (``--repeat`` times, median), as a
user would run it: wall time includes starting Python and importing torch. CPU seconds (user +
sys of the child) are recorded too (less sensitive to other load on a shared host), and the
child's peak RSS. Prints the figures and the predicted bytes per strategy (256 ranks); writes
JSON.

Run from the repository root::

    python -m benchmarks.bench_plan                 # writes bench_out/bench_plan.json
    python -m benchmarks.bench_plan --repeat 3 --skip-inspect
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `moeshard` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moeshard.checkpoint import INDEX_NAME, CheckpointIndex  # noqa: E402
from moeshard.cluster import read_config, synthetic_index  # noqa: E402
from moeshard.cluster.render import format_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "docs" / "deepseek_v3_config.json"
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# (label, nodes, ranks per node, ep): expert-FSDP is world / ep = 4 in both.
CLUSTERS = (("256 ranks", 32, 8, 64), ("1024 ranks", 128, 8, 256))


def write_sparse_checkpoint(index: CheckpointIndex, cfg: dict, root: Path) -> int:
    """The checkpoint ``index`` describes, as safetensors files with real headers and sparse
    (unwritten) data sections, plus its index and ``config.json``. Returns bytes on disk."""
    by_file: dict[str, list[tuple[int, str]]] = {}
    for key, t in index.tensors.items():
        by_file.setdefault(t.file, []).append((t.offset, key))
    weight_map = {}
    for name, entries in by_file.items():
        header, begin = {}, 0
        for _, key in sorted(entries):
            t = index.tensors[key]
            header[key] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [begin, begin + t.nbytes]}
            begin += t.nbytes
            weight_map[key] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
        with open(root / name, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + begin)  # the data: a hole
    (root / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": index.total_bytes}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    return sum(p.stat().st_blocks * 512 for p in root.iterdir())


def _run(cmd: list[str]) -> tuple[str, float, float, int]:
    """stdout, wall seconds, CPU seconds (user + sys) and peak RSS bytes of one child process."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=ROOT)
        _, status, ru = os.wait4(p.pid, 0)  # this child's own resource usage
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {err.read().strip()[-2000:]}")
        return out.read(), wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024  # Linux: KiB


def _repeated(cmd: list[str], repeat: int) -> tuple[list[str], dict]:
    """Every run's stdout; median wall / CPU seconds and peak RSS over ``repeat`` runs."""
    walls, cpus, rss, outs = [], [], [], []
    for _ in range(repeat):
        out, wall, cpu, peak = _run(cmd)
        outs.append(out)
        walls.append(wall)
        cpus.append(cpu)
        rss.append(peak)
    return outs, {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
                  "peak_rss_bytes": max(rss), "wall_s_all": walls, "cpu_s_all": cpus}


def bench_inspect(cfg: dict, repeat: int) -> list[dict]:
    rows = []
    for label, c in (("BF16", cfg), ("FP8", {**cfg, "quantization_config": FP8})):
        index = synthetic_index(c)
        with tempfile.TemporaryDirectory(prefix="moeshard_bench_plan_") as tmp:
            on_disk = write_sparse_checkpoint(index, c, Path(tmp))
            outs, t = _repeated([sys.executable, "-m", "moeshard.cli", "inspect", tmp, "--json"], repeat)
        rep = json.loads(outs[-1])
        rows.append({"checkpoint": f"DeepSeek-V3 {label}", "num_tensors": len(index.tensors),
                     "num_files": len(index.file_sizes), "total_bytes": index.total_bytes, "bytes_on_disk": on_disk,
                     "num_problems": len(rep["problems"]), **t})
    return rows


def bench_plan(config: Path, bandwidth: str, repeat: int) -> list[dict]:
    rows = []
    for label, nodes, rpn, ep in CLUSTERS:
        cmd = [sys.executable, "-m", "moeshard.cli", "plan", "--synthetic-from-config", str(config),
               "--nodes", str(nodes), "--ranks-per-node", str(rpn), "--ep", str(ep), "--bandwidth", bandwidth, "--json"]
        outs, t = _repeated(cmd, repeat)
        reps = [json.loads(o) for o in outs]
        rep = reps[-1]  # the plans are deterministic; only the timings differ between runs
        stages = {k: statistics.median(r["timings_s"][k] for r in reps) for k in rep["timings_s"]}
        rows.append({"cluster": label, "command": "moeshard plan " + " ".join(cmd[4:-1]), **rep["cluster"],
                     "num_needs": rep["num_needs"], **t, "timings_s": stages, "strategies": rep["strategies"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--bandwidth", default="storage=10,intra=150,inter=50",
                    help="GB/s: storage per node, per-rank intra-node and inter-node links")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--skip-inspect", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench_out" / "bench_plan.json")
    args = ap.parse_args(argv)
    cfg = read_config(args.config)
    result = {"host": {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()},
              "config": str(args.config), "bandwidth": args.bandwidth, "repeat": args.repeat}

    if not args.skip_inspect:
        result["inspect"] = bench_inspect(cfg, args.repeat)
        print("1. moeshard inspect on header-only (sparse) DeepSeek-V3 checkpoints")
        print(f"{'checkpoint':<18}{'tensors':>9}{'files':>7}{'size':>13}{'problems':>10}{'wall s':>9}{'cpu s':>8}"
              f"{'peak RSS':>12}")
        for r in result["inspect"]:
            print(f"{r['checkpoint']:<18}{r['num_tensors']:>9,}{r['num_files']:>7}{format_bytes(r['total_bytes']):>13}"
                  f"{r['num_problems']:>10}{r['wall_s']:>9.2f}{r['cpu_s']:>8.2f}{format_bytes(r['peak_rss_bytes']):>12}")
        print()

    result["plan"] = bench_plan(args.config, args.bandwidth, args.repeat)
    shown = os.path.relpath(args.config, ROOT) if args.config.resolve().is_relative_to(ROOT) else args.config
    print(f"2. moeshard plan --synthetic-from-config {shown} --bandwidth {args.bandwidth} (all storage modes)")
    print(f"{'cluster':<12}{'EP x eFSDP':>12}{'needs':>10}{'wall s':>9}{'cpu s':>8}{'peak RSS':>12}{'planning s':>12}"
          "   planning stages (s), medians")
    for r in result["plan"]:
        stages = ", ".join(f"{k} {v:.2f}" for k, v in r["timings_s"].items() if k != "total")
        print(f"{r['cluster']:<12}{str(r['ep']) + ' x ' + str(r['efsdp']):>12}{r['num_needs']:>10,}{r['wall_s']:>9.2f}"
              f"{r['cpu_s']:>8.2f}{format_bytes(r['peak_rss_bytes']):>12}{r['timings_s']['total']:>12.2f}   {stages}")

    first = result["plan"][0]
    print(f"\n3. predicted cost per strategy, {first['cluster']} ({first['num_nodes']} x {first['ranks_per_node']}, "
          f"EP {first['ep']} x expert-FSDP {first['efsdp']})")
    cols = ("read total", "read max/node", "cross-node", "sent max/rank", "recv max/rank", "est. time", "bottleneck")
    print(f"{'strategy':<22}" + "".join(f"{c:>15}" for c in cols))
    for s in first["strategies"]:
        vals = [format_bytes(s[k]) for k in ("read_bytes_total", "read_bytes_max_node", "cross_node_bytes",
                                             "sent_bytes_max_rank", "recv_bytes_max_rank")]
        print(f"{s['name']:<22}" + "".join(f"{v:>15}" for v in vals) + f"{s['time_s']:>13.1f} s{s['bottleneck']:>15}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
