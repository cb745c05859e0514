"""Block pool: exact round trips, eviction against brute-force models, tiers, pinning, events, bad input."""

import random

import ml_dtypes
import numpy as np
import pytest

from mooncake_jax.blocks import block_keys
from mooncake_jax.transfer import BlockEvent, BlockPool, BlockSpec, EventKind, EvictionPolicy, PoolFullError
from mooncake_jax.transfer.files import (ARRAY_DIRS, DATA_DIR, LEGACY_ARRAY_DIR, LEGACY_SLOTS_FILE, record_arrays,
                                         slots_per_shard)
from mooncake_jax.transfer.frame import DATA_OFFSET, PREFIX_BYTES, record_bytes, record_prefix

SPEC = BlockSpec((2, 2, 4, 2, 8), np.float32)  # (layers, K/V, block_size, kv_heads, head_dim)


def block_of(key: int, spec: BlockSpec = SPEC) -> np.ndarray:
    """A block whose bits depend on its key, so a block served under the wrong key is caught."""
    bits = np.random.default_rng(key).integers(0, 2**16, size=spec.nbytes // 2, dtype=np.uint16)
    return bits.view(spec.dtype).reshape(spec.shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


class EventLog(list):
    def __call__(self, event: BlockEvent) -> None:
        self.append((event.kind.value, event.key, event.tier))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("tiers", ["dram", "ssd"])
def test_round_trip_is_bit_exact(tmp_path, dtype, tiers):
    spec = BlockSpec((2, 2, 4, 2, 8), dtype)
    kwargs = {"dram_blocks": 0, "ssd_path": tmp_path} if tiers == "ssd" else {}
    pool = BlockPool(spec, **kwargs)
    special = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-30, 65504.0], dtype=np.float32).astype(dtype)
    blocks = [block_of(k, spec) for k in (11, 12, 13)]
    blocks[0].reshape(-1)[: special.size] = special
    assert pool.put_many([11, 12], np.stack(blocks[:2])) == 2  # one stacked array
    assert pool.put(13, blocks[2]) is True
    assert pool.put(13, blocks[2]) is False  # already held
    got = pool.get_many([11, 99, 12, 13])
    assert got[1] is None
    for block, back in zip(blocks, [got[0], got[2], got[3]]):
        assert same_bits(block, back)
    assert pool.tier_of(11) == tiers
    assert not got[0].flags.writeable  # a view of the stored frame: callers copy before writing


def test_get_many_into_a_staging_buffer():
    pool = BlockPool(SPEC)
    pool.put_many([1, 2], [block_of(1), block_of(2)])
    staging = np.full((3, *SPEC.shape), np.nan, np.float32)
    got = pool.get_many([2, 9, 1], out=staging)
    assert got[1] is None and np.isnan(staging[1]).all()
    assert same_bits(staging[0], block_of(2)) and same_bits(staging[2], block_of(1))
    assert np.shares_memory(got[0], staging) and np.shares_memory(got[2], staging)
    with pytest.raises(ValueError, match=r"out must be a float32\[2, 2, 2, 4, 2, 8\] array, got float32\[3"):
        pool.get_many([1, 2], out=staging)
    with pytest.raises(ValueError, match="C-contiguous"):  # blocks would land in a copy, the view left as it was
        pool.get_many([1, 2, 9], out=np.asfortranarray(staging))
    with pytest.raises(ValueError, match="writable"):
        staging.flags.writeable = False
        pool.get_many([1, 2, 9], out=staging)


def test_prefix_len_and_contains_need_no_io():
    keys = block_keys(list(range(64)), 16)
    pool = BlockPool(SPEC)
    pool.put_many(keys[:2], [block_of(1), block_of(2)])
    pool.put(keys[3], block_of(3))
    for tier in pool._tiers:  # any storage read now fails the test
        tier.read = lambda key: pytest.fail("a lookup touched storage")
    assert pool.prefix_len(keys) == 2
    assert keys[3] in pool and pool.contains(keys[0]) and keys[2] not in pool
    assert pool.tier_of(keys[2]) is None


class LRUModel:
    def __init__(self, capacity):
        self.capacity, self.order = capacity, []

    def use(self, key, store):
        """Returns the evicted key, if any."""
        if key in self.order:
            self.order.remove(key)
            self.order.append(key)
            return None
        if not store:
            return None
        victim = self.order.pop(0) if len(self.order) == self.capacity else None
        self.order.append(key)
        return victim

    def keys(self):
        return set(self.order)


class LFUModel:
    """Fewest uses, ties to least recent: a linear scan over every key at every eviction."""

    def __init__(self, capacity):
        self.capacity, self.uses, self.clock = capacity, {}, 0

    def use(self, key, store):
        self.clock += 1
        if key in self.uses:
            self.uses[key] = (self.uses[key][0] + 1, self.clock)
            return None
        if not store:
            return None
        victim = None
        if len(self.uses) == self.capacity:
            victim = min(self.uses, key=lambda k: self.uses[k])
            del self.uses[victim]
        self.uses[key] = (1, self.clock)
        return victim

    def keys(self):
        return set(self.uses)


@pytest.mark.parametrize("policy, model", [("lru", LRUModel), ("lfu", LFUModel)])
def test_eviction_order_matches_brute_force_model(policy, model):
    rng = random.Random(7)
    events = EventLog()
    pool = BlockPool(SPEC, dram_blocks=6, eviction=policy, on_event=events)
    reference = model(6)
    expected_evictions = []
    for _ in range(800):
        key = rng.choice(range(16)) if rng.random() < 0.7 else rng.choice(range(4))  # a few hot keys
        if rng.random() < 0.5:
            victim = reference.use(key, store=True)
            pool.put(key, block_of(key))
        else:
            victim = reference.use(key, store=False)
            got = pool.get(key)
            assert (got is None) == (key not in reference.keys())
            if got is not None:
                assert same_bits(got, block_of(key))
        if victim is not None:
            expected_evictions.append(victim)
        assert set(pool.keys()) == reference.keys()
    evicted = [key for kind, key, _ in events if kind == "removed"]
    assert evicted == expected_evictions and len(evicted) > 100


