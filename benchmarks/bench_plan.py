"""Sizing-tool benchmark: wall time of ``moeshard inspect`` and ``moeshard plan`` at DeepSeek-V3's
shape, the bytes ``moeshard plan`` predicts for every strategy, and how planning grows with
the world size.

1. ``moeshard inspect`` on header-only DeepSeek-V3 checkpoints: the safetensors files of
   ``docs/deepseek_v3_config.json`` (BF16, 45,395 tensors, 1.22 TiB) and of its FP8 release
   format (``quantization_config`` added: FP8 weights + F32 block scales, 90,000+ tensors),
   written with real headers and *sparse* data sections (the files have their full size but
   occupy a few MB on disk; inspect reads headers only).
2. ``moeshard plan --synthetic-from-config docs/deepseek_v3_config.json`` for 256 ranks
   (32 nodes x 8, EP 64 x expert-FSDP 4) and 1,024 ranks (128 x 8, EP 256 x expert-FSDP 4),
   every storage mode, with ``--bandwidth``.
3. World-size sweep (``--worlds``, default 64,256,1024,8192): for each world W, 8 ranks per
   node, EP = min(256, W), expert-FSDP = W / EP (8,192 = 1,024 nodes x 8, EP 256 x eFSDP 32).

   a. the whole ``moeshard plan ... --storage all`` command, as in 2., with the planner's own
      timings (its ``--json`` report's ``timings_s``: headers, synthesize, needs, the plans of
      all storage modes, baselines, total; and each mode's ``plan_seconds``: plan + lower
      bounds + link bytes);
   b. what ONE RANK of a real job computes inside ``moeshard.load`` with storage "shared",
      measured in a child process of its own (``--one-rank W``, so its peak RSS is its own):
      the synthetic ParamDescs and placement are built as ``moeshard plan`` builds them, then
      ``need_table(keep_ranks=rank 0)`` (rank 0's needs and those several ranks share),
      ``plan_transfers(scope="job", every rank a reader, rank=0)`` (the transfers and rank
      0's local reads), ``Schedule.for_rank(0)`` and ``Schedule.fingerprint`` (what ranks
      compare) are timed, with the number of needs, pieces, sends and rounds; then, for
      comparison, every rank's need table, the whole job's schedule and its fingerprint
      (after the peak RSS is taken).

   Printed (as 4a and 4b, after the predicted bytes of 2.) with the growth of the seconds
   and of peak RSS between worlds 4x and 8x apart; JSON section ``sweep``.

With ``--compare SRC_TREE`` only one thing runs: the command of 3a at each ``--worlds`` size by
another source tree's package (``SRC_TREE/src`` on PYTHONPATH: e.g. a worktree of HEAD) and by
this checkout's, interleaved, side by side (wall, CPU, peak RSS, and whether both give the same
strategies); JSON ``bench_out/bench_plan_compare.json``.

Every command runs as its own process, one after the other (``--repeat`` times, median), as a
user would run it: wall time includes starting Python and importing moeshard (not torch: the
plan command does not import it). CPU seconds (user +
sys of the child) are recorded too (less sensitive to other load on a shared host), and the
child's peak RSS (``os.wait4``: that child's own ``ru_maxrss``). Prints the figures and the
predicted bytes per strategy (256 ranks); writes JSON (sections ``inspect``, ``plan``,
``sweep``).

Run from the repository root::

    python -m benchmarks.bench_plan                 # writes bench_out/bench_plan.json
    python -m benchmarks.bench_plan --repeat 3 --skip-inspect
    python -m benchmarks.bench_plan --skip-inspect --worlds 64,256,1024,2048,4096,8192
    python -m benchmarks.bench_plan --skip-sweep    # sections 1 and 2 only
    python -m benchmarks.bench_plan --one-rank 1024 # 3b for one world, as JSON on stdout
    git worktree add /tmp/old HEAD && python -m benchmarks.bench_plan --compare /tmp/old --worlds 1024,8192 --repeat 3
                                                    # before / after, interleaved: bench_plan_compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `moeshard` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np

from moeshard.cluster import (
    ClusterSpec,
    find_experts,
    make_placement,
    read_config,
    synthesize_descs,
    synthetic_index,
)
from moeshard.cluster.render import format_bytes
from moeshard.io.index import INDEX_NAME, CheckpointIndex
from moeshard.models.layout import need_table
from moeshard.plan import plan_transfers

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "docs" / "deepseek_v3_config.json"
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# (label, nodes, ranks per node, ep): expert-FSDP is world / ep = 4 in both.
CLUSTERS = (("256 ranks", 32, 8, 64), ("1024 ranks", 128, 8, 256))
# The world-size sweep: 8 ranks per node, EP = min(MAX_EP, world), expert-FSDP = world / EP.
SWEEP_RANKS_PER_NODE, SWEEP_MAX_EP = 8, 256
DEFAULT_WORLDS = "64,256,1024,8192"
MIB = 2**20


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
    (root / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": index.total_bytes}, "weight_map": weight_map})
    )
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    return sum(p.stat().st_blocks * 512 for p in root.iterdir())


def run_timed(cmd: list[str], env: dict | None = None) -> tuple[str, float, float, int]:
    """stdout, wall seconds, CPU seconds (user + sys) and peak RSS bytes of one child process
    (``env``: variables set for it on top of this process's)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, cwd=ROOT, env={**os.environ, **(env or {})})
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
        out, wall, cpu, peak = run_timed(cmd)
        outs.append(out)
        walls.append(wall)
        cpus.append(cpu)
        rss.append(peak)
    return outs, {
        "wall_s": statistics.median(walls),
        "cpu_s": statistics.median(cpus),
        "peak_rss_bytes": max(rss),
        "wall_s_all": walls,
        "cpu_s_all": cpus,
    }


def bench_inspect(cfg: dict, repeat: int) -> list[dict]:
    rows = []
    for label, c in (("BF16", cfg), ("FP8", {**cfg, "quantization_config": FP8})):
        index = synthetic_index(c)
        with tempfile.TemporaryDirectory(prefix="moeshard_bench_plan_") as tmp:
            on_disk = write_sparse_checkpoint(index, c, Path(tmp))
            outs, t = _repeated([sys.executable, "-m", "moeshard.cli", "inspect", tmp, "--json"], repeat)
        rep = json.loads(outs[-1])
        rows.append(
            {
                "checkpoint": f"DeepSeek-V3 {label}",
                "num_tensors": len(index.tensors),
                "num_files": len(index.file_sizes),
                "total_bytes": index.total_bytes,
                "bytes_on_disk": on_disk,
                "num_problems": len(rep["problems"]),
                **t,
            }
        )
    return rows


def _plan_command(config: Path, nodes: int, rpn: int, ep: int, bandwidth: str, repeat: int) -> dict:
    """``moeshard plan --synthetic-from-config ... --storage all --json`` run ``repeat`` times:
    the command line, cluster, needs, strategies, the child's figures (:func:`_repeated`), the
    planner's stage timings and each storage mode's ``plan_seconds`` (medians)."""
    cmd = [
        sys.executable,
        "-m",
        "moeshard.cli",
        "plan",
        "--synthetic-from-config",
        str(config),
        "--nodes",
        str(nodes),
        "--ranks-per-node",
        str(rpn),
        "--ep",
        str(ep),
        "--storage",
        "all",
        "--bandwidth",
        bandwidth,
        "--json",
    ]
    outs, t = _repeated(cmd, repeat)
    reps = [json.loads(o) for o in outs]
    rep = reps[-1]  # the plans are deterministic; only the timings differ between runs
    stages = {k: statistics.median(r["timings_s"][k] for r in reps) for k in rep["timings_s"]}
    modes = [s["name"] for s in rep["strategies"] if s["kind"] == "moeshard"]
    mode_s = {
        m.split()[-1]: statistics.median(
            next(s["plan_seconds"] for s in r["strategies"] if s["name"] == m) for r in reps
        )
        for m in modes
    }
    return {
        "command": "moeshard plan " + " ".join(cmd[4:-1]),
        **rep["cluster"],
        "num_needs": rep["num_needs"],
        **t,
        "timings_s": stages,
        "mode_plan_s": mode_s,
        "strategies": rep["strategies"],
    }


def bench_plan(config: Path, bandwidth: str, repeat: int) -> list[dict]:
    return [
        {"cluster": label, **_plan_command(config, nodes, rpn, ep, bandwidth, repeat)}
        for label, nodes, rpn, ep in CLUSTERS
    ]


def sweep_cluster(world: int) -> ClusterSpec:
    """The sweep's cluster for ``world`` ranks: 8 per node, EP = min(256, world), the rest expert-FSDP."""
    if world < SWEEP_RANKS_PER_NODE or world % SWEEP_RANKS_PER_NODE:
        raise ValueError(f"world size {world}: not a positive multiple of {SWEEP_RANKS_PER_NODE} ranks per node")
    return ClusterSpec.build(world // SWEEP_RANKS_PER_NODE, SWEEP_RANKS_PER_NODE, min(SWEEP_MAX_EP, world), None)


def _peak_rss_self() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def one_rank(config: Path, world: int) -> dict:
    """What one rank (rank 0) of a ``world``-rank job plans inside ``moeshard.load`` with
    storage "shared": need table, schedule (scope "job", every rank reads), its rows, the
    schedule's fingerprint. Seconds of each and the sizes; peak RSS before and after planning."""
    t0 = time.perf_counter()
    cluster = sweep_cluster(world)
    index = synthetic_index(read_config(config))
    layout = find_experts(index)
    placement = make_placement(layout, cluster)
    descs = synthesize_descs(layout, index, cluster)
    topo = cluster.topology()
    setup = time.perf_counter() - t0
    rss_setup = _peak_rss_self()
    readers = np.ones(world, dtype=bool)
    keep = np.zeros(world, dtype=bool)  # rank 0's own needs, and those several ranks share
    keep[0] = True
    t = time.perf_counter()
    table = need_table(descs, index, placement, world, keep_ranks=keep)
    t_needs = time.perf_counter() - t
    t = time.perf_counter()
    schedule = plan_transfers(table, index, topo, readers=readers, scope="job", rank=0)
    t_plan = time.perf_counter() - t
    t = time.perf_counter()
    mine = schedule.for_rank(0)
    t_rank = time.perf_counter() - t
    t = time.perf_counter()
    _ = schedule.fingerprint
    t_fp = time.perf_counter() - t
    rss = _peak_rss_self()
    # The whole job's schedule, for comparison (after the peak RSS above: it is not what a rank plans).
    t = time.perf_counter()
    every = need_table(descs, index, placement, world)
    t_every = time.perf_counter() - t
    t = time.perf_counter()
    whole = plan_transfers(every, index, topo, readers=readers, scope="job")
    t_whole = time.perf_counter() - t
    t = time.perf_counter()
    _ = whole.fingerprint
    t_whole_fp = time.perf_counter() - t
    return {
        "world_size": world,
        "setup_s": setup,
        "need_table_s": t_needs,
        "plan_transfers_s": t_plan,
        "for_rank_s": t_rank,
        "fingerprint_s": t_fp,
        "planning_s": t_needs + t_plan + t_rank + t_fp,
        "whole_job_need_table_s": t_every,
        "whole_job_plan_transfers_s": t_whole,
        "whole_job_fingerprint_s": t_whole_fp,
        "num_needs": len(every),
        "num_needs_planned": len(table),
        "num_alone": int(every.alone.sum()) if every.alone is not None else 0,
        "num_pieces": schedule.num_pieces,
        "num_reads": len(schedule.reads.rank),
        "num_sends": len(schedule.sends.src),
        "num_broadcasts": len(schedule.bcasts.piece),
        "num_rounds": schedule.num_rounds,
        "whole_job_pieces": whole.num_pieces,
        "rank0_reads": len(mine.reads),
        "rank0_sends": len(mine.sends),
        "rank0_deliveries": len(mine.deliveries),
        "rank0_rounds": len(mine.rounds),
        "peak_rss_after_setup_bytes": rss_setup,
        "peak_rss_self_bytes": rss,
    }


def bench_sweep(config: Path, bandwidth: str, repeat: int, worlds: list[int]) -> dict:
    """The sweep: per world size, the whole command and one rank's planning (each its own process)."""
    rows = []
    for world in worlds:
        c = sweep_cluster(world)
        row = {"world_size": world, **_plan_command(config, c.num_nodes, c.ranks_per_node, c.ep, bandwidth, repeat)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--config", str(config), "--one-rank", str(world)]
        outs, t = _repeated(cmd, repeat)
        reps = [json.loads(o) for o in outs]
        timed = [k for k, v in reps[-1].items() if k.endswith("_s")]
        row["one_rank"] = {
            **reps[-1],
            **{k: statistics.median(r[k] for r in reps) for k in timed},
            "process": {"command": " ".join(["python", *cmd[1:]]), **t},
        }
        rows.append(row)
        print(f"  swept {world:,} ranks: command {row['wall_s']:.1f} s, one rank {t['wall_s']:.1f} s", flush=True)
    return {"ranks_per_node": SWEEP_RANKS_PER_NODE, "max_ep": SWEEP_MAX_EP, "rows": rows, "growth": _growth(rows)}


def _growth(rows: list[dict]) -> list[dict]:
    """Ratios of seconds (and RSS) between every pair of swept worlds 4x or 8x apart."""

    def figures(r: dict) -> dict:
        o = r["one_rank"]
        return {
            "command_wall_s": r["wall_s"],
            "command_cpu_s": r["cpu_s"],
            "needs_s": r["timings_s"]["needs"],
            **{f"plan_{m}_s": v for m, v in r["mode_plan_s"].items()},
            "one_rank_need_table_s": o["need_table_s"],
            "one_rank_plan_transfers_s": o["plan_transfers_s"],
            "one_rank_planning_s": o["planning_s"],
            "num_needs": r["num_needs"],
            "command_peak_rss": r["peak_rss_bytes"],
            "one_rank_peak_rss": o["peak_rss_self_bytes"],
        }

    out = []
    for a in rows:
        for b in rows:
            if b["world_size"] / a["world_size"] in (4, 8):
                fa, fb = figures(a), figures(b)
                out.append(
                    {
                        "from": a["world_size"],
                        "to": b["world_size"],
                        "ratios": {k: fb[k] / fa[k] if fa[k] else None for k in fa},
                    }
                )
    return out


def bench_compare(config: Path, baseline: Path, worlds: list[int], repeat: int) -> list[dict]:
    """``moeshard plan --synthetic-from-config`` (all storage modes) at each swept world size,
    by the package of ``baseline`` (a source tree, e.g. a ``git worktree`` of HEAD: its
    ``src`` on PYTHONPATH) and by this checkout's, runs interleaved (drift on a shared host hits
    both alike). Per side: median wall and CPU seconds, peak RSS; and whether both printed the
    same strategies (every counter but the timings)."""
    rows = []
    sides = {"before": str(baseline.resolve() / "src"), "after": str(ROOT / "src")}
    for world in worlds:
        c = sweep_cluster(world)
        cmd = [
            sys.executable,
            "-m",
            "moeshard.cli",
            "plan",
            "--synthetic-from-config",
            str(config),
            "--nodes",
            str(c.num_nodes),
            "--ranks-per-node",
            str(c.ranks_per_node),
            "--ep",
            str(c.ep),
            "--efsdp",
            str(c.efsdp),
            "--json",
        ]
        runs: dict[str, list] = {k: [] for k in sides}
        for _ in range(repeat):
            for side, src in sides.items():
                runs[side].append(run_timed(cmd, {"PYTHONPATH": src}))
        row = {"world_size": world, "command": "moeshard plan " + " ".join(cmd[4:-1])}
        strategies = {}
        for side, rs in runs.items():
            row[side] = {
                "wall_s": statistics.median(r[1] for r in rs),
                "cpu_s": statistics.median(r[2] for r in rs),
                "peak_rss_bytes": max(r[3] for r in rs),
                "wall_s_all": [r[1] for r in rs],
            }
            rep = json.loads(rs[-1][0])
            strategies[side] = [{k: v for k, v in s.items() if k != "plan_seconds"} for s in rep["strategies"]]
        row["same_strategies"] = strategies["before"] == strategies["after"]
        rows.append(row)
        b, a = row["before"], row["after"]
        print(
            f"{world:>6}{b['wall_s']:>10.2f}{b['cpu_s']:>8.2f}{format_bytes(b['peak_rss_bytes']):>12}"
            f"{a['wall_s']:>10.2f}{a['cpu_s']:>8.2f}{format_bytes(a['peak_rss_bytes']):>12}"
            f"{b['wall_s'] / a['wall_s']:>9.1f}x{'yes' if row['same_strategies'] else 'NO':>8}",
            flush=True,
        )
    return rows


def print_sweep(sweep: dict) -> None:
    rows = sweep["rows"]
    modes = list(rows[0]["mode_plan_s"])
    print(
        f"4a. world-size sweep, whole command ({sweep['ranks_per_node']} ranks/node, "
        f"EP = min({sweep['max_ep']}, W)); per-mode = plan + lower bounds + link bytes (s)"
    )
    print(
        f"{'W':>6}{'nodes':>7}{'EP x eFSDP':>12}{'needs':>12}{'wall s':>9}{'cpu s':>8}{'RSS MiB':>9}{'needs s':>9}"
        + "".join(f"{m + ' s':>10}" for m in modes)
        + f"{'baselines s':>13}{'planning s':>12}"
    )
    for r in rows:
        t = r["timings_s"]
        shape = f"{r['ep']} x {r['efsdp']}"
        print(
            f"{r['world_size']:>6,}{r['num_nodes']:>7,}{shape:>12}{r['num_needs']:>12,}"
            f"{r['wall_s']:>9.1f}{r['cpu_s']:>8.1f}{r['peak_rss_bytes'] / MIB:>9,.0f}{t['needs']:>9.2f}"
            + "".join(f"{r['mode_plan_s'][m]:>10.2f}" for m in modes)
            + f"{t['baselines']:>13.2f}{t['total']:>12.2f}"
        )
    print(
        '\n4b. one rank inside moeshard.load, storage "shared" (own process; seconds; RSS = that process\'s peak '
        "before the whole job's plan, planned after for comparison: 'whole' = its need table + plan + fingerprint)"
    )
    print(
        f"{'W':>6}{'needs':>12}{'pieces':>11}{'sends':>11}{'rounds':>8}{'need_table':>12}{'plan':>8}{'for_rank':>10}"
        f"{'fingerpr.':>11}{'total':>8}{'RSS MiB':>9}{'setup MiB':>11}{'r0 sends':>10}{'r0 dlv':>9}{'whole':>8}"
    )
    for r in rows:
        o = r["one_rank"]
        print(
            f"{r['world_size']:>6,}{o['num_needs']:>12,}{o['num_pieces']:>11,}{o['num_sends']:>11,}"
            f"{o['num_rounds']:>8}{o['need_table_s']:>12.2f}{o['plan_transfers_s']:>8.2f}{o['for_rank_s']:>10.3f}"
            f"{o['fingerprint_s']:>11.3f}"
            f"{o['planning_s']:>8.2f}{o['peak_rss_self_bytes'] / MIB:>9,.0f}"
            f"{o['peak_rss_after_setup_bytes'] / MIB:>11,.0f}{o['rank0_sends']:>10,}{o['rank0_deliveries']:>9,}"
            f"{o['whole_job_need_table_s'] + o['whole_job_plan_transfers_s'] + o['whole_job_fingerprint_s']:>8.2f}"
        )
    if sweep["growth"]:
        print("\ngrowth (ratio of the larger world's figure to the smaller's)")
        cols = (
            ("needs", "num_needs"),
            ("cmd wall", "command_wall_s"),
            ("cmd cpu", "command_cpu_s"),
            ("needs s", "needs_s"),
            *((m, f"plan_{m}_s") for m in modes),
            ("1-rank", "one_rank_planning_s"),
            ("cmd RSS", "command_peak_rss"),
            ("1-rank RSS", "one_rank_peak_rss"),
        )
        print(f"{'W':>14}" + "".join(f"{label:>11}" for label, _ in cols))
        for g in sweep["growth"]:
            cells = ("" if g["ratios"][k] is None else f"x{g['ratios'][k]:.1f}" for _, k in cols)
            print(f"{str(g['from']) + ' -> ' + str(g['to']):>14}" + "".join(f"{c:>11}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument(
        "--bandwidth",
        default="storage=10,intra=150,inter=50",
        help="GB/s: storage per node, per-rank intra-node and inter-node links",
    )
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--skip-inspect", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true", help="skip the world-size sweep")
    ap.add_argument("--worlds", default=DEFAULT_WORLDS, help="world sizes of the sweep, comma-separated")
    ap.add_argument(
        "--one-rank",
        type=int,
        metavar="W",
        help="only time one rank's planning at world size W and print it as JSON (the sweep runs this)",
    )
    ap.add_argument(
        "--compare",
        type=Path,
        metavar="SRC_TREE",
        help="only compare the plan command of another source tree (e.g. `git worktree add /tmp/old "
        "HEAD`) with this checkout's at the --worlds sizes, interleaved; writes bench_plan_compare.json",
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench_out/bench_plan.json)")
    args = ap.parse_args(argv)
    if args.one_rank is not None:
        print(json.dumps(one_rank(args.config, args.one_rank)))
        return 0
    try:  # bad world sizes fail before anything runs
        worlds = [sweep_cluster(int(w)).world_size for w in args.worlds.split(",") if w.strip()]
    except ValueError as e:
        ap.error(f"--worlds {args.worlds}: {e}")
    if args.compare is not None:
        if not (args.compare / "src" / "moeshard").is_dir():
            ap.error(f"--compare {args.compare}: no src/moeshard there")
        print(
            f"moeshard plan --synthetic-from-config (all storage modes), {args.repeat} interleaved run(s) each: "
            f"before = {args.compare}, after = {ROOT}"
        )
        print(
            f"{'W':>6}{'before s':>10}{'cpu s':>8}{'peak RSS':>12}{'after s':>10}{'cpu s':>8}{'peak RSS':>12}"
            f"{'speedup':>10}{'same':>8}"
        )
        rows = bench_compare(args.config, args.compare, worlds, args.repeat)
        out = args.out or ROOT / "bench_out" / "bench_plan_compare.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "host": {"python": platform.python_version(), "cpus": os.cpu_count()},
                    "baseline": str(args.compare),
                    "repeat": args.repeat,
                    "rows": rows,
                },
                indent=2,
            )
        )
        print(f"wrote {out}")
        return 0
    args.out = args.out or ROOT / "bench_out" / "bench_plan.json"
    cfg = read_config(args.config)
    result = {
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()},
        "config": str(args.config),
        "bandwidth": args.bandwidth,
        "repeat": args.repeat,
    }

    if not args.skip_inspect:
        result["inspect"] = bench_inspect(cfg, args.repeat)
        print("1. moeshard inspect on header-only (sparse) DeepSeek-V3 checkpoints")
        print(
            f"{'checkpoint':<18}{'tensors':>9}{'files':>7}{'size':>13}{'problems':>10}{'wall s':>9}{'cpu s':>8}"
            f"{'peak RSS':>12}"
        )
        for r in result["inspect"]:
            print(
                f"{r['checkpoint']:<18}{r['num_tensors']:>9,}{r['num_files']:>7}{format_bytes(r['total_bytes']):>13}"
                f"{r['num_problems']:>10}{r['wall_s']:>9.2f}{r['cpu_s']:>8.2f}{format_bytes(r['peak_rss_bytes']):>12}"
            )
        print()

    result["plan"] = bench_plan(args.config, args.bandwidth, args.repeat)
    shown = os.path.relpath(args.config, ROOT) if args.config.resolve().is_relative_to(ROOT) else args.config
    print(f"2. moeshard plan --synthetic-from-config {shown} --bandwidth {args.bandwidth} (all storage modes)")
    print(
        f"{'cluster':<12}{'EP x eFSDP':>12}{'needs':>10}{'wall s':>9}{'cpu s':>8}{'peak RSS':>12}{'planning s':>12}"
        "   planning stages (s), medians"
    )
    for r in result["plan"]:
        stages = ", ".join(f"{k} {v:.2f}" for k, v in r["timings_s"].items() if k != "total")
        print(
            f"{r['cluster']:<12}{str(r['ep']) + ' x ' + str(r['efsdp']):>12}{r['num_needs']:>10,}{r['wall_s']:>9.2f}"
            f"{r['cpu_s']:>8.2f}{format_bytes(r['peak_rss_bytes']):>12}{r['timings_s']['total']:>12.2f}   {stages}"
        )

    first = result["plan"][0]
    print(
        f"\n3. predicted cost per strategy, {first['cluster']} ({first['num_nodes']} x {first['ranks_per_node']}, "
        f"EP {first['ep']} x expert-FSDP {first['efsdp']})"
    )
    cols = ("read total", "read max/node", "cross-node", "sent max/rank", "recv max/rank", "est. time", "bottleneck")
    print(f"{'strategy':<22}" + "".join(f"{c:>15}" for c in cols))
    for s in first["strategies"]:
        vals = [
            format_bytes(s[k])
            for k in (
                "read_bytes_total",
                "read_bytes_max_node",
                "cross_node_bytes",
                "sent_bytes_max_rank",
                "recv_bytes_max_rank",
            )
        ]
        print(f"{s['name']:<22}" + "".join(f"{v:>15}" for v in vals) + f"{s['time_s']:>13.1f} s{s['bottleneck']:>15}")

    if not args.skip_sweep:
        print()
        result["sweep"] = bench_sweep(args.config, args.bandwidth, args.repeat, worlds)
        print()
        print_sweep(result["sweep"])

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
