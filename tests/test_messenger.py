"""Messenger: blocks between pools over gRPC, in one process and across two; dedup, errors, partial transfers."""

import signal
import socket
import time
from concurrent import futures

import grpc
import ml_dtypes
import numpy as np
import pytest

from mooncake_jax.proto import channel_options
from mooncake_jax.transfer import BlockPool, BlockSpec, EventKind
from mooncake_jax.transfer.files import record_arrays
from mooncake_jax.transfer.frame import PREFIX_BYTES, frame_bytes, record_prefix, varint
from mooncake_jax.transfer.peer import PeerProcess
from mooncake_jax.transfer.pieces import (PIECE_BYTES, RecordAssembler, batched, encode_piece, parse_message,
                                          parse_piece)
from mooncake_jax.transfer.messenger import (
    BlocksNotFoundError,
    MessengerClient,
    MessengerServer,
    TransferError,
    messages,
    services,
)
from mooncake_jax.transfer.messenger_wire import SERVICE

SPEC = BlockSpec((2, 2, 16, 2, 32), np.float32)  # 16 KiB blocks
BIG_SPEC = BlockSpec((8, 2, 16, 16, 64), np.float32)  # 1 MiB blocks


def block_of(key: int, spec: BlockSpec = SPEC) -> np.ndarray:
    bits = np.random.default_rng(key).integers(0, 2**16, size=spec.nbytes // 2, dtype=np.uint16)
    return bits.view(spec.dtype).reshape(spec.shape)


def filled_pool(keys, spec: BlockSpec = SPEC, **kwargs) -> BlockPool:
    pool = BlockPool(spec, **kwargs)
    pool.put_many(list(keys), [block_of(key, spec) for key in keys])
    return pool


def assert_exact(pool: BlockPool, keys, spec: BlockSpec = SPEC) -> None:
    for key in keys:
        got = pool.get(key)
        assert got is not None and got.tobytes() == block_of(key, spec).tobytes(), f"block {key}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def serve():
    """Start a MessengerServer for a pool on a free port; all are stopped after the test."""
    servers = []

    def start(pool: BlockPool) -> MessengerServer:
        server = MessengerServer(pool, host="127.0.0.1", port=free_port()).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace_s=0)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_fetch_and_push_between_two_servers_in_one_process(serve, dtype):
    spec = BlockSpec((2, 2, 16, 2, 32), dtype)
    a, b = filled_pool(range(10), spec), filled_pool(range(100, 104), spec)
    server_a, server_b = serve(a), serve(b)
    with MessengerClient(server_a.address, b) as b_from_a, MessengerClient(server_b.address, a) as a_to_b:
        fetched = b_from_a.fetch(range(10))
        assert fetched.moved == list(range(10)) and fetched.skipped == []
        assert_exact(b, range(10), spec)
        pushed = a_to_b.push(range(10))  # b has them all now: nothing to send
        assert pushed.moved == [] and pushed.skipped == list(range(10)) and pushed.bytes == 0
    with MessengerClient(server_a.address, b) as b_to_a:
        assert b_to_a.push(range(100, 104)).moved == list(range(100, 104))
    assert_exact(a, range(100, 104), spec)


def test_dedup_sends_only_missing_blocks(serve):
    sender = filled_pool(range(20))
    receiver = filled_pool(range(0, 20, 2))  # holds the even keys already
    server = serve(sender)
    per_block = frame_bytes(SPEC)
    with MessengerClient(server.address, receiver) as client:
        result = client.fetch([*range(20), 3, 3])  # duplicates are asked once
        assert sorted(result.moved) == list(range(1, 20, 2)) and sorted(result.skipped) == list(range(0, 20, 2))
        assert client.counters.bytes_received == 10 * per_block == result.bytes
        assert client.counters.blocks_skipped == 10
    assert server.counters.bytes_sent == 10 * per_block and server.counters.blocks_sent == 10
    assert_exact(receiver, range(20))

    target = filled_pool(range(15, 20))
    target_server = serve(target)
    with MessengerClient(target_server.address, sender) as pusher:
        result = pusher.push(range(20))
        assert sorted(result.moved) == list(range(15)) and pusher.counters.bytes_sent == 15 * per_block
    assert target_server.counters.bytes_received == 15 * per_block
    assert_exact(target, range(20))


