"""The contract between the client-facing gateway and whatever generates tokens behind it.

The gateway (gRPC ``mooncake.v1.Gateway`` and OpenAI-compatible HTTP) tokenizes, validates the request's shape,
and streams; a ``Backend`` turns token ids into generated token ids. Two backends implement it: the disaggregated
cluster (Conductor + prefill and decode instances) and a single local engine (coupled prefill and decode). Tests
drive the gateway with a fake backend whose outputs are predictable.

Errors a backend raises map to one status each, on both front ends:

    InvalidRequest -> gRPC INVALID_ARGUMENT   / HTTP 400
    Rejected       -> gRPC RESOURCE_EXHAUSTED / HTTP 429 (with a retry-after hint)
    Unavailable    -> gRPC UNAVAILABLE        / HTTP 503
    DuplicateRequest -> gRPC ALREADY_EXISTS   / HTTP 409 (a request id already in flight)
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator
from typing import Protocol

from ..slo import tbt_of_times

FINISH_LENGTH, FINISH_STOP, FINISH_ABORT = "length", "stop", "abort"
REJECT_EARLY, REJECT_LATE = "early", "late"


@dataclasses.dataclass
class GenerateRequest:
    """One generation request, already tokenized."""

    prompt: list[int]
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    request_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: off; else top alternatives per generated token
    prompt_logprobs: int | None = None  # None: off; else logprobs of prompt tokens 1 .. n-1 (no prefix reuse)
    token_feed: str = ""  # a gateway's token_feed.FeedReceiver address, for backends with accepts_token_feed


Logprob = tuple[float, tuple[tuple[int, float], ...]]
"""A token's float32 log-probability and the most likely tokens at its position with theirs."""


@dataclasses.dataclass
class TokenOut:
    """One generated token, as soon as it exists."""

    token: int
    index: int  # 0 for the first generated token
    time_s: float  # seconds since the backend received the request
    logprob: Logprob | None = None  # with request.logprobs
    prompt_logprobs: list[Logprob] | None = None  # on the first token, with request.prompt_logprobs


@dataclasses.dataclass
class Finished:
    """The last item of every successful stream."""

    reason: str  # FINISH_LENGTH, FINISH_STOP or FINISH_ABORT
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused instead of computed
    ttft_s: float
    tbt_s: float  # the paper's TBT: mean of the longest 10% of the request's token gaps (0 with < 2 tokens)
    # what its prefill instance reported (0 where no prefill instance served it): seconds it waited for the
    # engine and seconds of the engine's prefill compute; the parts of its TTFT that are queue and work
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    decided_s: float = 0.0  # seconds from the backend's receipt of the request to the Conductor's decision on it
    decision_seq: int = 0  # that decision's place in the order the Conductor made its decisions (0: none)


class InvalidRequest(ValueError):
    """The request itself is wrong (empty prompt, token outside the vocabulary, too long, bad parameters)."""


class DuplicateRequest(InvalidRequest):
    """A request id that names a request still in flight (a client retrying too early, or two clients sharing an
    id): refused, the running request untouched."""


class Rejected(RuntimeError):
    """Overload: the request was not (or no longer) accepted. ``stage`` is REJECT_EARLY (before prefill, by the
    Conductor) or REJECT_LATE (by the decode instance after prefill); ``cause`` says what refused it in one word a
    program can count without reading the message: the Conductor's reason (``ttft_slo``, ``tbt_slo``, ...) for an
    early refusal, the refusing instance's id for a late one. Both travel in the HTTP 429 body's ``error``."""

    def __init__(self, message: str, retry_after_s: float = 1.0, stage: str = REJECT_EARLY, cause: str = ""):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.stage = stage
        self.cause = cause


class Unavailable(RuntimeError):
    """The backend cannot serve right now (an instance died mid-request, shutting down)."""


class Backend(Protocol):
    model_name: str
    vocab_size: int
    max_context: int
    eos_token_id: int | None

    def generate(self, request: GenerateRequest, cancelled: threading.Event | None = None
                 ) -> Iterator[TokenOut | Finished]:
        """Tokens as they are generated, then one ``Finished``.

        Raises InvalidRequest / Rejected / Unavailable (before the first item, or Unavailable mid-stream). When
        ``cancelled`` is set (the client went away) the backend stops the request and frees its KV, and the
        iterator ends with ``Finished(reason=FINISH_ABORT)``.

        The gateway sets ``cancelled`` also after a stop string, and never ``close()``s the iterator early: after
        setting it, it reads the iterator to its end (on a background thread when the client is gone), so the
        abort path runs in the backend's own code, between two items.
        """
        ...

    def health(self) -> str | None:
        """Optional. None when the backend can serve now, else a message naming what is missing (for the
        cluster: the Conductor, or a live prefill or decode instance). ``/health`` answers 503 with it and the
        gRPC health service NOT_SERVING; a backend without this method is taken to be always ready."""
        ...

    def stats(self) -> dict[str, float]:
        """Gauges and counters the gateway exports on /metrics (queue depths, cache hits, transfer bytes, ...).

        Each key becomes ``mooncake_backend_<key>``: keys ending in ``_total`` are exported as counters, the rest
        as gauges; a key may carry Prometheus labels, e.g. ``'queue_depth{instance="p0"}'``. Called at every
        scrape, from the HTTP server's threads.
        """
        ...


def paper_tbt(token_times: list[float]) -> float:
    """The paper's TBT of a request from its token times (``mooncake_jax.slo``); 0.0 with fewer than two tokens."""
    return tbt_of_times(token_times)
