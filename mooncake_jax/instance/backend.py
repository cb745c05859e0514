"""The disaggregated cluster as a gateway ``Backend``: one request's trip through Conductor, prefill and decode.

    keys = block keys of the prompt
    Conductor.Schedule      -> reject (Rejected, early) or (prefill p, decode d, transfer plan)
    p.Prefill               -> p fetches the plan, prefills, stores new KV, pushes the request's KV to d;
                               returns the first token
    d.Decode                -> first message: accepted (or RESOURCE_EXHAUSTED: Rejected, late)
    stream                  -> the first token, then d's tokens, then Finished (TTFT, TBT, cached tokens)

Every call has a deadline; an instance that dies mid-request surfaces as ``Unavailable`` (never a hang), and the
Conductor is told the request was dropped. A cancelled request (client gone) cancels the decode stream, which
frees its KV on the decode instance.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc
import grpc.experimental  # noqa: F401 - ChannelOptions
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..blocks import block_keys
from ..gateway.backend import (FINISH_ABORT, REJECT_EARLY, REJECT_LATE, DuplicateRequest, Finished, GenerateRequest,
                               InvalidRequest, Rejected, TokenOut, Unavailable, paper_tbt)
from ..gateway.token_feed import reaches
from ..model.config import ModelConfig
from ..model.sequence import SamplingParams, validate_prompt
from ..proto import load
from ..proto.auth import open_channel
from .rpc import messages as instance_messages
from .rpc import logprob_entry, sampling_message, sampling_of
from .rpc import services as instance_services

conductor_messages, conductor_services = load("conductor")
log = logging.getLogger(__name__)

RETRIES_BEFORE_FIRST_TOKEN = 1
"""A request that fails before its first token (an instance died or could not be reached) is scheduled once more:
the Conductor has dropped the dead instance by then, so the retry lands on a live one."""

PROBE_TIMEOUT_S = 1.0
SCHEDULE_TIMEOUT_S = 10.0
"""Deadline of one Schedule call: a decision takes milliseconds, so a Conductor silent this long is down (a request
in flight while it restarts fails with UNAVAILABLE instead of waiting the whole request deadline)."""
INSTANCE_CHANNEL_OPTIONS = ((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),)
"""Each decode stream's tokens are read by the thread that iterates it (``SingleThreadedUnaryStream``), not handed
to it by the channel's own polling thread: one thread wake-up and one interpreter-lock hand-off fewer per token,
in the process that also runs the gateway. Measured on loopback (``benchmarks/stream_latency.py``, AMD EPYC, 2
cores), a message every 1.7 ms (a decode step): latency p99 0.20-0.27 ms against 0.41-3.58 ms in five runs of six;
beside a Python thread that keeps the interpreter lock busy, p99 2.6-5.7 ms against 4.2-25.2 ms in six of seven
(docs/benchmarks/demo.md, "seventeenth session"). It relies on the serving processes' short GIL switch interval.
Such a stream must be ended with ``end_stream``, not a bare cancel."""
MISSING_ROLE = {"no_prefill_instance": "prefill", "no_decode_instance": "decode"}
"""Schedule's reasons that mean "nothing to serve with", not overload: 503, naming the role."""


def predictions(decision) -> str:
    """What the Conductor predicted for a request it refused (a ``ScheduleReply``), for the refusal's message: a
    stray refusal in a demo run then says which instance looked slow and by how much."""
    on_decode = f" on {decision.decode_id}" if decision.decode_id else " (no decode instance had room)"
    return (f"predicted TTFT {decision.predicted_ttft_s:.3f} s (queue {decision.predicted_queue_s:.3f} s + prefill "
            f"{decision.predicted_prefill_s:.3f} s on {decision.prefill_id or '-'}), TBT "
            f"{decision.predicted_tbt_s:.4f} s{on_decode}")


def _with_first(error: Exception, first: Exception | None) -> Exception:
    """``error`` of a retry, saying also why the first try failed (the instance that actually failed)."""
    if first is None or not isinstance(error, Unavailable):
        return error
    return Unavailable(f"{error}; the first try failed: {first}")