def test_unknown_keys_are_not_found_by_name_and_nothing_is_sent(serve):
    server = serve(filled_pool(range(4)))
    receiver = BlockPool(SPEC)
    with MessengerClient(server.address, receiver) as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.fetch([0, 1, 0xDEAD, 2, 0xBEEF])
    err = caught.value
    assert err.code == grpc.StatusCode.NOT_FOUND and sorted(err.keys) == [0xBEEF, 0xDEAD]
    assert f"{0xDEAD:#018x}" in str(err) and f"{0xBEEF:#018x}" in str(err)
    assert len(receiver) == 0 and server.counters.bytes_sent == 0

    with MessengerClient(server.address, filled_pool([7])) as pusher:
        with pytest.raises(BlocksNotFoundError, match=f"{0x99:#018x}") as caught:
            pusher.push([7, 0x99])
        assert caught.value.keys == [0x99]
    assert 7 not in server.pool  # a push with a key the sender lacks sends nothing


def test_large_blocks_travel_in_pieces_under_the_limit(serve):
    spec = BlockSpec((5, 2, 256, 8, 64), np.float32)  # 5 MiB: above gRPC's default 4 MiB message cap
    server = serve(filled_pool([1, 2], spec))
    with grpc.insecure_channel(server.address, options=channel_options()) as channel:
        request = messages.FetchRequest(keys=[1, 2], spec_fingerprint=spec.fingerprint)
        pieces = list(services.MessengerStub(channel).Fetch(request, timeout=30))
    assert len(pieces) == 2 * 2 and all(0 < len(p.data) <= PIECE_BYTES for p in pieces)
    assert all(len(p.SerializeToString()) < 4 * 1024 * 1024 for p in pieces)  # under gRPC's default cap
    receiver = BlockPool(spec)
    with MessengerClient(server.address, receiver) as client:
        client.fetch([1, 2])
    assert_exact(receiver, [1, 2], spec)


def test_a_block_under_the_limit_travels_as_its_stored_record(serve):
    spec = BlockSpec((12, 2, 128, 4, 64), np.float32)  # 3 MiB: the small preset's block
    sender = filled_pool([1, 2], spec)
    server = serve(sender)
    with grpc.insecure_channel(server.address, options=channel_options()) as channel:
        request = messages.FetchRequest(keys=[1, 2], spec_fingerprint=spec.fingerprint)
        raw = list(channel.unary_stream(f"/{SERVICE}/Fetch", messages.FetchRequest.SerializeToString)(request))
    assert raw == [sender.get_record(1), sender.get_record(2)]  # one message per block, the stored bytes as they are
    piece = messages.BlockPiece.FromString(raw[0])  # and a well-formed BlockPiece for any gRPC peer
    assert (piece.key, piece.offset, piece.frame_bytes, len(piece.data)) == (1, 0, frame_bytes(spec), frame_bytes(spec))
    assert piece.spec_fingerprint == spec.fingerprint and raw[0].endswith(piece.data)
    receiver = BlockPool(spec)
    with MessengerClient(server.address, receiver) as client:
        assert client.fetch([1, 2]).moved == [1, 2]
        assert client.probe(3 << 20, parse=False) > 0
    assert_exact(receiver, [1, 2], spec)
    assert receiver.get_record(1) == raw[0]


@pytest.mark.parametrize(
    "fields", [(1, 0, 7, b"abc", 0), (2**64 - 1, 2**40, 3 << 20, b"\x00" * 300, 2**63 + 5), (0, 0, 0, b"", 0)]
)
def test_hand_encoded_pieces_are_exactly_protobuf(fields):
    key, offset, total, data, fingerprint = fields
    reference = messages.BlockPiece(key=key, offset=offset, frame_bytes=total, data=data, spec_fingerprint=fingerprint)
    wire = encode_piece(key, offset, total, memoryview(data), fingerprint)
    assert wire == reference.SerializeToString()
    parsed = parse_piece(wire)
    assert (parsed.key, parsed.offset, parsed.frame_bytes, parsed.spec_fingerprint) == (key, offset, total, fingerprint)
    assert parsed.data == data


