"""The parts every operation of :mod:`moeshard.ops` shares, written once.

Every operation (load, verify, relocate, save, LoRA load / save) runs the same skeleton on
every rank of its group (:mod:`moeshard.ops.report`): *describe* the model or tensors ->
*plan* -> *agree* on the plan (:func:`moeshard.collectives.agree`) -> *run* the schedule ->
*report*. Around those steps each needs the same few things:

- :func:`group_topology`: the operation's :class:`~moeshard.topology.Topology`, checked against
  its process group, with this rank set;
- :class:`OpMeter`: wall seconds since the call began, seconds per step
  (:class:`~moeshard.ops.report.Phases`) and, where the report carries it, the call's peak RSS
  (:mod:`moeshard.ops.peak_rss`);
- :func:`progress_bar`: the byte counter a node's local rank 0 shows;
- :func:`named_tensors` and :func:`local_tensors`: a model's tensors by name, and the
  rank-local tensor behind each described parameter.

Nothing here communicates: each function is this rank's own, called by every rank of the
operation inside its :func:`moeshard.collectives.scope`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import psutil
import torch
from torch import nn

from .. import collectives
from ..models.describe import ParamDesc, local_tensor
from ..progress import Progress, progress_enabled
from ..topology import Topology
from .peak_rss import PeakRss, reset_peak_rss
from .report import Phases

__all__ = ["group_topology", "OpMeter", "progress_bar", "named_tensors", "local_tensors"]


def group_topology(topology: Topology | None, group=None) -> Topology:
    """The operation's topology with this rank's group rank set: ``topology``, or by default
    the nodes of ``group``'s members (:meth:`~moeshard.topology.Topology.of_group`; None: the
    default group). Called by every rank of the group, inside its scope (ranks are group ranks).

    Raises:
        ValueError: ``topology`` has another world size than the process group.
    """
    rank, world = collectives.rank_and_world()
    topo = topology or Topology.of_group(group)
    if topo.world_size != world:
        raise ValueError(f"topology has world_size {topo.world_size}, the process group has {world}")
    return topo.with_rank(rank)


class OpMeter:
    """This rank's measurements of one operation call, started at its creation: wall seconds
    since then, wall and thread CPU seconds per step (:attr:`phases`), and with
    ``peak_rss=True`` the resident set size then (:attr:`rss_before`) and the call's peak
    (:meth:`peak_rss`: the kernel's high-water mark is reset here, so it is the call's own
    where Linux allows it)."""

    def __init__(self, peak_rss: bool = False):
        self.t0 = time.perf_counter()
        self.phases = Phases(self.t0)
        self._rss_reset = reset_peak_rss() if peak_rss else False
        self.rss_before = psutil.Process().memory_info().rss if peak_rss else 0

    def end(self, step: str) -> float:
        """Close ``step`` (begun where the previous one ended); seconds since the call began."""
        return self.phases.end(step) - self.t0

    def seconds(self) -> float:
        """Wall seconds since the call began."""
        return time.perf_counter() - self.t0

    def peak_rss(self) -> PeakRss:
        """The peak RSS since the call began (or, where it could not be reset, the process's)."""
        return PeakRss.since(self._rss_reset)


def progress_bar(what: str, total_bytes: int, progress: bool | None, topology: Topology) -> Progress:
    """The byte counter of operation ``what`` on this rank: shown by local rank 0 of each node
    when ``progress`` (None: the ``MOESHARD_PROGRESS`` environment variable) says so."""
    return Progress(what, total_bytes, enabled=progress_enabled(progress), local_rank=topology.local_rank,
                    node=topology.node)


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` under each of its names (a tied one under all), and its
    buffers: the tensors that :func:`~moeshard.models.describe.describe_model` names."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers())
    return tensors


def local_tensors(tensors: dict[str, torch.Tensor], descs: Sequence[ParamDesc]) -> list[torch.Tensor]:
    """The rank-local tensor (writable in place, viewed with its description's dims) of each
    of ``descs``, from ``tensors`` (:func:`named_tensors`)."""
    return [local_tensor(tensors[d.name], d) for d in descs]
