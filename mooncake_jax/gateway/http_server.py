"""OpenAI-compatible HTTP front end on the standard library (``ThreadingHTTPServer``, one thread per connection).

Routes: ``POST /v1/completions`` (JSON, or server-sent events with ``"stream": true``), ``GET /v1/models``,
``GET /v1/models/<id>``, ``GET /metrics`` (Prometheus text), ``GET /health`` (open even with a token).

A streamed answer's status line is sent only once the backend has produced its first token, so a rejection
still becomes a proper 429 (with ``Retry-After``), 400 or 503 rather than an error inside a 200 stream. A client
that goes away is noticed by a watcher thread that waits for the connection's end-of-stream (while the handler
itself waits on the backend), and by a failing write; either sets the request's ``cancelled`` event.
"""

from __future__ import annotations

import json
import logging
import math
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mooncake_jax.gateway import openai_format as oai
from mooncake_jax.proto.auth import bearer_ok
from mooncake_jax.gateway.backend import InvalidRequest, Rejected, Unavailable
from mooncake_jax.gateway.core import GatewayCore, retry_hint_s
from mooncake_jax.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mooncake_jax.gateway.stream import Summary

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


class _HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, **extra):
        super().__init__(message)
        self.status, self.headers, self.extra = status, headers or {}, extra


def _http_error(e: Exception) -> _HttpError:
    """The answer to a failed request: the backend contract's errors by kind, anything else a logged 500."""
    if isinstance(e, InvalidRequest):
        return _HttpError(400, str(e))
    if isinstance(e, Rejected):
        hint = retry_hint_s(e)
        return _HttpError(429, f"{e} (retry after {hint:g} s)", {"Retry-After": str(math.ceil(hint))},
                          retry_after_s=hint)
    if isinstance(e, Unavailable):
        return _HttpError(503, str(e))
    log.error("completion failed", exc_info=e)
    return _HttpError(500, "internal error in the gateway or backend (see its log)")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # listen backlog: a burst of clients (the standard library's 5) must not be reset

    def __init__(self, address, core: GatewayCore, auth_token: str | None, idle_timeout_s: float):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.core, self.auth_token, self.idle_timeout_s = core, auth_token, idle_timeout_s
        self.active: set[threading.Event] = set()  # the cancelled events of requests being served
        self.connections: set[socket.socket] = set()  # open client connections, busy or kept alive
        self.active_lock = threading.Lock()
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "mooncake-jax-gateway"

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout_s  # a silent or stuck client does not hold its thread forever
        super().setup()
        # Headers and body (and each streamed token) are separate small writes: without this, Nagle's algorithm
        # holds the second until the client's delayed ACK, 40 ms per answer.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.active_lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.active_lock:
            self.server.connections.discard(self.connection)
        super().finish()

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)

    # --- routing ---------------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        core = self.server.core
        if path == "/health":
            return self._json(200, {"status": "ok"})
        if not self._authorized():
            return
        if path == "/v1/models":
            return self._json(200, oai.models(core.model_name, core.backend.max_context))
        if path.startswith("/v1/models/"):
            if path[len("/v1/models/"):] == core.model_name:
                return self._json(200, oai.model_card(core.model_name, core.backend.max_context))
            return self._error(404, f"no model {path[len('/v1/models/'):]!r}; this gateway serves {core.model_name!r}")
        if path == "/metrics":
            return self._send(200, core.metrics.render(), METRICS_CONTENT_TYPE)
        self._error(404, f"no route GET {path}")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if not self._authorized():
            return
        if path != "/v1/completions":
            self._drain_body()
            return self._error(404, f"no route POST {path}")
        try:
            self._completions()
        except _HttpError as e:
            self._error(e.status, str(e), e.headers, **e.extra)

    # --- completions -----------------------------------------------------------------------------------------

    def _completions(self) -> None:
        arrival = time.monotonic()
        core = self.server.core
        body = self._read_json()
        parsed: dict = {}

        def parse():
            params, model, stream, include_usage = oai.parse_completion(body)
            core.check_model(model)
            parsed.update(stream=stream, include_usage=include_usage)
            return params

        cancelled = threading.Event()
        with _DisconnectWatch(self.connection, cancelled), _Active(self.server, cancelled):
            try:
                request_id, events = core.generate("http", parse, arrival=arrival, cancelled=cancelled,
                                                   always_text=True)
                first = next(events)  # errors surface before the status line
            except Exception as e:  # noqa: BLE001 - every failure becomes a status; none takes the server down
                raise _http_error(e) from None
            created = int(time.time())
            if parsed["stream"]:
                self._stream(request_id, first, events, created, parsed["include_usage"], cancelled)
            else:
                self._complete(first, events, created)

    def _complete(self, first, events, created: int) -> None:
        pieces, ids = [], []
        try:
            for event in _chain(first, events):
                if isinstance(event, Summary):
                    return self._json(200, oai.completion(self.server.core.model_name, created, "".join(pieces),
                                                          ids, event))
                pieces.append(event.text)
                ids.append(event.token)
        except Exception as e:  # noqa: BLE001 - late (after the first token), still before the status line
            raise _http_error(e) from None
        finally:
            events.close()

    def _stream(self, request_id: str, first, events, created: int, include_usage: bool,
                cancelled: threading.Event) -> None:
        model = self.server.core.model_name
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self._chunked = self.request_version != "HTTP/1.0"  # 1.0 clients read to the end of the connection
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True
        self.end_headers()
        try:
            for event in _chain(first, events):
                if isinstance(event, Summary):
                    self._sse(oai.chunk(event.request_id, model, created, "", [], event))
                    if include_usage:
                        self._sse(oai.usage_chunk(model, created, event))
                else:
                    self._sse(oai.chunk(request_id, model, created, event.text, [event.token]))
        except _GONE:
            cancelled.set()
            self.close_connection = True
            return
        except Exception as e:  # noqa: BLE001 - the status line is gone: report inside the stream
            error = _http_error(e)
            self._try_sse(oai.error(error.status, str(error), **error.extra))
        finally:
            events.close()
        try:
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except _GONE:
            self.close_connection = True

    # --- plumbing --------------------------------------------------------------------------------------------

    def _authorized(self) -> bool:
        if bearer_ok(self.headers.get("Authorization"), self.server.auth_token):
            return True
        self._drain_body()
        self._error(401, "missing or wrong token: send 'Authorization: Bearer <token>'",
                    {"WWW-Authenticate": 'Bearer realm="mooncake-jax"'})
        return False

    def _read_json(self):
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or length is None:
            self.close_connection = True
            raise _HttpError(411, "send the body with a Content-Length")
        try:
            n = int(length)
        except ValueError:
            self.close_connection = True
            raise _HttpError(400, f"bad Content-Length {length!r}") from None
        if not 0 <= n <= MAX_BODY_BYTES:
            self.close_connection = True
            raise _HttpError(413, f"the body is {n} bytes; the limit is {MAX_BODY_BYTES}")
        raw = self.rfile.read(n)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _HttpError(400, f"malformed JSON body: {e}") from None

    def _drain_body(self) -> None:
        """Read (and drop) a request body we will not use, so the connection stays in step for the next one."""
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if 0 <= n <= MAX_BODY_BYTES:
            self.rfile.read(n)
        else:
            self.close_connection = True

    def _json(self, status: int, body, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(body).encode(), "application/json", headers)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None, **extra) -> None:
        self._json(status, oai.error(status, message, **extra), headers)

    def _send(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)
        except _GONE:
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        """One piece of a streamed body (``b""`` ends it)."""
        if self._chunked:
            self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))
        else:
            self.wfile.write(data)
        self.wfile.flush()

    def _sse(self, body: dict) -> None:
        self._chunk(b"data: " + json.dumps(body).encode() + b"\n\n")

    def _try_sse(self, body: dict) -> None:
        try:
            self._sse(body)
        except _GONE:
            self.close_connection = True


