"""The relocation planner: old placement + new placement -> :class:`RelocationPlan` (pure).

Input: the expert tensors of every MoE layer as plain records (:class:`ExpertTensor`: which
rank holds which slots and which box of the per-expert slice), the old and new
:class:`~moeshard.placement.Placement`, the live ranks and the ranks that can read the
checkpoint. No communication, same answer on every rank, any world size. With ``rank``, only
the *component* that rank takes part in is planned (ranks holding slots of the same box
column of a layer move data only among themselves; see :class:`RelocationPlan`): what a rank
that runs the plan needs, at a cost that grows with its component, not with the world.

What moves. A rank *needs* logical expert ``e`` in slot ``s`` when the new placement puts
``e`` there and the old one did not. Each need is met, in this order of preference, by

1. a *local copy*: the rank already holds ``e`` in another slot;
2. a *same-node* send from a live holder on the rank's node (the least-loaded one, so the
   sending load spreads over all holders);
3. a *cross-node* send: one rank of the node receives it from a live holder elsewhere and
   relays it to the node's other needers, so each copy crosses between nodes once;
4. a *checkpoint read* (only the slices of experts no live rank holds), by a needer that can
   read, else by a reader on its node, else any reader; then sent as in 2 and 3.

The unit of transfer is a *move*: one logical expert's share of one *part* of a layer's
tensors (every expert tensor of the layer -- weights, biases, scales -- in the same box
column, split so that one part is at most a quarter of the staging budget).

Ordering. Moves run in *rounds*. In a round, a rank first reads, copies and sends old slot
contents, then receives into staging buffers, and only at the round's end writes the staged
data into its slots. A move that reads slot ``X`` must run no later than the move that
overwrites ``X``; a cycle of such constraints (experts swapping slots) is broken by
*stashing* one slot: its rank copies the old content aside before it is overwritten. Every
rank stages at most ``staging_bytes`` per round (stashes included), provided a part fits in a
quarter of it; a part is at least one element, so below four elements of budget a single move
may exceed it (it gets a round of its own) and a round may hold a stash beside a move
(``cost.peak_staging_bytes`` is the exact figure either way) and posts at most ``max_ops`` P2P ops
per phase (a single move's fan-out excepted).

Modules, each importing only those above it: :mod:`.records` (the records and counters),
:mod:`.layouts` (columns, part groups, components), :mod:`.needs`, :mod:`.routing`,
:mod:`.rounds` (round packing), :mod:`.schedule` (a plan's schedule rows), :mod:`.plan`
(:class:`RelocationPlan`), :mod:`.fingerprint`, :mod:`.planner` (:func:`plan_relocation`).
"""

from .layouts import rank_of_slot
from .plan import RelocationPlan
from .planner import plan_relocation
from .records import (
    CLASSES,
    COUNTERS,
    CROSS_NODE,
    DEFAULT_MAX_OPS,
    DEFAULT_STAGING_BYTES,
    DISK,
    LOCAL,
    SAME_NODE,
    ExpertTensor,
    Keys,
    Move,
    Part,
    RelocationCost,
    Round,
    Stash,
    job_summary,
)
from .rounds import pack_rounds

__all__ = [
    "ExpertTensor",
    "Part",
    "Move",
    "Stash",
    "Round",
    "RelocationCost",
    "RelocationPlan",
    "plan_relocation",
    "rank_of_slot",
    "COUNTERS",
    "job_summary",
    "DEFAULT_STAGING_BYTES",
    "DEFAULT_MAX_OPS",
    "CLASSES",
    "LOCAL",
    "SAME_NODE",
    "CROSS_NODE",
    "DISK",
    "Keys",
    "pack_rounds",
]