class FIFOPolicy(EvictionPolicy):
    """Oldest insertion first, uses ignored: shows a policy of one's own plugs in."""

    def __init__(self):
        self.order = []

    def inserted(self, key):
        self.order.append(key)

    def accessed(self, key):
        pass

    def removed(self, key):
        self.order.remove(key)

    def victim(self, pinned):
        return next((key for key in self.order if key not in pinned), None)


def test_pluggable_policy():
    pool = BlockPool(SPEC, dram_blocks=2, eviction=FIFOPolicy)
    pool.put(1, block_of(1))
    pool.put(2, block_of(2))
    pool.get(1)  # LRU would now evict 2; FIFO still evicts 1
    pool.put(3, block_of(3))
    assert sorted(pool.keys()) == [2, 3]


def test_demotion_then_promotion(tmp_path):
    events = EventLog()
    pool = BlockPool(SPEC, dram_blocks=2, ssd_path=tmp_path, on_event=events)
    for key in (1, 2, 3):
        pool.put(key, block_of(key))
    assert [pool.tier_of(k) for k in (1, 2, 3)] == ["ssd", "dram", "dram"]
    assert events[2:] == [("stored", 1, "ssd"), ("stored", 3, "dram")]  # 1 demoted: its fastest tier is SSD
    assert same_bits(pool.get(1), block_of(1))  # SSD hit: promoted, 2 demoted to make room
    assert [pool.tier_of(k) for k in (1, 2, 3)] == ["dram", "ssd", "dram"]
    assert events[4:] == [("stored", 2, "ssd"), ("stored", 1, "dram")]
    counters = pool.counters()
    assert counters["dram"].promotions == 1 and counters["dram"].misses == 1 and counters["ssd"].hits == 1
    assert counters["dram"].demotions == 2 and counters["dram"].evictions == 2
    pool.put(4, block_of(4))  # evicts 3 (LRU) to SSD; then 1 ...
    pool.put(5, block_of(5))  # ... whose SSD copy is still there: no second write
    assert pool.counters()["ssd"].stored == 3  # 1, 2, 3 only
    assert events[6:] == [("stored", 3, "ssd"), ("stored", 4, "dram"), ("stored", 1, "ssd"), ("stored", 5, "dram")]
    assert sorted(pool.keys()) == [1, 2, 3, 4, 5]


def test_events_replayed_give_the_pools_real_state(tmp_path):
    """A Conductor-style index fed only by events ends equal to the pool, through demotion, promotion, eviction
    from both tiers, removal and pinning."""
    index = {}

    def apply(event: BlockEvent) -> None:
        if event.kind is EventKind.STORED:
            index[event.key] = event.tier
        else:
            assert index.pop(event.key) == event.tier

    rng = random.Random(3)
    pool = BlockPool(SPEC, dram_blocks=3, ssd_path=tmp_path, ssd_blocks=6, on_event=apply)
    for step in range(400):
        key = rng.randrange(12)
        action = rng.random()
        if action < 0.45:
            pool.put(key, block_of(key))
        elif action < 0.85:
            got = pool.get(key)
            assert got is None or same_bits(got, block_of(key))
        elif action < 0.95:
            with pool.pin([key]):
                pool.put((key + 1) % 12, block_of((key + 1) % 12))
        else:
            pool.remove(key)
        assert index == {key: pool.tier_of(key) for key in pool.keys()}, step
    by_tier = pool.keys_by_tier()
    assert {k: t for t, keys in by_tier.items() for k in keys} == index
    assert len(by_tier["ssd"]) > 0 and pool.counters()["ssd"].evictions > 0


def test_ssd_survives_restart_and_refuses_another_spec(tmp_path):
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many([5, 6, 7], [block_of(5), block_of(6), block_of(7)])
    reopened = BlockPool(SPEC, dram_blocks=4, ssd_path=tmp_path)
    assert sorted(reopened.keys()) == [5, 6, 7] and reopened.tier_of(6) == "ssd"
    assert all(same_bits(reopened.get(k), block_of(k)) for k in (5, 6, 7))
    with pytest.raises(ValueError, match="holds blocks of float32"):
        BlockPool(BlockSpec((2, 2, 4, 2, 8), ml_dtypes.bfloat16), ssd_path=tmp_path)
    reopened.close()
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path, ssd_blocks=2) as smaller:  # reopened with less room
        assert len(smaller) == 2
    assert len(BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path)) == 2  # the excess block is gone for good
    with pytest.raises(ValueError, match="not a directory"):
        BlockPool(SPEC, ssd_path=tmp_path / "spec.json")


def flip(raw: bytes, at: int, bits: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ bits]) + raw[at + 1 :]


def swap_words(raw: bytes, a: int, b: int) -> bytes:
    """``raw`` with the 8-byte words at offsets a < b exchanged (a word sum over the sector is unchanged)."""
    assert raw[a : a + 8] != raw[b : b + 8]
    return raw[:a] + raw[b : b + 8] + raw[a + 8 : b] + raw[a : a + 8] + raw[b + 8 :]


def cancelling_bit_flips(raw: bytes) -> bytes:
    """Set bit 0 of one data word and clear it in another of the same sector: +1 and -1 leave every additive
    sum (plain or sector-weighted) as it was, which the pool's old checksum could not see."""
    words = np.frombuffer(raw, "<u8", count=64, offset=DATA_OFFSET).copy()
    clear, setb = int(np.flatnonzero(words & 1)[0]), int(np.flatnonzero((words & 1) == 0)[0])
    words[clear] -= 1
    words[setb] += 1
    return raw[:DATA_OFFSET] + words.tobytes() + raw[DATA_OFFSET + 64 * 8 :]


def shard_files(root):
    """The SSD tier's data shard files (one per shard holding records) in its zarr3 array."""
    return sorted((root / DATA_DIR).glob("c.*.0"))


