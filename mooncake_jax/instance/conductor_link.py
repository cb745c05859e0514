"""An instance's connection to the Conductor: registration, heartbeats with load, KV events, request milestones.

A background thread sends a heartbeat every interval the Conductor asked for, and flushes the pool's KV events
(batched) at the same time and whenever enough have queued. When the Conductor answers NOT_FOUND (it restarted, or
drained this instance after missed heartbeats) the link registers again and re-sends its whole block list, which
is how a restarted Conductor rebuilds its index. A Conductor that cannot be reached is retried; the instance keeps
serving the requests it has.

KV event batches are numbered (1, 2, 3, ...; registration says which number its block lists include). A batch that
fails on the way is not re-sent piecemeal: the next flush sends the whole block list instead (a RESET batch), and
the Conductor, seeing a number skipped for any other reason, asks for the same; so its index never drifts silently.

At start, a Conductor that does not answer is retried with a doubling backoff, each try logged, for
``register_timeout_s`` seconds; then ``start`` raises. A Conductor that answers and refuses (another model) is not
retried.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import grpc

from ..proto import UNANSWERED, load
from ..proto.auth import open_channel
from ..transfer.events import BlockEvent, EventKind

log = logging.getLogger(__name__)
messages, services = load("conductor")

PREFILL, DECODE = "prefill", "decode"
RPC_TIMEOUT_S = 5.0
REGISTER_BACKOFF_FIRST_S = 0.5
REGISTER_BACKOFF_MAX_S = 10.0
UNREACHABLE_LOG_S = 10.0


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
        self.admits = False  # whether the cluster admits on its SLOs at all (its admission policy is not `none`)
        self._thread = threading.Thread(target=self._run, name=f"conductor-link-{instance_id}", daemon=True)
        self.ignored_keys: set[int] = set()  # keys never announced (a request's partial tail blocks)
        self.conductor_address = conductor_address
        self._seq = 0  # number of the last KV event batch sent (or lost on the way)
        self._resync = False  # the next flush sends the whole block list
        self.resyncs = 0

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self, register_timeout_s: float = 0.0) -> "ConductorLink":
        """Register (retrying a Conductor that does not answer for ``register_timeout_s``), then start the
        heartbeats. Raises the last ``grpc.RpcError`` when it is refused or the time is up."""
        deadline = time.monotonic() + register_timeout_s
        delay = REGISTER_BACKOFF_FIRST_S
        while True:
            try:
                self._register()
                break
            except grpc.RpcError as e:
                left = deadline - time.monotonic()
                if e.code() not in UNANSWERED or left <= 0 or self._stop.is_set():
                    raise
                wait_s = min(delay, left)
                log.warning("%s: the Conductor at %s does not answer (%s); retrying in %.1f s, giving up in %.0f s",
                            self.instance_id, self.conductor_address, e.code().name, wait_s, left)
                self._stop.wait(wait_s)
                delay = min(REGISTER_BACKOFF_MAX_S, delay * 2)
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
        seq = self._seq  # the block lists read below include every event of the batches sent so far
        dram, ssd = self._block_lists() if self._publish else ([], [])
        reply = self._stub.Register(messages.RegisterRequest(
            instance_id=self.instance_id, role=messages.PREFILL if self.role == PREFILL else messages.DECODE,
            address=self.address, profile_json=self._profile_json, kv_capacity_tokens=self._capacity,
            dram_block_keys=[k for k in dram if k not in self.ignored_keys],
            ssd_block_keys=[k for k in ssd if k not in self.ignored_keys], event_seq=seq, **self._described),
            timeout=RPC_TIMEOUT_S)
        self._resync = False
        self.interval_s = reply.heartbeat_interval_s
        self.ttft_slo_s, self.tbt_slo_s = reply.ttft_slo_s or None, reply.tbt_slo_s or None
        self.admits = reply.admits
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
        away_since = None  # when the Conductor stopped answering (logged once, then every UNREACHABLE_LOG_S)
        said_at = 0.0
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                self._flush_events()
                self._heartbeat()
                if away_since is not None:
                    log.info("%s: the Conductor answers again (after %.1f s)", self.instance_id,
                             time.monotonic() - away_since)
                    away_since = None
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self._reregister()
                    if away_since is not None:
                        log.info("%s: registered again with the Conductor (away %.1f s)", self.instance_id,
                                 time.monotonic() - away_since)
                        away_since = None
                elif not self._stop.is_set():
                    now = time.monotonic()
                    if away_since is None or now - said_at >= UNREACHABLE_LOG_S:
                        away_since = away_since or now
                        said_at = now
                        log.warning("%s: the Conductor at %s does not answer (%s) for %.0f s; serving on and "
                                    "retrying every %.1f s", self.instance_id, self.conductor_address, e.code().name,
                                    now - away_since, self.interval_s)

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
        if "prefill_slowdown" in load:
            request.prefill_slowdown = load["prefill_slowdown"]
        if "active" in load:
            request.reports_batch = True
            for request_id, kv_tokens in load["active"].items():
                request.active.add(request_id=request_id, kv_tokens=kv_tokens)
        self._stub.Heartbeat(request, timeout=RPC_TIMEOUT_S)

    def _flush_events(self) -> None:
        if self._resync:
            batch = self._whole_list()
        else:
            batch = messages.KvEventBatch(instance_id=self.instance_id)
        current = None
        while not self._resync and not self._events.empty():
            event = self._events.get_nowait()
            kind = messages.KvEvent.STORED if event.kind == EventKind.STORED else messages.KvEvent.REMOVED
            tier = messages.SSD if event.tier == "ssd" else messages.DRAM
            if current is None or current.kind != kind or current.tier != tier:
                current = batch.events.add(kind=kind, tier=tier)
            current.block_keys.append(event.key)
        if not batch.events:
            return
        self._seq += 1
        batch.seq = self._seq
        try:
            reply = self._stub.PublishKvEvents(iter([batch]), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:  # lost on the way: the next flush sends the whole list
                self._resync = True
            raise
        self._resync = False
        if reply.resync:
            log.warning("%s: the Conductor missed a KV event batch; re-sending the whole block list",
                        self.instance_id)
            self._resync = True
            self._wake.set()

    def _whole_list(self):
        """A batch replacing this instance's whole block list: RESET with the DRAM keys, then the SSD ones."""
        while not self._events.empty():  # the list read now supersedes them
            self._events.get_nowait()
        self.resyncs += 1
        dram, ssd = self._block_lists()
        batch = messages.KvEventBatch(instance_id=self.instance_id)
        batch.events.add(kind=messages.KvEvent.RESET, tier=messages.DRAM,
                         block_keys=[k for k in dram if k not in self.ignored_keys])
        batch.events.add(kind=messages.KvEvent.STORED, tier=messages.SSD,
                         block_keys=[k for k in ssd if k not in self.ignored_keys])
        return batch
