"""The SSD tier's storage: block records in fixed, page-aligned slots of one file, written behind the caller.

Every record of a pool has the same size, so the tier is an array of slots on disk (``records.slots`` in the tier's
directory): slot i starts at byte ``i * stride`` (the record size rounded up to 4 KiB), a key's slot is kept in
memory, freed slots are reused lowest first and the file only grows. Creating one file per block, as the tier did
before through TensorStore's file kvstore, cost about a millisecond of filesystem metadata per block here (more
than writing a 384 KiB block), and its read and write paths copied every block once more than the kernel does.

A write hands the kernel the record head and the caller's array as they are (``os.pwritev`` at the slot's
aligned offset) on a writer thread, so hashing the next block overlaps the kernel's copy of this one; writes in
flight are bounded (``max_in_flight``) and ``settle`` waits for all of them and reports failures. The pool settles
at the end of every call, so buffers handed to a write stay untouched until it is done. A read lands chunk by chunk
straight in the caller's staging buffer, each chunk hashed while in cache; a batch read first asks the kernel to
start reading all its records (``prefetch``), so the disk reads ahead while the blocks are copied and verified.

Nothing is fsynced: the checksum in every record, not fsync, keeps a torn or lost write from being served. A freed
slot has its head zeroed, so a restart does not bring its block back; on open every slot's head is read and
checked (a damaged head is counted corrupt and its slot freed; the data is checked when the block is read).
"""

from __future__ import annotations

import heapq
import logging
import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.checksum import COPY_CHUNK_BYTES, checksum
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
from mooncake_jax.transfer.spec import BlockSpec

log = logging.getLogger(__name__)

SLOTS_FILE = "records.slots"
PAGE_BYTES = 4096
_KEY_IN_HEAD = slice(PREFIX_BYTES + 16, PREFIX_BYTES + 24)  # the key field of the frame header
_LOW = (1 << 64) - 1

Buffer = bytes | bytearray | memoryview | np.ndarray


def _as_bytes(part: Buffer) -> memoryview:
    if isinstance(part, np.ndarray):
        return memoryview(part.reshape(-1).view(np.uint8))
    return memoryview(part).cast("B")


