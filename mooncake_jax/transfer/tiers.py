"""One storage level of the pool: a store of block records plus an in-memory index of what it holds.

The index (a set of keys, kept exact by this class) answers ``contains`` and prefix lookups without I/O; the store
holds the records. DRAM is a ``SlotStore`` (records in reusable slots of preallocated host memory, ``slots.py``);
SSD is a ``FileStore`` (records in the shards of two zarr3 TensorStore arrays on disk, written behind the caller,
``files.py``), rescanned on open so it survives a restart. A tier never evicts by itself: the pool decides,
because eviction from DRAM means demotion to SSD.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.counters import TierCounters
from mooncake_jax.transfer.eviction import EvictionPolicy
from mooncake_jax.transfer.files import FileStore
from mooncake_jax.transfer.slots import SlotStore
from mooncake_jax.transfer.spec import BlockSpec

SPEC_FILE = "spec.json"


class TierWriteError(OSError):
    """Storing a block failed (disk full, directory removed...); the block is not in the tier."""

    def __init__(self, tier: str, key: BlockKey, cause: Exception, keys: Sequence[BlockKey] = ()) -> None:
        super().__init__(f"{tier} tier: storing block {key:#018x} failed: {cause}")
        self.tier = tier
        self.key = key
        self.keys = list(keys) or [key]


class Tier:
    """Records of one storage level, its capacity (in blocks), eviction policy, index and counters.

    Writes may still be in flight when ``write_*`` returns (the SSD store writes behind the caller); every read or
    delete first ``settle``s them, so reads never race a write, and the pool settles at the end of each call.
    """

    def __init__(
        self,
        name: str,
        store: SlotStore | FileStore,
        capacity_blocks: int | None,
        policy: EvictionPolicy,
        present: Iterable[BlockKey] = (),
    ) -> None:
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.policy = policy
        self.counters = TierCounters()
        self.store = store
        self._store_room = getattr(store, "has_room", None)
        self._take_checked = getattr(store, "take_checked", None)  # a store whose batch reads check checksums
        self._present: set[BlockKey] = set()
        for key in present:
            self._present.add(key)
            policy.inserted(key)

    def __contains__(self, key: object) -> bool:
        return key in self._present

    def __len__(self) -> int:
        return len(self._present)

    def keys(self) -> list[BlockKey]:
        return list(self._present)

    def has_room(self, whole: bytes | memoryview | None = None) -> bool:
        """Whether one more block fits without evicting: under the capacity in blocks and, for a store that counts
        memory (DRAM, which may keep a received record ``whole`` as it arrived), in bytes."""
        if self.capacity_blocks is not None and len(self._present) >= self.capacity_blocks:
            return False
        return self._store_room is None or self._store_room(whole)

    def read_record(self, key: BlockKey) -> bytes | memoryview | None:
        """The stored record, or None when the store has lost it (unverified: the pool checks it). A DRAM record
        is a view of its slot: copy it before the pool's lock is released."""
        self.settle()
        record = self.store.record(key)
        if record is not None:
            self.counters.bytes_read += len(record)
        return record

    def read_into(self, key: BlockKey, out: np.ndarray) -> tuple[bytes | memoryview, tuple[int, int] | None] | None:
        """Copy the block's data into ``out`` (flat uint8); its record head (unverified) and the checksum of the
        bytes copied (None when they could not all be read), or None when the store has lost it."""
        self.settle()
        found = self.store.read_into(key, out)
        if found is not None:
            self.counters.bytes_read += out.size + len(found[0])
        return found

    def take_checked(self, key: BlockKey, out: np.ndarray) -> bytes | None:
        """The record head of ``key`` if the store's batch read (``prefetch``) already landed its data in ``out``
        and found it matching the checksum of its sound head (the SSD store): nothing left to check; else None
        (then ``read_into``)."""
        heads = self.take_checked_many([key], [out])  # None while writes are in flight: read_into settles them
        return None if heads is None else heads[0]

    def take_checked_many(self, keys: Sequence[BlockKey], outs: Sequence[np.ndarray]) -> list[bytes | None] | None:
        """``take_checked`` of each key into its out in one call (a batch's hits in the fastest tier: the pool's
        Python per record is a fair share of a 16-token get); None when the store has no batch reads (a store with
        ``take_checked`` has ``take_checked_many``)."""
        if self._take_checked is None:  # (a store without batch reads, or one told to act as one)
            return None
        heads = self.store.take_checked_many(keys, outs)
        self.counters.bytes_read += (len(heads) - heads.count(None)) * self.store.record_bytes  # data and head each
        return heads

    def prefetch(self, keys: Sequence[BlockKey], outs: Sequence[np.ndarray],
                 addresses: Sequence[int] | None = None) -> None:
        """Start bringing in the records of the ``keys`` this tier holds (a batch read is coming), their data
        into ``outs`` (flat uint8, one per key), where ``read_into`` will be asked to copy them (``addresses``:
        where each out starts, if the caller knows; for a store that reads ahead, the SSD's)."""
        held = [i for i, key in enumerate(keys) if key in self._present]
        self.store.prefetch(picked(keys, held), picked(outs, held), picked(addresses, held))

    def write_block(self, key: BlockKey, data: np.ndarray) -> None:
        """Start storing the block whose bytes are ``data`` (flat uint8) under a key not yet in the tier."""
        self.store.put_block(key, data)
        self._added(key)

    def write_record(self, key: BlockKey, parts: Sequence[bytes | bytearray | memoryview | np.ndarray],
                     owned: bool = True) -> None:
        """Start storing a verified record given as consecutive parts (``owned``: see ``FileStore.put``)."""
        self.store.put(key, parts, owned)
        self._added(key)

    def write_checked(self, key: BlockKey, head: bytes | memoryview, data: np.ndarray,
                      expected: tuple[int, int], whole: bytes | memoryview | None = None) -> None:
        """Store a record (its checked ``head`` and ``data``, flat uint8) whose data must hash to ``expected``;
        CorruptBlockError, and nothing stored, if it does not. ``whole``: the record (head then data) lying in an
        immutable ``bytes`` (itself, or a view of a received message), which a store that adopts records (DRAM)
        may keep instead of copying it."""
        if whole is not None and getattr(self.store, "adopts_records", False):
            self.store.adopt_checked(key, whole, expected)
        else:
            self.store.put_checked(key, head, data, expected)
        self._added(key)

    def _added(self, key: BlockKey) -> None:
        self._present.add(key)
        self.policy.inserted(key)
        self.counters.stored += 1
        self.counters.bytes_written += self.store.record_bytes

    def settle(self) -> None:
        """Wait for the writes in flight; forget the blocks of those that failed and raise TierWriteError."""
        failed = self.store.settle()
        for key, _ in failed:
            self._present.discard(key)
            self.policy.removed(key)
        if failed:
            key, err = failed[0]
            raise TierWriteError(self.name, key, err, [key for key, _ in failed]) from err

    def delete(self, key: BlockKey) -> None:
        if getattr(self.store, "settle_before_delete", True):  # a DRAM slot is reused: no copy may be in flight
            self.settle()
        self._present.discard(key)
        self.policy.removed(key)
        self.store.delete(key)

    def accessed(self, key: BlockKey) -> None:
        self.policy.accessed(key)

    def close(self) -> None:
        self.store.close()


