"""The compiled loops of the balancer (numba, ``pip install moeshard[fast]``), loaded on demand:
:func:`kernel` gives a kernel module where numba is installed, the call is large enough to
repay numba's start (importing it and loading the compiled code costs a process ~0.75 s of
CPU) or the module is already loaded, and ``MOESHARD_EPLB_JIT`` is not ``0``. Every kernel
makes the very choices of the numpy code it replaces, so only the time depends on it.
"""

from __future__ import annotations

import importlib
import os

_LOADED: dict = {}  # kernel module name -> the module, or None where numba is missing


def kernel(name: str, size: int, threshold: int):
    """The module ``moeshard.eplb.<name>`` (a kernel module), or None: numpy's loops for a
    call of ``size`` (rows x items) under ``threshold`` while it is not loaded yet, under
    ``MOESHARD_EPLB_JIT=0``, or without numba."""
    if os.environ.get("MOESHARD_EPLB_JIT", "1").strip() == "0":
        return None
    if name not in _LOADED:
        if size < threshold:
            return None
        try:
            _LOADED[name] = importlib.import_module(f"{__package__}.{name}")
        except ImportError:  # numba not installed
            _LOADED[name] = None
    return _LOADED[name]
