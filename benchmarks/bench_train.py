"""Training memory benchmark: peak memory per rank at load and during a training step, against
the rank's shard size, beside the same model trained unsharded on one process.

Builds (once, cached) an fp32 Qwen3-MoE checkpoint with transformers' ``save_pretrained``,
starts 4 gloo ranks (2 simulated nodes x 2), and for each layout (EP=4; EP=2 x expert-FSDP=2):
meta model -> ``moeshard.parallelize`` -> ``moeshard.load`` -> AdamW steps on fixed data.
Per rank: the shard (bytes of its local parameters), RSS before the load, peak RSS growth
during the load (Linux VmHWM, reset before), and peak RSS growth during each training step
(forward + backward + ``optimizer.step``; the first step also allocates AdamW's two state
tensors per parameter, which stay). Before each baseline the heap is trimmed (``malloc_trim``)
so RSS counts live memory, not what glibc keeps cached. The one-process reference does the same steps on the whole model and
the whole batch. Memory is reported as growth over the process's RSS before the load (the
torch runtime alone is a few hundred MiB) and as a multiple of the shard size.

Run from the repository root::

    python -m benchmarks.bench_train              # ~170 MiB fp32 model, about a minute
    python -m benchmarks.bench_train --hidden 256 # smaller
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import torch

from benchmarks.bench_load import malloc_trim  # noqa: E402
from moeshard.ops.peak_rss import read_peak_rss, reset_peak_rss  # noqa: E402

STEPS, LR, SEQ = 2, 1e-3, 64


def _config(hidden: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
        num_experts=16, num_experts_per_tok=2, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )


def _settle() -> None:
    """Free what is garbage and hand freed heap back to the OS (glibc keeps it otherwise), so
    an RSS baseline counts live memory only."""
    gc.collect()
    malloc_trim()


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    peak = read_peak_rss()
    if peak is None:
        raise RuntimeError("this benchmark needs Linux's VmHWM (/proc/self/status)")
    return peak


def _vmhwm_reset() -> None:
    if not reset_peak_rss():
        raise RuntimeError("this benchmark needs a resettable VmHWM (/proc/self/clear_refs)")


def _batch(world: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (world, SEQ), generator=torch.Generator().manual_seed(0))


def _steps(model, ids, opt, step_fn=None) -> list[dict]:
    out = []
    for _ in range(STEPS):
        _settle()
        base = _rss()
        _vmhwm_reset()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step_fn is not None:
            step_fn(model)
        opt.step()
        opt.zero_grad()
        out.append({"loss": loss.item(), "wall_s": time.perf_counter() - t0, "rss_before": base,
                    "peak_rss": _peak_rss()})
    return out


def rank_main(ckpt: str, hidden: int, layouts: list) -> list:
    import torch.distributed as dist
    from transformers import Qwen3MoeForCausalLM

    import moeshard
    from moeshard.models.describe import local_tensor

    rank, world = dist.get_rank(), dist.get_world_size()
    ids = _batch(world, _config(hidden).vocab_size)[rank : rank + 1]
    out = []
    for ep, efsdp in layouts:
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(_config(hidden))
        pl = moeshard.Placement.contiguous(4, 16, ep)
        moeshard.parallelize(model, moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp), pl)
        _settle()
        rss0 = _rss()
        rep = moeshard.load(model, ckpt, placement=pl)
        shard = sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        steps = _steps(model, ids, opt, moeshard.sync_redundant_grads)
        out.append({"ep": ep, "efsdp": efsdp, "rank": rank, "shard_bytes": shard, "rss_before_load": rss0,
                    "load_peak_rss": rep.peak_rss_bytes, "load_wall_s": rep.wall_seconds, "steps": steps})
        del model, opt, rep
    return out


def one_process(ckpt: str, hidden: int, world: int) -> dict:
    from transformers import Qwen3MoeForCausalLM

    _settle()
    rss0 = _rss()
    _vmhwm_reset()
    model = Qwen3MoeForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    load_peak = _peak_rss()
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    steps = _steps(model, _batch(world, model.config.vocab_size), opt)
    return {"shard_bytes": shard, "rss_before_load": rss0, "load_peak_rss": load_peak, "steps": steps}


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--out", default="bench_out/bench_train.json")
    args = parser.parse_args(argv)
    from transformers import Qwen3MoeForCausalLM

    from moeshard._launch import run_local_ranks

    ckpt = Path("bench_out") / f"train_ckpt_h{args.hidden}"
    if not (ckpt / "model.safetensors.index.json").exists() and not (ckpt / "model.safetensors").exists():
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(_config(args.hidden)).save_pretrained(ckpt, max_shard_size="32MB")
    nbytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    print(f"checkpoint {ckpt}: {_mib(nbytes)} MiB fp32; 4 gloo ranks (2 nodes x 2), {STEPS} AdamW steps, "
          f"1 sequence of {SEQ} tokens per rank (one process: all 4)")
    layouts = [(4, 1), (2, 2)]
    ranks = run_local_ranks(rank_main, str(ckpt), args.hidden, layouts, world=4, local_world=2, timeout=600)
    ref = one_process(str(ckpt), args.hidden, 4)
    rows = []
    print(f"{'layout':14} {'rank':>4} {'shard MiB':>9} {'load peak +MiB':>14} {'x shard':>7} "
          f"{'step1 peak +MiB':>15} {'x shard':>7} {'step2 peak +MiB':>15} {'x shard':>7}")

    def row(name, rank, r):
        base = r["rss_before_load"]
        load = r["load_peak_rss"] - base
        s1, s2 = (s["peak_rss"] - base for s in r["steps"])
        sh = r["shard_bytes"]
        rows.append({"layout": name, "rank": rank, "shard_bytes": sh, "load_peak_growth": load,
                     "step_peak_growth": [s1, s2], "step_wall_s": [s["wall_s"] for s in r["steps"]],
                     "losses": [s["loss"] for s in r["steps"]]})
        print(f"{name:14} {rank:>4} {_mib(sh):>9} {_mib(load):>14} {load / sh:7.2f} {_mib(s1):>15} "
              f"{s1 / sh:7.2f} {_mib(s2):>15} {s2 / sh:7.2f}")

    for i, (ep, efsdp) in enumerate(layouts):
        for rank, res in enumerate(ranks):
            row(f"EP={ep} efsdp={efsdp}", rank, res[i])
    row("one process", 0, ref)
    for i, (ep, efsdp) in enumerate(layouts):
        worst = max(r[i]["steps"][-1]["peak_rss"] - r[i]["rss_before_load"] for r in ranks)
        full = ref["steps"][-1]["peak_rss"] - ref["rss_before_load"]
        print(f"EP={ep} efsdp={efsdp}: the worst rank's step peak growth is {worst / full:.2f} of one process's "
              f"({_mib(worst)} vs {_mib(full)} MiB)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"checkpoint_bytes": nbytes, "steps": STEPS, "seq": SEQ, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
