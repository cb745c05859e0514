"""KV-cache writes through ``kv_scatter.set_at``: bit for bit the plain scatter, in every dtype, and for 16-bit
floats on CPU without the whole-cache converts XLA:CPU's float normalization puts around a bfloat16 scatter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mooncake_jax.model.attention import write_pages
from mooncake_jax.model.kv_scatter import scatters_as_bits, set_at


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_write_pages_is_the_plain_scatter_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    pages = jnp.asarray(rng.standard_normal((2, 9, 4, 8)), dtype)  # [H, rows, bs, D]
    new = jnp.asarray(rng.standard_normal((3, 2, 2, 8)), jnp.float32)  # [B, T, H, D], cast on write
    slots = jnp.asarray([[5, 6], [17, 30], [0, 1]], jnp.int32)  # rows 1, 4, 7 and the scratch row
    got = jax.jit(write_pages)(pages, new, slots)
    expected = np.asarray(pages).copy()
    for b in range(3):
        for t in range(2):
            row, offset = divmod(int(slots[b, t]), 4)
            expected[:, row, offset] = np.asarray(new[b, t].astype(dtype))
    assert got.dtype == dtype
    assert np.asarray(got).view(np.uint8).tobytes() == expected.view(np.uint8).tobytes()


def test_bitcast_path_chosen_only_for_16_bit_floats_on_cpu():
    on_cpu = jax.default_backend() == "cpu"
    assert scatters_as_bits(jnp.bfloat16) == on_cpu and scatters_as_bits(jnp.float16) == on_cpu
    assert not scatters_as_bits(jnp.float32) and not scatters_as_bits(jnp.int16)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's float normalization")
def test_a_bfloat16_write_converts_nothing_of_the_cache_size():
    """The compiled write holds no convert of a cache-sized array (the plain bfloat16 scatter holds two)."""
    pages = jnp.zeros((2, 64, 16, 8), jnp.bfloat16)
    new, index = jnp.ones((2, 3, 8), jnp.bfloat16), (slice(None), jnp.asarray([1, 2, 3]), jnp.asarray([0, 5, 9]))

    def converts(fn) -> int:
        hlo = jax.jit(fn).lower(pages, new).compile().as_text()
        return sum(1 for line in hlo.splitlines() if " convert(" in line and "[2,64,16,8]" in line)

    assert converts(lambda p, n: p.at[index].set(n)) >= 1  # the reference: what XLA:CPU does without the workaround
    assert converts(lambda p, n: set_at(p, index, n)) == 0
