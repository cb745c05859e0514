"""The stored and transmitted form of a block: a fixed header (identity, length, checksum) then the raw data.

The same bytes live in the DRAM tier, in the SSD tier's files and in the Messenger's streamed pieces, so a block
is checksummed once when it enters a pool and verified wherever it is read, with no re-encoding between tiers or
instances. The header names the block's key and spec, so a frame filed under the wrong key or produced for
another model is rejected instead of decoded.

Header (64 bytes, little-endian): magic ``MKVB``, format version (u16), header length (u16), spec fingerprint
(u64), key (u64), data length (u64), checksum total (u64), checksum weighted (u64), zero padding.
"""

from __future__ import annotations

import struct

import numpy as np

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.checksum import checksum
from mooncake_jax.transfer.spec import BlockSpec

MAGIC = b"MKVB"
VERSION = 1
HEADER_BYTES = 64  # a cache line; keeps the data 8-byte aligned inside the frame
_HEADER = struct.Struct("<4sHHQQQQQ")
_MAX_KEY = (1 << 64) - 1


class CorruptBlockError(ValueError):
    """A frame that fails its checks: it must be treated as a miss, never served."""


def check_key(key: object) -> BlockKey:
    """``key`` as a block key (an int in [0, 2**64)), or ValueError."""
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
        raise ValueError(f"block key must be an int, got {type(key).__name__}")
    key = int(key)
    if not 0 <= key <= _MAX_KEY:
        raise ValueError(f"block key must be in [0, 2**64), got {key}")
    return key


def frame_bytes(spec: BlockSpec) -> int:
    """Size of every frame of ``spec``."""
    return HEADER_BYTES + spec.nbytes


def encode(spec: BlockSpec, key: BlockKey, block: np.ndarray) -> bytes:
    """The frame of ``block`` (already checked against ``spec``) under ``key``."""
    data = memoryview(block.reshape(-1).view(np.uint8))
    total, weighted = checksum(block)
    header = _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, spec.fingerprint, key, spec.nbytes, total, weighted)
    return b"".join((header, bytes(HEADER_BYTES - _HEADER.size), data))


def decode(spec: BlockSpec, key: BlockKey, frame: bytes) -> np.ndarray:
    """The block in ``frame`` as a read-only array sharing its memory; CorruptBlockError if any check fails."""
    if len(frame) != frame_bytes(spec):
        raise CorruptBlockError(f"block {key:#018x}: frame is {len(frame)} bytes, expected {frame_bytes(spec)}")
    magic, version, header_len, fingerprint, stored_key, n_bytes, total, weighted = _HEADER.unpack_from(frame)
    if magic != MAGIC or version != VERSION or header_len != HEADER_BYTES:
        raise CorruptBlockError(f"block {key:#018x}: not a block frame (magic {magic!r}, version {version})")
    if fingerprint != spec.fingerprint:
        raise CorruptBlockError(f"block {key:#018x}: frame was written for another block spec than {spec.describe()}")
    if stored_key != key:
        raise CorruptBlockError(f"block {key:#018x}: frame holds block {stored_key:#018x}")
    if n_bytes != spec.nbytes:
        raise CorruptBlockError(f"block {key:#018x}: header says {n_bytes} data bytes, spec has {spec.nbytes}")
    data = memoryview(frame)[HEADER_BYTES:]
    if checksum(data) != (total, weighted):
        raise CorruptBlockError(f"block {key:#018x}: checksum mismatch")
    return np.frombuffer(frame, dtype=spec.dtype, offset=HEADER_BYTES).reshape(spec.shape)
