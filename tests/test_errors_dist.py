"""Tier 2: every bad input raises moeshard.DistributedError on EVERY rank, names what is wrong,
and leaves the process group usable (no hang, no rank left behind in a collective).

One spawned group (4 ranks = 2 nodes x 2) runs every scenario; each rank catches the error and
returns its type and text.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import moeshard
import tiny_moe
from mp import run_ranks

pytestmark = pytest.mark.dist

WORLD, LWS = 4, 2


def _attempt(fn):
    try:
        fn()
    except moeshard.DistributedError as e:
        return ("DistributedError", str(e))
    except Exception as e:  # noqa: BLE001 - reported to the test
        return (type(e).__name__, str(e))
    return None


class OddHiddenMoE(torch.nn.Module):
    """One MoE layer with hidden size 41: ``down_proj`` [E, 41, INTER] has an odd dim 1."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].mlp = torch.nn.Module()
        self.layers[0].mlp.experts = tiny_moe.Experts(tiny_moe.NUM_EXPERTS, 41, tiny_moe.INTER)


def errors_worker(root: str) -> dict:
    import numpy as np
    import torch.distributed as dist

    rank = dist.get_rank()
    node = rank // LWS
    good = os.path.join(root, "good")
    ckpt = tiny_moe.read_all(good)
    mesh = moeshard.make_mesh("cpu", ep=2, efsdp=2)
    pl = moeshard.Placement.contiguous(2, tiny_moe.NUM_EXPERTS, 2, num_redundant=2)  # 10 slots
    with torch.device("meta"):
        model = tiny_moe.TinyMoE()
    moeshard.parallelize(model, mesh, pl)

    def load(path, placement=pl, storage="auto"):
        return lambda: moeshard.load(model, path, placement=placement, storage=storage)

    res = {}
    d = lambda name: os.path.join(root, name)  # noqa: E731
    res["missing-key"] = _attempt(load(d("missing-key")))
    res["missing-expert-key"] = _attempt(load(d("missing-expert-key")))
    res["wrong-shape"] = _attempt(load(d("wrong-shape")))
    res["wrong-expert-shape"] = _attempt(load(d("wrong-expert-shape")))
    res["int-dtype"] = _attempt(load(d("int-dtype")))
    res["truncated"] = _attempt(load(d("truncated")))
    res["garbage-header"] = _attempt(load(d("garbage-header")))
    res["bad-index"] = _attempt(load(d("bad-index")))
    # Node 1's copy of one file is truncated; node 0's copy (which the headers come from) is fine.
    res["truncated-node-copy"] = _attempt(load(d(f"copy{node}"), storage="node"))
    res["num-physical"] = _attempt(load(good, placement=moeshard.Placement.contiguous(2, tiny_moe.NUM_EXPERTS, 2, 4)))
    res["num-layers"] = _attempt(load(good, placement=moeshard.Placement.contiguous(3, tiny_moe.NUM_EXPERTS, 2, 2)))
    res["too-few-logical"] = _attempt(load(good, placement=moeshard.Placement(
        np.array([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2]] * 2), num_logical=7, num_ranks=2)))
    # The checkpoint is visible to rank 0 only (rank r passes the name view-r; only view-0 exists).
    res["shared-not-visible"] = _attempt(load(d(f"view-{rank}"), storage="shared"))
    # Only node 0 sees the files.
    res["node-not-visible"] = _attempt(load(good if node == 0 else d(f"view-{rank}"), storage="node"))
    res["single-rank0-blind"] = _attempt(load(good if rank != 0 else d("view-nope"), storage="single"))
    res["nothing-visible"] = _attempt(load(d("view-nope")))
    res["bad-storage"] = _attempt(load(good, storage="nfs"))
    # Rank 2 asks for another storage mode than the others (which would pick other readers).
    res["storage-differs"] = _attempt(load(good, storage="node" if rank == 2 else "shared"))
    # Rank 3 has another placement (same shape): plans disagree.
    other = tiny_moe.shuffled_placement(2, tiny_moe.NUM_EXPERTS, 2, 10, seed=5)
    res["placement-differs"] = _attempt(load(good, placement=other if rank == 3 else pl))
    res["verify-placement-differs"] = _attempt(lambda: moeshard.verify(model, good, placement=other if rank == 3 else pl))
    res["verify-missing-key"] = _attempt(lambda: moeshard.verify(model, d("missing-key"), placement=pl))
    # A read fails in the middle of the transfers (the file changed under the job, an I/O
    # error): the failing rank keeps serving its peers and every rank raises afterwards.
    from unittest import mock

    victim = moeshard.CheckpointIndex.open(good).info("layers.2.mlp.experts.3.down_proj.weight").file
    real_pread = moeshard.CheckpointReader._pread

    def failing_pread(self, fd, buf, offset, name):
        if name == victim:
            raise moeshard.CheckpointError(f"{self.root / name}: unexpected end of file at byte {offset}")
        return real_pread(self, fd, buf, offset, name)

    for failing_rank, storage in ((0, "single"), (2, "shared")):
        with mock.patch.object(moeshard.CheckpointReader, "_pread", failing_pread if rank == failing_rank else real_pread):
            res[f"read-fails-{storage}"] = _attempt(load(good, storage=storage))
    # The same, with reads on a pool of threads: the error of a read in a worker thread of
    # rank 2 reaches every rank; a good threaded load afterwards is exact.
    with mock.patch.object(moeshard.CheckpointReader, "_pread", failing_pread if rank == 2 else real_pread):
        res["read-fails-threads"] = _attempt(
            lambda: moeshard.load(model, good, placement=pl, storage="shared", read_threads=4))
    # With "single", rank 0's reads of the pieces it sends run a round ahead on its threads:
    # one fails there, the peers get zeros (no hang) and every rank raises.
    with mock.patch.object(moeshard.CheckpointReader, "_pread", failing_pread if rank == 0 else real_pread):
        res["read-ahead-fails"] = _attempt(
            lambda: moeshard.load(model, good, placement=pl, storage="single", read_threads=4, staging_bytes=2048))
    serial = moeshard.load(model, good, placement=pl, storage="shared", read_threads=1)
    tiny_moe.scramble(model)
    rep = moeshard.load(model, good, placement=pl, storage="shared", read_threads=4)
    res["threads-good"] = (tiny_moe.compare(model, ckpt, pl), rep.bytes_read_rank, serial.bytes_read_rank)
    # The same failure in verify: with "single", rank 0 reads for every rank; its needers get
    # all-zero digests (no hang) and report nothing themselves.
    moeshard.load(model, good, placement=pl)
    for failing_rank, storage in ((0, "single"), (2, "shared")):
        with mock.patch.object(moeshard.CheckpointReader, "_pread", failing_pread if rank == failing_rank else real_pread):
            res[f"verify-read-fails-{storage}"] = _attempt(
                lambda s=storage: moeshard.verify(model, good, placement=pl, storage=s))
    # Stray expert keys (strict: refused on every rank; strict=False: loaded, exact) and FP8
    # weights with their scale for a fp32 model when asked not to dequantize (refused, also by
    # ranks that hold no copy).
    res["stray-expert"] = _attempt(load(d("stray-expert")))
    res["verify-stray-expert"] = _attempt(lambda: moeshard.verify(model, d("stray-expert"), placement=pl))
    tiny_moe.scramble(model)
    rep = moeshard.load(model, d("stray-expert"), placement=pl, strict=False)
    res["stray-not-strict"] = (rep.unused_keys, tiny_moe.compare(model, ckpt, pl))
    # (with dequantize=False: the default dequantizes FP8 weights that have a block scale)
    res["fp8-scale"] = _attempt(lambda: moeshard.load(model, d("fp8-scale"), placement=pl, dequantize=False))
    # Expert FSDP shards dim 1 (here the hidden size, 41) over efsdp=2: refused before FSDP2.
    with torch.device("meta"):
        odd = OddHiddenMoE()
    res["efsdp-uneven"] = _attempt(lambda: moeshard.parallelize(
        odd, mesh, moeshard.Placement.contiguous(1, tiny_moe.NUM_EXPERTS, 2)))
    # The agreement itself (moeshard.collectives): shares of every size reach every rank, a share too
    # large for the one exchange included (rank 1's); a failure on one rank and fingerprints that
    # split the ranks two ways or differ on every rank raise on every rank.
    from moeshard import collectives

    share = {1: "x" * 5000, 2: None}.get(rank, ("rank", rank, b"\x00" * rank))
    res["gather-shares"] = collectives.agree_and_gather(lambda: rank * 10, "gathering", share=lambda r: (r, share))
    res["gather-small"] = collectives.agree_and_gather(lambda: rank, "gathering", share=lambda r: r)

    def fail_on_3():
        if rank == 3:
            raise ValueError("rank 3 cannot")
        return rank

    res["gather-fails"] = _attempt(lambda: collectives.agree_and_gather(fail_on_3, "gathering", share=lambda r: r))
    res["agree-fails"] = _attempt(lambda: collectives.agree(fail_on_3, "agreeing", fingerprint=str))
    res["agree-same"] = collectives.agree(lambda: rank, "agreeing", fingerprint=lambda r: "plan-A")
    res["agree-halves"] = _attempt(lambda: collectives.agree(lambda: rank, "agreeing", fingerprint=lambda r: f"plan-{r // 2}"))
    res["agree-all-differ"] = _attempt(lambda: collectives.agree(lambda: rank, "agreeing", fingerprint=str))
    # After all that, the group still works: a good load is exact and verifies.
    tiny_moe.scramble(model)
    moeshard.load(model, good, placement=pl)
    v = moeshard.verify(model, good, placement=pl)
    res["final"] = (tiny_moe.compare(model, ckpt, pl), v.num_boxes_checked)
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    good = tiny_moe.checkpoint_tensors()
    mb = 3000

    def write(name, tensors):
        moeshard.write_checkpoint(root / name, tensors.items(), max_shard_bytes=mb)

    write("good", good)
    t = dict(good)
    del t["layers.0.attn.bias"]
    write("missing-key", t)
    t = dict(good)
    del t["layers.2.mlp.experts.5.up_proj.weight"]
    write("missing-expert-key", t)
    t = dict(good)
    t["embed.weight"] = torch.zeros(tiny_moe.VOCAB + 1, tiny_moe.HIDDEN)
    write("wrong-shape", t)
    t = dict(good)
    t["layers.0.mlp.experts.3.gate_proj.weight"] = torch.zeros(tiny_moe.INTER + 1, tiny_moe.HIDDEN, dtype=torch.bfloat16)
    write("wrong-expert-shape", t)
    t = dict(good)
    t["norm.weight"] = torch.arange(tiny_moe.HIDDEN, dtype=torch.int32)
    write("int-dtype", t)
    t = dict(good)
    for part in ("gate", "up", "down"):
        t[f"layers.2.mlp.experts.99.{part}_proj.weight"] = good[f"layers.2.mlp.experts.0.{part}_proj.weight"]
    write("stray-expert", t)
    t = dict(good)
    t["layers.2.mlp.experts.5.up_proj.weight"] = good["layers.2.mlp.experts.5.up_proj.weight"].to(torch.float8_e4m3fn)
    t["layers.2.mlp.experts.5.up_proj.weight_scale_inv"] = torch.ones(1, 1)
    write("fp8-scale", t)
    index = moeshard.CheckpointIndex.open(root / "good")
    victim = index.info("embed.weight").file
    for name in ("truncated", "garbage-header", "bad-index", "copy0", "copy1"):
        shutil.copytree(root / "good", root / name)
    for name in ("truncated", "copy1"):
        f = root / name / victim
        f.write_bytes(f.read_bytes()[:-10])
    (root / "garbage-header" / victim).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage garbage" + bytes(64))
    (root / "bad-index" / "model.safetensors.index.json").write_text(
        '{"weight_map": {"embed.weight": "../good/' + victim + '"}}')
    os.symlink(root / "good", root / "view-0")
    out = run_ranks(errors_worker, str(root), world=WORLD, local_world=LWS, timeout=200)
    return out, victim


