"""The block index as flat hash tables walked by compiled code: ``BlockIndex``'s answers at a fraction of its cost.

Where numba is installed, ``ClusterState`` keeps its block index here (``index_kernels.py``): one ``uint64`` table of
key, holder mask and SSD mask per row, and one of expectations, (key, slot) -> the time the block is expected to
land; open addressing, exact. Without numba, or with ``compiled=False``, the dict ``BlockIndex`` answers the same
questions the same way: ``tests/test_conductor_flat_index.py`` drives both and a plain dict of sets with the same
random operations, and ``tests/test_conductor_decision_oracle.py`` runs its decisions on both.

What differs from ``BlockIndex`` besides speed: a count per slot instead of its key set (a purge scans the table,
compiled: milliseconds at 10^6 keys, once per departing instance), and expectations due by now forgotten for every
slot in one sweep each time their number has doubled, instead of per slot (``settle``; an expectation already due
and one forgotten answer every question the policy asks the same, see ``settle``). A request's key tuple is
converted to an array once for both its prefix walk and its expected blocks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from mooncake_jax.conductor.index import BlockIndex, Tier
from mooncake_jax.conductor.index_kernels import Compiled, empty_expectations, empty_table

_MAX_LOAD = 0.7
"""Most keys per row before the table doubles: linear probing's runs stay a few rows (a miss reads ~6 at 0.7)."""
_MAX_EXPECTED_LOAD = 0.5
"""The same for the expectations' table: most lookups there are of keys it lacks, which read a run to its end."""
_SWEEP_FLOOR = 4096
"""Expectations kept at least before a sweep (``settle``)."""


