"""Load benchmark: moeshard against the loaders it replaces and the one users compare it with.

Builds (once, cached) a synthetic Qwen3-MoE-shaped Hugging Face checkpoint (bf16, per-expert
keys and ``config.json`` as transformers' ``save_pretrained`` writes them), starts gloo ranks as
simulated nodes (default 8 = 2 nodes x 4 local ranks, ``LOCAL_WORLD_SIZE`` as torchrun sets it),
and in that one process group, for each layout (EPxEFSDP, default EP=8 and EP=4 x efsdp=2):

1. Into one meta-built, ``moeshard.parallelize``-d Qwen3MoeForCausalLM, zeroed before each
   strategy and proven with ``moeshard.verify`` after it:

   * moeshard.load, storage "shared", "node" and "single";
   * the baselines of ``benchmarks/baselines.py``: rank0-broadcast (accelerate / transformers
     #45662), chunk-broadcast-loop (twinkle #200), node-local-p2p (twinkle #207).

2. Into fresh memory every round (``benchmarks/load_fresh.py``), the whole user-facing call
   each, alternated round by round (A B F A B F ...), every parameter compared with the
   checkpoint's bytes after each load:

   * moeshard-fresh: ``moeshard.from_pretrained(path, ep=E, efsdp=F)`` (config, meta build,
     parallelize, load);
   * transformers-native: ``AutoModelForCausalLM.from_pretrained(path,
     distributed_config=DistributedConfig(fsdp_size=W, ep_size=E))``;
   * parallel-read-floor: every rank preadv-s its 1/W of each file into new memory, nothing else.

   ``--cache warm,cold`` runs them with a warm page cache and with the cache dropped before
   every call (root only; otherwise a line says so and it runs warm). ``--profile`` adds
   instrumented moeshard rounds (``benchmarks/load_profile.py``, out of the medians) and prints
   where each rank's time goes.

Per strategy: wall seconds (barrier before and after, slowest rank, median of ``--repeat``
runs), bytes read from storage, bytes sent (total, crossing nodes, max per rank), peak RSS
growth (max over ranks), check. Also: the "read floor" (one process reading the whole checkpoint
once), the planner's lower bounds for the layout, and ratios ("A vs B" = wall(B) / wall(A);
"A / B" = wall(A) / wall(B)). Prints a table; writes JSON.

Run from the repository root::

    python -m benchmarks.bench_load                  # ~1 GiB checkpoint, a few minutes
    python -m benchmarks.bench_load --size-mib 64    # quick run
    python -m benchmarks.bench_load --size-mib 512 --ranks 4 --strategies moeshard-fresh,\\
        transformers-native,parallel-read-floor --repeat 5 --cache warm,cold --profile
    python benchmarks/bench_load.py --help
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.load_fresh import FRESH_STRATEGIES
from benchmarks.load_fresh_report import aggregate_fresh, format_fresh
from benchmarks.load_rss import RssMonitor, malloc_trim
from moeshard.cli.bench.page_cache import cold_cache_problem

MOESHARD_MODES = ("shared", "node", "single")
BASELINE_NAMES = ("rank0-broadcast", "chunk-broadcast-loop", "node-local-p2p")
ALL_STRATEGIES = MOESHARD_MODES + BASELINE_NAMES + FRESH_STRATEGIES
CACHE_MODES = ("warm", "cold")
DEFAULT_LAYOUTS = "8x1,4x2"
NUM_LAYERS, NUM_EXPERTS = 8, 64
WORLD, LOCAL_WORLD = 8, 4
DIMS_FILE = "bench_dims.json"
DIMS_VERSION = 1
MiB = 2**20


# -- model shape and checkpoint -------------------------------------------------------------


def model_dims(size_mib: float, num_layers: int = NUM_LAYERS, num_experts: int = NUM_EXPERTS) -> dict:
    """Qwen3-MoE dims whose bf16 checkpoint is closest to ``size_mib`` (hidden size a
    multiple of 64; moe_intermediate = 5/16 hidden; vocab = 8 x hidden)."""

    def dims(h: int) -> dict:
        head_dim = 128 if h % 128 == 0 and h >= 512 else 64
        heads = h // head_dim
        return dict(
            num_layers=num_layers,
            num_experts=num_experts,
            hidden=h,
            moe_intermediate=max(8, round(5 * h / 16 / 8) * 8),
            vocab=8 * h,
            head_dim=head_dim,
            num_heads=heads,
            num_kv_heads=max(1, heads // 2),
            version=DIMS_VERSION,
        )

    target = size_mib * MiB
    best = min((dims(h) for h in range(64, 8193, 64)), key=lambda d: abs(checkpoint_bytes(d) - target))
    return best


def checkpoint_bytes(d: dict) -> int:
    h, i, e = d["hidden"], d["moe_intermediate"], d["num_experts"]
    q, kv = d["num_heads"] * d["head_dim"], d["num_kv_heads"] * d["head_dim"]
    per_layer = e * 3 * h * i + 2 * q * h + 2 * kv * h + e * h + 2 * h + 2 * d["head_dim"]
    return 2 * (d["num_layers"] * per_layer + 2 * d["vocab"] * h + h)


def hf_config(d: dict):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        intermediate_size=4 * d["hidden"],
        moe_intermediate_size=d["moe_intermediate"],
        num_hidden_layers=d["num_layers"],
        num_attention_heads=d["num_heads"],
        num_key_value_heads=d["num_kv_heads"],
        head_dim=d["head_dim"],
        num_experts=d["num_experts"],
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def meta_model(d: dict, dtype):
    import torch
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(hf_config(d))
    return model.to(dtype)


def checkpoint_tensors(d: dict, seed: int = 0):
    """``(key, tensor)`` pairs of the checkpoint, generated lazily (keys as transformers
    writes a Qwen3-MoE checkpoint: fused experts split per expert)."""
    import torch

    model = meta_model(d, torch.bfloat16)
    g = torch.Generator().manual_seed(seed)

    def rand(shape):
        return torch.randn(shape, generator=g, dtype=torch.bfloat16)

    for name, t in model.state_dict().items():
        prefix, _, attr = name.rpartition(".")
        if prefix.endswith("mlp.experts") and attr == "gate_up_proj":
            num_experts, two_i, h = t.shape  # [E, 2I, H] = cat(gate_proj [I, H], up_proj [I, H])
            for e in range(num_experts):
                yield f"{prefix}.{e}.gate_proj.weight", rand((two_i // 2, h))
                yield f"{prefix}.{e}.up_proj.weight", rand((two_i // 2, h))
        elif prefix.endswith("mlp.experts") and attr == "down_proj":
            num_experts, h, i = t.shape  # [E, H, I]
            for e in range(num_experts):
                yield f"{prefix}.{e}.down_proj.weight", rand((h, i))
        elif prefix.endswith("mlp.experts"):
            raise ValueError(f"unexpected expert parameter {name} in the transformers model")
        else:
            yield name, rand(tuple(t.shape))


def ensure_checkpoint(path: Path, d: dict, rebuild: bool = False) -> tuple[bool, float]:
    """Write the checkpoint (safetensors shards, index, ``config.json``) unless ``path``
    already holds one with these dims. Returns ``(built, seconds)``."""
    from moeshard import write_checkpoint
    from moeshard.io.index import INDEX_NAME

    dims_path = path / DIMS_FILE
    config_path = path / "config.json"
    if not rebuild and (path / INDEX_NAME).is_file() and dims_path.is_file():
        try:
            if json.loads(dims_path.read_text()) == d:
                if not config_path.is_file():  # a checkpoint cached before the fresh-memory loaders
                    hf_config(d).to_json_file(str(config_path))
                return False, 0.0
        except (OSError, json.JSONDecodeError):
            pass
    if path.exists():
        # Only files this benchmark writes; never a whole directory it did not create.
        for p in (
            list(path.glob("model-*.safetensors"))
            + list(path.glob("*.tmp"))
            + [path / INDEX_NAME, dims_path, config_path]
        ):
            if p.is_file():
                p.unlink()
    t0 = time.perf_counter()
    total = checkpoint_bytes(d)
    shard = max(4 * MiB, min(256 * MiB, total // 4))
    write_checkpoint(path, checkpoint_tensors(d), max_shard_bytes=shard, metadata={"generator": "moeshard bench_load"})
    # config.json as save_pretrained writes it: what both from_pretrained loaders read.
    hf_config(d).to_json_file(str(config_path))
    dims_path.write_text(json.dumps(d))
    return True, time.perf_counter() - t0


def read_floor(path: Path) -> dict:
    """Seconds one process takes to read every tensor of the checkpoint once (warm cache:
    one untimed pass first, then the timed pass)."""
    from moeshard import CheckpointIndex, CheckpointReader

    index = CheckpointIndex.open(path)
    keys = sorted(index.tensors, key=lambda k: (index.info(k).file, index.info(k).offset))

    def once() -> float:
        t0 = time.perf_counter()
        with CheckpointReader(index, path) as reader:
            for k in keys:
                reader.read(k)
        return time.perf_counter() - t0

    once()
    seconds = once()
    return {
        "seconds": seconds,
        "bytes": index.total_bytes,
        "num_files": len(index.file_sizes),
        "num_tensors": len(keys),
        "GiB_per_s": index.total_bytes / 2**30 / seconds,
    }


# -- per-rank measurement -------------------------------------------------------------------


def _verify(model, ckpt: str, placement) -> tuple[bool, str]:
    import moeshard

    try:
        moeshard.verify(model, ckpt, placement=placement)
        return True, ""
    except (moeshard.DistributedError, moeshard.VerificationError) as e:
        return False, str(e)[:600]


def _run_strategy(name: str, model, target, placement, ckpt: str, spec: dict) -> dict:
    """One timed load with strategy ``name`` into zeroed local tensors, then verify."""
    import torch.distributed as dist

    import moeshard
    from benchmarks.baselines import BASELINES

    target.zero_()
    gc.collect()
    malloc_trim()
    dist.barrier()
    row: dict = {"error": ""}
    with RssMonitor() as mon:
        dist.barrier()
        t0 = time.perf_counter()
        if name in MOESHARD_MODES:
            try:
                rep = moeshard.load(model, ckpt, placement=placement, storage=name, staging_bytes=spec["staging_bytes"])
                row.update(
                    bytes_read=rep.bytes_read_rank,
                    bytes_sent=rep.bytes_sent_rank,
                    bytes_received=rep.bytes_received_rank,
                    plan_seconds=rep.plan_seconds,
                    load_wall_seconds=rep.wall_seconds,
                    phase_seconds=rep.phase_seconds,
                    phase_cpu_seconds=rep.phase_cpu_seconds,
                    peak_staging_bytes=rep.peak_staging_bytes_rank,
                    plan=rep.plan,
                    checkpoint_bytes=rep.checkpoint_bytes,
                )
            except moeshard.DistributedError as e:  # raised on every rank alike
                row["error"] = str(e)[:600]
        else:
            st = BASELINES[name](target)
            row.update(
                bytes_read=st.bytes_read,
                bytes_sent=st.bytes_sent,
                bytes_sent_cross_node=st.bytes_sent_cross_node,
                bytes_received=st.bytes_received,
                num_collectives=st.num_collectives,
            )
        dist.barrier()
        row["wall_seconds"] = time.perf_counter() - t0
    row.update(
        rss_before=mon.before,
        rss_growth=mon.growth,
        rss_growth_sampled=mon.peak_sampled - mon.before,
        rss_growth_hwm=(mon.peak_hwm - mon.before) if mon.peak_hwm else None,
    )
    t_v = time.perf_counter()
    row["verify_ok"], row["verify_error"] = _verify(model, ckpt, placement)
    row["verify_seconds"] = time.perf_counter() - t_v
    return row


def _lower_bounds(target) -> dict:
    """moeshard.plan.minimal_cost of this layout's needs for each storage mode (pure)."""
    import numpy as np

    from moeshard.plan import minimal_cost
    from moeshard.topology import Topology

    topo = Topology(target.world_size, target.local_world_size)
    everyone = np.ones(target.world_size, dtype=bool)
    only0 = np.arange(target.world_size) == 0
    out = {}
    for mode, readers, scope in (("shared", everyone, "job"), ("node", everyone, "node"), ("single", only0, "job")):
        out[mode] = {k: int(v) for k, v in minimal_cost(target.needs, target.index, topo, readers, scope).items()}
    return out


