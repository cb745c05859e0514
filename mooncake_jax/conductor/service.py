"""The Conductor's gRPC service (``mooncake.v1.Conductor``, proto ``mooncake_jax/proto/conductor.proto``).

A thin shell around one ``ClusterState`` and one ``Policy`` (the very objects the simulator drives): it turns
messages into state calls under one lock, so concurrent callers see decisions made one after another, each
counting the load of the ones before; and it turns bad messages into INVALID_ARGUMENT (malformed) or NOT_FOUND
(unknown instance or request) with the reason, never into a crash.

Liveness: an instance that has not sent a heartbeat for ``heartbeat_timeout_s`` is drained (no new work) and its
blocks are purged, by a sweeper thread. Its next heartbeat gets NOT_FOUND, which tells it to register again and
re-send its block list; a restarted Conductor rebuilds its whole index the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mooncake_jax.addresses import join
from mooncake_jax.conductor.api import Admission, Decision, PolicyConfig, Request
from mooncake_jax.conductor.hardware import instance_costs
from mooncake_jax.conductor.index import Tier
from mooncake_jax.conductor.instances import Role, UnknownInstance
from mooncake_jax.conductor.policy import Policy
from mooncake_jax.conductor.profile import costs_from_profile
from mooncake_jax.conductor.state import ClusterState, RequestInFlight
from mooncake_jax.kv_layout import KVLayout, exchange_problem
from mooncake_jax.proto import load, server_options
from mooncake_jax.proto.auth import interceptors
from mooncake_jax.proto.tls import add_port
from mooncake_jax.proto.guards import DecodeGuard

messages, services = load("conductor")
log = logging.getLogger(__name__)

SERVICE_NAME = messages.DESCRIPTOR.services_by_name["Conductor"].full_name


class UnknownRequest(KeyError):
    def __str__(self) -> str:
        return self.args[0]


def _rpc(method):
    """Run a handler, mapping the errors that mean 'bad message' to status codes with their message."""

    @functools.wraps(method)
    def handler(self, request, context):
        try:
            return method(self, request, context)
        except (UnknownInstance, UnknownRequest) as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except RequestInFlight as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    return handler


class ConductorService(services.ConductorServicer):
    """RPC handlers over one cluster state; ``clock`` is the policy clock (monotonic seconds)."""

    def __init__(self, config: PolicyConfig | None = None, *, clock: Callable[[], float] = time.monotonic,
                 heartbeat_interval_s: float = 1.0, heartbeat_timeout_s: float = 5.0,
                 adopt_block_size: bool = False):
        """``adopt_block_size``: take the prefix index's block size from the first prefill instance that registers
        (a Conductor started alone knows no model) instead of ``config.block_size``."""
        if not 0 < heartbeat_interval_s < heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        self.state = ClusterState(config)
        self.policy = Policy(self.state.config)
        self.clock = clock
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.lock = threading.Lock()
        self.decisions = 0  # decisions made so far: each reply carries its place in their order (decision_seq)
        self.kv_layout: KVLayout | None = None  # the first registered instance's: every other must exchange KV
        self.prefill_kv_layout: KVLayout | None = None  # the first prefill instance's: the others share its blocks
        self.adopt_block_size = config is None or adopt_block_size
        self.model = ""  # the first registered instance's model (what a gateway started alone serves)
        self.event_seq: dict[str, int] = {}  # instance id -> number of its last KV event batch applied
        self.resyncs = 0  # KV event gaps detected (each made its instance re-send its block list)

    def _check_layout(self, request, role: Role) -> None:
        """Refuse, at registration, an instance whose KV cannot become the cluster's (another model), or a prefill
        instance whose blocks are not the index's block size (its KV events would name other blocks) or not the other
        prefill instances' dtype (transfer plans copy blocks between their pools as they are)."""
        if not request.kv_layout:
            return
        layout = KVLayout.from_json(request.kv_layout)
        if role == Role.PREFILL and self.adopt_block_size:
            with self.lock:
                if self.prefill_kv_layout is None and layout.block_size != self.state.config.block_size:
                    config = dataclasses.replace(self.state.config, block_size=layout.block_size)
                    self.state.config = self.policy.config = config
                    log.info("prefix index block size %d (from %s)", layout.block_size, request.instance_id)
        if role == Role.PREFILL and layout.block_size != self.state.config.block_size:
            raise ValueError(f"instance {request.instance_id}: prefill block_size {layout.block_size} differs from "
                             f"the cluster's {self.state.config.block_size} (the prefix index's block size); "
                             f"allowed: {self.state.config.block_size}")
        with self.lock:
            first = self.kv_layout = self.kv_layout or layout
            if role == Role.PREFILL:
                prefill = self.prefill_kv_layout = self.prefill_kv_layout or layout
        if role == Role.PREFILL and layout.dtype != prefill.dtype:
            raise ValueError(f"instance {request.instance_id}: prefill KV dtype {layout.dtype} differs from the other "
                             f"prefill instances' {prefill.dtype} (transfer plans move blocks between prefill pools "
                             f"unchanged); allowed: {prefill.dtype}")
        problem = exchange_problem(layout, first)
        if problem:
            raise ValueError(f"instance {request.instance_id} cannot exchange KV with this cluster ({problem}): "
                             f"it has {layout.describe()}, the cluster {first.describe()}")

    def sweep(self) -> list[str]:
        """Drain the instances whose heartbeats stopped; returns their ids."""
        with self.lock:
            dead = self.state.expire(self.clock(), self.heartbeat_timeout_s)
        for instance_id in dead:
            log.warning("instance %s missed its heartbeats: drained, its blocks purged", instance_id)
        return dead

    @_rpc
    def Register(self, request, context):
        costs = _costs(request)
        if request.role == messages.ROLE_UNSPECIFIED:
            raise ValueError("role must be PREFILL or DECODE")
        role = Role.PREFILL if request.role == messages.PREFILL else Role.DECODE
        capacity = request.kv_capacity_tokens or None
        self._check_layout(request, role)
        with self.lock:
            self.state.add_instance(request.instance_id, role, costs, self.clock(), request.address, capacity,
                                    hardware=request.hardware or None, max_batch=_max_batch_of(request),
                                    index_blocks=_index_blocks_of(request) if role == Role.PREFILL else 0)
            self.state.kv_reset(request.instance_id, request.dram_block_keys, request.ssd_block_keys)
            self.event_seq[request.instance_id] = request.event_seq
            self.model = self.model or _model_of(request)
        log.info("registered %s instance %s at %s (%s)", role.name.lower(), request.instance_id, request.address,
                 request.hardware or costs.hardware or costs.name)
        config = self.state.config
        return messages.RegisterReply(heartbeat_interval_s=self.heartbeat_interval_s,
                                      heartbeat_timeout_s=self.heartbeat_timeout_s, ttft_slo_s=config.ttft_slo_s,
                                      tbt_slo_s=config.tbt_slo_s, block_size=config.block_size,
                                      admits=config.admission != Admission.NONE)

    @_rpc
    def Deregister(self, request, context):
        with self.lock:
            self.state.remove_instance(request.instance_id)
            self.event_seq.pop(request.instance_id, None)
        return messages.Ack()

    @_rpc
    def Heartbeat(self, request, context):
        active = None
        if request.reports_batch:
            active = {a.request_id: a.kv_tokens for a in request.active}
            if "" in active:
                raise ValueError("active requests need a request_id")
        with self.lock:
            self.state.heartbeat(
                request.instance_id, self.clock(),
                queued_s=request.queued_s if request.HasField("queued_s") else None,
                send_backlog_s=request.send_backlog_s if request.HasField("send_backlog_s") else None,
                active=active,
                prefill_slowdown=request.prefill_slowdown if request.HasField("prefill_slowdown") else None)
        return messages.Ack()

    @_rpc
    def PublishKvEvents(self, request_iterator, context):
        applied, resync = 0, False
        for batch in request_iterator:
            with self.lock:
                if not self._in_sequence(batch):
                    resync = True
                    continue
                for event in batch.events:
                    self._apply_kv_event(batch.instance_id, event)
                    applied += 1
        return messages.KvEventsReply(applied=applied, resync=resync)

    def _in_sequence(self, batch) -> bool:
        """Whether ``batch`` is to be applied (under the lock): unnumbered, the next of its instance's numbers, or a
        whole block list (RESET first). A skipped number means a batch was lost: the index would drift silently,
        so the batch is refused and the instance asked for its whole block list."""
        if not batch.seq:
            return True
        last = self.event_seq.get(batch.instance_id)
        if last is None:
            self.state.instances.slot(batch.instance_id)  # unknown instance: NOT_FOUND (it registers again)
        if batch.events and batch.events[0].kind == messages.KvEvent.RESET or batch.seq == (last or 0) + 1:
            self.event_seq[batch.instance_id] = batch.seq
            return True
        self.resyncs += 1
        log.warning("instance %s: KV event batch %d after %s (a batch was lost); asking for its block list",
                    batch.instance_id, batch.seq, last)
        return False

    def _apply_kv_event(self, instance_id: str, event) -> None:
        tier = Tier.SSD if event.tier == messages.SSD else Tier.DRAM
        if event.kind == messages.KvEvent.STORED:
            self.state.kv_stored(instance_id, event.block_keys, tier)
        elif event.kind == messages.KvEvent.REMOVED:
            self.state.kv_removed(instance_id, event.block_keys)
        elif event.kind == messages.KvEvent.RESET:
            keys = event.block_keys
            self.state.kv_reset(instance_id, *((keys, ()) if tier == Tier.DRAM else ((), keys)))
        else:
            raise ValueError(f"unknown KV event kind {event.kind}")

    @_rpc
    def Schedule(self, request, context):
        req = Request(request.request_id, request.block_keys, request.input_tokens, request.output_tokens)
        with self.lock:
            decision = self.state.schedule(self.policy, req, self.clock())
            self.decisions += 1
            reply = self._reply(decision)
            reply.decision_seq = self.decisions
            return reply

    def _reply(self, decision: Decision):
        table = self.state.instances

        def address(instance_id):
            return table.addresses[table.slot_of[instance_id]] if instance_id else ""

        reply = messages.ScheduleReply(
            request_id=decision.request_id, accepted=decision.accepted,
            reject_reason=decision.reason.value if decision.reason else "", retry_after_s=decision.retry_after_s,
            prefill_id=decision.prefill or "", prefill_address=address(decision.prefill),
            decode_id=decision.decode or "", decode_address=address(decision.decode),
            prefix_blocks=decision.prefix_blocks, predicted_queue_s=decision.queue_s,
            predicted_prefill_s=decision.prefill_s, predicted_ttft_s=decision.predicted_ttft_s,
            predicted_tbt_s=decision.predicted_tbt_s)
        if decision.transfer is not None:
            plan = decision.transfer
            reply.transfer.CopyFrom(messages.TransferPlan(
                source_id=plan.source, source_address=address(plan.source), block_keys=plan.keys,
                n_bytes=plan.n_bytes, predicted_s=plan.seconds))
        return reply

    @_rpc
    def ReportRequest(self, request, context):
        kinds, state = messages.RequestEvent, self.state
        with self.lock:
            now = self.clock()
            if request.kind == kinds.DROPPED:
                known = state.dropped(request.request_id)
            else:
                milestone = {kinds.PREFILL_DONE: state.prefill_done, kinds.DECODE_STARTED: state.decode_started,
                             kinds.FINISHED: state.finished}.get(request.kind)
                if milestone is None:
                    raise ValueError(f"unknown request event kind {request.kind}")
                known = milestone(request.request_id, now)
        if not known:
            raise UnknownRequest(f"request {request.request_id!r} is not in flight")
        return messages.Ack()

    @_rpc
    def ListInstances(self, request, context):
        with self.lock:
            state, now = self.state, self.clock()
            table = state.instances
            batch, _ = state.ledger.per_slot(state.ledger.committed(now, state.decode_time_s, now), table.capacity)
            reply = messages.InstanceList(indexed_blocks=len(state.index), decode_time_s=state.decode_time_s,
                                          model=self.model, block_size=state.config.block_size)
            for instance_id, slot in sorted(table.slot_of.items()):
                reply.instances.add(
                    instance_id=instance_id, role=int(table.role[slot]), address=table.addresses[slot],
                    queued_s=max(0.0, table.queue_free_at[slot] - now), blocks=state.index.blocks_of(slot),
                    decoding=int(batch[slot]), seconds_since_heartbeat=now - table.last_seen[slot],
                    hardware=table.hardware[slot])
        return reply