def slot_of(root, key, spec=SPEC):
    """The slot holding ``key``'s record in the SSD tier's arrays (found by its wire prefix), and the record."""
    heads, data = record_arrays(root, spec)
    found = heads[:256].read().result()  # the slots of these tests' few puts
    slot = next(i for i, head in enumerate(found) if head[:PREFIX_BYTES].tobytes() == record_prefix(spec, key))
    raw = found[slot].tobytes() + data[slot].read().result().tobytes()
    assert len(raw) == record_bytes(spec)  # a slot is exactly one record: head and data, stored raw
    return slot, raw


def rewrite_record(root, key, damage, spec=SPEC):
    """Replace ``key``'s record by ``damage(record)`` through TensorStore; a shorter one is a shard file cut short
    (the record must be the last in its shard file, whose index is at its start)."""
    slot, record = slot_of(root, key, spec)
    damaged = damage(record)
    heads, data = record_arrays(root, spec)
    if len(damaged) < len(record):
        path = root / DATA_DIR / f"c.{slot // slots_per_shard(record_bytes(spec))}.0"
        size = path.stat().st_size
        with open(path, "r+b") as file:
            file.truncate(size - (len(record) - len(damaged)))
        return
    heads[slot].write(np.frombuffer(damaged[:DATA_OFFSET], np.uint8)).result()
    data[slot].write(np.frombuffer(damaged[DATA_OFFSET:], np.uint8)).result()


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: flip(raw, DATA_OFFSET + 36, 0x10),  # one bit of the data
        lambda raw: flip(raw, PREFIX_BYTES + 20, 1),  # the key in the frame header
        lambda raw: flip(raw, 1, 1),  # the key in the wire prefix (sent to peers as it is)
        lambda raw: raw[: len(raw) // 2],  # a write cut short
        lambda raw: raw[: len(raw) // 2] + bytes(len(raw) - len(raw) // 2),  # tail never reached the disk
        lambda raw: raw[:DATA_OFFSET] + raw[DATA_OFFSET + 512 :] + raw[DATA_OFFSET : DATA_OFFSET + 512],  # reordered
        lambda raw: swap_words(raw, DATA_OFFSET, DATA_OFFSET + 8),  # two words of one sector swapped
        cancelling_bit_flips,  # a bit set in one word and cleared in another: the sums stay equal
    ],
    ids=["bit", "header", "prefix", "truncated", "zero-tail", "reordered", "swapped-words", "cancelling-bits"],
)
def test_damaged_file_is_a_counted_miss_never_garbage(tmp_path, damage):
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many([2, 1], [block_of(2), block_of(1)])  # 1 in the last slot, so cutting the file spares 2
    rewrite_record(tmp_path, 1, damage)
    events = EventLog()
    pool = BlockPool(SPEC, dram_blocks=4, ssd_path=tmp_path, on_event=events)
    assert pool.get(1) is None and 1 not in pool
    # a damaged head is found when the tier opens (its slot freed, never announced), damaged data when read
    assert events in ([], [("removed", 1, "ssd")])
    assert pool.counters()["ssd"].corrupt == 1 and pool.counters()["ssd"].misses == 1
    assert same_bits(pool.get(2), block_of(2))


@pytest.mark.parametrize("damage", [lambda raw: flip(raw, DATA_OFFSET + 36, 0x10), lambda raw: raw[:-100]],
                         ids=["bit", "truncated"])
def test_a_batch_read_as_one_run_serves_the_sound_blocks_beside_a_damaged_one(tmp_path, damage):
    """Blocks written by one call and read back in order are copied by one read of their consecutive slots; a
    damaged one in the run (a bad checksum, or a shard file cut short so the run's read fails) is a miss alone."""
    keys = [1, 2, 3, 4]
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, [block_of(k) for k in keys])
    rewrite_record(tmp_path, 4, damage)
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        staging = np.zeros((4, *SPEC.shape), SPEC.dtype)
        got = pool.get_many(keys, staging)
        assert [g is not None for g in got] == [True, True, True, False]
        assert all(same_bits(got[i], block_of(k)) for i, k in enumerate(keys[:3]))
        assert pool.counters()["ssd"].corrupt == 1 and 4 not in pool


def test_a_record_of_an_older_format_is_dropped_as_stale_not_corrupt(tmp_path, caplog):
    """Blocks written by a build with another record format are misses counted as stale, logged once."""
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many([1, 2, 3], [block_of(1), block_of(2), block_of(3)])
    for key in (1, 2):  # version 1 in the header (offset 4 of the frame)
        rewrite_record(tmp_path, key, lambda raw: raw[: PREFIX_BYTES + 4] + (1).to_bytes(2, "little")
                       + raw[PREFIX_BYTES + 6 :])
    pool = BlockPool(SPEC, dram_blocks=4, ssd_path=tmp_path)
    with caplog.at_level("WARNING"):
        assert pool.get(1) is None and pool.get(2) is None
    counters = pool.counters()["ssd"]
    assert counters.stale == 2 and counters.corrupt == 0 and counters.misses == 2
    assert 1 not in pool and 2 not in pool
    assert sum("record format version 1" in r.getMessage() for r in caplog.records) == 1
    assert same_bits(pool.get(3), block_of(3))


def test_block_filed_under_another_key_is_not_served(tmp_path):
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many([1, 2], [block_of(1), block_of(2)])
    rewrite_record(tmp_path, 1, lambda raw: slot_of(tmp_path, 2)[1])
    reopened = BlockPool(SPEC, ssd_path=tmp_path)
    assert reopened.get(1) is None and same_bits(reopened.get(2), block_of(2))
    assert reopened.counters()["ssd"].corrupt == 1  # the second copy of 2 was freed


def test_pinning_holds_under_eviction_pressure(tmp_path):
    pool = BlockPool(SPEC, dram_blocks=2)
    pool.put(1, block_of(1))
    with pool.pin([1, 50]) as pinned:
        assert pinned == [1, 50]
        for key in range(2, 12):
            pool.put(key, block_of(key))
            assert 1 in pool
        pool.put(50, block_of(50))  # pinned before it arrived: protected too
        with pytest.raises(PoolFullError, match="pinned"):
            pool.put(60, block_of(60))
        with pytest.raises(ValueError, match="pinned"):
            pool.remove(1)
    pool.put(60, block_of(60))
    pool.put(61, block_of(61))
    assert sorted(pool.keys()) == [60, 61]


