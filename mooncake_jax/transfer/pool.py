"""The KVCache block pool of one instance: blocks keyed by block key in a DRAM tier and an optional SSD tier.

A block enters the fastest tier. When a tier is full its policy picks a victim that is not pinned; a DRAM victim
is demoted to SSD (if there is one) instead of being lost; an SSD hit is promoted back to DRAM and keeps its SSD
copy, so evicting it again costs no write. Every read verifies the block's checksum: a block that fails is
removed, counted as corrupt and as a miss, and never returned. ``contains`` and ``prefix_len`` read only the
in-memory indexes, never storage. One lock serialises operations: they are short, and it keeps eviction,
pinning and demotion simple to reason about.

The SSD tier is written back, not through: a block reaches it when DRAM evicts it. What survives a restart is
what was on SSD; blocks only in DRAM die with the process (they are a cache of recomputable KV).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from mooncake_jax.blocks import BlockKey, prefix_match
from mooncake_jax.transfer.checksum import checksum
from mooncake_jax.transfer.counters import TierCounters
from mooncake_jax.transfer.events import BlockEvent, EventKind, EventListener
from mooncake_jax.transfer.eviction import PolicyChoice, make_policy
from mooncake_jax.transfer.frame import (DATA_OFFSET, MAX_KEY, VERSION, CorruptBlockError, StaleFormatError,
                                         check_digest, check_head, check_key, data_bytes, frame_bytes, record_bytes)
from mooncake_jax.transfer.frame import verify as verify_record
from mooncake_jax.transfer.host_memory import keep_freed_buffers
from mooncake_jax.transfer.shard_reader import PAGE_BYTES
from mooncake_jax.transfer.slots import joined, message_of
from mooncake_jax.transfer.spec import BlockSpec
from mooncake_jax.transfer.stream_copy import writable_address
from mooncake_jax.transfer.tiers import Tier, TierWriteError, file_tier, memory_tier, picked

log = logging.getLogger(__name__)


def page_aligned_empty(shape: tuple[int, ...], dtype: np.dtype, page_offset: int = 0) -> np.ndarray:
    """An uninitialised C-contiguous array starting at a page boundary (``page_offset`` bytes past one; a page more
    is allocated). Where a get's block lands: the SSD tier's records start page-aligned in their files, and the
    kernel's copy out of the page cache costs 4-8x on the AMD EPYC measured when its destination lies 1-31 bytes past
    its source modulo a page (``shard_reader.ALIASED_BYTES``; such a read goes through a bounce buffer, an extra
    copy), where numpy's own arrays may lie (glibc puts a large one 16 bytes into a page, a reused heap one
    anywhere)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    spare = np.empty(nbytes + PAGE_BYTES, np.uint8)
    shift = (page_offset - writable_address(spare)) % PAGE_BYTES
    return spare[shift : shift + nbytes].view(dtype).reshape(shape)


class PoolFullError(RuntimeError):
    """A block could not be stored because every block of the last tier is pinned."""


def _capacity(tier: str, blocks: int | None, n_bytes: int | None, block_bytes: int) -> int | None:
    """Capacity in blocks from a count or a byte budget (None: unbounded)."""
    if blocks is not None and n_bytes is not None:
        raise ValueError(f"give the {tier} capacity in blocks or in bytes, not both")
    if n_bytes is not None:
        if n_bytes < block_bytes:
            raise ValueError(f"{tier}_bytes={n_bytes} holds no block (one block takes {block_bytes} bytes)")
        return n_bytes // block_bytes
    if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0):
        raise ValueError(f"{tier}_blocks must be an int >= 0, got {blocks!r}")
    return blocks


