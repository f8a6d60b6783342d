"""Tier 3: ``moeshard.from_pretrained`` on 4 gloo ranks, against the one-process model.

Tiny float32 Qwen3-MoE (8 experts), Mixtral (6 experts) and DeepSeek-V3 (8 routed experts, MLA,
a dense first layer, a shared expert, ``e_score_correction_bias`` buffers) checkpoints from
``save_pretrained`` are loaded by one ``from_pretrained`` call with EP=4 and EP=2 x efsdp=2, a
contiguous placement and shuffled redundant ones given as a :class:`moeshard.Placement` and as a
placement file (both moeshard JSON and ``.npy``), in float32, in bf16 (``dtype=``) and with a
bf16 ``mp_policy`` (float32 parameters, bf16 logits). Every parameter, gathered whole and put back
in logical expert order (each redundant copy checked), and every persistent buffer on every rank
must equal transformers' one-process ``from_pretrained`` of the same checkpoint bit for bit, in
the same dtypes (in bf16, DeepSeek-V3's routers stay float32 as transformers keeps them), and
every rank's logits on its own batch must equal the one-process model's within 1e-5 of their
largest magnitude (float32: the EP forward sums the same products in another order). Bad inputs
(no config.json, an EP size that does not divide the world, a placement or placement file for
another expert count, arguments that differ between ranks) must raise ValueError on every rank,
naming what was expected, and leave the process group usable (the good scenarios run after them,
in the same processes). Two models (a Qwen3-MoE, a DeepSeek-V3) are then relocated:
``model.moeshard_placement`` must name the new placement, the parameters, buffers and logits stay
the same.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from mp import run_ranks
from tiny_hf import FAMILIES, NUM_LAYERS, data, full_params, persistent_buffers, save_checkpoint, shuffled_redundant

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

WORLD = 4
LOGITS_RTOL = 1e-5

# (family, ep, efsdp, placement: None | "placement" | "json" | "npy", extra from_pretrained kwargs)
SCENARIOS = [
    ("qwen3_moe", 4, 1, None, {"verify": True}),
    ("qwen3_moe", 4, 1, "placement", {}),
    ("qwen3_moe", 2, 2, "json", {"verify": True}),
    ("qwen3_moe", 2, 2, "placement", {"dtype": torch.bfloat16}),
    ("mixtral", 4, 1, "npy", {}),
    ("mixtral", 2, 2, "placement", {"verify": True}),
    ("mixtral", 4, 1, None, {"mp_policy": "bf16", "num_redundant": 2}),
    ("deepseek_v3", 4, 1, "placement", {"verify": True}),
    ("deepseek_v3", 2, 2, None, {"dtype": torch.bfloat16}),
]
RELOCATED = (0, 7)  # the scenarios whose model is then relocated: model.moeshard_placement must follow
BAD = ["no_config", "ep_3", "placement_6_experts", "placement_file_6_experts", "args_differ", "uneven_default"]


def _placement(kind, family, ep, files, redundant=0):
    import moeshard
    from moeshard.io.placement_files import write_placement

    if kind is None:
        return None, moeshard.Placement.contiguous(2, FAMILIES[family], ep, redundant)
    pl = shuffled_redundant(FAMILIES[family], ep, seed=ep * 10 + len(family))
    if kind == "placement":
        return pl, pl
    path = os.path.join(files, f"{family}-ep{ep}.{kind}")
    if kind == "npy":
        np.save(path, pl.phy2log)
    else:
        write_placement(pl, path, format="moeshard")
    return path, pl


def worker(ckpts: dict, files: str) -> dict:
    import torch.distributed as dist

    import moeshard

    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(files, exist_ok=True)
    dist.barrier()
    out: dict = {"bad": {}, "good": []}
    wrong = moeshard.Placement.contiguous(2, 6, 4, num_redundant=2)  # Mixtral's 6 experts, for Qwen3-MoE's 8
    wrong_file = os.path.join(files, "wrong.json")
    if rank == 0:
        from moeshard.io.placement_files import write_placement

        write_placement(wrong, wrong_file, format="moeshard")
    dist.barrier()
    bad = {
        "no_config": dict(path=files, ep=4),  # a directory with placement files, no config.json
        "ep_3": dict(path=ckpts["qwen3_moe"], ep=3),
        "placement_6_experts": dict(path=ckpts["qwen3_moe"], ep=4, placement=wrong),
        "placement_file_6_experts": dict(path=ckpts["qwen3_moe"], ep=4, placement=wrong_file),
        "args_differ": dict(path=ckpts["qwen3_moe"], ep=4, verify=rank == 1),
        "uneven_default": dict(path=ckpts["mixtral"], ep=4),  # 6 experts, no copies, 4 ranks
    }
    for name in BAD:
        kwargs = dict(bad[name])
        try:
            moeshard.from_pretrained(kwargs.pop("path"), **kwargs)
            out["bad"][name] = ("no error", "")
        except Exception as e:  # noqa: BLE001 - the test checks the type
            out["bad"][name] = (type(e).__name__, str(e))
    # make_mesh and parallelize refuse sizes that do not fit the ranks; parallelize before the model changes.
    import transformers

    from tiny_hf import config

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config("qwen3_moe"))
    pl4 = moeshard.Placement.contiguous(2, 8, 4)
    calls = {
        "make_mesh_ep3": lambda: moeshard.make_mesh("cpu", ep=3),
        "make_mesh_replicate3": lambda: moeshard.make_mesh("cpu", ep=4, replicate=3),
        "parallelize_replicate3": lambda: moeshard.parallelize(meta, moeshard.make_mesh("cpu", ep=4), pl4, replicate=3),
        "parallelize_hybrid_replicate4": lambda: moeshard.parallelize(
            meta, moeshard.make_mesh("cpu", ep=4, replicate=2), pl4, replicate=4
        ),
    }
    out["mesh"] = {}
    for name, call in calls.items():
        try:
            call()
            out["mesh"][name] = ("no error", "")
        except Exception as e:  # noqa: BLE001 - the test checks the type
            out["mesh"][name] = (type(e).__name__, str(e))
    out["meta_untouched"] = not isinstance(meta, torch.distributed.fsdp.FSDPModule) and all(
        p.is_meta and not hasattr(p, "placements") for p in meta.parameters()
    )
    ids = data(WORLD)[rank : rank + 1]
    refs = {}
    for i, (family, ep, efsdp, kind, extra) in enumerate(SCENARIOS):
        given, pl = _placement(kind, family, ep, files, extra.get("num_redundant", 0))
        kwargs = dict(extra)
        if kwargs.get("mp_policy") == "bf16":
            kwargs["mp_policy"] = torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        model = moeshard.from_pretrained(ckpts[family], ep=ep, efsdp=efsdp, placement=given, **kwargs)
        dtype = extra.get("dtype", torch.float32)
        if (family, dtype) not in refs:
            refs[family, dtype] = transformers.AutoModelForCausalLM.from_pretrained(ckpts[family], dtype=dtype)
        rec = dict(
            _compare(model, refs[family, dtype], ids),
            same_placement=model.moeshard_placement == pl,
            fsdp=isinstance(model, torch.distributed.fsdp.FSDPModule),
            # The ("efsdp", "ep") mesh the experts are DTensors on (from_pretrained reuses one per sizes).
            mesh=next(id(p.device_mesh._get_root_mesh()) for n, p in model.named_parameters() if ".experts." in n),
        )
        if i in RELOCATED:  # relocate: the attribute names the new placement, the model stays the same
            new = moeshard.Placement(
                np.stack(
                    [row[np.random.default_rng(5 + k).permutation(pl.num_physical)] for k, row in enumerate(pl.phy2log)]
                ),
                num_logical=pl.num_logical,
                num_ranks=ep,
            )
            moeshard.relocate(model, old=model.moeshard_placement, new=new)
            rec["relocated"] = dict(
                _compare(model, refs[family, dtype], ids), same_placement=model.moeshard_placement == new
            )
        out["good"].append(rec)
    return out


def _compare(model, ref, ids) -> dict:
    """Collective: the parameters that differ from the one-process model's (in logical order,
    through ``model.moeshard_placement``), and the logits' largest difference."""
    dtypes = {str(p.dtype) for p in model.parameters()}  # before a forward unshards the root's in bf16
    got = full_params(model, model.moeshard_placement)
    got.update(persistent_buffers(model))  # whole on every rank
    want = dict(ref.named_parameters())
    want.update(persistent_buffers(ref))
    unequal = sorted(
        n for n in want if n not in got or got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n].detach())
    )
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        ref_logits = ref(input_ids=ids).logits
    return dict(
        unequal=unequal,
        extra_names=sorted(set(got) - set(want)),
        num_buffers=sum(n.endswith("e_score_correction_bias") for n in want),
        dtypes=dtypes,
        ref_dtypes={str(p.dtype) for p in ref.parameters()},
        logits_dtype=str(logits.dtype),
        logits_diff=float((logits.float() - ref_logits.float()).abs().max() / ref_logits.float().abs().max()),
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    ckpts = {}
    for family in FAMILIES:
        ckpts[family] = str(root / family)
        save_checkpoint(family, ckpts[family])
    return run_ranks(worker, ckpts, str(root / "files"), world=WORLD, local_world=2, timeout=280)


@pytest.mark.parametrize(
    "i",
    range(len(SCENARIOS)),
    ids=[f"{f}-ep{e}-efsdp{d}-{k or 'contiguous'}{''.join('-' + x for x in extra)}" for f, e, d, k, extra in SCENARIOS],
)
def test_from_pretrained_equals_one_process(results, i):
    family, ep, efsdp, kind, extra = SCENARIOS[i]
    dtype = extra.get("dtype", torch.float32)
    for r, rank_results in enumerate(results):
        got = rank_results["good"][i]
        assert got["fsdp"], "the model is FSDP2's (its root an FSDPModule)"
        for what, g in [("loaded", got), *([("relocated", got["relocated"])] if i in RELOCATED else [])]:
            assert not g["unequal"], f"rank {r}, {what}: parameters differ from the one-process model: {g['unequal']}"
            assert not g["extra_names"], g["extra_names"]
            assert g["same_placement"], f"rank {r}, {what}: model.moeshard_placement is not the model's placement"
            assert g["dtypes"] == g["ref_dtypes"] and str(dtype) in g["dtypes"]
            # DeepSeek-V3: the routers' buffers are compared; in bf16 the routers stay float32.
            assert g["num_buffers"] == (NUM_LAYERS if family == "deepseek_v3" else 0)
            assert len(g["dtypes"]) == (2 if family == "deepseek_v3" and dtype == torch.bfloat16 else 1)
            if "mp_policy" in extra:  # float32 parameters, bf16 compute (tests/test_mixed_precision_dist.py)
                assert g["logits_dtype"] == "torch.bfloat16"
                continue
            assert g["logits_dtype"] == str(dtype)
            # bf16 parameters: bf16 compute on both sides, one rounding (2**-8 relative) of slack; else
            # 1e-5. (DeepSeek-V3: the EP forward sums its float32-weighted outputs as transformers
            # does; one more bf16 rounding in each flips a group-limited routing choice: 0.16.)
            tol = 2**-8 if dtype == torch.bfloat16 else LOGITS_RTOL
            assert g["logits_diff"] <= tol, f"rank {r}, {what}: logits differ by {g['logits_diff']:.3g} of their max"


def test_calls_with_the_same_sizes_share_one_mesh(results):
    """from_pretrained makes the ("efsdp", "ep") mesh (its process groups) once per sizes:
    later calls reuse it (and load exactly: test_from_pretrained_equals_one_process)."""
    for rank_results in results:
        by_sizes: dict = {}
        for (_, ep, efsdp, _, _), got in zip(SCENARIOS, rank_results["good"]):
            by_sizes.setdefault((ep, efsdp), set()).add(got["mesh"])
        assert all(len(ids) == 1 for ids in by_sizes.values()), by_sizes
        assert len(by_sizes) == 2


@pytest.mark.parametrize(
    "name,expected",
    [
        ("no_config", r"no config\.json \(expected a Hugging Face checkpoint directory"),
        ("ep_3", r"ep=3 x efsdp=1 must equal the world size 4"),
        (
            "placement_6_experts",
            r"describes 2 MoE layers of 6 logical experts; the model .* has 2 MoE layers .* of 8 "
            r"logical experts",
        ),
        ("placement_file_6_experts", r"wrong\.json was written for num_logical=6; the model .* has 8 logical experts"),
        ("args_differ", r"the ranks passed different arguments .*\[\[0, 2, 3\], \[1\]\]"),
        (
            "uneven_default",
            r"has 6 logical experts per layer; with num_redundant=0 copies they do not fill EP=4 ranks "
            r"evenly: pass num_redundant=2",
        ),
    ],
)
def test_bad_input_raises_value_error_on_every_rank(results, name, expected):
    import re

    for r, rank_results in enumerate(results):
        kind, message = rank_results["bad"][name]
        assert kind == "ValueError", f"rank {r}: {kind}: {message}"
        assert re.search(expected, message), f"rank {r}: {message}"


@pytest.mark.parametrize(
    "name,expected",
    [
        ("make_mesh_ep3", r"ep=3 x efsdp=1 must equal the world size 4"),
        ("make_mesh_replicate3", r"replicate=3 must be a positive divisor of the world size 4"),
        ("parallelize_replicate3", r"replicate=3 must be a positive divisor of the mesh's 4 ranks"),
        ("parallelize_hybrid_replicate4", r"replicate=4 differs from the HybridMesh's 2 replica groups"),
    ],
)
def test_mesh_sizes_that_do_not_fit_are_refused(results, name, expected):
    """make_mesh's and parallelize's ValueErrors (their docstrings'), parallelize's before the
    model changes."""
    import re

    for r, rank_results in enumerate(results):
        kind, message = rank_results["mesh"][name]
        assert kind == "ValueError" and re.search(expected, message), f"rank {r}: {kind}: {message}"
        assert rank_results["meta_untouched"], f"rank {r}: a refused parallelize changed the model"


def test_from_pretrained_needs_a_process_group(tmp_path):
    import torch.distributed as dist

    import moeshard

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"collective: initialize torch\.distributed first"):
        moeshard.from_pretrained(tmp_path, ep=1)


