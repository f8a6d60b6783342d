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

Then the real planner runs (:func:`~moeshard.layout.compute_needs`,
:func:`~moeshard.plan.plan_transfers`) for each storage mode, and the three baselines of
``benchmarks/baselines.py`` are costed analytically from what each of them sends. With
``--rebalance LOADS.npy`` the relocation planner runs instead, from the current placement to
``eplb.rebalance(loads, migration_aware=True)``.

Everything here except :func:`main` is pure: functions of plain data, ValueError for bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .adapters import ExpertParam
from .box import box_numel
from .checkpoint import DTYPES, CheckpointIndex, TensorInfo
from .layout import ExpertRef, Need, ParamDesc, _local_boxes, compute_needs
from .load import storage_sources
from .placement import Placement
from .plan import DEFAULT_STAGING_BYTES, TransferPlan, minimal_cost, plan_transfers
from .topology import Topology

__all__ = [
    "ClusterSpec", "Bandwidth", "ExpertModule", "MoeLayout", "StrategyCost", "RelocationSummary",
    "read_config", "synthetic_index", "num_params", "make_placement", "run", "find_experts", "synthesize_descs", "moeshard_cost",
    "baseline_costs", "estimate_time", "plan_relocation_summary", "parse_bandwidth", "main",
]

STORAGE_MODES = ("shared", "node", "single")
# Persistent buffers FSDP2 does not shard (it only shards parameters): every rank holds them.
_PLAIN_SUFFIXES = ("e_score_correction_bias",)
# HF's default max_shard_size "5GB" (decimal), as save_pretrained writes checkpoints.
_SHARD_BYTES = 5 * 10**9
_EXPERT_KEY = re.compile(r"^(?P<module>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<suffix>.+)$")
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# -- cluster -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSpec:
    """A job: ``num_nodes`` x ``ranks_per_node`` ranks, EP size ``ep``, expert-FSDP ``efsdp``
    (``ep * efsdp`` = world size), ``num_redundant`` extra expert slots per MoE layer."""

    num_nodes: int
    ranks_per_node: int
    ep: int
    efsdp: int
    num_redundant: int = 0

    def __post_init__(self) -> None:
        for name, flag in (("num_nodes", "--nodes"), ("ranks_per_node", "--ranks-per-node"), ("ep", "--ep"),
                           ("efsdp", "--efsdp")):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")
        if self.num_redundant < 0:
            raise ValueError(f"--redundant must be >= 0, got {self.num_redundant}")
        if self.ep * self.efsdp != self.world_size:
            raise ValueError(
                f"ep={self.ep} x efsdp={self.efsdp} = {self.ep * self.efsdp} ranks, but the cluster has "
                f"{self.num_nodes} nodes x {self.ranks_per_node} ranks = {self.world_size}"
            )

    @classmethod
    def build(cls, num_nodes: int, ranks_per_node: int, ep: int, efsdp: int | None, num_redundant: int = 0) -> "ClusterSpec":
        """``efsdp=None``: the rest of the world (``world / ep``, which must be whole)."""
        world = num_nodes * ranks_per_node
        if efsdp is None:
            if ep < 1 or world % ep:
                raise ValueError(f"--ep {ep} does not divide the world size {world} ({num_nodes} nodes x {ranks_per_node} ranks)")
            efsdp = world // ep
        return cls(num_nodes, ranks_per_node, ep, efsdp, num_redundant)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.ranks_per_node

    def topology(self) -> Topology:
        return Topology(self.world_size, self.ranks_per_node)

    def ep_nodes(self) -> int:
        """Nodes one EP group spans, for EPLB's hierarchical policy (1: the global policy).
        EP groups are ``ep`` consecutive ranks; an irregular straddle counts as one node."""
        if self.ep >= self.ranks_per_node and self.ep % self.ranks_per_node == 0:
            return self.ep // self.ranks_per_node
        return 1


@dataclass(frozen=True)
class Bandwidth:
    """Bandwidths in bytes/s: storage reads per node, per-rank intra-node and inter-node links."""

    storage: float
    intra: float
    inter: float


def parse_bandwidth(text: str) -> Bandwidth:
    """``"storage=5,intra=150,inter=25"`` (GB/s, 1 GB = 1e9 bytes) -> :class:`Bandwidth`."""
    vals: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in ("storage", "intra", "inter"):
            raise ValueError(f"--bandwidth: expected storage=GBps,intra=GBps,inter=GBps, got {text!r}")
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"--bandwidth: {name}={value!r} is not a number") from None
        if not v > 0 or not math.isfinite(v):
            raise ValueError(f"--bandwidth: {name} must be a positive number of GB/s, got {value}")
        vals[name] = v * 1e9
    missing = [k for k in ("storage", "intra", "inter") if k not in vals]
    if missing:
        raise ValueError(f"--bandwidth: missing {', '.join(missing)} (give storage=,intra=,inter= in GB/s)")
    return Bandwidth(**vals)


# -- config.json -> synthetic checkpoint headers ----------------------------------------------------


