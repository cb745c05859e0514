"""Explicit sharding: meshes from a spec, one logical-axis rules table, tensor parallelism, and chunked
pipeline-parallel prefill (see ``pipeline.py`` for the schedule)."""

from .layout import MeshLayout, SingleDevice, split_layers
from .mesh import MESH_AXES, STAGE, TENSOR, MeshSpec, build_mesh
from .pipeline import PipelineRunner, pipeline_schedule
from .rules import LOGICAL_AXIS_RULES, spec_for

__all__ = ["MESH_AXES", "STAGE", "TENSOR", "MeshSpec", "build_mesh", "LOGICAL_AXIS_RULES", "spec_for",
           "MeshLayout", "SingleDevice", "split_layers", "PipelineRunner", "pipeline_schedule"]
