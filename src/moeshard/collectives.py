"""torch.distributed helpers that never leave a rank hanging on another rank's error.

Pattern: every rank runs a step, catches its own exception, and all ranks exchange
(error, fingerprint) before anything else moves. If any rank failed, every rank raises one
:class:`DistributedError` that lists each failing rank's message; if fingerprints differ, the
ranks disagree about the plan and every rank raises. All functions here are collective: every
rank of ``group`` must call them, in the same order. Without an initialized process group
they run locally.

Groups. A moeshard operation runs on one process group (the default group, the survivors of a
lost rank, an EP group inside a larger job): it enters :func:`scope` with it, and every helper
here that is given no ``group`` uses that one. Ranks are the group's ranks throughout (plans,
messages, ``src``); :func:`p2p` and the broadcasts translate them to the global ranks that
torch.distributed's P2P ops and ``src`` arguments take.

A rank that dies (killed, out of memory, its node lost) cannot report anything: its peers see
the communication backend fail instead (gloo: "Connection closed by peer", NCCL: an aborted
communicator). Every torch.distributed call of moeshard runs inside :func:`collective`, which
turns that failure into :class:`PeerLostError` naming the moeshard operation and, where
known, the peers it was talking to.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import pickle
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["DistributedError", "PlanMismatchError", "PeerLostError", "is_dist", "rank_and_world", "agree",
           "agree_and_gather", "Gathered", "unanimous", "broadcast_result", "all_gather_object", "broadcast_object",
           "barrier", "collective", "errors_as", "start_p2p", "scope", "runs_on_group", "p2p", "global_rank",
           "group_ranks", "all_reduce_max"]

T = TypeVar("T")

# The process group of the moeshard operation running in this context (None: the default group).
_GROUP: contextvars.ContextVar = contextvars.ContextVar("moeshard_group", default=None)


@contextlib.contextmanager
def scope(group) -> Iterator[None]:
    """Run the block on process ``group`` (None: the default group): the helpers of this module
    called with no ``group`` use it, and ranks are its ranks.

    Raises:
        ValueError: this process is not a member of ``group``.
    """
    if group is not None and is_dist() and dist.get_rank(group) < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the group passed as group=; "
                         "only the group's members call a moeshard operation on it")
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def runs_on_group(fn: Callable[..., T]) -> Callable[..., T]:
    """Decorate a collective operation with a keyword-only ``group`` argument: it runs in
    :func:`scope` of that group (and still receives ``group``)."""
    @functools.wraps(fn)
    def run(*args, group=None, **kwargs):
        with scope(group):
            return fn(*args, group=group, **kwargs)
    return run


def _g(group):
    return group if group is not None else _GROUP.get()


def group_ranks(group=None) -> list[int] | None:
    """Global rank of every rank of ``group`` (default: the current one), or None when it is
    the default group (group rank = global rank)."""
    group = _g(group)
    if group is None or not is_dist() or group is dist.group.WORLD:
        return None
    ranks = dist.get_process_group_ranks(group)
    return None if ranks == list(range(dist.get_world_size())) else ranks


def global_rank(rank: int, group=None) -> int:
    """The global rank of ``group``'s rank ``rank`` (default: the current group)."""
    group = _g(group)
    return rank if group is None or not is_dist() else dist.get_global_rank(group, rank)


def p2p(op: Callable, tensor: torch.Tensor, peer: int, members: list[int] | None = None) -> dist.P2POp:
    """A ``torch.distributed.P2POp`` with ``peer``, a rank of the current group (``members``:
    :func:`group_ranks`, looked up once by callers that build many ops)."""
    group = _GROUP.get()
    if group is None:
        return dist.P2POp(op, tensor, peer)
    return dist.P2POp(op, tensor, members[peer] if members is not None else global_rank(peer), group=group)


class DistributedError(RuntimeError):
    """Raised on every rank when any rank failed a collective step."""


class PlanMismatchError(DistributedError):
    """Raised on every rank by :func:`agree` when the ranks' fingerprints differ (each rank
    planned from other inputs: another placement, model or checkpoint index)."""


