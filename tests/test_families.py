"""Every transformers MoE causal-LM family (tests/hf_families.py), one process: ``moeshard.save``
writes the names the family's ``from_pretrained`` reads (transformers' own conversion mapping),
or refuses before writing anything; ``moeshard.load`` reads what ``save_pretrained`` wrote.

For each family whose checkpoints hold per-expert tensors:
- save -> from_pretrained: no missing, unexpected or mismatched key, the state dict bit for bit,
  and the same key set as transformers' own save_pretrained;
- save_pretrained -> moeshard.load into a model with other values: the state dict bit for bit.
For each family that stores its experts fused on disk (``[E, ...]`` tensors): load reads rows of
them and save writes them fused, as save_pretrained does. A family whose converter moeshard
cannot express as box reads (gate and up rows interleaved, one checkpoint tensor split into
several model tensors) is refused by load and verify, naming the converter and why
(``hf_families.REFUSED``); save refuses before writing anything or writes names from_pretrained
reads back. Families the installed transformers lacks are skipped.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import hf_families

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

# Every per-expert family round-trips. longcat_flash's gate_up_proj keeps rows for its identity
# "zero experts" that down_proj lacks: an unsharded model holds and writes them as the experts
# after the logical ones (tests/test_families_ep.py: an EP model writes them as zeros).
# bailing_hybrid and kimi_linear keep one attention tensor (conv1d) that transformers splits into
# q/k/v conv1d tensors on disk (a Concatenate converter): load reads the parts, save writes them.
SPLIT_ON_DISK = {"bailing_hybrid", "kimi_linear"}


def _keys(path: str) -> set[str]:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return set(json.load(f)["weight_map"])


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().reshape(-1).view(torch.uint8) for k, v in model.state_dict().items()}


def _same(a, b) -> list[str]:
    assert set(a) == set(b), set(a) ^ set(b)
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.fixture(scope="module", autouse=True)
def quiet():
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(level)


def _reference(family, tmp_path):
    if not hf_families.installed(family):
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    model = hf_families.build(family)
    ref = tmp_path / "ref"
    model.save_pretrained(ref, max_shard_size="40KB")
    return model, str(ref)


def _perturbed(family):
    other = hf_families.build(family)
    with torch.no_grad():  # every value differs from the checkpoint's before the load
        for t in list(other.parameters()) + list(other.buffers()):
            if t.is_floating_point():
                t.add_(1.0)
    return other


@pytest.mark.parametrize("family", sorted(hf_families.PER_EXPERT_ON_DISK - set(hf_families.REFUSED)))
def test_save_is_read_back_by_from_pretrained(family, tmp_path):
    import moeshard

    model, ref = _reference(family, tmp_path)
    out = tmp_path / "out"
    moeshard.save(model, out, max_shard_bytes=40_000)
    assert _keys(str(out)) == _keys(ref), "not the names transformers' own save_pretrained writes"
    if family in SPLIT_ON_DISK:
        assert any(k.endswith("q_conv1d.weight") for k in _keys(str(out)))
        assert not any(k.endswith(".conv1d.weight") for k in _keys(str(out)))
    back, info = hf_families.auto_class(family).from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(back) is type(model)
    assert _same(_state(model), _state(back)) == []


@pytest.mark.parametrize("family", sorted(hf_families.PER_EXPERT_ON_DISK - set(hf_families.REFUSED)))
def test_load_reads_save_pretrained(family, tmp_path):
    import moeshard

    model, ref = _reference(family, tmp_path)
    other = _perturbed(family)
    moeshard.load(other, ref)
    # state_dict: parameters and persistent buffers (rotary tables are no checkpoint's).
    assert _same(_state(model), _state(other)) == []


@pytest.mark.parametrize("family", sorted(hf_families.FUSED_ON_DISK - set(hf_families.REFUSED)))
def test_fused_on_disk_families(family, tmp_path):
    """Experts fused on disk: load reads rows of the one tensor per projection; save writes the
    names and layout save_pretrained writes (with and without the checkpoint as reference), and
    from_pretrained reads it back bit for bit."""
    import moeshard

    model, ref = _reference(family, tmp_path)
    assert not any(re.search(r"\.experts\.\d+\.", k) for k in moeshard.CheckpointIndex.open(ref).tensors)
    out = tmp_path / "out"
    other = _perturbed(family)
    moeshard.load(other, ref)
    assert _same(_state(model), _state(other)) == []
    for i, reference in enumerate((None, ref)):
        moeshard.save(model, out / str(i), max_shard_bytes=40_000, reference=reference)
        assert _keys(str(out / str(i))) == _keys(ref), "not the names transformers' own save_pretrained writes"
        back, info = hf_families.auto_class(family).from_pretrained(
            out / str(i), dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        assert _same(_state(model), _state(back)) == []


@pytest.mark.parametrize("family", sorted(hf_families.REFUSED))
def test_refused_families(family, tmp_path):
    """A family whose checkpoints transformers reads through a converter moeshard cannot express
    as box reads: load and verify of what save_pretrained wrote raise, naming the converter and
    why (hf_families.REFUSED), before any read. save either refuses before writing anything
    (the names it would write are not read back) or writes the model's own tensors, which
    from_pretrained and moeshard.load read back bit for bit."""
    import moeshard

    model, ref = _reference(family, tmp_path)
    other = _perturbed(family)
    for op in (moeshard.load, moeshard.verify):
        with pytest.raises(ValueError, match="converter moeshard cannot express as box reads") as e:
            op(other, ref)
        assert hf_families.REFUSED[family] in str(e.value), str(e.value)
    out = tmp_path / "out"
    if family in hf_families.SAVE_REFUSED:
        with pytest.raises(ValueError) as e:
            moeshard.save(model, out)
        msg = str(e.value)
        assert "from_pretrained" in msg and "would not read these names back" in msg, msg
        assert not out.exists() or not os.listdir(out), "nothing may be written"
        return
    moeshard.save(model, out, max_shard_bytes=40_000)
    back, info = hf_families.auto_class(family).from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert _same(_state(model), _state(back)) == []
    moeshard.load(other, out)
    assert _same(_state(model), _state(other)) == []


def test_names_come_from_transformers_mapping():
    """The names are transformers' own conversion mapping read at run time (hf_names), not a
    family table kept by moeshard."""
    from moeshard.models.hf_names import hf_names

    names = hf_names(hf_families.build("lfm2_moe"))
    assert names.family == "lfm2_moe" and names.model_class == "Lfm2MoeForCausalLM"
    (spec,) = names.specs
    assert {p.name: p.parts for p in spec.params} == {
        "gate_up_proj": ("{e}.w1.weight", "{e}.w3.weight"),
        "down_proj": ("{e}.w2.weight",),
    }
    assert (
        names.checkpoint_name("model.layers.1.feed_forward.experts.3.w1.weight")
        == "model.layers.1.feed_forward.experts.3.w1.weight"
    )
    assert (
        names.loaded_name("model.layers.1.feed_forward.experts.3.w1.weight")
        == "model.layers.1.feed_forward.experts.gate_up_proj"
    )
    phi = hf_names(hf_families.build("phimoe"))
    assert phi.checkpoint_name("model.layers.0.mlp.router.weight") == "model.layers.0.block_sparse_moe.gate.weight"
    assert (
        phi.checkpoint_module("model.layers.0.mlp.experts", phi.specs[0].params[0])
        == "model.layers.0.block_sparse_moe.experts"
    )
    # A dense tensor a converter concatenates from several checkpoint tensors: its parts, renamed.
    bailing = hf_names(hf_families.build("bailing_hybrid", device="meta"))
    assert bailing.checkpoint_parts("model.layers.0.self_attn.conv1d.weight") == (
        tuple(f"model.layers.0.attention.{x}_conv1d.weight" for x in "qkv"),
        0,
    )
    assert bailing.checkpoint_parts("model.layers.0.self_attn.o_proj.weight") is None
    assert not any("conv1d" in target for target, _ in bailing.refused)
    # A model that is no transformers model has no transformers names.
    assert hf_names(torch.nn.Linear(2, 2)) is None
