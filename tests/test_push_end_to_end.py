"""A push checks each record end to end: the sender sends its records as stored (their heads carry the checksum
taken when each block was stored), the receiver hashes each as it lands and refuses, counts and names one that does
not match. A block damaged in the sender's memory is still never stored or served anywhere: the receiver refuses
it, the sender checks its own copy when told and drops it."""

import numpy as np
import pytest
from test_messenger import SPEC, assert_exact, filled_pool, serve  # noqa: F401 (serve: the fixture)

from mooncake_jax.transfer import BlockPool, BlockSpec
from mooncake_jax.transfer.messenger import BlocksNotFoundError, MessengerClient, TransferError
from mooncake_jax.transfer.pieces import BATCH_BYTES, records_per_message
from mooncake_jax.transfer.frame import DATA_OFFSET, PREFIX_BYTES

ALONE_SPEC = BlockSpec((8, 2, 16, 16, 160), np.float32)  # 2.5 MiB blocks: one record a message


def flip_in_slot(pool: BlockPool, key: int, at: int | None = None) -> None:
    """Flip one bit of ``key``'s data where the DRAM tier keeps it (after its put: memory gone bad)."""
    slot = pool._tiers[0].store._slot_of[key]
    slot.data[slot.data.size // 2 if at is None else at] ^= 0x10


@pytest.mark.parametrize("spec", [SPEC, ALONE_SPEC], ids=["joined", "alone"])
def test_a_block_flipped_in_the_senders_slot_is_refused_counted_and_dropped_there(serve, spec):  # noqa: F811
    assert (records_per_message(BlockPool(spec).frame_bytes, BATCH_BYTES) > 1) == (spec is SPEC)
    sender = filled_pool(range(1, 7), spec)
    receiver = BlockPool(spec)
    server = serve(receiver)
    flip_in_slot(sender, 4)
    with MessengerClient(server.address, sender, data_plane="grpc") as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.push(range(1, 7))
        assert caught.value.keys == [4] and caught.value.stored == [1, 2, 3]
        assert "failed its checksum here" in str(caught.value)
        assert 4 not in sender and sender.counters()["dram"].corrupt == 1  # checked when named: dropped
        assert 4 not in receiver and sorted(receiver.keys()) == [1, 2, 3]
        assert server.counters.blocks_refused == 1
        assert receiver.get(4) is None
        assert client.push([1, 2, 3, 5, 6]).moved == [5, 6]  # the rest still goes; 1-3 are there already
    assert_exact(receiver, [1, 2, 3, 5, 6], spec)


@pytest.mark.parametrize("where", [lambda spec: 0, lambda spec: spec.nbytes - 1, None], ids=["first", "last", "mid"])
def test_any_flipped_byte_of_a_joined_record_is_refused(serve, where):  # noqa: F811
    sender = filled_pool(range(1, 11))
    receiver = BlockPool(SPEC)
    server = serve(receiver)
    flip_in_slot(sender, 1, None if where is None else where(SPEC))
    with MessengerClient(server.address, sender, data_plane="grpc") as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.push(range(1, 11))
    assert caught.value.keys == [1] and caught.value.stored == [] and len(receiver) == 0


def test_a_head_damaged_in_the_senders_slot_is_refused_too(serve):  # noqa: F811
    """The checksum itself (in the record's head) flipped in the sender's memory: the data no longer matches it."""
    sender = filled_pool(range(1, 4))
    receiver = BlockPool(SPEC)
    server = serve(receiver)
    sender._tiers[0].store._slot_of[2].memory[PREFIX_BYTES + 40] ^= 0x01  # a byte of the stored checksum (low word)
    with MessengerClient(server.address, sender, data_plane="grpc") as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.push(range(1, 4))
    assert caught.value.keys == [2] and 2 not in sender and 2 not in receiver
    assert sorted(receiver.keys()) == [1]


def test_a_block_damaged_on_its_way_is_refused_and_kept_by_the_sender(serve, monkeypatch):  # noqa: F811
    """Sound in the sender's pool, damaged after it was read (on the way): refused by the receiver, a
    TransferError (DATA_LOSS) naming it, and the sender keeps its sound copy, which a second push delivers."""
    import grpc

    sender = filled_pool(range(1, 7))
    receiver = BlockPool(SPEC)
    server = serve(receiver)
    real = sender.join_records
    damaged = []

    def join_then_damage(keys, separator, **options):
        message, count = real(keys, separator, **options)
        if 5 in keys[:count] and not damaged:
            at = keys.index(5) * (sender.record_bytes + len(separator)) + DATA_OFFSET + 100
            message = message[:at] + bytes([message[at] ^ 1]) + message[at + 1 :]
            damaged.append(5)
        return message, count

    monkeypatch.setattr(sender, "join_records", join_then_damage)
    with MessengerClient(server.address, sender, data_plane="grpc") as client:
        with pytest.raises(TransferError) as caught:
            client.push(range(1, 7))
        assert not isinstance(caught.value, BlocksNotFoundError)
        assert caught.value.code == grpc.StatusCode.DATA_LOSS and "damaged on its way" in str(caught.value)
        assert caught.value.stored == [1, 2, 3, 4] and 5 in sender and 5 not in receiver
        assert client.push(range(1, 7)).moved == [5, 6]
    assert_exact(receiver, range(1, 7))


def test_a_block_damaged_in_the_senders_ssd_tier_is_refused_and_dropped_there(serve, tmp_path):  # noqa: F811
    sender = filled_pool([1, 2, 3], dram_blocks=0, ssd_path=tmp_path)
    store = sender._tiers[0].store
    store.settle()
    shard, row, offset = store._location(2)
    with open(store._data_path(shard), "r+b") as file:
        file.seek(offset + 7)
        byte = file.read(1)
        file.seek(offset + 7)
        file.write(bytes([byte[0] ^ 0x40]))
    receiver = BlockPool(SPEC)
    server = serve(receiver)
    with MessengerClient(server.address, sender, data_plane="grpc") as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.push([1, 2, 3])
        assert caught.value.keys == [2] and caught.value.stored == [1]
        assert 2 not in sender and sender.counters()["ssd"].corrupt == 1
        assert client.push([3]).moved == [3]
    assert sorted(receiver.keys()) == [1, 3]
    assert_exact(receiver, [1, 3])
    sender.close()


def test_unverified_records_are_the_stored_records_and_are_never_promoted():
    """``verify=False`` hands out the same bytes as a verified read (only the check is skipped), is refused with
    ``promote=True``, and serves nothing through a get: a local read of a damaged block still fails its check."""
    pool = filled_pool(range(1, 6))
    separator = b"\x0a"
    assert pool.join_records(list(range(1, 6)), separator, verify=False) == pool.join_records(
        list(range(1, 6)), separator)
    assert pool.get_record(3, promote=False, verify=False) == pool.get_record(3)
    with pytest.raises(ValueError, match="promote=False"):
        pool.get_record(3, verify=False)
    flip_in_slot(pool, 3)
    unchecked = pool.get_record(3, promote=False, verify=False)
    assert unchecked is not None and unchecked[PREFIX_BYTES:] != b""  # handed out as stored, for a receiver to check
    assert pool.get(3) is None and 3 not in pool and pool.counters()["dram"].corrupt == 1
