"""The SSD tier's storage: block records in two sharded TensorStore arrays on disk (zarr3 over the file kvstore),
written as whole shards behind the caller.

Every record of a pool has the same size, so the tier is two ``[slots, width]`` uint8 zarr3 arrays: ``heads.zarr``
(each slot's 128-byte record head: wire prefix and frame header with the checksum) and ``data.zarr`` (each slot's
block bytes). Both are sharded alike (``sharding_indexed``: a shard file holds ``slots_per_shard`` slots, up to
64 MiB of records; one raw inner chunk per slot, the shard index at the start of the file), so a shard file of
``data.zarr`` is one large sequential write instead of one file per block.

Why the layout (see docs/benchmarks/pool.md): TensorStore's file kvstore writes a key as a whole file, through a
temporary file renamed over the old one; one file per block cost 0.1-0.3 of a raw sequential write. Here the
slots are filled log-structured: writes go to fresh slots of the open shard, whose data file the tier writes itself
behind the caller, in the layout TensorStore's sharding codec reads (``shard_file.py``): appended with ``pwritev``
straight from the caller's arrays (untouched until ``settle``), or, with ``direct_io``, with ``O_DIRECT`` from
aligned pieces (``shard_writer.py``). Through TensorStore (a transaction per shard committed behind the caller) the
same write cost two copies, its chunk encoder's and the kernel's, where a raw write costs one: 0.2-0.5 of a raw
write. At every ``settle`` the open shard's index and its heads file (the same layout) are written after the rows
they list, so each call's blocks are whole in the page cache when it returns (no fsync), and the shard stays open
for the next call's blocks (no new files per call) until it is full or the store closes; a direct-I/O shard is
finished per call (its last piece is padded). A torn write is caught by the checksum in the head or the CRC32C of a
shard's index, as fsync is not used (nor was it before); a torn rewrite of the open shard's index costs every
record of that shard. Removing a record of a finished shard rewrites its heads shard through
TensorStore; one of the open shard is zeroed in its heads file at the next ``settle``. Slots are
never reused: a removed block zeroes its head (a rewrite of the small heads shard, atomic); a shard whose records
are all gone is deleted; and when dead slots outnumber the live blocks, the live records of the emptiest shards
are moved into fresh ones (compaction), so the disk holds at most about twice the live records.

A read is the tier's own too (``shard_reader.py``): the offset of every record's data is known in memory (the tier
wrote the shard, or read its index on open), so a get is one ``preadv`` straight into the caller's staging buffer,
hashed (XXH3) from cache as it lands, and a record's head comes from memory (kept since it was written, or read and
checked on open; 128 bytes per record). Through TensorStore the same read cost about 0.1 ms of CPU per 384 KiB
record beyond the copy (thread hand-offs, chunk decoding): a 16-token get at 0.22-0.27 of a raw read's CPU, 0.41-0.57
now (docs/benchmarks/pool.md, seventh pass). A batch read names its runs of chunks lying end to end to the reader, which
asks the kernel for them (``POSIX_FADV_WILLNEED``) once a read finds the page cache cold, so records not in the page
cache come in from the device while earlier ones are hashed.
The shards stay TensorStore's zarr3 arrays: TensorStore creates and opens them, reads every head on open, lists and
deletes shards and rewrites a finished shard's heads, and can read every record the tier wrote (tested).
On open every head is read and checked (a damaged head is counted corrupt and zeroed; the data is checked when the
block is read). Directories of the three layouts before this one are migrated on open with one log line: one
chunk file per slot (``records.zarr``), the slot file ``records.slots`` and one file per record.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import tensorstore as ts

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.checksum import checksum
from mooncake_jax.transfer.frame import (
    DATA_OFFSET,
    DIGEST_IN_HEAD,
    DIGEST_WORDS,
    PREFIX_BYTES,
    CorruptBlockError,
    StaleFormatError,
    check_digest,
    check_head,
    record_bytes,
    record_head,
    verify,
)
from mooncake_jax.transfer.shard_file import chunk_offsets, index_bytes
from mooncake_jax.transfer.shard_reader import ReadResult, ShardReader, pace_for
from mooncake_jax.transfer.shard_writer import ShardImage, ShardWriter
from mooncake_jax.transfer.spec import BlockSpec

log = logging.getLogger(__name__)

HEADS_DIR = "heads.zarr"
DATA_DIR = "data.zarr"
ARRAY_DIRS = (DATA_DIR, HEADS_DIR)
LEGACY_ARRAY_DIR = "records.zarr"
"""The layout before this one: one zarr3 chunk file per slot holding the whole record (migrated on open)."""
LEGACY_SLOTS_FILE = "records.slots"
"""The layout before that: records in page-aligned slots of one file (migrated on open)."""
MAX_SLOTS = 1 << 40
"""The arrays' extent along slots: shards exist only where records are, so this costs nothing."""
SHARD_BYTES = 64 << 20
"""Records per shard file: about this many bytes, so a pool call's batch is one sequential write into one new file
(16 blocks of 3 MiB: one file, not eight of 8 MiB; 1.5x the put rate and 0.65x its CPU per GB, docs/benchmarks/pool.md).
An array keeps the shard size it was created with (``open_array``)."""
MAX_SHARD_SLOTS = 64
_SHARD_KEY = re.compile(rb"c\.(\d+)\.0")
_LEGACY_CHUNK_KEY = re.compile(rb"c/(\d+)/0")
_KEY_IN_HEAD = slice(PREFIX_BYTES + 16, PREFIX_BYTES + 24)  # the key field of the frame header
_DATA_CONTEXT = ts.Context({"file_io_sync": False, "file_io_locking": {"mode": "non_atomic"},
                            "file_io_mode": {"mode": "memmap"}})
