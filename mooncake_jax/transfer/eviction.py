"""Which block a full tier gives up: LRU (the default), LFU, or a policy of your own.

A policy only orders keys; the tier tells it what happened (inserted, accessed, removed) and asks for a victim,
passing the pinned keys it must skip. Each tier owns its own policy instance, so ``make_policy`` takes a name or
a factory, never a shared instance.
"""

from __future__ import annotations

import abc
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Container

from mooncake_jax.blocks import BlockKey


class EvictionPolicy(abc.ABC):
    """Orders the keys of one tier for eviction. Implement the four methods to plug in your own."""

    @abc.abstractmethod
    def inserted(self, key: BlockKey) -> None:
        """``key`` entered the tier (it was not there)."""

    @abc.abstractmethod
    def accessed(self, key: BlockKey) -> None:
        """``key``, already in the tier, was read or stored again."""

    @abc.abstractmethod
    def removed(self, key: BlockKey) -> None:
        """``key`` left the tier (evicted, deleted or found corrupt)."""

    @abc.abstractmethod
    def victim(self, pinned: Container[BlockKey]) -> BlockKey | None:
        """The key to evict next, skipping ``pinned`` ones; None when every key is pinned or the tier is empty."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first (insertion counts as a use)."""

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def inserted(self, key: BlockKey) -> None:
        self._order[key] = None

    def accessed(self, key: BlockKey) -> None:
        self._order.move_to_end(key)

    def removed(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def victim(self, pinned: Container[BlockKey]) -> BlockKey | None:
        return next((key for key in self._order if key not in pinned), None)


class LFUPolicy(EvictionPolicy):
    """Fewest uses first (insertion is the first use); ties go to the least recently used.

    A heap of (uses, last use, key) with stale entries skipped lazily keeps every operation O(log n).
    """

    def __init__(self) -> None:
        self._uses: dict[BlockKey, tuple[int, int]] = {}  # key -> (uses, tick of last use)
        self._heap: list[tuple[int, int, BlockKey]] = []
        self._tick = itertools.count()

    def _touch(self, key: BlockKey, uses: int) -> None:
        entry = (uses, next(self._tick))
        self._uses[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 4 * len(self._uses) + 64:  # drop stale entries before they dominate the heap
            self._heap = [(u, t, k) for k, (u, t) in self._uses.items()]
            heapq.heapify(self._heap)

    def inserted(self, key: BlockKey) -> None:
        self._touch(key, 1)

    def accessed(self, key: BlockKey) -> None:
        self._touch(key, self._uses[key][0] + 1)

    def removed(self, key: BlockKey) -> None:
        self._uses.pop(key, None)

    def victim(self, pinned: Container[BlockKey]) -> BlockKey | None:
        skipped = []
        found = None
        while self._heap:
            uses, tick, key = self._heap[0]
            if self._uses.get(key) != (uses, tick):
                heapq.heappop(self._heap)  # stale
            elif key in pinned:
                skipped.append(heapq.heappop(self._heap))
            else:
                found = key
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}

PolicyChoice = str | Callable[[], EvictionPolicy]


def make_policy(choice: PolicyChoice) -> EvictionPolicy:
    """A fresh policy from a name in ``POLICIES`` or a zero-argument factory (such as an EvictionPolicy subclass)."""
    if isinstance(choice, str):
        if choice not in POLICIES:
            raise ValueError(f"unknown eviction policy {choice!r}; choose one of {sorted(POLICIES)} or pass a factory")
        return POLICIES[choice]()
    if not callable(choice):
        raise ValueError(f"eviction must be a policy name or a factory, got {type(choice).__name__}")
    policy = choice()
    if not isinstance(policy, EvictionPolicy):
        raise ValueError(f"eviction factory returned {type(policy).__name__}, not an EvictionPolicy")
    return policy
