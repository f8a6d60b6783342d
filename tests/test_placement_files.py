"""Placement files (:mod:`moeshard.io.placement_files`): every format round-trips; files laid
out as sglang and vLLM write them (keys, dtypes, shapes built here by hand, as their code
does) read as the placement they describe; bad files fail with a ValueError naming the file
and the key; ``moeshard plan --placement`` takes each format in-process."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest

from moeshard.io.placement_files import (
    FORMATS, PlacementFile, moe_layer_indices, named_placement, read_placement, read_placement_file, write_placement,
)
from moeshard.placement import Placement

MODULES = ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]


def _placement(num_ranks: int | None = 4) -> Placement:
    rng = np.random.default_rng(0)
    p2l = np.stack([rng.permutation(np.concatenate([np.arange(8), [1, 2, 3, 4]])) for _ in range(2)])
    return Placement(p2l, num_logical=8, num_ranks=num_ranks)


@pytest.mark.parametrize("fmt, ext", [("moeshard", ".json"), ("npy", ".npy"), ("sglang", ".json"),
                                      ("sglang", ".pt"), ("vllm", ".pt"), ("vllm", ".json")])
def test_round_trip_every_format(tmp_path, fmt, ext):
    if ext == ".pt":
        pytest.importorskip("torch")
    pl = _placement()
    path = tmp_path / f"placement{ext}"
    write_placement(pl, path, format=fmt, moe_layers=[1, 2], modules=MODULES, num_hidden_layers=3)
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically, nothing left beside it
    f = read_placement_file(path, moe_layers=[1, 2])  # format sniffed
    assert f.format == fmt and np.array_equal(f.phy2log, pl.phy2log) and f.phy2log.dtype == np.int64
    assert read_placement(path, format=fmt, moe_layers=[1, 2], num_logical=8, num_ranks=4) == pl
    if fmt == "moeshard":
        assert (f.num_logical, f.num_ranks, f.layers, f.modules) == (8, 4, (1, 2), tuple(MODULES))
        assert read_placement(path).num_ranks == 4  # the file's own metadata suffices


def test_moeshard_json_schema_and_optional_metadata(tmp_path):
    path = tmp_path / "p.json"
    write_placement(_placement(num_ranks=None), path, format="moeshard")
    doc = json.loads(path.read_text())
    assert {k: doc[k] for k in ("format", "version", "num_layers", "num_logical", "num_physical", "num_ranks",
                                "slots_per_rank")} == {"format": "moeshard.placement", "version": 1, "num_layers": 2,
                                                       "num_logical": 8, "num_physical": 12, "num_ranks": None,
                                                       "slots_per_rank": None}
    assert [set(layer) for layer in doc["layers"]] == [{"phy2log"}] * 2
    assert len(path.read_text().splitlines()) == 4  # header, "layers", one line per layer
    f = read_placement_file(path, moe_layers=[5, 9])  # no layer metadata: nothing to contradict
    assert f.layers is None and f.num_ranks is None


def test_sglang_files_as_sglang_writes_them(tmp_path):
    """DeepSeek-like model: decoder layer 0 dense, 1 and 2 MoE; sglang sizes its table by
    num_hidden_layers (3 rows), its default trivial row is arange(num_physical) % num_logical."""
    torch = pytest.importorskip("torch")
    pl = _placement()
    trivial = torch.arange(0, 12).repeat(3, 1) % 8  # int64, as init_trivial builds it
    table = trivial.clone()
    table[1:] = torch.tensor(pl.phy2log.tolist())
    # --init-expert-location FILE.json
    (tmp_path / "loc.json").write_text(json.dumps({"physical_to_logical_map": table.tolist()}))
    # --init-expert-location FILE.pt (torch.load(weights_only=True) reads it)
    torch.save({"physical_to_logical_map": table}, tmp_path / "loc.pt")
    # the per-pass recorder dump: records and the last placement
    record = {"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary",
              "global_physical_count": torch.zeros(3, 12, dtype=torch.int32)}
    torch.save({"records": [record], "last_physical_to_logical_map": table},
               tmp_path / "expert_distribution_recorder_1700000000.0_0.pt")
    for name in ("loc.json", "loc.pt", "expert_distribution_recorder_1700000000.0_0.pt"):
        assert read_placement(tmp_path / name, moe_layers=[1, 2], num_logical=8, num_ranks=4) == pl, name
        assert read_placement_file(tmp_path / name).phy2log.shape == (3, 12)  # without moe_layers: every row
    # A Qwen3-MoE-like model (every layer MoE) has a row per MoE layer: taken as is.
    assert read_placement(tmp_path / "loc.json", moe_layers=[0, 1, 2], num_logical=8).num_layers == 3
    # The stat dump holds loads, not a placement.
    torch.save({"rank": 0, "logical_count": torch.zeros(4, 3, 8, dtype=torch.int32),
                "average_utilization_rate_over_window": None}, tmp_path / "stat.pt")
    with pytest.raises(ValueError, match=r"stat\.pt: key 'logical_count' holds expert loads"):
        read_placement(tmp_path / "stat.pt")


def test_vllm_eplb_state_tensors(tmp_path):
    """EplbModelState's documented example (2 MoE layers, 4 logical, 6 physical, 3 ranks),
    logical_to_physical_map padded to 1024 columns as add_model allocates it."""
    torch = pytest.importorskip("torch")
    p2l = torch.tensor([[0, 1, 2, 3, 0, 1], [0, 2, 0, 1, 0, 3]])
    l2p = torch.full((2, 4, 1024), -1, dtype=torch.int64)
    l2p[:, :, :3] = torch.tensor([[[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]],
                                  [[0, 2, 4], [3, -1, -1], [1, -1, -1], [5, -1, -1]]])
    count = torch.tensor([[2, 2, 1, 1], [3, 1, 1, 1]], dtype=torch.long)
    state = {"physical_to_logical_map": p2l, "logical_to_physical_map": l2p, "logical_replica_count": count}
    torch.save(state, tmp_path / "eplb.pt")
    torch.save(p2l, tmp_path / "p2l.pt")  # the bare tensor
    want = Placement(p2l.numpy(), num_logical=4, num_ranks=3)
    f = read_placement_file(tmp_path / "eplb.pt")
    assert f.format == "vllm" and f.num_logical == 4
    assert read_placement(tmp_path / "eplb.pt", num_ranks=3) == want
    assert read_placement(tmp_path / "p2l.pt", num_logical=4) == want
    with pytest.raises(ValueError, match="num_logical=4, expected num_logical=5"):
        read_placement(tmp_path / "eplb.pt", num_logical=5)
    # the tables must agree
    torch.save({**state, "logical_replica_count": count.flip(1)}, tmp_path / "count.pt")
    with pytest.raises(ValueError, match=r"count\.pt: key 'logical_replica_count'\[0, 0\] = 1, but "
                                         r"'physical_to_logical_map' has 2 copies"):
        read_placement(tmp_path / "count.pt")
    bad = l2p.clone()
    bad[0, 0, 1] = 0  # slot 0 listed twice, slot 4 not at all
    torch.save({**state, "logical_to_physical_map": bad}, tmp_path / "l2p.pt")
    with pytest.raises(ValueError, match=r"l2p\.pt: key 'logical_to_physical_map' layer 0: lists 6 slots \(5 distinct"):
        read_placement(tmp_path / "l2p.pt")


def test_named_placements():
    assert named_placement("vllm:linear", num_layers=2, num_logical=8, num_ranks=4, num_redundant=4) == \
        Placement.contiguous(2, 8, 4, num_redundant=4)
    assert named_placement("sglang:trivial", num_layers=1, num_logical=4, num_ranks=2) == Placement.contiguous(1, 4, 2)
    rr = named_placement("vllm:round_robin", num_layers=2, num_logical=8, num_ranks=4)
    assert rr.phy2log[1].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]  # rank r holds r, r + 4 (vLLM's example, EP 4)
    with pytest.raises(ValueError, match="round robin only without redundant"):
        named_placement("vllm:round_robin", num_layers=1, num_logical=8, num_ranks=4, num_redundant=4)
    with pytest.raises(ValueError, match="do not split evenly over EP size 3"):
        named_placement("vllm:linear", num_layers=1, num_logical=8, num_ranks=3)
    assert moe_layer_indices(MODULES) == (1, 2) and moe_layer_indices(["experts"]) is None


def _write(path, text):
    path.write_text(text)
    return path


def _moeshard_doc(**change):
    doc = {"format": "moeshard.placement", "version": 1, "num_layers": 1, "num_logical": 4, "num_physical": 4,
           "num_ranks": 2, "slots_per_rank": 2, "layers": [{"layer": 3, "phy2log": [0, 1, 2, 3]}]}
    return json.dumps({**doc, **change})


@pytest.mark.parametrize("name, text, kwargs, expected", [
    ("garbage.json", "{not json", {}, "garbage.json: not a readable placement JSON"),
    ("list.json", "[[0, 1]]", {}, "holds a list, expected a dict"),
    ("keys.json", '{"experts": 1}', {}, "has keys ['experts']; expected 'format'"),
    ("load.json", '{"logical_count": [[1, 2]]}', {}, "key 'logical_count' holds expert loads"),
    ("float.json", '{"physical_to_logical_map": [[0, 1.5]]}', {},
     "key 'physical_to_logical_map': expected integer expert ids, got dtype float64"),
    ("ragged.json", '{"physical_to_logical_map": [[0, 1], [0]]}', {}, "expected a rectangular table"),
    ("flat.json", '{"physical_to_logical_map": [0, 1]}', {},
     "key 'physical_to_logical_map': it has shape [2], expected [num_layers, num_physical]"),
    ("range.json", '{"physical_to_logical_map": [[0, 1, 9, 2]]}', {"num_logical": 4},
     "range.json: key 'physical_to_logical_map': phy2log[0, 2] = 9 is not a logical expert id in [0, 4)"),
    ("missing.json", '{"physical_to_logical_map": [[0, 0, 1, 1]]}', {"num_logical": 3},
     "logical expert 2 of layer 0 has no physical slot"),
    ("rows.json", '{"physical_to_logical_map": [[0, 1], [1, 0]]}', {"moe_layers": [1, 2, 3]},
     "has 2 row(s) (sglang writes one per decoder layer); the model has 3 MoE layers"),
    ("version.json", _moeshard_doc(version=2), {}, "key 'version': 2 is newer than this moeshard reads (1)"),
    ("slots.json", _moeshard_doc(slots_per_rank=3), {}, "key 'slots_per_rank': 3, expected num_physical / num_ranks"),
    ("short.json", _moeshard_doc(layers=[{"phy2log": [0, 1, 2]}]), {},
     "key 'layers[0].phy2log' has 3 slots, expected num_physical=4"),
    ("nlayers.json", _moeshard_doc(num_layers=2), {},
     "key 'layers': expected a list of num_layers=2 objects, got a list of 1"),
    ("bool.json", _moeshard_doc(num_logical=True), {}, "key 'num_logical': expected an integer >= 1, got True"),
    ("meta.json", _moeshard_doc(), {"moe_layers": [4]}, "written for MoE layers at decoder layers [3], the model's MoE "
                                                       "layers are at [4]"),
    ("ranks.json", _moeshard_doc(), {"num_ranks": 4}, "written for num_ranks=2, expected num_ranks=4"),
])
def test_bad_files_name_file_and_key(tmp_path, name, text, kwargs, expected):
    path = _write(tmp_path / name, text)
    with pytest.raises(ValueError) as e:
        read_placement(path, **kwargs)
    assert str(path) in str(e.value) and expected in str(e.value), str(e.value)


def test_bad_npy_torch_and_format_choices(tmp_path):
    np.save(tmp_path / "floats.npy", np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"floats\.npy: expected integer expert ids, got dtype float64"):
        read_placement(tmp_path / "floats.npy")
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(ValueError, match=r"junk\.npy: not a readable \.npy array"):
        read_placement(tmp_path / "junk.npy")
    with pytest.raises(ValueError, match=r"nope\.json: no such file"):
        read_placement(tmp_path / "nope.json")
    json_file = _write(tmp_path / "p.json", _moeshard_doc())
    with pytest.raises(ValueError, match="not a readable .npy array"):
        read_placement(json_file, format="npy")
    with pytest.raises(ValueError, match="key 'format': expected 'moeshard.placement'"):
        read_placement(_write(tmp_path / "s.json", '{"physical_to_logical_map": [[0]]}'), format="moeshard")
    with pytest.raises(ValueError, match="is not one of moeshard, npy, sglang, vllm"):
        read_placement(json_file, format="deepep")
    torch = pytest.importorskip("torch")
    torch.save({"physical_to_logical_map": torch.zeros(1, 4)}, tmp_path / "f.pt")
    with pytest.raises(ValueError, match=r"f\.pt: key 'physical_to_logical_map': expected integer expert ids, "
                                         r"got dtype torch\.float32"):
        read_placement(tmp_path / "f.pt")
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match=r"bad\.pt: not a torch\.save file torch\.load\(weights_only=True\) reads"):
        read_placement(tmp_path / "bad.pt")


def test_writers_refuse_what_the_engines_cannot_hold(tmp_path):
    p2l = Placement.contiguous(2, 8, 4, num_redundant=4).phy2log.copy()
    p2l[:, 9:] = -1  # rank 3 dead: its slots (copies of experts 1-3) empty
    pl = Placement(p2l, num_logical=8, num_ranks=4)
    for fmt in ("sglang", "vllm"):
        with pytest.raises(ValueError, match=f"{fmt} has no empty slots, the placement's slot 9 of layer 0"):
            write_placement(pl, tmp_path / f"{fmt}.json", format=fmt)
    write_placement(pl, tmp_path / "own.json", format="moeshard")  # moeshard's own formats keep -1
    assert read_placement(tmp_path / "own.json") == pl
    with pytest.raises(ValueError, match="modules has 1 entries, the placement 2 layers"):
        write_placement(pl, tmp_path / "m.json", format="moeshard", modules=["x"])
    assert set(FORMATS) == {"moeshard", "npy", "sglang", "vllm"} and PlacementFile.__doc__


# -- the command ----------------------------------------------------------------------------

CONFIG = {"model_type": "deepseek_v3", "hidden_size": 16, "vocab_size": 32, "num_hidden_layers": 3,
          "num_attention_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
          "qk_nope_head_dim": 4, "v_head_dim": 4, "n_routed_experts": 8, "n_shared_experts": 1,
          "moe_intermediate_size": 8, "intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 2,
          "torch_dtype": "bfloat16"}
CLUSTER = ["--nodes", "2", "--ranks-per-node", "2", "--ep", "4"]


def _plan(argv: list[str]) -> tuple[int, dict | None, str]:
    from moeshard.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["plan", *argv, "--json"])
    if rc:
        return rc, None, err.getvalue()
    rep = json.loads(out.getvalue())
    rep.pop("timings_s")
    # Timings differ run to run; everything else must not.
    rep["strategies"] = [{k: v for k, v in s.items() if not k.endswith(("seconds", "time_s"))}
                         for s in rep["strategies"]]
    return rc, rep, err.getvalue()


def test_plan_accepts_every_format(tmp_path):
    """A DeepSeek-like config (layer 0 dense): the same placement as .npy, moeshard JSON and
    sglang's JSON (3 rows) plans the same; a named placement plans as its .npy does."""
    cfg = _write(tmp_path / "config.json", json.dumps(CONFIG))
    base = ["--synthetic-from-config", str(cfg), *CLUSTER]
    pl = _placement()
    np.save(tmp_path / "p.npy", pl.phy2log)
    write_placement(pl, tmp_path / "own.json", format="moeshard", moe_layers=[1, 2], modules=MODULES)
    write_placement(pl, tmp_path / "sglang.json", format="sglang", moe_layers=[1, 2], num_hidden_layers=3)
    rc, want, err = _plan([*base, "--placement", str(tmp_path / "p.npy")])
    assert rc == 0 and want["cluster"]["num_physical"] == 12, err
    for name, extra in (("own.json", []), ("sglang.json", []), ("sglang.json", ["--placement-format", "sglang"])):
        rc, rep, err = _plan([*base, "--placement", str(tmp_path / name), *extra])
        assert rc == 0 and rep == want, (name, err)
    rr = named_placement("vllm:round_robin", num_layers=2, num_logical=8, num_ranks=4)
    np.save(tmp_path / "rr.npy", rr.phy2log)
    rc, rep, err = _plan([*base, "--placement", "vllm:round_robin"])
    assert rc == 0 and rep == _plan([*base, "--placement", str(tmp_path / "rr.npy")])[1], err
    # bad input: one line, exit 2, naming the file and the key
    write_placement(pl, tmp_path / "mixtral.json", format="moeshard", moe_layers=[0, 1])
    for argv, expected in (
        (["--placement", str(tmp_path / "mixtral.json")],
         "key 'layers': written for MoE layers at decoder layers [0, 1]"),
        (["--placement", str(_write(tmp_path / "one.json", '{"physical_to_logical_map": [[0, 1]]}'))],
         "has 1 row(s) (sglang writes one per decoder layer); the model has 2 MoE layers at decoder layers [1, 2]"),
        (["--placement", str(tmp_path / "own.json"), "--placement-format", "npy"], "not a readable .npy array"),
        (["--placement", "vllm:round_robin", "--redundant", "4"], "round robin only without redundant"),
    ):
        rc, _, err = _plan([*base, *argv])
        assert rc == 2 and err.count("\n") == 1 and expected in err and "Traceback" not in err, (argv, err)


