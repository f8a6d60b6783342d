"""Which box of a tensor every rank holds: torch's DTensor sharding rule, done with numpy.

A DTensor's placements and device mesh say what each mesh coordinate holds (torch's
``_compute_local_shape_and_global_offset``), for every rank at once and without
communication; FSDP2's ``_StridedShard`` over expert parallelism (torchtitan's layout) is
nested chunks. Pure and torch-free (a torch placement is only looked at when one is passed).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from ..box import Box, full_box
from .describe import ParamDesc

__all__ = ["shard_boxes", "local_boxes", "param_boxes", "rank_boxes", "holders_disjoint"]


def _shard_dims(placements: Sequence, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`_parse_shard_dims`, cached (placements are hashable: torch's are frozen
    dataclasses; a model has a handful of distinct ones)."""
    try:
        return _cached_shard_dims(tuple(placements), ndim)
    except TypeError:  # an unhashable placement: parse it every time
        return _parse_shard_dims(placements, ndim)


@functools.lru_cache(maxsize=1024)
def _cached_shard_dims(placements: tuple, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return _parse_shard_dims(placements, ndim)


def _parse_shard_dims(placements: Sequence, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(dims, order)``: per mesh dim, the tensor dim its ``Shard`` splits, or -1 for
    ``Replicate``; and the mesh dims in the order they split the tensor (mesh-dim order, except
    that a ``_StridedShard`` comes after the shard it strides over, see :func:`_strided_order`).
    A placement is torch's ``Shard`` / ``_StridedShard`` / ``Replicate`` or its torch-free
    spelling (an int dim, None). Raises ValueError for any other placement (``Partial``)."""
    dims = []
    strided: dict[int, int] = {}  # mesh dim -> split factor of its _StridedShard
    for p in placements:
        if p is None:
            dims.append(-1)
            continue
        if isinstance(p, int) and not isinstance(p, bool):
            dim = p
        else:
            # A torch placement: torch is already imported by whoever made it.
            from torch.distributed.tensor.placement_types import Replicate, Shard

            is_strided = type(p).__name__ == "_StridedShard"  # not a Shard subclass in every torch
            if not (is_strided or isinstance(p, (Shard, Replicate))):
                raise ValueError(f"placement {p} is not supported (Shard, _StridedShard and Replicate are)")
            if is_strided:
                strided[len(dims)] = int(p.split_factor)
            if not (is_strided or isinstance(p, Shard)):
                dims.append(-1)
                continue
            dim = p.dim
        norm = dim + ndim if dim < 0 else dim
        if not 0 <= norm < ndim:
            name = f"Shard({p})" if isinstance(p, int) else p
            raise ValueError(f"placement {name} shards dim {dim} of a {ndim}-dim tensor")
        dims.append(norm)
    return tuple(dims), _strided_order(tuple(dims), strided)


def _strided_order(dims: tuple[int, ...], strided: dict[int, int]) -> tuple[int, ...]:
    """The mesh dims in the order they split the tensor. FSDP2 over a tensor already sharded on
    the same dim by a later mesh dim (torchtitan's expert FSDP with ``Shard(0)``: EP's
    ``Shard(0)`` on the ``ep`` mesh dim, then FSDP's on ``efsdp``) writes the FSDP dim as
    ``_StridedShard(dim, split_factor=<that later mesh dim's size>)``: that mesh dim splits
    first, this one splits its chunks. Raises ValueError for a ``_StridedShard`` with no such
    later shard (torch's other uses of it are not supported)."""
    order = list(range(len(dims)))
    for i, sf in strided.items():
        later = [j for j in range(i + 1, len(dims)) if dims[j] == dims[i]]
        if len(later) != 1:
            raise ValueError(f"_StridedShard(dim={dims[i]}, split_factor={sf}) on mesh dim {i} is supported only "
                             "before exactly one Shard of the same tensor dim (FSDP2 over EP, torchtitan's layout)")
        order.remove(i)
        order.insert(order.index(later[0]) + 1, i)
    return tuple(order)


@functools.lru_cache(maxsize=4096)
def _shard_boxes(shape: tuple[int, ...], mesh_shape: tuple[int, ...], dims: tuple[int, ...],
                 order: tuple[int, ...] | None = None) -> np.ndarray:
    """:func:`shard_boxes` for placements given as :func:`_shard_dims` (read-only: cached)."""
    num = int(np.prod(mesh_shape, dtype=np.int64))
    coords = np.indices(mesh_shape, dtype=np.int64).reshape(len(mesh_shape), num)  # row-major
    off = np.zeros((num, len(shape)), dtype=np.int64)
    size = np.tile(np.asarray(shape, dtype=np.int64), (num, 1))
    for mesh_dim in (order if order is not None else range(len(dims))):
        dim = dims[mesh_dim]
        if dim < 0:
            continue
        # torch.chunk of what the earlier mesh dims left: chunks of ceil(size / n), the last
        # ones short or empty. Mesh dims sharding the same dim nest in mesh-dim order (a
        # _StridedShard after the shard it strides over: ``order``).
        cur, k = size[:, dim], coords[mesh_dim]
        chunk = -(-cur // mesh_shape[mesh_dim])
        start = np.minimum(chunk * k, cur)
        size[:, dim] = np.minimum(cur - start, chunk)
        off[:, dim] += start
    # torch gives an empty shard the dim's global size as its offset.
    for dim in {d for d in dims if d >= 0}:
        off[:, dim] = np.where(size[:, dim] == 0, shape[dim], off[:, dim])
    out = np.stack([off, size], axis=-1)
    out.setflags(write=False)
    return out


def shard_boxes(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence) -> np.ndarray:
    """Box (global coordinates) of every mesh coordinate of a DTensor of global ``shape``.

    ``placements``: one torch ``Shard(dim)`` / ``Replicate()`` per mesh dim (or the torch-free
    spelling, :class:`~moeshard.models.describe.ParamDesc`), or FSDP2's ``_StridedShard`` over a
    later ``Shard`` of the same dim (torchtitan's expert FSDP, :func:`_strided_order`; even
    shards only). The rule is torch's
    (``_compute_local_shape_and_global_offset``) done with numpy, cached.

    Returns:
        ``int64[prod(mesh_shape), len(shape), 2]`` of ``(offset, length)``, mesh coordinates in
        row-major order; read-only.

    Raises ValueError for another placement (``Partial``) or an uneven ``_StridedShard``.
    """
    shape = tuple(int(n) for n in shape)
    mesh_shape = tuple(int(n) for n in mesh_shape)
    dims, order = _shard_dims(placements, len(shape))
    if order != tuple(range(len(dims))):
        # torch's strided layout is nested chunks only where the chunks divide evenly.
        for dim in {d for d in dims if d >= 0}:
            split = int(np.prod([m for m, d in zip(mesh_shape, dims) if d == dim]))
            if shape[dim] % split:
                raise ValueError(f"placements {list(placements)}: tensor dim {dim} of size {shape[dim]} does not "
                                 f"divide into {split} equal shards (uneven _StridedShard shards are not supported)")
    return _shard_boxes(shape, mesh_shape, dims, order)


@functools.lru_cache(maxsize=4096)
def local_boxes(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple) -> tuple[Box, ...]:
    """Local box (in global coordinates) of every mesh coordinate, in row-major order."""
    return tuple(tuple(map(tuple, box)) for box in shard_boxes(shape, mesh_shape, placements).tolist())


def param_boxes(d: ParamDesc, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ranks, boxes)``: ``int64[M]`` ranks and ``int64[M, ndim, 2]`` the box (global
    coordinates) each holds, in mesh order (read-only); a plain tensor is held in full by
    ranks ``0 .. world_size - 1``. Raises ValueError for a mesh naming a rank >= world_size."""
    if d.mesh is None:
        full = np.stack([np.zeros(len(d.shape), np.int64), np.asarray(d.shape, np.int64)], axis=-1)
        return np.arange(world_size, dtype=np.int64), np.broadcast_to(full, (world_size, *full.shape))
    ranks = np.asarray(d.mesh, dtype=np.int64).reshape(-1)
    bad = np.flatnonzero(ranks >= world_size)
    if bad.size:
        raise ValueError(f"parameter {d.name}: its mesh names rank {ranks[bad[0]]} >= world size {world_size}")
    return ranks, shard_boxes(d.shape, d.mesh.shape, d.placements)


def rank_boxes(d: ParamDesc, world_size: int) -> list[tuple[int, Box]]:
    """``[(rank, box)]``: the box (global coordinates) of ``d`` each rank holds; a plain tensor
    is held in full by every rank. Raises ValueError for a mesh naming a rank >= world_size."""
    ranks, _ = param_boxes(d, world_size)  # checks the mesh's ranks
    if d.mesh is None:
        boxes = (full_box(d.shape),) * world_size
    else:
        boxes = local_boxes(d.shape, d.mesh.shape, d.placements)
    return list(zip(ranks.tolist(), boxes))


def holders_disjoint(d: ParamDesc, num_holders: int) -> bool:
    """Whether the non-empty boxes that the holders of ``d`` hold are pairwise different: no
    mesh dim of two or more ranks replicates it (a plain tensor: held whole by every rank)."""
    if d.mesh is None:
        return num_holders == 1
    dims, _ = _shard_dims(d.placements, len(d.shape))
    return all(n == 1 or dim >= 0 for n, dim in zip(d.mesh.shape, dims))
