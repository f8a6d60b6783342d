"""Tier 1: the reshard planner (pure). Holdings and needs of random dense and expert layouts are
planned, the schedule is run by a numpy simulator (copies from views, sends from views, storage
cells from the "checkpoint"), and every new local tensor must equal the global tensor's box."""

from __future__ import annotations

import numpy as np
import pytest

import reshard_plan_reference as reference
from moeshard.models.shards import shard_boxes
from moeshard.plan.reshard import BoxRows, Units, plan_reshard
from moeshard.topology import Topology

WIDTH = 3


def _rows(tensors, world, rank_map, phy2log, unit_ids):
    """BoxRows of layouts ``[(name, shape, mesh_shape or None, placements, layer)]`` (meshes of
    ranks 0..n-1 in row-major order), ranks mapped by ``rank_map``."""
    cols = {k: [] for k in ("unit", "rank", "param", "slot", "off", "len")}
    for j, (name, shape, mesh_shape, placements, layer) in enumerate(tensors):
        if mesh_shape is None:
            boxes = np.broadcast_to(
                np.stack([np.zeros(len(shape), np.int64), np.asarray(shape)], -1), (world, len(shape), 2)
            )
        else:
            boxes = shard_boxes(shape, mesh_shape, placements)
        for r, box in enumerate(boxes):
            nr = rank_map[r]
            if nr < 0 or (box[:, 1] == 0).any():
                continue
            if layer < 0:
                items = [(unit_ids.setdefault(name, len(unit_ids)), -1, box)]
            else:
                items = [
                    (unit_ids.setdefault(f"{name}[{phy2log[layer, s]}]", len(unit_ids)), k, box[1:])
                    for k, s in enumerate(range(box[0, 0], box[0, 0] + box[0, 1]))
                    if phy2log[layer, s] >= 0
                ]
            for u, slot, b in items:
                off, ln = np.zeros(WIDTH, np.int64), np.ones(WIDTH, np.int64)
                off[: len(b)], ln[: len(b)] = b[:, 0], b[:, 1]
                for k, v in zip(("unit", "rank", "param", "slot", "off", "len"), (u, nr, j, slot, off, ln)):
                    cols[k].append(v)
    n = len(cols["unit"])
    a = {k: np.asarray(cols[k], np.int64) for k in ("unit", "rank", "param", "slot")}
    off = np.stack(cols["off"]) if n else np.zeros((0, WIDTH), np.int64)
    ln = np.stack(cols["len"]) if n else np.zeros((0, WIDTH), np.int64)
    return BoxRows(a["unit"], a["rank"], a["param"], a["slot"], off, ln, np.zeros((n, WIDTH), np.int64))


def _locals(tensors, world, phy2log, values):
    """Each rank's local arrays of the layouts (expert params ``[local slots, *slice]``)."""
    out = [dict() for _ in range(world)]
    for j, (name, shape, mesh_shape, placements, layer) in enumerate(tensors):
        boxes = (
            np.broadcast_to(np.stack([np.zeros(len(shape), np.int64), np.asarray(shape)], -1), (world, len(shape), 2))
            if mesh_shape is None
            else shard_boxes(shape, mesh_shape, placements)
        )
        for r, box in enumerate(boxes):
            if layer < 0:
                full = values[name]
            else:
                full = np.stack(
                    [values[f"{name}[{e}]"] if e >= 0 else np.full(shape[1:], np.nan) for e in phy2log[layer]]
                )
            out[r][j] = full[tuple(slice(o, o + n) for o, n in box)].copy()
    return out


