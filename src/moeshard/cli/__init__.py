"""The ``moeshard`` command: demo, inspect, plan, verify, bench.

Each subcommand lives in its own module with a ``main(argv) -> int``; this file only
dispatches. A user error (a path that does not exist, a checkpoint that is not MoE, shapes
that do not divide) ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

# subcommand -> (module, help)
COMMANDS = {
    "demo": ("moeshard.cli.demo", "build a small MoE checkpoint, load it on 8 local ranks, rebalance, verify, report"),
    "inspect": ("moeshard.cli.inspect", "what a checkpoint holds, from its headers only: layout, bytes, problems"),
    "plan": ("moeshard.cli.plan", "the transfer plan of a load or rebalance on a given cluster, without a cluster"),
    "verify": ("moeshard.cli.verify", "under torchrun: load a checkpoint with a saved placement, verify, report slots"),
    "bench": ("moeshard.cli.bench.relocate", "benchmarks that print figures and write JSON ('bench relocate')"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="moeshard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    args, rest = parser.parse_known_args(argv[:1])
    rest += argv[1:]
    if args.command == "bench":
        if not rest or rest[0] not in ("relocate",):
            parser.error("usage: moeshard bench relocate [options] ('moeshard bench relocate -h')")
        rest = rest[1:]
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.main(rest) or 0)
    except (ValueError, OSError) as e:
        # Subcommands report their own bad input; this is the last line of defence.
        print(f"moeshard {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
