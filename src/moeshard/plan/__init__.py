"""Pure planning: needs, pieces and schedules as arrays (no torch.distributed, no files).

* :mod:`.needs`: :class:`NeedTable`, every rank's needs as columns;
* :mod:`.schedule`: :class:`Schedule`, rounds of reads, sends and node broadcasts;
* :mod:`.pieces`: :class:`Pieces`, needs cut into pieces and deliveries (the part of a load
  plan that every storage mode shares);
* :mod:`.load`: the load planner (:func:`plan_transfers`) and its lower bounds
  (:func:`minimal_cost`).

Importing it does not import torch.
"""

from .load import DEFAULT_MAX_OPS, DEFAULT_STAGING_BYTES, STAGING_PARTS, minimal_cost, plan_transfers
from .needs import NeedTable
from .pieces import Pieces, cut_pieces
from .schedule import PlanCost, RankSchedule, Schedule

__all__ = [
    "NeedTable",
    "Pieces",
    "cut_pieces",
    "Schedule",
    "RankSchedule",
    "PlanCost",
    "plan_transfers",
    "minimal_cost",
    "DEFAULT_STAGING_BYTES",
    "DEFAULT_MAX_OPS",
    "STAGING_PARTS",
]