class _Texts:
    """Every rank's error text; ``s in texts`` holds when every rank's text contains ``s``."""

    def __init__(self, texts):
        self.texts = texts

    def __contains__(self, s):
        return all(s in t for t in self.texts)

    def __repr__(self):
        return "\n---\n".join(self.texts)


def _all_raise(results, name):
    per_rank = [r[name] for r in results]
    for rank, got in enumerate(per_rank):
        assert got is not None, f"{name}: rank {rank} did not raise"
        kind, text = got
        assert kind == "DistributedError", f"{name}: rank {rank} raised {kind}: {text}"
    return _Texts([text for _, text in per_rank])


def test_missing_key(results):
    res, _ = results
    text = _all_raise(res, "missing-key")
    assert "failed on 4 of 4 rank(s)" in text
    assert "rank 0: ValueError: parameter layers.0.attn.bias" in text and "no tensor 'layers.0.attn.bias'" in text
    text = _all_raise(res, "missing-expert-key")
    assert "'layers.2.mlp.experts.5.up_proj.weight' (logical expert 5)" in text
    text = _all_raise(res, "verify-missing-key")
    assert "no tensor 'layers.0.attn.bias'" in text


def test_wrong_shape(results):
    res, _ = results
    text = _all_raise(res, "wrong-shape")
    assert "parameter embed.weight: checkpoint tensor 'embed.weight' has shape [14, 8]" in text
    assert "expects [13, 8]" in text
    text = _all_raise(res, "wrong-expert-shape")
    assert "layers.0.mlp.experts.gate_up_proj" in text and "expert 3" in text
    assert "layers.0.mlp.experts.3.gate_proj.weight" in text


