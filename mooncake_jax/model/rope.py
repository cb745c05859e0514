"""Rotary position embeddings, with the Llama-3 frequency scaling.

Uses the "rotate half" layout of Hugging Face's LLaMA (the first half of each head's dimensions pairs with the
second half), so HF checkpoints load without permuting q/k projection rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Per-pair rotation frequencies [head_dim / 2] (float64 on the host; a compile-time constant)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    s = cfg.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


MATERIALISED_TABLE_MIN_TOKENS = 128
"""From this many positions per sequence on, ``apply_rope`` materialises its cos/sin table once (``_cos_sin``). Below it (decode
steps, short chunks) the table is computed inside the rotation's fusion as before: the step's programs stay as
they were where the table is tiny."""


def _cos_sin(angles: jnp.ndarray):
    """cos and sin of ``angles`` [..., T, hd/2], each computed once per (position, frequency) for long steps.

    XLA:CPU fuses cos and sin into the rotation's loop fusion, which evaluates them once per *output* element: per
    head, for q and for k, in every layer (a 2,048-token ``small`` prefill: 25M cos+sin pairs where 65k are
    distinct; 2-3% of the prefill's thread time on a 2-core AMD EPYC). Elementwise producers are duplicated into
    consumers whatever their cost, and ``optimization_barrier`` is expanded before fusion on CPU, so the table is
    passed through a product with the identity: a dot is never fused into a loop fusion, its result is
    materialised once (the layers' identical tables are merged by CSE), and multiplying by an exact 1 and adding
    exact zeros changes no bit (docs/benchmarks/engine.md, AMD EPYC prefill, twenty-first pass).
    """
    cs = jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)
    n = angles.shape[-1]
    if angles.shape[-2] >= MATERIALISED_TABLE_MIN_TOKENS:
        cs = jnp.dot(cs, jnp.eye(2 * n, dtype=cs.dtype), precision=jax.lax.Precision.HIGHEST)
    return cs[..., :n], cs[..., n:]


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq) -> jnp.ndarray:
    """Rotate ``x`` [..., T, heads, head_dim] by ``positions`` [..., T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [..., T, hd/2]
    cos, sin = _cos_sin(angles)
    cos, sin = cos[..., None, :], sin[..., None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
