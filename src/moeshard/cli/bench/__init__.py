"""Benchmarks shipped with the ``moeshard bench`` command (figures, not tests)."""
