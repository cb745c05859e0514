"""A quick cost profile of an instance's own engine, measured at start-up.

The Conductor predicts TTFT and TBT from each instance's cost model; on a real cluster that is a profile written
by ``mooncake-jax profile`` (or a built-in hardware profile). A local cluster measures a small grid on the engine
it is about to serve with (which also compiles the shapes serving will use), fits the same models and registers
with the resulting profile JSON.

It measures the prefill path the instance serves: a layer-wise prefill instance (``LayerwisePrefill``: its cached
prefix handed in as host blocks, every layer's new KV read out as the layers run) times that path, not the plain
``Engine.prefill``. Measured on the plain path, ``demo --hetero``'s layer-wise instances registered a model their
requests then ran 1.4-3.6x over, with no compile in them (docs/benchmarks/demo.md, hetero ninth pass): until their
slowdown meters had samples, the Conductor admitted work they could not do in time.
"""

from __future__ import annotations

import json
import time

import numpy as np

from ..conductor.profile import build_profile
from ..model.engine import Engine, buckets
from ..model.measure import decode_step_seconds, prefill_seconds
from ..model.sequence import SamplingParams
from ..transfer.offload import LayerwisePrefill, usable_prefix_blocks

PREFILL_GRID = ((16, 0), (64, 0), (128, 64), (256, 0), (384, 128), (512, 0), (512, 256), (1024, 0), (2048, 0),
                (2048, 1024))
"""(prompt, cached prefix) tokens measured: every new-token count a chunk length the engine compiles (16, 64, 256,
512 with its default buckets) or a whole number of 512-token chunks, where padding costs nothing, so the fit is of
the work the engine really does. Up to 2,048 new tokens: the prompts served reach the context window (the demo's
up to 3,770 tokens), and a fit to points of at most 512 tokens under-predicted the longer ones more the longer they
were (tiny, Intel Xeon (207), quiet process, load 5: served over predicted 1.3x below 128 new tokens, 1.9x at
512-1,024, 2.1x at 1,024-2,048, 2.6x beyond; docs/benchmarks/demo.md, eleventh pass). The slowdown meter weighs
each request by its predicted seconds, so the long prompts decided its reading."""
DECODE_GRID = ((1, 64), (4, 64), (8, 256), (16, 128), (16, 512))
LOOPBACK_BYTES_PER_S = 0.5e9  # gRPC on loopback moves about this much KV per second on a 2-core machine


def decode_grid(limit: int, max_batch: int) -> list[tuple[int, int]]:
    """(batch, context tokens) points of DECODE_GRID that fit ``limit`` tokens of KV and ``max_batch``; where fewer
    than the fit's three do (a short context window, a small KV budget), points scaled to the limit instead: a
    model with 1,024 positions must calibrate as well as one with 32K."""
    fits = [(b, c) for b, c in DECODE_GRID if b <= max_batch and b * (c + 8) <= limit]
    if len(fits) >= 3:
        return fits
    wide = min(4, max_batch)
    points = {(1, limit // 2 - 8), (1, limit // 8 - 8), (wide, limit // (2 * wide) - 8), (wide, limit // (8 * wide) - 8),
              (1, limit // 4 - 8)}
    return sorted((b, c) for b, c in points if c >= 1)


def served_prefill_seconds(engine: Engine, prompt: list[int], prefix_tokens: int = 0) -> float:
    """Seconds of a plain prefill of ``prompt`` as a prefill instance serves one (``instance/prefill.py``): over its
    first ``prefix_tokens`` (whole blocks) cached in the engine, then the new blocks read out to the host for the
    pool. Without that read the prefill's time under-counts what the instance's slowdown meter measures."""
    return prefill_seconds(engine, prompt, prefix_tokens, read_out=True)


def layerwise_prefill_seconds(engine: Engine, prompt: list[int], prefix_tokens: int = 0) -> float:
    """Seconds of a layer-wise prefill of ``prompt`` as a prefill instance runs one (``instance/prefill.py``): its
    first ``prefix_tokens`` (rounded down to whole blocks) handed in as host blocks, as staged from the pool, and
    the new blocks returned on the host. The prefix's values do not change the work: zeros."""
    seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=1))
    n = min(prefix_tokens // engine.block_size, usable_prefix_blocks(seq, engine.block_size))
    kv_dtype = engine.kv_dtype
    prefix = np.zeros((n,) + engine.cfg.block_shape(), kv_dtype) if n else None
    t = time.perf_counter()
    try:
        LayerwisePrefill(engine).prefill(seq, prefix)  # the new blocks come back on the host: nothing left running
        engine.block_until_ready()
        return time.perf_counter() - t
    finally:
        engine.release(seq)


def calibrate(engine: Engine, name: str, model: str, kv_capacity_tokens: int, repeats: int = 2,
              layerwise: bool = False) -> str:
    """Measure ``engine`` on the grid (fastest of ``repeats`` after a compiling run) and return profile JSON;
    ``layerwise``: its prefill as a layer-wise prefill instance serves it (``layerwise_prefill_seconds``)."""
    cfg = engine.cfg
    limit = min(cfg.max_seq_len, (engine.num_pages - 1) * engine.block_size // 2)
    rng = np.random.default_rng(0)
    timer = layerwise_prefill_seconds if layerwise else served_prefill_seconds
    prefill_points = []
    for n, prefix in PREFILL_GRID:
        if n <= limit:
            prompt = rng.integers(0, cfg.vocab_size, n).tolist()
            seconds = min(timer(engine, prompt, prefix) for _ in range(repeats + 1))
            prefill_points.append((n, prefix, seconds))
    decode_points = []
    for batch, context in decode_grid(limit, engine.max_batch):
        seconds = decode_step_seconds(engine, rng, batch, context, steps=3, repeats=repeats)
        decode_points.append((batch, batch * context, seconds))
    profile = build_profile(name, model, prefill_points, decode_points,
                            kv_bytes_per_token=cfg.kv_bytes_per_token(), nic_bytes_per_s=LOOPBACK_BYTES_PER_S,
                            kv_capacity_tokens=kv_capacity_tokens, layers=cfg.n_layers, d_model=cfg.d_model,
                            chunk_buckets=buckets(engine.prefill_chunk_size, 16, engine.bucket_factor))
    return json.dumps(profile)
