"""The DRAM tier's storage: block records in slots of preallocated host memory, reused as blocks come and go.

A TensorStore memory kvstore (what this tier used before) copies a record on every write and again on every read,
and a put had to join the record into one ``bytes`` first: three copies and a hash for a put, two copies and a hash
for a get, about 0.3 of memcpy. Here a put copies the block once, straight from the caller's array into its slot,
hashing each chunk while it is still in cache (``copy_with_checksum``), and a get copies the data once, straight
into the caller's staging buffer, verifying the same way; the record layout in a slot is the one on SSD and on the
wire, so the Messenger sends a slot's bytes as they are.

Slots live in slabs (one numpy array of many slots); a slab is allocated when no slot is free and kept for the
life of the tier, so a warm pool writes into memory whose pages are already mapped (fresh pages cost more than the
copy). A bounded tier allocates at most its capacity; a slot starts on a page boundary (on a cache line for
records under 64 KiB, so small blocks do not waste most of a page each).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.checksum import copy_with_checksum
from mooncake_jax.transfer.frame import DATA_OFFSET, CorruptBlockError, record_bytes, record_head
from mooncake_jax.transfer.spec import BlockSpec

PAGE_BYTES = 4096
CACHE_LINE_BYTES = 64
SLAB_BYTES = 256 << 20
"""Most bytes allocated at once when the tier grows (one slot if a record is larger)."""


class SlotStore:
    """Records of one ``BlockSpec`` in reusable slots of host memory, by key."""

    def __init__(self, spec: BlockSpec, capacity_blocks: int | None) -> None:
        self.spec = spec
        self.record_bytes = record_bytes(spec)
        align = PAGE_BYTES if self.record_bytes >= 16 * PAGE_BYTES else CACHE_LINE_BYTES
        self._stride = -(-self.record_bytes // align) * align
        self._capacity = capacity_blocks
        self._allocated = 0
        self._slabs: list[np.ndarray] = []
        self._free: list[np.ndarray] = []
        self._slot_of: dict[BlockKey, np.ndarray] = {}

    def _take_slot(self) -> np.ndarray:
        if not self._free:
            count = max(1, SLAB_BYTES // self._stride)
            if self._capacity is not None:
                count = min(count, self._capacity - self._allocated)
            if count < 1:
                raise RuntimeError("the DRAM tier has no free slot (the pool evicts before it writes)")
            slab = np.empty((count, self._stride), np.uint8)
            self._slabs.append(slab)
            self._allocated += count
            self._free.extend(slab[i, : self.record_bytes] for i in reversed(range(count)))
        return self._free.pop()

    def _slot_for(self, key: BlockKey) -> np.ndarray:
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._slot_of[key] = self._take_slot()
        return slot

    def put_block(self, key: BlockKey, data: np.ndarray) -> None:
        """Store the block whose bytes are ``data`` (flat uint8): one copy, hashed on the way."""
        slot = self._slot_for(key)
        digest = copy_with_checksum(slot[DATA_OFFSET:], data)
        slot[:DATA_OFFSET] = np.frombuffer(record_head(self.spec, key, digest), np.uint8)

    def put_checked(self, key: BlockKey, head: bytes | memoryview, data: np.ndarray,
                    expected: tuple[int, int]) -> None:
        """Store a record whose data must hash to ``expected``, verified while it is copied in (one pass)."""
        slot = self._slot_for(key)
        if copy_with_checksum(slot[DATA_OFFSET:], data) != expected:
            self.delete(key)
            raise CorruptBlockError(f"block {key:#018x}: checksum mismatch")
        slot[:DATA_OFFSET] = np.frombuffer(head, np.uint8)

    def put(self, key: BlockKey, parts: Sequence[bytes | bytearray | memoryview | np.ndarray], owned: bool) -> None:
        """Store a record given as consecutive parts (already checksummed); copied at once, so ``owned`` is moot."""
        slot = self._slot_for(key)
        at = 0
        for part in parts:
            flat = part.reshape(-1).view(np.uint8) if isinstance(part, np.ndarray) else np.frombuffer(part, np.uint8)
            slot[at : at + flat.size] = flat
            at += flat.size
        if at != self.record_bytes:
            raise ValueError(f"record of {at} bytes, expected {self.record_bytes}")

    def record(self, key: BlockKey) -> memoryview | None:
        """The stored record (a view of its slot: valid until the slot is reused, so copy it before releasing the
        pool's lock)."""
        slot = self._slot_of.get(key)
        return None if slot is None else memoryview(slot)

    def read_into(self, key: BlockKey, out: np.ndarray) -> tuple[memoryview, tuple[int, int]] | None:
        """Copy the block's data into ``out`` (flat uint8); its record head and the checksum of what was copied."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        digest = copy_with_checksum(out, slot[DATA_OFFSET:])
        return memoryview(slot[:DATA_OFFSET]), digest

    def prefetch(self, keys: Sequence[BlockKey]) -> None:
        """Nothing to do: the records are in memory."""

    def delete(self, key: BlockKey) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def settle(self) -> list[tuple[BlockKey, Exception]]:
        return []  # every write is done when it returns

    def close(self) -> None:
        self._slot_of.clear()
        self._free.clear()
        self._slabs.clear()