def read_config(path: str | os.PathLike) -> dict:
    """Parse a Hugging Face ``config.json`` (ValueError if missing or not a JSON object)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{p}: no such config file")
    try:
        cfg = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: not a readable JSON config: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: a config must be a JSON object")
    return cfg


def _get_int(cfg: dict, *names: str, default: int | None = None, what: str = "config") -> int:
    for name in names:
        v = cfg.get(name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{what}: {name}={v!r} is not a non-negative integer")
            return v
    if default is None:
        raise ValueError(f"{what}: missing {' / '.join(names)}")
    return default


_TORCH_DTYPES = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32"}


def _model_kind(cfg: dict) -> str:
    mt = str(cfg.get("model_type", ""))
    if mt in ("deepseek_v3", "deepseek_v2") or "n_routed_experts" in cfg:
        return "deepseek"
    if mt == "mixtral" or "num_local_experts" in cfg:
        return "mixtral"
    if mt in ("qwen3_moe", "qwen2_moe") or "num_experts" in cfg:
        return "qwen2_moe" if mt == "qwen2_moe" else "qwen3_moe"
    raise ValueError(
        f"config: model_type {mt!r} has no routed-expert count (n_routed_experts / num_experts / "
        "num_local_experts): not a MoE model"
    )


def _tensor_specs(cfg: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """``[(key, dtype, shape)]`` of the checkpoint a config describes, in save order."""
    kind = _model_kind(cfg)
    what = "config"
    dtype = _TORCH_DTYPES.get(str(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))), "BF16")
    qc = cfg.get("quantization_config")
    qc = qc if isinstance(qc, dict) else {}
    fp8 = qc.get("quant_method") == "fp8"
    qdtype = ("F8_E5M2" if qc.get("fmt") == "e5m2" else "F8_E4M3") if fp8 else dtype
    block = (qc.get("weight_block_size") or [128, 128]) if fp8 else None
    if fp8 and not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"config: quantization_config.weight_block_size={block!r} is not two positive integers")
    H = _get_int(cfg, "hidden_size", what=what)
    V = _get_int(cfg, "vocab_size", what=what)
    L = _get_int(cfg, "num_hidden_layers", what=what)
    heads = _get_int(cfg, "num_attention_heads", what=what)
    if not (H and V and L and heads):
        raise ValueError("config: hidden_size, vocab_size, num_hidden_layers and num_attention_heads must be > 0")
    out: list[tuple[str, str, tuple[int, ...]]] = []

    def lin(key: str, rows: int, cols: int, quantized: bool = True) -> None:
        # FP8 block-quantized checkpoints store every projection in fp8 with an fp32 scale per
        # block (DeepSeek-V3's release); routers, embeddings and norms stay in the model dtype.
        if quantized and fp8:
            out.append((f"{key}.weight", qdtype, (rows, cols)))
            out.append((f"{key}.weight_scale_inv", "F32", (-(-rows // block[0]), -(-cols // block[1]))))
        else:
            out.append((f"{key}.weight", dtype, (rows, cols)))

    def vec(key: str, n: int, dt: str | None = None) -> None:
        out.append((key, dt or dtype, (n,)))

    out.append(("model.embed_tokens.weight", dtype, (V, H)))
    if kind == "deepseek":
        E = _get_int(cfg, "n_routed_experts", what=what)
        mI = _get_int(cfg, "moe_intermediate_size", what=what)
        dI = _get_int(cfg, "intermediate_size", what=what)
        q_lora = cfg.get("q_lora_rank")
        kv_lora = _get_int(cfg, "kv_lora_rank", what=what)
        rope = _get_int(cfg, "qk_rope_head_dim", what=what)
        nope = _get_int(cfg, "qk_nope_head_dim", what=what)
        v_dim = _get_int(cfg, "v_head_dim", what=what)
        n_shared = _get_int(cfg, "n_shared_experts", default=0, what=what)
        first_dense = _get_int(cfg, "first_k_dense_replace", default=0, what=what)
        freq = max(1, _get_int(cfg, "moe_layer_freq", default=1, what=what))
        bias = cfg.get("model_type") == "deepseek_v3" or cfg.get("topk_method") == "noaux_tc"
        for i in range(L):
            p = f"model.layers.{i}"
            a = f"{p}.self_attn"
            if q_lora:
                lin(f"{a}.q_a_proj", int(q_lora), H)
                vec(f"{a}.q_a_layernorm.weight", int(q_lora))
                lin(f"{a}.q_b_proj", heads * (nope + rope), int(q_lora))
            else:
                lin(f"{a}.q_proj", heads * (nope + rope), H)
            lin(f"{a}.kv_a_proj_with_mqa", kv_lora + rope, H)
            vec(f"{a}.kv_a_layernorm.weight", kv_lora)
            lin(f"{a}.kv_b_proj", heads * (nope + v_dim), kv_lora)
            lin(f"{a}.o_proj", H, heads * v_dim)
            vec(f"{p}.input_layernorm.weight", H)
            vec(f"{p}.post_attention_layernorm.weight", H)
            m = f"{p}.mlp"
            if E and i >= first_dense and i % freq == 0:
                lin(f"{m}.gate", E, H, quantized=False)
                if bias:
                    vec(f"{m}.gate.e_score_correction_bias", E, "F32")
                for e in range(E):
                    lin(f"{m}.experts.{e}.gate_proj", mI, H)
                    lin(f"{m}.experts.{e}.up_proj", mI, H)
                    lin(f"{m}.experts.{e}.down_proj", H, mI)
                if n_shared:
                    lin(f"{m}.shared_experts.gate_proj", mI * n_shared, H)
                    lin(f"{m}.shared_experts.up_proj", mI * n_shared, H)
                    lin(f"{m}.shared_experts.down_proj", H, mI * n_shared)
            else:
                lin(f"{m}.gate_proj", dI, H)
                lin(f"{m}.up_proj", dI, H)
                lin(f"{m}.down_proj", H, dI)
    else:
        mixtral = kind == "mixtral"
        E = _get_int(cfg, "num_local_experts" if mixtral else "num_experts", what=what)
        kv = _get_int(cfg, "num_key_value_heads", default=heads, what=what)
        hd = cfg.get("head_dim") or H // heads
        mI = _get_int(cfg, "intermediate_size" if mixtral else "moe_intermediate_size", what=what)
        dI = _get_int(cfg, "intermediate_size", what=what)
        step = max(1, _get_int(cfg, "decoder_sparse_step", default=1, what=what))
        dense_layers = set(cfg.get("mlp_only_layers") or [])
        qkv_bias = bool(cfg.get("qkv_bias", kind == "qwen2_moe")) or bool(cfg.get("attention_bias", False))
        for i in range(L):
            p = f"model.layers.{i}"
            a = f"{p}.self_attn"
            for name, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
                lin(f"{a}.{name}", rows, H)
                if qkv_bias:
                    vec(f"{a}.{name}.bias", rows)
            lin(f"{a}.o_proj", H, heads * hd)
            if kind == "qwen3_moe":
                vec(f"{a}.q_norm.weight", hd)
                vec(f"{a}.k_norm.weight", hd)
            vec(f"{p}.input_layernorm.weight", H)
            vec(f"{p}.post_attention_layernorm.weight", H)
            if mixtral:
                m = f"{p}.block_sparse_moe"
                lin(f"{m}.gate", E, H, quantized=False)
                for e in range(E):
                    lin(f"{m}.experts.{e}.w1", mI, H)
                    lin(f"{m}.experts.{e}.w2", H, mI)
                    lin(f"{m}.experts.{e}.w3", mI, H)
                continue
            m = f"{p}.mlp"
            if E and i not in dense_layers and (i + 1) % step == 0:
                lin(f"{m}.gate", E, H, quantized=False)
                for e in range(E):
                    lin(f"{m}.experts.{e}.gate_proj", mI, H)
                    lin(f"{m}.experts.{e}.up_proj", mI, H)
                    lin(f"{m}.experts.{e}.down_proj", H, mI)
                sI = _get_int(cfg, "shared_expert_intermediate_size", default=0, what=what)
                if sI:
                    lin(f"{m}.shared_expert.gate_proj", sI, H)
                    lin(f"{m}.shared_expert.up_proj", sI, H)
                    lin(f"{m}.shared_expert.down_proj", H, sI)
                    lin(f"{m}.shared_expert_gate", 1, H, quantized=False)
            else:
                lin(f"{m}.gate_proj", dI, H)
                lin(f"{m}.up_proj", dI, H)
                lin(f"{m}.down_proj", H, dI)
    vec("model.norm.weight", H)
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", dtype, (V, H)))
    return out


def synthetic_index(cfg: dict, root: str = "<synthetic>", shard_bytes: int = _SHARD_BYTES) -> CheckpointIndex:
    """Checkpoint headers (no files) of the model ``cfg`` describes, laid out as
    ``save_pretrained`` writes it: tensors in module order, shards of at most ``shard_bytes``,
    per-expert keys (``...experts.{e}.gate_proj.weight``).

    Supported: DeepSeek-V2/V3 (MLA attention, ``first_k_dense_replace`` dense layers, shared
    experts, FP8 block quantization with ``weight_scale_inv``), Qwen3-MoE / Qwen2-MoE and
    Mixtral. DeepSeek-V3's multi-token-prediction layer is not synthesized (transformers does
    not load it).
    """
    specs = _tensor_specs(cfg)
    files: list[list[tuple[str, str, tuple[int, ...], int]]] = [[]]
    size = 0
    for key, dt, shape in specs:
        nbytes = math.prod(shape) * DTYPES[dt].itemsize
        if files[-1] and size + nbytes > shard_bytes:
            files.append([])
            size = 0
        files[-1].append((key, dt, shape, nbytes))
        size += nbytes
    tensors: dict[str, TensorInfo] = {}
    file_sizes: dict[str, int] = {}
    for j, entries in enumerate(files):
        name = f"model-{j + 1:05d}-of-{len(files):05d}.safetensors"
        # A safetensors header is ~100 bytes of JSON per tensor; only the order matters here.
        offset = 8 + 128 * len(entries)
        for key, dt, shape, nbytes in entries:
            tensors[key] = TensorInfo(name, offset, dt, shape)
            offset += nbytes
        file_sizes[name] = offset
    return CheckpointIndex(root, tensors, file_sizes)


def num_params(index: CheckpointIndex) -> int:
    """Model parameters in a checkpoint (FP8 block scales not counted)."""
    return sum(math.prod(t.shape) for k, t in index.tensors.items() if not k.endswith("_scale_inv"))


# -- checkpoint headers -> MoE layout -------------------------------------------------------------


@dataclass(frozen=True)
class ExpertModule:
    """One experts module (MoE ``layer`` index) and its fused parameters."""

    layer: int
    module: str
    params: tuple[ExpertParam, ...]


@dataclass(frozen=True)
class MoeLayout:
    """What the checkpoint holds: experts modules (in layer order), ``num_logical`` experts
    each, dense keys (file order), and keys skipped (layers the model does not have)."""

    experts: tuple[ExpertModule, ...]
    num_logical: int
    dense_keys: tuple[str, ...]
    skipped_keys: tuple[str, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.experts)


def _natural(s: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s))


# Per-expert checkpoint parts fused into one parameter, as HF_EXPERTS / MIXTRAL_EXPERTS do:
# (first part prefix, second part prefix, fused name); weights and their scales/biases alike.
_FUSED = (("gate_proj.", "up_proj.", "gate_up_proj"), ("w1.", "w3.", "gate_up_proj"))
_SINGLE = {"down_proj.": "down_proj", "w2.": "down_proj"}


def _expert_params(module: str, suffixes: list[str], index: CheckpointIndex) -> tuple[ExpertParam, ...]:
    """Fused parameters of one experts module from the suffixes of expert 0's keys."""
    info = {s: index.info(f"{module}.0.{s}") for s in suffixes}
    used: set[str] = set()
    params: list[ExpertParam] = []

    def name_of(base: str, rest: str) -> str:
        return base if rest == "weight" else f"{base}_{rest.replace('.', '_')}"

    for s in suffixes:
        if s in used:
            continue
        for first, second, fused in _FUSED:
            if s.startswith(first):
                rest = s[len(first):]
                other = second + rest
                a, b = info[s], info.get(other)
                # Parts concatenate along dim 0 of the slice: same dtype, same trailing dims.
                if b is not None and a.dtype == b.dtype and len(a.shape) >= 1 and a.shape[1:] == b.shape[1:] \
                        and len(a.shape) == len(b.shape):
                    params.append(ExpertParam(name_of(fused, rest), (f"{{e}}.{s}", f"{{e}}.{other}")))
                    used.update((s, other))
                break
        if s in used:
            continue
        base = next((v for k, v in _SINGLE.items() if s.startswith(k)), None)
        name = name_of(base, s.split(".", 1)[1]) if base else s.replace(".", "_")
        params.append(ExpertParam(name, (f"{{e}}.{s}",)))
        used.add(s)
    return tuple(params)


