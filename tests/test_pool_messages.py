"""Blocks stored as the messages the Messenger sends them in (issue 15, tenth pass): a put builds them, a received
message is kept, and a sender asked for exactly a message's records in order sends that message as it lies.

Hand-worked with blocks of the ``small`` preset's 16-token geometry (384 KiB; records of 393,344 bytes, 4-byte
``next`` separators, five to a 1,966,736-byte message) and with a tiny spec; every message checked against
``frame.encode`` joined by hand, every block read back bit-exact."""

import ctypes

import numpy as np
import pytest

from mooncake_jax.transfer import BlockPool, BlockSpec
from mooncake_jax.transfer.frame import DATA_OFFSET, encode
from mooncake_jax.transfer.messenger import BlocksNotFoundError, MessengerClient, MessengerServer
from mooncake_jax.transfer.pieces import RecordAssembler, next_separator
from mooncake_jax.transfer.slots import joined, joined_blocks

SMALL16 = BlockSpec((12, 2, 16, 4, 64), np.float32)  # 393,216 data bytes: five records to a message
TINY = BlockSpec((2, 2, 4, 2, 8), np.float32)  # 1,152-byte records
BIG = BlockSpec((8, 2, 16, 16, 64), np.float32)  # 1 MiB: one record to a message


def block_of(key: int, spec: BlockSpec) -> np.ndarray:
    bits = np.random.default_rng(key).integers(0, 2**16, size=spec.nbytes // 2, dtype=np.uint16)
    return bits.view(spec.dtype).reshape(spec.shape)


def reference(spec: BlockSpec, keys) -> bytes:
    """The message of ``keys``' blocks as the Messenger sends it, built independently: records by ``frame.encode``,
    joined by hand with the ``next`` field's tag and length."""
    separator = next_separator(len(encode(spec, 0, block_of(0, spec))))
    return separator.join(encode(spec, k, block_of(k, spec)) for k in keys)


def exact(pool: BlockPool, keys, spec: BlockSpec) -> bool:
    return all(pool.get(k) is not None and pool.get(k).tobytes() == block_of(k, spec).tobytes() for k in keys)


def test_separator_and_sizes_are_the_hand_worked_ones():
    record = len(encode(SMALL16, 0, block_of(0, SMALL16)))
    assert record == 393_344 and next_separator(record) == b"\x3a\x80\x81\x18"  # 393,344 = 0x60080 as a varint
    assert len(reference(SMALL16, range(5))) == 5 * 393_344 + 4 * 4 == 1_966_736


def test_joined_is_the_join_and_relays_only_a_message_its_records_tile_exactly():
    """``joined`` returns the message itself only for its own records, all of them, in order, with its separator;
    anything else is copied. Either way the result is byte for byte ``separator.join``."""
    message = reference(TINY, [1, 2, 3])
    views = [view for _, view in RecordAssembler(TINY).whole_records(message)]
    sep = next_separator(1152)
    assert sep == b"\x3a\x80\x09" and len(message) == 3 * 1152 + 2 * 3
    assert joined(views, sep) is message
    other = reference(TINY, [4, 5])
    other_views = [view for _, view in RecordAssembler(TINY).whole_records(other)]
    for records, separator in ((views[:2], sep), (views[1:], sep), (views[::-1], sep), ([views[0], views[2]], sep),
                               (views, b"<>"), (views[:2] + other_views[:1], sep), ([bytes(v) for v in views], sep),
                               ([views[0], bytes(views[1]), views[2]], sep)):
        got = joined(records, separator)
        assert got == separator.join(bytes(r) for r in records) and got is not message
    alone = encode(TINY, 9, block_of(9, TINY))
    assert joined([alone], sep) is alone  # a record alone in its bytes is already its message
    assert joined([views[1]], sep) == bytes(views[1])


def test_joined_blocks_are_the_records_the_messenger_sends():
    keys = [7, 3, 11]
    message, records, digests = joined_blocks(TINY, keys, [block_of(k, TINY).reshape(-1).view(np.uint8) for k in keys],
                                              next_separator(1152))
    assert message == reference(TINY, keys)
    assert [bytes(r) for r in records] == [encode(TINY, k, block_of(k, TINY)) for k in keys]
    assert all(r.obj is message for r in records)
    expected = [encode(TINY, k, block_of(k, TINY))[96:112] for k in keys]  # the frame header's digest words
    assert [(hi.to_bytes(8, "little") + lo.to_bytes(8, "little")) for hi, lo in digests] == expected


def test_a_put_builds_its_blocks_five_to_a_message_within_the_capacity():
    """12 blocks put at once: messages of 5, 5 and 2 records, each the reference message. A tier of 10 blocks
    (10 x 397,312-byte slot strides = 3,973,120 bytes) holds two messages of five (3,933,472 bytes); the third needs
    786,692 more, so the pool evicts blocks 0-4 (the first message, freed with its last record) before it fits."""
    keys = list(range(12))
    with BlockPool(SMALL16) as pool:  # unbounded
        assert pool.put_many(keys, [block_of(k, SMALL16) for k in keys]) == 12
        store = pool._tiers[0].store
        messages = [store._slot_of[k].message for k in (0, 5, 10)]
        assert [messages[i] == reference(SMALL16, group) for i, group in
                enumerate((range(5), range(5, 10), range(10, 12)))] == [True] * 3
        assert all(store._slot_of[k].message is messages[k // 5] for k in keys)
        assert store._allocated == 0 and store.kept_records == 12 and exact(pool, keys, SMALL16)
        sep = next_separator(pool.record_bytes)
        assert pool.join_records(keys[:5], sep) == (messages[0], 5)  # the message itself, no copy
        assert pool.join_records(keys[:5], sep)[0] is messages[0]
        shifted, count = pool.join_records(keys[1:6], sep)  # spans two messages: joined by copy
        assert count == 5 and shifted == reference(SMALL16, range(1, 6)) and shifted is not messages[1]
    with BlockPool(SMALL16, dram_blocks=10) as pool:
        store = pool._tiers[0].store
        assert store._capacity_bytes == 3_973_120
        pool.put_many(keys, [block_of(k, SMALL16) for k in keys])
        assert sorted(pool.keys()) == list(range(5, 12)) and store.used_bytes == 1_966_736 + 786_692
        assert exact(pool, range(5, 12), SMALL16)


def test_a_put_of_held_and_repeated_keys_keeps_the_order_of_uses():
    """put_many stores the new blocks it was given in order and counts a held (or repeated) key as a use where it
    comes, as it did block by block (LRU). A put's blocks share a message, whose memory goes with its last record:
    capacity 3 blocks of 397,312-byte strides (1,191,936 bytes). [1, 2] is one message (786,692 bytes); [3, 1, 4]
    stores 3 (393,344: 1,180,036 in all), uses 1, and 4 evicts the least recent, 2, which frees nothing (1 holds
    its message), then 3: the tier holds 1 and 4 (block by block into slots it would hold 3, 1 and 4)."""
    with BlockPool(SMALL16, dram_blocks=3) as pool:
        assert pool.put_many([1, 2], [block_of(k, SMALL16) for k in (1, 2)]) == 2
        assert pool.put_many([3, 1, 4], [block_of(k, SMALL16) for k in (3, 1, 4)]) == 2
        assert sorted(pool.keys()) == [1, 4] and exact(pool, [1, 4], SMALL16)
        assert pool._tiers[0].store.used_bytes == 786_692 + 393_344
    with BlockPool(BIG, dram_blocks=3) as pool:  # 1 MiB blocks travel alone: into slots, block-level LRU
        # [5, 6, 5]: 5 and 6 stored, then 5 used: 6 is the least recent, and the first to go when 8 comes
        assert pool.put_many([5, 6, 5], [block_of(k, BIG) for k in (5, 6, 5)]) == 2
        assert pool.put_many([7], [block_of(7, BIG)]) == 1 and pool.put_many([8], [block_of(8, BIG)]) == 1
        assert sorted(pool.keys()) == [5, 7, 8] and exact(pool, [5, 7, 8], BIG)
        assert pool._tiers[0].store.kept_records == 0 and pool._tiers[0].store._allocated == 3


def test_a_small_block_put_alone_is_its_own_message_and_sent_as_it_is():
    """The last of six small blocks put together (5 + 1) is a record alone in its ``bytes``: get_record and a
    join of it alone hand that object on (no copy), as for a record received alone."""
    with BlockPool(SMALL16) as pool:
        pool.put_many(list(range(6)), [block_of(k, SMALL16) for k in range(6)])
        alone = pool._tiers[0].store._slot_of[5].adopted
        assert type(alone) is bytes and alone == encode(SMALL16, 5, block_of(5, SMALL16))
        assert pool.get_record(5) is alone and pool.join_records([5], next_separator(pool.record_bytes))[0] is alone


def test_a_free_slot_is_filled_by_a_copy_not_a_new_message():
    """Slot memory already paid for is used first: a put into a tier with free slots copies into them."""
    with BlockPool(TINY, dram_blocks=4) as pool:
        for key in (1, 2):
            pool.put_record(key, bytearray(encode(TINY, key, block_of(key, TINY))))  # mutable: copied into slots
        store = pool._tiers[0].store
        pool.remove(1)
        pool.remove(2)
        assert len(store._free) == store._allocated == 4  # one slab of the whole capacity
        pool.put_many([3, 4], [block_of(k, TINY) for k in (3, 4)])
        assert store.kept_records == 0 and store._slot_of[3].adopted is None and exact(pool, [3, 4], TINY)


def flip_last_byte(record: memoryview) -> None:
    """Damage a record's last byte where it lies in DRAM (an immutable ``bytes``: through ctypes), as bit rot would."""
    address = np.frombuffer(record, np.uint8).__array_interface__["data"][0] + len(record) - 1
    byte = ctypes.c_uint8.from_address(address)
    byte.value ^= 1


@pytest.fixture
def served():
    servers = []

    def start(pool: BlockPool) -> MessengerServer:
        servers.append(MessengerServer(pool).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop(grace_s=0)


def spy_on_joins(pool: BlockPool) -> list:
    """What ``pool.join_records`` returns from now on (the messages a sender hands gRPC)."""
    seen = []
    real = pool.join_records

    def join_records(keys, separator):
        got = real(keys, separator)
        seen.append(got[0])
        return got

    pool.join_records = join_records
    return seen


def test_push_and_fetch_send_built_and_received_messages_as_they_lie(served):
    """A push of put blocks in put order sends the messages the put built (the same objects); the receiving pool
    keeps them as they arrived and, fetched from in that order, sends them on as they lie again. Bit-exact at every
    pool, each record verified as sent and as received."""
    keys = list(range(100, 112))
    source, middle, last = BlockPool(SMALL16), BlockPool(SMALL16), BlockPool(SMALL16)
    source.put_many(keys, [block_of(k, SMALL16) for k in keys])
    built = [source._tiers[0].store._slot_of[k].message for k in (100, 105, 110)]
    sent = spy_on_joins(source)
    with MessengerClient(served(middle).address, source) as client:
        assert client.push(keys).moved == keys
    assert len(sent) == 3 and all(s is b for s, b in zip(sent, built))
    kept = [middle._tiers[0].store._slot_of[k].message for k in (100, 105, 110)]
    assert [bytes(m) for m in kept] == [reference(SMALL16, g) for g in (range(100, 105), range(105, 110), (110, 111))]
    relayed = spy_on_joins(middle)
    with MessengerClient(served(middle).address, last) as client:
        assert client.fetch(keys).moved == keys
    assert len(relayed) == 3 and all(r is k for r, k in zip(relayed, kept))
    assert exact(middle, keys, SMALL16) and exact(last, keys, SMALL16)


def test_a_block_damaged_in_a_built_message_is_dropped_and_never_sent(served):
    """The sender verifies every record of a message it sends as it lies: block 2 damaged in DRAM ends the fetch
    after blocks 0 and 1 (sent as a copy of the message's first two records), is dropped and named NOT_FOUND."""
    keys = list(range(5))
    source, receiver = BlockPool(SMALL16), BlockPool(SMALL16)
    source.put_many(keys, [block_of(k, SMALL16) for k in keys])
    flip_last_byte(source._tiers[0].store._slot_of[2].adopted)
    with MessengerClient(served(source).address, receiver) as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.fetch(keys)
    assert caught.value.keys == [2] and caught.value.stored == [0, 1]
    assert 2 not in source and source.stats()["dram"]["corrupt"] == 1
    assert sorted(receiver.keys()) == [0, 1] and exact(receiver, [0, 1], SMALL16)
