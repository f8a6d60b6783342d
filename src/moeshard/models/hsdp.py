"""HSDP for the dense part of a moeshard model: FSDP2's own hybrid sharding.

``fully_shard`` on a 2-D ``("replicate", "shard")`` DeviceMesh shards every dense parameter
over the ``shard`` axis and keeps one full set of shards per ``replicate`` coordinate (a
*replica group*: ranks ``r * S .. (r + 1) * S - 1`` of the model's mesh, ``S = world /
replicate``), so that a replica group on another node holds a live copy of every dense weight
(what :func:`moeshard.reshard` recovers from when a node dies). Gradients are reduce-scattered
within a replica group and all-reduced across them (FSDP2's HSDP). The expert side keeps its
``("efsdp", "ep")`` mesh: a second copy of an expert is a redundant expert of the placement.

With torchrun's rank order (a node's ranks consecutive) and ``S`` a multiple of the ranks per
node, each replica group is whole nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["HybridMesh", "dense_mesh", "as_hybrid", "DENSE_DIMS"]

DENSE_DIMS = ("replicate", "shard")


@dataclass(frozen=True)
class HybridMesh:
    """The meshes of a moeshard model with HSDP dense parameters (:func:`moeshard.make_mesh`
    with ``replicate > 1``): ``experts`` the ``("efsdp", "ep")`` mesh of the expert parameters,
    ``dense`` the ``("replicate", "shard")`` mesh of every other parameter, over the same ranks."""

    experts: DeviceMesh
    dense: DeviceMesh

    @property
    def replicate(self) -> int:
        return self.dense.size(0)


def dense_mesh(mesh: DeviceMesh, replicate: int) -> DeviceMesh:
    """Collective (every rank of ``mesh``): the ``("replicate", "shard")`` mesh over the ranks of
    ``mesh`` (in its row-major order), ``replicate`` rows of ``mesh.size() // replicate`` ranks.

    Raises ValueError when ``replicate`` does not divide the mesh's size."""
    world = mesh.size()
    if replicate < 1 or world % replicate:
        raise ValueError(f"replicate={replicate} must be a positive divisor of the mesh's {world} ranks")
    ranks = mesh.mesh.reshape(-1).reshape(replicate, world // replicate)
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=DENSE_DIMS)


def as_hybrid(mesh) -> tuple[DeviceMesh, DeviceMesh | None]:
    """``(expert mesh, dense mesh or None)`` of a :class:`HybridMesh` or a plain DeviceMesh."""
    if isinstance(mesh, HybridMesh):
        return mesh.experts, mesh.dense
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a DeviceMesh or a moeshard HybridMesh (make_mesh), got {type(mesh).__name__}")
    return mesh, None
