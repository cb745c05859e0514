"""The block index's two implementations (the dict ``BlockIndex``, the compiled ``FlatBlockIndex``) against a plain
dict of sets driven by the same random operations: stores, tiers, expectations, evictions, purges, growth of the
table and of the mask width, colliding keys, the key 2^64 - 1 (the table's empty marker)."""

import math

import numpy as np
import pytest

from mooncake_jax.blocks import prefix_match
from mooncake_jax.conductor import BlockIndex, Tier, index_kernels
from mooncake_jax.conductor.flat_index import FlatBlockIndex

OPS = index_kernels.compiled()
needs_numba = pytest.mark.skipif(OPS is None, reason="numba is not installed: no compiled index")
TOP = (1 << 64) - 1


class Model:
    """What an index must answer, kept the plainest way: key -> {slot: tier}, slot -> {key: ready_at}."""

    def __init__(self):
        self.held: dict[int, dict[int, Tier]] = {}
        self.ready: dict[int, dict[int, float]] = {}

    def store(self, slot, keys, tier):
        for key in keys:
            self.held.setdefault(key, {})[slot] = tier
            self.ready.get(slot, {}).pop(key, None)

    def expect(self, slot, keys, ready_at):
        for key in keys:
            if slot not in self.held.get(key, {}):
                self.held.setdefault(key, {})[slot] = Tier.DRAM
                self.ready.setdefault(slot, {})[key] = ready_at

    def remove(self, slot, keys):
        for key in keys:
            if slot in self.held.get(key, {}):
                del self.held[key][slot]
                if not self.held[key]:
                    del self.held[key]
                self.ready.get(slot, {}).pop(key, None)

    def purge(self, slot):
        keys = [k for k, slots in self.held.items() if slot in slots]
        self.remove(slot, keys)
        self.ready.pop(slot, None)
        return len(keys)

    def match(self, keys):
        slots = {s for holders in self.held.values() for s in holders}
        found = {s: prefix_match(keys, {k for k, h in self.held.items() if s in h}) for s in slots}
        return {s: m for s, m in found.items() if m}


def indexes():
    made = [BlockIndex()]
    if OPS is not None:
        made.append(FlatBlockIndex(OPS, capacity=2))  # grows many times
    return made


def agree(index, model, keys_seen, slots, queries):
    assert len(index) == len(model.held)
    for slot in slots:
        assert index.blocks_of(slot) == sum(slot in h for h in model.held.values())
    for key in keys_seen:
        assert index.holders(key) == sorted(model.held.get(key, {}))
        for slot in slots:
            assert index.tier(key, slot) == model.held.get(key, {}).get(slot)
    for keys in queries:
        assert index.match(keys) == model.match(keys)
        for slot in slots:
            pending = model.ready.get(slot, {})
            expected = [pending.get(k, -math.inf) for k in keys]
            assert index.ready_times(slot, keys) == expected
            assert index.ready_times(slot, tuple(keys), 2) == expected[:2]  # the first two (the request's tuple)


@pytest.mark.parametrize("index", indexes(), ids=lambda i: type(i).__name__)
def test_random_operations_match_a_plain_dict(index):
    rng = np.random.default_rng(1)
    # keys: small ints (trace ids), 64-bit ones, 0 and the top value (the table's empty marker); slots across three
    # mask words, so the flat table widens twice
    universe = [0, TOP, TOP - 1] + [int(k) for k in rng.integers(1, 400, 60)] + [
        int(k) * 2 + 1 for k in rng.integers(1 << 62, 1 << 63, 40, dtype=np.int64)]
    universe = list(dict.fromkeys(universe))
    slots = [0, 1, 5, 63, 64, 100, 130]
    model = Model()
    for step in range(1500):
        slot = slots[int(rng.integers(len(slots)))]
        keys = [universe[int(i)] for i in rng.integers(len(universe), size=int(rng.integers(1, 12)))]
        action = rng.random()
        if action < 0.35:
            tier = Tier.SSD if rng.random() < 0.3 else Tier.DRAM
            index.store(slot, keys, tier)
            model.store(slot, keys, tier)
        elif action < 0.6:
            first = int(rng.integers(0, 3))
            index.expect(slot, tuple(keys), float(step), first)
            model.expect(slot, keys[first:], float(step))
        elif action < 0.95:
            index.remove(slot, keys)
            model.remove(slot, keys)
        else:
            assert index.purge(slot) == model.purge(slot)
        if step % 150 == 0:
            queries = [[universe[int(i)] for i in rng.integers(len(universe), size=int(rng.integers(0, 8)))]
                       for _ in range(20)]
            queries += [sorted(k for k, h in model.held.items() if s in h)[:6] for s in slots]
            agree(index, model, universe, slots, queries)
    assert len(model.held) > 20  # the index ended holding something to compare


