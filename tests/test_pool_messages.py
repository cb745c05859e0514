"""Received messages relayed as they lie (issue 15, tenth pass): a received message is kept, and a sender asked for
exactly a message's records in order sends that message itself, no join copy.

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
from mooncake_jax.transfer.slots import joined

SMALL16 = BlockSpec((12, 2, 16, 4, 64), np.float32)  # 393,216 data bytes: five records to a message
TINY = BlockSpec((2, 2, 4, 2, 8), np.float32)  # 1,152-byte records


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

    def join_records(keys, separator, **options):
        got = real(keys, separator, **options)
        seen.append(got[0])
        return got

    pool.join_records = join_records
    return seen


def test_received_messages_are_fetched_and_pushed_on_as_they_lie(served):
    """Blocks put into slots and pushed travel joined by a copy; the receiving pool keeps the messages as they
    arrived and, fetched from in that order or pushing on in that order, sends them as they lie (the same objects).
    Bit-exact at every pool, each record verified as sent and as received."""
    keys = list(range(100, 112))
    source, middle, last, onward = BlockPool(SMALL16), BlockPool(SMALL16), BlockPool(SMALL16), BlockPool(SMALL16)
    source.put_many(keys, [block_of(k, SMALL16) for k in keys])
    sent = spy_on_joins(source)
    with MessengerClient(served(middle).address, source, data_plane="grpc") as client:
        assert client.push(keys).moved == keys
    assert [bytes(s) for s in sent] == [reference(SMALL16, g) for g in (range(100, 105), range(105, 110), (110, 111))]
    kept = [middle._tiers[0].store._slot_of[k].message for k in (100, 105, 110)]
    assert [bytes(m) for m in kept] == [bytes(s) for s in sent] and not any(k is s for k, s in zip(kept, sent))
    relayed = spy_on_joins(middle)
    with MessengerClient(served(middle).address, last, data_plane="grpc") as client:
        assert client.fetch(keys).moved == keys
    assert len(relayed) == 3 and all(r is k for r, k in zip(relayed, kept))
    with MessengerClient(served(onward).address, middle, data_plane="grpc") as client:
        assert client.push(keys).moved == keys
    assert len(relayed) == 6 and all(r is k for r, k in zip(relayed[3:], kept))
    assert exact(middle, keys, SMALL16) and exact(last, keys, SMALL16) and exact(onward, keys, SMALL16)


def test_a_block_damaged_in_a_kept_message_is_dropped_and_never_sent(served):
    """The sender verifies every record of a message it relays as it lies: block 2 damaged in DRAM ends the fetch
    after blocks 0 and 1 (sent as a copy of the message's first two records), is dropped and named NOT_FOUND."""
    keys = list(range(5))
    source, middle, receiver = BlockPool(SMALL16), BlockPool(SMALL16), BlockPool(SMALL16)
    source.put_many(keys, [block_of(k, SMALL16) for k in keys])
    with MessengerClient(served(middle).address, source, data_plane="grpc") as client:
        assert client.push(keys).moved == keys
    flip_last_byte(middle._tiers[0].store._slot_of[2].adopted)
    with MessengerClient(served(middle).address, receiver, data_plane="grpc") as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.fetch(keys)
    assert caught.value.keys == [2] and caught.value.stored == [0, 1]
    assert 2 not in middle and middle.stats()["dram"]["corrupt"] == 1
    assert sorted(receiver.keys()) == [0, 1] and exact(receiver, [0, 1], SMALL16)
