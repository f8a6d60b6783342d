"""Aggregation and text of bench_load's fresh-memory rows (``benchmarks/load_fresh.py``) and of
its moeshard profiles (``benchmarks/load_profile.py``). Pure functions of the ranks' rows.

Conventions: a round's wall time is the slowest rank's (barrier to barrier); a strategy's is
the median over its timed rounds; RSS growth is the peak during a round minus the RSS before
it, the largest over ranks and rounds; "RSS kept" is what a round left resident (the loaded
shard and anything the loader keeps). Ratios ``A / B`` are ``wall(A) / wall(B)``.
"""

from __future__ import annotations

import statistics

__all__ = ["STEP_ORDER", "aggregate_fresh", "format_fresh"]

MiB = 2**20
STEP_ORDER = ("build", "parallelize", "materialize", "headers", "plan", "scales", "execute", "finish", "after_load")
KINDS = ("reads", "p2p", "bcast", "deliver", "collective", "other")


def _median_of_max(runs: list[list[dict]], get) -> float:
    return statistics.median(max(get(r) for r in rows) for rows in runs)


def _strategy(name: str, runs: list[list[dict]], file_bytes: int) -> dict:
    """One strategy's rows ``runs[round][rank]``, aggregated."""
    rows_all = [r for rows in runs for r in rows]
    last = runs[-1]
    walls = [max(r["wall_seconds"] for r in rows) for rows in runs]
    error = next((r["error"] for r in rows_all if r["error"]), "")
    s: dict = {
        "wall_seconds": statistics.median(walls),
        "wall_seconds_runs": walls,
        "cpu_seconds_max_rank": _median_of_max(runs, lambda r: r.get("cpu_seconds", 0.0)),
        "error": error,
        "rss_growth_max_rank": max(r["rss_growth"] for r in rows_all),
        "rss_growth_per_rank": [max(runs[k][i]["rss_growth"] for k in range(len(runs))) for i in range(len(last))],
        "rss_final_growth_max_rank": max(r["rss_final_growth"] for r in rows_all),
        # What the round left resident, by kind: anonymous memory (tensors, heap) and mapped files.
        "rss_final_growth_parts_max_rank": {
            k: max(r.get("rss_final_growth_parts", {}).get(k, 0) for r in rows_all) for k in ("anon", "file")
        },
    }
    if name == "parallel-read-floor":
        read = sum(r.get("bytes_read", 0) for r in last)
        s["bytes_read_total"] = read
        s["check_ok"] = not error and read == file_bytes
        s["check"] = f"read {read} of the files' {file_bytes} bytes"
        return s
    checks = [r.get("check") for r in rows_all]
    s["check_ok"] = not error and all(c is not None and c["num_bad"] == 0 and c["num_params"] > 0 for c in checks)
    bad = next((c["mismatches"] for c in checks if c is not None and c["num_bad"]), ())
    if s["check_ok"]:
        s["check"] = (
            f"every round: {max(r['check']['num_params'] for r in last)} parameters, "
            f"{sum(r['check']['num_elements'] for r in last)} local elements over the ranks, "
            "equal to the checkpoint"
        )
    else:
        s["check"] = "; ".join(bad) if bad else (error or "no check")
    s["check_seconds_max"] = max((r.get("check_seconds", 0.0) for r in rows_all), default=0.0)
    s["local_bytes_max_rank"] = max((r.get("local_bytes", 0) for r in last), default=0)
    if name == "moeshard-fresh" and not error:
        s["storage"] = last[0]["storage"]
        s["bytes_read_total"] = sum(r["bytes_read"] for r in last)
        s["bytes_sent_total"] = sum(r["bytes_sent"] for r in last)
        s["peak_staging_bytes_max_rank"] = max(r["peak_staging_bytes"] for r in last)
        s["steps_max_rank"] = {
            st: _median_of_max(runs, lambda r, st=st: r["steps"].get(st, 0.0))
            for st in STEP_ORDER
            if st in last[0]["steps"]
        }
        s["plan_cost"] = last[0]["plan_cost"]
    if name == "transformers-native" and not error:
        s["call_seconds_max_rank"] = _median_of_max(runs, lambda r: r["call_seconds"])
    return s