def test_pieces_parse_in_any_field_order_and_malformed_ones_are_refused():
    reordered = b"\x22\x08abcdefgh" + b"\x4a\x02zz" + b"\x28\x03\x18\x0c\x08\x09\x10\x04"  # field 9: unknown
    parsed, reference = parse_piece(reordered), messages.BlockPiece.FromString(reordered)
    fields = (parsed.key, parsed.offset, parsed.frame_bytes, parsed.data, parsed.spec_fingerprint)
    expected = (reference.key, reference.offset, reference.frame_bytes, reference.data, reference.spec_fingerprint)
    assert fields == expected
    assert fields == (9, 4, 12, b"abcdefgh", 3)
    for bad in (b"\x22\x09abcdefgh", b"\x08", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0b"):
        with pytest.raises(ValueError, match="malformed"):
            parse_piece(bad)


def test_a_whole_frame_pushed_in_another_encoding_is_stored(serve):
    receiver = BlockPool(SPEC)
    server = serve(receiver)
    frame = frame_of(filled_pool([5]), 5)
    piece = messages.BlockPiece(key=5, frame_bytes=len(frame), data=frame, spec_fingerprint=SPEC.fingerprint)
    assert raw_push(server.address, [piece]).stored == 1  # protobuf's own layout: not a record, rebuilt as one
    assert_exact(receiver, [5])


def test_other_block_spec_is_refused(serve):
    server = serve(filled_pool([1]))
    other = BlockPool(BlockSpec((2, 2, 16, 2, 32), ml_dtypes.bfloat16))
    with MessengerClient(server.address, other) as client:
        with pytest.raises(TransferError, match="block spec mismatch") as caught:
            client.fetch([1])
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION and len(other) == 0


def raw_push(address: str, pieces):
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        return services.MessengerStub(channel).Push(iter(pieces), timeout=10)


def frame_of(pool: BlockPool, key: int) -> bytes:
    return pool.get_record(key)[PREFIX_BYTES:]


def pieces_of(key: int, data: bytes, cut: int, fingerprint: int = SPEC.fingerprint):
    first = messages.BlockPiece(key=key, offset=0, frame_bytes=len(data), data=data[:cut], spec_fingerprint=fingerprint)
    return [first, messages.BlockPiece(key=key, offset=cut, frame_bytes=len(data), data=data[cut:])]


def test_push_stream_that_stops_inside_a_block_stores_no_partial_block(serve):
    source = filled_pool([1, 2])
    receiver = BlockPool(SPEC)
    server = serve(receiver)
    whole = pieces_of(1, frame_of(source, 1), 1000)
    torn = pieces_of(2, frame_of(source, 2), 1000, fingerprint=0)[:1]
    with pytest.raises(grpc.RpcError) as caught:
        raw_push(server.address, whole + torn)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"inside block {2:#018x}" in caught.value.details()
    assert receiver.keys() == [1]
    assert_exact(receiver, [1])


@pytest.mark.parametrize(
    "bad, code, message",
    [
        (lambda frame: frame[:-1] + bytes([frame[-1] ^ 4]), grpc.StatusCode.DATA_LOSS, "checksum"),
        (lambda frame: frame + b"x", grpc.StatusCode.INVALID_ARGUMENT, "this pool's blocks take"),
    ],
    ids=["corrupt", "wrong-size"],
)
@pytest.mark.parametrize("whole", [False, True], ids=["in-pieces", "whole-record"])
def test_bad_pushed_frames_are_refused(serve, bad, code, message, whole):
    receiver = BlockPool(SPEC)
    server = serve(receiver)
    record = filled_pool([5]).get_record(5)
    frame = bad(record[PREFIX_BYTES:])
    with grpc.insecure_channel(server.address, options=channel_options()) as channel:
        push = channel.stream_unary(f"/{SERVICE}/Push", None, messages.PushReply.FromString)
        with pytest.raises(grpc.RpcError) as caught:  # the record's own layout, as a Mooncake peer sends it
            if whole:
                push(iter([encode_piece(5, 0, len(frame), frame, SPEC.fingerprint)]), timeout=10)
            else:
                push(iter(p.SerializeToString() for p in pieces_of(5, frame, 4096)), timeout=10)
    assert caught.value.code() == code and message in caught.value.details()
    assert len(receiver) == 0


def test_a_block_corrupt_at_the_sender_is_not_found_never_sent(serve, tmp_path):
    sender = filled_pool([1, 2, 3], dram_blocks=0, ssd_path=tmp_path)
    sender.close()  # its writes are done; damage the end of block 2's data in the SSD tier's data array
    heads, data = record_arrays(tmp_path, SPEC)
    slot = next(i for i, head in enumerate(heads[:8].read().result())
                if head.tobytes().startswith(record_prefix(SPEC, 2)))
    damaged = data[slot].read().result()
    damaged[-10] ^= 1
    data[slot].write(damaged).result()
    sender = BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path)
    server = serve(sender)
    receiver = BlockPool(SPEC)
    with MessengerClient(server.address, receiver) as client:
        with pytest.raises(BlocksNotFoundError) as caught:
            client.fetch([1, 2, 3])
        assert caught.value.keys == [2] and caught.value.stored == [1]
        assert client.fetch([3]).moved == [3]
    assert sorted(receiver.keys()) == [1, 3] and 2 not in sender
    assert_exact(receiver, [1, 3])


