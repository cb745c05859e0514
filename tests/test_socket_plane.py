"""The Messenger's socket data plane (``data_plane="socket"``, issue 15 fifteenth pass): gRPC carries control
(``OfferPull`` / ``PullFrom`` with a 128-bit pull token) and the records travel over a plain TCP connection, sent as
they are stored and stored, verified, as they land. The keys, the skipping of held blocks, the end-to-end checks and
the errors are those of the gRPC plane (``test_push_end_to_end.py``, ``test_fetch_end_to_end.py``)."""

import socket
import threading
import time

import grpc
import numpy as np
import pytest
from test_messenger import SPEC, assert_exact, block_of, filled_pool, serve  # noqa: F401 (serve: the fixture)

from mooncake_jax.instance.config import InstanceConfig
from mooncake_jax.proto import tls
from mooncake_jax.transfer import BlockPool, BlockSpec, device_plane as device_plane_module
from mooncake_jax.transfer import socket_plane as socket_plane_module
from mooncake_jax.transfer.frame import DATA_OFFSET, frame_bytes
from mooncake_jax.transfer.messenger import BlocksNotFoundError, MessengerClient, TransferError, messages, services
from mooncake_jax.transfer.socket_plane import PullError, SocketPlane, socket_plane

BIG_SPEC = BlockSpec((8, 2, 16, 16, 160), np.float32)  # 2.5 MiB blocks: larger than a staging batch


@pytest.fixture
def plane():
    """The process's socket plane, its test hook cleared afterwards."""
    plane = socket_plane()
    yield plane
    plane.tamper = None


@pytest.fixture
def small_groups(monkeypatch):
    """Groups of at most 3 MiB of records (many groups in a test), staging batches of 256 KiB."""
    monkeypatch.setattr(device_plane_module, "PULL_BYTES", 3 << 20)
    monkeypatch.setattr(socket_plane_module, "STAGE_BYTES", 256 << 10)


def flipped(record, at: int) -> bytes:
    """A copy of ``record`` with one bit flipped at ``at`` (damage on the way: the stored record stays sound)."""
    damaged = bytearray(record)
    damaged[at] ^= 0x04
    return bytes(damaged)


def offers_drained(plane: SocketPlane) -> bool:
    """Whether every offer was pulled or withdrawn (the sending threads release them as they finish)."""
    for _ in range(200):
        if plane.offers == 0:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("spec, n", [(SPEC, 450), (BIG_SPEC, 5)], ids=["16KiB", "2.5MiB"])
