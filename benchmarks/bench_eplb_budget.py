"""EPLB under move caps: copies moved against the balance the caps cost, at DeepSeek-V3's shape
(256 experts, 288 slots, 32 ranks, 4 nodes, 8 groups, 58 MoE layers) on a drifting Zipf trace.

Each configuration follows the trace from the same start (the oblivious answer of step 0): at
each step, ``eplb.rebalance_with_report`` from the configuration's own previous answer, the
migration-aware policy (1 % over the oblivious answer, as bench_eplb_optimum's migration
section) under the caps, whole layers only (``partial=False``) or partial answers
(``partial=True``). Per configuration: copies moved per step, the most one rank pair exchanged
and one rank received in a step, mean balance (max / mean rank load) of the answers, of the
unconstrained answers from the same placements (``balance_unconstrained``), and their ratio
(what the caps cost); the reference's copies moved per step (deepseek-ai/EPLB from its own
previous answer) for scale. Time: CPU time (``time.process_time``: less disturbed by other
processes than the wall clock on a shared host) of the call with caps against the same call
without (A/B, alternated, median over steps), so the figure is what the caps add, also as a
fraction of the uncapped call.

Run from the repository root::

    python -m benchmarks.bench_eplb_budget --out bench_out/bench_eplb_budget.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeshard import eplb
from moeshard.cli.bench.traces import zipf_trace

CFG = dict(num_physical=288, num_ranks=32, num_nodes=4, num_groups=8)
AWARE = dict(tolerance=0.01, relative_to="oblivious")
CAPS = {
    "none": {},
    "total 0": dict(max_moves=0),
    "total 16": dict(max_moves=16),
    "total 64": dict(max_moves=64),
    "total 256": dict(max_moves=256),
    "pair 1": dict(max_moves_per_pair=1),
    "rank 2": dict(max_moves_per_rank=2),
    "total 64, pair 1, rank 4": dict(max_moves=64, max_moves_per_pair=1, max_moves_per_rank=4),
}


def run(layers: int, steps: int, seed: int, drift: float) -> dict:
    tr = zipf_trace(layers, 256, steps + 1, seed=seed, alpha=1.2, drift=drift)
    start = eplb.rebalance(tr[0], **CFG, migration_aware=False)
    ref_prev, ref_moved = eplb.reference(tr[0], **CFG), []
    for t in range(1, steps + 1):
        ref = eplb.reference(tr[t], **CFG)
        ref_moved.append(eplb.copies_moved(ref_prev, ref, 32))
        ref_prev = ref
    rows = {}
    for name, caps in CAPS.items():
        for partial in (False, True) if caps else (False,):
            cur, acc = start, {"moved": [], "pair": [], "recv": [], "bal": [], "free": [], "ms_caps": [], "ms_free": []}
            for t in range(1, steps + 1):
                w = tr[t]
                t0 = time.process_time()
                eplb.rebalance(w, cur, **CFG, **AWARE)
                t1 = time.process_time()
                rep = eplb.rebalance_with_report(w, cur, **CFG, **AWARE, partial=partial, **caps)
                t2 = time.process_time()
                pairs = rep.pair_moves.sum(0)
                acc["moved"].append(rep.copies_moved)
                acc["pair"].append(int(pairs.max()))
                acc["recv"].append(int(pairs.sum(0).max()))
                acc["bal"].append(float(rep.balance.mean()))
                acc["free"].append(float(rep.balance_unconstrained.mean()))
                acc["ms_free"].append(1e3 * (t1 - t0))
                acc["ms_caps"].append(1e3 * (t2 - t1))
                cur = rep.placement
            key = name if not caps else f"{name} ({'partial' if partial else 'whole layers'})"
            rows[key] = {
                "moved_per_step": float(np.mean(acc["moved"])),
                "max_pair_per_step": max(acc["pair"]),
                "max_received_per_step": max(acc["recv"]),
                "balance": float(np.mean(acc["bal"])),
                "balance_unconstrained": float(np.mean(acc["free"])),
                "budget_cost_ratio": float(np.mean(acc["bal"]) / np.mean(acc["free"])),
                "ms_call": float(np.median(acc["ms_caps"])),
                "ms_added": float(np.median(np.array(acc["ms_caps"]) - np.array(acc["ms_free"]))),
                "added_over_uncapped_call": float(
                    np.median((np.array(acc["ms_caps"]) - np.array(acc["ms_free"])) / np.array(acc["ms_free"]))
                ),
            }
            print(f"{key}: {json.dumps(rows[key])}", flush=True)
    return {"reference_moved_per_step": float(np.mean(ref_moved)), "configs": rows}


def uncapped_ms(res: dict) -> float:
    return res["configs"]["none"]["ms_call"]


def table(res: dict) -> str:
    head = "| caps | moved / step | pair max | received max | balance | unconstrained | cost | CPU ms added |"
    lines = [head, "|" + "---|" * 8]
    for k, r in res["configs"].items():
        lines.append(
            f"| {k} | {r['moved_per_step']:.0f} | {r['max_pair_per_step']} | {r['max_received_per_step']} | "
            f"{r['balance']:.4f} | {r['balance_unconstrained']:.4f} | {r['budget_cost_ratio']:.4f}x | "
            f"{r['ms_added']:.0f} ({r['added_over_uncapped_call']:.2f}x) |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drift", type=float, default=0.1)
    ap.add_argument("--out", default="bench_out/bench_eplb_budget.json")
    args = ap.parse_args(argv)
    res = {"shape": "deepseek_v3", "layers": args.layers, "steps": args.steps, "drift": args.drift}
    res.update(run(args.layers, args.steps, args.seed, args.drift))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"reference: {res['reference_moved_per_step']:.0f} copies moved per step")
    print(f"uncapped call: {uncapped_ms(res):.0f} CPU ms")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
