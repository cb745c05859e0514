"""A fetch checks each record end to end, as a push does (issue 15, fourteenth pass): the fetching client asks the
peer to send its records as stored (``FetchRequest.receiver_checks``) and hashes each as it lands. From a record that
fails there, the blocks not yet stored are asked for once more with the flag unset, so the peer checks them before
sending: a block damaged in the peer's memory or on its disk is dropped there and named NOT_FOUND, as before; one
damaged on the way arrives sound the second time. Never is a damaged record stored or served."""

import grpc
import numpy as np
import pytest
from test_messenger import SPEC, assert_exact, filled_pool, serve  # noqa: F401 (serve: the fixture)

from mooncake_jax.transfer import BlockPool, BlockSpec
from mooncake_jax.transfer.frame import DATA_OFFSET
from mooncake_jax.transfer.messenger import BlocksNotFoundError, MessengerClient, TransferError, messages
from mooncake_jax.transfer.pieces import BATCH_BYTES

ALONE_SPEC = BlockSpec((8, 2, 16, 16, 160), np.float32)  # 2.5 MiB blocks: one record a message
KEYS = list(range(1, 9))


def spied(pool: BlockPool, damage_on_the_way: int = 0) -> list[bool]:
    """Record the ``verify`` of each ``join_records`` the peer's sender makes (its check of what it sends), and
    flip one data byte of block 5 in the first ``damage_on_the_way`` messages that carry it (after the read: the
    pool's copy stays sound)."""
    real = pool.join_records
    checks: list[bool] = []
    damaged = [0]

    def join(keys, separator, **options):
        message, count = real(keys, separator, **options)
        checks.append(options.get("verify", True))
        if 5 in keys[:count] and damaged[0] < damage_on_the_way:
            at = keys.index(5) * (pool.record_bytes + len(separator)) + DATA_OFFSET + 100
            message = message[:at] + bytes([message[at] ^ 1]) + message[at + 1 :]
            damaged[0] += 1
        return message, count

    pool.join_records = join
    return checks


def flip_in_slot(pool: BlockPool, key: int, at: int) -> None:
    """Flip one bit of ``key``'s record where the DRAM tier keeps it (``at`` into the record: memory gone bad)."""
    pool._tiers[0].store._slot_of[key].memory[at] ^= 0x10


@pytest.mark.parametrize("spec", [SPEC, ALONE_SPEC], ids=["joined", "alone"])
def test_the_peer_sends_unchecked_and_every_block_arrives_exact(serve, spec):  # noqa: F811
    sender = filled_pool(KEYS, spec)
    checks = spied(sender)
    receiver = BlockPool(spec)
    with MessengerClient(serve(sender).address, receiver, data_plane="grpc") as client:
        assert client.fetch(KEYS).moved == KEYS
        assert client.counters.blocks_refused == 0
    assert checks and not any(checks)  # the peer took no checksum of what it sent
    assert_exact(receiver, KEYS, spec)


@pytest.mark.parametrize("spec", [SPEC, ALONE_SPEC], ids=["joined", "alone"])
@pytest.mark.parametrize("at", [DATA_OFFSET + 7, DATA_OFFSET - 20, 3], ids=["data", "checksum", "wire prefix"])
def test_a_block_damaged_in_the_peers_memory_is_refused_here_and_dropped_there(serve, spec, at):  # noqa: F811
    sender = filled_pool(KEYS, spec)
    flip_in_slot(sender, 5, at)
    checks = spied(sender)
    receiver = BlockPool(spec)
    with MessengerClient(serve(sender).address, receiver, data_plane="grpc") as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.fetch(KEYS)
        assert caught.value.keys == [5] and caught.value.stored == [1, 2, 3, 4]
        assert client.counters.blocks_refused == 1
        assert False in checks and checks[-1] is True  # asked again, checked by the peer this time
        assert 5 not in sender and sender.stats()["dram"]["corrupt"] == 1
        assert sorted(receiver.keys()) == [1, 2, 3, 4] and receiver.get(5) is None
        assert client.fetch([6, 7, 8]).moved == [6, 7, 8]
    assert_exact(receiver, [1, 2, 3, 4, 6, 7, 8], spec)


@pytest.mark.parametrize("spec", [SPEC, ALONE_SPEC], ids=["joined", "alone"])
def test_a_block_damaged_on_its_way_is_asked_for_again_and_arrives_sound(serve, spec):  # noqa: F811
    sender = filled_pool(KEYS, spec)
    checks = spied(sender, damage_on_the_way=1)
    receiver = BlockPool(spec)
    with MessengerClient(serve(sender).address, receiver, data_plane="grpc") as client:
        assert client.fetch(KEYS).moved == KEYS
        assert client.counters.blocks_refused == 1
    assert checks[-1] is True and 5 in sender and sender.stats()["dram"]["corrupt"] == 0
    assert_exact(receiver, KEYS, spec)


def test_a_block_damaged_on_its_way_twice_is_a_transfer_error_and_kept_by_the_peer(serve):  # noqa: F811
    sender = filled_pool(KEYS)
    spied(sender, damage_on_the_way=2)
    receiver = BlockPool(SPEC)
    with MessengerClient(serve(sender).address, receiver, data_plane="grpc") as client:
        with pytest.raises(TransferError) as caught:
            client.fetch(KEYS)
        assert not isinstance(caught.value, BlocksNotFoundError) and caught.value.stored == [1, 2, 3, 4]
        assert "checksum mismatch" in str(caught.value)
    assert 5 in sender and sorted(receiver.keys()) == [1, 2, 3, 4]


def test_a_block_damaged_on_the_peers_ssd_is_dropped_there(serve, tmp_path):  # noqa: F811
    sender = filled_pool(KEYS, dram_blocks=0, ssd_path=tmp_path)
    store = sender._tiers[0].store
    shard, row, offset = store._location(5)
    with open(store._reader._path_of(shard), "r+b") as shard_file:
        shard_file.seek(offset + 11)
        byte = shard_file.read(1)
        shard_file.seek(offset + 11)
        shard_file.write(bytes([byte[0] ^ 4]))
    receiver = BlockPool(SPEC)
    with MessengerClient(serve(sender).address, receiver, data_plane="grpc") as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.fetch(KEYS)
        assert caught.value.keys == [5] and caught.value.stored == [1, 2, 3, 4]
    assert 5 not in sender and sorted(receiver.keys()) == [1, 2, 3, 4]
    assert_exact(receiver, [1, 2, 3, 4])


def test_a_caller_that_does_not_check_is_sent_checked_records(serve):  # noqa: F811
    """An older client (no ``receiver_checks``): the peer checks before sending, and a damaged block ends the stream
    with NOT_FOUND naming it, as it always did."""
    sender = filled_pool(KEYS)
    flip_in_slot(sender, 5, DATA_OFFSET + 7)
    checks = spied(sender)
    with MessengerClient(serve(sender).address, BlockPool(SPEC), data_plane="grpc") as client:
        request = messages.FetchRequest(keys=KEYS, spec_fingerprint=SPEC.fingerprint, batch_bytes=BATCH_BYTES)
        with pytest.raises(grpc.RpcError) as caught:
            list(client._fetch_raw(request, timeout=10))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND and checks and all(checks)
    assert 5 not in sender
