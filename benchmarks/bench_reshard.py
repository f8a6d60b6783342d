"""Recovery after a lost node: ``moeshard.reshard`` from live peers against rebuilding and
reloading from the checkpoint, on the same survivors (``moeshard bench reshard``; see
:mod:`moeshard.cli.bench.reshard` for what it measures).

Run from the repository root::

    python -m benchmarks.bench_reshard                      # 4 ranks (2 nodes x 2) -> 2, ~40 MiB model
    python -m benchmarks.bench_reshard --placement partial  # some experts only on the lost node
"""

from __future__ import annotations

import sys

from moeshard.cli.bench.reshard import main

if __name__ == "__main__":
    sys.exit(main())
