"""EPLB against the optimum: moeshard's oblivious policy, deepseek-ai/EPLB (the reference,
``eplb.reference``) and FlashLB (re-implemented, ``benchmarks/flashlb.py``) against the
yardstick (``benchmarks/eplb_exact.py``: the exact optimum where HiGHS finishes, else a lower
bound), and the migration-aware policy's moves under a limit relative to the oblivious one.

Sections (all on the same seeded loads per section):

1. FlashLB's example (8 experts, 16 slots on 8 ranks): each policy's heaviest rank.
2. ``--instances`` seeded random small shapes (two slots per rank on 3-8 ranks with up to 10
   experts, or three per rank on 3 ranks; Zipf-like loads), solved exactly: per policy, the
   ratio of its heaviest rank to the optimum (instances at it, mean, max).
3. Model shapes (DeepSeek-V3 256 experts / 288 slots / 32 ranks / 4 nodes / 8 groups,
   Qwen3-235B 128 / 160 / 32, Kimi-K2 384 / 416 / 32), on a Zipf trace and a bursty trace:
   per policy, mean max/mean rank load and its ratio to the lower bound; layers where moeshard
   is strictly lighter than FlashLB and the reference (or equal to the lower bound); ms per call.
4. Migration-aware steps on DeepSeek-V3's drifting trace: tolerance 1 % over the oblivious
   answer, per layer and (``tolerance_scope="step"``) on the mean over layers, copies moved
   against the reference's; and a lower bound of the per-layer policy's moves from its own
   previous placement: the groups that must change node for every node to fit under the
   limit (:func:`forced_group_moves`), a group's experts each one copy; and a floor of any
   hierarchical answer's moves within the per-layer limit over all the steps, from the start
   placement, even one that knew the later loads: the cheapest sequence of group assignments
   (:func:`group_move_floor`, copies moved inside nodes not counted).
5. With ``--compare SRC`` (another source tree's ``src``, e.g. an older checkout): the time of
   one ``eplb.rebalance`` call of sections 3 and 4 with this tree's package and with that one,
   alternated in one process (the host's load hits both alike), and their ratio.

"ms per call" is the time of one ``eplb.rebalance`` call on a whole trace (all ``--layers``
layers at once, as a serving engine rebalances every MoE layer in one call), wall clock.

Run from the repository root::

    python -m benchmarks.bench_eplb_optimum --out bench_out/bench_eplb_optimum.json

``--only migration`` (or any of ``flashlb small shapes migration compare``) runs only those
sections; ``--only-shapes NAME...`` runs only those shapes' rows of section 3.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.eplb_exact import lower_bound, node_upper, solve_exact
from benchmarks.flashlb import flashlb
from moeshard import eplb
from moeshard.cli.bench.traces import zipf_trace

SHAPES = {
    "deepseek_v3": dict(logical=256, physical=288, ranks=32, nodes=4, groups=8),
    "deepseek_v3_global": dict(logical=256, physical=288, ranks=32, nodes=4, groups=None),
    "qwen3_235b": dict(logical=128, physical=160, ranks=32, nodes=4, groups=None),
    "kimi_k2": dict(logical=384, physical=416, ranks=32, nodes=4, groups=None),
}


def _peak(load, pl, ranks) -> np.ndarray:
    return eplb.rank_loads(load, pl, ranks).max(1)


CPU_SECS: list[float] = []  # process CPU time of the last _timed call's runs


def _timed(fn, repeat=3):
    """``fn()``'s answer and the median wall time of ``repeat`` runs (their CPU times, less
    sensitive to other jobs on a shared host, in ``CPU_SECS``)."""
    out, secs = None, []
    CPU_SECS.clear()
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        secs.append(time.perf_counter() - t0)
        CPU_SECS.append(time.process_time() - c0)
    return out, float(np.median(secs))


def flashlb_example() -> dict:
    w = np.array([[600, 560, 120, 120, 20, 10, 10, 10]], dtype=float)
    ex = solve_exact(w[0], 8, 2)
    return {
        "reference": float(_peak(w, eplb.reference(w, num_physical=16, num_ranks=8), 8)[0]),
        "flashlb_reimplemented": float(_peak(w, flashlb(w, 16, 8), 8)[0]),
        "flashlb_published": 205.0,
        "moeshard": float(_peak(w, eplb.rebalance(w, num_physical=16, num_ranks=8, migration_aware=False), 8)[0]),
        "optimum": ex.value,
        "optimum_status": ex.status,
        "mean": float(w.sum() / 8),
    }


def small_instances(num: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    ratios = {"moeshard": [], "reference": [], "flashlb": []}
    unsolved, secs = 0, []
    for i in range(num):
        ranks, slots = int(rng.integers(3, 9)), 2
        experts = int(rng.integers(ranks, min(10, 2 * ranks) + 1))
        if i % 3 == 0:
            ranks, slots, experts = 3, 3, int(rng.integers(3, 10))
        w = (np.arange(1, experts + 1) ** -rng.uniform(0.5, 1.5)) * 1000 * rng.lognormal(0, 0.2, experts)
        w = w[rng.permutation(experts)][None]
        ex = solve_exact(w[0], ranks, slots)
        if ex.status != "optimal":
            unsolved += 1
            continue
        cfg = dict(num_physical=ranks * slots, num_ranks=ranks)
        pl, s = _timed(lambda: eplb.rebalance(w, **cfg, migration_aware=False), 1)
        secs.append(s)
        ratios["moeshard"].append(_peak(w, pl, ranks)[0] / ex.value)
        ratios["reference"].append(_peak(w, eplb.reference(w, **cfg), ranks)[0] / ex.value)
        ratios["flashlb"].append(_peak(w, flashlb(w, ranks * slots, ranks), ranks)[0] / ex.value)
    out = {"instances": num, "solved": num - unsolved, "moeshard_ms_median": 1e3 * float(np.median(secs))}
    for name, r in ratios.items():
        r = np.array(r)
        out[name] = {
            "at_optimum": int((r <= 1 + 1e-6).sum()),
            "within_1pct": int((r <= 1.01).sum()),
            "mean": float(r.mean()),
            "max": float(r.max()),
        }
    return out


def bursty_trace(layers: int, logical: int, seed: int) -> np.ndarray:
    """A Zipf (alpha 0.9) load where a few random experts per layer burst to 10x."""
    rng = np.random.default_rng(seed)
    w = zipf_trace(layers, logical, 1, seed=seed, alpha=0.9)[0]
    for layer in range(layers):
        hot = rng.choice(logical, size=max(1, logical // 64), replace=False)
        w[layer, hot] *= 10
    return w


def repacked_upper(w, pl, s, lb) -> np.ndarray:
    """``float[L]``: a feasible heaviest rank per layer under the node/group constraint: moeshard's
    groups per node, each node whose heaviest rank is above the lower bound repacked by
    :func:`benchmarks.eplb_exact.node_upper` where that is lighter. Between it and the lower
    bound lies the optimum."""
    rl = eplb.rank_loads(w, pl, s["ranks"])
    per_node, slots = s["ranks"] // s["nodes"], s["physical"] // s["ranks"]
    out = np.zeros(len(w))
    for layer in range(len(w)):
        p2l = np.asarray(pl.phy2log[layer])
        worst = 0.0
        for n in range(s["nodes"]):
            own = float(rl[layer, n * per_node : (n + 1) * per_node].max())
            if own > lb[layer] * (1 + 1e-9):
                ex = np.unique(p2l[n * per_node * slots : (n + 1) * per_node * slots])
                own = node_upper(w[layer, ex[ex >= 0]], per_node, slots, below=own)
            worst = max(worst, own)
        out[layer] = worst
    return out


def shapes(layers: int, flash_layers: int, seed: int, only=None) -> dict:
    out = {}
    for name, s in SHAPES.items():
        if only and name not in only:
            continue
        cfg = dict(num_physical=s["physical"], num_ranks=s["ranks"], num_nodes=s["nodes"], num_groups=s["groups"])
        for trace in ("zipf", "bursty"):
            if trace == "zipf":
                w = zipf_trace(layers, s["logical"], 1, seed=seed, alpha=1.2)[0]
            else:
                w = bursty_trace(layers, s["logical"], seed)
            lb = lower_bound(w, s["physical"], s["ranks"], s["nodes"], s["groups"])
            mean = w.sum(1) / s["ranks"]
            obl, ms = _timed(lambda: eplb.rebalance(w, **cfg, migration_aware=False))
            cpu_ms = 1e3 * float(np.median(CPU_SECS))
            ref, ms_ref = _timed(lambda: eplb.reference(w, **cfg))
            pm, pr = _peak(w, obl, s["ranks"]), _peak(w, ref, s["ranks"])
            fl_rows = slice(0, flash_layers)
            fl, ms_fl = _timed(lambda: flashlb(w[fl_rows], s["physical"], s["ranks"]), 1)
            pf = _peak(w[fl_rows], fl, s["ranks"])
            tie = 1e-9
            at_lb = pm <= lb * (1 + tie)
            hier = {}
            if s["groups"]:
                ub = repacked_upper(w, obl, s, lb)
                hier = {
                    "feasible_over_lower_bound": float((ub / lb).mean()),
                    "feasible_over_lower_bound_max": float((ub / lb).max()),
                    "moeshard_over_feasible": float((pm / ub).mean()),
                    "layers_moeshard_above_feasible": int((pm > ub * (1 + tie)).sum()),
                }
            row = {
                "layers": layers,
                "balance": {
                    "moeshard": float((pm / mean).mean()),
                    "reference": float((pr / mean).mean()),
                    "lower_bound": float((lb / mean).mean()),
                },
                "over_lower_bound": {"moeshard": float((pm / lb).mean()), "reference": float((pr / lb).mean())},
                "over_lower_bound_max": {"moeshard": float((pm / lb).max()), "reference": float((pr / lb).max())},
                "layers_better_than_reference_or_at_bound": int(((pm < pr * (1 - tie)) | at_lb).sum()),
                "layers_worse_than_reference": int((pm > pr * (1 + tie)).sum()),
                "flashlb_layers": flash_layers,
                "flashlb_over_lower_bound": float((pf / lb[fl_rows]).mean()),
                "moeshard_over_lower_bound_same_layers": float((pm[fl_rows] / lb[fl_rows]).mean()),
                "layers_better_than_flashlb_or_at_bound": int(((pm[fl_rows] < pf * (1 - tie)) | at_lb[fl_rows]).sum()),
                "layers_worse_than_flashlb": int((pm[fl_rows] > pf * (1 + tie)).sum()),
                **hier,
                "ms": {
                    "moeshard": 1e3 * ms,
                    "moeshard_cpu": cpu_ms,
                    "reference": 1e3 * ms_ref,
                    "flashlb_per_layer": 1e3 * ms_fl / flash_layers,
                },
            }
            out[f"{name}/{trace}"] = row
            print(f"{name}/{trace}: {json.dumps(row)}", flush=True)
    return out


def forced_group_moves(w, old, s, limit) -> np.ndarray:
    """``int[L]``: the fewest expert groups that must change node from the placement ``old``
    (hierarchical shape ``s``) so that no node carries more than its ranks may at ``limit``
    ``float[L]`` (the heaviest rank allowed): a node's load is its groups' whatever the
    copies, so every answer within the limit moves at least that many groups, each all its
    experts' copies (at least one per expert). Every assignment of groups to nodes (``G / N``
    per node) is looked at."""
    n, g, r = s["nodes"], s["groups"], s["ranks"]
    num_layers, num_logical = w.shape
    gsize = num_logical // g
    p3 = np.asarray(old.phy2log).reshape(num_layers, n, -1)
    # the node holding each group's copies (one per group in a hierarchical placement)
    old_node = np.zeros((num_layers, g), dtype=np.int64)
    for k in range(n):
        has = np.zeros((num_layers, g + 1), dtype=bool)
        has[np.arange(num_layers)[:, None], np.where(p3[:, k] >= 0, p3[:, k] // gsize, g)] = True
        old_node[has[:, :g]] = k
    per = g // n
    assign = np.array(
        sorted({tuple(np.repeat(np.arange(n), per)[list(q)]) for q in itertools.permutations(range(g))}),
        dtype=np.int64,
    )  # [A, G]: node of each group
    gl = w.reshape(num_layers, g, gsize).sum(-1)
    node_load = np.stack([(gl[:, None, :] * (assign[None] == k)).sum(-1) for k in range(n)], -1)  # [L, A, N]
    fits = node_load.max(-1) <= (limit * (r // n) * (1 + 1e-9))[:, None]
    changed = (assign[None] != old_node[:, None, :]).sum(-1)
    return np.where(fits, changed, g).min(1)


def group_move_floor(trace, start, s, limits) -> np.ndarray:
    """``int[L]``: per layer, the fewest copies any hierarchical answer (``G / N`` groups per
    node, each group on one node) moves over the steps ``trace[1:]`` (``float[T + 1, L, E]``)
    from ``start`` (the placement of step 0) with every node under what its ranks carry at
    ``limits[t - 1]`` ``float[L]`` (the heaviest rank allowed at step ``t``): a group that
    changes node moves all its experts' copies, at least ``max(1, ceil(load / limit))`` each,
    and the copies moved inside nodes are not counted (so it is a floor). Dynamic program over
    every assignment of groups to nodes, per layer: the cheapest sequence of assignments, each
    within the step's limit."""
    n, g, r = s["nodes"], s["groups"], s["ranks"]
    num_layers, num_logical = trace.shape[1:]
    gsize = num_logical // g
    per = g // n
    assign = np.array(
        sorted({tuple(np.repeat(np.arange(n), per)[list(q)]) for q in itertools.permutations(range(g))}),
        dtype=np.int64,
    )  # [A, G]: node of each group
    index = {tuple(a): i for i, a in enumerate(assign)}
    p3 = np.asarray(start.phy2log).reshape(num_layers, n, -1)
    out = np.zeros(num_layers, dtype=np.int64)
    for layer in range(num_layers):
        a0 = np.zeros(g, dtype=np.int64)
        for k in range(n):
            a0[np.unique(p3[layer, k][p3[layer, k] >= 0] // gsize)] = k
        cost = np.full(len(assign), np.inf)
        cost[index[tuple(a0)]] = 0.0
        for t in range(1, len(trace)):
            w, lim = trace[t][layer], float(limits[t - 1][layer])
            least = np.maximum(1, np.ceil(w / lim - 1e-12)).reshape(g, gsize).sum(1)  # [G]
            gl = w.reshape(g, gsize).sum(1)
            node_load = np.stack([(gl * (assign == k)).sum(1) for k in range(n)], 1)  # [A, N]
            fits = node_load.max(1) <= lim * (r // n) * (1 + 1e-9)
            rows = np.flatnonzero(np.isfinite(cost))
            trans = (assign[rows, None, :] != assign[None, :, :]) @ least.astype(np.float64)  # [rows, A]
            cost = np.where(fits, (cost[rows, None] + trans).min(0), np.inf)
        out[layer] = int(cost.min())
    return out


def migration(layers: int, steps: int, seed: int) -> dict:
    s = SHAPES["deepseek_v3"]
    cfg = dict(num_physical=s["physical"], num_ranks=s["ranks"], num_nodes=s["nodes"], num_groups=s["groups"])
    tr = zipf_trace(layers, s["logical"], steps + 1, seed=seed, alpha=1.2, drift=0.1)
    start = eplb.rebalance(tr[0], **cfg, migration_aware=False)
    cur = {"reference": eplb.reference(tr[0], **cfg), "oblivious": start, "aware": start, "step_scope": start}
    rows = []
    limits = []
    for t in range(1, steps + 1):
        w = tr[t]
        new = {
            "reference": eplb.reference(w, **cfg),
            "oblivious": eplb.rebalance(w, cur["oblivious"], **cfg, migration_aware=False),
        }
        new["aware"], ms = _timed(
            lambda: eplb.rebalance(w, cur["aware"], **cfg, tolerance=0.01, relative_to="oblivious"), 1
        )
        aware_cpu = CPU_SECS[0]
        new["step_scope"], _ = _timed(
            lambda: eplb.rebalance(
                w, cur["step_scope"], **cfg, tolerance=0.01, relative_to="oblivious", tolerance_scope="step"
            ),
            1,
        )
        step_cpu = CPU_SECS[0]
        obl_here = eplb.rebalance(w, **cfg, migration_aware=False)
        b_obl = eplb.balance(w, obl_here, s["ranks"])
        row = {n: {"moved": eplb.copies_moved(cur[n], new[n], s["ranks"])} for n in new}
        for n in new:
            row[n]["balance"] = float(eplb.balance(w, new[n], s["ranks"]).mean())
        row["aware_over_oblivious_max"] = float((eplb.balance(w, new["aware"], s["ranks"]) / b_obl).max())
        b_step = eplb.balance(w, new["step_scope"], s["ranks"])
        row["step_scope_over_oblivious_mean"] = float(b_step.mean() / b_obl.mean())
        row["step_scope_over_oblivious_max"] = float((b_step / b_obl).max())
        row["step_scope_cpu_ms"] = 1e3 * step_cpu
        limit = eplb.rank_loads(w, obl_here, s["ranks"]).max(1) * 1.01
        limits.append(limit)
        forced = forced_group_moves(w, cur["aware"], s, limit)
        row["aware_groups_forced"] = int(forced.sum())
        row["aware_forced_copies"] = int(forced.sum()) * (s["logical"] // s["groups"])
        row["aware_ms"] = 1e3 * ms
        row["aware_cpu_ms"] = 1e3 * aware_cpu
        rows.append(row)
        cur = new
    tot = {n: sum(r[n]["moved"] for r in rows) for n in ("reference", "oblivious", "aware", "step_scope")}
    floor = int(group_move_floor(tr, start, s, limits).sum())
    return {
        "group_move_floor": floor,
        "group_move_floor_over_reference_moves": floor / max(1, tot["reference"]),
        "steps": rows,
        "moved_total": tot,
        "aware_over_reference_moves": tot["aware"] / max(1, tot["reference"]),
        "aware_over_oblivious_balance_max": max(r["aware_over_oblivious_max"] for r in rows),
        "aware_ms_median": float(np.median([r["aware_ms"] for r in rows])),
        "aware_forced_over_reference_moves": sum(r["aware_forced_copies"] for r in rows) / max(1, tot["reference"]),
        "aware_cpu_ms_median": float(np.median([r["aware_cpu_ms"] for r in rows])),
        "step_scope_over_reference_moves": tot["step_scope"] / max(1, tot["reference"]),
        "step_scope_over_oblivious_mean_max": max(r["step_scope_over_oblivious_mean"] for r in rows),
        "step_scope_over_oblivious_balance_max": max(r["step_scope_over_oblivious_max"] for r in rows),
        "step_scope_cpu_ms_median": float(np.median([r["step_scope_cpu_ms"] for r in rows])),
    }


def _package(src: str):
    """``moeshard.eplb`` imported from the source tree ``src`` (modules of another tree dropped)."""
    for m in [m for m in sys.modules if m == "moeshard" or m.startswith("moeshard.")]:
        del sys.modules[m]
    sys.path.insert(0, src)
    try:
        import moeshard.eplb as mod
    finally:
        sys.path.remove(src)
    assert Path(mod.__file__).resolve().is_relative_to(Path(src).resolve()), mod.__file__
    return mod


def compare(other_src: str, layers: int, seed: int, repeat: int = 5) -> dict:
    """Per shape and trace (and one migration-aware step of DeepSeek-V3's drifting trace), the
    time of one ``rebalance`` call with this tree's package and with ``other_src``'s (the step:
    per layer and ``tolerance_scope="step"``),
    alternated (``repeat`` times each, each after an untimed call of the same case: a package
    is imported again per repeat, and its numba kernels load on first use); medians of wall
    clock and of process CPU time."""
    this_src = str(Path(eplb.__file__).resolve().parents[2])
    cases = {}
    for name, s in SHAPES.items():
        cfg = dict(num_physical=s["physical"], num_ranks=s["ranks"], num_nodes=s["nodes"], num_groups=s["groups"])
        for trace in ("zipf", "bursty"):
            w = (
                zipf_trace(layers, s["logical"], 1, seed=seed, alpha=1.2)[0]
                if trace == "zipf"
                else bursty_trace(layers, s["logical"], seed)
            )
            cases[f"{name}/{trace}"] = (w, cfg, None)
    s = SHAPES["deepseek_v3"]
    cfg = dict(num_physical=s["physical"], num_ranks=s["ranks"], num_nodes=s["nodes"], num_groups=s["groups"])
    tr = zipf_trace(layers, s["logical"], 2, seed=seed, alpha=1.2, drift=0.1)
    cases["deepseek_v3/aware_step"] = (tr[1], cfg, tr[0])
    cases["deepseek_v3/aware_step_scope"] = (tr[1], cfg, tr[0])
    trees = {"this": this_src, "other": other_src}
    wall = {k: {t: [] for t in trees} for k in cases}
    cpu = {k: {t: [] for t in trees} for k in cases}
    for r in range(repeat):
        for tree in ("this", "other") if r % 2 == 0 else ("other", "this"):
            mod = _package(trees[tree])
            for k, (w, cfg, prev) in cases.items():
                cur = None if prev is None else mod.rebalance(prev, **cfg, migration_aware=False)
                kw = dict(migration_aware=False) if prev is None else dict(tolerance=0.01, relative_to="oblivious")
                if k.endswith("_scope"):
                    kw["tolerance_scope"] = "step"
                # untimed first: the package was just imported, and its compiled kernels (numba)
                # load on their first call, once per process in real use
                mod.rebalance(w, cur, **cfg, **kw)
                t0, c0 = time.perf_counter(), time.process_time()
                mod.rebalance(w, cur, **cfg, **kw)
                wall[k][tree].append(time.perf_counter() - t0)
                cpu[k][tree].append(time.process_time() - c0)
    _package(this_src)
    out = {"other_src": other_src, "repeat": repeat}
    for k in cases:
        row = {f"{tree}_ms": 1e3 * float(np.median(wall[k][tree])) for tree in trees}
        row.update({f"{tree}_cpu_ms": 1e3 * float(np.median(cpu[k][tree])) for tree in trees})
        row["other_over_this"] = row["other_ms"] / row["this_ms"]
        row["other_over_this_cpu"] = row["other_cpu_ms"] / row["this_cpu_ms"]
        out[k] = row
        print(f"compare {k}: {json.dumps(row)}", flush=True)
    return out


# Sections by name for --only (the module docstring's 1-5).
SECTIONS = ("flashlb", "small", "shapes", "migration", "compare")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=200)
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--flashlb-layers", type=int, default=8, help="layers per trace FlashLB runs on (slow)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_out/bench_eplb_optimum.json")
    ap.add_argument("--only-shapes", nargs="+", choices=sorted(SHAPES), help="run only these model shapes' rows")
    ap.add_argument("--compare", metavar="SRC", help="also time rebalance against this source tree's package")
    ap.add_argument("--compare-only", action="store_true", help="with --compare: only that section")
    ap.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        help="run only these sections (compare needs --compare; without --only, --only-shapes runs only shapes)",
    )
    args = ap.parse_args(argv)
    if args.compare_only:
        if not args.compare:
            ap.error("--compare-only needs --compare")
        only = {"compare"}
    elif args.only:
        only = set(args.only)
    elif args.only_shapes:
        only = {"shapes"}
    else:
        only = set(SECTIONS) - (set() if args.compare else {"compare"})
    if "compare" in only and not args.compare:
        ap.error("--only compare needs --compare")
    res = {}
    if "flashlb" in only:
        res["flashlb_example"] = flashlb_example()
        print("FlashLB example:", json.dumps(res["flashlb_example"]), flush=True)
    if "small" in only:
        res["small_instances"] = small_instances(args.instances, args.seed)
        print("small instances:", json.dumps(res["small_instances"]), flush=True)
    if "shapes" in only:
        res["shapes"] = shapes(args.layers, args.flashlb_layers, args.seed, args.only_shapes)
    if "migration" in only:
        res["migration"] = migration(args.layers, args.steps, args.seed)
        print("migration:", json.dumps({k: v for k, v in res["migration"].items() if k != "steps"}), flush=True)
    if "compare" in only:
        res["compare"] = compare(args.compare, args.layers, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