def find_experts(index: CheckpointIndex, num_hidden_layers: int | None = None) -> MoeLayout:
    """Experts modules of a checkpoint from its per-expert keys (``<module>.experts.<e>.<rest>``).

    ``num_hidden_layers`` (from the checkpoint's config.json): keys of decoder layers at or
    beyond it are skipped (DeepSeek-V3's multi-token-prediction layer 61, which transformers
    does not load). Raises ValueError for a checkpoint without experts (not MoE) or experts
    modules that disagree (expert ids not 0..E-1, a tensor missing for some expert).
    """
    modules: dict[str, dict[str, set[int]]] = {}
    dense: list[str] = []
    skipped: list[str] = []
    for key in index.tensors:
        if num_hidden_layers is not None:
            m = _LAYER_KEY.search(key)
            if m and int(m.group(1)) >= num_hidden_layers:
                skipped.append(key)
                continue
        m = _EXPERT_KEY.match(key)
        if m is None:
            dense.append(key)
            continue
        modules.setdefault(m.group("module"), {}).setdefault(m.group("suffix"), set()).add(int(m.group("e")))
    if not modules:
        raise ValueError(
            f"checkpoint {index.root} has no per-expert tensors (keys like '<module>.experts.<e>.gate_proj.weight'): "
            "not a MoE checkpoint"
        )
    num_logical = None
    experts = []
    for layer, module in enumerate(sorted(modules, key=_natural)):
        by_suffix = modules[module]
        for suffix, ids in sorted(by_suffix.items()):
            n = len(ids)
            if ids != set(range(n)):
                missing = sorted(set(range(max(ids) + 1)) - ids)[:8]
                raise ValueError(f"checkpoint {index.root}: {module}.<e>.{suffix} lacks experts {missing}")
            if num_logical is None:
                num_logical = n
            elif n != num_logical:
                raise ValueError(
                    f"checkpoint {index.root}: {module}.<e>.{suffix} has {n} experts, other experts tensors "
                    f"have {num_logical}"
                )
        suffixes = sorted(by_suffix, key=lambda s: (index.info(f"{module}.0.{s}").file, index.info(f"{module}.0.{s}").offset))
        experts.append(ExpertModule(layer, module, _expert_params(module, suffixes, index)))
    order = {k: (t.file, t.offset) for k, t in index.tensors.items()}
    dense.sort(key=order.__getitem__)
    assert num_logical is not None
    return MoeLayout(tuple(experts), num_logical, tuple(dense), tuple(skipped))