def _chain(first, rest):
    yield first
    yield from rest


class _Active:
    """Registers a request's ``cancelled`` event with the server while it is served, so stop can cancel it."""

    def __init__(self, server: _Server, cancelled: threading.Event):
        self._server, self._cancelled = server, cancelled

    def __enter__(self) -> None:
        with self._server.active_lock:
            self._server.active.add(self._cancelled)

    def __exit__(self, *exc) -> None:
        with self._server.active_lock:
            self._server.active.discard(self._cancelled)


class _DisconnectWatch:
    """While a request is served, a thread waits for the client's end-of-stream and sets ``cancelled``.

    HTTP/1.1 clients send nothing more while they wait for an answer, so readable-with-no-bytes means the peer
    closed. Bytes (a pipelined next request) are left unread and end the watch. A socketpair wakes the thread
    when the request is done, so the watch costs no polling and ends at once.
    """

    def __init__(self, conn: socket.socket, cancelled: threading.Event):
        self._conn, self._cancelled = conn, cancelled
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(target=self._watch, name="gw-http-watch", daemon=True)

    def __enter__(self) -> "_DisconnectWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._wake_w.send(b"x")
        self._thread.join()
        self._wake_r.close()
        self._wake_w.close()

    def _watch(self) -> None:
        try:
            readable, _, _ = select.select([self._conn, self._wake_r], [], [])
            if self._conn in readable and self._wake_r not in readable:
                if not self._conn.recv(1, socket.MSG_PEEK):
                    self._cancelled.set()
        except (OSError, ValueError):
            self._cancelled.set()


class HttpFrontEnd:
    """The HTTP server of a gateway, served by a background thread; ``port`` is the one bound."""

    def __init__(self, core: GatewayCore, host: str, port: int, *, auth_token: str | None,
                 idle_timeout_s: float = 60.0):
        self._server = _Server((host, port), core, auth_token, idle_timeout_s)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="gw-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, grace_s: float) -> None:
        """Stop accepting; give requests being served ``grace_s`` to finish, then cancel the rest and close every
        client connection."""
        self._server.shutdown()
        self._thread.join()
        self.close()
        deadline = time.monotonic() + grace_s
        while self._server.active and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._server.active_lock:
            for cancelled in self._server.active:
                cancelled.set()
            for conn in self._server.connections:  # kept-alive ones too: stopped means no more answers
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Release the socket (of a server never started, or after ``stop``)."""
        self._server.server_close()
