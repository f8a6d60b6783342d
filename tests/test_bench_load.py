"""bench_load's fresh-memory pieces, in one process: the parallel read floor reads every byte of
every file exactly once and into the right place; the check against the checkpoint passes on a
model transformers loaded from the bench's checkpoint and reports a perturbed parameter; the
profile's attribution sums to each step's seconds; the report aggregates and prints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks/ (a checkout, not an installed package)

from benchmarks.load_fresh import check_against_checkpoint, file_shares, read_floor_parallel  # noqa: E402
from benchmarks.load_fresh_report import aggregate_fresh, format_fresh  # noqa: E402
from benchmarks.load_profile import CallProfiler, attribute  # noqa: E402


@pytest.mark.parametrize("world", [1, 3, 4, 8])
def test_read_floor_reads_every_byte_once(tmp_path, world):
    rng = torch.Generator().manual_seed(world)
    sizes = {"a.safetensors": 3 * 4096 + 17, "b.safetensors": 100, "c.safetensors": 1 << 16}
    data = {}
    for name, n in sizes.items():
        data[name] = torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).numpy().tobytes()
        (tmp_path / name).write_bytes(data[name])
    got = {name: bytearray(n) for name, n in sizes.items()}
    seen = {name: 0 for name in sizes}
    for rank in range(world):
        shares = file_shares(sizes, rank, world)
        for (name, off, length), buf in zip(shares, read_floor_parallel(str(tmp_path), shares)):
            assert off % 4096 == 0 and buf.numel() == length
            got[name][off : off + length] = buf.numpy().tobytes()
            seen[name] += length
    assert seen == sizes
    assert {k: bytes(v) for k, v in got.items()} == data


def test_read_floor_short_file_is_loud(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"abc")
    with pytest.raises(OSError, match="x.safetensors: read 3 of 10 bytes"):
        read_floor_parallel(str(tmp_path), [("x.safetensors", 0, 10)])


@pytest.mark.hf
def test_check_against_checkpoint_on_a_transformers_model(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from benchmarks.bench_load import ensure_checkpoint, model_dims

    dims = model_dims(1, num_layers=2, num_experts=4)
    built, _ = ensure_checkpoint(tmp_path / "ckpt", dims)
    assert built and (tmp_path / "ckpt" / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    ok = check_against_checkpoint(model, str(tmp_path / "ckpt"))
    assert ok.ok and ok.num_params == len(list(model.parameters()))
    assert ok.num_elements == sum(p.numel() for p in model.parameters())
    bad = check_against_checkpoint(model, str(tmp_path / "ckpt"), perturb="model.layers.1.mlp.experts.down_proj")
    assert bad.num_bad == 1 and bad.mismatches[0].startswith("model.layers.1.mlp.experts.down_proj: 1 of ")
    with torch.no_grad():  # an expert swapped in the loaded model: the fused layout is checked per expert
        w = model.model.layers[0].mlp.experts.gate_up_proj
        w[[0, 1]] = w[[1, 0]].clone()
    swapped = check_against_checkpoint(model, str(tmp_path / "ckpt"))
    assert [m.split(":")[0] for m in swapped.mismatches] == ["model.layers.0.mlp.experts.gate_up_proj"]


def test_attribute_splits_each_step():
    steps = [("plan", 0.0, 1.0), ("execute", 1.0, 3.0)]
    events = [("collective", 0.2, 0.5), ("reads", 1.0, 1.5), ("p2p", 2.0, 2.25), ("collective", 2.9, 3.0)]
    out = attribute(events, steps)
    assert out["plan"]["collective"] == pytest.approx(0.3) and out["plan"]["other"] == pytest.approx(0.7)
    ex = out["execute"]
    assert (ex["reads"], ex["p2p"], ex["collective"]) == pytest.approx((0.5, 0.25, 0.1))
    assert sum(ex.values()) == pytest.approx(2.0)


def test_profile_counts_the_runners_extent_reads_as_reads(tmp_path):
    """A rank's reads straight into place go by coalesced extents (moeshard.io.extents): the
    profiler times them as ``reads`` (each extent's read slowed here, so that they dominate)."""
    import time
    from unittest import mock

    import numpy as np

    import moeshard
    import tiny_moe
    from moeshard.execute import ReaderSource, TensorSink, execute_schedule
    from moeshard.io.extents import ExtentReads
    from moeshard.models.describe import local_tensor
    from moeshard.ops.load import plan_load
    from moeshard.topology import Topology

    tiny_moe.write(tmp_path)
    model = tiny_moe.TinyMoE()
    index = moeshard.CheckpointIndex.open(tmp_path)
    topo = Topology(1, 1).with_rank(0)
    descs, _, plan = plan_load(model, index, None, topo, np.ones(1, dtype=bool), "job", rank=0)
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    dests = [local_tensor(tensors[d.name], d) for d in descs]
    real, slow = ExtentReads.read, 0.01
    calls = []

    def read(self, i):
        calls.append(i)
        time.sleep(slow)
        return real(self, i)

    with moeshard.CheckpointReader(index) as reader, mock.patch.object(ExtentReads, "read", read):
        with CallProfiler() as prof, torch.no_grad():
            t0 = time.perf_counter()
            execute_schedule(
                plan, 0, ReaderSource(plan, reader, index), TensorSink(plan, dests, 0), torch.device("cpu")
            )
            t1 = time.perf_counter()
    assert calls and ExtentReads.read is real  # the profiler (and the mock) put back what they wrapped
    row = attribute(prof.events, [("execute", t0, t1)])["execute"]
    assert row["reads"] >= slow * len(calls)
    assert row["other"] < row["reads"]


def _row(wall, **kw):
    return {
        "error": "",
        "cold": False,
        "wall_seconds": wall,
        "rss_before": 0,
        "rss_growth": 10,
        "rss_final_growth": 5,
        "rss_growth_sampled": 10,
        **kw,
    }


def test_fresh_report_ratios_and_failed_check():
    check = {"num_params": 3, "num_elements": 12, "num_bad": 0, "mismatches": []}
    steps = {
        "build": 0.1,
        "parallelize": 0.1,
        "materialize": 0.1,
        "headers": 0.1,
        "plan": 0.1,
        "execute": 0.4,
        "finish": 0.1,
        "after_load": 0.0,
    }
    ms = dict(
        steps=steps,
        storage="shared",
        bytes_read=50,
        bytes_sent=0,
        peak_staging_bytes=0,
        plan_cost={},
        check=check,
        local_bytes=24,
    )

    def lay(rank, native_bad=False):
        bad = {**check, "num_bad": 1, "mismatches": ["w: 1 of 4 local elements differ"]} if native_bad else check
        return {
            "fresh": {
                "warm": {
                    "moeshard-fresh": [_row(1.0 + rank, **ms), _row(2.0, **ms), _row(3.0, **ms)],
                    "transformers-native": [_row(4.0, call_seconds=3.0, check=bad, local_bytes=24)] * 3,
                    "parallel-read-floor": [_row(0.5, bytes_read=50)] * 3,
                }
            },
            "profile": {
                "warm": [
                    {
                        "wall_seconds": 1.1,
                        "call_seconds": 1.0,
                        "cpu_seconds": 0.5,
                        "steps": steps,
                        "kinds": {st: {"reads": 0.3 if st == "execute" else 0.0, "collective": 0.05} for st in steps},
                    }
                ]
            },
        }

    agg = aggregate_fresh([lay(0), lay(1, native_bad=True)], file_bytes=100)
    c = agg["caches"]["warm"]
    assert c["strategies"]["moeshard-fresh"]["wall_seconds_runs"] == [2.0, 2.0, 3.0]
    assert c["strategies"]["moeshard-fresh"]["check_ok"] and c["strategies"]["parallel-read-floor"]["check_ok"]
    assert not c["strategies"]["transformers-native"]["check_ok"]
    assert c["ratios"] == pytest.approx(
        {"moeshard_over_floor": 4.0, "native_over_moeshard": 2.0, "native_over_floor": 8.0}
    )
    assert c["profile"]["max_rank"]["execute"] == 0.4
    assert c["profile"]["per_rank"][1]["kinds"]["execute"]["reads"] == 0.3
    text = "\n".join(format_fresh(agg, repeat=3))
    assert "FAIL" in text and "w: 1 of 4 local elements differ" in text and "moeshard / floor 4.00x" in text
    # per rank: wall, call, cpu, the 8 steps, then execute's reads ... and the collectives of all steps
    assert "   0.300   0.000   0.000   0.000   0.050   0.000 |    0.400" in text
