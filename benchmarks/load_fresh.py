"""Fresh-memory loads for bench_load: moeshard's whole user-facing path against transformers'
own distributed loader and a parallel read floor, on the same ranks and checkpoint.

Every round each strategy allocates its destination afresh, as every real load does, and is
timed on every rank from a barrier before the call to a barrier after it (a row's wall time is
the slowest rank's):

* ``moeshard-fresh``: ``moeshard.from_pretrained(path, ep=E, efsdp=W // E, dtype=...)``: read
  config.json, build the model on the meta device, choose the (contiguous) placement, make the
  mesh, ``parallelize`` (EP + FSDP2), ``load`` (materialize, headers, plan + agreement,
  execute), storage mode "auto".
* ``transformers-native``: ``AutoModelForCausalLM.from_pretrained(path, dtype=...,
  distributed_config=DistributedConfig(fsdp_size=W, ep_size=E))``: transformers' config, its
  meta build, its FSDP2 + EP distribution and its weight loading.
* ``parallel-read-floor``: every rank reads its 1/W share of every checkpoint file (one
  contiguous, page-aligned byte range per file) into freshly allocated memory with
  ``os.preadv``, nothing else: what the storage (or the page cache) and fresh memory allow when
  every byte is read once, spread evenly over the ranks.

After each load, :func:`check_against_checkpoint` compares every parameter's local shard on
every rank with the checkpoint's bytes (independently of moeshard: torch's own DTensor
sharding of the tensor read with safetensors), outside the timed part. ``--cache cold`` drops
the page cache (:func:`moeshard.cli.bench.page_cache.drop_page_cache`, rank 0, between two
barriers) before each timed call.

Every function taking ``spec`` is collective: every rank of the default group calls it.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.load_rss import RssMonitor, malloc_trim
from moeshard.cli.bench.page_cache import drop_page_cache

__all__ = [
    "FRESH_STRATEGIES",
    "CheckResult",
    "check_against_checkpoint",
    "file_shares",
    "negative_control",
    "profile_moeshard",
    "read_floor_parallel",
    "run_fresh",
]

FRESH_STRATEGIES = ("moeshard-fresh", "transformers-native", "parallel-read-floor")
PAGE = 4096
CHUNK = 64 * 2**20  # bytes per preadv call


# -- page cache -----------------------------------------------------------------------------


def _prepare_cache(cold: bool) -> None:
    """Collective: with ``cold``, rank 0 drops the page cache while the others wait."""
    import torch.distributed as dist

    dist.barrier()
    if cold and dist.get_rank() == 0:
        drop_page_cache()
    dist.barrier()


# -- checking the loaded model against the checkpoint ---------------------------------------


@dataclass(frozen=True)
class CheckResult:
    """This rank's comparison of its local shards with the checkpoint: parameters and
    elements compared, and the mismatches (``"name: why"``, at most 5 kept; ``num_bad`` all)."""

    num_params: int
    num_elements: int
    num_bad: int
    mismatches: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.num_bad == 0 and self.num_params > 0


class _Checkpoint:
    """The bench checkpoint's tensors by key, read with safetensors (files opened once)."""

    def __init__(self, root: str):
        from safetensors import safe_open

        self.root = Path(root)
        weight_map = json.loads((self.root / "model.safetensors.index.json").read_text())["weight_map"]
        self.files = {f: safe_open(str(self.root / f), framework="pt") for f in sorted(set(weight_map.values()))}
        self.where = weight_map

    def get(self, key: str):
        if key not in self.where:
            raise KeyError(f"{self.root}: no tensor {key!r} in the index")
        return self.files[self.where[key]].get_tensor(key)

    def reference(self, name: str, num_experts: int):
        """The whole tensor the model's parameter ``name`` must hold: the checkpoint's tensor of
        that name, or for Qwen3-MoE's fused experts the per-expert tensors stacked
        (``gate_up_proj`` [E, 2I, H] = cat(gate_proj [I, H], up_proj [I, H]) per expert;
        ``down_proj`` [E, H, I])."""
        import torch

        prefix, _, attr = name.rpartition(".")
        if prefix.endswith("mlp.experts") and attr == "gate_up_proj":
            return torch.stack(
                [
                    torch.cat([self.get(f"{prefix}.{e}.gate_proj.weight"), self.get(f"{prefix}.{e}.up_proj.weight")])
                    for e in range(num_experts)
                ]
            )
        if prefix.endswith("mlp.experts") and attr == "down_proj":
            return torch.stack([self.get(f"{prefix}.{e}.down_proj.weight") for e in range(num_experts)])
        return self.get(name)


