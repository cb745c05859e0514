"""Page allocator and prefix cache, tested as plain Python; out-of-pages never touches another sequence."""

import numpy as np
import pytest

import mooncake_jax as mj
from mooncake_jax.model.engine import Engine
from mooncake_jax.model.kv_cache import OutOfPages, PageAllocator, PrefixCache
from mooncake_jax.model.sequence import SamplingParams
from reference_model import reference_for, reference_greedy


def test_allocator_refcounts_keep_shared_pages_until_last_release():
    a = PageAllocator(6)
    assert a.num_free == 5
    pages = a.allocate(3)
    assert 0 not in pages and len(set(pages)) == 3
    a.retain(pages[:2])  # a second sequence shares the first two pages
    assert a.release(pages) == [pages[2]]
    assert a.num_free == 3
    assert sorted(a.release(pages[:2])) == sorted(pages[:2])
    assert a.num_free == 5
    with pytest.raises(ValueError, match="released more often"):
        a.release([pages[0]])
    with pytest.raises(OutOfPages, match="need 6 KV pages, only 5"):
        a.allocate(6)
    assert a.num_free == 5  # a failed allocation takes nothing


def test_allocator_hands_out_the_lowest_free_pages_in_ascending_order():
    """Pages released in any order come back lowest first, so a new sequence's pages are ascending and adjacent
    wherever free pages are (the stack this replaced handed back 3, 4, 9, 10 ... in release order)."""
    a = PageAllocator(12)
    held = [a.allocate(2) for _ in range(5)]
    assert held == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    for i in (4, 1, 3):  # three sequences end, not in page order; page 11 was never used
        a.release(held[i])
    assert a.allocate(3) == [3, 4, 7]
    assert a.allocate(4) == [8, 9, 10, 11]
    assert a.num_free == 0


def test_prefix_cache_matches_leading_keys_and_evicts_lru_unused():
    a = PageAllocator(8)
    cache = PrefixCache(a)
    pages = a.allocate(3)
    cache.insert([10, 11, 12], pages)
    assert cache.match([10, 11, 99, 12]) == pages[:2]
    a.release(pages)  # the sequence is done; only the cache holds them
    a.retain([pages[0]])  # another sequence is using block 10
    cache.match([12])  # 12 is now the most recently used
    assert cache.evict(1) == [11]  # 10 is in use, 11 is least recently used
    assert cache.evict(5) == [12]
    assert 10 in cache and a.refcount(pages[0]) == 2


def test_out_of_pages_is_clean_and_does_not_disturb_other_sequences():
    llm = mj.LLM("tiny", prefix_caching=False)
    ref = reference_for(llm.model)
    engine = Engine(llm.model, num_pages=8, prefix_caching=False)  # 7 usable pages of 16 tokens
    rng = np.random.default_rng(0)
    a = engine.new_sequence(rng.integers(0, 512, 40).tolist(), SamplingParams(max_new_tokens=20))  # 4 pages
    engine.admit(a)
    engine.prefill(a)
    before = (list(a.pages), engine.allocator.num_free)
    b = engine.new_sequence(rng.integers(0, 512, 50).tolist(), SamplingParams(max_new_tokens=5))  # 4 pages
    with pytest.raises(OutOfPages):
        engine.admit(b)
    assert (list(a.pages), engine.allocator.num_free) == before and b.pages == []
    while not a.finished:
        engine.decode([a])
    assert a.output == reference_greedy(ref, a.prompt, 20)
    with pytest.raises(ValueError, match="needs 9 KV pages but the cache has only 7"):
        engine.new_sequence(list(range(100)), SamplingParams(max_new_tokens=40))
