"""``moeshard.verify``: prove every rank holds exactly its checkpoint slices.

Each rank checks each of its local boxes against the same box read from disk (cast to the
model's dtype; a cast the cast rule refuses, such as FP8 without its scale into bf16, fails
the planning step as it does in ``load``, so no value produced by a meaningless cast is ever
declared correct). An FP8 weight with a block scale is compared dequantized: its reader reads
the scale blocks covering the box itself (:mod:`moeshard.io.fp8`), apart from load's path.
Boxes are read by the ranks the load plan makes readers (scope "job": each piece once in the
job), so a rank that cannot see the files is still checked:

* a piece its reader also needs is compared on the reader, byte for byte, on the model's
  device: no communication;
* for every other rank that needs it, the reader sends a 16-byte digest (blake2b, one per
  dtype that rank needs) point to point to exactly that rank, and the needer compares it with
  the digest of its own box. Every rank knows from the plan which digests it sends and
  receives, in which order: one ``batch_isend_irecv`` of uint8 tensors, no pickling, no
  gather. A rank receives 16 bytes per remotely-read box it holds, whatever the world size.

Catches transformers #45662 (every rank holding rank 0's experts): a wrong slot's bytes do not
match its logical expert's. A read that fails on a reader does not leave its needers waiting:
it sends all-zero digests (which the needers skip) and every rank raises after the exchange.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .. import collectives
from ..box import box_numel, box_shape, box_slices
from ..execute import exchange
from ..io.fp8 import FP8_DTYPES, dequantize, scale_box, scale_of
from ..io.index import CheckpointIndex
from ..io.reader import CheckpointReader
from ..io.sources import Storage, reader_root, resolve_sources, sources_share
from ..models.adapters import DEFAULT_SPECS, ExpertsSpec
from ..models.describe import KEEPS_PACKED, ParamDesc, keeps_packed
from ..models.layout import Need
from ..models.routing import resolve_placement
from ..placement import Placement
from ..plan import DEFAULT_STAGING_BYTES, Schedule
from ..plan.scales import scale_needs
from ..topology import Topology
from .load import checked_unused_keys, float_params, plan_load, target_device
from .report import OpReport
from .skeleton import group_topology, local_tensors, named_tensors

__all__ = ["VerifyReport", "VerificationError", "verify"]

DIGEST_BYTES = 16


class VerificationError(ValueError):
    """A local slice differs from the checkpoint."""


@dataclass(frozen=True)
class VerifyReport(OpReport):
    """This rank's checked boxes and bytes; ``unused_keys``: the checkpoint keys no parameter
    or buffer reads (as :attr:`moeshard.LoadReport.unused_keys`). ``digests_sent`` /
    ``digests_received``: 16-byte digests this rank sent to / received from other ranks (one
    per piece, needer and dtype that needer holds it in, where the needer is not the piece's
    reader); a box its own rank read is compared locally and counts in neither."""

    num_boxes_checked: int
    bytes_checked: int
    unused_keys: tuple[str, ...] = ()
    digests_sent: int = 0
    digests_received: int = 0


def _digest_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().view(-1).view(torch.uint8).cpu()
    return hashlib.blake2b(memoryview(flat.numpy()), digest_size=DIGEST_BYTES).digest()  # no copy of the bytes


def digest_hex(t: torch.Tensor) -> str:
    return _digest_bytes(t).hex()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor (a copy only where ``t`` is not contiguous)."""
    return t.contiguous().view(-1).view(torch.uint8)


def bytes_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """0-dim bool tensor on ``a``'s device (no synchronize): whether the bytes of ``a`` and ``b``
    (same shape and dtype) differ. Compared 8, 4 or 2 bytes at a time where the byte count and
    both tensors' offsets allow: torch's ``ne`` and ``any`` cost per element, so comparing
    bytes one by one took most of verify's time."""
    x, y = _as_bytes(a), _as_bytes(b)
    for wide in (torch.int64, torch.int32, torch.int16):
        n = wide.itemsize
        if x.numel() % n == 0 and x.storage_offset() % n == 0 and y.storage_offset() % n == 0:
            x, y = x.view(wide), y.view(wide)
            break
    return torch.ne(x, y).any()


@dataclass
class _Routes:
    """What one rank does in :func:`verify` (pure, from the plan).

    reads: ``(piece, this rank's need indices, ((needer, dtypes), ...))`` for each piece it
        reads, in piece order: its own needs are compared locally, each needer gets one digest
        per dtype (sorted by name).
    sends / recvs: per peer, the ``(piece, dtype)`` digests sent to / received from it, in the
        order both sides build them.
    remote: ``(piece, need index)`` of this rank's needs checked against a received digest.
    """

    reads: list = field(default_factory=list)
    sends: dict = field(default_factory=lambda: defaultdict(list))
    recvs: dict = field(default_factory=lambda: defaultdict(list))
    remote: list = field(default_factory=list)


