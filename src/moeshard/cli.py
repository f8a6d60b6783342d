"""The ``moeshard`` command."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moeshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build a small MoE checkpoint, load it on 8 local ranks, verify, report")
    demo.add_argument("--out", help="keep the demo checkpoint in this directory")
    bench = sub.add_parser("bench", help="benchmarks that print figures and write JSON", add_help=False)
    bench.add_argument("name", choices=["relocate"], help="which benchmark ('moeshard bench relocate -h')")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from .demo import main as demo_main

        return demo_main(args.out)
    if args.command == "bench":
        from .bench.relocate import main as bench_relocate

        return bench_relocate(rest)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