def synthesize_descs(layout: MoeLayout, index: CheckpointIndex, cluster: ClusterSpec) -> list[ParamDesc]:
    """The :class:`ParamDesc` records ``moeshard.parallelize`` would give the model of this
    checkpoint on ``cluster`` (model dtype = checkpoint dtype, so bytes are checkpoint bytes)."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    world = cluster.world_size
    dp = np.arange(world)  # the flattened ("efsdp", "ep") mesh is ranks 0..world-1 in order
    if cluster.efsdp == 1:
        emesh, eplace, eplace0 = dp, (Shard(0),), (Shard(0),)
    else:
        emesh = dp.reshape(cluster.efsdp, cluster.ep)
        # A 0-dim per-expert tensor (a per-expert scalar scale) has no dim 1 to shard.
        eplace, eplace0 = (Shard(1), Shard(0)), (Replicate(), Shard(0))
    num_physical = layout.num_logical + cluster.num_redundant
    descs: list[ParamDesc] = []
    for key in layout.dense_keys:
        info = index.info(key)
        dt = DTYPES[info.dtype]
        if not info.shape or key.endswith(_PLAIN_SUFFIXES):
            descs.append(ParamDesc(key, tuple(info.shape), dt, None, (), (key,)))
        else:
            descs.append(ParamDesc(key, tuple(info.shape), dt, dp, (Shard(0),), (key,)))
    for em in layout.experts:
        for p in em.params:
            parts = [index.info(k) for k in p.keys(em.module, 0)]
            slice_shape = (sum(t.shape[0] for t in parts), *parts[0].shape[1:]) if parts[0].shape else ()
            place = eplace if slice_shape else eplace0
            descs.append(ParamDesc(f"{em.module}.{p.name}", (num_physical, *slice_shape), DTYPES[parts[0].dtype],
                                   emesh, place, (), ExpertRef(em.layer, em.module, p)))
    return descs


def make_placement(layout: MoeLayout, cluster: ClusterSpec, phy2log: np.ndarray | None = None) -> Placement:
    """Contiguous placement (``num_redundant`` extra copies), or ``phy2log`` checked against
    the checkpoint's shape ``[num_moe_layers, num_logical + num_redundant]``."""
    num_physical = layout.num_logical + cluster.num_redundant
    if num_physical % cluster.ep:
        raise ValueError(
            f"--ep {cluster.ep} does not divide the {num_physical} expert slots per layer "
            f"({layout.num_logical} experts + {cluster.num_redundant} redundant)"
        )
    if phy2log is None:
        return Placement.contiguous(layout.num_layers, layout.num_logical, cluster.ep, cluster.num_redundant)
    want = (layout.num_layers, num_physical)
    if phy2log.shape != want:
        raise ValueError(
            f"--placement: phy2log has shape {list(phy2log.shape)}, expected [num_moe_layers={want[0]}, "
            f"num_physical={want[1]}] (set --redundant to num_physical - {layout.num_logical})"
        )
    return Placement(phy2log, num_logical=layout.num_logical, num_ranks=cluster.ep)


# -- costs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StrategyCost:
    """What one loading strategy costs (bytes in the checkpoint's dtype).

    ``sent_bytes_max_rank`` follows the project's convention (a broadcast of n bytes to k
    receivers counts k*n for its root). The time model instead uses *link* bytes per rank
    (``intra_bytes_max_rank`` / ``inter_bytes_max_rank``: max of a rank's bytes sent and
    received over that kind of link), with every broadcast modeled as a pipelined ring (each
    member receives n and forwards n once): the most favourable reading for broadcasts.
    """

    name: str
    kind: str  # "moeshard" or "baseline"
    read_bytes_total: int
    read_bytes_max_node: int
    cross_node_bytes: int
    sent_bytes_max_rank: int
    recv_bytes_max_rank: int
    num_p2p_ops: int
    num_collectives: int
    num_batches: int
    peak_staging_bytes_max_rank: int
    intra_bytes_max_rank: int
    inter_bytes_max_rank: int
    sent_bytes_total: int = 0
    minimal: dict = field(default_factory=dict)
    plan_seconds: float = 0.0
    note: str = ""

    def at_minimum(self) -> dict:
        """Which counters equal their lower bound (moeshard plans only)."""
        if not self.minimal:
            return {}
        return {
            "read": self.read_bytes_total == self.minimal["read_bytes"],
            "network": self.sent_bytes_total == self.minimal["network_bytes"],
            "cross_node": self.cross_node_bytes == self.minimal["cross_node_bytes"],
        }


def estimate_time(cost: StrategyCost, bw: Bandwidth) -> tuple[float, str]:
    """Seconds and bottleneck: max of (storage bytes read per node / storage bandwidth, max
    per-rank intra-node bytes / intra bandwidth, max per-rank inter-node bytes / inter
    bandwidth). A lower bound: it assumes the three overlap perfectly and ignores latency."""
    terms = {
        "storage": cost.read_bytes_max_node / bw.storage,
        "intra-node": cost.intra_bytes_max_rank / bw.intra,
        "inter-node": cost.inter_bytes_max_rank / bw.inter,
    }
    name = max(terms, key=terms.__getitem__)
    return terms[name], name


