"""Reads planned as extents (moeshard.io.extents): the pure planner (adjacent pieces joined,
small gaps read into scratch, large gaps, other files, overlaps and the iovec limit split,
staggered file order), the reads compared with the bytes safetensors itself reads, exact byte
counts, and the runner: destinations a read cannot land in as they are (not contiguous,
another dtype) beside coalesced ones, and a failed extent reported, not lost. (A failed
read raised on every rank of 4: tests/test_errors_dist.py, whose shared-storage load reads
by extents.)"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from safetensors import safe_open

import moeshard
import tiny_moe
from moeshard.box import box_numel, box_shape, box_slices
from moeshard.execute import ReaderSource, TensorSink, execute_schedule
from moeshard.io.extents import ExtentReads, Part, Segment, plan_extents
from moeshard.models.describe import local_tensor
from moeshard.ops.load import plan_load
from moeshard.topology import Topology


def _covers(extents, segments):
    """Every segment read exactly once, each extent's parts tiling it in file order."""
    seen = []
    for e in extents:
        pos = e.offset
        for p in e.parts:
            if p.seg >= 0:
                s = segments[p.seg]
                assert (s.file, s.offset, s.nbytes) == (e.file, pos, p.nbytes)
                seen.append(p.seg)
            pos += p.nbytes
        assert pos == e.offset + e.nbytes
        assert e.gap_bytes == sum(p.nbytes for p in e.parts if p.seg < 0)
    assert sorted(seen) == [i for i, s in enumerate(segments) if s.nbytes > 0]


def test_adjacent_segments_make_one_extent():
    segs = [Segment("a", 100, 50, 0, 0), Segment("a", 0, 100, 1, 0), Segment("a", 150, 10, 2, 0)]
    ext = plan_extents(segs, gap_bytes=0)
    assert len(ext) == 1 and (ext[0].offset, ext[0].nbytes, ext[0].gap_bytes) == (0, 160, 0)
    assert [p.seg for p in ext[0].parts] == [1, 0, 2]
    _covers(ext, segs)


def test_gaps_below_the_threshold_are_read_into_scratch_others_split():
    segs = [Segment("a", 0, 10, 0, 0), Segment("a", 14, 10, 1, 0), Segment("a", 100, 10, 2, 0)]
    ext = plan_extents(segs, gap_bytes=4)
    assert [(e.offset, e.nbytes, e.gap_bytes) for e in ext] == [(0, 24, 4), (100, 10, 0)]
    assert ext[0].parts == (Part(0, 10), Part(-1, 4), Part(1, 10)) and ext[0].piece_bytes == 20
    _covers(ext, segs)
    assert len(plan_extents(segs, gap_bytes=3)) == 3


def test_files_overlaps_limits_split_and_empty_segments_vanish():
    segs = [
        Segment("b", 0, 8, 0, 0),
        Segment("a", 0, 8, 1, 0),
        Segment("a", 8, 8, 2, 0),
        Segment("a", 12, 8, 3, 0),
        Segment("a", 20, 0, 4, 0),
    ]  # 3 overlaps 2: never joined
    ext = plan_extents(segs)
    assert [(e.file, e.offset, e.nbytes) for e in ext] == [("a", 0, 16), ("a", 12, 8), ("b", 0, 8)]
    _covers(ext, segs)
    many = [Segment("a", 4 * i, 4, i, 0) for i in range(10)]
    assert [len(e.parts) for e in plan_extents(many, max_parts=4)] == [4, 4, 2]
    assert [e.nbytes for e in plan_extents(many, max_bytes=12)] == [12, 12, 12, 4]
    with pytest.raises(ValueError, match="max_parts"):
        plan_extents(many, max_parts=1)


def test_each_rank_starts_at_its_own_file():
    segs = [Segment(f, o, 4, 0, 0) for f in ("f0", "f1", "f2") for o in (8, 0)]
    for rank in range(5):
        order = [e.file for e in plan_extents(segs, rank=rank)]
        want = [f"f{(rank + i) % 3}" for i in range(3)]
        assert order == want, (rank, order)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("extents")
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i:02d}": torch.randn(7, 5, 3, generator=g).to(torch.bfloat16 if i % 3 else torch.float32) for i in range(24)
    }
    tensors["scalar"] = torch.tensor(1.5)
    moeshard.write_checkpoint(root, tensors.items(), max_shard_bytes=2000)
    return root


def _file_values(root, index, key, box):
    with safe_open(str(root / index.info(key).file), "pt") as f:
        return f.get_tensor(key)[box_slices(box)]


def _random_boxes(index, rng, n):
    out = []
    keys = sorted(index.tensors)[:-10]
    for key in rng.choice(keys, size=n, replace=False):
        box = []
        for dim in index.info(str(key)).shape:
            a = int(rng.integers(dim))
            box.append((a, int(rng.integers(1, dim - a + 1))))
        out.append((str(key), tuple(box)))
    return out


