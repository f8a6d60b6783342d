"""``moeshard bench relocate``: rebalancing a drifting load, side by side in one run.

Synthetic model: ``--layers`` MoE layers of ``--experts`` logical experts plus ``--redundant``
slots, each expert a fused ``w13 [2*inter, hidden]`` and a ``w2 [hidden, inter]`` (bf16; about
1 GiB of expert copies by default), on ``--world`` local gloo ranks as nodes of
``--local-world``. Load: a drifting Zipf trace (fixed seed).

Reports (table on stdout, JSON in ``--out``):

1. per rebalance step, the oblivious policy and the migration-aware one: balance (mean over
   layers of max/mean rank load) and expert copies moved (pure, no ranks involved);
2. per step, wall time of the migration-aware relocation by P2P (with and without keeping the
   overwritten slots for a rollback, ``transactional``; and in chunks of one layer), of
   re-reading the changed experts from the checkpoint, and of reloading every expert from the
   checkpoint, one after
   the other on the same ranks and state; bytes sent vs the minimum for the two placements;
3. 1 and 2 dead ranks: experts recovered from live replicas vs read from disk; every live
   slot compared with the checkpoint (no expert lost);
4. planning time (policy + relocation plan) for DeepSeek-V3's shape.

The checkpoint's pages are dropped from the page cache (``posix_fadvise(DONTNEED)``) before
each checkpoint-reading variant unless ``--warm``: a warm page cache makes "disk" a memcpy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["main"]


@dataclass(frozen=True)
class Config:
    layers: int = 8
    experts: int = 32
    redundant: int = 16
    hidden: int = 1024
    inter: int = 512
    world: int = 8
    local_world: int = 4
    groups: int = 4
    steps: int = 5
    seed: int = 0
    staging_mib: int = 64
    repeat: int = 3
    warm: bool = False

    @property
    def num_physical(self) -> int:
        return self.experts + self.redundant

    @property
    def slots(self) -> int:
        return self.num_physical // self.world

    def shapes(self) -> list[tuple[int, int]]:
        return [(2 * self.inter, self.hidden), (self.hidden, self.inter)]


MODULE = "model.layers.{layer}.mlp.experts"


def _params():
    from ...models.adapters import ExpertParam

    return [ExpertParam("w13", ("{e}.w13.weight",)), ExpertParam("w2", ("{e}.w2.weight",))]


def write_checkpoint(cfg: Config, path: str) -> None:
    """Random bf16 experts, one key per (layer, expert, tensor); skipped when already there."""
    import torch

    from ...io.writer import write_checkpoint as write

    marker = os.path.join(path, "bench-config.json")
    want = json.dumps({k: v for k, v in asdict(cfg).items() if k in ("layers", "experts", "hidden", "inter")})
    if os.path.exists(marker) and open(marker).read() == want:
        return
    gen = torch.Generator().manual_seed(cfg.seed)

    def pairs():
        for layer in range(cfg.layers):
            for e in range(cfg.experts):
                for j, shape in enumerate(cfg.shapes()):
                    name = ("w13", "w2")[j]
                    value = torch.randn(shape, generator=gen).to(torch.bfloat16)
                    yield f"{MODULE.format(layer=layer)}.{e}.{name}.weight", value

    write(path, pairs(), max_shard_bytes=256 << 20)
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        os.fsync(fd)  # dirty pages cannot be dropped from the cache
        os.close(fd)
    with open(marker, "w") as f:
        f.write(want)


def drop_cache(path: str) -> None:
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def policy_trace(cfg: Config) -> tuple[list[dict], list, list]:
    """Both policies over the trace, each following its own chain of placements (pure)."""
    from ... import eplb
    from .traces import zipf_trace

    loads = zipf_trace(cfg.layers, cfg.experts, cfg.steps + 1, seed=cfg.seed)
    kw = dict(
        num_physical=cfg.num_physical,
        num_ranks=cfg.world,
        num_nodes=cfg.world // cfg.local_world,
        num_groups=cfg.groups,
    )
    start = eplb.rebalance(loads[0], None, migration_aware=False, **kw)
    obl, aware = [start], [start]
    rows = []
    for s in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        o = eplb.rebalance(loads[s], obl[-1], migration_aware=False, **kw)
        t1 = time.perf_counter()
        a = eplb.rebalance(loads[s], aware[-1], migration_aware=True, **kw)
        t2 = time.perf_counter()
        rows.append(
            dict(
                step=s,
                balance_oblivious=float(eplb.balance(loads[s], o, cfg.world).mean()),
                balance_aware=float(eplb.balance(loads[s], a, cfg.world).mean()),
                balance_before=float(eplb.balance(loads[s], aware[-1], cfg.world).mean()),
                moved_oblivious=eplb.copies_moved(obl[-1], o, cfg.world),
                moved_aware=eplb.copies_moved(aware[-1], a, cfg.world),
                policy_ms_oblivious=(t1 - t0) * 1e3,
                policy_ms_aware=(t2 - t1) * 1e3,
            )
        )
        obl.append(o)
        aware.append(a)
    last = loads[-1]
    dead = []
    for k in (1, 2):
        alive = np.ones(cfg.world, dtype=bool)
        alive[[5, 2][:k]] = False
        dead.append((alive, eplb.rebalance(last, aware[-1], active_ranks=alive, migration_aware=True, **kw)))
    return rows, aware, dead


def _check_slots(tensors, placement, rank: int, slots: int, reader) -> int:
    """Slots of this rank that differ from their logical expert in the checkpoint."""
    bad = 0
    for layer, ts in tensors.items():
        for k in range(slots):
            e = int(placement.phy2log[layer, rank * slots + k])
            if e < 0:
                continue
            for t, name in zip(ts, ("w13", "w2")):
                if not t[k].equal(reader.read(f"{MODULE.format(layer=layer)}.{e}.{name}.weight")):
                    bad += 1
    return bad


def rank_worker(cfg: Config, path: str, aware: list, dead: list) -> dict:
    """On every rank: the timed relocations (all ranks return their reports)."""
    import torch
    import torch.distributed as dist

    from ...io.index import CheckpointIndex
    from ...io.reader import CheckpointReader
    from ...ops.relocate import relocate, relocate_chunks
    from ...topology import Topology

    rank = dist.get_rank()
    topo = Topology(cfg.world, cfg.local_world)
    tensors = {
        layer: [torch.empty(cfg.slots, *s, dtype=torch.bfloat16) for s in cfg.shapes()] for layer in range(cfg.layers)
    }
    kw = dict(
        checkpoint=path, topology=topo, staging_bytes=cfg.staging_mib << 20, expert_params=_params(), module=MODULE
    )

    def cold():
        if not cfg.warm and rank % cfg.local_world == 0:
            drop_cache(path)
        dist.barrier()

    def timed(old, new, **extra) -> dict:
        dist.barrier()
        rep = relocate(tensors, old, new, **kw, **extra)
        return dict(
            wall=rep.wall_seconds,
            plan=rep.plan_seconds,
            copies=rep.copies,
            bytes=rep.bytes,
            network=rep.network_bytes,
            min_network=rep.min_network_bytes,
            cross=rep.cross_node_bytes,
            min_cross=rep.min_cross_node_bytes,
            rounds=rep.num_rounds,
            read=rep.bytes_read_rank,
            disk_experts=len(rep.disk_experts),
        )

    cold()
    out = {"initial": timed(None, aware[0]), "steps": [], "dead": []}
    for s in range(1, len(aware)):
        cur, new = aware[s - 1], aware[s]
        runs = {"p2p": [], "p2p_nobackup": [], "chunked": [], "disk": [], "full": []}
        for _ in range(cfg.repeat):
            # Each variant starts from the step's start state `cur` and ends in `new`.
            cold()
            runs["disk"].append(timed(cur, new, from_checkpoint=True))
            timed(new, cur)
            runs["p2p"].append(timed(cur, new))
            timed(new, cur)
            runs["p2p_nobackup"].append(timed(cur, new, transactional=False))  # the cost of "old or new"
            timed(new, cur)
            dist.barrier()
            t0 = time.perf_counter()  # one layer per chunk, as a server rebalancing between batches
            chunks = sum(1 for _ in relocate_chunks(tensors, cur, new, layers_per_chunk=1, **kw))
            runs["chunked"].append(dict(wall=time.perf_counter() - t0, chunks=chunks))
            timed(new, cur)
            cold()
            runs["full"].append(timed(None, new))
            timed(new, cur)
        timed(cur, new)
        out["steps"].append(dict(step=s, **runs))
    index = CheckpointIndex.open(path)
    base = aware[-1]
    with CheckpointReader(index) as reader:
        for alive, pl in dead:
            rep = timed(base, pl, active_ranks=alive)
            bad = _check_slots(tensors, pl, rank, cfg.slots, reader) if alive[rank] else 0
            # The dead ranks come back empty (scale-up) and the job returns to `base`.
            back = timed(pl, base)
            bad_back = _check_slots(tensors, base, rank, cfg.slots, reader)
            out["dead"].append(dict(dead=int((~alive).sum()), relocate=rep, rejoin=back, lost=bad + bad_back))
    return out


def plan_dsv3(repeat: int = 5) -> dict:
    """Policy + relocation plan for DeepSeek-V3's shape: 58 MoE layers, 256 logical experts,
    288 slots, 8 groups, 32 ranks on 4 nodes (pure; median of ``repeat``)."""
    from ... import eplb
    from ...box import full_box
    from ...plan.relocation import ExpertTensor, plan_relocation
    from ...topology import Topology
    from .traces import zipf_trace

    L, E, P, R, N, G = 58, 256, 288, 32, 4, 8
    spr = P // R
    tensors = [
        ExpertTensor(layer, f"l{layer}.{j}", shape, 1, tuple((r, r * spr, spr, full_box(shape)) for r in range(R)))
        for layer in range(L)
        for j, shape in enumerate([(4096, 7168), (7168, 2048)])
    ]
    loads = zipf_trace(L, E, 2, seed=1)
    kw = dict(num_physical=P, num_ranks=R, num_nodes=N, num_groups=G)
    old = eplb.rebalance(loads[0], None, migration_aware=False, **kw)
    pol, rel, moves = [], [], 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        new = eplb.rebalance(loads[1], old, migration_aware=True, **kw)
        t1 = time.perf_counter()
        plan = plan_relocation(tensors, old, new, Topology(R, R // N))
        t2 = time.perf_counter()
        pol.append(t1 - t0)
        rel.append(t2 - t1)
        moves = len(plan.moves)
    return dict(
        policy_ms=statistics.median(pol) * 1e3,
        plan_ms=statistics.median(rel) * 1e3,
        total_ms=statistics.median(a + b for a, b in zip(pol, rel)) * 1e3,
        copies_moved=eplb.copies_moved(old, new, R),
        plan_moves=moves,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moeshard bench relocate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = Config()
    for name in (
        "layers",
        "experts",
        "redundant",
        "hidden",
        "inter",
        "world",
        "local_world",
        "groups",
        "steps",
        "seed",
        "staging_mib",
        "repeat",
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    parser.add_argument("--warm", action="store_true", help="keep the checkpoint in the page cache")
    parser.add_argument("--out", default="bench_out", help="directory for the checkpoint and bench_relocate.json")
    args = parser.parse_args(argv)
    cfg = Config(**{k: getattr(args, k) for k in asdict(d)})
    if cfg.num_physical % cfg.world or cfg.world % cfg.local_world or cfg.experts % cfg.groups:
        parser.error("experts + redundant must divide by --world, --world by --local-world, experts by --groups")
    from ..._launch import run_local_ranks

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "relocate_ckpt")
    gib = cfg.layers * cfg.num_physical * sum(a * b for a, b in cfg.shapes()) * 2 / 2**30
    print(
        f"moeshard bench relocate: {cfg.layers} layers x {cfg.num_physical} slots ({cfg.experts} experts + "
        f"{cfg.redundant} redundant), {gib:.2f} GiB of expert copies, {cfg.world} ranks as "
        f"{cfg.world // cfg.local_world} nodes x {cfg.local_world}, {'warm' if cfg.warm else 'cold'} page cache"
    )
    write_checkpoint(cfg, path)
    rows, aware, dead = policy_trace(cfg)
    print("\n1. policies (pure): balance = mean over layers of max/mean rank load; moved = expert copies")
    print(
        f"{'step':>4} {'before':>7} {'oblivious':>10} {'aware':>7} {'moved obl':>10} {'moved aware':>12} {'ratio':>6}"
        f" {'ms obl':>7} {'ms aware':>9}"
    )
    for r in rows:
        ratio = r["moved_aware"] / max(r["moved_oblivious"], 1)
        print(
            f"{r['step']:>4} {r['balance_before']:7.3f} {r['balance_oblivious']:10.3f} {r['balance_aware']:7.3f} "
            f"{r['moved_oblivious']:>10} {r['moved_aware']:>12} {ratio:6.2f} {r['policy_ms_oblivious']:7.1f} "
            f"{r['policy_ms_aware']:9.1f}"
        )
    results = run_local_ranks(
        rank_worker, cfg, path, aware, dead, world=cfg.world, local_world=cfg.local_world, timeout=1200
    )

    def job(key_fn):
        return max(key_fn(r) for r in results)  # the job's wall time is its slowest rank's

    print(
        f"\n2. relocation wall time (slowest rank, median of {cfg.repeat}), same start state each: P2P = "
        "moeshard.relocate; disk = re-read the changed experts from the checkpoint; full = read every slot"
    )
    print(
        "   (P2P-nb = P2P without keeping the overwritten slots: transactional=False; chunks = the same move one "
        "layer per relocate_chunks step, all steps)"
    )
    print(
        f"{'step':>4} {'P2P s':>7} {'(plan)':>7} {'P2P-nb s':>8} {'chunks s':>8} {'disk s':>7} {'full s':>7} "
        f"{'disk/P2P':>9} {'full/P2P':>9} {'sent MiB':>9} {'min MiB':>8} {'cross MiB':>10} {'rounds':>7}"
    )
    steps = []
    for i in range(len(results[0]["steps"])):

        def get(kind: str, i: int = i) -> float:
            # Per repetition the job's time is its slowest rank's; then the median repetition.
            return statistics.median(max(r["steps"][i][kind][k]["wall"] for r in results) for k in range(cfg.repeat))

        p2p, p2p_nb, chunked, disk, full = (get(k) for k in ("p2p", "p2p_nobackup", "chunked", "disk", "full"))
        rep = results[0]["steps"][i]["p2p"][0]
        plan_s = statistics.median(max(r["steps"][i]["p2p"][k]["plan"] for r in results) for k in range(cfg.repeat))
        steps.append(
            dict(
                step=i + 1,
                p2p_s=p2p,
                p2p_plan_s=plan_s,
                p2p_nobackup_s=p2p_nb,
                chunked_s=chunked,
                chunks=results[0]["steps"][i]["chunked"][0]["chunks"],
                disk_s=disk,
                full_s=full,
                disk_over_p2p=disk / p2p,
                full_over_p2p=full / p2p,
                network_bytes=rep["network"],
                min_network_bytes=rep["min_network"],
                cross_node_bytes=rep["cross"],
                min_cross_node_bytes=rep["min_cross"],
                copies=rep["copies"],
                rounds=rep["rounds"],
            )
        )
        print(
            f"{i + 1:>4} {p2p:7.3f} {plan_s:7.3f} {p2p_nb:8.3f} {chunked:8.3f} {disk:7.3f} {full:7.3f} "
            f"{disk / p2p:9.2f} {full / p2p:9.2f} "
            f"{rep['network'] / 2**20:9.1f} {rep['min_network'] / 2**20:8.1f} {rep['cross'] / 2**20:10.1f} "
            f"{rep['rounds']:>7}"
        )
    init = job(lambda r: r["initial"]["wall"])
    print(f"initial fill of every slot from the checkpoint: {init:.3f} s")
    print("\n3. dead ranks (migration-aware placement on the live ranks), then the dead ranks rejoin empty")
    dead_rows = []
    for i in range(len(results[0]["dead"])):
        d0 = results[0]["dead"][i]
        lost = sum(r["dead"][i]["lost"] for r in results)
        c = d0["relocate"]["copies"]
        dead_rows.append(
            dict(
                dead=d0["dead"],
                copies=c,
                disk_experts=d0["relocate"]["disk_experts"],
                lost=lost,
                wall_s=job(lambda r, i=i: r["dead"][i]["relocate"]["wall"]),
                rejoin_copies=d0["rejoin"]["copies"],
            )
        )
        print(
            f"{d0['dead']} dead: from live replicas {c['local'] + c['same_node'] + c['cross_node']} "
            f"(local {c['local']}, same node {c['same_node']}, cross node {c['cross_node']}), "
            f"from disk {c['disk']} ({d0['relocate']['disk_experts']} experts had no live copy), "
            f"slots wrong after relocation and after rejoin: {lost}"
        )
    dsv3 = plan_dsv3()
    print(
        f"\n4. DeepSeek-V3 shape (58 layers, 256 experts, 288 slots, 32 ranks / 4 nodes): policy "
        f"{dsv3['policy_ms']:.1f} ms + relocation plan {dsv3['plan_ms']:.1f} ms = {dsv3['total_ms']:.1f} ms "
        f"({dsv3['copies_moved']} copies moved)"
    )
    with open(os.path.join(args.out, "bench_relocate.json"), "w") as f:
        json.dump(
            dict(
                config=asdict(cfg),
                policies=rows,
                relocation=steps,
                initial_fill_s=init,
                dead=dead_rows,
                dsv3_planning=dsv3,
            ),
            f,
            indent=1,
        )
    print(f"\nwrote {os.path.join(args.out, 'bench_relocate.json')}")
    return 0 if all(r["lost"] == 0 for r in dead_rows) else 1
