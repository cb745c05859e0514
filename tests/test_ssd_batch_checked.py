"""A batch get's SSD records are checked in the tier's batch read (issue 15, sixteenth pass): ``FileStore.prefetch``
reads and hashes a batch's records into the caller's buffer and compares each checksum with the one its head
promises, where that head is known sound (made by the tier from the data's checksum, or checked whole on open or
when a received record was stored); ``take_checked`` then hands such a record on without the pool's per-record
head parse. Everything else (a head not known sound, a record that failed, writes since) goes the per-record way,
which checks the head and the checksum as before. These tests hold the batch way to the per-record way's answers
and counters, and show that what it skips is never a check a record needs."""

import numpy as np
import pytest
from test_pool import SPEC, block_of, rewrite_record, same_bits

from mooncake_jax.transfer import BlockPool, shard_reader
from mooncake_jax.transfer.files import FileStore
from mooncake_jax.transfer.frame import DATA_OFFSET, PREFIX_BYTES, encode


def per_record_reads(monkeypatch) -> list:
    """The keys ``FileStore.read_into`` (the per-record way) is asked for, from now on."""
    seen = []
    real = FileStore.read_into

    def read_into(self, key, out):
        seen.append(key)
        return real(self, key, out)

    monkeypatch.setattr(FileStore, "read_into", read_into)
    return seen


def staging(n: int) -> np.ndarray:
    return np.zeros((n, *SPEC.shape), SPEC.dtype)


@pytest.mark.parametrize("helped", [True, False])
def test_a_batch_of_sound_records_is_served_checked_with_the_per_record_ways_counters(tmp_path, monkeypatch, helped):
    monkeypatch.setattr(shard_reader.Pace, "helped", lambda self: helped)
    keys = list(range(1, 9))
    counters = {}
    for way in ("batch", "per-record"):
        with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path / way) as pool:
            pool.put_many(keys, [block_of(k) for k in keys])
            if way == "per-record":
                monkeypatch.setattr(pool._tiers[0], "_take_checked", None)  # as a store without batch checks
            seen = per_record_reads(monkeypatch)
            got = pool.get_many(keys + [99], staging(len(keys) + 1))  # 99: a miss
            assert all(same_bits(g, block_of(k)) for g, k in zip(got, keys)) and got[-1] is None
            assert seen == ([] if way == "batch" else keys)
            counters[way] = pool.counters()["ssd"]
        monkeypatch.undo()
        monkeypatch.setattr(shard_reader.Pace, "helped", lambda self: helped)
    assert counters["batch"] == counters["per-record"]
    assert counters["batch"].hits == len(keys) and counters["batch"].misses == 1


@pytest.mark.parametrize("reopened", [False, True], ids=["as-written", "reopened"])
@pytest.mark.parametrize("at", [PREFIX_BYTES + 32, PREFIX_BYTES + 64 + 5, -1],
                         ids=["stored-checksum", "data", "last-byte"])
def test_a_damaged_record_in_a_batch_is_never_served_and_its_neighbours_are(tmp_path, reopened, at):
    """A bit flipped in the stored checksum or the data of one record (on disk, or in the page cache the read comes
    from): that one is a counted corrupt miss, dropped; the batch's others are served exact."""
    keys = list(range(1, 7))
    pool = BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path)
    pool.put_many(keys, [block_of(k) for k in keys])
    if reopened:
        pool.close()
    where = len(encode(SPEC, 4, block_of(4))) - 1 if at == -1 else at
    if reopened:  # through TensorStore, which rewrites the shard
        rewrite_record(tmp_path, 4, lambda raw: raw[:where] + bytes([raw[where] ^ 0x04]) + raw[where + 1 :])
    elif where < DATA_OFFSET:  # the head is held in memory: damage it there
        pool._tiers[0].store._shard_heads[0][3, where] ^= 0x04
    else:  # in the open shard file where the tier wrote it (the page cache a read comes from)
        store = pool._tiers[0].store
        shard, _, offset = store._location(4)
        with open(store._data_path(shard), "r+b") as file:
            file.seek(offset + where - DATA_OFFSET)
            byte = file.read(1)[0]
            file.seek(offset + where - DATA_OFFSET)
            file.write(bytes([byte ^ 0x04]))
    if reopened:
        pool = BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path)
    got = pool.get_many(keys, staging(len(keys)))
    assert [g is not None for g in got] == [k != 4 for k in keys]
    assert all(same_bits(g, block_of(k)) for g, k in zip(got, keys) if k != 4)
    assert pool.counters()["ssd"].corrupt == 1 and 4 not in pool
    pool.close()


