"""The human-readable form of a ``moeshard plan`` report (its JSON form is the dict itself)."""

from __future__ import annotations

__all__ = ["format_report", "format_bytes"]


def format_bytes(n: float) -> str:
    """``1.50 GiB``: binary units, two decimals; whole bytes below 1 KiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    return f"{n:,}"


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s >= 1 else f"{s * 1000:.0f} ms"


def _header(rep: dict) -> list[str]:
    """Checkpoint, cluster and planning-time lines."""
    ck, cl = rep["checkpoint"], rep["cluster"]
    lines = [
        f"checkpoint {ck['source']}: {_count(ck['num_tensors'])} tensors, {format_bytes(ck['total_bytes'])}, "
        f"{ck['num_params'] / 1e9:.1f}B params; {ck['num_moe_layers']} MoE layers x {ck['num_logical']} experts"
        + (
            f" ({ck['num_skipped_keys']} keys of layers beyond num_hidden_layers skipped)"
            if ck["num_skipped_keys"]
            else ""
        ),
        f"cluster: {cl['num_nodes']} nodes x {cl['ranks_per_node']} ranks = {cl['world_size']}, EP {cl['ep']} x "
        f"expert-FSDP {cl['efsdp']}, {cl['num_physical']} slots/layer ({cl['slots_per_rank']} per EP rank), "
        f"staging {format_bytes(cl['staging_bytes'])}/rank",
    ]
    q = ck.get("quantization")
    if q:
        blocks = ", ".join("x".join(map(str, b)) for b in q["blocks"]) or "-"
        lines.append(
            f"FP8: {q['num_scaled']:,} weights with block scales (blocks {blocks}): moved as stored, "
            f"{format_bytes(q['fp8_bytes'])} + {format_bytes(q['scale_bytes'])} of scales; "
            f"{format_bytes(q['bf16_bytes'])} dequantized to bf16 (what load gives a bf16 model)"
            + (f"; {len(q['unscaled']):,} FP8 tensors with no fitting scale" if q["unscaled"] else "")
        )
    qz = ck.get("quantized")
    if qz:
        schemes = sorted(
            {f"{r['scheme']} group {r['group']}" if r["group"] else f"{r['scheme']} per tensor" for r in qz["rows"]}
        )
        lines.append(
            f"quantized ({qz['method']}): {qz['num_weights']:,} weights ({', '.join(schemes)}) read as stored, "
            f"{format_bytes(qz['packed_bytes'])} packed + {format_bytes(qz['scale_bytes'])} of scales; "
            f"{format_bytes(qz['bf16_bytes'])} dequantized to bf16 (what load gives a bf16 model)"
        )
    t = rep["timings_s"]
    lines.append("planning time: " + ", ".join(f"{k} {_secs(v)}" for k, v in t.items()))
    per_mode = [s for s in rep.get("strategies", ()) if s["kind"] == "moeshard"]
    if per_mode:
        lines.append(
            "  each storage mode (plan + lower bounds + link bytes): "
            + ", ".join(f"{s['name'].split()[-1]} {_secs(s['plan_seconds'])}" for s in per_mode)
        )
    return lines


def _relocation(r: dict, efsdp: int) -> list[str]:
    """The rebalance: balance, copies moved, the relocation plan's bytes and ops."""
    c = r["cost"]
    b = format_bytes
    lines = [
        "",
        f"rebalance (EPLB, migration-aware): max/mean rank load {r['balance_before']:.2f} -> {r['balance_after']:.2f}; "
        f"expert copies moved {_count(r['copies_moved'])}, slots changed {_count(r['slots_changed'])}",
        f"  slot boxes written{' (an expert copy is ' + str(efsdp) + ' boxes with expert-FSDP)' if efsdp > 1 else ''}: "
        + ", ".join(f"{k} {_count(v)} ({b(c['bytes'][k])})" for k, v in c["copies"].items()),
        f"  network {b(c['network_bytes'])} (minimum {b(c['min_network_bytes'])}), cross-node "
        f"{b(c['cross_node_bytes'])} (minimum {b(c['min_cross_node_bytes'])}), read {b(c['read_bytes_total'])}",
        f"  max sent/rank {b(c['sent_bytes_max_rank'])}, max recv/rank {b(c['recv_bytes_max_rank'])}, "
        f"P2P ops {_count(c['num_p2p_ops'])}, rounds {c['num_rounds']}, stashes {c['num_stashes']}, "
        f"peak staging/rank {b(c['peak_staging_bytes_max_rank'])}",
    ]
    if "time_s" in r:
        lines.append(f"  estimated time {_secs(r['time_s'])} (bottleneck: {r['bottleneck']})")
    return lines


def _strategies(strategies: list[dict]) -> list[str]:
    """One table row per strategy, then whether moeshard's plans meet their lower bounds."""
    cols = [
        "strategy",
        "read total",
        "read max/node",
        "cross-node",
        "sent max/rank",
        "recv max/rank",
        "P2P ops",
        "collectives",
        "batches",
        "staging/rank",
    ]
    timed = any("time_s" in s for s in strategies)
    if timed:
        cols += ["est. time", "bottleneck"]
    rows = []
    for s in strategies:
        row = [s["name"]] + [
            format_bytes(s[k])
            for k in (
                "read_bytes_total",
                "read_bytes_max_node",
                "cross_node_bytes",
                "sent_bytes_max_rank",
                "recv_bytes_max_rank",
            )
        ]
        row += [_count(s[k]) for k in ("num_p2p_ops", "num_collectives", "num_batches")]
        row.append(format_bytes(s["peak_staging_bytes_max_rank"]))
        if timed:
            row += [_secs(s["time_s"]), s["bottleneck"]]
        rows.append(row)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]

    def fmt(r: list[str]) -> str:
        return "  ".join(
            v.ljust(w) if i == 0 or (timed and i == len(cols) - 1) else v.rjust(w)
            for i, (v, w) in enumerate(zip(r, widths))
        ).rstrip()

    lines = ["", fmt(cols)] + [fmt(r) for r in rows]
    lines.append("")
    for s in strategies:
        if s["kind"] == "moeshard":
            ok = s["at_minimum"]
            lines.append(
                f"{s['name']}: read / network / cross-node bytes at their lower bound: "
                + " / ".join("yes" if ok[k] else "NO" for k in ("read", "network", "cross_node"))
            )
        elif s["note"]:
            lines.append(f"{s['name']}: {s['note']}")
    lines.append(
        "bytes are checkpoint bytes; 'sent' counts a broadcast to k ranks k times at its root"
        + (
            "; times model broadcasts as pipelined rings, ignore latency, storage bandwidth is per node"
            if timed
            else ""
        )
    )
    return lines


def format_report(rep: dict) -> str:
    """The human-readable report of :func:`moeshard.cli.plan.run`."""
    lines = _header(rep)
    if "relocation" in rep:
        lines += _relocation(rep["relocation"], rep["cluster"]["efsdp"])
    else:
        lines += _strategies(rep["strategies"])
    return "\n".join(lines)