def test_deadline_ends_a_slow_transfer(serve):
    sender = filled_pool(range(6))
    slow_get = sender.get_record

    def get_record_slowly(key, promote=True, **options):
        time.sleep(0.15)
        return slow_get(key, promote, **options)

    slow_join = sender.join_records

    def join_records_slowly(keys, separator, **options):  # small blocks go several to a message, by join_records
        time.sleep(0.15 * len(keys))
        return slow_join(keys, separator, **options)

    sender.get_record = get_record_slowly
    sender.join_records = join_records_slowly
    server = serve(sender)
    receiver = BlockPool(SPEC)
    with MessengerClient(server.address, receiver, timeout_s=0.4, data_plane="grpc") as client:
        started = time.monotonic()
        with pytest.raises(TransferError) as caught:
            client.fetch(range(6))
        assert time.monotonic() - started < 2
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sorted(receiver.keys()) == sorted(caught.value.stored) and len(caught.value.stored) < 6
    assert_exact(receiver, caught.value.stored)
    assert client.counters.failures == 1


def test_bad_arguments(serve):
    server = serve(filled_pool([1]))
    with pytest.raises(ValueError, match="timeout_s"):
        MessengerClient(server.address, BlockPool(SPEC), timeout_s=0)
    with pytest.raises(ValueError, match="cannot listen"):
        MessengerServer(BlockPool(SPEC), port=server.port)
    with MessengerClient(server.address, BlockPool(SPEC)) as client:
        with pytest.raises(ValueError, match="2\\*\\*64"):
            client.fetch([-1])
        with pytest.raises(TransferError, match="probe of") as caught:
            client.probe(1 << 40)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert client.probe(3 << 20) > 0
        assert client.probe_upload(3 << 20, piece_bytes=1 << 20) > 0  # the peer counted the 3 messages sent
        assert client.probe_upload(3 << 20, piece_bytes=1 << 20, parse=True) > 0  # parsed: 3 pieces of data
    with MessengerClient(f"127.0.0.1:{free_port()}", BlockPool(SPEC), timeout_s=2) as nobody:
        with pytest.raises(TransferError) as caught:
            nobody.fetch([1])
        assert caught.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# ---- two processes ------------------------------------------------------------------------------------


