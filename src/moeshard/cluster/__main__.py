"""``python -m moeshard.cluster ...`` = ``moeshard plan ...``."""

import sys

from .command import main

sys.exit(main())
