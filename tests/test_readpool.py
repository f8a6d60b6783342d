"""The reader pool (moeshard.io.readpool): reads on worker threads, compared with the bytes
safetensors itself reads; byte counts; a failing read reported, not lost; load with threads.
(Load with threads on 4 ranks, and a failing read in a worker thread raised on every rank:
tests/test_errors_dist.py.)"""

from __future__ import annotations

import threading
from unittest import mock

import numpy as np
import pytest
import torch
from safetensors import safe_open

import moeshard
import tiny_moe
from moeshard.box import box_slices
from moeshard.io.readpool import ReadPool, default_read_threads


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("readpool")
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16": torch.randn(37, 29, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(5, 7, 11, generator=g),
        "c.i64": torch.randint(-1000, 1000, (64,), generator=g),
        "d.f16": torch.randn(3, 300, generator=g).to(torch.float16),
    }
    moeshard.write_checkpoint(root, tensors.items(), max_shard_bytes=4000)
    return root


def _file_values(root, index, key, box):
    info = index.info(key)
    with safe_open(str(root / info.file), "pt") as f:
        return f.get_tensor(key)[box_slices(box)]


def _random_boxes(index, rng, n):
    out = []
    keys = sorted(index.tensors)
    for _ in range(n):
        key = keys[rng.integers(len(keys))]
        shape = index.info(key).shape
        box = []
        for dim in shape:
            a = int(rng.integers(dim))
            box.append((a, int(rng.integers(1, dim - a + 1))))
        out.append((key, tuple(box)))
    return out


def test_threads_read_the_files_bytes(ckpt):
    index = moeshard.CheckpointIndex.open(ckpt)
    boxes = _random_boxes(index, np.random.default_rng(1), 200)
    seen_threads: set[str] = set()
    real = moeshard.CheckpointReader._pread

    def recording(self, fd, buf, offset, name):
        seen_threads.add(threading.current_thread().name)
        return real(self, fd, buf, offset, name)

    with mock.patch.object(moeshard.CheckpointReader, "_pread", recording):
        with moeshard.CheckpointReader(index) as reader, ReadPool(reader, threads=4) as pool:
            outs = []
            for i, (key, box) in enumerate(boxes):
                want_dtype = index.info(key).torch_dtype
                if i % 3 == 1 and want_dtype.is_floating_point:
                    want_dtype = torch.float64  # a cast on the way
                out = torch.full([n for _, n in box], -7, dtype=want_dtype)
                pool.submit(key, box, out)
                outs.append(out)
            assert pool.drain() == []
            nbytes = sum(int(np.prod([n for _, n in box])) * index.info(key).itemsize for key, box in boxes)
            assert pool.bytes_done == reader.bytes_read == nbytes
    for (key, box), out in zip(boxes, outs):
        want = _file_values(ckpt, index, key, box)
        assert torch.equal(out, want.to(out.dtype)), key
    assert seen_threads and all(name.startswith("moeshard-read") for name in seen_threads)


def test_failing_read_is_returned_by_drain(ckpt, tmp_path):
    index = moeshard.CheckpointIndex.open(ckpt)
    info = index.info("b.f32")
    victim = info.file
    real = moeshard.CheckpointReader._pread

    def failing(self, fd, buf, offset, name):  # only reads of b.f32's bytes fail
        if name == victim and info.offset <= offset < info.offset + info.nbytes:
            raise moeshard.CheckpointError(f"{self.root / name}: unexpected end of file at byte {offset}")
        return real(self, fd, buf, offset, name)

    with mock.patch.object(moeshard.CheckpointReader, "_pread", failing):
        with moeshard.CheckpointReader(index) as reader, ReadPool(reader, threads=3) as pool:
            good = torch.empty(37, 29, dtype=torch.bfloat16)
            pool.submit("b.f32", ((0, 5), (0, 7), (0, 11)), torch.empty(5, 7, 11))
            pool.submit("a.bf16", ((0, 37), (0, 29)), good)
            errors = pool.drain()
    assert len(errors) == 1 and isinstance(errors[0], moeshard.CheckpointError)
    assert victim in str(errors[0]) and "unexpected end of file" in str(errors[0])
    assert torch.equal(good, _file_values(ckpt, index, "a.bf16", ((0, 37), (0, 29))))


def test_submit_checks_the_shape(ckpt):
    index = moeshard.CheckpointIndex.open(ckpt)
    with moeshard.CheckpointReader(index) as reader, ReadPool(reader, threads=2) as pool:
        with pytest.raises(ValueError, match="destination of shape"):
            pool.submit("a.bf16", ((0, 3), (0, 4)), torch.empty(4, 3, dtype=torch.bfloat16))