def test_int_dtype_for_float_param(results):
    res, _ = results
    text = _all_raise(res, "int-dtype")
    assert "checkpoint tensor 'norm.weight' has dtype I32, which cannot be cast" in text


def test_corrupt_files(results):
    res, victim = results
    text = _all_raise(res, "truncated")
    assert f"truncated/{victim}" in text and "truncated or corrupt" in text
    assert "rank 0: CheckpointError: " in text
    text = _all_raise(res, "garbage-header")
    assert f"garbage-header/{victim}" in text and "corrupt safetensors header" in text
    text = _all_raise(res, "bad-index")
    assert "outside the checkpoint directory" in text and victim in text


def test_truncated_copy_on_one_node(results):
    res, victim = results
    text = _all_raise(res, "truncated-node-copy")
    # The ranks of node 1 (2 and 3) read from their own, truncated copy and say which file.
    assert "failed on 2 of 4 rank(s)" in text
    for r in (2, 3):
        assert f"rank {r}: CheckpointError: " in text
    assert f"copy1/{victim}" in text and "truncated or different file" in text
    assert not any("rank 0: " in t or "rank 1: " in t for t in text.texts)


def test_placement_inconsistent_with_model(results):
    res, _ = results
    text = _all_raise(res, "num-physical")
    assert "parameter layers.0.mlp.experts.gate_up_proj has 10 expert slots per layer, the placement has 12" in text
    text = _all_raise(res, "num-layers")
    assert "the model has 2 MoE layers, the placement describes 3" in text
    text = _all_raise(res, "too-few-logical")
    assert "the checkpoint has expert 7" in text and "only 7 logical experts" in text


