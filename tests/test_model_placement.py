"""Tier 2: an operation on a model uses the placement the model routes tokens by.

``load``, ``verify`` and ``save`` without a placement take the model's own (what
``parallelize`` set and ``relocate`` changed); given another, they refuse on every rank before
anything moves. Without this, ``save(model, dir)`` of a shuffled model wrote its slots as if
slot p held expert p, and ``load`` by a placement other than the forward's put experts where no
token reaches them: both silently. A real transformers Qwen3-MoE, 2 gloo ranks (EP=2).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from mp import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.hf]


def worker(root: str) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    import moeshard
    import tiny_moe
    from moeshard.models.ep import model_placement

    ckpt = os.path.join(root, "tiny")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt), dtype=torch.float32)
    placement = tiny_moe.shuffled_placement(2, 8, 2, 12, seed=5)
    moeshard.parallelize(model, moeshard.make_mesh("cpu", ep=2), placement)
    out: dict = {"own": np.array_equal(model_placement(model).phy2log, placement.phy2log)}
    moeshard.load(model, ckpt)
    out["verify_own"] = moeshard.verify(model, ckpt).num_boxes_checked
    out["verify_given"] = moeshard.verify(model, ckpt, placement=placement).num_boxes_checked
    identity = moeshard.Placement.contiguous(2, 8, 2, num_redundant=2)
    for name, call in (
        ("load", lambda: moeshard.load(model, ckpt, placement=identity)),
        ("verify", lambda: moeshard.verify(model, ckpt, placement=identity)),
        ("save", lambda: moeshard.save(model, os.path.join(root, "never"), placement=identity)),
    ):
        try:
            call()
            out[name] = None
        except moeshard.DistributedError as e:  # every rank's argument error, agreed (save: SaveError)
            out[name] = str(e)
    moeshard.save(model, os.path.join(root, "saved"), fsync=False)
    # After a relocation the model's placement is the new one; the stale one is refused.
    new = tiny_moe.shuffled_placement(2, 8, 2, 12, seed=6)
    moeshard.relocate(model, placement, new)
    try:
        moeshard.relocate(model, placement, new)
        out["stale_old"] = None
    except moeshard.DistributedError as e:
        out["stale_old"] = str(e)
    out["verify_after"] = moeshard.verify(model, ckpt).num_boxes_checked
    moeshard.save(model, os.path.join(root, "saved_after"), fsync=False)
    dist.barrier()
    return out


def test_operations_use_the_models_placement(tmp_path):
    pytest.importorskip("transformers")
    import tiny_moe
    from test_cli import write_tiny

    write_tiny(str(tmp_path / "tiny"))
    results = run_ranks(worker, str(tmp_path), world=2)
    for res in results:
        assert res["own"] and res["verify_own"] > 0 and res["verify_given"] == res["verify_own"]
        for name in ("load", "verify", "save"):
            assert res[name] is not None and f"rank 0: ValueError: moeshard.{name}: the placement given" in res[name]
            assert "differs from the one the model routes tokens by" in res[name]
        assert res["stale_old"] is not None and "moeshard.relocate (old)" in res["stale_old"]
        assert res["verify_after"] > 0
    assert not (tmp_path / "never").exists()
    want = tiny_moe.read_all(tmp_path / "tiny")
    for saved in ("saved", "saved_after"):
        got = tiny_moe.read_all(tmp_path / saved)
        assert sorted(got) == sorted(want), saved
        for key, value in want.items():
            assert got[key].dtype == value.dtype and bool((got[key] == value).all()), (saved, key)