def _routes(plan: Schedule, dtype_of: Sequence[torch.dtype], rank: int) -> _Routes:
    """This rank's reads, digests to send and receive, and remote checks (pure). ``dtype_of``:
    the model's dtype per parameter index. Needs are the schedule's delivery rows; only the
    rows of pieces this rank reads or needs are visited."""
    out = _Routes()
    readers = plan.piece_readers()
    rows = np.flatnonzero(
        (readers[plan.deliveries.piece] == rank) | (plan.deliveries.rank == rank)
    )  # sorted by (piece, rank)
    pieces, ranks = plan.deliveries.piece[rows].tolist(), plan.deliveries.rank[rows].tolist()
    for pid, grp in itertools.groupby(range(len(rows)), key=pieces.__getitem__):
        by_rank: dict[int, list[int]] = {}
        for j in grp:
            by_rank.setdefault(ranks[j], []).append(int(rows[j]))
        reader = int(readers[pid])
        if reader == rank:
            others = []
            for r, idx in by_rank.items():
                if r == rank:
                    continue
                dtypes = _dtypes(dtype_of, plan, idx)
                others.append((r, dtypes))
                out.sends[r].extend((pid, dt) for dt in dtypes)
            out.reads.append((pid, tuple(by_rank.get(rank, ())), tuple(others)))
        elif rank in by_rank:
            idx = by_rank[rank]
            out.recvs[reader].extend((pid, dt) for dt in _dtypes(dtype_of, plan, idx))
            out.remote.extend((pid, i) for i in idx)
    return out


def _dtypes(dtype_of: Sequence[torch.dtype], plan: Schedule, idx: Sequence[int]) -> tuple[torch.dtype, ...]:
    """The distinct dtypes of delivery rows ``idx``, in the order both ends of a digest use."""
    return tuple(sorted({dtype_of[int(plan.deliveries.param[i])] for i in idx}, key=str))


@dataclass(frozen=True)
class _VerifyPlan:
    """What every rank agreed on before reading: the model's descriptions, this rank's
    schedule (its needs are the delivery rows) and the unused checkpoint keys."""

    descs: list[ParamDesc]
    plan: Schedule
    unused_keys: tuple[str, ...]


class _PieceChecks:
    """Step 1 of :func:`verify` on this rank (no communication): read each of its pieces, one
    in memory at a time; compare its own boxes (:attr:`flags`: ``(need index, 0-dim bool
    tensor on the device: the box differs)``, no synchronize per box) and digest the other
    needers' boxes into :attr:`outbox` (per peer, ``uint8[digests, DIGEST_BYTES]`` in the order
    of ``routes.sends``). Errors go to :attr:`failure` (reported on every rank at the end); a
    piece that cannot be read leaves all-zero digests for its needers."""

    def __init__(
        self,
        plan: Schedule,
        index: CheckpointIndex,
        routes: _Routes,
        dtype_of: Sequence[torch.dtype],
        box: Callable[[int], torch.Tensor],
    ):
        self.plan, self.index, self.routes, self.dtype_of, self.box = plan, index, routes, dtype_of, box
        self.flags: list[tuple[int, torch.Tensor]] = []
        self.outbox = {r: np.zeros((len(v), DIGEST_BYTES), dtype=np.uint8) for r, v in routes.sends.items()}
        self.filled = dict.fromkeys(self.outbox, 0)
        self.failure: list[Exception] = []

    def read_all(self, path: str) -> None:
        try:
            with CheckpointReader(self.index, reader_root(path)) as reader:
                reader.check_keys(self.plan.piece_name(pid) for pid, _, _ in self.routes.reads)
                for pid, mine, others in self.routes.reads:
                    self.read_and_check(reader, pid, mine, others)
        except Exception as e:  # noqa: BLE001 - e.g. a file that cannot be opened; reported below
            self.failure.append(e)

    def read_and_check(self, reader: CheckpointReader, pid: int, mine: tuple[int, ...], others) -> None:
        plan, dtype_of, outbox, filled = self.plan, self.dtype_of, self.outbox, self.filled
        try:
            key, pbox = plan.piece_name(pid), plan.piece_box(pid)
            raw = deq = reader.read(key, pbox)
            quant = scale_of(self.index, key)
            wanted = {dtype_of[int(plan.deliveries.param[i])] for i in mine} | {dt for _, dts in others for dt in dts}
            if quant is not None and any(dt.itemsize > 1 for dt in wanted):
                # FP8 weights into float tensors are checked dequantized, apart from load's path.
                deq = dequantize(raw, pbox, reader.read(quant[0], scale_box(pbox, quant[1])), quant[1])
        except Exception as e:  # noqa: BLE001 - the needers still expect digests: all-zero ones
            self.failure.append(e)
            for r, dtypes in others:
                filled[r] += len(dtypes)
            return

        def as_dtype(dt: torch.dtype) -> torch.Tensor:
            return (raw if dt.itemsize == 1 else deq).to(dt)  # an FP8 tensor holds the FP8 bytes

        cast = {dt: as_dtype(dt) for dt in {dtype_of[int(plan.deliveries.param[i])] for i in mine}}
        for i in mine:
            got = self.box(i)
            want = cast[dtype_of[int(plan.deliveries.param[i])]].to(got.device)
            self.flags.append((i, bytes_differ(got, want)))
        digests: dict[torch.dtype, bytes] = {}
        for r, dtypes in others:
            for dt in dtypes:
                if dt not in digests:
                    digests[dt] = _digest_bytes(cast[dt] if dt in cast else as_dtype(dt))
                outbox[r][filled[r]] = np.frombuffer(digests[dt], dtype=np.uint8)
                filled[r] += 1


