"""``moeshard inspect`` on a header of the safetensors format's maximum size: wall time and
peak RSS.

A safetensors header may be up to 100,000,000 bytes. This benchmark writes one file whose
header is exactly that long: about 1.1 million per-expert tensors (``layers.{l}.experts.{e}.w{1,2,3}``,
BF16 ``[64, 64]``, so inspect's MoE layout code runs over every key) over a *sparse* data section
of about 9 GiB (the file has its full size but occupies ~100 MB on disk; inspect reads
headers only). Then it runs ``python -m moeshard.cli inspect FILE`` as a user would, in a child
process (``--repeat`` times), and records the child's wall time, CPU time and peak RSS
(``os.wait4``: that child's own ``ru_maxrss``).

Run from the repository root::

    python -m benchmarks.bench_inspect            # writes bench_out/bench_inspect.json
    python -m benchmarks.bench_inspect --repeat 3 --label after
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` and `moeshard` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from benchmarks.bench_plan import run_timed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's limit on the header's JSON
SHAPE = (64, 64)
ITEMSIZE = 2  # BF16
NUM_EXPERTS = 4096
NAMES = ("w1", "w2", "w3")


def _layer_entries(layer: int, begin: int) -> tuple[str, int]:
    """The JSON entries (comma-joined, no braces) of one layer's expert tensors whose data
    starts at ``begin``; returns them and where the next layer's data starts."""
    nbytes = SHAPE[0] * SHAPE[1] * ITEMSIZE
    shape = json.dumps(list(SHAPE), separators=(",", ":"))
    parts = []
    for e in range(NUM_EXPERTS):
        for name in NAMES:
            parts.append(f'"layers.{layer}.experts.{e}.{name}":{{"dtype":"BF16","shape":{shape},'
                         f'"data_offsets":[{begin},{begin + nbytes}]}}')
            begin += nbytes
    return ",".join(parts), begin


def write_max_header_file(path: Path, header_bytes: int = MAX_HEADER_BYTES) -> tuple[int, int]:
    """Write a safetensors file whose header is exactly ``header_bytes`` long (whole layers of
    expert tensors, padded with spaces) and whose data section is a hole. Returns
    ``(num_tensors, data bytes)``."""
    layers: list[str] = []
    used, begin, num_tensors = 2, 0, 0  # 2: the braces
    while True:
        text, end = _layer_entries(len(layers), begin)
        if used + len(text) + 1 > header_bytes:
            break
        layers.append(text)
        used += len(text) + (1 if len(layers) > 1 else 0)
        begin, num_tensors = end, num_tensors + NUM_EXPERTS * len(NAMES)
    raw = ("{" + ",".join(layers) + "}").encode()
    del layers
    assert len(raw) <= header_bytes, len(raw)
    raw += b" " * (header_bytes - len(raw))
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + begin)  # the data: a hole, no disk blocks
    return num_tensors, begin


def measure(path: Path, repeat: int) -> dict:
    """Median wall / CPU seconds and the largest peak RSS of ``repeat`` inspect runs."""
    cmd = [sys.executable, "-m", "moeshard.cli", "inspect", str(path)]
    runs = [run_timed(cmd) for _ in range(repeat)]
    walls = [r[1] for r in runs]
    return {"command": " ".join(["python"] + cmd[1:]), "wall_s": statistics.median(walls),
            "cpu_s": statistics.median(r[2] for r in runs), "peak_rss_bytes": max(r[3] for r in runs),
            "wall_s_all": walls, "report_tail": runs[-1][0].strip().splitlines()[-1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--label", default="current", help="a name for this measurement (e.g. before / after)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench_out" / "bench_inspect.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="moeshard_bench_inspect_") as tmp:
        path = Path(tmp) / "model.safetensors"
        num_tensors, data_bytes = write_max_header_file(path)
        on_disk = path.stat().st_blocks * 512
        row = {"label": args.label, "header_bytes": MAX_HEADER_BYTES, "num_tensors": num_tensors,
               "file_bytes": path.stat().st_size, "bytes_on_disk": on_disk, **measure(path, args.repeat)}
    # Keep earlier labels (a "before" row survives an "after" run), replace this one.
    rows = json.loads(args.out.read_text()).get("rows", []) if args.out.is_file() else []
    rows = [r for r in rows if r.get("label") != args.label] + [row]
    result = {"host": {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()},
              "repeat": args.repeat, "rows": rows}
    print(f"moeshard inspect, one file with a {MAX_HEADER_BYTES:,}-byte header ({num_tensors:,} tensors, "
          f"{data_bytes / 2**30:.1f} GiB sparse data, {on_disk / 2**20:.0f} MiB on disk)")
    print(f"{'label':<10}{'wall s':>9}{'cpu s':>8}{'peak RSS MiB':>14}")
    for r in rows:
        print(f"{r['label']:<10}{r['wall_s']:>9.2f}{r['cpu_s']:>8.2f}{r['peak_rss_bytes'] / 2**20:>14.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
