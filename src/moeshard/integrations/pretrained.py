"""``moeshard.from_pretrained``: one collective call from a checkpoint directory to a
parallelized, loaded model, where transformers needs one ``from_pretrained`` call.

It is the manual recipe, step for step: read ``config.json`` (one rank, strictly), build the
transformers model on the meta device, choose the placement, make the ``("efsdp", "ep")`` mesh,
:func:`~moeshard.parallelize`, :func:`~moeshard.load`, optionally :func:`~moeshard.verify`.

Sizes, in transformers' and torchtitan's words (moeshard keeps ``ep`` and ``efsdp``; the dense
parameters are always FSDP2-sharded over every rank, and there is no tensor parallelism):

==========================  ===========================================  ============================================
moeshard                    transformers ``DistributedConfig``           torchtitan ``[parallelism]``
==========================  ===========================================  ============================================
``ep``                      ``ep_size``                                  ``expert_parallel_degree``
``efsdp``                   ``efsdp_size`` (= ``fsdp_size // ep_size``)  the ``efsdp`` mesh dim (``dp_shard // ep``)
``ep * efsdp`` (the world)  ``fsdp_size``                                ``data_parallel_shard_degree`` (dp_shard)
==========================  ===========================================  ============================================

So ``DistributedConfig(fsdp_size=W, ep_size=E)`` is ``from_pretrained(path, ep=E, efsdp=W // E)``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from .. import collectives
from ..io.placement_files import NAMED_PLACEMENTS, moe_layer_indices, named_placement, read_placement_file
from ..io.sources import Storage
from ..models.build import MoELayout, meta_model, moe_layout, read_config
from ..models.parallel import make_mesh, parallelize
from ..ops.load import load
from ..ops.verify import verify as verify_model
from ..placement import Placement

__all__ = ["from_pretrained", "job_device"]

T = TypeVar("T")
# The default process group that the cached meshes belong to and {(device type, ep, efsdp):
# mesh}: :func:`_mesh`. It holds the default group object itself, so that a destroyed and
# re-initialized group (a new object) never finds an old group's mesh.
_MESH_CACHE: dict = {"default": None, "meshes": {}}
_STORAGE = ("auto", "shared", "node", "single")
# Backends that only move host tensors: their jobs keep the model on the CPU.
_CPU_BACKENDS = frozenset({"gloo", "mpi"})


def job_device() -> torch.device:
    """The device of the default process group's job: the CPU under a host-only backend (gloo,
    MPI), else the current accelerator device (NCCL: ``cuda:<torch.cuda.current_device()>``,
    which the job sets per rank, e.g. ``torch.cuda.set_device(LOCAL_RANK)``).

    Raises:
        ValueError: no process group, or an accelerator backend with no accelerator.
    """
    if not collectives.is_dist():
        raise ValueError(
            "no torch.distributed process group: initialize one first (torchrun, then "
            "torch.distributed.init_process_group())"
        )
    backend = str(dist.get_backend())
    if backend in _CPU_BACKENDS:
        return torch.device("cpu")
    if not torch.accelerator.is_available():
        raise ValueError(f"the process group's backend is {backend!r}, but no accelerator is available here")
    kind = torch.accelerator.current_accelerator().type
    return torch.device(kind, torch.accelerator.current_device_index())


def from_pretrained(
    path: str | os.PathLike,
    *,
    ep: int,
    efsdp: int = 1,
    dtype: torch.dtype | str | None = None,
    placement: Placement | str | os.PathLike | None = None,
    num_redundant: int = 0,
    placement_format: str | None = None,
    storage: Storage = "auto",
    mp_policy: MixedPrecisionPolicy | None = None,
    verify: bool = False,
    device: torch.device | str | None = None,
    strict: bool = True,
    progress: bool | None = None,
) -> nn.Module:
    """Collective (every rank of the default process group, with the same arguments): the
    transformers model of checkpoint ``path``, expert-parallel over ``ep`` ranks, its experts
    FSDP2-sharded over ``efsdp``, every other parameter FSDP2-sharded over all ranks, and loaded.

    Args:
        path: a Hugging Face checkpoint directory (``config.json`` and ``*.safetensors``, e.g.
            from ``save_pretrained`` or :func:`moeshard.save`). ``config.json`` is read by the
            first rank that sees it and sent to the others (any ``storage`` mode).
        ep: EP size (transformers' ``ep_size``, torchtitan's ``expert_parallel_degree``).
        efsdp: expert-FSDP size (transformers' ``efsdp_size``); ``ep * efsdp`` must be the world
            size (transformers' ``fsdp_size``, torchtitan's ``dp_shard``). See the module doc.
        dtype: the parameters' dtype (a torch dtype or its name); None or ``"auto"``: the
            config's ``dtype``, as transformers' ``from_pretrained`` does (float32 if it names
            none). Mixed-precision training wants float32 here and ``mp_policy``.
        placement: which logical expert each physical slot holds: a :class:`Placement`, a
            placement file (any format :mod:`moeshard.io.placement_files` reads, read by the
            first rank that sees it; ``placement_format`` to skip the sniffing), or a named one
            (``"vllm:linear"``...). None: contiguous, with ``num_redundant`` extra copies per
            layer (:meth:`Placement.contiguous`).
        storage: which ranks read the checkpoint (:func:`moeshard.load`).
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (:func:`moeshard.parallelize`), e.g.
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``.
        verify: after loading, check every local box against the checkpoint's bytes
            (:func:`moeshard.verify`; reads the checkpoint a second time).
        device: where the model lives; None: :func:`job_device` (CPU under gloo, the current
            CUDA device under NCCL). The mesh is made on its device type.
        strict, progress: as :func:`moeshard.load` (and ``strict`` for ``verify``).

    Returns:
        the model (an ``FSDPModule``; ``model(input_ids=...)`` as transformers' own). Its
        placement is ``model.moeshard_placement`` (a :class:`Placement`, read-only, read from
        the routing tables that :func:`moeshard.relocate` changes): pass it to
        :func:`moeshard.save`, ``relocate`` and the EPLB policies. Expert parameters are
        DTensors ``[num_physical, ...]`` in slot order.

    Raises:
        ValueError: on every rank, before any weight is read, naming what was expected: no
            process group; ``ep * efsdp`` not the world size; a missing or malformed
            ``config.json``; a model with no experts moeshard knows; a placement for another
            number of MoE layers, logical experts or EP ranks; arguments that differ between
            ranks; what :func:`moeshard.parallelize` refuses (efsdp not dividing the experts'
            dim 1). Where only some ranks failed, the others' ValueError names them and their
            errors.
        DistributedError: as :func:`moeshard.load` and :func:`moeshard.verify` (a checkpoint
            that does not fit the model, a wrong slice).
    """
    if not collectives.is_dist():
        raise ValueError(
            "moeshard.from_pretrained is collective: initialize torch.distributed first (torchrun, "
            "then torch.distributed.init_process_group())"
        )
    what = "moeshard.from_pretrained"
    given_path = path

    def arguments():
        checked = _checked(ep, efsdp, dtype, placement, num_redundant, storage, mp_policy, device)
        return checked, _path(given_path), _placement_path(placement)

    # One exchange: every rank's argument errors, a digest of its arguments (they must be the
    # same everywhere) and which ranks see config.json and the placement file (read by the
    # first that does).
    args = repr(
        (
            ep,
            efsdp,
            dtype,
            num_redundant,
            placement_format,
            storage,
            mp_policy,
            verify,
            strict,
            _placement_key(placement),
        )
    )
    ((dtype_, device_), path, placement_file), seen = _agreed(
        arguments,
        f"{what}: checking the arguments",
        share=lambda checked: (
            hashlib.blake2b(args.encode(), digest_size=8).hexdigest(),
            os.path.isfile(os.path.join(checked[1], "config.json")),
            checked[2] is not None and os.path.isfile(checked[2]),
        ),
    )
    config_file = os.path.join(path, "config.json")
    if len({s[0] for s in seen}) > 1:
        ranks = {}
        for r, s in enumerate(seen):
            ranks.setdefault(s[0], []).append(r)
        raise ValueError(
            f"{what}: the ranks passed different arguments (ranks grouped by their arguments: "
            f"{sorted(ranks.values())}); every rank must pass the same ep, efsdp, dtype, placement, "
            f"num_redundant, placement_format, storage, mp_policy, verify and strict"
        )
    config = _on_one_rank(_first(seen, 1), lambda: read_config(path), f"{what}: reading {config_file}")
    if placement_file is None:
        # No file to read between them: the build and the placement agreed in one exchange.
        model, layout, placement_ = _agreed(
            lambda: _build_and_place(config, dtype_, path, placement, ep, num_redundant),
            f"{what}: building the model on the meta device and choosing the placement",
            fingerprint=lambda built: built[2].fingerprint(),
        )
    else:
        model, layout = _agreed(lambda: _build(config, dtype_, path), f"{what}: building the model on the meta device")
        read = _on_one_rank(
            _first(seen, 2),
            lambda: read_placement_file(
                placement_file, format=placement_format, moe_layers=moe_layer_indices(layout.modules)
            ),
            f"{what}: reading the placement file {placement_file}",
        )
        placement_ = _agreed(
            lambda: _placement(placement, read, layout, ep, num_redundant, path),
            f"{what}: choosing the placement",
            fingerprint=lambda p: p.fingerprint(),
        )
    mesh = _mesh(device_.type, ep, efsdp)
    parallelize(model, mesh, placement_, mp_policy=mp_policy)
    load(model, path, placement=placement_, storage=storage, device=device_, strict=strict, progress=progress)
    if verify:
        verify_model(model, path, placement=placement_, storage=storage, strict=strict)
    return model


def _mesh(device_type: str, ep: int, efsdp: int):
    """Collective (every rank of the default group, with the same arguments): the
    ``("efsdp", "ep")`` mesh of :func:`moeshard.models.parallel.make_mesh`, made once per default
    process group and sizes and reused by later calls (its process groups, and the flattened
    "dp" mesh that :func:`moeshard.parallelize` derives and torch keeps on it, are not created
    again on every call: nothing frees them). Every rank calls with the same arguments in the
    same order, so every rank hits or misses alike and the creation stays matched."""
    default = dist.distributed_c10d._get_default_group()
    cache = _MESH_CACHE
    if cache["default"] is not default:
        cache.update(default=default, meshes={})
    key = (device_type, ep, efsdp)
    mesh = cache["meshes"].get(key)
    if mesh is None:
        mesh = cache["meshes"][key] = make_mesh(device_type, ep=ep, efsdp=efsdp)
    return mesh


def _checked(ep, efsdp, dtype, placement, num_redundant, storage, mp_policy, device):
    """The arguments' errors (ValueError naming what was expected); ``(dtype, device)`` resolved."""
    world = dist.get_world_size()
    for name, v in (("ep", ep), ("efsdp", efsdp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if ep * efsdp != world:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"ep={ep} x efsdp={efsdp} must equal the world size {world} (transformers' fsdp_size): "
            f"ep must divide {world} (one of {fits}) and efsdp be {world} // ep"
        )
    if isinstance(num_redundant, bool) or not isinstance(num_redundant, int) or num_redundant < 0:
        raise ValueError(f"num_redundant must be an int >= 0, got {num_redundant!r}")
    if num_redundant and placement is not None:
        raise ValueError(
            "num_redundant applies to the default (contiguous) placement only; the placement given has its own copies"
        )
    if not (placement is None or isinstance(placement, (Placement, str, os.PathLike))):
        raise ValueError(
            f"placement must be a moeshard.Placement, a placement file path or one of "
            f"{NAMED_PLACEMENTS}, got {type(placement).__name__}"
        )
    if storage not in _STORAGE:
        raise ValueError(f"storage must be one of {_STORAGE}, got {storage!r}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy (FSDP2's), got "
            f"{type(mp_policy).__qualname__}"
        )
    return _dtype(dtype), _device(device)


def _dtype(dtype) -> torch.dtype | None:
    if dtype is None or dtype == "auto":
        return None
    out = dtype
    if isinstance(dtype, str):
        out = getattr(torch, dtype, None) if dtype.isidentifier() else None
    if not isinstance(out, torch.dtype) or not out.is_floating_point:
        raise ValueError(
            f"dtype must be a floating torch dtype (torch.bfloat16, 'float32'), 'auto' or None; got {dtype!r}"
        )
    return out


def _device(device) -> torch.device:
    job = job_device()
    if device is None:
        return job
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    if dev.type != job.type:
        raise ValueError(
            f"device {dev} does not fit the process group (backend {dist.get_backend()!r}: {job.type} tensors)"
        )
    if dev.index is not None and job.index is not None and dev.index != job.index:
        # The device mesh and the collectives use the current device.
        raise ValueError(
            f"device {dev} is not this rank's current {dev.type} device ({job}): set it first "
            f"(torch.{dev.type}.set_device)"
        )
    return dev if dev.index is not None or job.index is None else job


def _path(path) -> str:
    """The checkpoint directory's path as a string (ValueError for anything but a path)."""
    try:
        return os.fspath(path)
    except TypeError:
        raise ValueError(f"path must be a checkpoint directory (str or os.PathLike), got {path!r}") from None


def _placement_path(placement) -> str | None:
    """The placement file to read, or None (a Placement, a named placement, the default)."""
    if isinstance(placement, (str, os.PathLike)):
        p = os.fspath(placement)
        if not (p in NAMED_PLACEMENTS and not os.path.exists(p)):
            return p
    return None


def _placement_key(placement) -> str | None:
    """What ranks must agree on about ``placement``, before any file is read."""
    if isinstance(placement, Placement):
        return placement.fingerprint()
    return None if placement is None else os.fspath(placement) if isinstance(placement, (str, os.PathLike)) else "?"


def _build(config: dict, dtype: torch.dtype | None, path: str) -> tuple[nn.Module, MoELayout]:
    """Every rank, no communication: the meta-device model of ``config`` and its MoE layout."""
    model = meta_model(config, dtype, source=path)
    return model, moe_layout(model, source=path)


def _build_and_place(
    config: dict, dtype: torch.dtype | None, path: str, given, ep: int, num_redundant: int
) -> tuple[nn.Module, MoELayout, Placement]:
    """Every rank, no communication: :func:`_build`, then the placement (``given``: a
    :class:`Placement`, a named one or None; not a file) checked against its MoE layers."""
    model, layout = _build(config, dtype, path)
    return model, layout, _placement(given, None, layout, ep, num_redundant, path)


def _placement(given, read, layout: MoELayout, ep: int, num_redundant: int, path: str) -> Placement:
    """The job's placement, checked against the model's MoE layers (``read``: the placement
    file's content, when ``given`` names one)."""
    L, E = layout.num_layers, layout.num_logical
    if given is None:
        if (E + num_redundant) % ep:
            raise ValueError(
                f"the model {path} has {E} logical experts per layer; with num_redundant={num_redundant} "
                f"copies they do not fill EP={ep} ranks evenly: pass num_redundant="
                f"{num_redundant + (-(E + num_redundant)) % ep} or a placement whose slots per layer "
                f"are a multiple of {ep}"
            )
        return Placement.contiguous(L, E, ep, num_redundant)
    if read is not None:
        where = f"placement file {os.fspath(given)}"
        p2l = read.phy2log
        for name, have, want in (("num_logical", read.num_logical, E), ("num_ranks", read.num_ranks, ep)):
            if have is not None and have != want:
                raise ValueError(
                    f"{where} was written for {name}={have}; the model {path} has {E} logical experts "
                    f"and the job EP size {ep}"
                )
        try:
            given = Placement(p2l, num_logical=E, num_ranks=ep)
        except ValueError as e:
            raise ValueError(
                f"{where} (key '{read.key}'), for the model {path} ({E} logical experts per layer, EP={ep}): {e}"
            ) from None
    elif isinstance(given, (str, os.PathLike)):
        where = f"named placement {given}"
        given = named_placement(
            os.fspath(given), num_layers=L, num_logical=E, num_ranks=ep, num_redundant=num_redundant
        )
    else:
        where = "the placement"
    if given.num_layers != L or given.num_logical != E:
        raise ValueError(
            f"{where} describes {given.num_layers} MoE layers of {given.num_logical} logical experts; "
            f"the model {path} has {L} MoE layers ({', '.join(layout.modules[:2])}"
            f"{', ...' if L > 2 else ''}) of {E} logical experts"
        )
    if given.num_physical % ep or (given.num_ranks is not None and given.num_ranks != ep):
        raise ValueError(
            f"{where} has {given.num_physical} slots per layer for EP size {given.num_ranks}; the job "
            f"has EP size {ep} (slots per layer must be a multiple of it)"
        )
    return given


def _first(seen: list, i: int) -> int:
    """The first rank whose share says it sees file ``i`` (0 when none: its read names the
    missing file)."""
    return next((r for r, s in enumerate(seen) if s[i]), 0)


def _agreed(
    step: Callable[[], T],
    what: str,
    fingerprint: Callable[[T], str] | None = None,
    share: Callable[[T], Any] | None = None,
):
    """Collective: ``step`` on every rank (:func:`moeshard.collectives.agree`; with ``share``:
    ``(result, every rank's share)`` as :func:`moeshard.collectives.agree_and_gather`). Input errors
    are ValueErrors on every rank: a rank's own where it failed, else one naming the ranks that
    failed (or disagree) and why."""
    own: list[BaseException] = []

    def run():
        try:
            return step()
        except Exception as e:
            own.append(e)
            raise

    try:
        if share is None:
            return collectives.agree(run, what, fingerprint)
        return collectives.agree_and_gather(run, what, share)
    except collectives.PeerLostError:
        raise
    except collectives.DistributedError as e:
        if own:
            raise own[0] from None
        raise ValueError(str(e)) from None


def _on_one_rank(src: int, step: Callable[[], T], what: str) -> T:
    """Collective: ``step()`` on rank ``src`` only, its result on every rank; its ValueError a
    ValueError on every rank (``src`` raises its own)."""
    rank = dist.get_rank()
    payload: tuple[str | None, Any] = (None, None)
    own = None
    if rank == src:
        try:
            payload = (None, step())
        except collectives.PeerLostError:
            raise
        except Exception as e:  # noqa: BLE001 - every rank must raise
            own = e
            payload = (f"{type(e).__name__}: {e}", None)
    error, result = collectives.broadcast_object(payload, src=src, what=what)
    if error is None:
        return result
    if own is not None and isinstance(own, ValueError):
        raise own
    raise ValueError(f"{what}: rank {src}: {error}")