@collectives.runs_on_group
def verify(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    placement: Placement | None = None,
    storage: Storage = "auto",
    *,
    topology: Topology | None = None,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    strict: bool = True,
    group=None,
) -> VerifyReport:
    """Collective (every rank of ``group``): check every local slice of ``model`` against
    ``checkpoint``.

    ``placement``: as in :func:`moeshard.load` (None: the model's own). ``strict``: as in
    :func:`moeshard.load`, refuse a checkpoint whose unused keys say it does
    not fit the model (stray experts, layers beyond the model's); False: a warning. ``group``:
    the process group that verifies (default: the default group; as in :func:`moeshard.load`).

    Communication: a rank receives one 16-byte digest per (piece, dtype) it holds that another
    rank read, from that rank only; a piece its own rank read is checked with no communication.

    Raises:
        DistributedError: on every rank if any rank's slice differs or a read failed; each
            rank's message names the rank, parameter, physical slot and logical expert (for
            expert params), box and checkpoint key of its first mismatch. Also on every rank,
            before anything is read, for any rank's bad argument (a placement other than its
            model's, a topology of another world size), naming that rank.
    """

    def arguments() -> tuple[Placement | None, Topology, str, bool]:
        placement_, path_ = resolve_placement(model, placement, "moeshard.verify"), os.fspath(checkpoint)
        return placement_, group_topology(topology, group), path_, os.path.exists(path_)

    # One exchange: every rank's argument errors (a rank's bad argument raises on every rank,
    # before any of them waits on it), whether it sees the checkpoint and its storage arguments.
    (placement, topo, path, sees), everyone = collectives.agree_and_gather(
        arguments,
        "moeshard.verify: checking the arguments",
        share=lambda checked: sources_share(checked[3], storage, checked[1]),
    )
    rank, world_size = topo.rank, topo.world_size
    _, readers, _, index = resolve_sources(path, storage, topo, sees, everyone=everyone)
    if keeps_packed(model, specs):  # compare the stored packed bytes, not their decoded view
        index = index.without_packed(KEEPS_PACKED)

    def make_plan():
        # Every rank's needs only where FP8 scales may be consumed (the unused-key check counts
        # them); else the table this rank's plan takes.
        fp8 = bool(index.dtypes & FP8_DTYPES)
        descs, needs, plan = plan_load(
            model, index, placement, topo, readers, "job", DEFAULT_STAGING_BYTES, specs, True, rank, all_needs=fp8
        )
        scales = scale_needs(needs, index, float_params(descs)) if fp8 else None
        also = scales.table.keys if scales is not None else ()
        return _VerifyPlan(
            descs, plan, checked_unused_keys(model, descs, index, placement, strict, "moeshard.verify", also)
        )

    def fingerprint(vp: _VerifyPlan) -> str:
        # Both ends of a digest count the dtypes of its needs: ranks must agree on them too.
        dtypes = hashlib.blake2b(repr([str(d.dtype) for d in vp.descs]).encode(), digest_size=8).hexdigest()
        return f"{vp.plan.fingerprint}:{dtypes}"

    planned = collectives.agree(make_plan, "moeshard.verify: planning", fingerprint=fingerprint)
    descs, plan, unused = planned.descs, planned.plan, planned.unused_keys
    locals_ = local_tensors(named_tensors(model), descs)
    dtype_of = [d.dtype for d in descs]
    routes = _routes(plan, dtype_of, rank)

    def need(i: int) -> Need:
        return Need(*plan.delivery(i))

    device = target_device(model)
    what = "moeshard.verify"

    def box(i: int) -> torch.Tensor:
        n = need(i)
        return locals_[n.param][box_slices(n.dest)].reshape(box_shape(n.src))

    # 1. Read this rank's pieces, one in memory at a time: compare its own boxes locally (the
    # flags stay on the device: no synchronize per box), digest the boxes of the other needers.
    pieces = _PieceChecks(plan, index, routes, dtype_of, box)
    if routes.reads:
        pieces.read_all(path)
    flags, outbox, failure = pieces.flags, pieces.outbox, pieces.failure

    # 2. Digests point to point: each reader to exactly the ranks that need its pieces.
    own, got = _exchange_digests(routes, outbox, box, device, failure)

    def check() -> VerifyReport:
        if failure:
            raise failure[0]
        bad = []
        if flags:
            differs = torch.stack([f for _, f in flags]).cpu().tolist()
            bad += [i for (i, _), d in zip(flags, differs) if d]
        unread = bytes(DIGEST_BYTES)  # a reader that failed sent this and reports its error
        for pid, i in routes.remote:
            want = got[(pid, dtype_of[int(plan.deliveries.param[i])])]
            if want != unread and own[i] != want:
                bad.append(i)
        if bad:
            raise VerificationError(_mismatch(plan, descs, placement, rank, min(bad)))
        checked = [i for i, _ in flags] + [i for _, i in routes.remote]
        nbytes = sum(box_numel(need(i).src) * locals_[int(plan.deliveries.param[i])].element_size() for i in checked)
        return VerifyReport(
            rank=rank,
            world_size=world_size,
            num_boxes_checked=len(checked),
            bytes_checked=nbytes,
            fingerprint=plan.fingerprint,
            unused_keys=unused,
            digests_sent=sum(len(v) for v in outbox.values()),
            digests_received=sum(len(v) for v in routes.recvs.values()),
        )

    return collectives.agree(check, what)


