"""Planning a refit of full-size DeepSeek-V3 (61 layers, 256 routed experts, 3 dense layers)
from a trainer of T ranks (EP=T for the experts, FSDP over T for the rest) into a vLLM engine of
E ranks (TP=8 x DP=E/8 for the dense tensors, EP=E for the experts, a redundant slot per engine rank): the
seconds one rank spends in the pure planner (every rank runs the same).

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
    t0 = time.perf_counter()
    plan = plan_for(shared, list(range(a.trainer)), layout, topo)
    dt = time.perf_counter() - t0
    print(
        f"trainer {a.trainer} + engine {a.engine} ranks, {a.layers} layers: plan {dt:.2f} s, "
        f"{len(plan.groups)} groups, peer bytes {plan.peer_bytes / 2**30:.1f} GiB"
    )


if __name__ == "__main__":
    main()
