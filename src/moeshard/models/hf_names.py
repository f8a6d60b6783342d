"""Checkpoint names of a transformers model, from transformers' own conversion mapping.

transformers 5 keeps, per model family, the list of transforms ``from_pretrained`` applies to
checkpoint keys (``transformers.conversion_mapping.get_model_conversion_mapping``):

* ``WeightRenaming(source, target)``: a checkpoint key matching ``source`` is renamed
  (Mixtral: ``.block_sparse_moe.`` -> ``.mlp.``; PhiMoE: ``.gate.weight`` -> ``.router.weight``);
* ``WeightConverter(sources, target, operations)``: per-expert checkpoint tensors become one
  fused parameter (``experts.*.w1.weight`` + ``experts.*.w3.weight`` ->
  ``experts.gate_up_proj`` by ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``).

``save_pretrained`` applies the reverse. :class:`HFNames` reads that mapping once per model
and gives moeshard what it needs, so that moeshard names a family's tensors exactly as
transformers does:

* :attr:`HFNames.specs`: an :class:`~moeshard.models.adapters.ExpertsSpec` per converter moeshard
  can express as box reads (stack along the expert dim, optionally concatenate the parts);
* :meth:`HFNames.checkpoint_parts`: the keys a dense tensor is split into on disk, where a
  converter concatenates several checkpoint tensors into one model tensor (Kimi-Linear's and
  Bailing-hybrid's ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` -> ``conv1d``: ``Concatenate(dim=0)``);
* :meth:`HFNames.checkpoint_name`: the key ``save_pretrained`` writes for a model name;
* :meth:`HFNames.loaded_name`: the model name ``from_pretrained`` gives a checkpoint key (or the
  fused parameter a per-expert key goes into), to check a key set before it is published.

Importing this module does not import transformers or torch; :func:`hf_names` does, and
returns None for a model that is not a transformers model (a custom model names its tensors
itself, see :class:`~moeshard.models.adapters.ExpertsSpec`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..io.formats import scaled_weight
from .adapters import ExpertParam, ExpertsSpec

__all__ = ["HFNames", "hf_names", "hf_model_of", "KeyMismatch"]

_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True, eq=False)
class HFNames:
    """The names transformers gives one model's tensors on disk.

    Args:
        family: the model's ``config.model_type``.
        model_class: the class whose ``from_pretrained`` reads the checkpoint.
        specs: expert specs from the family's converters (module regexes on model names).
        refused: ``(target pattern, why)`` of the family's converters moeshard cannot express
            as box reads (an ``Interleave``, a ``Transpose``, ...).
        concats: ``(target, sources, dim)`` of the family's converters that concatenate dense
            checkpoint tensors ``sources`` (name suffixes, in order) along ``dim`` into the model
            tensor named ``...target`` (:meth:`checkpoint_parts`).
        save_renamings: transformers' reversed renames (model -> disk).
        loading: its forward transforms (disk -> model), as ``from_pretrained`` applies them
            (``PrefixChange`` and the legacy renames included), worked out on first use of
            :attr:`load_renamings` / :attr:`load_converters` (a load, which names tensors as
            a save does, never asks: transformers' mapping is a deep copy per call).
    """

    family: str
    model_class: str
    specs: tuple[ExpertsSpec, ...]
    refused: tuple[tuple[str, str], ...]
    save_renamings: tuple[Any, ...] = field(repr=False)
    loading: Callable[[], list] = field(repr=False)
    concats: tuple[tuple[str, tuple[str, ...], int], ...] = ()

    @functools.cached_property
    def _loading(self) -> list:
        return self.loading()

    @property
    def load_renamings(self) -> tuple[Any, ...]:
        from transformers.core_model_loading import WeightRenaming

        return tuple(t for t in self._loading if isinstance(t, WeightRenaming))

    @property
    def load_converters(self) -> tuple[Any, ...]:
        from transformers.core_model_loading import WeightConverter

        return tuple(t for t in self._loading if isinstance(t, WeightConverter))

    def checkpoint_name(self, name: str) -> str:
        """The key ``save_pretrained`` writes for model tensor ``name`` (a dense parameter, a
        buffer, or a per-expert key spelled with the model's module names)."""
        for t in self.save_renamings:
            name, _ = t.rename_source_key(name)
        return name

    def checkpoint_parts(self, name: str) -> tuple[tuple[str, ...], int] | None:
        """``(keys, dim)``: the checkpoint keys ``save_pretrained`` splits dense model tensor
        ``name`` into (its ``Concatenate(dim)`` converter reversed: equal chunks along ``dim``,
        then the renames), in concatenation order; None when no converter concatenates it."""
        for target, sources, dim in self.concats:
            if name == target or name.endswith("." + target):
                head = name[: len(name) - len(target)]
                return tuple(self.checkpoint_name(head + s) for s in sources), dim
        return None

    def checkpoint_module(self, module: str, param: ExpertParam) -> str:
        """The checkpoint prefix of experts module ``module`` (model name) for ``param``: the
        part of the renamed per-expert keys before ``.{e}.``.

        Raises:
            ValueError: the family's renames do not keep the per-expert suffix intact.
        """
        prefixes = set()
        for e in (0, 1):
            for part in param.parts:
                suffix = "." + part.format(e=e)
                key = self.checkpoint_name(module + suffix)
                if not key.endswith(suffix):
                    raise ValueError(
                        f"model family {self.family!r}: its checkpoint name for {module + suffix!r} is "
                        f"{key!r}, which moeshard cannot split into a module and a per-expert key"
                    )
                prefixes.add(key[: -len(suffix)])
        if len(prefixes) != 1:
            raise ValueError(
                f"model family {self.family!r}: the parts of {module}.{param.name} are renamed to "
                f"different modules {sorted(prefixes)}"
            )
        return prefixes.pop()

    def loaded_name(self, key: str, model_names: frozenset[str] | set[str] = frozenset()) -> str:
        """The model name ``from_pretrained`` loads checkpoint ``key`` into: its renames in
        order, then at most one converter (a per-expert key -> the fused parameter); like
        ``from_pretrained``, a key that is a model name (``model_names``) and would be renamed
        to none stays as it is (DeepSeek-V4's ``.norm.`` -> ``.kv_norm.`` spares ``model.norm``)."""
        name = key
        for t in self.load_renamings:
            name, _ = t.rename_source_key(name)
        for c in self.load_converters:
            name, matched = c.rename_source_key(name)
            if matched is not None:
                break
        if name not in model_names and key in model_names:
            return key
        weight = scaled_weight(key)
        if name not in model_names and weight is not None and weight.endswith("weight"):
            # An FP8 block scale goes where its weight goes, suffixed as transformers' quantizer
            # copies the weight's converter for it when the model keeps the scale
            # (``experts.0.gate_proj.weight_scale_inv`` -> ``experts.gate_up_proj_scale_inv``).
            scale = self.loaded_name(weight, model_names) + key[len(weight) :]
            if scale in model_names:
                return scale
        return name

    def check_keys(self, keys: Iterable[str], expected: Iterable[Iterable[str]]) -> KeyMismatch | None:
        """Whether ``from_pretrained`` would consume exactly ``keys``: every key lands on a
        model tensor, and every tensor (``expected``: the names of each tensor, tied aliases
        together) gets a key. Returns the mismatch, or None when there is none."""
        expected = [tuple(names) for names in expected]
        known = {n for names in expected for n in names}
        landed: dict[str, str] = {}
        for k in keys:
            landed.setdefault(self.loaded_name(k, known), k)
        missing = [names[0] for names in expected if not any(n in landed for n in names)]
        unexpected = [k for name, k in landed.items() if name not in known]
        if missing or unexpected:
            return KeyMismatch(self, tuple(missing), tuple(unexpected))
        return None


@dataclass(frozen=True)
class KeyMismatch:
    """Model tensors a checkpoint lacks and checkpoint keys the model has no place for, as
    ``from_pretrained`` of the family would see them."""

    names: HFNames
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]

    def message(self, what: str) -> str:
        """The error text: what is missing or ignored, and the family's converters moeshard
        cannot express (the usual cause)."""

        def some(xs):
            return ", ".join(xs[:3]) + (f", ... ({len(xs)} in all)" if len(xs) > 3 else "")

        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} model tensor(s) would get no value ({some(self.missing)})")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} key(s) would be ignored ({some(self.unexpected)})")
        if self.names.refused:
            parts.append(
                f"moeshard cannot express the family's converters "
                f"{[f'{t} ({how})' for t, how in self.names.refused]} as box reads"
            )
        return (
            f"{what}: {self.names.model_class}.from_pretrained (model family {self.names.family!r}) would not "
            f"read these names back: " + "; ".join(parts)
        )


