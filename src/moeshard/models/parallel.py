"""``moeshard.parallelize``: expert parallelism + FSDP2 for a (meta-device) HF MoE model.

Mesh convention (torchtitan's): a 2D mesh ``("efsdp", "ep")`` with EP innermost, so an EP
group is ``ep`` consecutive ranks (one node, when EP fits in a node). Expert parameters
become DTensors whose global view is the physical tensor ``[num_physical, ...]`` (EP rank k
holds slots k*S..(k+1)*S-1, ``Shard(0)`` on "ep"); with efsdp > 1 FSDP2 shards them further
along dim 1 (``Shard(1)``, so the local box stays contiguous whatever the slot count). Every
other parameter gets ``fully_shard`` on the flattened data-parallel axis ("dp" = all ranks), or
with ``replicate > 1`` FSDP2's HSDP on a ``("replicate", "shard")`` mesh over the same ranks
(:mod:`moeshard.models.hsdp`: a full set of dense shards per replica group).
Mixed precision is FSDP2's own :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`, given to
every ``fully_shard`` here; the EP forward applies its ``param_dtype`` to the expert weights FSDP
ignores (efsdp == 1), see :mod:`moeshard.models.ep`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..placement import Placement
from .adapters import DEFAULT_SPECS, ExpertsSpec, expert_shape, identity_rows
from .describe import expert_layers
from .ep import EPLayer, ep_host, expose_placement, install_ep_forward
from .hsdp import HybridMesh, as_hybrid, dense_mesh
from .lora import expert_lora_wrappers, shard_expert_lora
from .slot_guard import SlotGuard, guard_model, guard_slots

__all__ = ["make_mesh", "parallelize"]


def make_mesh(device_type: str, ep: int, efsdp: int = 1, *, replicate: int = 1) -> DeviceMesh | HybridMesh:
    """Collective (all ranks): a ``("efsdp", "ep")`` mesh over all ranks (world = efsdp * ep).

    ``replicate > 1``: a :class:`~moeshard.models.hsdp.HybridMesh`, that mesh for the experts
    and a ``("replicate", "shard")`` mesh of ``replicate`` replica groups of ``world / replicate``
    consecutive ranks for the dense parameters (HSDP; :func:`parallelize` takes either).
    Raises ValueError when the sizes do not match the world size."""
    world = torch.distributed.get_world_size()
    if ep * efsdp != world:
        raise ValueError(f"ep={ep} x efsdp={efsdp} must equal the world size {world}")
    if replicate < 1 or world % replicate:
        raise ValueError(f"replicate={replicate} must be a positive divisor of the world size {world}")
    mesh = init_device_mesh(device_type, (efsdp, ep), mesh_dim_names=("efsdp", "ep"))
    return mesh if replicate == 1 else HybridMesh(mesh, dense_mesh(mesh, replicate))


def _dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    names = mesh.mesh_dim_names or ()
    if names == ("ep",):
        return mesh
    return mesh[tuple(names)]._flatten("dp")


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | HybridMesh,
    placement: Placement,
    specs: Sequence[ExpertsSpec] = DEFAULT_SPECS,
    ep_forward: bool = True,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    replicate: int = 1,
) -> nn.Module:
    """Collective (all ranks): shard ``model`` in place for EP (+ expert FSDP) and FSDP2.

    Args:
        model: built on the meta device (``with torch.device("meta")``); its experts modules'
            parameters are ``[num_logical, *slice_shape]``. A peft LoRA model
            (``get_peft_model``) works too: adapters on expert parameters (``target_parameters``)
            keep this rank's slots' rows of ``lora_A`` and columns of ``lora_B`` (see
            :mod:`moeshard.lora`); other adapters are sharded by FSDP2 like any parameter.
        mesh: from :func:`make_mesh` (dims "ep", optionally "efsdp"), or its
            :class:`~moeshard.models.hsdp.HybridMesh` (HSDP dense parameters).
        placement: num_physical must be a multiple of the EP size; its num_logical must
            match the model's expert count and its num_layers its MoE layer count.
        ep_forward: give experts modules the EP forward of :mod:`moeshard.models.ep` (tokens reach the
            ranks that hold their experts; the family's own experts math runs on the local
            slots): transformers' routed experts (``@use_experts_implementation``: Qwen3-MoE,
            Mixtral, gpt-oss, Aria, Nemotron-H, ...; LongCat-Flash's and DBRX's), Llama 4's
            pre-routed ones, JetMoE's grouped ones and Doge's embedding rows, see
            :func:`moeshard.models.ep.experts_kind`. Another transformers experts module gets a forward
            that raises NotImplementedError naming its class. A custom experts module (not from
            transformers, not ``gate_up_proj`` / ``down_proj`` / ``act_fn`` HF-style) keeps its
            forward, as every module does with ``ep_forward=False``: it must do its own dispatch
            over ``module.num_local_experts`` local slots (and :func:`moeshard.relocate` then
            needs ``routing="caller"``: moeshard cannot re-point such a forward).
        mp_policy: FSDP2's mixed-precision policy (``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)``: bf16 compute on float32 parameters), passed to every
            ``fully_shard`` (the expert FSDP's on "efsdp", every block's and the root's on "dp").
            With efsdp == 1 FSDP ignores the expert weights, so the EP forward casts them to
            ``param_dtype`` itself (with autograd: their gradients arrive in the parameters'
            dtype); the whole model then computes in ``param_dtype`` as FSDP2 alone would. A
            custom experts module that keeps its own forward (``ep_forward=False``, or not
            transformers' and not HF-style) must do that cast itself. None: no mixed precision.
            A module whose trainable parameters keep a dtype other than the rest of its block's
            (transformers' ``_keep_in_fp32_modules``: DeepSeek-V3's router stays float32 in a
            bf16 model) gets a ``fully_shard`` of its own (FSDP2 shards one dtype per group), and
            so computes in its own dtype as it does in transformers.
    Returns:
        the same model (call :func:`moeshard.load` next), with ``model.moeshard_mp_policy`` =
        the policy and a read-only ``model.moeshard_placement``: ``placement`` now, read from
        the experts modules' routing tables at every access, so it follows
        :func:`moeshard.relocate` (:func:`moeshard.models.ep.slot_placement`; the model's class
        becomes a subclass of its own adding that property, before FSDP2 wraps it).

        replicate: HSDP replica groups for the dense parameters (FSDP2's ``fully_shard`` on a
            ``("replicate", "shard")`` mesh, :func:`moeshard.models.hsdp.dense_mesh` of ``mesh``):
            every dense parameter is sharded within a replica group and held once per group.
            1 (default): FSDP on all ranks. A HybridMesh brings its own (``replicate`` must be 1
            or its degree).

    Raises:
        ValueError (before the model changes): ``replicate`` not dividing the ranks; with
            efsdp > 1, a parameter of an experts module whose dim 1 does not divide by efsdp
            (FSDP2 shards it there, evenly only);
            with efsdp > 1, a trainable parameter of an experts module outside its spec;
            an ``mp_policy`` that is not a ``MixedPrecisionPolicy``.
    """
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy()  # fully_shard's default: no casts
    elif not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy (FSDP2's), got "
            f"{type(mp_policy).__module__}.{type(mp_policy).__qualname__}"
        )
    mesh, dense = as_hybrid(mesh)
    if dense is not None and replicate not in (1, dense.size(0)):
        raise ValueError(f"replicate={replicate} differs from the HybridMesh's {dense.size(0)} replica groups")
    if replicate < 1 or mesh.size() % replicate:
        raise ValueError(f"replicate={replicate} must be a positive divisor of the mesh's {mesh.size()} ranks")
    names = mesh.mesh_dim_names or ()
    if "ep" not in names:
        raise ValueError(f"mesh must have an 'ep' dim, got dims {names}")
    ep_mesh = mesh["ep"]
    ep = ep_mesh.size()
    efsdp = mesh["efsdp"].size() if "efsdp" in names else 1
    spr = placement.slots_per_rank(ep)
    layers = expert_layers(model, specs)
    placement.check_layers(1 + max((e.layer for e in layers), default=-1))
    if efsdp > 1:
        _check_efsdp_dims(model, layers, efsdp, mesh.size())
        _check_whole_params(layers)
    # Modules to shard on their own for their dtype, found before anything changes: experts
    # modules (with their LoRA wrappers) are EP's or expert FSDP's, blocks the root's children.
    blocks = _blocks(model)
    opaque = {id(e.module) for e in layers} | {id(b) for b in blocks}
    opaque |= {id(w) for e in layers for w in expert_lora_wrappers(model, e.name, e.spec)}
    units = [(unit, _other_dtype_modules(unit, opaque - {id(unit)})) for unit in (*blocks, model)]
    expert_params: set[nn.Parameter] = set()
    slot_whole: set[nn.Parameter] = set()  # expert parameters expert FSDP leaves whole per slot
    names = {id(m): n for n, m in model.named_modules()}
    for module_name, module, spec, layer in layers:
        # peft LoRA on expert params (ParamWrappers around the module): per-slot local factors.
        wrappers = expert_lora_wrappers(model, module_name, spec)
        loras = tuple(shard_expert_lora(w, ep_mesh, placement) for w in wrappers)
        lora_b = {id(lora.b()) for lora in loras}
        expert_params.update(t for lora in loras for t in (lora.a(), lora.b()))
        for p in spec.params:
            old = getattr(module, p.name)
            # [experts, *slice] (a merged parameter, DBRX's [E * n, d], becomes [slots, n, d]).
            shape = expert_shape(module, spec, p)
            # Rows of identity ("zero") experts after the logical ones (LongCat-Flash's gate_up_proj)
            # are read by no forward: the EP parameter holds the placement's slots only.
            zero = identity_rows(module, p.name)
            if shape[0] != placement.num_logical + zero:
                also = f" + {zero} identity experts" if zero else ""
                raise ValueError(
                    f"{module_name}.{p.name} has {shape[0]} experts, the placement {placement.num_logical}{also}"
                )
            local = torch.empty((spr, *shape[1:]), dtype=old.dtype, device=old.device)
            # A frozen expert parameter FSDP2 cannot shard on dim 1 (per-expert scalars of a
            # packed model: ModelOpt's weight_scale_2 [S], compressed-tensors' global scales
            # [S, 1]) stays whole per slot, replicated over "efsdp" (expert FSDP leaves it out).
            whole_slot = efsdp > 1 and not old.requires_grad and (len(shape) < 2 or shape[1] % efsdp != 0)
            dt = DTensor.from_local(
                local,
                _experts_mesh(mesh) if whole_slot else ep_mesh,
                [Replicate(), Shard(0)] if whole_slot else [Shard(0)],
                run_check=False,
                shape=torch.Size((placement.num_physical, *shape[1:])),
                stride=_contiguous_stride((placement.num_physical, *shape[1:])),
            )
            new = nn.Parameter(dt, requires_grad=old.requires_grad)
            setattr(module, p.name, new)
            expert_params.add(new)
            if whole_slot:
                slot_whole.add(new)
        # The module now holds this rank's slots only; record the layout for forward code.
        module.num_local_experts = spr
        host = ep_host(model, module_name, module)  # whose forward runs the experts (DBRX: the parent)
        # The layer's routing table, the one record of the placement its slots hold: the EP
        # forward routes by it, the guards and model.moeshard_placement read it, and
        # set_placement (relocate) changes it. A module keeping its own forward has it too.
        host.moeshard_ep = EPLayer(
            layer,
            placement.phy2log[layer],
            placement.log2phy[layer],
            placement.logcnt[layer],
            spr,
            ep_mesh.get_local_rank(),
            ep_mesh.get_group(),
            1.0 / ep,
            tuple(p.name for p in spec.params),
            mp_policy.param_dtype,
        )
        # torch's state-dict paths must not read or write slots as experts (slot_guard's doc).
        guard_slots(module, SlotGuard(host, layer, tuple(p.name for p in spec.params), module_name))
        for lora in loras:  # A's rows are whole slots; B's columns interleave r with them
            w, a = lora.wrapper, lora.adapter
            for lin, r in ((w.lora_A[a], 0), (w.lora_B[a], w.r[a])):
                guard_slots(
                    lin,
                    SlotGuard(
                        host,
                        layer,
                        ("weight",),
                        names.get(id(lin), ""),
                        lora_rank=r,
                        saver="moeshard.lora.save_adapter(model, dir, placement=placement)",
                    ),
                )
        if efsdp > 1:
            # Shard(1), not Shard(0): the local box stays one contiguous run of whole slots
            # whether or not the slot count divides by efsdp (torchtitan's fallback).
            # LoRA B [out, r*S] shards its rows instead (its columns are EP's). On the module
            # whose forward is called, so that FSDP gathers the parameters before it runs.
            # The module's other parameters (frozen: _check_whole_params), e.g. a packed
            # gpt-oss's frozen expert biases, stay whole on every rank: sharded on "efsdp", each EP
            # group would hold its own copy on a mesh of its own, a tensor no description of
            # the model names alike on every rank.
            whole = {t for n, t in module.named_parameters(recurse=False) if n not in {p.name for p in spec.params}}
            whole |= {t for t in (getattr(module, p.name) for p in spec.params) if t in slot_whole}
            fully_shard(
                wrappers[-1] if wrappers else host,
                mesh=mesh["efsdp"],
                mp_policy=mp_policy,
                shard_placement_fn=lambda t, b=lora_b: Shard(0) if id(t) in b else Shard(1),
                ignored_params=whole or None,
            )
        installed = ep_forward and install_ep_forward(host, host.moeshard_ep, loras, holder=module)
        if loras and not installed:
            why = f"{type(module).__name__} is not an experts module it supports" if ep_forward else "ep_forward=False"
            raise ValueError(f"{module_name}: LoRA adapters on expert parameters need moeshard's EP forward ({why})")
    # A refused load_state_dict must copy nothing: the root checks every guarded module first.
    guard_model(model, {names[id(m)]: m for m in model.modules() if getattr(m, "moeshard_slot_guard", None)})
    # Where each logical expert is, for callers that did not keep it (from_pretrained's users):
    # derived from the routing tables (before fully_shard, which subclasses the class again).
    expose_placement(model)
    if dense is None and replicate > 1:
        dense = dense_mesh(mesh, replicate)
    dp = dense if dense is not None else _dp_mesh(mesh)
    ignored = expert_params if efsdp == 1 else slot_whole or None
    for unit, islands in units:
        for island in islands:
            fully_shard(island, mesh=dp, ignored_params=ignored, mp_policy=mp_policy)
        fully_shard(unit, mesh=dp, ignored_params=ignored, mp_policy=mp_policy)
    model.moeshard_mp_policy = mp_policy  # what the Trainer integration checks bf16/fp16 against
    return model


def _check_efsdp_dims(model: nn.Module, layers, efsdp: int, world: int) -> None:
    """Every parameter that expert FSDP will shard on dim 1 (each experts module's, or its peft
    wrappers', except LoRA B which shards dim 0) has a dim 1 that divides by ``efsdp``: FSDP2
    (torch 2.11 to 2.13) supports uneven sharding on dim 0 only, and otherwise fails deep in
    ``fully_shard`` without naming the parameter. EP sharding changes dim 0 only, so the
    unsharded shapes tell."""
    names = {id(m): n for n, m in model.named_modules()}
    for module_name, module, spec, _ in layers:
        wrappers = expert_lora_wrappers(model, module_name, spec)
        target = wrappers[-1] if wrappers else module
        lora_b = {id(lin.weight) for w in wrappers for lin in w.lora_B.values()}
        # The EP parameters' shapes (a merged one's dim 1 is its slice's dim 0).
        shapes = {id(getattr(module, p.name)): expert_shape(module, spec, p) for p in spec.params}
        for pname, p in target.named_parameters():
            shape = shapes.get(id(p), tuple(p.shape))
            if id(p) in lora_b or len(shape) < 2 or shape[1] % efsdp == 0:
                continue
            if id(p) in shapes and not p.requires_grad:  # kept whole per slot (_whole_per_slot)
                continue
            n = shape[1]
            fits = [d for d in range(1, world + 1) if world % d == 0 and n % d == 0]
            raise ValueError(
                f"parameter {names[id(target)]}.{pname} of shape {list(shape)}: expert FSDP shards its dim 1 "
                f"({n}) over efsdp={efsdp} ranks, and FSDP2 shards dims other than 0 only evenly; use an "
                f"efsdp size that divides {n} (of the sizes dividing the world size {world}: {fits}), or a "
                f"hidden / intermediate size that divides by {efsdp}"
            )


def _experts_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ``("efsdp", "ep")`` mesh of the expert parameters."""
    return mesh if tuple(mesh.mesh_dim_names or ()) == ("efsdp", "ep") else mesh["efsdp", "ep"]


def _check_whole_params(layers) -> None:
    """With efsdp > 1, every trainable parameter of an experts module is an expert parameter of
    its spec. Any other one (one row per logical expert) is whole on every EP
    rank, and the EP forward gathers its rows at the local slots' experts, so each EP rank
    computes its gradient from different tokens, which the expert FSDP (on "efsdp" only) would
    not reduce over "ep". A frozen one (a packed model's biases) stays whole on every rank."""
    for module_name, module, spec, _ in layers:
        names = {p.name for p in spec.params}
        extra = [n for n, p in module.named_parameters(recurse=False) if n not in names and p.requires_grad]
        if extra:
            raise ValueError(
                f"{module_name}: parameters {extra} of {type(module).__name__} are not expert "
                f"parameters of its spec ({sorted(names)}); with efsdp > 1 their gradients would not "
                "be reduced over the EP ranks: use efsdp=1, or freeze them (requires_grad=False)"
            )


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _other_dtype_modules(unit: nn.Module, opaque: set[int]) -> list[nn.Module]:
    """Submodules of ``unit`` whose trainable parameters have a dtype other than the rest of
    ``unit``'s (the dtype of most of its elements): transformers keeps some modules in float32
    in a bf16 model (``_keep_in_fp32_modules``: DeepSeek-V3's router), and FSDP2 needs one dtype
    of trainable parameters per ``fully_shard`` group, so each such module gets its own (and
    computes in its own dtype, as in transformers). Submodules whose ``id`` is in ``opaque``
    (sharded otherwise) and their parameters do not count. A module whose own parameters mix
    dtypes (a quantized layer kept with its scales, e.g. transformers' ``FP8Linear``) stays in
    ``unit``'s group: moving it would not give either group one dtype, and FSDP2 judges such a
    group itself when it runs.
    """
    owners: list[tuple[nn.Module, list[nn.Parameter]]] = []

    def walk(module: nn.Module) -> None:
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own:
            owners.append((module, own))
        for child in module.children():
            if id(child) not in opaque:
                walk(child)

    walk(unit)
    sizes: dict[torch.dtype, int] = {}
    for _, own in owners:
        for p in own:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) < 2:
        return []
    main = max(sizes, key=lambda dt: sizes[dt])
    return [module for module, own in owners if main not in {p.dtype for p in own}]


def _blocks(model: nn.Module) -> list[nn.Module]:
    """Transformer blocks: children of the first ModuleList named 'layers'."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.endswith("layers"):
            return list(mod)
    return []
