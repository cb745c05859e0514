"""Where each part of a model lives: which layers each pipeline stage holds, and on which devices, split how.

``Layout`` is what the engine asks: the layer range of every stage and the shardings of a stage's parameters, KV
pages and inputs. ``SingleDevice`` is the default (one stage, the default device, nothing sharded); ``MeshLayout``
builds a (stage, tensor) mesh and shards every stage over its own tensor devices by the rules table.
"""

from __future__ import annotations

import jax
from flax import nnx

from ..model.config import ModelConfig
from .mesh import MeshSpec, build_mesh, stage_mesh
from .rules import kv_sharding, param_shardings, replicated


def split_layers(n_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous, balanced layer ranges: the first ``n_layers % stages`` stages take one layer more."""
    if stages < 1 or stages > n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {stages} pipeline stages "
                         f"(allowed: 1 to {n_layers} stages)")
    base, extra = divmod(n_layers, stages)
    ranges, start = [], 0
    for s in range(stages):
        stop = start + base + (s < extra)
        ranges.append((start, stop))
        start = stop
    return ranges


class SingleDevice:
    """All layers as one stage on the default device."""

    def __init__(self, cfg: ModelConfig):
        self.stage_ranges = [(0, cfg.n_layers)]

    def place_params(self, stage: int, params: nnx.State) -> nnx.State:
        return params

    def kv_sharding(self, stage: int, shape: tuple[int, ...]):
        return None

    def place_inputs(self, stage: int, tree):
        return tree


class MeshLayout:
    """``spec.stage`` pipeline stages, each tensor-parallel over ``spec.tensor`` devices."""

    def __init__(self, cfg: ModelConfig, spec: MeshSpec, devices=None):
        if cfg.n_heads % spec.tensor:
            raise ValueError(f"tensor={spec.tensor} does not divide the {cfg.n_heads} attention heads of "
                             f"{cfg.name}; choose a divisor of {cfg.n_heads}")
        self.stage_ranges = split_layers(cfg.n_layers, spec.stage)
        self.spec = spec
        self.mesh = build_mesh(spec, devices)
        self.stage_meshes = [stage_mesh(self.mesh, s) for s in range(spec.stage)]

    def place_params(self, stage: int, params: nnx.State) -> nnx.State:
        """The stage's parameters on its devices, split by the rules (ValueError if an axis does not divide)."""
        shardings = param_shardings(params, self.stage_meshes[stage])
        return jax.device_put(params, shardings)

    def kv_sharding(self, stage: int, shape: tuple[int, ...]):
        return kv_sharding(shape, self.stage_meshes[stage])

    def place_inputs(self, stage: int, tree):
        """Inputs (tokens or the previous stage's hidden states, page tables, sampling) replicated on the stage."""
        return jax.device_put(tree, replicated(self.stage_meshes[stage]))
