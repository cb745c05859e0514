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

import threading
import time
from collections.abc import Iterator

import grpc

from ..blocks import block_keys
from ..gateway.backend import (FINISH_ABORT, REJECT_EARLY, REJECT_LATE, Finished, GenerateRequest, InvalidRequest,
                               Rejected, TokenOut, Unavailable, paper_tbt)
from ..model.config import ModelConfig
from ..model.sequence import SamplingParams, validate_prompt
from ..proto import load
from ..proto.auth import open_channel
from .rpc import messages as instance_messages
from .rpc import sampling_message
from .rpc import services as instance_services

conductor_messages, conductor_services = load("conductor")


class ClusterBackend:
    """Routes requests through a running Conductor and its instances."""

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
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()
        self._counts = {"requests": 0, "rejected_early": 0, "rejected_late": 0, "failed": 0, "cached_tokens": 0,
                        "prompt_tokens": 0, "transfer_plans": 0}

    def instance_stub(self, address: str):
        """A (cached) stub of the Instance service at ``address``."""
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                channel = open_channel(address, self._token)
                self._channels.append(channel)
                stub = self._stubs[address] = instance_services.InstanceStub(channel)
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
        params = SamplingParams(max_new_tokens=request.max_tokens, temperature=request.temperature,
                                top_p=request.top_p, seed=request.seed, ignore_eos=request.ignore_eos,
                                stop_token_ids=tuple(request.stop_token_ids))
        try:
            params.validate()
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
        keys = block_keys(request.prompt, self.config.block_size)
        try:
            decision = self._conductor.Schedule(conductor_messages.ScheduleRequest(
                request_id=request.request_id, block_keys=keys, input_tokens=len(request.prompt),
                output_tokens=request.max_tokens), timeout=self.timeout_s)
        except grpc.RpcError as e:
            self._count(failed=1)
            raise Unavailable(f"the Conductor is unavailable: {e.details()}") from None
        if not decision.accepted:
            self._count(rejected_early=1)
            raise Rejected(f"overloaded ({decision.reject_reason})", decision.retry_after_s, REJECT_EARLY)
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
            self._count(failed=1)
            raise self._error("prefill", decision.prefill_id, e) from None
        first_at = time.perf_counter() - t0
        self._count(cached_tokens=prefill.cached_tokens)
        times = [first_at]
        if prefill.finished:
            self._report_dropped(request.request_id)  # no decode: the Conductor's ledger lets it go
            yield TokenOut(prefill.first_token, 0, first_at)
            yield self._finished("stop" if params.max_new_tokens > 1 else "length", request, 1, prefill, times)
            return
        stream = self.instance_stub(decision.decode_address).Decode(instance_messages.DecodeRequest(
            request_id=request.request_id, prompt=request.prompt, sampling=sampling,
            first_token=prefill.first_token, kv_keys=prefill.kv_keys, kv_source=decision.prefill_address,
            kv_layout=prefill.kv_layout),
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
                    raise Rejected(f"decode instance rejected the request: {e.details()}", 1.0,
                                   REJECT_LATE) from None
                self._report_dropped(request.request_id)
                self._count(failed=1)
                raise self._error("decode", decision.decode_id, e) from None
            yield TokenOut(prefill.first_token, 0, first_at)
            count = 1
            reason = FINISH_ABORT
            try:
                for event in stream:
                    if event.HasField("token"):
                        now = time.perf_counter() - t0
                        times.append(now)
                        count += 1
                        yield TokenOut(event.token.token, event.token.index, now)
                    elif event.HasField("done"):
                        reason = event.done.reason
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED or not (cancelled and cancelled.is_set()):
                    self._count(failed=1)
                    raise self._error("decode", decision.decode_id, e) from None
            yield self._finished(reason, request, count, prefill, times)
        finally:
            stream.cancel()
            if watcher is not None:
                watcher.set()

    @staticmethod
    def _finished(reason, request, count, prefill, times) -> Finished:
        return Finished(reason=reason, prompt_tokens=len(request.prompt), output_tokens=count,
                        cached_tokens=prefill.cached_tokens, ttft_s=times[0], tbt_s=paper_tbt(times))

    @staticmethod
    def _error(stage: str, instance_id: str, error: grpc.RpcError) -> Exception:
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidRequest(error.details())
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return Rejected(f"{stage} instance {instance_id} is out of KV space: {error.details()}", 1.0,
                            REJECT_LATE)
        return Unavailable(f"{stage} instance {instance_id} failed ({error.code().name}): {error.details()}")

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self._conductor_channel.close()


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
