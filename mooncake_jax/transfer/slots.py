"""The DRAM tier's storage: block records in the slots of TensorStore arrays over preallocated host memory.

The backing store is TensorStore: each slab is a ``[slots, stride]`` uint8 TensorStore array (the ``array``
driver, ``ts.array(..., copy=False)``) whose memory is a preallocated host buffer, and records are written into
and read out of it through TensorStore, without intermediate encodes. A put is one TensorStore write per record
part straight from the caller's array into the slot (the data hashed just before, chunk by chunk, so the chunk is
in cache when TensorStore copies it); a get is one TensorStore write from the slot into a TensorStore view of the
caller's staging buffer, each chunk hashed from cache as it lands. The TensorStore memory kvstore this tier used
first copied a record on every write and again on every read, and a put had to join the record into one ``bytes``
first (about 0.3 of memcpy). The record layout in a slot is the one on SSD and on the wire, so the Messenger sends
a slot's bytes as they are (``record`` is a view of the array's memory, copied by the pool under its lock).

Slabs are allocated when no slot is free and kept for the life of the tier, so a warm pool writes into memory
whose pages are already mapped (fresh pages cost more than the copy). A bounded tier allocates at most its
capacity; a slot starts on a page boundary (on a cache line for records under 64 KiB, so small blocks do not waste
most of a page each).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorstore as ts
import xxhash

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.checksum import COPY_CHUNK_BYTES
from mooncake_jax.transfer.frame import DATA_OFFSET, CorruptBlockError, record_bytes, record_head
from mooncake_jax.transfer.spec import BlockSpec

PAGE_BYTES = 4096
CACHE_LINE_BYTES = 64
SLAB_BYTES = 256 << 20
"""Most bytes allocated at once when the tier grows (one slot if a record is larger)."""
_LOW = (1 << 64) - 1
_CONTEXT = ts.Context({"data_copy_concurrency": {"limit": 1}})
"""TensorStore copies on one thread: the caller waits for each copy anyway (it hashes the chunk next), and more
threads only add hand-offs on a 2-core host."""


def as_store(buffer: np.ndarray) -> ts.TensorStore:
    """A writable TensorStore array over ``buffer``'s memory (never a copy)."""
    return ts.array(buffer, copy=False, write=True, context=_CONTEXT)


def copy_hashed(dst: ts.TensorStore, src: ts.TensorStore | np.ndarray, landed: np.ndarray) -> tuple[int, int]:
    """Copy ``src`` into ``dst`` through TensorStore (flat uint8, one length) and return the XXH3-128 checksum of
    the bytes that landed (``landed``: ``dst``'s memory as numpy), hashed chunk by chunk right after each chunk's
    copy, from cache: one pass over memory, as ``checksum.copy_with_checksum`` does with numpy."""
    n = landed.size
    if n <= COPY_CHUNK_BYTES:
        dst.write(src).result()
        digest = xxhash.xxh3_128_intdigest(landed)
        return digest >> 64, digest & _LOW
    hasher = xxhash.xxh3_128()
    for start in range(0, n, COPY_CHUNK_BYTES):
        stop = min(n, start + COPY_CHUNK_BYTES)
        dst[start:stop].write(src[start:stop]).result()
        hasher.update(landed[start:stop])
    digest = hasher.intdigest()
    return digest >> 64, digest & _LOW


class _Slot:
    """One record's place in a slab: its memory as numpy (for hashing and views) and as TensorStore (for I/O)."""

    __slots__ = ("memory", "record", "head", "data")

    def __init__(self, memory: np.ndarray, store: ts.TensorStore) -> None:
        self.memory = memory
        self.record = store
        self.head = store[:DATA_OFFSET]
        self.data = store[DATA_OFFSET:]


class SlotStore:
    """Records of one ``BlockSpec`` in reusable slots of TensorStore arrays over host memory, by key."""

    def __init__(self, spec: BlockSpec, capacity_blocks: int | None) -> None:
        self.spec = spec
        self.record_bytes = record_bytes(spec)
        align = PAGE_BYTES if self.record_bytes >= 16 * PAGE_BYTES else CACHE_LINE_BYTES
        self._stride = -(-self.record_bytes // align) * align
        self._capacity = capacity_blocks
        self._allocated = 0
        self._slabs: list[ts.TensorStore] = []
        self._free: list[_Slot] = []
        self._slot_of: dict[BlockKey, _Slot] = {}

    def _take_slot(self) -> _Slot:
        if not self._free:
            count = max(1, SLAB_BYTES // self._stride)
            if self._capacity is not None:
                count = min(count, self._capacity - self._allocated)
            if count < 1:
                raise RuntimeError("the DRAM tier has no free slot (the pool evicts before it writes)")
            memory = np.empty((count, self._stride), np.uint8)
            slab = as_store(memory)
            self._slabs.append(slab)
            self._allocated += count
            size = self.record_bytes
            self._free.extend(_Slot(memory[i, :size], slab[i, :size]) for i in reversed(range(count)))
        return self._free.pop()

    def _slot_for(self, key: BlockKey) -> _Slot:
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._slot_of[key] = self._take_slot()
        return slot

    def put_block(self, key: BlockKey, data: np.ndarray) -> None:
        """Store the block whose bytes are ``data`` (flat uint8): one copy, hashed on the way."""
        slot = self._slot_for(key)
        digest = copy_hashed(slot.data, data, slot.memory[DATA_OFFSET:])
        slot.head.write(np.frombuffer(record_head(self.spec, key, digest), np.uint8)).result()

    def put_checked(self, key: BlockKey, head: bytes | memoryview, data: np.ndarray,
                    expected: tuple[int, int]) -> None:
        """Store a record whose data must hash to ``expected``, verified while it is copied in (one pass)."""
        slot = self._slot_for(key)
        if copy_hashed(slot.data, data, slot.memory[DATA_OFFSET:]) != expected:
            self.delete(key)
            raise CorruptBlockError(f"block {key:#018x}: checksum mismatch")
        slot.head.write(np.frombuffer(head, np.uint8)).result()

    def put(self, key: BlockKey, parts: Sequence[bytes | bytearray | memoryview | np.ndarray], owned: bool) -> None:
        """Store a record given as consecutive parts (already checksummed); copied at once, so ``owned`` is moot."""
        flats = [part.reshape(-1).view(np.uint8) if isinstance(part, np.ndarray) else np.frombuffer(part, np.uint8)
                 for part in parts]
        if sum(flat.size for flat in flats) != self.record_bytes:
            raise ValueError(f"record of {sum(flat.size for flat in flats)} bytes, expected {self.record_bytes}")
        slot = self._slot_for(key)
        at, writes = 0, []
        for flat in flats:
            writes.append(slot.record[at : at + flat.size].write(flat))
            at += flat.size
        for write in writes:
            write.result()

    def record(self, key: BlockKey) -> memoryview | None:
        """The stored record (a view of the TensorStore array's memory, valid until the slot is reused: the pool
        copies it before releasing its lock)."""
        slot = self._slot_of.get(key)
        return None if slot is None else memoryview(slot.memory)

    def read_into(self, key: BlockKey, out: np.ndarray) -> tuple[memoryview, tuple[int, int]] | None:
        """Copy the block's data into ``out`` (flat uint8) through TensorStore; its record head and the checksum
        of what was copied."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        digest = copy_hashed(as_store(out), slot.data, out)
        return memoryview(slot.memory[:DATA_OFFSET]), digest

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

