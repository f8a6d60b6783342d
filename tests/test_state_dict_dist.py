"""Tier 2: torch's own savers and loaders on a moeshard model are right or loud.

On 4 gloo ranks (EP=4, and EP=2 x expert-FSDP=2), for the tiny custom MoE of ``tiny_moe`` and the
transformers families of ``tiny_hf.MATRIX`` written by ``save_pretrained`` (Qwen3-MoE; DeepSeek-V3,
its ``e_score_correction_bias`` buffers compared with the rest, on EP=2 x expert-FSDP=2):

* identity placement (``Placement.contiguous(..., num_redundant=0)``): ``state_dict()`` and DCP's
  ``get_model_state_dict(full_state_dict=True)`` equal the checkpoint's tensors (bit for bit),
  ``load_state_dict`` and ``set_model_state_dict`` round trips are exact, and the optimizer's
  state dict saves and loads;
* shuffled and redundant placements: every path (``state_dict()``, ``load_state_dict()``, DCP's
  get/set model and optimizer state dicts, full and sharded, ``optimizer.state_dict()`` /
  ``load_state_dict()``, an unchecked optimizer load caught at the first step,
  ``save_pretrained``) raises ValueError on every rank naming the parameter, the placement and
  moeshard.save; none of them changes a weight (the model still equals the checkpoint after);
  ``moeshard.logical_state_dict`` gives rank 0 the checkpoint's tensors bit for bit;
* relocation identity -> shuffled turns the guard on, shuffled -> identity off again;
* peft LoRA on the experts: lora_A passes under the identity placement, lora_B (columns per EP
  rank) never with EP > 1, both naming moeshard.lora.save_adapter; logical_state_dict puts slot-
  encoded factors and weights in peft's / the checkpoint's layout.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tiny_hf
import tiny_moe
from mp import run_ranks

pytestmark = pytest.mark.dist

WORLD = 4
NUM_MOE = len(tiny_moe.MOE_BLOCKS)
# The transformers families (tiny_hf.MATRIX) beside the custom MoE: "hf" is Qwen3-MoE.
FAMILY = {"hf": "qwen3_moe", "deepseek_v3": "deepseek_v3"}
KINDS = ("tiny", *FAMILY)
# DeepSeek-V3 (its persistent buffers, MLA, dense first layer) on EP=2 x expert-FSDP=2 only: the
# suite's time; the EP=4 paths are the same code.
CONFIGS = [(k, ep, f) for k in KINDS for ep, f in ((4, 1), (2, 2)) if k != "deepseek_v3" or f == 2]


def _placements(ep: int, num_logical: int, num_layers: int) -> dict:
    import moeshard

    rng = np.random.default_rng(ep)
    # Permutations moving experts across EP ranks (neither is the identity).
    shuffled = np.stack(
        [np.roll(np.arange(num_logical), 1)] + [rng.permutation(num_logical) for _ in range(num_layers - 1)]
    )
    assert not (shuffled == np.arange(num_logical)).all(axis=1).any()
    return {
        "identity": moeshard.Placement.contiguous(num_layers, num_logical, ep),
        "shuffled": moeshard.Placement(shuffled, num_logical=num_logical, num_ranks=ep),
        "redundant": tiny_moe.shuffled_placement(num_layers, num_logical, ep, num_logical + ep, seed=ep),
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _try(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return f"ValueError: {e}"
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return "ok"


def _fake_grads(model) -> None:
    """Zero gradients: Adam creates its moments; with zero gradients and no weight decay the
    step leaves every weight as it is."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def _sd_mismatches(sd: dict, want: dict) -> list[str]:
    bad = (
        [f"keys: extra {sorted(set(sd) - set(want))[:3]} missing {sorted(set(want) - set(sd))[:3]}"]
        if set(sd) != set(want)
        else []
    )
    for k, v in sd.items():
        if k in want and not torch.equal(_full(v).cpu(), want[k].to(_full(v).dtype)):
            bad.append(k)
    return bad


