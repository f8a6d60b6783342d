"""Tier 3: one rank's bad input, at every stage of every collective operation, raises a clear
error on EVERY rank within seconds, naming that rank, and leaves the group usable.

Exactly one rank (``BAD``) passes something wrong to ``load``, ``verify``, ``save``,
``relocate``, ``moeshard.lora.load_adapter`` / ``save_adapter`` or ``from_pretrained`` (a
placement other than its model's, a topology of another world size, a checkpoint it cannot see,
a truncated copy of a file, an output directory it cannot write, a model of another shape, ...);
the others pass the right one. Every rank must raise (a DistributedError, or the operation's own
error type) whose text names rank ``BAD`` and what was wrong, long before the process group's
timeout: a rank that raised before the others' first collective would leave them waiting there
until the backend gives up. After each scenario the ranks agree on the scenario's name (the
group still works and every rank is at the same step), and at the end every model loads and
verifies against its checkpoint's bytes. Nothing is half-written: a refused save leaves no index,
shard or temporary file.

One group of 4 ranks (2 nodes x 2, EP=2 x expert-FSDP=2) runs every scenario in sequence, on a
tiny Qwen3-MoE and a tiny DeepSeek-V3 (``tiny_hf.MATRIX``). Its process group's timeout is
``TIMEOUT_S``; a scenario must fail within ``FAIL_WITHIN_S``, a quarter of it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch

import tiny_hf
from moeshard._launch import exit_process, free_port
from mp import forkserver, set_rank_env, start_and_join

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = [pytest.mark.dist, pytest.mark.hf]

WORLD, LWS, BAD = 4, 2, 2
# The group's collective timeout: a hang fails the scenario after this long. Scenarios must end
# far earlier (a 2-core test host under load still delays a healthy exchange by seconds).
TIMEOUT_S = 60
FAIL_WITHIN_S = 15
R = 4  # LoRA rank


def _lora_config():
    return peft.LoraConfig(
        r=R,
        lora_alpha=2 * R,
        target_modules=["o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )


def _hf_model(family: str, vocab: int | None = None):
    """The tiny ``family`` model on the meta device (``vocab``: another vocabulary size)."""
    config = tiny_hf.config(family)
    if vocab is not None:
        config.vocab_size = vocab
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _placements(family: str):
    num_logical = tiny_hf.FAMILIES[family]
    return tiny_hf.shuffled_redundant(num_logical, 2, seed=1), tiny_hf.shuffled_redundant(num_logical, 2, seed=2)


def _save_failing_on(bad: bool, model, out: Path):
    """``moeshard.save``, where rank BAD's shard files cannot be created (a full or read-only
    disk on its host)."""
    import contextlib
    from unittest import mock

    import moeshard
    from moeshard.ops import save as save_module

    def full(path, *args):
        raise OSError(28, "No space left on device", str(path))

    with mock.patch.object(save_module, "ShardWriter", full) if bad else contextlib.nullcontext():
        return moeshard.save(model, out, fsync=False)


def _scenarios(rank: int, root: Path, mesh) -> dict:
    """Scenario name -> the call every rank makes (rank ``BAD`` with its bad input)."""
    import moeshard
    import moeshard.lora as mlora
    from moeshard import Topology

    bad = rank == BAD
    wrong_world = Topology(world_size=2, local_world_size=2)
    steps = {}
    for family in tiny_hf.MATRIX:
        ckpt = str(root / family)
        pl, other = _placements(family)
        model = _hf_model(family)
        moeshard.parallelize(model, mesh, pl)
        # Rank BAD's model has another vocabulary: its embedding's shape is not the checkpoint's.
        odd = _hf_model(family, vocab=tiny_hf.VOCAB + 8 if bad else None)
        moeshard.parallelize(odd, mesh, pl)
        f = family
        steps |= {
            # Defect 6: a placement other than the one its model routes by, on one rank.
            f"load/placement-not-the-model's/{f}": lambda m=model, c=ckpt, o=other, p=pl: moeshard.load(
                m, c, placement=o if bad else p
            ),
            f"load/topology-world/{f}": lambda m=model, c=ckpt: moeshard.load(
                m, c, topology=wrong_world if bad else None
            ),
            f"load/read-threads/{f}": lambda m=model, c=ckpt: moeshard.load(m, c, read_threads=0 if bad else None),
            f"load/checkpoint-not-a-path/{f}": lambda m=model, c=ckpt: moeshard.load(m, None if bad else c),
            f"load/checkpoint-not-visible/{f}": lambda m=model, c=ckpt: moeshard.load(
                m, c + "-nowhere" if bad else c, storage="shared"
            ),
            f"load/truncated-copy/{f}": lambda m=model, c=ckpt: moeshard.load(
                m, c + "-truncated" if bad else c, storage="shared"
            ),
            f"load/model-shape/{f}": lambda m=odd, c=ckpt: moeshard.load(m, c),
            f"load/ok/{f}": lambda m=model, c=ckpt: moeshard.load(m, c),
            f"verify/placement-not-the-model's/{f}": lambda m=model, c=ckpt, o=other, p=pl: moeshard.verify(
                m, c, placement=o if bad else p
            ),
            f"verify/topology-world/{f}": lambda m=model, c=ckpt: moeshard.verify(
                m, c, topology=wrong_world if bad else None
            ),
            f"verify/truncated-copy/{f}": lambda m=model, c=ckpt: moeshard.verify(
                m, c + "-truncated" if bad else c, storage="shared"
            ),
            f"save/placement-not-the-model's/{f}": lambda m=model, o=other, p=pl, d=root / f"save-pl-{f}": (
                moeshard.save(m, d, placement=o if bad else p, fsync=False)
            ),
            f"save/topology-world/{f}": lambda m=model, d=root / f"save-topo-{f}": moeshard.save(
                m, d, topology=wrong_world if bad else None, fsync=False
            ),
            # Rank BAD's output directory lies under a file: it cannot write there.
            f"save/out-dir-not-writable/{f}": lambda m=model, d=root / f"save-dir-{f}": moeshard.save(
                m, root / "a-file" / "out" if bad else d, fsync=False
            ),
            f"save/reference-kind/{f}": lambda m=model, c=ckpt, d=root / f"save-ref-{f}": moeshard.save(
                m, d, reference=None if bad else c, fsync=False
            ),
            f"save/write-fails/{f}": lambda m=model, d=root / f"save-full-{f}": _save_failing_on(bad, m, d),
            f"save/out-dir-not-a-path/{f}": lambda m=model, d=root / f"save-none-{f}": moeshard.save(
                m, None if bad else d, fsync=False
            ),
            f"relocate/old-not-the-model's/{f}": lambda m=model, o=other, p=pl: moeshard.relocate(
                m, o if bad else p, o
            ),
            f"relocate/routing-mode/{f}": lambda m=model, o=other, p=pl: moeshard.relocate(
                m, p, o, routing="bogus" if bad else "auto"
            ),
            f"relocate/topology-world/{f}": lambda m=model, o=other, p=pl: moeshard.relocate(
                m, p, o, topology=wrong_world if bad else None
            ),
            f"relocate/no-checkpoint/{f}": lambda m=model, c=ckpt, o=other, p=pl: moeshard.relocate(
                m, p, o, checkpoint=None if bad else c, from_checkpoint=True
            ),
            f"relocate/new-differs/{f}": lambda m=model, o=other, p=pl: moeshard.relocate(m, p, p if bad else o),
            # Rank BAD has nothing to move (no chunk), the others two chunks.
            f"relocate_chunks/no-chunk-on-one-rank/{f}": lambda m=model, o=other, p=pl: list(
                moeshard.relocate_chunks(m, p, p if bad else o, layers_per_chunk=1)
            ),
            f"relocate_chunks/old-missing/{f}": lambda m=model, o=other, p=pl: list(
                moeshard.relocate_chunks(m, None if bad else p, o, layers_per_chunk=1)
            ),
            f"verify/after-refused-relocations/{f}": lambda m=model, c=ckpt, p=pl: moeshard.verify(m, c, placement=p),
        }
        # LoRA: a peft model of the same family, its base and adapter loaded.
        lora = peft.get_peft_model(_hf_model(family), _lora_config())
        moeshard.parallelize(lora, mesh, pl)
        adapter = str(root / f"adapter-{f}")
        steps |= {
            f"lora.load/ok/{f}": lambda m=lora, c=ckpt, a=adapter, p=pl: mlora.load(m, c, a, placement=p),
            f"lora.load_adapter/topology-world/{f}": lambda m=lora, a=adapter, p=pl: mlora.load_adapter(
                m, a, p, topology=wrong_world if bad else None
            ),
            f"lora.load_adapter/adapter-not-visible/{f}": lambda m=lora, a=adapter, p=pl: mlora.load_adapter(
                m, a + "-nowhere" if bad else a, p, storage="shared"
            ),
            f"lora.save_adapter/out-dir-not-writable/{f}": lambda m=lora, p=pl, d=root / f"adapter-out-{f}": (
                mlora.save_adapter(m, root / "a-file" / "adapter" if bad else d, p)
            ),
            f"lora.save_adapter/out-dir-not-a-path/{f}": lambda m=lora, p=pl, d=root / f"adapter-none-{f}": (
                mlora.save_adapter(m, None if bad else d, p)
            ),
            f"lora.load_adapter/placement-not-the-model's/{f}": lambda m=lora, a=adapter, o=other, p=pl: (
                mlora.load_adapter(m, a, o if bad else p)
            ),
            f"lora.save_adapter/placement-not-the-model's/{f}": lambda m=lora, o=other, p=pl, f=f: mlora.save_adapter(
                m, root / f"adapter-pl-{f}", placement=o if bad else p
            ),
        }
        steps |= {
            f"from_pretrained/path-not-a-path/{f}": lambda c=ckpt: moeshard.from_pretrained(
                None if bad else c, ep=2, efsdp=2
            ),
            f"from_pretrained/ep-differs/{f}": lambda c=ckpt: moeshard.from_pretrained(
                c, ep=4 if bad else 2, efsdp=1 if bad else 2
            ),
            f"from_pretrained/dtype/{f}": lambda c=ckpt: moeshard.from_pretrained(
                c, ep=2, efsdp=2, dtype="int8" if bad else None
            ),
            f"from_pretrained/checkpoint-not-visible/{f}": lambda c=ckpt: moeshard.from_pretrained(
                c + "-nowhere" if bad else c, ep=2, efsdp=2, storage="shared"
            ),
            f"from_pretrained/truncated-copy/{f}": lambda c=ckpt: moeshard.from_pretrained(
                c + "-truncated" if bad else c, ep=2, efsdp=2, storage="shared", verify=True
            ),
            # Last: the group still loads, every box equal to the checkpoint's bytes.
            f"final/{f}": lambda m=model, c=ckpt, p=pl: (
                moeshard.load(m, c, placement=p),
                moeshard.verify(m, c, placement=p).num_boxes_checked,
            )[1],
        }
    return steps


def _run(names: list[str] | None, rank: int, root: Path) -> dict:
    """Every scenario (or those of ``names``) in order: ``name -> (error type or None, error
    text or result, seconds, whether the ranks then agreed on the name)``."""
    import moeshard
    from moeshard import collectives

    mesh = moeshard.make_mesh("cpu", ep=2, efsdp=2)
    out = {}
    for name, call in _scenarios(rank, root, mesh).items():
        if names is not None and name not in names and not name.startswith(("load/ok", "lora.load/ok")):
            continue
        t0 = time.monotonic()
        try:
            got = (None, call())
        except Exception as e:  # noqa: BLE001 - reported to the test
            got = (type(e).__name__, str(e))
        seconds = time.monotonic() - t0
        try:  # the group works and every rank is at this scenario
            collectives.agree(lambda: None, "still in step", fingerprint=lambda _, n=name: n)
            usable = True
        except Exception as e:  # noqa: BLE001 - reported to the test
            usable = f"{type(e).__name__}: {e}"
        out[name] = (*got, seconds, usable)
        if got[0] is None and not name.startswith(("final", "load/ok", "lora.load/ok")):
            out[name] = (None, repr(got[1])[:200], seconds, usable)
    return out


def _rank_main(rank: int, port: int, root: str, names, timeout: float, out_dir: str) -> None:
    set_rank_env(rank, WORLD, LWS, port)
    torch.set_num_threads(1)
    dist = torch.distributed
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=timeout))
    try:
        result = ("ok", _run(names, rank, Path(root)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    exit_process(0)  # no teardown: after a hang the group may be broken


def run_group(root: Path, names: list[str] | None = None, timeout: float = TIMEOUT_S) -> list[dict]:
    """Run the scenarios (or ``names``) on WORLD forked ranks whose process group times out
    after ``timeout`` seconds; every rank's results."""
    ctx = forkserver(__name__)
    out_dir = root / f"results-{time.monotonic_ns()}"
    out_dir.mkdir()
    port = free_port()
    args = (port, str(root), names, timeout, str(out_dir))
    procs = [ctx.Process(target=_rank_main, args=(r, *args), daemon=True) for r in range(WORLD)]
    alive = start_and_join(procs, 30 * timeout)
    assert not alive, f"ranks {alive} still running (a hang)"
    res = []
    for r in range(WORLD):
        with open(out_dir / f"{r}.pkl", "rb") as f:
            kind, value = pickle.load(f)
        assert kind == "ok", f"rank {r} failed outside the scenarios:\n{value}"
        res.append(value)
    return res


