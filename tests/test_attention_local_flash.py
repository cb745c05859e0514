"""The xla implementation's fully looped prefill (``attention._local_flash``: a scan over query blocks, a loop over
the key tiles below each block's diagonal, the context folded per block) against the float64 reference of
test_attention.py. Most cases shrink the tile to 8 tokens (and take the looped form at every length) so that T crosses many tiles cheaply; prompt lengths
are not tile multiples (the padded tail), shorter than one tile, and 2048 tokens at the default tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mooncake_jax.model.attention as attention
from test_attention import BS, D, case, run
from test_attention_prefill import BF16_TOL

TILE = 8


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(attention, "LOCAL_TILE_TOKENS", TILE)
    monkeypatch.setattr(attention, "LOOPED_MIN_TOKENS", 2)  # every prefill takes the looped form
    monkeypatch.setattr(attention, "PREFILL_CONTEXT_CHUNK_TOKENS", 2 * BS)  # contexts take several iterations


@pytest.mark.parametrize("ctx_lens, t", [
    ([0], 5),  # shorter than one tile: one block, no loop
    ([0], 8),  # exactly one tile
    ([0], 13),  # two blocks, the second padded (3 padded keys after every real query)
    ([0], 37),  # five blocks
    ([21], 13),  # context of 6 pages (last partial) folded into each of the blocks
    ([22], 24),  # three full blocks after a context ending mid-page
])
def test_one_sequence_equals_reference(small_tiles, ctx_lens, t):
    args, expected = case(ctx_lens, t, seed=t + ctx_lens[0], rows=40, table_width=8)
    out = run("xla", *args)
    assert out.shape == expected.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("ctx_lens, t", [([21, 0, 9], 13), ([0, 0], 20), ([3, 17], 5)])
def test_batched_equals_reference(small_tiles, ctx_lens, t):
    args, expected = case(ctx_lens, t, seed=sum(ctx_lens) + t, rows=60, table_width=8)
    np.testing.assert_allclose(run("xla", *args), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("ctx_lens", [[21], [22, 23]])
def test_padded_pages_past_the_context_are_never_read(small_tiles, ctx_lens):
    """Every block folds the context: none of them may read the NaN pages past the last chunk needed."""
    args, expected = case(ctx_lens, 13, seed=3, rows=60, table_width=16, pad_page=59)
    out = run("xla", *args)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("ctx_lens, t", [([21], 13), ([21, 0, 9], 11)])
def test_bfloat16(small_tiles, ctx_lens, t):
    args, expected = case(ctx_lens, t, seed=11, rows=60, table_width=8, dtype=jnp.bfloat16)
    out = run("xla", *args)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=BF16_TOL, atol=BF16_TOL)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (XLA_FLAGS in conftest.py)")
@pytest.mark.parametrize("ctx_lens, t", [([21], 13), ([21, 0, 9], 11)])
def test_split_over_the_tensor_axis(small_tiles, ctx_lens, t):
    """kv heads and the cache's axis 0 sharded over 2 devices, as tensor parallelism lays them out."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    (q, k_new, v_new, k_pages, v_pages, batch), expected = case(ctx_lens, t, seed=12, rows=60, table_width=8)
    heads, pages = NamedSharding(mesh, P(None, None, "tensor")), NamedSharding(mesh, P("tensor"))
    q, k_new, v_new = (jax.device_put(x, heads) for x in (q, k_new, v_new))
    k_pages, v_pages = (jax.device_put(x, pages) for x in (k_pages, v_pages))
    with jax.set_mesh(mesh):
        out = run("xla", q, k_new, v_new, k_pages, v_pages, batch)
    np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("ctx_lens", [[0], [37]])
def test_2048_tokens_at_the_default_tile(ctx_lens):
    """The hf_compare prompt length: 8 blocks of 256 tokens, each folding up to 7 key tiles (and the context)."""
    assert attention.LOCAL_TILE_TOKENS == 256 and attention.LOOPED_MIN_TOKENS <= 2048
    args, expected = case(ctx_lens, 2048, seed=20, rows=540, table_width=16)
    np.testing.assert_allclose(run("xla", *args), expected, rtol=2e-5, atol=2e-5)


def _dots(t: int) -> int:
    """Dot instructions in the lowered program of one sequence's t-token prefill (no context)."""
    from test_attention import G, H

    f32, i32 = (lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)), (lambda *s: jax.ShapeDtypeStruct(s, jnp.int32))
    pages = f32(H, 4 + t // BS, BS, D)
    batch = attention.PagedBatch(i32(1, 0), i32(1), i32(1, t))
    f = jax.jit(lambda *a: attention.paged_attention(*a, scale=1 / np.sqrt(D), impl="xla"))
    return f.lower(f32(1, t, H, G, D), f32(1, t, H, D), f32(1, t, H, D), pages, pages, batch).as_text().count(
        "stablehlo.dot_general")


def test_program_size_is_flat_in_the_prompt_length():
    """The point of the looped form: 4x the tokens, the same products in the program (the unrolled form has one
    product pair per (head, query block): 8 blocks of 128 at 1024 tokens, 16 of 256 at 4096)."""
    assert attention.LOOPED_MIN_TOKENS <= 1024
    assert _dots(1024) == _dots(4096) > 0


def test_short_chunks_stay_unrolled():
    """Below ``LOOPED_MIN_TOKENS`` the unrolled form runs (faster there): its products grow with the blocks."""
    assert attention.LOOPED_MIN_TOKENS > 512
    assert _dots(512) == 2 * _dots(256) > 0


def test_no_copy_of_the_cache_in_the_compiled_prefill(monkeypatch):
    """The looped prefill reads the cache only through gathers of context chunks: no instruction of the compiled
    program produces a cache-sized array (a per-head slice of the cache inside the loop did: XLA:CPU materialised
    1/H of the whole cache per head and query block)."""
    import re

    from test_attention import G, H

    monkeypatch.setattr(attention, "LOOPED_MIN_TOKENS", 2)
    rows = 997  # a size no other operand has
    f32, i32 = (lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)), (lambda *s: jax.ShapeDtypeStruct(s, jnp.int32))
    pages = f32(H, rows, BS, D)
    f = jax.jit(lambda *a: attention.paged_attention(*a, scale=1 / np.sqrt(D), impl="xla"))
    for b, t in ((1, 600), (2, 300)):
        batch = attention.PagedBatch(i32(b, 64), i32(b), i32(b, t))
        hlo = f.lower(f32(b, t, H, G, D), f32(b, t, H, D), f32(b, t, H, D), pages, pages, batch).compile().as_text()
        sized = [line for line in hlo.splitlines() if re.search(rf"= f32\[[\d,]*\b{rows}\b", line)]
        copies = [line for line in sized if not re.search(r"\b(parameter|get-tuple-element|bitcast)\(", line)]
        assert sized and not copies, copies[:3]
