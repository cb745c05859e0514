"""``rope.apply_rope`` against Hugging Face's rotate-half formula computed in float64 (``reference_model``'s form):
the rotation written as a swap of the two halves must rotate the same pairs by the same angles, at any batch rank,
for large positions, and with the Llama-3 frequency scaling."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from mooncake_jax.model.config import PRESETS
from mooncake_jax.model.rope import apply_rope, inverse_frequencies


def reference(x, positions, inv):
    """HF LLaMA's ``q * cos + rotate_half(q) * sin`` in float64; x [..., T, heads, hd], positions [..., T]."""
    x = np.asarray(x, np.float64)
    ang = np.asarray(positions, np.float64)[..., None] * np.asarray(inv, np.float64)  # [..., T, hd/2]
    cos = np.cos(np.concatenate([ang, ang], -1))[..., None, :]
    sin = np.sin(np.concatenate([ang, ang], -1))[..., None, :]
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


@pytest.mark.parametrize("shape,offset", [((1, 37, 3, 16), 0), ((2, 5, 4, 64), 4000), ((3, 1, 2, 8), 123)])
def test_apply_rope_matches_the_float64_rotate_half_reference(shape, offset):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    b, t, _, hd = shape
    positions = offset + np.arange(t)[None, :] + 7 * np.arange(b)[:, None]
    inv = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions, jnp.int32), tuple(inv.tolist())))
    want = reference(x, positions, inv)
    # float32 angles: position * frequency rounds at ~6e-8 relative, i.e. ~2.5e-4 rad at position 4,000
    tol = 1e-5 + 4e-8 * (offset + t + 7 * b)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * math.sqrt(hd))
    assert not np.allclose(got, x, atol=1e-3)  # the rotation did rotate


def test_apply_rope_with_llama3_scaling_and_bfloat16_input():
    cfg = next(c for c in PRESETS.values() if c.rope_scaling is not None)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 9, 2, cfg.head_dim)).astype(np.float32)
    positions = np.arange(100, 109)[None]
    inv = inverse_frequencies(cfg)
    got = apply_rope(jnp.asarray(x, jnp.bfloat16), jnp.asarray(positions, jnp.int32), tuple(inv.tolist()))
    assert got.dtype == jnp.bfloat16
    want = reference(np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)), positions, inv)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=1e-2, atol=1e-2)