def check_against_checkpoint(model, ckpt: str, perturb: str | None = None) -> CheckResult:
    """Compare every parameter's local tensor on this rank with the checkpoint's bytes.

    The expected local tensor is torch's own sharding of the checkpoint tensor by the
    parameter's DTensor mesh and placements (``distribute_tensor(..., src_data_rank=None)``:
    each rank slices its own copy, no communication), so it is what ``full_tensor()`` would
    assemble, checked without moving the model. Expert slots are in logical order (both
    loaders' default placement). ``perturb``: a parameter whose local copy gets +1 at its first
    element before the comparison (the negative control: that parameter must be reported).
    Not collective; every rank checks its own shards.
    """
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    ck = _Checkpoint(ckpt)
    n_params = n_elems = n_bad = 0
    bad: list[str] = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p.detach()
            try:
                ref = ck.reference(name, p.shape[0]).to(device=local.device, dtype=p.dtype)
            except KeyError as e:
                n_bad += 1
                bad.append(f"{name}: {e}")
                continue
            if tuple(ref.shape) != tuple(p.shape):
                n_bad += 1
                bad.append(f"{name}: global shape {tuple(p.shape)}, checkpoint {tuple(ref.shape)}")
                continue
            want = (
                distribute_tensor(ref, p.device_mesh, p.placements, src_data_rank=None).to_local()
                if isinstance(p, DTensor)
                else ref
            )
            if name == perturb and local.numel():
                local = local.clone()
                local.view(-1)[0] += 1
            n_params += 1
            n_elems += local.numel()
            if tuple(want.shape) != tuple(local.shape):
                n_bad += 1
                bad.append(f"{name}: local shape {tuple(local.shape)}, expected {tuple(want.shape)}")
            elif not torch.equal(want, local):
                n_bad += 1
                diff = (want != local).nonzero()
                bad.append(
                    f"{name}: {len(diff)} of {local.numel()} local elements differ (first at local index "
                    f"{diff[0].tolist()})"
                )
    return CheckResult(n_params, n_elems, n_bad, tuple(bad[:5]))


# -- the parallel read floor ----------------------------------------------------------------


