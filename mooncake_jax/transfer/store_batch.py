"""Received block records stored a few at a time: one pool operation per batch instead of one per block.

A pool operation waits at its end for the copies it started (``BlockPool._operation``); a peer streaming many
small blocks paid that wait, a hand-off to TensorStore's copy thread and back, once per block. Holding up to
``STORE_BATCH`` whole records (each already its own bytes object from gRPC, so holding costs no copy) lets their
copies run side by side and be waited for once. Whoever receives records calls ``flush`` before it reports an
error or finishes, so the blocks that arrived whole are in the pool by then, as they were when stored one by one.
"""

from __future__ import annotations

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.pool import BlockPool

STORE_BATCH = 8
"""Records held before they are stored: enough to overlap the copies, few enough (8 blocks of a few MiB) that
holding them costs little memory and little delay before a block is usable."""


class StoreBatch:
    """Records of ``pool``'s spec received from a peer, stored in batches; ``stored`` lists the keys stored (new or
    already held) in arrival order, ``new`` counts those the pool did not hold before."""

    def __init__(self, pool: BlockPool, size: int = STORE_BATCH) -> None:
        self.pool = pool
        self.size = size
        self.stored: list[BlockKey] = []
        self.new = 0
        self._held: list[tuple[BlockKey, bytes | bytearray]] = []

    def add(self, key: BlockKey, record: bytes | bytearray) -> None:
        """Hold ``record`` for the next batch; one that is not immutable ``bytes`` (a frame reassembled from
        pieces in the assembler's reused buffer) is stored now, with those held before it."""
        self._held.append((key, record))
        if len(self._held) >= self.size or not isinstance(record, bytes):
            self.flush()

    def flush(self) -> None:
        """Store the records held (``BlockPool.put_records``: the first that fails verification raises, those
        before it are stored and listed)."""
        held, self._held = self._held, []
        if not held:
            return
        try:
            self.new += self.pool.put_records(held)
        finally:
            self.stored.extend(key for key, _ in held if key in self.pool)