def _config_field(request, name: str):
    """A field of the config an instance's registration carries (``config_json``), None when it carries none."""
    if not request.config_json:
        return None
    try:
        return json.loads(request.config_json).get(name)
    except (json.JSONDecodeError, AttributeError):
        return None


def _model_of(request) -> str:
    """The model an instance's registration names (its config's), "" when it names none."""
    return str(_config_field(request, "model") or "")


def _index_blocks_of(request) -> int:
    """The blocks an instance's pool can publish to the index, as its registration's config names them (DRAM tier
    plus SSD tier), 0 when it names none."""
    pool = _config_field(request, "pool")
    if not isinstance(pool, dict):
        return 0
    total = 0
    for tier in ("dram_blocks", "ssd_blocks"):
        value = pool.get(tier)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            total += value
    return total


def _max_batch_of(request) -> int | None:
    """The batch slots an instance's registration names (its config's ``max_batch``), None when it names none."""
    value = _config_field(request, "max_batch")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _costs(request):
    """The cost model a registration names: its profile JSON, else a built-in hardware + model pair."""
    if request.profile_json:
        return costs_from_profile(request.profile_json)
    if request.hardware and request.model:
        return instance_costs(request.hardware, request.model)
    raise ValueError("registration needs profile_json, or hardware and model (built-in profile names)")


