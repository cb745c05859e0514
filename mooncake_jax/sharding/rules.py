"""The one table that maps logical axes (named by the model on every parameter and array) to mesh axes.

Model code names *what* an axis is (``heads``, ``mlp``, ``vocab``, ...); this table says *where* it lives. A
different layout (say, sharding ``embed`` instead of ``mlp``) is a change here only.

Divisibility: an axis mapped to ``tensor`` must divide evenly, with one exception the design calls for: KV heads
are replicated when there are more tensor devices than KV heads (grouped-query attention with 8 KV heads on 16
chips). Everything else that does not divide is a configuration error, never a silent replication.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .mesh import TENSOR

LOGICAL_AXIS_RULES: dict[str, str | None] = {
    # parameters
    "vocab": TENSOR,
    "embed": None,
    "heads": TENSOR,
    "kv_heads": TENSOR,
    "head_dim": None,
    "mlp": TENSOR,
}

REPLICABLE = frozenset({"kv_heads"})
"""Logical axes that fall back to replication when the mesh axis does not divide them."""

KV_PAGE_AXES = ("kv_heads", None, None, "head_dim")
"""Logical axes of a (head-major) KV page array [kv_heads, pages, block_size, head_dim]."""


def spec_for(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
             rules: dict[str, str | None] = LOGICAL_AXIS_RULES) -> PartitionSpec:
    """The PartitionSpec of an array with logical ``axes`` and ``shape`` on ``mesh``."""
    parts = []
    for axis, size in zip(axes, shape):
        if axis is not None and axis not in rules:
            raise ValueError(f"logical axis {axis!r} has no rule; known: {sorted(rules)}")
        mesh_axis = rules.get(axis) if axis is not None else None
        if mesh_axis is None or mesh_axis not in mesh.shape or mesh.shape[mesh_axis] == 1:
            parts.append(None)
            continue
        n = mesh.shape[mesh_axis]
        if size % n:
            if axis in REPLICABLE:
                parts.append(None)
                continue
            raise ValueError(f"logical axis {axis!r} of size {size} cannot be split over {n} {mesh_axis!r} "
                             f"devices; choose a {mesh_axis} size that divides {size}")
        parts.append(mesh_axis)
    return PartitionSpec(*parts)


def param_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """A NamedSharding for every parameter of ``state``, from its ``out_sharding`` logical axes."""
    def one(var):
        axes = var.get_metadata().get("out_sharding") or (None,) * var.get_value().ndim
        return NamedSharding(mesh, spec_for(tuple(axes), var.get_value().shape, mesh))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def kv_sharding(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """Sharding of one layer's K or V pages: split over KV heads on axis 0 (replicated if they do not divide)."""
    return NamedSharding(mesh, spec_for(KV_PAGE_AXES, shape, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
