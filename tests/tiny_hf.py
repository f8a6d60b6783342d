"""Tiny transformers MoE models (Qwen3-MoE: 8 experts, Mixtral: 6, DeepSeek-V3: 8 routed experts
with MLA, a dense first layer, a shared expert, ``e_score_correction_bias`` buffers and
group-limited routing) and their checkpoints, for the tests of every operation. A helper module,
not a test file."""

from __future__ import annotations

import numpy as np
import torch

FAMILIES = {"qwen3_moe": 8, "mixtral": 6, "deepseek_v3": 8}  # family -> logical experts per MoE layer
NUM_LAYERS = 2  # MoE layers (every decoder layer, but DeepSeek-V3's first, which is dense)
# The families that stand side by side in every test matrix.
MATRIX = ("qwen3_moe", "deepseek_v3")
VOCAB, SEQ = 128, 16


def config(family: str):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        num_hidden_layers=NUM_LAYERS,
        num_key_value_heads=2,
        head_dim=8,
    )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=8, **common)
    if family == "deepseek_v3":
        common.pop("head_dim")
        common["num_hidden_layers"] = NUM_LAYERS + 1  # layer 0 is dense (first_k_dense_replace)
        return transformers.DeepseekV3Config(
            intermediate_size=64,
            moe_intermediate_size=16,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            **common,
        )
    assert family == "mixtral"
    return transformers.MixtralConfig(intermediate_size=16, num_local_experts=6, **common)


def save_checkpoint(family: str, directory) -> None:
    """``save_pretrained`` of a float32 model with distinct values everywhere (norms start at
    ones, biases at zero; DeepSeek-V3's ``e_score_correction_bias`` buffers too), in several
    shards."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(family))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a persistent buffer: saved, loaded, moved
                b.add_(torch.randn_like(b) * 0.1)
    model.save_pretrained(directory, max_shard_size="50KB")


def data(world: int) -> torch.Tensor:
    """``int64[world, SEQ]`` token ids: row r is rank r's batch."""
    return torch.randint(0, VOCAB, (world, SEQ), generator=torch.Generator().manual_seed(0))


def meta_qwen3(ep: int, placement, efsdp: int = 1, replicate: int = 1):
    """The tiny Qwen3-MoE built on the meta device and parallelized on a CPU mesh of the current
    group (EP ``ep``, expert-FSDP ``efsdp``, HSDP ``replicate``) with ``placement``."""
    return meta_model("qwen3_moe", ep, placement, efsdp=efsdp, replicate=replicate)


def meta_model(family: str, ep: int, placement, efsdp: int = 1, replicate: int = 1):
    """The tiny ``family`` model built on the meta device and parallelized on a CPU mesh of the
    current group (EP ``ep``, expert-FSDP ``efsdp``, HSDP ``replicate``) with ``placement``."""
    import transformers

    import moeshard

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config(family))
    mesh = moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp, replicate=replicate)
    moeshard.parallelize(model, mesh, placement)
    return model


def train_steps(model, opt, ids: torch.Tensor, n: int) -> list[float]:
    """Collective (every rank of the current group): ``n`` optimizer steps on this rank's
    ``ids`` (``int64[batch, SEQ]``), redundant experts' gradients synced; each step's loss
    averaged over the group's ranks."""
    import torch.distributed as dist

    import moeshard

    losses = []
    for _ in range(n):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        moeshard.sync_redundant_grads(model)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def shuffled_redundant(num_logical: int, ep: int, seed: int):
    """Every expert once plus redundant copies (at least one per EP rank, slots a multiple of
    ``ep``), shuffled, per layer."""
    import moeshard

    rng = np.random.default_rng(seed)
    extra = ep + (-(num_logical + ep)) % ep
    rows = [
        rng.permutation(np.concatenate([np.arange(num_logical), rng.integers(0, num_logical, extra)]))
        for _ in range(NUM_LAYERS)
    ]
    return moeshard.Placement(np.stack(rows), num_logical=num_logical, num_ranks=ep)


def full_params(model, placement, grads: bool = False, of=None) -> dict[str, torch.Tensor]:
    """Collective (every rank): every parameter (or its gradient; or ``of(parameter)``, e.g. an
    optimizer state shaped like it) of a parallelized model as one process holds it: DTensors
    gathered whole, and each expert parameter ``[num_physical, ...]`` in slot order turned into
    ``[num_logical, ...]`` logical order, after checking that every copy of a redundant expert is
    the same (a copy differing is reported as NaN rows)."""
    from torch.distributed.tensor import DTensor

    from moeshard.models.describe import expert_layers

    # Only the experts' sliced parameters are in slot order; an experts module's others (gpt-oss's
    # biases) are whole, one row per logical expert.
    layer_of = {f"{e.name}.{p.name}": e.layer for e in expert_layers(model) for p in e.spec.params}
    out = {}
    for name, p in model.named_parameters():
        t = of(p) if of is not None else p.grad if grads else p
        t = t.full_tensor() if isinstance(t, DTensor) else t
        t = t.detach().clone()
        if name in layer_of:
            p2l = torch.from_numpy(placement.phy2log[layer_of[name]].copy()).to(t.device)
            logical = t.new_empty((placement.num_logical, *t.shape[1:]))
            logical[p2l] = t  # one copy of each expert
            differs = (t != logical[p2l]).flatten(1).any(1)
            logical[p2l[differs]] = float("nan")
            t = logical
        out[name] = t
    return out


def moe_blocks(family: str) -> tuple[int, ...]:
    """Decoder-layer indices of the ``NUM_LAYERS`` MoE layers (DeepSeek-V3's layer 0 is dense)."""
    first = 1 if family == "deepseek_v3" else 0
    return tuple(range(first, first + NUM_LAYERS))


def persistent_buffers(model) -> dict[str, torch.Tensor]:
    """Every persistent buffer of ``model`` (DeepSeek-V3's ``e_score_correction_bias [8]``),
    by name, as this rank holds it (FSDP2 leaves buffers whole on every rank); cloned."""
    out = {}
    for prefix, module in model.named_modules():
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b.detach().clone()
    return out
