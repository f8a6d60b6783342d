"""The transformers ``Trainer`` (and TRL's trainers, its subclasses) with a moeshard model.

A moeshard model (built on meta, :func:`moeshard.parallelize`, :func:`moeshard.load`) trains under
the stock ``Trainer`` as it is: accelerate's FSDP2 path (``accelerate launch`` with
``fsdp_version: 2``) passes its root, already an ``FSDPModule``, through untouched, and the
Trainer's own gradient clipping takes the norm over the model's several device meshes. What the
Trainer cannot do right is save and resume: its savers write the model's state dict (expert
slots in *physical* order, a redundant expert several times) and its optimizer state in the same
order, and a resume under another placement would put both in the wrong slots. The mixin here
sends every saver and loader the Trainer calls through moeshard::

    from trl import SFTTrainer

    from moeshard.integrations.transformers import MoeshardTrainerMixin

    class MyTrainer(MoeshardTrainerMixin, SFTTrainer):   # or Trainer, DPOTrainer, ...
        pass

    # or: MyTrainer = moeshard_trainer(SFTTrainer)

A checkpoint directory (``save_model`` and every ``checkpoint-N``) then holds:

* the model as a Hugging Face checkpoint written by :func:`moeshard.save` (each logical expert
  once, in logical order, whatever the placement; ``config.json``): ``from_pretrained(dir)`` in
  one process is the trained model;
* ``moeshard_placement.json``: the placement the model routed by (moeshard JSON,
  :func:`moeshard.io.placement_files.write_placement`);
* (``checkpoint-N`` without ``save_only_model``) ``moeshard_optimizer/rank-R-of-W.pt``: each
  rank's *local* optimizer state (the local shards of its DTensor states) keyed by parameter
  name, with the world size and every parameter's mesh, placements and shape; the scheduler,
  scaler and RNG files as the Trainer writes them.

Resume (``trainer.train(resume_from_checkpoint=...)``): the weights are loaded by
:func:`moeshard.load` under the model's own placement (any placement reads a logical
checkpoint). The optimizer state goes back into ``optimizer.state`` as DTensors of the
parameters' meshes when the job has the same world size and every parameter the same mesh,
placements and shape. Under the same expert placement that is an exact continuation. Under
another placement with the same number of slots the experts are first relocated to the saved
placement, the state is loaded, and :func:`moeshard.relocate` moves weights and state back to
the model's placement (the same numbers, other slots: exact too). Anything else (another world
size, mesh or slot count) is refused on every rank with a :class:`ResumeError` naming what
differs; resume it with ``save_only_model=True`` checkpoints (weights only) and a fresh
optimizer.

Why accelerate's FSDP2 path and not transformers' own path for models sharded at load time
(``model.is_distributed_loading_by_transformers``): that path is keyed on transformers-private
model state (the flag, and ``model.config.distributed_config`` for gradient accumulation), and
its Trainer refuses any checkpoint with optimizer state (``save_only_model=True`` or no saving),
so no resume. accelerate's FSDP2 path is what users launch on GPUs, needs nothing from moeshard
and lets the Trainer checkpoint. (On CPU accelerate ignores its FSDP plugin and wraps the model in
DDP, which fails on DTensor parameters; moeshard does not patch accelerate, so CPU runs need
their own shim: see the tests.)

Every override is collective where the Trainer calls it on every rank (all of them are).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import re
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .. import collectives
from ..collectives import DistributedError
from ..eplb import rebalance
from ..io.placement_files import read_placement_file, write_placement
from ..models.ep import ROUTED, ep_layer_names, ep_layers, model_placement
from ..models.slot_guard import guard_optimizer
from ..ops.load import load
from ..ops.relocate import relocate
from ..ops.save import SaveError, save
from ..placement import Placement

__all__ = [
    "MoeshardTrainerMixin",
    "moeshard_trainer",
    "MoeshardRebalanceCallback",
    "ResumeError",
    "MixedPrecisionError",
    "PLACEMENT_NAME",
    "OPTIMIZER_DIR",
    "save_optimizer_state",
    "load_optimizer_state",
    "check_mixed_precision",
    "check_checkpoint",
]

PLACEMENT_NAME = "moeshard_placement.json"
OPTIMIZER_DIR = "moeshard_optimizer"
_FORMAT = "moeshard.optimizer"
_RANK_FILE = re.compile(r"rank-(\d+)-of-(\d+)\.pt$")
# The Trainer's own file names (transformers.trainer), repeated so that importing this module
# does not depend on where a transformers version keeps them.
_SCHEDULER_NAME = "scheduler.pt"
_TRAINER_OPTIMIZER_NAMES = ("optimizer.pt", "optimizer.bin")
_TRAINING_ARGS_NAME = "training_args.bin"
_TRAINER_STATE_NAME = "trainer_state.json"
_SCALER_NAME = "scaler.pt"


class ResumeError(DistributedError, ValueError):
    """Raised on every rank when a checkpoint cannot resume this job on some rank: its optimizer
    state was saved under another world size, mesh, parameter layout or slot count (refused
    before anything changed), or a file the resume reads is missing, unreadable or differs
    between ranks."""


class MixedPrecisionError(DistributedError, ValueError):
    """Raised on every rank when the Trainer's ``bf16`` / ``fp16`` flag would be ignored on some
    rank (:func:`check_mixed_precision`)."""


def _inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer behind accelerate's ``AcceleratedOptimizer`` (which forwards
    ``step`` but keeps the state on the wrapped one)."""
    return getattr(optimizer, "optimizer", optimizer)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _layout(p: torch.Tensor) -> dict:
    """What a parameter's local shard depends on: its global shape and, for a DTensor, its mesh
    (shape, dim names, this rank's coordinate) and placements."""
    out = {"shape": list(p.shape)}
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None:
        out.update(
            mesh=list(mesh.shape),
            dims=list(mesh.mesh_dim_names or ()),
            coord=list(mesh.get_coordinate() or ()),
            placements=[str(x) for x in p.placements],
        )
    return out


