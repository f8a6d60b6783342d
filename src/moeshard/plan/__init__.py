"""Pure planning: needs, pieces and schedules as arrays (no torch.distributed, no files).

* :mod:`.needs`: :class:`NeedTable`, every rank's needs as columns;
* :mod:`.schedule`: :class:`Schedule`, rounds of reads, sends and node broadcasts;
* :mod:`.load`: the load planner (:func:`plan_transfers`) and its lower bounds
  (:func:`minimal_cost`).
"""

from .load import DEFAULT_MAX_OPS, DEFAULT_STAGING_BYTES, STAGING_PARTS, minimal_cost, plan_transfers
from .needs import NeedTable
from .schedule import PlanCost, RankSchedule, Schedule

__all__ = ["NeedTable", "Schedule", "RankSchedule", "PlanCost", "plan_transfers", "minimal_cost",
           "DEFAULT_STAGING_BYTES", "DEFAULT_MAX_OPS", "STAGING_PARTS"]
