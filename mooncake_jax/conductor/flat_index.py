"""The block index as a flat hash table walked by compiled code: ``BlockIndex``'s answers, a few times faster.

Where numba is installed, ``ClusterState`` keeps its block index here (``index_kernels.py``: one ``uint64`` table,
key, holder mask and SSD mask per row, open addressing); without it, or with ``compiled=False``, in the dict
``BlockIndex``. Both give the same answers to every question: ``tests/test_conductor_flat_index.py`` drives both
and a plain dict of sets with the same random operations, and ``tests/test_conductor_decision_oracle.py`` runs its
decisions on both.

What stays as in ``BlockIndex`` (inherited): the expected blocks' ready times, per slot in small dicts (a few
thousand entries at most, settled as they double: cache-resident, and read by key from Python). What differs:
holder masks in the table instead of dicts of Python ints, a count per slot instead of its key set (a purge scans
the table, compiled: milliseconds at 10^6 keys, once per departing instance), and a request's key tuple converted
to an array once for both its prefix walk and its expected blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from mooncake_jax.conductor.index import BlockIndex, Tier
from mooncake_jax.conductor.index_kernels import Compiled, empty_table

_MAX_LOAD = 0.7
"""Most keys per row before the table doubles: linear probing's runs stay a few rows (a miss reads ~6 at 0.7)."""


