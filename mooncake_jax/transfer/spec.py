"""The fixed shape and dtype of every block in a pool.

A pool holds blocks of exactly one spec (the engine's ``(num_layers, 2, block_size, num_kv_heads, head_dim)``,
index 0 = K, 1 = V), so a block's byte size is known without reading it: capacities in bytes become capacities
in blocks, and a peer sending a block of another size is rejected before a byte of it is buffered.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

_EXTENDED_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
"""dtypes numpy only knows once ``ml_dtypes`` is imported (it comes with JAX; the pool does not import JAX)."""


def resolve_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype from a dtype, a type or a name, including ``"bfloat16"`` via ml_dtypes."""
    if isinstance(dtype, str) and dtype in _EXTENDED_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, dtype))
    try:
        return np.dtype(dtype)
    except TypeError as err:
        raise ValueError(f"not a dtype: {dtype!r}") from err


@dataclass(frozen=True)
class BlockSpec:
    """Shape and dtype of one block (all layers' K and V for ``block_size`` tokens)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def __init__(self, shape: tuple[int, ...] | list[int], dtype: Any) -> None:
        try:
            dims = tuple(int(d) for d in shape)
        except TypeError as err:
            raise ValueError(f"shape must be a sequence of ints, got {shape!r}") from err
        if not dims or any(d < 1 for d in dims):
            raise ValueError(f"shape must be non-empty with every dimension >= 1, got {dims}")
        resolved = resolve_dtype(dtype)
        if resolved.hasobject or resolved.itemsize == 0:
            raise ValueError(f"dtype must be a fixed-size numeric type, got {resolved}")
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "dtype", resolved)

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of one block's data (cached: it is asked for once per block stored or read)."""
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        """Human-readable form used in error messages, e.g. ``bfloat16[4, 2, 16, 2, 64]``."""
        return f"{self.dtype.name}[{', '.join(map(str, self.shape))}]"

    @functools.cached_property
    def fingerprint(self) -> int:
        """64-bit identity of the spec, written into every frame so blocks of another spec are never decoded."""
        digest = hashlib.blake2b(self.describe().encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    def check(self, block: Any, what: str = "block") -> np.ndarray:
        """``block`` as a C-contiguous array of this spec, or ValueError saying how it differs."""
        if not isinstance(block, np.ndarray):
            raise ValueError(f"{what} must be a numpy array of {self.describe()}, got {type(block).__name__}")
        if block.shape != self.shape or block.dtype != self.dtype:
            raise ValueError(f"{what} is {block.dtype.name}{list(block.shape)}, the pool holds {self.describe()}")
        return np.ascontiguousarray(block)

    def to_json(self) -> str:
        return json.dumps({"shape": list(self.shape), "dtype": self.dtype.name})

    @classmethod
    def from_json(cls, text: str) -> BlockSpec:
        try:
            fields = json.loads(text)
            return cls(fields["shape"], fields["dtype"])
        except (KeyError, TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"not a block spec: {text[:200]!r}") from err
