import os
import sys

# Spawned ranks import test modules and helpers (mp, tiny_moe) by name from this directory.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
