"""``moeshard verify CKPT``: prove on a real cluster that every rank gets exactly its slices.

Run under torchrun (every rank runs the same command). From the checkpoint's ``config.json``
it builds the transformers model on the meta device, parallelizes it for ``--ep`` x
``--efsdp`` with the job's saved placement (``--placement FILE``: moeshard's JSON, a phy2log
``.npy`` ``int[num_layers, num_physical]`` with ``-1`` for an empty slot, or sglang's or vLLM's
placement, see :mod:`moeshard.io.placement_files`; default contiguous with ``--redundant`` copies),
loads it with moeshard and verifies every local box against the checkpoint's bytes.
``--report`` then prints, per rank, which logical expert each slot of each MoE layer holds,
each one checksum-verified (a blake2b of the slot's bytes, compared with the checkpoint's).
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def placement_from_args(args, num_layers: int, num_logical: int, ep: int, modules: list[str] | None = None):
    """The job's placement: ``--placement`` (a file in any format
    :mod:`moeshard.io.placement_files` reads, or an engine's named placement), else contiguous."""
    from ..io.placement_files import NAMED_PLACEMENTS, moe_layer_indices, named_placement, read_placement_file
    from ..placement import Placement

    if args.placement is None:
        return Placement.contiguous(num_layers, num_logical, ep, args.redundant)
    if args.placement in NAMED_PLACEMENTS and not os.path.exists(args.placement):
        return named_placement(
            args.placement, num_layers=num_layers, num_logical=num_logical, num_ranks=ep, num_redundant=args.redundant
        )
    f = read_placement_file(
        args.placement, format=args.placement_format, moe_layers=None if modules is None else moe_layer_indices(modules)
    )
    p2l = f.phy2log
    if p2l.shape[0] != num_layers or p2l.shape[1] % ep:
        raise ValueError(
            f"placement file {args.placement} has shape {list(p2l.shape)}; expected [{num_layers}, "
            f"num_physical] with num_physical a multiple of EP={ep}"
        )
    for what, have, want in (("num_logical", f.num_logical, num_logical), ("num_ranks", f.num_ranks, ep)):
        if have is not None and have != want:
            raise ValueError(f"placement file {args.placement} was written for {what}={have}, the job has {want}")
    try:
        return Placement(p2l, num_logical=num_logical, num_ranks=ep)
    except ValueError as e:
        raise ValueError(f"placement file {args.placement}: {e}") from None


