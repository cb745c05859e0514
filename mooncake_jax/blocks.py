"""Block keys: the one prefix-chained hash every part of the system uses.

A prompt is cut into blocks of ``block_size`` tokens. Block i's key is a hash of (key of block i-1, tokens of
block i), so two prompts share their first k keys exactly when they share their first k * block_size tokens.
The prefix a cache can serve is therefore the number of *leading* keys it holds, which is what the Conductor,
the pool, the instances and the simulator all compute. Only full blocks get keys; a trailing partial block is
always recomputed.

Keys are unsigned 64-bit integers (hashable, cheap to compare, one protobuf ``uint64``), never strings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Container, Iterable, Sequence

import numpy as np

BlockKey = int
ROOT_KEY: BlockKey = 0
"""The parent of a prompt's first block (an empty prefix)."""

_KEY_BYTES = 8


def block_keys(tokens: Sequence[int] | np.ndarray, block_size: int, parent: BlockKey = ROOT_KEY) -> list[BlockKey]:
    """Keys of the full blocks of ``tokens``, chained from ``parent``.

    ``parent`` lets a caller extend a known prefix: ``block_keys(b, bs, parent=block_keys(a, bs)[-1])`` equals
    the tail of ``block_keys(a + b, bs)`` when ``len(a)`` is a multiple of ``bs``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    n_blocks = arr.size // block_size
    data = memoryview(arr[: n_blocks * block_size].astype("<i4", copy=False).tobytes())
    stride = block_size * 4
    keys: list[BlockKey] = []
    prev = int(parent).to_bytes(_KEY_BYTES, "little")
    blake = hashlib.blake2b
    for i in range(n_blocks):
        prev = blake(prev + data[i * stride : (i + 1) * stride], digest_size=_KEY_BYTES).digest()
        keys.append(int.from_bytes(prev, "little"))
    return keys


def tail_key(tokens: Sequence[int] | np.ndarray, block_size: int, parent: BlockKey = ROOT_KEY) -> BlockKey | None:
    """Key of the trailing partial block of ``tokens`` (None when the length is a multiple of ``block_size``).

    Used only to move a request's last, partial block of KV (prefill -> decode); it hashes fewer tokens than a
    full block, so it can never equal a full block's key and never enters anyone's prefix match.
    """
    arr = np.asarray(tokens)
    n_full = (arr.size // block_size) * block_size
    if n_full == arr.size:
        return None
    parent = block_keys(arr[:n_full], block_size, parent)[-1] if n_full else parent
    data = int(parent).to_bytes(_KEY_BYTES, "little") + arr[n_full:].astype("<i4").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=_KEY_BYTES).digest(), "little")


def prefix_match(keys: Iterable[BlockKey], holds: Container[BlockKey] | Callable[[BlockKey], bool]) -> int:
    """Number of leading ``keys`` that ``holds`` contains (a set, a dict, a pool, or a predicate)."""
    test = holds if callable(holds) and not isinstance(holds, Container) else holds.__contains__
    n = 0
    for key in keys:
        if not test(key):
            break
        n += 1
    return n


def num_blocks(n_tokens: int, block_size: int) -> int:
    """Blocks (the last one possibly partial) that ``n_tokens`` occupy."""
    return -(-n_tokens // block_size)
