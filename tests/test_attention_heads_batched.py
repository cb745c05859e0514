"""The one-sequence prefill runs each product over every KV head at once (a batch axis), not once per (head, query
block): a quarter of the ops and several times faster compiles at the same run time (docs/benchmarks/engine.md,
AMD EPYC prefill, nineteenth pass). Its results against the float64 reference are in test_attention*.py; here
the program's shape, and one case with context and several query blocks crossing the unmasked-keys threshold."""

import re

import jax
import numpy as np

from mooncake_jax.model.attention import UNMASKED_MIN_KEYS, paged_attention, query_block_size
from test_attention import BS, D, H, case, run


def test_every_product_batches_the_kv_heads():
    """The lowered 1,024-token prefill (8 query blocks of 128, those with UNMASKED_MIN_KEYS keys or more before
    them split in two products) has 2 products per block plus 2 per split block, each batched over the KV heads
    (before: H times as many, each without a batch axis)."""
    t = 1024
    args, _ = case([0], t, seed=1, rows=t // BS + 8)
    text = jax.jit(lambda *a: paged_attention(*a, scale=1 / np.sqrt(D), impl="xla")).lower(*args).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    qb = query_block_size(t)
    starts = range(0, t, qb)
    assert len(dots) == 2 * len(starts) + 2 * sum(s >= UNMASKED_MIN_KEYS for s in starts), len(dots)
    for line in dots:
        assert "batching_dims = [0] x [0]" in line, line
        assert re.search(rf"-> tensor<{H}x\d+x\d+xf32>", line), line


def test_several_blocks_with_context_equal_reference():
    """Blocks on either side of UNMASKED_MIN_KEYS with a cached context folded in, against float64."""
    args, expected = case([7], 650, seed=3, rows=650 // BS + 20, table_width=4)
    np.testing.assert_allclose(run("xla", *args), expected, rtol=2e-5, atol=2e-5)
