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
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..addresses import join, split
from ..conductor.profile import costs_from_profile
from ..llm import build_model
from ..model.engine import Engine
from ..model.llama import Llama
from ..proto import server_options
from ..proto.auth import interceptors
from ..proto.tls import add_port
from ..proto.guards import DecodeGuard, WorkGate
from ..transfer import BlockPool, BlockSpec
from ..transfer.messenger import MessengerClient
from ..transfer.messenger_server import add_messenger
from ..sharding.layout import MeshLayout
from ..sharding.spmd import SpmdLayout
from ..sharding.step_channel import StepChannel
from ..sharding.mesh import MeshSpec
from .calibrate import calibrate
from .config import InstanceConfig
from .devices import instance_devices
from .conductor_link import DECODE, PREFILL, ConductorLink
from ..engine.runner_loop import RunnerLoop, wait
from ..engine.transfer_workers import TransferWorkers

log = logging.getLogger(__name__)

INSTANCE_SERVICE, MESSENGER_SERVICE = "mooncake.v1.Instance", "mooncake.v1.Messenger"
MESSENGER_CALLS = 32
"""Concurrent block transfers a peer may run against one instance (pushes from prefill instances, fetches)."""


def build_engine(config: InstanceConfig, model: Llama) -> Engine:
    """The instance's engine: over its local devices, or (``num_processes`` > 1) over the global mesh of all its
    processes as one SPMD program, which process 0 drives and the others follow (``distributed.py``)."""
    spec = MeshSpec(stage=config.pipeline_stages, tensor=config.tensor_parallel)
    if config.num_processes > 1:
        layout = SpmdLayout(model.cfg, spec, channel=StepChannel())
    else:
        devices = instance_devices(config)
        layout = MeshLayout(model.cfg, spec, devices) if spec.devices > 1 or devices is not None else None
    return Engine(model, num_pages=config.num_pages, max_batch=config.max_batch,
                  prefill_chunk_size=config.prefill_chunk_size, layout=layout, bucket_factor=config.bucket_factor)


def advertised_address(advertise: str, host: str, port: int) -> str:
    """The address this instance registers: ``advertise`` (HOST:PORT, or HOST with the bound ``port``) when given,
    else where it listens."""
    if not advertise:
        return join(host, port)
    named_host, named_port = split(advertise)
    return join(named_host, named_port if named_port.isdigit() else port)


class RegistrationError(RuntimeError):
    """The Conductor refused (or could not be asked to take) this instance; the message says why."""


