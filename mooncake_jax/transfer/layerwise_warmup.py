"""Compile the layer-wise prefill's programs before a layer-wise prefill instance serves.

``Engine.warmup`` compiles the programs of the whole-stage steps. A layer-wise prefill (``offload.LayerwisePrefill``)
runs other ones: each stage's embedding, one layer program per (chunk, context) shape, the head, and the per-layer
load and save of the prefix and new KV (one program per bucketed page count). Left to the first request of each shape,
each compiled for seconds on the engine loop (measured on 2 shared cores at load 10, tiny model in bfloat16: 10-19 s
for a request whose prefill then takes 1-2 s), so those requests missed the TTFT SLO, and the instance's slowdown
meter read them as a host 8-27x slower than its model (``demo --hetero`` refused every request).

Everything runs on the scratch page (nothing allocated, no sequence touched), through the runner's own layer-hook
path with the layer-wise prefill's own hooks, so the programs compiled are exactly those serving runs.
"""

from __future__ import annotations

import numpy as np

from ..model.attention import SCRATCH_PAGE
from ..model.engine import SAMPLING_MODES, Engine, buckets, padded_page_counts
from ..model.map_budget import check_map_headroom
from ..sharding.pipeline import LayerPages
from .offload import _OffloadHooks


def layerwise_shapes(engine: Engine) -> list[tuple[int, int, int | None, int]]:
    """(chunk tokens, context pages, pages loaded or None, pages saved) of the warm-up's runs.

    A layer-wise prefill runs one layer program per (chunk bucket, context width) pair (``Engine.context_width``:
    none, or one width for the xla attention) and loads and saves each layer's KV with one program per padded
    page count (``Engine.padded_pages``: 1, 2, 4 ... up to the longest sequence), whatever the chunk. So every
    pair runs once, loading only where there is a context (a prefix is loaded in the chunk it is the context of),
    with the load and save counts cycled over the runs; runs of the smallest chunk over the widest context follow
    until every load and save count has run."""
    chunks = buckets(engine.prefill_chunk_size, 16, engine.bucket_factor)
    widths = engine.context_widths()
    most = engine.max_pages_per_seq
    loads = padded_page_counts(most - 1)  # a prefix leaves at least one page to compute
    saves = padded_page_counts(most)
    loads_left, saves_left = list(loads), list(saves)
    shapes = []
    for t, p in [(t, p) for t in chunks for p in [0] + widths]:
        load = (loads_left.pop(0) if loads_left else loads[-1]) if p and loads else None
        shapes.append((t, p, load, saves_left.pop(0) if saves_left else saves[-1]))
    while loads_left or saves_left:
        shapes.append((chunks[0], widths[-1], loads_left.pop(0) if loads_left else loads[-1],
                       saves_left.pop(0) if saves_left else saves[-1]))
    return shapes


def warm_layerwise(engine: Engine, modes=SAMPLING_MODES) -> int:
    """Run every shape of ``layerwise_shapes`` once (per sampling mode) on the scratch page; returns the runs made.
    Call on the engine's own thread (the engine loop), like ``Engine.warmup``."""
    kv_shape = engine.cfg.block_shape()
    dtype = engine.kv_dtype  # the pool's, as the instance stores and stages blocks
    runs = 0
    for mode in modes:
        for t, width, load, save in layerwise_shapes(engine):
            check_map_headroom()
            step = engine._step(np.zeros((1, t), np.int32), np.arange(t, dtype=np.int32)[None],
                                *engine._warm_context(1, width), np.full((1, t), engine._scratch_slot, np.int32),
                                np.array([t - 1], np.int32), [], 1, mode=mode)
            prefix = None if load is None else np.zeros((load, *kv_shape), dtype)
            hooks = _OffloadHooks(prefix)
            pages = LayerPages(None if load is None else np.full(load, SCRATCH_PAGE, np.int32),
                               np.full(save, SCRATCH_PAGE, np.int32))
            outputs = engine.runner.run([step], hooks, pages)
            np.asarray(outputs[-1][1][0])  # the last-token logits, read as ``Engine.prefill`` reads them (a program)
            hooks.blocks(engine.cfg.n_layers, 1)  # waits for the saved layers' copies to the host
            runs += 1
    return runs