@pytest.mark.parametrize("byte", [1, PREFIX_BYTES + 8, PREFIX_BYTES + 16],
                         ids=["key-in-prefix", "spec-fingerprint", "key-in-header"])
def test_a_head_damaged_in_dram_before_its_demotion_is_checked_whole_in_a_batch(tmp_path, monkeypatch, byte):
    """A demoted record's head is not known sound (the DRAM slot may have gone bad): a batch reads it, but the pool
    checks its head whole, so a head naming another key or spec is never served even though the data still matches
    the checksum it carries."""
    with BlockPool(SPEC, dram_blocks=2, ssd_path=tmp_path) as pool:
        pool.put_many([1, 2], [block_of(1), block_of(2)])
        pool._tiers[0].store._slot_of[1].memory[byte] ^= 0x01  # the head, after the put
        pool.put_many([3, 4], [block_of(3), block_of(4)])  # 1 and 2 demoted
        assert pool.tier_of(1) == "ssd" and pool.tier_of(2) == "ssd"
        seen = per_record_reads(monkeypatch)
        got = pool.get_many([1, 2], staging(2))  # 1 first: 2's promotion demotes 3, a write the batch waits for
        assert got[0] is None and same_bits(got[1], block_of(2))
        assert 1 in seen and pool.counters()["ssd"].corrupt == 1 and 1 not in pool


def test_a_record_of_an_older_format_in_a_batch_is_stale_and_the_rest_served(tmp_path):
    keys = [1, 2, 3, 4]
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, [block_of(k) for k in keys])
    rewrite_record(tmp_path, 2, lambda raw: raw[: PREFIX_BYTES + 4] + (1).to_bytes(2, "little")
                   + raw[PREFIX_BYTES + 6 :])  # version 1
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        got = pool.get_many(keys, staging(len(keys)))
        assert [g is not None for g in got] == [True, False, True, True]
        counters = pool.counters()["ssd"]
        assert counters.stale == 1 and counters.corrupt == 0 and 2 not in pool


def test_received_records_are_served_checked_and_a_key_written_again_is_read_anew(tmp_path, monkeypatch):
    """A received record stored in an SSD-only pool had its head checked whole when it was stored; a key asked twice
    in one batch is served twice, exact; and a key written again after its batch read is read from its new place."""
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        for key in (1, 2, 3):
            assert pool.put_record(key, encode(SPEC, key, block_of(key)))
        seen = per_record_reads(monkeypatch)
        got = pool.get_many([1, 2, 3, 1], staging(4))
        assert all(same_bits(g, block_of(k)) for g, k in zip(got, [1, 2, 3, 1]))
        assert seen == [1]  # the second 1: the batch read it once
        store = pool._tiers[0].store
        outs = list(staging(2).reshape(2, -1).view(np.uint8))
        store.prefetch([1, 2], outs)
        store.put_block(2, block_of(7).reshape(-1).view(np.uint8))  # 2 now lies elsewhere, other bytes
        assert store.take_checked(1, outs[0]) is None  # a write in flight: nothing handed on before it settles
        store.settle()
        assert store.take_checked(1, outs[0]) is not None and store.take_checked(2, outs[1]) is None
        assert store.take_checked(1, outs[0]) is None  # handed on once