def _simulate(plan, old_locals, new_shapes, storage_values):
    s = plan.schedule
    world = s.topology.world_size
    new = [{j: np.full(sh, np.nan) for j, sh in new_shapes[r].items()} for r in range(world)]

    def at(tensors, param, slot, off, pid):
        nd = int(s.key_ndim[s.pieces.key[pid]])
        t = tensors[param] if slot < 0 else tensors[param][slot]
        return t[tuple(slice(o, o + n) for o, n in zip(off[:nd], s.pieces.len[pid, :nd]))]

    data = {}
    for c in range(len(s.copies.view)):
        v, pid = int(s.copies.view[c]), int(s.copies.piece[c])
        r = int(s.views.rank[v])
        data[(pid, r)] = at(old_locals[r], s.views.param[v], s.views.slot[v], s.views.off[v], pid).copy()
    for i in range(len(s.sends.src)):
        v, pid = int(s.sends.view[i]), int(s.sends.piece[i])
        assert s.views.rank[v] == s.sends.src[i]
        src = old_locals[s.sends.src[i]]
        data[(pid, int(s.sends.dst[i]))] = at(src, s.views.param[v], s.views.slot[v], s.views.off[v], pid).copy()
    for i in range(len(s.deliveries.piece)):
        pid, r = int(s.deliveries.piece[i]), int(s.deliveries.rank[i])
        at(new[r], s.deliveries.param[i], s.deliveries.slot[i], s.deliveries.off[i], pid)[...] = data[(pid, r)]
    st = plan.storage
    for i in range(len(st)):
        u = plan.schedule.keys[st.unit[i]]
        nd = int(s.key_ndim[st.unit[i]])
        src = storage_values[u][tuple(slice(o, o + n) for o, n in zip(st.off[i, :nd], st.len[i, :nd]))]
        t = new[st.rank[i]][st.param[i]]
        t = t if st.slot[i] < 0 else t[st.slot[i]]
        t[tuple(slice(o, o + n) for o, n in zip(st.dst[i, :nd], st.len[i, :nd]))] = src
    return new


