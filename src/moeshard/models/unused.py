"""Checkpoint keys that no parameter of the model reads, and which of them say it does not fit.

Pure and torch-free but for :func:`ignored_patterns`, which reads the model's own list of keys
it expects to leave unread.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..io.formats import layer_of, parse_expert_key, scaled_weight
from ..io.index import CheckpointIndex
from ..placement import Placement
from .describe import ExpertRef, ParamDesc, preorder

if TYPE_CHECKING:
    from torch import nn

__all__ = ["UnusedKeys", "unused_keys", "ignored_patterns", "keys_of_experts"]


_EXPERTS_REASON = "name experts or expert tensors the model does not have"
_SCALES_REASON = "are scales of weights the model loads, which no parameter holds"


@dataclass(frozen=True)
class UnusedKeys:
    """Checkpoint keys that no parameter or buffer of the model reads.

    Args:
        keys: all of them, sorted.
        suspicious: ``{reason: sorted keys}``, those that say the checkpoint does not fit the
            model: a key under an experts module's prefix or like ``experts.<N>.`` (an expert
            the model does not have, or an expert tensor its spec does not declare), a key of a
            layer beyond the model's layers under the same prefix, the scale of a weight the
            model loads. The others (a stored rotary ``inv_freq``, the tied alias not read,
            keys the model's ``_keys_to_ignore_on_load_unexpected`` matches) are harmless.
    """

    keys: tuple[str, ...]
    suspicious: dict[str, tuple[str, ...]]

    def problem(self, root: str, limit: int = 5) -> str | None:
        """One line naming the suspicious keys (the first ``limit`` of each kind, and how
        many), or None when there are none."""
        if not self.suspicious:
            return None
        parts = []
        for reason, keys in self.suspicious.items():
            more = f" ... ({len(keys)} in all)" if len(keys) > limit else ""
            parts.append(f"{len(keys)} {reason}: {list(keys[:limit])}{more}")
        n = sum(len(k) for k in self.suspicious.values())
        return f"checkpoint {root} has {n} key(s) that no parameter or buffer of the model reads: " + "; ".join(parts)


def ignored_patterns(model: nn.Module) -> tuple[str, ...]:
    """Regexes of checkpoint keys the model expects to leave unread: transformers'
    ``_keys_to_ignore_on_load_unexpected`` of every module (transformers gathers the
    children's too; e.g. DeepSeek-V3's ``model\\.layers\\.61.*``, its MTP layer)."""
    out: dict[str, None] = {}
    name = "_keys_to_ignore_on_load_unexpected"
    for _, m in preorder(model):  # a module listed twice adds nothing
        # getattr(m, name, None) for a list that is no parameter, buffer or submodule, without
        # Module.__getattr__'s AttributeError on every module that lacks it.
        for pattern in (m.__dict__[name] if name in m.__dict__ else getattr(type(m), name, None)) or ():
            out[pattern] = None
    return tuple(sorted(out))


def unused_keys(
    descs: Sequence[ParamDesc],
    index: CheckpointIndex,
    placement: Placement | None,
    ignore: Sequence[str] = (),
    also_read: Sequence[str] = (),
) -> UnusedKeys:
    """Checkpoint keys that no parameter or buffer of ``descs`` reads (pure, no communication:
    every rank computes the same). Call it after :func:`~moeshard.models.layout.need_table`, which raises for
    missing keys.

    A key is consumed when some parameter reads it given the model, whatever the placement:
    a dense parameter's first key present in the checkpoint (the tied aliases after it are
    unused but harmless), and every part of every logical expert ``0 .. num_logical - 1`` of
    an expert parameter (an expert no slot holds, e.g. on a dead rank, is still the model's).
    ``ignore``: regexes (``re.search``) of keys never suspicious (:func:`ignored_patterns`).
    ``also_read``: keys the caller reads besides the parameters' (the scales of dequantized FP8 weights).
    Cost: set operations over the index's keys, plus a regex per unused key.
    """
    consumed: set[str] = set()
    dense: list[str] = []
    aliases: set[str] = set()
    prefixes: dict[str, None] = {}
    for d in descs:
        if d.expert is None:
            present = [k for k in d.keys if k in index]
            if not present and d.parts:  # stored as parts concatenated into it (layout._dense_part_rows)
                present = list(d.parts)
                consumed.update(present)
            dense.extend(present[:1])
            aliases.update(present[1:])
        else:
            # An unsharded model (no placement) holds the rows of identity experts too; an EP
            # model does not, but they are the model's, not stray experts.
            num_logical = placement.num_logical + d.expert.identity if placement is not None else d.shape[0]
            prefixes[f"{d.expert.module}."] = None
            consumed.update(expert_checkpoint_keys(d.expert, num_logical))
    consumed.update(dense)
    consumed.update(also_read)
    # A packed weight read as its logical tensor consumes its values, scales and the tensors its
    # format stores beside them (weight_shape, input_scale, ...); one kept packed (read under
    # its stored values key) consumes those it knowingly leaves unread.
    for pw in index.packed.values():
        if pw.key in consumed or pw.values in consumed:
            extra = (pw.values, pw.scale, pw.global_scale, getattr(pw, "shape_key", None), *pw.ignored)
            consumed.update(k for k in extra if k)
    unused = sorted(index.tensors.keys() - consumed)
    counts = _layer_counts(dense + list(prefixes))
    ignored = re.compile("|".join(f"(?:{p})" for p in ignore)) if ignore else None
    experts = tuple(prefixes)
    suspicious: dict[str, list[str]] = {}
    for key in unused:
        if key in aliases or (ignored is not None and ignored.search(key)):
            continue
        reason = None
        layer = layer_of(key)
        if layer is not None and layer[0] in counts and layer[1] >= counts[layer[0]]:
            reason = f"are in layers beyond the model's {counts[layer[0]]} under {layer[0]!r}"
        elif key.startswith(experts) or parse_expert_key(key) is not None:
            reason = _EXPERTS_REASON
        elif scaled_weight(key) in consumed:
            reason = _SCALES_REASON
        if reason is not None:
            suspicious.setdefault(reason, []).append(key)
    return UnusedKeys(tuple(unused), {r: tuple(k) for r, k in suspicious.items()})


def expert_checkpoint_keys(ref: ExpertRef, num_logical: int) -> list[str]:
    """Every checkpoint key of logical experts ``0 .. num_logical - 1`` of ``ref``
    (:func:`keys_of_experts`; the one tensor of a parameter fused on disk)."""
    if ref.param.fused:
        return list(ref.param.keys(ref.module, 0))
    return keys_of_experts(ref, range(num_logical))


def keys_of_experts(ref: ExpertRef, experts: Sequence[int]) -> list[str]:
    """Every checkpoint key of logical ``experts`` of ``ref``, part by part: part 0 of each
    expert, then part 1... DeepSeek-V3 has ~45,000: a template's keys (head + id + tail) are
    one join and one split, not a ``str.format`` call or a concatenation per key."""
    ids = list(map(str, experts))
    out: list[str] = []
    try:
        templates = ref.param.keys(ref.module, "{e}")  # the keys with their expert id left as "{e}"
    except ValueError:  # a template with a format spec (e.g. "{e:03d}"): one format per key
        return [ref.param.keys(ref.module, e)[j] for j in range(len(ref.param.parts)) for e in experts]
    for j, template in enumerate(templates):
        head, _, tail = template.partition("{e}")
        if "{e}" in tail or head == template:  # the id not exactly once: one format per key
            out.extend(ref.param.keys(ref.module, e)[j] for e in experts)
        elif "\0" in template:
            out.extend([head + i + tail for i in ids])
        elif ids:  # one join and one split (C loops) rather than a concatenation per key
            out.extend((head + (tail + "\0" + head).join(ids) + tail).split("\0"))
    return out


def _layer_counts(keys: Sequence[str]) -> dict[str, int]:
    """``{layer stack prefix: number of layers}`` from keys the model reads (the stack is the
    first ``...layers.<N>.`` of a key)."""
    counts: dict[str, int] = {}
    for key in keys:
        layer = layer_of(key)
        if layer is not None:
            counts[layer[0]] = max(counts.get(layer[0], 0), layer[1] + 1)
    return counts
