"""The KV cache's storage dtype: on CPU a 16-bit float cache lives as 16-bit integers between programs.

XLA:CPU has no bfloat16 (or float16) scatter: its float-normalization pass turns one into a convert of the whole
operand to float32, a float32 scatter and a convert of the whole result back. For the paged KV cache that was the
whole cache twice per layer per step: a ``tiny`` decode step at batch 2 took 154.6 ms in bfloat16 against 1.19 ms in
float32 (Intel Xeon, 2 cores, quiet). Scattering the same bits as ``uint16`` inside the program (the ninth pass)
brought it to 39.8 ms, but XLA:CPU compiles a ``bitcast_convert_type`` of a whole array to a copy, and a program
over a bfloat16 cache had one at its entry (into ``uint16``, before the first write) and one at its exit (back), per
cache array: two whole-cache copies per array per step (checked in the compiled HLO: the per-layer bitcasts between
writes cancel, those two do not, and donation does not alias through them).

So on CPU the cache arrays themselves are stored in a 16-bit integer dtype (``storage_dtype``): ``uint16`` for a
bfloat16 cache, ``int16`` for a float16 one, so the stored dtype alone says which float the bits are
(``logical_dtype``). Inside the programs, writers scatter bits into the stored array (``set_at``) and readers gather
first and bitcast only what they gathered (``as_logical``); nothing copies the whole cache. Outside the programs
everything sees the logical dtype: ``read_blocks`` / ``read_layer`` return it, ``write_blocks`` take it, and the
runners' ``kv`` are ``LogicalPages`` views (dtype, shape, sharding, host values) of the stored arrays. GPU and TPU
scatter 16-bit floats natively and keep them as they are (``storage_dtype`` is the identity there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_BITS_OF = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16), jnp.dtype(jnp.float16): jnp.dtype(jnp.int16)}
_FLOAT_OF = {bits: flt for flt, bits in _BITS_OF.items()}


def scatters_as_bits(dtype) -> bool:
    """Whether a scatter into an array of ``dtype`` goes through its bits here: a 16-bit float on the CPU backend."""
    return jnp.dtype(dtype) in _BITS_OF and jax.default_backend() == "cpu"


def storage_dtype(dtype) -> np.dtype:
    """The dtype a KV cache of logical ``dtype`` is stored in on this backend (see the module docstring)."""
    dtype = jnp.dtype(dtype)
    if dtype.kind in "iub":
        raise ValueError(f"KV cache dtype {dtype.name!r} is not a float dtype; allowed: float32, bfloat16, float16")
    return _BITS_OF[dtype] if scatters_as_bits(dtype) else dtype


def logical_dtype(dtype) -> np.dtype:
    """The float dtype of the values in a cache array stored as ``dtype`` (the inverse of ``storage_dtype``)."""
    dtype = jnp.dtype(dtype)
    return _FLOAT_OF.get(dtype, dtype)


def as_logical(array: jax.Array) -> jax.Array:
    """``array`` (a stored cache array, or part of one) as its logical float values, bit for bit. Inside a program
    apply it after a gather, to the gathered part only: on XLA:CPU a bitcast of a whole cache copies it."""
    dtype = logical_dtype(array.dtype)
    return array if dtype == array.dtype else jax.lax.bitcast_convert_type(array, dtype)


def set_at(array: jax.Array, index, values: jax.Array, **scatter_kwargs) -> jax.Array:
    """``array.at[index].set(values, **scatter_kwargs)`` with ``values`` cast to the array's logical dtype: for a
    stored 16-bit cache their bits are scattered into it; a 16-bit float array on CPU is scattered through its bits
    (the same result, bit for bit, without XLA:CPU's whole-array converts)."""
    logical = logical_dtype(array.dtype)
    values = values.astype(logical)
    if logical != array.dtype:  # a stored cache: scatter the bits, nothing else
        return array.at[index].set(jax.lax.bitcast_convert_type(values, array.dtype), **scatter_kwargs)
    if not scatters_as_bits(array.dtype):
        return array.at[index].set(values, **scatter_kwargs)
    bits_dtype = _BITS_OF[jnp.dtype(array.dtype)]
    bits = jax.lax.bitcast_convert_type(array, bits_dtype)
    new = jax.lax.bitcast_convert_type(values, bits_dtype)
    return jax.lax.bitcast_convert_type(bits.at[index].set(new, **scatter_kwargs), array.dtype)


class LogicalPages:
    """A stored cache array as code outside the step programs sees it: its logical ``dtype``, its ``shape`` and
    ``sharding`` (those of the stored array), its values on the host (``np.asarray``: a view of the stored bits,
    no copy on CPU) and as a JAX array (``jnp.asarray``: a bitcast, which copies). ``storage`` is the array itself.
    """

    __slots__ = ("storage",)

    def __init__(self, storage: jax.Array):
        self.storage = storage

    @property
    def dtype(self) -> np.dtype:
        return logical_dtype(self.storage.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.storage.shape

    @property
    def ndim(self) -> int:
        return self.storage.ndim

    @property
    def sharding(self):
        return self.storage.sharding

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    def __array__(self, dtype=None, copy=None):
        values = np.asarray(self.storage).view(self.dtype)
        return values if dtype is None else values.astype(dtype)

    def __jax_array__(self):
        return as_logical(self.storage)

    def __repr__(self) -> str:
        return f"LogicalPages({self.dtype.name}{list(self.shape)}, stored as {self.storage.dtype.name})"


def logical_pages(kv: tuple[jax.Array, jax.Array]) -> tuple[LogicalPages, LogicalPages]:
    """A stage's stored (K, V) arrays as ``LogicalPages``."""
    return LogicalPages(kv[0]), LogicalPages(kv[1])