def test_config_and_meta_model_errors_name_the_checkpoint(tmp_path):
    """What from_pretrained and ``moeshard verify`` build from (one process, no weights)."""
    from moeshard.models.build import meta_model, moe_layout, read_config

    with pytest.raises(ValueError, match=r"nope: no such checkpoint directory"):
        read_config(tmp_path / "nope")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(
        ValueError, match=r"config\.json: cannot read a transformers config\.json: expected a JSON object"
    ):
        read_config(tmp_path)
    with pytest.raises(ValueError, match=r"ckpt: config\.json has no model_type"):
        meta_model({}, source="ckpt")
    with pytest.raises(ValueError, match=r"ckpt: config\.json's model_type 'no_such_model' is not one transformers"):
        meta_model({"model_type": "no_such_model"}, source="ckpt")
    dense = transformers.Qwen2Config(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    ).to_dict()
    model = meta_model(dense, source="ckpt")
    with pytest.raises(ValueError, match=r"ckpt: the model has no experts module moeshard knows \(not MoE\?\)"):
        moe_layout(model, source="ckpt")
    from tiny_hf import config

    model = meta_model(config("mixtral").to_dict(), torch.bfloat16, source="ckpt")
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}
    moe = moe_layout(model)
    assert moe.modules == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts") and moe.num_logical == 6
