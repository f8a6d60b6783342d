"""EPLB's swap search compiled (numba, ``moeshard[fast]``) against its numpy rounds, in one
process: one ``eplb.rebalance`` call on all ``--layers`` layers at DeepSeek-V3's shape
(hierarchical, global, a migration-aware step per layer and with ``tolerance_scope="step"``),
``MOESHARD_EPLB_JIT`` switched per call and the two alternated ``--repeat`` times; medians of
process CPU time (the first round, which pays numba's import and compile, is left out), and
whether both gave the same placement.

Run from the repository root::

    python -m benchmarks.bench_eplb_jit --out bench_out/bench_eplb_jit.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_eplb_optimum import SHAPES
from moeshard import eplb
from moeshard.cli.bench.traces import zipf_trace


def cases(layers: int, seed: int) -> dict:
    """name -> a call of ``eplb.rebalance`` on a drifting Zipf trace's second step."""
    s = SHAPES["deepseek_v3"]
    cfg = dict(num_physical=s["physical"], num_ranks=s["ranks"], num_nodes=s["nodes"], num_groups=s["groups"])
    glob = dict(cfg, num_groups=None)
    tr = zipf_trace(layers, s["logical"], 2, seed=seed, alpha=1.2, drift=0.1)
    cur = eplb.rebalance(tr[0], **cfg, migration_aware=False)
    aware = dict(tolerance=0.01, relative_to="oblivious")
    return {
        "deepseek_v3": lambda: eplb.rebalance(tr[1], **cfg, migration_aware=False),
        "deepseek_v3_global": lambda: eplb.rebalance(tr[1], **glob, migration_aware=False),
        "deepseek_v3/aware_step": lambda: eplb.rebalance(tr[1], cur, **cfg, **aware),
        "deepseek_v3/aware_step_scope": lambda: eplb.rebalance(tr[1], cur, **cfg, **aware, tolerance_scope="step"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out/bench_eplb_jit.json")
    a = ap.parse_args(argv)
    calls = cases(a.layers, a.seed)
    cpu = {k: {"compiled": [], "numpy": []} for k in calls}
    same = {k: True for k in calls}
    for r in range(a.repeat):
        got = {}
        for mode in ("compiled", "numpy") if r % 2 == 0 else ("numpy", "compiled"):
            os.environ["MOESHARD_EPLB_JIT"] = "1" if mode == "compiled" else "0"
            for k, call in calls.items():
                c0 = time.process_time()
                pl = call()
                cpu[k][mode].append(time.process_time() - c0)
                got[k, mode] = pl.phy2log
        for k in calls:
            same[k] &= bool(np.array_equal(got[k, "compiled"], got[k, "numpy"]))
    out = {"layers": a.layers, "repeat": a.repeat, "load_average": os.getloadavg()}
    for k in calls:
        row = {f"{m}_cpu_ms": 1e3 * float(np.median(v[1:])) for m, v in cpu[k].items()}
        row["numpy_over_compiled"] = row["numpy_cpu_ms"] / row["compiled_cpu_ms"]
        row["same_placement"] = same[k]
        out[k] = row
        print(f"{k}: {json.dumps(row)}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
