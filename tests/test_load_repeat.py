"""Repeated loads in one process: what one load leaves behind must not leak into the next.

* node process groups are created once per default process group, not once per load (and a
  destroyed, re-initialized default group gets new ones);
* ``LoadReport.peak_rss_bytes`` is this load's peak, not an earlier allocation's;
* ``LoadReport.minimal`` is computed only when asked for, and then equals ``minimal_cost``.
"""

from __future__ import annotations

import os

import numpy as np
import psutil
import pytest
import torch

import moeshard
import tiny_moe
from mp import run_ranks

MiB = 2**20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("repeat") / "sharded"
    tiny_moe.write(d)
    return d


def _placement():
    return moeshard.Placement.contiguous(len(tiny_moe.MOE_BLOCKS), tiny_moe.NUM_EXPERTS, 1)


def _meta_model():
    with torch.device("meta"):
        return tiny_moe.TinyMoE()


def node_groups_worker(path: str, store_file: str) -> dict:
    """Plain (unsharded) model on one node of 3 ranks, storage "single": every piece is
    needed by every rank of the node, so the plan fans it out by node broadcasts."""
    import torch.distributed as dist

    from moeshard import execute

    calls = []
    real = dist.new_subgroups

    def counting(*args, **kwargs):
        calls.append(kwargs.get("group_size"))
        return real(*args, **kwargs)

    dist.new_subgroups = counting
    rank, world = dist.get_rank(), dist.get_world_size()
    values = tiny_moe.read_all(path)
    out: dict = {"loads": []}
    try:
        model = _meta_model()
        for _ in range(3):
            tiny_moe.scramble(model)
            rep = moeshard.load(model, path, placement=_placement(), storage="single")
            out["loads"].append(
                dict(
                    broadcasts=rep.plan["num_broadcasts"],
                    calls=len(calls),
                    problems=tiny_moe.compare(model, values, _placement()),
                )
            )
        first = execute.node_groups(moeshard.Topology(3, 3))
        out["direct_call_same_group"] = first is execute.node_groups(moeshard.Topology(3, 3))
        out["calls_before_reinit"] = len(calls)
        # A new default process group (destroy + init) must not reuse the destroyed groups.
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
        tiny_moe.scramble(model)
        rep = moeshard.load(model, path, placement=_placement(), storage="single")
        out["after_reinit"] = dict(
            broadcasts=rep.plan["num_broadcasts"],
            calls=len(calls),
            problems=tiny_moe.compare(model, values, _placement()),
            new_group=execute.node_groups(moeshard.Topology(3, 3)) is not first,
        )
        out["group_sizes"] = calls
    finally:
        dist.new_subgroups = real
    return out


@pytest.mark.dist
def test_node_groups_created_once_per_process_group(ckpt, tmp_path):
    results = run_ranks(node_groups_worker, str(ckpt), str(tmp_path / "store"), world=3, local_world=3)
    for rank, res in enumerate(results):
        loads = res["loads"]
        assert all(rec["problems"] == [] for rec in loads), (rank, loads)
        assert all(rec["broadcasts"] > 0 for rec in loads), (rank, loads)
        # Three loads with node broadcasts, one creation of the node groups.
        assert [rec["calls"] for rec in loads] == [1, 1, 1], (rank, loads)
        assert res["direct_call_same_group"] is True
        assert res["calls_before_reinit"] == 1
        after = res["after_reinit"]
        assert after["problems"] == [] and after["broadcasts"] > 0, (rank, after)
        assert after["calls"] == 2 and after["new_group"] is True, (rank, after)
        assert res["group_sizes"] == [3, 3]


def test_node_groups_without_process_group():
    from moeshard.execute import node_groups

    with pytest.raises(ValueError, match="initialized default process group"):
        node_groups(moeshard.Topology(2, 2))


def test_peak_rss_is_this_loads_peak(ckpt):
    model = _meta_model()
    moeshard.load(model, ckpt, placement=_placement())
    # A 256 MiB peak before the load, freed again (numpy's large buffers are unmapped).
    big = np.ones(256 * MiB // 8)
    grown = psutil.Process().memory_info().rss
    del big
    assert psutil.Process().memory_info().rss < grown - 128 * MiB
    rep = moeshard.load(model, ckpt, placement=_placement())
    if os.access("/proc/self/clear_refs", os.W_OK):
        assert rep.peak_rss_source == "vmhwm"
        # The tiny load's own peak: nowhere near the earlier 256 MiB one.
        assert rep.rss_before_bytes - 16 * MiB <= rep.peak_rss_bytes < rep.rss_before_bytes + 64 * MiB
        assert rep.peak_rss_bytes < grown - 128 * MiB
    else:  # the documented fallback: the process's lifetime peak
        assert rep.peak_rss_source == "ru_maxrss"
        assert rep.peak_rss_bytes >= grown - 16 * MiB


def test_minimal_only_when_asked(ckpt):
    from moeshard.ops.load import plan_load
    from moeshard.plan import minimal_cost

    model = _meta_model()
    rep = moeshard.load(model, ckpt, placement=_placement())
    assert rep.minimal == {}
    rep = moeshard.load(model, ckpt, placement=_placement(), report_minimal=True)
    index = moeshard.CheckpointIndex.open(ckpt)
    topo = moeshard.Topology(1, 1)
    readers = np.ones(1, dtype=bool)
    _, _, plan = plan_load(model, index, _placement(), topo, readers, "job")
    assert rep.minimal == minimal_cost(plan.needs, index, topo, readers, "job")
    assert rep.minimal["read_bytes"] == rep.checkpoint_bytes == rep.bytes_read_rank
    assert rep.minimal["network_bytes"] == 0 and rep.minimal["cross_node_bytes"] == 0