def test_fetch_and_push_are_bit_exact_in_several_groups(serve, plane, small_groups, spec, n):  # noqa: F811
    keys = list(range(1, n + 1))
    a, b = filled_pool(keys, spec), filled_pool([keys[0]], spec)
    server_a, server_b = serve(a), serve(b)
    assert len(device_plane_module.groups(keys, a.record_bytes)) >= 3
    with MessengerClient(server_a.address, b, data_plane="socket") as fetcher:
        fetched = fetcher.fetch(keys[: n // 2])
        assert fetched.moved == keys[1 : n // 2] and fetched.skipped == [keys[0]]
        assert fetched.bytes == (n // 2 - 1) * frame_bytes(spec)
        assert fetcher.counters.blocks_refused == 0
    assert_exact(b, keys[: n // 2], spec)
    with MessengerClient(server_b.address, a, data_plane="socket") as pusher:
        pushed = pusher.push(keys)
        assert pushed.moved == keys[n // 2 :] and pushed.skipped == keys[: n // 2]
    assert_exact(b, keys, spec)
    assert server_b.counters.blocks_received == n - n // 2
    assert offers_drained(plane)


def test_the_sender_offers_its_slots_as_they_lie_not_copies():
    pool = filled_pool(range(12))
    views = pool.record_views(list(range(12)))
    for key, view in zip(range(12), views):
        slot = pool._tiers[0].store._slot_of[key]
        assert np.shares_memory(np.frombuffer(view, np.uint8), slot.memory)
        assert bytes(view) == pool.get_record(key, promote=False)
    assert pool.record_views([99]) == [None]


def test_a_block_only_on_ssd_is_offered_as_a_copy_read_from_there(tmp_path):
    pool = filled_pool(range(3), dram_blocks=0, ssd_path=tmp_path)
    views = pool.record_views([0, 1, 2])
    assert [bytes(v) for v in views] == [pool.get_record(k, promote=False) for k in range(3)]
    assert pool.tier_of(0) == "ssd"  # not promoted


def test_a_byte_flipped_on_the_way_of_a_fetch_is_refused_and_asked_for_again(serve, plane):  # noqa: F811
    keys = list(range(1, 41))
    a, b = filled_pool(keys), BlockPool(SPEC)
    damaged = []

    def flip_once(i, record):
        if i == 7 and not damaged:
            damaged.append(i)
            return flipped(record, DATA_OFFSET + 300)
        return record

    plane.tamper = flip_once
    with MessengerClient(serve(a).address, b, data_plane="socket") as client:
        assert client.fetch(keys).moved == keys
        assert client.counters.blocks_refused == 1
    assert damaged and 8 in a and a.stats()["dram"]["corrupt"] == 0
    assert_exact(b, keys)


def test_a_byte_flipped_on_the_way_every_time_is_a_transfer_error_storing_nothing_damaged(serve, plane):  # noqa: F811
    keys = list(range(1, 41))
    a, b = filled_pool(keys), BlockPool(SPEC)
    eighth = a.get_record(8, promote=False)
    plane.tamper = lambda i, record: flipped(record, DATA_OFFSET + 5) if record == eighth else record
    with MessengerClient(serve(a).address, b, data_plane="socket") as client:
        with pytest.raises(TransferError) as caught:
            client.fetch(keys)
    assert not isinstance(caught.value, BlocksNotFoundError) and "checksum mismatch" in str(caught.value)
    assert caught.value.stored == keys[:7] and sorted(b.keys()) == keys[:7]
    assert_exact(b, keys[:7])
    assert 8 in a


def test_a_block_damaged_in_the_peers_memory_is_dropped_there_on_a_fetch(serve, plane):  # noqa: F811
    keys = list(range(1, 9))
    a, b = filled_pool(keys), BlockPool(SPEC)
    a._tiers[0].store._slot_of[5].memory[DATA_OFFSET + 9] ^= 0x10
    with MessengerClient(serve(a).address, b, data_plane="socket") as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.fetch(keys)
        assert caught.value.keys == [5] and caught.value.stored == [1, 2, 3, 4]
        assert client.counters.blocks_refused == 1
    assert 5 not in a and a.stats()["dram"]["corrupt"] == 1
    assert sorted(b.keys()) == [1, 2, 3, 4] and b.get(5) is None


def test_a_byte_flipped_on_the_way_of_a_push_is_refused_and_the_sender_keeps_its_block(serve, plane):  # noqa: F811
    keys = list(range(1, 41))
    a, b = filled_pool(keys), BlockPool(SPEC)
    plane.tamper = lambda i, record: flipped(record, DATA_OFFSET + 77) if i == 12 else record
    with MessengerClient(serve(b).address, a, data_plane="socket") as client:
        with pytest.raises(TransferError) as caught:
            client.push(keys)
    assert not isinstance(caught.value, BlocksNotFoundError)
    assert caught.value.code == grpc.StatusCode.DATA_LOSS and caught.value.stored == keys[:12]
    assert sorted(b.keys()) == keys[:12] and 13 in a and a.stats()["dram"]["corrupt"] == 0
    assert_exact(b, keys[:12])


def test_a_block_damaged_in_the_pushers_memory_is_refused_there_and_dropped(serve, plane):  # noqa: F811
    keys = list(range(1, 9))
    a, b = filled_pool(keys), BlockPool(SPEC)
    a._tiers[0].store._slot_of[6].memory[DATA_OFFSET + 1000] ^= 0x01
    with MessengerClient(serve(b).address, a, data_plane="socket") as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.push(keys)
    assert caught.value.keys == [6] and caught.value.stored == [1, 2, 3, 4, 5]
    assert 6 not in a and sorted(b.keys()) == [1, 2, 3, 4, 5]


def test_a_pull_token_is_good_for_one_pull_and_an_unknown_one_is_refused(plane):
    records = [bytes(block_of(k).tobytes()) for k in range(3)]
    released = threading.Event()
    address, token = plane.offer(records, timeout_s=30, release=released.set)
    got = []
    plane.pull(address, token, 3, len(records[0]), lambda first, views: got.extend(bytes(v) for v in views), 10)
    assert got == records
    assert released.wait(10) and plane.offers == 0  # released once sent
    with pytest.raises(PullError, match="unknown, already pulled, or expired"):
        plane.pull(address, token, 3, len(records[0]), lambda first, views: None, 10)
    with pytest.raises(PullError, match="unknown, already pulled, or expired"):
        plane.pull(address, bytes(16), 3, len(records[0]), lambda first, views: None, 10)


def test_an_offer_not_pulled_by_its_deadline_is_reaped_and_refused(plane):
    released = threading.Event()
    address, token = plane.offer([b"x" * 64], timeout_s=0.2, release=released.set)
    assert released.wait(10)  # the accepting thread reaps it, releasing its pins
    assert plane.offers == 0
    with pytest.raises(PullError, match="unknown, already pulled, or expired"):
        plane.pull(address, token, 1, 64, lambda first, views: None, 10)


def test_a_stray_connection_does_not_disturb_the_plane(plane):
    address, token = plane.offer([b"y" * 100], timeout_s=30)
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as stray:
        stray.sendall(b"GET / HTTP/1.1\r\n\r\n")
        try:
            assert stray.recv(100) == b""  # closed without a word
        except ConnectionResetError:  # closed with the rest of the request unread
            pass
    got = []
    plane.pull(address, token, 1, 100, lambda first, views: got.extend(bytes(v) for v in views), 10)
    assert got == [b"y" * 100]


def test_a_pull_of_another_count_or_size_than_offered_is_refused(plane):
    address, token = plane.offer([b"z" * 100] * 2, timeout_s=30)
    with pytest.raises(PullError, match="offers 2 records of 100 bytes, expected 3 of 100"):
        plane.pull(address, token, 3, 100, lambda first, views: None, 10)


@pytest.mark.parametrize("direction", ["fetch", "push"])
def test_a_peer_closing_mid_stream_is_a_transfer_error_with_the_whole_blocks_stored(  # noqa: F811
        serve, plane, direction):
    keys = list(range(1, 101))
    a, b = filled_pool(keys), BlockPool(SPEC)
    plane.tamper = lambda i, record: None if i == 70 else record  # the connection closes before record 70
    if direction == "fetch":
        client = MessengerClient(serve(a).address, b, data_plane="socket")
        move = client.fetch
    else:
        client = MessengerClient(serve(b).address, a, data_plane="socket")
        move = client.push
    with client, pytest.raises(TransferError) as caught:
        move(keys)
    assert "closed the connection mid-stream" in str(caught.value)
    assert sorted(b.keys()) == keys[:70]  # every whole record that arrived, none after
    assert_exact(b, keys[:70])
    if direction == "fetch":
        assert caught.value.stored == keys[:70]
    else:
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        assert "70 earlier block(s) were stored" in str(caught.value)
    assert offers_drained(plane)


def test_a_pull_past_its_deadline_ends_with_a_transfer_error(serve, plane):  # noqa: F811
    keys = list(range(1, 31))
    a, b = filled_pool(keys), BlockPool(SPEC)

    def stall(i, record):
        if i == 20:
            time.sleep(2.0)
        return record

    plane.tamper = stall
    with MessengerClient(serve(a).address, b, data_plane="socket") as client:
        with pytest.raises(TransferError) as caught:
            client.fetch(keys, timeout_s=0.8)
    assert "timed out" in str(caught.value) or "DEADLINE_EXCEEDED" in str(caught.value)
    stored = caught.value.stored
    assert stored == keys[: len(stored)] and sorted(b.keys()) == stored and len(stored) <= 20
    assert_exact(b, stored)


def test_a_full_pool_on_the_receiver_is_a_transfer_error(serve, plane):  # noqa: F811
    keys = list(range(1, 11))
    a = filled_pool(keys)
    b = filled_pool([100, 101, 102], dram_blocks=3)
    server_b = serve(b)
    with b.pin([100, 101, 102]):
        with MessengerClient(serve(a).address, b, data_plane="socket") as fetcher:
            with pytest.raises(TransferError) as caught:
                fetcher.fetch(keys)
            assert "pinned" in str(caught.value) and caught.value.stored == []
        with MessengerClient(server_b.address, a, data_plane="socket") as pusher:
            with pytest.raises(TransferError) as caught:
                pusher.push(keys)
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert sorted(b.keys()) == [100, 101, 102]
    assert offers_drained(plane)


def test_data_plane_values_are_checked_and_named(serve):  # noqa: F811
    server = serve(filled_pool([1]))
    with pytest.raises(ValueError, match="data_plane must be one of auto, grpc, jax, socket, got 'tcp'"):
        MessengerClient(server.address, BlockPool(SPEC), data_plane="tcp")
    with pytest.raises(ValueError, match=r"data_plane must be one of \['auto', 'grpc', 'jax', 'socket'\], got 'tcp'"):
        InstanceConfig("decode", data_plane="tcp")
    assert InstanceConfig("decode", data_plane="socket").data_plane == "socket"
    channel = grpc.insecure_channel(server.address)
    stub = services.MessengerStub(channel)
    with pytest.raises(grpc.RpcError) as caught:
        stub.OfferPull(messages.FetchRequest(keys=[1], spec_fingerprint=SPEC.fingerprint, data_plane="udp"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "jax, socket" in caught.value.details()
    channel.close()


def test_the_socket_plane_is_refused_with_tls(serve, monkeypatch):  # noqa: F811
    server = serve(filled_pool([1]))
    channel = grpc.insecure_channel(server.address)  # opened before TLS is turned on in this process
    monkeypatch.setattr(tls, "_files", tls.TlsFiles(*(["/nonexistent"] * 3)))
    with pytest.raises(ValueError, match="does not support TLS"):
        MessengerClient(server.address, BlockPool(SPEC), data_plane="socket")
    with pytest.raises(grpc.RpcError) as caught:
        services.MessengerStub(channel).OfferPull(
            messages.FetchRequest(keys=[1], spec_fingerprint=SPEC.fingerprint, data_plane="socket"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "TLS" in caught.value.details()
    channel.close()


def test_the_bare_socket_stream_counts_every_record(serve, plane):  # noqa: F811
    server = serve(BlockPool(SPEC))
    records = [bytes(np.full(BlockPool(SPEC).record_bytes, i, np.uint8)) for i in range(70)]
    with MessengerClient(server.address, BlockPool(SPEC), data_plane="socket") as client:
        assert client.probe_pull(records) > 0
        with pytest.raises(TransferError, match="UNAVAILABLE"):  # records of another size than the peer's pool's
            client.probe_pull([b"x" * 100] * 3)
    assert offers_drained(plane)


def test_a_peer_that_offers_on_another_plane_is_a_clear_error(serve, monkeypatch):  # noqa: F811
    """An older peer drops the request's data_plane field and offers on the device plane: refused by name, no
    pull attempted."""
    from mooncake_jax.transfer import messenger_server

    monkeypatch.setattr(messenger_server._Servicer, "_offer_on_socket", lambda self, keys, checks, context:
                        messages.PullOffer(address="127.0.0.1:1", pull_id=7, keys=keys))
    a, b = filled_pool([1, 2]), BlockPool(SPEC)
    with MessengerClient(serve(a).address, b, data_plane="socket") as client:
        with pytest.raises(TransferError, match="offered on the jax plane, not the socket plane"):
            client.fetch([1, 2])
    assert len(b) == 0
