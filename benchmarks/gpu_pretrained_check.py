"""One GPU, NCCL, one process: moeshard.from_pretrained and mixed precision on CUDA (CI has no GPU).

Run from the repository root: ``PYTHONPATH=src python3 benchmarks/gpu_pretrained_check.py``
(``benchmarks/gpu_checks.sh cuda`` runs it). Checks, asserting: job_device() picks the current
CUDA device under NCCL; from_pretrained (a shuffled redundant placement, verify=True) puts every
parameter on it, equal to transformers' one-process model, logits within 1e-5 (float32); with a
bf16 MixedPrecisionPolicy (EP=1: the experts are FSDP's ignored parameters, cast by the EP
forward) the logits are bf16, the gradients float32 and close to FSDP2's own bf16 run of the same
model, and the loss differs from the float32 one. Prints the figures.
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import moeshard
from moeshard.integrations.pretrained import job_device
from tiny_hf import data, full_params, save_checkpoint, shuffled_redundant

print("torch", torch.__version__, "transformers", transformers.__version__, flush=True)
cuda = torch.cuda.is_available()  # without one (a dry run of this script): gloo on the CPU
dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(0)
dist.init_process_group("nccl" if cuda else "gloo", init_method="tcp://127.0.0.1:29511", rank=0, world_size=1)
ck = "/tmp/ck_qwen"
save_checkpoint("qwen3_moe", ck)
ids = data(4).to(dev)
print("job_device", job_device(), flush=True)
pl = shuffled_redundant(8, 1, seed=3)
t = time.time()
m = moeshard.from_pretrained(ck, ep=1, placement=pl, verify=True)
print(
    "from_pretrained+verify s",
    round(time.time() - t, 2),
    "devices",
    {str(p.device) for p in m.parameters()},
    flush=True,
)
ref = transformers.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32).to(dev)
got = full_params(m, m.moeshard_placement)
unequal = [n for n, p in ref.named_parameters() if not torch.equal(got[n], p.detach())]
print("unequal params", unequal, flush=True)
assert not unequal and job_device() == dev
assert {p.device.type for p in m.parameters()} == {dev.type}
with torch.no_grad():
    a, b = m(input_ids=ids).logits, ref(input_ids=ids).logits
d32 = float((a - b).abs().max() / b.abs().max())
print("fp32 logits rel diff", d32, flush=True)
assert d32 <= 1e-5
pol = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
m2 = moeshard.from_pretrained(ck, ep=1, mp_policy=pol)
o2 = m2(input_ids=ids, labels=ids)
o2.loss.backward()
ref2 = transformers.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32).to(dev)
mesh = init_device_mesh(dev.type, (1,))
for blk in ref2.model.layers:
    fully_shard(blk, mesh=mesh, mp_policy=pol)
fully_shard(ref2, mesh=mesh, mp_policy=pol)
r2 = ref2(input_ids=ids, labels=ids)
r2.loss.backward()
g = full_params(m2, m2.moeshard_placement, grads=True)
gr = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in ref2.named_parameters()}
print(
    "bf16 logits dtype",
    o2.logits.dtype,
    "loss",
    float(o2.loss),
    float(r2.loss),
    "logits rel diff",
    float((o2.logits.float() - r2.logits.float()).abs().max() / r2.logits.float().abs().max()),
    flush=True,
)
print("grad dtypes", {str(p.grad.dtype) for p in m2.parameters()}, flush=True)
assert o2.logits.dtype == torch.bfloat16 and {p.grad.dtype for p in m2.parameters()} == {torch.float32}
worst = 0.0
for n in gr:
    d = float((g[n] - gr[n]).abs().max() / gr[n].abs().max())
    worst = max(worst, d)
    if d > 0 or ".experts." in n:
        print("grad", n, f"{d:.3g}")
assert worst < 2**-5, worst  # bf16 roundings (CPU: <= 4e-3), far below float32's 3e-2
o3 = m(input_ids=ids, labels=ids)
print("fp32 loss", float(o3.loss), "bf16-fp32 loss diff", float(o2.loss) - float(o3.loss), flush=True)
assert float(o2.loss) != float(o3.loss)
dist.destroy_process_group()
print("OK")
