"""OpenAI-compatible HTTP front end: Starlette on uvicorn, in a thread of its own with one asyncio event loop.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /v1/models/<id>``, ``GET /metrics`` (Prometheus text),
``GET /health`` (200 only when the backend can serve; open even with a token).

Why Starlette on uvicorn: it is the stack vLLM's and SGLang's OpenAI servers run on (through FastAPI), so its
behaviour under many connections, slow clients and shutdown is well trodden; uvicorn gives an event loop (no
thread per connection, no ``select.select`` and its 1,024-descriptor limit), a connection cap
(its count of open connections backs the cap here: a request arriving on a connection beyond it gets 503 in
OpenAI's error shape and the connection is closed, the connections already served are untouched), keep-alive
expiry, TCP_NODELAY on every connection, and graceful shutdown (stop accepting, close idle connections, wait for
the busy ones); Starlette gives the routing, the disconnect detection of a streamed response (it listens for the
ASGI ``http.disconnect`` beside the stream and cancels it) and the chunked framing of a streamed body. FastAPI
was not taken: its request validation answers 422 in its own shape, where this API answers 400 in OpenAI's, so
its main feature would be worked around; the pydantic request models live in ``openai_format`` instead.
aiohttp would do too; uvicorn's ASGI keeps the app portable to any ASGI server.

What is added here: a deadline for a request's head (uvicorn's keep-alive timer is dropped at the first byte, so
a client sending one header byte per second would hold its connection as long as it liked) and for its body;
the drain deadline (after ``stop``'s grace, streams still open end with an error event and ``data: [DONE]``
instead of being cut, plain requests get 503).

The backend's ``generate`` is a blocking iterator. Each generation runs on a thread of a bounded pool (a
running generation holds one; an idle connection holds none) that reads the iterator to its end and hands each
event to the event loop. A streamed answer's status line is sent only once the first token exists, so a
rejection still becomes a proper 429 (with ``Retry-After``), 400 or 503 rather than an error inside a 200 stream.
A client that goes away sets the request's ``cancelled`` event (the backend stops and frees its KV).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from mooncake_jax.gateway import openai_format as oai
from mooncake_jax.gateway.backend import DuplicateRequest, InvalidRequest, Rejected, Unavailable
from mooncake_jax.gateway.core import GatewayCore, retry_hint_s
from mooncake_jax.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mooncake_jax.gateway.stream import Summary
from mooncake_jax.gateway.token_feed import FeedReceiver
from mooncake_jax.proto.auth import bearer_ok
from mooncake_jax.proto import tls

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_JSON_DEPTH = 64
_SHUTTING_DOWN = "the server is shutting down"
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class _HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, **extra):
        super().__init__(message)
        self.status, self.headers, self.extra = status, headers or {}, extra


def _http_error(e: Exception) -> _HttpError:
    """The answer to a failed request: the backend contract's errors by kind, anything else a logged 500."""
    if isinstance(e, _HttpError):
        return e
    if isinstance(e, DuplicateRequest):
        return _HttpError(409, str(e))
    if isinstance(e, InvalidRequest):
        return _HttpError(400, str(e))
    if isinstance(e, Rejected):
        hint = retry_hint_s(e)
        return _HttpError(429, f"{e} (retry after {hint:g} s)", {"Retry-After": str(math.ceil(hint))},
                          retry_after_s=hint, stage=e.stage, cause=e.cause)
    if isinstance(e, Unavailable):
        return _HttpError(503, str(e))
    log.error("completion failed", exc_info=e)
    return _HttpError(500, "internal error in the gateway or backend (see its log)")


def _error_response(status: int, message: str, headers: dict[str, str] | None = None, **extra) -> JSONResponse:
    return JSONResponse(oai.error(status, message, **extra), status_code=status, headers=headers)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running on this thread, or None."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _sse(body) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class _End:
    """The pump's last item: the backend stream has been read to its end."""


_DRAIN = object()  # put in a request's queue when stop's grace is over (``_Gateway.drain``)


class _Started:
    def __init__(self, request_id: str):
        self.request_id = request_id


# --- the connection protocol: uvicorn's h11, with deadlines for a request's head ---------------------------------

