"""EPLB benchmark: the reference (deepseek-ai/EPLB), oblivious and migration-aware rebalancing.

Over a drifting Zipf load trace (``benchmarks/traces.py``), each policy rebalances once per
step from its own previous placement: the reference (``eplb.reference``, deepseek-ai/EPLB's
exact answer, re-implemented; it starts from its own step-0 answer), moeshard's oblivious
policy and the migration-aware one (both start from the oblivious placement of step 0).
Per step: balance (mean over layers of max/mean rank load), copies moved (copies whose rank
did not hold the expert before: network or storage transfers), the aware policy's worst
per-layer balance over the reference's for the same load, the aware/reference and
aware/oblivious ratios of moves, and the policies' wall time (median of ``--repeat`` calls).
Default shape: DeepSeek-V3 (58 MoE layers, 256 experts, 288 slots, 8 expert groups, 32 EP
ranks on 4 nodes). Prints a table; writes JSON.

First step (no previous placement: the oblivious policy) against the reference, over fresh
traces of several Zipf exponents (``--first-alphas``) and seeds (``--first-seeds``): the
per-layer ratio of max/mean rank loads, oblivious / reference (min, median, mean, max over
layers and traces; never above 1), and both policies' time per call.

Run from the repository root::

    python -m benchmarks.bench_eplb
    python -m benchmarks.bench_eplb --groups 0          # global policy
    python -m benchmarks.bench_eplb --layers 8 --logical 64 --physical 80 --ranks 16 --nodes 2 --groups 4
    python -m benchmarks.bench_eplb --steps 0            # the first step only
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

from moeshard import eplb
from moeshard.cli.bench.traces import zipf_trace


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


def first_step(args, cfg: dict) -> dict:
    """Per layer, oblivious / reference max/mean rank load of the first placement, over one
    fresh trace per Zipf exponent and seed; with the calls' median wall and CPU seconds."""
    ratios, rows = [], []
    secs = {"oblivious": [], "reference": []}
    cpu = {"oblivious": [], "reference": []}
    for alpha in args.first_alphas:
        for seed in range(args.first_seeds):
            load = zipf_trace(args.layers, args.logical, 1, seed=seed, alpha=alpha)[0]
            obl, s_o, c_o = _timed(lambda: eplb.rebalance(load, **cfg, migration_aware=False), args.repeat)
            ref, s_r, c_r = _timed(lambda: eplb.reference(load, **cfg), args.repeat)
            r = eplb.balance(load, obl, args.ranks) / eplb.balance(load, ref, args.ranks)
            for name, s_, c_ in (("oblivious", s_o, c_o), ("reference", s_r, c_r)):
                secs[name].append(s_)
                cpu[name].append(c_)
            ratios.append(r)
            rows.append(
                {
                    "alpha": alpha,
                    "seed": seed,
                    "ratio_min": float(r.min()),
                    "ratio_median": float(np.median(r)),
                    "ratio_mean": float(r.mean()),
                    "ratio_max": float(r.max()),
                    "layers_better": int((r < 1 - 1e-12).sum()),
                    "layers_worse": int((r > 1 + 1e-12).sum()),
                }
            )
    x = np.concatenate(ratios)
    return {
        "traces": rows,
        "ratio": {"min": float(x.min()), "median": float(np.median(x)), "mean": float(x.mean()), "max": float(x.max())},
        "layers": int(x.size),
        "layers_better": int((x < 1 - 1e-12).sum()),
        "layers_worse": int((x > 1 + 1e-12).sum()),
        "seconds_median": {k: float(np.median(v)) for k, v in secs.items()},
        "cpu_seconds_median": {k: float(np.median(v)) for k, v in cpu.items()},
    }