_HEADS_CONTEXT = ts.Context({"file_io_sync": False, "file_io_locking": {"mode": "none"}})
_NO_HEAD = np.zeros(DATA_OFFSET, np.uint8)  # the fill value: writing it removes the head's chunk
_DIGEST_AT = DIGEST_IN_HEAD.start

Buffer = bytes | bytearray | memoryview | np.ndarray


def _flat(part: Buffer) -> np.ndarray:
    if isinstance(part, np.ndarray):
        return part.reshape(-1).view(np.uint8)
    return np.frombuffer(part, np.uint8)


def slots_per_shard(record_size: int) -> int:
    return max(1, min(MAX_SHARD_SLOTS, SHARD_BYTES // record_size))


def _shard_key(shard: int) -> bytes:
    return b"c.%d.0" % shard


def open_array(path: Path, width: int, shard_slots: int, context: ts.Context) -> ts.TensorStore:
    """The ``[MAX_SLOTS, width]`` uint8 array at ``path``: as it was created if it exists (its shard size may be
    another build's), else created with ``shard_slots`` slots per shard file, one raw inner chunk per slot."""
    if (path / "zarr.json").exists():
        found = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}, open=True,
                        context=context).result()
        if found.dtype == ts.uint8 and list(found.shape) == [MAX_SLOTS, width]:
            return found
    return ts.open({
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
        "metadata": {
            "shape": [MAX_SLOTS, width],
            "data_type": "uint8",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [shard_slots, width]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": [1, width],
                "codecs": [{"name": "bytes"}],
                "index_codecs": [{"name": "bytes"}, {"name": "crc32c"}],
                "index_location": "start",
            }}],
            "fill_value": 0,
        },
    }, create=True, open=True, context=context).result()


def record_arrays(root: Path, spec: BlockSpec) -> tuple[ts.TensorStore, ts.TensorStore]:
    """The ``(heads, data)`` arrays of the SSD tier in ``root`` for blocks of ``spec``."""
    shard_slots = slots_per_shard(record_bytes(spec))
    return (open_array(root / HEADS_DIR, DATA_OFFSET, shard_slots, _HEADS_CONTEXT),
            open_array(root / DATA_DIR, spec.nbytes, shard_slots, _DATA_CONTEXT))


