"""``mj.Cluster``: a local disaggregated cluster, as a Python object.

    with mj.Cluster.local(model="tiny", prefill=2, decode=1) as cluster:
        cluster.generate([[1, 5, 9], [1, 7]], max_new_tokens=16)

It starts a Conductor, P prefill and D decode instances and a ``ClusterBackend`` that routes requests through them
(the gateway serves the same backend over gRPC and HTTP). Instances run in this process (``processes=False``, the
default: quick to start, they share the model's weights) or each in its own process (``processes=True``, what
``mooncake-jax serve`` does). The first instance measures the engine for the cost profile every instance then
registers with.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..conductor.api import PolicyConfig
from ..conductor.service import serve as serve_conductor
from ..gateway.backend import Finished, GenerateRequest, TokenOut
from ..llm import build_model
from ..model.compile_cache import enable_compilation_cache
from ..model.config import get_config
from .backend import ClusterBackend
from .conductor_link import DECODE, PREFILL
from .server import InstanceConfig, InstanceServer
from .supervise import Supervisor, exit_reason, tail

log = logging.getLogger(__name__)


PREFILL_NICENESS = 5
"""How much lower a local cluster's prefill processes run than its decode processes when all share one host's cores:
a decode step stalled behind a prefill is a token gap every running request sees (TBT), while a prefill is
throughput work whose delay the Conductor already counts as queue time. On Linux they run as SCHED_IDLE instead
(a decode thread that wakes preempts them at once; measured on the demo, 2 cores: decode-side token interval p99
17 -> 8-9 ms, client TBT p99 0.025-0.033 -> 0.012-0.018 s, TTFT unchanged); where that is not available, this many
nice levels lower. Nothing changes where the roles have their own machines, as in the paper's deployment."""


def lower_priority(pid: int, niceness: int) -> None:
    """Run process ``pid`` (and the threads it creates from now on) as background work: SCHED_IDLE where the OS
    has it, else ``niceness`` levels below this process; a warning, never an error, where neither is permitted."""
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, pid, os.getpriority(os.PRIO_PROCESS, 0) + niceness)
    except (AttributeError, OSError) as e:  # not on this platform, or not permitted: run at our priority
        log.warning("could not lower the priority of process %d: %s", pid, e)


