"""The stored and transmitted form of a block: a record, which is a frame behind a fixed wire prefix.

A **frame** is a fixed header (identity, length, checksum) then the raw data. A **record** is that frame behind
the 64-byte protobuf encoding of a ``BlockPiece`` carrying it whole (key, frame length, spec fingerprint, zero
padding to a fixed size, then the tag and length of the ``data`` field), so a record *is* the wire message of a
one-piece transfer. The same bytes live in the DRAM tier's slots, in the SSD tier's slot file and on the wire: a
block is checksummed once when it enters a pool and verified wherever it is read, and a record moves between tiers and
instances with no re-encoding (the Messenger sends the bytes a tier read returned, and stores the bytes gRPC
handed it). Frames too large for one message travel in pieces and are reassembled into a record (``pieces.py``).

The frame header names the block's key and spec, so a frame filed under the wrong key or produced for another
model is rejected instead of decoded, and the prefix of a stored record must be exactly the one its key and spec
give, so a damaged prefix is never sent on.

Frame header (64 bytes, little-endian): magic ``MKVB``, format version (u16), header length (u16), spec
fingerprint (u64), key (u64), data length (u64), checksum (XXH3-128 as two u64), zero padding.
The data starts 128 bytes into a record, so it keeps the alignment of the buffer holding the record.

Format versions: 1 had an additive checksum; 2 has XXH3-128. A record of another version is not damage: reading
one raises ``StaleFormatError`` (a ``CorruptBlockError``, so it is never served), and the pool drops it as stale
with one log line instead of counting it as corrupt.
"""

from __future__ import annotations

import struct

import numpy as np

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.checksum import checksum
from mooncake_jax.transfer.spec import BlockSpec

MAGIC = b"MKVB"
VERSION = 2
HEADER_BYTES = 64  # a cache line; keeps the data aligned inside the frame
PREFIX_BYTES = 64  # the record's wire prefix
DATA_OFFSET = PREFIX_BYTES + HEADER_BYTES  # where a block's data starts in its record
_HEADER = struct.Struct("<4sHHQQQQQ")
_HEADER_PADDING = bytes(HEADER_BYTES - _HEADER.size)
DIGEST_WORDS = struct.Struct("<QQ")  # the header's last two fields: the data's checksum, high then low
DIGEST_IN_HEAD = slice(PREFIX_BYTES + _HEADER.size - DIGEST_WORDS.size, PREFIX_BYTES + _HEADER.size)
"""Where a record head holds its data's checksum: a tier that knows a head is sound compares only these bytes
(``digest_bytes``) with the checksum of data it just read."""


def digest_bytes(digest: tuple[int, int]) -> bytes:
    """``(high, low)`` as a record head stores it (``DIGEST_IN_HEAD``)."""
    return DIGEST_WORDS.pack(*digest)
MAX_KEY = (1 << 64) - 1

# BlockPiece field tags (field number << 3 | wire type): see messenger.proto
TAG_KEY, TAG_OFFSET, TAG_FRAME_BYTES, TAG_DATA, TAG_SPEC, TAG_PADDING = 0x08, 0x10, 0x18, 0x22, 0x28, 0x32
TAG_NEXT = 0x3A  # BlockPiece.next: the further pieces of a message carrying several (pieces.py)


class CorruptBlockError(ValueError):
    """A frame that fails its checks: it must be treated as a miss, never served."""


class StaleFormatError(CorruptBlockError):
    """A sound frame of another format version (written by an older or newer build): dropped, not corruption."""

    def __init__(self, message: str, version: int):
        super().__init__(message)
        self.version = version


def check_key(key: object) -> BlockKey:
    """``key`` as a block key (an int in [0, 2**64)), or ValueError."""
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
        raise ValueError(f"block key must be an int, got {type(key).__name__}")
    key = int(key)
    if not 0 <= key <= MAX_KEY:
        raise ValueError(f"block key must be in [0, 2**64), got {key}")
    return key


def varint(value: int) -> bytes:
    """Protobuf base-128 encoding of an unsigned integer."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def frame_bytes(spec: BlockSpec) -> int:
    """Size of every frame of ``spec``."""
    return HEADER_BYTES + spec.nbytes


def record_bytes(spec: BlockSpec) -> int:
    """Size of every stored record of ``spec``: what a block takes in a tier."""
    return PREFIX_BYTES + frame_bytes(spec)


_TAILS: dict[int, tuple[bytes, ...]] = {}  # by spec fingerprint: hashing a BlockSpec hashes its numpy dtype


def _prefix_tails(spec: BlockSpec) -> tuple[bytes, ...]:
    """What follows the key in a record prefix, by the key's varint length (1 to 10 bytes)."""
    tails = _TAILS.get(spec.fingerprint)
    if tails is None:
        tails = _TAILS[spec.fingerprint] = _make_prefix_tails(spec)
    return tails


def _make_prefix_tails(spec: BlockSpec) -> tuple[bytes, ...]:
    n_frame = frame_bytes(spec)
    fields = bytes((TAG_FRAME_BYTES,)) + varint(n_frame) + bytes((TAG_SPEC,)) + varint(spec.fingerprint)
    data_field = bytes((TAG_DATA,)) + varint(n_frame)
    tails = []
    for key_len in range(11):
        pad = PREFIX_BYTES - 1 - key_len - len(fields) - len(data_field) - 2  # 2: the padding field's tag, length
        tails.append(b"".join((fields, bytes((TAG_PADDING, pad)), bytes(pad), data_field)))
    return tuple(tails)


