"""The one-sequence prefill's local causal part masks only each query block's diagonal keys: the keys before the
block are folded into its softmax unmasked (a second product and an online-softmax update), so no select runs over
the block's scores against them (on a 2-core AMD EPYC the 12-layer attention of a 2,048-token prefill took 11%
less CPU time; docs/benchmarks/engine.md, AMD EPYC prefill, eighteenth pass). Results against the float64
reference of test_attention.py, and the program's selects no wider than a query block."""

import re

import jax
import numpy as np
import pytest

from mooncake_jax.model.attention import paged_attention, query_block_size
from test_attention import BS, D, case, run


@pytest.mark.parametrize("ctx_lens, t", [([0], 300), ([0], 129), ([5], 260)])
def test_several_query_blocks_equal_reference(ctx_lens, t):
    """Blocks after the first fold their earlier keys unmasked; the last block is partial (300, 129 tokens)."""
    args, expected = case(ctx_lens, t, seed=t, rows=160, table_width=4 if ctx_lens[0] else None)
    np.testing.assert_allclose(run("xla", *args), expected, rtol=2e-5, atol=2e-5)


def test_no_select_wider_than_a_query_block():
    """Every select of the lowered 512-token prefill (4 query blocks of 128) is at most a block's keys wide: the
    causal mask of a block covers its diagonal keys only (before: [rows, end] selects, up to 512 keys wide)."""
    t = 512
    args, _ = case([0], t, seed=1, rows=t // BS + 8)
    text = jax.jit(lambda *a: paged_attention(*a, scale=1 / np.sqrt(D), impl="xla")).lower(*args).as_text()
    widths = [int(m.group(1)) for m in re.finditer(r"stablehlo\.select .*tensor<\d+x(\d+)xf32>", text)]
    assert widths, "no select found: the pattern no longer matches the lowered text"
    assert max(widths) <= query_block_size(t), widths
