"""Global block index: which instances hold each block key, and in which tier.

The Conductor asks one question per request: for every instance, how many *leading* keys of the prompt does it
hold? Asking each instance separately costs O(blocks x instances). Here each key maps to a bit mask of the
instance slots holding it, and one walk over the prompt's keys ANDs the masks: an instance drops out of the
running mask at the first key it lacks, and is recorded once, then. The walk stops when no instance is left, so
a request costs O(blocks + instances) (the AND of two masks is a handful of machine words for any realistic
cluster size).

Instances are identified by small integer *slots* (bit positions); the cluster state maps instance ids to slots
and gives a slot back only after its entries are purged.

Blocks can be recorded before they exist, with the clock time they are expected (``ready_at``): a request routed
to an instance will leave its blocks there, and requests queued behind it may count on them, but another
instance fetching them must wait until they are there. The instance's own KV event later confirms them.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterable, Sequence

import numpy as np


class Tier(enum.IntEnum):
    """Where an instance keeps a block: host DRAM, or SSD after demotion."""

    DRAM = 0
    SSD = 1


class BlockIndex:
    """Block key -> holding slots (bit mask) and the subset holding it on SSD; per-slot key sets for purges."""

    def __init__(self):
        self._holders: dict[int, int] = {}
        self._on_ssd: dict[int, int] = {}
        self._keys_of: dict[int, set[int]] = {}
        self._ready: dict[int, dict[int, float]] = {}  # slot -> key -> clock time an expected block lands
        self._settle_above: dict[int, int] = {}  # slot -> pending count at which expired entries are dropped
        self._latest_ready: dict[int, float] = {}  # slot -> latest ready time ever expected there (since a purge)

    def __len__(self) -> int:
        """Distinct keys held anywhere."""
        return len(self._holders)

    def reserve(self, keys: int) -> None:
        """Room for ``keys`` keys ahead (``FlatBlockIndex``'s tables; dicts grow by themselves: nothing to do)."""

    def blocks_of(self, slot: int) -> int:
        return len(self._keys_of.get(slot, ()))

    def store(self, slot: int, keys: Iterable[int], tier: Tier = Tier.DRAM) -> None:
        """``slot`` holds ``keys`` in ``tier`` now: an instance's KV event (it confirms expected blocks; a block
        moving between tiers is stored again)."""
        bit = 1 << slot
        holders, on_ssd = self._holders, self._on_ssd
        own = self._keys_of.setdefault(slot, set())
        pending = self._ready.get(slot)
        to_ssd = tier == Tier.SSD
        for key in keys:
            holders[key] = holders.get(key, 0) | bit
            own.add(key)
            if pending:
                pending.pop(key, None)
            if to_ssd:
                on_ssd[key] = on_ssd.get(key, 0) | bit
            elif key in on_ssd:
                self._clear(on_ssd, key, bit)

    def expect(self, slot: int, keys: Sequence[int], ready_at: float, first: int = 0) -> None:
        """``slot`` will hold those of ``keys[first:]`` it lacks from ``ready_at`` on (a request routed there computes
        or fetches them); those it holds already are left as they are."""
        if first:
            keys = keys[first:]
        bit = 1 << slot
        get = self._holders.get
        # the holder mask says whether the slot has it (as its key set does): one lookup a key; the new masks are
        # gathered in a dict, and every update below reads its keys with their stored hashes (nothing hashed
        # twice, one C loop per structure instead of a Python step per key: the hot path)
        new = {key: held | bit for key in keys if not (held := get(key, 0)) & bit}
        if not new:
            return
        self._holders.update(new)
        self._keys_of.setdefault(slot, set()).update(new)
        pending = self._ready.get(slot)
        if pending is None:
            pending = self._ready[slot] = {}
        pending.update(dict.fromkeys(new, ready_at))
        if ready_at > self._latest_ready.get(slot, -math.inf):
            self._latest_ready[slot] = ready_at

    def remove(self, slot: int, keys: Iterable[int]) -> None:
        """``slot`` no longer holds ``keys`` (evicted); keys it never held are ignored."""
        bit = 1 << slot
        own = self._keys_of.get(slot)
        if not own:
            return
        pending = self._ready.get(slot, {})
        for key in keys:
            if key in own:
                own.discard(key)
                pending.pop(key, None)
                self._clear(self._holders, key, bit)
                if key in self._on_ssd:
                    self._clear(self._on_ssd, key, bit)

    def purge(self, slot: int) -> int:
        """Forget everything ``slot`` holds (instance gone or about to re-send its list); returns how many."""
        own = self._keys_of.pop(slot, set())
        self._ready.pop(slot, None)
        self._settle_above.pop(slot, None)
        self._latest_ready.pop(slot, None)
        bit = 1 << slot
        for key in own:
            self._clear(self._holders, key, bit)
            if key in self._on_ssd:
                self._clear(self._on_ssd, key, bit)
        return len(own)

    def reset(self, slot: int, dram_keys: Iterable[int], ssd_keys: Iterable[int] = ()) -> None:
        """Replace ``slot``'s whole block list (an instance re-sending it, e.g. to a restarted Conductor)."""
        self.purge(slot)
        self.store(slot, dram_keys, Tier.DRAM)
        self.store(slot, ssd_keys, Tier.SSD)

    def has_pending(self, slot: int) -> bool:
        """Whether ``slot`` has blocks recorded as expected but not yet confirmed."""
        return bool(self._ready.get(slot))

    def pending_until(self, slot: int) -> float:
        """A bound on when every block expected on ``slot`` will have landed (the latest ready time ever expected
        there; -inf when none was): when it is already past, no key needs looking up (``ready_times``)."""
        return self._latest_ready.get(slot, -math.inf) if self._ready.get(slot) else -math.inf

    def ready_times(self, slot: int, keys: Sequence[int], count: int | None = None) -> list[float]:
        """For each key (the first ``count`` only, when given), the clock time ``slot`` is expected to have it (-inf:
        it has it now or not expected)."""
        pending = self._ready.get(slot, {})
        return [pending.get(key, -math.inf) for key in (keys if count is None else keys[:count])]

    def settle(self, slot: int, now: float) -> None:
        """Forget expectations already due by ``now`` on ``slot``, once their number has doubled since the last
        time (amortised O(1) per stored block; an instance that never confirms its blocks stays bounded)."""
        pending = self._ready.get(slot)
        if not pending or len(pending) <= self._settle_above.get(slot, 1024):
            return
        # the survivors copied, not the expired deleted: most have expired by then, and a comprehension over the
        # items costs about half a list of the expired plus a ``del`` each
        pending = self._ready[slot] = {key: t for key, t in pending.items() if t > now}
        self._settle_above[slot] = max(1024, 2 * len(pending))

    def holders(self, key: int) -> list[int]:
        """Slots holding ``key``, ascending."""
        return _bits(self._holders.get(key, 0))

    def tier(self, key: int, slot: int) -> Tier | None:
        """The tier ``slot`` holds ``key`` in, or None when it does not hold it."""
        bit = 1 << slot
        if not self._holders.get(key, 0) & bit:
            return None
        return Tier.SSD if self._on_ssd.get(key, 0) & bit else Tier.DRAM

    def match(self, keys: Sequence[int]) -> dict[int, int]:
        """Leading keys of ``keys`` each slot holds, for the slots holding at least the first one.

        Slots absent from the result match zero blocks.
        """
        return {slot: length for length, mask in self.match_levels(keys) for slot in _bits(mask)}

    def match_levels(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """The prefix match as (length, slot bit mask) levels: the slots of a level hold exactly ``length``
        leading keys of ``keys``; lengths ascend, masks are disjoint, slots in no level match zero.

        Why levels and not a slot -> length dict: a hot prefix is held by many slots that drop out of the walk
        together, so a request has a few levels (one to three on the conversation trace) but tens of matching
        slots; the policy works out what a prefix decides once per level and reads it into every slot through a
        memoised slot -> level index (``slot_groups``) instead of a Python step per slot.
        """
        if not keys:
            return []
        holders = self._holders
        levels: list[tuple[int, int]] = []
        running = holders.get(keys[0], 0)
        i = 1
        n = len(keys)
        while running and i < n:
            still = running & holders.get(keys[i], 0)
            if still != running:
                levels.append((i, running & ~still))
                running = still
            i += 1
        if running:
            levels.append((n, running))
        return levels

    @staticmethod
    def _clear(masks: dict[int, int], key: int, bit: int) -> None:
        remaining = masks.get(key, 0) & ~bit
        if remaining:
            masks[key] = remaining
        else:
            masks.pop(key, None)


@functools.lru_cache(maxsize=4096)
def slots_of_mask(mask: int) -> np.ndarray:
    """Positions of the set bits of ``mask`` as an index array (read-only: it is shared).

    Memoised because the same holder sets come back request after request (a hot prefix's holders drop out of
    the walk together), and a cached lookup costs a fraction of walking the bits in Python."""
    slots = np.array(_bits(mask), np.intp)
    slots.flags.writeable = False
    return slots


@functools.lru_cache(maxsize=4096)
def slot_groups(masks: tuple[int, ...], capacity: int) -> np.ndarray:
    """Each slot's group as a flat index into a ``(len(masks) + 1, capacity)`` array: entry ``s`` is
    ``group * capacity + s``, group 0 for a slot in none of ``masks``, group ``j`` for a slot in ``masks[j - 1]``
    (the masks are disjoint: ``BlockIndex.match_levels``' levels).

    The policy evaluates one row per group (a level's slots share their prefix, so they share everything the
    prefix decides) and reads each slot's value from its group's row with one ``take`` through this index;
    memoised like ``slots_of_mask``, as the same holder sets come back request after request."""
    flat = np.arange(capacity, dtype=np.intp)
    for group, mask in enumerate(masks, 1):
        flat[slots_of_mask(mask)] += group * capacity
    flat.flags.writeable = False
    return flat


def _bits(mask: int) -> list[int]:
    """Positions of the set bits of ``mask``, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
