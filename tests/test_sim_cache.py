"""Block caches against brute force, and the hit ratios measured on the real trace (../shared/traces/README.md)."""

import random

import pytest

from mooncake_jax.sim import cache_hit_ratio
from mooncake_jax.sim.cache import LFUBlockCache, LRUBlockCache, make_cache
from mooncake_jax.sim.trace import Trace, TraceRequest, load_trace


def brute_force_ratio(trace, capacity, eviction, weight="blocks"):
    """A list-based cache: slow, obvious, written independently of ``cache.py``."""
    order, freq, hit, total, clock = [], {}, 0, 0, 0
    last_use = {}
    for req in trace:
        sizes = [512] * (len(req.hash_ids) - 1) + [req.input_length - 512 * (len(req.hash_ids) - 1)]
        for key, size in zip(req.hash_ids, sizes):
            w = size if weight == "tokens" else 1
            total += w
            hit += w if key in order else 0
        for key in req.hash_ids:
            clock += 1
            if key in order:
                freq[key] += 1
            else:
                order.append(key)
                freq[key] = 1
            last_use[key] = clock
        while capacity is not None and len(order) > capacity:  # room is made once the whole request is in
            if eviction == "lru":
                victim = min(order, key=lambda k: last_use[k])
            else:
                victim = min(order, key=lambda k: (freq[k], last_use[k]))
            order.remove(victim)
            del freq[victim]
    return hit / total


def random_trace(seed, n=300):
    rng = random.Random(seed)
    roots = list(range(12))
    requests = []
    for i in range(n):
        root = rng.choice(roots)
        depth = rng.randint(1, 6)
        ids = tuple(root * 1000 + d * 100 + rng.choice([0, 0, 0, 1]) * (d >= 3) for d in range(depth))
        requests.append(TraceRequest(float(i), 512 * (depth - 1) + rng.randint(1, 512), 1, ids))
    return Trace(requests)


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("seed", range(4))
def test_hit_ratio_equals_brute_force_on_random_traces(eviction, seed):
    trace = random_trace(seed)
    for capacity in (1, 5, 17, 40, None):
        for weight in ("blocks", "tokens"):
            assert cache_hit_ratio(trace, capacity, eviction, weight) == pytest.approx(
                brute_force_ratio(trace, capacity, eviction, weight), abs=1e-12), (capacity, weight)


@pytest.mark.parametrize("capacity,expected", [(1_000, 0.045), (10_000, 0.212), (50_000, 0.355),
                                               (100_000, 0.364), (None, 0.366)])
def test_hit_ratio_on_the_real_trace_matches_the_measured_facts(capacity, expected):
    assert cache_hit_ratio("conversation", capacity) == pytest.approx(expected, abs=0.005)


def test_token_weighted_hit_ratio_on_the_real_trace():
    assert cache_hit_ratio(load_trace("conversation"), None, weight="tokens") == pytest.approx(0.374, abs=0.005)


@pytest.mark.parametrize("kind", [LRUBlockCache, LFUBlockCache])
def test_cache_prefix_insert_evict_resize(kind):
    cache = kind(3)
    assert cache.insert([1, 2, 3]) == []
    assert cache.prefix([1, 2, 9, 3]) == 2
    cache.touch([1])
    evicted = cache.insert([4])
    assert evicted == [2] and len(cache) == 3  # LRU: 2 is oldest; LFU: 2 and 3 used once, 2 less recently
    assert sorted(cache.resize(1) + [k for k in (1, 3, 4) if k in cache]) == [1, 3, 4]
    assert len(cache) == 1
    assert cache.resize(None) == [] and cache.insert(range(10, 100)) == []


def test_bad_cache_arguments():
    with pytest.raises(ValueError, match="eviction"):
        make_cache("fifo", 10)
    with pytest.raises(ValueError, match="capacity"):
        LRUBlockCache(-1)
    with pytest.raises(ValueError, match="weight"):
        cache_hit_ratio(random_trace(0), 10, weight="bytes")
    with pytest.raises(ValueError, match="unknown trace"):
        cache_hit_ratio("nope", 10)
