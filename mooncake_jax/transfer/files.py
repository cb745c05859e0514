"""The SSD tier's storage: block records in a TensorStore array on disk (zarr3 over the file kvstore), one chunk
per slot, written behind the caller.

Every record of a pool has the same size, so the tier is one ``[slots, record_bytes]`` uint8 zarr3 array
(``records.zarr`` in the tier's directory) whose chunk is one slot, stored raw (the ``bytes`` codec: the chunk's
bytes are the record, the layout the DRAM tier and the wire use). A key's slot is kept in memory and freed slots
are reused lowest first, so the number of chunk files is bounded by the most blocks ever held, not by the blocks
ever written. The context turns off fsync (``file_io_sync``: the checksum in every record, not fsync, keeps a
torn or lost write from being served) and TensorStore's lock files (``file_io_locking``: one pool owns its
directory).

A write stages the record head and the caller's array into one chunk of a TensorStore transaction (one copy; the
caller's buffers are free when ``put`` returns) and commits it asynchronously: TensorStore writes the chunk file
on its I/O threads while the caller goes on; commits in flight are bounded (``max_in_flight``) and ``settle`` waits
for all of them and reports failures. A read copies the slot's data straight from the array into the caller's
staging buffer (a TensorStore view of it) while the head is read, hashed as it lands; a batch read first starts
reading its records' heads (``prefetch``).

Why it is slower than the slot file it replaced (pwritev / preadv at page-aligned offsets of one file): the file
kvstore writes every chunk to a new temporary file and renames it over the old one (two metadata operations per
block), and a transactional write stages the data in a chunk buffer first; see docs/benchmarks.md.

A freed slot's chunk is deleted, so a restart does not bring its block back; on open every chunk's head is read
(a byte range of its file) and checked (a damaged head is counted corrupt and its chunk deleted; the data is
checked when the block is read). Directories of the two layouts before this one are migrated on open with one log
line: the slot file ``records.slots`` and one file per record (``<root>/<2 hex>/<16 hex>``).
"""

from __future__ import annotations

import heapq
import logging
import re
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tensorstore as ts
import xxhash

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.checksum import checksum
from mooncake_jax.transfer.frame import (
    DATA_OFFSET,
    PREFIX_BYTES,
    CorruptBlockError,
    StaleFormatError,
    check_digest,
    check_head,
    record_bytes,
    record_head,
    verify,
)
from mooncake_jax.transfer.slots import as_store
from mooncake_jax.transfer.spec import BlockSpec

log = logging.getLogger(__name__)

ARRAY_DIR = "records.zarr"
LEGACY_SLOTS_FILE = "records.slots"
"""The layout before this one: records in page-aligned slots of one file (migrated on open)."""
MAX_SLOTS = 1 << 40
"""The array's extent along slots: chunks exist only where records are, so this costs nothing."""
_CHUNK_KEY = re.compile(rb"c/(\d+)/0")
_KEY_IN_HEAD = slice(PREFIX_BYTES + 16, PREFIX_BYTES + 24)  # the key field of the frame header
_LOW = (1 << 64) - 1
_CONTEXT = ts.Context({"file_io_sync": False, "file_io_locking": {"mode": "none"}})

Buffer = bytes | bytearray | memoryview | np.ndarray


def _flat(part: Buffer) -> np.ndarray:
    if isinstance(part, np.ndarray):
        return part.reshape(-1).view(np.uint8)
    return np.frombuffer(part, np.uint8)


def _chunk_key(slot: int) -> bytes:
    return b"c/%d/0" % slot


