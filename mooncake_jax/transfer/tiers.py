"""One storage level of the pool: a TensorStore kvstore of block records plus an in-memory index of what it holds.

The index (a set of keys, kept exact by this class) answers ``contains`` and prefix lookups without I/O; the
kvstore holds the records. DRAM is a TensorStore memory kvstore with its own context (two pools in one process
must not share a store); SSD is a TensorStore file kvstore in a directory, written without fsync (the checksum in
every record, not fsync, is what keeps a torn write from being served) and relisted on open so it survives a
restart. A tier never evicts by itself: the pool decides, because eviction from DRAM means demotion to SSD.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

import tensorstore as ts

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.counters import TierCounters
from mooncake_jax.transfer.eviction import EvictionPolicy
from mooncake_jax.transfer.spec import BlockSpec

SPEC_FILE = "spec.json"
_STORED_NAME = re.compile(rb"^[0-9a-f]{2}/([0-9a-f]{16})$")


def _path_of(key: BlockKey) -> str:
    """Kvstore key of a block: 256 fan-out directories keep SSD directories small."""
    name = f"{key:016x}"
    return f"{name[:2]}/{name}"


class TierWriteError(OSError):
    """Storing a block failed (disk full, directory removed...); the block is not in the tier."""

    def __init__(self, tier: str, key: BlockKey, cause: Exception) -> None:
        super().__init__(f"{tier} tier: storing block {key:#018x} failed: {cause}")
        self.tier = tier
        self.key = key


class Tier:
    """Frames of one storage level, its capacity (in blocks), eviction policy, index and counters.

    One write may be in flight: ``write`` returns once the write is started (TensorStore has copied the record)
    and waits only for the previous one, so the pool encodes the next block of a batch while this one goes to
    disk (about 15% more SSD throughput here; more writes in flight measured no faster). Every other operation
    first ``settle``s it, so reads never race a write, and the pool settles at the end of each call.
    """

    def __init__(
        self,
        name: str,
        store: ts.KvStore,
        capacity_blocks: int | None,
        policy: EvictionPolicy,
        present: Iterable[BlockKey] = (),
    ) -> None:
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.policy = policy
        self.counters = TierCounters()
        self._store = store
        self._present: set[BlockKey] = set()
        self._in_flight: tuple[BlockKey, ts.Future] | None = None
        for key in present:
            self._present.add(key)
            policy.inserted(key)

    def __contains__(self, key: object) -> bool:
        return key in self._present

    def __len__(self) -> int:
        return len(self._present)

    def keys(self) -> list[BlockKey]:
        return list(self._present)

    @property
    def full(self) -> bool:
        return self.capacity_blocks is not None and len(self._present) >= self.capacity_blocks

    def read(self, key: BlockKey) -> bytes | None:
        """The stored record, or None when the store has lost it (unverified: the pool checks it)."""
        self.settle()
        try:
            result = self._store.read(_path_of(key)).result()
        except ValueError:  # an I/O error reading the file: as good as lost
            return None
        if result.state != "value":
            return None
        self.counters.bytes_read += len(result.value)
        return result.value

    def write(self, key: BlockKey, record: bytes | bytearray) -> None:
        """Start storing the record of a key not yet in the tier (the caller may reuse ``record`` at once)."""
        self.settle()
        self._in_flight = (key, self._store.write(_path_of(key), record))
        self._present.add(key)
        self.policy.inserted(key)
        self.counters.stored += 1
        self.counters.bytes_written += len(record)

    def settle(self) -> None:
        """Wait for the write in flight; if it failed, forget its block and raise TierWriteError."""
        if self._in_flight is None:
            return
        key, future = self._in_flight
        self._in_flight = None
        try:
            future.result()
        except Exception as err:
            self._present.discard(key)
            self.policy.removed(key)
            raise TierWriteError(self.name, key, err) from err

    def delete(self, key: BlockKey) -> None:
        self.settle()
        self._present.discard(key)
        self.policy.removed(key)
        self._store.write(_path_of(key), None).result()

    def accessed(self, key: BlockKey) -> None:
        self.policy.accessed(key)


def memory_tier(capacity_blocks: int | None, policy: EvictionPolicy) -> Tier:
    """The DRAM tier: a private TensorStore memory kvstore."""
    store = ts.KvStore.open({"driver": "memory"}, context=ts.Context()).result()
    return Tier("dram", store, capacity_blocks, policy)


def file_tier(path: str | os.PathLike, spec: BlockSpec, capacity_blocks: int | None, policy: EvictionPolicy) -> Tier:
    """The SSD tier in directory ``path``: created with ``spec``, or reopened with the blocks it already holds.

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
    context = ts.Context({"file_io_sync": False})
    store = ts.KvStore.open({"driver": "file", "path": str(root) + "/"}, context=context).result()
    listed = (_STORED_NAME.match(name) for name in store.list().result())
    present = sorted(int(match.group(1), 16) for match in listed if match)
    excess = present[capacity_blocks:] if capacity_blocks is not None else []
    for future in [store.write(_path_of(key), None) for key in excess]:
        future.result()
    return Tier("ssd", store, capacity_blocks, policy, present[: len(present) - len(excess)])
