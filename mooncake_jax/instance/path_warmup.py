"""Warm a started cluster's serving path with a few synthetic requests before clients arrive.

Compiling every step shape (``InstanceConfig.warmup``) is not all that a first request pays for. The first requests
through a new cluster also open the gRPC channels (gateway -> Conductor and instances, prefill -> decode Messenger),
grow the servers' and transfer threads' pools, touch fresh pool memory and run each Python path once. Measured on
the demo (2-core AMD EPYC, tiny model, load 5-7): without this, the trace's first burst of ten requests stalled every
running stream at once by 45 ms and by 92-152 ms in the two runs read, the demo's worst token gaps; with it, none of
that burst's gaps exceeded 39 ms in four runs (docs/benchmarks/demo.md, demo TBT tail, fourth pass).

The requests carry random token ids (their KV stays in the pools like any other, matching nothing real), a spread of
prompt lengths, and run concurrently so that every prefill instance and the decode instances see joins while a batch
runs. A refusal or failure is logged, never fatal: serving starts either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

log = logging.getLogger(__name__)

PROMPT_BLOCKS = (1, 4, 12, 24)
"""Prompt lengths of the warm-up requests, in KV blocks: short and long transfers, single and multi-chunk prefill."""


def warmup_prompts(count: int, vocab_size: int, max_context: int, block_size: int, max_new_tokens: int,
                   seed: int = 0) -> list[list[int]]:
    """``count`` random prompts cycling through ``PROMPT_BLOCKS`` lengths, each fitting the context with room for
    ``max_new_tokens``."""
    rng = np.random.default_rng(seed)
    longest = max(1, max_context - max_new_tokens)
    lengths = [min(longest, PROMPT_BLOCKS[i % len(PROMPT_BLOCKS)] * block_size) for i in range(count)]
    return [rng.integers(0, vocab_size, n).tolist() for n in lengths]


def warm_serving_path(generate: Callable[[list[int]], list[int]], prompts: list[list[int]]) -> int:
    """Run ``generate`` on every prompt concurrently; returns how many completed (the others are logged)."""
    t0 = time.perf_counter()

    def one(prompt: list[int]) -> bool:
        try:
            generate(prompt)
            return True
        except Exception as e:  # a refusal (admission, SLOs) or a failure: warm-up only, serving starts anyway
            log.warning("warm-up request of %d tokens did not complete: %s", len(prompt), e)
            return False

    with ThreadPoolExecutor(max(1, len(prompts))) as pool:
        done = sum(pool.map(one, prompts))
    log.info("serving path warmed: %d of %d requests in %.2f s", done, len(prompts), time.perf_counter() - t0)
    return done