def test_pinned_dram_full_spills_to_ssd(tmp_path):
    pool = BlockPool(SPEC, dram_blocks=1, ssd_path=tmp_path)
    pool.put(1, block_of(1))
    with pool.pin([1]):
        pool.put(2, block_of(2))
        assert pool.tier_of(1) == "dram" and pool.tier_of(2) == "ssd"
        assert same_bits(pool.get(2), block_of(2))  # served from SSD, no room to promote
        assert pool.tier_of(2) == "ssd"


def test_capacity_in_bytes_counts_whole_records():
    pool = BlockPool(SPEC, dram_bytes=3 * record_bytes(SPEC) + 10)
    for key in range(10):
        pool.put(key, block_of(key))
    assert len(pool) == 3 and pool.stats()["dram"]["capacity_blocks"] == 3


def test_remove_and_counters():
    events = EventLog()
    pool = BlockPool(SPEC, on_event=events)
    pool.put(1, block_of(1))
    assert pool.get(2) is None and pool.get(1) is not None
    assert pool.remove(1) is True and pool.remove(1) is False
    assert events == [("stored", 1, "dram"), ("removed", 1, "dram")]
    stats = pool.stats()["dram"]
    assert (stats["hits"], stats["misses"], stats["stored"], stats["blocks"]) == (1, 1, 1, 0)


def test_failed_write_is_an_error_and_leaves_no_trace(tmp_path, monkeypatch):
    events = EventLog()
    pool = BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path, on_event=events)
    store = pool._tiers[0].store
    write_slot, failed = store._write_slot, []

    def failing(slot, *record):
        if slot == 1 and not failed:  # block 2's
            failed.append(slot)
            raise OSError("No space left on device")
        return write_slot(slot, *record)

    monkeypatch.setattr(store, "_write_slot", failing)
    with pytest.raises(OSError, match="block 0x0000000000000002 failed: No space left"):
        pool.put_many([1, 2, 3], [block_of(1), block_of(2), block_of(3)])  # 3 was in flight beside 2: stored
    assert sorted(pool.keys()) == [1, 3] and pool.get(2) is None and same_bits(pool.get(1), block_of(1))
    assert events == [("stored", 1, "ssd"), ("stored", 2, "ssd"), ("stored", 3, "ssd"), ("removed", 2, "ssd")]
    assert pool.put(2, block_of(2)) and same_bits(pool.get(2), block_of(2))
    pool.close()
    assert sorted(BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path).keys()) == [1, 2, 3]


def test_a_failed_data_write_abandons_the_open_shard(tmp_path, monkeypatch):
    """A disk error writing the open shard's file (ENOSPC, EIO) fails that call's blocks; the shard is not kept
    open with the error in it, so the next call's blocks go to a fresh shard file and are stored."""
    from mooncake_jax.transfer import shard_writer

    pool = BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path)
    pool.put_many([1], [block_of(1)])  # the open shard, kept open across calls
    write_all, calls = shard_writer._write_all, []

    def failing(fd, buffers, offset):
        if not calls:
            calls.append(fd)
            raise OSError(28, "No space left on device")
        return write_all(fd, buffers, offset)

    monkeypatch.setattr(shard_writer, "_write_all", failing)
    monkeypatch.setattr(shard_writer, "PIECE_BYTES", 1)  # each block handed to the writer as it is appended
    monkeypatch.setattr(shard_writer, "HAND_OFF_BYTES", 1)
    with pytest.raises(OSError, match="No space left"):
        pool.put_many([2, 3], [block_of(2), block_of(3)])
    assert 2 not in pool and 3 not in pool
    pool.put_many([4, 5], [block_of(4), block_of(5)])  # once the disk has room again
    assert same_bits(pool.get(4), block_of(4)) and same_bits(pool.get(5), block_of(5))
    pool.close()
    assert {4, 5} <= set(BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path).keys())


def test_closed_pool_refuses_reads_and_writes(tmp_path):
    pool = BlockPool(SPEC, ssd_path=tmp_path)
    pool.put(1, block_of(1))
    pool.close()
    assert 1 not in pool and pool.prefix_len([1]) == 0
    for operation in (lambda: pool.get(1), lambda: pool.put(2, block_of(2)), lambda: pool.get_record(1)):
        with pytest.raises(ValueError, match="closed"):
            operation()


def test_a_failing_listener_does_not_break_storage():
    def broken(event):
        raise RuntimeError("listener bug")

    pool = BlockPool(SPEC, on_event=broken)
    assert pool.put(1, block_of(1)) and same_bits(pool.get(1), block_of(1))


def test_bad_input_is_a_clear_value_error(tmp_path):
    pool = BlockPool(SPEC)
    with pytest.raises(ValueError, match=r"float64\[2, 2, 4, 2, 8\], the pool holds float32"):
        pool.put(1, np.zeros(SPEC.shape))
    with pytest.raises(ValueError, match="the pool holds"):
        pool.put(1, np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="numpy array"):
        pool.put(1, [[1.0]])
    with pytest.raises(ValueError, match="2\\*\\*64"):
        pool.put(-1, block_of(1))
    with pytest.raises(ValueError, match="2\\*\\*64"):
        pool.get(1 << 64)
    with pytest.raises(ValueError, match="must be an int"):
        pool.get("abc")
    with pytest.raises(ValueError, match="2 keys but 1 blocks"):
        pool.put_many([1, 2], [block_of(1)])
    with pytest.raises(ValueError, match="block 1"):  # checked before anything is stored
        pool.put_many([1, 2], [block_of(1), np.zeros(3)])
    assert len(pool) == 0
    with pytest.raises(ValueError, match="unknown eviction policy"):
        BlockPool(SPEC, eviction="mru")
    with pytest.raises(ValueError, match="not both"):
        BlockPool(SPEC, dram_blocks=2, dram_bytes=10**6)
    with pytest.raises(ValueError, match="holds no block"):
        BlockPool(SPEC, dram_bytes=10)
    with pytest.raises(ValueError, match="no tier"):
        BlockPool(SPEC, dram_blocks=0)
    with pytest.raises(ValueError, match="without ssd_path"):
        BlockPool(SPEC, ssd_blocks=4)
    with pytest.raises(ValueError, match="shape"):
        BlockSpec((2, 0), np.float32)
    with pytest.raises(ValueError, match="not a dtype"):
        BlockSpec((2,), "float99")