class FlatBlockIndex(BlockIndex):
    """``BlockIndex`` with its holder and SSD masks in a flat table (``index_kernels``); ``ops``: the compiled
    table operations (``index_kernels.compiled()``)."""

    def __init__(self, ops: Compiled, capacity: int = 1024):
        super().__init__()
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two of at least 2, got {capacity!r}")
        self._ops = ops
        self._width = 1  # 64-bit words of a mask: slots 0..63 per word
        self._table = empty_table(capacity, self._width)
        self._limit = int(_MAX_LOAD * capacity)  # most keys the table holds before it doubles
        self._stats = np.zeros(1, np.int64)  # distinct keys held
        self._counts = np.zeros(64, np.int64)  # keys each slot holds
        self._levels = np.empty((65, 2), np.uint64)  # the prefix walk's levels: at most one per slot
        self._new = np.empty(64, np.uint64)  # an expect's new keys
        self._last_keys: tuple[int, ...] | None = None  # the last key tuple converted, and its array
        self._last_array = np.empty(0, np.uint64)

    def __len__(self) -> int:
        return int(self._stats[0])

    def blocks_of(self, slot: int) -> int:
        return int(self._counts[slot]) if 0 <= slot < self._counts.shape[0] else 0

    def store(self, slot: int, keys: Iterable[int], tier: Tier = Tier.DRAM) -> None:
        array = self._array(keys)
        while not self._ops.store(self._table, array, slot, tier == Tier.SSD, self._counts, self._stats, self._limit):
            self._make_room(slot, len(array))
        pending = self._ready.get(slot)
        if pending:
            for key in array.tolist():
                pending.pop(key, None)

    def expect(self, slot: int, keys: Sequence[int], ready_at: float, first: int = 0) -> None:
        # the hot path (once per accepted request, with the request's tuple: converted already by its prefix walk)
        array = self._last_array if keys is self._last_keys else self._array(keys)
        new = self._ops.expect(self._table, array, first, slot, self._counts, self._stats, self._new, self._limit)
        while new < 0:
            self._make_room(slot, len(array) - first)
            new = self._ops.expect(self._table, array, first, slot, self._counts, self._stats, self._new,
                                   self._limit)
        if not new:
            return
        pending = self._ready.get(slot)
        if pending is None:
            pending = self._ready[slot] = {}
        pending.update(dict.fromkeys(self._new[:new].tolist(), ready_at))
        if ready_at > self._latest_ready.get(slot, -math.inf):
            self._latest_ready[slot] = ready_at

    def remove(self, slot: int, keys: Iterable[int]) -> None:
        if not self.blocks_of(slot):
            return
        array = self._array(keys)
        self._ops.remove(self._table, array, slot, self._counts, self._stats)
        pending = self._ready.get(slot)
        if pending:
            for key in array.tolist():
                pending.pop(key, None)

    def purge(self, slot: int) -> int:
        self._ready.pop(slot, None)
        self._settle_above.pop(slot, None)
        self._latest_ready.pop(slot, None)
        if not self.blocks_of(slot):
            return 0
        return int(self._ops.purge(self._table, slot, self._counts, self._stats))

    def holders(self, key: int) -> list[int]:
        row = self._row(key)
        if row < 0:
            return []
        words = self._table[row, 1:1 + self._width].tolist()
        return [64 * w + b for w, word in enumerate(words) for b in range(64) if word >> b & 1]

    def tier(self, key: int, slot: int) -> Tier | None:
        row = self._row(key)
        word, bit = 1 + (slot >> 6), 1 << (slot & 63)
        if row < 0 or not 0 < word <= self._width or not int(self._table[row, word]) & bit:
            return None
        return Tier.SSD if int(self._table[row, word + self._width]) & bit else Tier.DRAM

    def match_levels(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        array = self._last_array if keys is self._last_keys else self._array(keys)
        count = self._ops.match_levels(self._table, array, self._levels)
        if not count:
            return []
        rows = self._levels[:count].tolist()
        if self._width == 1:
            return list(map(tuple, rows))
        return [(row[0], sum(word << (64 * w) for w, word in enumerate(row[1:]))) for row in rows]

    # ------------------------------------------------------------------------------------------ the table

    def _array(self, keys: Iterable[int]) -> np.ndarray:
        """``keys`` as a ``uint64`` array; the last tuple's array is kept, so a request's keys are converted once for
        its prefix walk and its expected blocks (a tuple cannot change, and the reference held keeps its identity)."""
        if keys is self._last_keys:
            return self._last_array
        try:
            if isinstance(keys, np.ndarray) and keys.dtype.kind in "iu":
                if keys.dtype.kind == "i" and keys.size and keys.min() < 0:
                    raise OverflowError
                array = np.ascontiguousarray(keys, np.uint64)
            else:
                array = np.fromiter(keys, np.uint64)
        except (OverflowError, TypeError, ValueError):
            raise ValueError("block keys must be unsigned 64-bit integers") from None
        if isinstance(keys, tuple):
            self._last_keys, self._last_array = keys, array
        return array

    def _row(self, key: int) -> int:
        if not 0 <= key < 1 << 64:
            return -1
        return int(self._ops.find(self._table, np.uint64(key)))

    def _make_room(self, slot: int, adding: int) -> None:
        """Mask words for ``slot``, and room for ``adding`` more keys within the load bound (the table doubles)."""
        if slot < 0:
            raise ValueError(f"slot must be non-negative, got {slot}")
        if slot >= 64 * self._width:
            self._widen(slot // 64 + 1)
        if self._new.shape[0] < adding:
            self._new = np.empty(2 * adding, np.uint64)
        rows = self._table.shape[0] - 1
        if len(self) + adding > self._limit:
            while len(self) + adding > _MAX_LOAD * rows:
                rows *= 2
            table = empty_table(rows, self._width)
            self._ops.rehash(self._table, table)
            self._table, self._limit = table, int(_MAX_LOAD * rows)

    def _widen(self, width: int) -> None:
        """Masks of ``width`` words (a slot beyond the last word): rows stay where they are (the hash is the key's)."""
        old, w = self._table, self._width
        table = np.zeros((old.shape[0], 1 + 2 * width), np.uint64)
        table[:, 0] = old[:, 0]
        table[:, 1:1 + w] = old[:, 1:1 + w]
        table[:, 1 + width:1 + width + w] = old[:, 1 + w:]
        self._table, self._width = table, width
        self._counts = np.concatenate([self._counts, np.zeros(64 * width - self._counts.shape[0], np.int64)])
        self._levels = np.empty((64 * width + 1, 1 + width), np.uint64)
