"""A 128-bit checksum of a block's bytes that runs at memory speed.

zlib.crc32 runs at about 7 GB/s here and blake2b at about 1.4 GB/s, slower than the copies a put or a get makes,
so they would cap the pool well below memcpy. This checksum is two wrapping 64-bit sums computed by numpy in one
pass over the data (about 30 GB/s):

* ``total``: the sum of the little-endian 64-bit words. Any change confined to one word changes it, so a flipped
  byte or bit is always caught.
* ``weighted``: the sum over 4 KiB rows of (2k + 1) * (sum of row k). The odd weights are invertible mod 2**64,
  so a change inside one row changes it too, and rows (disk pages) that are swapped, repeated or lost are
  caught, which a plain sum misses.

Together with the exact length kept in the frame header this catches truncated or zero-filled files (a write cut
short), stale pages and bit rot. What it can miss is a deliberate pair of compensating edits within one row; it
guards against accidents, not adversaries.
"""

from __future__ import annotations

import numpy as np

_ROW_WORDS = 512  # 4 KiB rows: the page size, the granularity at which storage loses or reorders data


def checksum(data: memoryview | bytes | np.ndarray) -> tuple[int, int]:
    """``(total, weighted)`` of ``data``'s bytes (see the module docstring)."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1).view(np.uint8)
    n_words = raw.size // 8
    words = raw[: n_words * 8].view("<u8")
    n_rows = n_words // _ROW_WORDS
    row_sums = np.empty(n_rows + 1, dtype=np.uint64)
    words[: n_rows * _ROW_WORDS].reshape(n_rows, _ROW_WORDS).sum(axis=1, dtype=np.uint64, out=row_sums[:n_rows])
    last = int(words[n_rows * _ROW_WORDS :].sum(dtype=np.uint64))
    tail = raw[n_words * 8 :]
    if tail.size:  # the bytes after the last full word, as one zero-padded word
        last += int.from_bytes(tail.tobytes(), "little")
    row_sums[n_rows] = last & 0xFFFF_FFFF_FFFF_FFFF
    weights = np.arange(1, 2 * (n_rows + 1), 2, dtype=np.uint64)
    with np.errstate(over="ignore"):
        total = int(row_sums.sum(dtype=np.uint64))
        weighted = int((row_sums * weights).sum(dtype=np.uint64))
    return total, weighted