WRITER = """
import sys, numpy as np
from mooncake_jax.transfer import BlockPool, BlockSpec
spec = BlockSpec((8, 2, 16, 4, 64), np.float32)
pool = BlockPool(spec, dram_blocks=0, ssd_path=sys.argv[1])
key = 0
while True:
    key += 1
    bits = np.random.default_rng(key).integers(0, 2**16, size=spec.nbytes // 2, dtype=np.uint16)
    pool.put(key, bits.view(spec.dtype).reshape(spec.shape))
"""


def test_writer_killed_mid_write_never_serves_a_torn_block(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    spec = BlockSpec((8, 2, 16, 4, 64), np.float32)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 30
        while len(shard_files(tmp_path)) < 2:  # 64 puts fill a shard; the second is growing when it is killed
            assert writer.poll() is None and time.monotonic() < deadline, "writer did not get going"
            time.sleep(0.02)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    pool = BlockPool(spec, dram_blocks=0, ssd_path=tmp_path)
    keys = sorted(pool.keys())
    assert len(keys) >= 20
    for key in keys:
        got = pool.get(key)
        assert got is None or same_bits(got, block_of(key, spec))


def test_dram_slots_are_reused_not_reallocated():
    pool = BlockPool(SPEC, dram_blocks=4)
    for key in range(1, 21):
        pool.put(key, block_of(key))
    store = pool._tiers[0].store
    assert store._allocated == 4 and len(store._slabs) == 1  # 20 puts, 16 evictions: the same 4 slots throughout
    assert sorted(pool.keys()) == [17, 18, 19, 20] and all(same_bits(pool.get(k), block_of(k)) for k in pool.keys())


def test_a_corrupt_record_from_a_peer_stores_nothing_and_frees_its_slot():
    from mooncake_jax.transfer import CorruptBlockError
    from mooncake_jax.transfer.frame import encode

    pool = BlockPool(SPEC, dram_blocks=2)
    pool.put(1, block_of(1))
    record = bytearray(encode(SPEC, 2, block_of(2)))
    record[DATA_OFFSET + 100] ^= 4
    with pytest.raises(CorruptBlockError, match="checksum mismatch"):
        pool.put_record(2, bytes(record))
    assert 2 not in pool and pool.tier_of(1) == "dram"
    assert pool.put_record(2, encode(SPEC, 2, block_of(2))) and pool.put(3, block_of(3))  # 2 slots, 1 evicted
    assert pool._tiers[0].store._allocated == 2 and same_bits(pool.get(2), block_of(2))


def test_received_records_stored_in_one_call_stop_at_a_corrupt_one():
    """put_records (a Messenger message's records in one pool call) stores in order as put_record would, says which
    were new, and on a record that fails leaves the ones before it stored, it and those after it not."""
    from mooncake_jax.transfer import CorruptBlockError
    from mooncake_jax.transfer.frame import encode

    pool = BlockPool(SPEC, dram_blocks=8)
    pool.put(2, block_of(2))
    damaged = bytearray(encode(SPEC, 4, block_of(4)))
    damaged[DATA_OFFSET + 7] ^= 1
    records = [(1, encode(SPEC, 1, block_of(1))), (2, encode(SPEC, 2, block_of(2))),
               (3, memoryview(encode(SPEC, 3, block_of(3)))), (4, bytes(damaged)), (5, encode(SPEC, 5, block_of(5)))]
    new: list[bool] = []
    with pytest.raises(CorruptBlockError, match="block 0x0000000000000004: checksum mismatch"):
        pool.put_records(records, new)
    assert new == [True, False, True]
    assert sorted(pool.keys()) == [1, 2, 3] and all(same_bits(pool.get(k), block_of(k)) for k in (1, 2, 3))
    new.clear()
    pool.put_records(records[4:], new)
    assert new == [True] and same_bits(pool.get(5), block_of(5))


def test_a_removed_ssd_block_stays_removed_and_empty_shards_are_deleted(tmp_path):
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many([1, 2], [block_of(1), block_of(2)])  # one call: one shard file
        assert len(shard_files(tmp_path)) == 1
        pool.put(3, block_of(3))  # a later call fills the same open shard: no new file
        assert len(shard_files(tmp_path)) == 1 and all(same_bits(pool.get(k), block_of(k)) for k in (1, 2, 3))
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        assert sorted(pool.keys()) == [1, 2, 3]
        pool.put(4, block_of(4))  # a reopened tier never rewrites a shard it found: a fresh one
        assert len(shard_files(tmp_path)) == 2
        assert pool.remove(2) and len(shard_files(tmp_path)) == 2  # its head is zeroed, the shard stays
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        assert sorted(pool.keys()) == [1, 3, 4]  # removed: not listed again
        assert pool.remove(4) and len(shard_files(tmp_path)) == 1  # the last record of a shard: file deleted
        pool.put(5, block_of(5))
        assert pool.remove(5)  # the last record of the open shard: deleted when it is sealed
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        assert sorted(pool.keys()) == [1, 3] and all(same_bits(pool.get(k), block_of(k)) for k in (1, 3))
        assert len(shard_files(tmp_path)) == 1


def keys_on_disk_now(root, copy):
    """The blocks another pool finds in a copy of the SSD directory ``root`` taken now (as after a crash)."""
    import shutil

    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(root, copy)
    with BlockPool(SPEC, dram_blocks=0, ssd_path=copy) as seen:
        keys = sorted(seen.keys())
        assert all(same_bits(seen.get(k), block_of(k)) for k in keys)
        return keys


def test_an_open_shard_grows_over_calls_and_each_call_is_on_disk_when_it_returns(tmp_path):
    """Calls fill one shard (its data and heads files rewritten in place, the index last): after every call the
    blocks so far are on disk whole, and a removal in the open shard is on disk after the next call."""
    pool = BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path / "ssd")
    for key in range(1, 6):
        pool.put(key, block_of(key))
        assert keys_on_disk_now(tmp_path / "ssd", tmp_path / "copy") == list(range(1, key + 1))
    assert len(shard_files(tmp_path / "ssd")) == 1
    assert pool.remove(3) and pool.put(6, block_of(6))
    assert keys_on_disk_now(tmp_path / "ssd", tmp_path / "copy") == [1, 2, 4, 5, 6]
    assert pool.remove(4) and pool.get(1) is not None  # a call that writes nothing still writes the zeroed head
    assert keys_on_disk_now(tmp_path / "ssd", tmp_path / "copy") == [1, 2, 5, 6]
    pool.close()