def _ring_links(ranks: Sequence[int], root: int, nbytes: int, node: np.ndarray,
                sent: tuple[np.ndarray, np.ndarray], recv: tuple[np.ndarray, np.ndarray]) -> None:
    """Add a pipelined ring broadcast from ``root`` over ``ranks`` (root first, then rank
    order) to per-rank link counters (index 0: intra-node, 1: inter-node)."""
    ring = [root] + [r for r in ranks if r != root]
    for a, b in zip(ring, ring[1:]):
        k = int(node[a] != node[b])
        sent[k][a] += nbytes
        recv[k][b] += nbytes


def moeshard_cost(name: str, plan: TransferPlan, minimal: dict, seconds: float) -> StrategyCost:
    """Counters of a moeshard plan, plus its per-rank intra/inter-node link bytes."""
    topo = plan.topology
    world, lws = topo.world_size, topo.local_world_size
    node = topo.nodes_array()
    sent = (np.zeros(world, np.int64), np.zeros(world, np.int64))
    recv = (np.zeros(world, np.int64), np.zeros(world, np.int64))
    sizes = [p.nbytes for p in plan.pieces]
    nl = node.tolist()
    s_in, s_out, r_in, r_out = ([0] * world for _ in range(4))
    for c in plan.chunks:
        for ph in c.phases:
            for s in ph.sends:
                n = sizes[s.piece]
                if nl[s.src] == nl[s.dst]:
                    s_in[s.src] += n
                    r_in[s.dst] += n
                else:
                    s_out[s.src] += n
                    r_out[s.dst] += n
            for b in ph.broadcasts:
                _ring_links(topo.node_ranks(b.node), b.root, sizes[b.piece], node, sent, recv)
    sent[0][:] += s_in
    sent[1][:] += s_out
    recv[0][:] += r_in
    recv[1][:] += r_out
    c = plan.cost
    read_node = c.read_bytes.reshape(-1, lws).sum(1)
    return StrategyCost(
        name=name, kind="moeshard",
        read_bytes_total=int(c.read_bytes.sum()),
        read_bytes_max_node=int(read_node.max()),
        cross_node_bytes=int(c.cross_node_bytes),
        sent_bytes_max_rank=int(c.sent_bytes.max()),
        recv_bytes_max_rank=int(c.recv_bytes.max()),
        num_p2p_ops=int(c.num_p2p_ops),
        num_collectives=int(c.num_broadcasts),
        num_batches=int(c.num_batches),
        peak_staging_bytes_max_rank=int(c.peak_staging_bytes.max()),
        intra_bytes_max_rank=int(np.maximum(sent[0], recv[0]).max()),
        inter_bytes_max_rank=int(np.maximum(sent[1], recv[1]).max()),
        sent_bytes_total=int(c.sent_bytes.sum()),
        minimal=dict(minimal),
        plan_seconds=seconds,
    )


def _local_bytes(d: ParamDesc, itemsize: int) -> list[tuple[int, int]]:
    """``[(rank, bytes of its local tensor)]`` of one DTensor parameter."""
    boxes = _local_boxes(d.shape, d.mesh.shape, d.placements)
    return [(r, box_numel(b) * itemsize) for r, b in zip(d.mesh.reshape(-1).tolist(), boxes)]


def baseline_costs(needs: Sequence[Need], descs: Sequence[ParamDesc], index: CheckpointIndex,
                   cluster: ClusterSpec) -> list[StrategyCost]:
    """Costs of the three baselines of ``benchmarks/baselines.py``, computed from what each
    sends (no execution):

    * rank0-broadcast: rank 0 reads every tensor and broadcasts it whole to all ranks;
    * chunk-broadcast-loop: dense tensors as above; for every fused expert parameter rank 0
      reads all its per-expert tensors and, for each rank r = 1..world-1, broadcasts r's local
      shard to all ranks (one collective + device synchronize each);
    * node-local-p2p: local rank 0 of every node reads the whole checkpoint and sends each rank
      of its node each of its boxes with one blocking send.
    """
    world, lws = cluster.world_size, cluster.ranks_per_node
    num_nodes = cluster.num_nodes
    infos = index.tensors
    total = sum(t.nbytes for t in infos.values())
    max_tensor = max((t.nbytes for t in infos.values()), default=0)
    # Ring-broadcast link bytes over all ranks: a middle rank forwards intra-node, a node's
    # first/last rank receives/sends across nodes.
    intra_ring = 1 if lws > 1 else 0
    inter_ring = 1 if num_nodes > 1 else 0
    out = []

    # rank0-broadcast: every checkpoint tensor once, to every rank.
    out.append(StrategyCost(
        name="rank0-broadcast", kind="baseline",
        read_bytes_total=total, read_bytes_max_node=total,
        cross_node_bytes=total * (world - lws),
        sent_bytes_max_rank=total * (world - 1), recv_bytes_max_rank=total if world > 1 else 0,
        num_p2p_ops=0, num_collectives=len(infos), num_batches=len(infos),
        peak_staging_bytes_max_rank=max_tensor,
        intra_bytes_max_rank=total * intra_ring, inter_bytes_max_rank=total * inter_ring,
        note="accelerate fsdp2_load_full_state_dict (transformers #45662)",
    ))

    # chunk-broadcast-loop.
    expert_keys: set[str] = set()
    bcast_bytes = 0  # sum of the payloads of all broadcasts
    num_bcast = 0
    peak0 = 0
    num_logical = _num_logical(descs, index)
    for d in descs:
        if d.expert is None:
            continue
        ref = d.expert
        keys = [k for e in range(num_logical) for k in ref.param.keys(ref.module, e)]
        expert_keys.update(keys)
        full = sum(infos[k].nbytes for k in keys)
        per_rank = _local_bytes(d, DTYPES[infos[keys[0]].dtype].itemsize)
        local = [b for r, b in per_rank if r != 0 and b]
        bcast_bytes += sum(local)
        num_bcast += len(local)
        peak0 = max(peak0, full + max(local, default=0))
    dense_bytes = sum(t.nbytes for k, t in infos.items() if k not in expert_keys)
    num_dense = len(infos) - len(expert_keys)
    payload = dense_bytes + bcast_bytes
    out.append(StrategyCost(
        name="chunk-broadcast-loop", kind="baseline",
        read_bytes_total=total, read_bytes_max_node=total,
        cross_node_bytes=payload * (world - lws),
        sent_bytes_max_rank=payload * (world - 1), recv_bytes_max_rank=payload if world > 1 else 0,
        num_p2p_ops=0, num_collectives=num_dense + num_bcast, num_batches=num_dense + num_bcast,
        peak_staging_bytes_max_rank=max(max_tensor, peak0),
        intra_bytes_max_rank=payload * intra_ring, inter_bytes_max_rank=payload * inter_ring,
        note=f"twinkle #200: {num_bcast} expert broadcasts, each followed by a device synchronize",
    ))

    # node-local-p2p: one blocking send per need of a rank other than its node's local rank 0.
    # Per-need sizes through a cache: the same few box shapes recur across many thousands of
    # needs (every expert tensor of a layer, every rank's shard of same-shaped tensors).
    item = {k: DTYPES[t.dtype].itemsize for k, t in infos.items()}
    numel: dict = {}
    ranks = np.fromiter((n.rank for n in needs), dtype=np.int64, count=len(needs))
    sizes = np.empty(len(needs), dtype=np.int64)
    for i, n in enumerate(needs):
        k = numel.get(n.src)
        if k is None:
            k = numel[n.src] = box_numel(n.src)
        sizes[i] = k * item[n.key]
    need_bytes = np.zeros(world, dtype=np.int64)
    np.add.at(need_bytes, ranks, sizes)  # exact int64 sums (bincount's weights are float64)
    need_ops = np.bincount(ranks, minlength=world)
    is_source = (np.arange(world) % lws) == 0
    recv = np.where(is_source, 0, need_bytes)
    sent_node = recv.reshape(num_nodes, lws).sum(1)
    ops_node = np.where(is_source, 0, need_ops).reshape(num_nodes, lws).sum(1)
    ops = int(ops_node.sum())  # job-wide, as PlanCost counts; nodes send in parallel, so the
    # sequential steps (batches) are the busiest node's sends
    max_need = int(sizes[~is_source[ranks]].max(initial=0))
    out.append(StrategyCost(
        name="node-local-p2p", kind="baseline",
        read_bytes_total=total * num_nodes, read_bytes_max_node=total,
        cross_node_bytes=0,
        sent_bytes_max_rank=int(sent_node.max()), recv_bytes_max_rank=int(recv.max()),
        num_p2p_ops=ops, num_collectives=0, num_batches=int(ops_node.max()),
        peak_staging_bytes_max_rank=max(max_tensor, max_need),
        intra_bytes_max_rank=int(max(sent_node.max(), recv.max())), inter_bytes_max_rank=0,
        note="twinkle #207: every node reads the whole checkpoint; blocking sends one at a time",
    ))
    return out


