"""``moeshard plan``: the argument parser, the pipeline that builds the report (:func:`run`)
and the command's entry point (:func:`main`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .._gc import paused_gc
from ..cluster.baselines import baseline_costs
from ..cluster.cost import StrategyCost
from ..cluster.estimate import Bandwidth, estimate_time, parse_bandwidth
from ..cluster.experts import MoeLayout, find_experts
from ..cluster.model import make_placement, synthesize_descs
from ..cluster.plans import plan_storage_modes
from ..cluster.rebalance import plan_relocation_summary
from ..cluster.render import format_report
from ..cluster.spec import ClusterSpec
from ..cluster.synthetic import num_params, read_config, synthetic_index
from ..io.fp8 import quantization
from ..io.index import CheckpointIndex
from ..io.placement_files import FORMATS, NAMED_PLACEMENTS, moe_layer_indices, named_placement, read_placement_file
from ..io.quant_report import summarize_checkpoint
from ..io.sources import storage_sources
from ..models.layout import need_table
from ..placement import Placement
from ..plan import DEFAULT_STAGING_BYTES, cut_pieces

__all__ = ["STORAGE_MODES", "run", "main"]

STORAGE_MODES = ("shared", "node", "single")


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump: main turns it into exit 2
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="moeshard plan",
        description=(
            "Plan loading a MoE checkpoint on a cluster (no GPUs, no process group) and print what it costs, "
            "beside three baseline loaders; or, with --rebalance, plan an EPLB relocation."
        ),
    )
    p.add_argument("ckpt", nargs="?", metavar="CKPT", help="checkpoint directory (only headers are read)")
    p.add_argument(
        "--synthetic-from-config",
        metavar="CONFIG_JSON",
        help="plan for the checkpoint a HF config.json describes (DeepSeek-V3, Qwen3-MoE, Mixtral) instead",
    )
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--ep", type=int, required=True, help="expert-parallel size")
    p.add_argument("--efsdp", type=int, help="expert-FSDP size (default: world / ep)")
    p.add_argument("--redundant", type=int, help="redundant expert slots per layer (default 0, or from --placement)")
    p.add_argument("--storage", choices=("shared", "node", "single", "all"), default="all")
    p.add_argument(
        "--placement",
        metavar="FILE",
        help="the current placement: moeshard JSON, phy2log .npy, sglang's --init-expert-location "
        "file (.json/.pt), vLLM's EPLB tensors (.pt); or vllm:linear, vllm:round_robin, sglang:trivial",
    )
    p.add_argument("--placement-format", choices=FORMATS, help="read --placement as this format (default: sniffed)")
    p.add_argument("--bandwidth", metavar="storage=GBps,intra=GBps,inter=GBps")
    p.add_argument("--staging-mib", type=float, default=DEFAULT_STAGING_BYTES / 2**20)
    p.add_argument("--rebalance", metavar="LOADS.npy", help="float[num_moe_layers, num_logical] tokens per expert")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _load_npy(path: str, what: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path}: no such file")
    try:
        return np.load(path, allow_pickle=False)  # untrusted input: never unpickle
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{what} {path}: not a readable .npy array ({e})") from None


def open_checkpoint(args: argparse.Namespace) -> tuple[CheckpointIndex, str, dict | None, MoeLayout]:
    """``(index, source, config or None, layout)`` of CKPT's headers or of the synthetic
    checkpoint ``--synthetic-from-config`` describes."""
    if args.synthetic_from_config:
        if args.ckpt:
            raise ValueError("give either CKPT or --synthetic-from-config, not both")
        cfg = read_config(args.synthetic_from_config)
        index = synthetic_index(cfg, root=f"<synthetic from {args.synthetic_from_config}>")
        return index, f"synthetic from {args.synthetic_from_config}", cfg, find_experts(index)
    if not args.ckpt:
        raise ValueError("give a checkpoint directory (CKPT) or --synthetic-from-config CONFIG_JSON")
    if not os.path.exists(args.ckpt):
        raise ValueError(f"{args.ckpt}: no such checkpoint file or directory")
    index = CheckpointIndex.open(args.ckpt)
    cfg_path = Path(index.root) / "config.json"
    cfg = read_config(cfg_path) if cfg_path.is_file() else None
    layers = cfg.get("num_hidden_layers") if cfg else None
    layout = find_experts(index, layers if isinstance(layers, int) and not isinstance(layers, bool) else None)
    if layout.skipped_keys:
        # Keys the model does not load are not part of any strategy's work.
        skip = set(layout.skipped_keys)
        index = CheckpointIndex(index.root, {k: v for k, v in index.tensors.items() if k not in skip}, index.file_sizes)
    return index, args.ckpt, cfg, layout


def cluster_and_placement(args: argparse.Namespace, layout: MoeLayout) -> tuple[ClusterSpec, Placement]:
    """The cluster and the current placement (``--placement``: a file in any format
    :mod:`moeshard.io.placement_files` reads, or an engine's named placement; else contiguous)."""
    named = args.placement in NAMED_PLACEMENTS and not os.path.exists(args.placement)
    phy2log = None
    if args.placement and not named:
        f = read_placement_file(
            args.placement,
            format=args.placement_format,
            moe_layers=moe_layer_indices([m.module for m in layout.experts]),
        )
        for what, have, want in (
            ("num_logical", f.num_logical, layout.num_logical),
            ("num_ranks", f.num_ranks, args.ep),
        ):
            if have is not None and have != want:
                raise ValueError(
                    f"--placement {args.placement} was written for {what}={have}; the plan has {want} "
                    f"({'experts per layer' if what == 'num_logical' else '--ep'})"
                )
        phy2log = f.phy2log
    if phy2log is not None and args.redundant is None:
        redundant = max(0, phy2log.shape[1] - layout.num_logical)
    else:
        redundant = args.redundant or 0
    cluster = ClusterSpec.build(args.nodes, args.ranks_per_node, args.ep, args.efsdp, redundant)
    cluster.topology()  # validates ranks per node
    if named:
        return cluster, named_placement(
            args.placement,
            num_layers=layout.num_layers,
            num_logical=layout.num_logical,
            num_ranks=cluster.ep,
            num_redundant=redundant,
        )
    return cluster, make_placement(layout, cluster, phy2log)


def _relocation(
    descs,
    placement: Placement,
    loads: np.ndarray,
    cluster: ClusterSpec,
    mode: str,
    staging: int,
    cfg: dict | None,
    bw: Bandwidth | None,
    timings: dict[str, float],
) -> dict:
    """The ``relocation`` section: a rebalance of ``loads`` and its relocation plan."""
    topo = cluster.topology()
    _, readers, _ = storage_sources(mode, np.ones(topo.world_size, dtype=bool), topo)
    num_groups = cfg.get("n_group") if cfg else None
    _, summary = plan_relocation_summary(
        descs, placement, loads, cluster, readers, staging, num_groups if isinstance(num_groups, int) else None
    )
    timings["rebalance"] = summary.rebalance_seconds
    timings["plan relocation"] = summary.plan_seconds
    r = asdict(summary)
    if bw is not None:
        cost = StrategyCost(
            "relocation",
            "moeshard",
            r["cost"]["read_bytes_total"],
            summary.read_bytes_max_node,
            r["cost"]["cross_node_bytes"],
            0,
            0,
            0,
            0,
            0,
            0,
            summary.intra_bytes_max_rank,
            summary.inter_bytes_max_rank,
        )
        r["time_s"], r["bottleneck"] = estimate_time(cost, bw)
    return r


def _strategies(
    descs,
    index: CheckpointIndex,
    placement: Placement,
    cluster: ClusterSpec,
    modes: tuple[str, ...],
    staging: int,
    bw: Bandwidth | None,
    timings: dict[str, float],
) -> tuple[int, list[dict]]:
    """``(num_needs, strategies)``: moeshard's plan per storage mode, then the baselines."""
    topo = cluster.topology()
    t = time.perf_counter()
    needs = need_table(descs, index, placement, topo.world_size)
    timings["needs"] = time.perf_counter() - t
    # Every mode plans from the same pieces; the baselines are costed from the needs, which are
    # then dropped: the plans do not need them (they are as large as the pieces).
    t = time.perf_counter()
    pieces = cut_pieces(needs, index, staging)
    timings["pieces"] = time.perf_counter() - t
    t = time.perf_counter()
    baselines = baseline_costs(needs, descs, index, cluster)
    t_baselines = time.perf_counter() - t
    num_needs = len(needs)
    del needs
    t = time.perf_counter()
    strategies = plan_storage_modes(pieces, index, topo, modes, staging) + baselines
    timings["plan " + "+".join(modes)] = time.perf_counter() - t
    timings["baselines"] = t_baselines
    out = []
    for s in strategies:
        d = asdict(s)
        d["at_minimum"] = s.at_minimum()
        if bw is not None:
            d["time_s"], d["bottleneck"] = estimate_time(s, bw)
        out.append(d)
    return num_needs, out


def run(args: argparse.Namespace) -> dict:
    """Everything ``moeshard plan`` computes, as a JSON-able dict (ValueError for bad input).

    The cyclic garbage collector is paused throughout: planning allocates millions of small
    objects and no reference cycles, and the collector's passes over them cost 15-50% of
    the wall time at DeepSeek-V3's shape (measured at 256 and 1,024 ranks)."""
    with paused_gc():
        return _run(args)


def _run(args: argparse.Namespace) -> dict:
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    index, source, cfg, layout = open_checkpoint(args)
    timings["headers"] = time.perf_counter() - t0

    cluster, placement = cluster_and_placement(args, layout)
    staging = int(args.staging_mib * 2**20)
    if staging < 1:
        raise ValueError(f"--staging-mib must be > 0, got {args.staging_mib}")
    bw = parse_bandwidth(args.bandwidth) if args.bandwidth else None
    loads = _load_npy(args.rebalance, "--rebalance") if args.rebalance else None

    t = time.perf_counter()
    descs = synthesize_descs(layout, index, cluster)
    timings["synthesize"] = time.perf_counter() - t
    quantized, consumed = summarize_checkpoint(index.root, index.tensors) if args.ckpt else (None, frozenset())
    if quantized is not None and quantized.error:
        raise ValueError(f"{args.ckpt}: quantized weights not readable: {quantized.error}")
    plain = {k: v for k, v in index.tensors.items() if k not in consumed} if consumed else index.tensors
    rep: dict = {
        "checkpoint": {
            "source": source,
            "num_tensors": len(index.tensors),
            "total_bytes": index.total_bytes,
            "num_params": num_params(index),
            "num_moe_layers": layout.num_layers,
            "num_logical": layout.num_logical,
            "expert_params": [p.name for p in layout.experts[0].params],
            "num_skipped_keys": len(layout.skipped_keys),
            # FP8 weights with block scales: the plan moves them as stored (FP8 + scales); a
            # bf16 model that load dequantizes them into holds bf16_bytes of them.
            "quantization": dataclasses.asdict(q) if (q := quantization(plain)) is not None else None,
            # MXFP4 / NVFP4 / INT4 / FP8-channel weights: read as stored (packed values + scales,
            # the bytes the strategies count), bf16_bytes once dequantized.
            "quantized": dataclasses.asdict(quantized) if quantized is not None else None,
        },
        "cluster": {
            "num_nodes": cluster.num_nodes,
            "ranks_per_node": cluster.ranks_per_node,
            "world_size": cluster.world_size,
            "ep": cluster.ep,
            "efsdp": cluster.efsdp,
            "num_physical": placement.num_physical,
            "num_redundant": cluster.num_redundant,
            "slots_per_rank": placement.num_physical // cluster.ep,
            "staging_bytes": staging,
        },
        "timings_s": timings,
    }
    modes = STORAGE_MODES if args.storage == "all" else (args.storage,)
    if loads is not None:
        rep["relocation"] = _relocation(descs, placement, loads, cluster, modes[0], staging, cfg, bw, timings)
    else:
        rep["num_needs"], rep["strategies"] = _strategies(descs, index, placement, cluster, modes, staging, bw, timings)
    timings["total"] = time.perf_counter() - t0
    return rep


def main(argv: list[str] | None = None) -> int:
    """``moeshard plan ...``: print the report; 2 with one line on stderr for bad input."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        rep = run(args)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (_UsageError, ValueError, OSError) as e:
        msg = " ".join(str(e).split())  # one line, whatever the message holds
        print(f"moeshard plan: error: {msg}", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    return 0