class PeerLostError(DistributedError):
    """The communication backend failed during a moeshard operation: a peer rank died or the
    network failed. Raised on each rank that saw the failure (a rank cannot tell its peers
    after the group broke); ``__cause__`` is the backend's own exception.

    Attributes:
        operation: the moeshard step, e.g. ``"moeshard.load: executing the plan"``.
        peers: the ranks the failed step talked to (the lost one is among them); empty when
            the step was a collective of the whole group (the backend does not say which
            rank it lost).
    """

    def __init__(self, message: str, operation: str = "", peers: Iterable[int] = ()):
        super().__init__(message)
        self.operation = operation
        self.peers = tuple(peers)

    def __reduce__(self):
        return type(self), (str(self), self.operation, self.peers)


# What a user does about a lost peer (part of every PeerLostError's text).
_NEXT_STEP = ("a rank of the job died or the network failed; restart the job, or recover with the survivors "
              "(a new process group of the live ranks, then moeshard.relocate with active_ranks or load again)")


@contextlib.contextmanager
def collective(what: str, peers: Iterable[int] | None = None) -> Iterator[None]:
    """Run torch.distributed calls (and waits on their work handles) of step ``what``;
    a failure of the backend becomes :class:`PeerLostError` chained to it.

    Wrap only communication: a RuntimeError raised inside comes from the process group
    (torch.distributed.DistBackendError is one), not from the user's input, which goes
    through :func:`agree` instead. ``peers``: the ranks the calls talk to, if not the whole
    group (named in the message).
    """
    try:
        yield
    except DistributedError:
        raise
    except RuntimeError as e:
        ranks = sorted(set(peers or ()))
        raise PeerLostError(_lost_message(what, e, ranks), what, ranks) from e


@contextlib.contextmanager
def errors_as(cls: type[DistributedError]) -> Iterator[None]:
    """Re-raise a DistributedError from the block as ``cls`` (an operation's own error type,
    e.g. SaveError), with the same text. A :class:`PeerLostError` stays as it is: it is not
    the operation's input that failed, and its ``__cause__`` is the backend's error."""
    try:
        yield
    except (PeerLostError, cls):
        raise
    except DistributedError as e:
        raise cls(str(e)) from None


def _lost_message(what: str, error: BaseException, ranks: list[int]) -> str:
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"one of ranks {ranks}" if ranks else "a peer"
    said = str(error).strip().splitlines()[0] if str(error).strip() else ""
    # gloo's: "[.../pair.cc:553] Connection closed by peer [addr]:port. This is typically ...":
    # the first sentence without its source location (the whole text is the __cause__).
    said = re.sub(r"^\[[^\]]*:\d+\]\s*", "", said).split(". ")[0]
    said = said if len(said) <= 300 else said[:300] + "..."
    return f"{what}: lost contact with {who} ({type(error).__name__}: {said}): {_NEXT_STEP}"


def start_p2p(ops: list, what: str) -> Callable[[], None]:
    """Post ``ops`` (``torch.distributed.P2POp``) as one batch; return a function that waits
    for all of them. Only the ops' peers take part (each must post the matching ops); a
    backend failure in posting or waiting raises :class:`PeerLostError` naming them."""
    members = group_ranks()
    of = None if members is None else {g: r for r, g in enumerate(members)}
    peers = sorted({op.peer if of is None else of[op.peer] for op in ops})  # named in group ranks
    with collective(what, peers):
        works = dist.batch_isend_irecv(ops) if ops else []

    def wait() -> None:
        with collective(what, peers):
            for w in works:
                w.wait()

    return wait


def barrier(what: str, group=None) -> None:
    """Collective: ``torch.distributed.barrier`` (nothing without a process group)."""
    if is_dist():
        with collective(what):
            dist.barrier(group=_g(group))


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(group=None) -> tuple[int, int]:
    """This process's rank in ``group`` (default: the current group) and its size."""
    if not is_dist():
        return 0, 1
    group = _g(group)
    return dist.get_rank(group), dist.get_world_size(group)


def all_gather_object(obj: Any, group=None, what: str = "moeshard: exchanging objects") -> list[Any]:
    """Collective: every rank's ``obj`` (a list indexed by group rank). ``what`` names the
    step in a :class:`PeerLostError`."""
    if not is_dist():
        return [obj]
    group = _g(group)
    out: list[Any] = [None] * dist.get_world_size(group)
    with collective(what):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group=None, what: str = "moeshard: broadcasting an object") -> Any:
    """Collective: ``obj`` of rank ``src`` (a rank of ``group``, default: the current group) on
    every rank. ``what`` names the step in a :class:`PeerLostError`."""
    if not is_dist():
        return obj
    group = _g(group)
    box = [obj]
    with collective(what):
        dist.broadcast_object_list(box, src=global_rank(src, group), group=group)
    return box[0]


