"""Tier 1: safetensors index/header parsing, box reads, the writer, and untrusted input."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import moeshard
from moeshard import CheckpointError, CheckpointIndex, CheckpointReader, write_checkpoint
from moeshard.box import box_slices, full_box

INDEX = "model.safetensors.index.json"


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(5, 10, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(4, 6, 7, generator=g),
        "c.bias": torch.randn(3, generator=g, dtype=torch.float64),
        "d.ids": torch.randint(-100, 100, (2, 3, 4, 5), generator=g, dtype=torch.int32),
        "e.half": torch.randn(6, 2, generator=g).half(),
        "f.scalar": torch.tensor(3.5),
        "g.empty": torch.zeros(0, 4),
    }


def _write_raw(path: Path, header: dict, data: bytes, header_len: int | None = None) -> None:
    raw = json.dumps(header).encode()
    n = len(raw) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)


def _write_index(root: Path, weight_map: dict[str, str]) -> None:
    (root / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# -- writing and reading --------------------------------------------------------------------


def test_write_checkpoint_roundtrip_sharded(tmp_path):
    ts = _tensors()
    idx = write_checkpoint(tmp_path, ts.items(), max_shard_bytes=300)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    assert not list(tmp_path.glob("*.tmp"))
    index_json = json.loads((tmp_path / INDEX).read_text())
    assert set(index_json["weight_map"]) == set(ts)
    assert index_json["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ts.values())
    assert set(idx.tensors) == set(ts)
    assert idx.total_bytes == index_json["metadata"]["total_size"]
    # The index returned by the writer equals one opened from disk.
    again = CheckpointIndex.open(tmp_path)
    assert again.tensors == idx.tensors and again.file_sizes == idx.file_sizes
    with CheckpointReader(idx) as r:
        for key, t in ts.items():
            info = idx.info(key)
            assert info.shape == tuple(t.shape) and info.torch_dtype == t.dtype
            assert info.file == index_json["weight_map"][key]
            got = r.read(key)
            assert got.dtype == t.dtype and torch.equal(got, t)
    with pytest.raises(ValueError, match="given twice"):
        write_checkpoint(tmp_path / "dup", [("x", torch.zeros(1)), ("x", torch.zeros(1))])


def test_write_checkpoint_crash_leaves_no_complete_looking_directory(tmp_path):
    """write_checkpoint's promise: a crash (here the tensors' iterator failing after a shard was
    written) leaves no index, in a fresh directory and over an earlier checkpoint alike."""
    ts = {f"t{i}": torch.full((64,), float(i)) for i in range(6)}

    def failing():
        for i, kv in enumerate(ts.items()):
            if i == 4:
                raise OSError("simulated crash")
            yield kv

    for earlier in (False, True):
        root = tmp_path / str(earlier)
        if earlier:
            write_checkpoint(root, ts.items(), max_shard_bytes=300)
            assert (root / INDEX).is_file()
        with pytest.raises(OSError, match="simulated crash"):
            write_checkpoint(root, failing(), max_shard_bytes=300)
        assert list(root.glob("model-*.safetensors")) and not (root / INDEX).exists()


def test_index_file_path_opens_its_directory(tmp_path):
    ts = _tensors(5)
    write_checkpoint(tmp_path, ts.items(), max_shard_bytes=200)
    idx = CheckpointIndex.open(tmp_path / INDEX)
    assert Path(idx.root) == tmp_path and idx.tensors == CheckpointIndex.open(tmp_path).tensors
    with CheckpointReader(idx) as r:
        assert torch.equal(r.read("b.weight"), ts["b.weight"])


def test_scalar_tensor(tmp_path):
    save_file({"s": torch.tensor(2.5), "v": torch.arange(3.0)}, str(tmp_path / "m.safetensors"))
    idx = CheckpointIndex.open(tmp_path / "m.safetensors")
    with CheckpointReader(idx) as r:
        got = r.read("s")
        assert got.shape == () and got.item() == 2.5 and r.bytes_read == 4
        out = torch.empty((), dtype=torch.float64)
        r.read("s", (), out=out)
        assert out.item() == 2.5


def test_safetensors_written_directly_with_index(tmp_path):
    ts = _tensors(1)
    keys = list(ts)
    save_file({k: ts[k] for k in keys[:3]}, str(tmp_path / "part-a.safetensors"))
    save_file({k: ts[k] for k in keys[3:]}, str(tmp_path / "part-b.safetensors"), metadata={"format": "pt"})
    _write_index(tmp_path, {k: ("part-a.safetensors" if i < 3 else "part-b.safetensors") for i, k in enumerate(keys)})
    idx = CheckpointIndex.open(tmp_path)
    assert set(idx.tensors) == set(ts)
    assert set(idx.file_sizes) == {"part-a.safetensors", "part-b.safetensors"}
    assert idx.file_sizes["part-a.safetensors"] == (tmp_path / "part-a.safetensors").stat().st_size
    with CheckpointReader(idx) as r:
        for k, t in ts.items():
            assert torch.equal(r.read(k), t)


def test_single_file_and_directory_with_one_file(tmp_path):
    ts = _tensors(2)
    save_file(ts, str(tmp_path / "model.safetensors"))
    by_file = CheckpointIndex.open(tmp_path / "model.safetensors")
    by_dir = CheckpointIndex.open(tmp_path)
    assert by_file.tensors == by_dir.tensors
    assert Path(by_file.root) == tmp_path and Path(by_dir.root) == tmp_path
    for idx in (by_file, by_dir):
        with CheckpointReader(idx) as r:
            for k, t in ts.items():
                assert torch.equal(r.read(k), t)
    # Two .safetensors files and no index: ambiguous.
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="exactly one .safetensors file, found 2"):
        CheckpointIndex.open(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        CheckpointIndex.open(tmp_path / "nope")


def _random_box(rng, shape):
    box = []
    for n in shape:
        off = int(rng.integers(0, n + 1))
        length = int(rng.integers(0, n - off + 1))
        box.append((off, length))
    return tuple(box)


def test_read_boxes_equal_tensor_slices(tmp_path):
    ts = _tensors(3)
    idx = write_checkpoint(tmp_path, ts.items())
    rng = np.random.default_rng(0)
    with CheckpointReader(idx) as r:
        a = ts["a.weight"]
        cases = [
            ("a.weight", ((0, 5), (0, 10))),  # full
            ("a.weight", ((1, 3), (0, 10))),  # dim-0 slice: one contiguous run
            ("a.weight", ((0, 5), (3, 4))),  # [:, 3:7]: one run per row
            ("a.weight", ((2, 1), (9, 1))),  # one element
            ("b.weight", ((1, 2), (0, 6), (2, 3))),
            ("b.weight", ((0, 4), (2, 3), (0, 7))),
            ("b.weight", ((3, 1), (5, 1), (0, 7))),
            ("d.ids", ((1, 1), (0, 3), (1, 2), (0, 5))),
            ("d.ids", ((0, 2), (1, 2), (0, 4), (2, 3))),
            ("a.weight", ((0, 0), (0, 10))),  # empty box
        ]
        for key in ts:
            shape = tuple(ts[key].shape)
            for _ in range(12):
                cases.append((key, _random_box(rng, shape)))
        for key, box in cases:
            before = r.bytes_read
            got = r.read(key, box)
            want = ts[key][box_slices(box)]
            assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (key, box)
            assert torch.equal(got, want), (key, box)
            # Exactly the box's bytes are read, nothing more.
            assert r.bytes_read - before == want.numel() * want.element_size(), (key, box)
        assert torch.equal(r.read("a.weight", full_box(a.shape)), a)


def test_read_casts_into_out(tmp_path):
    ts = _tensors(4)
    idx = write_checkpoint(tmp_path, ts.items())
    a = ts["a.weight"]  # bf16
    with CheckpointReader(idx) as r:
        out = torch.full((5, 4), -1.0, dtype=torch.float32)
        before = r.bytes_read
        ret = r.read("a.weight", ((0, 5), (3, 4)), out=out)
        assert ret is out
        assert torch.equal(out, a[:, 3:7].float())
        assert r.bytes_read - before == 5 * 4 * 2  # bf16 bytes of the box, not fp32 bytes
        # Same dtype, contiguous: read straight into out.
        out2 = torch.empty(2, 10, dtype=torch.bfloat16)
        assert r.read("a.weight", ((1, 2), (0, 10)), out=out2) is out2
        assert torch.equal(out2, a[1:3])
        # A non-contiguous destination view is filled correctly too.
        big = torch.zeros(10, 10, dtype=torch.bfloat16)
        view = big[::2]
        r.read("a.weight", out=view)
        assert torch.equal(big[::2], a) and (big[1::2] == 0).all()
        # fp32 -> bf16 cast (rounding like torch's own cast).
        b = ts["b.weight"]
        out3 = torch.empty(4, 6, 7, dtype=torch.bfloat16)
        r.read("b.weight", out=out3)
        assert torch.equal(out3, b.to(torch.bfloat16))
        with pytest.raises(ValueError, match=r"destination of shape \[5, 5\]"):
            r.read("a.weight", ((0, 5), (3, 4)), out=torch.empty(5, 5))
        with pytest.raises(ValueError, match="does not fit in shape"):
            r.read("a.weight", ((0, 5), (8, 4)))
        with pytest.raises(CheckpointError, match="no tensor 'zzz'"):
            r.read("zzz")


# -- untrusted input ------------------------------------------------------------------------


@pytest.fixture
def good_dir(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"x": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(d / "m1.safetensors"))
    save_file({"y": torch.ones(5, dtype=torch.bfloat16)}, str(d / "m2.safetensors"))
    _write_index(d, {"x": "m1.safetensors", "y": "m2.safetensors"})
    CheckpointIndex.open(d)  # sanity: the good checkpoint opens
    return d


def test_index_path_escaping_directory(good_dir, tmp_path):
    outside = tmp_path / "x.safetensors"
    save_file({"x": torch.zeros(3, 4)}, str(outside))
    _write_index(good_dir, {"x": "../x.safetensors", "y": "m2.safetensors"})
    with pytest.raises(CheckpointError, match=r"'\.\./x\.safetensors'.*outside the checkpoint directory"):
        CheckpointIndex.open(good_dir)
    _write_index(good_dir, {"x": str(outside), "y": "m2.safetensors"})
    with pytest.raises(CheckpointError, match=r"x\.safetensors.*outside the checkpoint directory"):
        CheckpointIndex.open(good_dir)
    # Escapes hidden in a longer name.
    (good_dir / "sub").mkdir()
    _write_index(good_dir, {"x": "sub/../../x.safetensors", "y": "m2.safetensors"})
    with pytest.raises(CheckpointError, match=r"'sub/\.\./\.\./x\.safetensors'.*outside the checkpoint directory"):
        CheckpointIndex.open(good_dir)
    _write_index(good_dir, {"x": "m1.safetensors", "y": ".."})
    with pytest.raises(CheckpointError, match=r"'\.\.'.*outside the checkpoint directory"):
        CheckpointIndex.open(good_dir)
    # A name that stays inside is fine, and is normalized.
    _write_index(good_dir, {"x": "sub/../m1.safetensors", "y": "./m2.safetensors"})
    idx = CheckpointIndex.open(good_dir)
    assert idx.info("x").file == "m1.safetensors" and idx.info("y").file == "m2.safetensors"


def test_hf_cache_snapshot_with_symlinked_blobs(tmp_path):
    """A Hugging Face hub cache: snapshots/<rev>/ holds symlinks to ../../blobs/<hash>."""
    ts = _tensors(6)
    src = tmp_path / "src"
    write_checkpoint(src, ts.items(), max_shard_bytes=300)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        f.rename(blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / f.name)
    idx = CheckpointIndex.open(snap)
    assert set(idx.tensors) == set(ts)
    with CheckpointReader(idx) as r:
        for k, t in ts.items():
            assert torch.equal(r.read(k), t)


def test_index_naming_missing_file(good_dir):
    _write_index(good_dir, {"x": "m1.safetensors", "y": "m3.safetensors"})
    with pytest.raises(CheckpointError, match=r"'m3\.safetensors', which does not exist"):
        CheckpointIndex.open(good_dir)


def test_index_naming_key_file_lacks(good_dir):
    _write_index(good_dir, {"x": "m1.safetensors", "y": "m1.safetensors"})
    with pytest.raises(CheckpointError, match=r"'y' in m1\.safetensors, but m1\.safetensors has no such tensor"):
        CheckpointIndex.open(good_dir)


def test_garbage_index(good_dir):
    (good_dir / INDEX).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{INDEX}: unreadable index"):
        CheckpointIndex.open(good_dir)
    (good_dir / INDEX).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="no 'weight_map'"):
        CheckpointIndex.open(good_dir)
    (good_dir / INDEX).write_text(json.dumps({"weight_map": {"x": 3}}))
    with pytest.raises(CheckpointError, match="not a file name"):
        CheckpointIndex.open(good_dir)


@pytest.mark.parametrize("cut", [4, 20, -1, -8])
def test_truncated_file(good_dir, cut):
    f = good_dir / "m1.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[:cut])
    with pytest.raises(CheckpointError, match=r"m1\.safetensors.*truncated"):
        CheckpointIndex.open(good_dir)


def test_file_truncated_after_index_was_read(good_dir):
    idx = CheckpointIndex.open(good_dir)
    f = good_dir / "m1.safetensors"
    f.write_bytes(f.read_bytes()[:-4])
    with CheckpointReader(idx) as r:
        assert torch.equal(r.read("y"), torch.ones(5, dtype=torch.bfloat16))
        with pytest.raises(CheckpointError, match=r"m1\.safetensors.*truncated or different file"):
            r.read("x")


def test_header_length_larger_than_file(tmp_path):
    f = tmp_path / "bad.safetensors"
    header = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    _write_raw(f, header, b"\0" * 8, header_len=10_000)
    with pytest.raises(CheckpointError, match=r"bad\.safetensors: header length 10000 does not fit"):
        CheckpointIndex.open(f)
    _write_raw(f, header, b"\0" * 8, header_len=2**63)
    with pytest.raises(CheckpointError, match=r"bad\.safetensors: header length"):
        CheckpointIndex.open(f)


@pytest.mark.parametrize(
    "entry, data_len",
    [
        ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 48]}, 24),  # past the end of the file
        ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}, 24),  # too few bytes for dtype x shape
        ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 28]}, 32),  # too many bytes
        ({"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 24]}, 24),  # wrong dtype size
        ({"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 32]}, 24),  # shifted past the end
        ({"dtype": "F32", "shape": [2, 3], "data_offsets": [-8, 16]}, 24),  # negative
        ({"dtype": "F32", "shape": [2, 3], "data_offsets": [24, 0]}, 24),  # reversed
    ],
)
def test_data_offsets_invalid(tmp_path, entry, data_len):
    f = tmp_path / "offs.safetensors"
    _write_raw(f, {"x": entry}, b"\1" * data_len)
    with pytest.raises(CheckpointError, match=r"offs\.safetensors: tensor 'x' has data_offsets"):
        CheckpointIndex.open(f)


@pytest.mark.parametrize(
    "entry, msg",
    [
        ({"dtype": "F32", "shape": [2]}, "lacks dtype/shape/data_offsets"),
        ("a string", "lacks dtype/shape/data_offsets"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4, 8]}, "lacks dtype/shape/data_offsets"),
        ({"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}, "unsupported dtype 'Q7'"),
        ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "malformed shape or offsets"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8]}, "malformed shape or offsets"),
    ],
)
def test_malformed_header_entries(tmp_path, entry, msg):
    f = tmp_path / "ent.safetensors"
    _write_raw(f, {"x": entry}, b"\0" * 8)
    with pytest.raises(CheckpointError, match=rf"ent\.safetensors: .*{msg}"):
        CheckpointIndex.open(f)


@pytest.mark.parametrize("raw", [b"{not json at all}", b"\xff\xfe\x00garbage", b"[1, 2, 3]", b'"str"'])
def test_garbage_header_json(tmp_path, raw):
    f = tmp_path / "junk.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"junk\.safetensors: corrupt safetensors header"):
        CheckpointIndex.open(f)


def test_garbage_file_in_index(good_dir):
    (good_dir / "m2.safetensors").write_bytes(os.urandom(64))
    with pytest.raises(CheckpointError, match=r"m2\.safetensors"):
        CheckpointIndex.open(good_dir)


def test_checkpoint_error_is_value_error():
    assert issubclass(moeshard.CheckpointError, ValueError)


def test_index_of_many_keys_checks_each_file_once(tmp_path, monkeypatch):
    """A big MoE index names ~100,000 keys in a few dozen files: each distinct file name is
    validated and stat-ed once, not once per key."""
    num_files, per_file = 3, 2000
    weight_map = {}
    for f in range(num_files):
        name = f"model-{f + 1:05d}-of-{num_files:05d}.safetensors"
        tensors = {f"layers.{f}.experts.{k}.weight": torch.full((2,), float(f * per_file + k)) for k in range(per_file)}
        save_file(tensors, str(tmp_path / name))
        # The same file spelled two ways: still one file, one check each spelling.
        weight_map.update({key: (name if k % 2 else f"./{name}") for k, key in enumerate(tensors)})
    _write_index(tmp_path, weight_map)
    calls = []
    real = Path.is_file

    def counting(self):
        calls.append(self.name)
        return real(self)

    monkeypatch.setattr(Path, "is_file", counting)
    idx = CheckpointIndex.open(tmp_path)
    monkeypatch.undo()
    checked = [c for c in calls if c.endswith(".safetensors")]
    assert sorted(checked) == sorted(
        f"model-{f + 1:05d}-of-{num_files:05d}.safetensors" for f in range(num_files) for _ in range(2)
    )
    assert len(idx.tensors) == num_files * per_file
    assert set(idx.file_sizes) == {f"model-{f + 1:05d}-of-{num_files:05d}.safetensors" for f in range(num_files)}
    with CheckpointReader(idx) as r:
        for f in range(num_files):
            for k in (0, 1, per_file - 1):
                key = f"layers.{f}.experts.{k}.weight"
                assert idx.info(key).file == f"model-{f + 1:05d}-of-{num_files:05d}.safetensors"
                assert torch.equal(r.read(key), torch.full((2,), float(f * per_file + k)))
    # A bad name is still reported with the first key that uses it.
    weight_map["zz.extra"] = "missing.safetensors"
    weight_map["zz.extra2"] = "missing.safetensors"
    _write_index(tmp_path, weight_map)
    with pytest.raises(CheckpointError, match=r"key 'zz\.extra' names 'missing\.safetensors', which does not exist"):
        CheckpointIndex.open(tmp_path)


# -- the header as a whole: the safetensors library's rules ----------------------------------


def _u8(begin: int, end: int) -> dict:
    return {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}


def _safetensors_accepts(path: Path) -> bool:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                f.get_tensor(k)
        return True
    except SafetensorError:
        return False


@pytest.mark.parametrize(
    "header, data_len, msg",
    [
        ({"a": _u8(0, 4), "b": _u8(4, 8)}, 8, None),
        ({"b": _u8(4, 8), "a": _u8(0, 4)}, 8, None),  # key order is not offset order
        ({"a": _u8(0, 4), "z": _u8(4, 4), "y": _u8(4, 4), "b": _u8(4, 8)}, 8, None),  # zero-byte tensors
        ({"z": _u8(0, 0)}, 0, None),
        ({}, 0, None),
        # Two keys over the same bytes: expert 1 would silently get expert 0's weights.
        (
            {"experts.0.w": _u8(0, 4), "experts.1.w": _u8(0, 4)},
            4,
            r"tensors 'experts\.0\.w' \(data bytes \[0, 4\)\) and 'experts\.1\.w' \(\[0, 4\)\) overlap",
        ),
        ({"a": _u8(0, 4), "b": _u8(2, 6)}, 6, r"tensors 'a' .* and 'b' \(\[2, 6\)\) overlap"),
        ({"a": _u8(0, 4), "z": _u8(2, 2)}, 4, r"tensors 'a' .* and 'z' \(\[2, 2\)\) overlap"),
        ({"a": _u8(0, 4), "b": _u8(6, 10)}, 10, r"bytes \[4, 6\) of the data section, between tensors 'a' and 'b'"),
        ({"a": _u8(2, 6)}, 6, r"bytes \[0, 2\) of the data section belong to no tensor \(the first, 'a'"),
        ({"a": _u8(0, 4)}, 6, r"bytes \[4, 6\) at the end of the data section belong to no tensor"),
        ({}, 3, "a header with no tensors, but 3 data bytes follow it"),
    ],
)
def test_byte_ranges_tile_the_data_section(tmp_path, header, data_len, msg):
    """The rule safetensors' own reader enforces, checked against it on every case."""
    f = tmp_path / "tile.safetensors"
    _write_raw(f, header, bytes(range(data_len)))
    assert _safetensors_accepts(f) == (msg is None)
    if msg is not None:
        with pytest.raises(CheckpointError, match=rf"tile\.safetensors: {msg}"):
            CheckpointIndex.open(f)
        return
    idx = CheckpointIndex.open(f)
    with CheckpointReader(idx) as r:
        for key, e in header.items():
            assert r.read(key).tolist() == list(range(*e["data_offsets"]))


