"""moeshard: put Mixture-of-Experts weights on the right ranks, fast, bounded, verified.

The public names are imported on first use (PEP 562): ``import moeshard.plan`` or
``moeshard.cluster`` (``moeshard plan``) must not pay for importing torch, which the
operations (load, verify, relocate, save) need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it (relative to this package)
_EXPORTS = {
    "eplb": (".eplb", None),
    "lora": (".lora", None),
    "DistributedError": (".collectives", "DistributedError"),
    "PeerLostError": (".collectives", "PeerLostError"),
    "PlanMismatchError": (".collectives", "PlanMismatchError"),
    "CheckpointError": (".io.errors", "CheckpointError"),
    "CheckpointIndex": (".io.index", "CheckpointIndex"),
    "CheckpointReader": (".io.reader", "CheckpointReader"),
    "write_checkpoint": (".io.writer", "write_checkpoint"),
    "HF_EXPERTS": (".models.adapters", "HF_EXPERTS"),
    "MIXTRAL_EXPERTS": (".models.adapters", "MIXTRAL_EXPERTS"),
    "ExpertParam": (".models.adapters", "ExpertParam"),
    "ExpertsSpec": (".models.adapters", "ExpertsSpec"),
    "clip_grad_norm_": (".models.ep", "clip_grad_norm_"),
    "grad_norm": (".models.ep", "grad_norm"),
    "sync_redundant_grads": (".models.ep", "sync_redundant_grads"),
    "allow_slot_order": (".models.slot_guard", "allow_slot_order"),
    "guard_optimizer": (".models.slot_guard", "guard_optimizer"),
    "logical_state_dict": (".models.logical_state", "logical_state_dict"),
    "make_mesh": (".models.parallel", "make_mesh"),
    "parallelize": (".models.parallel", "parallelize"),
    "LoadReport": (".ops.load", "LoadReport"),
    "load": (".ops.load", "load"),
    "materialize": (".ops.load", "materialize"),
    "RelocationReport": (".ops.relocate", "RelocationReport"),
    "relocate": (".ops.relocate", "relocate"),
    "RelocationStep": (".ops.relocate", "RelocationStep"),
    "relocate_chunks": (".ops.relocate", "relocate_chunks"),
    "relocation_chunks": (".plan.chunks", "relocation_chunks"),
    "SaveError": (".ops.save", "SaveError"),
    "SaveReport": (".ops.save", "SaveReport"),
    "save": (".ops.save", "save"),
    "VerificationError": (".ops.verify", "VerificationError"),
    "VerifyReport": (".ops.verify", "VerifyReport"),
    "verify": (".ops.verify", "verify"),
    "Placement": (".placement", "Placement"),
    "Schedule": (".plan", "Schedule"),
    "plan_transfers": (".plan", "plan_transfers"),
    "RelocationPlan": (".plan.relocation", "RelocationPlan"),
    "plan_relocation": (".plan.relocation", "plan_relocation"),
    "Topology": (".topology", "Topology"),
    "from_pretrained": (".integrations.pretrained", "from_pretrained"),
    "HybridMesh": (".models.hsdp", "HybridMesh"),
    "ReshardReport": (".ops.reshard", "ReshardReport"),
    "ShardLayout": (".ops.reshard", "ShardLayout"),
    "StaleStateError": (".ops.reshard", "StaleStateError"),
    "describe_shards": (".ops.reshard", "describe_shards"),
    "reshard": (".ops.reshard", "reshard"),
    "RefitReport": (".ops.refit", "RefitReport"),
    "RefitVerifyError": (".ops.refit", "RefitVerifyError"),
    "refit": (".ops.refit", "refit"),
    "EngineLayout": (".plan.refit", "EngineLayout"),
    "EngineTensor": (".plan.refit", "EngineTensor"),
    "Segment": (".plan.refit", "Segment"),
}

__all__ = [
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointReader",
    "DistributedError",
    "ExpertParam",
    "ExpertsSpec",
    "HF_EXPERTS",
    "LoadReport",
    "MIXTRAL_EXPERTS",
    "PeerLostError",
    "PlanMismatchError",
    "Placement",
    "Topology",
    "Schedule",
    "VerificationError",
    "VerifyReport",
    "eplb",
    "load",
    "lora",
    "make_mesh",
    "materialize",
    "parallelize",
    "plan_relocation",
    "plan_transfers",
    "RelocationPlan",
    "RelocationReport",
    "relocate",
    "RelocationStep",
    "relocate_chunks",
    "relocation_chunks",
    "SaveError",
    "SaveReport",
    "save",
    "verify",
    "write_checkpoint",
    "clip_grad_norm_",
    "grad_norm",
    "sync_redundant_grads",
    "from_pretrained",
    "allow_slot_order",
    "guard_optimizer",
    "logical_state_dict",
    "HybridMesh",
    "ReshardReport",
    "ShardLayout",
    "StaleStateError",
    "describe_shards",
    "reshard",
    "RefitReport",
    "RefitVerifyError",
    "refit",
    "EngineLayout",
    "EngineTensor",
    "Segment",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attr = _EXPORTS[name]
        mod = importlib.import_module(module, __name__)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value  # once: later lookups do not come here
        return value
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        sub = importlib.import_module(f".{name}", __name__)  # a submodule: moeshard.io, moeshard.collectives ...
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    # An eager ``import moeshard`` bound the API's modules under it (``moeshard.io.index``,
    # ``moeshard.ops.load``): so does the first use of the subpackage.
    for module, _ in _EXPORTS.values():
        if module.startswith(f".{name}."):
            importlib.import_module(module, __name__)
    return sub


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs: the names as eager imports would bind them
    from . import eplb, lora
    from .collectives import DistributedError, PeerLostError, PlanMismatchError
    from .integrations.pretrained import from_pretrained
    from .io.errors import CheckpointError
    from .io.index import CheckpointIndex
    from .io.reader import CheckpointReader
    from .io.writer import write_checkpoint
    from .models.adapters import HF_EXPERTS, MIXTRAL_EXPERTS, ExpertParam, ExpertsSpec
    from .models.ep import clip_grad_norm_, grad_norm, sync_redundant_grads
    from .models.hsdp import HybridMesh
    from .models.logical_state import logical_state_dict
    from .models.parallel import make_mesh, parallelize
    from .models.slot_guard import allow_slot_order, guard_optimizer
    from .ops.load import LoadReport, load, materialize
    from .ops.refit import RefitReport, RefitVerifyError, refit
    from .ops.relocate import RelocationReport, RelocationStep, relocate, relocate_chunks
    from .ops.reshard import ReshardReport, ShardLayout, StaleStateError, describe_shards, reshard
    from .ops.save import SaveError, SaveReport, save
    from .ops.verify import VerificationError, VerifyReport, verify
    from .placement import Placement
    from .plan import Schedule, plan_transfers
    from .plan.chunks import relocation_chunks
    from .plan.refit import EngineLayout, EngineTensor, Segment
    from .plan.relocation import RelocationPlan, plan_relocation
    from .topology import Topology
