"""A decode stream the gateway stops reading (its client went away) is cancelled and its last events read
(``instance/backend.end_stream``): a stream read on its own thread (``INSTANCE_CHANNEL_OPTIONS``) keeps its native
call otherwise. Checked against a plain gRPC server that streams until cancelled, with the options the gateway's
instance channels use, cancelling from the reading thread and from another (the gateway's disconnect watcher)."""

from __future__ import annotations

import struct
import threading
import time
from concurrent import futures

import grpc
import pytest

from mooncake_jax.instance.backend import INSTANCE_CHANNEL_OPTIONS, end_stream


@pytest.fixture(scope="module")
def stream():
    """A unary-stream method that yields a message every millisecond, up to the count asked for."""

    def messages(request, context):
        for _ in range(struct.unpack("<I", request)[0]):
            if not context.is_active():
                return
            yield b"token"
            time.sleep(0.001)

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Stream", {"Messages": grpc.unary_stream_rpc_method_handler(messages)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=list(INSTANCE_CHANNEL_OPTIONS))
    yield channel.unary_stream("/test.Stream/Messages")
    channel.close()
    server.stop(0)


def _pending(call) -> set:
    return set(getattr(call, "_state").due)


def test_the_gateway_reads_decode_streams_on_their_own_thread(stream):
    call = stream(struct.pack("<I", 3), timeout=10)
    assert type(call).__name__ == "_SingleThreadedRendezvous"  # else end_stream has nothing to read
    assert list(call) == [b"token"] * 3


def test_a_stream_cancelled_midway_is_read_to_its_end(stream):
    left = stream(struct.pack("<I", 10_000), timeout=10)
    next(left)
    left.cancel()
    assert _pending(left)  # what end_stream reads: plain cancel leaves it (and the call) behind
    ended = stream(struct.pack("<I", 10_000), timeout=10)
    next(ended)
    end_stream(ended)
    assert not _pending(ended)
    assert ended.code() == grpc.StatusCode.CANCELLED


def test_a_stream_cancelled_from_another_thread_is_read_to_its_end(stream):
    call = stream(struct.pack("<I", 10_000), timeout=10)
    next(call)
    threading.Timer(0.05, call.cancel).start()  # the disconnect watcher, while this thread is reading
    with pytest.raises(grpc.RpcError) as raised:
        for _ in call:
            pass
    assert raised.value.code() == grpc.StatusCode.CANCELLED
    end_stream(call)
    assert not _pending(call)


def test_ending_a_finished_stream_changes_nothing(stream):
    call = stream(struct.pack("<I", 2), timeout=10)
    assert list(call) == [b"token"] * 2
    end_stream(call)
    assert call.code() == grpc.StatusCode.OK and not _pending(call)
