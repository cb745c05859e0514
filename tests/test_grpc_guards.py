"""The gRPC guards (proto/guards.py) on a real server: a corrupt protobuf is INVALID_ARGUMENT (not grpcio's INTERNAL),
and the work gate refuses calls beyond its limit at once while exempt calls still answer, then admits again."""

import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2

from mooncake_jax.proto.guards import DecodeGuard, WorkGate


@pytest.fixture
def server():
    release = threading.Event()
    started = threading.Semaphore(0)

    def wait(request, context):
        started.release()
        release.wait(10)
        return b"done"

    def stats(request, context):
        return b"stats"

    def forever(request, context):
        started.release()
        while True:
            time.sleep(0.01)
            yield b"tick"

    def check(request, context):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    gate = WorkGate({"test.Slow": 2}, exempt=("Stats",), name="test server")
    srv = grpc.server(futures.ThreadPoolExecutor(gate.threads), interceptors=(DecodeGuard(), gate))
    srv.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler("test.Slow", {
            "Wait": grpc.unary_unary_rpc_method_handler(wait),
            "Stats": grpc.unary_unary_rpc_method_handler(stats),
            "Forever": grpc.unary_stream_rpc_method_handler(forever)}),
        grpc.method_handlers_generic_handler("test.Typed", {
            "Check": grpc.unary_unary_rpc_method_handler(
                check, request_deserializer=health_pb2.HealthCheckRequest.FromString,
                response_serializer=health_pb2.HealthCheckResponse.SerializeToString)})])
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield channel, gate, release, started
    release.set()
    channel.close()
    srv.stop(0)


def test_work_gate_refuses_beyond_its_limit_and_exempt_calls_answer(server):
    channel, gate, release, started = server
    wait, stats = channel.unary_unary("/test.Slow/Wait"), channel.unary_unary("/test.Slow/Stats")
    running = [wait.future(b"", timeout=20) for _ in range(2)]
    assert started.acquire(timeout=10) and started.acquire(timeout=10)
    t = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        wait(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 2" in err.value.details()
    assert time.monotonic() - t < 2  # refused at once, not after waiting for a thread
    assert stats(b"", timeout=5) == b"stats"  # exempt: answers while the limit is reached
    assert gate.refused == 1 and gate.in_flight("test.Slow") == 2
    release.set()
    assert [f.result() for f in running] == [b"done", b"done"]
    deadline = time.monotonic() + 5
    while gate.in_flight("test.Slow") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gate.in_flight("test.Slow") == 0
    assert wait(b"", timeout=5) == b"done"  # admitted again


def test_cancelled_streams_release_their_slot(server):
    channel, gate, release, started = server
    forever = channel.unary_stream("/test.Slow/Forever")
    for _ in range(3):  # each round fills the gate and cancels: slots must come back every time
        calls = [forever(b"", timeout=20) for _ in range(2)]
        assert [next(call) for call in calls] == [b"tick", b"tick"]
        assert started.acquire(timeout=10) and started.acquire(timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            next(forever(b"", timeout=5))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in calls:
            call.cancel()
        deadline = time.monotonic() + 5
        while gate.in_flight("test.Slow") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gate.in_flight("test.Slow") == 0


def test_corrupt_protobuf_is_invalid_argument(server, caplog):
    channel, *_ = server
    check = channel.unary_unary("/test.Typed/Check")
    with pytest.raises(grpc.RpcError) as err:
        check(b"\xff\xff\xff\xff\x0f", timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid protobuf" in err.value.details()
    ok = check(health_pb2.HealthCheckRequest(service="x").SerializeToString(), timeout=5)
    assert health_pb2.HealthCheckResponse.FromString(ok).status == health_pb2.HealthCheckResponse.SERVING