class FileStore:
    """Records of one ``BlockSpec`` in the chunks of the zarr3 array ``root/records.zarr``.

    On open, ``present`` lists the keys found (lowest slot first) and ``corrupt_at_open`` counts chunks whose head
    was damaged (deleted).
    """

    def __init__(self, root: Path, spec: BlockSpec, *, max_in_flight: int = 8) -> None:
        self.root = root
        self.spec = spec
        self.record_bytes = record_bytes(spec)
        self.max_in_flight = max_in_flight
        self.path = root / ARRAY_DIR
        self._array = ts.open({
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(self.path)},
            "metadata": {
                "shape": [MAX_SLOTS, self.record_bytes],
                "data_type": "uint8",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, self.record_bytes]}},
                "codecs": [{"name": "bytes"}],
                "fill_value": 0,
            },
        }, create=True, open=True, context=_CONTEXT).result()
        self._kvstore = self._array.kvstore
        self._slot_of: dict[BlockKey, int] = {}
        self._free: list[int] = []  # a heap: the lowest free slot is reused first
        self._end = 0  # one past the highest slot ever used
        self._pending: deque[tuple[BlockKey, ts.Future]] = deque()
        self._failed: list[tuple[BlockKey, Exception]] = []
        self._heads: dict[BlockKey, ts.Future] = {}  # heads being read ahead of ``read_into``
        self.corrupt_at_open = 0
        self.present = self._scan()
        self.present += self._migrate_slot_file()
        self.present += self._migrate_block_files()

    # ---- opening -----------------------------------------------------------------------------------------

    def _read_head(self, slot: int) -> ts.Future:
        return self._kvstore.read(_chunk_key(slot), byte_range=slice(0, DATA_OFFSET))

    def _scan(self) -> list[BlockKey]:
        """Index the chunks already in the array by the key in each head; delete the damaged ones."""
        slots = sorted(int(m.group(1)) for m in map(_CHUNK_KEY.fullmatch, self._kvstore.list().result()) if m)
        self._end = slots[-1] + 1 if slots else 0
        heads = [self._read_head(slot) for slot in slots]
        present, used = [], set()
        for slot, future in zip(slots, heads):
            try:
                head = future.result().value
            except Exception as err:  # unreadable: as damaged as a wrong head
                head = b""
                log.warning("ssd tier: reading slot %d of %s failed: %s", slot, self.path, err)
            key = int.from_bytes(head[_KEY_IN_HEAD], "little") if len(head) == DATA_OFFSET else 0
            try:
                check_head(self.spec, key, head)
                if key in self._slot_of:
                    raise CorruptBlockError(f"block {key:#018x}: a second copy in slot {slot}")
            except StaleFormatError:
                pass  # listed: reading it drops it as stale, with one log line for its version
            except CorruptBlockError as err:
                log.warning("ssd tier: slot %d of %s: %s; deleted", slot, self.path, err)
                self.corrupt_at_open += 1
                self._clear(slot)
                continue
            self._slot_of[key] = slot
            used.add(slot)
            present.append(key)
        self._free = [slot for slot in range(self._end) if slot not in used]
        heapq.heapify(self._free)
        return present

    def _migrate(self, found: list[tuple[Path, list[tuple[int | None, bytes | None]]]], layout: str) -> list[BlockKey]:
        """Store the verified records of an older layout, drop the rest, delete the old files; one log line."""
        moved, dropped = [], 0
        for path, records in found:
            for key, record in records:
                try:
                    if key is None or record is None:
                        raise CorruptBlockError("not a record")
                    if key not in self._slot_of:
                        verify(self.spec, key, record)
                        self.put(key, (record,), owned=True)
                        moved.append(key)
                except (ValueError, OSError):  # damaged or stale: a miss either way
                    dropped += 1
            path.unlink(missing_ok=True)
        failed = {key for key, _ in self.settle()}
        dropped += len(failed)
        moved = [key for key in moved if key not in failed]
        if moved or dropped:
            log.warning("ssd tier: moved %d blocks from %s into %s, dropped %d that failed their checks",
                        len(moved), layout, self.path, dropped)
        return moved

    def _migrate_slot_file(self) -> list[BlockKey]:
        """Records of the slot file (``records.slots``: page-aligned slots of one file, the same record format)."""
        path = self.root / LEGACY_SLOTS_FILE
        if not path.exists():
            return []
        stride = -(-self.record_bytes // 4096) * 4096
        records = []
        with open(path, "rb") as source:
            while head := source.read(DATA_OFFSET):
                rest = source.read(stride - DATA_OFFSET)
                if not any(head):
                    continue  # a free slot
                key = int.from_bytes(head[_KEY_IN_HEAD], "little") if len(head) == DATA_OFFSET else None
                records.append((key, head + rest[: self.record_bytes - DATA_OFFSET]))
        return self._migrate([(path, records)], "the slot file")

    def _migrate_block_files(self) -> list[BlockKey]:
        """Records of the layout with one file per record (``<root>/<2 hex>/<16 hex>``, the same format)."""
        found = []
        for fan_out in sorted(self.root.glob("[0-9a-f][0-9a-f]")):
            if not fan_out.is_dir():
                continue
            for path in sorted(fan_out.iterdir()):
                key = int(path.name, 16) if re.fullmatch("[0-9a-f]{16}", path.name) else None
                found.append((path, [(key, path.read_bytes() if key is not None else None)]))
        moved = self._migrate(found, "one file per block") if found else []
        for fan_out in self.root.glob("[0-9a-f][0-9a-f]"):
            if fan_out.is_dir():
                fan_out.rmdir()
        return moved

    # ---- writes ------------------------------------------------------------------------------------------

    def _take_slot(self, key: BlockKey) -> int:
        slot = self._slot_of.get(key)
        if slot is None:
            if self._free:
                slot = heapq.heappop(self._free)
            else:
                slot, self._end = self._end, self._end + 1
            self._slot_of[key] = slot
        return slot

    def put_block(self, key: BlockKey, data: np.ndarray) -> None:
        """Store the block whose bytes are ``data`` (flat uint8)."""
        self.put(key, (record_head(self.spec, key, checksum(data)), data), owned=True)

    def put_checked(self, key: BlockKey, head: bytes | memoryview, data: np.ndarray,
                    expected: tuple[int, int]) -> None:
        """Store a record whose data must hash to ``expected`` (checked before anything is written)."""
        check_digest(key, expected, checksum(data))
        self.put(key, (head, data), owned=True)

    def put(self, key: BlockKey, parts: Sequence[Buffer], owned: bool) -> None:
        """Store a record given as consecutive parts. They are copied into TensorStore's chunk buffer before this
        returns, so ``owned`` (the parts stay untouched until ``settle``) does not matter here."""
        flats = [_flat(part) for part in parts]
        if sum(flat.size for flat in flats) != self.record_bytes:
            raise ValueError(f"record of {sum(flat.size for flat in flats)} bytes, expected {self.record_bytes}")
        while len(self._pending) >= self.max_in_flight:
            self._finish_oldest()
        self._heads.pop(key, None)
        slot = self._take_slot(key)
        try:
            self._pending.append((key, self._write_slot(slot, flats)))
        except Exception as err:  # failed before it was under way: reported by settle like one that failed after
            self._failed.append((key, err))
            self.delete(key)

    def _write_slot(self, slot: int, parts: list[np.ndarray]) -> ts.Future:
        """Stage ``parts`` (consecutive, filling the slot) into the slot's chunk and start committing it."""
        transaction = ts.Transaction()
        chunk = self._array.with_transaction(transaction)[slot]
        at = 0
        for part in parts:
            chunk[at : at + part.size].translate_to[0].write(part).result()
            at += part.size
        return transaction.commit_async()

    def _finish_oldest(self) -> None:
        key, future = self._pending.popleft()
        try:
            future.result()
        except Exception as err:
            self._failed.append((key, err))
            self.delete(key)

    def _finish_all(self) -> None:
        while self._pending:
            self._finish_oldest()

    def settle(self) -> list[tuple[BlockKey, Exception]]:
        """Wait for every write in flight; the ``(key, error)`` of those that failed since the last settle."""
        self._finish_all()
        failed, self._failed = self._failed, []
        return failed

    def _clear(self, slot: int) -> None:
        """Delete the chunk of a slot that holds no block any more, and make the slot free."""
        key = _chunk_key(slot)
        try:
            self._kvstore.delete_range(ts.KvStore.KeyRange(key, key + b"\0")).result()
        except Exception as err:  # the slot is reused all the same; at worst a restart lists a removed block
            log.warning("ssd tier: deleting slot %d of %s failed: %s", slot, self.path, err)
        heapq.heappush(self._free, slot)

    def delete(self, key: BlockKey) -> None:
        self._heads.pop(key, None)
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._clear(slot)

    # ---- reads -------------------------------------------------------------------------------------------

    def record(self, key: BlockKey) -> bytes | None:
        """The stored record (unverified; short if the chunk file was cut), or None if the key has no slot."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        try:
            found = self._kvstore.read(_chunk_key(slot)).result()
        except Exception:
            return None
        return found.value

    def prefetch(self, keys: Sequence[BlockKey]) -> None:
        """Start reading the heads of these records (a batch read is coming): they are read on TensorStore's I/O
        threads while this thread copies and verifies the blocks before them (the data has no destination yet)."""
        self._heads.clear()  # what an earlier batch left unread
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is not None:
                self._heads[key] = self._read_head(slot)

    def read_into(self, key: BlockKey, out: np.ndarray) -> tuple[bytes, tuple[int, int]] | None:
        """Copy the record's data from the array straight into ``out`` (flat uint8) while its head is read; the
        head and the checksum of what landed (a chunk file cut short reads as a head that fails its checks)."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        head_read = self._heads.pop(key, None) or self._read_head(slot)
        copy = as_store(out).write(self._array[slot, DATA_OFFSET:].translate_to[0])
        try:
            head = head_read.result().value
            copy.result()
        except Exception:  # a chunk file of the wrong size, or unreadable: a damaged record
            return b"", (0, 0)
        digest = xxhash.xxh3_128_intdigest(out)
        return head, (digest >> 64, digest & _LOW)

    def close(self) -> None:
        self._finish_all()
        self._heads.clear()