@pytest.fixture
def peer_process():
    peers = []

    def start(spec: BlockSpec = SPEC) -> PeerProcess:
        port = free_port()
        peers.append(PeerProcess(spec, port=port))
        assert peers[-1].address == f"127.0.0.1:{port}"
        return peers[-1]

    yield start
    for peer in peers:
        peer.stop()


def test_between_two_processes(peer_process):
    peer = peer_process()
    with MessengerClient(peer.address, filled_pool(range(12))) as pusher:
        assert len(pusher.push(range(12)).moved) == 12
    receiver = filled_pool([3])
    with MessengerClient(peer.address, receiver) as fetcher:
        result = fetcher.fetch(range(12))
    assert len(result.moved) == 11 and result.skipped == [3]
    assert_exact(receiver, range(12))
    assert peer.stop() == 0


def test_server_killed_midway_gives_an_error_and_only_whole_blocks(peer_process):
    peer = peer_process(BIG_SPEC)
    n_blocks = 96
    with MessengerClient(peer.address, filled_pool(range(n_blocks), BIG_SPEC), data_plane="grpc") as pusher:
        pusher.push(range(n_blocks))

    def kill_on_first_block(event):
        if event.kind is EventKind.STORED and peer.process.poll() is None:
            peer.process.send_signal(signal.SIGKILL)
            peer.process.wait()

    receiver = BlockPool(BIG_SPEC, on_event=kill_on_first_block)
    with MessengerClient(peer.address, receiver, timeout_s=20, data_plane="grpc") as client:
        with pytest.raises(TransferError) as caught:
            client.fetch(range(n_blocks))
    assert caught.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)
    stored = caught.value.stored
    assert 1 <= len(stored) < n_blocks and sorted(receiver.keys()) == sorted(stored)
    assert_exact(receiver, stored, BIG_SPEC)


def test_device_data_plane_moves_the_same_blocks_with_grpc_for_control(serve):
    """data_plane="jax": records travel as device arrays pulled with jax.experimental.transfer; the keys, the
    skipping of held blocks, the verification and the errors are those of the gRPC data plane."""
    a, b = filled_pool(range(6)), filled_pool(range(100, 103))
    server_a, server_b = serve(a), serve(b)
    with MessengerClient(server_a.address, b, data_plane="jax") as b_from_a, MessengerClient(
        server_b.address, a, data_plane="jax"
    ) as a_to_b:
        fetched = b_from_a.fetch([0, 1, 2, 100])
        assert fetched.moved == [0, 1, 2] and fetched.skipped == [100] and fetched.bytes == 3 * frame_bytes(SPEC)
        assert_exact(b, [0, 1, 2])
        pushed = a_to_b.push([3, 4, 0])
        assert pushed.moved == [3, 4] and pushed.skipped == [0]
        assert_exact(b, [3, 4])
        with pytest.raises(BlocksNotFoundError) as caught:
            b_from_a.fetch([5, 77])
        assert caught.value.keys == [77] and 5 not in b
        assert server_a.counters.blocks_sent == 3 and server_b.counters.blocks_received == 2
    with pytest.raises(ValueError, match="data_plane must be one of auto, grpc, jax"):
        MessengerClient(server_a.address, b, data_plane="rdma")


def test_read_ahead_keeps_order_raises_where_the_error_was_and_stops_early():
    from mooncake_jax.transfer.readahead import Ahead

    read = []

    def record_of(key):
        read.append(key)
        if key == 4:
            raise KeyError("block 4 is gone")
        return key * 10

    def reads(keys):  # records read by key, as a sender reads its pool's
        return ((key, record_of(key)) for key in keys)

    with Ahead(reads(range(4)), depth=2) as records:
        assert list(records) == [(0, 0), (1, 10), (2, 20), (3, 30)]
    got = []
    with pytest.raises(KeyError, match="block 4 is gone"), Ahead(reads([3, 4, 5])) as records:
        for key, value in records:
            got.append(key)
    assert got == [3] and 5 not in read  # nothing read past the failure
    read.clear()
    with Ahead(reads(range(100, 200)), depth=2) as records:
        assert next(iter(records)) == (100, 1000)
    assert len(read) <= 4  # the reader stopped: at most depth ahead of the consumer (plus the one in hand)


