"""Chunked pipeline parallelism (CPP) for prefill, and the runner that executes a model laid out in stages.

A prefill group of S stages holds contiguous layer ranges (``layout.split_layers``). A long prompt is cut into C
chunks of at most ``prefill_chunk_size`` tokens that flow through the stages like micro-batches. At step k, stage s
works on chunk c = k - s (when 0 <= c < C), so with C = 3 and S = 3:

    step      0    1    2    3    4
    stage 0   c0   c1   c2   .    .
    stage 1   .    c0   c1   c2   .
    stage 2   .    .    c0   c1   c2

C + S - 1 steps in all; every chunk visits the stages in order, and each stage sees the chunks in order. Chunk c
at stage s needs the KV of chunks < c for stage s's own layers only, which stage s wrote itself in earlier steps:
stages exchange nothing but the hidden states of a chunk at their boundary, once per chunk. A one-chunk prompt
(a short prompt) simply passes through the stages, with no other overhead.

Steps are dispatched in schedule order without waiting for results (JAX dispatch is asynchronous), so different
stages, on different devices, compute different chunks at the same time. Decode uses the same stages: one step of
B sequences is a single "chunk" that passes through them (each stage keeps the KV of its layers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from ..model.attention import PagedBatch
from ..model.kv_cache import allocate_kv, kv_shape
from ..model.llama import Llama, Stage
from ..model.sampling import SamplingInputs
from ..model.steps import forward_step, read_blocks, write_blocks


def pipeline_schedule(n_chunks: int, n_stages: int) -> list[list[tuple[int, int]]]:
    """For each step, the (stage, chunk) pairs that run in it (see the module docstring)."""
    if n_chunks < 1 or n_stages < 1:
        raise ValueError(f"need at least one chunk and one stage, got {n_chunks} chunks, {n_stages} stages")
    return [[(s, k - s) for s in range(n_stages) if 0 <= k - s < n_chunks]
            for k in range(n_chunks + n_stages - 1)]


class StepInputs(NamedTuple):
    """One chunk (prefill) or one decode step: everything but the first stage's input is shared by all stages."""

    tokens: np.ndarray  # [B, T] int32
    positions: np.ndarray  # [B, T] int32
    batch: PagedBatch
    logits_index: np.ndarray | None  # [B] int32, or None for logits at every position
    sampling: SamplingInputs
    mode: str


class StageRunner:
    """One stage: its parameters and its layers' KV pages on its devices, and the jitted step over them."""

    def __init__(self, model: Llama, start: int, stop: int, index: int, layout, num_pages: int, kv_dtype=None):
        self.index, self.start, self.stop = index, start, stop
        self.layout = layout
        self.graphdef, params = nnx.split(Stage(model, start, stop))
        self.params = layout.place_params(index, params)
        cfg = model.cfg
        shape = kv_shape(cfg, num_pages)
        self.kv = allocate_kv(cfg, num_pages, kv_dtype, layout.kv_sharding(index, shape), n_layers=stop - start)
        # Traced under the stage's mesh, so the attention seam can shard_map its kernels over the tensor axis.
        meshes = getattr(layout, "stage_meshes", None)
        self.mesh = meshes[index] if meshes else None

    def __call__(self, inputs, step: StepInputs):
        """(next_tokens or None, logits or hidden states) of this stage, left on its devices."""
        args = self.layout.place_inputs(self.index, (inputs, step.positions, step.batch, step.logits_index,
                                                     step.sampling))
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            next_tokens, out, self.kv = forward_step(self.graphdef, self.params, self.kv, *args, mode=step.mode)
        return next_tokens, out


class PipelineRunner:
    """A model laid out in stages (one for a single device); runs chunks through them in the CPP schedule."""

    def __init__(self, model: Llama, layout, num_pages: int, kv_dtype=None):
        self.stages = [StageRunner(model, start, stop, i, layout, num_pages, kv_dtype)
                       for i, (start, stop) in enumerate(layout.stage_ranges)]
        self.dispatch_log: list[tuple[int, int, int]] | None = None  # (step, stage, chunk) when recording

    def run(self, steps: Sequence[StepInputs]) -> list[tuple[jax.Array | None, jax.Array]]:
        """Each step's (next_tokens, last stage output), dispatched in pipeline order."""
        outputs: list = [None] * len(steps)
        for k, pairs in enumerate(pipeline_schedule(len(steps), len(self.stages))):
            for s, c in pairs:
                stage = self.stages[s]
                inputs = steps[c].tokens if s == 0 else outputs[c][1]
                outputs[c] = stage(inputs, steps[c])
                if self.dispatch_log is not None:
                    self.dispatch_log.append((k, s, c))
        return outputs

    @property
    def kv(self) -> list:
        """Every layer's (K, V) pages, in layer order (each on its stage's devices)."""
        return [layer for stage in self.stages for layer in stage.kv]

    def read_blocks(self, pages: np.ndarray) -> np.ndarray:
        """Whole blocks [n, layers, 2, block_size, kv_heads, head_dim] of ``pages``, gathered to the host."""
        parts = [np.asarray(read_blocks(stage.kv, pages)) for stage in self.stages]
        return np.concatenate(parts, axis=1)

    def write_blocks(self, pages: np.ndarray, blocks: np.ndarray) -> None:
        for stage in self.stages:
            layers = stage.layout.place_inputs(stage.index, (pages, blocks[:, stage.start:stage.stop]))
            stage.kv = write_blocks(stage.kv, *layers)

    def block_until_ready(self) -> None:
        jax.block_until_ready(self.kv)
