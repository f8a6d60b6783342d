"""LoRA benchmark: ``moeshard.lora.load_adapter`` and ``save_adapter`` wall time on local gloo ranks.

Builds (once, cached) a Qwen3-MoE checkpoint from a config (``save_pretrained``) and a peft
adapter with random factors on the attention projections (``target_modules``) and on the fused
experts (``target_parameters``: A ``[r*E, in]``, B ``[out, r*E]``); then on 4 ranks, for each
layout (EP=4; EP=2 x expert-FSDP=2), builds the model on meta, applies peft, parallelizes,
loads the base and times ``load_adapter`` and ``save_adapter`` (barrier before and after; median
of ``--repeat``). Each saved adapter is compared with the source file byte for byte (``same``).
The public API only, so the same script times an older tree (``PYTHONPATH=<tree>/src``).

    python -m benchmarks.bench_lora [--experts 64] [--layers 4] [--hidden 256] [--r 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORLD = 4


def build(root: Path, args) -> dict:
    """The checkpoint and adapter under ``root`` (rebuilt when the dims differ)."""
    import peft
    import torch
    import transformers

    dims = dict(experts=args.experts, layers=args.layers, hidden=args.hidden, r=args.r)
    paths = dict(base=str(root / "base"), adapter=str(root / "adapter"), dims=dims)
    stamp = root / "dims.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == dims:
        return paths
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config(dims))
    model.save_pretrained(paths["base"])
    peft.get_peft_model(model, lora_config(dims)).save_pretrained(paths["adapter"])
    stamp.write_text(json.dumps(dims))
    return paths


def config(d: dict):
    import transformers

    h = d["hidden"]
    return transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=h // 2,
        num_hidden_layers=d["layers"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=h // 4,
        num_experts=d["experts"],
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def lora_config(d: dict):
    import peft

    return peft.LoraConfig(
        r=d["r"],
        lora_alpha=2 * d["r"],
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )


def worker(paths: dict, out: str, ep: int, efsdp: int, repeat: int) -> dict:
    import peft
    import torch
    import torch.distributed as dist
    import transformers

    import moeshard
    import moeshard.lora as mlora

    d = paths["dims"]
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config(d))
    model = peft.get_peft_model(model, lora_config(d))
    placement = moeshard.Placement.contiguous(d["layers"], d["experts"], ep)
    moeshard.parallelize(model, moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp), placement)
    mlora.load(model, paths["base"], paths["adapter"], placement=placement)
    load_s, save_s, same = [], [], []
    source = (Path(paths["adapter"]) / mlora.ADAPTER_WEIGHTS).read_bytes()
    for i in range(repeat):
        dist.barrier()
        t = time.perf_counter()
        mlora.load_adapter(model, paths["adapter"], placement=placement)
        dist.barrier()
        load_s.append(time.perf_counter() - t)
        target = Path(out) / f"ep{ep}x{efsdp}-{i}"
        t = time.perf_counter()
        mlora.save_adapter(model, target, placement=placement)
        dist.barrier()
        save_s.append(time.perf_counter() - t)
        same.append((target / mlora.ADAPTER_WEIGHTS).read_bytes() == source)
    return dict(load_s=statistics.median(load_s), save_s=statistics.median(save_s), same=all(same))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256, help="hidden size (a multiple of 8)")
    p.add_argument("--r", type=int, default=16, help="LoRA rank")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default="bench_out/lora", help="where the checkpoint, adapter and saves go")
    p.add_argument("--out", default="bench_out/bench_lora.json", help="JSON report path")
    args = p.parse_args(argv)
    import tempfile

    import moeshard
    from moeshard._launch import run_local_ranks

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    paths = build(root, args)
    rows = []
    print(
        f"moeshard from {Path(moeshard.__file__).parent}; {paths['dims']}; {WORLD} gloo ranks, median of {args.repeat}"
    )
    for ep, efsdp in ((WORLD, 1), (WORLD // 2, 2)):
        with tempfile.TemporaryDirectory(dir=root) as out:
            r = run_local_ranks(worker, paths, out, ep, efsdp, args.repeat, world=WORLD)[0]
        rows.append(dict(r, ep=ep, efsdp=efsdp, dims=paths["dims"]))
        print(
            f"  EP={ep} x efsdp={efsdp}: load_adapter {r['load_s']:.3f} s, save_adapter {r['save_s']:.3f} s, "
            f"saved == source: {r['same']}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