def agree(step: Callable[[], T], what: str, fingerprint: Callable[[T], str] | None = None, group=None) -> T:
    """Collective: run ``step`` on every rank; raise on every rank if any rank failed or if
    ``fingerprint(result)`` differs between ranks.

    Raises:
        ValueError: this rank's own error when no process group is initialized.
        DistributedError: on every rank, naming each failing rank and its message.
        PeerLostError: on the ranks that saw a peer die, in ``step`` or in the exchange.
    """
    return _agree(step, what, fingerprint, None, group)[0]


class Gathered(NamedTuple):
    """What :func:`agree_and_gather` returns: this rank's ``result`` and every rank's
    ``shares`` (a list indexed by group rank)."""

    result: Any
    shares: list[Any]


def agree_and_gather(step: Callable[[], T], what: str, share: Callable[[T], Any], group=None) -> Gathered:
    """Collective: :func:`agree` on ``step``, and every rank's ``share(result)`` on every rank,
    in the same exchange: one all-gather where :func:`agree` then :func:`all_gather_object`
    take two."""
    return Gathered(*_agree(step, what, None, share, group))


def unanimous(step: Callable[[], T], what: str, group=None) -> T:
    """Run ``step``, a pure function of data every rank of ``group`` holds alike (gathered in an
    earlier exchange), with no exchange: every rank gets the same result or the same error, which
    is raised as the :class:`DistributedError` :func:`agree` would raise when every rank fails.

    Raises:
        ValueError: the step's own error when no process group is initialized.
    """
    try:
        return step()
    except Exception as e:
        if not is_dist():
            raise
        world = dist.get_world_size(_g(group))
        error = _failure(what, [(r, f"{type(e).__name__}: {e}") for r in range(min(world, 4))], world, world)
        more = f"\n  (and the other {world - 4} ranks alike)" if world > 4 else ""
        raise DistributedError(f"{error}{more}") from None


def broadcast_result(step: Callable[[], T], src: int, what: str) -> T:
    """Collective: run ``step`` on rank ``src`` only and return its result on every rank; if it
    raised, every rank raises the :class:`DistributedError` :func:`agree` would raise (naming
    rank ``src``). One broadcast where :func:`agree` then :func:`broadcast_object` take two
    exchanges."""
    if not is_dist():
        return step()
    payload: tuple[str | None, Any] = (None, None)
    if rank_and_world()[0] == src:
        try:
            payload = (None, step())
        except PeerLostError:
            raise  # the group is broken: no exchange can follow
        except Exception as e:  # noqa: BLE001 - every error must reach the other ranks
            payload = (f"{type(e).__name__}: {e}", None)
    error, result = broadcast_object(payload, src=src, what=what)
    if error is not None:
        raise DistributedError(_failure(what, [(src, error)], 1, rank_and_world()[1]))
    return result


# Bytes of a rank's share that travel inside agree_and_gather's one exchange; a larger share
# takes a second all-gather of just the shares (load's storage arguments take ~80).
_INLINE_SHARE = 248
# Digest words are 62-bit, so that their negations fit int64 (see _agree).
_WORD = (1 << 62) - 1


