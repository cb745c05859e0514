"""XXH3-128 called through ``ctypes``, so that the hash runs without the GIL.

Why: the ``xxhash`` package's ``xxh3_128_intdigest`` and ``xxh3_128().update`` hold the GIL while they hash (two
threads hashing 64 MiB each took twice the wall of one), so an SSD get read on two threads (``shard_reader.
read_many``) had its hashes taken in turn however many cores were free: only the ``preadv``s overlapped. The
package's extension module exports the C library's functions, and a call through ``ctypes.CDLL`` releases the GIL
for its duration, so two threads can hash at once, or one hash while the other reads.

``XXH3_128bits_dispatch`` (and ``XXH3_128bits_update_dispatch``) are the exports that pick the vector code for this
CPU (AVX2 on the AMD EPYC measured: 0.023 CPU s/GB of a 384 KiB record from L2, as the package's own call); the
plain ``XXH3_128bits`` export is the scalar build (0.042), so it is not used. A call costs about 0.7 us more than
the package's (``ctypes`` argument conversion and the returned struct): 1-2% of a 384 KiB record's read and hash,
paid only where the GIL's release buys something (the two-thread way of a batch read).

Where the exports are missing (another build of ``xxhash``) or give another digest than the package on a test
string, ``hash_at`` and ``Hasher`` are None (one log line) and callers hash with the package: the same digest,
with the GIL held.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

import numpy as np
import xxhash

Digest = tuple[int, int]
"""``(high, low)`` 64-bit words of a 128-bit digest, what the frame header stores (``checksum.split_digest``)."""


class _Hash128(ctypes.Structure):
    """``XXH128_hash_t``, returned by value."""

    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


HashAt = Callable[[int, int], Digest]
"""``hash_at(address, n_bytes)``: the digest of ``n_bytes`` of memory the caller keeps alive during the call."""


class _Library:
    """The bound exports (built once, by ``_bind``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.oneshot = lib.XXH3_128bits_dispatch
        self.oneshot.restype = _Hash128
        self.oneshot.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        self.create = lib.XXH3_createState
        self.create.restype = ctypes.c_void_p
        self.create.argtypes = ()
        self.free = lib.XXH3_freeState
        self.free.restype = ctypes.c_int
        self.free.argtypes = (ctypes.c_void_p,)
        self.reset = lib.XXH3_128bits_reset
        self.reset.restype = ctypes.c_int
        self.reset.argtypes = (ctypes.c_void_p,)
        self.update = lib.XXH3_128bits_update_dispatch
        self.update.restype = ctypes.c_int
        self.update.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
        self.digest = lib.XXH3_128bits_digest
        self.digest.restype = _Hash128
        self.digest.argtypes = (ctypes.c_void_p,)


def _bind() -> _Library | None:
    try:
        from xxhash import _xxhash

        library = _Library(ctypes.CDLL(_xxhash.__file__))
        sample = np.frombuffer(bytes(range(256)) * 5 + b"tail", np.uint8)  # over XXH3's 240-byte short path
        at = sample.__array_interface__["data"][0]
        expected = xxhash.xxh3_128_intdigest(sample)
        got = library.oneshot(at, sample.size)
        state = library.create()
        if not state:
            raise MemoryError("XXH3_createState returned NULL")
        try:
            library.reset(state)
            library.update(state, at, 100)
            library.update(state, at + 100, sample.size - 100)
            streamed = library.digest(state)
        finally:
            library.free(state)
        for digest in (got, streamed):
            if (digest.high64 << 64 | digest.low64) != expected:
                raise RuntimeError("the exported XXH3-128 disagrees with xxhash.xxh3_128")
    except Exception as err:  # noqa: BLE001 - optional: the package's hash gives the same digest, with the GIL
        logging.getLogger(__name__).warning("XXH3-128 without the GIL unavailable (%s); hashing with the GIL held",
                                            err)
        return None
    return library


_LIBRARY = _bind()


def _make_hash_at(library: _Library) -> HashAt:
    oneshot = library.oneshot

    def hash_at(address: int, n: int) -> Digest:
        digest = oneshot(address, n)
        return digest.high64, digest.low64

    return hash_at


hash_at: HashAt | None = _make_hash_at(_LIBRARY) if _LIBRARY is not None else None
"""The one-shot hash without the GIL, or None where the exports cannot be used."""


class _NativeHasher:
    """A streaming XXH3-128 over memory by address, without the GIL: ``reset``, ``update`` step by step,
    ``digest``. Its state is allocated by the library (aligned as it needs) and freed with this object."""

    def __init__(self) -> None:
        self._library = _LIBRARY
        self._state = self._library.create()
        if not self._state:
            raise MemoryError("XXH3_createState returned NULL")
        self._library.reset(self._state)

    def reset(self) -> None:
        self._library.reset(self._state)

    def update(self, address: int, n: int) -> None:
        self._library.update(self._state, address, n)

    def digest(self) -> Digest:
        digest = self._library.digest(self._state)
        return digest.high64, digest.low64

    def __del__(self) -> None:
        state, self._state = getattr(self, "_state", None), None
        if state:
            self._library.free(state)


Hasher = _NativeHasher if _LIBRARY is not None else None
"""The streaming hash without the GIL (a class), or None where the exports cannot be used."""

_hashers = threading.local()


def thread_hasher() -> _NativeHasher:
    """This thread's ``Hasher``, reset (one state per thread, made on first use). Only where ``Hasher`` is not
    None."""
    hasher = getattr(_hashers, "hasher", None)
    if hasher is None:
        hasher = _hashers.hasher = _NativeHasher()
    else:
        hasher.reset()
    return hasher