def worker(root: str, hf_ckpts: dict) -> dict:
    import copy

    import torch.distributed as dist
    import transformers
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import moeshard

    full_opts = StateDictOptions(full_state_dict=True)
    ckpt = tiny_moe.read_all(os.path.join(root, "tiny"))
    out: dict = {kind: {} for kind in KINDS}
    out["relocate"] = {}
    # The one-process state dicts (parameters and persistent buffers: DeepSeek-V3's
    # e_score_correction_bias), per transformers family.
    hf_refs = {
        kind: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        for kind, path in hf_ckpts.items()
    }

    def build(kind: str, mesh, pl):
        if kind == "tiny":
            with torch.device("meta"):
                model = tiny_moe.TinyMoE()
            moeshard.parallelize(model, mesh, pl)
            moeshard.load(model, os.path.join(root, "tiny"), placement=pl)
            return model
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(tiny_hf.config(FAMILY[kind]))
        moeshard.parallelize(model, mesh, pl)
        moeshard.load(model, hf_ckpts[kind], placement=pl)
        return model

    def wrong(kind: str, model, pl) -> list[str]:
        """Mismatches between the model's local tensors and the checkpoint under ``pl``."""
        if kind == "tiny":
            return tiny_moe.compare(model, ckpt, pl)
        layers = tiny_moe.moe_layers(model)
        bad = []
        for name, t in tiny_moe.named_tensors(model).items():
            if name not in hf_refs[kind]:  # a non-persistent buffer
                continue
            module, _, param = name.rpartition(".")
            want = hf_refs[kind][name]
            if module in layers and param in ("gate_up_proj", "down_proj"):
                want = want[torch.tensor(pl.phy2log[layers[module]])]  # slot p holds expert phy2log[p]
            if not torch.equal(tiny_moe.local_of(t), want[tiny_moe.local_box(t)]):
                bad.append(name)
        return bad

    def logical(kind: str, model) -> dict:
        """The checkpoint's tensors under the model's names (what a logical state dict holds)."""
        if kind != "tiny":
            return hf_refs[kind]
        ident = np.tile(np.arange(tiny_moe.NUM_EXPERTS), (NUM_MOE, 1))
        layers = tiny_moe.moe_layers(model)
        return {k: tiny_moe.expected_full(k, ckpt, ident, layers) for k in tiny_moe.named_tensors(model)}

    meshes = {(4, 1): moeshard.make_mesh("cpu", ep=4), (2, 2): moeshard.make_mesh("cpu", ep=2, efsdp=2)}
    for kind in KINDS:
        num_logical = tiny_moe.NUM_EXPERTS if kind == "tiny" else 8
        for (ep, efsdp), mesh in meshes.items():
            if (kind, ep, efsdp) not in CONFIGS:
                continue
            pls = _placements(ep, num_logical, NUM_MOE)
            # -- identity: every path works and is the checkpoint's ---------------------------
            model = build(kind, mesh, pls["identity"])
            want = logical(kind, model)
            rec: dict = {}
            rec["state_dict"] = _sd_mismatches(model.state_dict(), want)
            # Cloned: DCP returns unsharded tensors (buffers) themselves, and scramble() fills them.
            full = {k: v.clone() for k, v in get_model_state_dict(model, options=full_opts).items()}
            rec["dcp_full"] = _sd_mismatches(full, want)
            rec["dcp_sharded"] = _sd_mismatches(get_model_state_dict(model), want)
            saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
            tiny_moe.scramble(model)
            model.load_state_dict(saved)
            rec["load_round_trip"] = wrong(kind, model, pls["identity"])
            tiny_moe.scramble(model)
            set_model_state_dict(model, dict(full), options=full_opts)  # (DCP rewrites the dict it is given)
            rec["dcp_set_full_round_trip"] = wrong(kind, model, pls["identity"])
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            _fake_grads(model)
            opt.step()
            ident_osd = copy.deepcopy(opt.state_dict())
            ident_full_osd = get_optimizer_state_dict(model, opt, options=full_opts)
            rec["optim_paths"] = [
                _try(lambda: get_optimizer_state_dict(model, opt)),
                _try(lambda: set_optimizer_state_dict(model, opt, copy.deepcopy(ident_full_osd), options=full_opts)),
                _try(lambda: opt.load_state_dict(ident_osd)),
            ]
            opt2 = torch.optim.Adam(model.parameters(), lr=1e-3)
            opt2.load_state_dict(ident_osd)
            _fake_grads(model)
            rec["fresh_load_step"] = _try(opt2.step)
            rec["after"] = wrong(kind, model, pls["identity"])
            out[kind][(ep, efsdp, "identity")] = rec
            # -- shuffled and redundant: every path raises, nothing changes ---------------------
            for pname in ("shuffled", "redundant"):
                pl = pls[pname]
                model = build(kind, mesh, pl)
                # Refused loads are given other values (+1), so that a partial copy would show.
                bumped = {k: v.detach() + 1 for k, v in model.named_parameters()}
                experts = {k: v for k, v in bumped.items() if k.endswith(("gate_up_proj", "down_proj"))}
                others = {k: v.detach().clone() for k, v in model.named_parameters() if k not in experts}
                bumped_full = {k: v + 1 for k, v in full.items()}
                rec = {"before": wrong(kind, model, pl)}
                # Loads of other parameters only are not refused (first: they would restore
                # what a refused load had copied before raising, and hide it).
                rec["others_nonstrict"] = _try(lambda: model.load_state_dict(others, strict=False))
                rec["dcp_set_others"] = _try(
                    lambda: set_model_state_dict(model, others, options=StateDictOptions(strict=False))
                )
                attempts = {
                    "state_dict": model.state_dict,
                    "submodule_state_dict": lambda: model.get_submodule(
                        next(iter(experts)).rsplit(".", 2)[0]
                    ).state_dict(),
                    "keep_vars_state_dict": lambda: model.state_dict(keep_vars=True),
                    "dcp_get_sharded": lambda: get_model_state_dict(model),
                    "dcp_get_full": lambda: get_model_state_dict(model, options=full_opts),
                    "load_state_dict": lambda: model.load_state_dict(bumped),
                    "load_experts_nonstrict": lambda: model.load_state_dict(experts, strict=False),
                    "dcp_set_sharded": lambda: set_model_state_dict(model, dict(bumped)),
                    "dcp_set_full": lambda: set_model_state_dict(model, dict(bumped_full), options=full_opts),
                }
                if kind != "tiny":
                    where = os.path.join(root, f"sp{dist.get_rank()}")
                    attempts["save_pretrained"] = lambda: model.save_pretrained(where)
                rec["model_paths"] = {k: _try(f) for k, f in attempts.items()}
                with moeshard.allow_slot_order():
                    rec["allowed_keys"] = sorted(model.state_dict()) == sorted(want)
                # The explicit, collective way: rank 0 gets the checkpoint's tensors, the others nothing.
                gathered = moeshard.logical_state_dict(model)
                rec["logical"] = _sd_mismatches(gathered, want) if dist.get_rank() == 0 else sorted(gathered)
                opt = torch.optim.Adam(model.parameters(), lr=1e-3)
                rec["empty_optim_state_dict"] = _try(opt.state_dict)  # no moments yet: nothing in slot order
                _fake_grads(model)
                opt.step()
                rec["optim_paths"] = {
                    "state_dict": _try(opt.state_dict),
                    "load_state_dict": _try(lambda: opt.load_state_dict(ident_osd)),
                    "dcp_get_sharded": _try(lambda: get_optimizer_state_dict(model, opt)),
                    "dcp_get_full": _try(lambda: get_optimizer_state_dict(model, opt, options=full_opts)),
                    "dcp_set_full": _try(
                        lambda: set_optimizer_state_dict(model, opt, copy.deepcopy(ident_full_osd), options=full_opts)
                    ),
                }
                unchecked = torch.optim.Adam(model.parameters(), lr=1.0)
                unchecked.load_state_dict(ident_osd)  # a fresh optimizer: torch has no hook to see it yet
                for p in model.parameters():
                    p.grad = torch.ones_like(p)  # lr 1: a step that ran would change every weight
                rec["unchecked_first_step"] = _try(unchecked.step)
                rec["unchecked_second_step"] = _try(unchecked.step)
                checked = torch.optim.Adam(model.parameters(), lr=1.0)
                rec["guard_optimizer"] = moeshard.guard_optimizer(checked)
                rec["checked_load"] = _try(lambda: checked.load_state_dict(ident_osd))
                rec["after"] = wrong(kind, model, pl)
                # Last: DCP's broadcast_from_rank0 copies into the parameters before load_state_dict.
                rec["dcp_set_bcast"] = _try(
                    lambda: set_model_state_dict(
                        model,
                        dict(full) if dist.get_rank() == 0 else {},
                        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
                    )
                )
                out[kind][(ep, efsdp, pname)] = rec
            # -- relocation moves the guard with the placement ----------------------------------
            model = build(kind, mesh, pls["identity"])
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            _fake_grads(model)
            opt.step()
            rec = {"identity": _try(model.state_dict)}
            moeshard.relocate(model, pls["identity"], pls["shuffled"], optimizer=opt)
            rec["shuffled_wrong"] = wrong(kind, model, pls["shuffled"])
            rec["shuffled"] = _try(model.state_dict)
            rec["shuffled_dcp"] = _try(lambda: get_model_state_dict(model, options=full_opts))
            rec["shuffled_optim"] = _try(opt.state_dict)
            moeshard.relocate(model, pls["shuffled"], pls["identity"], optimizer=opt)
            rec["back"] = _sd_mismatches(get_model_state_dict(model, options=full_opts), want)
            rec["back_optim"] = _try(opt.state_dict)
            out["relocate"][(kind, ep, efsdp)] = rec
    out["lora"] = _lora_paths(meshes[(4, 1)])
    return out


