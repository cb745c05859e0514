"""The DRAM tier's storage: block records in the slots of TensorStore arrays over preallocated host memory.

The backing store is TensorStore: each slab is a ``[slots, stride]`` uint8 TensorStore array (the ``array`` driver,
``ts.array(..., copy=False)``) whose memory is a preallocated host buffer, and records are written into and read out
of it through TensorStore, without intermediate encodes. A put of a block (``put_block``) and a record received from a
peer (``put_checked``, the Messenger's store) land straight in the slot's memory (the TensorStore array's own buffer),
copied and hashed chunk by chunk in one pass on the caller's thread (``copy_with_checksum``: the slot written with
streaming stores, which skip reading its old lines, each source chunk hashed from cache right after it is copied;
issue 15 eleventh pass: a 70B put 0.28 -> 0.17 CPU s/GB on the Intel Xeon): the two TensorStore hand-offs per record
(data and head) cost more than the copy itself at 384 KiB (put_record 82 -> 55 us per 16-token block, 340 -> 295 us
per 128-token block; a 16-token ``put_many`` 0.49-0.52 -> 0.96-0.97 of memcpy, 128-token 0.74-0.81 -> 0.87-0.88, A/B
in one process, load 4.0). A get (``read_into``) is the same one pass from the slot into the caller's staging buffer
(16-token ``get_many`` 0.36 -> 1.08 of memcpy, 128-token 0.71 -> 0.74, 70B 0.85 -> 0.90, A/B at load 1.2); a record
moved between tiers (``put``) is written through TensorStore. Copies in flight are waited for by ``settle`` (the pool
settles before every read and delete and at the end of every call), which costs a thread hand-off per block instead of
one per copy. The TensorStore memory kvstore this tier used first copied a record on every write and again on every
read, and a put had to join the record into one ``bytes`` first (about 0.3 of memcpy). The record layout in a slot is
the one on SSD and on the wire, so the Messenger sends a slot's bytes as they are (``record`` is a view of the array's
memory, copied by the pool under its lock).

Slabs are allocated when no slot is free and kept for the life of the tier, so a warm pool writes into memory
whose pages are already mapped (fresh pages cost more than the copy). A bounded tier allocates at most its
capacity (in bytes, below); slots are a whole number of pages apart (of cache lines for records under 64 KiB, so
small blocks do not waste most of a page each), from wherever the allocator put the slab (``np.empty``: not
page-aligned; placing records to agree with their sources' alignment was tried, issue 15 ninth pass, and made no
difference to a put).

A received record that lies in an immutable ``bytes`` (the Messenger's message, of one record or of several) is
kept where it arrived when no slot is free (``adopt_checked``): hashed where it lies, not copied, and a record alone
in its message is sent on later as it is (``record`` returns the object, so the sender's ``bytes()`` is no copy
either). That saves the receiver's landing copy, about a quarter of its CPU per GB (issue 15, seventh and ninth
passes). Memory stays within the capacity, counted in bytes: the slabs as allocated plus every kept message whole
while any of its records is held (a message's memory goes only with its last record). A message needs room for all
its bytes when its first record is kept and none for the others; ``has_room`` says whether the next record fits, and
the pool evicts until it does (evicting a record whose message still holds others frees nothing). A free slot,
already paid for, is filled by a copy instead, and a message that could not fit even beside the slabs alone is
copied into a slot. The tier also holds at most its capacity in blocks. A kept record is not in a TensorStore
array (it is never written; its slot is dropped, not reused, when the block goes).

A sender asked for exactly a kept message's records in order (a fetch from a pool that received them, or a push
of them onward) sends that ``bytes`` as it lies (``joined``: the records verified where they lie, no join copy).
grpcio sends only an exact ``bytes`` (a ``bytearray``, ``memoryview`` or ``bytes`` subclass is refused), which it
copies into its own buffer when it sends it. So the slots of records that travel whole (a frame of at most
``PIECE_BYTES``) are laid out as messages (issue 15, thirteenth pass): each slab is a run of groups of
``records_per_message`` slots, each group the buffer of one ``bytes`` object, written in place through a writable
view, with the ``next`` separators between its records written once when it is made. Blocks put together land in a
group's slots in order (free slots are taken in order, and a full pool's LRU victims free them in the order they
were put), and a sender asking for exactly a group's records in order is lent that ``bytes`` (``lend``): no join
copy, the sender's one copy beyond gRPC's own (a 16-token push: 0.21 -> 0.09 CPU s/GB over the bare upload stream
at the sender). While lent, a slot of the group whose block goes is held, not reused, so the ``bytes`` does not
change under gRPC; the sender gives it back when gRPC asks for the next message (``outgoing.Outgoing``). Its
memory is never handed anywhere else: a record read from a group is copied (``bytes()`` of a view of a numpy
array), and ``message_of`` does not take a view of it for a kept ``bytes``. Each slot is still a block of its own
(evicted, freed and reused alone): only the layout is a message's. Building each put as a fresh message instead
(tenth pass, not kept) cost the put 6-9% and made a put's blocks share their message's memory until the last went.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import tensorstore as ts

from mooncake_jax.blocks import BlockKey
from mooncake_jax.transfer.checksum import checksum, copy_with_checksum
from mooncake_jax.transfer.frame import DATA_OFFSET, CorruptBlockError, frame_bytes, record_bytes, record_head
from mooncake_jax.transfer.pieces import PIECE_BYTES, next_separator, records_per_message
from mooncake_jax.transfer.spec import BlockSpec
from mooncake_jax.transfer.stream_copy import address

GET_STREAM_BYTES = 1 << 20
"""A get of a larger block writes the caller's buffer with streaming stores (it could not stay in the core's L2
anyway, and the stores then skip reading the buffer's old lines: copy-and-hash of 128-token blocks 0.24 -> 0.17 CPU
s/GB, a 70B get in the pool 0.28 -> 0.16, on the Intel Xeon); a smaller one is copied through the cache, where the
engine reading it next finds it (streaming a 16-token one saved nothing: 0.168 against 0.176)."""
PAGE_BYTES = 4096
CACHE_LINE_BYTES = 64
SLAB_BYTES = 256 << 20
"""Most bytes reserved at once when the tier grows (one slot if a record is larger)."""
MAKE_SLOTS = 64
"""Plain slots made at once from a reserved slab: their memory in one numpy buffer (its pages mapped as they are
first written, so a slab's worth made this way costs what one buffer of it would)."""
_CONTEXT = ts.Context({"data_copy_concurrency": {"limit": 1}})
"""TensorStore copies on one thread (records moved between tiers here): more
copy threads only add hand-offs on a 2-core host."""


def as_store(buffer: np.ndarray) -> ts.TensorStore:
    """A writable TensorStore array over ``buffer``'s memory (never a copy)."""
    return ts.array(buffer, copy=False, write=True, context=_CONTEXT)


class _Group:
    """Slots laid out as one wire message (``records_per_message`` records, each after the first behind its
    ``next`` field's tag and length, written once when the group is made), whose memory is the buffer of a ``bytes``
    object (``message``) written in place through a writable view: when a sender asks for exactly its records in
    order, that ``bytes`` is what gRPC is handed, no join copy (``SlotStore.lend``). ``lent`` counts the sends that
    hold it: a slot of a lent group whose block goes is ``held`` (not reused) until the last is given back."""

    __slots__ = ("message", "memory", "size", "lent", "held")

    def __init__(self, message: bytes, memory: np.ndarray, size: int) -> None:
        self.message = message
        self.memory = memory
        self.size = size
        self.lent = 0
        self.held: list[_Slot] = []


def _writable_view(message: bytes) -> np.ndarray:
    """A writable uint8 view of a ``bytes`` object's buffer (the object must outlive the view: ``_Group`` holds
    both)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * len(message)).from_address(_address(message)))


class _Slot:
    """One record's place in a slab: its memory as numpy (for hashing and views) and as TensorStore (for I/O); or a
    received record kept as it arrived (``adopted``: the record, a ``bytes`` or a view into its ``message``;
    ``memory`` a read-only view of it). ``group`` / ``index``: the message-shaped group it is record ``index`` of
    (None for a slot of a plain slab)."""

    __slots__ = ("memory", "record", "head", "data", "adopted", "message", "data_address", "group", "index")

    def __init__(self, memory: np.ndarray, store: ts.TensorStore | None, adopted: bytes | memoryview | None = None,
                 message: bytes | None = None, group: _Group | None = None, index: int = 0) -> None:
        self.memory = memory
        self.record = store
        self.head = memoryview(memory[:DATA_OFFSET])  # the record head, written from bytes without numpy
        self.data = memory[DATA_OFFSET:]  # the block's bytes, viewed once (a put or get copies into or out of it)
        # a slab slot's address, looked up once (numpy's lookup costs 3-4 us a call); a kept record's when read
        self.data_address = address(self.data) if store is not None else None
        self.adopted = adopted
        self.message = message
        self.group = group
        self.index = index


def message_of(record: bytes | memoryview) -> bytes | None:
    """The immutable ``bytes`` that ``record`` lies in (itself, or what a view views), or None: only such a buffer
    can be kept as received (exactly ``bytes``: a subclass might be mutable)."""
    if type(record) is bytes:
        return record
    if type(record) is memoryview and type(record.obj) is bytes:
        return record.obj
    return None


def _address(buffer: bytes | memoryview) -> int:
    """Where ``buffer``'s first byte lies in memory."""
    return address(np.frombuffer(buffer, np.uint8))


def joined(records: Sequence[bytes | memoryview], separator: bytes) -> bytes:
    """``separator.join(records)``: one copy, unless the records already lie in one immutable ``bytes`` exactly
    so (records kept in a message as it was received, asked for in its order), which is then
    that ``bytes`` itself: a message relayed as it lies, no copy. The message is returned only when it holds
    nothing but these records in this order with ``separator`` between them, so it is byte for byte the join."""
    if len(records) > 1:
        message = message_of(records[0])
        if message is not None and _tiles(message, records, separator):
            return message
    return separator.join(records)


def _tiles(message: bytes, records: Sequence[bytes | memoryview], separator: bytes) -> bool:
    """Whether ``records`` are views into ``message`` that cover it in order, ``separator`` between them."""
    size, gap = len(records[0]), len(separator)
    step = size + gap
    if len(message) != len(records) * step - gap:
        return False
    base = _address(message)
    for i, record in enumerate(records):
        if type(record) is not memoryview or record.obj is not message or record.nbytes != size:
            return False
        if _address(record) != base + i * step:
            return False
    view = memoryview(message)
    return all(view[i * step - gap : i * step] == separator for i in range(1, len(records)))


class SlotStore:
    """Records of one ``BlockSpec`` in reusable slots of TensorStore arrays over host memory, by key."""

    def __init__(self, spec: BlockSpec, capacity_blocks: int | None) -> None:
        self.spec = spec
        self.record_bytes = record_bytes(spec)
        align = PAGE_BYTES if self.record_bytes >= 16 * PAGE_BYTES else CACHE_LINE_BYTES
        self._stride = -(-self.record_bytes // align) * align
        self._capacity_bytes = None if capacity_blocks is None else capacity_blocks * self._stride
        self._allocated = 0  # slots counted against the capacity: made, or reserved and not yet made (_unmade)
        self._unmade = 0
        self._kept: dict[int, list] = {}  # id(message) -> [message, records of it held]: counted whole while held
        self._kept_bytes = 0
        self._slabs: list[ts.TensorStore] = []
        self._free: list[_Slot] = []
        self._slot_of: dict[BlockKey, _Slot] = {}
        self._pending: list[tuple[BlockKey, ts.Future]] = []
        # records that travel whole in a message (at most PIECE_BYTES of frame) sit in message-shaped groups
        n_frame = frame_bytes(spec)
        self.group_size = records_per_message(n_frame) if n_frame <= PIECE_BYTES else 0
        self.separator = next_separator(self.record_bytes)
        self._groups: dict[int, _Group] = {}  # id(group.message) -> group

    def _take_slot(self) -> _Slot:
        if not self._free:
            if not self._unmade:
                self._reserve()
            self._make_slots()
        return self._free.pop()

    def _reserve(self) -> None:
        """Count a slab's worth of slots as allocated (``used_bytes``): their memory is taken as they are made
        (``_make_slots``), so a small record's slab of 256 MiB costs nothing up front. Making every slot of it at
        once (a TensorStore view each) took 8-9 s for a test's 1 KiB records (233,016 slots)."""
        count = max(1, SLAB_BYTES // self._stride)
        if self._capacity_bytes is not None:
            count = min(count, (self._capacity_bytes - self.used_bytes) // self._stride)
        if count < 1:
            raise RuntimeError("the DRAM tier has no free slot (the pool evicts before it writes)")
        self._allocated += count
        self._unmade = count

    def _make_slots(self) -> None:
        """Make the next free slots of the reserved slab: one message-shaped group, or up to ``MAKE_SLOTS`` plain
        slots over one numpy buffer (pushed so that they are taken in order: blocks put together fill a group in
        order)."""
        if self.group_size:
            slots = self._new_group(min(self.group_size, self._unmade))
        else:
            count, size = min(MAKE_SLOTS, self._unmade), self.record_bytes
            memory = np.empty((count, self._stride), np.uint8)
            slab = as_store(memory)
            self._slabs.append(slab)
            slots = [_Slot(memory[i, :size], slab[i, :size]) for i in range(count)]
        self._unmade -= len(slots)
        self._free.extend(reversed(slots))

    def _new_group(self, count: int) -> list[_Slot]:
        """``count`` slots laid out as one message of ``count`` records (``_Group``), in order. Its bytes are
        counted at ``count`` slot strides (``used_bytes``), which is more than they take."""
        size, gap = self.record_bytes, len(self.separator)
        step = size + gap
        message = bytes(count * step - gap)
        memory = _writable_view(message)
        for i in range(1, count):
            memory[i * step - gap : i * step] = np.frombuffer(self.separator, np.uint8)
        group = _Group(message, memory, count)
        self._groups[id(message)] = group
        store = as_store(memory)
        self._slabs.append(store)
        return [_Slot(memory[i * step : i * step + size], store[i * step : i * step + size].translate_to[0],
                      group=group, index=i) for i in range(count)]

    def lend(self, keys: Sequence[BlockKey]) -> bytes | None:
        """The message-shaped group holding exactly the records of ``keys`` in this order (its whole ``bytes``,
        ``separator`` between the records: byte for byte their join), lent until ``give_back``: while lent, a slot
        of it whose block goes is not reused, so the ``bytes`` does not change under gRPC, which copies it into its
        own buffer when it sends it. None when the records lie otherwise (a join copy then)."""
        first = self._slot_of.get(keys[0]) if keys else None
        group = None if first is None else first.group
        if group is None or first.index != 0 or len(keys) != group.size:
            return None
        for i in range(1, len(keys)):
            slot = self._slot_of.get(keys[i])
            if slot is None or slot.group is not group or slot.index != i:
                return None
        size, gap = self.record_bytes, len(self.separator)
        view = memoryview(group.message)
        if any(view[i * (size + gap) - gap : i * (size + gap)] != self.separator for i in range(1, group.size)):
            return None  # not expected (nothing writes there): the join copy is right whatever happened
        group.lent += 1
        return group.message

    def give_back(self, message: object) -> None:
        """End one loan of ``message`` (``lend``); nothing for a message that is not a lent group."""
        group = self._groups.get(id(message))
        if group is None or group.message is not message or not group.lent:
            return
        group.lent -= 1
        if not group.lent and group.held:
            self._free.extend(group.held)
            group.held.clear()

    def _slot_for(self, key: BlockKey) -> _Slot:
        slot = self._slot_of.get(key)
        if slot is not None and slot.adopted is not None:  # a received buffer is never written: a slot instead
            self.delete(key)
            slot = None
        if slot is None:
            slot = self._slot_of[key] = self._take_slot()
        return slot

    def put_block(self, key: BlockKey, data: np.ndarray) -> None:
        """Store the block whose bytes are ``data`` (flat uint8): copied into the slot and hashed in one pass (nothing
        in flight afterwards)."""
        slot = self._slot_for(key)
        digest = copy_with_checksum(slot.data, data, dst_address=slot.data_address)
        slot.head[:] = record_head(self.spec, key, digest)

    def put_checked(self, key: BlockKey, head: bytes | memoryview, data: np.ndarray,
                    expected: tuple[int, int]) -> None:
        """Store a record whose data must hash to ``expected``: copied into the slot's memory and hashed in one
        pass, chunk by chunk from cache (nothing in flight afterwards; CorruptBlockError and the slot freed if the
        hash differs)."""
        slot = self._slot_for(key)
        if copy_with_checksum(slot.data, data, dst_address=slot.data_address) != expected:
            self.delete(key)
            raise CorruptBlockError(f"block {key:#018x}: checksum mismatch")
        slot.memory[:DATA_OFFSET] = np.frombuffer(head, np.uint8)

    adopts_records = True
    """``adopt_checked`` keeps a received record where it arrived (see the module docstring)."""

    @property
    def kept_records(self) -> int:
        """How many records are kept in the buffers they arrived in."""
        return sum(held for _, held in self._kept.values())

    @property
    def used_bytes(self) -> int:
        """Memory counted against the capacity: the slabs as allocated plus every kept message whole."""
        return self._allocated * self._stride + self._kept_bytes

    def _keeps(self, message: bytes) -> bool:
        """Whether a record of ``message`` is kept rather than copied when no slot is free: unbounded, or the
        message fits the capacity beside the slabs alone (else it could never fit: copied into a slot)."""
        return self._capacity_bytes is None or self._allocated * self._stride + len(message) <= self._capacity_bytes

    def has_room(self, record: bytes | memoryview | None = None) -> bool:
        """Whether the next record fits without evicting: a free slot, or the memory a new one or ``record``'s
        message (a received record that would be kept) needs; the pool evicts until this holds."""
        if self._capacity_bytes is None or self._free or self._unmade:
            return True
        message = None if record is None else message_of(record)
        if message is not None and self._keeps(message):
            return id(message) in self._kept or self.used_bytes + len(message) <= self._capacity_bytes
        return self.used_bytes + self._stride <= self._capacity_bytes

    def adopt_checked(self, key: BlockKey, record: bytes | memoryview, expected: tuple[int, int]) -> None:
        """Store a received record (its head already checked) whose data must hash to ``expected``, keeping it
        where it lies when no slot is free and it lies in an immutable ``bytes`` (hashed there, never copied), else
        copying it into a slot as ``put_checked`` does. CorruptBlockError, and nothing stored, if the hash
        differs."""
        message = message_of(record)
        if self._free or self._unmade or message is None or self._slot_of.get(key) is not None \
                or not self._keeps(message):
            self.put_checked(key, memoryview(record)[:DATA_OFFSET], np.frombuffer(record, np.uint8, offset=DATA_OFFSET),
                             expected)
            return
        if len(record) != self.record_bytes:
            raise ValueError(f"record of {len(record)} bytes, expected {self.record_bytes}")
        if checksum(memoryview(record)[DATA_OFFSET:]) != expected:
            raise CorruptBlockError(f"block {key:#018x}: checksum mismatch")
        kept = self._kept.get(id(message))
        if kept is None:
            self._kept[id(message)] = [message, 1]
            self._kept_bytes += len(message)
        else:
            kept[1] += 1
        self._slot_of[key] = _Slot(np.frombuffer(record, np.uint8), None, record, message)

    def put(self, key: BlockKey, parts: Sequence[bytes | bytearray | memoryview | np.ndarray], owned: bool) -> None:
        """Store a record given as consecutive parts (already checksummed). ``owned``: the parts stay untouched
        until ``settle`` (else the copies finish before this returns)."""
        flats = [part.reshape(-1).view(np.uint8) if isinstance(part, np.ndarray) else np.frombuffer(part, np.uint8)
                 for part in parts]
        if sum(flat.size for flat in flats) != self.record_bytes:
            raise ValueError(f"record of {sum(flat.size for flat in flats)} bytes, expected {self.record_bytes}")
        slot = self._slot_for(key)
        at = 0
        for flat in flats:
            self._pending.append((key, slot.record[at : at + flat.size].translate_to[0].write(flat)))
            at += flat.size
        if not owned:
            self._finish()

    def record(self, key: BlockKey) -> bytes | memoryview | None:
        """The stored record: a view of the TensorStore array's memory, valid until the slot is reused (the pool
        copies it before releasing its lock), or an adopted record's own immutable ``bytes``."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        return slot.adopted if slot.adopted is not None else memoryview(slot.memory)

    def view(self, key: BlockKey) -> bytes | memoryview | None:
        """The stored record without a copy, for a sender that keeps the block pinned while it sends (the socket
        data plane): a view of a message-shaped group's ``bytes`` (which the view keeps alive), of a plain slab's
        numpy memory (likewise), or a kept record's own ``bytes``. Unlike ``record`` it stays valid once the pool's
        lock is released, as long as the block stays (a pinned block is not evicted, demoted or removed, and a put
        of a held key only counts a use, so its slot is not rewritten)."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        if slot.adopted is not None:
            return slot.adopted
        if slot.group is not None:
            start = slot.index * (self.record_bytes + len(self.separator))
            return memoryview(slot.group.message)[start : start + self.record_bytes]
        return memoryview(slot.memory)

    def read_into(self, key: BlockKey, out: np.ndarray) -> tuple[memoryview, tuple[int, int]] | None:
        """Copy the block's data into ``out`` (flat uint8) and hash the bytes copied, in one pass; its record head
        and that checksum (so what is verified is what the caller got)."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        digest = copy_with_checksum(out, slot.data, stream=out.nbytes > GET_STREAM_BYTES,
                                    src_address=slot.data_address)
        return memoryview(slot.memory[:DATA_OFFSET]), digest

    def prefetch(self, keys: Sequence[BlockKey], outs: Sequence[np.ndarray] | None = None,
                 addresses: Sequence[int] | None = None) -> None:
        """Nothing to do: the records are in memory."""

    def delete(self, key: BlockKey) -> None:
        if self._pending:
            self._finish()
        slot = self._slot_of.pop(key, None)
        if slot is not None and slot.adopted is not None:
            kept = self._kept[id(slot.message)]  # its buffer goes with the last reference (a sender may hold it)
            kept[1] -= 1
            if not kept[1]:  # the message's last record: its memory no longer counts
                del self._kept[id(slot.message)]
                self._kept_bytes -= len(slot.message)
        elif slot is not None and slot.group is not None and slot.group.lent:
            slot.group.held.append(slot)  # its bytes are being sent: reused once given back
        elif slot is not None:
            self._free.append(slot)

    def _finish(self) -> list[tuple[BlockKey, Exception]]:
        failed = []
        for key, copy in self._pending:
            try:
                copy.result()
            except Exception as err:  # not seen: a copy between arrays of one shape does not fail
                failed.append((key, err))
        self._pending.clear()
        for key, _ in failed:
            self.delete(key)
        return failed

    def settle(self) -> list[tuple[BlockKey, Exception]]:
        """Wait for the copies in flight (every read, delete and the end of every pool call settles first)."""
        return self._finish() if self._pending else []

    def close(self) -> None:
        self._finish()
        self._slot_of.clear()
        self._kept.clear()
        self._kept_bytes = 0
        self._free.clear()
        self._unmade = 0
        self._slabs.clear()
        self._groups.clear()

