"""A 128-bit checksum of a block's bytes that runs at memory speed.

zlib.crc32 runs at about 7 GB/s here and blake2b at about 1.4 GB/s, slower than the copies a put or a get makes,
so either would cap the pool well below memcpy. This checksum is two wrapping 64-bit sums that numpy computes in
one pass over the data (about 25 GB/s):

* ``total``: the sum of the little-endian 64-bit words. Any change confined to one word changes it, so a flipped
  bit or byte is always caught.
* ``weighted``: the sum over 512-byte rows (a disk sector) of (2k + 1) * (sum of row k). The odd weights are
  invertible mod 2**64, so a change inside one row changes it too, and sectors that are swapped, repeated,
  shifted or lost are caught, which a plain sum misses.

With the exact length kept in the frame header this catches truncated or zero-filled files (a write cut short),
stale or misplaced sectors and single-bit rot. Its holes, like any additive checksum's: changes inside one sector
that cancel in the sum (words permuted, or the same bit set in one word and cleared in another; a CRC would
catch the latter) and edits made on purpose. It guards against accidents, not adversaries.
"""

from __future__ import annotations

import numpy as np

_ROW_WORDS = 64  # 512-byte rows: the smallest unit storage writes, loses or misplaces


def checksum(data: memoryview | bytes | np.ndarray) -> tuple[int, int]:
    """``(total, weighted)`` of ``data``'s bytes (see the module docstring)."""
    raw = data.reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    n_words = raw.size // 8
    words = raw[: n_words * 8].view("<u8")
    n_rows = n_words // _ROW_WORDS
    row_sums = np.empty(n_rows + 1, dtype=np.uint64)
    np.einsum("ij->i", words[: n_rows * _ROW_WORDS].reshape(n_rows, _ROW_WORDS), out=row_sums[:n_rows])
    last = int(words[n_rows * _ROW_WORDS :].sum(dtype=np.uint64))
    tail = raw[n_words * 8 :]
    if tail.size:  # the bytes after the last full word, as one zero-padded word
        last += int.from_bytes(tail.tobytes(), "little")
    row_sums[n_rows] = last & 0xFFFF_FFFF_FFFF_FFFF
    weights = np.arange(1, 2 * (n_rows + 1), 2, dtype=np.uint64)
    total = int(row_sums.sum(dtype=np.uint64))
    weighted = int(np.einsum("i,i->", row_sums, weights))
    return total, weighted