def test_storage_not_visible(results):
    res, _ = results
    text = _all_raise(res, "shared-not-visible")
    assert "storage='shared' but ranks [1, 2, 3] cannot read the checkpoint" in text
    text = _all_raise(res, "node-not-visible")
    assert "storage='node' but no rank of node 1 can read the checkpoint" in text
    text = _all_raise(res, "single-rank0-blind")
    assert "storage='single' but rank 0 cannot read the checkpoint" in text
    text = _all_raise(res, "nothing-visible")
    assert "no rank can read the checkpoint" in text
    text = _all_raise(res, "bad-storage")
    assert "storage must be 'auto', 'shared', 'node' or 'single', got 'nfs'" in text
    text = _all_raise(res, "storage-differs")
    assert "the ranks passed different storage: rank 0 'shared', ranks [2] another (rank 2: 'node')" in text


def test_placement_differs_across_ranks(results):
    res, _ = results
    for name in ("placement-differs", "verify-placement-differs"):
        text = _all_raise(res, name)
        assert "ranks disagree on the plan fingerprint" in text
        assert "rank 0: " in text and "rank 3: " in text


def test_read_failure_during_transfers(results):
    res, _ = results
    for name, failing_rank in (("read-fails-single", 0), ("read-fails-shared", 2),
                               ("verify-read-fails-single", 0), ("verify-read-fails-shared", 2)):
        text = _all_raise(res, name)
        assert "failed on 1 of 4 rank(s)" in text
        assert f"rank {failing_rank}: CheckpointError: " in text and "unexpected end of file" in text
        assert "good/model-0000" in text


