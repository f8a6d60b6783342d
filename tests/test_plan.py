"""Tier 1: needs (layout.compute_needs) and the planner (plan.plan_transfers), pure.

Synthetic models are described as ParamDescs and checkpoints as CheckpointIndexes built from
headers only (no files). A small simulator walks a plan the way the executor does (per chunk:
reads, phase A, phase B; local reads) on numpy arrays holding unique ids for every checkpoint
element, and checks that every rank ends with exactly the values it should hold, each element
delivered exactly once, by a rank that really had it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from moeshard import HF_EXPERTS, Placement, Topology
from moeshard.box import box_numel, box_slices
from moeshard.io.header import DTYPES, TensorInfo
from moeshard.io.index import CheckpointIndex
from moeshard.models.describe import ExpertRef, ParamDesc
from moeshard.models.layout import compute_needs
from moeshard.plan import STAGING_PARTS, minimal_cost, plan_transfers

GATE_UP, DOWN = HF_EXPERTS.params


# -- synthetic models and checkpoints ---------------------------------------------------------


@dataclass
class Case:
    world: int
    lws: int
    descs: list[ParamDesc]
    index: CheckpointIndex
    placement: Placement | None
    values: dict[str, np.ndarray]  # checkpoint key -> unique element ids


def _chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """torch.chunk / DTensor Shard semantics: (offset, length) of chunk i of n split k ways."""
    size = -(-n // k)
    start = min(i * size, n)
    return start, min(size, n - start)


def build_case(
    world: int,
    lws: int,
    ep: int,
    efsdp: int,
    *,
    num_layers: int = 2,
    num_logical: int = 4,
    spr: int = 2,
    inter: int = 3,
    hidden: int = 4,
    expert_placements: str = "shard",  # "shard": (Shard(1), Shard(0)); "replicate": (Replicate(), Shard(0))
    dense: tuple[str, ...] = ("shard", "replicate", "plain"),
    seed: int = 0,
    ckpt_dtype: str = "BF16",
    redundant: bool = True,
    shuffle: bool = True,
) -> Case:
    """A model with ``num_layers`` MoE layers (gate_up_proj [P, 2I, H], down_proj [P, H, I])
    on an (efsdp, ep) mesh of the first ep*efsdp ranks, plus dense params."""
    rng = np.random.default_rng(seed)
    assert ep * efsdp <= world
    num_physical = ep * spr
    if num_physical < num_logical:
        num_logical = num_physical
    rows = []
    for _ in range(num_layers):
        base = np.arange(num_logical)
        extra = (
            rng.integers(0, num_logical, num_physical - num_logical)
            if redundant
            else np.arange(num_physical - num_logical) % num_logical
        )
        row = np.concatenate([base, extra])
        rows.append(rng.permutation(row) if shuffle else row)
    placement = Placement(np.stack(rows), num_logical=num_logical, num_ranks=ep)

    descs: list[ParamDesc] = []
    keys: dict[str, tuple[int, ...]] = {}
    mesh2 = np.arange(ep * efsdp).reshape(efsdp, ep)
    eplace = (Shard(1), Shard(0)) if expert_placements == "shard" else (Replicate(), Shard(0))
    if efsdp == 1 and expert_placements == "shard":
        mesh2, eplace = np.arange(ep), (Shard(0),)
    for layer in range(num_layers):
        module = f"layers.{layer}.mlp.experts"
        descs.append(
            ParamDesc(
                f"{module}.gate_up_proj",
                (num_physical, 2 * inter, hidden),
                torch.float32,
                mesh2,
                eplace,
                expert=ExpertRef(layer, module, GATE_UP),
            )
        )
        descs.append(
            ParamDesc(
                f"{module}.down_proj",
                (num_physical, hidden, inter),
                torch.float32,
                mesh2,
                eplace,
                expert=ExpertRef(layer, module, DOWN),
            )
        )
        for e in range(num_logical):
            keys[f"{module}.{e}.gate_proj.weight"] = (inter, hidden)
            keys[f"{module}.{e}.up_proj.weight"] = (inter, hidden)
            keys[f"{module}.{e}.down_proj.weight"] = (hidden, inter)
    for j, kind in enumerate(dense):
        name = f"dense{j}.weight"
        shape = (int(rng.integers(1, 9)), int(rng.integers(1, 4)))
        if kind == "shard":
            descs.append(ParamDesc(name, shape, torch.float32, np.arange(world), (Shard(0),), keys=(name,)))
        elif kind == "replicate":
            descs.append(ParamDesc(name, shape, torch.bfloat16, np.arange(world), (Replicate(),), keys=(name,)))
        else:
            descs.append(ParamDesc(name, shape, torch.float32, None, (), keys=(name,)))
        keys[name] = shape
    # Headers only: keys spread over a few files in a shuffled order.
    order = rng.permutation(len(keys))
    names = list(keys)
    tensors, sizes, values = {}, defaultdict(int), {}
    item = DTYPES[ckpt_dtype].itemsize
    next_id = 0
    for k in order:
        key = names[k]
        shape = keys[key]
        f = f"model-{k % 3:05d}.safetensors"
        tensors[key] = TensorInfo(f, 8 + sizes[f], ckpt_dtype, shape)
        sizes[f] += math.prod(shape) * item
        n = math.prod(shape)
        values[key] = np.arange(next_id, next_id + n, dtype=np.int64).reshape(shape)
        next_id += n
    index = CheckpointIndex("/nonexistent", tensors, {f: s + 8 for f, s in sizes.items()})
    return Case(world, lws, descs, index, placement, values)


def expected_locals(case: Case) -> dict[tuple[int, int], np.ndarray]:
    """What each rank must hold, computed from the descs and placement directly."""
    out = {}
    for i, d in enumerate(case.descs):
        if d.expert is not None:
            ref = d.expert
            p2l = case.placement.phy2log[ref.layer]
            slices = []
            for p in range(d.shape[0]):
                keys = ref.param.keys(ref.module, int(p2l[p]))
                slices.append(np.concatenate([case.values[k] for k in keys], axis=0))
            full = np.stack(slices)
        else:
            full = case.values[d.keys[0]]
        if d.mesh is None:
            for r in range(case.world):
                out[(r, i)] = full
            continue
        for coord in np.ndindex(*d.mesh.shape):
            r = int(d.mesh[coord])
            box = [(0, n) for n in d.shape]
            for mesh_dim, pl in enumerate(d.placements):
                if isinstance(pl, Shard):
                    box[pl.dim] = _chunk(d.shape[pl.dim], d.mesh.shape[mesh_dim], coord[mesh_dim])
            out[(r, i)] = full[box_slices(tuple(box))]
    return out


# -- the simulator ------------------------------------------------------------------------------


@dataclass
class SimResult:
    read_bytes: np.ndarray
    recv_bytes: np.ndarray
    sent_bytes: np.ndarray
    cross_node_bytes: int
    peak_staging: np.ndarray
    max_ops: int
    reads_per_piece: dict[int, list[int]]


def simulate(plan, case: Case, readers: np.ndarray) -> SimResult:
    """Replay ``plan`` (a Schedule) as the runner does, independently of the planner's own
    counters: round by round, reads at the start of a round, then P2P ops (a sender must hold
    the piece before the round), then node broadcasts (the root must hold it before); a rank
    holds a buffer from the round it gets it to the last round it sends it."""
    topo = plan.topology
    world = topo.world_size
    node = topo.nodes_array()
    exp = expected_locals(case)
    local = {k: np.full(v.shape, -1, dtype=np.int64) for k, v in exp.items()}
    count = {k: np.zeros(v.shape, dtype=np.int64) for k, v in exp.items()}
    read_bytes = np.zeros(world, dtype=np.int64)
    recv_bytes = np.zeros(world, dtype=np.int64)
    sent_bytes = np.zeros(world, dtype=np.int64)
    cross = 0
    max_ops_seen = 0
    reads_per_piece: dict[int, list[int]] = defaultdict(list)
    nbytes = plan.pieces.bytes.tolist()
    dlv: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (pid, r) in enumerate(zip(plan.deliveries.piece.tolist(), plan.deliveries.rank.tolist())):
        dlv[(r, pid)].append(i)

    def data(pid):
        return case.values[plan.piece_name(pid)][box_slices(plan.piece_box(pid))]

    def deliver(rank, pid, buf):
        assert (rank, pid) in dlv, f"piece {pid} delivered to rank {rank}, which does not need it"
        box = plan.piece_box(pid)
        for i in dlv[(rank, pid)]:
            param, slot = int(plan.deliveries.param[i]), int(plan.deliveries.slot[i])
            sl = tuple(slice(o, o + n) for o, (_, n) in zip(plan.deliveries.off[i].tolist(), box))
            target = local[(rank, param)][slot] if slot >= 0 else local[(rank, param)]
            target[sl] = buf
            (count[(rank, param)][slot] if slot >= 0 else count[(rank, param)])[sl] += 1

    held: dict[tuple[int, int], np.ndarray] = {}
    reads_at = defaultdict(list)
    for r, pid, t in zip(plan.reads.rank.tolist(), plan.reads.piece.tolist(), plan.reads.round.tolist()):
        assert readers[r], f"rank {r} cannot read but the plan has it read piece {pid}"
        read_bytes[r] += nbytes[pid]
        reads_per_piece[pid].append(r)
        if t < 0:  # a local read: the reader is the piece's only needer in its scope
            deliver(r, pid, data(pid))
        else:
            reads_at[t].append((r, pid))
    sends_at, bcasts_at = defaultdict(list), defaultdict(list)
    sends = plan.sends
    for row in zip(sends.src.tolist(), sends.dst.tolist(), sends.piece.tolist(), sends.round.tolist()):
        sends_at[row[3]].append(row[:3])
    bcasts = plan.bcasts
    for row in zip(bcasts.node.tolist(), bcasts.root.tolist(), bcasts.piece.tolist(), bcasts.round.tolist()):
        bcasts_at[row[3]].append(row[:3])
    # Buffer lifetimes: from the round a rank gets a piece to the last round it sends it.
    last_send: dict[tuple[int, int], int] = {}
    for t in range(plan.num_rounds):
        for src, _, pid in sends_at[t]:
            last_send[(src, pid)] = t
        for _, root, pid in bcasts_at[t]:
            last_send[(root, pid)] = t
    live: dict[int, dict[int, int]] = defaultdict(dict)  # rank -> {piece: bytes}
    peak = np.zeros(world, dtype=np.int64)
    for t in range(plan.num_rounds):
        assert sends_at[t] or bcasts_at[t], f"round {t} is empty"
        for r, pid in reads_at[t]:
            held[(r, pid)] = data(pid)
            live[r][pid] = nbytes[pid]
            if (r, pid) in dlv:
                deliver(r, pid, held[(r, pid)])
        ops = np.zeros(world, dtype=np.int64)
        new = {}
        for src, dst, pid in sends_at[t]:
            assert (src, pid) in held, f"rank {src} sends piece {pid} it does not hold yet"
            assert (dst, pid) not in held and (dst, pid) not in new, "piece received twice"
            new[(dst, pid)] = held[(src, pid)]
            ops[src] += 1
            ops[dst] += 1
            sent_bytes[src] += nbytes[pid]
            recv_bytes[dst] += nbytes[pid]
            if node[src] != node[dst]:
                cross += nbytes[pid]
        max_ops_seen = max(max_ops_seen, int(ops.max(initial=0)))
        for n, root, pid in bcasts_at[t]:
            assert (root, pid) in held, f"rank {root} broadcasts piece {pid} it does not hold"
            assert node[root] == n
            for r in topo.node_ranks(n):
                if r == root:
                    continue
                assert (r, pid) not in held and (r, pid) not in new, "piece received twice"
                new[(r, pid)] = held[(root, pid)]
                sent_bytes[root] += nbytes[pid]
                recv_bytes[r] += nbytes[pid]
        for (r, pid), buf in new.items():
            held[(r, pid)] = buf
            live[r][pid] = nbytes[pid]
            deliver(r, pid, buf)
        for r, bufs in live.items():
            peak[r] = max(peak[r], sum(bufs.values()))
        for r in list(live):
            for pid in [p for p in live[r] if last_send.get((r, p), -1) <= t]:
                del live[r][pid]

    # Every rank holds exactly what it should, every element written exactly once.
    for k, want in exp.items():
        assert (count[k] == 1).all(), (
            f"rank {k[0]} param {case.descs[k[1]].name}: elements delivered {np.unique(count[k])} times"
        )
        np.testing.assert_array_equal(local[k], want, err_msg=f"rank {k[0]} param {case.descs[k[1]].name}")
    return SimResult(read_bytes, recv_bytes, sent_bytes, cross, peak, max_ops_seen, reads_per_piece)


MODES = {
    "shared": lambda world: (np.ones(world, bool), "job"),
    "node": lambda world: (np.ones(world, bool), "node"),
    "single": lambda world: (np.eye(1, world, 0, dtype=bool)[0], "job"),
}


def check_plan(case: Case, mode: str, staging_bytes: int = 1 << 20, max_ops: int = 64, topo: Topology | None = None):
    world, lws = case.world, case.lws
    topo = topo or Topology(world, lws)
    readers, scope = MODES[mode](world)
    needs = compute_needs(case.descs, case.index, case.placement, world)
    plan = plan_transfers(needs, case.index, topo, readers, scope=scope, staging_bytes=staging_bytes, max_ops=max_ops)
    sim = simulate(plan, case, readers)
    node = topo.nodes_array()

    # Storage reads: each piece once per scope.
    needers = defaultdict(set)
    for pid, r in zip(plan.deliveries.piece.tolist(), plan.deliveries.rank.tolist()):
        needers[pid].add(r)
    for pid in range(plan.num_pieces):
        ranks = sorted(needers[pid])
        got = sorted(sim.reads_per_piece[pid])
        need_nodes = np.unique(node[ranks])
        if scope == "job":
            assert len(got) == 1
        else:
            assert sorted(node[got].tolist()) == need_nodes.tolist()
        if mode == "single":
            assert got == [0]
        if readers[ranks].any() and scope == "job":
            assert got[0] in ranks  # a reader that needs it reads it

    # Costs: the plan's counters are what the simulation saw, and they are minimal.
    minimal = minimal_cost(needs, case.index, topo, readers, scope)
    assert minimal == minimal_cost(plan.needs, case.index, topo, readers, scope)
    assert int(sim.read_bytes.sum()) == minimal["read_bytes"]
    assert int(sim.recv_bytes.sum()) == minimal["network_bytes"]
    assert sim.cross_node_bytes == minimal["cross_node_bytes"]
    if mode == "node":
        assert sim.cross_node_bytes == 0
    np.testing.assert_array_equal(plan.cost.read_bytes, sim.read_bytes)
    np.testing.assert_array_equal(plan.cost.recv_bytes, sim.recv_bytes)
    np.testing.assert_array_equal(plan.cost.sent_bytes, sim.sent_bytes)
    np.testing.assert_array_equal(plan.cost.peak_staging_bytes, sim.peak_staging)
    assert plan.cost.cross_node_bytes == sim.cross_node_bytes
    # A rank holding two copies of one expert gets the piece once (one (rank, piece) delivery).
    total_needed = sum(
        box_numel(src) * case.index.info(key).itemsize for _, key, src in {(n.rank, n.key, n.src) for n in needs}
    )
    held_locally = sum(
        int(plan.pieces.bytes[p])
        for r, p in zip(plan.reads.rank.tolist(), plan.reads.piece.tolist())
        if r in needers[p]
    )
    assert held_locally + int(sim.recv_bytes.sum()) == total_needed
    # Budgets.
    assert sim.peak_staging.max(initial=0) <= staging_bytes
    assert sim.max_ops <= max_ops
    assert (plan.pieces.bytes <= staging_bytes // STAGING_PARTS).all()
    # Determinism.
    again = plan_transfers(needs, case.index, topo, readers, scope=scope, staging_bytes=staging_bytes, max_ops=max_ops)
    assert again.fingerprint == plan.fingerprint and plan.fingerprint
    return plan, sim


# -- tests ------------------------------------------------------------------------------------

SMALL = [
    # world, lws, ep, efsdp, expert placements
    (1, 1, 1, 1, "shard"),
    (2, 1, 2, 1, "shard"),
    (2, 2, 2, 1, "shard"),
    (4, 2, 4, 1, "shard"),
    (4, 2, 2, 2, "shard"),
    (4, 2, 2, 2, "replicate"),
    (4, 4, 2, 2, "shard"),
    (6, 3, 3, 2, "shard"),
    (6, 3, 2, 3, "shard"),
    (8, 4, 4, 2, "shard"),
    (8, 4, 2, 4, "replicate"),
    (8, 2, 8, 1, "shard"),
    (8, 1, 4, 2, "shard"),
    (12, 4, 4, 3, "shard"),
    (16, 8, 8, 2, "shard"),
    (16, 4, 4, 2, "shard"),  # experts on the first 8 ranks only
]


@pytest.mark.parametrize("mode", ["shared", "node", "single"])
@pytest.mark.parametrize("world, lws, ep, efsdp, eplace", SMALL)
def test_plan_covers_needs_minimal_cost(world, lws, ep, efsdp, eplace, mode):
    case = build_case(world, lws, ep, efsdp, expert_placements=eplace, seed=world * 31 + ep)
    check_plan(case, mode)


@pytest.mark.parametrize("mode", ["shared", "node", "single"])
@pytest.mark.parametrize(
    "nodes, ep, efsdp", [((0, 0, 0, 0, 1, 1), 6, 1), ((0, 0, 0, 1, 1, 1, 1), 7, 1), ((0, 0, 1, 1, 1, 2, 2, 2), 4, 2)]
)
def test_plan_uneven_nodes(nodes, ep, efsdp, mode):
    """A process group of some of a job's ranks (the survivors of a lost rank) has nodes of
    different sizes: the schedule still delivers every element once at the lower bounds, node
    broadcasts go to the whole of a node of any size."""
    topo = Topology.from_nodes(nodes)
    assert topo.nodes == nodes
    case = build_case(len(nodes), 1, ep, efsdp, seed=len(nodes) * 7 + ep)
    plan, _ = check_plan(case, mode, topo=topo)
    if mode != "single":
        assert plan.has_broadcasts or mode == "shared"


def test_uneven_topology():
    assert Topology.from_nodes([5, 5, 9, 9]) == Topology(4, 2)  # the plain form where it is one
    t = Topology.from_nodes([3, 3, 3, 1, 1], rank=4)
    assert (t.num_nodes, t.node, t.local_rank, list(t.node_ranks(1)), t.local_world_size) == (2, 1, 1, [3, 4], 3)
    with pytest.raises(ValueError, match="with none left out"):
        Topology(3, 2, nodes=(0, 2, 2))
    with pytest.raises(ValueError, match="contiguous"):
        check_plan(build_case(4, 1, 4, 1, seed=3), "shared", topo=Topology.from_nodes([0, 1, 0, 1]))


@pytest.mark.parametrize("mode", ["shared", "node", "single"])
@pytest.mark.parametrize("world, lws, ep, efsdp", [(64, 8, 16, 4), (128, 8, 128, 1), (256, 16, 64, 4)])
def test_plan_large_worlds(world, lws, ep, efsdp, mode):
    case = build_case(
        world,
        lws,
        ep,
        efsdp,
        num_layers=1,
        num_logical=8,
        spr=1,
        inter=1,
        hidden=2,
        seed=world,
        dense=("shard", "replicate"),
    )
    plan, _ = check_plan(case, mode)
    if mode == "shared":
        # Reads are spread over many ranks, not funnelled through one.
        assert (plan.cost.read_bytes > 0).sum() > 8


@pytest.mark.parametrize("mode", ["shared", "node", "single"])
def test_plan_1024_ranks(mode):
    case = build_case(
        1024,
        8,
        256,
        4,
        num_layers=1,
        num_logical=16,
        spr=1,
        inter=1,
        hidden=1,
        seed=7,
        dense=("shard", "replicate", "plain"),
        ckpt_dtype="F32",
    )
    plan, _ = check_plan(case, mode)
    assert plan.topology.world_size == 1024


@pytest.mark.parametrize("mode", ["shared", "node", "single"])
@pytest.mark.parametrize("staging_bytes, max_ops", [(44, 2), (60, 3), (100, 4), (200, 8)])
def test_tiny_staging_budget_splits_pieces(staging_bytes, max_ops, mode):
    case = build_case(8, 4, 4, 2, inter=3, hidden=5, seed=staging_bytes, ckpt_dtype="F32")
    plan, _ = check_plan(case, mode, staging_bytes=staging_bytes, max_ops=max_ops)
    needs = compute_needs(case.descs, case.index, case.placement, 8)
    # Pieces were split: more pieces than distinct (key, box) needs, and the plan's needs
    # partition the original ones.
    assert plan.num_pieces > len({(n.key, n.src) for n in needs})
    assert int(plan.needs.src_len.prod(axis=1).sum()) == sum(box_numel(n.src) for n in needs)
    assert plan.num_rounds > 1


def test_contiguous_and_unshuffled_placement():
    for redundant in (False, True):
        case = build_case(8, 4, 4, 2, redundant=redundant, shuffle=False, seed=3)
        check_plan(case, "shared")
        check_plan(case, "single")


def test_mixed_readers_and_plan_is_pure_function_of_inputs():
    case = build_case(8, 2, 4, 2, seed=11)
    topo = Topology(8, 2)
    needs = compute_needs(case.descs, case.index, case.placement, 8)
    readers = np.array([0, 1, 0, 0, 1, 0, 0, 0], bool)  # nodes 0 and 2 have a reader
    plan = plan_transfers(needs, case.index, topo, readers, scope="job")
    sim = simulate(plan, case, readers)
    minimal = minimal_cost(needs, case.index, topo, readers, "job")
    assert int(sim.read_bytes.sum()) == minimal["read_bytes"]
    assert sim.read_bytes[~readers].sum() == 0
    assert int(sim.recv_bytes.sum()) == minimal["network_bytes"]
    assert sim.cross_node_bytes == minimal["cross_node_bytes"]
    # A different staging budget or topology is a different plan.
    other = plan_transfers(needs, case.index, Topology(8, 4), np.ones(8, bool), scope="job")
    assert other.fingerprint != plan.fingerprint


def test_needs_of_one_rank_match_expected_boxes():
    """compute_needs for one expert param, checked by hand."""
    case = build_case(4, 2, 2, 2, num_layers=1, num_logical=3, spr=2, inter=2, hidden=3, dense=(), seed=5)
    needs = compute_needs(case.descs, case.index, case.placement, 4)
    p2l = case.placement.phy2log[0]
    # gate_up_proj [4, 4, 3] on mesh (efsdp=2, ep=2): rank 3 = (efsdp 1, ep 1) holds slots 2..3,
    # rows 2..3 of the fused dim = the up_proj of each slot's expert.
    mine = sorted((n for n in needs if n.rank == 3 and n.param == 0), key=lambda n: n.dest)
    assert [(n.key, n.src, n.dest) for n in mine] == [
        (f"layers.0.mlp.experts.{p2l[2]}.up_proj.weight", ((0, 2), (0, 3)), ((0, 1), (0, 2), (0, 3))),
        (f"layers.0.mlp.experts.{p2l[3]}.up_proj.weight", ((0, 2), (0, 3)), ((1, 1), (0, 2), (0, 3))),
    ]
    # down_proj [4, 3, 2]: efsdp splits dim 1 (3 rows) as 2 + 1.
    mine = sorted((n for n in needs if n.rank == 1 and n.param == 1), key=lambda n: n.dest)
    assert [(n.key, n.src, n.dest) for n in mine] == [
        (f"layers.0.mlp.experts.{p2l[2]}.down_proj.weight", ((0, 2), (0, 2)), ((0, 1), (0, 2), (0, 2))),
        (f"layers.0.mlp.experts.{p2l[3]}.down_proj.weight", ((0, 2), (0, 2)), ((1, 1), (0, 2), (0, 2))),
    ]


# -- errors ---------------------------------------------------------------------------------


def test_compute_needs_errors():
    case = build_case(4, 2, 2, 2, seed=1)
    idx = case.index
    # Missing dense key.
    t = dict(idx.tensors)
    del t["dense0.weight"]
    with pytest.raises(ValueError, match="dense0.weight: checkpoint /nonexistent has no tensor 'dense0.weight'"):
        compute_needs(case.descs, CheckpointIndex(idx.root, t, idx.file_sizes), case.placement, 4)
    # Missing expert key.
    t = dict(idx.tensors)
    del t["layers.1.mlp.experts.2.up_proj.weight"]
    with pytest.raises(
        ValueError, match=r"no tensor 'layers\.1\.mlp\.experts\.2\.up_proj\.weight' \(logical expert 2\)"
    ):
        compute_needs(case.descs, CheckpointIndex(idx.root, t, idx.file_sizes), case.placement, 4)
    # Wrong dense shape.
    t = dict(idx.tensors)
    info = t["dense1.weight"]
    t["dense1.weight"] = TensorInfo(info.file, info.offset, info.dtype, (info.shape[0] + 1, info.shape[1]))
    with pytest.raises(ValueError, match="checkpoint tensor 'dense1.weight' has shape"):
        compute_needs(case.descs, CheckpointIndex(idx.root, t, idx.file_sizes), case.placement, 4)
    # Wrong expert shape.
    t = dict(idx.tensors)
    t["layers.0.mlp.experts.1.down_proj.weight"] = TensorInfo("f", 8, "BF16", (4, 9))
    with pytest.raises(ValueError, match=r"'layers\.0\.mlp\.experts\.1\.down_proj\.weight' has shape \[4, 9\]"):
        compute_needs(case.descs, CheckpointIndex(idx.root, t, idx.file_sizes), case.placement, 4)
    # An expert whose parts are split differently from expert 0's (same total).
    t = dict(idx.tensors)
    t["layers.1.mlp.experts.2.gate_proj.weight"] = TensorInfo("f", 8, "BF16", (4, 4))
    t["layers.1.mlp.experts.2.up_proj.weight"] = TensorInfo("f", 8, "BF16", (2, 4))
    with pytest.raises(
        ValueError,
        match=r"\['layers\.1\.mlp\.experts\.2\.gate_proj\.weight', "
        r"'layers\.1\.mlp\.experts\.2\.up_proj\.weight'\] of logical expert 2 "
        r"differ in shape from expert 0's",
    ):
        compute_needs(case.descs, CheckpointIndex(idx.root, t, idx.file_sizes), case.placement, 4)
    # Parts that do not add up to the fused size.
    t["layers.1.mlp.experts.2.up_proj.weight"] = TensorInfo("f", 8, "BF16", (1, 4))
    with pytest.raises(ValueError, match=r"of logical expert 2 have sizes \[4, 1\] along dim 0, summing to 5, not 6"):
        compute_needs(case.descs, CheckpointIndex(idx.root, t, idx.file_sizes), case.placement, 4)
    # Integer dtype for a float param.
    t = dict(idx.tensors)
    info = t["dense0.weight"]
    t["dense0.weight"] = TensorInfo(info.file, info.offset, "I32", info.shape)
    with pytest.raises(ValueError, match="'dense0.weight' has dtype I32, which cannot be cast"):
        compute_needs(case.descs, CheckpointIndex(idx.root, t, idx.file_sizes), case.placement, 4)
    # The checkpoint has more experts than the placement.
    with pytest.raises(ValueError, match="the checkpoint has expert 3 .* placement has only 3 logical experts"):
        small = Placement(np.array([[0, 1, 2, 0]] * 2), num_logical=3, num_ranks=2)
        compute_needs(case.descs, idx, small, 4)
    # num_physical disagrees with the model.
    with pytest.raises(ValueError, match="has 4 expert slots per layer, the placement has 8"):
        compute_needs(case.descs, idx, Placement.contiguous(2, 4, 2, 4), 4)
    # MoE layers disagree.
    with pytest.raises(ValueError, match="the model has 2 MoE layers, the placement describes 3"):
        compute_needs(case.descs, idx, Placement.contiguous(3, 4, 2), 4)
    # A mesh naming a rank outside the world.
    with pytest.raises(ValueError, match="names rank 3 >= world size 3"):
        compute_needs(case.descs, idx, case.placement, 3)


def test_plan_errors():
    case = build_case(4, 2, 2, 2, seed=2)
    needs = compute_needs(case.descs, case.index, case.placement, 4)
    topo = Topology(4, 2)
    with pytest.raises(ValueError, match="no rank can read"):
        plan_transfers(needs, case.index, topo, np.zeros(4, bool))
    with pytest.raises(ValueError, match=r"readers must be bool\[4\]"):
        plan_transfers(needs, case.index, topo, np.ones(3, bool))
    with pytest.raises(ValueError, match="node 1 needs .* none of its ranks can read"):
        plan_transfers(needs, case.index, topo, np.array([1, 1, 0, 0], bool), scope="node")
    with pytest.raises(ValueError, match="cannot hold one element"):
        plan_transfers(needs, case.index, topo, np.ones(4, bool), staging_bytes=1)
    with pytest.raises(ValueError, match="max_ops"):
        plan_transfers(needs, case.index, topo, np.ones(4, bool), max_ops=1)
    with pytest.raises(ValueError, match="must divide world_size"):
        Topology(6, 4)


@pytest.mark.parametrize("mode", ["shared", "single"])
def test_wide_fanout_is_split_into_batches_of_max_ops(mode):
    """One replicated piece needed on 32 nodes: the reader's 31 cross-node sends do not fit
    in one batch of max_ops=4, so they are spread over several rounds."""
    case = build_case(
        64,
        2,
        8,
        1,
        num_layers=1,
        num_logical=8,
        spr=1,
        inter=1,
        hidden=1,
        dense=("replicate", "plain"),
        seed=4,
        ckpt_dtype="F32",
    )
    plan, sim = check_plan(case, mode, max_ops=4)
    rounds_per_piece = defaultdict(set)
    for pid, t in zip(plan.sends.piece.tolist(), plan.sends.round.tolist()):
        rounds_per_piece[pid].add(t)
    assert max(len(v) for v in rounds_per_piece.values()) > 2
    assert sim.max_ops <= 4
    assert plan.cost.num_batches >= 8


def _minimal_cost_reference(needs, index, topology, readers, scope):
    """The original per-piece loop of minimal_cost (a reference for the vectorized one)."""
    readers = np.asarray(readers, dtype=bool)
    node = topology.nodes_array()
    by_piece = defaultdict(set)
    for n in needs:
        by_piece[(n.key, n.src)].add(n.rank)
    read = net = cross = 0
    for (key, src), ranks in by_piece.items():
        nbytes = box_numel(src) * index.info(key).itemsize
        r = np.fromiter(sorted(ranks), dtype=np.int64)
        nodes = np.unique(node[r])
        if scope == "job":
            read += nbytes
            net += (len(r) - int(readers[r].any())) * nbytes
            cross += (len(nodes) - int(bool(np.isin(node[readers], nodes).any()))) * nbytes
        else:
            for n in nodes:
                rn = r[node[r] == n]
                read += nbytes
                net += (len(rn) - int(readers[rn].any())) * nbytes
    return {"read_bytes": read, "network_bytes": net, "cross_node_bytes": cross}


@pytest.mark.parametrize(
    "world, lws, ep, efsdp, eplace", SMALL + [(64, 8, 16, 4, "shard"), (128, 4, 32, 4, "replicate")]
)
def test_minimal_cost_matches_reference(world, lws, ep, efsdp, eplace):
    case = build_case(world, lws, ep, efsdp, expert_placements=eplace, seed=world + 3 * ep)
    topo = Topology(world, lws)
    needs = compute_needs(case.descs, case.index, case.placement, world)
    rng = np.random.default_rng(world)
    mixed = rng.random(world) < 0.3
    mixed[rng.integers(world)] = True
    for readers in (np.ones(world, bool), np.arange(world) == 0, np.arange(world) == world - 1, mixed):
        for scope in ("job", "node"):
            got = minimal_cost(needs, case.index, topo, readers, scope)
            assert got == _minimal_cost_reference(needs, case.index, topo, readers, scope)
            assert all(type(v) is int for v in got.values())
    assert minimal_cost([], case.index, topo, np.ones(world, bool)) == {
        "read_bytes": 0,
        "network_bytes": 0,
        "cross_node_bytes": 0,
    }
    with pytest.raises(ValueError, match="scope must be"):
        minimal_cost(needs, case.index, topo, np.ones(world, bool), "rack")
