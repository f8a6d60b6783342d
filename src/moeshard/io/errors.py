"""The error every reader of checkpoint files raises: :class:`CheckpointError` (a ValueError)."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint file, index or header is missing, malformed or inconsistent."""
