"""Block-quantized FP8 checkpoints (DeepSeek-V3's format: float8_e4m3fn weights with a float32
``weight_scale_inv`` of 16 x 16 blocks here, 128 x 128 in the release) load dequantized into bf16 and
fp32 models (and verify checks them): every value equals an independent dequantization (this file's own quantizer and
``from_pretrained`` of the dequantized checkpoint), in one process and on 4 gloo ranks with EP=2 x
expert-FSDP=2 and a redundant placement, with the scales in other files than their weights and, in
"single" mode, read by rank 0 only and a staging budget that cuts pieces across blocks. An FP8
model (transformers' FP8Linear / FP8Experts) keeps the FP8 bytes and takes the scales as expert
tensors that load, relocate and save move with their expert.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

import hf_families
from mp import run_ranks

transformers = pytest.importorskip("transformers")

BLOCK = 16
FAMILY = "deepseek_v3"


def _quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("proj.weight")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn, scale_inv float32 [ceil(R/B), ceil(C/B)])`` with ``w ~ q * scale``."""
    r, c = w.shape
    sr, sc = -(-r // BLOCK), -(-c // BLOCK)
    pad = torch.zeros(sr * BLOCK, sc * BLOCK)
    pad[:r, :c] = w.float().abs()
    amax = pad.reshape(sr, BLOCK, sc, BLOCK).amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (w.float() / expand(scale, r, c)).to(torch.float8_e4m3fn)
    return q, scale


def expand(scale: torch.Tensor, r: int, c: int) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, 0)[:r].repeat_interleave(BLOCK, 1)[:, :c]


def make_checkpoints(root) -> tuple[str, str, int]:
    """(FP8 checkpoint, the same dequantized in fp32, number of quantized weights)."""
    from safetensors.torch import load_file

    import moeshard

    model = hf_families.build(FAMILY)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    plain = os.path.join(root, "plain")
    model.save_pretrained(plain)
    state = {}
    for f in sorted(os.listdir(plain)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(plain, f)))
    weights, scales, deq = [], [], []
    for k, v in sorted(state.items()):
        if _quantized(k, v):
            q, s = quantize(v)
            weights.append((k, q))
            scales.append((k + "_scale_inv", s))
            deq.append((k, q.float() * expand(s, *v.shape)))
        else:
            weights.append((k, v))
            deq.append((k, v))
    fp8, dq = os.path.join(root, "fp8"), os.path.join(root, "dequantized")
    # Scales after every weight, in small shards: a weight's scale sits in another file.
    moeshard.write_checkpoint(fp8, weights + scales, max_shard_bytes=8_000)
    moeshard.write_checkpoint(dq, deq, max_shard_bytes=8_000)
    for d in (fp8, dq):
        shutil.copy(os.path.join(plain, "config.json"), d)
    assert len(scales) > 20
    return fp8, dq, len(scales)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return make_checkpoints(str(tmp_path_factory.mktemp("fp8")))


# An expert other than 0 (whose checks the others' used to ride on), in the second MoE layer.
ODD_KEY = "model.layers.2.mlp.experts.3.down_proj.weight"


def _rewrite(src: str, dst: str, changes: dict) -> str:
    """A copy of checkpoint ``src`` at ``dst`` with ``changes`` (key -> tensor, or None to drop
    it), in the same small shards (scales in other files than their weights)."""
    from safetensors.torch import load_file

    import moeshard

    state = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(src, f)))
    weights = sorted((k, v) for k, v in state.items() if not k.endswith("_scale_inv"))
    scales = sorted((k, v) for k, v in state.items() if k.endswith("_scale_inv"))
    kept = [(k, changes.get(k, v)) for k, v in weights + scales if changes.get(k, v) is not None]
    moeshard.write_checkpoint(dst, kept, max_shard_bytes=8_000)
    shutil.copy(os.path.join(src, "config.json"), dst)
    return dst


@pytest.fixture(scope="module")
def broken(ckpts, tmp_path_factory):
    """The FP8 checkpoint with :data:`ODD_KEY`'s scale missing, of a shape no block grid of the
    weight gives, or of an integer dtype."""
    fp8, _, _ = ckpts
    root = tmp_path_factory.mktemp("fp8_broken")
    scale = ODD_KEY + "_scale_inv"
    rows, cols = load_tensor(fp8, scale).shape
    return {
        "missing": _rewrite(fp8, str(root / "missing"), {scale: None}),
        "shape": _rewrite(fp8, str(root / "shape"), {scale: torch.ones(rows + 1, cols)}),
        "dtype": _rewrite(fp8, str(root / "dtype"), {scale: torch.ones(rows, cols, dtype=torch.int32)}),
    }