def test_overlap_in_an_indexed_shard_names_the_file(good_dir):
    """Through the index, as a load opens it."""
    f = good_dir / "m1.safetensors"
    data = f.read_bytes()[-48:]
    _write_raw(
        f,
        {
            "x": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
            "x2": {"dtype": "F32", "shape": [2, 4], "data_offsets": [16, 48]},
        },
        data,
    )
    _write_index(good_dir, {"x": "m1.safetensors", "y": "m2.safetensors"})
    with pytest.raises(CheckpointError, match=r"m1\.safetensors: tensors 'x' .* and 'x2' .* overlap"):
        CheckpointIndex.open(good_dir)


def test_project_writers_produce_tiled_files(tmp_path):
    """write_checkpoint (safetensors) and safetensors_header + pwrite_all (save, LoRA) both
    write files that safetensors and the validation accept."""
    ts = _tensors(7)
    idx = write_checkpoint(tmp_path / "w", ts.items(), max_shard_bytes=200)
    for name in idx.file_sizes:
        assert _safetensors_accepts(tmp_path / "w" / name)
    entries, pos = [], 0
    for key, t in ts.items():
        n = t.numel() * t.element_size()
        entries.append((key, moeshard.io.header.DTYPE_NAMES[t.dtype], t.shape, pos, pos + n))
        pos += n
    head = moeshard.io.writer.safetensors_header(entries)
    f = tmp_path / "streamed.safetensors"
    fd = os.open(f, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for (_key, *_, begin, _end), t in zip(entries, ts.values()):
            moeshard.io.writer.pwrite_all(fd, t.contiguous().view(-1).view(torch.uint8).numpy(), len(head) + begin)
        moeshard.io.writer.pwrite_all(fd, head, 0)
    finally:
        os.close(fd)
    assert _safetensors_accepts(f)
    with CheckpointReader(CheckpointIndex.open(f)) as r:
        for key, t in ts.items():
            assert torch.equal(r.read(key), t)


def test_header_size_limit_is_the_formats(tmp_path):
    """100,000,000 bytes (safetensors' MAX_HEADER_SIZE), not 100 MiB."""
    from moeshard.io.header import MAX_HEADER_BYTES

    assert MAX_HEADER_BYTES == 100_000_000
    f = tmp_path / "big.safetensors"
    with open(f, "wb") as fh:
        fh.write(struct.pack("<Q", 100_000_001) + b"{}")
        fh.truncate(200_000_000)  # sparse: the length fits in the file, but not in the format
    with pytest.raises(CheckpointError, match=r"big\.safetensors: header length 100000001 .*100,000,000-byte limit"):
        CheckpointIndex.open(f)


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    "raw, msg",
    [
        (b'{"__metadata__": {"x": ' + _nested(50_000) + b"}}", "JSON nested too deeply"),
        (b'{"x": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}", "JSON nested too deeply"),
        (b'{"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, ' + b"9" * 5000 + b"]}}", "a number too long"),
        (b'{"x": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}', "a number too long"),
        (
            b'{"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "x": '
            b'{"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}',
            "key 'x' appears twice",
        ),
        (b'{"x": {"dtype": "U8", "dtype": "F32", "shape": [4], "data_offsets": [0, 4]}}', "key 'dtype' appears twice"),
        (
            b'{"__metadata__": {}, "__metadata__": {}, "x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}',
            "key '__metadata__' appears twice",
        ),
        (
            b'{"__metadata__": {"a": NaN}, "x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}',
            "NaN is not valid JSON",
        ),
        (b'{"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, Infinity]}}', "Infinity is not valid JSON"),
        (
            b'{"__metadata__": {"a": 1}, "x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}',
            "__metadata__ must map strings to strings",
        ),
        (b'{"x\xff": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}', "not UTF-8"),
        (b'{"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}\x00\x00', "Extra data"),
    ],
)
def test_hostile_header_json(tmp_path, raw, msg):
    """Parser limits (recursion, int digits) and JSON that strict readers refuse: one
    CheckpointError naming the file, never RecursionError or a bare ValueError."""
    f = tmp_path / "hostile.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    with pytest.raises(CheckpointError, match=rf"hostile\.safetensors: .*{msg}"):
        CheckpointIndex.open(f)


@pytest.mark.parametrize(
    "shape, offsets, msg",
    [
        ([True, 4], [0, 4], r"shape \[True, 4\] is not non-negative integers"),  # bool is an int in Python
        ([4.0], [0, 4], r"shape \[4\.0\] is not non-negative"),
        ([-4], [0, 4], r"shape \[-4\] is not non-negative"),
        ([2**63], [0, 4], r"is not non-negative integers below 2\*\*63"),
        ([2**40, 2**40, 0], [0, 0], r"has 2\*\*63 elements or more"),  # safetensors: usize overflow
        ([4], [False, 4], r"data_offsets \[False, 4\] are not integers"),
        ([4], [0, 4.0], r"data_offsets \[0, 4\.0\] are not integers"),
        ([4], [0, 10**30], r"data_offsets \[0, 1000000000000000000000000000000\] but .* needs 4 bytes"),
    ],
)
def test_absurd_shapes_and_offsets(tmp_path, shape, offsets, msg):
    f = tmp_path / "absurd.safetensors"
    _write_raw(f, {"x": {"dtype": "U8", "shape": shape, "data_offsets": offsets}}, b"\0" * 4)
    with pytest.raises(CheckpointError, match=rf"absurd\.safetensors: tensor 'x' .*{msg}"):
        CheckpointIndex.open(f)


def test_hostile_index_json(good_dir):
    index = good_dir / INDEX
    index.write_bytes(b'{"weight_map": ' + _nested(50_000) + b"}")
    with pytest.raises(CheckpointError, match=rf"{INDEX}: unreadable index: JSON nested too deeply"):
        CheckpointIndex.open(good_dir)
    index.write_text('{"weight_map": {"x": "m1.safetensors", "x": "m2.safetensors"}}')
    with pytest.raises(CheckpointError, match=rf"{INDEX}: unreadable index: key 'x' appears twice"):
        CheckpointIndex.open(good_dir)
    index.write_text('{"metadata": {"total_size": ' + "9" * 5000 + '}, "weight_map": {}}')
    with pytest.raises(CheckpointError, match=rf"{INDEX}: unreadable index: a number too long"):
        CheckpointIndex.open(good_dir)


def test_load_json_names_the_file(tmp_path):
    from moeshard.io.strict_json import load_json

    cfg = tmp_path / "config.json"
    cfg.write_bytes(b'{"a": ' + _nested(100_000) + b"}")
    with pytest.raises(CheckpointError, match=r"config\.json: config: JSON nested too deeply"):
        load_json(cfg, "config")
    with pytest.raises(CheckpointError, match=r"nope\.json: config: .*No such file"):
        load_json(tmp_path / "nope.json", "config")
    cfg.write_text('{"a": [1, 2], "b": {"c": "d"}}')
    assert load_json(cfg, "config") == {"a": [1, 2], "b": {"c": "d"}}


def test_tensor_info_is_compact_and_picklable():
    """A maximal header holds ~1M TensorInfos (slotted: no per-object __dict__); indexes
    travel between ranks pickled."""
    import pickle

    from moeshard.io.header import TensorInfo

    t = TensorInfo("f.safetensors", 8, "BF16", (2, 3))
    assert not hasattr(t, "__dict__")
    assert pickle.loads(pickle.dumps(t)) == t and t.nbytes == 12 and t.itemsize == 2


_ENTRY = b'"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]'


@pytest.mark.parametrize(
    "raw, msg",
    [
        (b"{" + _ENTRY + b', "zz": 1e308}}', None),  # unknown fields are ignored, as safetensors does
        (b"{" + _ENTRY + b', "zz": 1e400}}', "number '1e400' is out of range"),  # Python: inf
        (b"{" + _ENTRY + b', "zz": -0}}', None),
        (b'{"a": {"dtype": "U8", "shape": [-0], "data_offsets": [0, 0]}}', r"shape \[-0\.0\]"),  # serde: a float
        (b'{"__metadata__": {"x": "\\ud83d\\ude00"}, ' + _ENTRY + b"}}", None),  # a pair: one character
        (b'{"__metadata__": {"x": "\\\\ud800"}, ' + _ENTRY + b"}}", None),  # an escaped backslash, then text
        (b'{"__metadata__": {"x": "\\ud7ff"}, ' + _ENTRY + b"}}", None),  # below the surrogates
        (b'{"__metadata__": {"x": "\\ud800"}, ' + _ENTRY + b"}}", "unpaired UTF-16 surrogate"),
        (b'{"a\\udc00": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}', "unpaired UTF-16 surrogate"),
        (b'{"__metadata__": {"x": "\\ud83dx\\ude00"}, ' + _ENTRY + b"}}", "unpaired UTF-16 surrogate"),
        (b"{" + _ENTRY + b', "zz": ' + _nested(125) + b"}}", None),  # 127 levels in all
        (b"{" + _ENTRY + b', "zz": ' + _nested(126) + b"}}", "JSON nested 128 levels deep"),
        (b"{" + _ENTRY + b', "zz": "' + b"[" * 200 + b'"}}', None),  # brackets in a string nest nothing
    ],
)
def test_header_json_as_safetensors_reads_it(tmp_path, raw, msg):
    """Where Python's json and serde_json (safetensors' parser) disagree, the header is read
    as safetensors reads it (checked against safetensors itself on every case)."""
    f = tmp_path / "serde.safetensors"
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\1" * (0 if b"[-0]" in raw else 4))
    assert _safetensors_accepts(f) == (msg is None)
    if msg is None:
        assert set(CheckpointIndex.open(f).tensors) == {"a"}
    else:
        with pytest.raises(CheckpointError, match=rf"serde\.safetensors: .*{msg}"):
            CheckpointIndex.open(f)


def test_load_refuses_experts_aliasing_the_same_bytes(tmp_path):
    """The issue's case: expert 1's header entry pointing at expert 0's bytes. The load (and
    verify, which would have agreed with the wrong bytes) refuse the file, naming it and both keys."""
    import shutil

    import tiny_moe

    good, bad = tmp_path / "good", tmp_path / "bad"
    tiny_moe.write(good)
    shutil.copytree(good, bad)
    weight_map = json.loads((bad / INDEX).read_text())["weight_map"]
    e0, e1 = "layers.0.mlp.experts.0.up_proj.weight", "layers.0.mlp.experts.1.up_proj.weight"
    shard = bad / weight_map[e0]
    assert weight_map[e1] == weight_map[e0]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header[e1]["data_offsets"] = header[e0]["data_offsets"]
    _write_raw(shard, header, raw[8 + n :])
    want = rf"{shard.name}: tensors '{e0}' .* and '{e1}' .* overlap"
    with torch.device("meta"):
        model = tiny_moe.TinyMoE()
    with pytest.raises(CheckpointError, match=want):
        moeshard.load(model, bad)
    with torch.device("meta"):
        model = tiny_moe.TinyMoE()
    moeshard.load(model, good)
    with pytest.raises(CheckpointError, match=want):
        moeshard.verify(model, bad)