def write_inputs(root: Path) -> None:
    """Every family's checkpoint, a copy with every shard truncated, a peft adapter, and a file
    (``a-file``) under which no directory can be made."""
    from safetensors.torch import load_file

    for family in tiny_hf.MATRIX:
        ckpt = root / family
        tiny_hf.save_checkpoint(family, ckpt)
        shutil.copytree(ckpt, root / f"{family}-truncated")
        for shard in (root / f"{family}-truncated").glob("*.safetensors"):  # whichever rank BAD reads
            shard.write_bytes(shard.read_bytes()[:-16])
        torch.manual_seed(1)
        pm = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(tiny_hf.config(family)), _lora_config())
        with torch.no_grad():  # peft initializes B to zero: make every factor nonzero
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn_like(p) * 0.2)
        pm.save_pretrained(root / f"adapter-{family}")
        assert load_file(root / f"adapter-{family}" / "adapter_model.safetensors")
    (root / "a-file").write_text("not a directory")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-rank")
    write_inputs(root)
    return root, run_group(root)


# scenario (without the family) -> what every rank's error text contains (rank BAD's part).
EXPECT = {
    "load/placement-not-the-model's": "ValueError: moeshard.load: the placement given (phy2log [2, 10]) differs",
    "load/topology-world": "ValueError: topology has world_size 2, the process group has 4",
    "load/read-threads": "ValueError: read_threads must be >= 1, got 0",
    "load/checkpoint-not-a-path": "TypeError: expected str, bytes or os.PathLike object, not NoneType",
    "load/checkpoint-not-visible": "storage='shared' but ranks [2] cannot read the checkpoint",
    "load/truncated-copy": "CheckpointError: ",
    "load/model-shape": "checkpoint tensor 'model.embed_tokens.weight' has shape [128, 32]",
    "verify/placement-not-the-model's": "ValueError: moeshard.verify: the placement given (phy2log [2, 10]) differs",
    "verify/topology-world": "ValueError: topology has world_size 2, the process group has 4",
    "verify/truncated-copy": "CheckpointError: ",
    "save/placement-not-the-model's": "ValueError: moeshard.save: the placement given (phy2log [2, 10]) differs",
    "save/topology-world": "ValueError: topology has world_size 2, the process group has 4",
    "save/out-dir-not-writable": "save needs a directory that every rank sees",
    "save/reference-kind": "reference: ranks [0, 1, 3] passed a path, ranks [2] none or a CheckpointIndex",
    "save/write-fails": "rank 2: OSError: [Errno 28] No space left on device",
    "save/out-dir-not-a-path": "TypeError: expected str, bytes or os.PathLike object, not NoneType",
    "relocate/old-not-the-model's": "ValueError: moeshard.relocate (old): the placement given",
    "relocate/routing-mode": "ValueError: routing='bogus': expected one of ['auto', 'caller']",
    "relocate/topology-world": "ValueError: topology has world_size 2, the process group has 4",
    "relocate/no-checkpoint": "expert(s) have no live copy and no checkpoint was given",
    "relocate/new-differs": "ranks disagree on the plan fingerprint",
    "relocate_chunks/no-chunk-on-one-rank": "moeshard.relocate_chunks: planning the chunks: ranks disagree",
    "relocate_chunks/old-missing": "ValueError: relocate_chunks needs the old placement",
    "lora.load_adapter/topology-world": "ValueError: topology has world_size 2, the process group has 4",
    "lora.load_adapter/adapter-not-visible": "storage='shared' but ranks [2] cannot read the checkpoint",
    "lora.load_adapter/placement-not-the-model's": "ValueError: moeshard.lora.load_adapter: the placement given",
    "lora.save_adapter/out-dir-not-writable": "rank 2: NotADirectoryError: ",
    "lora.save_adapter/out-dir-not-a-path": "TypeError: expected str, bytes or os.PathLike object, not NoneType",
    "lora.save_adapter/placement-not-the-model's": "ValueError: moeshard.lora.save_adapter: the placement given",
    "from_pretrained/path-not-a-path": "path must be a checkpoint directory (str or os.PathLike), got None",
    "from_pretrained/ep-differs": "the ranks passed different arguments",
    "from_pretrained/dtype": "dtype must be a floating torch dtype",
    "from_pretrained/checkpoint-not-visible": "storage='shared' but ranks [2] cannot read the checkpoint",
    "from_pretrained/truncated-copy": "CheckpointError: ",
}
# Errors that compare every rank's arguments: each names the ranks with each value (rank BAD among
# them) or each rank's plan fingerprint, not one failing rank.
COMPARED = {"relocate/new-differs", "relocate_chunks/no-chunk-on-one-rank", "from_pretrained/ep-differs"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", tiny_hf.MATRIX)
@pytest.mark.parametrize("scenario", list(EXPECT))
def test_every_rank_raises_within_seconds(results, scenario, family):
    _, res = results
    name = f"{scenario}/{family}"
    for rank, r in enumerate(res):
        kind, text, seconds, usable = r[name]
        assert kind is not None, f"{name}: rank {rank} did not raise: {text}"
        assert seconds < FAIL_WITHIN_S, f"{name}: rank {rank} raised after {seconds:.1f}s: {kind}: {text}"
        assert usable is True, f"{name}: rank {rank}: the group is not usable after it: {usable}"
        assert EXPECT[scenario] in text, f"{name}: rank {rank}: {kind}: {text}"
        if scenario in COMPARED:
            assert f"[{BAD}]" in text or f"rank {BAD}: " in text, f"{name}: rank {rank}: {text}"
        elif rank != BAD or kind != "ValueError":  # (rank BAD may raise its own ValueError as it is)
            # Every rank's error names rank BAD: as the one that failed, or in what every rank found.
            named = f"rank {BAD}: " in text and "failed on 1 of 4 rank(s)" in text
            assert named or f"ranks [{BAD}]" in text, f"{name}: rank {rank}: {text}"


@pytest.mark.parametrize("family", tiny_hf.MATRIX)
def test_group_usable_and_exact_after_every_refusal(results, family):
    root, res = results
    for rank, r in enumerate(res):
        kind, boxes, seconds, usable = r[f"final/{family}"]
        assert kind is None and boxes > 0 and usable is True, (rank, kind, boxes)
        # The refused relocations left every slot as it was: the model verifies against its placement.
        kind, text, _, _ = r[f"verify/after-refused-relocations/{family}"]
        assert kind is None, f"rank {rank}: {kind}: {text}"


@pytest.mark.parametrize("family", tiny_hf.MATRIX)
def test_refused_saves_leave_nothing(results, family):
    root, _ = results
    for d in ("save-pl", "save-topo", "save-ref", "save-none", "save-full"):
        assert not (root / f"{d}-{family}").exists(), f"{d}: {list((root / f'{d}-{family}').iterdir())}"
    # The directory rank 0 writes to while rank BAD cannot: no index, shard or temporary directory.
    left = list((root / f"save-dir-{family}").glob("*")) if (root / f"save-dir-{family}").exists() else []
    assert left == [], left
    for d in ("adapter-out", "adapter-pl", "adapter-none"):
        left = list((root / f"{d}-{family}").glob("*")) if (root / f"{d}-{family}").exists() else []
        assert left == [], f"{d}: {left}"
