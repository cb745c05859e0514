"""One request's trip through the backend, as both front ends see it: timing, text, stop strings, metrics.

``run`` turns the backend's ``TokenOut``/``Finished`` items into ``TokenEvent``s and one closing ``Summary``.
Text is released only when it can no longer change: an unfinished UTF-8 character, or a tail that may be the
start of a stop string, waits for the next token. To keep every piece of text inside a token event, the one token
whose text is held back is itself held (never more than one, and only while its text is undecided); all other
tokens go out the moment they arrive. A stop string ends the request: the text stops before it, the backend is
told through the ``cancelled`` event and its remaining items are drained for the cached-token count. A request
that ends any other early way (client gone, error) sets ``cancelled`` too, and its backend stream is read to its
end on a background thread rather than closed, so the backend's own abort path (which frees the KV) runs.

With a token feed (``token_feed.py``, HTTP streams over a cluster) a request's tokens may also come straight from
its decode instance, on the HTTP server's event loop; a ``TokenMerge`` then takes each token once, in order, from
whichever way brings it first, and hands the events to the caller's ``emit``.

Times are measured at the gateway from the request's arrival there, so TTFT and TBT include what a client
waits for (tokenization, scheduling, queueing, transfers).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

from mooncake_jax.gateway.backend import (FINISH_ABORT, FINISH_STOP, Backend, Finished, InvalidRequest,
                                          Rejected, TokenOut, Unavailable, paper_tbt)
from mooncake_jax.gateway.metrics import GatewayMetrics
from mooncake_jax.gateway.tokenizer import Tokenizer
from mooncake_jax.gateway.validate import Prepared

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TokenEvent:
    token: int
    index: int
    time_s: float  # since arrival at the gateway
    text: str = ""
    logprob: tuple | None = None  # backend.Logprob, with request.logprobs
    prompt_logprobs: list | None = None  # on the first event, with request.prompt_logprobs


@dataclasses.dataclass
class Summary:
    reason: str  # backend.FINISH_*
    ttft_s: float
    tbt_s: float
    total_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    request_id: str
    prompt_ids: list[int] = dataclasses.field(default_factory=list)


class StopMatcher:
    """Finds the first stop string in streamed text, releasing only text that cannot be the start of one."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops = stops
        self._held = ""

    @property
    def pending(self) -> bool:
        return bool(self._held)

    def feed(self, text: str) -> tuple[str, bool]:
        """``(released text, stopped)``; after a stop the released text ends where the stop string began."""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        keep = max((k for s in self._stops for k in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:k])), default=0)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class _Text:
    """Detokenizer followed by the stop matcher."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]):
        self._detok = tokenizer.detokenizer()
        self._stops = StopMatcher(stops)

    @property
    def pending(self) -> bool:
        return self._detok.pending or self._stops.pending

    def add(self, token: int) -> tuple[str, bool]:
        return self._stops.feed(self._detok.add(token))

    def flush(self) -> str:
        text, stopped = self._stops.feed(self._detok.flush())
        return text if stopped else text + self._stops.flush()


def run(backend: Backend, prepared: Prepared, tokenizer: Tokenizer, *, arrival: float,
        cancelled: threading.Event, metrics: GatewayMetrics, api: str, want_text: bool,
        clock: Callable[[], float] = time.monotonic, feed=None,
        emit: Callable[[TokenEvent], object] | None = None) -> Iterator[TokenEvent | Summary]:
    """Stream one request; token events carry text when ``want_text``. Raises what the backend raises
    (``Rejected``, ``Unavailable``, ``InvalidRequest``) after counting it. If the consumer stops early (the
    client went away), ``cancelled`` is set so the backend frees the request's KV.

    With a ``feed`` (``token_feed.FeedReceiver``) and ``emit``, the request's tokens may also come straight from
    its decode instance: token events then go to ``emit`` (called in order, from whichever thread brought the
    token: keep it short and thread-safe) and only the ``Summary`` is yielded. Requests with logprobs keep the
    backend's stream alone. Whether the backend takes a feed at all (``accepts_token_feed``) is the caller's to
    know: ``GatewayServer`` makes one only then."""
    request = prepared.request
    text = _Text(tokenizer, prepared.stop) if want_text or prepared.stop else None
    times: list[float] = []
    outcome, summary, items = "error", None, None
    metrics.started()

    def record() -> None:
        done = summary is not None
        metrics.ended(decoding=bool(times))
        metrics.finished(api, outcome, ttft_s=times[0] if times else None,
                         tbt_s=summary.tbt_s if done and len(times) > 1 else None,
                         token_gaps_s=[b - a for a, b in zip(times, times[1:])],
                         e2e_s=summary.total_s if done else None,
                         prompt_tokens=len(request.prompt) if done else 0,
                         cached_tokens=summary.cached_tokens if done else 0, output_tokens=len(times))

    def elapsed() -> float:
        if not times:
            metrics.first_token()
        return clock() - arrival

    try:
        flow = TokenFlow(text, want_text, times, cancelled, elapsed)
        merge = None
        if feed is not None and emit is not None and request.logprobs is None and request.prompt_logprobs is None:
            merge = TokenMerge(flow, emit)
            request.token_feed = feed.address
            feed.register(request.request_id, merge.offer)
        try:
            items = iter(backend.generate(request, cancelled))
            finished = yield from _tokens(items, merge or flow)
        finally:
            if merge is not None:
                feed.unregister(request.request_id)
        stopped = flow.stopped
        total = clock() - arrival
        summary = Summary(FINISH_STOP if stopped else finished.reason, times[0] if times else total,
                          paper_tbt(times), total, len(request.prompt), len(times), finished.cached_tokens,
                          request.request_id, list(request.prompt))
        outcome = "cancelled" if summary.reason == FINISH_ABORT and cancelled.is_set() else summary.reason
    except GeneratorExit:
        outcome = "cancelled"
        raise
    except Rejected as e:
        outcome = "rejected"
        metrics.rejections.labels(e.stage).inc()
        raise
    except Unavailable:
        outcome = "unavailable"
        raise
    except InvalidRequest:
        outcome = "invalid"
        raise
    finally:
        if summary is None:
            cancelled.set()  # ended early, whatever the reason: let the backend free the KV
            if items is not None:
                _drain(items)
        record()  # before the summary goes out, so a client that reads it sees its request counted
    yield summary


def _drain(items: Iterator) -> None:
    """Read a cancelled backend stream to its end on a thread of its own. Not ``close()``: a backend may free the
    request's KV on its way to ``Finished(FINISH_ABORT)``, and a close would skip that path."""

    if getattr(items, "gi_frame", True) is None:
        return  # a generator that has already ended (it raised): nothing to read

    def drain() -> None:
        try:
            for _ in items:
                pass
        except Exception:  # noqa: BLE001 - the request is over; its backend's failure only matters in the log
            log.debug("cancelled stream ended with an error", exc_info=True)

    threading.Thread(target=drain, name="gw-drain", daemon=True).start()