class FileStore:
    """Records of one ``BlockSpec`` in the slots of ``root/records.slots``.

    On open, ``present`` lists the keys found (lowest slot first) and ``corrupt_at_open`` counts slots whose head
    was damaged (freed).
    """

    def __init__(self, root: Path, spec: BlockSpec, *, writers: int = 2, max_in_flight: int = 8) -> None:
        self.root = root
        self.spec = spec
        self.record_bytes = record_bytes(spec)
        self.stride = -(-self.record_bytes // PAGE_BYTES) * PAGE_BYTES
        self.max_in_flight = max_in_flight
        self.path = root / SLOTS_FILE
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._slot_of: dict[BlockKey, int] = {}
        self._free: list[int] = []  # a heap: the lowest free slot is reused first
        self._end = 0  # slots in the file
        self._executor = ThreadPoolExecutor(writers, thread_name_prefix="ssd-write")
        self._pending: deque[tuple[BlockKey, Future]] = deque()
        self._failed: list[tuple[BlockKey, Exception]] = []
        self.corrupt_at_open = 0
        self.present = self._scan()
        self.present += self._migrate_block_files()

    # ---- opening -----------------------------------------------------------------------------------------

    def _scan(self) -> list[BlockKey]:
        """Index the slots already in the file by the key in each head; free the empty and the damaged ones."""
        size = os.fstat(self._fd).st_size
        self._end = -(-size // self.stride)
        present = []
        for slot in range(self._end):
            head = os.pread(self._fd, DATA_OFFSET, slot * self.stride)
            if not any(head):
                heapq.heappush(self._free, slot)
                continue
            key = int.from_bytes(head[_KEY_IN_HEAD], "little") if len(head) == DATA_OFFSET else 0
            try:
                check_head(self.spec, key, head)
                if key in self._slot_of:
                    raise CorruptBlockError(f"block {key:#018x}: a second copy in slot {slot}")
            except StaleFormatError:
                pass  # listed: reading it drops it as stale, with one log line for its version
            except CorruptBlockError as err:
                log.warning("ssd tier: slot %d of %s: %s; freed", slot, self.path, err)
                self.corrupt_at_open += 1
                self._clear(slot)
                continue
            self._slot_of[key] = slot
            present.append(key)
        return present

    def _migrate_block_files(self) -> list[BlockKey]:
        """Move the blocks of the layout before slots (one file per record, ``<root>/<2 hex>/<16 hex>``, the same
        record format) into slots, with one log line; files that fail verification are dropped."""
        moved, dropped = [], 0
        for fan_out in sorted(self.root.glob("[0-9a-f][0-9a-f]")):
            if not fan_out.is_dir():
                continue
            for path in sorted(fan_out.iterdir()):
                try:
                    key = int(path.name, 16) if len(path.name) == 16 else None
                    if key is not None and key not in self._slot_of:
                        record = path.read_bytes()
                        verify(self.spec, key, record)
                        self.put(key, (record,), owned=False)
                        moved.append(key)
                except (ValueError, OSError):  # not a record, or a damaged or stale one: a miss either way
                    dropped += 1
                path.unlink(missing_ok=True)
            fan_out.rmdir()
        failed = {key for key, _ in self.settle()}
        if moved or dropped:
            log.warning("ssd tier: moved %d blocks from one file each into %s, dropped %d that failed their checks",
                        len(moved) - len(failed), self.path, dropped + len(failed))
        return [key for key in moved if key not in failed]

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
        """Store the block whose bytes are ``data`` (flat uint8, untouched until ``settle``)."""
        self.put(key, (record_head(self.spec, key, checksum(data)), data), owned=True)

    def put_checked(self, key: BlockKey, head: bytes | memoryview, data: np.ndarray,
                    expected: tuple[int, int]) -> None:
        """Store a record whose data must hash to ``expected`` (checked before anything is written)."""
        check_digest(key, expected, checksum(data))
        self.put(key, (head, data), owned=True)

    def put(self, key: BlockKey, parts: Sequence[Buffer], owned: bool) -> None:
        """Store a record given as consecutive parts. ``owned``: the parts stay untouched until ``settle`` (else
        the write finishes before this returns, e.g. from a DRAM slot about to be reused)."""
        while len(self._pending) >= self.max_in_flight:
            self._finish_oldest()
        slot = self._take_slot(key)
        future = self._executor.submit(self._write_slot, slot, [_as_bytes(part) for part in parts])
        self._pending.append((key, future))
        if not owned:
            self._finish_all()

    def _write_slot(self, slot: int, parts: list[memoryview]) -> None:
        offset = slot * self.stride
        while parts:  # pwritev may write less than asked: go on from where it stopped
            written = os.pwritev(self._fd, parts, offset)
            offset += written
            while parts and written >= len(parts[0]):
                written -= len(parts.pop(0))
            if parts:
                parts[0] = parts[0][written:]

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
        """Zero the head of a slot that holds no block any more, and make it free."""
        try:
            os.pwrite(self._fd, bytes(DATA_OFFSET), slot * self.stride)
        except OSError as err:  # the slot is reused all the same; at worst a restart lists a removed block
            log.warning("ssd tier: clearing slot %d of %s failed: %s", slot, self.path, err)
        heapq.heappush(self._free, slot)

    def delete(self, key: BlockKey) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._clear(slot)

    # ---- reads -------------------------------------------------------------------------------------------

    def record(self, key: BlockKey) -> bytes | None:
        """The stored record (unverified; short if the file was cut), or None if the key has no slot."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        try:
            return os.pread(self._fd, self.record_bytes, slot * self.stride)
        except OSError:
            return None

    def prefetch(self, keys: Sequence[BlockKey]) -> None:
        """Ask the kernel to start reading these records from disk now (``POSIX_FADV_WILLNEED``), so the disk works
        on the next blocks while this thread copies and verifies the current one; a hint, free when cached."""
        if not hasattr(os, "posix_fadvise"):
            return
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is not None:
                try:
                    os.posix_fadvise(self._fd, slot * self.stride, self.record_bytes, os.POSIX_FADV_WILLNEED)
                except OSError:
                    return

    def read_into(self, key: BlockKey, out: np.ndarray) -> tuple[bytes, tuple[int, int]] | None:
        """Read the record's data straight into ``out`` (flat uint8), hashing each chunk as it lands; its head and
        the checksum of what was read (a file cut short reads as a head that fails its checks)."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        offset = slot * self.stride
        try:
            if out.size <= COPY_CHUNK_BYTES:  # one system call for head and data, then the hash from cache
                head = bytearray(DATA_OFFSET)
                if os.preadv(self._fd, [head, out], offset) != DATA_OFFSET + out.size:
                    return b"", (0, 0)
                digest = xxhash.xxh3_128_intdigest(out)
                return head, (digest >> 64, digest & _LOW)
            head = os.pread(self._fd, DATA_OFFSET, offset)
            hasher = xxhash.xxh3_128()
            for start in range(0, out.size, COPY_CHUNK_BYTES):
                chunk = out[start : start + COPY_CHUNK_BYTES]
                if os.preadv(self._fd, [chunk], offset + DATA_OFFSET + start) != chunk.size:
                    return b"", (0, 0)
                hasher.update(chunk)
        except OSError:
            return None
        digest = hasher.intdigest()
        return head, (digest >> 64, digest & _LOW)

    def close(self) -> None:
        self._finish_all()
        self._executor.shutdown(wait=True)
        os.close(self._fd)