class _BeforeFirstToken(Exception):
    """A failure before the request's first token, which a second trip may avoid; ``error`` is what the client
    gets if there is none."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class ClusterBackend:
    """Routes requests through a running Conductor and its instances."""

    accepts_token_feed = True
    """A request's ``token_feed`` goes to its decode instance, which sends it each token as it is generated
    (``gateway/token_feed.py``); the decode stream still brings them all, in batches (so the ``tbt_s`` of such a
    request's ``Finished`` is the batches', not the tokens': the gateway measures its own)."""

    def __init__(self, conductor_address: str, config: ModelConfig, model_name: str, timeout_s: float = 120.0,
                 auth_token: str | None = None):
        self.model_name = model_name
        self.vocab_size = config.vocab_size
        self.max_context = config.max_seq_len
        self.eos_token_id = config.eos_token_id
        self.config = config
        self.timeout_s = timeout_s
        self._token = auth_token
        self._conductor_channel = open_channel(conductor_address, auth_token)
        self._conductor = conductor_services.ConductorStub(self._conductor_channel)
        self._stubs: dict[str, object] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._probing: set[str] = set()  # instances being probed after another could not reach them (_suspect)
        self._counts = {"requests": 0, "rejected_early": 0, "rejected_late": 0, "failed": 0, "cached_tokens": 0,
                        "prompt_tokens": 0, "transfer_plans": 0, "retried": 0,
                        # the Conductor's predicted TTFT of each admitted request beside the one it got (queue,
                        # prefill, KV push and decode admission), and its parts: where an SLO miss comes from
                        "first_tokens": 0, "ttft_predicted_seconds": 0.0, "ttft_seconds": 0.0,
                        "ttft_prefill_reply_seconds": 0.0, "ttft_prefill_queue_seconds": 0.0,
                        "ttft_prefill_seconds": 0.0}

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(address, self._token, INSTANCE_CHANNEL_OPTIONS)
            return channel

    def instance_stub(self, address: str):
        """A (cached) stub of the Instance service at ``address``."""
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = instance_services.InstanceStub(self._channel(address))
        return stub

    def _count(self, **amounts) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._counts[name] += amount

    def health(self) -> str | None:
        """None when a request can be served (the Conductor answers and lists a live prefill and a live decode
        instance; it drops instances that miss heartbeats), else what is missing."""
        try:
            listing = self._conductor.ListInstances(conductor_messages.ListInstancesRequest(), timeout=2)
        except grpc.RpcError as e:
            return f"the Conductor does not answer ({e.code().name})"
        roles = {info.role for info in listing.instances}
        missing = [name for name, role in (("prefill", conductor_messages.PREFILL),
                                           ("decode", conductor_messages.DECODE)) if role not in roles]
        return f"no {' and no '.join(missing)} instance alive" if missing else None

    def stats(self) -> dict[str, float]:
        """This router's counters, and every live instance's figures (queue depths, pool and Messenger traffic,
        cache hits) labelled by instance, as the gateway's /metrics exports them (``*_total`` are counters)."""
        with self._lock:
            values = {f"cluster_{k}_total": float(v) for k, v in self._counts.items()}
        try:
            listing = self._conductor.ListInstances(conductor_messages.ListInstancesRequest(), timeout=2)
        except grpc.RpcError:
            return values
        values["cluster_instances"] = float(len(listing.instances))
        values["cluster_indexed_blocks"] = float(listing.indexed_blocks)
        for info in listing.instances:
            label = f'{{instance="{info.instance_id}"}}'
            values[f"instance_predicted_queue_s{label}"] = info.queued_s
            try:
                reply = self.instance_stub(info.address).Stats(instance_messages.StatsRequest(), timeout=2)
            except grpc.RpcError:
                continue
            values.update({f"instance_{name}{label}": value for name, value in reply.values.items()})
        return values

    def _validate(self, request: GenerateRequest) -> SamplingParams:
        params = sampling_of(request)
        try:
            params.validate(self.config.vocab_size)
            validate_prompt(request.prompt, self.config, request.max_tokens)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        return params

    def _report_dropped(self, request_id: str) -> None:
        try:
            self._conductor.ReportRequest(conductor_messages.RequestEvent(
                request_id=request_id, kind=conductor_messages.RequestEvent.DROPPED), timeout=5)
        except grpc.RpcError:
            pass

    def generate(self, request: GenerateRequest, cancelled: threading.Event | None = None
                 ) -> Iterator[TokenOut | Finished]:
        params = self._validate(request)
        t0 = time.perf_counter()
        self._count(requests=1, prompt_tokens=len(request.prompt))
        first_failure = None
        for attempt in range(1 + RETRIES_BEFORE_FIRST_TOKEN):
            started = False
            try:
                for item in self._attempt(request, params, cancelled, t0):
                    started = True
                    yield item
                return
            except _BeforeFirstToken as failure:
                if attempt == RETRIES_BEFORE_FIRST_TOKEN or (cancelled is not None and cancelled.is_set()):
                    self._count(failed=1)
                    raise _with_first(failure.error, first_failure) from None
                first_failure = failure.error
                self._count(retried=1)
                log.warning("request %s failed before its first token (%s); retrying it once",
                            request.request_id, failure.error)
            except Unavailable as e:
                if started:
                    raise
                raise _with_first(e, first_failure) from None

    def _attempt(self, request: GenerateRequest, params: SamplingParams, cancelled: threading.Event | None,
                 t0: float) -> Iterator[TokenOut | Finished]:
        """One trip through Conductor, prefill and decode. A failure before the first token is yielded raises
        ``_BeforeFirstToken`` when another trip may succeed (an instance died or could not be reached)."""
        keys = block_keys(request.prompt, self.config.block_size)
        try:
            decision = self._conductor.Schedule(conductor_messages.ScheduleRequest(
                request_id=request.request_id, block_keys=keys, input_tokens=len(request.prompt),
                output_tokens=request.max_tokens), timeout=min(self.timeout_s, SCHEDULE_TIMEOUT_S))
            decided_at = (time.perf_counter() - t0, decision.decision_seq)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ALREADY_EXISTS:
                raise DuplicateRequest(e.details()) from None
            self._count(failed=1)
            raise Unavailable(f"the Conductor is unavailable: {e.details()}") from None
        if not decision.accepted:
            missing = MISSING_ROLE.get(decision.reject_reason)
            if missing is not None:  # not overload: nothing to retry after; say what is missing
                self._count(failed=1)
                raise Unavailable(f"no {missing} instance alive (the Conductor lists none); retry when one is back")
            self._count(rejected_early=1)
            raise Rejected(f"overloaded ({decision.reject_reason}): {predictions(decision)}", decision.retry_after_s,
                           REJECT_EARLY, cause=decision.reject_reason)
        prefill_at = (decision.prefill_id, decision.prefill_address, "prefill")
        decode_at = (decision.decode_id, decision.decode_address, "decode")
        sampling = sampling_message(params)
        plan = decision.transfer if decision.HasField("transfer") else None
        self._count(transfer_plans=int(plan is not None))
        try:
            prefill = self.instance_stub(decision.prefill_address).Prefill(instance_messages.PrefillRequest(
                request_id=request.request_id, prompt=request.prompt, sampling=sampling,
                fetch_from=plan.source_address if plan else "", fetch_keys=plan.block_keys if plan else [],
                push_to=decision.decode_address), timeout=self.timeout_s)
        except grpc.RpcError as e:
            self._report_dropped(request.request_id)
            raise self._failure(e, prefill_at, [prefill_at, decode_at]) from None
        first_at = time.perf_counter() - t0
        if plan is not None and prefill.fetch_failed:
            self._suspect(plan.source_id, plan.source_address, "prefill")
        self._count(cached_tokens=prefill.cached_tokens)
        ttft_parts = dict(first_tokens=1, ttft_predicted_seconds=decision.predicted_ttft_s,
                          ttft_prefill_reply_seconds=first_at, ttft_prefill_queue_seconds=prefill.queue_s,
                          ttft_prefill_seconds=prefill.prefill_s)
        times = [first_at]
        first_logprob = logprob_entry(prefill.first_logprob) if params.logprobs is not None else None
        prompt_logprobs = ([logprob_entry(m) for m in prefill.prompt_logprobs]
                           if params.prompt_logprobs is not None else None)
        first_out = TokenOut(prefill.first_token, 0, first_at, first_logprob, prompt_logprobs)
        if prefill.finished:
            self._report_dropped(request.request_id)  # no decode: the Conductor's ledger lets it go
            self._count(ttft_seconds=first_at, **ttft_parts)
            yield first_out
            yield self._finished("stop" if params.max_new_tokens > 1 else "length", request, 1, prefill, times,
                                 decided_at)
            return
        stream = self.instance_stub(decision.decode_address).Decode(instance_messages.DecodeRequest(
            request_id=request.request_id, prompt=request.prompt, sampling=sampling,
            first_token=prefill.first_token, kv_keys=prefill.kv_keys, kv_source=decision.prefill_address,
            first_logprob=prefill.first_logprob if params.logprobs is not None else None,
            kv_layout=prefill.kv_layout, token_feed=self._feed_for(request, params, decision.decode_address)),
            timeout=self.timeout_s)
        watcher = _cancel_on(cancelled, stream)
        try:
            try:
                first = next(stream)
                if not first.HasField("accepted"):
                    raise Unavailable("decode instance answered without accepting the request")
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._count(rejected_late=1)
                    raise Rejected(f"decode instance {decision.decode_id} rejected the request: {e.details()}",
                                   1.0, REJECT_LATE, cause=decision.decode_id) from None
                self._report_dropped(request.request_id)
                raise self._failure(e, decode_at, [decode_at]) from None
            self._count(ttft_seconds=time.perf_counter() - t0, **ttft_parts)  # once the decode side accepted
            yield first_out
            count = 1
            reason = FINISH_ABORT
            try:
                for event in stream:
                    if event.HasField("token"):
                        now = time.perf_counter() - t0
                        times.append(now)
                        count += 1
                        yield TokenOut(event.token.token, event.token.index, now,
                                       logprob_entry(event.token.logprob) if params.logprobs is not None else None)
                    elif event.HasField("tokens"):  # with a token feed: a batch (the feed brought each already)
                        now = time.perf_counter() - t0
                        for index, token in enumerate(event.tokens.tokens, start=event.tokens.index):
                            times.append(now)
                            count += 1
                            yield TokenOut(token, index, now)
                    elif event.HasField("done"):
                        reason = event.done.reason
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED or not (cancelled and cancelled.is_set()):
                    failure = self._failure(e, decode_at, [decode_at])
                    if isinstance(failure, _BeforeFirstToken):  # too late to retry: tokens were streamed
                        self._count(failed=1)
                        failure = failure.error
                    raise failure from None
            yield self._finished(reason, request, count, prefill, times, decided_at)
        finally:
            end_stream(stream)
            if watcher is not None:
                watcher.set()

    @staticmethod
    def _feed_for(request: GenerateRequest, params: SamplingParams, decode_address: str) -> str:
        """The token feed the decode instance is given: the request's, unless the request asks for logprobs (the
        stream carries those) or the instance cannot reach the feed (``token_feed.reaches``)."""
        if not request.token_feed or params.logprobs is not None or not reaches(request.token_feed, decode_address):
            return ""
        return request.token_feed

    def _failure(self, error: grpc.RpcError, called: tuple[str, str, str],
                 suspects: list[tuple[str, str, str]]) -> Exception:
        """The error to raise for a failed call to instance ``called`` (id, address, role). Instance-reported
        refusals map to their kind; otherwise each of ``suspects`` is probed, the dead ones are dropped from the
        Conductor at once (not after missed heartbeats) and the error names the instance that actually failed;
        a failure another instance could avoid comes wrapped in ``_BeforeFirstToken``."""
        code = error.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidRequest(error.details())
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._count(rejected_late=1)
            return Rejected(f"{called[2]} instance {called[0]} is overloaded: {error.details()}", 1.0, REJECT_LATE,
                            cause=called[0])
        dead = [s for s in suspects if not self._alive(s[1])]
        for instance_id, _, role in dead:
            self._drop_instance(instance_id, role)
        instance_id, _, role = dead[0] if dead else called
        state = "is down" if dead else f"failed ({code.name})"
        failure = Unavailable(f"{role} instance {instance_id} {state}: {error.details()}")
        retryable = bool(dead) or code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                           grpc.StatusCode.FAILED_PRECONDITION)
        if not retryable:
            self._count(failed=1)
        return _BeforeFirstToken(failure) if retryable else failure

    def _suspect(self, instance_id: str, address: str, role: str) -> None:
        """An instance another one could not reach (a prefill's fetch of its transfer plan): probed on a thread of its
        own, off the request's way, and dropped from the Conductor when dead, as one a call failed on is; the
        Conductor would otherwise plan fetches from it until it missed its heartbeats. One probe per instance at a
        time."""
        with self._lock:
            if instance_id in self._probing:
                return
            self._probing.add(instance_id)

        def probe() -> None:
            try:
                if not self._alive(address):
                    self._drop_instance(instance_id, role)
            finally:
                with self._lock:
                    self._probing.discard(instance_id)

        threading.Thread(target=probe, name=f"probe-{instance_id}", daemon=True).start()

    def _alive(self, address: str) -> bool:
        """Whether the instance at ``address`` answers its (open) health service within a second."""
        try:
            reply = health_pb2_grpc.HealthStub(self._channel(address)).Check(health_pb2.HealthCheckRequest(),
                                                                             timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _drop_instance(self, instance_id: str, role: str) -> None:
        """Tell the Conductor to stop placing work on a dead instance now (it registers again if it was alive)."""
        log.warning("%s instance %s does not answer: dropping it from the Conductor", role, instance_id)
        try:
            self._conductor.Deregister(conductor_messages.DeregisterRequest(instance_id=instance_id), timeout=5)
        except grpc.RpcError:
            pass  # already dropped (NOT_FOUND), or the Conductor is gone too

    @staticmethod
    def _finished(reason, request, count, prefill, times, decided_at: tuple[float, int]) -> Finished:
        return Finished(reason=reason, prompt_tokens=len(request.prompt), output_tokens=count,
                        cached_tokens=prefill.cached_tokens, ttft_s=times[0], tbt_s=paper_tbt(times),
                        prefill_queue_s=prefill.queue_s, prefill_compute_s=prefill.prefill_s,
                        decided_s=decided_at[0], decision_seq=decided_at[1])

    def close(self) -> None:
        for channel in list(self._channels.values()):
            channel.close()
        self._conductor_channel.close()


def end_stream(call) -> None:
    """Cancel a decode stream (a no-op once it has ended) and read what its cancellation completes. A stream read on
    its own thread (``INSTANCE_CHANNEL_OPTIONS``) cancelled before its end keeps its last event, the call's
    status, unread, and with it the call's native memory for good (about 25 KiB a cancelled stream, grpc 1.85;
    the gateway cancels one at every client that goes away); reading it frees the call. grpc has no public way
    to: its single-threaded call's own event reader is used where it exists, and nothing else happens where not."""
    call.cancel()
    state, read_event = getattr(call, "_state", None), getattr(call, "_consume_next_event", None)
    if state is None or read_event is None:
        return
    try:
        while state.due:  # each event completes at least one due operation; a cancelled call completes them all
            read_event()
    except Exception:  # noqa: BLE001 - grpc's private reader changed: leave the call to grpc, as before
        log.debug("could not read a cancelled decode stream's last events", exc_info=True)


def _cancel_on(cancelled: threading.Event | None, call) -> threading.Event | None:
    """Cancel ``call`` as soon as ``cancelled`` is set; returns an event that ends the watcher."""
    if cancelled is None:
        return None
    done = threading.Event()

    def watch():
        while not done.is_set():
            if cancelled.wait(0.05):
                call.cancel()
                return

    threading.Thread(target=watch, daemon=True, name="cancel-watch").start()
    return done