def test_a_refused_push_ends_at_once_though_the_sender_keeps_the_stream_open(serve):
    """The receiver takes messages ahead on a thread; a refused block ends the call with its error at once, not
    when the sender's deadline runs out (that thread is not waited for while the peer sends nothing more)."""
    import threading

    receiver = BlockPool(SPEC)
    server = serve(receiver)
    record = filled_pool([5]).get_record(5)
    bad = bytearray(record)
    bad[-1] ^= 4
    stalled = threading.Event()

    def stream():
        yield encode_piece(5, 0, len(record) - PREFIX_BYTES, bytes(bad[PREFIX_BYTES:]), SPEC.fingerprint)
        stalled.wait(30)  # the stream stays open, sending nothing

    started = time.monotonic()
    try:
        with grpc.insecure_channel(server.address, options=channel_options()) as channel:
            push = channel.stream_unary(f"/{SERVICE}/Push", None, messages.PushReply.FromString)
            with pytest.raises(grpc.RpcError) as caught:
                push(stream(), timeout=20)
    finally:
        stalled.set()
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in caught.value.details()
    assert time.monotonic() - started < 10 and len(receiver) == 0


def test_ahead_produces_in_order_bounded_and_need_not_wait_for_a_blocked_source():
    import threading

    from mooncake_jax.transfer.readahead import Ahead

    produced, release = [], threading.Event()

    def source():
        for item in range(100):
            produced.append(item)
            if item == 10:
                release.wait(30)  # a peer that stops sending
            yield item

    ahead = Ahead(source(), depth=2, join=False)
    got = iter(ahead)
    assert [next(got) for _ in range(3)] == [0, 1, 2]
    time.sleep(0.1)
    assert len(produced) <= 3 + 2 + 1  # at most depth ahead of the consumer, plus the one in hand
    started = time.monotonic()
    ahead.close()  # returns at once; the thread ends once the source does
    assert time.monotonic() - started < 1
    release.set()


# ---- several blocks to a message (BlockPiece.next) ----------------------------------------------------------


def test_batched_messages_are_exactly_protobuf_and_parse_back():
    records = [(key, filled_pool([key]).get_record(key)) for key in range(1, 8)]
    budget = 3 * len(records[0][1]) + 40  # three records and the framing of two `next` fields
    batches = list(batched(records, SPEC.fingerprint, budget))
    assert [keys for _, keys in batches] == [[1, 2, 3], [4, 5, 6], [7]]
    assert batches[-1][0] == records[-1][1]  # a message of one record is the record itself
    for message, keys in batches:
        assert len(message) <= budget
        reference = messages.BlockPiece.FromString(message)  # protobuf's own parser: first piece, then `next`
        ref_pieces = [reference, *reference.next]
        assert [p.key for p in ref_pieces] == keys and all(not p.next for p in reference.next)
        parsed = parse_message(message)
        assert [piece.key for piece, _ in parsed] == keys
        for (piece, raw), ref, key in zip(parsed, ref_pieces, keys):
            assert piece.data == ref.data and piece.spec_fingerprint == ref.spec_fingerprint == SPEC.fingerprint
            assert bytes(raw) == dict(records)[key]  # each piece's wire bytes: the record, uncopied
    assert [keys for _, keys in batched(records, SPEC.fingerprint, 0)] == [[key] for key in range(1, 8)]
    assert next(iter(batched(records, SPEC.fingerprint, 0)))[0] == records[0][1]


