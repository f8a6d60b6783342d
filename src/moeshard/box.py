"""Boxes: per-dim ``(offset, length)`` regions of a tensor.

A box is a tuple of ``(offset, length)`` pairs, one per tensor dim. They are plain tuples so
plans stay hashable, picklable and cheap to compare.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Box = tuple[tuple[int, int], ...]

__all__ = ["Box", "full_box", "box_shape", "box_numel", "box_slices", "split_box", "check_box"]


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(length for _, length in box)


def box_numel(box: Box) -> int:
    return math.prod(length for _, length in box)


def box_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(off, off + length) for off, length in box)


def check_box(box: Box, shape: Sequence[int], what: str) -> None:
    """Raise ValueError unless ``box`` lies inside a tensor of ``shape``."""
    if len(box) != len(shape) or any(off < 0 or length < 0 or off + length > n for (off, length), n in zip(box, shape)):
        raise ValueError(f"{what}: box {list(box)} does not fit in shape {list(shape)}")


def split_box(box: Box, max_numel: int) -> list[Box]:
    """Split ``box`` along its first dim longer than one into boxes of at most ``max_numel``
    elements where possible (a single row of a larger size stays whole along later dims only
    if it cannot be split further). Order is row-major, so concatenating the parts restores
    the box."""
    if box_numel(box) <= max_numel:
        return [box]
    for dim, (off, length) in enumerate(box):  # noqa: B007 - dim, off and length are used after the break
        if length > 1:
            break
    else:  # pragma: no cover - a single element is always <= max_numel >= 1
        return [box]
    inner = box_numel(box) // length
    step = max(1, max_numel // max(inner, 1))
    parts: list[Box] = []
    for start in range(off, off + length, step):
        sub = box[:dim] + ((start, min(step, off + length - start)),) + box[dim + 1 :]
        parts.extend(split_box(sub, max_numel) if inner > max_numel else [sub])
    return parts