def _exchange_digests(
    routes: _Routes,
    outbox: dict[int, np.ndarray],
    box: Callable[[int], torch.Tensor],
    device: torch.device,
    failure: list[Exception],
) -> tuple[dict[int, bytes], dict[tuple[int, torch.dtype], bytes]]:
    """Collective (every rank of the verification): send each rank the digests in ``outbox``
    and receive those ``routes.recvs`` names; while they fly, digest this rank's own box of
    each remote need (an error doing so goes to ``failure``, reported by the caller's
    agreement). ``(own, got)``: need index -> digest of this rank's box, and (piece, dtype) ->
    the digest its reader sent."""
    inbox = {
        r: torch.empty(len(routes.recvs[r]) * DIGEST_BYTES, dtype=torch.uint8, device=device)
        for r in sorted(routes.recvs)
    }
    wait = exchange(
        {r: torch.from_numpy(outbox[r]).view(-1).to(device) for r in sorted(outbox)},
        inbox,
        "moeshard.verify: exchanging digests",
    )
    own: dict[int, bytes] = {}  # need index -> digest of this rank's box, while digests fly
    try:
        for _, i in routes.remote:
            own[i] = _digest_bytes(box(i))
    except Exception as e:  # noqa: BLE001 - reported by the caller
        failure.append(e)
    wait()
    got: dict[tuple[int, torch.dtype], bytes] = {}
    for r, buf in inbox.items():
        rows = buf.cpu().numpy().reshape(-1, DIGEST_BYTES)
        got.update((key, rows[k].tobytes()) for k, key in enumerate(routes.recvs[r]))
    return own, got


def _mismatch(plan: Schedule, descs, placement: Placement | None, rank: int, i: int) -> str:
    """The message for need ``i`` of ``rank`` whose box differs from the checkpoint."""
    n = Need(*plan.delivery(i))
    d = descs[n.param]
    where = f"box {list(n.dest)} of its local tensor"
    expert = ""
    if d.expert is not None:
        slot = n.dest[0][0] + _slot_origin(d, rank)
        logical = placement.phy2log[d.expert.layer, slot] if placement is not None else slot
        expert = f", physical slot {slot} = logical expert {int(logical)}"
    return (
        f"rank {rank}: parameter {d.name}{expert}: {where} differs from checkpoint tensor {n.key!r} box {list(n.src)}"
    )


def _slot_origin(d, rank: int) -> int:
    """Global slot offset of this rank's local expert tensor."""
    if d.mesh is None:
        return 0
    from ..models.shards import local_boxes

    boxes = local_boxes(d.shape, d.mesh.shape, d.placements)
    flat = d.mesh.reshape(-1).tolist()
    return boxes[flat.index(rank)][0][0]
