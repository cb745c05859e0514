"""The one-sequence prefill's local causal part masks only each query block's diagonal keys: the keys before the
block are folded into its softmax unmasked (a second product and an online-softmax update) once they are
``UNMASKED_MIN_KEYS`` or more, so no select runs over the block's scores against them (docs/benchmarks/engine.md,
AMD EPYC prefill, eighteenth pass). Results against the float64 reference of test_attention.py, and the
program's selects no wider than the threshold."""

import re

import jax
import numpy as np
import pytest

from mooncake_jax.model.attention import UNMASKED_MIN_KEYS, paged_attention
from test_attention import BS, D, case, run


@pytest.mark.parametrize("ctx_lens, t", [([0], 300), ([0], 129), ([5], 260), ([0], 700), ([9], 600)])
def test_several_query_blocks_equal_reference(ctx_lens, t):
    """Blocks with ``UNMASKED_MIN_KEYS`` keys or more before them fold those unmasked (700 and 600 tokens: query
    blocks of 128, the last one partial), the others mask all their keys."""
    args, expected = case(ctx_lens, t, seed=t, rows=t // BS + 16, table_width=4 if ctx_lens[0] else None)
    np.testing.assert_allclose(run("xla", *args), expected, rtol=2e-5, atol=2e-5)


def test_no_select_wider_than_the_unmasked_threshold():
    """Every select of the lowered 1,024-token prefill (8 query blocks of 128) is at most ``UNMASKED_MIN_KEYS``
    keys wide: a block with that many keys before it masks its diagonal keys only (before: [rows, end] selects, up
    to 1,024 keys wide)."""
    t = 1024
    args, _ = case([0], t, seed=1, rows=t // BS + 8)
    text = jax.jit(lambda *a: paged_attention(*a, scale=1 / np.sqrt(D), impl="xla")).lower(*args).as_text()
    widths = [int(m.group(1)) for m in re.finditer(r"stablehlo\.select .*tensor<\d+x(\d+)xf32>", text)]
    assert widths, "no select found: the pattern no longer matches the lowered text"
    assert max(widths) <= UNMASKED_MIN_KEYS < t, widths