def _rank_path(out_dir: str, rank: int, world: int) -> str:
    return os.path.join(out_dir, OPTIMIZER_DIR, f"rank-{rank:05d}-of-{world:05d}.pt")


def save_optimizer_state(model: nn.Module, optimizer, out_dir: str | os.PathLike) -> str:
    """Collective (every rank): write this rank's local optimizer state to
    ``out_dir/moeshard_optimizer/rank-R-of-W.pt`` (``torch.save`` of plain tensors, dicts and
    lists: readable with ``weights_only=True``).

    The file holds ``state`` ``{param name: {key: tensor}}`` (a DTensor state as its local shard
    ``[*local shape]``, a scalar such as AdamW's ``step`` as it is), ``param_groups`` (each
    group's hyperparameters and its parameters' names), ``layout`` ``{param name: global shape,
    mesh, coordinate, placements}`` and ``world_size``. Nothing goes through
    ``optimizer.state_dict()``. Returns this rank's file. Raises on every rank if any rank
    failed to write.
    """
    rank, world = collectives.rank_and_world()
    opt = _inner_optimizer(optimizer)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    path = _rank_path(os.fspath(out_dir), rank, world)

    def write() -> str:
        groups, state, layout = [], {}, {}
        for g in opt.param_groups:
            missing = [i for i, p in enumerate(g["params"]) if id(p) not in names]
            if missing:
                raise ValueError(f"optimizer parameter {missing[0]} of a param group is not a parameter of the model")
            groups.append(
                {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
            )
            for p in g["params"]:
                name = names[id(p)]
                layout[name] = _layout(p)
                st = opt.state.get(p)
                if st:
                    state[name] = {
                        k: (_local(v).detach().to("cpu", copy=True) if torch.is_tensor(v) else v) for k, v in st.items()
                    }
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp"
        torch.save(
            {
                "format": _FORMAT,
                "version": 1,
                "world_size": world,
                "rank": rank,
                "param_groups": groups,
                "state": state,
                "layout": layout,
            },
            tmp,
        )
        os.replace(tmp, path)
        return path

    return collectives.agree(write, "moeshard: saving the optimizer state")


@dataclass(frozen=True)
class _SavedOptimizer:
    """One rank's optimizer file, read and checked against the running job."""

    payload: dict
    saved: Placement | None  # the placement the checkpoint was saved under
    current: Placement | None  # the one the model routes by now
    mode: str  # "same" or "relocate"


def _check_world(checkpoint: str, rank: int, world: int) -> str:
    """This rank's file, or a ValueError saying which world size the checkpoint was saved with."""
    path = _rank_path(checkpoint, rank, world)
    if os.path.isfile(path):
        return path
    found = sorted(
        {
            int(m.group(2))
            for f in glob.glob(os.path.join(checkpoint, OPTIMIZER_DIR, "rank-*.pt"))
            if (m := _RANK_FILE.search(f))
        }
    )
    if found and world not in found:
        raise ValueError(
            f"{checkpoint}: its optimizer state was saved by {found[0]} ranks, this job has {world}: "
            "it cannot resume here. Save with save_only_model=True (weights only) and resume with a "
            "fresh optimizer"
        )
    raise ValueError(f"{checkpoint}: no optimizer state for rank {rank} ({os.path.relpath(path, checkpoint)})")


def _check_layout(saved: dict, model: nn.Module, checkpoint: str) -> None:
    """Every parameter with saved state exists and has the layout (global shape, mesh,
    placements, coordinate) it had: then its local shard is the same box of it."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, was in saved["layout"].items():
        if name not in params:
            raise ValueError(f"{checkpoint}: the optimizer state has parameter {name}, which the model does not")
        now = _layout(params[name])
        if now != was:
            diff = ", ".join(
                f"{k} {was.get(k)} -> {now.get(k)}" for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)
            )
            raise ValueError(
                f"{checkpoint}: parameter {name} was sharded otherwise when its optimizer state was saved ({diff}): "
                "the optimizer state resumes only on the same mesh (EP and expert-FSDP sizes). Save with "
                "save_only_model=True (weights only) and resume with a fresh optimizer"
            )


def _read_placement(checkpoint: str, model: nn.Module) -> Placement | None:
    path = os.path.join(checkpoint, PLACEMENT_NAME)
    if not os.path.isfile(path):
        return None
    f = read_placement_file(path, format="moeshard")
    current = model_placement(model)
    return Placement(
        f.phy2log,
        num_logical=f.num_logical
        if f.num_logical is not None
        else (current.num_logical if current is not None else None),
        num_ranks=f.num_ranks,
    )


def _resume_mode(saved: Placement | None, current: Placement | None, checkpoint: str) -> str:
    if saved is None and current is None:
        return "same"
    if saved is None or current is None:
        has = "has none" if saved is None else f"has {PLACEMENT_NAME}"
        raise ValueError(
            f"{checkpoint}: the checkpoint {has} and the model "
            f"{'routes by an expert placement' if current is not None else 'has no EP layers'}: "
            "its optimizer state cannot be matched to the experts' slots"
        )
    if saved.phy2log.shape != current.phy2log.shape or saved.num_logical != current.num_logical:
        raise ValueError(
            f"{checkpoint}: saved under a placement of {saved.num_layers} layers x {saved.num_physical} slots "
            f"({saved.num_logical} experts), the model has {current.num_layers} x {current.num_physical} "
            f"({current.num_logical}): the optimizer state resumes only with the same slot count. Save with "
            "save_only_model=True (weights only) and resume with a fresh optimizer"
        )
    return "same" if np.array_equal(saved.phy2log, current.phy2log) else "relocate"


def _resume_fingerprint(got: _SavedOptimizer) -> str:
    """What every rank must read alike: the mode and the placement the state was saved under
    (a rank whose placement file differs would relocate to other slots)."""
    return f"{got.mode}, saved placement {got.saved.fingerprint() if got.saved is not None else None}"


def _put_state(model: nn.Module, opt: torch.optim.Optimizer, payload: dict, checkpoint: str) -> None:
    """Local: the saved local state back into ``opt.state`` (a per-element state as a DTensor
    of its parameter's mesh and placements), the saved hyperparameters into its groups."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters(remove_duplicate=False))
    groups = payload["param_groups"]
    _check_groups(model, opt, payload, checkpoint)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    for g, was in zip(opt.param_groups, groups):
        g.update({k: v for k, v in was.items() if k != "params"})
    for name, st in payload["state"].items():
        p = params[name]
        local = _local(p)
        out = {}
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                if v.shape != local.shape:
                    raise ValueError(
                        f"{checkpoint}: optimizer state {k!r} of {name} has local shape {list(v.shape)}, "
                        f"the parameter's local shard {list(local.shape)}"
                    )
                v = v.to(local.device)
                if isinstance(p, DTensor):
                    v = DTensor.from_local(
                        v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                    )
            elif torch.is_tensor(v) and (group_of[id(p)].get("capturable") or group_of[id(p)].get("fused")):
                v = v.to(local.device)  # torch keeps a capturable / fused step on the parameter's device
            out[k] = v
        opt.state[p] = out


def _check_groups(model: nn.Module, opt: torch.optim.Optimizer, payload: dict, checkpoint: str) -> None:
    """The optimizer's param groups hold the saved groups' parameters, by name, in order."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    mine = [[names.get(id(p), f"<not in the model: {tuple(p.shape)}>") for p in g["params"]] for g in opt.param_groups]
    saved = [g["params"] for g in payload["param_groups"]]
    if saved != mine:
        raise ValueError(
            f"{checkpoint}: the optimizer's param groups ({[len(g) for g in mine]} parameters) are not "
            f"the saved ones ({[len(g) for g in saved]}): build the optimizer as the saved run did"
        )


def load_optimizer_state(model: nn.Module, optimizer, checkpoint: str | os.PathLike) -> str:
    """Collective (every rank): put the optimizer state :func:`save_optimizer_state` wrote into
    ``optimizer`` (its state and param groups' hyperparameters), for ``model`` as it is now.

    Same world size, and every parameter with state on the same mesh, placements and shape (else
    :class:`ResumeError` on every rank, nothing changed). Expert placement: the saved one
    (``moeshard_placement.json``) equal to the model's: the state goes in as it is; another one
    with the same slot count: the model's experts are relocated to the saved placement, the
    state goes in, and weights and state are relocated back together (:func:`moeshard.relocate`
    with ``optimizer=``). Returns ``"same"`` or ``"relocated"``.
    """
    checkpoint = os.fspath(checkpoint)
    rank, world = collectives.rank_and_world()
    opt = _inner_optimizer(optimizer)
    # The state goes in by name with the placement it was saved under (and is relocated with its
    # experts where that differs): checked here, so the slot guard trusts it from now on.
    guard_optimizer(opt)

    def read() -> _SavedOptimizer:
        path = _check_world(checkpoint, rank, world)
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
            raise ValueError(f"{path}: not a moeshard optimizer file (format {_FORMAT!r})")
        if payload["world_size"] != world or payload["rank"] != rank:
            raise ValueError(
                f"{path}: written by rank {payload['rank']} of {payload['world_size']}, read by rank {rank} of {world}"
            )
        _check_layout(payload, model, checkpoint)
        _check_groups(model, opt, payload, checkpoint)  # before anything moves
        saved, current = _read_placement(checkpoint, model), model_placement(model)
        return _SavedOptimizer(payload, saved, current, _resume_mode(saved, current, checkpoint))

    with collectives.errors_as(ResumeError):
        got = collectives.agree(
            read, "moeshard: reading the optimizer state to resume", fingerprint=_resume_fingerprint
        )
        if got.mode == "same":
            collectives.agree(
                lambda: _put_state(model, opt, got.payload, checkpoint), "moeshard: loading the optimizer state"
            )
            return "same"
    # Another placement, same slots: the saved local state belongs to the saved placement's
    # slots. Put the weights there (no optimizer state yet: nothing else moves), load the
    # state, then move weights and state together to the model's placement.
    for p in list(opt.state):
        opt.state.pop(p)
    relocate(model, got.current, got.saved)
    with collectives.errors_as(ResumeError):
        collectives.agree(
            lambda: _put_state(model, opt, got.payload, checkpoint), "moeshard: loading the optimizer state"
        )
    relocate(model, got.saved, got.current, optimizer=opt)
    return "relocated"


def check_checkpoint(checkpoint: str) -> str:
    """Local: what the Trainer's resume reads from ``checkpoint`` before moeshard is called (the
    directory, ``trainer_state.json``) and the placement file, checked; returns what every rank
    must find alike (the checkpoint's name and step, the placement, which optimizer, scheduler
    and scaler files it has).

    Raises:
        ValueError: naming the checkpoint and the file that is missing or unreadable.
    """
    if not os.path.isdir(checkpoint):
        raise ValueError(f"{checkpoint}: no such checkpoint directory")
    try:
        with open(os.path.join(checkpoint, _TRAINER_STATE_NAME)) as f:
            step = json.load(f)["global_step"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{checkpoint}: its {_TRAINER_STATE_NAME}, which the Trainer resumes from, cannot be read "
            f"({type(e).__name__}: {e})"
        ) from None
    placement = os.path.join(checkpoint, PLACEMENT_NAME)
    digest = None
    if os.path.exists(placement):
        table = np.ascontiguousarray(read_placement_file(placement, format="moeshard").phy2log, dtype=np.int64)
        digest = hashlib.blake2b(table.tobytes() + str(table.shape).encode(), digest_size=8).hexdigest()
    names = (OPTIMIZER_DIR, *_TRAINER_OPTIMIZER_NAMES, _SCHEDULER_NAME, _SCALER_NAME)
    found = [n for n in names if os.path.exists(os.path.join(checkpoint, n))]
    return f"{os.path.basename(os.path.normpath(checkpoint))} at step {step}, placement {digest}, files {found}"


def _agreed(step, what: str, error: type[DistributedError]):
    """Collective: ``step()`` on every rank, a failure on any rank raised as ``error`` on all."""
    with collectives.errors_as(error):
        return collectives.agree(step, what)


def check_mixed_precision(model: nn.Module, args) -> None:
    """Local: refuse ``args.bf16`` / ``args.fp16`` (TRL's trainers default to ``bf16=True``) that
    would be silently ignored. accelerate applies mixed precision to a model it shards with
    ``fully_shard`` itself, and it passes a moeshard model (already FSDP2) through, so the flag
    would leave training in the parameters' dtype. Accepted: parameters already in that dtype, or
    a model :func:`moeshard.parallelize` gave a ``MixedPrecisionPolicy`` that computes in it.
    :class:`MoeshardTrainerMixin` runs it on every rank, agreed, when the Trainer is created and
    when ``train`` starts.

    Raises:
        ValueError: naming the flag, the parameters' dtype and what to do instead.
    """
    want = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) else None
    if want is None:
        return
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes <= {want}:
        return
    # The policy moeshard.parallelize gave every fully_shard (FSDP2 has no public accessor).
    if getattr(getattr(model, "moeshard_mp_policy", None), "param_dtype", None) == want:
        return
    flag = "bf16" if want == torch.bfloat16 else "fp16"
    raise ValueError(
        f"{flag}=True with a moeshard model whose parameters are {sorted(str(d) for d in dtypes)}: accelerate applies "
        "mixed precision only inside the fully_shard it skips for a model that is already FSDP2, so training would "
        f"run in {sorted(str(d) for d in dtypes)[0]} without a word. Pass FSDP2's own policy to "
        f"moeshard.from_pretrained or moeshard.parallelize (mp_policy=MixedPrecisionPolicy(param_dtype={want}, "
        f"reduce_dtype=torch.float32), from torch.distributed.fsdp), load the model in {want}, or set {flag}=False"
    )


class MoeshardTrainerMixin:
    """Put before a transformers ``Trainer`` class (``Trainer``, TRL's ``SFTTrainer``, ...):
    ``class MyTrainer(MoeshardTrainerMixin, SFTTrainer): pass``. The model must be a moeshard
    model (parallelized and loaded by moeshard); the module doc says what is saved and how a
    resume works. Every override is collective; the Trainer calls each on every rank.

    Every step that can fail on one rank (a flag, a file written or read) is agreed: a failure
    on any rank raises on every rank (:class:`MixedPrecisionError`, ``moeshard.SaveError``,
    :class:`ResumeError`), never leaving the others waiting in a collective.
    """

    def __init__(self, *args, **kwargs):
        """Collective: the Trainer's own ``__init__``, then :func:`check_mixed_precision` agreed
        on every rank (``bf16=True`` / ``fp16=True`` that would be ignored raises
        :class:`MixedPrecisionError` on every rank)."""
        super().__init__(*args, **kwargs)
        self._moeshard_check_precision()

    def _moeshard_model(self) -> nn.Module:
        model = self.model
        unwrap = getattr(getattr(self, "accelerator", None), "unwrap_model", None)
        return unwrap(model, keep_torch_compile=False) if unwrap is not None and model is not None else model

    def _moeshard_check_precision(self) -> None:
        model = self._moeshard_model()
        if model is None:  # built by model_init when train() starts: checked there
            return
        with collectives.errors_as(MixedPrecisionError):
            collectives.agree(
                lambda: check_mixed_precision(model, self.args), "moeshard: checking the Trainer's bf16 / fp16 flags"
            )

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """Collective: the Trainer's ``train``, after every rank agreed that the mixed-precision
        flags are honoured and, when resuming, on the checkpoint (``True``: the last one in
        ``args.output_dir``; :func:`check_checkpoint`). A checkpoint missing, unreadable or
        different on any rank raises :class:`ResumeError` on every rank before anything is
        loaded."""
        self._moeshard_check_precision()
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return super().train(None, *args, **kwargs)

        def find() -> tuple[str, str]:
            path = resume_from_checkpoint
            if path is True:
                from transformers.trainer_utils import get_last_checkpoint

                path = get_last_checkpoint(self.args.output_dir)
                if path is None:
                    raise ValueError(f"no checkpoint to resume from in {self.args.output_dir}")
            path = os.fspath(path)
            return path, check_checkpoint(path)

        with collectives.errors_as(ResumeError):
            path, _ = collectives.agree(find, "moeshard: checking the checkpoint to resume from", lambda r: r[1])
        return super().train(path, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective: the model as a Hugging Face checkpoint in ``output_dir`` (default
        ``args.output_dir``) by :func:`moeshard.save` (replacing one there), the placement file,
        and, on the main process, the processing class and the training arguments."""
        self._save(output_dir)
        if getattr(self.args, "push_to_hub", False) and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is not None:
            raise ValueError(
                "MoeshardTrainerMixin._save: a state_dict names the experts by slot, not by logical "
                "expert; the model is saved by moeshard.save (call save_model without one)"
            )
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model = self._moeshard_model()
        save(model, output_dir, overwrite=True)
        placement = model_placement(model)

        def write_main() -> None:
            if not self.args.should_save:
                return
            if placement is not None:
                write_placement(
                    placement,
                    os.path.join(output_dir, PLACEMENT_NAME),
                    format="moeshard",
                    modules=ep_layer_names(model),
                )
            processing = getattr(self, "processing_class", None)
            if processing is None:
                processing = getattr(getattr(self, "data_collator", None), "tokenizer", None)
            if processing is not None:
                processing.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, _TRAINING_ARGS_NAME))

        _agreed(write_main, "moeshard: saving the placement file, processing class and training arguments", SaveError)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Collective: every rank's local optimizer state (:func:`save_optimizer_state`); the
        scheduler on the main process, as the Trainer writes it."""
        with collectives.errors_as(SaveError):
            save_optimizer_state(self._moeshard_model(), self.optimizer, output_dir)

        def write_scheduler() -> None:
            if self.args.should_save and self.lr_scheduler is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the scheduler's "save the optimizer too" reminder
                    torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

        _agreed(write_scheduler, "moeshard: saving the scheduler", SaveError)

    def _save_scaler(self, output_dir: str) -> None:
        """Collective: the Trainer's own (the gradient scaler, if any, on the main process), agreed."""
        base = super()._save_scaler
        _agreed(lambda: base(output_dir), "moeshard: saving the gradient scaler", SaveError)

    def _save_rng_state(self, output_dir: str) -> None:
        """Collective: the Trainer's own (each rank's RNG file), agreed."""
        base = super()._save_rng_state
        _agreed(lambda: base(output_dir), "moeshard: saving the RNG state", SaveError)

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        """Collective: the Trainer's own (``save_model``, the optimizer, scheduler, scaler and RNG
        state, each agreed above; then, on the main process, the trainer state and the rotation
        of old checkpoints), its outcome agreed: a failure on any rank raises
        ``moeshard.SaveError`` on every rank."""
        failure: Exception | None = None
        try:
            super()._save_checkpoint(model, trial)
        except DistributedError:
            raise  # an agreed step: raised on every rank already
        except Exception as e:  # noqa: BLE001 - a local step's error must reach the other ranks
            failure = e

        def outcome() -> None:
            if failure is not None:
                raise failure

        _agreed(outcome, "moeshard: saving the checkpoint (trainer state)", SaveError)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Collective: the checkpoint's weights into the model, by :func:`moeshard.load` under
        the placement the model routes by (its failure on any rank: :class:`ResumeError` on
        every rank)."""
        model = self._moeshard_model() if model is None else model
        unwrap = getattr(getattr(self, "accelerator", None), "unwrap_model", None)
        with collectives.errors_as(ResumeError):
            load(unwrap(model, keep_torch_compile=False) if unwrap is not None else model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        """Collective: the best checkpoint's weights, by :func:`moeshard.load`."""
        load(self._moeshard_model(), self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Collective: the optimizer state (:func:`load_optimizer_state`: as saved under the same
        placement; through a relocation under another one; refused otherwise) and the
        scheduler. A checkpoint without moeshard optimizer state (``save_only_model``) leaves
        the optimizer fresh, as the Trainer does; one with the Trainer's own optimizer file
        instead is refused (its state is in slot order)."""
        if checkpoint is None:
            return
        has_ours = os.path.isdir(os.path.join(checkpoint, OPTIMIZER_DIR))
        theirs = [n for n in _TRAINER_OPTIMIZER_NAMES if os.path.exists(os.path.join(checkpoint, n))]

        def check() -> bool:
            if not has_ours and theirs:
                raise ValueError(
                    f"{checkpoint} holds the Trainer's own {theirs[0]}, not moeshard's optimizer "
                    f"state ({OPTIMIZER_DIR}/): it was not saved with MoeshardTrainerMixin and names "
                    "expert slots, not experts; resume with a fresh optimizer"
                )
            return has_ours

        with collectives.errors_as(ResumeError):
            if not collectives.agree(check, "moeshard: finding the optimizer state", fingerprint=str):
                return
        # "same" or "relocated" (load_optimizer_state), for the user's logs and the tests.
        self.moeshard_resumed = load_optimizer_state(self._moeshard_model(), self.optimizer, checkpoint)
        path = os.path.join(checkpoint, _SCHEDULER_NAME)

        def read_scheduler() -> dict | None:
            if self.lr_scheduler is None or not os.path.isfile(path):
                return None
            return torch.load(path, weights_only=True)

        with collectives.errors_as(ResumeError):
            state = collectives.agree(
                read_scheduler, "moeshard: reading the scheduler", fingerprint=lambda r: str(r is not None)
            )
        if state is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.lr_scheduler.load_state_dict(state)

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Collective: the Trainer's own (the gradient scaler's file, if any), agreed."""
        base = super()._load_scaler
        _agreed(lambda: base(checkpoint), "moeshard: loading the gradient scaler", ResumeError)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Collective: the Trainer's own (this rank's RNG file), agreed."""
        base = super()._load_rng_state
        _agreed(lambda: base(checkpoint), "moeshard: loading the RNG state", ResumeError)


@functools.cache
def moeshard_trainer(base_cls: type) -> type:
    """``MoeshardTrainerMixin`` put before ``base_cls`` (a transformers ``Trainer`` class): the
    same class for the same ``base_cls`` every call. ``moeshard_trainer(SFTTrainer)(model=...,
    args=..., ...)`` is an ``SFTTrainer`` that saves and resumes through moeshard."""
    if not isinstance(base_cls, type):
        raise ValueError(f"moeshard_trainer expects a Trainer class, got {base_cls!r}")
    if issubclass(base_cls, MoeshardTrainerMixin):
        return base_cls
    return type(
        f"Moeshard{base_cls.__name__}",
        (MoeshardTrainerMixin, base_cls),
        {"__module__": __name__, "__doc__": f"{base_cls.__name__} saving and resuming through moeshard."},
    )


try:  # the callback base class; the rest of this module needs no transformers import
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # pragma: no cover - transformers is this module's reason to exist
    _CallbackBase = object


class MoeshardRebalanceCallback(_CallbackBase):
    """A Trainer callback that rebalances the experts every ``every_n_steps`` optimizer steps
    from the router's counts: the tokens routed to each logical expert since the last rebalance
    (counted on the experts modules' inputs in training mode, summed over every rank),
    :func:`moeshard.eplb.rebalance` to a placement of the same slots (migration-aware by
    default: few copies move), and :func:`moeshard.relocate` with the optimizer, whose state
    moves with its experts, so training goes on as if nothing moved. Use with
    :class:`MoeshardTrainerMixin`: checkpoints then record the placement the model routes by.

    ``trainer = MyTrainer(..., callbacks=[MoeshardRebalanceCallback(every_n_steps=100)])``.
    ``num_nodes`` / ``num_groups``: as :func:`moeshard.eplb.rebalance` (hierarchical policy).
    ``history``: ``(global step, slots changed on this rank)`` of each rebalance.

    Collective (every rank), at the end of a step whose number divides by ``every_n_steps``:
    one all-reduce of the counts ``int64[num_moe_layers, num_logical]``, then the relocation.
    """

    def __init__(
        self, every_n_steps: int, *, num_nodes: int = 1, num_groups: int | None = None, migration_aware: bool = True
    ):
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive int, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.num_nodes, self.num_groups, self.migration_aware = num_nodes, num_groups, migration_aware
        self.history: list[tuple[int, int]] = []
        self._counts: list[torch.Tensor | None] = []
        self._hooked: nn.Module | None = None

    def _hook(self, model: nn.Module) -> None:
        """Count each experts module's ``top_k_index [T, K]`` (logical experts) per forward."""
        if self._hooked is model:
            return
        layers = ep_layers(model)
        if not layers:
            raise ValueError(
                "MoeshardRebalanceCallback: the model has no moeshard EP layers (parallelize it "
                "with moeshard's EP forward)"
            )
        self._counts = [None] * len(layers)
        for i, (module, ep) in enumerate(layers):
            if module.moeshard_kind != ROUTED:
                raise ValueError(
                    f"MoeshardRebalanceCallback: {type(module).__name__} takes pre-routed rows; "
                    "counting its tokens is not supported"
                )
            num_logical = len(ep.logcnt)

            def count(mod, args, kwargs, i=i, num_logical=num_logical):
                if not mod.training:
                    return
                idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
                with torch.no_grad():
                    c = torch.bincount(idx.reshape(-1), minlength=num_logical)
                    self._counts[i] = c if self._counts[i] is None else self._counts[i] + c

            module.register_forward_pre_hook(count, with_kwargs=True)
        self._hooked = model

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._hook(model)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step % self.every_n_steps:
            return
        self._hook(model)
        current = model_placement(model)
        device = (
            next((c.device for c in self._counts if c is not None), None) or _local(next(model.parameters())).device
        )
        load_ = torch.stack(
            [
                c if c is not None else torch.zeros(current.num_logical, dtype=torch.int64, device=device)
                for c in self._counts
            ]
        )
        if collectives.is_dist():
            torch.distributed.all_reduce(load_)
        self._counts = [None] * len(self._counts)
        new = rebalance(
            load_.cpu().numpy().astype(np.float64),
            current,
            num_physical=current.num_physical,
            num_ranks=current.num_ranks,
            num_nodes=self.num_nodes,
            num_groups=self.num_groups,
            migration_aware=self.migration_aware,
        )
        spr = current.num_physical // current.num_ranks
        ep_rank = ep_layers(model)[0][1].ep_rank
        mine = slice(ep_rank * spr, (ep_rank + 1) * spr)
        self.history.append((state.global_step, int((new.phy2log[:, mine] != current.phy2log[:, mine]).sum())))
        if not np.array_equal(new.phy2log, current.phy2log):
            relocate(model, current, new, optimizer=_inner_optimizer(optimizer) if optimizer is not None else None)
