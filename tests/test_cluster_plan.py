"""Tier 1: ``moeshard plan`` (moeshard.cluster), pure: no process group, no model object.

* The ParamDescs synthesized from checkpoint headers give the *same needs* as a real
  transformers Qwen3-MoE model built on meta and sharded by ``moeshard.parallelize`` (under
  torch's single-process fake process group, world 8, several EP x expert-FSDP layouts).
* Every checkpoint element is needed by exactly the expected number of ranks, and moeshard's
  plans meet their lower bounds in every storage mode.
* A DeepSeek-V3 config.json (public values) synthesizes a ~671B-parameter index.
* Bad input: one line on stderr, exit code 2; ``--json`` parses.
* The pieces: per-rank link counters, Mixtral / Qwen2-MoE synthetic headers, the garbage
  collector restored after a run.
"""

from __future__ import annotations

import gc
import json
import math

import numpy as np
import pytest
import torch

from moeshard import Placement
from moeshard.box import box_slices
from moeshard.cli.plan import main
from moeshard.cluster import (
    ClusterSpec,
    LinkBytes,
    baseline_costs,
    find_experts,
    make_placement,
    num_params,
    parse_bandwidth,
    plan_storage_modes,
    synthesize_descs,
    synthetic_index,
)
from moeshard.dtypes import dtype_name
from moeshard.io.index import CheckpointIndex
from moeshard.io.writer import write_checkpoint
from moeshard.models.layout import compute_needs, need_table
from moeshard.models.shards import shard_boxes
from moeshard.topology import Topology

NUM_LAYERS, NUM_EXPERTS = 2, 8

# deepseek-ai/DeepSeek-V3 config.json (the public values that shape the weights).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "vocab_size": 129280,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}


def _qwen_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def qwen_ckpt(tmp_path_factory):
    """A tiny Qwen3-MoE checkpoint written by transformers' save_pretrained (bf16)."""
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeForCausalLM

    path = tmp_path_factory.mktemp("qwen3moe")
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(_qwen_config()).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _placements(ep: int, num_redundant: int):
    pl = [Placement.contiguous(NUM_LAYERS, NUM_EXPERTS, ep, num_redundant)]
    rng = np.random.default_rng(ep * 10 + num_redundant)
    rows = [
        rng.permutation(np.concatenate([np.arange(NUM_EXPERTS), rng.integers(0, NUM_EXPERTS, num_redundant)]))
        for _ in range(NUM_LAYERS)
    ]
    pl.append(Placement(np.stack(rows), num_logical=NUM_EXPERTS, num_ranks=ep))
    return pl


def _need_set(needs, descs):
    return {(n.rank, descs[n.param].name, n.dest, n.key, n.src) for n in needs}


LAYOUTS = [(8, 1, 0), (4, 2, 4), (2, 4, 2)]  # (ep, efsdp, redundant) on world 8


