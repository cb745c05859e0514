"""Device meshes from a spec such as ``"stage=2,tensor=4"``; the mesh axis names, defined once.

Axes:
- ``stage``: pipeline stages of chunked pipeline-parallel prefill; each stage owns a contiguous range of layers.
- ``tensor``: tensor parallelism inside a stage (attention heads, MLP columns/rows, vocabulary split).

Axes are ``Auto``: parameters and KV pages carry ``NamedSharding`` s and XLA's partitioner inserts the collectives,
so changing a layout is a change of the rules table in ``rules.py``, never of model code.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

STAGE = "stage"
TENSOR = "tensor"
MESH_AXES = (STAGE, TENSOR)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """How many pipeline stages, and how many tensor-parallel devices per stage."""

    stage: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"mesh axis {axis!r} must be a positive integer, got {value!r}")

    @property
    def devices(self) -> int:
        return self.stage * self.tensor

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        """``"stage=2,tensor=4"`` (either part may be left out; empty means one device)."""
        sizes = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in MESH_AXES:
                raise ValueError(f"bad mesh spec part {part!r}: expected AXIS=SIZE with AXIS in {MESH_AXES}")
            if name in sizes:
                raise ValueError(f"mesh axis {name!r} given twice in {text!r}")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(f"mesh axis {name!r} needs an integer size, got {value!r}") from None
        return cls(**sizes)

    def __str__(self) -> str:
        return f"{STAGE}={self.stage},{TENSOR}={self.tensor}"


def build_mesh(spec: MeshSpec, devices=None) -> Mesh:
    """A (stage, tensor) mesh over the first ``spec.devices`` devices (ValueError if there are fewer)."""
    devices = list(jax.devices() if devices is None else devices)
    if spec.devices > len(devices):
        raise ValueError(f"mesh {spec} needs {spec.devices} devices but only {len(devices)} "
                         f"{devices[0].platform if devices else ''} devices exist")
    return jax.make_mesh((spec.stage, spec.tensor), MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[: spec.devices])


def stage_mesh(mesh: Mesh, stage: int) -> Mesh:
    """The one-axis (tensor) mesh of one pipeline stage's devices."""
    return Mesh(mesh.devices[stage], (TENSOR,), axis_types=(AxisType.Auto,))