def _tokens(items, flow):
    """Feed the backend's tokens to ``flow`` (a ``TokenFlow``, or a ``TokenMerge`` that emits them itself),
    yielding the events it returns; return the ``Finished``."""
    for item in items:
        if isinstance(item, Finished):
            yield from flow.finish()
            return item
        if isinstance(item, TokenOut):
            yield from flow.add(item)
    raise Unavailable("the backend's stream ended without a final message")


class TokenFlow:
    """One request's generated tokens turned into token events, one token at a time: its times, its text and stop
    strings. An object, not a loop over the backend's stream: tokens are handed to it one at a time, as they
    arrive, so that a second way for them to arrive (a decode instance's token feed, ``token_feed.py``) feeds the
    same state through a ``TokenMerge``.

    Without ``want_text`` the text is only followed for stop strings, and the events carry none. The one token
    whose text is undecided (the start of a UTF-8 character or of a stop string) is held until the next one
    decides it; every other token's event is returned by the ``add`` that brought it. After a stop string
    (``stopped``) tokens are ignored and ``cancelled`` is set, so the backend ends the request."""

    def __init__(self, text: _Text | None, want_text: bool, times: list[float], cancelled: threading.Event,
                 elapsed: Callable[[], float]):
        self._text, self._want_text, self._times = text, want_text, times
        self._cancelled, self._elapsed = cancelled, elapsed
        self._held: TokenEvent | None = None
        self.stopped = False

    def _out(self, event: TokenEvent) -> TokenEvent:
        if not self._want_text:
            event.text = ""
        return event

    def add(self, item: TokenOut) -> list[TokenEvent]:
        """The events ``item`` releases: none, its own, or the held one's and perhaps its own."""
        if self.stopped:
            return []  # after a stop string: drain until the backend confirms
        times = self._times
        times.append(self._elapsed())
        event = TokenEvent(item.token, len(times) - 1, times[-1], logprob=item.logprob,
                           prompt_logprobs=item.prompt_logprobs)
        if self._text is None:
            return [event]
        piece, self.stopped = self._text.add(item.token)
        emit_now = self.stopped or not self._text.pending
        out = []
        if self._held is not None:  # its text is decided now; the newest token takes the text if it goes out too
            if not emit_now:
                self._held.text, piece = self._held.text + piece, ""
            out.append(self._out(self._held))
            self._held = None
        event.text = piece
        if emit_now:
            out.append(self._out(event))
        else:
            self._held = event
        if self.stopped:
            self._cancelled.set()
        return out

    def finish(self) -> list[TokenEvent]:
        """At the end of the stream: the held token, with the rest of the text."""
        if self._held is None:
            return []
        held, self._held = self._held, None
        held.text += self._text.flush()
        return [self._out(held)]


MAX_AHEAD = 4096
"""Tokens a merge keeps that came before their turn: a datagram further ahead than this is dropped (the backend's
stream brings it in its turn)."""


class TokenMerge:
    """One request's tokens from two ways at once (the backend's stream and a decode instance's token feed), into
    one ``TokenFlow`` in index order, each once: whichever way brings the next index first has it processed; a token
    ahead of its turn waits for the ones before it; a copy of one already processed is dropped. The events go to
    ``emit`` inside the lock, so they reach it in order whichever thread brought them. ``add`` and ``finish`` return
    nothing: the events are emitted."""

    def __init__(self, flow: TokenFlow, emit: Callable[[TokenEvent], object]):
        self._flow, self._emit = flow, emit
        self._lock = threading.Lock()
        self._next = 0
        self._ahead: dict[int, TokenOut] = {}
        self._done = False

    def offer(self, item: TokenOut) -> None:
        with self._lock:
            if self._done or not self._next <= item.index < self._next + MAX_AHEAD:
                return
            self._ahead.setdefault(item.index, item)
            while self._next in self._ahead:
                for event in self._flow.add(self._ahead.pop(self._next)):
                    self._emit(event)
                self._next += 1

    def add(self, item: TokenOut) -> list[TokenEvent]:
        self.offer(item)
        return []

    def finish(self) -> list[TokenEvent]:
        with self._lock:
            self._done = True
            for event in self._flow.finish():
                self._emit(event)
        return []
