"""The xla implementation's prefill (T > 1) paths against the float64 reference of test_attention.py: the context
folded in chunk by chunk (a while loop up to the real ctx_len over a power-of-two padded page table), merged with
the causal local part; single sequence and batched, float32 and bfloat16, and split over a tensor axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mooncake_jax.model.attention as attention
from test_attention import BS, case, run

CHUNK = 2 * BS  # context tokens per loop iteration in these tests: 2 pages


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(attention, "PREFILL_CONTEXT_CHUNK_TOKENS", CHUNK)


@pytest.mark.parametrize("ctx_lens, t", [
    ([21], 5),  # 6 pages of context (the last one partial): 3 loop iterations
    ([22], 9),  # context ends mid-page and mid-chunk; new tokens cross pages
    ([0], 7),  # context 0 under a non-empty (all padding) table: no iteration
    ([21, 0, 9], 6),  # batched: one sequence without context, lengths neither page nor chunk multiples
    ([3, 17], 4),
])
def test_prefill_context_loop_equals_reference(small_chunks, ctx_lens, t):
    args, expected = case(ctx_lens, t, seed=sum(ctx_lens) + t, rows=40, table_width=8)
    np.testing.assert_allclose(run("xla", *args), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("ctx_lens, t", [([13], 300), ([13, 0], 260)])
def test_several_query_blocks_fold_the_context(small_chunks, ctx_lens, t):
    """Past 128 new tokens the local part runs in query blocks (the last one partial here): each block's state
    takes the context's chunks."""
    args, expected = case(ctx_lens, t, seed=9, rows=160, table_width=4)
    np.testing.assert_allclose(run("xla", *args), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("ctx_lens", [[21], [22, 23]])
def test_padded_pages_past_the_context_are_never_read(small_chunks, ctx_lens):
    """The padded table's pages past the last chunk any sequence needs point at a row of NaN: the old whole-table
    gather multiplied them by weight 0 (NaN); the loop must not read them at all."""
    args, expected = case(ctx_lens, 5, seed=3, rows=40, table_width=16, pad_page=39)
    out = run("xla", *args)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


def test_one_chunk_covers_a_short_table():
    """With the default chunk (512 tokens) longer than the table, the loop reads the table once."""
    args, expected = case([13, 6], 5, seed=4, rows=40, table_width=4)
    np.testing.assert_allclose(run("xla", *args), expected, rtol=2e-5, atol=2e-5)


BF16_TOL = 3e-2
"""bfloat16 inputs and weights (8 mantissa bits, relative rounding 2^-9 per value): the reference sees the same
rounded inputs, the error left is the seam's own bfloat16 rounding of q * scale and of the softmax weights before
the weighted sum. A wrong merge of the chunks or parts is off by O(1)."""


@pytest.mark.parametrize("ctx_lens, t", [([21], 6), ([21, 0, 9], 5)])
def test_prefill_context_loop_bfloat16(small_chunks, ctx_lens, t):
    args, expected = case(ctx_lens, t, seed=11, rows=40, table_width=8, dtype=jnp.bfloat16)
    out = run("xla", *args)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=BF16_TOL, atol=BF16_TOL)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS in conftest.py)")
@pytest.mark.parametrize("ctx_lens, t", [([21], 6), ([21, 0, 9], 5)])
def test_prefill_context_loop_split_over_the_tensor_axis(small_chunks, ctx_lens, t):
    """kv heads (and the cache's axis 0) sharded over 2 devices, as tensor parallelism lays them out: GSPMD
    partitions the loop; the result still equals the reference."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    (q, k_new, v_new, k_pages, v_pages, batch), expected = case(ctx_lens, t, seed=12, rows=40, table_width=8)
    heads, pages = NamedSharding(mesh, P(None, None, "tensor")), NamedSharding(mesh, P("tensor"))
    q, k_new, v_new = (jax.device_put(x, heads) for x in (q, k_new, v_new))
    k_pages, v_pages = (jax.device_put(x, pages) for x in (k_pages, v_pages))
    with jax.set_mesh(mesh):
        out = run("xla", q, k_new, v_new, k_pages, v_pages, batch)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)