def _lora_paths(mesh) -> dict:
    """peft LoRA on the experts (no load needed: the hooks raise before any data is read).
    lora_A ``[r*P, in]`` rows are whole slots: logical under the identity placement. lora_B
    ``[out, r*P]``'s global columns are (EP rank, r, slot), never peft's (r, expert) with EP > 1."""
    import peft
    import torch.distributed as dist
    import transformers

    import moeshard

    out = {}
    for pname, pl in _placements(4, 8, NUM_MOE).items():
        if pname == "redundant":
            continue
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(tiny_hf.config("qwen3_moe"))
        model = peft.get_peft_model(
            model,
            peft.LoraConfig(
                r=2,
                lora_alpha=4,
                target_modules=["q_proj"],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            ),
        )
        moeshard.parallelize(model, mesh, pl)
        mods = dict(model.named_modules())
        a = next(n for n in mods if "experts" in n and n.endswith("lora_A.default"))
        b = a.replace("lora_A", "lora_B")
        q = next(n for n in mods if "q_proj" in n and n.endswith("lora_A.default"))
        out[pname] = {
            "lora_A": _try(mods[a].state_dict),
            "lora_B": _try(mods[b].state_dict),
            "attention_lora": _try(mods[q].state_dict),
            "model": _try(model.state_dict),
        }
        # logical_state_dict's layouts: slot values encode (expert, LoRA rank index j).
        moeshard.materialize(model)
        experts = next(
            n
            for n, m in mods.items()
            if "gate_up_proj" in getattr(getattr(m, "moeshard_slot_guard", None), "params", ())
        )
        layer = mods[a].moeshard_slot_guard.layer
        spr, r = pl.num_physical // 4, 2
        slots = pl.phy2log[layer, dist.get_rank() * spr : (dist.get_rank() + 1) * spr]  # ep rank == rank here
        code = torch.tensor([[10.0 * e + j for j in range(r)] for e in slots])  # [S, r]
        with torch.no_grad():
            mods[a].weight.to_local().copy_(code.reshape(-1, 1))  # rows (slot, j)
            mods[b].weight.to_local().copy_(code.T.reshape(1, -1))  # columns (j, slot)
            mods[experts].gate_up_proj.to_local().copy_(code[:, :1, None])
        logical = moeshard.logical_state_dict(model, cpu_offload=False)
        want = torch.tensor([[10.0 * e + j for j in range(r)] for e in range(8)])  # [E, r]
        out[pname]["logical"] = [
            torch.equal(logical[f"{a}.weight"], want.reshape(-1, 1).expand_as(logical[f"{a}.weight"])),
            torch.equal(logical[f"{b}.weight"], want.T.reshape(1, -1).expand_as(logical[f"{b}.weight"])),
            torch.equal(
                logical[f"{experts}.gate_up_proj"], want[:, :1, None].expand_as(logical[f"{experts}.gate_up_proj"])
            ),
        ]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("state_dict")
    tiny_moe.write(os.path.join(root, "tiny"))
    hf = {}
    for kind, family in FAMILY.items():
        hf[kind] = os.path.join(root, kind)
        tiny_hf.save_checkpoint(family, hf[kind])
    return run_ranks(worker, str(root), hf, world=WORLD, local_world=2, timeout=400)


