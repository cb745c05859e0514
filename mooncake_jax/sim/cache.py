"""Block caches of the simulated cluster (LRU, LFU) and the single-cache hit-ratio replay.

A cache holds block keys only (the KV itself is never simulated). It answers the two questions the cluster asks:
how many leading blocks of a prompt it holds (``prefix``), and which blocks fall out when new ones come in
(``insert`` returns them, so the Conductor's block index hears of every eviction). Capacity is in blocks and can
change at run time (``resize``): a coupled node's prefix cache lives in whatever HBM running requests leave free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

EVICTIONS = ("lru", "lfu")


class _BlockCache:
    """What both caches share: ``_held`` maps every held key to the policy's bookkeeping for it."""

    _held: dict

    def __init__(self, capacity_blocks: int | None):
        self.capacity = _capacity(capacity_blocks)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: int) -> bool:
        return key in self._held

    def prefix(self, keys: Sequence[int]) -> int:
        """Leading ``keys`` held (no use recorded)."""
        held = self._held
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def resize(self, capacity_blocks: int | None) -> list[int]:
        """Change the capacity; returns the keys evicted to fit it."""
        self.capacity = _capacity(capacity_blocks)
        return self._evict()

    def _evict(self) -> list[int]:
        raise NotImplementedError


class LRUBlockCache(_BlockCache):
    """Least recently used eviction; a lookup that hits and an insert both count as a use."""

    def __init__(self, capacity_blocks: int | None = None):
        super().__init__(capacity_blocks)
        self._held: OrderedDict[int, None] = OrderedDict()

    def touch(self, keys: Iterable[int]) -> None:
        """Record a use of those ``keys`` that are held."""
        held = self._held
        for key in keys:
            if key in held:
                held.move_to_end(key)

    def insert(self, keys: Iterable[int]) -> list[int]:
        """Hold ``keys`` (in order, each becoming the most recent); returns the keys evicted to make room.

        Room is made once all of them are in, so one request's blocks never push each other out unless they
        alone exceed the capacity (for LRU the order makes this the same as evicting per block).
        """
        held = self._held
        for key in keys:
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
        return self._evict()

    def _evict(self) -> list[int]:
        held, cap = self._held, self.capacity
        if cap is None or len(held) <= cap:
            return []
        return [held.popitem(last=False)[0] for _ in range(len(held) - cap)]


class LFUBlockCache(_BlockCache):
    """Least frequently used eviction (ties: least recently used among them), O(1) per operation.

    Frequency counts uses while the block is held; an evicted block starts again from zero.
    """

    def __init__(self, capacity_blocks: int | None = None):
        super().__init__(capacity_blocks)
        self._held: dict[int, int] = {}  # key -> uses
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._min = 0

    def touch(self, keys: Iterable[int]) -> None:
        for key in keys:
            if key in self._held:
                self._bump(key)

    def insert(self, keys: Iterable[int]) -> list[int]:
        for key in keys:
            if key in self._held:
                self._bump(key)
            else:
                self._held[key] = 1
                self._buckets.setdefault(1, OrderedDict())[key] = None
                self._min = 1
        return self._evict()

    def _bump(self, key: int) -> None:
        freq = self._held[key]
        bucket = self._buckets[freq]
        del bucket[key]
        if not bucket:
            del self._buckets[freq]
            if self._min == freq:
                self._min = freq + 1
        self._held[key] = freq + 1
        self._buckets.setdefault(freq + 1, OrderedDict())[key] = None

    def _evict(self) -> list[int]:
        cap = self.capacity
        evicted = []
        while cap is not None and len(self._held) > cap:
            while self._min not in self._buckets:
                self._min += 1
            bucket = self._buckets[self._min]
            key, _ = bucket.popitem(last=False)
            if not bucket:
                del self._buckets[self._min]
            del self._held[key]
            evicted.append(key)
        return evicted


def _capacity(capacity_blocks: int | None) -> int | None:
    if capacity_blocks is not None and (int(capacity_blocks) != capacity_blocks or capacity_blocks < 0):
        raise ValueError(f"cache capacity must be a non-negative integer or None, got {capacity_blocks!r}")
    return None if capacity_blocks is None else int(capacity_blocks)


def make_cache(eviction: str, capacity_blocks: int | None) -> LRUBlockCache | LFUBlockCache:
    """A block cache by eviction policy name."""
    if eviction == "lru":
        return LRUBlockCache(capacity_blocks)
    if eviction == "lfu":
        return LFUBlockCache(capacity_blocks)
    raise ValueError(f"unknown eviction policy {eviction!r}; choose from {list(EVICTIONS)}")


def cache_hit_ratio(trace, capacity_blocks: int | None = None, eviction: str = "lru",
                    weight: str = "blocks") -> float:
    """Replay a trace against one cache of ``capacity_blocks`` blocks (None: unbounded) and return its hit ratio.

    Requests in arrival order; each looks up all its blocks (a hit is a block id present when the request
    arrives, whatever its position) and then inserts them all, in prompt order. ``weight="tokens"`` weighs each
    block by its tokens (the last block of a prompt is usually partial). ``trace``: a bundled name, a path, or a
    ``Trace``.
    """
    from mooncake_jax.sim.trace import load_trace

    if weight not in ("blocks", "tokens"):
        raise ValueError(f"weight must be 'blocks' or 'tokens', got {weight!r}")
    trace = load_trace(trace)
    cache = make_cache(eviction, capacity_blocks)
    hit = total = 0.0
    by_tokens = weight == "tokens"
    block = trace.block_tokens
    for request in trace:
        keys = request.hash_ids
        if not keys:
            continue
        if by_tokens:
            sizes = request.block_tokens(block)
            hit += sum(size for key, size in zip(keys, sizes) if key in cache)
            total += request.input_length
        else:
            hit += sum(1 for key in keys if key in cache)
            total += len(keys)
        cache.insert(keys)
    return hit / total if total else 0.0
