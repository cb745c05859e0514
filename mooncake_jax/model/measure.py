"""Timing the local engine for cost-model profiles (``mooncake-jax profile``).

Each function reuses one engine per model (compiles are paid once) and times the steady state: the first call
for a shape compiles and is not counted.
"""

from __future__ import annotations

import functools
import time

import numpy as np

from .engine import Engine
from .sequence import SamplingParams


@functools.cache
def _engine(model: str) -> Engine:
    from ..llm import LLM

    return LLM(model, prefill_chunk_size=2048, max_batch=64).engine


def _prefilled(engine: Engine, rng, n_tokens: int, max_new: int):
    seq = engine.new_sequence(rng.integers(0, engine.cfg.vocab_size, n_tokens).tolist(),
                              SamplingParams(max_new_tokens=max_new))
    engine.admit(seq, cached_pages=[])
    engine.prefill(seq)
    return seq


def measure_prefill(model: str, n_tokens: int, prefix_tokens: int) -> float:
    """Seconds to prefill ``n_tokens`` - ``prefix_tokens`` new tokens on top of a cached ``prefix_tokens`` prefix
    (rounded down to whole blocks, as the cache holds them)."""
    engine = _engine(model)
    if not 0 <= prefix_tokens < n_tokens:
        raise ValueError(f"need 0 <= prefix_tokens < n_tokens, got {prefix_tokens} and {n_tokens}")
    rng = np.random.default_rng(n_tokens * 7919 + prefix_tokens)
    prompt = rng.integers(0, engine.cfg.vocab_size, n_tokens).tolist()
    cached_blocks = prefix_tokens // engine.block_size

    def run_once() -> float:
        warm = engine.new_sequence(prompt[: max(1, cached_blocks * engine.block_size) + 1],
                                   SamplingParams(max_new_tokens=1))
        engine.admit(warm, cached_pages=[])
        engine.prefill(warm)  # puts the prefix blocks into the prefix cache
        seq = engine.new_sequence(prompt, SamplingParams(max_new_tokens=1))
        engine.admit(seq, cached_pages=warm.pages[:cached_blocks])
        t = time.perf_counter()
        engine.prefill(seq)
        engine.block_until_ready()
        seconds = time.perf_counter() - t
        engine.release(seq)
        engine.release(warm)
        return seconds

    run_once()
    return run_once()


def measure_decode_step(model: str, batch: int, context_tokens: int) -> float:
    """Seconds per decode step for ``batch`` sequences of ``context_tokens`` tokens each."""
    engine = _engine(model)
    rng = np.random.default_rng(batch * 131 + context_tokens)
    seqs = [_prefilled(engine, rng, context_tokens, 16) for _ in range(batch)]
    try:
        engine.decode(seqs)  # compile
        steps = 4
        t = time.perf_counter()
        for _ in range(steps):
            engine.decode(seqs)
        return (time.perf_counter() - t) / steps
    finally:
        for seq in seqs:
            engine.release(seq)
