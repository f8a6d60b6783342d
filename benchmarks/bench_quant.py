"""Quantized load benchmark: a model loaded (dequantized on load) from an MXFP4 checkpoint and
from an INT4 one, each against the same model stored in bf16, on 4 gloo ranks, side by side in
one run (A B A B ...).

* MXFP4: a gpt-oss-shaped checkpoint, routed experts as gpt-oss ships them
  (``experts.gate_up_proj_blocks`` / ``_scales``, E8M0 per 32 values, ``quant_method: mxfp4``);
* INT4: a Qwen3-MoE-shaped checkpoint, routed experts compressed-tensors ``pack-quantized``
  (``weight_packed`` int32, ``weight_scale`` bf16 per 32, ``weight_shape``; Kimi-K2-Thinking's
  layout, per expert).

Each bf16 twin holds exactly the quantized checkpoint's values (its dequantization, cast once to
bf16; every other tensor the same), so the two loads must give equal models: after every load,
each rank compares every local parameter with what the twin's first load gave (parameters zeroed
before every load). One untimed round of every load comes first (first touches, imports). Per
checkpoint: wall (barrier to barrier, the slowest rank; median of ``--repeat``), bytes read by all
ranks, bytes sent. Prints a table and the ratios; writes JSON (``--out``).

    python -m benchmarks.bench_quant --repeat 3           # ~256 MiB bf16 each, a few minutes
    python -m benchmarks.bench_quant --size-mib 64 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_load import MiB

WORLD = 4
FORMATS = ("mxfp4", "int4")
GROUP = 32  # values per scale: MXFP4's, and the INT4 checkpoints' (Kimi-K2-Thinking's)
DIMS_VERSION = 1


def dims(fmt: str, size_mib: float) -> dict:
    """Dims (hidden = moe intermediate, a multiple of 64; 4 layers; vocab 8 x hidden) whose bf16
    checkpoint is about ``size_mib``: gpt-oss (16 experts) for MXFP4, Qwen3-MoE (32) for INT4."""
    experts, layers = (16, 4) if fmt == "mxfp4" else (32, 4)

    def of(h):
        return dict(fmt=fmt, hidden=h, inter=h, experts=experts, layers=layers, vocab=8 * h, version=DIMS_VERSION)

    def nbytes(d):
        h = d["hidden"]
        return 2 * (d["layers"] * (d["experts"] * 3 * h * h + 4 * h * h) + 2 * d["vocab"] * h)

    return min((of(h) for h in range(64, 8193, 64)), key=lambda d: abs(nbytes(d) - size_mib * MiB))


def hf_config(d: dict):
    h = d["hidden"]
    heads = max(1, h // 64)
    if d["fmt"] == "mxfp4":
        from transformers import GptOssConfig

        return GptOssConfig(
            vocab_size=d["vocab"],
            hidden_size=h,
            intermediate_size=d["inter"],
            num_hidden_layers=d["layers"],
            num_local_experts=d["experts"],
            num_experts_per_tok=4,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            head_dim=64,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        )
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=d["vocab"],
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=d["inter"],
        num_hidden_layers=d["layers"],
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        num_experts=d["experts"],
        num_experts_per_tok=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def quantization_config(fmt: str) -> dict:
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    weights = {"group_size": GROUP, "num_bits": 4, "strategy": "group", "symmetric": True, "type": "int"}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"],
    }


def meta_model(d: dict, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(d)).to(dtype)


def _template(d: dict):
    """(checkpoint key, shape, quantized) of the model's float checkpoint: gpt-oss's experts
    fused ``[E, H, 2I]`` / ``[E, I, H]``, Qwen3-MoE's per expert."""
    import torch

    for name, t in meta_model(d, torch.bfloat16).state_dict().items():
        prefix, _, attr = name.rpartition(".")
        expert = prefix.endswith("mlp.experts") and attr in ("gate_up_proj", "down_proj")
        if expert and d["fmt"] == "int4":
            e, rows, cols = t.shape  # gate_up [E, 2I, H], down [E, H, I]
            parts = ("gate_proj", "up_proj") if attr == "gate_up_proj" else ("down_proj",)
            for i in range(e):
                for part in parts:
                    yield f"{prefix}.{i}.{part}.weight", (rows // len(parts), cols), True
        else:
            yield name, tuple(t.shape), expert


def _packed(d: dict, key: str, shape: tuple):
    """The stored tensors of a quantized weight (random codes and scales, seeded by its key)."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    if d["fmt"] == "mxfp4":
        e, c, r = shape  # logical [E, C, R] holds the value-oriented [E, R, C] transposed
        blocks = torch.randint(0, 256, (e, r, c // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 124, (e, r, c // 32), generator=g, dtype=torch.uint8)
        return {key + "_blocks": blocks, key + "_scales": scales}
    r, c = shape
    packed = torch.randint(-(2**31), 2**31 - 1, (r, c // 8), generator=g, dtype=torch.int32)
    scale = (0.002 + 0.01 * torch.rand(r, c // GROUP, generator=g)).to(torch.bfloat16)
    pre = key[: -len("weight")]
    return {pre + "weight_packed": packed, pre + "weight_scale": scale, pre + "weight_shape": torch.tensor([r, c])}


def _tensors(d: dict, packed: dict | None):
    """The checkpoint's ``(key, tensor)`` pairs: quantized weights packed, or (``packed``: the
    quantized checkpoint's recognized weights) decoded and cast once to bf16."""
    import torch

    from moeshard.io.codecs import decode

    for key, shape, quantized in _template(d):
        if not quantized:
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            yield key, (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            continue
        stored = _packed(d, key, shape)
        if packed is None:
            yield from stored.items()
            continue
        pw = packed[key]
        w = decode(pw.scheme, stored[pw.values], stored[pw.scale], None)
        yield key, (w.transpose(-1, -2) if pw.transposed else w).contiguous().to(torch.bfloat16)


def ensure_checkpoints(d: dict, root: Path) -> tuple[Path, Path]:
    """The quantized checkpoint and its bf16 twin under ``root`` (written once per dims)."""
    from moeshard import write_checkpoint

    name = f"{d['fmt']}-{d['hidden']}-{d['layers']}x{d['experts']}"
    quant, twin = root / name, root / f"{name}-bf16"
    stamp = json.dumps(d, sort_keys=True)
    shard = 64 * MiB
    if not ((quant / "dims.json").is_file() and (quant / "dims.json").read_text() == stamp):
        cfg = hf_config(d).to_dict()
        for path, c in ((quant, {**cfg, "quantization_config": quantization_config(d["fmt"])}), (twin, cfg)):
            path.mkdir(parents=True, exist_ok=True)  # config.json first: the index recognizes the format by it
            (path / "config.json").write_text(json.dumps(c))
        packed = write_checkpoint(quant, _tensors(d, None), max_shard_bytes=shard).packed
        assert len(packed) == sum(q for _, _, q in _template(d)), "every quantized weight recognized"
        write_checkpoint(twin, _tensors(d, packed), max_shard_bytes=shard)
        (quant / "dims.json").write_text(stamp)
    return quant, twin


def _local(p):
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def rank_main(spec: dict) -> list[dict]:
    import torch
    import torch.distributed as dist

    import moeshard

    torch.set_num_threads(1)
    rows = []
    models = {}
    for fmt in FORMATS:
        d = spec[fmt]["dims"]
        model = meta_model(d, torch.bfloat16)
        pl = moeshard.Placement.contiguous(d["layers"], d["experts"], WORLD)
        moeshard.parallelize(model, moeshard.make_mesh("cpu", ep=WORLD), pl)
        models[fmt] = (model, pl, {})
    for run in range(-1, spec["repeat"]):  # run -1: an untimed warm-up of every load (first touches, imports)
        for fmt in FORMATS:  # A B A B: bf16 then quantized, per format, every run
            model, pl, want = models[fmt]
            for kind in ("bf16", fmt):
                with torch.no_grad():
                    for p in model.parameters():
                        _local(p).zero_()
                dist.barrier()
                t0 = time.perf_counter()
                rep = moeshard.load(model, spec[fmt][kind], placement=pl)
                dist.barrier()
                wall = time.perf_counter() - t0
                got = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
                if not want:
                    want.update(got)
                same = [n for n in got if not torch.equal(got[n], want[n])]
                if run < 0:
                    if same:
                        raise AssertionError(f"{kind}: the warm-up load differs from the bf16 twin's at {same[:3]}")
                    continue
                rows.append(
                    dict(
                        fmt=fmt,
                        ckpt=kind,
                        run=run,
                        wall=wall,
                        read=rep.bytes_read_rank,
                        sent=rep.bytes_sent_rank,
                        plan=rep.plan_seconds,
                        differs=same[:3],
                    )
                )
    return rows


def summarize(per_rank: list[list[dict]], repeat: int, sizes: dict) -> dict:
    """Per (format, checkpoint): median wall of the slowest rank, bytes read and sent by all
    ranks (each run's; they are the same every run), and the ratios quantized / bf16."""
    out = {}
    for fmt in FORMATS:
        res = {}
        for kind in ("bf16", fmt):
            mine = [[r for r in rows if r["fmt"] == fmt and r["ckpt"] == kind] for rows in per_rank]
            walls = [max(rows[i]["wall"] for rows in mine) for i in range(repeat)]
            res[kind] = dict(
                wall_median=statistics.median(walls),
                walls=walls,
                bytes_read=sum(rows[0]["read"] for rows in mine),
                bytes_sent=sum(rows[0]["sent"] for rows in mine),
                checkpoint_bytes=sizes[fmt][kind],
                equal_to_bf16=all(not r["differs"] for rows in mine for r in rows),
                differs=sorted({n for rows in mine for r in rows for n in r["differs"]}),
            )
        res["wall_ratio"] = res[fmt]["wall_median"] / res["bf16"]["wall_median"]
        res["read_ratio"] = res[fmt]["bytes_read"] / res["bf16"]["bytes_read"]
        out[fmt] = res
    return out


def format_report(out: dict, world: int, repeat: int) -> str:
    lines = [f"{world} gloo ranks, EP={world}, median of {repeat} (A B A B), wall = slowest rank"]
    lines.append(f"{'checkpoint':<34}{'size MiB':>10}{'read MiB':>10}{'sent MiB':>10}{'wall s':>9}  equal")
    for fmt in FORMATS:
        r = out[fmt]
        d = r["dims"]
        for kind in ("bf16", fmt):
            x = r[kind]
            label = f"{'gpt-oss' if fmt == 'mxfp4' else 'Qwen3-MoE'} h{d['hidden']} {d['layers']}x{d['experts']} {kind}"
            lines.append(
                f"{label:<34}{x['checkpoint_bytes'] / MiB:>10,.1f}{x['bytes_read'] / MiB:>10,.1f}"
                f"{x['bytes_sent'] / MiB:>10,.1f}{x['wall_median']:>9.3f}  {x['equal_to_bf16']}"
            )
        lines.append(f"  {fmt} / bf16: wall {r['wall_ratio']:.2f}x, bytes read {r['read_ratio']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=256, help="each bf16 checkpoint's size (default 256)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=Path("bench_out"), help="where the checkpoints are written")
    ap.add_argument("--out", type=Path, default=Path("bench_out/bench_quant.json"))
    args = ap.parse_args(argv)
    from moeshard import CheckpointIndex
    from moeshard._launch import run_local_ranks

    spec: dict = {"repeat": args.repeat}
    sizes = {}
    for fmt in FORMATS:
        d = dims(fmt, args.size_mib)
        t0 = time.perf_counter()
        quant, twin = ensure_checkpoints(d, args.cache)
        print(f"[bench_quant] {quant} and its bf16 twin ready in {time.perf_counter() - t0:.1f} s", flush=True)
        spec[fmt] = {"dims": d, "bf16": str(twin.resolve()), fmt: str(quant.resolve())}
        sizes[fmt] = {
            k: sum(f.stat().st_size for f in p.glob("*.safetensors")) for k, p in (("bf16", twin), (fmt, quant))
        }
        assert CheckpointIndex.open(quant).packed
    os.environ.update(OMP_NUM_THREADS="1")
    per_rank = run_local_ranks(rank_main, spec, world=WORLD, timeout=1800)
    out = summarize(per_rank, args.repeat, sizes)
    for fmt in FORMATS:
        out[fmt]["dims"] = spec[fmt]["dims"]
    print(format_report(out, WORLD, args.repeat))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"world": WORLD, "repeat": args.repeat, **out}, indent=1))
    print(f"[bench_quant] wrote {args.out}")
    if not all(out[f][k]["equal_to_bf16"] for f in FORMATS for k in ("bf16", f)):
        raise SystemExit(f"a load differs from its bf16 twin's: {[out[f][f]['differs'] for f in FORMATS]}")
    return out


if __name__ == "__main__":
    main()