class ConductorServer:
    """A running Conductor: gRPC server (with health and reflection) and its heartbeat sweeper."""

    def __init__(self, service: ConductorService, host: str = "127.0.0.1", port: int = 0, max_workers: int = 16,
                 sweep: bool = True, auth_token: str | None = None):
        self.service = service
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=server_options(),
                                   interceptors=(*interceptors(auth_token), DecodeGuard()))
        services.add_ConductorServicer_to_server(service, self._server)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection([SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME],
                                            self._server)
        self.port = add_port(self._server, join(host, port))
        if not self.port:
            raise OSError(f"cannot listen on {join(host, port)}")
        self.address = join(host, self.port)
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="conductor-sweeper", daemon=True)
        self._sweep = sweep

    def start(self) -> "ConductorServer":
        self._server.start()
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self._sweep:
            self._sweeper.start()
        log.info("conductor listening on %s", self.address)
        return self

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.service.heartbeat_interval_s):
            self.service.sweep()

    def stop(self, grace_s: float | None = 1.0) -> None:
        self._stop.set()
        self._health.enter_graceful_shutdown()
        self._server.stop(grace_s).wait()
        if self._sweeper.is_alive():
            self._sweeper.join()

    def __enter__(self) -> "ConductorServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(config: PolicyConfig | None = None, host: str = "127.0.0.1", port: int = 0, sweep: bool = True,
          auth_token: str | None = None, **service_options) -> ConductorServer:
    """Start a Conductor on ``host:port`` (port 0: a free one; see ``.port``) and return it running.

    ``service_options`` go to ``ConductorService`` (clock, heartbeat interval and timeout); ``sweep=False``
    leaves draining to explicit ``server.service.sweep()`` calls (tests on a fake clock).
    """
    return ConductorServer(ConductorService(config, **service_options), host, port, sweep=sweep,
                           auth_token=auth_token).start()