@pytest.mark.parametrize("gap", [0, 64, 1 << 20])
@pytest.mark.parametrize("seed", range(4))
def test_extent_reads_are_the_files_bytes(ckpt, gap, seed):
    index = moeshard.CheckpointIndex.open(ckpt)
    assert len(index.file_sizes) > 3
    rng = np.random.default_rng(seed)
    items = []
    for key, box in _random_boxes(index, rng, 12):
        items.append((key, box, torch.full(box_shape(box), -7, dtype=index.info(key).torch_dtype)))
    # Whole tensors too: neighbours in a file, joined without gaps.
    for key in sorted(index.tensors)[-10:]:
        if key not in {k for k, _, _ in items}:
            box = tuple((0, n) for n in index.info(key).shape)
            items.append((key, box, torch.empty(box_shape(box), dtype=index.info(key).torch_dtype)))
    with moeshard.CheckpointReader(index) as reader:
        reads = ExtentReads.of_boxes(reader, items, rank=seed, gap_bytes=gap, max_bytes=1500)
        landed = sum(reads.read(i) for i in range(len(reads)))
        want = sum(box_numel(box) * index.info(key).itemsize for key, box, _ in items)
        gaps = sum(e.gap_bytes for e in reads.extents)
        assert landed == reader.bytes_read == want  # the pieces' bytes, exactly
        assert reader.gap_bytes_read == gaps and (gap > 0 or gaps == 0)
        assert len(reads) < len(reads.segments)  # coalesced
    for key, box, out in items:
        assert torch.equal(out, _file_values(ckpt, index, key, box)), (key, box)


def test_hints_cover_every_extent_once(ckpt):
    index = moeshard.CheckpointIndex.open(ckpt)
    items = [
        (
            k,
            tuple((0, n) for n in index.info(k).shape),
            torch.empty(index.info(k).shape, dtype=index.info(k).torch_dtype),
        )
        for k in sorted(index.tensors)
    ]
    with moeshard.CheckpointReader(index) as reader:
        reads = ExtentReads.of_boxes(reader, items, advise_bytes=1000, max_bytes=400)
        hints = []
        with mock.patch.object(reader, "advise", lambda f, o, n: hints.append((f, o, n))):
            reads.advise(-1)
            first = len(hints)
            for i in range(len(reads)):
                reads.advise(i)
        assert 0 < first < len(reads)  # a window ahead, not everything at once
    covered = {}
    for f, o, n in hints:
        covered.setdefault(f, []).append((o, o + n))
    for e in reads.extents:  # each extent inside one hint, hints disjoint
        assert sum(a <= e.offset and e.offset + e.nbytes <= b for a, b in covered[e.file]) == 1
    for spans in covered.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def _single_rank_plan(root, model):
    index = moeshard.CheckpointIndex.open(root)
    topo = Topology(1, 1).with_rank(0)
    descs, _, plan = plan_load(model, index, None, topo, np.ones(1, dtype=bool), "job", rank=0)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers())
    return index, descs, plan, [local_tensor(tensors[d.name], d) for d in descs]


def test_runner_mixes_extents_with_staged_and_cast_destinations(tmp_path):
    """A rank's own reads: contiguous same-dtype destinations by extents; a transposed
    (non-contiguous) destination and a float64 one (a cast) piece by piece; all exact."""
    tiny_moe.write(tmp_path)
    values = tiny_moe.read_all(tmp_path)
    model = tiny_moe.TinyMoE()
    index, descs, plan, dests = _single_rank_plan(tmp_path, model)
    names = [d.name for d in descs]
    odd = {names.index("lm_head.weight"): "transposed", names.index("layers.1.mlp.fc.weight"): "float64"}
    for j, how in odd.items():
        t = dests[j]
        dests[j] = torch.empty(t.shape[::-1]).t() if how == "transposed" else torch.empty(t.shape, dtype=torch.float64)
        assert dests[j].is_contiguous() == (how != "transposed")
    for t in dests:
        t.fill_(-7)
    with moeshard.CheckpointReader(index) as reader:
        calls = []
        real = moeshard.CheckpointReader.read_extent
        with mock.patch.object(
            moeshard.CheckpointReader, "read_extent", lambda self, e, v, s: (calls.append(e), real(self, e, v, s))[1]
        ):
            with torch.no_grad():
                stats = execute_schedule(
                    plan, 0, ReaderSource(plan, reader, index), TensorSink(plan, dests, 0), torch.device("cpu")
                ).check()
        assert stats.bytes_read == index.total_bytes == int(plan.cost.read_bytes.sum())
        assert stats.gap_bytes_read == reader.gap_bytes_read
        assert 0 < len(calls) < len(plan.reads.piece) / 4  # coalesced: far fewer reads than pieces
    for j, d in enumerate(descs):
        if d.name in values:
            assert torch.equal(dests[j], values[d.name].to(dests[j].dtype)), d.name
    experts = dests[names.index("layers.0.mlp.experts.gate_up_proj")]
    want = torch.stack(
        [
            torch.cat(
                [
                    values[f"layers.0.mlp.experts.{e}.gate_proj.weight"],
                    values[f"layers.0.mlp.experts.{e}.up_proj.weight"],
                ]
            )
            for e in range(tiny_moe.NUM_EXPERTS)
        ]
    )
    assert torch.equal(experts, want.to(experts.dtype))