def file_shares(sizes: dict[str, int], rank: int, world: int) -> list[tuple[str, int, int]]:
    """``(file, offset, length)``: rank ``rank``'s 1/``world`` of each file, contiguous and
    page-aligned (the last rank takes the tail); every byte of every file in exactly one
    rank's share (pure)."""
    out = []
    for name in sorted(sizes):
        size = sizes[name]
        cut = [min(size, (size * r // world) // PAGE * PAGE) for r in range(world)] + [size]
        lo, hi = cut[rank], cut[rank + 1]
        if hi > lo:
            out.append((name, lo, hi - lo))
    return out


def read_floor_parallel(root: str, shares: list[tuple[str, int, int]]) -> list:
    """Read each ``(file, offset, length)`` of ``shares`` into newly allocated memory with
    ``os.preadv``; the buffers (uint8 tensors), kept alive by the caller as a load keeps its
    weights. Raises OSError naming the file and offset on a short read."""
    import torch

    bufs = []
    for name, off, length in shares:
        buf = torch.empty(length, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        path = os.path.join(root, name)
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < length:
                n = os.preadv(fd, [view[done : done + CHUNK]], off + done)
                if n <= 0:
                    raise OSError(f"{path}: read {done} of {length} bytes at offset {off}, then end of file")
                done += n
        finally:
            os.close(fd)
        bufs.append(buf)
    return bufs


# -- one round of one strategy --------------------------------------------------------------


def _load_moeshard(spec: dict, ep: int, efsdp: int, dtype, row: dict):
    import moeshard
    from benchmarks.load_profile import PretrainedSteps

    with PretrainedSteps() as steps:
        t0 = time.perf_counter()
        model = moeshard.from_pretrained(spec["ckpt"], ep=ep, efsdp=efsdp, dtype=dtype)
        t1 = time.perf_counter()
    rep = steps.report
    row.update(
        steps=steps.steps(t0, t1),
        storage=rep.storage,
        bytes_read=rep.bytes_read_rank,
        bytes_sent=rep.bytes_sent_rank,
        bytes_received=rep.bytes_received_rank,
        peak_staging_bytes=rep.peak_staging_bytes_rank,
        load_phase_cpu_seconds=rep.phase_cpu_seconds,
        fingerprint=rep.fingerprint,
        plan_cost=rep.plan,
    )
    return model


def _load_transformers(spec: dict, ep: int, efsdp: int, dtype, row: dict):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    world = dist.get_world_size()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        spec["ckpt"], dtype=dtype, distributed_config=DistributedConfig(fsdp_size=world, ep_size=ep)
    )
    row["call_seconds"] = time.perf_counter() - t0
    return model


def _local_bytes(model) -> int:
    """Bytes of this rank's local parameter tensors (elements x element size)."""
    from torch.distributed.tensor import DTensor

    return sum(
        t.numel() * t.element_size()
        for t in (p.to_local() if isinstance(p, DTensor) else p for p in model.parameters())
    )


def run_fresh(name: str, spec: dict, ep: int, efsdp: int, cold: bool) -> dict:
    """Collective: one timed round of strategy ``name`` into fresh memory, then (loaders) the
    check against the checkpoint. This rank's row: ``wall_seconds`` (barrier to barrier),
    ``rss_growth`` (peak RSS during the round minus RSS before it), ``rss_final_growth`` (what
    the round left resident), the check, and the strategy's own counters."""
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, spec["model_dtype"])
    rank, world = dist.get_rank(), dist.get_world_size()
    gc.collect()
    malloc_trim()
    _prepare_cache(cold)
    row: dict = {"error": "", "cold": cold}
    result = None
    with RssMonitor() as mon:
        dist.barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            if name == "moeshard-fresh":
                result = _load_moeshard(spec, ep, efsdp, dtype, row)
            elif name == "transformers-native":
                result = _load_transformers(spec, ep, efsdp, dtype, row)
            elif name == "parallel-read-floor":
                result = read_floor_parallel(spec["ckpt"], file_shares(spec["file_sizes"], rank, world))
                row["bytes_read"] = sum(int(b.numel()) for b in result)
            else:
                raise ValueError(f"unknown fresh strategy {name!r}; choose from {FRESH_STRATEGIES}")
        except Exception as e:  # noqa: BLE001 - reported in the table; the peers still reach the barrier
            row["error"] = f"rank {rank}: {type(e).__name__}: {str(e)[:500]}"
        dist.barrier()
        row["wall_seconds"] = time.perf_counter() - t0
        # This process's CPU seconds (every thread): far below the wall time is waiting (for peers,
        # storage, or a core when the ranks outnumber the cores).
        row["cpu_seconds"] = time.process_time() - cpu0
    row.update(
        rss_before=mon.before,
        rss_growth=mon.growth,
        rss_final_growth=mon.final_growth,
        rss_final_growth_parts=mon.final_growth_parts,
        rss_growth_sampled=mon.peak_sampled - mon.before,
    )
    if name != "parallel-read-floor" and result is not None:
        row["local_bytes"] = _local_bytes(result)
        t = time.perf_counter()
        row["check"] = asdict(check_against_checkpoint(result, spec["ckpt"]))
        row["check_seconds"] = time.perf_counter() - t
    del result
    gc.collect()
    malloc_trim()
    return row


def negative_control(spec: dict, ep: int, efsdp: int) -> dict:
    """Collective: load once with moeshard and confirm the check reports a perturbed expert
    parameter and nothing else (else "check ok" would prove nothing). This rank's findings."""
    import torch
    import torch.distributed as dist

    import moeshard

    model = moeshard.from_pretrained(spec["ckpt"], ep=ep, efsdp=efsdp, dtype=getattr(torch, spec["model_dtype"]))
    target = next(n for n, _ in model.named_parameters() if n.endswith("experts.gate_up_proj"))
    res = check_against_checkpoint(model, spec["ckpt"], perturb=target)
    ok = res.num_bad == 1 and res.mismatches[0].startswith(target + ":")
    del model
    gc.collect()
    dist.barrier()
    return {"rejected_perturbed_param": ok, "perturbed": target, "found": list(res.mismatches)}


def profile_moeshard(spec: dict, ep: int, efsdp: int, cold: bool) -> dict:
    """Collective: one ``moeshard.from_pretrained`` under :func:`benchmarks.load_profile.profiled`
    (kept out of the timed medians). This rank's steps and per-step seconds by kind."""
    import torch
    import torch.distributed as dist

    import moeshard
    from benchmarks.load_profile import profiled

    gc.collect()
    malloc_trim()
    _prepare_cache(cold)
    dist.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    model, steps, kinds = profiled(
        lambda: moeshard.from_pretrained(spec["ckpt"], ep=ep, efsdp=efsdp, dtype=getattr(torch, spec["model_dtype"]))
    )
    t_call = time.perf_counter() - t0
    dist.barrier()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    del model
    gc.collect()
    malloc_trim()
    return {
        "cold": cold,
        "wall_seconds": wall,
        "call_seconds": t_call,
        "cpu_seconds": cpu,
        "steps": steps,
        "kinds": kinds,
    }