def _profile(lays: list[dict], cache: str) -> dict:
    """Per rank: the median over profile rounds of each step's seconds and of each
    ``(step, kind)``'s seconds; and the slowest rank's per step (``max_rank``)."""
    per_rank = []
    for lay in lays:
        rounds = lay["profile"].get(cache, [])
        if not rounds:
            return {}
        steps = {
            st: statistics.median(p["steps"].get(st, 0.0) for p in rounds)
            for st in STEP_ORDER
            if st in rounds[0]["steps"]
        }
        kinds = {st: {k: statistics.median(p["kinds"][st].get(k, 0.0) for p in rounds) for k in KINDS} for st in steps}
        per_rank.append(
            {
                "wall_seconds": statistics.median(p["wall_seconds"] for p in rounds),
                "call_seconds": statistics.median(p["call_seconds"] for p in rounds),
                "cpu_seconds": statistics.median(p.get("cpu_seconds", 0.0) for p in rounds),
                "steps": steps,
                "kinds": kinds,
            }
        )
    return {
        "rounds": len(lays[0]["profile"][cache]),
        "per_rank": per_rank,
        "max_rank": {st: max(r["steps"][st] for r in per_rank) for st in per_rank[0]["steps"]},
    }


def aggregate_fresh(lays: list[dict], file_bytes: int) -> dict:
    """Collect one layout's fresh-memory rows from every rank (``lays[rank]``): per cache
    mode, each strategy's aggregate, the ratios and the profile."""
    lay0 = lays[0]
    out: dict = {"caches": {}}
    if "fresh_negative_control" in lay0:
        out["negative_control_check_rejected_perturbed_param"] = all(
            lay["fresh_negative_control"]["rejected_perturbed_param"] for lay in lays
        )
        out["negative_control_found"] = lay0["fresh_negative_control"]["found"]
    for cache, by_name in lay0["fresh"].items():
        st = {
            name: _strategy(
                name, [[lay["fresh"][cache][name][k] for lay in lays] for k in range(len(rows0))], file_bytes
            )
            for name, rows0 in by_name.items()
            if rows0
        }

        def wall(name, st=st):
            s = st.get(name)
            return s["wall_seconds"] if s and not s["error"] else None

        def ratio(a, b):
            return a / b if (a is not None and b) else None

        m, n, f = wall("moeshard-fresh"), wall("transformers-native"), wall("parallel-read-floor")
        out["caches"][cache] = {
            "strategies": st,
            "ratios": {
                "moeshard_over_floor": ratio(m, f),
                "native_over_moeshard": ratio(n, m),
                "native_over_floor": ratio(n, f),
            },
            "profile": _profile(lays, cache),
        }
    return out