def test_needs_equal_a_parallelized_model(qwen_ckpt):
    """Synthesized descs == describe_model of the real parallelized model: same needs."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import Qwen3MoeForCausalLM

    import moeshard
    from moeshard.models.describe import describe_model

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    index = CheckpointIndex.open(qwen_ckpt)
    layout = find_experts(index)
    assert (layout.num_layers, layout.num_logical) == (NUM_LAYERS, NUM_EXPERTS)
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        for ep, efsdp, red in LAYOUTS:
            mesh = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp)
            cluster = ClusterSpec.build(2, 4, ep, efsdp, red)
            synth = synthesize_descs(layout, index, cluster)
            for pl in _placements(ep, red):
                old = torch.get_default_dtype()
                torch.set_default_dtype(torch.bfloat16)  # as from_pretrained(dtype=bf16) builds it
                try:
                    with torch.device("meta"):
                        model = Qwen3MoeForCausalLM(_qwen_config())
                finally:
                    torch.set_default_dtype(old)
                moeshard.parallelize(model, mesh, pl)
                real = describe_model(model, index)
                assert sorted(d.name for d in real) == sorted(d.name for d in synth)
                by_name = {d.name: d for d in real}
                for d in synth:
                    r = by_name[d.name]
                    # Synthesized descs are torch-free: placements as ints / None, dtypes as names.
                    assert d.shape == r.shape and dtype_name(d.dtype) == dtype_name(r.dtype), d.name
                    assert np.array_equal(d.mesh, r.mesh), d.name
                    if d.mesh is None:
                        assert d.placements == r.placements == (), d.name
                    else:
                        assert np.array_equal(
                            shard_boxes(d.shape, d.mesh.shape, d.placements),
                            shard_boxes(r.shape, r.mesh.shape, r.placements),
                        ), d.name
                assert _need_set(compute_needs(synth, index, pl, 8), synth) == _need_set(
                    compute_needs(real, index, pl, 8), real
                ), (ep, efsdp, red)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ep,efsdp,red", LAYOUTS)
def test_every_element_needed_the_expected_number_of_times(qwen_ckpt, ep, efsdp, red):
    """Dense elements: exactly one rank (FSDP shards). Expert elements: once per copy of the
    expert (expert-FSDP splits a copy, it does not duplicate it)."""
    index = CheckpointIndex.open(qwen_ckpt)
    layout = find_experts(index)
    cluster = ClusterSpec.build(2, 4, ep, efsdp, red)
    for pl in _placements(ep, red):
        descs = synthesize_descs(layout, index, cluster)
        needs = compute_needs(descs, index, pl, 8)
        counts = {k: np.zeros(t.shape, dtype=np.int64) for k, t in index.tensors.items()}
        for n in needs:
            counts[n.key][box_slices(n.src)] += 1
        expert_of = {}
        for em in layout.experts:
            for p in em.params:
                for e in range(NUM_EXPERTS):
                    for k in p.keys(em.module, e):
                        expert_of[k] = (em.layer, e)
        for key, c in counts.items():
            want = 1 if key not in expert_of else int(pl.logcnt[expert_of[key]])
            assert (c == want).all(), (key, want, np.unique(c))


def test_plans_meet_lower_bounds_and_baselines_add_up(qwen_ckpt):
    index = CheckpointIndex.open(qwen_ckpt)
    layout = find_experts(index)
    cluster = ClusterSpec.build(2, 4, 4, 2, 4)
    topo = cluster.topology()
    pl = _placements(4, 4)[1]
    descs = synthesize_descs(layout, index, cluster)
    needs = need_table(descs, index, pl, 8)
    costs = plan_storage_modes(needs, index, topo, ("shared", "node", "single"), 1 << 20)
    total = index.total_bytes
    for c in costs:
        assert c.at_minimum() == {"read": True, "network": True, "cross_node": True}, c.name
    shared, node, single = costs
    assert shared.read_bytes_total == total == single.read_bytes_total == single.read_bytes_max_node
    assert node.cross_node_bytes == 0 and node.read_bytes_total >= total
    assert single.read_bytes_max_node == total
    r0, loop, p2p = baseline_costs(needs, descs, index, cluster)
    # rank 0 broadcasts every tensor to the 7 others, 4 of them on the other node.
    assert (r0.sent_bytes_max_rank, r0.cross_node_bytes, r0.recv_bytes_max_rank) == (7 * total, 4 * total, total)
    assert r0.num_collectives == len(index.tensors)
    # The loop broadcasts each rank's shard of every expert param to everyone: 7 x 8 x 2 x 2.
    assert loop.num_collectives == len(index.tensors) - NUM_LAYERS * NUM_EXPERTS * 3 + 7 * NUM_LAYERS * 2
    # node-local-p2p: each node reads everything; nothing crosses nodes.
    assert (p2p.read_bytes_total, p2p.read_bytes_max_node, p2p.cross_node_bytes) == (2 * total, total, 0)
    needed = sum(math.prod(ln for _, ln in n.src) * index.info(n.key).itemsize for n in needs.to_needs() if n.rank % 4)
    assert p2p.num_p2p_ops == sum(1 for n in needs.to_needs() if n.rank % 4)
    assert p2p.sent_bytes_max_rank * 2 >= needed >= p2p.sent_bytes_max_rank


def test_deepseek_v3_synthetic_index():
    index = synthetic_index(DEEPSEEK_V3)
    n = num_params(index)
    assert abs(n - 671e9) / 671e9 < 0.02, n  # the main model, without the MTP layer
    layout = find_experts(index)
    assert (layout.num_layers, layout.num_logical) == (58, 256)
    assert layout.experts[0].module == "model.layers.3.mlp.experts"
    names = [p.name for p in layout.experts[0].params]
    assert names == ["gate_up_proj", "gate_up_proj_weight_scale_inv", "down_proj", "down_proj_weight_scale_inv"]
    e = index.info("model.layers.3.mlp.experts.255.gate_proj.weight")
    assert (e.dtype, e.shape) == ("F8_E4M3", (2048, 7168))
    assert index.info("model.layers.3.mlp.experts.0.down_proj.weight_scale_inv").shape == (56, 16)
    assert index.info("model.layers.0.mlp.gate_proj.weight").shape == (18432, 7168)
    assert index.info("model.layers.60.self_attn.q_b_proj.weight").shape == (128 * 192, 1536)
    assert index.info("model.embed_tokens.weight").dtype == "BF16"
    assert "model.layers.61.mlp.experts.0.gate_proj.weight" not in index
    # save_pretrained-like shards of at most 5 GB, offsets increasing inside each file.
    assert 120 <= len(index.file_sizes) <= 160
    assert 600 * 2**30 < index.total_bytes < 700 * 2**30


def test_deepseek_v3_cli_json(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(DEEPSEEK_V3))
    rc = main(
        [
            "--synthetic-from-config",
            str(cfg),
            "--nodes",
            "2",
            "--ranks-per-node",
            "8",
            "--ep",
            "16",
            "--storage",
            "shared",
            "--bandwidth",
            "storage=5,intra=150,inter=25",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    rep = json.loads(out)
    assert rep["cluster"]["world_size"] == 16 and rep["cluster"]["slots_per_rank"] == 16
    names = [s["name"] for s in rep["strategies"]]
    assert names == ["moeshard shared", "rank0-broadcast", "chunk-broadcast-loop", "node-local-p2p"]
    ms = rep["strategies"][0]
    assert ms["at_minimum"] == {"read": True, "network": True, "cross_node": True}
    assert ms["bottleneck"] == "storage" and ms["time_s"] > 0
    # Shared storage at EP 16: every expert byte is read by the one rank that holds it.
    assert ms["read_bytes_total"] == rep["checkpoint"]["total_bytes"]
    assert ms["cross_node_bytes"] < 2**20


def test_table_output_and_rebalance(qwen_ckpt, tmp_path, capsys):
    rc = main(
        [qwen_ckpt, "--nodes", "2", "--ranks-per-node", "4", "--ep", "8", "--bandwidth", "storage=1,intra=100,inter=10"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    for name in (
        "moeshard shared",
        "moeshard node",
        "moeshard single",
        "rank0-broadcast",
        "chunk-broadcast-loop",
        "node-local-p2p",
        "bottleneck",
    ):
        assert name in out
    loads = np.random.default_rng(0).gamma(0.5, 100.0, size=(NUM_LAYERS, NUM_EXPERTS))
    np.save(tmp_path / "loads.npy", loads)
    rc = main(
        [
            qwen_ckpt,
            "--nodes",
            "2",
            "--ranks-per-node",
            "4",
            "--ep",
            "4",
            "--redundant",
            "4",
            "--rebalance",
            str(tmp_path / "loads.npy"),
            "--json",
        ]
    )
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0
    r = rep["relocation"]
    assert r["balance_after"] <= r["balance_before"]
    assert r["cost"]["network_bytes"] == r["cost"]["min_network_bytes"]
    assert r["cost"]["cross_node_bytes"] == r["cost"]["min_cross_node_bytes"]
    assert r["cost"]["copies"]["disk"] == 0


def _bad(tmp_path):
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((3, 8), dtype=np.int64))
    floats = tmp_path / "floats.npy"
    np.save(floats, np.zeros((NUM_LAYERS, 8)))
    dense = tmp_path / "dense"
    write_checkpoint(dense, [("w", torch.zeros(4, 4)), ("b", torch.zeros(4))])
    notmoe = tmp_path / "llama.json"
    notmoe.write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    base = ["--nodes", "2", "--ranks-per-node", "4"]
    return [
        (["/nonexistent/ckpt", *base, "--ep", "8"], "no such checkpoint"),
        ([str(dense), *base, "--ep", "8"], "not a MoE checkpoint"),
        (["{ckpt}", *base, "--ep", "3"], "does not divide"),  # EP vs world
        (["{ckpt}", "--nodes", "1", "--ranks-per-node", "6", "--ep", "6"], "does not divide the 8 expert slots"),
        (["{ckpt}", *base, "--ep", "4", "--efsdp", "4"], "ep=4 x efsdp=4"),
        (["{ckpt}", "--nodes", "2", "--ranks-per-node", "0", "--ep", "8"], "must be >= 1"),
        (["{ckpt}", *base, "--ep", "8", "--placement", str(wrong)], "phy2log has shape [3, 8]"),
        (["{ckpt}", *base, "--ep", "8", "--placement", str(floats)], "integer expert ids"),
        (["{ckpt}", *base, "--ep", "8", "--placement", str(tmp_path / "missing.npy")], "no such file"),
        (["{ckpt}", *base, "--ep", "8", "--bandwidth", "storage=1,intra=2"], "missing inter"),
        (["{ckpt}", *base, "--ep", "8", "--rebalance", str(wrong)], "loads have shape"),
        (["{ckpt}", *base], "--ep"),  # argparse: required
        (["--synthetic-from-config", str(notmoe), *base, "--ep", "8"], "not a MoE model"),
        (["--synthetic-from-config", str(garbage), *base, "--ep", "8"], "not a readable JSON config"),
        (["{ckpt}", "--synthetic-from-config", str(notmoe), *base, "--ep", "8"], "not both"),
    ]


def test_bad_inputs_exit_2_with_one_line(qwen_ckpt, tmp_path, capsys):
    for argv, fragment in _bad(tmp_path):
        argv = [a.replace("{ckpt}", qwen_ckpt) for a in argv]
        rc = main(argv)
        cap = capsys.readouterr()
        assert rc == 2, (argv, cap.err)
        assert cap.out == ""
        lines = cap.err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("moeshard plan: error: "), cap.err
        assert fragment in lines[0], (fragment, lines[0])
        assert "Traceback" not in cap.err


def test_parse_bandwidth_and_placement_roundtrip(qwen_ckpt):
    bw = parse_bandwidth("storage=2.5, intra=100,inter=25")
    assert (bw.storage, bw.intra, bw.inter) == (2.5e9, 100e9, 25e9)
    with pytest.raises(ValueError):
        parse_bandwidth("storage=-1,intra=1,inter=1")
    index = CheckpointIndex.open(qwen_ckpt)
    layout = find_experts(index)
    pl = _placements(4, 4)[1]
    assert make_placement(layout, ClusterSpec.build(1, 8, 4, 2, 4), pl.phy2log) == pl


def test_link_bytes():
    """A ring broadcast adds one hop per member; a rank's link load is max(sent, received)."""
    links = LinkBytes(Topology(4, 2))  # nodes {0, 1} and {2, 3}
    links.ring([0, 1, 2, 3], root=1, nbytes=10)  # 1 -> 0 (intra), 0 -> 2 (inter), 2 -> 3 (intra)
    assert links.max_rank() == (10, 10)
    links.add(1, 0, 7)  # rank 0 now receives 17 intra-node
    links.add(3, 1, 4)
    assert links.max_rank() == (17, 10)
    links.add(3, 0, 30)
    assert links.max_rank() == (17, 34)  # rank 0 receives 34 across nodes