def _slot_report(model, placement, index, reader_root_dir: str) -> list[tuple[int, str, list]]:
    """This rank's slots: ``[(layer, module, [(slot, logical expert, checksum, ok)])]``; each
    checksum is of the slot's bytes, ``ok`` compares it with the checkpoint's (cast alike)."""
    import torch

    from ..io.reader import CheckpointReader
    from ..models.adapters import read_expert_box
    from ..models.describe import expert_layers, local_tensor
    from ..models.shards import local_boxes
    from ..ops.verify import digest_hex

    out = []
    with CheckpointReader(index, reader_root_dir) as reader:
        for name, mod, spec, layer in expert_layers(model):
            rows: dict[int, list] = {}
            for p in spec.params:
                t = getattr(mod, p.name)
                loc = local_tensor(t)
                mesh = t.device_mesh
                rank = torch.distributed.get_rank()
                boxes = local_boxes(tuple(t.shape), tuple(mesh.mesh.shape), tuple(t.placements))
                box = boxes[mesh.mesh.reshape(-1).tolist().index(rank)]
                (s0, ns), rest = box[0], box[1:]
                for k in range(ns):
                    slot = s0 + k
                    e = int(placement.phy2log[layer, slot])
                    if e < 0:
                        rows.setdefault(slot, [slot, -1, "", True])
                        continue
                    want = read_expert_box(
                        reader, p, name, e, rest, torch.empty_like(loc[k]), t.shape[1] if t.dim() > 1 else 0
                    )
                    ok = torch.equal(loc[k], want)
                    row = rows.setdefault(slot, [slot, e, "", True])
                    row[2] += digest_hex(loc[k])[:8]  # one short checksum per expert tensor
                    row[3] = row[3] and ok
            out.append((layer, name, [tuple(r) for _, r in sorted(rows.items())]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moeshard verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="HF checkpoint directory (config.json + safetensors)")
    parser.add_argument("--ep", type=int, help="EP size (default: the world size)")
    parser.add_argument("--efsdp", type=int, default=1, help="expert-FSDP size (ep x efsdp = world size)")
    parser.add_argument("--redundant", type=int, default=0, help="redundant slots per layer (no --placement)")
    parser.add_argument(
        "--placement",
        help="the job's saved placement: moeshard JSON, phy2log .npy [num_layers, "
        "num_physical], sglang's or vLLM's file; or vllm:linear, vllm:round_robin, sglang:trivial",
    )
    parser.add_argument(
        "--placement-format",
        choices=("moeshard", "npy", "sglang", "vllm"),
        help="read --placement as this format (default: sniffed)",
    )
    parser.add_argument("--storage", default="auto", choices=["auto", "shared", "node", "single"])
    parser.add_argument("--report", action="store_true", help="print every rank's slots, checksum-verified")
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    from .. import collectives
    from ..integrations.pretrained import job_device
    from ..io.index import CheckpointIndex
    from ..io.sources import reader_root
    from ..models.build import meta_model, moe_layout, read_config
    from ..models.parallel import make_mesh, parallelize
    from ..ops.load import load
    from ..ops.verify import verify

    if not os.path.exists(args.checkpoint):
        print(f"moeshard verify: error: {args.checkpoint} does not exist", file=sys.stderr)
        return 2
    own_group = not dist.is_initialized()
    if own_group:
        if "RANK" not in os.environ:
            print("moeshard verify: error: run it under torchrun (every rank runs the same command)", file=sys.stderr)
            return 2
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        ep = args.ep or world // args.efsdp
        try:

            def setup():
                model = meta_model(read_config(args.checkpoint), source=args.checkpoint)
                moe = moe_layout(model, source=args.checkpoint)
                return model, placement_from_args(args, moe.num_layers, moe.num_logical, ep, list(moe.modules))

            model, placement = collectives.agree(setup, "moeshard verify: building the model")
            parallelize(model, make_mesh(job_device().type, ep=ep, efsdp=args.efsdp), placement)
            load(model, args.checkpoint, placement=placement, storage=args.storage)
            rep = verify(model, args.checkpoint, placement=placement, storage=args.storage)
        except (ValueError, collectives.DistributedError) as e:
            if rank == 0:
                # One line: a DistributedError's first failing rank's message.
                lines = str(e).splitlines()
                line = lines[1].strip() if isinstance(e, collectives.DistributedError) and len(lines) > 1 else lines[0]
                print(f"moeshard verify: error: {line}", file=sys.stderr)
            return 2
        boxes = collectives.all_gather_object(rep.num_boxes_checked)
        report = None
        if args.report:
            index = CheckpointIndex.open(args.checkpoint)
            report = collectives.all_gather_object(_slot_report(model, placement, index, reader_root(args.checkpoint)))
        if rank == 0:
            print(
                f"moeshard verify: {args.checkpoint}: {world} ranks (EP={ep} x efsdp={args.efsdp}), "
                f"{sum(boxes)} boxes verified against the checkpoint: OK"
            )
            if report is not None:
                bad = 0
                for r, layers in enumerate(report):
                    print(f"rank {r}:")
                    for layer, name, rows in layers:
                        cells = []
                        for slot, e, digest, ok in rows:
                            bad += not ok
                            cells.append(
                                f"{slot}:{'empty' if e < 0 else e}"
                                + ("" if ok else "(WRONG)")
                                + (f"[{digest[:8]}]" if e >= 0 else "")
                            )
                        print(f"  layer {layer} ({name}): slot:expert[checksum] " + " ".join(cells))
                if bad:
                    print(f"moeshard verify: {bad} slot(s) differ from their logical expert", file=sys.stderr)
                    return 1
        return 0
    finally:
        if own_group:
            dist.destroy_process_group()