def _num_logical(descs: Sequence[ParamDesc], index: CheckpointIndex) -> int:
    d = next(d for d in descs if d.expert is not None)
    ref = d.expert
    n = 0
    while ref.param.keys(ref.module, n)[0] in index:
        n += 1
    return n


def _plan_mode(mode: str, needs: Sequence[Need], index: CheckpointIndex, topo: Topology, staging: int) -> StrategyCost:
    t = time.perf_counter()
    name, readers, scope = storage_sources(mode, np.ones(topo.world_size, dtype=bool), topo)
    plan = plan_transfers(needs, index, topo, readers, scope=scope, staging_bytes=staging)
    minimal = minimal_cost(needs, index, topo, readers, scope)
    cost = moeshard_cost(f"moeshard {name}", plan, minimal, 0.0)
    return StrategyCost(**{**asdict(cost), "plan_seconds": time.perf_counter() - t})


def plan_storage_modes(needs: Sequence[Need], index: CheckpointIndex, topo: Topology, modes: Sequence[str],
                       staging: int) -> list[StrategyCost]:
    """Plan every storage mode in ``modes`` and cost each plan (pure), one plan in memory at
    a time (each holds every need). Running the modes in forked processes was tried: faster
    at 256 ranks on 2 cores (16 -> 11 s), slower at 1,024 ranks (45 -> 53 s, 79 -> 114 s),
    so it is not done."""
    return [_plan_mode(mode, needs, index, topo, staging) for mode in modes]


# -- relocation -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RelocationSummary:
    """A rebalance: balance before/after, copies moved, and the relocation plan's costs."""

    balance_before: float
    balance_after: float
    copies_moved: int
    slots_changed: int
    cost: dict
    read_bytes_max_node: int
    intra_bytes_max_rank: int
    inter_bytes_max_rank: int
    plan_seconds: float
    rebalance_seconds: float


def plan_relocation_summary(descs: Sequence[ParamDesc], old: Placement, loads: np.ndarray, cluster: ClusterSpec,
                            readers: np.ndarray, staging_bytes: int, num_groups: int | None) -> tuple[Placement, RelocationSummary]:
    """Rebalance ``loads`` (``float[num_moe_layers, num_logical]``) from ``old`` with EPLB's
    migration-aware policy and plan the relocation of every expert tensor (pure)."""
    from . import eplb
    from .relocation import ExpertTensor, plan_relocation

    loads = np.asarray(loads)
    if loads.ndim != 2 or loads.shape != (old.num_layers, old.num_logical):
        raise ValueError(
            f"loads have shape {list(loads.shape)}, expected [num_moe_layers={old.num_layers}, "
            f"num_logical={old.num_logical}]"
        )
    nodes = cluster.ep_nodes()
    groups = num_groups if num_groups and old.num_logical % num_groups == 0 else None
    t0 = time.perf_counter()
    new = eplb.rebalance(loads, old, num_physical=old.num_physical, num_ranks=cluster.ep, num_nodes=nodes,
                         num_groups=groups, migration_aware=True)
    t1 = time.perf_counter()
    tensors = []
    for d in descs:
        if d.expert is None:
            continue
        boxes = _local_boxes(d.shape, d.mesh.shape, d.placements)
        holdings = tuple((r, b[0][0], b[0][1], b[1:]) for r, b in zip(d.mesh.reshape(-1).tolist(), boxes))
        tensors.append(ExpertTensor(d.expert.layer, d.name, d.shape[1:], d.dtype.itemsize, holdings))
    topo = cluster.topology()
    plan = plan_relocation(tensors, old, new, topo, readers=readers, staging_bytes=staging_bytes)
    t2 = time.perf_counter()
    world = topo.world_size
    node = topo.nodes_array()
    nl = node.tolist()
    sent = [[0] * world, [0] * world]
    recv = [[0] * world, [0] * world]
    for m in plan.moves:
        for s, _, d in m.sends:
            k = int(nl[s] != nl[d])
            sent[k][s] += m.nbytes
            recv[k][d] += m.nbytes
        for s, d in m.relays:
            k = int(nl[s] != nl[d])
            sent[k][s] += m.nbytes
            recv[k][d] += m.nbytes
    c = plan.cost
    summary = RelocationSummary(
        balance_before=float(eplb.balance(loads, old, cluster.ep).mean()),
        balance_after=float(eplb.balance(loads, new, cluster.ep).mean()),
        copies_moved=eplb.copies_moved(old, new, cluster.ep),
        slots_changed=eplb.slots_changed(old, new),
        cost=c.summary(),
        read_bytes_max_node=int(c.read_bytes.reshape(-1, topo.local_world_size).sum(1).max()),
        intra_bytes_max_rank=int(max(max(a, b) for a, b in zip(sent[0], recv[0]))),
        inter_bytes_max_rank=int(max(max(a, b) for a, b in zip(sent[1], recv[1]))),
        plan_seconds=t2 - t1,
        rebalance_seconds=t1 - t0,
    )
    return new, summary