class ChildInstance:
    """An instance process (``instance/main.py``), tied to this process through its standard input."""

    def __init__(self, args: list[str], log_path: Path | None, timeout_s: float = 600.0,
                 auth_token: str | None = None, niceness: int = 0):
        self.log_path = log_path
        self.log_file = open(log_path, "ab") if log_path else subprocess.DEVNULL
        if auth_token:
            args = [*args, "--auth-token-stdin"]
        self.proc = subprocess.Popen([sys.executable, "-m", "mooncake_jax.instance.main", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file)
        if niceness:
            lower_priority(self.proc.pid, niceness)
        if auth_token:  # not on the command line, where every user of the machine could read it
            self.proc.stdin.write(auth_token.encode() + b"\n")
            self.proc.stdin.flush()
        self.info = self._ready(timeout_s)
        self.instance_id, self.address = self.info["instance_id"], self.info["address"]

    def _ready(self, timeout_s: float) -> dict:
        result: dict = {}

        def read():
            line = self.proc.stdout.readline()
            if line:
                result.update(json.loads(line))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not result.get("ready"):
            self.kill()
            if self.log_file is not subprocess.DEVNULL:
                self.log_file.flush()
            lines = tail(self.log_path)
            where = f"its log {self.log_path} ends:\n{lines}" if lines else "it wrote no log"
            raise RuntimeError(f"instance process did not start ({exit_reason(self.proc.returncode)}); {where}")
        return result

    def kill(self) -> None:
        """Abrupt death (tests of failure handling)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream:
                stream.close()
        if self.log_file is not subprocess.DEVNULL:
            self.log_file.close()


class Cluster:
    """A running local cluster (use ``Cluster.local``)."""

    def __init__(self, conductor, instances: dict, backend: ClusterBackend, model_name: str):
        self.conductor = conductor
        self.instances = instances  # instance id -> InstanceServer or ChildInstance
        self.backend = backend
        self.model_name = model_name
        self.gateway = None
        self.auth_token = None
        self.supervisor: Supervisor | None = None
        self.log_dir: Path | None = None
        self._closed = False

    def serve_gateway(self, *, host: str = "127.0.0.1", grpc_port: int | None = 0, http_port: int | None = 0,
                      auth_token: str | None = None, **options):
        """Start the client-facing gateway (gRPC and OpenAI HTTP) over this cluster; stopped by ``close``.
        ``options`` go to ``GatewayServer`` (tokenizer, chat_template, HTTP limits)."""
        from ..gateway import GatewayServer

        if self.gateway is not None:
            raise ValueError("this cluster already serves a gateway")
        self.gateway = GatewayServer(self.backend, host=host, grpc_port=grpc_port, http_port=http_port,
                                     auth_token=auth_token or self.auth_token, model_name=self.model_name,
                                     **options).start()
        return self.gateway

    @classmethod
    def local(cls, model: str = "tiny", prefill: int = 2, decode: int = 1, *, processes: bool = False,
              policy: str = "kvcache-centric", admission: str = "predictive", ttft_slo_s: float = 30.0,
              tbt_slo_s: float = 1.0, seed: int = 0, prefill_chunk_size: int = 512, max_batch: int = 32,
              num_pages: int | None = None, pool_dram_blocks: int = 8192, layerwise: bool = False,
              heartbeat_interval_s: float = 0.5, heartbeat_timeout_s: float = 3.0,
              kvcache_balancing_threshold: float = 1.0, profile_json: str | None = None,
              log_dir: str | Path | None = None, host: str = "127.0.0.1", warmup: bool = True,
              compile_cache: str | Path | None = "", auth_token: str | None = None,
              supervise: bool = True) -> "Cluster":
        """Start a Conductor with ``prefill`` + ``decode`` instances of ``model`` on this machine.

        ``warmup`` compiles every step shape before an instance registers (first requests do not wait for XLA);
        ``compile_cache`` is the persistent XLA cache folder ("" for the user's cache directory, None for none),
        so later starts load the programs instead of compiling them. ``auth_token`` is required on every RPC
        between the cluster's processes (and by ``serve_gateway`` unless it is given its own).

        With ``processes``, each instance logs to ``log_dir`` (default: a new folder per run under the system's
        temporary directory, see ``.log_dir``) and, with ``supervise``, a crashed instance process is restarted
        (``instance/supervise.py``).
        """
        for name, value in (("prefill", prefill), ("decode", decode)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"a cluster needs at least one {name} instance, got {value!r}")
        cfg = get_config(model)
        config = PolicyConfig(strategy=policy, admission=admission, block_size=cfg.block_size,
                              ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s,
                              kvcache_balancing_threshold=kvcache_balancing_threshold, seed=seed)
        conductor = serve_conductor(config, host=host, heartbeat_interval_s=heartbeat_interval_s,
                                    heartbeat_timeout_s=heartbeat_timeout_s, auth_token=auth_token)
        instances: dict = {}
        try:
            common = dict(conductor_address=conductor.address, model=model, seed=seed, host=host,
                          prefill_chunk_size=prefill_chunk_size, max_batch=max_batch, num_pages=num_pages,
                          pool_dram_blocks=pool_dram_blocks, tbt_slo_s=tbt_slo_s, warmup=warmup,
                          auth_token=auth_token)
            roles = [(PREFILL, i) for i in range(prefill)] + [(DECODE, i) for i in range(decode)]
            if processes:
                starter = _ProcessStarter(common, layerwise, Path(log_dir) if log_dir else None, compile_cache)
            else:
                if compile_cache is not None:
                    enable_compilation_cache(compile_cache or None)
                starter = _InProcessStarter(common, layerwise, build_model(model, seed=seed))
            first = starter.start(*roles[0], profile_json)
            instances[first.instance_id] = first
            profile_json = starter.profile_of(first)
            with ThreadPoolExecutor(max(1, len(roles) - 1)) as pool:
                rest = list(pool.map(lambda role_index: starter.start(*role_index, profile_json), roles[1:]))
            instances.update({inst.instance_id: inst for inst in rest})
        except BaseException:
            for inst in instances.values():
                inst.stop()
            conductor.stop()
            raise
        backend = ClusterBackend(conductor.address, cfg, model_name=model, auth_token=auth_token)
        cluster = cls(conductor, instances, backend, model)
        cluster.auth_token = auth_token
        if processes and supervise:
            cluster.log_dir = starter.log_dir
            roles_of = {f"{role}-{index}": (role, index) for role, index in roles}
            # a restart skips the warm-up: back in seconds instead of a minute of compiling on a loaded host (its
            # programs compile, or load from the persistent cache, on first use), so the cluster heals quickly
            cluster.supervisor = Supervisor(instances, lambda instance_id: starter.start(
                *roles_of[instance_id], profile_json, warmup=False)).start()
        return cluster

    def addresses(self) -> list[tuple[str, str]]:
        """(name, address) of the Conductor and every instance."""
        return [("conductor", self.conductor.address)] + [(i, inst.address) for i, inst in self.instances.items()]

    # ---- using it ------------------------------------------------------------------------------------------
    def stream(self, prompt, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, cancelled: threading.Event | None = None):
        """Yields ``TokenOut`` items then a ``Finished`` (raises InvalidRequest / Rejected / Unavailable)."""
        request = GenerateRequest(prompt=list(prompt), max_tokens=max_new_tokens, temperature=temperature,
                                  top_p=top_p, seed=seed)
        return self.backend.generate(request, cancelled)

    def generate(self, prompts, max_new_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int = 0) -> list[list[int]]:
        """New tokens for each prompt; the prompts run concurrently through the cluster."""
        def one(prompt):
            return [item.token for item in self.stream(prompt, max_new_tokens, temperature, top_p, seed)
                    if isinstance(item, TokenOut)]

        with ThreadPoolExecutor(max(1, min(32, len(prompts)))) as pool:
            return list(pool.map(one, prompts))

    def run(self, prompt, **kwargs) -> tuple[list[int], Finished]:
        """(tokens, Finished) of one request."""
        tokens, finished = [], None
        for item in self.stream(prompt, **kwargs):
            if isinstance(item, TokenOut):
                tokens.append(item.token)
            else:
                finished = item
        return tokens, finished

    def stats(self) -> dict[str, float]:
        """The router's counters and every live instance's figures (``name{instance="id"}``)."""
        return self.backend.stats()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.gateway is not None:
            self.gateway.stop()
        if self.supervisor is not None:
            self.supervisor.stop()
        self.backend.close()
        for inst in self.instances.values():
            inst.stop()
        self.conductor.stop()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _InProcessStarter:
    def __init__(self, common: dict, layerwise: bool, model):
        self.common, self.layerwise, self.model = common, layerwise, model

    def start(self, role: str, index: int, profile_json: str | None) -> InstanceServer:
        config = InstanceConfig(role=role, instance_id=f"{role}-{index}", profile_json=profile_json,
                                layerwise=self.layerwise and role == PREFILL, **self.common)
        return InstanceServer(config, self.model).start()

    @staticmethod
    def profile_of(instance: InstanceServer) -> str:
        return instance.profile_json


class _ProcessStarter:
    def __init__(self, common: dict, layerwise: bool, log_dir: Path | None, compile_cache):
        if log_dir is None:  # kept after the run: the logs of a crash are what its operator reads next
            log_dir = Path(tempfile.mkdtemp(prefix=f"mooncake-run-{time.strftime('%Y%m%d-%H%M%S')}-"))
        self.common, self.layerwise, self.log_dir = common, layerwise, log_dir
        self.compile_cache = "none" if compile_cache is None else str(compile_cache)
        self._profile_dir = tempfile.TemporaryDirectory(prefix="mooncake-profile-")
        log_dir.mkdir(parents=True, exist_ok=True)
        log.info("instance logs in %s", log_dir)

    def start(self, role: str, index: int, profile_json: str | None, warmup: bool | None = None) -> ChildInstance:
        c = self.common
        instance_id = f"{role}-{index}"
        args = ["--role", role, "--conductor", c["conductor_address"], "--model", c["model"],
                "--instance-id", instance_id, "--host", c["host"], "--seed", str(c["seed"]),
                "--prefill-chunk-size", str(c["prefill_chunk_size"]), "--max-batch", str(c["max_batch"]),
                "--pool-dram-blocks", str(c["pool_dram_blocks"]), "--tbt-slo-s", str(c["tbt_slo_s"])]
        if c["num_pages"]:
            args += ["--num-pages", str(c["num_pages"])]
        if self.layerwise and role == PREFILL:
            args.append("--layerwise")
        if not (c["warmup"] if warmup is None else warmup):
            args.append("--no-warmup")
        args += ["--compile-cache", self.compile_cache]
        if profile_json:
            path = Path(self._profile_dir.name) / "profile.json"
            if not path.exists():
                path.write_text(profile_json)
            args += ["--profile-file", str(path)]
        log_path = self.log_dir / f"{instance_id}.log"
        return ChildInstance(args, log_path, auth_token=c["auth_token"],
                             niceness=PREFILL_NICENESS if role == PREFILL else 0)

    @staticmethod
    def profile_of(instance: ChildInstance) -> str:
        return instance.info["profile_json"]
