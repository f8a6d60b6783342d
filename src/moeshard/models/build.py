"""The transformers model a checkpoint's ``config.json`` describes, built on the meta device
(no memory, no weights): what ``moeshard verify`` and :func:`moeshard.from_pretrained`
parallelize and then load.

The config is read strictly (:func:`read_config`: moeshard's JSON parser, which bounds nesting
and number lengths; transformers' own ``json.load`` lets a RecursionError or a bare ValueError
escape without the file's name) and handed to transformers as a dict, so that one rank can read
it and the others build the same model from what it sent (a checkpoint only rank 0 sees).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..io.strict_json import load_json
from .adapters import DEFAULT_SPECS, ExpertsSpec, num_logical_experts
from .describe import expert_layers, layer_names

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["MoELayout", "meta_model", "moe_layout", "read_config"]

_WHAT = "cannot read a transformers config.json"


def read_config(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of checkpoint directory ``checkpoint``.

    Raises:
        ValueError (a :class:`~moeshard.io.errors.CheckpointError` for a bad file): naming
            the path, for a missing directory or config.json, a file that is not strict JSON,
            or JSON that is not an object.
    """
    path = os.fspath(checkpoint)
    cfg = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ValueError(
            f"{path}: no such checkpoint directory (expected a Hugging Face checkpoint: config.json and *.safetensors)"
        )
    if not os.path.isfile(cfg):
        raise ValueError(
            f"{path}: no config.json (expected a Hugging Face checkpoint directory: config.json and *.safetensors)"
        )
    config = load_json(cfg, _WHAT)
    if not isinstance(config, dict):
        raise ValueError(f"{cfg}: {_WHAT}: expected a JSON object, got {type(config).__name__}")
    return config


def meta_model(
    config: Mapping[str, Any], dtype: torch.dtype | None = None, *, source: str = "config.json"
) -> nn.Module:
    """``AutoModelForCausalLM`` for ``config`` (a parsed config.json: :func:`read_config`),
    built on the meta device.

    Args:
        dtype: the parameters' dtype; None: the config's ``dtype`` (``torch_dtype``) as
            transformers' ``from_config`` takes it (float32 when the config names none).
        source: where the config came from (the checkpoint directory), for messages.

    Raises:
        ValueError: naming ``source``: transformers missing, no or an unknown ``model_type``
            (remote-code models are not built), a config transformers refuses, or a model type
            with no causal-LM class.
    """
    try:
        import transformers
    except ImportError:
        raise ValueError("moeshard builds the model with transformers: pip install transformers") from None
    import torch

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f"{source}: config.json has no model_type (a string), so no transformers model to build")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"{source}: config.json's model_type {model_type!r} is not one transformers "
            f"{transformers.__version__} knows (models with remote code are not supported)"
        )
    try:
        # What AutoConfig.from_pretrained does with a config.json naming a model_type.
        cfg = transformers.CONFIG_MAPPING[model_type].from_dict(dict(config))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise ValueError(f"{source}: {_WHAT}: {type(e).__name__}: {e}") from None
    kwargs = {} if dtype is None else {"dtype": dtype}
    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(cfg, **kwargs)
    except ValueError as e:  # e.g. "Unrecognized configuration class ... for AutoModelForCausalLM"
        raise ValueError(f"{source}: cannot build a causal-LM model for model_type {model_type!r}: {e}") from None


@dataclass(frozen=True)
class MoELayout:
    """The MoE layers of a model, as a placement must fit them.

    Attributes:
        modules: each MoE layer's name, in layer order (a placement's rows): its experts
            module's, or the parent of the experts modules one router drives together
            (JetMoE's ``mlp`` for ``mlp.input_linear`` and ``mlp.output_linear``).
        num_logical: the logical experts of every layer.
    """

    modules: tuple[str, ...]
    num_logical: int

    @property
    def num_layers(self) -> int:
        return len(self.modules)


def moe_layout(
    model: nn.Module, specs: Sequence[ExpertsSpec] = DEFAULT_SPECS, *, source: str = "the model"
) -> MoELayout:
    """The MoE layers of ``model`` (unsharded: on meta or whole; one per router) and their
    expert count.

    Raises:
        ValueError: naming ``source``: no experts module moeshard knows (not an MoE model), or
            layers with different expert counts (one placement cannot describe them).
    """
    layers = expert_layers(model, specs)
    if not layers:
        raise ValueError(f"{source}: the model has no experts module moeshard knows (not MoE?)")
    counts = {name: num_logical_experts(mod, spec) for name, mod, spec, _ in layers}
    if len(set(counts.values())) > 1:
        raise ValueError(f"{source}: the MoE layers have different expert counts ({counts}); a placement has one")
    return MoELayout(tuple(layer_names(layers)), next(iter(counts.values())))
