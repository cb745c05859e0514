"""An instance process's parts, wired together: engine + its loop thread, KV pool, one gRPC server (the Instance
service, the Messenger and health), and the link to the Conductor.

``InstanceServer(config).start()`` brings them up in order (the engine is calibrated first unless a profile is
given, which also compiles what serving will run), registers with the Conductor, and ``stop()`` takes them down
in reverse, deregistering first so no new work arrives.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..conductor.profile import costs_from_profile
from ..llm import build_model
from ..model.engine import Engine
from ..model.llama import Llama
from ..proto import server_options
from ..proto.auth import interceptors
from ..proto.guards import DecodeGuard, WorkGate
from ..transfer import BlockPool, BlockSpec
from ..transfer.messenger import MessengerClient
from ..transfer.messenger_server import add_messenger
from .calibrate import calibrate
from .conductor_link import DECODE, PREFILL, ConductorLink
from ..engine.runner_loop import RunnerLoop, wait
from ..engine.scheduler import DEFAULT_MAX_WAITING
from ..engine.transfer_workers import TransferWorkers

log = logging.getLogger(__name__)

INSTANCE_SERVICE, MESSENGER_SERVICE = "mooncake.v1.Instance", "mooncake.v1.Messenger"
MESSENGER_CALLS = 32
"""Concurrent block transfers a peer may run against one instance (pushes from prefill instances, fetches)."""


@dataclasses.dataclass
class InstanceConfig:
    """Everything an instance needs to start (also its command line, see ``main.py``)."""

    role: str
    conductor_address: str
    model: str = "tiny"
    instance_id: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    seed: int = 0
    dtype: str | None = None
    prefill_chunk_size: int = 512
    max_batch: int = 32
    num_pages: int | None = None
    pool_dram_blocks: int = 8192
    pool_ssd_path: str | None = None
    layerwise: bool = False
    tbt_slo_s: float = 1.0
    profile_json: str | None = None
    request_timeout_s: float = 120.0
    warmup: bool = True  # compile every step shape of its role before registering
    auth_token: str | None = None  # required on every RPC to this instance (and sent on its own calls)
    bucket_factor: int = 4  # prefill chunk lengths grow 4x: fewer programs to compile per instance
    max_waiting: int = DEFAULT_MAX_WAITING  # requests queued for the engine beyond this: RESOURCE_EXHAUSTED
    transfer_workers: int = 4  # threads for pool / SSD / Messenger I/O (never on the engine's thread)
    def __post_init__(self):
        if self.role not in (PREFILL, DECODE):
            raise ValueError(f"role must be {PREFILL!r} or {DECODE!r}, got {self.role!r}")
        self.instance_id = self.instance_id or f"{self.role}-{uuid.uuid4().hex[:8]}"


class InstanceServer:
    """One prefill or decode instance. ``model`` may be shared with other in-process instances (read only)."""

    def __init__(self, config: InstanceConfig, model: Llama | None = None):
        self.config = config
        self.instance_id = config.instance_id
        self.model = model or build_model(config.model, dtype=config.dtype, seed=config.seed)
        cfg = self.model.cfg
        self.engine = Engine(self.model, num_pages=config.num_pages, max_batch=config.max_batch,
                             prefill_chunk_size=config.prefill_chunk_size,
                             bucket_factor=config.bucket_factor)
        self.loop = RunnerLoop(self.engine, name=f"engine-{config.instance_id}", max_waiting=config.max_waiting)
        self.transfers = TransferWorkers(config.transfer_workers, max(config.max_waiting, config.transfer_workers),
                                         name=f"transfer-{config.instance_id}")
        self.link: ConductorLink | None = None
        self.pool = BlockPool(BlockSpec(cfg.block_shape(), self.engine.runner.kv[0][0].dtype),
                              dram_blocks=config.pool_dram_blocks, ssd_path=config.pool_ssd_path,
                              on_event=self._on_pool_event)
        # admission before grpcio's queue (proto/guards.py): work calls beyond the scheduler's own bounds are
        # refused at once, and Stats and health always find a thread
        engine_calls = (config.max_batch + config.max_waiting if config.role == DECODE
                        else config.max_waiting + config.transfer_workers + 1)
        self.work_gate = WorkGate({INSTANCE_SERVICE: engine_calls, MESSENGER_SERVICE: MESSENGER_CALLS},
                                  name=f"{config.role} instance {config.instance_id}")
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.work_gate.threads),
                                   options=server_options(),
                                   interceptors=(*interceptors(config.auth_token), DecodeGuard(), self.work_gate))
        self.messenger_meter = add_messenger(self._server, self.pool)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = self._server.add_insecure_port(f"{config.host}:{config.port}")
        if not self.port:
            raise ValueError(f"cannot listen on {config.host}:{config.port}")
        self.address = f"{config.host}:{self.port}"
        self._clients: dict[str, MessengerClient] = {}
        self._clients_lock = threading.Lock()
        self.costs = None
        if config.role == PREFILL:
            from .prefill import PrefillService

            self.service = PrefillService(self)
        else:
            from .decode import DecodeService

            self.service = DecodeService(self)
        self.service.add_to_server(self._server)

    @property
    def kv_capacity_tokens(self) -> int:
        return (self.engine.num_pages - 1) * self.engine.block_size

    def _on_pool_event(self, event) -> None:
        if self.link is not None:
            self.link.on_pool_event(event)

    def messenger(self, address: str) -> MessengerClient:
        """A (cached) Messenger client to a peer instance."""
        with self._clients_lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = MessengerClient(address, self.pool,
                                                                  timeout_s=self.config.request_timeout_s,
                                                                  auth_token=self.config.auth_token)
            return client

    def start(self) -> "InstanceServer":
        self.loop.start()
        if self.config.warmup:
            prefill = self.config.role == PREFILL
            t = time.perf_counter()
            n = wait(self.loop.submit(lambda engine: engine.warmup(prefill=prefill, decode=not prefill)), 1800)
            log.info("%s: compiled %d step shapes in %.1f s", self.instance_id, n, time.perf_counter() - t)
        profile = self.config.profile_json
        if profile is None:
            log.info("%s: measuring the engine for its cost profile", self.config.instance_id)
            profile = wait(self.loop.submit(lambda engine: calibrate(
                engine, self.config.instance_id, self.config.model, self.kv_capacity_tokens)), 600)
        self.profile_json = profile
        self.costs = costs_from_profile(profile)
        self._server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.link = ConductorLink(
            self.config.conductor_address, self.config.instance_id, self.config.role, self.address, profile,
            self.kv_capacity_tokens, load=self.service.load, block_lists=self._block_lists,
            publish_events=self.config.role == PREFILL, auth_token=self.config.auth_token)
        self.link.start()
        log.info("%s instance %s listening on %s", self.config.role, self.config.instance_id, self.address)
        return self

    def _block_lists(self) -> tuple[list[int], list[int]]:
        by_tier = self.pool.keys_by_tier()
        return by_tier.get("dram", []), by_tier.get("ssd", [])

    def stats(self) -> dict[str, float]:
        values = {f"pool_{tier}_{name}": float(v) for tier, counters in self.pool.stats().items()
                  for name, v in counters.items() if isinstance(v, (int, float))}
        meter = self.messenger_meter.snapshot()
        values.update({f"messenger_{k}": float(v) for k, v in dataclasses.asdict(meter).items()
                       if isinstance(v, (int, float))})
        values.update(self.service.stats())
        values["engine_free_pages"] = float(self.engine.free_pages)
        values["engine_running"] = float(len(self.loop.running))
        values["engine_queued_jobs"] = float(self.loop.queued_jobs)
        values["rpc_refused_total"] = float(self.work_gate.refused)
        return values

    def stop(self, grace_s: float = 1.0) -> None:
        if self.link is not None:
            self.link.stop()
        self._health.enter_graceful_shutdown()
        self._server.stop(grace_s).wait()
        self.loop.stop()
        self.transfers.close()
        with self._clients_lock:
            for client in self._clients.values():
                client.close()
        self.pool.close()

    def __enter__(self) -> "InstanceServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
