"""``moeshard.verify``: prove every rank holds exactly its checkpoint slices.

Each rank checks each of its local boxes against a digest of the same box read from disk
(cast to the model's dtype). Digests of boxes are computed by the ranks the load plan makes
readers (so a rank that cannot see the files is still checked) and exchanged as small
digests, never as tensors: no gather of weights. Catches transformers #45662 (every rank
holding rank 0's experts): a wrong slot's bytes do not match its logical expert's digest.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from . import _dist
from .adapters import DEFAULT_SPECS, ExpertsSpec
from .box import box_shape, box_slices
from .checkpoint import CheckpointReader
from .layout import local_tensor
from .load import Storage, plan_load, reader_root, resolve_sources
from .placement import Placement
from .topology import Topology

__all__ = ["VerifyReport", "VerificationError", "verify"]


class VerificationError(ValueError):
    """A local slice differs from the checkpoint."""


@dataclass(frozen=True)
class VerifyReport:
    rank: int
    num_boxes_checked: int
    bytes_checked: int


def _digest(t: torch.Tensor) -> str:
    flat = t.detach().contiguous().view(-1).view(torch.uint8).cpu()
    return hashlib.blake2b(flat.numpy().tobytes(), digest_size=16).hexdigest()


def verify(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    placement: Placement | None = None,
    storage: Storage = "auto",
    *,
    topology: Topology | None = None,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
) -> VerifyReport:
    """Collective (every rank): check every local slice of ``model`` against ``checkpoint``.

    Raises:
        DistributedError: on every rank if any rank's slice differs; each rank's message names
            the rank, parameter, logical expert (for expert params) and box of its first mismatch.
    """
    topo = topology or Topology.from_env()
    rank = _dist.rank_and_world()[0]
    topo = topo.with_rank(rank)
    path = os.fspath(checkpoint)
    _, readers, _, index = resolve_sources(path, storage, topo, os.path.exists(path))
    descs, plan = _dist.agree(lambda: plan_load(model, index, placement, topo, readers, "job", specs=specs),
                              "moeshard.verify: planning", fingerprint=lambda dp: dp[1].fingerprint)

    # Digests of the pieces this rank reads (for every needer's dtype).
    mine = list(plan.local_reads[rank]) + [p for c in plan.chunks for r, p in c.reads if r == rank]

    def read_digests() -> dict:
        out = {}
        if not mine:
            return out
        with CheckpointReader(index, reader_root(path)) as reader:
            for pid in mine:
                piece = plan.pieces[pid]
                raw = reader.read(piece.key, piece.src)
                for dtype in {descs[plan.needs[i].param].dtype for _, idx in piece.needs for i in idx}:
                    out[(pid, str(dtype))] = _digest(raw.to(dtype))
        return out

    digests: dict = {}
    for part in _dist.all_gather_object(_dist.agree(read_digests, "moeshard.verify: reading")):
        digests.update(part)

    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers())
    locals_ = [local_tensor(tensors[d.name]) for d in descs]

    def check() -> VerifyReport:
        count = nbytes = 0
        for pid, piece in enumerate(plan.pieces):
            for r, idx in piece.needs:
                if r != rank:
                    continue
                for i in idx:
                    n = plan.needs[i]
                    d = descs[n.param]
                    got = locals_[n.param][box_slices(n.dest)].reshape(box_shape(piece.src))
                    if _digest(got) != digests[(pid, str(d.dtype))]:
                        where = f"box {list(n.dest)} of its local tensor"
                        expert = ""
                        if d.expert is not None:
                            slot = n.dest[0][0] + _slot_origin(d, rank)
                            logical = placement.phy2log[d.expert.layer, slot] if placement is not None else slot
                            expert = f", physical slot {slot} = logical expert {int(logical)}"
                        raise VerificationError(
                            f"rank {rank}: parameter {d.name}{expert}: {where} differs from checkpoint "
                            f"tensor {n.key!r} box {list(n.src)}"
                        )
                    count += 1
                    nbytes += got.numel() * got.element_size()
        return VerifyReport(rank, count, nbytes)

    return _dist.agree(check, "moeshard.verify")


def _slot_origin(d, rank: int) -> int:
    """Global slot offset of this rank's local expert tensor."""
    if d.mesh is None:
        return 0
    from .layout import _local_boxes

    boxes = _local_boxes(d.shape, d.mesh.shape, d.placements)
    flat = d.mesh.reshape(-1).tolist()
    return boxes[flat.index(rank)][0][0]
