"""gRPC front end: ``mooncake.v1.Gateway`` (proto ``mooncake_jax/proto/gateway.proto``), with the standard
health service and server reflection.

Status codes: INVALID_ARGUMENT for a bad request (the message says what), RESOURCE_EXHAUSTED for overload with
the suggested wait in the trailing metadata ``retry-after-s`` (and ``rejected-stage``, ``rejected-cause``: what
refused it, ``gateway.backend.Rejected``), UNAVAILABLE when the backend cannot serve,
UNAUTHENTICATED without the shared token (health stays open so orchestrators can probe). A client that cancels
or disconnects sets the request's ``cancelled`` event at once (an RPC-termination callback), so the backend
stops and frees the KV even while the handler waits for the next token.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mooncake_jax.addresses import join
from mooncake_jax.gateway.backend import (FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, DuplicateRequest,
                                          InvalidRequest, Rejected, Unavailable)
from mooncake_jax.gateway.core import GatewayCore, retry_hint_s
from mooncake_jax.gateway.stream import Summary
from mooncake_jax.gateway.validate import Params
from mooncake_jax.proto import load, server_options
from mooncake_jax.proto.auth import interceptors
from mooncake_jax.proto.tls import add_port
from mooncake_jax.proto.guards import DecodeGuard

messages, services = load("gateway")
log = logging.getLogger(__name__)

SERVICE_NAME = messages.DESCRIPTOR.services_by_name["Gateway"].full_name
RETRY_AFTER_KEY = "retry-after-s"
REJECTED_STAGE_KEY, REJECTED_CAUSE_KEY = "rejected-stage", "rejected-cause"
_FINISH = {FINISH_LENGTH: messages.FINISH_REASON_LENGTH, FINISH_STOP: messages.FINISH_REASON_STOP,
           FINISH_ABORT: messages.FINISH_REASON_ABORT}


# Optional GenerateRequest fields that go to Params under the same name when set (validated there, as over HTTP).
_OPTIONAL = ("top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "logprobs",
             "prompt_logprobs")


def _logprob(entry) -> "messages.Logprob":
    """A ``backend.Logprob`` (logprob, ((top id, logprob), ...)) as its message."""
    logprob, top = entry
    return messages.Logprob(logprob=logprob, top_ids=[t for t, _ in top], top_logprobs=[x for _, x in top])


class GatewayService(services.GatewayServicer):
    def __init__(self, core: GatewayCore):
        self.core = core

    def Generate(self, request, context):
        arrival = time.monotonic()
        cancelled = threading.Event()
        context.add_callback(cancelled.set)  # runs when the RPC ends, at once if the client cancels
        events = None
        try:
            _, events = self.core.generate("grpc", lambda: self._params(request), arrival=arrival,
                                           cancelled=cancelled, always_text=False)
            for event in events:
                if isinstance(event, Summary):
                    yield messages.GenerateResponse(summary=messages.GenerateSummary(
                        finish_reason=_FINISH.get(event.reason, messages.FINISH_REASON_UNSPECIFIED),
                        ttft_s=event.ttft_s, tbt_s=event.tbt_s, total_s=event.total_s,
                        prompt_tokens=event.prompt_tokens, output_tokens=event.output_tokens,
                        cached_tokens=event.cached_tokens, request_id=event.request_id))
                else:
                    yield messages.GenerateResponse(token=messages.TokenChunk(
                        token_id=event.token, text=event.text, index=event.index, time_s=event.time_s,
                        logprob=None if event.logprob is None else _logprob(event.logprob),
                        prompt_logprobs=[_logprob(e) for e in event.prompt_logprobs or ()]))
        except DuplicateRequest as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Rejected as e:
            hint = retry_hint_s(e)
            context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{hint:g}"), (REJECTED_STAGE_KEY, e.stage),
                                           (REJECTED_CAUSE_KEY, e.cause)))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e} (retry after {hint:g} s)")
        except Unavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Exception:  # noqa: BLE001 - a bug in one request must not take the server down
            log.exception("Generate failed")
            context.abort(grpc.StatusCode.INTERNAL, "internal error in the gateway or backend (see its log)")
        finally:
            if events is not None:
                events.close()  # a client gone mid-stream: the request is cancelled now, not at garbage collection

    def _params(self, request) -> Params:
        self.core.check_model(request.model)
        return Params(prompt_ids=list(request.prompt_token_ids) or None, prompt_text=request.prompt_text or None,
                      max_tokens=request.max_tokens if request.HasField("max_tokens") else None,
                      temperature=request.temperature if request.HasField("temperature") else None,
                      top_p=request.top_p if request.HasField("top_p") else None,
                      seed=request.seed if request.HasField("seed") else None,
                      stop=tuple(request.stop), stop_token_ids=tuple(request.stop_token_ids),
                      ignore_eos=request.ignore_eos, request_id=request.request_id or None,
                      **{name: getattr(request, name) for name in _OPTIONAL if request.HasField(name)},
                      logit_bias=dict(request.logit_bias) or None)

    def ListModels(self, request, context):
        core = self.core
        return messages.ModelList(models=[messages.ModelInfo(
            name=core.model_name, vocab_size=core.backend.vocab_size, max_context=core.backend.max_context,
            tokenizer=core.tokenizer.name)])


class _LiveHealth(health.HealthServicer):
    """The standard health service, whose SERVING also needs the backend to be able to serve (``core.health``):
    NOT_SERVING while, say, no decode instance is alive, as ``/health`` answers 503."""

    def __init__(self, core: GatewayCore):
        super().__init__()
        self._core = core

    def Check(self, request, context):
        reply = super().Check(request, context)
        if reply.status == health_pb2.HealthCheckResponse.SERVING and self._core.health() is not None:
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return reply


class GrpcFrontEnd:
    """The gRPC server of a gateway; ``port`` is the one bound (a free one when asked for 0)."""

    def __init__(self, core: GatewayCore, host: str, port: int, *, auth_token: str | None, max_workers: int):
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="gw-grpc"),
                                   options=server_options(), interceptors=(*interceptors(auth_token), DecodeGuard()))
        services.add_GatewayServicer_to_server(GatewayService(core), self._server)
        self._health = _LiveHealth(core)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection([SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME],
                                            self._server)
        bind = join(host, port)
        self.port = add_port(self._server, bind)
        if not self.port:
            raise OSError(f"gRPC cannot listen on {bind}")

    def start(self) -> None:
        self._server.start()
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace_s: float) -> threading.Event:
        """Begin stopping; the returned event is set once the last RPC has ended (cancelled after ``grace_s``)."""
        self._health.enter_graceful_shutdown()
        return self._server.stop(grace_s)
