"""Save-planning benchmark: what ONE rank of a ``moeshard.save`` computes before any byte moves, at
DeepSeek-V3's shape (``docs/deepseek_v3_config.json``: 45,395 checkpoint tensors), for a range of
world sizes (8 ranks per node, EP = min(256, W), expert-FSDP = W / EP, as ``bench_plan``'s sweep).

The model's parameter descriptions are synthesized as ``moeshard plan`` builds them (no torch model,
no process group); then ``describe_outputs`` (every checkpoint tensor and every rank's boxes of it)
and ``plan_save`` (writers, files, transfers, batches, the schedule and its fingerprint) are timed.
Then the schedule one rank runs (``SavePlan.schedule_for``; rank 3) is built and timed. Each
world size runs in a process of its own (its peak RSS is its own). With ``--compare SRC_TREE`` the
same runs use another source tree's package too (``SRC_TREE/src`` first on PYTHONPATH, e.g. a
worktree of an older commit), interleaved. ``same`` is a digest of what the plan makes rank 3 do
(every tensor's writer, file and offset; its sends, copies and deliveries with their boxes and
rounds; the job's counters), made alike in both trees: equal digests mean rank 3 runs the same.

    python -m benchmarks.bench_save_plan [--worlds 64,256,1024] [--compare /path/to/old/tree]
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import side_by_side

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "docs" / "deepseek_v3_config.json"
RANK = 3  # the rank whose schedule is built (any rank: every rank plans alike)


def one(world: int) -> dict:
    """Time describe_outputs + plan_save for ``world`` ranks in this process."""
    import dataclasses
    import inspect

    import torch

    from benchmarks.bench_plan import sweep_cluster
    from moeshard.cluster import find_experts, make_placement, read_config, synthesize_descs, synthetic_index
    from moeshard.dtypes import TORCH_NAMES
    from moeshard.models.outputs import describe_outputs
    from moeshard.plan.save import plan_save

    cluster = sweep_cluster(world)
    index = synthetic_index(read_config(CONFIG))
    layout = find_experts(index)
    placement = make_placement(layout, cluster)
    # save describes a torch model: torch dtypes, where moeshard plan's descriptions carry names
    descs = [
        dataclasses.replace(d, dtype=getattr(torch, TORCH_NAMES[d.dtype]))
        for d in synthesize_descs(layout, index, cluster)
    ]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    outs = describe_outputs(descs, placement, world, index)
    t1 = time.perf_counter()
    # What one rank plans (a tree without plan_save(rank=) kept every rank's pieces, and one
    # without schedule_for built the whole job's schedule inside plan_save).
    one_rank = "rank" in inspect.signature(plan_save).parameters
    plan = plan_save(outs, world, 5 << 30, 256 << 20, **({"rank": RANK} if one_rank else {}))
    t2 = time.perf_counter()
    mine = plan.schedule_for(RANK) if hasattr(plan, "schedule_for") else plan.schedule
    t3 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(
        world=world,
        rank=RANK,
        tensors=len(outs),
        describe_s=t1 - t,
        plan_s=t2 - t1,
        schedule_s=t3 - t2,
        total_s=t3 - t,
        rank_sends=int(((mine.sends.src == RANK) | (mine.sends.dst == RANK)).sum()),
        transfers=int(plan.cost.num_p2p_ops),
        batches=int(plan.cost.num_batches),
        files=len(plan.files),
        fingerprint=plan.fingerprint,
        same=rank_digest(plan, mine, RANK),
        peak_rss_mib=peak,
        rss_growth_mib=peak - rss0,
    )


def rank_digest(plan, s, rank: int) -> str:
    """sha256 of what ``plan`` makes ``rank`` do, with ``s`` a schedule holding its rows (piece
    ids spelled out as boxes: they differ between a rank's schedule and the job's)."""
    import hashlib

    m = s.for_rank(rank)
    box = [tuple(s.pieces.key.tolist()), s.pieces.off.tolist(), s.pieces.len.tolist()]

    def piece(p: int):
        return box[0][p], box[1][p], box[2][p]

    h = hashlib.sha256(repr([(t.key, t.writer, t.file, t.offset) for t in plan.tensors]).encode())
    h.update(repr(plan.cost.summary()).encode())
    h.update(
        repr(
            [
                (int(s.sends.round[i]), int(s.sends.src[i]), int(s.sends.dst[i]), piece(int(s.sends.piece[i])))
                for i in m.sends
            ]
        ).encode()
    )
    h.update(repr([piece(int(s.copies.piece[i])) for i in m.copies]).encode())
    h.update(
        repr(sorted((piece(int(s.deliveries.piece[i])), s.deliveries.off[i].tolist()) for i in m.deliveries)).encode()
    )
    return h.hexdigest()[:16]


def main(argv=None) -> None:
    side_by_side.main(
        argv,
        "benchmarks.bench_save_plan",
        __doc__,
        "64,256,1024",
        one,
        f"{'describe s':>11} {'plan s':>8} {'sched s':>8} {'total s':>8} {'peak MiB':>9} {'+MiB':>6}  same",
        lambda r: (
            f"{r['describe_s']:>11.2f} {r['plan_s']:>8.2f} {r['schedule_s']:>8.2f} {r['total_s']:>8.2f} "
            f"{r['peak_rss_mib']:>9.0f} {r['rss_growth_mib']:>6.0f}  {r['same']}"
        ),
    )


if __name__ == "__main__":
    main()
