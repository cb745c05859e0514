"""Slots laid out as messages (issue 15, thirteenth pass): blocks put together into the DRAM tier lie in
message-shaped slot groups, and a sender asked for exactly a group's records in order is lent the group's own
``bytes`` (no join copy), which must then stay byte for byte the join of those records until it is given back.

Every lent message is checked against ``frame.encode`` joined by hand (``test_pool_messages.reference``), every
block read back bit-exact."""

import numpy as np
import pytest
from test_messenger import serve  # noqa: F401 (the fixture)
from test_pool_messages import SMALL16, block_of, exact, reference

from mooncake_jax.transfer import BlockPool, BlockSpec
from mooncake_jax.transfer.frame import encode
from mooncake_jax.transfer.messenger import BlocksNotFoundError, MessengerClient
from mooncake_jax.transfer.outgoing import Outgoing
from mooncake_jax.transfer.pieces import BATCH_BYTES, next_separator

ALONE = BlockSpec((8, 2, 16, 16, 160), np.float32)  # 2.5 MiB: one record a message, a group of one


def put_pool(keys, spec: BlockSpec = SMALL16, capacity: int | None = None) -> BlockPool:
    pool = BlockPool(spec, dram_blocks=capacity)
    pool.put_many(list(keys), [block_of(k, spec) for k in keys])
    return pool


def separator_of(pool: BlockPool) -> bytes:
    return next_separator(pool.record_bytes)


def groups(pool: BlockPool):
    return pool._tiers[0].store._groups.values()


def test_a_group_put_in_order_is_lent_as_it_lies_and_is_the_join():
    pool = put_pool(range(1, 13), capacity=12)  # groups of 5, 5, 2
    store = pool._tiers[0].store
    assert store.group_size == 5
    message, count = pool.join_records([1, 2, 3, 4, 5], separator_of(pool), lend=True)
    assert count == 5 and message is store._slot_of[1].group.message and store._slot_of[1].group.lent == 1
    assert message == reference(SMALL16, [1, 2, 3, 4, 5])
    assert pool.join_records([1, 2, 3, 4, 5], separator_of(pool)) == (message, 5)  # a copy, equal
    tail, count = pool.join_records([11, 12], separator_of(pool), lend=True)  # the last, short group
    assert count == 2 and tail is store._slot_of[11].group.message and tail == reference(SMALL16, [11, 12])
    pool.give_back(message)
    pool.give_back(tail)
    assert all(group.lent == 0 for group in groups(pool))


@pytest.mark.parametrize("keys", [[2, 1, 3, 4, 5], [1, 2, 3, 4], [2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]],
                         ids=["out-of-order", "part", "straddling", "more"])
def test_records_lying_otherwise_are_joined_by_a_copy(keys):
    pool = put_pool(range(1, 13), capacity=12)
    message, count = pool.join_records(keys, separator_of(pool), lend=True)
    assert count == len(keys) and message == reference(SMALL16, keys)
    assert all(message is not group.message and group.lent == 0 for group in groups(pool))


def test_another_separator_is_never_served_a_group():
    pool = put_pool(range(1, 6))
    message, count = pool.join_records([1, 2, 3, 4, 5], b"<>", lend=True)
    records = [encode(SMALL16, k, block_of(k, SMALL16)) for k in range(1, 6)]
    assert count == 5 and message == b"<>".join(records)
    assert all(group.lent == 0 for group in groups(pool))


def test_a_lent_group_does_not_change_while_its_blocks_go_and_others_come():
    """Blocks of a lent group removed and new ones put into a full pool: the lent bytes stay the join they were
    (its slots are held, not reused); once given back, the slots take new blocks again, and nothing was lost."""
    pool = put_pool(range(1, 11), capacity=10)
    store = pool._tiers[0].store
    message, _ = pool.join_records([1, 2, 3, 4, 5], separator_of(pool), lend=True)
    before = bytes(bytearray(message))  # a copy to compare with (bytes(message) is message itself)
    for key in (1, 2, 3):
        pool.remove(key)
    pool.put_many([21, 22, 23], [block_of(k, SMALL16) for k in (21, 22, 23)])  # evicts 6, 7, 8 (LRU)
    assert message == before == reference(SMALL16, [1, 2, 3, 4, 5])
    assert len(store._slot_of[1 if 1 in store._slot_of else 4].group.held) == 3
    assert all(store._slot_of[k].group is not store._slot_of[4].group for k in (21, 22, 23))
    assert exact(pool, [4, 5, 9, 10, 21, 22, 23], SMALL16)
    pool.give_back(message)
    assert store._slot_of[4].group.lent == 0 and not store._slot_of[4].group.held
    pool.put_many([31, 32, 33], [block_of(k, SMALL16) for k in (31, 32, 33)])  # into the three slots given back
    assert store._allocated == 10 and exact(pool, [4, 5, 9, 10, 21, 22, 23, 31, 32, 33], SMALL16)
    assert message != before  # the group's bytes now hold the new blocks (it was not kept)


