"""Tier 3: ``parallelize(..., mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))``
computes in bf16 on 4 gloo ranks, experts included, as FSDP2 would in one process.

The model: a tiny float32 Qwen3-MoE from ``save_pretrained``, parallelized with EP=4 (contiguous
placement; the experts are FSDP's ignored parameters, so moeshard's EP forward must cast them
itself) and EP=2 x efsdp=2 (a shuffled placement; expert FSDP casts them), loaded, then one
forward and backward, each rank on its own batch row.

The reference is one process running FSDP2 itself with the same policy: transformers'
``from_pretrained`` in float32, ``fully_shard`` on every decoder layer and the root over a
1-rank mesh, which casts every parameter to bf16 for compute, the experts' with the rest, and
brings the bf16 gradients back in float32. It is the closest analog because it is the very
mechanism (same casts at the same module boundaries); autocast would keep some ops in float32
and cast at other places. It runs each batch row alone, and its gradient is the float32 mean of
the rows' gradients: what 4 data-parallel FSDP2 ranks compute, each rounding its own bf16
gradient.

Tolerances, and why:
- loss and logits, each rank against the reference on its row: within 1e-6 and 1e-3 of the
  largest magnitude. The EP forward runs the same bf16 operations on the same rows (the
  all-to-all moves values unchanged; each expert runs the family's own forward; top-2 sums
  commute), and was bitwise equal when written; the logits' margin, a quarter of one bf16
  rounding (2**-8) at their largest, is for CPU kernels that round differently for another row
  count. The float32 model is asserted to be more than 10x the tolerance away.
- gradients of non-expert parameters: within 1e-5 of each tensor's largest (float32 sums of the
  same bf16 per-row gradients, in another order).
- gradients of expert parameters: element-wise within ``2 * 2**-8 * mean_r |g_r|`` (+1e-6 of the
  tensor's largest), ``g_r`` the reference's gradient of row r. With EP, a slot's weight
  gradient sums the rows of several ranks in one bf16 matmul, rounded once (unit roundoff
  ``u = 2**-8``), where the reference rounds each row's gradient: each is within
  ``u * sum_r |g_r| / 4`` of the exact mean, so within twice that of each other. The float32
  model's expert gradients are asserted to break that bound by more than 4x somewhere.
"""

from __future__ import annotations

import pytest
import torch

from mp import run_ranks
from tiny_hf import data, full_params, save_checkpoint

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

WORLD = 4
U = 2.0**-8  # bf16's unit roundoff (8 significant bits)
LOSS_RTOL, LOGITS_RTOL, DENSE_GRAD_RTOL = 1e-6, 1e-3, 1e-5
SCENARIOS = [(4, 1), (2, 2)]  # (EP, efsdp)


