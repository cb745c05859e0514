"""A fake backend with predictable outputs and client helpers for the gateway tests (as JetStream's orchestrator
tests drive a mock engine). Holds no tests itself; the tests import it by name."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import grpc
import pytest

from mooncake_jax.gateway import GatewayServer
from mooncake_jax.gateway.backend import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Finished, GenerateRequest,
                                          TokenOut, paper_tbt)
from mooncake_jax.gateway.tokenizer import ByteTokenizer
from mooncake_jax.proto import channel_options, load

messages, services = load("gateway")
BYTES = ByteTokenizer(512)
WAIT_S = 10.0  # the longest any test waits for something that should happen at once


class FakeBackend:
    """Answers every request with ``reply`` (token ids; by default the prompt's tokens after its first, cycled),
    stops at ``eos_token_id`` or a stop token (both included in the stream), honours ``cancelled`` between tokens.

    Knobs for the failure tests: ``fail`` (an exception raised before the first token, for the requests
    ``fail_when`` accepts), ``fail_after`` (raised
    after that many tokens), ``pause_after`` (stop after that many tokens until ``release`` or cancellation, for
    the requests ``pause_when`` accepts).
    """

    model_name = "fake-model"
    vocab_size = 512
    max_context = 64
    eos_token_id = 2

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.reply: list[int] | None = None
        self.fail: Exception | None = None
        self.fail_when = lambda request: True  # which requests ``fail`` applies to
        self.fail_after: tuple[int, Exception] | None = None
        self.pause_after: int | None = None
        self.pause_when = lambda request: True  # which requests pause_after applies to
        self.release = threading.Event()
        self.token_delay_s = 0.0
        self.cached_tokens = 3
        self.requests: list[GenerateRequest] = []
        self.cancel_events: list[threading.Event] = []
        self.aborted = threading.Event()  # a stream ended because its cancelled event was set
        self.ended = threading.Event()  # a stream's generator finished (normally, aborted or closed)
        self.stats_calls = 0
        self.unhealthy: str | None = None  # what health() reports missing (None: ready)

    def generate(self, request: GenerateRequest, cancelled: threading.Event | None = None):
        self.requests.append(request)
        self.cancel_events.append(cancelled)
        try:
            yield from self._generate(request, cancelled or threading.Event())
        finally:
            self.ended.set()

    def _generate(self, request, cancelled):
        start = time.monotonic()
        if self.fail is not None and self.fail_when(request):
            raise self.fail
        reply = self.reply if self.reply is not None else request.prompt[1:] or request.prompt
        times, reason = [], FINISH_LENGTH
        for i in range(request.max_tokens):
            if self.fail_after is not None and i == self.fail_after[0]:
                raise self.fail_after[1]
            if self.pause_after is not None and i == self.pause_after and self.pause_when(request):
                while not self.release.is_set() and not cancelled.wait(0.005):
                    pass
            if cancelled.is_set():
                self.aborted.set()
                reason = FINISH_ABORT
                break
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            token = reply[i % len(reply)]
            times.append(time.monotonic() - start)
            yield TokenOut(token, i, times[-1])
            if (token == self.eos_token_id and not request.ignore_eos) or token in request.stop_token_ids:
                reason = FINISH_STOP
                break
        yield Finished(reason, len(request.prompt), len(times), self.cached_tokens, times[0] if times else 0.0,
                       paper_tbt(times))

    def health(self) -> str | None:
        return self.unhealthy

    def stats(self) -> dict[str, float]:
        self.stats_calls += 1
        return {'queue_depth{instance="p0"}': 2, 'queue_depth{instance="d0"}': 1, "cache_hit_tokens_total": 40,
                "transfer_bytes_total": 4096.0}


def text_ids(text: str) -> list[int]:
    """Byte-tokenizer ids of ``text`` without BOS (what a reply made of that text looks like)."""
    return BYTES.encode(text)[1:]


@pytest.fixture(scope="module")
def backend():
    return FakeBackend()


@pytest.fixture(scope="module")
def gateway(backend):
    with GatewayServer(backend) as gw:
        yield gw


@pytest.fixture(autouse=True)
def _fresh_backend(request):
    if "backend" in request.fixturenames:
        request.getfixturevalue("backend").reset()
    yield


# --- gRPC --------------------------------------------------------------------------------------------------------

def grpc_channel(port: int) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())


def generate(port: int, metadata=(), **fields) -> list:
    """All responses of one Generate call."""
    with grpc_channel(port) as channel:
        return list(services.GatewayStub(channel).Generate(messages.GenerateRequest(**fields), metadata=metadata,
                                                           timeout=WAIT_S))


def grpc_error(port: int, **fields) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        generate(port, **fields)
    return info.value


# --- HTTP --------------------------------------------------------------------------------------------------------

def call_http(port: int, method: str, path: str, body=None, headers=None, raw: bytes | None = None):
    """``(status, headers, decoded body)``: JSON decoded when the answer is JSON, else text."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        payload = resp.read()
        kind = resp.getheader("Content-Type", "")
        value = json.loads(payload) if kind.startswith("application/json") else payload.decode()
        return resp.status, resp.headers, value  # case-insensitive, as HTTP header names are
    finally:
        conn.close()


def open_request(port: int, body) -> socket.socket:
    """A raw client socket that has sent a completion request (to be read from, then dropped)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def read_events(sock: socket.socket, count: int) -> bytes:
    """Read from a raw stream until ``count`` server-sent events have started."""
    received = b""
    while received.count(b"data: ") < count:
        data = sock.recv(4096)
        assert data, f"the server closed the stream after {received!r}"
        received += data
    return received


def sse_events(text: str) -> list:
    """The ``data:`` payloads of a server-sent-event stream: parsed JSON, and the literal ``"[DONE]"``."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_for(predicate, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()
