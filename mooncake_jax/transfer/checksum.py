"""The checksum of a block's bytes: XXH3-128 from the maintained ``xxhash`` package.

XXH3 runs at about 12 GB/s on one core here, faster than the copies a put or a get makes, so verifying every read
costs little; zlib.crc32 (about 7 GB/s) and blake2b (about 1.4 GB/s) would cap the pool. Unlike the additive sums
this module used before, a 128-bit hash also catches changes that cancel in a sum (words permuted inside one
sector, a bit set in one word and cleared in another). With the exact length kept in the frame header this
catches truncated or zero-filled files, stale, swapped or misplaced sectors and bit rot. It guards against
accidents, not adversaries (it is not a MAC).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import xxhash

from mooncake_jax.transfer.stream_copy import address, streaming_copy

LOW_WORD = (1 << 64) - 1
Digest = tuple[int, int]
"""``(high, low)`` 64-bit words of a 128-bit XXH3 digest, what the frame header stores (``split_digest``)."""


def split_digest(digest: int) -> tuple[int, int]:
    """A 128-bit XXH3 digest as the ``(high, low)`` 64-bit words the frame header stores."""
    return digest >> 64, digest & LOW_WORD


def checksum(data: memoryview | bytes | np.ndarray) -> tuple[int, int]:
    """The XXH3-128 digest of ``data``'s bytes as ``(high, low)`` 64-bit words (what the frame header stores)."""
    if isinstance(data, np.ndarray):
        data = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    digest = xxhash.xxh3_128_intdigest(data)
    return split_digest(digest)


COPY_CHUNK_BYTES = 1 << 20
"""Bytes landed then hashed at a time by ``fill_with_checksum`` (unless told another step: an SSD read's
``preadv`` takes ``shard_reader.READ_STEP_BYTES``) and by ``copy_with_checksum`` without streaming stores: small enough that the chunk is still in the core's L2 cache (2 MiB
on the machines measured) when it is hashed, large enough that Python's per-chunk cost is noise."""


def fill_with_checksum(out: np.ndarray, fill: Callable[[np.ndarray, int], bool],
                       step: int = COPY_CHUNK_BYTES) -> tuple[int, int] | None:
    """Fill ``out`` (flat uint8) ``step`` bytes at a time, ``fill(chunk, start)`` writing
    ``out[start:start + chunk.size]``, each chunk hashed from cache right after it lands: one pass over memory
    instead of two. The checksum of the bytes, or None as soon as ``fill`` says a chunk did not land whole."""
    n = out.size
    if n <= step:  # one chunk: no streaming state to set up
        return split_digest(xxhash.xxh3_128_intdigest(out)) if fill(out, 0) else None
    hasher = xxhash.xxh3_128()
    for start in range(0, n, step):
        chunk = out[start : start + step]
        if not fill(chunk, start):
            return None
        hasher.update(chunk)
    return split_digest(hasher.intdigest())


STREAM_CHUNK_BYTES = 512 << 10
"""Bytes copied by streaming stores then hashed at a time by ``copy_with_checksum``: the source chunk is still in
the core's L2 cache when it is hashed; 256-512 KiB measured fastest for a 160 MiB block (Python's per-chunk cost
shows below, the hash misses L2 above)."""


def copy_with_checksum(dst: np.ndarray, src: np.ndarray, stream: bool = True, dst_address: int | None = None,
                       src_address: int | None = None) -> tuple[int, int]:
    """Copy ``src`` into ``dst`` (flat uint8 arrays of one length) and return the checksum of the bytes copied, in
    one pass over each, so a put or a verified get costs little more than the copy itself. ``stream``: ``dst`` is
    written with streaming stores (``stream_copy.py``: no read of ``dst``'s old lines, and ``dst`` not left in
    the cache), chunk by chunk, each source chunk hashed from cache right after it was copied; else (or where the
    streaming copy cannot be built) copied by ``np.copyto`` and each copied chunk hashed from cache.
    ``dst_address`` / ``src_address``: where ``dst`` / ``src`` lie, if the caller knows (a slot's is looked up once,
    as numpy's lookup costs a few microseconds a call)."""
    copy = streaming_copy() if stream else None
    if copy is None:
        return _cached_copy_with_checksum(dst, src)
    n = src.nbytes
    if dst.nbytes != n or dst.dtype != np.uint8 or src.dtype != np.uint8:
        raise ValueError(f"copy of {src.nbytes} bytes ({src.dtype}) into {dst.nbytes} bytes ({dst.dtype}): "
                         "expected two flat uint8 arrays of one length")
    if not (dst.flags.c_contiguous and src.flags.c_contiguous and dst.flags.writeable):
        raise ValueError("copy_with_checksum needs C-contiguous arrays and a writable destination")
    src = src.reshape(-1)  # a view: sliced by bytes below
    to = address(dst) if dst_address is None else dst_address
    origin = address(src) if src_address is None else src_address
    if n <= STREAM_CHUNK_BYTES:  # one chunk (a 16-token block): no streaming hash state to set up
        copy(to, origin, n)
        return split_digest(xxhash.xxh3_128_intdigest(src))
    hasher = xxhash.xxh3_128()
    for start in range(0, n, STREAM_CHUNK_BYTES):
        size = min(STREAM_CHUNK_BYTES, n - start)
        copy(to + start, origin + start, size)
        hasher.update(src[start : start + size])
    return split_digest(hasher.intdigest())


def _cached_copy_with_checksum(dst: np.ndarray, src: np.ndarray) -> tuple[int, int]:
    if src.size <= COPY_CHUNK_BYTES:  # one chunk (a 16-token block): no closure, no call through fill
        np.copyto(dst, src)
        return split_digest(xxhash.xxh3_128_intdigest(dst))

    def copy(chunk: np.ndarray, start: int) -> bool:
        np.copyto(chunk, src[start : start + chunk.size])
        return True

    return fill_with_checksum(dst, copy)
