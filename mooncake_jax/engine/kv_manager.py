"""The KV-cache manager: every page of one engine's cache, who holds it, and what is promised.

One object answers the admission questions the scheduler asks (does this sequence fit now? with which cached
prefix?) and does the page bookkeeping the engine's steps need (grow a sequence by a page, give its pages back,
make room for blocks arriving from the pool or the Messenger). It is pure Python over ``PageAllocator`` (free
list with reference counts) and ``PrefixCache`` (block key -> page, LRU), so it is tested without a device.

Accounting, in pages (page 0 is scratch and never counted):

    num_pages - 1 == free (on the allocator's free list) + held (referenced by sequences and/or the prefix cache)
    reserved       == sum of every admitted sequence's ``reserved_pages`` (pages its generation may still need)
    free_pages     == free - reserved   (what a new admission may take; cached-only pages are evicted on demand)

A sequence is admitted with pages for its whole prompt and a reservation for the rest of ``max_len``, so decode
never runs out of pages mid-way; refusing (``OutOfPages``) happens only at admission, with nothing held.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

from ..blocks import BlockKey, block_keys, num_blocks
from ..model.kv_cache import OutOfPages, PageAllocator, PrefixCache
from ..model.sequence import Sequence

__all__ = ["KVCacheManager", "OutOfPages"]


class KVCacheManager:
    """Pages, reservations and prefix reuse for one engine's paged KV cache of ``num_pages`` pages."""

    def __init__(self, num_pages: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = PrefixCache(self.allocator) if prefix_caching else None
        self.reserved = 0  # pages promised to admitted sequences but not yet allocated

    # ---- figures --------------------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def free_pages(self) -> int:
        """Pages neither in use nor promised (cached-only pages count as used until evicted)."""
        return self.allocator.num_free - self.reserved

    @property
    def evictable_pages(self) -> int:
        """Cached pages that no sequence holds (freed on demand by an admission)."""
        if self.prefix_cache is None:
            return 0
        return sum(1 for key in self.prefix_cache.keys()
                   if self.allocator.refcount(self.prefix_cache.page_of(key)) == 1)

    @property
    def pages_in_use(self) -> int:
        """Pages held by sequences (beyond the prefix cache's own) or promised to them: 0 when nothing runs."""
        cached = len(self.prefix_cache) if self.prefix_cache is not None else 0
        return self.num_pages - 1 - self.allocator.num_free - cached + self.reserved

    def pages_needed(self, seq: Sequence, cached_pages: int = 0) -> int:
        """Pages ``seq`` takes from the free pool when admitted over ``cached_pages`` cached prefix pages."""
        return num_blocks(seq.max_len, self.block_size) - cached_pages

    # ---- prefix reuse ---------------------------------------------------------------------------------------
    def prompt_keys(self, seq: Sequence) -> list[BlockKey]:
        """The prompt's block keys (computed once per sequence: admission and prefill both use them)."""
        if seq.prompt_keys is None:
            seq.prompt_keys = block_keys(seq.prompt, self.block_size)
        return seq.prompt_keys

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Pages of the prompt's leading cached blocks (counted as hits), never the block of the last token:
        its logits give the first output token, so it is always computed."""
        if self.prefix_cache is None:
            return []
        usable = (len(seq.prompt) - 1) // self.block_size
        return self.prefix_cache.match(self.prompt_keys(seq)[:usable])

    def cached_pages(self, keys: SequenceABC[BlockKey]) -> list[int]:
        """Pages of the leading ``keys`` already in the prefix cache (no hit counting, LRU order unchanged)."""
        if self.prefix_cache is None:
            return []
        pages = []
        for key in keys:
            page = self.prefix_cache.page_of(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def page_of(self, key: BlockKey) -> int | None:
        return None if self.prefix_cache is None else self.prefix_cache.page_of(key)

    def cache_prompt(self, seq: Sequence) -> None:
        """Offer the computed prompt's full blocks to the prefix cache (after its prefill)."""
        if self.prefix_cache is not None:
            keys = self.prompt_keys(seq)
            self.prefix_cache.insert(keys, seq.pages[: len(keys)])

    # ---- pages of sequences -----------------------------------------------------------------------------------
    def take(self, n: int) -> list[int]:
        """``n`` fresh pages, evicting unused cached prefix pages if the free list is short; OutOfPages (nothing
        taken, nothing evicted) if even that leaves too few beside the reservations."""
        short = n + self.reserved - self.allocator.num_free
        if 0 < short <= self.evictable_pages:  # never evict cached blocks for an admission that fails anyway
            self.prefix_cache.evict(short)
        if n + self.reserved > self.allocator.num_free:
            raise OutOfPages(f"need {n} KV pages, {self.allocator.num_free} free of which {self.reserved} "
                             f"are promised to running sequences")
        return self.allocator.allocate(n)

    def admit(self, seq: Sequence, cached_pages: SequenceABC[int] | None = None,
              cached_tokens: int | None = None) -> None:
        """Give ``seq`` pages for its prompt (reusing its cached prefix) and reserve its generation's pages.

        ``cached_pages`` overrides the prefix-cache lookup: pages already holding the prompt's leading KV, of which
        ``cached_tokens`` tokens are valid (default: all of every page). Raises OutOfPages, with nothing held,
        when the cache cannot take the sequence now.
        """
        if seq.pages or seq.reserved_pages:
            raise ValueError(f"sequence {seq.seq_id} is already admitted")
        if cached_pages is None:
            cached_pages = self.match_prefix(seq)
        if cached_tokens is None:
            cached_tokens = len(cached_pages) * self.block_size
        bs = self.block_size
        if cached_pages and not (len(cached_pages) - 1) * bs < cached_tokens <= len(cached_pages) * bs:
            raise ValueError(f"{cached_tokens} cached tokens do not fit {len(cached_pages)} pages")
        if cached_tokens > len(seq.prompt):
            raise ValueError(f"{cached_tokens} cached tokens exceed the prompt's {len(seq.prompt)}")
        self.allocator.retain(cached_pages)
        n_prompt = num_blocks(len(seq.prompt), bs)
        future = num_blocks(seq.max_len, bs) - n_prompt
        try:
            self.reserved += future  # counted before allocating, so eviction makes room for it too
            fresh = self.take(n_prompt - len(cached_pages))
        except OutOfPages:
            self.reserved -= future
            self.allocator.release(cached_pages)
            raise
        seq.pages = list(cached_pages) + fresh
        seq.reserved_pages = future
        seq.cached_tokens = seq.num_computed = cached_tokens

    def grow(self, seq: Sequence, length: int) -> None:
        """Make sure ``seq`` has pages for ``length`` tokens, drawing on its reservation first."""
        while len(seq.pages) * self.block_size < length:
            if seq.reserved_pages > 0:
                seq.reserved_pages -= 1
                self.reserved -= 1
            seq.pages.extend(self.take(1))

    def release(self, seq: Sequence) -> None:
        """Return the sequence's pages and unused reservation; its cached prompt blocks stay in the prefix cache."""
        self.allocator.release(seq.pages)
        self.reserved -= seq.reserved_pages
        seq.pages, seq.reserved_pages = [], 0

    # ---- blocks arriving from elsewhere ------------------------------------------------------------------------
    def pages_for_load(self, keys: SequenceABC[BlockKey], protect: SequenceABC[int] = ()
                       ) -> tuple[list[int], list[int]]:
        """Fresh pages for the ``keys`` not cached yet: (indexes of those keys, their pages, one reference each).

        The pages of ``keys`` already cached and the ``protect`` pages are held while room is made, so a request
        never loses part of its own prefix to its own load. Finish with ``commit_load`` once the blocks are written.
        """
        if self.prefix_cache is None:
            raise ValueError("loading blocks needs prefix caching enabled")
        missing = [i for i, key in enumerate(keys) if self.prefix_cache.page_of(key) is None]
        if not missing:
            return [], []
        held = list(protect) + [p for p in map(self.prefix_cache.page_of, keys) if p is not None]
        self.allocator.retain(held)
        try:
            fresh = self.take(len(missing))
        finally:
            self.allocator.release(held)
        return missing, fresh

    def commit_load(self, keys: SequenceABC[BlockKey], fresh: SequenceABC[int]) -> None:
        """The blocks of ``keys`` are in ``fresh``: cache them (the cache's reference is the only one left)."""
        self.prefix_cache.insert(keys, fresh)
        self.allocator.release(fresh)

    # ---- checking ---------------------------------------------------------------------------------------------
    def check(self, sequences: SequenceABC[Sequence] = ()) -> None:
        """Recount every page from ``sequences`` (all admitted ones) and the prefix cache; AssertionError on any
        mismatch with the allocator's reference counts, the free list or the reservation total."""
        n = self.num_pages
        refs = [0] * n
        for seq in sequences:
            for p in seq.pages:
                refs[p] += 1
        if self.prefix_cache is not None:
            for key in self.prefix_cache.keys():
                refs[self.prefix_cache.page_of(key)] += 1
        for p in range(1, n):
            assert refs[p] == self.allocator.refcount(p), f"page {p}: {refs[p]} holders, refcount " \
                                                          f"{self.allocator.refcount(p)}"
        free = sum(1 for p in range(1, n) if refs[p] == 0)
        assert free == self.allocator.num_free, f"{free} unheld pages, free list has {self.allocator.num_free}"
        promised = sum(s.reserved_pages for s in sequences)
        assert promised == self.reserved, f"sequences reserve {promised} pages, manager counts {self.reserved}"
        assert self.reserved <= self.allocator.num_free + self.evictable_pages, "reservations exceed the cache"