def hf_model_of(model) -> tuple[Any, str] | None:
    """The transformers model inside ``model`` and its name prefix: the model itself, or a peft
    model's base model (``base_model.model.``); None for any other model."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers is optional: no transformers, no transformers models
        return None
    if isinstance(model, PreTrainedModel):
        return model, ""
    inner = getattr(getattr(model, "base_model", None), "model", None)
    if isinstance(inner, PreTrainedModel):
        return inner, _PEFT_PREFIX
    return None


def hf_names(model) -> HFNames | None:
    """The names transformers gives ``model``'s tensors, or None when ``model`` is not a
    transformers model (or transformers has no conversion API). Must be called on a model
    whose module tree is final (it looks at the sub-models' configs)."""
    found = hf_model_of(model)
    if found is None:
        return None
    hf, _ = found
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming
    except ImportError:  # a transformers without conversion mappings (< 5): names are the model's own
        return None
    family = getattr(hf.config, "model_type", None) or type(hf).__name__
    # transformers picks a mapping by the model's class name: FSDP2 renames the class
    # (FSDPHyV4ForCausalLM), so look it up as the class transformers defined.
    own = next(c for c in type(hf).__mro__ if not c.__module__.startswith("torch."))

    def mapping(**kwargs) -> list:  # may run later (loading): the class it has then is put back
        wrapped = type(hf)
        try:
            hf.__class__ = own
            return list(get_model_conversion_mapping(hf, **kwargs))
        finally:
            hf.__class__ = wrapped

    conversions = getattr(hf, "_weight_conversions", None)  # a model from_pretrained loaded has them
    # save_pretrained's: the reverse of the family's own, PrefixChange dropped for a model not
    # loaded by from_pretrained (transformers does the same: it cannot know the prefix was there).
    saving = conversions
    if saving is None:
        saving = [t for t in mapping(add_legacy=False) if not isinstance(t, PrefixChange)]
    # from_pretrained's transforms (a model built from a config has no _weight_conversions).
    loading = (lambda: list(conversions)) if conversions else mapping
    reverse = [t.reverse_transform() for t in saving[::-1]]
    specs, refused, concats = [], [], []
    for t in saving:
        if isinstance(t, WeightConverter):
            spec, why = _expert_spec(t)
            concat = _dense_concat(t) if spec is None else None
            if spec is not None:
                specs.append(spec)
            elif concat is not None:
                concats.append(concat)
            else:
                refused.append((", ".join(t._original_target_patterns), why))
    return HFNames(
        family=family,
        model_class=own.__name__,
        specs=merge_specs(specs),
        refused=tuple(refused),
        save_renamings=tuple(t for t in reverse if isinstance(t, WeightRenaming)),
        loading=loading,
        concats=tuple(concats),
    )


def _plain(pattern: str) -> str | None:
    """A pattern of literal text (``\\.`` for a dot, ``*`` for the expert index), unescaped;
    None for a real regex."""
    text = pattern.replace("\\.", ".")
    return None if re.search(r"[\\()\[\]^$?+|{}]", text) else text


def _expert_spec(conv) -> tuple[ExpertsSpec | None, str]:
    """The :class:`ExpertsSpec` of a converter that stacks per-expert tensors along the expert
    dim (``MergeModulelist(dim=0)``) and optionally concatenates the parts
    (``Concatenate(dim=d)``, d >= 1): ``(spec, "")``, or ``(None, why)``."""
    ops = [type(op).__name__ for op in conv.operations]
    if (
        not ops
        or ops[0] != "MergeModulelist"
        or conv.operations[0].dim != 0
        or len(ops) > 2
        or (len(ops) == 2 and (ops[1] != "Concatenate" or conv.operations[1].dim < 1))
    ):
        interleave = next((op for op in conv.operations if type(op).__name__ == "Interleave"), None)
        if interleave is not None:
            d = interleave.dim
            sources = [_plain(p) or p for p in conv._original_source_patterns]
            return None, (
                f"operations {ops} on checkpoint tensor {', '.join(sources)}: Interleave(dim={d}) alternates "
                f"the two halves of dim {d} on disk (index 2*i + j of the checkpoint tensor is index "
                f"j*n + i of the model's, n half the dim), so each "
                f"half of an expert's slice is every other row of the checkpoint tensor: no box of it, and "
                f"moeshard reads and writes boxes only"
            )
        split = next((op for op in conv.operations if type(op).__name__ == "Split"), None)
        if split is not None and len(conv._original_source_patterns) == 1:
            source = _plain(conv._original_source_patterns[0]) or conv._original_source_patterns[0]
            targets = [_plain(p) or p for p in conv._original_target_patterns]
            return None, (
                f"operations {ops}: Split(dim={split.dim}) cuts checkpoint tensor {source} into the model's "
                f"{', '.join(targets)} (consecutive runs of dim {split.dim}); moeshard reads and writes each "
                f"model tensor as a checkpoint tensor of its own (or the parts a Concatenate joins), and does "
                f"not cut one checkpoint tensor into several"
            )
        return None, f"operations {ops}"
    targets = conv._original_target_patterns
    if len(targets) != 1 or _plain(targets[0]) is None or "*" in targets[0]:
        return None, f"target {targets}"
    module, _, name = _plain(targets[0]).rpartition(".")
    parts = []
    for src in conv._original_source_patterns:
        text = _plain(src)
        if text is None or text.count(".*.") != 1:
            return None, f"source {src!r}"
        pre, stem = text.split(".*.")
        if pre != module:
            return None, f"source {src!r} and target {targets[0]!r} name different modules"
        parts.append("{e}." + stem)
    if len(parts) > 1 and len(ops) != 2:
        return None, f"{len(parts)} sources without a Concatenate"
    dim = conv.operations[1].dim - 1 if len(ops) == 2 else 0
    # The module pattern anchors on name boundaries: ``.experts`` or ``mlp.experts`` end a name.
    regex = ("" if module.startswith(".") else r"(^|\.)") + re.escape(module) + "$"
    return ExpertsSpec(module=regex, params=(ExpertParam(name, tuple(parts), dim),)), ""


def _dense_concat(conv) -> tuple[str, tuple[str, ...], int] | None:
    """``(target, sources, dim)`` of a converter that only concatenates two or more dense
    checkpoint tensors along ``dim`` (``Concatenate(dim)``, literal patterns with no expert
    index), else None."""
    ops = conv.operations
    if len(ops) != 1 or type(ops[0]).__name__ != "Concatenate" or getattr(ops[0], "num_shards_attribute", None):
        return None
    targets, sources = conv._original_target_patterns, conv._original_source_patterns
    if len(targets) != 1 or len(sources) < 2:
        return None
    plain = [_plain(p) for p in (*targets, *sources)]
    if any(p is None or "*" in p or p.startswith(".") or p.endswith(".") for p in plain):
        return None
    return plain[0], tuple(plain[1:]), ops[0].dim


def merge_specs(specs: Iterable[ExpertsSpec]) -> tuple[ExpertsSpec, ...]:
    """Specs of the same module pattern merged into one (a family's gate/up and down converters
    describe one experts module)."""
    by_module: dict[str, list[ExpertParam]] = {}
    for s in specs:
        by_module.setdefault(s.module, []).extend(s.params)
    return tuple(ExpertsSpec(m, tuple(ps)) for m, ps in by_module.items())