class BlockPool:
    """Blocks of one ``BlockSpec`` keyed by block key, in DRAM and optionally SSD.

    Args:
        spec: shape and dtype of every block.
        dram_blocks / dram_bytes: DRAM capacity (bytes count whole stored records: the data plus 128 bytes of
            wire prefix and header, see ``frame.py``); both None means unbounded, ``dram_blocks=0`` means no DRAM
            tier.
        ssd_path: directory of the SSD tier (created, or reopened with the blocks it holds); None for no SSD.
        ssd_blocks / ssd_bytes: SSD capacity; None means unbounded.
        ssd_direct_io: write the SSD tier's shard files with ``O_DIRECT`` (copied into aligned pieces, the page
            cache bypassed) instead of through the page cache (``shard_writer.py`` says when each pays).
        eviction: ``"lru"`` (default), ``"lfu"``, or a factory of ``EvictionPolicy`` (one instance per tier).
        on_event: called with a ``BlockEvent`` whenever a block enters the pool, moves to another fastest tier
            or leaves the pool, under the pool's lock: keep it quick (queue the event), do not call back.
    """

    def __init__(
        self,
        spec: BlockSpec,
        *,
        dram_blocks: int | None = None,
        dram_bytes: int | None = None,
        ssd_path: str | os.PathLike | None = None,
        ssd_blocks: int | None = None,
        ssd_bytes: int | None = None,
        ssd_direct_io: bool = False,
        eviction: PolicyChoice = "lru",
        on_event: EventListener | None = None,
    ) -> None:
        if not isinstance(spec, BlockSpec):
            raise ValueError(f"spec must be a BlockSpec, got {type(spec).__name__}")
        keep_freed_buffers()  # the transient buffers of every block moved reuse warm pages (host_memory.py)
        self.spec = spec
        self.frame_bytes = frame_bytes(spec)
        self.record_bytes = record_bytes(spec)
        dram_capacity = _capacity("dram", dram_blocks, dram_bytes, self.record_bytes)
        ssd_capacity = _capacity("ssd", ssd_blocks, ssd_bytes, self.record_bytes)
        if ssd_path is None and ssd_capacity is not None:
            raise ValueError("an SSD capacity was given without ssd_path")
        self._tiers: list[Tier] = []
        if dram_capacity != 0:
            self._tiers.append(memory_tier(spec, dram_capacity, make_policy(eviction)))
        if ssd_path is not None:
            self._tiers.append(file_tier(ssd_path, spec, ssd_capacity, make_policy(eviction), ssd_direct_io))
        if not self._tiers:
            raise ValueError("the pool has no tier: dram capacity is 0 and there is no ssd_path")
        self._listeners: list[EventListener] = [on_event] if on_event is not None else []
        self._pins: dict[BlockKey, int] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._stale_versions: set[int] = set()  # old record formats already reported in the log

    # ---- lookups (no I/O) -------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return any(key in tier for tier in self._tiers)

    def contains(self, key: BlockKey) -> bool:
        return key in self

    def prefix_len(self, keys: Iterable[BlockKey]) -> int:
        """Number of leading ``keys`` the pool holds: the prefix it can serve."""
        return prefix_match(keys, self.__contains__)

    def tier_of(self, key: BlockKey) -> str | None:
        """Name of the fastest tier holding ``key`` (``"dram"`` or ``"ssd"``), or None."""
        for tier in self._tiers:  # a loop, not a generator: this runs twice per block stored
            if key in tier:
                return tier.name
        return None

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return list(set().union(*(tier.keys() for tier in self._tiers)))

    def __len__(self) -> int:
        return len(self.keys())

    def keys_by_tier(self) -> dict[str, list[BlockKey]]:
        """Keys grouped by the fastest tier holding them: the state the events describe (to resend it whole,
        e.g. to a restarted Conductor)."""
        with self._lock:
            grouped: dict[str, list[BlockKey]] = {tier.name: [] for tier in self._tiers}
            for key in self.keys():
                grouped[self.tier_of(key)].append(key)
            return grouped

    @property
    def tier_names(self) -> list[str]:
        return [tier.name for tier in self._tiers]

    def counters(self) -> dict[str, TierCounters]:
        """A snapshot of each tier's counters, by tier name."""
        with self._lock:
            return {tier.name: dataclasses.replace(tier.counters) for tier in self._tiers}

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters and occupancy of each tier as plain dicts (for metrics and JSON)."""
        with self._lock:
            return {
                tier.name: {**tier.counters.as_dict(), "blocks": len(tier), "capacity_blocks": tier.capacity_blocks}
                for tier in self._tiers
            }

    # ---- writes -----------------------------------------------------------------------------------------

    def put(self, key: BlockKey, block: np.ndarray) -> bool:
        """Store ``block`` under ``key``; False (and counted as a use) if the pool already holds it."""
        return self.put_many([key], [block]) == 1

    def put_many(self, keys: Sequence[BlockKey], blocks: Sequence[np.ndarray] | np.ndarray) -> int:
        """Store blocks (a list of arrays or one array stacked on a leading axis); returns how many were new.

        Every block is checked before any is stored, so bad input stores nothing.
        """
        keys = [check_key(key) for key in keys]
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        checked = [self.spec.check(block, f"block {i}") for i, block in enumerate(blocks)]
        stored = 0
        with self._operation():
            for key, block in zip(keys, checked):
                if not self._touch(key):
                    data = data_bytes(block)
                    self._insert(0, key, lambda tier, key=key, data=data: tier.write_block(key, data))
                    stored += 1
        return stored

    def put_record(self, key: BlockKey, record: bytes | bytearray | memoryview) -> bool:
        """Store a block's record (as received from a peer) after verifying it; False if already held.

        The pool keeps a copy, so the caller may reuse ``record``; a record lying in a ``bytes``, which no one can
        change (itself, or a view of a received message of several), the DRAM tier may keep where it lies instead
        (``SlotStore.adopt_checked``: no copy; the message's memory counted until its last record goes). A record
        that fails verification raises ``CorruptBlockError`` (a ValueError) and stores nothing.
        """
        new: list[bool] = []
        self.put_records([(key, record)], new)
        return new[0]

    def put_records(self, records: Sequence[tuple[BlockKey, bytes | bytearray | memoryview]],
                    new: list[bool]) -> None:
        """Store received ``(key, record)`` pairs in order, each as ``put_record`` stores one, under one lock: a
        Messenger message of several small blocks is one pool call, not one per block. Appends to ``new``, per
        record stored, whether it was new (False: already held); when a record fails (``CorruptBlockError``,
        ``PoolFullError``, a ValueError for one that is not bytes) the error is raised with ``new`` holding the
        records stored before it."""
        with self._operation():
            for key, record in records:
                new.append(self._put_checked(check_key(key), record))

    def _put_checked(self, key: BlockKey, record: bytes | bytearray | memoryview) -> bool:
        """``put_record`` with the lock held."""
        if not isinstance(record, (bytes, bytearray, memoryview)):
            raise ValueError(f"record must be bytes, got {type(record).__name__}")
        if isinstance(record, memoryview):
            if not record.c_contiguous:
                raise ValueError("record must be a contiguous buffer")
            record = record.cast("B")
        if len(record) != self.record_bytes:
            raise CorruptBlockError(f"block {key:#018x}: record is {len(record)} bytes, expected {self.record_bytes}")
        head = memoryview(record)[:DATA_OFFSET]
        expected = check_head(self.spec, key, head)
        data = np.frombuffer(record, np.uint8, offset=DATA_OFFSET)
        if self._touch(key):
            check_digest(key, expected, checksum(data))
            return False
        # verified while it is copied in (or hashed where it lies, if kept): a record that fails leaves nothing behind
        whole = record if message_of(record) is not None else None  # in an immutable bytes: may be kept as it is
        self._insert(0, key, lambda tier: tier.write_checked(key, head, data, expected, whole), whole)
        return True

    def remove(self, key: BlockKey) -> bool:
        """Delete ``key`` from every tier; False if absent. Removing a pinned block is a ValueError."""
        key = check_key(key)
        with self._lock:
            if key in self._pins:
                raise ValueError(f"block {key:#018x} is pinned")
            held = [tier for tier in self._tiers if key in tier]
            for tier in held:
                self._drop(tier, key)
            return bool(held)

    # ---- reads ------------------------------------------------------------------------------------------

    def get(self, key: BlockKey) -> np.ndarray | None:
        """The block (a read-only array; copy it to modify it), or None on a miss."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[BlockKey], out: np.ndarray | None = None) -> list[np.ndarray | None]:
        """Blocks of ``keys`` in order, None where missing or corrupt. SSD hits are promoted to DRAM.

        Without ``out`` each block is a read-only array of its own. With ``out`` (a writable array of shape
        ``(len(keys), *spec.shape)`` and the spec's dtype, e.g. a reused staging buffer) block i is copied straight
        from its tier into ``out[i]`` (verified as it lands) and returned as that view: holding many multi-MiB
        results at once makes the allocator take fresh pages from the kernel for every batch, which costs more
        than the copy. ``out[i]`` of a block that was missing is untouched; of one that failed its checksum it
        holds garbage (the result says None).
        """
        keys = [key if type(key) is int and 0 <= key <= MAX_KEY else check_key(key) for key in keys]  # (a call a
        # key is a share of a 16-token get's Python)
        if out is not None:
            expected = (len(keys), *self.spec.shape)
            if not isinstance(out, np.ndarray) or out.shape != expected or out.dtype != self.spec.dtype:
                got = f"{out.dtype.name}{list(out.shape)}" if isinstance(out, np.ndarray) else type(out).__name__
                raise ValueError(f"out must be a {self.spec.dtype.name}{list(expected)} array, got {got}")
            if not out.flags.writeable:
                raise ValueError("out must be writable")
            if not out.flags.c_contiguous:  # a block lands as flat bytes: a strided view would be a copy
                raise ValueError("out must be C-contiguous (np.ascontiguousarray, or a slice of whole blocks)")
        blocks: list[np.ndarray | None] = []
        addresses = None  # where each block starts: known at once for staging (the SSD's batch read needs them)
        if out is not None:
            targets = list(out)
            flats = list(out.reshape(len(keys), -1).view(np.uint8)) if keys else []  # one view a block, not two
            if keys:
                base, step = writable_address(flats[0]), self.spec.nbytes  # (bytes: ctypes takes no bfloat16)
                addresses = range(base, base + step * len(keys), step)
        else:
            targets = [page_aligned_empty(self.spec.shape, self.spec.dtype) for _ in keys]
            flats = [data_bytes(block) for block in targets]
        with self._operation():
            if keys:
                self._check_open()
            below = list(range(len(keys)))  # the keys no faster tier holds
            for level, tier in enumerate(self._tiers):  # disk tiers read ahead of the copies
                if level:
                    upper = self._tiers[level - 1]
                    below = [i for i in below if keys[i] not in upper]
                tier.prefetch(picked(keys, below), picked(flats, below), picked(addresses, below))
            # the fastest tier's batch-checked hits (an SSD-only pool's), taken in one call rather than the per-record
            # path's five a block (about 2 us a 16-token record beside a read and hash of 35, docs/benchmarks/pool.md,
            # nineteenth pass); only the fastest tier's: its hits are served with no promotion, so taking them before
            # the other blocks' reads changes no order of writes (a lower tier's hit is promoted, and its evictions
            # may write into that tier before the next block is read)
            first = self._tiers[0]
            taken = first.take_checked_many(keys, flats) or [None] * len(keys)
            for key, block, flat, head in zip(keys, targets, flats, taken):
                if head is not None:  # a hit, counted and used in key order as the per-record path would
                    self._hit(0, first, key, lambda t: t.write_record(key, (head, flat)))  # (no promotion at 0)
                    found = True
                else:
                    found = self._read_into(key, flat)
                if out is None:
                    block.flags.writeable = False
                blocks.append(block if found else None)
        return blocks

    def get_record(self, key: BlockKey, promote: bool = True, verify: bool = True) -> bytes | None:
        """The verified record of ``key`` (what the Messenger sends), or None on a miss.

        ``promote=False`` serves an SSD hit without copying it into DRAM: a block sent to a peer is not
        thereby hot here. ``verify=False`` (only with ``promote=False``): the record as stored, its checksum not
        checked here, for a sender whose receiver checks it end to end (a Messenger push: the head carries the
        checksum taken when the block was stored, and the receiver hashes the data as it lands); never served or
        stored here unverified.
        """
        key = check_key(key)
        if not verify and promote:
            raise ValueError("an unverified record cannot be promoted: pass promote=False with verify=False")
        with self._operation():
            return self._read_record(key, promote, verify)

    def record_views(self, keys: Sequence[BlockKey]) -> list[bytes | memoryview | None]:
        """The records of ``keys`` as stored, unverified and not copied where the DRAM tier holds them
        (``SlotStore.view``), for a sender that pins the blocks for as long as it uses the views (the socket data
        plane sends them with ``sendmsg``; the receiver checks each end to end). A block held only below DRAM is
        read (a copy, unverified, not promoted); None for a key no tier can serve. Counted as hits."""
        keys = [check_key(key) for key in keys]
        out: list[bytes | memoryview | None] = []
        with self._operation():
            self._check_open()
            for key in keys:
                record = None
                for level, tier in enumerate(self._tiers):
                    if key not in tier:
                        tier.counters.misses += 1
                        continue
                    view = getattr(tier.store, "view", None) if level == 0 else None
                    try:
                        if view is not None:
                            tier.settle()
                            record = view(key)
                            tier.counters.bytes_read += 0 if record is None else len(record)
                        else:
                            record = tier.read_record(key)
                            record = None if record is None else bytes(record)
                    except OSError as err:
                        self._unavailable(tier, key, err)
                        continue
                    if record is not None:
                        self._hit(0, tier, key, lambda _: None)
                        break
                out.append(record)
        return out

    def join_records(self, keys: Sequence[BlockKey], separator: bytes,
                     verify: bool = True, lend: bool = False) -> tuple[bytes, int]:
        """The verified records of the leading ``keys``, joined into one ``bytes`` with ``separator`` between them
        (copied once, straight out of their slots: the Messenger sends several small blocks to a message; or no
        copy at all when they are exactly the records of one message kept as received, in order, which is then
        returned as it lies, ``slots.joined``), and how many it holds. It stops before the first key its fastest
        tier cannot serve (absent, or failing its checksum: dropped as a bad block), for ``get_record`` to try the
        tiers below. Not promoted, as ``promote=False``. ``verify=False``: the records as stored, their checksums not
        checked here (``get_record``'s ``verify``): a corrupt one is then sent, for the receiver to refuse.

        ``lend=True`` (a sender that hands the message to gRPC and then calls ``give_back(message)`` once gRPC has
        taken it, ``outgoing.Outgoing``): when the records fill one of the DRAM tier's message-shaped slot groups in
        order (blocks put together, asked for in the order put, ``slots.SlotStore.lend``), the message is that
        group's own ``bytes``, no join copy; its slots are not reused until it is given back. The caller must not
        keep it past ``give_back``."""
        keys = [check_key(key) for key in keys]
        with self._operation():
            self._check_open()
            parts: list[bytes | memoryview] = []
            found: list[tuple[Tier, BlockKey]] = []
            for key in keys:
                tier = None
                for candidate in self._tiers:
                    if key in candidate:
                        tier = candidate
                        break
                    candidate.counters.misses += 1
                try:
                    record = None if tier is None else tier.read_record(key)
                except OSError as err:
                    self._unavailable(tier, key, err)
                    break
                if record is None or len(record) != self.record_bytes:
                    break
                parts.append(record)
                found.append((tier, key))
            # a group of slots lent as it lies; else one copy (the slots' views are valid until the lock is
            # released), or none when the records lie in one received message in this order: relayed as it is
            lent = None
            if lend and found:
                lent = self._lend([key for _, key in found], found, separator)
            message = lent if lent is not None else joined(parts, separator)
            view, at = memoryview(message), 0
            for i, (tier, key) in enumerate(found):
                try:  # the copy is verified: what is sent is what was checked
                    if verify:
                        verify_record(self.spec, key, view[at : at + self.record_bytes])
                except CorruptBlockError as err:
                    self._bad_block(tier, key, err)
                    cut = message[: max(at - len(separator), 0)]
                    if lent is not None:
                        self._tiers[0].store.give_back(lent)
                    return cut, i
                self._hit(0, tier, key, lambda _: None)
                at += self.record_bytes + len(separator)
            return message, len(found)

    def _lend(self, keys: list[BlockKey], found: list[tuple[Tier, BlockKey]], separator: bytes) -> bytes | None:
        """The DRAM tier's slot group holding exactly ``keys``' records in order with ``separator`` between them,
        lent (``join_records``)."""
        tier = self._tiers[0]
        if getattr(tier.store, "separator", None) != separator or any(holder is not tier for holder, _ in found):
            return None
        return tier.store.lend(keys)

    def give_back(self, message: object) -> None:
        """End a loan of ``message`` from ``join_records(..., lend=True)``; nothing for any other object."""
        with self._lock:
            if self._tiers and hasattr(self._tiers[0].store, "give_back"):
                self._tiers[0].store.give_back(message)

    @contextlib.contextmanager
    def pin(self, keys: Iterable[BlockKey]) -> Iterator[list[BlockKey]]:
        """Keep ``keys`` from being evicted (or demoted) while the block runs; pins nest and count.

        Keys need not be present: a key stored while pinned is protected too.
        """
        pinned = [check_key(key) for key in keys]
        with self._lock:
            for key in pinned:
                self._pins[key] = self._pins.get(key, 0) + 1
        try:
            yield pinned
        finally:
            with self._lock:
                for key in pinned:
                    if self._pins[key] == 1:
                        del self._pins[key]
                    else:
                        self._pins[key] -= 1

    def subscribe(self, listener: EventListener) -> None:
        """Also send block events to ``listener`` (same rules as ``on_event``)."""
        with self._lock:
            self._listeners.append(listener)

    def close(self) -> None:
        """Release the DRAM tier's memory; the SSD tier's array stays for the next open. Reads and writes after
        this are a ValueError; lookups answer as for an empty pool."""
        with self._operation():  # finishes writes in flight on the way out
            self._closed = True
        with self._lock:
            for tier in self._tiers:
                tier.close()
            self._tiers = []

    def __enter__(self) -> BlockPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals (lock held) --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        """Hold the lock and, before releasing it, finish the writes the operation started.

        A failed write surfaces here (TierWriteError, an OSError): its block was announced in that tier, so the
        change is announced again before the error propagates.
        """
        with self._lock:
            try:
                try:
                    yield
                finally:
                    for tier in self._tiers:
                        tier.settle()
            except TierWriteError as err:
                for key in err.keys:
                    self._announce(key, err.tier)
                raise

    def _touch(self, key: BlockKey) -> bool:
        """Count a use of ``key`` in the fastest tier holding it; False if no tier does."""
        self._check_open()
        for tier in self._tiers:
            if key in tier:
                tier.accessed(key)
                return True
        return False

    def _insert(self, level: int, key: BlockKey, write: Callable[[Tier], None],
                whole: bytes | memoryview | None = None) -> int:
        """Store ``key`` by ``write(tier)`` in tier ``level`` (or, if every block there is pinned, a lower one),
        evicting until it fits (``whole``: a received record the DRAM tier may keep with its message, which needs
        the message's memory; evicting a record whose message still holds others frees none); returns the level."""
        tier = self._tiers[level]
        if key in tier:
            tier.accessed(key)
            return level
        while not tier.has_room(whole):
            if self._evict_one(level):
                continue
            if level + 1 < len(self._tiers):
                return self._insert(level + 1, key, write)
            raise PoolFullError(
                f"cannot store block {key:#018x}: all {len(tier)} blocks of the {tier.name} tier left are pinned"
            )
        before = self.tier_of(key) if self._listeners else None
        write(tier)
        self._announce(key, before)
        return level

    def _evict_one(self, level: int) -> bool:
        """Free one slot of tier ``level``, demoting the victim to the next tier; False if all are pinned."""
        tier = self._tiers[level]
        victim = tier.policy.victim(self._pins)
        if victim is None:
            return False
        if level + 1 < len(self._tiers):
            lower = self._tiers[level + 1]
            record = None if victim in lower else tier.read_record(victim)
            try:
                if record is not None:  # written before its slot is reused (owned=False); checked when read back
                    self._insert(level + 1, victim, lambda t: t.write_record(victim, (record,), owned=False))
                tier.counters.demotions += victim in lower
            except PoolFullError:
                log.warning("dropping block %#018x: no unpinned room below the %s tier", victim, tier.name)
        tier.counters.evictions += 1
        self._drop(tier, victim)
        return True

    def _read_into(self, key: BlockKey, out: np.ndarray) -> bool:
        """Copy ``key``'s data from the fastest tier holding a sound copy into ``out`` (flat uint8), verified as
        it lands, promoting an SSD hit; False on a miss."""
        self._check_open()
        for level, tier in enumerate(self._tiers):
            if key not in tier:
                tier.counters.misses += 1
                continue
            head = tier.take_checked(key, out)  # read ahead and checked in the tier's batch read (SSD)
            if head is not None:
                self._hit(level, tier, key, lambda t: t.write_record(key, (head, out)))
                return True
            try:
                found = tier.read_into(key, out)
            except OSError as err:
                self._unavailable(tier, key, err)
                continue
            try:
                if found is None:
                    raise CorruptBlockError(f"block {key:#018x}: lost from the {tier.name} tier")
                head, digest = found
                expected = check_head(self.spec, key, head)  # an older format is stale, whatever its data
                if digest is None:
                    raise CorruptBlockError(f"block {key:#018x}: its data is cut short or unreadable")
                check_digest(key, expected, digest)
            except CorruptBlockError as err:
                self._bad_block(tier, key, err)
                continue
            self._hit(level, tier, key, lambda t: t.write_record(key, (head, out)))
            return True
        return False

    def _read_record(self, key: BlockKey, promote: bool, verify: bool = True) -> bytes | None:
        """The verified record of ``key`` from the fastest tier holding a sound copy (promoting an SSD hit if
        ``promote``), or None; ``verify=False``: from the fastest tier holding one, unchecked (``get_record``)."""
        self._check_open()
        for level, tier in enumerate(self._tiers):
            if key not in tier:
                tier.counters.misses += 1
                continue
            try:
                record = tier.read_record(key)
            except OSError as err:
                self._unavailable(tier, key, err)
                continue
            try:
                if record is None:
                    raise CorruptBlockError(f"block {key:#018x}: lost from the {tier.name} tier")
                # copied first (a DRAM record is a view of a slot a later write may reuse; an adopted one is
                # immutable bytes, which bytes() returns as it is), then verified: the copy is still in cache
                record = bytes(record)
                if verify:
                    verify_record(self.spec, key, record)
            except CorruptBlockError as err:
                self._bad_block(tier, key, err)
                continue
            self._hit(level if promote else 0, tier, key, lambda t: t.write_record(key, (record,)))
            return record
        return None

    def _hit(self, level: int, tier: Tier, key: BlockKey, promote: Callable[[Tier], None]) -> None:
        """Count a hit of ``key`` in ``tier`` (at ``level``); a hit below DRAM is copied up by ``promote``."""
        tier.counters.hits += 1
        tier.accessed(key)
        if level > 0 and self._insert(0, key, promote) == 0:
            self._tiers[0].counters.promotions += 1

    def _unavailable(self, tier: Tier, key: BlockKey, err: OSError) -> None:
        """A read the process could not make now (out of descriptors or memory: ``shard_reader.UNAVAILABLE``): a
        miss this time, the block kept (it says nothing of the record)."""
        tier.counters.misses += 1
        log.warning("block %#018x: the %s tier cannot be read now (%s); a miss, the block kept", key, tier.name, err)

    def _bad_block(self, tier: Tier, key: BlockKey, err: CorruptBlockError) -> None:
        """Drop a block that failed its checks: stale (another record format) or corrupt, a miss either way."""
        if isinstance(err, StaleFormatError):
            if err.version not in self._stale_versions:  # one line per old format, not one per block
                self._stale_versions.add(err.version)
                log.warning("%s tier: dropping blocks stored in record format version %d (this build writes "
                            "version %d); they are misses and will be recomputed", tier.name, err.version, VERSION)
            tier.counters.stale += 1
        else:
            log.warning("%s tier: %s; treated as a miss", tier.name, err)
            tier.counters.corrupt += 1
        tier.counters.misses += 1
        self._drop(tier, key)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the block pool is closed")

    def _drop(self, tier: Tier, key: BlockKey) -> None:
        before = self.tier_of(key) if self._listeners else None
        tier.delete(key)
        self._announce(key, before)

    def _announce(self, key: BlockKey, before: str | None) -> None:
        """Tell listeners if the fastest tier holding ``key`` is no longer ``before`` (see ``BlockEvent``); nothing
        to work out when none listens (the callers skip ``before`` then: a put of a small block is mostly Python)."""
        if not self._listeners:
            return
        after = self.tier_of(key)
        if after == before:
            return
        event = BlockEvent(EventKind.STORED, key, after) if after else BlockEvent(EventKind.REMOVED, key, before)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a broken listener must not break storage
                log.exception("block event listener failed on %s", event)
