"""The paged KV cache: device page arrays, and the pure-Python managers that hand pages out.

Device side: per pipeline stage one K and one V array of shape [kv_heads, n_layers * num_pages, block_size,
head_dim] (``kv_shape``): layer l (0-based within the stage) owns rows l * num_pages .. (l + 1) * num_pages - 1 and
its page p is row l * num_pages + p. Head-major, so the tensor-parallel KV-head axis leads and paged-attention
kernels read it without a transpose. Page 0 of every layer is scratch (padded tokens write there, no sequence reads
it); the managers below hand out page numbers 1 .. num_pages - 1, the same for every layer. The arrays are stored in
``kv_scatter.storage_dtype`` of the cache's dtype: on CPU a bfloat16 (float16) cache as uint16 (int16) bits, which
the step programs scatter and bitcast after gathering; everything outside them sees the float dtype.

Host side (plain classes, tested without an accelerator):

- ``PageAllocator``: a free list with reference counts, so a page shared by several sequences (a common prefix)
  returns to the free list only when its last holder releases it. It hands out the lowest free pages first, so a
  sequence's pages are ascending and mostly adjacent however often pages were reused, and decode attention's
  gather of a chunk of them reads adjacent pages (scattered pages cost 12 layers of b32 decode attention 5-11% more
  CPU time and up to 20% more wall time).
- ``PrefixCache``: block key -> page for full blocks whose KV is in the cache, in LRU order, holding one
  reference on each of its pages. A new request reuses the pages of its leading cached blocks; pages that only
  the cache still holds are evicted (LRU) when the allocator runs dry.
"""

from __future__ import annotations

import functools
import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..blocks import BlockKey
from .attention import SCRATCH_PAGE
from .config import ModelConfig
from .kv_scatter import storage_dtype


class OutOfPages(RuntimeError):
    """The cache has too few free pages for this request; other sequences are untouched."""


class PageAllocator:
    """Free pages ``1 .. num_pages - 1`` (page 0 is scratch) with reference counts, handed out lowest first.

    The free pages are a min-heap, not a stack: a stack hands back the most recently freed pages first, in the order
    their holders released them, so after a few rounds of admissions, releases and prefix-cache evictions every
    sequence's pages were scattered over the cache (measured as ``benchmarks/engine_cpu.py`` runs batch 32 after
    batches 1 and 8: 992-1,056 of 1,056 neighbouring page pairs apart, against 0 in a fresh engine). Lowest-first keeps a
    sequence's pages ascending and adjacent wherever the free pages are, which decode attention's per-chunk page
    gather reads faster (docs/benchmarks/engine.md, Xeon decode, sixteenth pass)."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is scratch), got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(1, num_pages))  # a sorted list is a valid min-heap
        self._refs = np.zeros(num_pages, np.int32)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages with one reference each; OutOfPages (and nothing allocated) if fewer are free."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} KV pages, only {len(self._free)} of {self.num_pages - 1} are free")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._refs[pages] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} is not allocated; cannot share it")
            self._refs[p] += 1

    def release(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference from each page; returns the pages that became free."""
        freed = []
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} released more often than it was held")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                freed.append(p)
        for p in freed:
            heapq.heappush(self._free, p)
        return freed


class PrefixCache:
    """Block key -> page of cached full blocks, LRU; holds one allocator reference per page."""

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self._pages: OrderedDict[BlockKey, int] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._pages

    def keys(self) -> list[BlockKey]:
        return list(self._pages)

    def page_of(self, key: BlockKey) -> int | None:
        """The page of ``key`` if cached (not counted as a hit, LRU order unchanged)."""
        return self._pages.get(key)

    def match(self, keys: Sequence[BlockKey]) -> list[int]:
        """Pages of the leading cached ``keys`` (marked recently used); counts block hits and misses."""
        pages = []
        for key in keys:
            page = self._pages.get(key)
            if page is None:
                break
            self._pages.move_to_end(key)
            pages.append(page)
        self.hits += len(pages)
        self.misses += len(keys) - len(pages)
        return pages

    def insert(self, keys: Sequence[BlockKey], pages: Sequence[int]) -> list[BlockKey]:
        """Cache ``pages`` under ``keys`` (already cached keys keep their page); returns the newly added keys."""
        added = []
        for key, page in zip(keys, pages):
            if key in self._pages:
                self._pages.move_to_end(key)
                continue
            self.allocator.retain([page])
            self._pages[key] = page
            added.append(key)
        return added

    def evict(self, n_pages: int) -> list[BlockKey]:
        """Drop least recently used entries whose page no sequence holds, until ``n_pages`` pages were freed."""
        evicted, freed = [], 0
        for key, page in list(self._pages.items()):
            if freed >= n_pages:
                break
            if self.allocator.refcount(page) == 1:
                del self._pages[key]
                self.allocator.release([page])
                evicted.append(key)
                freed += 1
        return evicted

    def clear(self) -> None:
        for page in self._pages.values():
            self.allocator.release([page])
        self._pages.clear()


def kv_shape(cfg: ModelConfig, num_pages: int, n_layers: int) -> tuple[int, int, int, int]:
    """Shape of a stage's stacked K (or V) array: [kv_heads, n_layers * num_pages, block_size, head_dim]."""
    return (cfg.n_kv_heads, n_layers * num_pages, cfg.block_size, cfg.head_dim)


def allocate_kv(cfg: ModelConfig, num_pages: int, dtype=None, sharding=None,
                n_layers: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Zeroed stacked (K, V) page arrays for ``n_layers`` layers (all of the model's by default), of logical
    ``dtype`` (the model's by default) in its storage dtype on this backend (``kv_scatter.storage_dtype``)."""
    shape = kv_shape(cfg, num_pages, cfg.n_layers if n_layers is None else n_layers)
    make = zeros_program(shape, storage_dtype(dtype or cfg.param_dtype), sharding)
    return make(), make()


@functools.cache
def zeros_program(shape: tuple[int, ...], dtype: np.dtype, sharding=None):
    """A compiled program making a zeroed array of ``shape`` laid out by ``sharding``, once per process for each
    (a lambda jitted per call compiled again for every engine)."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def write_slots(pages: Sequence[int], start: int, n: int, block_size: int) -> np.ndarray:
    """Flat cache slots of positions ``start .. start + n`` of a sequence whose pages are ``pages``."""
    pos = np.arange(start, start + n)
    return np.asarray(pages, np.int32)[pos // block_size] * block_size + (pos % block_size)


assert SCRATCH_PAGE == 0, "PageAllocator hands out pages from 1 on"
