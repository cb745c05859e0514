"""``GatewayServer``: both front ends over one backend, started and stopped together."""

from __future__ import annotations

import logging
from pathlib import Path

from mooncake_jax.gateway.auth import check_exposure
from mooncake_jax.gateway.backend import Backend
from mooncake_jax.gateway.chat import load_chat_template
from mooncake_jax.gateway.core import GatewayCore, default_model_name
from mooncake_jax.gateway.grpc_server import GrpcFrontEnd
from mooncake_jax.gateway.http_server import HttpFrontEnd
from mooncake_jax.gateway.metrics import GatewayMetrics
from mooncake_jax.gateway.tokenizer import Tokenizer, tokenizer_for
from mooncake_jax.proto import tls

log = logging.getLogger(__name__)


class GatewayServer:
    """The client-facing gateway: gRPC ``mooncake.v1.Gateway`` on ``grpc_port`` and OpenAI-compatible HTTP on
    ``http_port`` (0: a free port, see ``.grpc_port`` / ``.http_port`` after construction; None: that front end
    is not started). ``model_name``: the model id clients see and name (default: the preset's name, or the
model folder's name, not its path).

    ``tokenizer``: a ``Tokenizer``, a path to a folder with (or to a) tokenizer.json, "bytes", or None for the
    one of ``backend.model_name`` (its tokenizer.json when it names a folder, which must have one; bytes for a
    preset). ``chat_template``: a Jinja file for /v1/chat/completions instead of the model's own. ``auth_token``:
    if given, every call but health checks must carry ``Bearer <token>``; without one the gateway refuses a
    non-loopback ``host`` unless ``allow_unauthenticated``.

    HTTP limits: at most ``http_max_connections`` open connections (requests beyond get 503), a connection
    waits at most ``http_idle_timeout_s`` for its next request and ``http_header_timeout_s`` for the rest of a
    request's head once it has begun, a body must arrive within ``http_body_timeout_s``; at most
    ``http_generation_threads`` generations run at once (more wait for a thread). ``drain_grace_s``: what
    ``stop()`` gives open requests to finish when not told otherwise. ``cors_origins``: browser origins allowed
    to call the HTTP API (none by default). A client's ``X-Request-Id`` header becomes the request's id and every
    answer echoes the id; an id already in flight gets 409 / ALREADY_EXISTS. ``token_feed``: HTTP streams of a
    backend that takes it (``ClusterBackend``) get their tokens straight from the decode instances too, over UDP to
    the HTTP server's event loop (``token_feed.py``); ignored with an ``auth_token`` or TLS, where a datagram's
    request id would be no credential.
    """

    def __init__(self, backend: Backend, *, host: str = "127.0.0.1", grpc_port: int | None = 0,
                 http_port: int | None = 0, auth_token: str | None = None, model_name: str | None = None,
                 tokenizer: Tokenizer | str | Path | None = None, chat_template: str | Path | None = None,
                 allow_unauthenticated: bool = False, grpc_workers: int = 128, http_idle_timeout_s: float = 60.0,
                 http_header_timeout_s: float = 10.0, http_body_timeout_s: float = 30.0,
                 http_max_connections: int = 4096, http_generation_threads: int = 256, drain_grace_s: float = 1.0,
                 cors_origins: tuple[str, ...] = (), token_feed: bool = False):
        check_exposure(host, auth_token, allow_unauthenticated)
        if tokenizer is None or isinstance(tokenizer, (str, Path)):
            tokenizer = tokenizer_for(backend.model_name, backend.vocab_size,
                                      None if tokenizer is None else str(tokenizer))
        template = load_chat_template(tokenizer, chat_template)
        self.backend = backend
        self.metrics = GatewayMetrics(backend.stats)
        self.core = GatewayCore(backend, tokenizer, model_name or default_model_name(backend.model_name), self.metrics)
        self.host = host
        self.drain_grace_s = drain_grace_s
        self._grpc = self._http = None
        self._started = self._stopped = False
        try:
            if grpc_port is not None:
                self._grpc = GrpcFrontEnd(self.core, host, grpc_port, auth_token=auth_token, max_workers=grpc_workers)
            if http_port is not None:
                self._http = HttpFrontEnd(self.core, host, http_port, auth_token=auth_token,
                                          idle_timeout_s=http_idle_timeout_s, header_timeout_s=http_header_timeout_s,
                                          body_timeout_s=http_body_timeout_s, max_connections=http_max_connections,
                                          generation_threads=http_generation_threads, chat_template=template,
                                          cors_origins=tuple(cors_origins),
                                          token_feed=token_feed and auth_token is None and tls.files() is None
                                          and getattr(backend, "accepts_token_feed", False))
        except BaseException:
            if self._grpc is not None:
                self._grpc.stop(0).wait()
            raise

    @property
    def token_feed(self):
        """The HTTP front end's ``token_feed.FeedReceiver``, or None where it is off."""
        return self._http.feed if self._http is not None else None

    @property
    def grpc_port(self) -> int | None:
        return self._grpc.port if self._grpc is not None else None

    @property
    def http_port(self) -> int | None:
        return self._http.port if self._http is not None else None

    @property
    def model_name(self) -> str:
        return self.core.model_name

    def start(self) -> "GatewayServer":
        if not self._started:
            self._started = True
            if self._grpc is not None:
                self._grpc.start()
                log.info("gateway gRPC listening on %s:%d", self.host, self.grpc_port)
            if self._http is not None:
                self._http.start()
                log.info("gateway HTTP listening on http://%s:%d", self.host, self.http_port)
        return self

    def stop(self, grace_s: float | None = None) -> None:
        """Stop both front ends; streams still open after ``grace_s`` (default ``drain_grace_s``) are cancelled
        (their backends told; an SSE stream gets an error event and ``[DONE]``, a gRPC stream a status)."""
        if self._stopped:
            return
        grace_s = self.drain_grace_s if grace_s is None else grace_s
        self._stopped = True
        grpc_done = self._grpc.stop(grace_s) if self._grpc is not None else None
        if self._http is not None and self._started:
            self._http.stop(grace_s)
        elif self._http is not None:
            self._http.close()
        if grpc_done is not None:
            grpc_done.wait()

    def __enter__(self) -> "GatewayServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