def test_ssd_churn_is_compacted_so_the_disk_holds_about_twice_the_live_blocks(tmp_path, monkeypatch):
    """A full SSD tier where one block of each call's shard stays hot: the other three die, their shard stays
    for the live one; compaction moves the live records of the emptiest shards so the records on disk stay
    within twice the live ones (plus a shard), and no block is lost or damaged."""
    from mooncake_jax.transfer import files
    from mooncake_jax.transfer.shard_file import data_start
    from mooncake_jax.transfer.shard_writer import ALIGN

    monkeypatch.setattr(files, "SHARD_BYTES", 4 * record_bytes(SPEC))  # four slots per shard
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path, ssd_blocks=8) as pool:
        store = pool._tiers[0].store
        index_bytes = data_start(store.shard_slots, ALIGN)  # the index, then padding to the page the data starts on
        most = 0
        for call in range(40):
            keys = [4 * call + i for i in range(1, 5)]
            pool.put_many(keys, [block_of(k) for k in keys])
            for key in pool.keys():  # the first of every call stays the most recently used
                if key % 4 == 1:
                    assert same_bits(pool.get(key), block_of(key))
            on_disk = sum((path.stat().st_size - index_bytes) // SPEC.nbytes for path in shard_files(tmp_path))
            most = max(most, on_disk)
            assert store._dead == on_disk - len(pool)  # the bookkeeping matches the files
        assert store.moved_by_compaction > 0 and len(pool) == 8 and most <= 2 * 8 + 2 * store.shard_slots
        assert all(same_bits(pool.get(k), block_of(k)) for k in pool.keys())
        kept = sorted(pool.keys())
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        assert sorted(pool.keys()) == kept and all(same_bits(pool.get(k), block_of(k)) for k in kept)


def test_ssd_writes_in_flight_are_bounded(tmp_path, monkeypatch):
    import threading
    import time

    from mooncake_jax.transfer import files

    monkeypatch.setattr(files, "SHARD_BYTES", record_bytes(SPEC))  # one slot per shard: one commit per block
    pool = BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path)
    store = pool._tiers[0].store
    assert store.shard_slots == 1
    write_slot, running, most = store._write_slot, [0], [0]
    lock = threading.Lock()

    def slow(slot, *record):
        with lock:
            running[0] += 1
            most[0] = max(most[0], len(store._pending))
        time.sleep(0.005)
        return write_slot(slot, *record)

    monkeypatch.setattr(store, "_write_slot", slow)
    keys = list(range(1, 3 * store.max_in_flight))
    pool.put_many(keys, [block_of(k) for k in keys])
    assert running[0] == len(keys) and most[0] <= store.max_in_flight and not store._pending
    assert all(same_bits(pool.get(k), block_of(k)) for k in keys)


@pytest.mark.parametrize("size", [1, 1000, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 5])
def test_copy_with_checksum_copies_and_hashes_like_one_shot(size):
    import xxhash

    from mooncake_jax.transfer.checksum import copy_with_checksum

    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros_like(src)
    high, low = copy_with_checksum(dst, src)
    assert np.array_equal(dst, src) and (high << 64 | low) == xxhash.xxh3_128_intdigest(src.tobytes())


def assert_migrated_once(tmp_path, caplog, layout):
    """Blocks 1 and 2 of an older ``layout`` move into the arrays on open (a damaged third is dropped), with one
    log line; the old files are gone and a second open finds the same blocks without moving anything again."""
    with caplog.at_level("WARNING"), BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        assert sorted(pool.keys()) == [1, 2] and same_bits(pool.get(2), block_of(2))
    assert sum(f"moved 2 blocks from {layout}" in r.getMessage() and "dropped 1" in r.getMessage()
               for r in caplog.records) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*ARRAY_DIRS, "spec.json"])
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        assert sorted(pool.keys()) == [1, 2] and same_bits(pool.get(1), block_of(1))


def test_blocks_in_the_chunk_per_slot_layout_move_into_the_shards(tmp_path, caplog):
    """An SSD directory of the layout before shards (``records.zarr``: one zarr3 chunk file per slot holding the
    whole record) is migrated on open, once, with one log line; a damaged record is dropped."""
    from mooncake_jax.transfer.frame import encode

    BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path).close()  # writes spec.json
    bad = bytearray(encode(SPEC, 3, block_of(3)))
    bad[DATA_OFFSET + 5] ^= 1
    for slot, record in enumerate([encode(SPEC, 1, block_of(1)), bytes(bad), encode(SPEC, 2, block_of(2))]):
        (tmp_path / LEGACY_ARRAY_DIR / "c" / str(slot)).mkdir(parents=True)
        (tmp_path / LEGACY_ARRAY_DIR / "c" / str(slot) / "0").write_bytes(record)
    (tmp_path / LEGACY_ARRAY_DIR / "zarr.json").write_text("{}")
    assert_migrated_once(tmp_path, caplog, "one chunk file per slot")


