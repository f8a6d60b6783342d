"""``moeshard bench reshard``: recovering a trained model after a node dies, from live peers
against rebuilding and reloading from the checkpoint, on the same ranks.

A Qwen3-MoE (transformers, float32, ``--hidden`` / ``--layers`` / ``--experts``; written once by
``save_pretrained``) on ``--world`` local gloo ranks as nodes of ``--local-world``: EP over all
ranks, HSDP dense (one replica group per node) and, with ``--placement full``, every expert on
every node (redundant experts); ``--placement partial``: every expert once plus one redundant
copy per rank, so some experts live on the lost node only. The job loads and trains one AdamW
step; then its last node's processes exit (the loss) and the survivors form a new process group
(a new rendezvous) and, on an EP-over-survivors mesh:

1. ``reshard``: build the model and fill it from their live shards (``moeshard.reshard``);
2. ``reload``: build the model and ``moeshard.load`` the checkpoint (the checkpoint is older
   than the live weights).

``--cache cold`` (the default) empties the page cache before each variant of each round, as after
a real loss, where the survivors have not read the checkpoint lately: the host's whole cache
(``/proc/sys/vm/drop_caches``) where this runs as root, else ``posix_fadvise(DONTNEED)`` on the
checkpoint's files (best effort: the output says which). ``--cache warm`` keeps it; ``cold,warm``
runs both.

Reports per cache state and variant the wall time (the slowest survivor's, best and median of
``--repeat`` alternated rounds), bytes read from storage and bytes received from peers (job-wide),
as a table and as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import pickle
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from .page_cache import cold_cache_problem, drop_file_cache, drop_page_cache

__all__ = ["main", "Config", "best_and_median", "cold_method"]


@dataclass(frozen=True)
class Config:
    hidden: int = 256
    layers: int = 4
    experts: int = 16
    world: int = 4
    local_world: int = 2
    placement: str = "full"
    repeat: int = 2
    caches: tuple[str, ...] = ("cold",)
    checkpoint: str = ""

    @property
    def survivors(self) -> int:
        return self.world - self.local_world


def _config(cfg: Config):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=4096,
        hidden_size=cfg.hidden,
        intermediate_size=2 * cfg.hidden,
        moe_intermediate_size=cfg.hidden // 2,
        num_hidden_layers=cfg.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=cfg.hidden // 8,
        num_experts=cfg.experts,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _write(cfg: Config, path: str) -> None:
    import torch
    import transformers

    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config(cfg)).save_pretrained(path, max_shard_size="100MB")


def _old_placement(cfg: Config):
    import moeshard

    rng = np.random.default_rng(0)
    nodes = cfg.world // cfg.local_world
    if cfg.placement == "full":  # every expert on every node
        rows = [np.concatenate([rng.permutation(cfg.experts) for _ in range(nodes)]) for _ in range(cfg.layers)]
    else:  # every expert once, one redundant copy per rank
        rows = [
            rng.permutation(np.concatenate([np.arange(cfg.experts), rng.integers(0, cfg.experts, cfg.world)]))
            for _ in range(cfg.layers)
        ]
    return moeshard.Placement(np.stack(rows), num_logical=cfg.experts, num_ranks=cfg.world)


def _build(cfg: Config, ep: int, replicate: int, pl):
    import torch
    import transformers

    import moeshard

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config(cfg))
    moeshard.parallelize(model, moeshard.make_mesh("cpu", ep=ep, replicate=replicate), pl)
    return model


def cold_method() -> str:
    """How ``--cache cold`` empties the cache here: ``drop_caches`` (root) or ``fadvise``."""
    return "drop_caches" if cold_cache_problem() is None else "fadvise"


def _drop_cache(path: str) -> None:
    """Empty the page cache of the checkpoint (the host's whole cache where permitted)."""
    if cold_cache_problem() is None:
        drop_page_cache()
    else:
        drop_file_cache(path)


def _prepare(cfg: Config, cache: str, idx: int) -> None:
    """Collective: with a cold cache, rank 0 empties it while the others wait."""
    import torch.distributed as dist

    dist.barrier()
    if cache == "cold" and idx == 0:
        _drop_cache(cfg.checkpoint)
    dist.barrier()


def _max(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _sum(x: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t)


def best_and_median(rows: list[dict]) -> dict:
    """The best round's row, with the median and every round's seconds."""
    best = dict(min(rows, key=lambda r: r["seconds"]))
    best["median_seconds"] = float(np.median([r["seconds"] for r in rows]))
    best["all_seconds"] = [round(r["seconds"], 4) for r in rows]
    return best


def _rank_main(idx: int, cfg: Config, ports: tuple, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import moeshard

    os.environ.update(LOCAL_WORLD_SIZE=str(cfg.local_world), MOESHARD_PROGRESS="0")
    torch.set_num_threads(1)
    result: tuple = ("ok", None)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{ports[0]}",
            rank=idx,
            world_size=cfg.world,
            timeout=datetime.timedelta(seconds=600),
        )
        pl = _old_placement(cfg)
        old = _build(cfg, cfg.world, cfg.world // cfg.local_world, pl)
        moeshard.load(old, cfg.checkpoint, placement=pl)
        opt = torch.optim.AdamW(old.parameters(), lr=1e-3)
        ids = torch.randint(0, 4096, (1, 32), generator=torch.Generator().manual_seed(idx))
        old(input_ids=ids, labels=ids).loss.backward()
        moeshard.sync_redundant_grads(old)
        opt.step()
        layout = moeshard.describe_shards(old)
        dist.destroy_process_group()
        if idx >= cfg.survivors:  # the lost node
            raise SystemExit
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{ports[1]}",
            rank=idx,
            world_size=cfg.survivors,
            timeout=datetime.timedelta(seconds=600),
        )
        new_pl = moeshard.Placement.contiguous(cfg.layers, cfg.experts, cfg.survivors)
        runs: dict = {}  # {cache: {variant: [row per round]}}
        for cache in cfg.caches:
            for _ in range(cfg.repeat):  # alternated: reshard, reload, reshard, ...
                for variant in ("reshard", "reload"):
                    _prepare(cfg, cache, idx)
                    t0 = time.perf_counter()
                    new = _build(cfg, cfg.survivors, 1, new_pl)
                    if variant == "reshard":
                        rep = moeshard.reshard(new, layout, old, cfg.checkpoint, dense_from_storage="allow")
                    else:
                        rep = moeshard.load(new, cfg.checkpoint, placement=new_pl)
                    t = _max(time.perf_counter() - t0)
                    row = dict(
                        seconds=t,
                        read_bytes=_sum(rep.bytes_read_rank),
                        received_bytes=_sum(rep.bytes_received_rank),
                        copied_bytes=_sum(rep.bytes_copied_rank) if variant == "reshard" else 0,
                        storage_boxes=len(rep.storage_boxes) if variant == "reshard" else -1,
                        phases={k: round(_max(v), 4) for k, v in rep.phase_seconds.items()},
                    )
                    runs.setdefault(cache, {}).setdefault(variant, []).append(row)
                    del new
        rows = {cache: {v: best_and_median(rs) for v, rs in by.items()} for cache, by in runs.items()}
        result = ("ok", rows)
        dist.destroy_process_group()
    except SystemExit:
        result = ("ok", None)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{idx}.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)


def run(cfg: Config) -> dict:
    """Write the checkpoint (once), run the ranks, return ``{variant: row}`` (rank 0's view)."""
    _write(cfg, cfg.checkpoint)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "transformers", "moeshard"])
    with tempfile.TemporaryDirectory() as out_dir:
        from ..._launch import free_port

        ports = (free_port(), free_port())
        procs = [ctx.Process(target=_rank_main, args=(i, cfg, ports, out_dir), daemon=True) for i in range(cfg.world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(3600)
        results = []
        for i in range(cfg.world):
            with open(os.path.join(out_dir, f"{i}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    errors = [f"rank {i}: {v}" for i, (k, v) in enumerate(results) if k == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return results[0][1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moeshard bench reshard", description=__doc__.splitlines()[0])
    d = Config()
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--experts", type=int, default=d.experts)
    p.add_argument("--world", type=int, default=d.world)
    p.add_argument("--local-world", type=int, default=d.local_world)
    p.add_argument("--placement", choices=("full", "partial"), default=d.placement)
    p.add_argument("--repeat", type=int, default=d.repeat)
    p.add_argument(
        "--cache",
        default="cold",
        help="cold, warm or cold,warm: empty the page cache before each variant (cold: as after a real loss)",
    )
    p.add_argument("--checkpoint", default="", help="where the checkpoint is written (default: a cache directory)")
    p.add_argument("--out", default="", help="write the JSON here")
    a = p.parse_args(argv)
    if a.world % a.local_world or a.world // a.local_world < 2:
        raise ValueError(f"--world {a.world} must be 2 or more nodes of --local-world {a.local_world}")
    caches = tuple(c.strip() for c in a.cache.split(",") if c.strip())
    if not caches or set(caches) - {"cold", "warm"}:
        raise ValueError(f"--cache: expected cold, warm or cold,warm, got {a.cache!r}")
    name = f"moeshard-bench-reshard-{a.hidden}-{a.layers}-{a.experts}"
    ckpt = a.checkpoint or os.path.join(tempfile.gettempdir(), name)
    cfg = Config(a.hidden, a.layers, a.experts, a.world, a.local_world, a.placement, a.repeat, caches, ckpt)
    rows = run(cfg)
    print(
        f"moeshard bench reshard: {cfg.world} ranks ({cfg.world // cfg.local_world} nodes), node lost, "
        f"{cfg.survivors} survivors; placement {cfg.placement}; cold cache by {cold_method()}"
    )
    print(
        f"{'cache':6} {'variant':8} {'best s':>8} {'median s':>9} {'read MiB':>10} {'recv MiB':>10} "
        f"{'copied MiB':>11} {'boxes':>6}"
    )
    for cache, by in rows.items():
        for name, r in by.items():
            print(
                f"{cache:6} {name:8} {r['seconds']:8.3f} {r['median_seconds']:9.3f} {r['read_bytes'] / 2**20:10.2f} "
                f"{r['received_bytes'] / 2**20:10.2f} {r['copied_bytes'] / 2**20:11.2f} "
                f"{r['storage_boxes'] if r['storage_boxes'] >= 0 else '-':>6}"
            )
        ratio = by["reload"]["median_seconds"] / by["reshard"]["median_seconds"]
        print(f"{cache:6} reload / reshard (medians): {ratio:.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(config=asdict(cfg), cold_method=cold_method(), results=rows), f, indent=2)
    return 0
