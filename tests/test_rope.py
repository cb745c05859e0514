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


def _rope_layers(x, ws, positions, inv):
    """q and k of a few 'layers' rotated with the same positions, as the model does per layer."""
    out = 0.0
    for w in ws:
        y = (x @ w).reshape(x.shape[0], x.shape[1], -1, 16)
        out = out + apply_rope(y, positions, inv).sum() + apply_rope(y[..., :2, :], positions, inv).sum()
    return out


def test_long_steps_compute_the_cos_sin_table_once():
    """From MATERIALISED_TABLE_MIN_TOKENS positions on the table is materialised once for every rotation of the
    program (one cosine and one sine in the optimized HLO); XLA:CPU otherwise fuses cos/sin into each rotation and
    evaluates them per head and element. Short steps keep the fused form."""
    import re

    import jax

    from mooncake_jax.model.rope import MATERIALISED_TABLE_MIN_TOKENS

    inv = tuple((1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)).tolist())
    rng = np.random.default_rng(2)
    ws = [jnp.asarray(rng.standard_normal((32, 64)), jnp.float32) for _ in range(3)]

    def transcendental_ops(t):
        x = jnp.asarray(rng.standard_normal((1, t, 32)), jnp.float32)
        positions = jnp.arange(t, dtype=jnp.int32)[None]
        text = jax.jit(_rope_layers, static_argnums=3).lower(x, ws, positions, inv).compile().as_text()
        return len(re.findall(r" cosine\(", text)), len(re.findall(r" sine\(", text))

    assert transcendental_ops(MATERIALISED_TABLE_MIN_TOKENS) == (1, 1)
    assert transcendental_ops(MATERIALISED_TABLE_MIN_TOKENS // 2)[0] > 1  # the fused form: once per rotation


@pytest.mark.parametrize("offset", [0, 3000])
def test_materialised_table_matches_the_float64_reference(offset):
    from mooncake_jax.model.rope import MATERIALISED_TABLE_MIN_TOKENS

    rng = np.random.default_rng(3)
    t, hd = MATERIALISED_TABLE_MIN_TOKENS + 45, 64
    x = rng.standard_normal((1, t, 3, hd)).astype(np.float32)
    positions = offset + np.arange(t)[None, :]
    inv = 1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions, jnp.int32), tuple(inv.tolist())))
    tol = 1e-5 + 4e-8 * (offset + t)
    np.testing.assert_allclose(got, reference(x, positions, inv), rtol=0, atol=tol * math.sqrt(hd))
