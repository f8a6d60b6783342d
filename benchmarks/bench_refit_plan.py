"""Planning a refit of full-size DeepSeek-V3 (61 layers, 256 routed experts, 3 dense layers)
from a trainer of T ranks (EP=T for the experts, FSDP over T for the rest) into a vLLM engine of
E ranks (TP=8 x DP=E/8 for the dense tensors, EP=E for the experts, a redundant slot per engine rank): the
seconds (CPU and wall) one rank spends in the pure planner (``plan_for``: its own transfers only), for the first trainer
rank and the first engine rank; with ``--job-wide``, also the job-wide reshard planner run on every rank's
rows per install group (what each rank would otherwise plan).

    python -m benchmarks.bench_refit_plan --trainer 256 --engine 256
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from moeshard.ops.refit import plan_for
from moeshard.ops.reshard import ShardLayout, TensorLayout
from moeshard.plan.engines import vllm_deepseek_v3
from moeshard.topology import Topology

H, V, I_DENSE, I_MOE, E = 7168, 129280, 18432, 2048, 256
Q_LORA, KV_LORA, ROPE, NOPE, VH, HEADS = 1536, 512, 64, 128, 128, 128


def _trainer(num_layers: int, first_dense: int, ranks: int, world: int) -> ShardLayout:
    mesh = np.arange(ranks, dtype=np.int64)
    t = []

    def dense(name, shape):
        t.append(TensorLayout(name, shape, "bfloat16", mesh, (0,)))

    dense("model.embed_tokens.weight", (V, H))
    dense("model.norm.weight", (H,))
    dense("lm_head.weight", (V, H))
    for i in range(num_layers):
        a = f"model.layers.{i}.self_attn"
        dense(f"{a}.q_a_proj.weight", (Q_LORA, H))
        dense(f"{a}.q_a_layernorm.weight", (Q_LORA,))
        dense(f"{a}.q_b_proj.weight", (HEADS * (NOPE + ROPE), Q_LORA))
        dense(f"{a}.kv_a_proj_with_mqa.weight", (KV_LORA + ROPE, H))
        dense(f"{a}.kv_a_layernorm.weight", (KV_LORA,))
        dense(f"{a}.kv_b_proj.weight", (HEADS * (NOPE + VH), KV_LORA))
        dense(f"{a}.o_proj.weight", (H, HEADS * VH))
        dense(f"model.layers.{i}.input_layernorm.weight", (H,))
        dense(f"model.layers.{i}.post_attention_layernorm.weight", (H,))
        p = f"model.layers.{i}.mlp"
        if i < first_dense:
            for n, s in (("gate_proj", (I_DENSE, H)), ("up_proj", (I_DENSE, H)), ("down_proj", (H, I_DENSE))):
                dense(f"{p}.{n}.weight", s)
            continue
        dense(f"{p}.gate.weight", (E, H))
        t.append(TensorLayout(f"{p}.gate.e_score_correction_bias", (E,), "float32", None, ()))
        ep = mesh.reshape(1, ranks)
        t.append(
            TensorLayout(f"{p}.experts.gate_up_proj", (E, 2 * I_MOE, H), "bfloat16", ep, (None, 0), i - first_dense)
        )
        t.append(TensorLayout(f"{p}.experts.down_proj", (E, H, I_MOE), "bfloat16", ep, (None, 0), i - first_dense))
        for n, s in (("gate_proj", (I_MOE, H)), ("up_proj", (I_MOE, H)), ("down_proj", (H, I_MOE))):
            dense(f"{p}.shared_experts.{n}.weight", s)
    p2l = np.tile(np.arange(E, dtype=np.int64), (num_layers - first_dense, 1))
    return ShardLayout(tuple(t), p2l, E, world, 0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainer", type=int, default=256)
    ap.add_argument("--engine", type=int, default=256)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--redundant", type=int, default=None, help="redundant slots (default: one per engine rank)")
    ap.add_argument("--repeat", type=int, default=3, help="plans per rank (the best is shown)")
    ap.add_argument("--job-wide", action="store_true", help="also time the job-wide planner")
    a = ap.parse_args(argv)
    world = a.trainer + a.engine
    shared = _trainer(a.layers, 3, a.trainer, world)
    rng = np.random.default_rng(0)
    n_moe = a.layers - 3
    p2l = np.stack(
        [
            rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, a.redundant or a.engine)]))
            for _ in range(n_moe)
        ]
    )
    engine = list(range(a.trainer, world))
    layout = vllm_deepseek_v3(a.layers, engine, tp=a.tp, ep=a.engine, phy2log=p2l, first_k_dense=3, dtype="bfloat16")
    topo = Topology(world_size=world, local_world_size=8)
    trainers = list(range(a.trainer))
    for rank, role in ((0, "trainer"), (a.trainer, "engine")):
        wall = cpu = None
        for _ in range(a.repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            plan = plan_for(shared, trainers, layout, topo, rank=rank)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            wall, cpu = min(wall or dt, dt), min(cpu or dc, dc)
        ops = sum(len(p.schedule.sends.src) for p in plan.plans)
        print(
            f"trainer {a.trainer} + engine {a.engine} ranks, {a.layers} layers: plan of rank {rank} ({role}) "
            f"{cpu:.3f} s CPU, {wall:.3f} s wall (best of {a.repeat}), {len(plan.groups)} groups, {ops} P2P ops, "
            f"sends {plan.sent_bytes / 2**20:.1f} MiB"
        )
    if a.job_wide:
        _job_wide(shared, trainers, layout, topo)


def _job_wide(shared, trainers, layout, topo) -> None:
    """The job-wide reshard planner on every rank's need rows and holdings, per install group."""
    from moeshard.ops.refit import refit_inputs
    from moeshard.plan import DEFAULT_MAX_OPS, DEFAULT_STAGING_BYTES
    from moeshard.plan.refit import engine_needs, wire_dtypes
    from moeshard.plan.reshard import BoxRows, Units, plan_reshard

    t0, c0 = time.perf_counter(), time.process_time()
    info, holds, sizes, _ = refit_inputs(shared, trainers, layout)
    width = holds.off.shape[1]
    keys = info.unit_keys()
    ndim, _ = info.unit_columns()
    wire = np.asarray([sizes[d] for d in wire_dtypes(layout, info, sizes)], np.int64)
    units = Units(keys, ndim, wire, np.zeros(len(keys), bool))
    rows = engine_needs(layout, info, width).rows
    group_of = np.asarray([t.group for t in layout.tensors])
    peer = 0
    for g in sorted(set(group_of.tolist())):
        sel = group_of[rows.param] == g
        n_g = BoxRows(*(x[sel] for x in (rows.unit, rows.rank, rows.param, rows.slot, rows.off, rows.len, rows.local)))
        used = np.zeros(len(keys), bool)
        used[n_g.unit] = True
        hs = used[holds.unit]
        h_g = BoxRows(
            *(x[hs] for x in (holds.unit, holds.rank, holds.param, holds.slot, holds.off, holds.len, holds.local))
        )
        peer += plan_reshard(units, h_g, n_g, topo, DEFAULT_STAGING_BYTES, DEFAULT_MAX_OPS).peer_bytes
    print(
        f"job-wide planner: {time.process_time() - c0:.2f} s CPU, {time.perf_counter() - t0:.2f} s wall, "
        f"peer bytes {peer} ({peer / 2**30:.2f} GiB)"
    )


if __name__ == "__main__":
    main()