@pytest.mark.parametrize("kind,ep,efsdp", CONFIGS)
def test_identity_placement_state_dicts_are_the_checkpoint(results, kind, ep, efsdp):
    for r in results:
        rec = r[kind][(ep, efsdp, "identity")]
        assert rec["state_dict"] == [] and rec["dcp_full"] == [] and rec["dcp_sharded"] == []
        assert rec["load_round_trip"] == [] and rec["dcp_set_full_round_trip"] == []
        assert rec["optim_paths"] == ["ok"] * 3
        assert rec["fresh_load_step"] == "ok" and rec["after"] == []


def _check_error(
    msg: str, pname: str, saver: str = "moeshard.save", names=("experts.gate_up_proj", "experts.down_proj")
) -> None:
    assert msg.startswith("ValueError: "), msg
    assert saver in msg, msg
    assert any(n in msg for n in names), msg
    assert f"placement is {pname}" in msg, msg


@pytest.mark.parametrize("pname", ["shuffled", "redundant"])
@pytest.mark.parametrize("kind,ep,efsdp", CONFIGS)
def test_other_placements_refuse_every_path(results, kind, ep, efsdp, pname):
    for r in results:
        rec = r[kind][(ep, efsdp, pname)]
        assert rec["before"] == [], "the load itself must be right"
        for msg in rec["model_paths"].values():
            _check_error(msg, pname)
        for path, msg in rec["optim_paths"].items():
            _check_error(msg, pname, "moeshard.allow_slot_order")
            assert msg.startswith("ValueError: optimizer state of "), (path, msg)
        assert rec["others_nonstrict"] == "ok", "a load of other parameters only is not refused"
        assert rec["dcp_set_others"] == "ok"
        assert rec["allowed_keys"], "allow_slot_order lets the state dict through"
        assert rec["logical"] == [], "logical_state_dict: the checkpoint's tensors on rank 0, nothing elsewhere"
        assert rec["empty_optim_state_dict"] == "ok", "no per-element state yet: nothing in slot order"
        # An optimizer loaded before any hook could see it refuses its first step (and the next).
        _check_error(rec["unchecked_first_step"], pname, "moeshard.allow_slot_order")
        assert "unchecked optimizer.load_state_dict" in rec["unchecked_first_step"]
        assert rec["unchecked_second_step"] == rec["unchecked_first_step"]
        assert rec["guard_optimizer"] is True
        _check_error(rec["checked_load"], pname, "moeshard.allow_slot_order")
        assert rec["after"] == [], "no refused path changed a weight"
        if pname == "redundant" and rec["dcp_set_bcast"].startswith("RuntimeError"):
            # DCP's broadcast_from_rank0 copies rank 0's [8, ...] rows into [P > 8, ...] slots
            # before load_state_dict: its own size check fails first, on every rank.
            assert "The size of tensor a" in rec["dcp_set_bcast"], rec["dcp_set_bcast"]
        else:
            _check_error(rec["dcp_set_bcast"], pname)