def rank_main(spec: dict) -> dict:
    """Runs on every rank (collective): every layout; in each, the strategies into the
    pre-built model (round-robin over ``--repeat`` runs), then the fresh-memory ones (per cache
    mode: warm-up rounds, timed rounds, instrumented profile rounds)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its per-rank "Loading weights" bars
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    rank = dist.get_rank()
    out: dict = {"rank": rank, "layouts": []}
    warmed = False
    for li, (ep, efsdp) in enumerate(spec["layouts"]):
        lay: dict = {"ep": ep, "efsdp": efsdp, "strategies": {}, "minimal": {}}
        prebuilt = [n for n in spec["strategies"] if n not in FRESH_STRATEGIES]
        if prebuilt:
            _prebuilt_rounds(spec, prebuilt, ep, efsdp, li, lay)
        fresh = [n for n in spec["strategies"] if n in FRESH_STRATEGIES]
        if fresh:
            _fresh_rounds(spec, fresh, ep, efsdp, lay, warm_up=not warmed)
            warmed = True
        out["layouts"].append(lay)
    return out


def _prebuilt_rounds(spec: dict, names: list[str], ep: int, efsdp: int, li: int, lay: dict) -> None:
    """Collective: the strategies of ``names`` into one pre-built model, zeroed before each."""
    import torch
    import torch.distributed as dist

    import moeshard
    from benchmarks.baselines import Target

    ckpt = spec["ckpt"]
    t_setup = time.perf_counter()
    model = meta_model(spec["dims"], getattr(torch, spec["model_dtype"]))
    mesh = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp)
    placement = moeshard.Placement.contiguous(spec["dims"]["num_layers"], spec["dims"]["num_experts"], ep)
    moeshard.parallelize(model, mesh, placement)
    moeshard.materialize(model)
    target = Target.build(model, ckpt, placement, spec["local_world"])
    lay.update(
        shard_bytes=target.shard_bytes(),
        setup_seconds=time.perf_counter() - t_setup,
        minimal=_lower_bounds(target) if dist.get_rank() == 0 else {},
    )
    if spec["negative_control"] and li == 0:
        # A zeroed model must fail verify, or "verify ok" below proves nothing.
        target.zero_()
        ok, msg = _verify(model, ckpt, placement)
        lay["negative_control"] = {"verify_rejected_zeroed_model": not ok, "message": msg[:200]}
    for _ in range(spec["repeat"]):
        for name in names:  # round-robin over strategies, so drift hits all alike
            lay["strategies"].setdefault(name, []).append(_run_strategy(name, model, target, placement, ckpt, spec))
    del target, model, mesh
    gc.collect()
    malloc_trim()


def _fresh_rounds(spec: dict, names: list[str], ep: int, efsdp: int, lay: dict, warm_up: bool) -> None:
    """Collective: per cache mode, ``spec["warmup"]`` untimed rounds (first layout only:
    imports and first-use caches are no loader's cost), ``spec["repeat"]`` timed rounds
    alternating the strategies of ``names``, then ``spec["profile"]`` instrumented moeshard
    rounds. Rows go to ``lay["fresh"][cache][name]``, profiles to ``lay["profile"][cache]``."""
    import torch.distributed as dist

    from benchmarks.load_fresh import negative_control, profile_moeshard, run_fresh

    rank = dist.get_rank()
    lay["fresh"], lay["profile"] = {}, {}
    if spec["negative_control"]:
        lay["fresh_negative_control"] = negative_control(spec, ep, efsdp)
    for cache in spec["caches"]:
        cold = cache == "cold"
        rows: dict = {n: [] for n in names}
        for _ in range(spec["warmup"] if warm_up else 0):
            for name in names:
                run_fresh(name, spec, ep, efsdp, cold)
        warm_up = False
        for k in range(spec["repeat"]):
            for name in names:  # A B F A B F ...: drift and other load on the host hit all alike
                rows[name].append(run_fresh(name, spec, ep, efsdp, cold))
                if rank == 0:  # progress: rank 0's own wall time (the table takes the slowest rank's)
                    r = rows[name][-1]
                    print(
                        f"[bench_load] EP={ep} x efsdp={efsdp} {cache} round {k + 1}/{spec['repeat']} {name}: "
                        f"{r['wall_seconds']:.2f} s{' ERROR ' + r['error'][:200] if r['error'] else ''}",
                        flush=True,
                    )
        lay["fresh"][cache] = rows
        lay["profile"][cache] = [profile_moeshard(spec, ep, efsdp, cold) for _ in range(spec["profile"])]


# -- aggregation and report -----------------------------------------------------------------


def aggregate(per_rank: list[dict], ckpt_bytes: int, file_bytes: int = 0) -> list[dict]:
    """Per layout and strategy: wall = max over ranks (median over repeats), bytes summed or
    maxed over ranks, RSS growth max over ranks and repeats, verify ok only if every run is;
    the fresh-memory rows by :func:`benchmarks.load_fresh_report.aggregate_fresh`
    (``file_bytes``: the checkpoint files' total size, what the parallel read floor reads)."""
    import statistics

    layouts = []
    for li, lay0 in enumerate(per_rank[0]["layouts"]):
        lays = [r["layouts"][li] for r in per_rank]
        ep, efsdp = lay0["ep"], lay0["efsdp"]
        agg: dict = {
            "layout": f"EP={ep}" if efsdp == 1 else f"EP={ep} x efsdp={efsdp}",
            "ep": ep,
            "efsdp": efsdp,
            "shard_bytes_per_rank": [lay.get("shard_bytes") for lay in lays],
            "shard_bytes_max_rank": max((lay.get("shard_bytes") or 0) for lay in lays)
            if "shard_bytes" in lay0
            else None,
            "setup_seconds_max_rank": max(lay["setup_seconds"] for lay in lays) if "setup_seconds" in lay0 else None,
            "minimal": lay0["minimal"],
            "strategies": {},
        }
        if "fresh" in lay0:
            agg["fresh"] = aggregate_fresh(lays, file_bytes)
        if "negative_control" in lay0:
            agg["negative_control_verify_rejected_zeroed_model"] = all(
                lay["negative_control"]["verify_rejected_zeroed_model"] for lay in lays
            )
        for name in lay0["strategies"]:
            runs = [[lay["strategies"][name][k] for lay in lays] for k in range(len(lay0["strategies"][name]))]
            all_rows = [r for rows in runs for r in rows]
            walls = [max(r["wall_seconds"] for r in rows) for rows in runs]
            rows = runs[-1]  # byte counters are deterministic; the last run's
            r0 = rows[0]
            s: dict = {
                "kind": "moeshard" if name in MOESHARD_MODES else "baseline",
                "wall_seconds": statistics.median(walls),
                "wall_seconds_runs": walls,
                "error": next((r["error"] for r in all_rows if r["error"]), ""),
                "verify_ok": all(r["verify_ok"] for r in all_rows) and not any(r["error"] for r in all_rows),
                "verify_error": next((r["verify_error"] for r in all_rows if r["verify_error"]), ""),
                "verify_seconds_max": max(r["verify_seconds"] for r in all_rows),
                "rss_growth_max_rank": max(r["rss_growth"] for r in all_rows),
                "rss_growth_per_rank": [
                    max(runs[k][i]["rss_growth"] for k in range(len(runs))) for i in range(len(rows))
                ],
                "rss_growth_sampled_max_rank": max(r["rss_growth_sampled"] for r in all_rows),
            }
            if not s["error"]:
                read = [r["bytes_read"] for r in rows]
                sent = [r["bytes_sent"] for r in rows]
                s.update(
                    storage_read_bytes_total=sum(read),
                    storage_read_bytes_max_rank=max(read),
                    storage_read_per_checkpoint=sum(read) / ckpt_bytes,
                    network_bytes_total=sum(sent),
                    network_bytes_max_rank=max(sent),
                    storage_read_bytes_per_rank=read,
                    network_bytes_per_rank=sent,
                )
                if name in MOESHARD_MODES:
                    s["network_bytes_cross_node"] = r0["plan"]["cross_node_bytes"]
                    s["plan_seconds_max_rank"] = statistics.median(max(r["plan_seconds"] for r in rs) for rs in runs)
                    # Per step of the load (materialize, headers, plan, ..., execute): the slowest
                    # rank's seconds, median over the runs; "plan" is describe + plan + agree.
                    s["phase_seconds_max_rank"] = {
                        ph: statistics.median(max(r["phase_seconds"][ph] for r in rs) for rs in runs)
                        for ph in rows[0]["phase_seconds"]
                    }
                    s["planning_share_of_wall"] = s["phase_seconds_max_rank"]["plan"] / s["wall_seconds"]
                    # The calling thread's CPU seconds of the same steps (slowest rank, median).
                    s["phase_cpu_seconds_max_rank"] = {
                        ph: statistics.median(max(r["phase_cpu_seconds"][ph] for r in rs) for rs in runs)
                        for ph in rows[0]["phase_cpu_seconds"]
                    }
                    s["peak_staging_bytes_max_rank"] = max(r["peak_staging_bytes"] for r in rows)
                    s["plan"] = r0["plan"]
                    # Lower bounds: computed once per layout outside the timed loads.
                    s["minimal"] = lay0["minimal"].get(name, {})
                else:
                    s["network_bytes_cross_node"] = sum(r["bytes_sent_cross_node"] for r in rows)
                    s["num_collectives_max_rank"] = max(r["num_collectives"] for r in rows)
            agg["strategies"][name] = s
        agg["ratios"] = ratios(agg["strategies"], ckpt_bytes)
        layouts.append(agg)
    return layouts


def ratios(st: dict, ckpt_bytes: int, floor: float | None = None) -> dict:
    def wall(name):
        s = st.get(name)
        return s["wall_seconds"] if s and not s["error"] else None

    def ratio(a, b):
        return (a / b) if (a is not None and b) else None

    out = {
        "speedup_shared_vs_rank0_broadcast": ratio(wall("rank0-broadcast"), wall("shared")),
        "speedup_shared_vs_chunk_broadcast_loop": ratio(wall("chunk-broadcast-loop"), wall("shared")),
        "speedup_shared_vs_node_local_p2p": ratio(wall("node-local-p2p"), wall("shared")),
        "speedup_node_vs_node_local_p2p": ratio(wall("node-local-p2p"), wall("node")),
        "speedup_single_vs_rank0_broadcast": ratio(wall("rank0-broadcast"), wall("single")),
    }
    if "shared" in st and not st["shared"]["error"]:
        out["shared_storage_read_per_checkpoint"] = st["shared"]["storage_read_bytes_total"] / ckpt_bytes
    return out


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:,.1f}"


def _secs(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def format_report(res: dict) -> str:
    lines = []
    ck, fl = res["checkpoint"], res["read_floor"]
    lines.append(
        f"checkpoint: {ck['path']}  {_mib(ck['bytes'])} MiB in {fl['num_files']} files, {fl['num_tensors']} tensors "
        f"({ck['dims']['num_layers']} layers x {ck['dims']['num_experts']} experts, hidden {ck['dims']['hidden']}, "
        f"moe_intermediate {ck['dims']['moe_intermediate']}, bf16); model dtype {res['config']['model_dtype']}"
    )
    cfg = res["config"]
    lines.append(
        f"ranks: {cfg['world_size']} gloo processes = {cfg['num_nodes']} simulated node(s) x "
        f"{cfg['local_world_size']} on {res['host']['cpus']} CPU cores; "
        f"moeshard staging budget {_mib(cfg['staging_bytes'])} MiB/rank"
    )
    la = res["host"]["loadavg_before"][0]
    if la > 1.5:
        lines.append(f"WARNING: load average was {la:.1f} at the start: other work shared the cores; timings are noisy")
    lines.append(
        f"read floor (1 process, CheckpointReader, every tensor once): {fl['seconds']:.2f} s "
        f"({fl['GiB_per_s']:.2f} GiB/s)"
    )
    lines.append(
        "page cache: warm for the strategies into the pre-built model (nothing dropped; the checkpoint "
        "was just written or read); the fresh-memory rows say theirs"
    )
    if cfg.get("cache_note"):
        lines.append(cfg["cache_note"])
    lines.append(
        f"wall s: barrier to barrier, max over ranks, median of {res['config']['repeat']} run(s); "
        "plan s: the part of moeshard.load before data moves (headers, plan, agreement)"
    )
    lines.append(
        "bytes: checkpoint dtype; a broadcast to k ranks counts k copies for its root; "
        "RSS+ = peak RSS during the strategy minus RSS before it, max over ranks and runs"
    )
    for li, lay in enumerate(res["layouts"]):
        lines.append("")
        mins = lay["minimal"]
        lines.append(
            f"== {lay['layout']}"
            + (
                f"  (shard per rank: max {_mib(lay['shard_bytes_max_rank'])} MiB)"
                if lay["shard_bytes_max_rank"]
                else ""
            )
        )
        if mins:
            lines.append(
                "   lower bounds (moeshard.plan.minimal_cost): "
                + "; ".join(
                    f"{m}: net {_mib(v['network_bytes'])} MiB, cross-node {_mib(v['cross_node_bytes'])} MiB, "
                    f"read {_mib(v['read_bytes'])} MiB"
                    for m, v in mins.items()
                )
            )
        if "negative_control_verify_rejected_zeroed_model" in lay:
            lines.append(
                f"   negative control: verify rejects a zeroed model: "
                f"{lay['negative_control_verify_rejected_zeroed_model']}"
            )
        if "fresh" in lay:
            lines.extend(format_fresh(lay["fresh"], res["config"]["repeat"], legend=li == 0))
        if not lay["strategies"]:
            continue
        lines.append("   into one pre-built model, zeroed before each strategy:")
        hdr = (
            f"   {'strategy':<22}{'wall s':>8}{'plan s':>8}{'read MiB':>11}{'read/rank':>11}{'net MiB':>11}"
            f"{'cross':>10}{'net/rank':>10}{'RSS+ MiB':>10}  verify"
        )
        lines.append(hdr)
        lines.append("   " + "-" * (len(hdr) - 3))
        for name, s in lay["strategies"].items():
            label = f"moeshard:{name}" if s["kind"] == "moeshard" else name
            if s["error"]:
                lines.append(f"   {label:<22}{s['wall_seconds']:>8.2f}  ERROR {s['error'][:120]}")
                continue
            lines.append(
                f"   {label:<22}{s['wall_seconds']:>8.2f}{_secs(s.get('plan_seconds_max_rank')):>8}"
                f"{_mib(s['storage_read_bytes_total']):>11}"
                f"{_mib(s['storage_read_bytes_max_rank']):>11}{_mib(s['network_bytes_total']):>11}"
                f"{_mib(s['network_bytes_cross_node']):>10}{_mib(s['network_bytes_max_rank']):>10}"
                f"{_mib(s['rss_growth_max_rank']):>10}  {'ok' if s['verify_ok'] else 'FAIL'}"
            )
            if not s["verify_ok"]:
                lines.append(f"      verify: {s['verify_error'][:200]}")
            if "phase_seconds_max_rank" in s:
                lines.append(
                    "      steps (slowest rank, s): "
                    + ", ".join(f"{ph} {v:.3f}" for ph, v in s["phase_seconds_max_rank"].items())
                    + f"; planning (describe + plan + agree) {100 * s['planning_share_of_wall']:.0f}% of the wall"
                )
                lines.append(
                    "      CPU of the calling thread (most of any rank, s): "
                    + ", ".join(f"{ph} {v:.3f}" for ph, v in s["phase_cpu_seconds_max_rank"].items())
                )
        r = lay["ratios"]
        lines.append(
            "   ratios: shared vs rank0-broadcast "
            + _x(r["speedup_shared_vs_rank0_broadcast"])
            + ", shared vs chunk-broadcast-loop "
            + _x(r["speedup_shared_vs_chunk_broadcast_loop"])
            + ", shared vs node-local-p2p "
            + _x(r["speedup_shared_vs_node_local_p2p"])
        )
        lines.append(
            "           node vs node-local-p2p "
            + _x(r["speedup_node_vs_node_local_p2p"])
            + ", single vs rank0-broadcast "
            + _x(r["speedup_single_vs_rank0_broadcast"])
            + ", shared / read floor "
            + _x(r.get("shared_over_read_floor"))
            + ", shared storage read / checkpoint "
            + _x(r.get("shared_storage_read_per_checkpoint"))
        )
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------


def parse_layouts(text: str, world: int = WORLD) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        ep, _, efsdp = part.strip().lower().partition("x")
        out.append((int(ep), int(efsdp or 1)))
    for ep, efsdp in out:
        if ep * efsdp != world:
            raise argparse.ArgumentTypeError(f"layout {ep}x{efsdp}: ep x efsdp must be {world} (--ranks)")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_load",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size-mib", type=float, default=1024, help="checkpoint size to aim for (default 1024)")
    p.add_argument(
        "--ckpt",
        default=None,
        help="checkpoint directory (default bench_out/ckpt, or bench_out/ckpt_<size>mib for other sizes)",
    )
    p.add_argument("--rebuild", action="store_true", help="rewrite the checkpoint even if a matching one is cached")
    p.add_argument("--out", default="bench_out/bench_load.json", help="JSON report path")
    p.add_argument("--layouts", default=None, help="comma list of EPxEFSDP (default 8x1,4x2 for 8 ranks, else RANKSx1)")
    p.add_argument(
        "--ranks",
        type=int,
        default=WORLD,
        help=f"local ranks (default {WORLD}; fewer than the host's cores gives each rank its own core)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help=f"ranks per simulated node (default {LOCAL_WORLD}, or all ranks when fewer)",
    )
    p.add_argument(
        "--strategies",
        default=",".join(ALL_STRATEGIES),
        help=f"comma list from {','.join(ALL_STRATEGIES)} (default all, in that order)",
    )
    p.add_argument(
        "--model-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="model parameter dtype (checkpoint is bf16; float32 = fp32 master weights)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="timed runs per strategy (round-robin); the table shows the median (default 3)",
    )
    p.add_argument(
        "--cache",
        default="warm",
        help="page cache for the fresh-memory strategies: warm, cold or warm,cold (cold: dropped "
        "before every call; needs root, else runs warm and says so)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds of the fresh-memory strategies before the timed ones, in the first "
        "layout (imports, first-use caches; default 1)",
    )
    p.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=1,
        default=0,
        metavar="N",
        help="after the timed fresh rounds, N (default 1) instrumented moeshard-fresh rounds per layout "
        "and cache mode: where each rank's time goes (kept out of the medians)",
    )
    p.add_argument("--staging-mib", type=float, default=256, help="moeshard staging budget per rank (default 256)")
    p.add_argument(
        "--no-negative-control", action="store_true", help="skip checking that verify rejects a zeroed model"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds before the ranks are killed (default 900)")
    args = p.parse_args(argv)
    if args.ranks < 1:
        p.error(f"--ranks must be >= 1, got {args.ranks}")
    if args.ranks_per_node is None:
        args.ranks_per_node = min(LOCAL_WORLD, args.ranks)
    if args.ranks_per_node < 1 or args.ranks % args.ranks_per_node:
        p.error(f"--ranks-per-node must divide --ranks ({args.ranks}), got {args.ranks_per_node}")
    if args.layouts is None:
        args.layouts = DEFAULT_LAYOUTS if args.ranks == WORLD else f"{args.ranks}x1"
    try:
        args.layouts = parse_layouts(args.layouts, args.ranks)
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(f"--layouts: {e}")
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in args.strategies if s not in ALL_STRATEGIES]
    if bad:
        p.error(f"unknown strategies {bad}; choose from {list(ALL_STRATEGIES)}")
    args.cache = [c.strip() for c in args.cache.split(",") if c.strip()]
    bad = [c for c in args.cache if c not in CACHE_MODES]
    if bad or not args.cache or len(set(args.cache)) != len(args.cache):
        p.error(f"--cache: a comma list of distinct modes from {list(CACHE_MODES)}, got {args.cache}")
    if args.warmup < 0 or args.profile < 0:
        p.error("--warmup and --profile must be >= 0")
    if args.profile and "moeshard-fresh" not in args.strategies:
        p.error("--profile instruments moeshard-fresh: include it in --strategies")
    return args


