"""Token sampling on device: greedy, temperature and top-p (nucleus), reproducible from a seed.

Each sequence's random key is derived from (its seed, the index of the token being generated), never from a
shared stream, so a sequence samples the same tokens alone or in any batch, in any engine or instance.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

GREEDY, SAMPLE, TOP_P = "greedy", "sample", "top_p"
"""Static sampling modes of a batch: the cheapest one that covers every sequence in it is compiled."""


class SamplingInputs(NamedTuple):
    temperature: jax.Array  # [B] float32; 0 means greedy for that row
    top_p: jax.Array  # [B] float32 in (0, 1]
    seed: jax.Array  # [B] uint32
    step: jax.Array  # [B] int32, index of the token being generated


def batch_mode(temperatures, top_ps) -> str:
    if all(t == 0 for t in temperatures):
        return GREEDY
    return TOP_P if any(p < 1.0 for t, p in zip(temperatures, top_ps) if t > 0) else SAMPLE


def _row_keys(seed, step):
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seed, step)


def _top_p_mask(scaled: jax.Array, top_p: jax.Array) -> jax.Array:
    """Scaled logits with every token outside the smallest set of mass >= top_p set to -inf."""
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = mass_before < top_p[:, None]  # the first token is always kept
    threshold = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits: jax.Array, inputs: SamplingInputs, mode: str) -> jax.Array:
    """Next token [B] int32 from float32 logits [B, V]."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == GREEDY:
        return greedy
    temp = jnp.where(inputs.temperature > 0, inputs.temperature, 1.0)
    scaled = logits / temp[:, None]
    if mode == TOP_P:
        scaled = _top_p_mask(scaled, inputs.top_p)
    keys = _row_keys(inputs.seed, inputs.step)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(inputs.temperature > 0, drawn, greedy)
