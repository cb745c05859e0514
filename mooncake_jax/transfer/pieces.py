"""Cutting a frame into streamed pieces, encoding them for the wire, and putting frames back together.

gRPC caps a message (4 MiB by default, and a 70B model's block is 160 MiB), so a frame travels as ``BlockPiece``
messages of at most ``CHUNK_BYTES`` of data. Pieces are encoded here by hand rather than by building protobuf
objects: building and serialising a 1.5 MiB ``BlockPiece`` with the upb runtime runs at about 0.9 GB/s (its arena
takes fresh pages for every message), slower than the loopback link, while joining a 20-byte header to a slice of
the frame runs at memory speed. The bytes are exactly what protobuf would produce (a test checks it).

The assembler accepts pieces only in order and of the one frame size the pool's spec allows, so a confused or
hostile peer cannot make it buffer more than one frame, and a block whose pieces stop coming is never handed on.
"""

from __future__ import annotations

from collections.abc import Iterator

from mooncake_jax.blocks import BlockKey
from mooncake_jax.proto import CHUNK_BYTES


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_piece(
    key: BlockKey, offset: int, frame_bytes: int, data: bytes | memoryview, spec_fingerprint: int = 0
) -> bytes:
    """Wire bytes of ``BlockPiece{key, offset, frame_bytes, data, spec_fingerprint}`` (proto3: zeros omitted)."""
    fields = [b"\x08", _varint(key)] if key else []
    if offset:
        fields += [b"\x10", _varint(offset)]
    if frame_bytes:
        fields += [b"\x18", _varint(frame_bytes)]
    if len(data):
        fields += [b"\x22", _varint(len(data)), data]
    if spec_fingerprint:
        fields += [b"\x28", _varint(spec_fingerprint)]
    return b"".join(fields)


def piece_bytes_for(frame_bytes: int, limit: int = CHUNK_BYTES) -> int:
    """Data bytes per piece of a frame: as few pieces as ``limit`` allows, of near-equal size."""
    n_pieces = max(1, -(-frame_bytes // limit))
    return -(-frame_bytes // n_pieces)


def encoded_pieces(key: BlockKey, frame: bytes, spec_fingerprint: int = 0, limit: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The encoded pieces of ``frame``; the first carries ``spec_fingerprint`` (pushes announce their spec)."""
    size = piece_bytes_for(len(frame), limit)
    view = memoryview(frame)
    for offset in range(0, len(frame), size):
        yield encode_piece(key, offset, len(frame), view[offset : offset + size], spec_fingerprint if not offset else 0)


class FrameAssembler:
    """Rebuilds frames of exactly ``frame_bytes`` from in-order pieces, one block at a time.

    A frame in several pieces is gathered into one buffer reused for every block of the transfer: a fresh
    multi-MiB object per block would take fresh pages from the kernel each time (glibc maps allocations of that
    size anew), which measured slower than the network. The frame returned is that buffer, valid until the next
    ``add``; the pool copies what it stores.
    """

    def __init__(self, frame_bytes: int) -> None:
        self.frame_bytes = frame_bytes
        self.pending_key: BlockKey | None = None
        self._buffer: bytearray | None = None
        self._received = 0

    def add(self, key: BlockKey, offset: int, frame_bytes: int, data: bytes) -> bytes | bytearray | None:
        """Take one piece; returns the whole frame when this piece completes it. ValueError if inconsistent."""
        if frame_bytes != self.frame_bytes:
            raise ValueError(
                f"block {key:#018x}: frame of {frame_bytes} bytes, this pool's blocks take {self.frame_bytes}"
            )
        if self.pending_key is not None and key != self.pending_key:
            raise ValueError(f"block {key:#018x} started before block {self.pending_key:#018x} was complete")
        if offset != self._received:
            raise ValueError(f"block {key:#018x}: piece at offset {offset}, expected {self._received}")
        end = offset + len(data)
        if not data or end > frame_bytes:
            raise ValueError(f"block {key:#018x}: piece of {len(data)} bytes at {offset} does not fit the frame")
        if offset == 0 and end == frame_bytes:
            return data  # a frame in one piece: no copy
        if self._buffer is None:
            self._buffer = bytearray(frame_bytes)
        self._buffer[offset:end] = data
        self.pending_key, self._received = key, end
        if end < frame_bytes:
            return None
        self.pending_key, self._received = None, 0
        return self._buffer