class InstanceServer:
    """One prefill or decode instance. ``model`` may be shared with other in-process instances (read only)."""

    def __init__(self, config: InstanceConfig, model: Llama | None = None):
        self.config = config
        self.instance_id = config.instance_id
        self.model = model or build_model(config.model, dtype=config.dtype, block_size=config.block_size,
                                          seed=config.seed)
        cfg = self.model.cfg
        config.validate_for(cfg)
        for name in ("dtype", "block_size"):
            if getattr(config, name) is not None and getattr(config, name) != getattr(cfg, name):
                raise ValueError(f"the model given has {name} {getattr(cfg, name)!r}, the config asks for "
                                 f"{getattr(config, name)!r}")
        self.engine = build_engine(config, self.model)
        self.kv_layout = dataclasses.replace(config.kv_layout(cfg),
                                             dtype=self.engine.kv_dtype.name)
        self.loop = RunnerLoop(self.engine, name=f"engine-{config.instance_id}", max_waiting=config.max_waiting,
                               join_budget_steps=config.join_budget_steps if config.role == DECODE else None)
        self.transfers = TransferWorkers(config.transfer_workers, max(config.max_waiting, config.transfer_workers),
                                         name=f"transfer-{config.instance_id}")
        self.link: ConductorLink | None = None
        self.pool = BlockPool(BlockSpec(cfg.block_shape(), self.engine.kv_dtype),
                              dram_blocks=config.pool.dram_blocks, ssd_path=config.pool.ssd_path,
                              ssd_blocks=config.pool.ssd_blocks, on_event=self._on_pool_event)
        # admission before grpcio's queue (proto/guards.py): work calls beyond the scheduler's own bounds are
        # refused at once, and Stats and health always find a thread
        engine_calls = (config.max_batch + config.max_waiting if config.role == DECODE
                        else config.max_waiting + config.transfer_workers + 1)
        self.work_gate = WorkGate({INSTANCE_SERVICE: engine_calls, MESSENGER_SERVICE: MESSENGER_CALLS},
                                  name=f"{config.role} instance {config.instance_id}")
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.work_gate.threads),
                                   options=server_options(),
                                   interceptors=(*interceptors(config.auth_token), DecodeGuard(), self.work_gate))
        # the socket data plane listens where the gRPC server does and its offers name the advertised host
        self.messenger_meter = add_messenger(self._server, self.pool, data_host=config.host,
                                             data_advertise=config.data_advertise,
                                             serve_socket=config.data_plane != "grpc")
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = add_port(self._server, join(config.host, config.port))
        if not self.port:
            raise ValueError(f"cannot listen on {config.host}:{config.port}")
        self.address = advertised_address(config.advertise, config.host, self.port)
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
    def ttft_slo_s(self) -> float | None:
        """The cluster's TTFT SLO, as the Conductor handed it out at registration (None before, and where the
        cluster admits everything: admission ``none``)."""
        return self.link.ttft_slo_s if self.link is not None and self.link.admits else None

    @property
    def tbt_slo_s(self) -> float | None:
        """The cluster's TBT SLO, as the Conductor handed it out at registration (None before)."""
        return self.link.tbt_slo_s if self.link is not None else None

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
                client = self._clients[address] = MessengerClient(
                    address, self.pool, timeout_s=self.config.request_timeout_s, auth_token=self.config.auth_token,
                    data_plane=self.config.data_plane, data_host=self.config.host,
                    data_advertise=self.config.data_advertise)
            return client

    def start(self) -> "InstanceServer":
        self.loop.start()
        if self.config.warmup:
            prefill = self.config.role == PREFILL
            t = time.perf_counter()
            n = wait(self.loop.submit(lambda engine: engine.warmup(prefill=prefill, decode=not prefill)), 1800)
            if prefill and self.config.layerwise:  # the layer-by-layer programs too (transfer/layerwise_warmup.py)
                from ..transfer.layerwise_warmup import warm_layerwise

                n += wait(self.loop.submit(warm_layerwise), 1800)
            log.info("%s: compiled %d step shapes in %.1f s", self.instance_id, n, time.perf_counter() - t)
        profile = self.config.profile_json
        if profile is None:
            log.info("%s: measuring the engine for its cost profile", self.config.instance_id)
            layerwise = self.config.role == PREFILL and self.config.layerwise  # the path it serves
            profile = wait(self.loop.submit(lambda engine: calibrate(
                engine, self.config.instance_id, self.config.model, self.kv_capacity_tokens, layerwise=layerwise)), 600)
        self.profile_json = profile
        self.costs = costs_from_profile(profile)
        self._server.start()
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.link = ConductorLink(
            self.config.conductor_address, self.config.instance_id, self.config.role, self.address, profile,
            self.kv_capacity_tokens, load=self.service.load, block_lists=self._block_lists,
            publish_events=self.config.role == PREFILL, auth_token=self.config.auth_token,
            config_json=self.config.to_json(), kv_layout=self.kv_layout.to_json(), hardware=self.config.hardware,
            model=self.config.model)
        try:
            self.link.start(register_timeout_s=self.config.conductor_wait_s)
        except grpc.RpcError as e:  # refused (say, KV of another model) or unreachable: take everything down
            self.stop()
            raise RegistrationError(f"{self.instance_id}: the Conductor at {self.config.conductor_address} did not "
                                    f"register it: {e.code().name}: {e.details()}") from None
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
        values["engine_kv_usage"] = self.engine.pages_in_use / max(1, self.engine.num_pages - 1)  # 0..1, as vLLM's
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