def test_verify_reads_every_format(tmp_path):
    """``moeshard verify``'s placement reading, without a process group."""
    from argparse import Namespace

    from moeshard.cli.verify import placement_from_args as verify_placement

    pl = _placement()
    write_placement(pl, tmp_path / "sglang.json", format="sglang", moe_layers=[1, 2], num_hidden_layers=3)
    write_placement(pl, tmp_path / "own.json", format="moeshard", moe_layers=[1, 2])

    def args(placement, fmt=None, redundant=0):
        return Namespace(placement=str(placement), placement_format=fmt, redundant=redundant)

    for name in ("sglang.json", "own.json"):
        assert verify_placement(args(tmp_path / name), 2, 8, 4, MODULES) == pl
    assert verify_placement(args("vllm:linear", redundant=4), 2, 8, 4, MODULES) == Placement.contiguous(2, 8, 4, 4)
    with pytest.raises(ValueError, match=r"sglang\.json has shape \[3, 12\]; expected \[2, num_physical\]"):
        verify_placement(args(tmp_path / "sglang.json"), 2, 8, 4, None)  # no module names: sglang's 3 rows kept
    with pytest.raises(ValueError, match="written for num_ranks=4, the job has 2"):
        verify_placement(args(tmp_path / "own.json"), 2, 8, 2, MODULES)