# -- formatting -----------------------------------------------------------------------------------


def _b(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    return f"{n:,}"


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s >= 1 else f"{s * 1000:.0f} ms"


def format_report(rep: dict) -> str:
    """The human-readable report of :func:`run` (its JSON form is ``rep`` itself)."""
    ck, cl = rep["checkpoint"], rep["cluster"]
    lines = [
        f"checkpoint {ck['source']}: {_count(ck['num_tensors'])} tensors, {_b(ck['total_bytes'])}, "
        f"{ck['num_params'] / 1e9:.1f}B params; {ck['num_moe_layers']} MoE layers x {ck['num_logical']} experts"
        + (f" ({ck['num_skipped_keys']} keys of layers beyond num_hidden_layers skipped)" if ck["num_skipped_keys"] else ""),
        f"cluster: {cl['num_nodes']} nodes x {cl['ranks_per_node']} ranks = {cl['world_size']}, EP {cl['ep']} x "
        f"expert-FSDP {cl['efsdp']}, {cl['num_physical']} slots/layer ({cl['slots_per_rank']} per EP rank), "
        f"staging {_b(cl['staging_bytes'])}/rank",
    ]
    t = rep["timings_s"]
    lines.append("planning time: " + ", ".join(f"{k} {_secs(v)}" for k, v in t.items()))
    per_mode = [s for s in rep.get("strategies", ()) if s["kind"] == "moeshard"]
    if per_mode:
        lines.append("  each storage mode (plan + lower bounds + link bytes): "
                     + ", ".join(f"{s['name'].split()[-1]} {_secs(s['plan_seconds'])}" for s in per_mode))
    if "relocation" in rep:
        r = rep["relocation"]
        c = r["cost"]
        lines += [
            "",
            f"rebalance (EPLB, migration-aware): max/mean rank load {r['balance_before']:.2f} -> {r['balance_after']:.2f}; "
            f"expert copies moved {_count(r['copies_moved'])}, slots changed {_count(r['slots_changed'])}",
            f"  slot boxes written{' (an expert copy is ' + str(cl['efsdp']) + ' boxes with expert-FSDP)' if cl['efsdp'] > 1 else ''}: "
            + ", ".join(f"{k} {_count(v)} ({_b(c['bytes'][k])})" for k, v in c["copies"].items()),
            f"  network {_b(c['network_bytes'])} (minimum {_b(c['min_network_bytes'])}), cross-node "
            f"{_b(c['cross_node_bytes'])} (minimum {_b(c['min_cross_node_bytes'])}), read {_b(c['read_bytes_total'])}",
            f"  max sent/rank {_b(c['sent_bytes_max_rank'])}, max recv/rank {_b(c['recv_bytes_max_rank'])}, "
            f"P2P ops {_count(c['num_p2p_ops'])}, rounds {c['num_rounds']}, stashes {c['num_stashes']}, "
            f"peak staging/rank {_b(c['peak_staging_bytes_max_rank'])}",
        ]
        if "time_s" in r:
            lines.append(f"  estimated time {_secs(r['time_s'])} (bottleneck: {r['bottleneck']})")
        return "\n".join(lines)
    cols = ["strategy", "read total", "read max/node", "cross-node", "sent max/rank", "recv max/rank",
            "P2P ops", "collectives", "batches", "staging/rank"]
    timed = any("time_s" in s for s in rep["strategies"])
    if timed:
        cols += ["est. time", "bottleneck"]
    rows = []
    for s in rep["strategies"]:
        row = [s["name"], _b(s["read_bytes_total"]), _b(s["read_bytes_max_node"]), _b(s["cross_node_bytes"]),
               _b(s["sent_bytes_max_rank"]), _b(s["recv_bytes_max_rank"]), _count(s["num_p2p_ops"]),
               _count(s["num_collectives"]), _count(s["num_batches"]), _b(s["peak_staging_bytes_max_rank"])]
        if timed:
            row += [_secs(s["time_s"]), s["bottleneck"]]
        rows.append(row)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = lambda r: "  ".join(v.ljust(w) if i == 0 or (timed and i == len(cols) - 1) else v.rjust(w)  # noqa: E731
                              for i, (v, w) in enumerate(zip(r, widths))).rstrip()
    lines += ["", fmt(cols)] + [fmt(r) for r in rows]
    lines.append("")
    for s in rep["strategies"]:
        if s["kind"] == "moeshard":
            ok = s["at_minimum"]
            lines.append(f"{s['name']}: read / network / cross-node bytes at their lower bound: "
                         + " / ".join("yes" if ok[k] else "NO" for k in ("read", "network", "cross_node")))
        elif s["note"]:
            lines.append(f"{s['name']}: {s['note']}")
    lines.append("bytes are checkpoint bytes; 'sent' counts a broadcast to k ranks k times at its root"
                 + ("; times model broadcasts as pipelined rings, ignore latency, storage bandwidth is per node" if timed else ""))
    return "\n".join(lines)


# -- the command -----------------------------------------------------------------------------------


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump: main turns it into exit 2
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moeshard plan", description=(
        "Plan loading a MoE checkpoint on a cluster (no GPUs, no process group) and print what it costs, "
        "beside three baseline loaders; or, with --rebalance, plan an EPLB relocation."))
    p.add_argument("ckpt", nargs="?", metavar="CKPT", help="checkpoint directory (only headers are read)")
    p.add_argument("--synthetic-from-config", metavar="CONFIG_JSON",
                   help="plan for the checkpoint a HF config.json describes (DeepSeek-V3, Qwen3-MoE, Mixtral) instead")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--ep", type=int, required=True, help="expert-parallel size")
    p.add_argument("--efsdp", type=int, help="expert-FSDP size (default: world / ep)")
    p.add_argument("--redundant", type=int, help="redundant expert slots per layer (default 0, or from --placement)")
    p.add_argument("--storage", choices=("shared", "node", "single", "all"), default="all")
    p.add_argument("--placement", metavar="FILE.npy", help="phy2log int[num_moe_layers, num_physical]")
    p.add_argument("--bandwidth", metavar="storage=GBps,intra=GBps,inter=GBps")
    p.add_argument("--staging-mib", type=float, default=DEFAULT_STAGING_BYTES / 2**20)
    p.add_argument("--rebalance", metavar="LOADS.npy", help="float[num_moe_layers, num_logical] tokens per expert")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _load_npy(path: str, what: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path}: no such file")
    try:
        return np.load(path, allow_pickle=False)  # untrusted input: never unpickle
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{what} {path}: not a readable .npy array ({e})") from None