def test_malformed_batches_are_refused():
    record = filled_pool([1]).get_record(1)
    late_field = record + b"\x3a" + bytes([len(b"\x08\x02")]) + b"\x08\x02" + b"\x08\x05"  # a first-piece field last
    nested = record + b"\x3a\x04" + b"\x3a\x02\x08\x02"  # a batched piece carrying pieces of its own
    for bad in (late_field, nested, record + b"\x3a\x09\x08"):
        with pytest.raises(ValueError, match="malformed"):
            parse_message(bad)
    with pytest.raises(ValueError, match="malformed"):
        parse_piece(record + b"\x3a\x02\x08\x02")  # a piece read alone may not carry others


def test_a_message_of_whole_records_is_read_by_their_prefixes_as_the_full_parse_reads_it():
    """RecordAssembler.records reads a message of whole records (what this build sends) by checking each record's
    prefix and separator; the records are the ones protobuf's parse gives. A message that is anything else (a record
    in another encoding, a damaged separator, cut short) is left to the full parse: stored the same, or refused."""
    records = [(key, filled_pool([key]).get_record(key)) for key in (1, 2, 3)]
    [(message, _)] = batched(records, SPEC.fingerprint, 10 * len(records[0][1]))
    assembler = RecordAssembler(SPEC)
    fast = assembler.whole_records(message)
    assert [(key, bytes(record)) for key, record in fast] == records
    assert [(key, bytes(record)) for key, record in assembler.records(message)] == records
    assert assembler.whole_records(records[0][1]) == [(1, records[0][1])]  # one record: the message itself
    other = encode_piece(2, 0, frame_bytes(SPEC), records[1][1][PREFIX_BYTES:], SPEC.fingerprint)  # no padding
    mixed = b"".join((records[0][1], b"\x3a", varint(len(other)), other))
    assert assembler.whole_records(mixed) is None
    assert [(key, bytes(record)) for key, record in assembler.records(mixed)] == records[:2]
    unknown_field = bytearray(message)
    unknown_field[len(records[0][1])] = 0x42  # field 8 instead of `next`: skipped by the parse, with the record in it
    assert assembler.whole_records(bytes(unknown_field)) is None
    assert [key for key, _ in assembler.records(bytes(unknown_field))] == [1, 3]
    assert assembler.whole_records(message[:-1]) is None
    with pytest.raises(ValueError, match="malformed"):
        assembler.records(message[:-1])


def test_a_message_completing_two_large_frames_hands_on_two_records():
    """Frames gathered in the assembler's reused buffer: two completed by one message are two records, not the same
    buffer twice."""
    frames = {key: filled_pool([key]).get_record(key)[PREFIX_BYTES:] for key in (1, 2)}
    half = len(frames[1]) // 2
    pieces = [encode_piece(key, at, len(frame), frame[at : at + half] if at == 0 else frame[at:], SPEC.fingerprint)
              for key, frame in frames.items() for at in (0, half)]
    message = pieces[0] + b"".join(b"\x3a" + varint(len(piece)) + piece for piece in pieces[1:])
    got = RecordAssembler(SPEC).records(message)
    expected = [(key, filled_pool([key]).get_record(key)) for key in (1, 2)]
    assert [(key, bytes(record)) for key, record in got] == expected


def test_fetch_batches_small_blocks_only_for_a_caller_that_takes_them(serve):
    server = serve(filled_pool(range(1, 11)))
    record_size = len(server.pool.get_record(1))
    with grpc.insecure_channel(server.address, options=channel_options()) as channel:
        fetch = channel.unary_stream(f"/{SERVICE}/Fetch", messages.FetchRequest.SerializeToString)
        old = list(fetch(messages.FetchRequest(keys=list(range(1, 11)), spec_fingerprint=SPEC.fingerprint)))
        budget = 4 * record_size + 40
        new = list(fetch(messages.FetchRequest(keys=list(range(1, 11)), spec_fingerprint=SPEC.fingerprint,
                                               batch_bytes=budget)))
    assert old == [server.pool.get_record(key) for key in range(1, 11)]  # an older caller: one record a message
    assert [len(messages.BlockPiece.FromString(m).next) for m in new] == [3, 3, 1]
    assert all(len(m) <= budget for m in new)
    receiver = BlockPool(SPEC)
    with MessengerClient(server.address, receiver) as client:
        assert client.fetch(range(1, 11)).moved == list(range(1, 11))
    assert_exact(receiver, range(1, 11))
    assert server.counters.blocks_sent == 30