def run(args) -> dict:
    cfg = dict(num_physical=args.physical, num_ranks=args.ranks, num_nodes=args.nodes, num_groups=args.groups or None)
    trace = zipf_trace(args.layers, args.logical, args.steps + 1, seed=args.seed, alpha=args.alpha, drift=args.drift)
    start = eplb.rebalance(trace[0], **cfg, migration_aware=False)
    cur = {"reference": eplb.reference(trace[0], **cfg), "oblivious": start, "aware": start}
    calls = {
        "reference": lambda load, old: eplb.reference(load, **cfg),
        "oblivious": lambda load, old: eplb.rebalance(load, old, **cfg, migration_aware=False),
        "aware": lambda load, old: eplb.rebalance(load, old, **cfg, tolerance=args.tolerance),
    }
    rows = []
    for step in range(1, args.steps + 1):
        load = trace[step]
        row = {"step": step}
        new = {}
        for name, call in calls.items():
            new[name], secs, cpu = _timed(lambda: call(load, cur[name]), args.repeat)
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
        # the guarantees, per layer, against the reference's answer (it depends on the load
        # only) and the oblivious answer for the aware policy's own start
        aw = row["aware"]["_per_layer"]
        row["aware_vs_reference_balance_max"] = float((aw / row["reference"]["_per_layer"]).max())
        row["aware_vs_reference_balance_mean"] = float(aw.mean() / row["reference"]["_per_layer"].mean())
        obl = eplb.rebalance(load, cur["aware"], **cfg, migration_aware=False)
        row["aware_vs_oblivious_balance_max"] = float((aw / eplb.balance(load, obl, args.ranks)).max())
        row["moved_ratio"] = row["aware"]["copies_moved"] / max(1, row["oblivious"]["copies_moved"])
        row["moved_ratio_vs_reference"] = row["aware"]["copies_moved"] / max(1, row["reference"]["copies_moved"])
        for name in new:
            del row[name]["_per_layer"]
        cur = new
        rows.append(row)
    tot = {name: sum(r[name]["copies_moved"] for r in rows) for name in calls}
    if not rows:
        return {
            "config": {**vars(args), **cfg, "policy": "hierarchical" if args.groups else "global"},
            "first_step": first_step(args, cfg),
        }
    summary = {
        "copies_per_step": args.layers * args.physical,
        "copies_moved_total": tot,
        "moved_ratio": tot["aware"] / max(1, tot["oblivious"]),
        "moved_ratio_vs_reference": tot["aware"] / max(1, tot["reference"]),
        "balance_mean": {n: float(np.mean([r[n]["balance"] for r in rows])) for n in tot},
        "aware_vs_reference_balance_max": max(r["aware_vs_reference_balance_max"] for r in rows),
        "aware_vs_reference_balance_mean_max": max(r["aware_vs_reference_balance_mean"] for r in rows),
        "aware_vs_oblivious_balance_max": max(r["aware_vs_oblivious_balance_max"] for r in rows),
        "seconds_median": {n: float(np.median([r[n]["seconds"] for r in rows])) for n in tot},
        "cpu_seconds_median": {n: float(np.median([r[n]["cpu_seconds"] for r in rows])) for n in tot},
    }
    return {
        "config": {**vars(args), **cfg, "policy": "hierarchical" if args.groups else "global"},
        "machine": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpu": platform.processor(),
            "cpus": __import__("os").cpu_count(),
        },
        "steps": rows,
        "summary": summary,
        "first_step": first_step(args, cfg),
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
    ap.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="aware policy: per layer at most (1 + tolerance) x the reference's max/mean",
    )
    ap.add_argument("--repeat", type=int, default=5, help="policy calls per step (median wall time)")
    ap.add_argument(
        "--first-alphas",
        type=lambda t: [float(a) for a in t.split(",")],
        default=[0.6, 0.9, 1.2, 1.5],
        help="first step: Zipf exponents of the fresh traces (comma-separated)",
    )
    ap.add_argument("--first-seeds", type=int, default=2, help="first step: traces per exponent")
    ap.add_argument("--out", default="bench_out/bench_eplb.json")
    args = ap.parse_args(argv)

    res = run(args)
    if "steps" in res:
        _print_steps(args, res)
    _print_first(args, res["first_step"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0


def _print_first(args, f: dict) -> None:
    """The first step's lines: per trace and over all, oblivious / reference per layer."""
    print(
        f"first step (no previous placement), oblivious / reference max/mean per layer, {args.layers} layers per trace:"
    )
    print(f"{'alpha':>5} {'seed':>4} | {'min':>7} {'median':>7} {'mean':>7} {'max':>7} | {'better':>6} {'worse':>5}")
    for t in f["traces"]:
        print(
            f"{t['alpha']:>5} {t['seed']:>4} | {t['ratio_min']:>7.4f} {t['ratio_median']:>7.4f} "
            f"{t['ratio_mean']:>7.4f} {t['ratio_max']:>7.4f} | {t['layers_better']:>6} {t['layers_worse']:>5}"
        )
    r = f["ratio"]
    print(
        f"  all | {r['min']:>7.4f} {r['median']:>7.4f} {r['mean']:>7.4f} {r['max']:>7.4f} | "
        f"{f['layers_better']:>6} {f['layers_worse']:>5}  of {f['layers']} layers (max {r['max']!r})"
    )
    c = f["cpu_seconds_median"]
    print(
        f"first step CPU time (median): oblivious {1e3 * c['oblivious']:.1f} ms, reference "
        f"{1e3 * c['reference']:.1f} ms"
    )


def _print_steps(args, res: dict) -> None:
    """The drifting trace's table and summary lines."""
    c = res["config"]
    print(
        f"EPLB {c['policy']}: {args.layers} layers x {args.logical} experts, {args.physical} slots, "
        f"{args.ranks} ranks / {args.nodes} nodes, groups={args.groups or '-'}; zipf alpha={args.alpha} "
        f"drift={args.drift}; {args.layers * args.physical} copies per step"
    )
    print(
        f"{'step':>4} | {'balance ref':>11} {'obl':>7} {'aware':>7} {'aw/ref':>7} | {'moved ref':>9} {'obl':>6} "
        f"{'aware':>6} {'aw/ref':>6} | {'ms ref':>6} {'obl':>6} {'aware':>6}"
    )

    def row(label, balance: dict, balance_ratio: float, moved: dict, moved_ratio: float, seconds: dict) -> str:
        """One line of the table: per policy (reference, oblivious, aware) balance, moves, ms."""
        b, m, t = ([d[k] for k in ("reference", "oblivious", "aware")] for d in (balance, moved, seconds))
        return (
            f"{label:>4} | {b[0]:>11.4f} {b[1]:>7.4f} {b[2]:>7.4f} {balance_ratio:>7.4f} | {m[0]:>9} {m[1]:>6} "
            f"{m[2]:>6} {moved_ratio:>6.3f} | {1e3 * t[0]:>6.1f} {1e3 * t[1]:>6.1f} {1e3 * t[2]:>6.1f}"
        )

    for r in res["steps"]:
        per = {
            k: {p: r[p][k] for p in ("reference", "oblivious", "aware")} for k in ("balance", "copies_moved", "seconds")
        }
        print(
            row(
                r["step"],
                per["balance"],
                r["aware_vs_reference_balance_max"],
                per["copies_moved"],
                r["moved_ratio_vs_reference"],
                per["seconds"],
            )
        )
    s = res["summary"]
    print(
        row(
            "all",
            s["balance_mean"],
            s["aware_vs_reference_balance_max"],
            s["copies_moved_total"],
            s["moved_ratio_vs_reference"],
            s["seconds_median"],
        )
    )
    c = s["cpu_seconds_median"]
    print(
        f"policy CPU time (median): reference {1e3 * c['reference']:.1f} ms, oblivious {1e3 * c['oblivious']:.1f} ms, "
        f"aware {1e3 * c['aware']:.1f} ms"
    )
    print(
        f"aware / reference, worst per-layer balance ratio: {s['aware_vs_reference_balance_max']!r} "
        f"(limit {1 + args.tolerance:.2f}; worst step mean: {s['aware_vs_reference_balance_mean_max']:.4f}); "
        f"aware / oblivious: {s['aware_vs_oblivious_balance_max']:.4f}"
    )
    print(
        f"copies moved, aware / reference: {s['moved_ratio_vs_reference']:.3f}; aware / oblivious: "
        f"{s['moved_ratio']:.3f}"
    )


if __name__ == "__main__":
    sys.exit(main())
