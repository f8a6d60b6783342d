"""Checkpoint keys <-> model parameters.

Non-expert parameters are stored under their own name (identity), or under the name of a
parameter they are tied to (``lm_head.weight`` <-> ``model.embed_tokens.weight``).

Expert parameters are fused in memory and split per expert on disk. An :class:`ExpertsSpec`
declares, for one kind of experts module, how each fused parameter is assembled:

* HF transformers 5 (Qwen3-MoE, DeepSeek-V3, ...)::

      gate_up_proj [E, 2I, H] = concat(experts.{e}.gate_proj.weight [I, H],
                                       experts.{e}.up_proj.weight   [I, H]) along dim 0
      down_proj    [E, H, I]  = experts.{e}.down_proj.weight [H, I]

* A custom (torchtitan-style) model declares its own::

      ExpertsSpec(module=r"moe\\.experts$", params=(
          ExpertParam("w1", ("{e}.w1.weight",)),
          ExpertParam("w2", ("{e}.w2.weight",)),
          ExpertParam("w3", ("{e}.w3.weight",))))

Key templates are relative to the experts module's name (``{e}`` is the logical expert id);
``dim`` is the dim of the per-expert slice (the expert dim excluded) along which the parts
are concatenated. Part sizes along ``dim`` come from the checkpoint's headers.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from ..box import Box
from ..io.formats import SCALE_SUFFIXES

__all__ = [
    "ExpertParam",
    "ExpertsSpec",
    "HF_EXPERTS",
    "MIXTRAL_EXPERTS",
    "HF_UNGATED_EXPERTS",
    "JETMOE_EXPERTS",
    "DBRX_EXPERTS",
    "DOGE_EXPERTS",
    "GPT_OSS_EXPERTS",
    "MXFP4_EXPERTS",
    "MODELOPT_EXPERTS",
    "COMPRESSED_EXPERTS",
    "PACKED_SPECS",
    "packed_tensor_names",
    "DEFAULT_SPECS",
    "KEY_RENAMES",
    "IDENTITY_EXPERTS",
    "checkpoint_names",
    "class_names",
    "expert_params",
    "expert_parts",
    "expert_shape",
    "identity_experts",
    "identity_rows",
    "num_logical_experts",
    "read_expert_box",
    "routed_block",
    "specs_for",
    "with_scales",
]


@dataclass(frozen=True)
class ExpertParam:
    """One fused expert parameter ``[num_experts, *slice_shape]`` of an experts module.

    ``parts``: key templates relative to the experts module, ``{e}`` the logical expert id
    (``"{e}.gate_proj.weight"``). A parameter whose one part has no ``{e}`` is *fused on disk*
    (:attr:`fused`): that one checkpoint tensor holds every expert, ``[num_logical,
    *slice_shape]`` with expert ``e`` at row ``e``, as gpt-oss and Llama 4 ship them.
    """

    name: str
    parts: tuple[str, ...]
    dim: int = 0
    merged: bool = False

    @property
    def fused(self) -> bool:
        """Whether the checkpoint holds this parameter fused (one tensor, every expert)."""
        return len(self.parts) == 1 and "{e" not in self.parts[0]

    # ``merged`` (fused only): the expert dim is merged into the slice's dim 0, on disk and in
    # an unsharded model: ``[num_logical * n, *rest]`` for slices ``[n, *rest]``, expert ``e`` at
    # rows ``e*n .. (e+1)*n`` (DBRX's ``w1`` / ``v1`` / ``w2``); an EP model holds it
    # ``[num_physical, n, *rest]``.

    def keys(self, prefix: str, expert: int) -> tuple[str, ...]:
        return tuple(f"{prefix}.{p.format(e=expert)}" if prefix else p.format(e=expert) for p in self.parts)


@functools.lru_cache(maxsize=1024)
def class_names(cls: type) -> frozenset[str]:
    """The names of ``cls`` and its bases (a class FSDP2 made for a module it shards keeps the
    original among its bases)."""
    return frozenset(c.__name__ for c in cls.__mro__)


@dataclass(frozen=True)
class ExpertsSpec:
    """Which modules are experts modules (``module``: a regex searched in the module's
    qualified name; ``classes``: where given, the names of the classes one of which the module
    must be an instance of) and how their fused parameters map to per-expert checkpoint keys.

    ``routed_by_parent``: the experts modules of this spec under one parent module are driven
    by one router, the parent's (JetMoE's ``input_linear`` and ``output_linear``, Doge's
    ``down_embed`` and ``up_embed``): together they are one MoE layer, one placement row
    (:func:`routed_block`). Otherwise each experts module is a MoE layer of its own."""

    module: str
    params: tuple[ExpertParam, ...]
    classes: frozenset[str] = frozenset()
    count: str = ""  # the module's attribute giving its number of experts, where a merged parameter hides it
    routed_by_parent: bool = False

    def matches(self, module_name: str, param_names: set[str], module=None) -> bool:
        # The names first: most modules fail there, without a regex search.
        if not all(p.name in param_names for p in self.params):
            return False
        if self.classes and (module is None or self.classes.isdisjoint(class_names(type(module)))):
            return False
        return re.search(self.module, module_name) is not None


HF_EXPERTS = ExpertsSpec(
    module=r"(^|\.)experts$",
    params=(
        ExpertParam("gate_up_proj", ("{e}.gate_proj.weight", "{e}.up_proj.weight")),
        ExpertParam("down_proj", ("{e}.down_proj.weight",)),
    ),
)
MIXTRAL_EXPERTS = ExpertsSpec(
    module=r"(^|\.)experts$",
    params=(
        ExpertParam("gate_up_proj", ("{e}.w1.weight", "{e}.w3.weight")),
        ExpertParam("down_proj", ("{e}.w2.weight",)),
    ),
)
# Experts without a gate (NemotronH: ``up_proj`` [E, I, H], ``down_proj`` [E, H, I]).
HF_UNGATED_EXPERTS = ExpertsSpec(
    module=r"(^|\.)experts$",
    params=(
        ExpertParam("up_proj", ("{e}.up_proj.weight",)),
        ExpertParam("down_proj", ("{e}.down_proj.weight",)),
    ),
)
# JetMoE's experts: every ``JetMoeParallelExperts`` (the MoE MLP's ``mlp.input_linear`` /
# ``mlp.output_linear`` and the mixture-of-attention-heads' ``self_attention.experts.input_linear``
# / ``output_linear``) is an experts module of its own, one ``weight`` [E, out, in], fused on disk
# under its own name (``...input_linear.weight``).
JETMOE_EXPERTS = ExpertsSpec(
    module=r"(^|\.)(input|output)_linear$",
    params=(ExpertParam("weight", ("weight",)),),
    classes=frozenset({"JetMoeParallelExperts"}),
    routed_by_parent=True,  # the block's router (``mlp.router``, ``self_attention.experts.router``) drives both
)
# DBRX's experts: ``ffn.experts.mlp`` (DbrxExpertGLU) holds w1 (gate), v1 (up) and w2 (down, used
# transposed), each ``[num_experts * ffn_hidden_size, d_model]``, merged on disk as in memory.
DBRX_EXPERTS = ExpertsSpec(
    module=r"(^|\.)experts\.mlp$",
    params=tuple(ExpertParam(n, (n,), merged=True) for n in ("w1", "v1", "w2")),
    classes=frozenset({"DbrxExpertGLU"}),
    count="moe_num_experts",
)
# Doge's retrieval experts (DogeCDMoE, config.is_moe): expert ``e`` is row ``e`` of two embedding
# tables, ``mlp.down_embed`` and ``mlp.up_embed`` (``weight`` [E, hidden] each, under their own
# names on disk); each table is an experts module of its own, looked up by expert id.
DOGE_EXPERTS = ExpertsSpec(
    module=r"(^|\.)mlp\.(down|up)_embed$",
    params=(ExpertParam("weight", ("weight",)),),
    classes=frozenset({"Embedding"}),
    routed_by_parent=True,  # ``mlp.router_gate`` picks the ids both tables are looked up by
)
# gpt-oss's experts: ``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]`` and their biases
# ``gate_up_proj_bias`` ``[E, 2I]`` and ``down_proj_bias`` ``[E, H]``, each fused on disk under its
# own name; the biases are expert parameters like the weights (a row per expert, which moves with
# its expert and is trained on its expert's tokens).
GPT_OSS_EXPERTS = ExpertsSpec(
    module=r"(^|\.)experts$",
    params=tuple(ExpertParam(n, (n,)) for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")),
    classes=frozenset({"GptOssExperts"}),
)
# gpt-oss experts kept in MXFP4 as its checkpoints store them (a serving model, a frozen
# quantized base): ``gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]`` (two E2M1 values per byte)
# and ``gate_up_proj_scales`` uint8 ``[E, 2I, H/32]`` (E8M0), ``down_proj_blocks`` ``[E, H, I/32,
# 16]`` and ``down_proj_scales`` ``[E, H, I/32]``, each fused on disk under its own name; the
# packed bytes and their scales are expert parameters that load, move and save unchanged. The
# float biases stay whole tensors, as in the float module.
MXFP4_EXPERTS = ExpertsSpec(
    module=r"(^|\.)experts$",
    params=tuple(
        ExpertParam(f"{proj}_{kind}", (f"{proj}_{kind}",))
        for proj in ("gate_up_proj", "down_proj")
        for kind in ("blocks", "scales")
    ),
)


def _compressed_experts(tensors: tuple[str, ...]) -> ExpertsSpec:
    """HF-style experts kept compressed as compressed-tensors stores each expert's linear
    layers: every tensor ``<t>`` of ``tensors`` (``weight_packed``, ``weight_scale``, ...) of
    ``experts.{e}.gate_proj`` + ``up_proj`` is parameter ``gate_up_proj_<t>`` (the two stacked
    along dim 0, as ``gate_up_proj`` is from their weights), of ``down_proj`` ``down_proj_<t>``:
    e.g. ``gate_up_proj_weight_packed`` int32 ``[E, 2I, H/8]``, ``gate_up_proj_weight_scale``
    ``[E, 2I, H/group]``, ``gate_up_proj_weight_shape`` ``[E, 4]`` (the two ``[2]`` shapes)."""
    return ExpertsSpec(
        module=r"(^|\.)experts$",
        params=tuple(
            ExpertParam(f"{fused}_{t}", tuple(f"{{e}}.{part}.{t}" for part in parts))
            for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))
            for t in tensors
        ),
    )


def _per_projection(tensors: tuple[str, ...]) -> tuple[ExpertParam, ...]:
    """One expert parameter ``<proj>_<t>`` ``[E]`` per projection (``gate_proj``, ``up_proj``,
    ``down_proj``) and scalar tensor ``<t>`` of ``tensors`` stored per expert as a 0-d tensor
    (``experts.{e}.<proj>.<t>``, ModelOpt's ``weight_scale_2`` and ``input_scale``)."""
    return tuple(
        ExpertParam(f"{proj}_{t}", (f"{{e}}.{proj}.{t}",))
        for t in tensors
        for proj in ("gate_proj", "up_proj", "down_proj")
    )


# HF-style experts kept in ModelOpt NVFP4 as its checkpoints store each expert's linear layers:
# ``gate_up_proj_weight`` uint8 ``[E, 2I, H/2]`` (two E2M1 values per byte; gate then up rows),
# ``gate_up_proj_weight_scale`` float8_e4m3fn ``[E, 2I, H/16]``, ``down_proj_*`` likewise, and the
# per-expert scalars ``<proj>_weight_scale_2`` / ``<proj>_input_scale`` float32 ``[E]`` for each
# of ``gate_proj``, ``up_proj`` and ``down_proj`` (0-d on disk).
MODELOPT_EXPERTS = ExpertsSpec(
    module=r"(^|\.)experts$",
    params=_compressed_experts(("weight", "weight_scale")).params + _per_projection(("weight_scale_2", "input_scale")),
)


# Experts kept compressed (a serving model, a frozen quantized base under LoRA), one spec per
# set of tensors compressed-tensors writes, the largest first (a module matches the first spec
# whose parameters it has all of): NVFP4 (``nvfp4-pack-quantized``), INT4 with a zero point and
# without (``pack-quantized``, Kimi-K2-Thinking's routed experts).
COMPRESSED_EXPERTS: tuple[ExpertsSpec, ...] = tuple(
    _compressed_experts(t)
    for t in (
        ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
        ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"),
        ("weight_packed", "weight_scale", "weight_shape"),
    )
)
# The specs of experts kept packed: transformers reads their tensors through its quantizer
# (mxfp4, compressed-tensors), not through the family's converters.
PACKED_SPECS: tuple[ExpertsSpec, ...] = (MXFP4_EXPERTS, MODELOPT_EXPERTS, *COMPRESSED_EXPERTS)
DEFAULT_SPECS: tuple[ExpertsSpec, ...] = (
    GPT_OSS_EXPERTS,  # before HF_EXPERTS, whose parameters a GptOssExperts has too
    HF_EXPERTS,
    MIXTRAL_EXPERTS,
    HF_UNGATED_EXPERTS,
    JETMOE_EXPERTS,
    DBRX_EXPERTS,
    DOGE_EXPERTS,
    *PACKED_SPECS,
)


@functools.lru_cache(maxsize=1)
def packed_tensor_names() -> tuple[frozenset[str], frozenset[str]]:
    """``(parameter names, checkpoint leaf names)`` of experts kept packed (:data:`PACKED_SPECS`):
    ``gate_up_proj_blocks``, ``gate_up_proj_weight_packed``, ...; ``gate_up_proj_blocks``,
    ``weight_packed``, ``weight_scale``, ..."""
    params = frozenset(p.name for s in PACKED_SPECS for p in s.params)
    leaves = frozenset(part.rpartition(".")[2] for s in PACKED_SPECS for p in s.params for part in p.parts)
    return params, leaves


def routed_block(name: str, spec: ExpertsSpec) -> str:
    """The routed block (one router, one MoE layer, one placement row) of experts module
    ``name`` of ``spec``: the module itself, or its parent for a spec ``routed_by_parent``
    (``model.layers.0.mlp.input_linear`` -> ``model.layers.0.mlp``)."""
    return name.rpartition(".")[0] if spec.routed_by_parent else name


def expert_shape(
    module, spec: ExpertsSpec, param: ExpertParam, shape: tuple[int, ...] | None = None, sharded: bool = False
) -> tuple[int, ...]:
    """``[num experts, *slice]`` of ``param`` of experts module ``module`` (``shape``: the
    tensor's, default the module's parameter's): the shape itself, or for a merged parameter
    of an unsharded model (not ``sharded``: parallelize made it ``[num_physical, n, *rest]``)
    ``[E, n, *rest]`` from ``[E * n, *rest]``, ``E`` the module's ``spec.count`` attribute."""
    if shape is None:
        shape = tuple(module._parameters[param.name].shape)
    if not param.merged or sharded:
        return tuple(shape)
    num = getattr(module, spec.count, None) if spec.count else None
    if not isinstance(num, int) or num < 1 or not shape or shape[0] % num:
        raise ValueError(
            f"{type(module).__name__}.{param.name} of shape {list(shape)}: its experts are merged into "
            f"dim 0, and the module's {spec.count or 'expert count'} ({num}) does not divide it"
        )
    return (num, shape[0] // num, *shape[1:])


# Experts modules with identity ("zero") experts after the logical ones: a token routed to id
# ``num_logical + z`` gets its own hidden state back (times its routing weight), no weights
# involved. Class name -> (the attribute counting them, the parameters that nonetheless keep a
# row per identity expert, which the class's forward never reads). transformers' LongCat-Flash
# allocates ``gate_up_proj`` [n_routed + zero_expert_num, ...] and ``save_pretrained`` writes
# ``experts.<n_routed + z>.gate_proj / up_proj`` for them, while ``down_proj`` has n_routed rows.
IDENTITY_EXPERTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "LongcatFlashExperts": ("zero_expert_num", ("gate_up_proj",)),
}


def _identity_entry(module) -> tuple[str, tuple[str, ...]] | None:
    # By class name along the MRO: FSDP2 gives a module it shards a class of its own.
    return next((IDENTITY_EXPERTS[n] for n in class_names(type(module)) if n in IDENTITY_EXPERTS), None)


def identity_experts(module) -> int:
    """How many identity ("zero") experts experts module ``module`` routes to after its logical
    ones (:data:`IDENTITY_EXPERTS`; 0 for any other module)."""
    entry = _identity_entry(module)
    return int(getattr(module, entry[0], 0) or 0) if entry is not None else 0


def identity_rows(module, param: str) -> int:
    """How many rows for identity experts (after the logical experts' rows) parameter ``param``
    of experts module ``module`` has on disk and in the unsharded model (rows its forward never
    reads; an EP model does not hold them)."""
    entry = _identity_entry(module)
    return identity_experts(module) if entry is not None and param in entry[1] else 0


def num_logical_experts(module, spec: ExpertsSpec) -> int:
    """The logical experts of experts module ``module`` of an unsharded model (its parameters'
    expert dim, a merged one's from the module's count, the rows of identity experts left out)."""
    return min(expert_shape(module, spec, p)[0] - identity_rows(module, p.name) for p in spec.params)


def with_scales(spec: ExpertsSpec, param_names: set[str]) -> ExpertsSpec:
    """``spec`` plus the FP8 block scales an experts module keeps beside its weights (names
    ``param_names``), each an expert parameter of its own that moves with its expert.

    transformers' ``FP8Experts`` (a model loaded FP8 as stored) has ``gate_up_proj`` float8
    ``[E, 2I, H]`` and ``gate_up_proj_scale_inv`` float32 ``[E, ceil(2I/B), ceil(H/B)]``, stacked
    from the per-expert ``gate_proj.weight_scale_inv`` + ``up_proj.weight_scale_inv``
    ``[ceil(I/B), ceil(H/B)]`` exactly as the weight is from ``gate_proj.weight`` + ``up_proj.weight``
    (its ``HfQuantizer.update_weight_conversions``: the companion's suffix is the serialized name
    minus ``weight``). So the scale ``<param><suffix>`` reads parts ``<part><suffix>`` along the
    same dim; the parts' sizes (block rows) come from the checkpoint, as for any part."""
    own = {p.name for p in spec.params}
    extra = tuple(
        ExpertParam(p.name + suffix, tuple(part + suffix for part in p.parts), p.dim)
        for p in spec.params
        for suffix in SCALE_SUFFIXES
        if p.name + suffix in param_names and p.name + suffix not in own
    )
    return dataclasses.replace(spec, params=spec.params + extra) if extra else spec


# Names a checkpoint may use for a model name, besides the name itself: ``(regex, replacement)``.
# Mixtral-family checkpoints keep the pre-v5 module name ``block_sparse_moe`` for what
# transformers 5 builds as ``mlp`` (transformers renames it at load time, and so do we).
KEY_RENAMES: tuple[tuple[str, str], ...] = ((r"\.mlp\.(experts|gate)(\.|$)", r".block_sparse_moe.\1\2"),)

# model_type of a HF config -> (specs to try first, whether its checkpoints use KEY_RENAMES).
_HF_FAMILIES = {"mixtral": (MIXTRAL_EXPERTS, True), "minimax": (MIXTRAL_EXPERTS, True)}


def checkpoint_names(name: str, renames: tuple[tuple[str, str], ...] = KEY_RENAMES) -> tuple[str, ...]:
    """``name`` and the other names a checkpoint may store it under (own name first)."""
    out = [name]
    for pattern, repl in renames:
        alt = re.sub(pattern, repl, name)
        if alt not in out:
            out.append(alt)
    return tuple(out)


def _spec_stems(specs) -> tuple[tuple[tuple[str, str, str], ...], dict[str, str]]:
    """The checkpoint module names of the specs' parts: ``((first, second, fused name), ...)``
    for two-part parameters (``("gate_proj.", "up_proj.", "gate_up_proj")``) and ``{stem:
    name}`` for one-part ones (``{"down_proj.": "down_proj"}``), from part templates
    ``{e}.<stem>.weight`` (other templates are left out)."""
    pairs: list[tuple[str, str, str]] = []
    singles: dict[str, str] = {}
    for spec in specs:
        for p in spec.params:
            stems = [
                part[len("{e}.") : -len("weight")]
                for part in p.parts
                if part.startswith("{e}.") and part.endswith(".weight") and part.count(".") == 2
            ]
            if len(stems) == len(p.parts) == 2 and p.dim == 0:
                pairs.append((stems[0], stems[1], p.name))
            elif len(stems) == len(p.parts) == 1:
                singles.setdefault(stems[0], p.name)
    return tuple(pairs), singles


# How transformers fuses the per-expert tensors of the known families (HF_EXPERTS,
# MIXTRAL_EXPERTS): weights and the scales or biases stored beside them alike.
_PAIRS, _SINGLES = _spec_stems(DEFAULT_SPECS)


def expert_params(tensors) -> tuple[ExpertParam, ...]:
    """The fused parameters a model of a known family (:data:`DEFAULT_SPECS`) has for an
    experts module whose per-expert tensors are ``tensors`` (name -> one expert's header info,
    with ``dtype`` and ``shape``; in checkpoint order).

    ``gate_proj.<x>`` + ``up_proj.<x>`` (Mixtral: ``w1`` + ``w3``) become ``gate_up_proj``
    (``<x>`` = weight) or ``gate_up_proj_<x>`` (``weight_scale_inv`` ...) when they concatenate
    along dim 0 (same dtype, same trailing dims); ``down_proj.<x>`` (``w2``) becomes
    ``down_proj[_<x>]``; any other tensor a parameter of its own (dots made underscores)."""
    used: set[str] = set()
    params: list[ExpertParam] = []

    def name_of(base: str, rest: str) -> str:
        return base if rest == "weight" else f"{base}_{rest.replace('.', '_')}"

    for s in tensors:
        if s in used:
            continue
        for first, second, fused in _PAIRS:
            if s.startswith(first):
                rest = s[len(first) :]
                other = second + rest
                a, b = tensors[s], tensors.get(other)
                # Parts concatenate along dim 0 of the slice: same dtype, same trailing dims.
                if (
                    b is not None
                    and a.dtype == b.dtype
                    and len(a.shape) >= 1
                    and a.shape[1:] == b.shape[1:]
                    and len(a.shape) == len(b.shape)
                ):
                    params.append(ExpertParam(name_of(fused, rest), (f"{{e}}.{s}", f"{{e}}.{other}")))
                    used.update((s, other))
                break
        if s in used:
            continue
        base = next((v for k, v in _SINGLES.items() if s.startswith(k)), None)
        name = name_of(base, s.split(".", 1)[1]) if base else s.replace(".", "_")
        params.append(ExpertParam(name, (f"{{e}}.{s}",)))
        used.add(s)
    return tuple(params)


def specs_for(model, specs) -> tuple[tuple[ExpertsSpec, ...], bool]:
    """Order ``specs`` for ``model`` when no checkpoint tells: a HF model's ``config.model_type``
    picks its family's spec and naming. Returns ``(specs, prefer_renamed_names)``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    family = _HF_FAMILIES.get(model_type)
    if family is None or family[0] not in specs:
        return tuple(specs), False
    spec, renamed = family
    return (spec, *(s for s in specs if s is not spec)), renamed


def expert_parts(slice_box: Box, part_sizes: tuple[int, ...], dim: int) -> list[tuple[int, Box, Box]]:
    """Split a box of one expert's slice into boxes of its checkpoint parts.

    Args:
        slice_box: box in the per-expert slice ``[*slice_shape]`` (expert dim excluded).
        part_sizes: size of each part along ``dim`` (they sum to ``slice_shape[dim]``).
        dim: the concatenation dim.

    Returns:
        ``[(part index, box in the part's tensor, box in slice coordinates)]`` in order.
    """
    out = []
    start, length = slice_box[dim]
    lo = 0
    for j, size in enumerate(part_sizes):
        a, b = max(start, lo), min(start + length, lo + size)
        if a < b:
            part_box = slice_box[:dim] + ((a - lo, b - a),) + slice_box[dim + 1 :]
            sub = slice_box[:dim] + ((a, b - a),) + slice_box[dim + 1 :]
            out.append((j, part_box, sub))
        lo += size
    return out


def read_expert_box(reader, param: ExpertParam, module: str, expert: int, box: Box, out, slice_rows: int = 0):
    """Read ``box`` (slice coordinates, expert dim excluded) of logical ``expert``'s slice of
    ``param`` from its checkpoint parts into ``out`` (a tensor of shape ``box_shape(box)``;
    ``slice_rows``: a merged parameter's rows per expert, its slice's dim 0;
    values are cast to its dtype, FP8 weights with a block scale dequantized into a float
    ``out``: :func:`moeshard.io.fp8.read_dequantized`). ``reader`` is a
    :class:`~moeshard.io.reader.CheckpointReader`.
    """
    from ..io.fp8 import read_dequantized

    def read(key: str, part_box: Box, dst) -> None:
        if not read_dequantized(reader, key, part_box, dst):
            reader.read(key, part_box, out=dst)

    keys = param.keys(module, expert)
    if param.fused and param.merged:  # rows ``expert * n ..`` of the one tensor, dim 0 merged
        if not slice_rows:
            raise ValueError(f"{module}.{param.name}: a merged expert parameter needs its slice's rows")
        (o, k), rest = box[0], tuple(box[1:])
        read(keys[0], ((expert * slice_rows + o, k),) + rest, out)
        return out
    if param.fused:  # row ``expert`` of the one tensor holding every expert
        read(keys[0], ((expert, 1),) + tuple(box), out.unsqueeze(0))
        return out
    if len(keys) == 1:  # the part is the slice (a 0-d one too: ModelOpt's weight_scale_2)
        read(keys[0], tuple(box), out)
        return out
    sizes = tuple(reader.index.info(k).shape[param.dim] for k in keys)
    base = tuple(o for o, _ in box)
    for j, part_box, sub in expert_parts(box, sizes, param.dim):
        read(keys[j], part_box, out[tuple(slice(o - b, o - b + n) for (o, n), b in zip(sub, base))])
    return out
