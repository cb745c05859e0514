"""The shared token that gates every RPC between the cluster's own processes when they leave loopback.

Servers add ``TokenGate(token)``; clients open channels with ``open_channel(address, token)``, which sends
``authorization: Bearer <token>`` on every call. Health checks stay open (orchestrators probe them without
secrets). The comparison is constant-time.
"""

from __future__ import annotations

import collections
import hmac

import grpc

from . import channel_options, tls

OPEN_SERVICES = ("grpc.health.v1.Health",)


def bearer_ok(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` value carries ``token`` (always true without a token); constant-time."""
    if token is None:
        return True
    if not header:
        return False
    scheme, _, value = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


class TokenGate(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the token, except to the open services."""

    def __init__(self, token: str):
        if not token or not token.strip():
            raise ValueError("the auth token must not be empty")
        self.token = token

    def intercept_service(self, continuation, details):
        service = details.method.rsplit("/", 2)[-2] if details.method.count("/") >= 2 else ""
        headers = dict(details.invocation_metadata or ())
        handler = continuation(details)
        if handler is None or service in OPEN_SERVICES or bearer_ok(headers.get("authorization"), self.token):
            return handler
        return _refusing(handler)


def _refusing(handler):
    """A handler of the same shape as ``handler`` that answers UNAUTHENTICATED."""

    def refuse(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token: send 'authorization: Bearer <token>'")

    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[handler.request_streaming, handler.response_streaming]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


_Details = collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                               "wait_for_ready", "compression"))


class _AddToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, d):
        return _Details(d.method, d.timeout, list(d.metadata or ()) + [self.header], d.credentials,
                        getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)]
"""A peer that went away (a restarting Conductor or instance) is tried again at least every 2 s, not after gRPC's
default backoff of up to 2 minutes: calls fail fast while it is away (UNAVAILABLE) and succeed soon after it is back."""


def open_channel(address: str, token: str | None = None, options: tuple = ()) -> grpc.Channel:
    """A channel to ``address`` with the project's message limits (TLS when this process has it: ``tls.py``),
    carrying ``token`` on every call if given; ``options`` are more gRPC channel options."""
    channel = tls.channel(address, channel_options() + RECONNECT_OPTIONS + list(options))
    return grpc.intercept_channel(channel, _AddToken(token)) if token else channel


def interceptors(token: str | None) -> tuple:
    """Server interceptors for ``grpc.server(..., interceptors=...)``: the gate when there is a token."""
    return (TokenGate(token),) if token else ()