class FlatBlockIndex(BlockIndex):
    """``BlockIndex``'s interface over two flat tables (``index_kernels``); ``ops``: the compiled table operations
    (``index_kernels.compiled()``). Inherits only ``match`` and ``reset``, which are written over the others."""

    def __init__(self, ops: Compiled, capacity: int = 1024):  # (none of BlockIndex's dicts: not calling its init)
        if capacity < 2 or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two of at least 2, got {capacity!r}")
        self._ops = ops
        self._width = 1  # 64-bit words of a mask: slots 0..63 per word
        self._table = empty_table(capacity, self._width)
        self._pend, self._ptime = empty_expectations(capacity)
        # keys held, expectations kept, and the two tables' load bounds (the kernels check them: ``_room``)
        self._stats = np.array([0, 0, int(_MAX_LOAD * capacity), int(_MAX_EXPECTED_LOAD * capacity)], np.int64)
        self._counts = np.zeros((2, 64), np.int64)  # per slot: keys held, keys expected
        self._latest = np.full(64, -math.inf)  # per slot: the latest ready time ever expected there (since a purge)
        self._sweep_above = _SWEEP_FLOOR
        self._levels = np.empty((65, 2), np.uint64)  # the prefix walk's levels: at most one per slot
        self._times = np.empty(64)  # ready_times' answers
        self._last_keys: tuple[int, ...] | None = None  # the last key tuple converted, and its array
        self._last_array = np.empty(0, np.uint64)

    def __len__(self) -> int:
        return int(self._stats[0])

    def blocks_of(self, slot: int) -> int:
        return int(self._counts[0, slot]) if 0 <= slot < self._counts.shape[1] else 0

    def reserve(self, keys: int) -> None:
        """Room for ``keys`` keys within the load bound now, so that the table does not double while it fills (a
        doubling rehashes every key: ~283 ms at 1.47M keys, on the decision path when a store brings it)."""
        self._make_room(0, max(0, int(keys) - int(self._stats[0])), 0)

    @property
    def rows(self) -> int:
        """The key table's rows (its capacity; it holds at most ``_MAX_LOAD`` of them)."""
        return self._table.shape[0] - 1

    def store(self, slot: int, keys: Iterable[int], tier: Tier = Tier.DRAM) -> None:
        array = self._array(keys)
        while not self._ops.store(self._table, array, slot, tier == Tier.SSD, self._counts, self._stats, self._pend,
                                  self._ptime):
            self._make_room(slot, len(array), 0)

    def expect(self, slot: int, keys: Sequence[int], ready_at: float, first: int = 0) -> None:
        # the hot path (once per accepted request, with the request's tuple: converted already by its prefix walk)
        array = self._last_array if keys is self._last_keys else self._array(keys)
        while self._ops.expect(self._table, array, first, slot, float(ready_at), self._counts, self._latest,
                               self._stats, self._pend, self._ptime) < 0:
            self._make_room(slot, len(array) - first, len(array) - first)

    def remove(self, slot: int, keys: Iterable[int]) -> None:
        if self.blocks_of(slot):
            self._ops.remove(self._table, self._array(keys), slot, self._counts, self._stats, self._pend, self._ptime)

    def purge(self, slot: int) -> int:
        if not 0 <= slot < self._counts.shape[1]:
            return 0
        return int(self._ops.purge(self._table, slot, self._counts, self._latest, self._stats, self._pend,
                                   self._ptime))

    def has_pending(self, slot: int) -> bool:
        return 0 <= slot < self._counts.shape[1] and self._counts.item(1, slot) > 0

    def pending_until(self, slot: int) -> float:
        # (on the decision path whenever a group fetches: ``item`` reads a number without making a numpy scalar)
        return self._latest.item(slot) if self.has_pending(slot) else -math.inf

    def ready_times(self, slot: int, keys: Sequence[int], count: int | None = None) -> list[float]:
        array = self._last_array if keys is self._last_keys else self._array(keys)
        if count is not None:
            array = array[:count]
        if self._times.shape[0] < len(array):
            self._times = np.empty(2 * len(array))
        self._ops.ready_times(self._pend, self._ptime, slot, array, self._counts, self._times)
        return self._times[:len(array)].tolist()

    def settle(self, slot: int, now: float) -> None:
        """Forget every slot's expectations already due by ``now``, once their number has doubled since the last
        sweep (amortised O(1) per expected block; instances that never confirm their blocks stay bounded).

        One sweep for all slots, not one per slot as ``BlockIndex.settle``: a sweep reads the whole table. An
        expectation due by ``now`` answers ``ready_times`` with a time at or before ``now`` where a forgotten one
        answers -inf, and the policy reads either as "there now" (a send starts when the sender is free, and a
        start before now waits for nothing), so when they are forgotten changes no decision."""
        if self._stats.item(1) > self._sweep_above:
            kept = self._ops.sweep(self._pend, self._ptime, float(now), self._counts, self._stats)
            self._sweep_above = max(_SWEEP_FLOOR, 2 * kept)

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
        if self._width == 1:
            return list(map(tuple, self._levels[:count].tolist()))
        return [(row[0], sum(word << (64 * w) for w, word in enumerate(row[1:])))
                for row in self._levels[:count].tolist()]

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

    def _make_room(self, slot: int, adding: int, expecting: int) -> None:
        """Mask words for ``slot``, and room for ``adding`` more keys and ``expecting`` more expectations within the
        load bounds (a table doubles as often as needed)."""
        if slot < 0:
            raise ValueError(f"slot must be non-negative, got {slot}")
        if slot >= 64 * self._width:
            self._widen(slot // 64 + 1)
        stats = self._stats
        rows = self._table.shape[0] - 1
        if stats[0] + adding > stats[2]:
            while stats[0] + adding > _MAX_LOAD * rows:
                rows *= 2
            table = empty_table(rows, self._width)
            self._ops.rehash(self._table, table)
            self._table, stats[2] = table, int(_MAX_LOAD * rows)
        rows = self._pend.shape[0]
        if stats[1] + expecting > stats[3]:
            while stats[1] + expecting > _MAX_EXPECTED_LOAD * rows:
                rows *= 2
            pend, ptime = empty_expectations(rows)
            self._ops.prehash(self._pend, self._ptime, pend, ptime)
            self._pend, self._ptime, stats[3] = pend, ptime, int(_MAX_EXPECTED_LOAD * rows)

    def _widen(self, width: int) -> None:
        """Masks of ``width`` words (a slot beyond the last word): rows stay where they are (the hash is the key's)."""
        old, w = self._table, self._width
        table = np.zeros((old.shape[0], 1 + 2 * width), np.uint64)
        table[:, 0] = old[:, 0]
        table[:, 1:1 + w] = old[:, 1:1 + w]
        table[:, 1 + width:1 + width + w] = old[:, 1 + w:]
        self._table, self._width = table, width
        grown = 64 * width - self._counts.shape[1]
        self._counts = np.concatenate([self._counts, np.zeros((2, grown), np.int64)], axis=1)
        self._latest = np.concatenate([self._latest, np.full(grown, -math.inf)])
        self._levels = np.empty((64 * width + 1, 1 + width), np.uint64)
