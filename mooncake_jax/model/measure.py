"""Timing an engine: one prefill (optionally over a cached prefix) and steady decode steps.

The cost-model profile (``mooncake-jax profile``, an instance's start-up calibration) and the benchmark scripts all
time the engine through these two functions, so "prefill time" and "decode step time" mean the same everywhere.
``measure_prefill`` / ``measure_decode_step`` are the by-model-name entry points ``mooncake-jax profile`` calls;
they reuse one engine per model and time the steady state (a first, compiling run is not counted).
"""

from __future__ import annotations

import contextlib
import functools
import time

import numpy as np

from .engine import Engine
from .sequence import SamplingParams


def prefill_seconds(engine: Engine, prompt: list[int], prefix_tokens: int = 0, read_out: bool = False) -> float:
    """Seconds to prefill ``prompt`` when its first ``prefix_tokens`` (rounded down to whole blocks) are cached;
    ``read_out``: and to read its new blocks back to the host, as a prefill instance does for its pool."""
    cached = prefix_tokens // engine.block_size
    warm = None
    if cached:
        warm = engine.new_sequence(prompt[: cached * engine.block_size + 1], SamplingParams(max_new_tokens=1))
        engine.admit(warm, cached_pages=[])
        engine.prefill(warm)
    seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=1))
    engine.admit(seq, cached_pages=warm.pages[:cached] if warm else [])
    try:
        t = time.perf_counter()
        engine.prefill(seq)
        if read_out:
            engine.read_blocks(seq.pages[cached:])  # comes back on the host: nothing left running
        else:
            engine.block_until_ready()
        return time.perf_counter() - t
    finally:
        engine.release(seq)
        if warm:
            engine.release(warm)


def decode_step_seconds(engine: Engine, rng: np.random.Generator, batch: int, context_tokens: int,
                        steps: int = 4, repeats: int = 1, around=contextlib.nullcontext) -> float:
    """Seconds per decode step for ``batch`` sequences of ``context_tokens`` each (fastest of ``repeats``
    rounds of ``steps`` steps, after one compiling step). EOS is ignored: a model that samples it must still be
    timed for every step. ``around()``: a context manager entered around the timed rounds only (a profiler
    trace of the steps without the prefills before them)."""
    seqs = []
    for _ in range(batch):
        seq = engine.new_sequence(rng.integers(0, engine.cfg.vocab_size, context_tokens).tolist(),
                                  SamplingParams(max_new_tokens=steps * repeats + 2, ignore_eos=True))
        engine.admit(seq, cached_pages=[])
        engine.prefill(seq)
        seqs.append(seq)
    try:
        engine.decode(seqs)
        best = float("inf")
        with around():
            for _ in range(repeats):
                t = time.perf_counter()
                for _ in range(steps):
                    engine.decode(seqs)
                best = min(best, (time.perf_counter() - t) / steps)
        return best
    finally:
        for seq in seqs:
            engine.release(seq)


@functools.cache
def _engine(model: str) -> Engine:
    from ..llm import LLM

    return LLM(model, prefill_chunk_size=2048, max_batch=64).engine


def measure_prefill(model: str, n_tokens: int, prefix_tokens: int) -> float:
    """``prefill_seconds`` of a random ``n_tokens`` prompt on ``model``'s engine (steady state)."""
    if not 0 <= prefix_tokens < n_tokens:
        raise ValueError(f"need 0 <= prefix_tokens < n_tokens, got {prefix_tokens} and {n_tokens}")
    engine = _engine(model)
    rng = np.random.default_rng(n_tokens * 7919 + prefix_tokens)
    prompt = rng.integers(0, engine.cfg.vocab_size, n_tokens).tolist()
    prefill_seconds(engine, prompt, prefix_tokens)
    return prefill_seconds(engine, prompt, prefix_tokens)


def measure_decode_step(model: str, batch: int, context_tokens: int) -> float:
    """``decode_step_seconds`` on ``model``'s engine."""
    return decode_step_seconds(_engine(model), np.random.default_rng(batch * 131 + context_tokens), batch,
                               context_tokens)