def test_read_failure_in_a_reader_thread(results):
    res, _ = results
    text = _all_raise(res, "read-fails-threads")
    assert "failed on 1 of 4 rank(s)" in text
    assert "rank 2: CheckpointError: " in text and "unexpected end of file" in text and "good/model-0000" in text
    text = _all_raise(res, "read-ahead-fails")
    assert "failed on 1 of 4 rank(s)" in text and "rank 0: CheckpointError: " in text
    # Then the group loads with threads again, exactly, each rank counting the bytes it read
    # as the serial load counts them.
    for r in res:
        wrong, nbytes, serial = r["threads-good"]
        assert wrong == [] and nbytes == serial > 0


def test_strict_and_fp8_raise_on_every_rank(results):
    res, _ = results
    for name in ("stray-expert", "verify-stray-expert"):
        text = _all_raise(res, name)
        assert "failed on 4 of 4 rank(s)" in text
        assert ("has 3 key(s) that no parameter or buffer of the model reads: 3 name experts or expert tensors the "
                "model does not have: ['layers.2.mlp.experts.99.down_proj.weight', "
                "'layers.2.mlp.experts.99.gate_proj.weight', 'layers.2.mlp.experts.99.up_proj.weight']; "
                "pass strict=False") in text
    stray = ("layers.2.mlp.experts.99.down_proj.weight", "layers.2.mlp.experts.99.gate_proj.weight",
             "layers.2.mlp.experts.99.up_proj.weight")
    for rank, r in enumerate(res):
        assert r["stray-not-strict"] == (stray, []), f"rank {rank}: {r['stray-not-strict']}"
    text = _all_raise(res, "fp8-scale")
    assert "failed on 4 of 4 rank(s)" in text
    assert ("checkpoint tensor 'layers.2.mlp.experts.5.up_proj.weight' has dtype F8_E4M3 (FP8), the model's tensor "
            "is torch.float32: its scale tensor 'layers.2.mlp.experts.5.up_proj.weight_scale_inv' (F32 [1, 1]) would "
            "be dropped") in text


def test_efsdp_uneven_dim_refused_up_front(results):
    res, _ = results
    for rank, r in enumerate(res):
        kind, text = r["efsdp-uneven"]
        assert kind == "ValueError", (rank, kind, text)
        assert text.startswith("parameter layers.0.mlp.experts.down_proj of shape [8, 41, 6]: expert FSDP shards "
                               "its dim 1 (41) over efsdp=2 ranks"), text
        assert "use an efsdp size that divides 41 (of the sizes dividing the world size 4: [1])" in text
        assert "or a hidden / intermediate size that divides by 2" in text


def test_agreement_gathers_every_share_and_refuses_any_difference(results):
    res, _ = results
    shares = [(r * 10, {1: "x" * 5000, 2: None}.get(r, ("rank", r, b"\x00" * r))) for r in range(WORLD)]
    for rank, r in enumerate(res):
        assert r["gather-shares"] == (rank * 10, shares), f"rank {rank}"
        assert r["gather-small"] == (rank, list(range(WORLD))), f"rank {rank}"
        assert r["agree-same"] == rank
    text = _all_raise(res, "gather-fails")
    assert "gathering failed on 1 of 4 rank(s):\n  rank 3: ValueError: rank 3 cannot" in text
    text = _all_raise(res, "agree-fails")
    assert "agreeing failed on 1 of 4 rank(s):\n  rank 3: ValueError: rank 3 cannot" in text
    text = _all_raise(res, "agree-halves")
    assert "ranks disagree on the plan fingerprint (rank 0: plan-0, rank 1: plan-0, rank 2: plan-1, rank 3: plan-1)" in text
    text = _all_raise(res, "agree-all-differ")
    assert "(rank 0: 0, rank 1: 1, rank 2: 2, rank 3: 3)" in text


def test_group_usable_after_errors(results):
    res, _ = results
    for rank, r in enumerate(res):
        problems, boxes = r["final"]
        assert problems == [] and boxes > 0, f"rank {rank}: {problems}"
