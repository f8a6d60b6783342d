"""Tier 2: an operation on a model uses the placement the model routes tokens by.

``load``, ``verify`` and ``save`` without a placement take the model's own (what
``parallelize`` set and ``relocate`` changed); given another, they refuse on every rank before
anything moves. Without this, ``save(model, dir)`` of a shuffled model wrote its slots as if
slot p held expert p, and ``load`` by a placement other than the forward's put experts where no
token reaches them: both silently. A real transformers Qwen3-MoE, 2 gloo ranks (EP=2).

The model's placement has one record, its EP layers' routing tables: ``model.moeshard_placement``,
``model_placement``, ``describe_shards`` (reshard's layout) and each layer's state-dict guard read
them, after a relocation, after refused changes (a stale relocate, a ``set_placement`` that does
not fit, an assignment to the attribute) and after relocating back.
"""

from __future__ import annotations

import json
import os
import re

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
    out["views"] = {"relocated": _views(model)}
    try:  # 8 slots per layer for a model of 12: refused, and nothing may change
        moeshard.models.ep.set_placement(model, moeshard.Placement.contiguous(2, 8, 2))
        out["set_refused"] = None
    except ValueError as e:
        out["set_refused"] = str(e)
    try:
        model.moeshard_placement = placement
        out["assigned"] = None
    except AttributeError as e:
        out["assigned"] = str(e)
    out["views"]["refused"] = _views(model)
    moeshard.relocate(model, new, placement)
    out["views"]["back"] = _views(model)
    out["new"], out["placement"] = new.phy2log.tolist(), placement.phy2log.tolist()
    dist.barrier()
    return out


def _views(model) -> dict:
    """Every record of ``model``'s placement as ``phy2log`` lists: its EP layers' routing tables,
    ``model.moeshard_placement``, ``model_placement``, ``describe_shards``, and per layer the
    slots the state-dict guard's refusal names."""
    import moeshard
    from moeshard.models.ep import ep_layers, model_placement

    guards = []
    for module, _ in ep_layers(model):
        try:
            module.state_dict()
            guards.append(None)
        except ValueError as e:
            guards.append(json.loads(re.search(r"slot -> logical expert: (\[[^\]]*\])", str(e)).group(1)))
    return dict(
        tables=[ep.phy2log.tolist() for _, ep in ep_layers(model)],
        attribute=model.moeshard_placement.phy2log.tolist(),
        own=model_placement(model).phy2log.tolist(),
        shards=moeshard.describe_shards(model).phy2log.tolist(),
        guards=guards,
    )


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
        for when, want in (("relocated", res["new"]), ("refused", res["new"]), ("back", res["placement"])):
            views = res["views"][when]
            assert views["tables"] == want, when
            for name in ("attribute", "own", "shards", "guards"):
                assert views[name] == views["tables"], (when, name, views)
        assert res["set_refused"] is not None and "the placement has 2 layers x 8 slots" in res["set_refused"]
        assert res["assigned"] is not None and "moeshard_placement" in res["assigned"], "the attribute is read-only"
    assert not (tmp_path / "never").exists()
    want = tiny_moe.read_all(tmp_path / "tiny")
    for saved in ("saved", "saved_after"):
        got = tiny_moe.read_all(tmp_path / saved)
        assert sorted(got) == sorted(want), saved
        for key, value in want.items():
            assert got[key].dtype == value.dtype and bool((got[key] == value).all()), (saved, key)
