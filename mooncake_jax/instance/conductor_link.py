"""An instance's connection to the Conductor: registration, heartbeats with load, KV events, request milestones.

A background thread sends a heartbeat every interval the Conductor asked for, and flushes the pool's KV events
(batched) at the same time and whenever enough have queued. When the Conductor answers NOT_FOUND (it restarted, or
drained this instance after missed heartbeats) the link registers again and re-sends its whole block list, which
is how a restarted Conductor rebuilds its index. A Conductor that cannot be reached is retried; the instance keeps
serving the requests it has.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import grpc

from ..proto import load
from ..proto.auth import open_channel
from ..transfer.events import BlockEvent, EventKind

log = logging.getLogger(__name__)
messages, services = load("conductor")

PREFILL, DECODE = "prefill", "decode"
RPC_TIMEOUT_S = 5.0


class ConductorLink:
    """Registers ``instance_id`` (at ``address``, with cost ``profile_json``) and keeps the Conductor informed.

    ``load()`` returns the heartbeat's load fields (``queued_s`` and/or ``active``: request id -> KV tokens);
    ``block_lists()`` returns (DRAM keys, SSD keys) for re-registration; ``publish_events`` says whether this
    instance's pool events go to the Conductor's index (prefill instances: yes).
    """

    def __init__(self, conductor_address: str, instance_id: str, role: str, address: str, profile_json: str,
                 kv_capacity_tokens: int, load: Callable[[], dict], block_lists: Callable[[], tuple[list, list]],
                 publish_events: bool = True, auth_token: str | None = None, config_json: str = "",
                 kv_layout: str = "", hardware: str = "", model: str = ""):
        if role not in (PREFILL, DECODE):
            raise ValueError(f"role must be {PREFILL!r} or {DECODE!r}, got {role!r}")
        self.instance_id, self.role, self.address = instance_id, role, address
        self._profile_json, self._capacity = profile_json, kv_capacity_tokens
        self._load, self._block_lists, self._publish = load, block_lists, publish_events
        self._channel = open_channel(conductor_address, auth_token)
        self._stub = services.ConductorStub(self._channel)
        self._events: queue.Queue[BlockEvent] = queue.Queue()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.interval_s = 1.0
        self._described = dict(config_json=config_json, kv_layout=kv_layout, hardware=hardware, model=model)
        self.ttft_slo_s: float | None = None  # the cluster's SLOs, as the Conductor hands them out at registration
        self.tbt_slo_s: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"conductor-link-{instance_id}", daemon=True)
        self.ignored_keys: set[int] = set()  # keys never announced (a request's partial tail blocks)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> "ConductorLink":
        self._register()
        self._thread.start()
        return self

    def stop(self, deregister: bool = True) -> None:
        """Stop heartbeats (and say goodbye unless ``deregister`` is False); a second call does nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(5)
        if deregister:
            try:
                self._stub.Deregister(messages.DeregisterRequest(instance_id=self.instance_id),
                                      timeout=RPC_TIMEOUT_S)
            except grpc.RpcError:
                pass
        self._channel.close()

    def _register(self) -> None:
        dram, ssd = self._block_lists() if self._publish else ([], [])
        reply = self._stub.Register(messages.RegisterRequest(
            instance_id=self.instance_id, role=messages.PREFILL if self.role == PREFILL else messages.DECODE,
            address=self.address, profile_json=self._profile_json, kv_capacity_tokens=self._capacity,
            dram_block_keys=[k for k in dram if k not in self.ignored_keys],
            ssd_block_keys=[k for k in ssd if k not in self.ignored_keys], **self._described),
            timeout=RPC_TIMEOUT_S)
        self.interval_s = reply.heartbeat_interval_s
        self.ttft_slo_s, self.tbt_slo_s = reply.ttft_slo_s or None, reply.tbt_slo_s or None
        log.info("%s registered with the Conductor (heartbeat every %.2f s)", self.instance_id, self.interval_s)

    # ---- events and milestones ---------------------------------------------------------------------------------
    def on_pool_event(self, event: BlockEvent) -> None:
        """Pool listener (runs under the pool's lock): only queues."""
        if self._publish and event.key not in self.ignored_keys:
            self._events.put(event)
            if self._events.qsize() >= 256:
                self._wake.set()

    def report(self, request_id: str, kind: str) -> None:
        """Tell the Conductor a request reached a milestone (PREFILL_DONE, DECODE_STARTED, FINISHED, DROPPED)."""
        try:
            self._stub.ReportRequest(messages.RequestEvent(request_id=request_id,
                                                           kind=getattr(messages.RequestEvent, kind)),
                                     timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:  # the Conductor forgot the request (restart) or is away: not the client's problem
            log.debug("report %s %s: %s", request_id, kind, e.code())
        except ValueError:  # the link was stopped (channel closed) while a request was still ending
            log.debug("report %s %s: the link is stopped", request_id, kind)

    # ---- the thread ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                self._flush_events()
                self._heartbeat()
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self._reregister()
                elif not self._stop.is_set():
                    log.warning("%s: Conductor unreachable (%s); retrying", self.instance_id, e.code())

    def _reregister(self) -> None:
        while not self._events.empty():  # the full block list below supersedes them
            self._events.get_nowait()
        try:
            self._register()
        except grpc.RpcError as e:
            log.warning("%s: re-registration failed (%s)", self.instance_id, e.code())

    def _heartbeat(self) -> None:
        load = self._load()
        request = messages.HeartbeatRequest(instance_id=self.instance_id)
        if "queued_s" in load:
            request.queued_s = load["queued_s"]
        if "active" in load:
            request.reports_batch = True
            for request_id, kv_tokens in load["active"].items():
                request.active.add(request_id=request_id, kv_tokens=kv_tokens)
        self._stub.Heartbeat(request, timeout=RPC_TIMEOUT_S)

    def _flush_events(self) -> None:
        batch = messages.KvEventBatch(instance_id=self.instance_id)
        current = None
        while not self._events.empty():
            event = self._events.get_nowait()
            kind = messages.KvEvent.STORED if event.kind == EventKind.STORED else messages.KvEvent.REMOVED
            tier = messages.SSD if event.tier == "ssd" else messages.DRAM
            if current is None or current.kind != kind or current.tier != tier:
                current = batch.events.add(kind=kind, tier=tier)
            current.block_keys.append(event.key)
        if batch.events:
            self._stub.PublishKvEvents(iter([batch]), timeout=RPC_TIMEOUT_S)