def load_tensor(path: str, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(os.path.join(path, _file_of(path, key)), "pt") as f:
        return f.get_tensor(key)


def _file_of(path: str, key: str) -> str:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"][key]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_dequantized_on_load(ckpts, dtype):
    import moeshard

    fp8, dq, num = ckpts
    key = "model.layers.1.mlp.experts.0.gate_proj.weight"
    index = moeshard.CheckpointIndex.open(fp8)
    assert index.info(key).dtype == "F8_E4M3" and _file_of(fp8, key) != _file_of(fp8, key + "_scale_inv")
    want = transformers.AutoModelForCausalLM.from_pretrained(dq, dtype=dtype)
    model = hf_families.build(FAMILY, dtype)
    rep = moeshard.load(model, fp8)
    assert rep.dequantized_keys == num and rep.unused_keys == ()
    for (n, a), (_, b) in zip(want.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n
    # verify dequantizes on its own (the reader reads the scale blocks), and catches one changed value.
    assert moeshard.verify(model, fp8).num_boxes_checked > 0
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[2, 3, 5] += 1
    with pytest.raises(ValueError, match="down_proj"):
        moeshard.verify(model, fp8)
    # Asked not to dequantize: refused, naming the weight and its scale.
    with pytest.raises(ValueError, match="float8_e4m3fn|F8_E4M3"):
        moeshard.load(hf_families.build(FAMILY, dtype), fp8, dequantize=False)


@pytest.mark.parametrize("case", ["missing", "shape", "dtype"])
def test_every_experts_scale_is_checked(ckpts, broken, case):
    """Expert 3's FP8 weight without a usable scale (missing, of a shape its block grid does not
    give, not float), its neighbours' fine: load refuses it, strict or not, naming the key, the
    expert and the file, never loading its raw FP8 values (up to 448) unscaled; verify refuses it
    as well, so a model holding those raw values cannot pass."""
    import re

    import moeshard

    fp8, _, _ = ckpts
    bad = broken[case]
    where = rf"'{re.escape(ODD_KEY)}' has dtype F8_E4M3 \(FP8\).*\(logical expert 3's tensor, in file model-\d+"
    for strict in (True, False):
        with pytest.raises(ValueError, match=where):
            moeshard.load(hf_families.build(FAMILY, torch.float32), bad, strict=strict)
    # A model holding expert 3's raw FP8 values (what such a load gave) fails verify against the
    # intact checkpoint (compared dequantized), and verify refuses the broken one.
    model = hf_families.build(FAMILY, torch.float32)
    moeshard.load(model, fp8)
    experts = model.model.layers[2].mlp.experts
    with torch.no_grad():
        experts.down_proj[3] = load_tensor(fp8, ODD_KEY).float()
    assert experts.down_proj[3].abs().max() > 1  # raw FP8 values; dequantized they are below 1
    with pytest.raises(moeshard.VerificationError, match=r"down_proj, physical slot 3 = logical expert 3"):
        moeshard.verify(model, fp8)
    for strict in (True, False):
        with pytest.raises(ValueError, match=where):
            moeshard.verify(model, bad, strict=strict)


def _placement(seed: int, n: int, layers: int):
    """A shuffled placement of ``n`` experts with 2 redundant copies per layer on 2 EP ranks."""
    import moeshard

    rng = np.random.default_rng(seed)
    rows = [rng.permutation(np.concatenate([np.arange(n), rng.integers(0, n, 2)])) for _ in range(layers)]
    return moeshard.Placement(np.stack(rows), num_logical=n, num_ranks=2)


def fp8_worker(fp8: str, missing: str) -> list:
    from torch.distributed.tensor import DTensor

    import moeshard

    mesh = moeshard.make_mesh("cpu", ep=2, efsdp=2)

    def state_of(model, experts, pl):
        state = {}
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            module, _, attr = name.rpartition(".")
            if module in experts and attr in ("gate_up_proj", "down_proj"):
                layer = experts.index(module)
                # every copy of an expert equal, then one row per logical expert
                for e in range(pl.num_logical):
                    slots = pl.log2phy[layer, e, : pl.logcnt[layer, e]].tolist()
                    assert all(torch.equal(full[s], full[slots[0]]) for s in slots)
                full = full[torch.as_tensor(pl.log2phy[layer, :, 0])]
            state[name] = full.clone()
        return state

    out = []
    for storage in ("shared", "single"):
        model = hf_families.build(FAMILY, torch.bfloat16, device="meta")
        experts = [n for n, m in model.named_modules() if n.endswith(".experts")]
        pl = _placement(5, model.config.n_routed_experts, len(experts))
        moeshard.parallelize(model, mesh, pl)
        if storage == "shared":
            # Expert 3's scale missing (its neighbours' there): refused on every rank, before any read.
            with pytest.raises(moeshard.DistributedError) as refused:
                moeshard.load(model, missing, placement=pl, strict=False)
        # "single" with a small staging budget: pieces (and so dequantized boxes) cut blocks.
        rep = moeshard.load(
            model, fp8, placement=pl, storage=storage, staging_bytes=4096 if storage == "single" else 256 << 20
        )
        assert moeshard.verify(model, fp8, placement=pl).num_boxes_checked > 0
        out.append((storage, rep.storage, rep.dequantized_keys, rep.bytes_read_rank, state_of(model, experts, pl)))
    # Every changed slot re-read from disk, dequantized as it is read (each box with its scale blocks).
    new = _placement(6, pl.num_logical, len(experts))
    moved = moeshard.relocate(model, pl, new, checkpoint=fp8, from_checkpoint=True)
    assert moeshard.verify(model, fp8, placement=new).num_boxes_checked > 0
    out.append(("relocated", "relocated", rep.dequantized_keys, moved.bytes_read_rank, state_of(model, experts, new)))
    return out, str(refused.value)


@pytest.mark.dist
def test_fp8_dequantized_on_ep_and_expert_fsdp_ranks(ckpts, broken):
    fp8, dq, num = ckpts
    want = dict(transformers.AutoModelForCausalLM.from_pretrained(dq, dtype=torch.bfloat16).named_parameters())
    results = run_ranks(fp8_worker, fp8, broken["missing"], world=4, local_world=2, timeout=240)
    relocated_read = 0
    for rank, (res, refused) in enumerate(results):
        assert f"{ODD_KEY!r} has dtype F8_E4M3 (FP8)" in refused and "no scale tensor" in refused, (rank, refused)
        assert "logical expert 3's tensor, in file model-" in refused, (rank, refused)
        for storage, mode, deq, read, state in res:
            assert mode == storage and deq == num
            relocated_read += read if storage == "relocated" else 0
            if storage == "single":
                assert (read > 0) == (rank == 0)
            assert set(state) == set(want)
            for name, got in state.items():
                assert torch.equal(got, want[name]), f"rank {rank} {storage} {name}"
    assert relocated_read > 0  # the relocation read the changed slots from disk


def fp8_model(device: str = "meta"):
    """The family's model kept in FP8 as transformers holds it (``FP8Linear`` weight + block
    ``weight_scale_inv``; ``FP8Experts``: ``gate_up_proj`` float8 ``[E, 2I, H]`` beside
    ``gate_up_proj_scale_inv`` float32 ``[E, 2I/B, H/B]``), for this file's checkpoint: what it
    quantized (every ``*proj.weight``) is FP8, the rest not."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    with torch.device(device):
        model = hf_families.build(FAMILY)
    config = FineGrainedFP8Config(weight_block_size=(BLOCK, BLOCK))
    return replace_with_fp8_linear(
        model, modules_to_not_convert=["lm_head", "kv_a_proj_with_mqa"], quantization_config=config, pre_quantized=True
    )


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes to compare exactly (FP8 as uint8: gloo and torch.equal have no float8)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def fp8_kept_worker(fp8: str, out_dir: str) -> list:
    """Load the FP8 checkpoint into an FP8 model with EP=2 x efsdp=2 and a redundant placement,
    verify, relocate P2P to another placement (no checkpoint: the scales must travel with their
    experts), verify again, save, relocate back reading from disk; return each parameter's local
    bytes and global offset (torch's own rule) after each step, with its placement's phy2log."""

    import moeshard

    mesh = moeshard.make_mesh("cpu", ep=2, efsdp=2)
    model = fp8_model()
    n = model.config.n_routed_experts
    layers = sum(1 for name, _ in model.named_modules() if name.endswith(".experts"))

    old, new = _placement(5, n, layers), _placement(6, n, layers)
    moeshard.parallelize(model, mesh, old, ep_forward=False)
    rep = moeshard.load(model, fp8, placement=old)
    assert moeshard.verify(model, fp8, placement=old).num_boxes_checked > 0
    loaded = _local_state(model)
    # ep_forward=False: the experts keep their own forward, which moeshard does not re-point
    # (this test never runs it), so the caller says it routes the tokens.
    moved = moeshard.relocate(model, old, new, routing="caller")
    assert moeshard.verify(model, fp8, placement=new).num_boxes_checked > 0
    moeshard.save(model, out_dir, new, max_shard_bytes=8_000)
    relocated = _local_state(model)
    # And back, every changed slot re-read from disk: FP8 bytes and their scales as stored.
    moeshard.relocate(model, new, old, checkpoint=fp8, from_checkpoint=True, routing="caller")
    return [
        (rep.dequantized_keys, rep.unused_keys, moved.bytes_sent_rank, old.phy2log, loaded),
        (0, (), 0, new.phy2log, relocated),
        (0, (), 0, old.phy2log, _local_state(model)),
    ]


@pytest.mark.dist
def test_fp8_kept_with_scales_that_move_with_their_experts(ckpts, kept_runs):
    """An FP8 model (transformers' FP8Linear / FP8Experts) takes the FP8 bytes and the block scales
    as stored, on EP=2 x expert-FSDP=2 ranks with a redundant placement: every local byte equals
    the checkpoint's (an expert's ``gate_up_proj_scale_inv`` row is its gate and up scales
    stacked), after load, after a P2P relocation that moves the scales with their experts, and
    after one back that reads them from disk; the relocated model verifies and saves the
    checkpoint's exact key set and bytes."""
    from safetensors.torch import load_file

    import moeshard

    fp8, _, _ = ckpts
    want = {}
    for f in os.listdir(fp8):
        if f.endswith(".safetensors"):
            want.update(load_file(os.path.join(fp8, f)))
    model = fp8_model("cpu")  # the names and shapes only
    experts = [name for name, _ in model.named_modules() if name.endswith(".experts")]
    kept = {name for name, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert any(name.endswith("experts.gate_up_proj") for name in kept)
    assert any(name.endswith("experts.gate_up_proj_scale_inv") for name, _ in model.named_parameters())

    def expected(name: str, phy2log: np.ndarray) -> torch.Tensor:
        module, _, attr = name.rpartition(".")
        if module not in experts:
            return _raw(want[name])
        proj, _, suffix = attr.partition("_proj")
        parts = ("gate", "up") if proj == "gate_up" else (proj,)
        rows = phy2log[experts.index(module)]
        return torch.stack(
            [_raw(torch.cat([want[f"{module}.{int(e)}.{q}_proj.weight{suffix}"] for q in parts])) for e in rows]
        )

    root, _, both, _, _ = kept_runs
    results = [res[0] for res in both]
    sent = 0
    for rank, steps in enumerate(results):
        for deq, unused, moved, phy2log, state in steps:
            assert deq == 0 and unused == ()  # nothing dequantized, every scale read by a parameter
            sent += moved
            assert set(state) == {name for name, _ in model.named_parameters()}
            for name, (got, offset, shape) in state.items():
                full = expected(name, phy2log)
                assert tuple(full.shape) == shape, name
                box = tuple(slice(o, o + n) for o, n in zip(offset, got.shape))
                assert torch.equal(got, full[box]), f"rank {rank} {name}"
    assert sent > 0  # the relocation moved experts (and their scales) between ranks
    saved = {}
    for f in os.listdir(root / "saved"):
        if f.endswith(".safetensors"):
            saved.update(load_file(os.path.join(root / "saved", f)))
    assert set(saved) == set(want)
    for key, t in want.items():
        assert saved[key].dtype == t.dtype and torch.equal(_raw(saved[key]), _raw(t)), key
    assert (
        moeshard.CheckpointIndex.open(str(root / "saved")).tensors.keys()
        == moeshard.CheckpointIndex.open(fp8).tensors.keys()
    )


def test_inspect_reports_the_quantization(ckpts):
    from moeshard.cli.inspect import format_summary, inspect_checkpoint

    fp8, dq, num = ckpts
    s = inspect_checkpoint(fp8)
    q = s.quantization
    assert q.num_scaled == num and q.blocks == ((BLOCK, BLOCK),) and q.unscaled == ()
    assert q.bf16_bytes == 2 * q.fp8_bytes and 0 < q.scale_bytes < q.fp8_bytes
    assert f"FP8: {num} weights with block scales (blocks {BLOCK}x{BLOCK})" in format_summary(s)
    assert inspect_checkpoint(dq).quantization is None


def test_dequantize_any_box_matches_the_expanded_scale():
    """Boxes that start on a column block take a blocked path, the others the general one: both
    equal the weight times its scale expanded element by element (128 x 128 blocks, ragged edges)."""
    from moeshard.io.fp8 import block_size, dequantize, scale_box

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 530, generator=g).to(torch.float8_e4m3fn)
    s = torch.rand(3, 5, generator=g)
    assert block_size((300, 530), (3, 5)) == (128, 128) and block_size((576, 7168), (5, 56)) == (128, 128)
    full = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :530]
    rng = np.random.default_rng(0)
    for _ in range(300):
        o0 = int(rng.integers(0, 300))
        n0 = int(rng.integers(1, 301 - o0))
        o1 = int(rng.choice([0, 128, 256, 384, int(rng.integers(0, 530))]))
        n1 = int(rng.integers(1, 531 - o1))
        box = ((o0, n0), (o1, n1))
        (a, na), (b, nb) = scale_box(box, (128, 128))
        got = dequantize(w[o0 : o0 + n0, o1 : o1 + n1], box, s[a : a + na, b : b + nb], (128, 128))
        assert torch.equal(got, w[o0 : o0 + n0, o1 : o1 + n1].float() * full[o0 : o0 + n0, o1 : o1 + n1]), box


def test_cpu_fp8_table_equals_torch_cast_for_every_code():
    from moeshard.io.fp8 import to_float32

    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.uint8).view(dt)
        assert torch.equal(to_float32(codes).view(torch.int32), codes.to(torch.float32).view(torch.int32)), dt
        x = torch.randn(7, 9).to(dt)[:, 2:5]  # a non-contiguous view
        assert torch.equal(to_float32(x), x.float())


def test_plan_reports_the_quantization(ckpts, capsys):
    from moeshard.cli.plan import main

    fp8, dq, num = ckpts
    assert main([fp8, "--nodes", "1", "--ranks-per-node", "2", "--ep", "2", "--json"]) == 0
    q = json.loads(capsys.readouterr().out)["checkpoint"]["quantization"]
    assert q["num_scaled"] == num and q["blocks"] == [[BLOCK, BLOCK]] and q["bf16_bytes"] == 2 * q["fp8_bytes"]
    assert main([fp8, "--nodes", "1", "--ranks-per-node", "2", "--ep", "2"]) == 0
    assert f"FP8: {num} weights with block scales (blocks {BLOCK}x{BLOCK}): moved as stored" in capsys.readouterr().out
    assert main([dq, "--nodes", "1", "--ranks-per-node", "2", "--ep", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"]["quantization"] is None


def test_fitting_scales_equals_scale_of_key_by_key(tmp_path):
    """The one-pass check of every expert's scale says what scale_of says of each key: a fitting
    ``_scale_inv``, a fitting ``_scale`` (behind an integer ``_scale_inv``), none, one of a shape
    no block grid gives, a weight that is not FP8, a key the checkpoint lacks, a key twice."""
    import moeshard
    from moeshard.io.fp8 import fitting_scales, scale_of

    def q():
        return torch.randn(32, 16).to(torch.float8_e4m3fn)

    moeshard.write_checkpoint(
        str(tmp_path),
        [
            ("a.weight", q()),
            ("a.weight_scale_inv", torch.ones(2, 1)),
            ("b.weight", q()),
            ("c.weight", q()),
            ("c.weight_scale_inv", torch.ones(3, 1)),
            ("e.weight", q()),
            ("e.weight_scale", torch.ones(2, 1)),
            ("f.weight", torch.ones(2, 2)),
            ("g.weight", q()),
            ("g.weight_scale_inv", torch.ones(2, 1, dtype=torch.int32)),
            ("g.weight_scale", torch.ones(2, 1)),
        ],
    )
    index = moeshard.CheckpointIndex.open(str(tmp_path))
    keys = ["a.weight", "b.weight", "c.weight", "e.weight", "f.weight", "g.weight", "missing", "a.weight"]
    want = [k in index and scale_of(index, k) is not None for k in keys]
    assert fitting_scales(index, keys).tolist() == want == [True, False, False, True, False, True, False, True]
    assert fitting_scales(index, []).shape == (0,)


# -- experts kept packed in other formats (MXFP4, compressed-tensors INT4) ---------------------


# Qwen3-MoE fixtures whose experts are kept as stored (packed_experts.stored_qwen3): compressed-tensors
# NVFP4, ModelOpt NVFP4 (per-expert 0-d weight_scale_2 / input_scale) and FP8 per channel.
STORED = ("nvfp4", "modelopt-nvfp4", "fp8")


def packed_checkpoints(root: str) -> dict[str, str]:
    """gpt-oss with MXFP4 experts, DeepSeek-V3 with compressed-tensors INT4 routed experts
    (Kimi-K2-Thinking's layout), each in two shards with its quantization_config, and the
    Qwen3-MoE fixtures of :data:`STORED`."""
    import packed_experts
    import quant_fixtures

    out = {"gpt_oss": os.path.join(root, "mxfp4"), "deepseek_v3": os.path.join(root, "int4")}
    packed_experts.write_mxfp4_checkpoint(out["gpt_oss"])
    packed_experts.write_int4_checkpoint(out["deepseek_v3"])
    for fmt in STORED:
        out[fmt] = quant_fixtures.WRITERS[fmt](os.path.join(root, fmt)).path
    return out


def _packed_model(family: str, path: str):
    import packed_experts

    if family in STORED:
        return packed_experts.stored_qwen3(family, path)
    return packed_experts.packed_gpt_oss() if family == "gpt_oss" else packed_experts.compressed_deepseek_v3()


def _local_state(model) -> dict:
    """Each parameter's local bytes, global offset (torch's own rule) and global shape."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    state = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            state[name] = (_raw(p.to_local()).clone(), tuple(offset), tuple(p.shape))
        else:
            state[name] = (_raw(p.detach()).clone(), (0,) * p.dim(), tuple(p.shape))
    return state


def packed_kept_worker(packed: dict, out_dir: str) -> dict:
    """Per family: load the packed checkpoint into a model that keeps its experts packed
    (EP=2 x efsdp=2, a redundant placement), verify, relocate P2P (the scales and shapes travel
    with their experts), verify, save, relocate back from disk, reshard into a fresh model from
    ranks 0-1 and the checkpoint; each step's local bytes."""
    import moeshard

    mesh = moeshard.make_mesh("cpu", ep=2, efsdp=2)
    out = {}
    for family, ckpt in packed.items():
        model = _packed_model(family, ckpt)
        with open(os.path.join(ckpt, "config.json")) as f:  # what transformers' quantizer leaves on the config
            model.config.quantization_config = json.load(f).get("quantization_config")
        n = {"gpt_oss": 4, "deepseek_v3": getattr(model.config, "n_routed_experts", 0)}.get(family, 8)
        layers = 2
        old, new = _placement(7, n, layers), _placement(8, n, layers)
        moeshard.parallelize(model, mesh, old, ep_forward=False)
        rep = moeshard.load(model, ckpt, placement=old)
        checked = moeshard.verify(model, ckpt, placement=old).num_boxes_checked
        steps = [(rep.unused_keys, old.phy2log, _local_state(model))]
        moved = moeshard.relocate(model, old, new, routing="caller")
        checked += moeshard.verify(model, ckpt, placement=new).num_boxes_checked
        moeshard.save(model, os.path.join(out_dir, family), new, max_shard_bytes=20_000)
        steps.append(((), new.phy2log, _local_state(model)))
        moeshard.relocate(model, new, old, checkpoint=ckpt, from_checkpoint=True, routing="caller")
        steps.append(((), old.phy2log, _local_state(model)))
        # A reshard into a fresh model at placement ``new`` where ranks 2-3 lost their state (they
        # join with nothing): what only they held is read from disk, as stored (ModelOpt's and
        # FP8's stored key is the logical one: not their dequantized view; gpt-oss's experts are
        # fused on disk, one tensor per layer whose rows the new slots read).
        fresh = _packed_model(family, ckpt)
        fresh.config.quantization_config = model.config.quantization_config
        moeshard.parallelize(fresh, mesh, new, ep_forward=False)
        survivor = torch.distributed.get_rank() < 2
        shards = moeshard.describe_shards(model)
        resharded = moeshard.reshard(
            fresh, shards if survivor else None, model if survivor else None, ckpt, dense_from_storage="allow"
        )
        steps.append(((), new.phy2log, _local_state(fresh)))
        read = (resharded.bytes_read_rank, resharded.storage_bytes)
        out[family] = (steps, moved.bytes_sent_rank, checked, read)
    return out


def requant_worker(source: str, float_dir: str, out_dir: str) -> tuple:
    """A float DeepSeek-V3 (the INT4 source's dequantized reference) on EP=2 x efsdp=2 ranks with
    a redundant placement, saved in the source's format (quantize="source")."""
    import transformers

    import moeshard

    mesh = moeshard.make_mesh("cpu", ep=2, efsdp=2)
    config = transformers.AutoConfig.from_pretrained(float_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    pl = _placement(9, config.n_routed_experts, config.num_hidden_layers - config.first_k_dense_replace)
    moeshard.parallelize(model, mesh, pl)
    moeshard.load(model, float_dir, placement=pl)
    rep = moeshard.save(model, out_dir, pl, quantize="source", reference=source, max_shard_bytes=40_000)
    return rep.num_requantized, rep.requant_max_abs_error, rep.files


def gpt_oss_efsdp_worker(float_dir: str, ids: torch.Tensor) -> tuple:
    """A float gpt-oss (trainable expert biases) on EP=2 x efsdp=2 ranks with a redundant
    placement and the EP forward: loss and logits of ``ids`` (every rank the same batch, so the
    data-parallel mean is the one-process gradient), then backward; each expert bias's gradient
    ``[num_physical, ...]`` (gathered) with its layer's ``(phy2log, first copy of each expert)``;
    then a reshard into a fresh model at another placement whose ranks 2-3 held nothing (its
    experts fused on disk: what only they held is read from the checkpoint): the new placement,
    the fresh model's local bytes (:func:`_local_state`), this rank's bytes read and the plan's."""
    import transformers

    import moeshard

    mesh = moeshard.make_mesh("cpu", ep=2, efsdp=2)
    config = transformers.AutoConfig.from_pretrained(float_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    pl = _placement(10, config.num_local_experts, config.num_hidden_layers)
    moeshard.parallelize(model, mesh, pl)
    moeshard.load(model, float_dir, placement=pl)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if name.endswith("_bias") and ".experts." in name:
            layer = int(name.split(".")[2])
            grads[name] = (p.grad.full_tensor(), pl.phy2log[layer].tolist(), pl.log2phy[layer, :, 0].tolist())
    new = _placement(11, config.num_local_experts, config.num_hidden_layers)
    fresh = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    moeshard.parallelize(fresh, mesh, new)
    survivor = torch.distributed.get_rank() < 2
    shards = moeshard.describe_shards(model)
    rep = moeshard.reshard(
        fresh, shards if survivor else None, model if survivor else None, float_dir, dense_from_storage="allow"
    )
    moved = (new.phy2log, _local_state(fresh), rep.bytes_read_rank, rep.storage_bytes)
    return float(out.loss), out.logits.detach(), grads, moved


def kept_worker(fp8: str, out_dir: str, packed: dict, packed_out: str, requant: tuple, gpt_oss: tuple) -> tuple:
    """Every kept-quantized scenario, the requantizing save and a float gpt-oss at EP x efsdp in
    one spawn (spawning costs seconds)."""
    return (
        fp8_kept_worker(fp8, out_dir),
        packed_kept_worker(packed, packed_out),
        requant_worker(*requant),
        gpt_oss_efsdp_worker(*gpt_oss),
    )


def _expected_packed(want: dict, name: str, phy2log: np.ndarray, layers: dict) -> torch.Tensor:
    """The bytes parameter ``name`` holds under placement ``phy2log``: the checkpoint tensor
    itself, or for an expert parameter of experts module ``layers[module] = (layer, spec)`` its
    slots' logical experts' rows, each its checkpoint parts concatenated (gpt-oss: rows of the
    fused ``*_blocks`` / ``*_scales``; a 0-d part, ModelOpt's ``weight_scale_2``: itself)."""
    module, _, attr = name.rpartition(".")
    param = next((p for p in layers[module][1].params if p.name == attr), None) if module in layers else None
    if param is None:
        return _raw(want[name])
    rows = torch.as_tensor(phy2log[layers[module][0]])
    if param.fused:
        return _raw(want[f"{module}.{param.parts[0]}"])[rows]

    def one(e: int) -> torch.Tensor:
        parts = [want[k] for k in param.keys(module, e)]
        return parts[0] if parts[0].dim() == 0 else torch.cat(parts)

    return _raw(torch.stack([one(int(e)) for e in rows]))


def _saved(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.fixture(scope="module")
def kept_runs(ckpts, tmp_path_factory):
    """One spawn of 4 ranks (EP=2 x expert-FSDP=2, 2 per node) for every kept-quantized model."""
    fp8, _, _ = ckpts
    root = tmp_path_factory.mktemp("kept")
    packed = packed_checkpoints(str(root / "packed"))
    import quant_fixtures

    fx = quant_fixtures.WRITERS["int4"](str(root / "int4"))
    float_dir = quant_fixtures.write_reference(fx, str(root / "int4-float"), torch.float32)
    requant = (fx.path, float_dir, str(root / "requantized"))
    oss = quant_fixtures.WRITERS["mxfp4"](str(root / "gpt_oss"))
    ids = torch.randint(0, oss.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    gpt_oss = (quant_fixtures.write_reference(oss, str(root / "gpt_oss-float"), torch.float32), ids)
    results = run_ranks(
        kept_worker,
        fp8,
        str(root / "saved"),
        packed,
        str(root / "packed_saved"),
        requant,
        gpt_oss,
        world=4,
        local_world=2,
        timeout=300,
    )
    return root, packed, results, fx, gpt_oss


@pytest.mark.dist
@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", *STORED])
def test_packed_experts_kept_moved_and_saved_byte_identical(kept_runs, family):
    """A model that keeps its experts packed (gpt-oss: MXFP4 ``*_blocks`` uint8 + E8M0
    ``*_scales``; DeepSeek-V3: compressed-tensors INT4 ``weight_packed`` int32 + ``weight_scale``
    + ``weight_shape``, Kimi-K2-Thinking's layout) loads on EP=2 x expert-FSDP=2 ranks with a
    redundant placement, every local byte the checkpoint's: after load, after a P2P relocation
    (scales and shapes move with their experts), after one back read from disk and after a
    reshard into a fresh model whose ranks 2-3 held nothing (their boxes read from disk as
    stored, gpt-oss's from its experts fused on disk, the bytes read the plan's); saved after
    the relocation, every tensor of the checkpoint (scales and shapes included) is written, with
    its dtype and bytes unchanged."""
    from moeshard.models.describe import expert_layers

    root, packed, results, _, _ = kept_runs
    ckpt = packed[family]
    want = _saved(ckpt)
    model = _packed_model(family, ckpt)
    layers = {e.name: (e.layer, e.spec) for e in expert_layers(model)}
    names = {name for name, _ in model.named_parameters()}
    sent = disk = 0
    for rank, res in enumerate(results):
        steps, moved, checked, (read, planned) = res[1][family]
        assert checked > 0
        sent += moved
        disk += read
        for unused, phy2log, state in steps:
            assert unused == ()  # every tensor read into a parameter
            assert set(state) == names
            for name, (got, offset, shape) in state.items():
                full = _expected_packed(want, name, phy2log, layers)
                assert tuple(full.shape) == shape, name
                box = tuple(slice(o, o + n) for o, n in zip(offset, got.shape))
                assert got.dtype == full.dtype and torch.equal(got, full[box]), f"rank {rank} {name}"
    assert sent > 0 and disk > 0  # the reshard read what only the lost ranks held
    assert disk == planned  # exactly the boxes its plan reads from storage
    saved = _saved(str(root / "packed_saved" / family))
    assert set(saved) == set(want)
    with open(os.path.join(ckpt, "config.json")) as f, open(root / "packed_saved" / family / "config.json") as g:
        assert json.load(g).get("quantization_config") == json.load(f).get("quantization_config")
    for key, t in want.items():
        assert saved[key].dtype == t.dtype and saved[key].shape == t.shape, key
        assert torch.equal(_raw(saved[key].reshape(-1)), _raw(t.reshape(-1))), key


@pytest.mark.dist
def test_requantized_save_from_ep_ranks_with_redundant_experts(kept_runs):
    """A float DeepSeek-V3 loaded from the dequantized values of an INT4 checkpoint (Kimi-K2-Thinking's
    layout) and saved with quantize="source" from EP=2 x expert-FSDP=2 ranks with a redundant
    placement writes the source's key set and dtypes: every requantized weight's bytes equal
    moeshard.io.codecs.encode of the float weight in this process, every other tensor the
    source's bytes (its bf16 values cast back), and the report gives the error."""
    import moeshard
    from moeshard.io import codecs
    from moeshard.io.quant import read_quant_configs, recognize

    root, _, results, fx, _ = kept_runs
    src, saved = _saved(fx.path), _saved(str(root / "requantized"))
    assert set(saved) == set(src)
    packed = recognize(*read_quant_configs(fx.path), moeshard.CheckpointIndex.open(fx.path).tensors)
    written = set()
    for key, pw in packed.items():
        enc = codecs.encode(pw.scheme, fx.reference[key])
        assert torch.equal(saved[pw.values], enc.values) and torch.equal(saved[pw.scale], enc.scale), key
        written |= set(pw.keys)
    for key, t in src.items():
        assert saved[key].dtype == t.dtype and saved[key].shape == t.shape, key
        if key not in written or key.endswith("weight_shape"):
            assert torch.equal(saved[key], t), key
    num = {r[2][0] for r in results}
    assert num == {len(packed)}  # job-wide, the same on every rank
    assert len({f for r in results for f in r[2][2]}) > 1  # several ranks wrote


@pytest.mark.dist
def test_gpt_oss_trains_with_expert_biases_at_ep_and_efsdp(kept_runs):
    """A float gpt-oss, whose experts have trainable biases (``gate_up_proj_bias`` [E, 2I],
    ``down_proj_bias`` [E, H]: expert parameters that move with their experts), runs the EP
    forward on EP=2 x expert-FSDP=2 ranks with a redundant placement: the loss and logits equal
    one process's, and each bias's gradient is the one-process gradient in the first copy of
    each expert, zero in the other copies."""
    import transformers

    _, _, results, _, (float_dir, ids) = kept_runs
    model = transformers.AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    want = model(input_ids=ids, labels=ids)
    want.loss.backward()
    params = dict(model.named_parameters())
    for rank, (_, _, _, (loss, logits, grads, _)) in enumerate(results):
        assert abs(loss - float(want.loss)) < 1e-5, rank
        torch.testing.assert_close(logits, want.logits.detach(), rtol=1e-5, atol=1e-5)
        assert len(grads) == 2 * model.config.num_hidden_layers, sorted(grads)
        for name, (g, phy2log, first) in grads.items():
            expected = params[name].grad[torch.as_tensor(phy2log)].clone()
            expected[torch.as_tensor([first[e] != s for s, e in enumerate(phy2log)])] = 0
            assert expected.abs().sum() > 0, name
            torch.testing.assert_close(g, expected, rtol=1e-4, atol=1e-7, msg=f"rank {rank} {name}")


@pytest.mark.dist
def test_gpt_oss_float_reshard_reads_experts_fused_on_disk(kept_runs):
    """A float gpt-oss (every expert parameter one ``[E, ...]`` tensor per layer on disk) on
    EP=2 x expert-FSDP=2 ranks reshards into a fresh model at another placement whose ranks 2-3
    held nothing: every local tensor equals the checkpoint's box (an expert parameter's, its
    slots' logical experts' rows), what only the lost ranks held is read from the fused tensors,
    and the bytes read are the plan's."""
    _, _, results, _, (float_dir, _) = kept_runs
    want = _saved(float_dir)
    read = planned = 0
    for rank, (_, _, _, (_, _, _, (phy2log, state, nread, nplanned))) in enumerate(results):
        read, planned = read + nread, nplanned
        assert set(state) <= set(want) and any(".experts." in n for n in state)
        for name, (got, offset, shape) in state.items():
            full = want[name]
            if ".experts." in name:
                full = full[torch.as_tensor(phy2log[int(name.split(".")[2])])]
            assert tuple(full.shape) == shape, name
            box = tuple(slice(o, o + n) for o, n in zip(offset, got.shape))
            assert got.dtype == full.dtype and torch.equal(got, full[box]), f"rank {rank} {name}"
    assert read > 0 and read == planned
