"""``moeshard plan``: the cost of loading (or rebalancing) a MoE checkpoint on a cluster,
computed on one machine, before any GPU is booked.

No process group and no model object: the parameters a real job would have are synthesized
from the checkpoint's headers (or, with ``--synthetic-from-config``, from a Hugging Face
``config.json`` alone), laid out exactly as :func:`moeshard.parallelize` lays them out:

* every dense tensor is an FSDP2 ``Shard(0)`` DTensor over all ranks (the flattened ``dp``
  mesh, ranks ``0..world-1`` in order);
* every fused expert parameter is ``[num_physical, *slice_shape]`` on the ``("efsdp", "ep")``
  mesh ``arange(world).reshape(efsdp, ep)`` (EP innermost, as :func:`moeshard.make_mesh`
  builds it), ``Shard(0)`` on "ep" and, when ``efsdp > 1``, ``Shard(1)`` on "efsdp";
* persistent buffers that FSDP2 leaves whole (DeepSeek's ``e_score_correction_bias``) are
  plain tensors held in full by every rank.

Then the real planner runs (:func:`~moeshard.models.layout.need_table`,
:func:`~moeshard.plan.plan_transfers`) for each storage mode, and the three baselines of
``benchmarks/baselines.py`` are costed analytically from what each of them sends. With
``--rebalance LOADS.npy`` the relocation planner runs instead, from the current placement to
``eplb.rebalance(loads, migration_aware=True)``.

One job per module:

* :mod:`.spec` -- :class:`ClusterSpec`: nodes x ranks per node, EP x expert-FSDP;
* :mod:`.synthetic` -- a ``config.json`` -> synthetic checkpoint headers;
* :mod:`.experts` -- checkpoint headers -> :class:`MoeLayout` (experts modules, fused params);
* :mod:`.model` -- the ParamDescs and placement a parallelized model would have;
* :mod:`.cost` -- :class:`StrategyCost`, per-rank link counters;
* :mod:`.plans` -- moeshard's plan per storage mode, costed;
* :mod:`.baselines` -- the three baselines, costed analytically;
* :mod:`.estimate` -- bandwidths and the time estimate with its bottleneck;
* :mod:`.rebalance` -- an EPLB rebalance and its relocation plan, summarized;
* :mod:`.render` -- the text report; :mod:`.command` -- argparse, :func:`run`, :func:`main`.

Everything except :func:`main` is pure: functions of plain data, ValueError for bad input.
Docs: ``docs/storage-and-cost-model.md``.
"""

from __future__ import annotations

from .baselines import baseline_costs
from .cost import LinkBytes, StrategyCost
from .estimate import Bandwidth, estimate_time, parse_bandwidth
from .experts import ExpertModule, MoeLayout, find_experts
from .model import make_placement, synthesize_descs
from .plans import moeshard_cost, plan_storage_modes
from .rebalance import RelocationSummary, plan_relocation_summary
from .render import format_report
from .spec import ClusterSpec
from .synthetic import num_params, read_config, synthetic_index

__all__ = [
    "ClusterSpec",
    "Bandwidth",
    "ExpertModule",
    "MoeLayout",
    "StrategyCost",
    "RelocationSummary",
    "LinkBytes",
    "read_config",
    "synthetic_index",
    "num_params",
    "make_placement",
    "find_experts",
    "synthesize_descs",
    "moeshard_cost",
    "plan_storage_modes",
    "baseline_costs",
    "estimate_time",
    "plan_relocation_summary",
    "parse_bandwidth",
    "format_report",
]
