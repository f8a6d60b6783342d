"""The ``moeshard`` command: demo, inspect, plan, verify, bench.

Each subcommand lives in its own module with a ``main(argv) -> int``; this file only
dispatches. A user error (a path that does not exist, a checkpoint that is not MoE, shapes
that do not divide) ends with one line on stderr and exit code 2, never a traceback.

Run as a program (``moeshard ...``, ``python -m moeshard.cli ...``, under torchrun too), the
process ends through :func:`moeshard._launch.exit_process` once the command is done: a command
that used gloo collectives could otherwise abort at interpreter exit after succeeding.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

__all__ = ["main"]

# subcommand -> (module, help)
COMMANDS = {
    "demo": ("moeshard.cli.demo", "build a small MoE checkpoint, load it on 8 local ranks, rebalance, verify, report"),
    "inspect": ("moeshard.cli.inspect", "what a checkpoint holds, from its headers only: layout, bytes, problems"),
    "plan": ("moeshard.cli.plan", "the transfer plan of a load or rebalance on a given cluster, without a cluster"),
    "verify": ("moeshard.cli.verify", "under torchrun: load a checkpoint with a saved placement, verify, report slots"),
    "bench": ("moeshard.cli.bench.relocate", "benchmarks that print figures and write JSON ('bench relocate')"),
}
# ``moeshard bench <name>`` -> its module
BENCHES = {"relocate": "moeshard.cli.bench.relocate", "reshard": "moeshard.cli.bench.reshard"}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit code. With ``argv`` None (the process's own command
    line: the console script, ``python -m moeshard.cli``) the process ends here with that code."""
    if argv is not None:
        return _run(list(argv))
    try:
        code = _run(sys.argv[1:])
    except SystemExit as e:  # argparse's --help (0) and usage errors (2)
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - printed as Python would, then the same exit
        traceback.print_exc()
        code = 1
    from .._launch import exit_process

    exit_process(code)


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moeshard", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    args, rest = parser.parse_known_args(argv[:1])
    rest += argv[1:]
    module_name = COMMANDS[args.command][0]
    if args.command == "bench":
        if not rest or rest[0] not in BENCHES:
            parser.error(f"usage: moeshard bench {{{','.join(BENCHES)}}} [options] ('moeshard bench relocate -h')")
        module_name, rest = BENCHES[rest[0]], rest[1:]
    module = importlib.import_module(module_name)
    try:
        return int(module.main(rest) or 0)
    except (ValueError, OSError) as e:
        # Subcommands report their own bad input; this is the last line of defence.
        print(f"moeshard {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
