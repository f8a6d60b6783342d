"""Every transformers MoE family at EP=2 with redundant copies: load, verify, and the logits of
moeshard's EP forward against the one-process model's (a sweep, and what tests/test_families_ep.py
runs on a subset).

    python tests/family_sweep.py [--families a,b,...] [--json out.json]

(FAMILY_SWEEP_TRACE=1 prints each failing family's traceback.)

For each family (tests/hf_families.py): a tiny model with perturbed weights is saved by
``save_pretrained`` and its logits on 2 x 7 random tokens computed in this process; then 2 gloo
ranks build it on meta, ``moeshard.parallelize`` it (EP=2, each layer 2 slots more than experts,
shuffled), ``moeshard.load`` + ``moeshard.verify`` the checkpoint and run the forward. Prints one
line per family: the max |logit difference|, or the error (a family whose one-process forward
fails on the tiny config is reported as such, not run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_families
from mp import run_ranks

SEQ = (2, 7)


def expert_layers(model) -> tuple[int, int]:
    """``(MoE layers, logical experts per layer)`` of ``model``, as ``moeshard.parallelize`` sees
    them (its expert specs; rows of identity "zero" experts are not logical experts)."""
    from moeshard.models.adapters import num_logical_experts
    from moeshard.models.describe import expert_layers as layers

    found = layers(model)
    if not found:
        raise ValueError("the model has 0 MoE layers")
    _, mod, spec, _ = found[0]
    return 1 + max(e.layer for e in found), num_logical_experts(mod, spec)


def reference(family: str, root: str) -> str | None:
    """Save the family's checkpoint and reference logits under ``root/family``; the error of a
    one-process forward that fails, else None."""
    model = hf_families.build(family)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(os.path.join(root, family, "ckpt"))
    model.eval()
    ids = torch.randint(0, 100, SEQ, generator=torch.Generator().manual_seed(2))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
    except Exception as e:  # noqa: BLE001 - the tiny config's own forward: reported, not run
        return f"one-process forward fails: {type(e).__name__}: {str(e)[:120]}"
    n_layers, n = expert_layers(model)
    torch.save(dict(ids=ids, logits=logits, n_experts=n, n_layers=n_layers), os.path.join(root, family, "ref.pt"))
    return None


def ep_worker(root: str, families: list[str]) -> dict:
    """On every rank: each family at EP=2, redundant shuffled placement."""
    import moeshard

    mesh = moeshard.make_mesh("cpu", ep=2, efsdp=1)
    out = {}
    for family in families:
        t0 = time.perf_counter()
        try:
            ref = torch.load(os.path.join(root, family, "ref.pt"))
            ckpt = os.path.join(root, family, "ckpt")
            model = hf_families.build(family, device="meta")
            n = ref["n_experts"]
            rng = np.random.default_rng(3)
            rows = [
                rng.permutation(np.concatenate([np.arange(n), rng.integers(0, n, 2)])) for _ in range(ref["n_layers"])
            ]
            pl = moeshard.Placement(np.stack(rows), num_logical=n, num_ranks=2)
            moeshard.parallelize(model, mesh, pl)
            moeshard.load(model, ckpt, placement=pl)
            boxes = moeshard.verify(model, ckpt, placement=pl).num_boxes_checked
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=ref["ids"], use_cache=False).logits
            out[family] = dict(err=float((logits - ref["logits"]).abs().max()), boxes=boxes)
        except Exception as e:  # noqa: BLE001 - reported per family
            # A DistributedError's first line says which step failed; its next one rank 0's error.
            lines = str(e).splitlines()
            out[family] = dict(error=f"{type(e).__name__}: " + " ".join(x.strip() for x in lines[:2]))
            if os.environ.get("FAMILY_SWEEP_TRACE"):
                import traceback

                out[family]["trace"] = traceback.format_exc()
        out[family]["seconds"] = time.perf_counter() - t0
    return out


def sweep(families, root: str) -> dict:
    results: dict[str, dict] = {}
    ready = []
    for family in families:
        problem = reference(family, root)
        if problem is None:
            ready.append(family)
        else:
            results[family] = dict(error=problem, reference=False)
    if ready:
        per_rank = run_ranks(ep_worker, root, ready, world=2, local_world=2, timeout=1800)
        for family in ready:
            results[family] = per_rank[0][family]
            other = per_rank[1][family]
            if "err" in other and "err" in results[family]:
                results[family]["err"] = max(results[family]["err"], other["err"])
            elif "error" in other:
                results[family] = other
    return results


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(hf_families.FAMILIES))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        results = sweep(args.families.split(","), root)
    ok = [f for f, r in results.items() if r.get("err", 1.0) <= 1e-4]
    for family, r in results.items():
        what = f"max |dlogit| {r['err']:.2e}, {r['boxes']} boxes verified" if "err" in r else r["error"][:320]
        print(f"{family:<20} {what}")
        if "trace" in r:
            print(r["trace"])
    print(f"{len(ok)} of {len(results)} families match one-process logits within 1e-4 at EP=2 with redundant copies")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