def picked(items: Sequence | None, indices: list[int]) -> Sequence | None:
    """``items`` at ``indices`` (increasing, each once): ``items`` itself when that is all of them (a batch read's
    usual case, no copy), None for None."""
    if items is None or len(indices) == len(items):
        return items
    return [items[i] for i in indices]


def memory_tier(spec: BlockSpec, capacity_blocks: int | None, policy: EvictionPolicy) -> Tier:
    """The DRAM tier: records in slots of TensorStore arrays over host memory."""
    return Tier("dram", SlotStore(spec, capacity_blocks), capacity_blocks, policy)


def file_tier(path: str | os.PathLike, spec: BlockSpec, capacity_blocks: int | None, policy: EvictionPolicy,
              direct_io: bool = False) -> Tier:
    """The SSD tier in directory ``path``: created with ``spec``, or reopened with the blocks it already holds
    (``direct_io``: its shard files written with ``O_DIRECT``).

    Reopening with another spec is a ValueError (its blocks could never be decoded). Recency is not kept across
    a restart: reopened blocks start in key order, and those beyond a smaller ``capacity_blocks`` are deleted.
    """
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ValueError(f"ssd_path {root} is not a directory")
    root.mkdir(parents=True, exist_ok=True)
    spec_path = root / SPEC_FILE
    if spec_path.exists():
        found = BlockSpec.from_json(spec_path.read_text())
        if found != spec:
            raise ValueError(f"{root} holds blocks of {found.describe()}, not {spec.describe()}")
    else:
        tmp = spec_path.with_suffix(".tmp")
        tmp.write_text(spec.to_json())
        tmp.replace(spec_path)
    store = FileStore(root, spec, direct_io=direct_io)
    present = store.present
    excess = present[capacity_blocks:] if capacity_blocks is not None else []
    for key in excess:
        store.delete(key)
    tier = Tier("ssd", store, capacity_blocks, policy, present[: len(present) - len(excess)])
    tier.counters.corrupt = store.corrupt_at_open
    return tier
