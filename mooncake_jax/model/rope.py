"""Rotary position embeddings, with the Llama-3 frequency scaling.

Uses the "rotate half" layout of Hugging Face's LLaMA (the first half of each head's dimensions pairs with the
second half), so HF checkpoints load without permuting q/k projection rows.
"""

from __future__ import annotations

import math

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


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq) -> jnp.ndarray:
    """Rotate ``x`` [..., T, heads, head_dim] by ``positions`` [..., T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [..., T, hd/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
