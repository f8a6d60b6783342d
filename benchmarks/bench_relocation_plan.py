"""Relocation planning at DeepSeek-V3's shape: what ONE rank of ``moeshard.relocate`` computes,
and the whole job's plan (``moeshard plan --rebalance``), for growing world sizes.

The model is ``docs/deepseek_v3_config.json`` as ``moeshard plan --synthetic-from-config``
describes it (58 MoE layers, EP 256 with 256 redundant slots, 8 ranks per node, expert-FSDP =
world / 256), the current placement contiguous, the new one EPLB's migration-aware rebalance of
Zipf(1.5) loads (seed 0), every rank a reader. Each measurement runs in a child process of its
own (its peak RSS is its own):

- ``rank``: ``plan_relocation(..., rank=3)`` and ``RelocationPlan.schedule_for(3)``: rank 3's
  component and its own rows, as ``relocate`` plans;
- ``whole``: ``plan_relocation`` without ``rank``: the whole job's plan (moves, rounds, costs).

Printed per world: seconds of the plan and of the schedule, peak RSS and its growth over the
setup (the synthetic description, built before planning), moves, P2P ops, rounds, and whether
the plan meets both lower bounds. ``--src TREE`` runs the children with another source tree
(``TREE/src`` first on PYTHONPATH, e.g. a worktree of an older commit): a tree without
``rank=`` plans the whole job and builds the whole job's schedule, which is what its
``relocate`` did on every rank. JSON: ``bench_out/bench_relocation_plan.json``.

Run from the repository root::

    python -m benchmarks.bench_relocation_plan                        # 1,024 and 8,192 ranks
    python -m benchmarks.bench_relocation_plan --worlds 256,1024,8192 --repeat 2
    git worktree add /tmp/old HEAD~2 && python -m benchmarks.bench_relocation_plan --src /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RANK = 3


def child(world: int, mode: str) -> dict:
    """In a child process: build the inputs, then time the planning of ``mode``."""
    import inspect
    import resource
    import time
    from types import SimpleNamespace

    import numpy as np

    from moeshard import eplb
    from moeshard._gc import paused_gc
    from moeshard.cli import plan as cli_plan
    from moeshard.cluster.model import synthesize_descs
    from moeshard.dtypes import itemsize
    try:
        from moeshard.models.shards import local_boxes
    except ImportError:  # --src: a tree from before models/layout.py was split
        from moeshard.models import layout
        local_boxes = layout._local_boxes
    # --src: a tree from before these helpers of ``moeshard plan`` had public names
    open_checkpoint = getattr(cli_plan, "open_checkpoint", None) or cli_plan._open_checkpoint
    cluster_and_placement = getattr(cli_plan, "cluster_and_placement", None) or cli_plan._cluster
    from moeshard.plan.relocation import ExpertTensor, plan_relocation

    nodes = world // 8
    args = SimpleNamespace(synthetic_from_config=str(ROOT / "docs/deepseek_v3_config.json"), ckpt=None, layers=None,
                           placement=None, placement_format=None, redundant=256, nodes=nodes, ranks_per_node=8,
                           ep=min(256, world), efsdp=max(1, world // 256))
    with paused_gc():
        index, _, _, layout = open_checkpoint(args)
        cluster, old = cluster_and_placement(args, layout)
        descs = synthesize_descs(layout, index, cluster)
        loads = np.random.default_rng(0).zipf(1.5, (old.num_layers, old.num_logical)).astype(np.float32).clip(max=1e4)
        new = eplb.rebalance(loads, old, num_physical=old.num_physical, num_ranks=cluster.ep,
                             num_nodes=cluster.ep_nodes(), num_groups=8, migration_aware=True)
        tensors = []
        for d in descs:
            if d.expert is not None:
                boxes = local_boxes(d.shape, d.mesh.shape, d.placements)
                holdings = tuple((r, b[0][0], b[0][1], b[1:]) for r, b in zip(d.mesh.reshape(-1).tolist(), boxes))
                tensors.append(ExpertTensor(d.expert.layer, d.name, d.shape[1:], itemsize(d.dtype), holdings))
        topo = cluster.topology().with_rank(RANK)
        del descs, index
        per_rank = mode == "rank" and "rank" in inspect.signature(plan_relocation).parameters
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        kw = dict(rank=RANK) if per_rank else {}
        plan = plan_relocation(tensors, old, new, topo, readers=np.ones(topo.world_size, bool), **kw)
        t1 = time.perf_counter()
        if mode == "rank":  # what relocate runs: its own rows (a tree without them: the job's)
            s = plan.schedule_for(RANK) if per_rank else plan.schedule
            s.for_rank(RANK)
        t2 = time.perf_counter()
    c = plan.cost
    return dict(world=world, mode=mode, per_rank=per_rank, plan_s=t1 - t0, schedule_s=t2 - t1,
                rss_setup_mib=rss0 / 1024, rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                moves=len(plan.moves), p2p_ops=c.num_p2p_ops, rounds=c.num_rounds, stashes=c.num_stashes,
                at_bounds=bool(c.network_bytes == c.min_network_bytes and c.cross_node_bytes == c.min_cross_node_bytes),
                fingerprint=plan.fingerprint)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1024,8192", help="world sizes, multiples of 256 (default 1024,8192)")
    p.add_argument("--repeat", type=int, default=1, help="runs per world and mode (median)")
    p.add_argument("--src", help="another source tree to measure (its src/ first on PYTHONPATH)")
    p.add_argument("--out", default="bench_out", help="directory for bench_relocation_plan.json")
    p.add_argument("--child", nargs=2, metavar=("WORLD", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1])))
        return 0
    src = Path(args.src or ROOT).resolve() / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(ROOT)])}
    rows = []
    print(f"relocation planning at DeepSeek-V3's shape, source tree {src.parent}")
    print(f"{'world':>6} {'mode':>5} {'plan s':>7} {'sched s':>8} {'peak MiB':>9} {'+MiB':>6} {'moves':>8} "
          f"{'P2P ops':>9} {'rounds':>6} {'bounds':>6}")
    for world in [int(w) for w in args.worlds.split(",")]:
        if world % 256 and world > 256 or world % 8:
            raise SystemExit(f"--worlds: {world} is not a multiple of 256 (or of 8 below 256)")
        for mode in ("rank", "whole"):
            runs = []
            for _ in range(args.repeat):
                out = subprocess.run([sys.executable, "-m", "benchmarks.bench_relocation_plan", "--child", str(world),
                                      mode], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = dict(runs[0])
            for k in ("plan_s", "schedule_s", "rss_mib", "rss_setup_mib"):
                r[k] = statistics.median(x[k] for x in runs)
            r["runs"] = runs
            rows.append(r)
            print(f"{world:>6} {mode:>5} {r['plan_s']:>7.2f} {r['schedule_s']:>8.2f} {r['rss_mib']:>9.0f} "
                  f"{r['rss_mib'] - r['rss_setup_mib']:>6.0f} {r['moves']:>8,} {r['p2p_ops']:>9,} {r['rounds']:>6} "
                  f"{'met' if r['at_bounds'] else 'MISSED':>6}" + ("" if r["per_rank"] or mode == "whole" else
                                                                    "  (no rank=: the job's plan and schedule)"))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_relocation_plan.json")
    with open(path, "w") as f:
        json.dump(dict(src=str(src.parent), rank=RANK, rows=rows), f, indent=1)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
