"""XXH3-128 called through ``ctypes``: the hash of a record read at once on the two-thread way of an SSD get.

Why it was bound (twentieth pass): the ``xxhash`` package's call was taken to hold the GIL while it hashes (two
threads hashing 64 MiB each took twice the wall of one, on a machine whose second core was seldom free), so an SSD
get read on two threads (``shard_reader.read_many``) would have its hashes taken in turn; a call through
``ctypes.CDLL`` releases the GIL for its duration, whatever the size. In fact the installed package (xxhash 4.1,
its ``_xxhash.c``) releases the GIL in both ``xxh3_128_intdigest`` and ``xxh3_128().update`` for buffers over 64
KiB (``XXHASH_GIL_MINSIZE``), and holds it at 64 KiB and under: beside a 256 MiB ``xxh3_128_intdigest`` on another
thread the caller ran 550-710 loop iterations a millisecond, beside a GIL-holding C call 7-17 (review of the
twentieth pass). So for the 384 KiB records the binding's gain in that pass's pool get (10.7-11.1 GB/s against
9.1-9.4 with the package's call, boosted, 25 rounds) is not the GIL's release, and what it is was not found; at
load 4.7 with no core free the package's call read as fast (6.84 against 6.62 GB/s, 0.099 against 0.104 CPU s/GB,
30 alternated rounds). The binding is kept until a quiet A/B says whether it can go; it does release the GIL for
records of 64 KiB and under, where the package holds it.

``XXH3_128bits_dispatch`` is the export that picks the vector code for this CPU (AVX2 on the AMD EPYC measured:
0.023 CPU s/GB of a 384 KiB record from L2, as the package's own call); the plain ``XXH3_128bits`` export is the
scalar build (0.042), so it is not used. A call costs about 0.7 us more than the package's (``ctypes`` argument
conversion and the returned struct): 1-2% of a 384 KiB record's read and hash, paid only where the GIL's release
buys something (the two-thread way of a batch read, for records read at once; a large record's 256 KiB steps are
hashed by the package's ``update``, which releases the GIL itself over 64 KiB: ``shard_reader.read_with_checksum``).

Where the export is missing (another build of ``xxhash``) or gives another digest than the package on a test
string, ``hash_at`` is None (one log line: INFO where the export is missing, as on builds for other CPUs than
x86-64 that have no dispatch, a WARNING where it disagrees) and callers hash with the package: the same digest,
the GIL held at 64 KiB and under.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import numpy as np
import xxhash

from mooncake_jax.transfer.checksum import Digest
from mooncake_jax.transfer.stream_copy import address


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


def _bind() -> _Library | None:
    log = logging.getLogger(__name__)
    try:
        from xxhash import _xxhash

        library = _Library(ctypes.CDLL(_xxhash.__file__))
    except Exception as err:  # noqa: BLE001 - optional: another build (aarch64, Windows) has no such export
        log.info("XXH3-128 without the GIL unavailable (%s); hashing with the GIL held", err)
        return None
    sample = np.frombuffer(bytes(range(256)) * 5 + b"tail", np.uint8)  # over XXH3's 240-byte short path
    got = library.oneshot(address(sample), sample.size)
    if (got.high64 << 64 | got.low64) != xxhash.xxh3_128_intdigest(sample):
        log.warning("XXH3-128 without the GIL unavailable (the exported XXH3-128 disagrees with xxhash.xxh3_128); "
                    "hashing with the GIL held")
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