class FileStore:
    """Records of one ``BlockSpec`` in the sharded zarr3 arrays ``root/heads.zarr`` and ``root/data.zarr``.

    On open, ``present`` lists the keys found (lowest slot first) and ``corrupt_at_open`` counts heads that were
    damaged (zeroed).
    """

    settle_before_delete = False
    """A delete need not wait for the writes in flight (``Tier.delete``): slots are never reused, and removing a
    record still being written is ordered after its write here, so a call's puts that each evict a block still
    go out as one shard."""

    def __init__(self, root: Path, spec: BlockSpec, *, max_in_flight: int = 8, direct_io: bool = False) -> None:
        self.root = root
        self.spec = spec
        self.record_bytes = record_bytes(spec)
        self.max_in_flight = max_in_flight  # shard commits and head removals in flight
        self._heads_array, self._data_array = record_arrays(root, spec)
        self.shard_slots = int(self._data_array.chunk_layout.write_chunk.shape[0])
        if self._heads_array.chunk_layout.write_chunk.shape[0] != self.shard_slots:
            raise ValueError(f"{root}: the heads and data arrays have shards of different sizes")
        self._slot_of: dict[BlockKey, int] = {}
        self._live: dict[int, int] = {}  # shard -> live records in it
        self._filled: dict[int, int] = {}  # shard -> slots ever written in it
        self._dead = 0  # slots written whose record is gone, in shards still on disk
        self._next_shard = 0
        self._open_shard: int | None = None  # the shard the writes of this call fill
        self._writer = ShardWriter(root / DATA_DIR, direct_io)
        self._image: ShardImage | None = None  # the open shard's data file being written
        self._staged: list[BlockKey] = []  # keys written into the open shard since it was last written out
        self._heads_changed = False  # a head of the open shard zeroed since then
        self._open_heads = np.zeros((self.shard_slots, DATA_OFFSET), np.uint8)  # its heads, written at seal
        self._shard_heads: dict[int, np.ndarray] = {}  # shard -> its heads (zeroed where removed), as on disk
        self._head_checked: dict[int, np.ndarray] = {}  # shard -> per slot: its head in memory is the sound head of
        # its key in this build's format (made here from the data's checksum, or passed check_head), so a batch read
        # needs only compare checksums (``prefetch``); False: the pool checks the head as it reads (``read_into``)
        self._offsets: dict[int, list[int]] = {}  # shard -> where each slot's data starts in its file (-1: none; a
        # list, not an array: a batch read looks one up per record, and a list hands out Python ints)
        self._reader = ShardReader(self._data_path, pace_for(spec.nbytes))
        self._read_ahead: dict[BlockKey, tuple[np.ndarray, int, ReadResult, bool, bytes | None]] = {}  # prefetch's
        # reads (out, slot, result, sound, head) for take_checked or read_into, kept until the batch's read or the next
        # prefetch
        self._pending: deque[tuple[list[BlockKey], int, tuple[Future | ts.Future, ...]]] = deque()
        self._failed: list[tuple[BlockKey, Exception]] = []
        self.corrupt_at_open = 0
        self.moved_by_compaction = 0  # records moved into fresh shards (``_compact``)
        try:
            self.present = self._scan()
            self.present += self._migrate_chunk_per_slot()
            self.present += self._migrate_slot_file()
            self.present += self._migrate_block_files()
        except BaseException:  # no writer thread or open shard file left behind by a store that did not open
            if self._image is not None:
                self._image.abort()
            self._writer.close()
            raise

    # ---- opening -----------------------------------------------------------------------------------------

    def _shards_in(self, array: ts.TensorStore) -> list[int]:
        keys = array.kvstore.list().result()
        return sorted(int(m.group(1)) for m in map(_SHARD_KEY.fullmatch, keys) if m)

    def _scan(self) -> list[BlockKey]:
        """Index the records already on disk by the key in each head; zero the damaged heads."""
        head_shards = self._shards_in(self._heads_array)
        data_shards = self._shards_in(self._data_array)
        self._next_shard = max(head_shards + data_shards, default=-1) + 1
        size = self.shard_slots
        reads = [self._heads_array[shard * size : (shard + 1) * size].read() for shard in head_shards]
        present = []
        for shard, future in zip(head_shards, reads):
            try:
                heads = future.result()
            except Exception as err:  # an unreadable heads shard: its records are lost
                log.warning("ssd tier: heads of shard %d of %s unreadable (%s); its records dropped", shard,
                            self.root, err)
                self.corrupt_at_open += 1
                self._delete_shard(shard)
                continue
            self._live[shard] = 0
            self._shard_heads[shard] = heads
            checked = self._head_checked[shard] = np.zeros(size, bool)
            for index in np.flatnonzero(heads.any(axis=1)):
                slot, head = shard * size + int(index), heads[index].tobytes()
                key = int.from_bytes(head[_KEY_IN_HEAD], "little")
                try:
                    check_head(self.spec, key, head)
                    if key in self._slot_of:
                        raise CorruptBlockError(f"block {key:#018x}: a second copy in slot {slot}")
                    checked[index] = True
                except StaleFormatError:
                    pass  # listed: reading it drops it as stale, with one log line for its version
                except CorruptBlockError as err:
                    log.warning("ssd tier: slot %d of %s: %s; removed", slot, self.root, err)
                    self.corrupt_at_open += 1
                    self._remove_head(slot)
                    continue
                self._slot_of[key] = slot
                self._live[shard] += 1
                present.append(key)
            self._filled[shard] = max(self._live[shard], self._read_index(shard))
            self._dead += self._filled[shard] - self._live[shard]
            if not self._live[shard]:
                self._delete_shard(shard)
        for shard in set(data_shards) - set(self._live):  # data whose heads never reached the disk
            self._delete_shard(shard)
        self._finish_all()
        return present

    def _data_path(self, shard: int) -> Path:
        return self.root / DATA_DIR / _shard_key(shard).decode()

    def _read_index(self, shard: int) -> int:
        """Learn where the data shard file's chunks lie (its index: TensorStore may have rewritten the shard) and
        how many it holds; a file without a sound index holds none (its records read as damaged)."""
        try:
            with open(self._data_path(shard), "rb") as file:
                offsets = chunk_offsets(file.read(index_bytes(self.shard_slots)), self.shard_slots,
                                        self.spec.nbytes)
        except OSError:
            offsets = None
        self._offsets[shard] = [-1] * self.shard_slots if offsets is None else offsets.tolist()
        return sum(offset >= 0 for offset in self._offsets[shard])

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
        failed = {key for key, _ in self.settle()}
        for path, _ in found:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        dropped += len(failed)
        moved = [key for key in moved if key not in failed]
        if moved or dropped:
            log.warning("ssd tier: moved %d blocks from %s into %s, dropped %d that failed their checks",
                        len(moved), layout, self.root, dropped)
        return moved

    def _migrate_chunk_per_slot(self) -> list[BlockKey]:
        """Records of ``records.zarr`` (one unsharded chunk file per slot holding the whole record)."""
        path = self.root / LEGACY_ARRAY_DIR
        if not path.is_dir():
            return []
        kvstore = ts.KvStore.open({"driver": "file", "path": str(path) + "/"}).result()
        records = []
        for name in sorted(kvstore.list().result()):
            if _LEGACY_CHUNK_KEY.fullmatch(name):
                record = kvstore.read(name).result().value
                key = int.from_bytes(record[_KEY_IN_HEAD], "little") if len(record) >= DATA_OFFSET else None
                records.append((key, record))
        return self._migrate([(path, records)], "one chunk file per slot")

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

    def put_block(self, key: BlockKey, data: np.ndarray) -> None:
        """Store the block whose bytes are ``data`` (flat uint8, untouched until ``settle``); its head carries the
        checksum taken as the data is written."""
        self._store(key, None, data, owned=True)

    def put_checked(self, key: BlockKey, head: bytes | memoryview, data: np.ndarray,
                    expected: tuple[int, int]) -> None:
        """Store a record whose data must hash to ``expected`` (checked before anything is written)."""
        check_digest(key, expected, checksum(data))
        self._store(key, _flat(head), data, owned=True, head_checked=True)

    def put(self, key: BlockKey, parts: Sequence[Buffer], owned: bool) -> None:
        """Store a record given as consecutive parts into a fresh slot. ``owned``: the parts stay untouched until
        ``settle`` (the data may be written straight from them); else the data is copied first."""
        flats = [_flat(part) for part in parts]
        if sum(flat.size for flat in flats) != self.record_bytes:
            raise ValueError(f"record of {sum(flat.size for flat in flats)} bytes, expected {self.record_bytes}")
        if flats[0].size == DATA_OFFSET and len(flats) == 2:
            head, data = flats
        else:
            record = np.concatenate(flats) if len(flats) > 1 else flats[0]
            head, data = record[:DATA_OFFSET], record[DATA_OFFSET:]
        self._store(key, head, data, owned)

    def _store(self, key: BlockKey, head: np.ndarray | None, data: np.ndarray, owned: bool,
               head_checked: bool = False) -> None:
        """Write a record (its head, or None to make it from the data's checksum) into a fresh slot.
        ``head_checked``: the given head passed ``check_head`` for ``key`` (the pool checked a received record)."""
        if key in self._slot_of:  # a record is never rewritten in place: the new one takes a fresh slot
            self._release(self._slot_of.pop(key))
        try:
            slot = self._take_slot()
        except Exception as err:  # the shard file could not be created: reported by settle
            self._failed.append((key, err))
            return
        self._slot_of[key] = slot
        self._staged.append(key)
        try:  # not owned (a demoted block's DRAM slot, refilled at once): written before this returns, no copy
            self._write_slot(slot, key, head, data, not owned)  # positional: tests wrap it as (slot, *record)
        except Exception as err:  # failed before it was under way: reported by settle like one that failed after
            self._failed.append((key, err))
            self.delete(key)
            self._seal()  # the slots after this one would not match the shard file's chunks
            return
        if head is None or head_checked:
            self._head_checked[self._open_shard][slot % self.shard_slots] = True
        if self._filled[self._open_shard] == self.shard_slots:
            self._seal()

    def _take_slot(self) -> int:
        """The next slot of the open shard (a fresh shard if none is open)."""
        if self._open_shard is None:
            shard = self._next_shard
            self._image = self._writer.open(self._data_path(shard), self.shard_slots, self.spec.nbytes)
            self._open_shard, self._next_shard = shard, shard + 1
            self._open_heads = self._shard_heads[shard] = np.zeros((self.shard_slots, DATA_OFFSET), np.uint8)
            self._head_checked[shard] = np.zeros(self.shard_slots, bool)
            self._offsets[shard] = list(range(self._image.start, self._image.start + self.spec.nbytes * self.shard_slots,
                                              self.spec.nbytes))
            self._live[shard] = self._filled[shard] = 0
        shard = self._open_shard
        slot = shard * self.shard_slots + self._filled[shard]
        self._filled[shard] += 1
        self._live[shard] += 1
        return slot

    def _write_slot(self, slot: int, key: BlockKey, head: np.ndarray | None, data: np.ndarray,
                    now: bool = False) -> None:
        """Append a record's data to the open shard's file (referenced until it is finished, written before this
        returns if ``now``, or copied into an aligned piece for direct writes); its head is kept for the shard's one
        heads write after the data."""
        digest = self._image.append(data, digest=head is None, now=now)  # a given head carries the checksum already
        if head is None:
            head = np.frombuffer(record_head(self.spec, key, digest), np.uint8)
        self._open_heads[slot % self.shard_slots] = head

    def _seal(self, keep_open: bool = False) -> None:
        """Write the open shard behind the caller: the rest of its data file and its index, then its heads file.
        ``keep_open`` (buffered writes only): the shard takes the next calls' blocks too (no new files per call),
        its files written so far and readable, the indexes and heads written again as it grows."""
        if self._open_shard is None:
            return
        keep_open = keep_open and not self._writer.direct and bool(self._live[self._open_shard])
        shard, image, keys = self._open_shard, self._image, self._staged
        self._staged = []
        if not keep_open:
            self._open_shard = self._image = None
        if not self._live[shard]:
            image.abort().exception()  # the file is closed before it is deleted
            self._delete_shard(shard)
            return
        if keep_open and not keys and not self._heads_changed:  # nothing since the shard was last written
            return
        self._heads_changed = False
        data = image.finish(close=not keep_open)
        heads = self._writer.write_rows(self.root / HEADS_DIR / _shard_key(shard).decode(), self.shard_slots,
                                        self._open_heads[: self._filled[shard]].copy())
        self._in_flight(keys, shard, data, heads)

    def _in_flight(self, keys: list[BlockKey], shard: int, *writes: Future | ts.Future) -> None:
        while len(self._pending) >= self.max_in_flight:
            self._finish_oldest()
        self._pending.append((keys, shard, writes))

    def _finish_oldest(self) -> None:
        keys, shard, writes = self._pending.popleft()
        try:
            for write in writes:
                write.result()
        except Exception as err:
            if shard == self._open_shard:  # its file keeps the error: later calls' blocks go to a new shard,
                image, self._open_shard, self._image = self._image, None, None  # those staged in it fail too
                keys, self._staged = keys + self._staged, []
                with contextlib.suppress(Exception):
                    image.abort().exception()
            for key in keys:
                if self._slot_of.get(key, -1) // self.shard_slots == shard:
                    self._failed.append((key, err))
                    self.delete(key)

    def _finish_all(self) -> None:
        while self._pending:
            self._finish_oldest()

    def settle(self) -> list[tuple[BlockKey, Exception]]:
        """Write the open shard (kept open for the next call's blocks) and wait for every write in flight; the
        ``(key, error)`` of those that failed since the last settle."""
        if not (self._staged or self._pending or self._failed or self._heads_changed):
            return []  # nothing written, removed or failed since (a batch read settles before every record)
        self._seal(keep_open=True)
        self._finish_all()
        failed, self._failed = self._failed, []
        return failed

    def _release(self, slot: int) -> None:
        """Forget the record in ``slot``: zero its head, or delete its shard if no record is left there."""
        shard = slot // self.shard_slots
        self._live[shard] -= 1
        self._dead += 1
        if shard in self._head_checked:
            self._head_checked[shard][slot % self.shard_slots] = False
        if shard == self._open_shard:  # staged, not committed: its head is not written
            self._open_heads[slot % self.shard_slots] = 0
            self._heads_changed = True
            return
        if any(pending == shard for _, pending, _ in self._pending):
            self._finish_all()  # its shard is being written: remove after, not beside, that write
        if self._live[shard]:
            self._remove_head(slot)
        else:
            self._delete_shard(shard)

    def _remove_head(self, slot: int) -> None:
        shard = slot // self.shard_slots
        if shard in self._shard_heads:
            self._shard_heads[shard][slot % self.shard_slots] = 0
        self._in_flight([], -1, self._heads_array[slot].write(_NO_HEAD))

    def _delete_shard(self, shard: int) -> None:
        """Delete both shard files of ``shard`` (none of its records is live)."""
        self._finish_all()  # a head removal in flight would write the heads shard again after the delete
        self._dead -= self._filled.pop(shard, 0) - self._live.pop(shard, 0)
        self._shard_heads.pop(shard, None)
        self._head_checked.pop(shard, None)
        self._offsets.pop(shard, None)
        self._reader.forget(shard)
        for array in (self._heads_array, self._data_array):
            try:
                key = _shard_key(shard)
                array.kvstore.delete_range(ts.KvStore.KeyRange(key, key + b"\0")).result()
            except Exception as err:  # at worst a restart finds records that were removed
                log.warning("ssd tier: deleting shard %d of %s failed: %s", shard, self.root, err)

    def delete(self, key: BlockKey) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._release(slot)
            self._compact()

    def _compact(self) -> None:
        """When the dead records on disk outnumber the live ones (and a shard's worth), move the live records of
        the emptiest shards into fresh ones, so their files can be deleted."""
        if self._dead <= max(len(self._slot_of), self.shard_slots):
            return
        self._seal()
        self._finish_all()  # failures stay for the next settle
        by_shard: dict[int, list[BlockKey]] = {}
        for key, slot in self._slot_of.items():
            by_shard.setdefault(slot // self.shard_slots, []).append(key)
        for shard in sorted(by_shard, key=lambda s: len(by_shard[s])):
            if self._dead <= len(self._slot_of) // 2 or len(by_shard[shard]) > self.shard_slots // 2:
                break
            for key in by_shard[shard]:  # the last one moved deletes the shard's files
                try:
                    record = self.record(key)
                except OSError:  # the process cannot read now (shard_reader.UNAVAILABLE): compact another time
                    self._seal()
                    return
                if record is not None and len(record) == self.record_bytes:
                    self.put(key, (record,), owned=True)
                    self.moved_by_compaction += 1
                else:
                    self.delete(key)
        self._seal()

    # ---- reads -------------------------------------------------------------------------------------------

    def _location(self, key: BlockKey) -> tuple[int, int, int] | None:
        """``(shard, row in it, offset of its data in the shard file)`` of ``key``'s record (offset -1 where the
        file's index lists none), or None if the key has no slot."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        shard, row = divmod(slot, self.shard_slots)
        return shard, row, self._offsets[shard][row]

    def record(self, key: BlockKey) -> bytearray | None:
        """The stored record (unverified), or None if the key has no slot or its data cannot be read whole."""
        where = self._location(key)
        if where is None:
            return None
        shard, row, offset = where
        record = bytearray(self.record_bytes)
        view = np.frombuffer(record, np.uint8)
        view[:DATA_OFFSET] = self._shard_heads[shard][row]
        if offset < 0 or not self._reader.read_exact(shard, offset, view[DATA_OFFSET:]):
            return None
        return record

    def prefetch(self, keys: Sequence[BlockKey], outs: Sequence[np.ndarray] | None = None,
                 addresses: Sequence[int] | None = None) -> None:
        """A batch read of these records is coming: name its runs of chunks lying end to end in one shard (a batch
        written by one call, read back in order) to the reader, which asks the kernel for them once a read finds
        the page cache cold (``shard_reader.py``). With ``outs`` (where ``read_into`` will put them) and nothing
        being written, the records are read and hashed into them now (``ShardReader.read_many``), each checksum
        compared here with the one its head promises where that head is known sound (``_head_checked``), and
        ``take_checked`` / ``read_into`` hand on what landed: the per-record checks of a batch in one loop here
        instead of the pool's per-record path (its Python cost 10-15 us a 16-token record beside a read of about
        60, docs/benchmarks/pool.md, sixteenth pass). ``addresses``: where each out starts, if the caller knows."""
        runs: list[tuple[int, int, int]] = []  # shard, offset, length
        reads: list[tuple[int, int, np.ndarray]] = []  # shard, offset, out
        read_keys: list[tuple[BlockKey, int]] = []  # key, slot
        read_addresses: list[int] | None = [] if addresses is not None and outs is not None else None
        slot_of, size, nbytes, offsets = self._slot_of, self.shard_slots, self.spec.nbytes, self._offsets
        for i, key in enumerate(keys):
            slot = slot_of.get(key)
            if slot is None:
                continue
            shard, row = divmod(slot, size)
            offset = offsets[shard][row]
            if offset < 0:
                continue
            if runs and runs[-1][0] == shard and runs[-1][1] + runs[-1][2] == offset:
                runs[-1] = (shard, runs[-1][1], runs[-1][2] + nbytes)
            else:
                runs.append((shard, offset, nbytes))
            if outs is not None:
                reads.append((shard, offset, outs[i]))
                read_keys.append((key, slot))
                if read_addresses is not None:
                    read_addresses.append(addresses[i])
        self._reader.want(runs)
        self._read_ahead = {}
        if len(reads) < 2 or self._pending or self._staged:  # one record: nothing to share; writes: not yet on disk
            return
        ahead, shards = self._read_ahead, {}  # shard -> its heads as bytes and which are checked, as a list
        results = self._reader.read_many(reads, read_addresses)
        for (key, slot), (shard, _, out), result in zip(read_keys, reads, results):
            if key in ahead:
                continue  # a key twice: the second read later
            row = slot % size
            sound, head = False, None
            if type(result) is tuple:  # compared here: bytes and lists, not numpy, per record
                known = shards.get(shard)
                if known is None:
                    known = shards[shard] = (self._shard_heads[shard].tobytes(), self._head_checked[shard].tolist())
                at = row * DATA_OFFSET
                if known[1][row] and DIGEST_WORDS.unpack_from(known[0], at + _DIGEST_AT) == result:
                    sound, head = True, known[0][at : at + DATA_OFFSET]
            ahead[key] = (out, slot, result, sound, head)

    def take_checked(self, key: BlockKey, out: np.ndarray) -> bytes | None:
        """The head of ``key``'s record if ``prefetch`` read it into ``out`` from where it still lies and its data
        matched the checksum of its sound head (the record is then served as it landed: nothing more to check);
        None otherwise, the read ahead left for ``read_into``, which hands the head and checksum on for the
        pool's own checks."""
        return self.take_checked_many([key], [out])[0]

    def take_checked_many(self, keys: Sequence[BlockKey], outs: Sequence[np.ndarray]) -> list[bytes | None]:
        """``take_checked`` of each key into its out, in order (a key twice: its first out only)."""
        ahead = self._read_ahead
        if not ahead or self._pending or self._staged or self._failed:  # written since (a promotion demoting) or a
            # write failed: read_into settles first, and raises what failed where the per-record way raises it
            return [None] * len(keys)
        heads: list[bytes | None] = []
        slot_of = self._slot_of
        for key, out in zip(keys, outs):
            found = ahead.get(key)
            if found is None or not found[3] or found[0] is not out or slot_of.get(key) != found[1]:
                heads.append(None)
            else:
                del ahead[key]
                heads.append(found[4])  # as it was at prefetch: the key still lies in that slot, its head unchanged
        return heads

    def read_into(self, key: BlockKey, out: np.ndarray) -> tuple[bytes, tuple[int, int] | None] | None:
        """Read the record's data from its shard file straight into ``out`` (flat uint8), hashed as it lands; the
        head (kept in memory since it was written or found on open) and the checksum of what landed, None when the
        shard file is cut short or unreadable (the head still says whether the record is of an older format). A
        record ``prefetch`` already read into this ``out`` from where it still lies is not read again."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        shard, row = divmod(slot, self.shard_slots)
        ahead = self._read_ahead.pop(key, None)
        if ahead is not None and ahead[0] is out and ahead[1] == slot:  # a slot is never reused: the same record
            digest = ahead[2]  # ahead: (out, slot, digest, sound, head)
            if isinstance(digest, OSError):
                raise digest
        else:
            offset = self._offsets[shard][row]
            digest = self._reader.read(shard, offset, out) if offset >= 0 else None
        return self._shard_heads[shard][row].tobytes(), digest

    def close(self) -> None:
        try:
            self._seal()
            self.settle()
        finally:
            self._read_ahead = {}
            self._writer.close()
            self._reader.close()
