"""Received messages read and hashed as they arrive (``arrival.py``, issue 15 fourteenth pass): the digests taken on
gRPC's thread are the records' own checksums, anything but whole records of the pool's spec passes through untouched,
and a store given digests refuses what does not match its head before anything is evicted for it, in DRAM (kept as
received or copied into a free slot) and on SSD. Every digest is checked against ``xxhash`` called directly on the
record's data; every stored block read back bit-exact."""

import numpy as np
import pytest
import xxhash

from mooncake_jax.transfer import BlockPool, BlockSpec, CorruptBlockError
from mooncake_jax.transfer.arrival import Arrival, hashing, received
from mooncake_jax.transfer.frame import DATA_OFFSET, encode
from mooncake_jax.transfer.messenger import MessengerClient, MessengerServer
from mooncake_jax.transfer.pieces import RecordAssembler, encode_piece, next_separator, record_pieces

TINY = BlockSpec((2, 2, 4, 2, 8), np.float32)  # 1,152-byte records
OTHER = BlockSpec((2, 2, 4, 2, 4), np.float32)


def block_of(key: int, spec: BlockSpec = TINY) -> np.ndarray:
    bits = np.random.default_rng(key).integers(0, 2**16, size=spec.nbytes // 2, dtype=np.uint16)
    return bits.view(spec.dtype).reshape(spec.shape)


def message(keys, spec: BlockSpec = TINY) -> bytes:
    """Whole records joined by hand as a sender joins them (``frame.encode``, the ``next`` tag and length)."""
    records = [encode(spec, key, block_of(key, spec)) for key in keys]
    return next_separator(len(records[0])).join(records)


def xxh(data) -> tuple[int, int]:
    digest = xxhash.xxh3_128_intdigest(bytes(data))
    return digest >> 64, digest & ((1 << 64) - 1)


def exact(pool: BlockPool, keys, spec: BlockSpec = TINY) -> bool:
    return all(pool.get(k) is not None and pool.get(k).tobytes() == block_of(k, spec).tobytes() for k in keys)


def test_a_message_of_whole_records_arrives_with_each_records_own_digest():
    for keys in ([7], [1, 2, 3], [2**64 - 1, 0, 300]):
        raw = message(keys)
        got = hashing(TINY)(raw)
        assert type(got) is Arrival and got.raw is raw
        assert [key for key, _ in got.records] == keys
        assert [bytes(record) for _, record in got.records] == [encode(TINY, k, block_of(k)) for k in keys]
        assert got.digests == [xxh(block_of(k).tobytes()) for k in keys]
        assert got.digests == [xxh(bytes(record)[DATA_OFFSET:]) for _, record in got.records]
    alone = message([5])
    assert hashing(TINY)(alone).records[0][1] is alone  # a message of one record is the record itself


def test_anything_else_passes_through_as_it_came_and_nothing_raises():
    record = encode(TINY, 4, block_of(4))
    pieces = list(record_pieces(4, record, TINY.fingerprint, limit=500))  # a frame in three pieces
    assert len(pieces) == 3
    for raw in (*pieces, message([1, 2], OTHER), b"", b"\xff" * 40, record[:-1], message([1, 2])[:-3],
                encode_piece(9, 0, 10, b"0123456789"), record + b"\x00"):
        assert hashing(TINY)(raw) is raw


def test_received_reads_an_arrival_between_blocks_and_hands_the_rest_to_the_assembler():
    assembler = RecordAssembler(TINY)
    arrival = hashing(TINY)(message([1, 2]))
    records, digests = received(assembler, arrival)
    assert records is arrival.records and digests is arrival.digests
    record = encode(TINY, 4, block_of(4))
    first, *rest = record_pieces(4, record, TINY.fingerprint, limit=500)
    assert received(assembler, first) == ([], None) and assembler.pending_key == 4
    with pytest.raises(ValueError, match="started before block"):  # whole records while block 4 is still due
        received(assembler, arrival)
    assembler = RecordAssembler(TINY)
    received(assembler, first)
    *_, last = rest
    received(assembler, rest[0])
    (key, got), = received(assembler, last)[0]
    assert key == 4 and bytes(got) == record


def test_digests_are_compared_with_the_head_instead_of_hashing_and_a_mismatch_evicts_nothing():
    arrival = hashing(TINY)(message([1, 2, 3]))
    with BlockPool(TINY, dram_blocks=4) as pool:
        pool.put_many([10, 11, 12, 13], [block_of(k) for k in (10, 11, 12, 13)])  # full: slots, none free
        new: list[bool] = []
        wrong = list(arrival.digests)
        wrong[1] = (wrong[1][0], wrong[1][1] ^ 1)
        with pytest.raises(CorruptBlockError, match="checksum mismatch"):
            pool.put_records(arrival.records, new, wrong)
        assert new == [True] and sorted(pool.keys()) == [1, 11, 12, 13]  # one evicted for 1, none for 2
        with pytest.raises(ValueError, match="2 digests for 3 records"):
            pool.put_records(arrival.records, [], arrival.digests[:2])
        new.clear()
        pool.put_records(arrival.records, new, arrival.digests)  # 1 held already: compared, counted as a use
        assert new == [False, True, True] and exact(pool, [1, 2, 3])


def test_a_digest_is_trusted_for_the_data_so_the_caller_must_take_it_from_the_same_bytes():
    """What ``put_records`` vouches for: with a digest, the data is not hashed again. A digest of the sound data
    stores a record whose data differs (the test's mutation): which is why only ``arrival.hashing``, hashing the
    immutable ``bytes`` it hands on, gives them."""
    sound = hashing(TINY)(message([1]))
    damaged = bytearray(message([1]))
    damaged[DATA_OFFSET + 3] ^= 1
    with BlockPool(TINY, dram_blocks=2) as pool:
        with pytest.raises(CorruptBlockError):
            pool.put_records([(1, bytes(damaged))], [], None)  # hashed: refused
        pool.put_records([(1, bytes(damaged))], [], sound.digests)
        assert pool.get(1) is None  # stored unhashed, then caught by the read's own check and dropped
        assert pool.counters()["dram"].corrupt == 1


@pytest.mark.parametrize("where", ["kept", "free slot", "ssd"])
def test_records_with_digests_are_stored_exact_in_every_store(tmp_path, where):
    keys = [1, 2, 3]
    arrival = hashing(TINY)(message(keys))
    options = {"kept": dict(dram_blocks=8), "free slot": dict(dram_blocks=8),
               "ssd": dict(dram_blocks=0, ssd_path=tmp_path)}[where]
    with BlockPool(TINY, **options) as pool:
        if where == "free slot":  # slots allocated and freed: received records are copied into them
            pool.put_many([20, 21, 22], [block_of(k) for k in (20, 21, 22)])
            for key in (20, 21, 22):
                pool.remove(key)
        new: list[bool] = []
        pool.put_records(arrival.records, new, arrival.digests)
        assert new == [True] * 3 and exact(pool, keys)
        if where != "ssd":
            kept = pool._tiers[0].store.kept_records
            assert kept == (3 if where == "kept" else 0)
        wrong = [(high, low ^ 1) for high, low in hashing(TINY)(message([4])).digests]
        with pytest.raises(CorruptBlockError):
            pool.put_records(hashing(TINY)(message([4])).records, [], wrong)
        assert 4 not in pool and exact(pool, keys)
    if where == "ssd":
        with BlockPool(TINY, dram_blocks=0, ssd_path=tmp_path) as reopened:
            assert sorted(reopened.keys()) == keys and exact(reopened, keys)


def test_pushed_and_fetched_messages_arrive_hashed_and_are_stored_bit_exact():
    """Over gRPC, both ways: the receiving pool is given the digests taken on arrival for every message of whole
    records (a spy on ``put_records``), and every block arrives bit-exact."""
    calls: list[bool] = []

    class Spy(BlockPool):
        def put_records(self, records, new, digests=None):
            calls.append(digests is not None and len(digests) == len(records))
            return super().put_records(records, new, digests)

    keys = list(range(1, 41))
    with Spy(TINY) as there, MessengerServer(there) as server, BlockPool(TINY) as here, \
            MessengerClient(server.address, here) as client:
        here.put_many(keys[:20], [block_of(k) for k in keys[:20]])
        assert client.push(keys[:20]).moved == keys[:20]
        assert calls and all(calls) and exact(there, keys[:20])
        there.put_many(keys[20:], [block_of(k) for k in keys[20:]])
        calls.clear()
        here.__class__ = Spy
        assert client.fetch(keys[20:]).moved == keys[20:]
        assert calls and all(calls) and exact(here, keys[20:])
