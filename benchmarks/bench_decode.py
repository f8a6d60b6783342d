"""Decode micro-benchmark, one process: a packed box (MXFP4 gpt-oss-style, transposed into an
``[E, H, 2I]`` bf16 parameter; INT4 pack-quantized with bf16 group scales into ``[E, R, C]``)
decoded into its bf16 destination, as a load delivers it. Times each step of the plain path
(float32 decode, cast, copy) and the tiled one (:func:`moeshard.io.codecs.decode_into`, when the
tree has it), checks they are equal bit for bit, and prints the ratio.

    python -m benchmarks.bench_decode --experts 8 --rows 2880 --cols 2880 --repeat 5 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moeshard.io import codecs
from moeshard.io.quant import Scheme

MX = Scheme("mxfp4", "mxfp4", "e2m1", 4, 32, "U8", "")
INT4 = Scheme("int4", "compressed-tensors/pack-quantized", "int4", 4, 32, "BF16", "")


def boxes(e: int, r: int, c: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mx_v = torch.randint(0, 256, (e, r, c // 32, 16), dtype=torch.uint8, generator=g)
    mx_s = torch.randint(110, 140, (e, r, c // 32), dtype=torch.uint8, generator=g)
    i4_v = torch.randint(0, 256, (e, r, c // 2), dtype=torch.uint8, generator=g).view(torch.int32)
    i4_s = (torch.rand((e, r, c // 32), generator=g) * 0.01 + 1e-4).to(torch.bfloat16)
    return (mx_v, mx_s), (i4_v, i4_s)


def timed(fn, repeat):
    walls = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=2880)
    ap.add_argument("--cols", type=int, default=2880)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a rank's: 1)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    e, r, c = a.experts, a.rows, a.cols
    (mv, ms), (iv, is_) = boxes(e, r, c)
    param_mx = torch.empty(e, c, r, dtype=torch.bfloat16)  # gpt-oss [E, H, 2I]; values are [E, 2I, H]
    param_i4 = torch.empty(e, r, c, dtype=torch.bfloat16)
    cases = (("mxfp4", MX, mv, ms, param_mx, param_mx.transpose(-1, -2)), ("int4", INT4, iv, is_, param_i4, param_i4))
    has_into = hasattr(codecs, "decode_into")
    print(f"box [{e}, {r}, {c}], torch threads {torch.get_num_threads()}, decode_into: {has_into}")
    for name, sch, v, s, param, dest in cases:
        codecs.decode(sch, v[:1], s[:1], None)  # tables
        steps = {}
        f = codecs.decode(sch, v, s, None)
        steps["decode f32"] = timed(lambda: codecs.decode(sch, v, s, None), a.repeat)
        steps["cast bf16"] = timed(lambda: f.to(torch.bfloat16), a.repeat)
        h = f.to(torch.bfloat16)
        steps["copy into param"] = timed(lambda: dest.copy_(h), a.repeat)
        plain = timed(lambda: dest.copy_(codecs.decode(sch, v, s, None).to(torch.bfloat16)), a.repeat)
        ref = param.clone()
        line = f"{name}: plain {plain:.3f} s (" + ", ".join(f"{k} {t:.3f}" for k, t in steps.items()) + ")"
        if has_into:
            param.zero_()
            codecs.decode_into(sch, v, s, None, dest)
            if not torch.equal(param.view(torch.int16), ref.view(torch.int16)):
                raise SystemExit(f"{name}: decode_into differs from the plain decode")
            tiled = timed(lambda: codecs.decode_into(sch, v, s, None, dest), a.repeat)
            line += f"; tiled {tiled:.3f} s, plain/tiled {plain / tiled:.2f}x (equal bit for bit)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