@pytest.mark.parametrize("threads", [1, 3])
def test_a_failed_extent_is_reported_not_lost(tmp_path, threads):
    tiny_moe.write(tmp_path)
    index = moeshard.CheckpointIndex.open(tmp_path)
    victim = index.info("layers.1.mlp.fc.weight").file  # fp32, as the model: read by an extent
    real = moeshard.CheckpointReader._pread

    def failing(self, fd, buf, offset, name):
        if name == victim and isinstance(buf, list):  # only extents (lists of iovecs) fail
            raise moeshard.CheckpointError(f"{self.root / name}: unexpected end of file at byte {offset}")
        return real(self, fd, buf, offset, name)

    model = tiny_moe.TinyMoE()
    with mock.patch.object(moeshard.CheckpointReader, "_pread", failing):
        with pytest.raises(moeshard.CheckpointError, match=f"{victim}: unexpected end of file"):
            moeshard.load(model, tmp_path, read_threads=threads)
    rep = moeshard.load(model, tmp_path, read_threads=threads)
    assert rep.bytes_read_rank == rep.checkpoint_bytes
    assert (
        tiny_moe.compare(model, tiny_moe.read_all(tmp_path), moeshard.Placement.contiguous(2, tiny_moe.NUM_EXPERTS, 1))
        == []
    )


def test_flat_targets_are_the_views_bytes(tmp_path):
    """TensorSink.flat_targets (the byte ranges the runner reads into without a view per
    piece) names, for every delivery, exactly the bytes of its view, or declines (-1)."""
    tiny_moe.write(tmp_path)
    model = tiny_moe.TinyMoE()
    _, descs, plan, dests = _single_rank_plan(tmp_path, model)
    names = [d.name for d in descs]
    dests[names.index("lm_head.weight")] = torch.empty(dests[names.index("lm_head.weight")].shape[::-1]).t()
    sink = TensorSink(plan, dests, 0)
    rows = np.arange(len(plan.deliveries.piece))
    flat = sink.flat_targets(rows)
    assert (flat.buffer >= 0).sum() > len(rows) // 2
    for i, row in enumerate(rows.tolist()):
        view = sink.target(row)
        b = int(flat.buffer[i])
        if b < 0:
            assert not view.is_contiguous() or descs[int(plan.deliveries.param[row])].name == "lm_head.weight", row
            continue
        assert view.is_contiguous() and flat.dtypes[b] == view.dtype
        base = np.frombuffer(flat.buffers[b], dtype=np.uint8).ctypes.data
        assert view.data_ptr() - base == int(flat.start[i]), (row, descs[int(plan.deliveries.param[row])].name)
    # Slots: experts' rows address their slot's part of the fused tensor.
    assert any(int(plan.deliveries.slot[r]) > 0 and flat.buffer[r] >= 0 for r in rows.tolist())


@pytest.mark.parametrize("seed", range(3))
def test_pieces_given_as_arrays_read_the_files_bytes(ckpt, seed):
    """ExtentReads.of_pieces (the runner's path: a schedule's padded box arrays, no step per
    piece for one-range boxes) against safetensors, boxes of one and of several runs."""
    index = moeshard.CheckpointIndex.open(ckpt)
    rng = np.random.default_rng(10 + seed)
    boxes = _random_boxes(index, rng, 12) + [("scalar", ())]
    keys = sorted({k for k, _ in boxes})
    d = 3
    off = np.zeros((len(boxes), d), dtype=np.int64)
    length = np.full((len(boxes), d), 7, dtype=np.int64)  # padding values must not matter
    outs, views = [], []
    for i, (key, box) in enumerate(boxes):
        off[i, : len(box)] = [o for o, _ in box]
        length[i, : len(box)] = [n for _, n in box]
        out = torch.full(box_shape(box), -7, dtype=index.info(key).torch_dtype)
        outs.append(out)
        views.append(memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B"))
    key = np.array([keys.index(k) for k, _ in boxes], dtype=np.int64)
    with moeshard.CheckpointReader(index) as reader:
        reads = ExtentReads.of_pieces(reader, keys, key, off, length, views, rank=seed, gap_bytes=32)
        landed = sum(reads.read(i) for i in range(len(reads)))
        assert landed == reader.bytes_read == sum(o.numel() * o.element_size() for o in outs)
        bad = off.copy()
        bad[0, 0] = 10**6
        with pytest.raises(ValueError, match="does not fit"):
            ExtentReads.of_pieces(reader, keys, key, bad, length, views)
    for (k, box), out in zip(boxes, outs):
        assert torch.equal(out, _file_values(ckpt, index, k, box)), (k, box)