def _mib(x) -> str:
    return "-" if x is None else f"{x / MiB:,.1f}"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def format_fresh(fresh: dict, repeat: int, legend: bool = True) -> list[str]:
    """The fresh-memory table, ratios, moeshard's steps and the per-rank profile of one layout
    (``legend``: with the lines saying what the columns mean)."""
    lines = []
    if "negative_control_check_rejected_perturbed_param" in fresh:
        lines.append(
            "   negative control: the check reports a perturbed expert parameter (and nothing else): "
            f"{fresh['negative_control_check_rejected_perturbed_param']}"
        )
    if legend:
        lines.append(
            "   cpu = the rank's process CPU seconds in the call (all threads; slowest rank, median): "
            "wall far above it is waiting for peers, storage or a core"
        )
        lines.append(
            "   RSS+ = peak RSS during the call minus RSS before it; kept = RSS after it minus before (of "
            "it mapped = file pages mapped, e.g. an mmap-ed checkpoint); shard = the rank's local parameter "
            "bytes; all max over ranks and rounds"
        )
    for cache, c in fresh["caches"].items():
        lines.append(
            f"   fresh memory, page cache {cache}"
            + (" (dropped before every call)" if cache == "cold" else "")
            + f": median of {repeat}, wall = barrier to barrier, slowest rank"
        )
        hdr = (
            f"   {'strategy':<22}{'wall s':>8}{'min s':>8}{'max s':>8}{'cpu s':>7}{'read MiB':>10}{'RSS+ MiB':>10}"
            f"{'kept MiB':>10}{'mapped':>8}{'shard MiB':>10}  check"
        )
        lines.append(hdr)
        lines.append("   " + "-" * (len(hdr) - 3))
        for name, s in c["strategies"].items():
            runs = s["wall_seconds_runs"]
            if s["error"]:
                lines.append(f"   {name:<22}{s['wall_seconds']:>8.2f}  ERROR {s['error'][:140]}")
                continue
            lines.append(
                f"   {name:<22}{s['wall_seconds']:>8.2f}{min(runs):>8.2f}{max(runs):>8.2f}"
                f"{s['cpu_seconds_max_rank']:>7.2f}"
                f"{_mib(s.get('bytes_read_total')):>10}{_mib(s['rss_growth_max_rank']):>10}"
                f"{_mib(s['rss_final_growth_max_rank']):>10}"
                f"{_mib(s['rss_final_growth_parts_max_rank'].get('file')):>8}"
                f"{_mib(s.get('local_bytes_max_rank')):>10}"
                f"  {'ok' if s['check_ok'] else 'FAIL'}"
            )
            if not s["check_ok"]:
                lines.append(f"      check: {s['check'][:300]}")
        r = c["ratios"]
        lines.append(
            f"   ratios: moeshard / floor {_x(r['moeshard_over_floor'])}, native / moeshard "
            f"{_x(r['native_over_moeshard'])}, native / floor {_x(r['native_over_floor'])}"
        )
        ms = c["strategies"].get("moeshard-fresh")
        if ms and "steps_max_rank" in ms:
            lines.append(
                "   moeshard-fresh steps (slowest rank, median, s): "
                + ", ".join(f"{k} {v:.3f}" for k, v in ms["steps_max_rank"].items())
                + f"; storage {ms['storage']}"
            )
        prof = c["profile"]
        if prof:
            lines.extend(_format_profile(prof, cache))
    return lines


def _format_profile(prof: dict, cache: str) -> list[str]:
    steps = list(prof["per_rank"][0]["steps"])
    short = {
        "build": "build",
        "parallelize": "par",
        "materialize": "mat",
        "headers": "hdr",
        "plan": "plan",
        "scales": "scale",
        "execute": "exec",
        "finish": "fin",
        "after_load": "after",
    }
    lines = [
        f"   where moeshard's time goes, per rank ({prof['rounds']} instrumented round(s), page cache {cache}, "
        "median, s):",
        "     steps: wall = barrier to barrier; call = from_pretrained; cpu = its process CPU seconds (all "
        "threads); then its steps. "
        "exec = reads + p2p + bcast + deliver + coll + other;",
        "     coll = collectives outside the executor's transfers (agreement, headers, config, barriers), "
        "summed over all steps",
    ]
    hdr = (
        f"     {'rank':>4}{'wall':>7}{'call':>7}{'cpu':>7}"
        + "".join(f"{short.get(s, s):>7}" for s in steps)
        + " |"
        + "".join(f"{k[:7]:>8}" for k in ("reads", "p2p", "bcast", "deliver", "coll", "other"))
        + f" |{'coll all':>9}"
    )
    lines.append(hdr)
    for rank, r in enumerate(prof["per_rank"]):
        ex = r["kinds"].get("execute", {})
        coll_all = sum(r["kinds"][s].get("collective", 0.0) for s in steps)
        lines.append(
            f"     {rank:>4}{r['wall_seconds']:>7.3f}{r['call_seconds']:>7.3f}{r['cpu_seconds']:>7.3f}"
            + "".join(f"{r['steps'][s]:>7.3f}" for s in steps)
            + " |"
            + "".join(f"{ex.get(k, 0.0):>8.3f}" for k in ("reads", "p2p", "bcast", "deliver", "collective", "other"))
            + f" |{coll_all:>9.3f}"
        )
    return lines
