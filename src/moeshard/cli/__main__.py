"""``python -m moeshard.cli``: the ``moeshard`` command."""

import sys

from . import main

sys.exit(main())