def test_a_damaged_record_of_a_group_is_cut_off_and_the_group_given_back():
    """Verified (a fetch's server): a record that fails its checksum ends the message before it, as a copy, the
    block is dropped, and the group is not left lent (its slot is reused)."""
    pool = put_pool(range(1, 6))
    store = pool._tiers[0].store
    store._slot_of[3].data[100] ^= 0x04
    message, count = pool.join_records([1, 2, 3, 4, 5], separator_of(pool), lend=True)
    assert count == 2 and message == reference(SMALL16, [1, 2])
    assert 3 not in pool and pool.counters()["dram"].corrupt == 1
    assert store._slot_of[1].group.lent == 0 and not store._slot_of[1].group.held
    assert not store._free or store._free[-1].index == 2  # the dropped block's slot is free again


def test_a_record_alone_in_its_message_is_lent_as_its_own_group():
    pool = put_pool([1, 2, 3], ALONE)
    store = pool._tiers[0].store
    assert store.group_size == 1
    message, count = pool.join_records([2], separator_of(pool), lend=True)
    assert count == 1 and message is store._slot_of[2].group.message
    assert message == encode(ALONE, 2, block_of(2, ALONE))
    pool.give_back(message)
    assert store._slot_of[2].group.lent == 0


def test_outgoing_gives_back_what_grpc_took_and_what_it_never_asked_for():
    pool = put_pool(range(1, 21))
    with Outgoing(pool, list(range(1, 21)), BATCH_BYTES, verify=False) as outgoing:
        messages = iter(outgoing)
        first, keys = next(messages)
        assert keys == [1, 2, 3, 4, 5] and first == reference(SMALL16, keys)
        assert pool._tiers[0].store._slot_of[1].group.lent == 1
        second, keys = next(messages)  # asked for the next: the first was sent
        assert keys == [6, 7, 8, 9, 10] and pool._tiers[0].store._slot_of[1].group.lent == 0
    assert all(group.lent == 0 for group in groups(pool))  # the rest (made ahead, never sent) given back on close


def test_a_push_relays_groups_and_every_block_arrives_exact(serve):  # noqa: F811
    sender = put_pool(range(1, 23), capacity=22)
    store = sender._tiers[0].store
    lent = []
    real = store.lend

    def spy(keys):
        got = real(keys)
        lent.append(got is not None)
        return got

    store.lend = spy
    receiver = BlockPool(SMALL16)
    server = serve(receiver)
    with MessengerClient(server.address, sender, data_plane="grpc") as client:
        assert client.push(range(1, 23)).moved == list(range(1, 23))
    assert lent == [True] * 5  # 5 + 5 + 5 + 5 + 2, every one lent
    assert all(group.lent == 0 for group in groups(sender))
    assert exact(receiver, range(1, 23), SMALL16)


def test_a_bit_flipped_in_a_lent_group_is_refused_by_the_receiver(serve):  # noqa: F811
    sender = put_pool(range(1, 11))
    sender._tiers[0].store._slot_of[7].data[5] ^= 0x80
    receiver = BlockPool(SMALL16)
    server = serve(receiver)
    with MessengerClient(server.address, sender, data_plane="grpc") as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.push(range(1, 11))
    assert caught.value.keys == [7] and caught.value.stored == [1, 2, 3, 4, 5, 6]  # in order, up to the refused one
    assert 7 not in receiver and 7 not in sender and receiver.get(7) is None
    assert all(group.lent == 0 for group in groups(sender))
    assert exact(receiver, [1, 2, 3, 4, 5, 6], SMALL16)


def test_an_unbounded_tier_of_small_records_makes_its_slots_as_they_are_needed():
    """A slab of 256 MiB is counted at once, but its slots are made as blocks need them: making every slot of it
    when the first block came took 8-9 s for 1 KiB records (233,016 TensorStore views), a second per test."""
    spec = BlockSpec((2, 2, 4, 2, 8), np.float32)
    pool = put_pool(range(1, 8), spec)  # unbounded
    store = pool._tiers[0].store
    made = len(store._slot_of) + len(store._free)
    assert 7 <= made <= 7 + store.group_size
    assert store.used_bytes == (256 << 20) // store._stride * store._stride  # the slab is counted whole
    assert exact(pool, range(1, 8), spec)
    pool.remove(3)
    pool.put(20, block_of(20, spec))  # the freed slot is reused before another is made
    assert len(store._slot_of) + len(store._free) == made