def record_prefix(spec: BlockSpec, key: BlockKey) -> bytes:
    """The 64-byte wire prefix of ``key``'s record: ``BlockPiece{key, frame_bytes, spec_fingerprint, padding}``
    then the tag and length of ``data``, which is the frame that follows (offset 0 is proto3's default)."""
    key_field = varint(key)
    return b"\x08" + key_field + _prefix_tails(spec)[len(key_field)]


def record_head(spec: BlockSpec, key: BlockKey, digest: tuple[int, int]) -> bytes:
    """The first ``DATA_OFFSET`` bytes of ``key``'s record (wire prefix and frame header) for data of checksum
    ``digest``: a tier writes these beside the data, which it copies or writes straight from the caller's array."""
    header = _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, spec.fingerprint, key, spec.nbytes, *digest)
    return b"".join((record_prefix(spec, key), header, _HEADER_PADDING))


def data_bytes(block: np.ndarray) -> np.ndarray:
    """A C-contiguous block's bytes as a flat uint8 view (no copy)."""
    return block.reshape(-1).view(np.uint8)


def encode(spec: BlockSpec, key: BlockKey, block: np.ndarray) -> bytes:
    """The record of ``block`` (already checked against ``spec``) under ``key``."""
    data = data_bytes(block)
    return b"".join((record_head(spec, key, checksum(data)), memoryview(data)))


def check_head(spec: BlockSpec, key: BlockKey, head: bytes | bytearray | memoryview) -> tuple[int, int]:
    """The checksum ``key``'s record head promises for its data; CorruptBlockError (StaleFormatError for another
    format version) unless ``head`` is exactly the head of ``key``'s record for ``spec``."""
    if len(head) != DATA_OFFSET:
        raise CorruptBlockError(f"block {key:#018x}: record head is {len(head)} bytes, expected {DATA_OFFSET}")
    if head[:PREFIX_BYTES] != record_prefix(spec, key):
        raise CorruptBlockError(f"block {key:#018x}: damaged or foreign wire prefix")
    return _check_header(spec, key, memoryview(head)[PREFIX_BYTES:])


def _check_header(spec: BlockSpec, key: BlockKey, frame: memoryview) -> tuple[int, int]:
    magic, version, header_len, fingerprint, stored_key, n_bytes, high, low = _HEADER.unpack_from(frame)
    if magic == MAGIC and version != VERSION:
        raise StaleFormatError(f"block {key:#018x}: record format version {version}, this build reads {VERSION}",
                               version)
    if magic != MAGIC or header_len != HEADER_BYTES:
        raise CorruptBlockError(f"block {key:#018x}: not a block frame (magic {bytes(magic)!r})")
    if fingerprint != spec.fingerprint:
        raise CorruptBlockError(f"block {key:#018x}: frame was written for another block spec than {spec.describe()}")
    if stored_key != key:
        raise CorruptBlockError(f"block {key:#018x}: frame holds block {stored_key:#018x}")
    if n_bytes != spec.nbytes:
        raise CorruptBlockError(f"block {key:#018x}: header says {n_bytes} data bytes, spec has {spec.nbytes}")
    return high, low


def check_digest(key: BlockKey, expected: tuple[int, int], found: tuple[int, int]) -> None:
    """CorruptBlockError unless the data's checksum ``found`` is the one its head promised."""
    if found != expected:
        raise CorruptBlockError(f"block {key:#018x}: checksum mismatch")


def verify_frame(spec: BlockSpec, key: BlockKey, frame: bytes | bytearray | memoryview) -> None:
    """CorruptBlockError unless ``frame`` is ``key``'s frame for ``spec`` with a matching checksum."""
    if len(frame) != frame_bytes(spec):
        raise CorruptBlockError(f"block {key:#018x}: frame is {len(frame)} bytes, expected {frame_bytes(spec)}")
    check_digest(key, _check_header(spec, key, memoryview(frame)), checksum(memoryview(frame)[HEADER_BYTES:]))


def verify(spec: BlockSpec, key: BlockKey, record: bytes | bytearray) -> None:
    """CorruptBlockError unless ``record`` is exactly ``key``'s record for ``spec``, checksum included."""
    if len(record) != record_bytes(spec):
        raise CorruptBlockError(f"block {key:#018x}: record is {len(record)} bytes, expected {record_bytes(spec)}")
    if record[:PREFIX_BYTES] != record_prefix(spec, key):
        raise CorruptBlockError(f"block {key:#018x}: damaged or foreign wire prefix")
    verify_frame(spec, key, memoryview(record)[PREFIX_BYTES:])


def decode(spec: BlockSpec, key: BlockKey, record: bytes) -> np.ndarray:
    """The block in ``record`` as a read-only array sharing its memory; CorruptBlockError if any check fails."""
    verify(spec, key, record)
    return np.frombuffer(record, dtype=spec.dtype, offset=DATA_OFFSET).reshape(spec.shape)
