"""Tier 1: the torch-free dtype vocabulary (:mod:`moeshard.dtypes`) agrees with torch: item
sizes, names of torch dtypes, and the cast rule given a model dtype as a torch dtype or as its
safetensors name; the torch-free spelling of placements gives torch's boxes; a checkpoint
index survives pickling (as columns)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from moeshard.dtypes import ITEMSIZE, LazyTable, cast_refusal, dtype_name, itemsize, torch_dtypes
from moeshard.io.header import DTYPE_NAMES, DTYPES, TensorInfo
from moeshard.io.index import CheckpointIndex
from moeshard.models.shards import shard_boxes


def test_table_matches_torch():
    assert set(ITEMSIZE) == set(DTYPES) == set(torch_dtypes())
    for name, dt in torch_dtypes().items():
        assert ITEMSIZE[name] == dt.itemsize == itemsize(name) == itemsize(dt)
        assert dtype_name(dt) == dtype_name(name) == DTYPE_NAMES[dt] == name
        assert DTYPES[name] is dt
    assert dtype_name(torch.float8_e4m3fnuz) is None and dtype_name(torch.complex64) is None
    with pytest.raises(ValueError, match="unknown safetensors dtype name 'F4'"):
        dtype_name("F4")


def test_cast_rule_is_the_same_for_names_and_torch_dtypes():
    extra = [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.complex64, torch.uint16]
    for src in ITEMSIZE:
        for name, dt in torch_dtypes().items():
            assert cast_refusal(src, name) == cast_refusal(src, dt), (src, name)
        for dt in extra:
            cast_refusal(src, dt)  # torch dtypes without a safetensors name are judged by their traits
    assert cast_refusal("BF16", "F32") is None and cast_refusal("F8_E4M3", "BF16") == "from_fp8"
    assert cast_refusal("BF16", torch.float8_e4m3fnuz) == "to_fp8"
    assert cast_refusal("F8_E4M3", "F8_E5M2") == "fp8_formats" and cast_refusal("I32", "BOOL") == "kind"


def test_lazy_table_builds_once():
    calls = []
    table = LazyTable(lambda: calls.append(1) or {"a": 1})
    assert not calls
    assert table["a"] == 1 and "a" in table and list(table) == ["a"] and len(table) == 1 and dict(table) == {"a": 1}
    assert calls == [1]


def test_torch_free_placements_give_torch_boxes():
    rng = np.random.default_rng(5)
    for _ in range(300):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(n) for n in rng.integers(0, 9, ndim))
        mesh_shape = tuple(int(n) for n in rng.integers(1, 4, int(rng.integers(1, 3))))
        dims = [int(rng.integers(-ndim, ndim)) if rng.random() < 0.7 else None for _ in mesh_shape]
        torch_pl = tuple(Replicate() if d is None else Shard(d) for d in dims)
        assert np.array_equal(shard_boxes(shape, mesh_shape, tuple(dims)), shard_boxes(shape, mesh_shape, torch_pl))
    with pytest.raises(ValueError, match=r"placement Shard\(2\) shards dim 2 of a 2-dim tensor"):
        shard_boxes((4, 4), (2,), (2,))


def test_index_pickles_as_columns():
    shape = (4, 2)
    tensors = {
        f"k{i}": TensorInfo(f"f{i % 3}.safetensors", 8 + 16 * i, ("BF16", "F32")[i % 2], shape if i % 2 else ())
        for i in range(50)
    }
    index = CheckpointIndex("/x", tensors, {"f0.safetensors": 1, "f1.safetensors": 2, "f2.safetensors": 3})
    back = pickle.loads(pickle.dumps(index))
    assert back == index and list(back.tensors) == list(index.tensors)
    assert back.tensors["k1"].shape is back.tensors["k3"].shape  # shared, as the header parser shares them
