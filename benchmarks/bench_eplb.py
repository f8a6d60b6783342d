"""EPLB benchmark: oblivious (deepseek-ai/EPLB) against migration-aware rebalancing.

Over a drifting Zipf load trace (``benchmarks/traces.py``), starting from the oblivious
placement of step 0, each policy rebalances once per step from its own previous placement.
Per step: balance (mean over layers of max/mean rank load), copies moved (copies whose rank
did not hold the expert before: network or storage transfers), the aware/oblivious ratio of
moves, and the policy's wall time (median of ``--repeat`` calls). Default shape: DeepSeek-V3
(58 MoE layers, 256 experts, 288 slots, 8 expert groups, 32 EP ranks on 4 nodes). Prints a
table; writes JSON.

Run from the repository root::

    python -m benchmarks.bench_eplb
    python -m benchmarks.bench_eplb --groups 0          # global policy
    python -m benchmarks.bench_eplb --layers 8 --logical 64 --physical 80 --ranks 16 --nodes 2 --groups 4
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeshard.cli.bench.traces import zipf_trace  # noqa: E402
from moeshard import eplb  # noqa: E402


def _timed(fn, repeat: int):
    """Result, median wall seconds, median CPU seconds of this process (less sensitive to other
    load on a shared machine)."""
    times, cpu, out = [], [], None
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return out, float(np.median(times)), float(np.median(cpu))


def run(args) -> dict:
    cfg = dict(num_physical=args.physical, num_ranks=args.ranks, num_nodes=args.nodes,
               num_groups=args.groups or None)
    trace = zipf_trace(args.layers, args.logical, args.steps + 1, seed=args.seed, alpha=args.alpha, drift=args.drift)
    start = eplb.rebalance(trace[0], **cfg, migration_aware=False)
    cur = {"oblivious": start, "aware": start}
    rows = []
    for step in range(1, args.steps + 1):
        load = trace[step]
        row = {"step": step}
        new = {}
        for name, aware in (("oblivious", False), ("aware", True)):
            new[name], secs, cpu = _timed(lambda: eplb.rebalance(load, cur[name], **cfg, migration_aware=aware,
                                                            tolerance=args.tolerance), args.repeat)
            bal = eplb.balance(load, new[name], args.ranks)
            row[name] = {
                "balance": float(bal.mean()),
                "balance_max": float(bal.max()),
                "copies_moved": eplb.copies_moved(cur[name], new[name], args.ranks),
                "slots_changed": eplb.slots_changed(cur[name], new[name]),
                "seconds": secs,
                "cpu_seconds": cpu,
            }
            row[name]["_per_layer"] = bal
        # the guarantee, per layer, against the oblivious answer for the aware policy's own start
        ref = eplb.rebalance(load, cur["aware"], **cfg, migration_aware=False)
        row["aware_vs_oblivious_balance_max"] = float(
            (row["aware"]["_per_layer"] / eplb.balance(load, ref, args.ranks)).max())
        row["moved_ratio"] = row["aware"]["copies_moved"] / max(1, row["oblivious"]["copies_moved"])
        for name in new:
            del row[name]["_per_layer"]
        cur = new
        rows.append(row)
    tot = {name: sum(r[name]["copies_moved"] for r in rows) for name in ("oblivious", "aware")}
    summary = {
        "copies_per_step": args.layers * args.physical,
        "copies_moved_total": tot,
        "moved_ratio": tot["aware"] / max(1, tot["oblivious"]),
        "balance_mean": {n: float(np.mean([r[n]["balance"] for r in rows])) for n in tot},
        "aware_vs_oblivious_balance_max": max(r["aware_vs_oblivious_balance_max"] for r in rows),
        "seconds_median": {n: float(np.median([r[n]["seconds"] for r in rows])) for n in tot},
        "cpu_seconds_median": {n: float(np.median([r[n]["cpu_seconds"] for r in rows])) for n in tot},
    }
    return {
        "config": {**vars(args), **cfg, "policy": "hierarchical" if args.groups else "global"},
        "machine": {"python": platform.python_version(), "numpy": np.__version__, "cpu": platform.processor(),
                    "cpus": __import__("os").cpu_count()},
        "steps": rows,
        "summary": summary,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--logical", type=int, default=256)
    ap.add_argument("--physical", type=int, default=288)
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8, help="expert groups; 0 = global policy")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of expert popularity")
    ap.add_argument("--drift", type=float, default=0.1, help="fraction of experts swapping popularity per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=5, help="policy calls per step (median wall time)")
    ap.add_argument("--out", default="bench_out/bench_eplb.json")
    args = ap.parse_args(argv)

    res = run(args)
    c = res["config"]
    print(f"EPLB {c['policy']}: {args.layers} layers x {args.logical} experts, {args.physical} slots, "
          f"{args.ranks} ranks / {args.nodes} nodes, groups={args.groups or '-'}; zipf alpha={args.alpha} "
          f"drift={args.drift}; {args.layers * args.physical} copies per step")
    print(f"{'step':>4} | {'balance obl':>11} {'aware':>7} | {'moved obl':>9} {'aware':>6} {'ratio':>6} | "
          f"{'ms obl':>7} {'aware':>7}")
    for r in res["steps"]:
        o, a = r["oblivious"], r["aware"]
        print(f"{r['step']:>4} | {o['balance']:>11.4f} {a['balance']:>7.4f} | {o['copies_moved']:>9} "
              f"{a['copies_moved']:>6} {r['moved_ratio']:>6.3f} | {1e3 * o['seconds']:>7.1f} {1e3 * a['seconds']:>7.1f}")
    s = res["summary"]
    print(f" all | {s['balance_mean']['oblivious']:>11.4f} {s['balance_mean']['aware']:>7.4f} | "
          f"{s['copies_moved_total']['oblivious']:>9} {s['copies_moved_total']['aware']:>6} {s['moved_ratio']:>6.3f} | "
          f"{1e3 * s['seconds_median']['oblivious']:>7.1f} {1e3 * s['seconds_median']['aware']:>7.1f}")
    print(f"policy CPU time (median): oblivious {1e3 * s['cpu_seconds_median']['oblivious']:.1f} ms, "
          f"aware {1e3 * s['cpu_seconds_median']['aware']:.1f} ms")
    print(f"worst per-layer balance, aware / oblivious: {s['aware_vs_oblivious_balance_max']:.4f} "
          f"(tolerance {1 + args.tolerance:.2f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