def test_blocks_in_the_slot_file_layout_move_into_the_array(tmp_path, caplog):
    """An SSD directory of the slot-file layout (records at page-aligned offsets of ``records.slots``, the same
    record format) is migrated on open, once, with one log line; damaged records and free slots are dropped."""
    from mooncake_jax.transfer.frame import encode

    BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path).close()  # writes spec.json
    stride = -(-record_bytes(SPEC) // 4096) * 4096
    bad = bytearray(encode(SPEC, 3, block_of(3)))
    bad[DATA_OFFSET + 5] ^= 1
    slots = [encode(SPEC, 1, block_of(1)), bytes(record_bytes(SPEC)), bytes(bad), encode(SPEC, 2, block_of(2))]
    (tmp_path / LEGACY_SLOTS_FILE).write_bytes(b"".join(r.ljust(stride, b"\0") for r in slots))
    assert_migrated_once(tmp_path, caplog, "the slot file")


def test_blocks_in_the_file_per_block_layout_move_into_the_array(tmp_path, caplog):
    """An SSD directory written before slots (one file per record, same format) is migrated on open, once."""
    from mooncake_jax.transfer.frame import encode

    BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path).close()  # writes spec.json
    for key in (1, 2, 0xAB00000000000003):
        name = f"{key:016x}"
        (tmp_path / name[:2]).mkdir(exist_ok=True)
        (tmp_path / name[:2] / name).write_bytes(encode(SPEC, key, block_of(key)))
    (tmp_path / "00" / f"{2:016x}").write_bytes(encode(SPEC, 9, block_of(9)))  # filed under the wrong key
    with caplog.at_level("WARNING"), BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        assert sorted(pool.keys()) == [1, 0xAB00000000000003] and same_bits(pool.get(1), block_of(1))
    assert sum("moved 2 blocks" in r.getMessage() and "dropped 1" in r.getMessage() for r in caplog.records) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*ARRAY_DIRS, "spec.json"])
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        assert same_bits(pool.get(0xAB00000000000003), block_of(0xAB00000000000003)) and len(pool) == 2


def test_dram_tier_is_a_tensorstore_array_over_its_slot_memory():
    """Records live in TensorStore arrays whose memory is the preallocated slab; a multi-MiB block (copied into its
    slot and hashed in one pass) round-trips bit-exact, and a get into a staging buffer lands every byte."""
    import tensorstore as ts

    spec = BlockSpec((4, 2, 64, 4, 256), np.float32)  # 2 MiB
    blocks = {key: block_of(key, spec) for key in (1, 2, 3)}
    with BlockPool(spec, dram_blocks=2) as pool:
        pool.put_many(list(blocks), list(blocks.values()))  # 1 evicted (no SSD tier: dropped)
        store = pool._tiers[0].store
        assert all(isinstance(slab, ts.TensorStore) for slab in store._slabs)
        slot = store._slot_of[3]
        assert np.array_equal(slot.memory[DATA_OFFSET:], blocks[3].reshape(-1).view(np.uint8))
        staging = np.zeros((2, *spec.shape), spec.dtype)
        got = pool.get_many([2, 3], staging)
        assert same_bits(got[0], blocks[2]) and same_bits(got[1], blocks[3]) and got[1] is not None
        assert pool.get(1) is None
        slot.record[:1].write(np.array([0xAB], np.uint8)).result()  # the array's memory is the slot's, not a copy
        assert slot.memory[0] == 0xAB and pool.get(3) is None and pool.stats()["dram"]["corrupt"] == 1


def test_a_pool_process_reuses_freed_buffers_instead_of_faulting_in_fresh_pages():
    """After a pool exists, a 64 MiB ``bytes`` built, used and freed again and again (as gRPC's messages and
    TensorStore's encode buffers are) lands on the same warm pages (glibc's default maps and unmaps anything over
    32 MiB: 16,384 page faults every time)."""
    import platform
    import resource

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's mallopt only")
    BlockPool(SPEC, dram_blocks=1).close()
    pages = (64 << 20) // 4096
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        message = b"x" * (64 << 20)  # allocated, written, freed
        del message
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 2 * pages, f"{faults} page faults for 8 fills of {pages} pages: freed buffers not reused"


def test_joined_records_are_the_records_and_stop_before_a_corrupt_one():
    """What the Messenger sends several to a message: the records as get_record gives them, separator between; a
    record failing its checksum ends the join before it and is dropped, never sent."""
    with BlockPool(SPEC, dram_blocks=8) as pool:
        pool.put_many([1, 2, 3, 4], [block_of(key) for key in (1, 2, 3, 4)])
        records = {key: pool.get_record(key) for key in (1, 2, 3, 4)}
        message, count = pool.join_records([1, 2, 3, 4], b"<>")
        assert count == 4 and message == b"<>".join(records[key] for key in (1, 2, 3, 4))
        pool._tiers[0].store._slot_of[3].memory[-1] ^= 1  # block 3's last data byte
        message, count = pool.join_records([1, 2, 3, 4], b"<>")
        assert count == 2 and message == records[1] + b"<>" + records[2]
        assert 3 not in pool and pool.stats()["dram"]["corrupt"] == 1
        assert pool.join_records([3, 4], b"<>") == (b"", 0)  # absent now: nothing joined
        assert pool.join_records([4], b"<>") == (records[4], 1)