def checkpoint_path(ckpt: str | None, size_mib: float) -> Path:
    """The checkpoint directory: ``ckpt`` if given, else the cache for ``size_mib``."""
    if ckpt:
        return Path(ckpt)
    return Path("bench_out") / ("ckpt" if size_mib == 1024 else f"ckpt_{size_mib:g}mib")


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    from benchmarks.bench_load import rank_main  # importable by name in the spawned ranks
    from moeshard._launch import run_local_ranks

    dims = model_dims(args.size_mib)
    ckpt = checkpoint_path(args.ckpt, args.size_mib)
    print(f"[bench_load] checkpoint {ckpt} (~{checkpoint_bytes(dims) / MiB:,.0f} MiB) ...", flush=True)
    built, build_s = ensure_checkpoint(ckpt, dims, args.rebuild)
    print(f"[bench_load] {f'built in {build_s:.1f} s' if built else 'reusing the cached checkpoint'}", flush=True)
    load_before = os.getloadavg()
    if load_before[0] > 1.5:
        print(
            f"[bench_load] WARNING: load average {load_before[0]:.1f} on {os.cpu_count()} cores: other work "
            "is running; timings will be noisy",
            flush=True,
        )
    floor = read_floor(ckpt)
    world, local = args.ranks, args.ranks_per_node
    print(
        f"[bench_load] read floor {floor['seconds']:.2f} s; starting {world} ranks "
        f"({world // local} nodes x {local}) ...",
        flush=True,
    )
    caches, cache_note = list(args.cache), ""
    fresh = [n for n in args.strategies if n in FRESH_STRATEGIES]
    if "cold" in caches and fresh:
        problem = cold_cache_problem()
        if problem:
            cache_note = (
                f"--cache cold: cannot drop the page cache ({problem}): the fresh-memory strategies ran "
                "with a warm cache only"
            )
            caches = [c for c in caches if c != "cold"] or ["warm"]
        else:
            cache_note = (
                "--cache cold: the page cache of the whole host is dropped (sync, then 3 > "
                "/proc/sys/vm/drop_caches, by rank 0 between two barriers) before every cold call"
            )
        print(f"[bench_load] {cache_note}", flush=True)
    file_sizes = {p.name: p.stat().st_size for p in sorted(ckpt.glob("*.safetensors"))}
    spec = {
        "ckpt": str(ckpt.resolve()),
        "dims": dims,
        "layouts": args.layouts,
        "strategies": args.strategies,
        "model_dtype": args.model_dtype,
        "staging_bytes": int(args.staging_mib * MiB),
        "negative_control": not args.no_negative_control,
        "repeat": max(1, args.repeat),
        "local_world": local,
        "caches": caches,
        "warmup": args.warmup,
        "profile": args.profile,
        "file_sizes": file_sizes,
    }
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # the ranks share the cores
    t_ranks = time.perf_counter()
    try:
        per_rank = run_local_ranks(rank_main, spec, world=world, local_world=local, timeout=args.timeout)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ranks_s = time.perf_counter() - t_ranks
    import torch

    layouts = aggregate(per_rank, floor["bytes"], sum(file_sizes.values()))
    for lay in layouts:
        sh = lay["strategies"].get("shared")
        lay["ratios"]["shared_over_read_floor"] = (
            (sh["wall_seconds"] / floor["seconds"]) if sh and not sh["error"] else None
        )
    res = {
        "command": " ".join(
            [
                os.path.basename(sys.executable),
                "-m",
                "benchmarks.bench_load",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "checkpoint": {
            "path": str(ckpt),
            "bytes": floor["bytes"],
            "dims": dims,
            "built": built,
            "build_seconds": build_s,
        },
        "read_floor": {**floor, "page_cache": "warm (same for every strategy; nothing dropped)"},
        "config": {
            "world_size": world,
            "local_world_size": local,
            "num_nodes": world // local,
            "backend": "gloo",
            "model_dtype": args.model_dtype,
            "staging_bytes": spec["staging_bytes"],
            "strategies": args.strategies,
            "layouts": args.layouts,
            "repeat": spec["repeat"],
            "caches": caches,
            "cache_requested": list(args.cache),
            "cache_note": cache_note,
            "warmup": args.warmup,
            "profile_rounds": args.profile,
            "file_bytes": sum(file_sizes.values()),
        },
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "layouts": layouts,
        "ranks_seconds": ranks_s,
        "total_seconds": time.perf_counter() - t_start,
    }
    report = format_report(res)
    print()
    print(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(res, indent=2, default=json_default))
    os.replace(tmp, out)
    print(f"\n[bench_load] wrote {out}; ranks {ranks_s:.0f} s, total {res['total_seconds']:.0f} s", flush=True)
    return res


def json_default(o):
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


if __name__ == "__main__":
    main()
