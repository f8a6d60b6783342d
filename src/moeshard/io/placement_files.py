"""Placement files: read and write an expert placement (``phy2log``) in moeshard's own JSON,
as a bare ``.npy`` array, and in the layouts the serving engines sglang and vLLM use.

Every reader returns the same thing, ``phy2log: int64[num_moe_layers, num_physical]``
(:class:`moeshard.placement.Placement`'s table: the logical expert each physical slot holds,
``-1`` for an empty slot; slot ``p`` is on EP rank ``p // slots_per_rank``, which is also how
both engines number their slots). Formats (the ``format=`` names):

``"moeshard"``: JSON, written by :func:`write_placement`::

    {"format": "moeshard.placement", "version": 1,
     "num_layers": 2, "num_logical": 8, "num_physical": 12, "num_ranks": 4, "slots_per_rank": 3,
     "layers": [
      {"layer": 1, "module": "model.layers.1.mlp.experts", "phy2log": [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]},
      {"layer": 2, "module": "model.layers.2.mlp.experts", "phy2log": [...]}]}

    ``layers`` has one entry per MoE layer, in module order. ``num_ranks`` and
    ``slots_per_rank`` may be null (EP size not fixed). ``layer`` (the decoder-layer index of
    the MoE layer) and ``module`` (the experts module's name) are optional metadata, given for
    every layer or for none; when the reader knows the model's MoE layers it checks them.

``"npy"``: ``np.save`` of the integer ``phy2log`` array (moeshard's original format).

``"sglang"``: what ``--init-expert-location FILE`` reads (``.json``, or ``.pt`` through
    ``torch.load(weights_only=True)``): a dict whose ``physical_to_logical_map`` is
    ``int[num_hidden_layers, num_physical]``. sglang sizes it by the model's
    ``num_hidden_layers``, dense layers included (DeepSeek-V3: 61 rows, rows 0-2 unused), so
    reading picks the rows of the MoE layers (``moe_layers``) and writing fills dense rows
    with sglang's own "trivial" row (``arange(num_physical) % num_logical``). Also read: the
    per-pass dump of sglang's expert-distribution recorder (``.pt``, key
    ``last_physical_to_logical_map``, same shape). A file holding ``logical_count`` (expert
    loads, which sglang rebalances at start-up) is a load table, not a placement: refused.

``"vllm"``: vLLM has no placement file; its placement is the EPLB state tensors of each model
    (``EplbModelState``). This format is those tensors as ``torch.save`` writes them: a
    dict with ``physical_to_logical_map`` ``int64[num_moe_layers, num_physical]`` and,
    optionally (checked when present), ``logical_to_physical_map``
    ``int64[num_moe_layers, num_logical, K]`` (``-1`` pads, ``K >= max copies``) and
    ``logical_replica_count`` ``int64[num_moe_layers, num_logical]``; or the bare
    ``physical_to_logical_map`` tensor. vLLM's rows are MoE layers only.

Named placements, not files (:func:`named_placement`): ``"vllm:linear"`` and
``"sglang:trivial"`` (both: slot ``p`` holds expert ``p % num_logical``, which is vLLM's
``build_initial_global_physical_to_logical_map`` and its ``linear`` ``expert_placement_strategy``
and sglang's default ``--init-expert-location trivial``) and ``"vllm:round_robin"`` (EP rank
``r``'s ``k``-th slot holds expert ``r + k * num_ranks``; vLLM allows it only without
redundant experts).

Sources read (the formats are re-implemented from them; no code copied):

- sgl-project/sglang ``python/sglang/srt/eplb/expert_location.py`` (commit
  6270b01498692d05d29267efe96d0eb7d9824545): ``compute_initial_expert_location_metadata``
  (``.pt`` via ``torch.load(weights_only=True)``, ``.json``, keys ``physical_to_logical_map``
  / ``logical_count``), ``ExpertLocationMetadata.init_trivial``;
  ``python/sglang/srt/eplb/expert_distribution.py`` (commit
  dd780ab9de484cf1198ff538a1b8b0da6464ab5a): the recorder's dumps (``_DetailAccumulator.dump``:
  ``records``, ``last_physical_to_logical_map``; ``_StatAccumulator.dump``: ``rank``,
  ``logical_count``); ``python/sglang/srt/models/deepseek_v2.py`` (commit
  3e4a39ee73308590c5c753108bdcb8d333f7f1c6): ``get_model_config_for_expert_location`` sizes the
  table by ``num_hidden_layers``.
- vllm-project/vllm ``vllm/distributed/eplb/eplb_state.py`` (commit
  50feac95f9e53a97d6ed27fee6bfe3b163d18594): ``EplbModelState`` (the three tables and their
  shapes), ``build_initial_global_physical_to_logical_map``; ``vllm/config/parallel.py``
  (commit 00193b82b0e2d4faea5d3b4ea4f6c4c2bd9d057a): ``EPLBConfig`` has no file option,
  ``expert_placement_strategy`` is ``"linear"`` or ``"round_robin"``;
  ``vllm/model_executor/layers/fused_moe/expert_map_manager.py`` (commit
  04d26335ddf7fb894244a56de9dc3b841323b0ae): ``determine_expert_map`` and
  ``determine_expert_placement_strategy`` (round robin: no redundant experts).
  Offline expert maps for vLLM were proposed (vllm-project/vllm PRs 26176, 41141, 49572,
  53022) and not merged when this was written.

torch is imported only to read or write a ``.pt`` file, always with ``weights_only=True``.
User errors are ValueErrors naming the file, the key and what was expected.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..placement import Placement

__all__ = [
    "FORMATS",
    "NAMED_PLACEMENTS",
    "PlacementFile",
    "moe_layer_indices",
    "named_placement",
    "read_placement",
    "read_placement_file",
    "write_placement",
]

FORMATS = ("moeshard", "npy", "sglang", "vllm")
NAMED_PLACEMENTS = ("vllm:linear", "vllm:round_robin", "sglang:trivial")

_MAGIC = "moeshard.placement"
_VERSION = 1
_P2L = "physical_to_logical_map"
_L2P = "logical_to_physical_map"
_COUNT = "logical_replica_count"
_SGLANG_DUMP = "last_physical_to_logical_map"  # sglang's per-pass recorder dump


@dataclass(frozen=True)
class PlacementFile:
    """What a placement file holds.

    Attributes:
        phy2log: ``int64[num_moe_layers, num_physical]``, ``-1`` for an empty slot.
        format: one of :data:`FORMATS`.
        key: where in the file the table was (``"physical_to_logical_map"``, ``"layers"``...).
        num_logical, num_ranks: as the file states them, None when it does not.
        layers: decoder-layer index of each MoE layer, when the file records them.
        modules: experts module name of each MoE layer, when the file records them.
    """

    phy2log: np.ndarray
    format: str
    key: str
    num_logical: int | None = None
    num_ranks: int | None = None
    layers: tuple[int, ...] | None = None
    modules: tuple[str, ...] | None = None


# -- reading -------------------------------------------------------------------------------


def read_placement(
    path: str | os.PathLike,
    *,
    format: str | None = None,
    num_logical: int | None = None,
    num_ranks: int | None = None,
    moe_layers: Sequence[int] | None = None,
) -> Placement:
    """The :class:`Placement` a placement file holds.

    Args:
        path: the file.
        format: one of :data:`FORMATS`; None sniffs it from the extension and content.
        num_logical, num_ranks: what the model and job have; a file that states other values
            is refused. The Placement is checked against them (every expert has a copy,
            slots divisible by the EP size).
        moe_layers: decoder-layer index of each MoE layer of the model (DeepSeek-V3:
            ``3..60``): picks sglang's rows and is checked against moeshard JSON metadata.

    Raises:
        ValueError: naming the file (and key) for a missing or unreadable file, a missing
            key, a wrong shape, a non-integer dtype, ids out of range, a logical expert
            without a copy, or values that contradict ``num_logical`` / ``num_ranks``.
    """
    f = read_placement_file(path, format=format, moe_layers=moe_layers)
    for name, want, have in (("num_logical", num_logical, f.num_logical), ("num_ranks", num_ranks, f.num_ranks)):
        if want is not None and have is not None and want != have:
            raise ValueError(f"placement file {path}: it was written for {name}={have}, expected {name}={want}")
    try:
        return Placement(
            f.phy2log,
            num_logical=num_logical if num_logical is not None else f.num_logical,
            num_ranks=num_ranks if num_ranks is not None else f.num_ranks,
        )
    except ValueError as e:
        raise ValueError(f"placement file {path}: key '{f.key}': {e}") from None


def read_placement_file(
    path: str | os.PathLike, *, format: str | None = None, moe_layers: Sequence[int] | None = None
) -> PlacementFile:
    """Parse and shape-check a placement file without building a :class:`Placement` (the CLI
    checks shapes against the model first, for its own messages). See :func:`read_placement`."""
    if format is not None and format not in FORMATS:
        raise ValueError(f"placement format {format!r} is not one of {', '.join(FORMATS)}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"placement file {path}: no such file")
    container, obj = _load(path, format)
    if container == "npy":
        if format not in (None, "npy"):
            raise ValueError(f"placement file {path}: a .npy array, not a {format} placement file")
        return PlacementFile(_int_table(obj, path, None, 2), "npy", "phy2log")
    fmt = format or _sniff(obj, path)
    if fmt == "moeshard":
        out = _from_moeshard(obj, path)
    elif fmt == "sglang":
        out = _from_sglang(obj, path, moe_layers)
    elif fmt == "vllm":
        out = _from_vllm(obj, path)
    else:
        raise ValueError(f"placement file {path}: a {container} file, not a .npy array")
    if moe_layers is not None and out.layers is not None and tuple(out.layers) != tuple(moe_layers):
        raise ValueError(
            f"placement file {path}: key 'layers': written for MoE layers at decoder layers {_short(out.layers)}, "
            f"the model's MoE layers are at {_short(moe_layers)}"
        )
    return out


def _load(path: str, format: str | None) -> tuple[str, object]:
    """``(container, content)``: ``("npy", ndarray)``, ``("json", object)`` or ``("torch", object)``."""
    with open(path, "rb") as fh:
        head = fh.read(8)
    ext = os.path.splitext(path)[1].lower()
    if head.startswith(b"\x93NUMPY") or (ext == ".npy" and format in (None, "npy")):
        try:
            return "npy", np.load(path, allow_pickle=False)  # untrusted input: never unpickle
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"placement file {path}: not a readable .npy array ({e})") from None
    # torch.save writes a zip archive (PK); older torch a raw pickle (0x80 protocol byte).
    if ext in (".pt", ".pth") or head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return "torch", _torch_load(path)
    if format == "npy":
        raise ValueError(f"placement file {path}: not a readable .npy array (no .npy header)")
    from .strict_json import load_json

    try:
        return "json", load_json(path, "not a readable placement JSON")
    except ValueError as e:
        raise ValueError(f"placement file {e}") from None


def _torch_load(path: str) -> object:
    try:
        import torch
    except ImportError:
        raise ValueError(f"placement file {path}: a torch.save file; reading it needs torch") from None
    try:
        # weights_only: tensors, dicts, lists and numbers only, never arbitrary objects.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised as ValueError; torch raises UnpicklingError, RuntimeError, EOFError...
        msg = " ".join(str(e).split())[:300]
        raise ValueError(
            f"placement file {path}: not a torch.save file torch.load(weights_only=True) reads "
            f"({type(e).__name__}: {msg})"
        ) from None


def _sniff(obj: object, path: str) -> str:
    if _is_tensor(obj):
        return "vllm"  # a bare physical_to_logical_map, as torch.save(state.physical_to_logical_map) writes it
    if not isinstance(obj, Mapping):
        raise ValueError(f"placement file {path}: holds a {type(obj).__name__}, expected a dict of placement tables")
    if obj.get("format") == _MAGIC:
        return "moeshard"
    if _P2L in obj and (_L2P in obj or _COUNT in obj):
        return "vllm"
    if _P2L in obj or _SGLANG_DUMP in obj:
        return "sglang"
    if "logical_count" in obj:
        raise ValueError(_load_table_message(path))
    raise ValueError(
        f"placement file {path}: has keys {_short(list(obj))}; expected 'format': '{_MAGIC}' (moeshard), "
        f"'{_P2L}' (sglang --init-expert-location, vLLM EPLB state) or '{_SGLANG_DUMP}' (sglang recorder dump)"
    )


def _load_table_message(path: str) -> str:
    return (
        f"placement file {path}: key 'logical_count' holds expert loads (sglang's expert-distribution "
        f"recorder), not a placement; sglang runs EPLB on it at start-up. Give a file with '{_P2L}'"
    )


def _from_moeshard(obj: object, path: str) -> PlacementFile:
    if not isinstance(obj, Mapping):
        raise ValueError(f"placement file {path}: holds a {type(obj).__name__}, expected a JSON object")
    if obj.get("format") != _MAGIC:
        raise ValueError(f"placement file {path}: key 'format': expected '{_MAGIC}', got {obj.get('format')!r}")
    version = _int_field(obj, "version", path, minimum=1)
    if version > _VERSION:
        raise ValueError(
            f"placement file {path}: key 'version': {version} is newer than this moeshard reads ({_VERSION})"
        )
    num_layers = _int_field(obj, "num_layers", path, minimum=1)
    num_logical = _int_field(obj, "num_logical", path, minimum=1)
    num_physical = _int_field(obj, "num_physical", path, minimum=1)
    num_ranks = _int_field(obj, "num_ranks", path, minimum=1, optional=True)
    slots = _int_field(obj, "slots_per_rank", path, minimum=1, optional=True)
    if num_ranks is not None and num_physical % num_ranks:
        raise ValueError(
            f"placement file {path}: key 'num_ranks': {num_ranks} does not divide num_physical={num_physical}"
        )
    if slots is not None and (num_ranks is None or slots * num_ranks != num_physical):
        raise ValueError(
            f"placement file {path}: key 'slots_per_rank': {slots}, expected num_physical / num_ranks "
            f"= {num_physical} / {num_ranks}"
        )
    layers = obj.get("layers")
    if not isinstance(layers, list) or len(layers) != num_layers:
        got = f"a list of {len(layers)}" if isinstance(layers, list) else repr(type(layers).__name__)
        raise ValueError(
            f"placement file {path}: key 'layers': expected a list of num_layers={num_layers} objects, got {got}"
        )
    rows, idx, mods = [], [], []
    for i, entry in enumerate(layers):
        where = f"layers[{i}]"
        if not isinstance(entry, Mapping) or "phy2log" not in entry:
            raise ValueError(f"placement file {path}: key '{where}': expected an object with 'phy2log'")
        row = _int_table(entry["phy2log"], path, f"{where}.phy2log", 1)
        if row.shape != (num_physical,):
            raise ValueError(
                f"placement file {path}: key '{where}.phy2log' has {row.shape[0]} slots, "
                f"expected num_physical={num_physical}"
            )
        rows.append(row)
        if "layer" in entry:
            idx.append(_int_field(entry, "layer", path, minimum=0, where=where))
        if "module" in entry:
            if not isinstance(entry["module"], str):
                raise ValueError(f"placement file {path}: key '{where}.module': expected a string")
            mods.append(entry["module"])
    for name, got in (("layer", idx), ("module", mods)):
        if got and len(got) != num_layers:
            raise ValueError(
                f"placement file {path}: key 'layers': '{name}' is given for {len(got)} of "
                f"{num_layers} layers; give it for every layer or none"
            )
    return PlacementFile(
        np.stack(rows),
        "moeshard",
        "layers",
        num_logical,
        num_ranks,
        tuple(idx) if idx else None,
        tuple(mods) if mods else None,
    )


def _from_sglang(obj: object, path: str, moe_layers: Sequence[int] | None) -> PlacementFile:
    if not isinstance(obj, Mapping):
        raise ValueError(f"placement file {path}: holds a {type(obj).__name__}, expected a dict with '{_P2L}'")
    key = _P2L if _P2L in obj else _SGLANG_DUMP if _SGLANG_DUMP in obj else None
    if key is None:
        if "logical_count" in obj:
            raise ValueError(_load_table_message(path))
        raise ValueError(
            f"placement file {path}: missing key '{_P2L}' (sglang's [num_hidden_layers, "
            f"num_physical] table); it has {_short(list(obj))}"
        )
    table = _int_table(obj[key], path, key, 2)
    if moe_layers is not None:
        moe = [int(i) for i in moe_layers]
        # sglang has a row per decoder layer; a table with a row per MoE layer is taken as is.
        if len(moe) != table.shape[0]:
            if not moe or min(moe) < 0 or max(moe) >= table.shape[0]:
                raise ValueError(
                    f"placement file {path}: key '{key}' has {table.shape[0]} row(s) (sglang writes one per decoder "
                    f"layer); the model has {len(moe)} MoE layers at decoder layers {_short(moe)}"
                )
            table = table[moe]
    return PlacementFile(table, "sglang", key)


def _from_vllm(obj: object, path: str) -> PlacementFile:
    if not isinstance(obj, Mapping):
        return PlacementFile(_int_table(obj, path, _P2L, 2), "vllm", _P2L)
    if _P2L not in obj:
        raise ValueError(
            f"placement file {path}: missing key '{_P2L}' (vLLM's [num_moe_layers, num_physical] "
            f"EPLB table); it has {_short(list(obj))}"
        )
    p2l = _int_table(obj[_P2L], path, _P2L, 2)
    num_layers, num_physical = p2l.shape
    num_logical = None
    if _COUNT in obj:
        count = _int_table(obj[_COUNT], path, _COUNT, 2)
        if count.shape[0] != num_layers:
            raise ValueError(
                f"placement file {path}: key '{_COUNT}' has shape {list(count.shape)}, expected "
                f"[num_moe_layers={num_layers}, num_logical]"
            )
        num_logical = count.shape[1]
        _check_counts(p2l, count, path)
    if _L2P in obj:
        l2p = _int_table(obj[_L2P], path, _L2P, 3)
        if l2p.shape[0] != num_layers or (num_logical is not None and l2p.shape[1] != num_logical):
            raise ValueError(
                f"placement file {path}: key '{_L2P}' has shape {list(l2p.shape)}, expected "
                f"[num_moe_layers={num_layers}, num_logical={num_logical or 'E'}, max copies]"
            )
        num_logical = l2p.shape[1]
        _check_l2p(p2l, l2p, path)
    return PlacementFile(p2l, "vllm", _P2L, num_logical)


def _check_counts(p2l: np.ndarray, count: np.ndarray, path: str) -> None:
    num_layers, num_logical = count.shape
    have = np.zeros((num_layers, num_logical + 1), dtype=np.int64)
    ids = np.where((p2l >= 0) & (p2l < num_logical), p2l, num_logical)  # others are caught by Placement
    np.add.at(have, (np.arange(num_layers)[:, None], ids), 1)
    bad = np.argwhere(have[:, :num_logical] != count)
    if len(bad):
        layer, e = bad[0]
        raise ValueError(
            f"placement file {path}: key '{_COUNT}'[{layer}, {e}] = {count[layer, e]}, but "
            f"'{_P2L}' has {have[layer, e]} copies of expert {e} in layer {layer}"
        )


def _check_l2p(p2l: np.ndarray, l2p: np.ndarray, path: str) -> None:
    """Every listed slot holds its expert, no slot twice, every copy listed."""
    num_layers, num_physical = p2l.shape
    for layer in range(num_layers):
        experts, _ = np.nonzero(l2p[layer] >= 0)
        slots = l2p[layer][l2p[layer] >= 0]
        where = f"placement file {path}: key '{_L2P}' layer {layer}"
        if len(slots) and (slots.max() >= num_physical or not np.array_equal(p2l[layer, slots], experts)):
            raise ValueError(
                f"{where}: lists a slot out of [0, {num_physical}) or holding another expert than '{_P2L}' says"
            )
        if len(np.unique(slots)) != len(slots) or len(slots) != int((p2l[layer] >= 0).sum()):
            raise ValueError(
                f"{where}: lists {len(slots)} slots ({len(np.unique(slots))} distinct), expected each "
                f"of the {int((p2l[layer] >= 0).sum())} expert copies once"
            )


def _is_tensor(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "numpy")


def _int_table(value: object, path: str, key: str | None, ndim: int) -> np.ndarray:
    """``value`` (a list, ndarray or tensor) as an int64 array of ``ndim`` dims."""
    where = f"placement file {path}: " + ("" if key is None else f"key '{key}': ")
    if _is_tensor(value):
        if value.is_floating_point() or value.is_complex() or str(value.dtype) == "torch.bool":
            raise ValueError(f"{where}expected integer expert ids, got dtype {value.dtype}")
        value = value.detach().cpu().numpy()
    try:
        a = np.asarray(value)
    except ValueError:  # ragged nested lists
        raise ValueError(f"{where}expected a rectangular table of integer expert ids") from None
    if a.dtype == object:
        raise ValueError(f"{where}expected a rectangular table of integer expert ids (ragged, or ids beyond int64)")
    if a.dtype.kind not in "iu":
        raise ValueError(f"{where}expected integer expert ids, got dtype {a.dtype}")
    if a.ndim != ndim or 0 in a.shape:
        want = {1: "[num_physical]", 2: "[num_layers, num_physical]", 3: "[num_layers, num_logical, copies]"}[ndim]
        what = "phy2log" if key is None else "it"
        raise ValueError(f"{where}{what} has shape {list(a.shape)}, expected {want}")
    if a.dtype.kind == "u" and a.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{where}expert id {a.max()} out of range")
    return np.ascontiguousarray(a, dtype=np.int64)


def _int_field(
    obj: Mapping, name: str, path: str, *, minimum: int, optional: bool = False, where: str | None = None
) -> int | None:
    v = obj.get(name)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        key = name if where is None else f"{where}.{name}"
        raise ValueError(
            f"placement file {path}: key '{key}': expected an integer >= {minimum}"
            f"{' or null' if optional else ''}, got {v!r}"
        )
    return v


def _short(xs: Sequence) -> str:
    xs = list(xs)
    return repr(xs) if len(xs) <= 8 else f"[{', '.join(map(repr, xs[:4]))}, ..., {xs[-1]!r}] ({len(xs)})"


# -- named placements ----------------------------------------------------------------------


def named_placement(
    name: str, *, num_layers: int, num_logical: int, num_ranks: int, num_redundant: int = 0
) -> Placement:
    """An engine's built-in initial placement (see the module docstring), for every layer.

    ``num_logical + num_redundant`` slots per layer must split evenly over ``num_ranks``
    (vLLM gives the first ranks one slot more when they do not; moeshard's slots are even)."""
    if name not in NAMED_PLACEMENTS:
        raise ValueError(f"placement {name!r} is not one of {', '.join(NAMED_PLACEMENTS)}")
    num_physical = num_logical + num_redundant
    if num_ranks < 1 or num_physical % num_ranks:
        raise ValueError(
            f"placement {name}: {num_physical} slots per layer ({num_logical} experts + "
            f"{num_redundant} redundant) do not split evenly over EP size {num_ranks}"
        )
    if name != "vllm:round_robin":
        return Placement.contiguous(num_layers, num_logical, num_ranks, num_redundant)
    if num_redundant:
        raise ValueError(
            f"placement {name}: vLLM places experts round robin only without redundant experts "
            f"(it falls back to linear); got {num_redundant} redundant"
        )
    spr = num_physical // num_ranks
    # Slot r * spr + k (rank r, local slot k) holds expert r + k * num_ranks.
    row = (np.arange(num_ranks)[:, None] + np.arange(spr)[None, :] * num_ranks).reshape(-1)
    return Placement(np.tile(row, (num_layers, 1)), num_logical=num_logical, num_ranks=num_ranks)


def moe_layer_indices(modules: Sequence[str]) -> tuple[int, ...] | None:
    """Decoder-layer index of each experts module (``model.layers.3.mlp.experts`` -> 3), or
    None when some name has no ``layers.<N>.`` segment."""
    from .formats import layer_of

    out = []
    for m in modules:
        block = layer_of(m + ".")
        if block is None:
            return None
        out.append(block[1])
    return tuple(out)


# -- writing -------------------------------------------------------------------------------


def write_placement(
    placement: Placement,
    path: str | os.PathLike,
    *,
    format: str,
    moe_layers: Sequence[int] | None = None,
    modules: Sequence[str] | None = None,
    num_hidden_layers: int | None = None,
) -> None:
    """Write ``placement`` to ``path`` in ``format`` (one of :data:`FORMATS`), atomically.

    Args:
        moe_layers: decoder-layer index of each MoE layer: metadata of the moeshard JSON; for
            sglang, with ``num_hidden_layers``, the rows the MoE layers take (dense rows get
            sglang's trivial row).
        modules: experts module name of each MoE layer (moeshard JSON metadata).
        num_hidden_layers: the model's decoder layers (sglang's row count).

    sglang and vLLM files are ``.pt`` (``torch.save``, int64 tensors) when ``path`` ends in
    ``.pt``/``.pth``, else JSON. Neither engine has empty slots: a placement with one is refused.
    """
    path = os.fspath(path)
    p2l = placement.phy2log
    if format not in FORMATS:
        raise ValueError(f"placement format {format!r} is not one of {', '.join(FORMATS)}")
    for name, meta in (("moe_layers", moe_layers), ("modules", modules)):
        if meta is not None and len(meta) != placement.num_layers:
            raise ValueError(f"{name} has {len(meta)} entries, the placement {placement.num_layers} layers")
    if format in ("sglang", "vllm") and placement.empty.any():
        layer, slot = np.argwhere(placement.empty)[0]
        raise ValueError(f"{format} has no empty slots, the placement's slot {slot} of layer {layer} is empty (-1)")
    if format == "npy":
        _atomic(path, lambda f: np.save(f, p2l))
    elif format == "moeshard":
        _atomic(path, lambda f: f.write(_moeshard_json(placement, moe_layers, modules).encode()))
    else:
        tables = (
            {_P2L: _sglang_rows(placement, moe_layers, num_hidden_layers)}
            if format == "sglang"
            else {_P2L: p2l, _L2P: _vllm_l2p(placement), _COUNT: placement.logcnt}
        )
        if os.path.splitext(path)[1].lower() in (".pt", ".pth"):
            import torch

            _atomic(
                path,
                lambda f: torch.save({k: torch.from_numpy(np.array(v, dtype=np.int64)) for k, v in tables.items()}, f),
            )
        else:
            text = "{" + ",\n ".join(f"{json.dumps(k)}: {_json_rows(v)}" for k, v in tables.items()) + "}\n"
            _atomic(path, lambda f: f.write(text.encode()))


def _moeshard_json(placement: Placement, moe_layers, modules) -> str:
    n = placement.num_ranks
    head = {
        "format": _MAGIC,
        "version": _VERSION,
        "num_layers": placement.num_layers,
        "num_logical": placement.num_logical,
        "num_physical": placement.num_physical,
        "num_ranks": n,
        "slots_per_rank": None if n is None else placement.num_physical // n,
    }
    layers = []
    for i, row in enumerate(placement.phy2log.tolist()):
        entry: dict = {}
        if moe_layers is not None:
            entry["layer"] = int(moe_layers[i])
        if modules is not None:
            entry["module"] = str(modules[i])
        entry["phy2log"] = row
        layers.append(json.dumps(entry))
    # One layer a line: readable and diffable at DeepSeek-V3's 58 x 288.
    return json.dumps(head)[:-1] + ',\n "layers": [\n  ' + ",\n  ".join(layers) + "]}\n"


def _sglang_rows(placement: Placement, moe_layers, num_hidden_layers) -> np.ndarray:
    if num_hidden_layers is None or moe_layers is None:
        return placement.phy2log  # every decoder layer is a MoE layer (Qwen3-MoE, Mixtral)
    moe = [int(i) for i in moe_layers]
    if len(set(moe)) != len(moe) or min(moe) < 0 or max(moe) >= num_hidden_layers:
        raise ValueError(f"moe_layers {_short(moe)} are not distinct decoder layers of 0..{num_hidden_layers - 1}")
    # Rows of dense layers are never read; sglang's own default fills them with its trivial row.
    rows = np.tile(np.arange(placement.num_physical) % placement.num_logical, (num_hidden_layers, 1))
    rows[moe] = placement.phy2log
    return rows


def _vllm_l2p(placement: Placement) -> np.ndarray:
    """``[num_layers, num_logical, num_redundant + 1]``, as vLLM's EplbModelState documents it."""
    width = placement.num_physical - placement.num_logical + 1
    out = np.full((placement.num_layers, placement.num_logical, width), -1, dtype=np.int64)
    out[:, :, : placement.log2phy.shape[2]] = placement.log2phy
    return out


def _json_rows(a: np.ndarray) -> str:
    a = np.asarray(a)
    if a.ndim == 1:
        return json.dumps(a.tolist())
    return "[\n  " + ",\n  ".join(json.dumps(x.tolist()) for x in a) + "]"


def _atomic(path: str, write) -> None:
    """Write through a temporary file beside ``path``, then rename: no half-written file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