def test_a_pushed_message_of_several_records_one_corrupt_stores_the_ones_before_it(serve):
    receiver = BlockPool(SPEC)
    server = serve(receiver)
    records = [(key, filled_pool([key]).get_record(key)) for key in (1, 2, 3, 4)]
    damaged = bytearray(records[2][1])
    damaged[-5] ^= 0x10  # block 3's data: its checksum no longer matches
    records[2] = (3, bytes(damaged))
    [(message, keys)] = batched(records, SPEC.fingerprint, 10 * len(damaged))
    assert keys == [1, 2, 3, 4]
    with grpc.insecure_channel(server.address, options=channel_options()) as channel:
        push = channel.stream_unary(f"/{SERVICE}/Push", None, messages.PushReply.FromString)
        with pytest.raises(grpc.RpcError) as caught:
            push(iter([message]), timeout=10)
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS
    assert "checksum" in caught.value.details() and "2 earlier block(s) were stored" in caught.value.details()
    assert sorted(receiver.keys()) == [1, 2]
    assert_exact(receiver, [1, 2])


def test_push_sends_one_record_a_message_to_a_peer_that_does_not_take_batches():
    """A peer of an older build: its HasReply has no batch_bytes, and it reads every message as one piece."""
    received: list[bytes] = []

    def has(request, context):
        return messages.HasReply(present=[False] * len(request.keys))  # no batch_bytes

    def push(request_iterator, context):
        received.extend(request_iterator)
        return messages.PushReply(stored=len(received))

    server = grpc.server(futures.ThreadPoolExecutor(2), options=channel_options())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Has": grpc.unary_unary_rpc_method_handler(has, messages.HasRequest.FromString,
                                                   messages.HasReply.SerializeToString),
        "Push": grpc.stream_unary_rpc_method_handler(push, None, messages.PushReply.SerializeToString),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        sender = filled_pool(range(1, 7))
        with MessengerClient(f"127.0.0.1:{port}", sender) as client:
            assert client.push(range(1, 7)).moved == list(range(1, 7))
    finally:
        server.stop(0)
    assert received == [sender.get_record(key) for key in range(1, 7)]


@pytest.mark.parametrize("shape", [(8, 2, 16, 16, 80), SPEC.shape], ids=["alone", "several"])
def test_a_block_is_stored_as_received_and_served_on(serve, shape):
    """A block too large to share a message (as a 128-token block of the ``small`` preset; "alone") arrives as one
    ``bytes`` holding its record, small blocks ("several") as views into a message of several: the receiving pool
    keeps that buffer (verified, not copied) and serves it on to a third pool the same way, fetch and push,
    bit-exact (each record verified again as it is sent and received)."""
    spec = BlockSpec(shape, np.float32)  # 1.25 MiB: one record per message; 16 KiB: several
    source, middle, last = filled_pool(range(3), spec), BlockPool(spec), BlockPool(spec)
    with MessengerClient(serve(source).address, middle, data_plane="grpc") as middle_from_source:
        assert middle_from_source.fetch(range(3)).moved == [0, 1, 2]
    with MessengerClient(serve(middle).address, last, data_plane="grpc") as last_from_middle:
        assert last_from_middle.fetch([0]).moved == [0]
    with MessengerClient(serve(last).address, middle, data_plane="grpc") as middle_to_last:
        assert middle_to_last.push([1, 2]).moved == [1, 2]
    for pool, together in ((middle, (0, 1, 2)), (last, (1, 2))):  # last got 0 alone
        slots = [pool._tiers[0].store._slot_of[key] for key in range(3)]
        assert all(slot.adopted is not None for slot in slots)
        assert all((len(slots[key].message) > pool.record_bytes) == (shape == SPEC.shape) for key in together)
        assert_exact(pool, range(3), spec)
