"""Global block index: prefix match for all instances against brute force, tiers, purges, expected blocks."""

import math

import numpy as np
import pytest

from mooncake_jax.blocks import block_keys, prefix_match
from mooncake_jax.conductor import BlockIndex, Tier, index_kernels
from mooncake_jax.conductor.flat_index import FlatBlockIndex


@pytest.fixture(params=["dict", "flat"])
def new_index(request):
    """Makes an empty index of either kind: the dict ``BlockIndex``, or the compiled ``FlatBlockIndex`` (numba)."""
    if request.param == "dict":
        return BlockIndex
    ops = index_kernels.compiled()
    if ops is None:
        pytest.skip("numba is not installed: no compiled index")
    return lambda: FlatBlockIndex(ops, capacity=2)


def test_prefix_match_equals_brute_force_on_random_holdings(new_index):
    rng = np.random.default_rng(0)
    n_slots, universe = 24, 60
    index = new_index()
    held = {s: set() for s in range(n_slots)}
    for _ in range(3000):  # random stores and evictions, so holdings have holes and rise and fall
        slot = int(rng.integers(n_slots))
        keys = [int(k) for k in rng.integers(0, universe, int(rng.integers(1, 6)))]
        if rng.random() < 0.7:
            index.store(slot, keys)
            held[slot].update(keys)
        else:
            index.remove(slot, keys)
            held[slot].difference_update(keys)
    queries = [[int(k) for k in rng.permutation(universe)[: int(rng.integers(0, 30))]] for _ in range(400)]
    queries += [sorted(held[s])[:10] for s in range(n_slots)]
    nonzero = 0
    for keys in queries:
        expected = {s: prefix_match(keys, held[s]) for s in range(n_slots)}
        expected = {s: m for s, m in expected.items() if m}
        assert index.match(keys) == expected
        nonzero += bool(expected)
    assert nonzero > 100  # the check compared real matches, not only empty ones
    assert len(index) == len(set().union(*held.values()))
    for key in range(universe):
        assert index.holders(key) == [s for s in range(n_slots) if key in held[s]]


def test_match_on_real_block_keys_stops_at_first_difference(new_index):
    tokens = np.arange(64)
    other = tokens.copy()
    other[40] += 1  # block 2 of 4 differs
    a, b = block_keys(tokens, 16), block_keys(other, 16)
    index = new_index()
    index.store(3, a)
    index.store(5, b)
    index.store(7, a[1:])  # holds later blocks but not the first: matches nothing
    assert index.match(a) == {3: 4, 5: 2}
    assert index.match(b) == {3: 2, 5: 4}
    assert index.match([]) == {}


def test_tiers_purge_and_reset(new_index):
    index = new_index()
    index.store(0, [1, 2, 3])
    index.store(0, [3], Tier.SSD)  # demoted
    index.store(1, [1, 2])
    assert index.tier(3, 0) == Tier.SSD and index.tier(2, 0) == Tier.DRAM and index.tier(3, 1) is None
    index.store(0, [3])  # promoted back
    assert index.tier(3, 0) == Tier.DRAM
    assert index.purge(0) == 3
    assert index.match([1, 2, 3]) == {1: 2} and len(index) == 2
    index.reset(1, [7, 8], ssd_keys=[9])
    assert index.match([1]) == {} and index.match([7, 8, 9]) == {1: 3}
    assert index.tier(9, 1) == Tier.SSD and index.blocks_of(1) == 3
    index.remove(1, [42])  # never held: ignored
    index.remove(4, [7])  # unknown slot: ignored
    assert index.blocks_of(1) == 3


def test_expected_blocks_carry_their_landing_time_until_confirmed(new_index):
    index = new_index()
    index.store(0, [1], Tier.SSD)
    index.expect(0, [1, 2, 3], ready_at=5.0)  # 1 already there; 2 and 3 expected at 5
    assert index.match([1, 2, 3]) == {0: 3}
    assert index.ready_times(0, [1, 2, 3]) == [-math.inf, 5.0, 5.0]
    assert index.tier(1, 0) == Tier.SSD  # an expectation does not move a held block between tiers
    index.store(0, [2])  # the instance's KV event confirms 2
    assert index.ready_times(0, [2, 3]) == [-math.inf, 5.0] and index.has_pending(0)
    index.remove(0, [3])
    assert not index.has_pending(0)


def test_settle_bounds_unconfirmed_expectations(new_index):
    index = new_index()
    index.expect(0, range(5000), ready_at=1.0)
    index.expect(0, range(5000, 5100), ready_at=9.0)
    index.settle(0, now=5.0)  # 5,100 pending > 1,024 (dict, per slot) or 4,096 (flat): the 5,000 due are dropped
    assert index.ready_times(0, [0, 5050]) == [-math.inf, 9.0] and index.has_pending(0)
    assert index.match(list(range(3))) == {0: 3}  # still held


@pytest.mark.parametrize("n_slots", [4, 300])
def test_match_with_masks_wider_than_a_machine_word(n_slots, new_index):
    # Every slot holds the first half of a 200-block prompt; slot numbers past 63 need multi-word masks.
    keys = list(range(200))
    index = new_index()
    for slot in range(n_slots):
        index.store(slot, keys[:100])
    assert index.match(keys) == {slot: 100 for slot in range(n_slots)}
