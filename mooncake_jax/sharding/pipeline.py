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
B sequences is a single "chunk" that passes through them (each stage keeps the KV of its layers, stacked).

With layer hooks (``model.layer_hooks``) the same schedule runs, but each (stage, chunk) step dispatches the stage's
layers one by one (one per-layer program per stage) and calls the hooks between them: loads before each layer of
the first chunk, saves after each layer of the last chunk.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from ..model.attention import PagedBatch
from ..model.kv_cache import allocate_kv, kv_shape
from ..model.kv_scatter import LogicalPages, logical_pages
from ..model.layer_hooks import LayerHooks
from ..model.llama import Llama, Stage
from ..model.packed_inputs import pack
from ..model.sampling import SamplingInputs
from ..model.steps import (HashedGraph, embed_step, forward_step, forward_step_packed, head_step, layer_apply_step,
                           layer_step, plain_arrays, read_blocks, read_layer, write_blocks, write_layer)


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


class LayerPages(NamedTuple):
    """Pages the layer hooks load into and save from (each padded with the scratch page to a bucketed count)."""

    load: np.ndarray | None  # [n_load] pages of the prefix that wait_for_layer_load fills, or None
    save: np.ndarray | None  # [n_save] pages whose new KV save_layer receives, or None


class StageRunner:
    """One stage: its slice of the stacked parameters and its layers' stacked KV pages on its devices, and the
    jitted steps over them."""

    def __init__(self, model: Llama, start: int, stop: int, index: int, layout, num_pages: int, kv_dtype=None,
                 scan: bool = True, pack_inputs: bool = False):
        self.index, self.start, self.stop = index, start, stop
        self.pack_inputs = pack_inputs
        self.n_layers = stop - start
        self.layout = layout
        self.scan = scan
        stage = Stage(model, start, stop, scan=scan)
        graphdef, params = nnx.split(stage)
        # hashed once and as plain arrays: jax.jit hashes the one and flattens the other on every step
        self.graphdef = HashedGraph(graphdef)
        self.params = plain_arrays(layout.place_params(index, params))
        self.layer_graphdef = None if scan else HashedGraph(nnx.split(stage.layers[0])[0])
        cfg = model.cfg
        shape = kv_shape(cfg, num_pages, self.n_layers)
        self.kv = allocate_kv(cfg, num_pages, kv_dtype, layout.kv_sharding(index, shape), n_layers=self.n_layers)
        # Traced under the stage's mesh, so the attention seam can shard_map its kernels over the tensor axis.
        meshes = getattr(layout, "stage_meshes", None)
        self.mesh = meshes[index] if meshes else None

    def _traced_here(self):
        """The context the stage's programs are traced in: its mesh, where it has one."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def __call__(self, inputs, step: StepInputs):
        """(next_tokens or None, logits or hidden states) of this stage, left on its devices."""
        tree = (inputs, step.positions, step.batch, step.logits_index, step.sampling)
        run = forward_step
        if self.pack_inputs:
            buffer, passed, packing = pack(tree)
            run, tree = functools.partial(forward_step_packed, packing=packing), (buffer, passed)
        args = self.layout.place_inputs(self.index, tree)
        with self._traced_here():
            next_tokens, out, self.kv = run(self.graphdef, self.params, self.kv, *args, mode=step.mode)
        return next_tokens, out

    def by_layer(self, inputs, step: StepInputs, hooks: LayerHooks, load: np.ndarray | None,
                 save: np.ndarray | None):
        """Like ``__call__``, one layer at a time with the hooks between layers: before each layer its prefix KV
        from ``hooks.wait_for_layer_load`` into pages ``load`` (None: no loading in this chunk), after each layer
        the KV of pages ``save`` to ``hooks.save_layer`` (None: no saving in this chunk)."""
        place = lambda tree: self.layout.place_inputs(self.index, tree)  # noqa: E731
        inputs, positions, batch, logits_index, sampling = place(
            (inputs, step.positions, step.batch, step.logits_index, step.sampling))
        load, save = place((load, save))
        x = embed_step(self.graphdef, self.params, inputs) if self.start == 0 else inputs
        for local in range(self.n_layers):
            layer = self.start + local
            index = place(np.int32(local))
            if load is not None:
                blocks = hooks.wait_for_layer_load(layer)
                if blocks is not None:
                    self.kv = write_layer(self.kv, index, load, place(_pad_rows(blocks, load.shape[0])),
                                          n_layers=self.n_layers)
            with self._traced_here():
                if self.scan:
                    x, self.kv = layer_step(self.graphdef, self.params, self.kv, index, x, positions, batch)
                else:
                    x, self.kv = layer_apply_step(self.layer_graphdef, self.params["layers"][local], self.kv, index,
                                                  x, positions, batch, n_layers=self.n_layers)
            if save is not None:
                hooks.save_layer(layer, read_layer(self.kv, index, save, n_layers=self.n_layers))
        if self.index < len(self.layout.stage_ranges) - 1:
            return None, x
        return head_step(self.graphdef, self.params, x, logits_index, sampling, mode=step.mode)


def default_pack_inputs() -> bool:
    """Whether a stage packs its step's host arrays into one transfer (``model.packed_inputs``) by default: on GPU and
    TPU yes, where each array is a host-to-device copy the device waits for; on CPU no (its arrays are handed over in
    host memory, and the packing would be a copy of its own)."""
    return jax.default_backend() != "cpu"


def default_scan() -> bool:
    """Whether layers run scanned by default on this backend: on GPU and TPU yes; on CPU no (see ``llama.Stage``)."""
    return jax.default_backend() != "cpu"


def _pad_rows(blocks, n: int):
    """``blocks`` with zero rows appended up to ``n`` (padding rows are written to the scratch page)."""
    missing = n - blocks.shape[0]
    if missing < 0:
        raise ValueError(f"layer hook returned {blocks.shape[0]} blocks for {n} prefix pages")
    if not missing:
        return blocks
    if isinstance(blocks, jax.Array):
        return jax.numpy.pad(blocks, [(0, missing)] + [(0, 0)] * (blocks.ndim - 1))
    return np.concatenate([blocks, np.zeros((missing,) + blocks.shape[1:], blocks.dtype)])


class PipelineRunner:
    """A model laid out in stages (one for a single device); runs chunks through them in the CPP schedule.

    ``scan``: stages run their layers under ``lax.scan`` (see ``llama.Stage``); None chooses by backend: scanned on
    GPU/TPU, unrolled on CPU (whose matmuls cannot read a slice of the stacked weights in place). ``pack_inputs``:
    each step's host arrays go to the device as one buffer (``model.packed_inputs``); None chooses by backend
    (``default_pack_inputs``).
    """

    def __init__(self, model: Llama, layout, num_pages: int, kv_dtype=None, scan: bool | None = None,
                 pack_inputs: bool | None = None):
        self.scan = default_scan() if scan is None else scan
        pack_inputs = default_pack_inputs() if pack_inputs is None else pack_inputs
        self.stages = [StageRunner(model, start, stop, i, layout, num_pages, kv_dtype, self.scan, pack_inputs)
                       for i, (start, stop) in enumerate(layout.stage_ranges)]
        self.dispatch_log: list[tuple[int, int, int]] | None = None  # (step, stage, chunk) when recording

    def run(self, steps: Sequence[StepInputs], hooks: LayerHooks | None = None,
            pages: LayerPages | None = None) -> list[tuple[jax.Array | None, jax.Array]]:
        """Each step's (next_tokens, last stage output), dispatched in pipeline order.

        With ``hooks``, every stage runs layer by layer and calls them: loads into ``pages.load`` during the first
        chunk, saves of ``pages.save`` during the last one.
        """
        if hooks is not None and pages is None:
            raise ValueError("layer hooks need the pages to load into and save from")
        outputs: list = [None] * len(steps)
        for k, pairs in enumerate(pipeline_schedule(len(steps), len(self.stages))):
            for s, c in pairs:
                stage = self.stages[s]
                inputs = steps[c].tokens if s == 0 else outputs[c][1]
                if hooks is None:
                    outputs[c] = stage(inputs, steps[c])
                else:
                    outputs[c] = stage.by_layer(inputs, steps[c], hooks, pages.load if c == 0 else None,
                                                pages.save if c == len(steps) - 1 else None)
                if self.dispatch_log is not None:
                    self.dispatch_log.append((k, s, c))
        return outputs

    @property
    def kv(self) -> list[tuple[LogicalPages, LogicalPages]]:
        """Every stage's stacked (K, V) pages, in stage order (each on its stage's devices), as views of their
        logical dtype (``kv_scatter``: on CPU a 16-bit float cache is stored as 16-bit integers)."""
        return [logical_pages(stage.kv) for stage in self.stages]

    def read_blocks(self, pages: np.ndarray) -> np.ndarray:
        """Whole blocks [n, layers, 2, block_size, kv_heads, head_dim] of ``pages``, gathered to the host."""
        parts = [np.asarray(read_blocks(stage.kv, stage.layout.place_inputs(stage.index, pages),
                                        n_layers=stage.n_layers)) for stage in self.stages]
        return np.concatenate(parts, axis=1)

    def write_blocks(self, pages: np.ndarray, blocks: np.ndarray) -> None:
        for stage in self.stages:
            layers = stage.layout.place_inputs(stage.index, (pages, blocks[:, stage.start:stage.stop]))
            stage.kv = write_blocks(stage.kv, *layers, n_layers=stage.n_layers)

    def block_until_ready(self) -> None:
        jax.block_until_ready([stage.kv for stage in self.stages])
