"""moeshard: put Mixture-of-Experts weights on the right ranks, fast, bounded, verified."""

from . import eplb, lora
from ._dist import DistributedError, PeerLostError
from .io.checkpoint import CheckpointError, CheckpointIndex, CheckpointReader, write_checkpoint
from .models.adapters import HF_EXPERTS, MIXTRAL_EXPERTS, ExpertParam, ExpertsSpec
from .models.ep import clip_grad_norm_, grad_norm, sync_redundant_grads
from .models.parallel import make_mesh, parallelize
from .ops.load import LoadReport, load, materialize
from .ops.relocate import RelocationReport, relocate
from .ops.save import SaveError, SaveReport, save
from .ops.verify import VerificationError, VerifyReport, verify
from .placement import Placement
from .plan import Schedule, plan_transfers
from .plan.relocation import RelocationPlan, plan_relocation
from .topology import Topology

__all__ = [
    "CheckpointError", "CheckpointIndex", "CheckpointReader", "DistributedError", "ExpertParam",
    "ExpertsSpec", "HF_EXPERTS", "LoadReport", "MIXTRAL_EXPERTS", "PeerLostError", "Placement", "Topology",
    "Schedule", "VerificationError", "VerifyReport", "eplb", "load", "lora", "make_mesh", "materialize",
    "parallelize", "plan_relocation", "plan_transfers", "RelocationPlan", "RelocationReport", "relocate",
    "SaveError", "SaveReport", "save", "verify", "write_checkpoint", "clip_grad_norm_", "grad_norm", "sync_redundant_grads",
]
__version__ = "0.1.0"
