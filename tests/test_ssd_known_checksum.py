"""A record whose head already carries its checksum is written to the SSD tier without hashing it again (issue 15,
thirteenth pass): a block demoted from DRAM (its head is the one the DRAM tier took when the block was put) and a
received record stored in an SSD-only pool (hashed once, against its head, before anything is written). What the
head promises is still checked on every read: a block damaged in DRAM before its demotion lands on SSD with the
head of the sound block, so its read fails the check (dropped, counted corrupt) and it is never served."""

import numpy as np
import pytest
from test_pool import SPEC, block_of, same_bits

from mooncake_jax.transfer import BlockPool
from mooncake_jax.transfer.frame import CorruptBlockError, encode
from mooncake_jax.transfer.shard_writer import ShardImage

BIG = type(SPEC)((4, 2, 32, 4, 64), np.float32)  # 256 KiB blocks: written from where they lie in a 1 MiB hand-off


def counted_hashes(monkeypatch) -> list:
    """Every ``ShardImage.append`` call's ``digest`` argument, from now on."""
    seen = []
    real = ShardImage.append

    def append(self, data, digest=True, now=False):
        seen.append(digest)
        return real(self, data, digest, now)

    monkeypatch.setattr(ShardImage, "append", append)
    return seen


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("spec", [SPEC, BIG], ids=["tiny", "256k"])
def test_demoted_blocks_are_not_hashed_again_and_read_back_exact(tmp_path, monkeypatch, direct_io, spec):
    seen = counted_hashes(monkeypatch)
    keys = list(range(1, 11))
    with BlockPool(spec, dram_blocks=3, ssd_path=tmp_path, ssd_direct_io=direct_io) as pool:
        pool.put_many(keys, [block_of(k, spec) for k in keys])  # 1-7 demoted
        assert seen == [False] * 7 and pool.counters()["dram"].evictions == 7
        assert pool.tier_of(1) == "ssd"
        for key in keys:
            assert same_bits(pool.get(key), block_of(key, spec))
        assert pool.counters()["ssd"].corrupt == 0


@pytest.mark.parametrize("direct_io", [False, True], ids=["buffered", "direct"])
def test_a_block_damaged_in_dram_before_its_demotion_is_never_served_from_ssd(tmp_path, direct_io):
    with BlockPool(SPEC, dram_blocks=2, ssd_path=tmp_path, ssd_direct_io=direct_io) as pool:
        pool.put_many([1, 2], [block_of(1), block_of(2)])
        pool._tiers[0].store._slot_of[1].data[7] ^= 0x20  # memory gone bad after the put
        pool.put_many([3, 4], [block_of(3), block_of(4)])  # 1 and 2 demoted
        assert pool.tier_of(1) == "ssd" and pool.tier_of(2) == "ssd"
        assert pool.get(1) is None  # its SSD copy fails the head's checksum: dropped, never served
        assert 1 not in pool and pool.counters()["ssd"].corrupt == 1
        assert pool.get_record(1) is None
        assert same_bits(pool.get(2), block_of(2))  # its neighbour is sound


def test_a_received_record_in_an_ssd_only_pool_is_hashed_once_and_checked(tmp_path, monkeypatch):
    seen = counted_hashes(monkeypatch)
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        record = encode(SPEC, 5, block_of(5))
        assert pool.put_record(5, record)
        assert seen == [False]
        damaged = bytearray(encode(SPEC, 6, block_of(6)))
        damaged[-1] ^= 0x01
        with pytest.raises(CorruptBlockError):
            pool.put_record(6, bytes(damaged))
        assert seen == [False] and 6 not in pool  # refused before anything was written
        assert same_bits(pool.get(5), block_of(5))
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as reopened:  # and after a reopen
        assert sorted(reopened.keys()) == [5] and same_bits(reopened.get(5), block_of(5))


def test_a_put_of_a_callers_block_is_still_hashed(tmp_path, monkeypatch):
    seen = counted_hashes(monkeypatch)
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many([1, 2], [block_of(1), block_of(2)])
        assert seen == [True, True]
        pool._tiers[0].settle()
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as reopened:
        assert same_bits(reopened.get(1), block_of(1)) and same_bits(reopened.get(2), block_of(2))