def _agree(step: Callable[[], T], what: str, fingerprint: Callable[[T], str] | None, share: Callable[[T], Any] | None,
           group) -> tuple[T, list[Any]]:
    """:func:`agree` (and :func:`agree_and_gather`): ``(result, every rank's share(result))``.

    The usual path (no error, one plan) is one collective over a few integers, whatever the
    world size: :func:`agree` all-reduces ``max`` of ``[failed, w0, w1, -w0, -w1]`` (``w``: the
    fingerprint digest's words), so every rank learns whether any rank failed and whether the
    digests are all equal (``max(w) == min(w)``, with ``min(w) = -max(-w)``) without holding
    every rank's digest; :func:`agree_and_gather` all-gathers ``[failed, digest, share size,
    share bytes]`` in one fixed-size buffer (a second all-gather only for a share over
    ``_INLINE_SHARE`` bytes). An object all-gather would cost two collectives and pickling on
    every rank. Error texts and whole fingerprints are gathered only when some rank failed or
    the digests differ, to name them."""
    result: Any = None
    error: str | None = None
    try:
        result = step()
    except PeerLostError:
        raise  # the group is broken: no exchange can follow
    except Exception as e:
        if not is_dist():
            raise
        error = f"{type(e).__name__}: {e}"
    if not is_dist():
        return result, [share(result)] if share is not None else []
    group = _g(group)
    fp = fingerprint(result) if (fingerprint is not None and error is None) else None
    digest = hashlib.blake2b((fp or "").encode(), digest_size=16).digest()
    w0, w1 = (int.from_bytes(digest[i:i + 8], "little") & _WORD for i in (0, 8))
    if share is None:
        top = _all_reduce_max(torch.tensor([int(error is not None), w0, w1, -w0, -w1], dtype=torch.int64), group,
                              what).tolist()
        failed, same = bool(top[0]), top[1] == -top[3] and top[2] == -top[4]
        shares: list[Any] = []
    else:
        mine = pickle.dumps(share(result)) if error is None else b""
        head = torch.tensor([int(error is not None), w0, w1, len(mine)], dtype=torch.int64).view(torch.uint8)
        n = len(head)
        buf = torch.zeros(n + _INLINE_SHARE, dtype=torch.uint8)
        buf[:n] = head
        if 0 < len(mine) <= _INLINE_SHARE:
            buf[n:n + len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        rows = _all_gather_tensor(buf, group, what)
        heads = [r[:n].view(torch.int64).tolist() for r in rows]
        failed, same = any(h[0] for h in heads), len({(h[1], h[2]) for h in heads}) == 1
        shares = [r[n:] for r in rows]
    if failed:
        errors = all_gather_object(error, group=group, what=what)
        bad = [(r, err) for r, err in enumerate(errors) if err is not None]
        raise DistributedError(_failure(what, bad, len(bad), len(errors)))
    if not same:
        fps = all_gather_object(fp, group=group, what=what)
        by = ", ".join(f"rank {r}: {f}" for r, f in enumerate(fps))
        raise PlanMismatchError(f"{what}: ranks disagree on the plan fingerprint ({by}); "
                               "every rank must build the same model, placement and checkpoint index")
    if share is None:
        return result, []
    sizes = [h[3] for h in heads]
    if max(sizes) > _INLINE_SHARE:  # some share did not fit: every rank's share, padded to the largest
        big = torch.zeros(max(sizes), dtype=torch.uint8)
        if mine:
            big[:len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        shares = _all_gather_tensor(big, group, what)
    return result, [pickle.loads(t[:n].numpy().tobytes()) for t, n in zip(shares, sizes)]


def _failure(what: str, shown: list[tuple[int, str]], failed: int, world: int) -> str:
    """The text of a step that failed on ``failed`` of ``world`` ranks, one line per ``(rank,
    error)`` of ``shown``: the one spelling every rank's error takes."""
    lines = "\n".join(f"  rank {r}: {err}" for r, err in shown)
    return f"{what} failed on {failed} of {world} rank(s):\n{lines}"


def _all_gather_tensor(t: torch.Tensor, group, what: str) -> list[torch.Tensor]:
    """Collective: every rank's ``t`` (same shape on every rank; a CPU tensor), as CPU tensors,
    gathered on the device the backend's object collectives use (CUDA under NCCL)."""
    group = _g(group)
    x = t.to(_collective_device(group))
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    with collective(what):
        dist.all_gather(out, x, group=group)
    return [o.cpu() for o in out]


def all_reduce_max(a: np.ndarray, what: str, group=None) -> np.ndarray:
    """Collective (every rank of ``group``): the elementwise maximum of every rank's int64
    array ``a`` (same shape on every rank)."""
    return _all_reduce_max(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)), group, what).numpy()


def _all_reduce_max(t: torch.Tensor, group, what: str) -> torch.Tensor:
    """Collective: the elementwise maximum of every rank's ``t`` (a CPU tensor), as a CPU
    tensor, reduced on the device the backend's object collectives use (CUDA under NCCL)."""
    group = _g(group)
    x = t.to(_collective_device(group))
    with collective(what):
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x.cpu()


def _collective_device(group) -> torch.device:
    """The device of the tensors :func:`_all_gather_tensor` and :func:`_all_reduce_max` exchange."""
    kind = _object_device(group)
    return torch.device(kind) if kind == "cpu" else torch.device(kind, getattr(torch, kind).current_device())


def _object_device(group) -> str:
    """The device type torch.distributed uses for ``group``'s object collectives."""
    pick = getattr(dist.distributed_c10d, "_get_object_coll_device", None)
    if pick is not None:
        return pick(group)
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"
