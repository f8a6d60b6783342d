"""The harness of the planning benchmarks that compare source trees (``bench_save_plan``,
``bench_lora_plan``): each world size runs in a child process of its own (its peak RSS is its
own), once per tree (this one, and ``--compare SRC_TREE``'s package first on PYTHONPATH, e.g. a
worktree of an older commit), side by side; rows print as they come and go to a JSON file."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(
    argv, module: str, doc: str, worlds: str, one: Callable[[int], dict], header: str, line: Callable[[dict], str]
) -> None:
    """A benchmark's command line: ``--one W`` (a child) prints ``one(W)`` as JSON; otherwise
    :func:`sweep` over ``--worlds`` (default ``worlds``), this tree and ``--compare``'s."""
    name = module.rsplit(".", 1)[-1]
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    arguments(p, worlds=worlds, out=f"bench_out/{name}.json")
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args.one)))
        return
    sweep(module, args, header, line)


def arguments(p: argparse.ArgumentParser, worlds: str, out: str) -> None:
    """Add ``--worlds``, ``--compare``, ``--timeout``, ``--out`` and the child's ``--one``."""
    p.add_argument("--worlds", default=worlds, help=f"comma list of world sizes (default {worlds})")
    p.add_argument("--compare", type=Path, default=None, help="another source tree to run side by side")
    p.add_argument("--timeout", type=float, default=600, help="seconds one world size may take (default 600)")
    p.add_argument("--out", default=out, help="JSON report path")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: one world size


def child(module: str, world: int, tree: Path, timeout: float) -> dict | None:
    """``python -m module --one world`` with ``tree``'s package: its last stdout line (JSON), or
    None past ``timeout`` seconds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "src"), str(ROOT)]))
    try:
        out = subprocess.run(
            [sys.executable, "-m", module, "--one", str(world)],
            env=env,
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
        ).stdout
    except subprocess.TimeoutExpired:
        return None
    return json.loads(out.strip().splitlines()[-1])


def sweep(module: str, args: argparse.Namespace, header: str, line: Callable[[dict], str]) -> list[dict]:
    """Run every ``--worlds`` size in this tree (and ``--compare``'s), print ``header`` then
    ``line(row)`` per run (prefixed by ranks and tree), write the rows to ``--out``."""
    sides = [("this", ROOT)] + ([("compare", args.compare.resolve())] if args.compare else [])
    rows = []
    print(f"{'ranks':>7} {'tree':<8} {header}")
    for world in (int(w) for w in args.worlds.split(",")):
        for name, tree in sides:
            r = child(module, world, tree, args.timeout)
            rows.append(dict(world=world, tree=name, timeout_s=args.timeout) if r is None else dict(r, tree=name))
            print(f"{world:>7,} {name:<8} " + (f"over {args.timeout:.0f} s" if r is None else line(r)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")
    return rows