def run(args: argparse.Namespace) -> dict:
    """Everything ``moeshard plan`` computes, as a JSON-able dict (ValueError for bad input)."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    cfg: dict | None = None
    if args.synthetic_from_config:
        if args.ckpt:
            raise ValueError("give either CKPT or --synthetic-from-config, not both")
        cfg = read_config(args.synthetic_from_config)
        index = synthetic_index(cfg, root=f"<synthetic from {args.synthetic_from_config}>")
        source = f"synthetic from {args.synthetic_from_config}"
        layout = find_experts(index)
    else:
        if not args.ckpt:
            raise ValueError("give a checkpoint directory (CKPT) or --synthetic-from-config CONFIG_JSON")
        if not os.path.exists(args.ckpt):
            raise ValueError(f"{args.ckpt}: no such checkpoint file or directory")
        index = CheckpointIndex.open(args.ckpt)
        source = args.ckpt
        cfg_path = Path(index.root) / "config.json"
        cfg = read_config(cfg_path) if cfg_path.is_file() else None
        layers = cfg.get("num_hidden_layers") if cfg else None
        layout = find_experts(index, layers if isinstance(layers, int) and not isinstance(layers, bool) else None)
        if layout.skipped_keys:
            # Keys the model does not load are not part of any strategy's work.
            skip = set(layout.skipped_keys)
            index = CheckpointIndex(index.root, {k: v for k, v in index.tensors.items() if k not in skip}, index.file_sizes)
    timings["headers"] = time.perf_counter() - t0

    phy2log = _load_npy(args.placement, "--placement") if args.placement else None
    if phy2log is not None and phy2log.ndim == 2 and args.redundant is None:
        redundant = max(0, phy2log.shape[1] - layout.num_logical)
    else:
        redundant = args.redundant or 0
    cluster = ClusterSpec.build(args.nodes, args.ranks_per_node, args.ep, args.efsdp, redundant)
    topo = cluster.topology()  # validates ranks per node
    if phy2log is not None and not np.issubdtype(phy2log.dtype, np.integer):
        raise ValueError(f"--placement {args.placement}: expected integer expert ids, got dtype {phy2log.dtype}")
    placement = make_placement(layout, cluster, phy2log)
    staging = int(args.staging_mib * 2**20)
    if staging < 1:
        raise ValueError(f"--staging-mib must be > 0, got {args.staging_mib}")
    bw = parse_bandwidth(args.bandwidth) if args.bandwidth else None
    loads = _load_npy(args.rebalance, "--rebalance") if args.rebalance else None

    t = time.perf_counter()
    descs = synthesize_descs(layout, index, cluster)
    timings["synthesize"] = time.perf_counter() - t
    rep: dict = {
        "checkpoint": {
            "source": source,
            "num_tensors": len(index.tensors),
            "total_bytes": index.total_bytes,
            "num_params": num_params(index),
            "num_moe_layers": layout.num_layers,
            "num_logical": layout.num_logical,
            "expert_params": [p.name for p in layout.experts[0].params],
            "num_skipped_keys": len(layout.skipped_keys),
        },
        "cluster": {
            "num_nodes": cluster.num_nodes, "ranks_per_node": cluster.ranks_per_node,
            "world_size": cluster.world_size, "ep": cluster.ep, "efsdp": cluster.efsdp,
            "num_physical": placement.num_physical, "num_redundant": cluster.num_redundant,
            "slots_per_rank": placement.num_physical // cluster.ep, "staging_bytes": staging,
        },
        "timings_s": timings,
    }
    modes = STORAGE_MODES if args.storage == "all" else (args.storage,)
    can_read = np.ones(topo.world_size, dtype=bool)

    if loads is not None:
        _, readers, _ = storage_sources(modes[0], can_read, topo)
        num_groups = cfg.get("n_group") if cfg else None
        _, summary = plan_relocation_summary(descs, placement, loads, cluster, readers, staging,
                                             num_groups if isinstance(num_groups, int) else None)
        timings["rebalance"] = summary.rebalance_seconds
        timings["plan relocation"] = summary.plan_seconds
        r = asdict(summary)
        if bw is not None:
            cost = StrategyCost("relocation", "moeshard", r["cost"]["read_bytes_total"], summary.read_bytes_max_node,
                                r["cost"]["cross_node_bytes"], 0, 0, 0, 0, 0, 0,
                                summary.intra_bytes_max_rank, summary.inter_bytes_max_rank)
            r["time_s"], r["bottleneck"] = estimate_time(cost, bw)
        rep["relocation"] = r
        timings["total"] = time.perf_counter() - t0
        return rep

    t = time.perf_counter()
    needs = compute_needs(descs, index, placement, topo.world_size)
    timings["needs"] = time.perf_counter() - t
    rep["num_needs"] = len(needs)
    t = time.perf_counter()
    strategies = plan_storage_modes(needs, index, topo, modes, staging)
    timings["plan " + "+".join(modes)] = time.perf_counter() - t
    t = time.perf_counter()
    strategies += baseline_costs(needs, descs, index, cluster)
    timings["baselines"] = time.perf_counter() - t
    out = []
    for s in strategies:
        d = asdict(s)
        d["at_minimum"] = s.at_minimum()
        if bw is not None:
            d["time_s"], d["bottleneck"] = estimate_time(s, bw)
        out.append(d)
    rep["strategies"] = out
    timings["total"] = time.perf_counter() - t0
    return rep


def main(argv: list[str] | None = None) -> int:
    """``moeshard plan ...``: print the report; 2 with one line on stderr for bad input."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        rep = run(args)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (_UsageError, ValueError, OSError) as e:
        msg = " ".join(str(e).split())  # one line, whatever the message holds
        print(f"moeshard plan: error: {msg}", file=sys.stderr)
        return 2
    print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
