"""Cutting a frame into streamed pieces and putting it back together, refusing anything inconsistent.

gRPC caps a message (4 MiB by default, and a 70B model's block is 160 MiB), so a frame travels as pieces of at
most ``CHUNK_BYTES``. The assembler accepts pieces only in order, of the one frame size the pool's spec allows,
so a confused or hostile peer cannot make it buffer more than one frame, and a block whose pieces stop coming is
never handed on.
"""

from __future__ import annotations

from collections.abc import Iterator

from mooncake_jax.blocks import BlockKey
from mooncake_jax.proto import CHUNK_BYTES


def split(frame: bytes, piece_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, bytes]]:
    """``(offset, data)`` pieces of ``frame``, as few as the limit allows and of near-equal size."""
    n_pieces = max(1, -(-len(frame) // piece_bytes))
    if n_pieces == 1:
        yield 0, frame  # no copy
        return
    size = -(-len(frame) // n_pieces)
    for offset in range(0, len(frame), size):
        yield offset, frame[offset : offset + size]


class FrameAssembler:
    """Rebuilds frames of exactly ``frame_bytes`` from in-order pieces, one block at a time."""

    def __init__(self, frame_bytes: int) -> None:
        self.frame_bytes = frame_bytes
        self.pending_key: BlockKey | None = None
        self._pieces: list[bytes] = []
        self._received = 0

    def add(self, key: BlockKey, offset: int, frame_bytes: int, data: bytes) -> bytes | None:
        """Take one piece; returns the whole frame when this piece completes it. ValueError if inconsistent."""
        if frame_bytes != self.frame_bytes:
            raise ValueError(f"block {key:#018x}: frame of {frame_bytes} bytes, this pool's blocks take {self.frame_bytes}")
        if self.pending_key is not None and key != self.pending_key:
            raise ValueError(f"block {key:#018x} started before block {self.pending_key:#018x} was complete")
        if offset != self._received:
            raise ValueError(f"block {key:#018x}: piece at offset {offset}, expected {self._received}")
        if not data or self._received + len(data) > frame_bytes:
            raise ValueError(f"block {key:#018x}: piece of {len(data)} bytes at {offset} does not fit the frame")
        self.pending_key = key
        self._pieces.append(data)
        self._received += len(data)
        if self._received < frame_bytes:
            return None
        frame = self._pieces[0] if len(self._pieces) == 1 else b"".join(self._pieces)
        self.pending_key, self._pieces, self._received = None, [], 0
        return frame
