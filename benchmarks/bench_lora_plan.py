"""LoRA-planning benchmark: what ONE rank of ``moeshard.lora.save_adapter`` and ``load_adapter``
computes before any byte moves, for a peft adapter on DeepSeek-V3 (``docs/deepseek_v3_config.json``)
with rank r=16 on every routed expert's ``gate_up_proj`` / ``down_proj`` (``target_parameters``:
fused factors A ``[r*E, in]``, B ``[out, r*E]``) and on the five MLA projections of every layer
(``target_modules``), for a range of world sizes (EP = min(256, W), expert-FSDP = W / EP, as
``moeshard.parallelize`` shards the factors: A ``(Shard(1), Shard(0))``, B ``(Shard(0),
Shard(1))`` on the ``(efsdp, ep)`` mesh; the other LoRA weights FSDP2 ``Shard(0)`` on all ranks).

The adapter's tensors and layouts are synthesized (no torch model, no process group, no file);
then, for rank 3, the save plan (every tensor's boxes and their holders -> the schedule rank 3
runs) and the load plan (the adapter's needs -> the schedule rank 3 runs) are timed. Each world
size runs in a process of its own (its peak RSS is its own). With ``--compare SRC_TREE`` the
same runs use another source tree's package too (e.g. a worktree of an older commit), side by
side; a child past ``--timeout`` seconds is reported as such. ``bytes`` are the job's bytes sent
to save writers and rank 3's bytes to load: the same data in both trees, however it is cut.

    python -m benchmarks.bench_lora_plan [--worlds 64,1024,8192] [--compare /path/to/old/tree]
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import side_by_side

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "docs" / "deepseek_v3_config.json"
RANK, R = 3, 16


def adapter(world: int):
    """``(items, placement, index)``: DeepSeek-V3's LoRA weights as ``(AdapterTensor, ParamDesc)``
    pairs on ``world`` ranks, their contiguous placement and the adapter file's headers."""
    import numpy as np
    import torch

    from moeshard.io.header import TensorInfo
    from moeshard.io.index import CheckpointIndex

    try:
        from moeshard.models.describe import ParamDesc
    except ImportError:  # --compare with a tree from before models/layout.py was split
        from moeshard.models.layout import ParamDesc
    from moeshard.models.lora import AdapterTensor
    from moeshard.placement import Placement

    c = json.loads(CONFIG.read_text())
    h, inter, num_experts = c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"]
    heads, q_lora, kv_lora = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attention = {
        "q_a_proj": (q_lora, h),
        "q_b_proj": (heads * qk, q_lora),
        "kv_a_proj_with_mqa": (kv_lora + c["qk_rope_head_dim"], h),
        "kv_b_proj": (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), kv_lora),
        "o_proj": (h, heads * c["v_head_dim"]),
    }
    ep = min(256, world)
    first_moe, num_layers = c["first_k_dense_replace"], c["num_hidden_layers"]
    placement = Placement.contiguous(num_layers - first_moe, num_experts, ep)
    fsdp, experts_mesh = np.arange(world), np.arange(world).reshape(world // ep, ep)
    items = []

    def add(name, t_args, shape, mesh, placements):
        key = name.replace(".default", "")  # the file key: the parameter name without the adapter name
        t = AdapterTensor(name, key, *t_args)
        items.append((t, ParamDesc(name, shape, torch.bfloat16, mesh, placements, (key,))))

    prefix = "base_model.model.model.layers"
    for layer in range(num_layers):
        for mod, (out, inp) in attention.items():
            for f, shape in (("A", (R, inp)), ("B", (out, R))):
                add(f"{prefix}.{layer}.self_attn.{mod}.lora_{f}.default.weight", (shape, "", -1, R), shape, fsdp, (0,))
        if layer < first_moe:
            continue
        moe = layer - first_moe
        for mod, (out, inp) in (("experts.base_layer", (2 * inter, h)), ("experts", (h, inter))):
            for f in "AB":
                file = (R * num_experts, inp) if f == "A" else (out, R * num_experts)
                shape = (R * placement.num_physical, inp) if f == "A" else (out, R * placement.num_physical)
                add(
                    f"{prefix}.{layer}.mlp.{mod}.lora_{f}.default.weight",
                    (file, f, moe, R),
                    shape,
                    experts_mesh,
                    (1, 0) if f == "A" else (0, 1),
                )
    pos, tensors = 0, {}
    for t, _ in items:
        tensors[t.key] = TensorInfo("adapter_model.safetensors", 8 + pos, "BF16", tuple(t.shape))
        pos += int(np.prod(t.shape)) * 2
    return items, placement, CheckpointIndex("/nonexistent", tensors, {"adapter_model.safetensors": 8 + pos})


def one(world: int) -> dict:
    """Time rank 3's save and load planning for ``world`` ranks in this process (either tree's API)."""
    import numpy as np

    import moeshard.models.lora as mlora
    import moeshard.ops.lora as olora
    from moeshard.plan import DEFAULT_STAGING_BYTES, plan_transfers
    from moeshard.plan.save import tensor_schedule
    from moeshard.topology import Topology

    items, placement, index = adapter(world)
    keys, itemsizes = [t.key for t, _ in items], [2] * len(items)
    writers = [i % world for i in range(len(items))]
    readers = np.ones(world, dtype=bool)
    topo = Topology(world, 8)
    new = hasattr(mlora, "factor_boxes")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    if new:  # this rank's rows from each tensor's boxes
        save = tensor_schedule(
            keys,
            [mlora.plan_shape(t) for t, _ in items],
            itemsizes,
            olora._held_boxes(items, placement, world),
            writers,
            world,
            DEFAULT_STAGING_BYTES,
            rank=RANK,
        )
    else:  # every tensor's per-column segments as Python tuples, then the rank's rows
        segs = olora._segments(items, placement, world)
        save = tensor_schedule(
            keys, [tuple(t.shape) for t, _ in items], itemsizes, segs, writers, world, DEFAULT_STAGING_BYTES, rank=RANK
        )
    t1 = time.perf_counter()
    if new:  # this rank's plan from a need table of its own rows and the shared ones
        view = olora._planning_index(index, items)
        keep = ~readers
        keep[RANK] = True
        load = plan_transfers(
            olora._needs(items, view, placement, world, keep),
            view,
            topo,
            readers,
            staging_bytes=DEFAULT_STAGING_BYTES,
            rank=RANK,
        )
    else:  # every rank's needs as Need objects, the whole job's plan
        load = plan_transfers(
            olora._needs(items, index, placement, world), index, topo, readers, staging_bytes=DEFAULT_STAGING_BYTES
        )
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    mine = load.deliveries.rank == RANK
    return dict(
        world=world,
        rank=RANK,
        tensors=len(items),
        save_s=t1 - t0,
        load_s=t2 - t1,
        total_s=t2 - t0,
        save_bytes=int(save.cost.sent_bytes.sum()),
        save_sends=int(save.cost.num_p2p_ops),
        load_bytes=int(load.pieces.bytes[load.deliveries.piece[mine]].sum()),
        load_pieces=int(mine.sum()),
        peak_rss_mib=peak,
        rss_growth_mib=peak - rss0,
    )


def main(argv=None) -> None:
    side_by_side.main(
        argv,
        "benchmarks.bench_lora_plan",
        __doc__,
        "64,1024,8192",
        one,
        f"{'save s':>8} {'load s':>8} {'peak MiB':>9} {'+MiB':>6} {'save sends':>11} {'save bytes':>16} "
        f"{'rank load bytes':>16}",
        lambda r: (
            f"{r['save_s']:>8.2f} {r['load_s']:>8.2f} {r['peak_rss_mib']:>9.0f} {r['rss_growth_mib']:>6.0f} "
            f"{r['save_sends']:>11,} {r['save_bytes']:>16,} {r['load_bytes']:>16,}"
        ),
    )


if __name__ == "__main__":
    main()
