"""Tier 2: a rank dies (SIGKILL) in the middle of a moeshard operation.

Every survivor must raise moeshard.PeerLostError (a DistributedError) within seconds, naming
the operation, chained (``__cause__``) to the backend's own error; nothing hangs until a
collective timeout. One 4-rank gloo group (2 nodes x 2) per scenario, since a dead rank breaks
its group: rank 3 kills itself as it enters a step, the survivors record what they raised and
exit at once (as a crashing job does), which is also what unblocks survivors waiting on them.

Ranks are forked from a forkserver that has imported torch and moeshard once, so a group
starts in about a second instead of one torch import per rank.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pickle
import signal
import time

import pytest
import torch

import moeshard
import tiny_moe
from moeshard import collectives
from moeshard._launch import free_port
from mp import forkserver, set_rank_env, start_and_join

WORLD, LWS, VICTIM = 4, 2, 3
# The backend's timeout is a backstop only: survivors must fail long before it (the load of a
# 2-core test machine can still delay a healthy collective by seconds, hence not smaller).
BACKSTOP_S = 60
FAIL_WITHIN_S = 20


# -- tier 1: the wrapper itself --------------------------------------------------------------


def test_collective_converts_backend_errors_only():
    backend = RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.7]:4242\nmore")
    with pytest.raises(moeshard.PeerLostError) as info:
        with collectives.collective("moeshard.load: executing the plan", peers=[3, 1, 3]):
            raise backend
    e = info.value
    assert isinstance(e, moeshard.DistributedError) and e.__cause__ is backend
    assert e.operation == "moeshard.load: executing the plan" and e.peers == (1, 3)
    assert str(e).startswith(
        "moeshard.load: executing the plan: lost contact with one of ranks [1, 3] "
        "(RuntimeError: Connection closed by peer [10.0.0.7]:4242)"
    )
    assert "restart the job, or recover with the survivors" in str(e)
    with pytest.raises(moeshard.PeerLostError, match=r"^moeshard\.save: x: lost contact with a peer"):
        with collectives.collective("moeshard.save: x"):
            raise torch.distributed.DistBackendError("NCCL communicator was aborted")
    # Not the backend's: unchanged.
    for err in (ValueError("bad input"), moeshard.DistributedError("rank 2: ValueError: bad input")):
        with pytest.raises(type(err)) as info:
            with collectives.collective("moeshard.load: planning", peers=[1]):
                raise err
        assert info.value is err
    # One peer, and the error survives pickling (ranks report errors to launchers).
    with pytest.raises(moeshard.PeerLostError, match="lost contact with rank 2 ") as info:
        with collectives.collective("op", peers=[2]):
            raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")
    again = pickle.loads(pickle.dumps(info.value))
    assert (type(again), str(again), again.peers, again.operation) == (
        moeshard.PeerLostError,
        str(info.value),
        (2,),
        "op",
    )


def test_operation_errors_keep_a_lost_peer():
    lost = moeshard.PeerLostError("op: lost contact with a peer", "op")
    with pytest.raises(moeshard.PeerLostError) as info:
        with collectives.errors_as(moeshard.SaveError):
            raise lost
    assert info.value is lost
    with pytest.raises(moeshard.SaveError, match="rank 1: ValueError: x"):
        with collectives.errors_as(moeshard.SaveError):
            raise moeshard.DistributedError("rank 1: ValueError: x")


# -- tier 2: a rank dies -----------------------------------------------------------------------


def _model():
    mesh = moeshard.make_mesh("cpu", ep=2, efsdp=2)
    pl = moeshard.Placement.contiguous(2, tiny_moe.NUM_EXPERTS, 2, num_redundant=2)
    with torch.device("meta"):
        model = tiny_moe.TinyMoE()
    moeshard.parallelize(model, mesh, pl)
    return model, pl


def _steps(model, pl, root: str) -> dict:
    """Scenario -> (module, attribute the victim dies entering, the operation every rank runs)."""
    ckpt = os.path.join(root, "ckpt")
    new = tiny_moe.shuffled_placement(2, tiny_moe.NUM_EXPERTS, 2, pl.num_physical, seed=3)
    module = importlib.import_module  # moeshard.load etc. are also the package's functions
    return {
        "load-enter": (moeshard, "load", lambda: moeshard.load(model, ckpt, placement=pl)),
        # storage="single": rank 0 reads everything and sends to the others, the victim too.
        "load-execute": (
            module("moeshard.ops.load"),
            "execute_schedule",
            lambda: moeshard.load(model, ckpt, placement=pl, storage="single"),
        ),
        # The planning agreement (an all-reduce; load's last collective is the execution's).
        "load-agree": (collectives, "_all_reduce_max", lambda: moeshard.load(model, ckpt, placement=pl)),
        "relocate": (module("moeshard.ops.relocate"), "execute_schedule", lambda: moeshard.relocate(model, pl, new)),
        "save": (
            module("moeshard.ops.save"),
            "_write_shards",
            lambda: moeshard.save(model, os.path.join(root, "out"), placement=pl, fsync=False),
        ),
    }


def _scenario(name: str, rank: int, root: str, patch) -> tuple | None:
    """Set up, make the victim die entering the step, run the operation; returns what it raised."""
    model, pl = _model()
    if name in ("relocate", "save"):
        moeshard.load(model, os.path.join(root, "ckpt"), placement=pl)
    owner, attribute, run = _steps(model, pl, root)[name]
    if rank == VICTIM:
        patch.setattr(owner, attribute, lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL))
    t0 = time.monotonic()
    try:
        run()
    except Exception as e:  # noqa: BLE001 - reported to the test
        cause = e.__cause__
        return (
            type(e).__name__,
            isinstance(e, moeshard.DistributedError),
            str(e),
            getattr(e, "peers", None),
            type(cause).__name__ if cause else None,
            str(cause) if cause else None,
            time.monotonic() - t0,
        )
    return None


def _rank_main(name: str, rank: int, port: int, root: str, out_dir: str) -> None:
    set_rank_env(rank, WORLD, LWS, port)
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=BACKSTOP_S)
    )
    patch = pytest.MonkeyPatch()
    try:
        result = ("ok", _scenario(name, rank, root, patch))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # Exit at once, as a crashing job does: no barrier or group teardown with a dead peer.
    os._exit(0)


_FORKSERVER = None


def _context():
    """A forkserver context whose server has imported mp.PRELOAD (torch, moeshard, ...) and this module."""
    global _FORKSERVER
    if _FORKSERVER is None:
        _FORKSERVER = forkserver(__name__)
    return _FORKSERVER


def _run_group(name: str, root: str, out_dir: str, timeout: float = 3 * BACKSTOP_S) -> list:
    """Run scenario ``name`` on WORLD forked ranks; every survivor's result (the victim's: None)."""
    ctx = _context()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(name, r, port, root, out_dir), daemon=True) for r in range(WORLD)]
    alive = start_and_join(procs, timeout)
    assert not alive, f"{name}: ranks {alive} still running after {timeout}s (a hang)"
    assert procs[VICTIM].exitcode == -signal.SIGKILL, f"{name}: the victim exited with {procs[VICTIM].exitcode}"
    out = []
    for r in range(WORLD):
        if r == VICTIM:
            out.append(None)
            continue
        with open(os.path.join(out_dir, f"{r}.pkl"), "rb") as f:
            kind, value = pickle.load(f)
        assert kind == "ok", f"{name}: rank {r} failed outside the operation:\n{value}"
        out.append(value)
    return out


SCENARIOS = {
    # scenario: what every survivor's error text starts with
    "load-enter": "moeshard.load: checking the arguments and materializing the model: lost contact with a peer",
    "load-execute": "moeshard.load: executing the plan: lost contact with ",
    "load-agree": "moeshard.load: planning: lost contact with a peer",
    "relocate": "moeshard.relocate: running the plan: lost contact with ",
    "save": "moeshard.save: ",
}


@pytest.fixture(scope="module")
def lost(tmp_path_factory):
    root = tmp_path_factory.mktemp("lost")
    tiny_moe.write(str(root / "ckpt"))
    results = {}
    for name in SCENARIOS:
        out_dir = root / f"results-{name}"
        out_dir.mkdir()
        results[name] = _run_group(name, str(root), str(out_dir))
    return root, results


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_survivors_raise_peer_lost(lost, name):
    _, results = lost
    for rank, got in enumerate(results[name]):
        if rank == VICTIM:
            continue
        assert got is not None, f"{name}: rank {rank} did not raise"
        kind, is_dist_error, text, peers, cause, cause_text, seconds = got
        assert kind == "PeerLostError" and is_dist_error, f"{name}: rank {rank} raised {kind}: {text}"
        assert text.startswith(SCENARIOS[name]), f"{name}: rank {rank}: {text}"
        assert "a rank of the job died or the network failed; restart the job" in text
        # Chained to the backend's own error (gloo: a RuntimeError about the closed connection).
        assert cause == "RuntimeError" and cause_text, f"{name}: rank {rank}: cause {cause}: {cause_text}"
        assert seconds < FAIL_WITHIN_S, f"{name}: rank {rank} raised after {seconds:.1f}s"


@pytest.mark.dist
def test_peer_named_when_known(lost):
    _, results = lost
    # Rank 0 (the only reader with storage="single") sends to the victim in a P2P batch.
    named = [r for r, got in enumerate(results["load-execute"]) if got and VICTIM in (got[3] or ())]
    assert named, results["load-execute"]


@pytest.mark.dist
def test_save_publishes_nothing_after_a_lost_rank(lost):
    root, _ = lost
    # Each survivor removed the shard files it had created; no index was published.
    assert not (root / "out" / "model.safetensors.index.json").exists()
    assert not list((root / "out").rglob("*.safetensors"))


def test_ep_all_to_all_raises_peer_lost(monkeypatch):
    """The EP forward's and backward's all-to-alls (training, not a moeshard operation) turn a
    backend failure into PeerLostError like every other collective."""
    from moeshard.models import ep

    def closed(*args, **kwargs):
        raise RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.7]:4242")

    x = torch.ones(3, 2, requires_grad=True)
    # A working exchange (one rank: rows stay), then the backward's exchange fails.
    monkeypatch.setattr(ep.dist, "all_to_all_single", lambda out, inp, *a, **k: out.copy_(inp))
    y = ep._AllToAll.apply(x, [3], [3], None)
    monkeypatch.setattr(ep.dist, "all_to_all_single", closed)
    with pytest.raises(
        moeshard.PeerLostError,
        match=r"^moeshard EP backward: exchanging gradients \(all-to-all\): "
        r"lost contact with a peer \(RuntimeError: Connection closed by peer",
    ) as info:
        y.sum().backward()
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(moeshard.PeerLostError, match=r"^moeshard EP forward: exchanging tokens \(all-to-all\)"):
        ep._AllToAll.apply(x, [3], [3], None)
