"""Server interceptors that keep a gRPC server honest under abuse and overload.

``DecodeGuard``: a request that is not a valid protobuf of its method's type gets INVALID_ARGUMENT naming the
type, with one log line (grpcio itself answers INTERNAL "Exception deserializing request!" and logs a traceback).

``WorkGate``: admission before a call can wait in grpcio's queue. grpcio hands every accepted call to its thread
pool and queues it there while all threads are busy, where no admission check runs (a decode instance with all
threads in long streams left the surplus waiting for minutes, its Stats calls too). The gate counts the calls of
each gated service that are running or about to run and refuses one beyond the service's limit at once with
RESOURCE_EXHAUSTED; the server's pool is sized to the sum of the limits plus ``RESERVED_THREADS``, so admitted calls
never wait for a thread and the calls that are not gated (Stats, health) always find one.

Interceptors run on grpcio's polling thread, before the call is handed to the pool: that is what makes the refusal
immediate.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc

log = logging.getLogger(__name__)

RESERVED_THREADS = 8
"""Threads beyond the gated limits: for Stats, health and the (instant) refusals."""

PENDING_TTL_S = 10.0
"""A call admitted but never started (its client went away while it was being handed to a thread) stops counting
after this long."""


def _make_handler(like, behavior, request_deserializer=None):
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[like.request_streaming, like.response_streaming]
    return make(behavior, request_deserializer=request_deserializer or like.request_deserializer,
                response_serializer=like.response_serializer)


def _behavior(handler):
    return (handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)


def _split(method: str) -> tuple[str, str]:
    parts = method.rsplit("/", 2)
    return (parts[-2], parts[-1]) if len(parts) == 3 else ("", method)


class _Corrupt:
    def __init__(self, reason: str):
        self.reason = reason


class DecodeGuard(grpc.ServerInterceptor):
    """Malformed request bytes -> INVALID_ARGUMENT with the message type's name, one log line."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        decode, behavior, method = handler.request_deserializer, _behavior(handler), details.method

        def safe_decode(raw: bytes):
            try:
                return decode(raw)
            except Exception as e:  # noqa: BLE001 - any parse failure is the sender's fault
                return _Corrupt(f"{type(e).__name__}: {e}")

        def refuse(context, corrupt: _Corrupt):
            log.warning("%s: refused a request that is not a valid protobuf (%s)", method, corrupt.reason)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the request is not a valid protobuf message for {method} ({corrupt.reason})")

        if handler.request_streaming:
            def checked_stream(requests):
                for request in requests:
                    if isinstance(request, _Corrupt):
                        raise _CorruptInStream(request)
                    yield request

            def guarded(requests, context):
                try:
                    return behavior(checked_stream(requests), context)
                except _CorruptInStream as e:
                    refuse(context, e.corrupt)
        else:
            def guarded(request, context):
                if isinstance(request, _Corrupt):
                    refuse(context, request)
                return behavior(request, context)

        return _make_handler(handler, guarded, safe_decode)


class _CorruptInStream(Exception):
    def __init__(self, corrupt: _Corrupt):
        super().__init__(corrupt.reason)
        self.corrupt = corrupt


class WorkGate(grpc.ServerInterceptor):
    """At most ``limits[service]`` concurrent calls of each gated service (full names, e.g.
    ``mooncake.v1.Instance``); methods named in ``exempt`` are never gated. ``name`` appears in refusals."""

    def __init__(self, limits: dict[str, int], exempt: tuple[str, ...] = ("Stats",), name: str = "this server"):
        if any(n < 1 for n in limits.values()):
            raise ValueError(f"work limits must be at least 1, got {limits}")
        self.limits, self.exempt, self.name = dict(limits), set(exempt), name
        self._lock = threading.Lock()
        self._busy = dict.fromkeys(limits, 0)
        self._pending: dict[str, dict[int, float]] = {s: {} for s in limits}
        self._ids = itertools.count()
        self.refused = 0

    @property
    def threads(self) -> int:
        """The thread pool size that lets every admitted call run at once, with the reserve."""
        return sum(self.limits.values()) + RESERVED_THREADS

    def in_flight(self, service: str) -> int:
        with self._lock:
            return self._busy[service] + len(self._pending[service])

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        service, method = _split(details.method)
        limit = self.limits.get(service)
        if handler is None or limit is None or method in self.exempt:
            return handler
        now = time.monotonic()
        with self._lock:
            pending = self._pending[service]
            for ticket in [t for t, at in pending.items() if now - at > PENDING_TTL_S]:
                del pending[ticket]
            if self._busy[service] + len(pending) >= limit:
                self.refused += 1
                return _make_handler(handler, self._refuse(service, limit))
            ticket = next(self._ids)
            pending[ticket] = now
        return _make_handler(handler, self._counted(handler, service, ticket))

    def _refuse(self, service: str, limit: int):
        message = f"{self.name} is at its limit of {limit} concurrent {service.rsplit('.', 1)[-1]} calls; retry later"

        def refuse(_request, context):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        return refuse

    def _counted(self, handler, service: str, ticket: int):
        behavior, streaming = _behavior(handler), handler.response_streaming

        def counted(request, context):
            """Counts until the handler returns (a stream: until its generator ends or is closed), i.e. for as
            long as it holds a pool thread, a cancelled call included."""
            ended = threading.Event()

            def end():
                with self._lock:
                    if not ended.is_set():
                        ended.set()
                        self._busy[service] -= 1

            with self._lock:
                self._pending[service].pop(ticket, None)
                self._busy[service] += 1
            try:
                result = behavior(request, context)
            except BaseException:
                end()
                raise
            if not streaming:
                end()
                return result
            return _ending(result, end)
        return counted


def _ending(iterator, end):
    try:
        yield from iterator
    finally:
        end()