def test_a_whole_received_record_is_kept_as_it_arrived_when_no_slot_is_free(tmp_path):
    """A ``bytes`` record (a Messenger message of one record) is kept as that buffer, hashed where it lies, when no
    slot is free: no copy, and get_record hands the same object on (a sender's ``bytes()`` of it is no copy
    either). Adopted records count against the capacity when slabs grow; a free slot is filled by a copy instead; a
    corrupt one stores nothing; an adopted block is demoted to SSD like any other."""
    from mooncake_jax.transfer import CorruptBlockError
    from mooncake_jax.transfer.frame import encode

    records = {key: encode(SPEC, key, block_of(key)) for key in range(1, 7)}
    with BlockPool(SPEC, dram_blocks=3) as pool:
        store = pool._tiers[0].store
        assert pool.put_record(1, records[1]) and pool.put_record(2, records[2])
        assert store._slot_of[1].adopted is records[1] and store._allocated == 0  # no slab: kept as they came
        assert pool.get_record(2) is records[2] and same_bits(pool.get(1), block_of(1))
        pool.put(3, block_of(3))  # a local block needs a slot: the slab gets only what the adopted two leave
        assert store._allocated == 1 and store.kept_records == 2
        damaged = bytearray(records[4])
        damaged[DATA_OFFSET + 7] ^= 1
        with pytest.raises(CorruptBlockError, match="checksum mismatch"):
            pool.put_record(4, bytes(damaged))  # full: block 2 evicted first, then nothing stored
        assert 4 not in pool and store.kept_records == 1 and sorted(pool.keys()) == [1, 3]
        assert pool.put_record(4, records[4]) and store._slot_of[4].adopted is records[4]
        pool.remove(3)  # its slot is free now: the next record is copied into it, no new memory
        assert pool.put_record(5, records[5]) and store._slot_of[5].adopted is None
        assert store._allocated == 1 and store.kept_records == 2
        assert all(same_bits(pool.get(key), block_of(key)) for key in (1, 4, 5))
    with BlockPool(SPEC, dram_blocks=1, ssd_path=tmp_path) as pool:
        pool.put_record(1, records[1])
        pool.put_record(2, records[2])  # block 1, adopted, is demoted to SSD
        assert pool.tier_of(1) == "ssd" and pool.tier_of(2) == "dram" and same_bits(pool.get(1), block_of(1))


def message_of_records(keys, spec: BlockSpec = SPEC) -> tuple[bytes, list]:
    """A Messenger message of several whole records (as a sender joins them) and its ``(key, view)`` pairs, as the
    receiver reads them."""
    from mooncake_jax.transfer.frame import encode
    from mooncake_jax.transfer.pieces import RecordAssembler, next_separator

    message = next_separator(record_bytes(spec)).join(encode(spec, key, block_of(key, spec)) for key in keys)
    return message, RecordAssembler(spec).whole_records(message)


def test_records_received_several_to_a_message_are_kept_in_it_within_the_capacity_in_bytes(tmp_path):
    """Records viewed in a received message are kept where they lie (no copy); the message counts whole against the
    capacity while any of its records is held, so the pool evicts until it fits. Hand-worked with 1,152-byte records
    in 1,152-byte slots, 4 blocks = 4,608 bytes: a message of 3 is 3,462 bytes (two 3-byte separators)."""
    from mooncake_jax.transfer import CorruptBlockError
    from mooncake_jax.transfer.frame import encode
    from mooncake_jax.transfer.pieces import RecordAssembler

    def stored(pool: BlockPool, message_keys) -> tuple[bytes, list[bool]]:
        message, records = message_of_records(message_keys)
        new: list[bool] = []
        pool.put_records(records, new)
        return message, new

    with BlockPool(SPEC, dram_blocks=4) as pool:
        store = pool._tiers[0].store
        assert store._stride == 1152 and store._capacity_bytes == 4608
        a, new = stored(pool, [1, 2, 3])
        assert new == [True] * 3 and len(a) == 3462 and store._allocated == 0 and store.used_bytes == 3462
        assert all(store._slot_of[key].message is a for key in (1, 2, 3))  # kept in the message, not copied
        assert [pool.get_record(key) for key in (1, 2, 3)] == [bytes(r) for _, r in message_of_records([1, 2, 3])[1]]
        # a second message needs 3,462 more bytes: evicting 1 and 2 frees nothing (3 still holds the first message)
        b, _ = stored(pool, [4, 5, 6])
        assert sorted(pool.keys()) == [4, 5, 6] and store.used_bytes == 3462 and len(store._kept) == 1
        # a local block needs a 1,152-byte slot: 3,462 + 1,152 > 4,608, so the whole message goes before it fits
        pool.put(7, block_of(7))
        assert pool.keys() == [7] and store._allocated == 4 and store.used_bytes == 4608 and not store._kept
        c, _ = stored(pool, [8, 9, 10])  # free slots, already paid for, are filled by copies
        assert sorted(pool.keys()) == [7, 8, 9, 10] and store.kept_records == 0 and store.used_bytes == 4608
        assert all(same_bits(pool.get(key), block_of(key)) for key in (7, 8, 9, 10))

    with BlockPool(SPEC, dram_blocks=4) as pool:  # a record outliving its message's others keeps it all counted
        store = pool._tiers[0].store
        a, _ = stored(pool, [1, 2, 3])
        pool.remove(1)
        pool.remove(3)
        assert pool.keys() == [2] and store.used_bytes == 3462 and same_bits(pool.get(2), block_of(2))
        alone = encode(SPEC, 4, block_of(4))  # 3,462 + 1,152 > 4,608: 2 goes first
        assert pool.put_record(4, alone) and pool.keys() == [4] and store.used_bytes == 1152
        assert store._slot_of[4].adopted is alone
        damaged = bytearray(message_of_records([5, 6, 7])[0])
        damaged[1152 + 3 + DATA_OFFSET + 5] ^= 1  # record 6's data; the message needs 4 evicted first
        new: list[bool] = []
        with pytest.raises(CorruptBlockError, match="checksum mismatch"):
            pool.put_records(RecordAssembler(SPEC).whole_records(bytes(damaged)), new)
        assert new == [True] and pool.keys() == [5] and store.used_bytes == 3462
        assert same_bits(pool.get(5), block_of(5))

    with BlockPool(SPEC, dram_blocks=2) as pool:  # a message larger than the whole tier is copied into slots
        store = pool._tiers[0].store
        stored(pool, [1, 2, 3])
        assert sorted(pool.keys()) == [2, 3] and store.kept_records == 0 and store.used_bytes == 2304

    with BlockPool(SPEC, dram_blocks=4, ssd_path=tmp_path) as pool:  # kept records are demoted like any other
        stored(pool, [1, 2, 3])
        stored(pool, [4, 5, 6])
        assert [pool.tier_of(key) for key in range(1, 7)] == ["ssd"] * 3 + ["dram"] * 3
        assert all(same_bits(pool.get(key), block_of(key)) for key in range(1, 7))
