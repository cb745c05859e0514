"""gRPC glue shared by the prefill and decode services: proto <-> engine types, and errors -> status codes."""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeout

import grpc

from ..model.kv_cache import OutOfPages
from ..gateway.backend import GenerateRequest
from ..model.sequence import SamplingParams
from ..proto import load
from ..transfer.messenger import TransferError
from ..engine.runner_loop import LoopStopped
from ..engine.scheduler import BatchFull, QueueFull

log = logging.getLogger(__name__)
messages, services = load("instance")


class InvalidArgument(ValueError):
    """The request itself is malformed (validated at the top of a handler): INVALID_ARGUMENT. Any other error,
    ValueErrors from deeper down included, is a server fault: INTERNAL, logged with its traceback."""


def validated(make):
    """Run ``make()`` (parsing and validating a request), turning its ValueError into InvalidArgument."""
    try:
        return make()
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


class LateRejection(RuntimeError):
    """An instance cannot take the request now (decode: TBT SLO or KV capacity; prefill: it can no longer meet the
    TTFT SLO): RESOURCE_EXHAUSTED."""


class MissingKV(RuntimeError):
    """The request's KV did not arrive in this instance's pool."""


def sampling_params(msg) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p or 1.0, seed=msg.seed,
        stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos, top_k=msg.top_k, min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        frequency_penalty=msg.frequency_penalty, presence_penalty=msg.presence_penalty,
        logit_bias=tuple((b.token, b.bias) for b in msg.logit_bias),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None)


def sampling_message(params: SamplingParams):
    return messages.Sampling(
        max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p, seed=params.seed,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos, top_k=params.top_k,
        min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
        logit_bias=[messages.LogitBias(token=t, bias=b) for t, b in params.logit_bias],
        logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs)


def logprob_message(entry):
    """A ``Sequence.logprobs`` entry ``(logprob, ((id, logprob), ...))`` as a TokenLogprob (None: None)."""
    if entry is None:
        return None
    lp, top = entry
    return messages.TokenLogprob(logprob=lp, top_ids=[t for t, _ in top], top_logprobs=[x for _, x in top])


def logprob_entry(msg):
    """The inverse of ``logprob_message``."""
    return float(msg.logprob), tuple(zip(msg.top_ids, (float(x) for x in msg.top_logprobs)))


def sampling_of(request: GenerateRequest) -> SamplingParams:
    """The engine's sampling settings of a gateway request."""
    return SamplingParams(
        max_new_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p, seed=request.seed,
        ignore_eos=request.ignore_eos, stop_token_ids=tuple(request.stop_token_ids), top_k=request.top_k,
        min_p=request.min_p, repetition_penalty=request.repetition_penalty,
        frequency_penalty=request.frequency_penalty, presence_penalty=request.presence_penalty,
        logit_bias=tuple(request.logit_bias), logprobs=request.logprobs, prompt_logprobs=request.prompt_logprobs)


STATUS = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (LateRejection, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (OutOfPages, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BatchFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (MissingKV, grpc.StatusCode.FAILED_PRECONDITION),
    (TransferError, grpc.StatusCode.UNAVAILABLE),
    (LoopStopped, grpc.StatusCode.UNAVAILABLE),
    (FutureTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_of(error: BaseException) -> grpc.StatusCode:
    for kind, code in STATUS:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def rpc(method):
    """Turn the exceptions of a unary handler into gRPC statuses with their message (never a crash)."""
    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as e:
            code = status_of(e)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", method.__name__)
            context.abort(code, f"{type(e).__name__}: {e}" if code == grpc.StatusCode.INTERNAL else str(e))
    return wrapper


class InstanceService(services.InstanceServicer):
    """What the prefill and decode services share: counters, registration on a server, and the Stats RPC."""

    def __init__(self, instance, counters: tuple[str, ...]):
        self.instance = instance
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(counters, 0)

    def add_to_server(self, server) -> None:
        services.add_InstanceServicer_to_server(self, server)

    def _count(self, **amounts) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counts[name] += amount

    def counts(self) -> dict[str, float]:
        with self._lock:
            return {f"{k}_total": float(v) for k, v in self._counts.items()}

    @rpc
    def Stats(self, request, context):
        return messages.StatsReply(values=self.instance.stats())