@pytest.mark.parametrize("kind,ep,efsdp", CONFIGS)
def test_relocation_moves_the_guard(results, kind, ep, efsdp):
    for r in results:
        rec = r["relocate"][(kind, ep, efsdp)]
        assert rec["identity"] == "ok"
        assert rec["shuffled_wrong"] == []
        _check_error(rec["shuffled"], "shuffled")
        _check_error(rec["shuffled_dcp"], "shuffled")
        _check_error(rec["shuffled_optim"], "shuffled", "moeshard.allow_slot_order")
        assert rec["back"] == [] and rec["back_optim"] == "ok"


def test_expert_lora_factors_refuse_unless_logical(results):
    for r in results:
        ident, shuffled = r["lora"]["identity"], r["lora"]["shuffled"]
        assert ident["lora_A"] == "ok" and ident["attention_lora"] == "ok" and shuffled["attention_lora"] == "ok"
        for msg in (ident["lora_B"], ident["model"]):
            assert msg.startswith("ValueError: ") and "moeshard.lora.save_adapter" in msg, msg
            assert "not peft's (r, experts) order" in msg, msg
        assert ident["logical"] == [True] * 3 and shuffled["logical"] == [True] * 3
        for msg in (shuffled["lora_A"], shuffled["lora_B"]):
            _check_error(msg, "shuffled", "moeshard.lora.save_adapter", names=("lora_A.default", "lora_B.default"))
            assert ".experts." in msg, msg