def _case(
    seed: int, old_world: int, new_world: int, alive: list[int], staging: int, w_replicas: int = 2, planner=plan_reshard
):
    rng = np.random.default_rng(seed)
    layers, logical = 2, 6
    old_slots, new_slots = old_world * 3, new_world * 4

    def p2l(slots):
        extra = rng.integers(0, logical, slots - logical)
        return np.stack([rng.permutation(np.concatenate([np.arange(logical), extra])) for _ in range(layers)])

    old_p2l, new_p2l = p2l(old_slots), p2l(new_slots)

    def layout(world, slots, replicate, w_replicas=1):
        return [
            ("embed", (10, 4), (replicate, world // replicate), (None, 0), -1),
            ("norm", (4,), None, (), -1),
            ("w", (7, 3), (w_replicas, world // w_replicas), (None, 1), -1),
            ("experts.0", (slots, 4, 6), (world,), (0,), 0),
            ("experts.1", (slots, 4, 6), (world // 2, 2), (1, 0), 1),
        ]

    old_t = layout(old_world, old_slots, 2, w_replicas)
    new_t = layout(new_world, new_slots, 1)
    values = {"embed": rng.standard_normal((10, 4)), "norm": rng.standard_normal(4), "w": rng.standard_normal((7, 3))}
    for name in ("experts.0", "experts.1"):
        for e in range(logical):
            values[f"{name}[{e}]"] = rng.standard_normal((4, 6))
    rank_map = np.full(old_world, -1)
    rank_map[alive] = np.arange(len(alive)) if new_world == len(alive) else alive
    units: dict[str, int] = {}
    holds = _rows(old_t, old_world, rank_map, old_p2l, units)
    needs = _rows(new_t, new_world, np.arange(new_world), new_p2l, units)
    keys = tuple(units)
    ndim = np.asarray([1 if k == "norm" else 2 for k in keys], np.int64)
    u = Units(keys, ndim, np.full(len(keys), 8, np.int64), np.asarray(["[" not in k for k in keys]))
    topo = Topology(new_world, 2)
    plan = planner(u, holds, needs, topo, staging, 4)
    old_locals_all = _locals(old_t, old_world, old_p2l, values)
    old_locals = [None] * new_world
    for r in range(old_world):
        if rank_map[r] >= 0:
            old_locals[rank_map[r]] = old_locals_all[r]
    want = _locals(new_t, new_world, new_p2l, values)
    shapes = [{j: a.shape for j, a in w.items()} for w in want]
    got = _simulate(plan, old_locals, shapes, values)
    return plan, got, want, old_p2l, rank_map


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("case", ["resize", "loss"])
def test_plan_fills_every_new_tensor(seed, case):
    if case == "resize":  # every old rank alive: 4 -> 4 other layout (ranks the same)
        plan, got, want, _, _ = _case(seed, 4, 4, [0, 1, 2, 3], staging=64 + 32 * seed)
        assert plan.storage_bytes == 0 and len(plan.storage) == 0
    else:  # ranks 2, 3 lost: 4 -> 2
        plan, got, want, old_p2l, _ = _case(seed, 4, 2, [0, 1], staging=64 + 32 * seed)
        # HSDP replicas keep every dense box. Layer 0 (experts whole on one rank each): exactly the
        # experts only on ranks 2, 3 are read. Layer 1 (mesh (2, 2): dim 1 halves on ranks 0, 1 and
        # 2, 3): every expert's second half is read, and only it.
        assert plan.dense_from_storage == ()
        lost0 = {f"experts.0[{e}]" for e in range(6) if set(np.flatnonzero(old_p2l[0] == e) // 3) <= {2, 3}}
        assert {k for k, _ in plan.storage_boxes} == lost0 | {f"experts.1[{e}]" for e in range(6)}
        assert {box for k, box in plan.storage_boxes if k.startswith("experts.1")} == {((2, 2), (0, 6))}
        assert plan.storage_bytes == len(lost0) * 4 * 6 * 8 + 6 * 2 * 6 * 8
    for r in range(len(want)):
        for j in want[r]:
            np.testing.assert_array_equal(got[r][j], want[r][j], err_msg=f"rank {r} tensor {j}")
    s = plan.schedule
    assert (s.cost.peak_staging_bytes <= max(s.staging_bytes, int(s.pieces.bytes.max(initial=0)))).all()


def test_plan_prefers_own_then_same_node():
    plan, _, _, _, _ = _case(0, 4, 4, [0, 1, 2, 3], staging=1 << 20)
    s = plan.schedule
    # a piece a rank holds itself is never sent to it; sends prefer the receiver's node
    own = {(int(s.copies.piece[c]), int(s.views.rank[s.copies.view[c]])) for c in range(len(s.copies.piece))}
    assert not own & {(int(p), int(d)) for p, d in zip(s.sends.piece, s.sends.dst)}
    assert own  # the norm (held whole everywhere) at least
    node = np.asarray([0, 0, 1, 1])
    assert s.cost.cross_node_bytes < int(s.pieces.bytes[s.sends.piece].sum())
    assert (node[s.sends.src] == node[s.sends.dst]).any()


def test_plan_is_deterministic_and_dense_loss_is_named():
    a, got, want, _, _ = _case(3, 4, 2, [0, 1], staging=96, w_replicas=1)
    b, _, _, _, _ = _case(3, 4, 2, [0, 1], staging=96, w_replicas=1)
    assert a.fingerprint == b.fingerprint
    # no replica of "w" (its dim 1 of 3 sharded over the 4 old ranks): ranks 2, 3 held its column 2
    assert a.dense_from_storage == ("w",)
    assert ("w", ((0, 7), (2, 1))) in a.storage_boxes
    for r in range(len(want)):  # and it is read from storage into place
        for j in want[r]:
            np.testing.assert_array_equal(got[r][j], want[r][j])


def _plan_arrays(plan) -> dict:
    s = plan.schedule
    out = {}
    for table in ("pieces", "sends", "deliveries", "views", "copies"):
        t = getattr(s, table)
        for f in t.__dataclass_fields__:
            out[f"{table}.{f}"] = getattr(t, f)
    for f in ("unit", "rank", "param", "slot", "off", "len", "dst"):
        out[f"storage.{f}"] = getattr(plan.storage, f)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_vectorized_planner_matches_the_reference(seed):
    """The vectorized planner gives the old per-row planner's schedule arrays, storage cells,
    bytes and fingerprint (random layouts, losses and staging budgets)."""
    rng = np.random.default_rng(100 + seed)
    alive = [0, 1] if seed % 2 else [0, 1, 2, 3]
    new_world = len(alive) if seed % 4 < 2 else 4
    staging = int(rng.integers(24, 400))
    args = dict(old_world=4, new_world=new_world, alive=alive, staging=staging, w_replicas=1 + seed % 2)
    got, _, _, _, _ = _case(seed, **args)
    want, _, _, _, _ = _case(seed, **args, planner=reference.plan_reshard)
    a, b = _plan_arrays(want), _plan_arrays(got)
    for name in a:
        assert (a[name] is None) == (b[name] is None), name
        if a[name] is not None:
            assert a[name].dtype == b[name].dtype, name
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    for name in ("storage_boxes", "dense_from_storage", "peer_bytes", "copy_bytes", "storage_bytes", "fingerprint"):
        assert getattr(want, name) == getattr(got, name), name
    assert want.schedule.num_rounds == got.schedule.num_rounds
    assert want.schedule.cost.summary() == got.schedule.cost.summary()