def _policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _reference(ckpt: str, ids: torch.Tensor, group, policy) -> list[tuple[float, torch.Tensor, dict]]:
    """One process: ``(loss, logits, {name: float32 grad})`` of each row of ``ids`` alone."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    if policy is not None:
        one = DeviceMesh.from_group(group, "cpu")
        for block in model.model.layers:
            fully_shard(block, mesh=one, mp_policy=policy)
        fully_shard(model, mesh=one, mp_policy=policy)
    out = []
    for r in range(len(ids)):
        res = model(input_ids=ids[r : r + 1], labels=ids[r : r + 1])
        res.loss.backward()
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().float().clone()
            for n, p in model.named_parameters()
        }
        out.append((float(res.loss.detach()), res.logits.detach().float(), grads))
        model.zero_grad()
    return out


def worker(ckpt: str) -> dict | None:
    import numpy as np
    import torch.distributed as dist

    import moeshard

    rank = dist.get_rank()
    ids = data(WORLD)
    ones = [dist.new_group([r]) for r in range(WORLD)]  # every rank creates every group
    refs = {}
    if rank == 0:
        refs = {"bf16": _reference(ckpt, ids, ones[0], _policy()), "fp32": _reference(ckpt, ids, None, None)}
    out = {}
    for ep, efsdp in SCENARIOS:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(ckpt))
        if efsdp == 1:
            pl = moeshard.Placement.contiguous(2, 8, ep)
        else:  # shuffled, no redundant copies (their gradients are another test's)
            rng = np.random.default_rng(3)
            pl = moeshard.Placement(np.stack([rng.permutation(8) for _ in range(2)]), num_logical=8, num_ranks=ep)
        moeshard.parallelize(model, moeshard.make_mesh("cpu", ep=ep, efsdp=efsdp), pl, mp_policy=_policy())
        moeshard.load(model, ckpt, placement=pl)
        res = model(input_ids=ids[rank : rank + 1], labels=ids[rank : rank + 1])
        res.loss.backward()
        losses = [None] * WORLD
        dist.all_gather_object(losses, float(res.loss.detach()))
        logits = [torch.empty_like(res.logits, dtype=torch.float32) for _ in range(WORLD)]
        dist.all_gather(logits, res.logits.detach().float().contiguous())
        grads = full_params(model, pl, grads=True)
        param_dtypes = {str(p.dtype) for p in model.parameters()}
        grad_dtypes = {str(p.grad.dtype) for p in model.parameters()}
        if rank == 0:
            out[(ep, efsdp)] = _compare(refs, losses, logits, grads, str(res.logits.dtype), param_dtypes, grad_dtypes)
    return out if rank == 0 else None


def _compare(refs, losses, logits, grads, logits_dtype, param_dtypes, grad_dtypes) -> dict:
    """Every measure of the module doc, against the bf16 and the float32 reference."""
    out = dict(logits_dtype=logits_dtype, param_dtypes=param_dtypes, grad_dtypes=grad_dtypes)
    for name, ref in refs.items():
        mean = {n: sum(r[2][n] for r in ref) / WORLD for n in ref[0][2]}
        out[name] = dict(
            loss=max(abs(losses[r] - ref[r][0]) / abs(ref[r][0]) for r in range(WORLD)),
            logits=max(float((logits[r] - ref[r][1]).abs().max() / ref[r][1].abs().max()) for r in range(WORLD)),
            dense=max(
                float((grads[n] - mean[n]).abs().max() / mean[n].abs().max()) for n in mean if ".experts." not in n
            ),
            # Expert gradients in units of the bound of the module doc.
            experts=max(
                float(
                    (
                        (grads[n] - mean[n]).abs()
                        / (2 * U * sum(r[2][n].abs() for r in refs["bf16"]) / WORLD + 1e-6 * mean[n].abs().max())
                    ).max()
                )
                for n in mean
                if ".experts." in n
            ),
        )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("mp") / "qwen3_moe")
    save_checkpoint("qwen3_moe", ckpt)
    return run_ranks(worker, ckpt, world=WORLD, local_world=2, timeout=280)[0]


@pytest.mark.parametrize("ep,efsdp", SCENARIOS, ids=[f"ep{e}-efsdp{f}" for e, f in SCENARIOS])
def test_bf16_policy_matches_one_process_fsdp2_bf16(results, ep, efsdp):
    got = results[(ep, efsdp)]
    print(f"ep={ep} efsdp={efsdp}: {got}")
    # float32 master weights and gradients, bf16 compute.
    assert got["param_dtypes"] == {"torch.float32"} and got["grad_dtypes"] == {"torch.float32"}
    assert got["logits_dtype"] == "torch.bfloat16"
    bf16, fp32 = got["bf16"], got["fp32"]
    assert bf16["loss"] <= LOSS_RTOL, bf16
    assert bf16["logits"] <= LOGITS_RTOL, bf16
    assert bf16["dense"] <= DENSE_GRAD_RTOL, bf16
    assert bf16["experts"] <= 1.0, bf16
    # The policy is applied: the float32 model is far outside every tolerance.
    assert fp32["loss"] > 10 * LOSS_RTOL, fp32
    assert fp32["logits"] > 10 * LOGITS_RTOL, fp32
    assert fp32["dense"] > 10 * DENSE_GRAD_RTOL, fp32
    assert fp32["experts"] > 4.0, fp32


def test_mp_policy_must_be_fsdp2s():
    """A policy of another kind (FSDP1's MixedPrecision, a bare dtype) is refused by name."""
    import moeshard

    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"mp_policy must be a torch\.distributed\.fsdp\.MixedPrecisionPolicy"):
        moeshard.parallelize(model, None, None, mp_policy=torch.bfloat16)