def _protocol(idle_timeout_s: float, header_timeout_s: float):
    """uvicorn's h11 protocol with two deadlines while no request is being served: ``idle_timeout_s`` for the first
    byte of the next request (from the connection's start or the previous answer), then ``header_timeout_s`` for
    the rest of its head. A connection that misses one is closed."""

    class DeadlineH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:  # headers and body are separate writes: Nagle would hold the second ~40 ms
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._deadline = None
            self._awaiting_head = False
            self._arm(idle_timeout_s)

        def _arm(self, seconds: float | None) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(seconds, self._expire) if seconds is not None else None

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            if self._idle() and not self._awaiting_head:
                self._awaiting_head = True
                self._arm(header_timeout_s)
            super().data_received(data)
            if not self._idle():
                self._awaiting_head = False
                self._arm(None)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._idle() and not self.transport.is_closing():
                self._awaiting_head = False
                self._arm(idle_timeout_s)

        def connection_lost(self, exc) -> None:
            self._arm(None)
            super().connection_lost(exc)

        def _expire(self) -> None:
            self._deadline = None
            if self._idle() and not self.transport.is_closing():
                self.transport.close()

    return DeadlineH11Protocol


# --- the application ---------------------------------------------------------------------------------------------

class _Gateway:
    """The routes, over one ``GatewayCore``; lives on the server's event loop."""

    def __init__(self, core: GatewayCore, auth_token: str | None, pool: ThreadPoolExecutor,
                 body_timeout_s: float, chat_template):
        self.core, self.auth_token, self.pool = core, auth_token, pool
        self.body_timeout_s = body_timeout_s
        self.chat_template = chat_template
        self.draining: asyncio.Event | None = None  # set when stop's grace is over (made on the loop)
        self.feed: FeedReceiver | None = None  # decode instances' tokens straight to this loop (token_feed.py)
        # the requests being served: each choice's cancelled event and the queue its pump fills
        self.active: dict[threading.Event, asyncio.Queue] = {}
        self.lock = threading.Lock()
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{name:path}", self.model, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ], exception_handlers={HTTPException: self._http_exception, Exception: self._crash})

    # --- plumbing ----------------------------------------------------------------------------------------------

    @staticmethod
    async def _http_exception(request: Request, exc: HTTPException) -> Response:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        return _error_response(exc.status_code, message, dict(exc.headers or {}))

    @staticmethod
    async def _crash(request: Request, exc: Exception) -> Response:
        log.error("HTTP request failed", exc_info=exc)
        return _error_response(500, "internal error in the gateway (see its log)")

    def _refused(self, request: Request) -> Response | None:
        if bearer_ok(request.headers.get("authorization"), self.auth_token):
            return None
        return _error_response(401, "missing or wrong token: send 'Authorization: Bearer <token>'",
                               {"WWW-Authenticate": 'Bearer realm="mooncake-jax"'})

    async def _json_body(self, request: Request):
        length = request.headers.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                raise _HttpError(400, f"bad Content-Length {length!r}") from None
            if not 0 <= n <= MAX_BODY_BYTES:
                raise _HttpError(413, f"the body is {n} bytes; the limit is {MAX_BODY_BYTES}")

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise _HttpError(413, f"the body is over the limit of {MAX_BODY_BYTES} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            raw = await asyncio.wait_for(read(), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise _HttpError(408, f"the body did not arrive within {self.body_timeout_s:g} s") from None
        # a large body is parsed off the event loop, which must keep streaming everyone else's tokens
        return await run_in_threadpool(_parse_json, raw) if len(raw) > 1 << 20 else _parse_json(raw)

    # --- simple routes -----------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.draining is not None and self.draining.is_set():
            return _error_response(503, _SHUTTING_DOWN)
        problem = await run_in_threadpool(self.core.health)
        if problem is not None:
            return _error_response(503, f"cannot serve: {problem}")
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        return JSONResponse(oai.models(self.core.model_name, self.core.backend.max_context))

    async def model(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        name = request.path_params["name"]
        if name != self.core.model_name:
            return _error_response(404, f"no model {name!r}; this gateway serves {self.core.model_name!r}")
        return JSONResponse(oai.model_card(self.core.model_name, self.core.backend.max_context))

    async def metrics(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        text = await run_in_threadpool(self.core.metrics.render)  # backend.stats() may call other processes
        return Response(text, media_type=METRICS_CONTENT_TYPE)

    # --- generation --------------------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, oai.parse_completion, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, lambda body: oai.parse_chat(body, self.chat_template), chat=True)

    async def _generate(self, request: Request, parse_body, chat: bool) -> Response:
        arrival = time.monotonic()
        if (refused := self._refused(request)) is not None:
            return refused
        try:
            given_id = _request_id_header(request)
            body = await self._json_body(request)
            parsed: oai.Parsed = await run_in_threadpool(parse_body, body)  # a chat template may take a while
            self.core.check_model(parsed.model)
        except ClientDisconnect:
            return Response(status_code=400)
        except Exception as e:  # noqa: BLE001 - a bad request is a status
            error = _http_error(e)
            return _error_response(error.status, str(error), error.headers, **error.extra)
        loop = asyncio.get_running_loop()
        if given_id is not None:  # the caller's id names the request (and, with several choices, each of them)
            ids = [given_id] if len(parsed.choices) == 1 else [f"{given_id}-{i}" for i in range(len(parsed.choices))]
            parsed.choices = [dataclasses.replace(p, request_id=i) for p, i in zip(parsed.choices, ids)]
        runs = [_Run(asyncio.Queue(), threading.Event()) for _ in parsed.choices]
        with self.lock:
            self.active.update((run.cancelled, run.queue) for run in runs)
        watch = asyncio.create_task(_watch_disconnect(request, [run.cancelled for run in runs]))
        handed_over = False
        try:
            for run, params in zip(runs, parsed.choices):
                try:
                    self.pool.submit(self._pump, loop, run.queue, lambda params=params: params, arrival,
                                     run.cancelled)
                except RuntimeError:  # the pool has shut down: the server is stopping
                    raise Unavailable(_SHUTTING_DOWN) from None
            starts = [await self._next(run.queue, run.cancelled) for run in runs]
            firsts = [await self._next(run.queue, run.cancelled) for run in runs]
            request_id, created = starts[0].request_id, int(time.time())
            if parsed.stream:
                watch.cancel()
                response = _StreamOf(self._stream(request_id, parsed, runs, firsts, created, chat),
                                     lambda: [self._done(run.cancelled) for run in runs],
                                     headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                              REQUEST_ID_HEADER: given_id or request_id})
                handed_over = True  # the response unregisters the requests when it ends
                return response
            choices, summaries = [], []
            for i, (run, event) in enumerate(zip(runs, firsts)):
                events = []
                while not isinstance(event, Summary):
                    events.append(event)
                    event = await self._next(run.queue, run.cancelled)
                summaries.append(event)
                choices.append(self._choice(parsed, i, events, event, chat))
            answer = (oai.chat_completion if chat else oai.completion)(
                self.core.model_name, created, request_id, choices, summaries, parsed.n, parsed.echo_only)
            return JSONResponse(answer, headers={REQUEST_ID_HEADER: given_id or request_id})
        except Exception as e:  # noqa: BLE001 - every failure becomes a status; none takes the server down
            error = _http_error(e)
            headers = error.headers | ({REQUEST_ID_HEADER: given_id} if given_id else {})
            return _error_response(error.status, str(error), headers, **error.extra)
        finally:
            watch.cancel()
            if not handed_over:
                for run in runs:
                    self._done(run.cancelled)

    def _token_text(self, token: int) -> str:
        """A token's text for logprobs; one that decodes to nothing alone (a byte of a longer character, a
        special token) is named ``token_id:<id>`` as vLLM's ``return_tokens_as_token_ids`` does."""
        return self.core.tokenizer.decode([token]) or f"token_id:{token}"

    def _prompt_part(self, parsed: oai.Parsed, index: int, first, summary: Summary | None) -> tuple[str, dict | None]:
        """(prompt text, prompt logprobs) that ``echo`` puts before choice ``index``'s completion."""
        text = parsed.prompt_texts[index // parsed.n]
        prompt_ids = summary.prompt_ids if summary is not None else None
        entries = getattr(first, "prompt_logprobs", None)
        if text is None:
            ids = prompt_ids if prompt_ids is not None else parsed.choices[index].prompt_ids
            text = self.core.tokenizer.decode(ids)
        if parsed.logprobs is None:
            return text, None
        ids = prompt_ids if prompt_ids is not None else parsed.choices[index].prompt_ids
        if ids is None:
            ids = self.core.tokenizer.encode(text)
        return text, oai.completion_logprobs(self._token_text, ids, [None] + list(entries or ()))

    def _choice(self, parsed: oai.Parsed, index: int, events: list, summary: Summary, chat: bool) -> oai.Choice:
        """Choice ``index`` of a non-streamed answer from its token events."""
        first = events[0] if events else None
        if parsed.echo_only:
            events = []
        ids = [e.token for e in events]
        text = "".join(e.text for e in events)
        logprobs = None
        if parsed.logprobs is not None:
            entries = [e.logprob for e in events]
            if chat:
                logprobs = oai.chat_logprobs(self._token_text, ids, entries)
            else:
                logprobs = oai.completion_logprobs(self._token_text, ids, entries)
        if parsed.echo:
            prompt_text, prompt_logprobs = self._prompt_part(parsed, index, first, summary)
            if prompt_logprobs is not None:
                offset = sum(len(t) for t in prompt_logprobs["tokens"])  # the offsets run on over the prompt's
                for key in ("tokens", "token_logprobs", "top_logprobs"):
                    prompt_logprobs[key] += logprobs[key]
                prompt_logprobs["text_offset"] += [offset + o for o in logprobs["text_offset"]]
                logprobs = prompt_logprobs
            text = prompt_text + text
        return oai.Choice(index, text, ids, logprobs, summary.reason)

    def _done(self, cancelled: threading.Event) -> None:
        cancelled.set()  # a no-op for a request that has ended; stops one that has not
        with self.lock:
            self.active.pop(cancelled, None)

    def drain(self) -> None:
        """On the loop, when stop's grace is over: every request still being served reads ``_DRAIN`` next.

        The deadline reaches a waiting request through its own queue, so waiting for a token is one plain
        ``queue.get`` (no race of two futures per token: each of their loop turns delays every stream)."""
        self.draining.set()
        with self.lock:
            queues = list(self.active.values())
        for queue in queues:
            queue.put_nowait(_DRAIN)

    async def _next(self, queue: asyncio.Queue, cancelled: threading.Event):
        """The pump's next item (raised if it is an error); after the drain deadline, Unavailable."""
        if self.draining is None or self.draining.is_set():
            raise Unavailable(_SHUTTING_DOWN)
        item = queue.get_nowait() if not queue.empty() else await queue.get()
        if item is _DRAIN:
            cancelled.set()
            raise Unavailable(_SHUTTING_DOWN)
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, _End):
            raise Unavailable("the backend's stream ended without a final message")
        return item

    def _pump(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, parse, arrival: float,
              cancelled: threading.Event) -> None:
        """On a pool thread: validate, run the generation and hand every event to the loop, reading the backend's
        stream to its end even when nobody listens any more (so its abort path frees the KV)."""

        def put(item) -> None:
            try:
                if _running_loop() is loop:  # a token feed's event, on the loop itself: no wake-up to write
                    loop.call_soon(queue.put_nowait, item)  # the same ready queue: the order of events is kept
                else:
                    loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop has closed (server stopped): nobody is listening
                cancelled.set()

        try:
            request_id, events = self.core.generate("http", parse, arrival=arrival, cancelled=cancelled,
                                                    always_text=True, feed=self.feed, emit=put)
            put(_Started(request_id))
            for event in events:
                put(event)
        except Exception as e:  # noqa: BLE001 - handed to the request's coroutine, which maps it to a status
            put(e)
        put(_End())

    async def _stream(self, request_id: str, parsed: oai.Parsed, runs: list, firsts: list, created: int,
                      chat: bool):
        """The choices' events as server-sent chunks, in the order they come (each chunk names its choice)."""
        model = self.core.model_name
        chunk = oai.chat_chunk if chat else oai.chunk
        next_event, tasks = self._choice_events(runs, firsts)
        summaries: list = [None] * len(runs)
        offsets = [0] * len(runs)
        try:
            for i, first in enumerate(firsts):
                if chat:
                    yield _sse(oai.chat_chunk(request_id, model, created, oai.Choice(i, "", []), first=True))
                elif parsed.echo:
                    text, logprobs = self._prompt_part(parsed, i, first, None)
                    offsets[i] = len(text)
                    yield _sse(chunk(request_id, model, created, oai.Choice(i, text, [], logprobs)))
            remaining = len(runs)
            while remaining:
                i, event = await next_event()
                if isinstance(event, Summary):
                    summaries[i] = event
                    remaining -= 1
                    yield _sse(chunk(request_id, model, created, oai.Choice(i, "", [], None, event.reason), event))
                    continue
                if parsed.echo_only:
                    continue
                logprobs = None
                if parsed.logprobs is not None:
                    if chat:
                        logprobs = oai.chat_logprobs(self._token_text, [event.token], [event.logprob])
                    else:
                        logprobs = oai.completion_logprobs(self._token_text, [event.token], [event.logprob],
                                                           offsets[i])
                offsets[i] += len(event.text)
                yield _sse(chunk(request_id, model, created, oai.Choice(i, event.text, [event.token], logprobs)))
            if parsed.include_usage:
                yield _sse((oai.chat_usage_chunk if chat else oai.usage_chunk)(
                    request_id, model, created, summaries, parsed.n, parsed.echo_only))
        except Exception as e:  # noqa: BLE001 - the status line is gone: report inside the stream
            error = _http_error(e)
            yield _sse(oai.error(error.status, str(error), **error.extra))
        finally:
            for task in tasks:
                task.cancel()
        yield _DONE

    def _choice_events(self, runs: list, firsts: list):
        """``(next_event, tasks)``: ``await next_event()`` is the next ``(choice index, event)`` of any choice
        (raising a choice's error), ``tasks`` what to cancel at the end. One choice (the usual request) reads its
        queue directly; several are merged by a task each, in the order their events come."""
        if len(runs) == 1:
            run, pending = runs[0], [firsts[0]]

            async def next_one():
                return 0, pending.pop() if pending else await self._next(run.queue, run.cancelled)

            return next_one, []
        merged: asyncio.Queue = asyncio.Queue()

        async def forward(i: int, run, event) -> None:
            try:
                while True:
                    await merged.put((i, event))
                    if isinstance(event, Summary):
                        return
                    event = await self._next(run.queue, run.cancelled)
            except Exception as e:  # noqa: BLE001 - handed to the stream, which reports it
                await merged.put((i, e))

        async def next_merged():
            i, event = await merged.get()
            if isinstance(event, Exception):
                raise event
            return i, event

        return next_merged, [asyncio.create_task(forward(i, run, first))
                             for i, (run, first) in enumerate(zip(runs, firsts))]


class _StreamOf(StreamingResponse):
    """A streamed answer that calls ``on_end`` however it ends: finished, failed, or its client gone, also before
    the body's first chunk (a body generator that never started never runs its own ``finally``)."""

    def __init__(self, body, on_end: Callable[[], object], **kwargs):
        super().__init__(body, **kwargs)
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


@dataclasses.dataclass
class _Run:
    """One choice being generated: the queue its pump fills and the event that stops it."""

    queue: asyncio.Queue
    cancelled: threading.Event


async def _watch_disconnect(request: Request, cancelled: list[threading.Event]) -> None:
    """Until cancelled: the client's ``http.disconnect`` (the connection closed) sets every ``cancelled``."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for event in cancelled:
                event.set()
            return


def _request_id_header(request: Request) -> str | None:
    """The client's ``X-Request-Id`` (used as the request's id, echoed on the answer), checked: 1-128 characters of
    letters, digits and ``._:-``."""
    value = request.headers.get(REQUEST_ID_HEADER)
    if value is None:
        return None
    if not _REQUEST_ID.fullmatch(value):
        raise _HttpError(400, f"bad {REQUEST_ID_HEADER} header: use 1-128 characters of letters, digits and ._:-")
    return value


def _parse_json(raw: bytes):
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _HttpError(400, f"the JSON body is nested too deeply (the limit is {MAX_JSON_DEPTH})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise _HttpError(400, f"malformed JSON body: {e}") from None
    if _depth_over(body, MAX_JSON_DEPTH):
        raise _HttpError(400, f"the JSON body is nested too deeply (the limit is {MAX_JSON_DEPTH})")
    return body


def _capped(app, open_connections, limit: int):
    """``app`` behind the connection cap: a request on a connection beyond ``limit`` gets 503 (OpenAI's error
    shape, ``Retry-After``) and its connection is closed."""

    async def capped(scope, receive, send):
        if scope["type"] == "http" and open_connections() > limit:
            response = _error_response(503, f"too many open connections (the limit is {limit}); retry later",
                                       {"Retry-After": "1", "Connection": "close"})
            return await response(scope, receive, send)
        return await app(scope, receive, send)

    return capped


def _depth_over(value, limit: int) -> bool:
    """Whether a parsed JSON value nests containers deeper than ``limit`` (iterative: no recursion to overflow)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if not isinstance(item, (list, dict)):  # a scalar body (``1.5``) nests nothing
            continue
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return False


def _loop_factory():
    """uvloop's event loop where it is installed (orbax-checkpoint requires it; not on Windows), else asyncio's.

    Each streamed token costs the loop a wake-up from the generation thread, a task step and a socket write; on
    uvloop those run in C (measured with ``benchmarks/gateway_stream.py``)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class HttpFrontEnd:
    """The HTTP server of a gateway, served by a background thread; ``port`` is the one bound (at construction)."""

    def __init__(self, core: GatewayCore, host: str, port: int, *, auth_token: str | None,
                 idle_timeout_s: float = 60.0, header_timeout_s: float = 10.0, body_timeout_s: float = 30.0,
                 max_connections: int = 4096, generation_threads: int = 256, chat_template=None,
                 cors_origins: tuple[str, ...] = (), token_feed: bool = False):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # proto IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so (accepted ones inherit it)
        self._sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(2048)
        except OSError:
            self._sock.close()
            raise
        self.port = self._sock.getsockname()[1]
        self._pool = ThreadPoolExecutor(max_workers=generation_threads, thread_name_prefix="gw-http-gen")
        self._gateway = _Gateway(core, auth_token, self._pool, body_timeout_s, chat_template)
        if token_feed:  # on this host's address: the decode instances send to it (off with TLS: see token_feed.py)
            try:
                self._gateway.feed = FeedReceiver(host if host not in ("0.0.0.0", "::", "") else "127.0.0.1")
            except OSError:
                self._sock.close()
                raise
        app = self._gateway.app
        if cors_origins:  # browsers on these origins may call the API (preflights answered, headers exposed)
            app = CORSMiddleware(app, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                 allow_headers=["Authorization", "Content-Type", REQUEST_ID_HEADER],
                                 expose_headers=[REQUEST_ID_HEADER, "Retry-After"])
        config = uvicorn.Config(_capped(app, lambda: len(self._server.server_state.connections), max_connections),
                                http=_protocol(idle_timeout_s, header_timeout_s), lifespan="off", log_config=None,
                                access_log=False, server_header=False, timeout_keep_alive=max(1, int(idle_timeout_s)),
                                timeout_graceful_shutdown=None, backlog=2048, **tls.http_ssl_files())
        self._server = uvicorn.Server(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, name="gw-http", daemon=True)
        self._ready = threading.Event()

    def _serve(self) -> None:
        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._gateway.draining = asyncio.Event()
            if self._gateway.feed is not None:
                self._gateway.feed.attach(self._loop)
            self._ready.set()
            await self._server.serve(sockets=[self._sock])

        try:
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(serve())
        finally:
            self._ready.set()

    @property
    def feed(self) -> FeedReceiver | None:
        """The token feed this front end's streams take tokens from, or None where it is off."""
        return self._gateway.feed

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()

    def stop(self, grace_s: float) -> None:
        """Stop accepting and close idle connections; give requests being served ``grace_s`` to finish, then end
        open streams with an error event and ``[DONE]`` (plain requests: 503) and cancel their generations."""
        loop = self._loop
        if loop is not None and self._thread.is_alive():
            def begin() -> None:
                loop.call_later(max(0.0, grace_s), self._gateway.drain)

            self._server.config.timeout_graceful_shutdown = max(1, math.ceil(grace_s) + 5)
            loop.call_soon_threadsafe(begin)
            self._server.should_exit = True
            self._thread.join(grace_s + 15)
        with self._gateway.lock:
            for cancelled in self._gateway.active:
                cancelled.set()
        self._pool.shutdown(wait=False)
        self.close()

    def close(self) -> None:
        """Release the socket (of a server never started, or after ``stop``)."""
        self._sock.close()
        if self._gateway.feed is not None:
            self._gateway.feed.close()
