"""Writes into the KV cache, with XLA:CPU's bfloat16 scatter worked around.

XLA:CPU has no bfloat16 (or float16) scatter: its float-normalization pass turns one into a convert of the whole
operand to float32, a float32 scatter and a convert of the whole result back. For the paged KV cache that is the
whole cache twice per layer per step: a ``tiny`` decode step at batch 2 took 154.6 ms in bfloat16 against 1.19 ms in
float32 (Intel Xeon, 2 cores, quiet; a profile put 90% of it in those converts). On CPU the same bits are scattered
as ``uint16`` instead, an integer scatter with no normalization. XLA:CPU still copies the cache once at each
bitcast (into ``uint16`` at the first write of a program, back at its end), so a step pays two copies per cache
array instead of two converts per layer (4x less in the ``tiny`` step; the copies would go if the cache were kept as
``uint16`` between programs, not done). GPU and TPU scatter bfloat16 natively and keep the plain scatter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def scatters_as_bits(dtype) -> bool:
    """Whether a scatter into an array of ``dtype`` goes through its bits here: a 16-bit float on the CPU backend."""
    dtype = jnp.dtype(dtype)
    return dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating) and jax.default_backend() == "cpu"


def set_at(array: jax.Array, index, values: jax.Array, **scatter_kwargs) -> jax.Array:
    """``array.at[index].set(values.astype(array.dtype), **scatter_kwargs)``, scattered as bits where
    ``scatters_as_bits`` says so (the same result, bit for bit)."""
    values = values.astype(array.dtype)
    if not scatters_as_bits(array.dtype):
        return array.at[index].set(values, **scatter_kwargs)
    bits = jax.lax.bitcast_convert_type(array, jnp.uint16)
    new = jax.lax.bitcast_convert_type(values, jnp.uint16)
    return jax.lax.bitcast_convert_type(bits.at[index].set(new, **scatter_kwargs), array.dtype)