def test_default_threads(monkeypatch):
    monkeypatch.setenv("MOESHARD_READ_THREADS", "3")
    assert default_read_threads(8) == 3
    for bad in ("0", "x"):
        monkeypatch.setenv("MOESHARD_READ_THREADS", bad)
        with pytest.raises(ValueError, match="MOESHARD_READ_THREADS"):
            default_read_threads(8)
    monkeypatch.delenv("MOESHARD_READ_THREADS")
    assert 1 <= default_read_threads(1) <= 8 and default_read_threads(10**6) == 1
    # Accelerator destinations: at most 4 (measured fastest on an H200 host), cores shared alike.
    assert default_read_threads(1, "cuda") == min(4, default_read_threads(1))
    assert default_read_threads(10**6, "cuda") == 1


@pytest.mark.parametrize("threads", [1, 4])
def test_load_with_threads(tmp_path, threads):
    tiny_moe.write(tmp_path)
    values = tiny_moe.read_all(tmp_path)
    with torch.device("meta"):
        model = tiny_moe.TinyMoE()
    rep = moeshard.load(model, tmp_path, read_threads=threads)
    assert rep.bytes_read_rank == rep.checkpoint_bytes
    assert tiny_moe.compare(model, values, moeshard.Placement.contiguous(2, tiny_moe.NUM_EXPERTS, 1)) == []
    with pytest.raises(ValueError, match="read_threads"):
        moeshard.load(model, tmp_path, read_threads=0)
    assert moeshard.verify(model, tmp_path).num_boxes_checked > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned buffers and side-stream copies")
def test_cuda_destinations(ckpt):
    index = moeshard.CheckpointIndex.open(ckpt)
    boxes = _random_boxes(index, np.random.default_rng(2), 100)
    with moeshard.CheckpointReader(index) as reader, ReadPool(reader, threads=4, buffer_bytes=4096) as pool:
        outs = []
        for i, (key, box) in enumerate(boxes):
            dtype = index.info(key).torch_dtype
            dtype = torch.float32 if i % 2 and dtype.is_floating_point else dtype
            out = torch.full([n for _, n in box], -7, dtype=dtype, device="cuda")
            pool.submit(key, box, out)
            outs.append(out)
        assert pool.drain() == []
    for (key, box), out in zip(boxes, outs):
        assert torch.equal(out.cpu(), _file_values(ckpt, index, key, box).to(out.dtype)), key


def _direct_io_or_skip(root, index):
    try:
        with moeshard.CheckpointReader(index, direct_io=True) as reader:
            reader.check_files(index.file_sizes)
    except moeshard.CheckpointError as e:
        assert "O_DIRECT" in str(e)  # named, as the error a user gets
        pytest.skip(f"no direct I/O on this file system: {e}")


@pytest.mark.parametrize("threads", [1, 3])
def test_direct_io_reads(ckpt, threads, monkeypatch):
    import moeshard.io.reader as cp

    index = moeshard.CheckpointIndex.open(ckpt)
    _direct_io_or_skip(ckpt, index)
    # A bounce buffer of 2 blocks: boxes of several runs, runs longer than the buffer, offsets
    # inside blocks and the files' short last blocks all occur.
    monkeypatch.setattr(cp, "DIRECT_BOUNCE_BYTES", 2 * cp.DIRECT_ALIGN)
    boxes = _random_boxes(index, np.random.default_rng(3), 120) + [(k, None) for k in sorted(index.tensors)]
    with moeshard.CheckpointReader(index, direct_io=True) as reader, ReadPool(reader, threads=threads) as pool:
        outs = []
        for key, box in boxes:
            box = box or tuple((0, n) for n in index.info(key).shape)
            out = torch.empty([n for _, n in box], dtype=index.info(key).torch_dtype)
            pool.submit(key, box, out)
            outs.append((key, box, out))
        assert pool.drain() == []
        assert reader.bytes_read == sum(out.numel() * out.element_size() for _, _, out in outs)
    for key, box, out in outs:
        assert torch.equal(out, _file_values(ckpt, index, key, box)), key


def test_load_with_direct_io(tmp_path):
    tiny_moe.write(tmp_path)
    index = moeshard.CheckpointIndex.open(tmp_path)
    _direct_io_or_skip(tmp_path, index)
    values = tiny_moe.read_all(tmp_path)
    with torch.device("meta"):
        model = tiny_moe.TinyMoE()
    rep = moeshard.load(model, tmp_path, read_threads=2, direct_io=True)
    assert rep.bytes_read_rank == rep.checkpoint_bytes
    assert tiny_moe.compare(model, values, moeshard.Placement.contiguous(2, tiny_moe.NUM_EXPERTS, 1)) == []