MIXTRAL = {
    "model_type": "mixtral",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "num_local_experts": 8,
    "torch_dtype": "float16",
}
QWEN2_MOE = {
    "model_type": "qwen2_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "num_experts": 16,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [0],
    "tie_word_embeddings": True,
}


def test_synthetic_mixtral_and_qwen2_moe():
    index = synthetic_index(MIXTRAL)
    layout = find_experts(index)
    assert (layout.num_layers, layout.num_logical) == (3, 8)
    assert layout.experts[0].module == "model.layers.0.block_sparse_moe.experts"
    assert [p.name for p in layout.experts[0].params] == ["gate_up_proj", "down_proj"]  # w1 + w3, w2
    w2 = index.info("model.layers.2.block_sparse_moe.experts.7.w2.weight")
    assert (w2.dtype, w2.shape) == ("F16", (64, 128))
    assert index.info("model.layers.0.self_attn.k_proj.weight").shape == (2 * 16, 64)
    assert "lm_head.weight" in index

    index = synthetic_index(QWEN2_MOE)
    layout = find_experts(index)
    # decoder_sparse_step 2 makes layers 1 and 3 sparse; mlp_only_layers [0] changes nothing more.
    assert [em.module for em in layout.experts] == ["model.layers.1.mlp.experts", "model.layers.3.mlp.experts"]
    assert layout.num_logical == 16
    assert index.info("model.layers.1.mlp.shared_expert.down_proj.weight").shape == (64, 64)
    assert index.info("model.layers.1.mlp.shared_expert_gate.weight").shape == (1, 64)
    assert index.info("model.layers.0.mlp.gate_proj.weight").shape == (128, 64)
    assert index.info("model.layers.3.self_attn.q_proj.bias").shape == (64,)  # Qwen2's qkv bias
    assert "lm_head.weight" not in index  # tied embeddings


@pytest.mark.parametrize("enabled", [True, False])
def test_run_restores_the_garbage_collector(tmp_path, capsys, enabled):
    """Planning pauses the cyclic collector; the command leaves it as it found it, on success
    and on bad input."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MIXTRAL))
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        assert main(["--synthetic-from-config", str(cfg), "--nodes", "1", "--ranks-per-node", "4", "--ep", "4"]) == 0
        assert gc.isenabled() == enabled
        assert main(["--synthetic-from-config", str(cfg), "--nodes", "1", "--ranks-per-node", "4", "--ep", "3"]) == 2
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
    capsys.readouterr()