@needs_numba
def test_colliding_keys_survive_deletions_in_their_probe_run():
    """Keys whose probes start at four neighbouring rows, stored interleaved, in a table that does not grow:
    deleting from their run shifts back exactly the rows that would no longer be found and leaves the others, and
    every survivor is still found (a run in the middle, one wrapping round the table's end)."""
    capacity = 1024
    home = index_kernels._home
    homes = [int(home(np.uint64(k), np.uint64(capacity - 1))) for k in range(120_000)]
    for row in (500, capacity - 2):
        near = {(row + d) % capacity: [] for d in range(4)}
        for key, h in enumerate(homes):
            if h in near and len(near[h]) < 12:
                near[h].append(key)
        rng = np.random.default_rng(row)
        same = rng.permutation(sum(near.values(), [])).tolist()
        assert len(same) == 48
        index, model = FlatBlockIndex(OPS, capacity=capacity), Model()
        index.store(3, same)
        model.store(3, same, Tier.DRAM)
        for key in rng.permutation(same)[:36].tolist():
            index.remove(3, [key])
            model.remove(3, [key])
            agree(index, model, same, [3], [same[:5]])
        assert index._table.shape[0] == capacity + 1  # no growth: the deletions ran in the one table


@needs_numba
def test_growth_keeps_every_key_and_bad_keys_are_refused():
    index = FlatBlockIndex(OPS, capacity=2)
    keys = list(range(5000))
    expectation_rows = index._pend.shape[0]
    index.store(7, keys[:2500])
    assert index._pend.shape[0] == expectation_rows  # a store adds no expectation: that table does not grow
    index.expect(9, tuple(keys), 1.0)
    assert len(index) == 5000 and index.blocks_of(7) == 2500 and index.blocks_of(9) == 5000
    assert index._table.shape[0] - 1 >= 5000 / 0.7
    assert index.match(keys) == {7: 2500, 9: 5000}
    for bad in ([-1], [1 << 64], ["x"]):
        with pytest.raises(ValueError, match="unsigned 64-bit"):
            index.store(1, bad)
    assert index.holders(-1) == [] and index.tier(1 << 64, 7) is None


@needs_numba
def test_a_kernel_that_cannot_compile_leaves_the_dict_index(monkeypatch, caplog):
    """numba installed but failing on a kernel: one log line, no compiled index, and ``ClusterState`` keeps the
    dict index (decisions the same: the oracle runs that path)."""
    from mooncake_jax.conductor import ClusterState, kernels

    def fails(numba, function, *example):
        kernels.logging.getLogger(kernels.__name__).warning("numba could not compile %s", function.__name__)

    monkeypatch.setattr(kernels, "_compiled", fails)
    assert index_kernels.compiled.__wrapped__() is None
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    monkeypatch.setattr(index_kernels, "compiled", lambda: None)
    assert type(ClusterState().index) is BlockIndex


@needs_numba
def test_registered_pools_size_the_index_ahead():
    """A prefill instance's pool capacity, named in its registration's config, sizes the table when it registers:
    filling the pools then never doubles it (a doubling rehashes every key, on the decision path). A decode
    instance (it publishes no blocks) and a config naming no pool reserve nothing; a reservation is capped."""
    from types import SimpleNamespace

    from mooncake_jax.conductor import ClusterState
    from mooncake_jax.conductor import state as state_module
    from mooncake_jax.conductor.hardware import instance_costs
    from mooncake_jax.conductor.service import _index_blocks_of

    def registration(config_json):
        return SimpleNamespace(config_json=config_json)

    assert _index_blocks_of(registration('{"pool": {"dram_blocks": 3000, "ssd_blocks": 1000}}')) == 4000
    assert _index_blocks_of(registration('{"pool": {"dram_blocks": 3000, "ssd_blocks": null}}')) == 3000
    for unknown in ("", "not json", "[1]", '{"pool": 5}', '{"pool": {"dram_blocks": -3}}',
                    '{"pool": {"dram_blocks": true}}'):
        assert _index_blocks_of(registration(unknown)) == 0, unknown

    state = ClusterState()
    costs = instance_costs("8xA800", "llama2-70b")
    start = state.index.rows
    state.add_instance("d0", "decode", costs, 0.0)
    assert state.index.rows == start
    state.add_instance("p0", "prefill", costs, 0.0, index_blocks=30_000)
    state.add_instance("p1", "prefill", costs, 0.0, index_blocks=30_000)
    rows = state.index.rows
    assert rows >= 60_000 / 0.7 and rows < 2 * 60_000 / 0.7  # both pools: the smallest power of two that holds them
    state.kv_stored("p0", range(30_000))
    state.kv_stored("p1", range(30_000, 60_000))
    assert state.index.rows == rows and len(state.index) == 60_000  # filled: not doubled
    with pytest.raises(ValueError, match="index_blocks must be a non-negative integer, got -1"):
        state.add_instance("p2", "prefill", costs, 0.0, index_blocks=-1)
    capped = ClusterState()
    state_module_cap = state_module.INDEX_RESERVE_MAX_KEYS
    try:
        state_module.INDEX_RESERVE_MAX_KEYS = 1000
        capped.add_instance("p0", "prefill", costs, 0.0, index_blocks=10**9)
    finally:
        state_module.INDEX_RESERVE_MAX_KEYS = state_module_cap
    assert capped.index.rows < 2 * 1000 / 0.7
