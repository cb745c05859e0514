"""``mj.Cluster``: a local disaggregated cluster, as a Python object.

    with mj.Cluster.local(model="tiny", prefill=2, decode=1) as cluster:
        cluster.generate([[1, 5, 9], [1, 7]], max_new_tokens=16)

It starts a Conductor, P prefill and D decode instances and a ``ClusterBackend`` that routes requests through them
(the gateway serves the same backend over gRPC and HTTP). Instances run in this process (``processes=False``, the
default: quick to start, they share the model's weights) or each in its own process (``processes=True``, what
``mooncake-jax serve`` does). Instances may be unlike (per-role shapes, dtypes and page sizes, or a cluster file:
``cluster_spec.py``), each on its own devices; the first instance of each kind of engine measures it for the cost
profile the instances of that kind register with.
"""

from __future__ import annotations

import hashlib
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
from . import cpus
from .conductor_process import ConductorLauncher
from .cluster_spec import check_cluster, cluster_block_size, file_configs, role_configs
from .config import InstanceConfig
from .devices import reserve_cpu_devices
from .server import InstanceServer
from .supervise import Supervisor, exit_reason, tail

log = logging.getLogger(__name__)


PREFILL_NICENESS = 5
"""How much lower a local cluster's prefill processes run than its decode processes when all share one host's cores:
a decode step stalled behind a prefill is a token gap every running request sees (TBT), while a prefill is
throughput work whose delay the Conductor already counts as queue time. Nothing changes where the roles have their
own machines, as in the paper's deployment. Not SCHED_IDLE: measured, it cut the demo's TBT p99 further (0.025 ->
0.013-0.022 s) but on a host loaded by other work it starved prefill processes until they missed their heartbeats
and were drained from the Conductor (load 13, seven times in one run)."""

DECODE_NICENESS = -5
"""How much higher a local cluster's decode processes run than the launcher, where the launcher may raise a priority
(root, or CAP_SYS_NICE; elsewhere they keep the launcher's, said in one log line). On a shared host a decode step
also waits for a core behind the gateway, the Conductor and other users' work at the default priority, and each wait
is a gap in every running stream. Measured with `demo` on 2 cores beside other work at the default priority (load
5-7, three alternated pairs): TBT p99 0.023 / 0.035 / 0.015 s against 0.048 / 0.039 / 0.043 s at the launcher's
priority. A decode process steps only while it has requests, so it cannot hold the cores from the others for long."""


def renice(pid: int, niceness: int) -> None:
    """Run process ``pid`` ``niceness`` levels below this process (above it for a negative ``niceness``): each of
    its threads (Linux lists them in /proc; elsewhere only the main one) and the threads they create from now on.
    Where that is not permitted (raising needs root or CAP_SYS_NICE) the process keeps this one's priority, said in
    a log line, never an error. Called once the instance is ready: its start-up (calibration, warm-up) runs at
    this process's priority."""
    for tid in cpus.threads_of(pid):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, 0) + niceness)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
        except (AttributeError, OSError) as e:  # not on this platform, or not permitted: run at our priority
            (log.info if niceness < 0 else log.warning)(
                "could not %s the priority of process %d by %d levels (it keeps this process's): %s",
                "raise" if niceness < 0 else "lower", pid, abs(niceness), e)
            return


READY_TIMEOUT_S = 2400.0
"""How long an instance process may take to say it is ready: the budgets it gives itself (warm-up 1,800 s, calibration
600 s). A cold start of ``demo --hetero`` on 2 shared cores (load 9-12, empty compile cache) outran the 600 s this
was: the first prefill instance was killed in its warm-up, twice, before its layer-wise programs were compiled too
(measured then: 854 s of warm-up)."""


class ChildInstance:
    """An instance process (``instance/main.py``), or with ``command="conductor"`` the Conductor's, tied to this
    process through its standard input."""

    def __init__(self, args: list[str], log_path: Path | None, timeout_s: float = READY_TIMEOUT_S,
                 auth_token: str | None = None, niceness: int = 0, command: str = "instance"):
        self.command = command
        self.log_path = log_path
        self.log_file = open(log_path, "ab") if log_path else subprocess.DEVNULL
        if auth_token:
            args = [*args, "--auth-token-stdin"]
        # the same role command an operator runs (``mooncake-jax instance``), tied to this process by its stdin
        self.proc = subprocess.Popen([sys.executable, "-m", "mooncake_jax.cli", command, "--exit-with-stdin", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file)
        if auth_token:  # not on the command line, where every user of the machine could read it
            self.proc.stdin.write(auth_token.encode() + b"\n")
            self.proc.stdin.flush()
        self.info = self._ready(timeout_s)
        self.instance_id, self.address = self.info.get("instance_id", command), self.info["address"]
        if niceness:
            renice(self.proc.pid, niceness)

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
            raise RuntimeError(f"{self.command} process did not start ({exit_reason(self.proc.returncode)}); {where}")
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
        self.conductor_supervisor: Supervisor | None = None  # with the Conductor in its own process
        self.log_dir: Path | None = None
        self.configs: list[InstanceConfig] = []  # every instance's config, devices assigned
        self.cpus_before: tuple[int, ...] | None = None  # the launcher's cores before keep_off (cpus.py)
        self._closed = False

    def serve_gateway(self, *, host: str = "127.0.0.1", grpc_port: int | None = 0, http_port: int | None = 0,
                      auth_token: str | None = None, **options):
        """Start the client-facing gateway (gRPC and OpenAI HTTP) over this cluster; stopped by ``close``.
        ``options`` go to ``GatewayServer`` (model_name, tokenizer, chat_template, HTTP limits); its token feed is on
        unless ``token_feed=False`` (the gateway turns it off itself with a token or TLS)."""
        from ..gateway import GatewayServer

        if self.gateway is not None:
            raise ValueError("this cluster already serves a gateway")
        options.setdefault("token_feed", True)
        self.gateway = GatewayServer(self.backend, host=host, grpc_port=grpc_port, http_port=http_port,
                                     auth_token=auth_token or self.auth_token, **options).start()
        return self.gateway

    @classmethod
    def local(cls, model: str = "tiny", prefill: int = 2, decode: int = 1, *, processes: bool = False,
              policy: str = "kvcache-centric", admission: str = "predictive", ttft_slo_s: float = 30.0,
              tbt_slo_s: float = 1.0, seed: int = 0, prefill_shape: str | None = None,
              decode_shape: str | None = None, prefill_dtype: str | None = None, decode_dtype: str | None = None,
              prefill_block_size: int | None = None, decode_block_size: int | None = None,
              prefill_cpus: str | None = None, decode_cpus: str | None = None,
              prefill_num_pages: int | None = None, decode_num_pages: int | None = None,
              instances: list | None = None, cluster_file: str | Path | None = None,
              heartbeat_interval_s: float = 0.5, heartbeat_timeout_s: float = 3.0,
              kvcache_balancing_threshold: float = 1.0, profile_json: str | None = None,
              log_dir: str | Path | None = None, host: str = "127.0.0.1", warmup: bool = True,
              compile_cache: str | Path | None = "", auth_token: str | None = None,
              supervise: bool = True, conductor_process: bool | None = None, **instance_options) -> "Cluster":
        """Start a Conductor with ``prefill`` + ``decode`` instances of ``model`` on this machine.

        Instances are alike (``instance_options``: any ``InstanceConfig`` field, e.g. ``prefill_chunk_size``,
        ``max_batch``, ``num_pages``, ``dtype``, ``block_size``, ``layerwise`` (prefill only), ``pool_dram_blocks``,
        ``pool_ssd_path``), or shaped per role: ``prefill_shape="tensor=2,stage=2"``, ``decode_shape="tensor=4"``,
        ``prefill_dtype`` / ``decode_dtype``, ``prefill_block_size`` / ``decode_block_size``, KV pages of their engines
        ``prefill_num_pages`` / ``decode_num_pages`` (a layer-wise prefill instance keeps no KV in its engine
        between requests: it needs room for the prompts it prefills, not a decode batch's), host cores of their
        own ``prefill_cpus`` / ``decode_cpus`` (e.g. ``decode_cpus="1"``: ``cpus.py``); or listed one by one
        (``instances``: ``InstanceConfig`` s or their dicts; ``cluster_file``: JSON, see ``cluster_spec.py``).
        Instances spanning several devices get their own (``devices``, else the next free ones); everything is
        checked before anything starts.

        ``warmup`` compiles every step shape before an instance registers (first requests do not wait for XLA);
        ``compile_cache`` is the persistent XLA cache folder ("" for the user's cache directory, None for none),
        so later starts load the programs instead of compiling them. ``auth_token`` is required on every RPC
        between the cluster's processes (and by ``serve_gateway`` unless it is given its own).

        With ``processes``, each instance logs to ``log_dir`` (default: a new folder per run under the system's
        temporary directory, see ``.log_dir``) and, with ``supervise``, a crashed instance process is restarted
        (``instance/supervise.py``). The Conductor runs in its own process too (``conductor_process``, default:
        ``processes``), restarted on the same address when it dies (``conductor_process.py``).
        """
        configs = _instance_configs(model, prefill, decode, seed, warmup, instances, cluster_file, instance_options,
                                    {PREFILL: dict(shape=prefill_shape, dtype=prefill_dtype,
                                                   block_size=prefill_block_size, cpus=prefill_cpus,
                                                   num_pages=prefill_num_pages),
                                     DECODE: dict(shape=decode_shape, dtype=decode_dtype,
                                                  block_size=decode_block_size, cpus=decode_cpus,
                                                  num_pages=decode_num_pages)})
        model = configs[0].model
        # On the CPU platform, before JAX starts, ask for the devices the shapes need: instances in this process
        # run on them; instance processes are checked against them (each child asks for its own).
        reserve_cpu_devices(sum(c.device_count for c in configs), keep_flagged=True)
        import jax

        configs = check_cluster(model, configs, jax.device_count())
        if any(c.cpus for c in configs) and not processes:
            raise ValueError("cpus pin instance processes to cores: they need processes=True (instances in this "
                             "process share its cores)")
        cpus.check(configs)
        cpus_before = cpus.keep_off(configs)
        cfg = get_config(model)
        config = PolicyConfig(strategy=policy, admission=admission, block_size=cluster_block_size(model, configs),
                              ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s,
                              kvcache_balancing_threshold=kvcache_balancing_threshold, seed=seed)
        if conductor_process is None:
            conductor_process = processes
        log_dir = run_log_dir(log_dir) if processes or conductor_process else None
        if conductor_process:
            launcher = ConductorLauncher(config, host, heartbeat_interval_s, heartbeat_timeout_s, lambda args:
                                         ChildInstance(args, log_dir / "conductor.log", timeout_s=120.0,
                                                       auth_token=auth_token, command="conductor"))
            conductor = launcher.start()
        else:
            launcher = None
            conductor = serve_conductor(config, host=host, heartbeat_interval_s=heartbeat_interval_s,
                                        heartbeat_timeout_s=heartbeat_timeout_s, auth_token=auth_token)
        configs = [c.replace(conductor_address=conductor.address, host=host) for c in configs]
        instances: dict = {}
        try:
            if processes:
                starter = _ProcessStarter(auth_token, log_dir, compile_cache, jax.default_backend() == "cpu")
            else:
                if compile_cache is not None:
                    enable_compilation_cache(compile_cache or None)
                starter = _InProcessStarter(auth_token)
            # the first instance of each kind of engine measures it; the others of that kind reuse its profile
            profiles: dict = {}
            firsts = [c for i, c in enumerate(configs)
                      if profile_key(c) not in {profile_key(x) for x in configs[:i]}]
            for c in firsts:
                inst = starter.start(c, profile_json)
                instances[inst.instance_id] = inst
                profiles[profile_key(c)] = profile_json or starter.profile_of(inst)
            rest = [c for c in configs if c.instance_id not in instances]
            with ThreadPoolExecutor(max(1, len(rest))) as pool:
                started = list(pool.map(lambda c: starter.start(c, profiles[profile_key(c)]), rest))
            instances.update({inst.instance_id: inst for inst in started})
        except BaseException:
            for inst in instances.values():
                inst.stop()
            conductor.stop()
            cpus.pin(cpus_before)
            raise
        backend = ClusterBackend(conductor.address, cfg, model_name=model, auth_token=auth_token)
        cluster = cls(conductor, instances, backend, model)
        cluster.auth_token = auth_token
        cluster.configs = configs
        cluster.log_dir = log_dir
        cluster.cpus_before = cpus_before
        if launcher is not None and supervise:
            cluster.conductor_supervisor = _supervise_conductor(cluster, launcher)
        if processes and supervise:
            configs_of = {c.instance_id: c for c in configs}
            # a restart skips the warm-up: back in seconds instead of a minute of compiling on a loaded host (its
            # programs compile, or load from the persistent cache, on first use), so the cluster heals quickly
            cluster.supervisor = Supervisor(instances, lambda instance_id: starter.start(
                configs_of[instance_id].replace(warmup=False), profiles[profile_key(configs_of[instance_id])])
            ).start()
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

    def warm_serving_path(self, requests: int | None = None, max_new_tokens: int = 4) -> int:
        """Send ``requests`` (default: two per prefill instance, at least four) synthetic requests through the whole
        path before clients come (``path_warmup.py``); returns how many completed. ``serve`` and ``demo`` do this
        once the instances are up."""
        from .path_warmup import warm_serving_path, warmup_prompts

        prefill = sum(1 for c in self.configs if c.role == PREFILL) or 1
        count = requests if requests is not None else max(4, 2 * prefill)
        if count < 1:
            raise ValueError(f"requests must be >= 1, got {count}")
        backend = self.backend
        block_size = (cluster_block_size(self.model_name, self.configs) if self.configs
                      else get_config(self.model_name).block_size)
        prompts = warmup_prompts(count, backend.vocab_size, backend.max_context, block_size, max_new_tokens)
        return warm_serving_path(lambda prompt: list(self.stream(prompt, max_new_tokens)), prompts)

    def stats(self) -> dict[str, float]:
        """The router's counters and every live instance's figures (``name{instance="id"}``)."""
        return self.backend.stats()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.gateway is not None:
            self.gateway.stop()
        for supervisor in (self.conductor_supervisor, self.supervisor):
            if supervisor is not None:
                supervisor.stop()
        self.backend.close()
        for inst in self.instances.values():
            inst.stop()
        self.conductor.stop()
        cpus.pin(self.cpus_before)  # the launcher's cores as before it kept off its instances' (when it did)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _instance_configs(model, prefill, decode, seed, warmup, instances, cluster_file, options, per_role):
    """The cluster's instance configs from exactly one of: ``instances``, ``cluster_file``, per-role options."""
    if instances is not None and cluster_file is not None:
        raise ValueError("give instances or cluster_file, not both")
    listed = instances is not None or cluster_file is not None
    if listed and (options or any(v is not None for role in per_role.values() for v in role.values())):
        raise ValueError(f"instances listed one by one take no per-role or instance options "
                         f"(got {sorted(options) or 'per-role shapes'}); put them in each instance's config")
    if cluster_file is not None:
        configs = file_configs(cluster_file, model)[1]
        return configs if warmup else [c.replace(warmup=False) for c in configs]
    if instances is not None:
        if not instances:
            raise ValueError("instances is empty: a cluster needs at least one prefill and one decode instance")
        configs = []
        for n, c in enumerate(instances):
            if isinstance(c, dict):
                c = InstanceConfig.from_dict({"model": model, **c,
                                              "instance_id": c.get("instance_id") or f"{c.get('role')}-{n}"})
            elif not isinstance(c, InstanceConfig):
                raise ValueError(f"instance {n} must be an InstanceConfig or a dict, got {type(c).__name__}")
            configs.append(c)
        return configs if warmup else [c.replace(warmup=False) for c in configs]
    return role_configs(model, prefill, decode, options={"seed": seed, "warmup": warmup, **options},
                        per_role=per_role)


class _InProcessStarter:
    """Instances as threads of this process; instances of one model dtype and block size share its weights."""

    def __init__(self, auth_token: str | None):
        self.auth_token = auth_token
        self._models: dict = {}
        self._lock = threading.Lock()

    def _model(self, c: InstanceConfig):
        key = (c.model, c.dtype, c.block_size, c.seed)
        with self._lock:
            if key not in self._models:
                self._models[key] = build_model(c.model, dtype=c.dtype, block_size=c.block_size, seed=c.seed)
            return self._models[key]

    def start(self, config: InstanceConfig, profile_json: str | None) -> InstanceServer:
        config = config.replace(profile_json=profile_json, auth_token=self.auth_token)
        return InstanceServer(config, self._model(config)).start()

    @staticmethod
    def profile_of(instance: InstanceServer) -> str:
        return instance.profile_json


def run_log_dir(log_dir: str | Path | None) -> Path:
    """The folder the cluster's processes log to: ``log_dir``, or a new one per run in the temporary directory
    (kept after the run: the logs of a crash are what its operator reads next)."""
    if log_dir is None:
        log_dir = Path(tempfile.mkdtemp(prefix=f"mooncake-run-{time.strftime('%Y%m%d-%H%M%S')}-"))
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log.info("process logs in %s", log_dir)
    return log_dir


def _supervise_conductor(cluster: Cluster, launcher: ConductorLauncher) -> Supervisor:
    """Restart the Conductor process when it dies, on its address; ``cluster.conductor`` follows the new one."""
    def restart(_name):
        cluster.conductor = launcher.start()
        return cluster.conductor

    return Supervisor({"conductor": cluster.conductor}, restart, what="Conductor").start()


def profile_key(config: InstanceConfig) -> tuple:
    """Instances equal in this share one measured profile: the same engine (``engine_key``) serving the same
    prefill path (a layer-wise prefill instance calibrates the layer-wise one, ``calibrate.py``)."""
    return config.engine_key(), config.role == PREFILL and config.layerwise


def child_config(config: InstanceConfig, cpu_platform: bool) -> InstanceConfig:
    """``config`` as its own process gets it. On the CPU platform each process has its own (fake) devices, threads
    on the same host cores whatever their ids, so an instance process numbers its devices from 0: instances of one
    shape then compile the same programs for the same device assignment, and the persistent compile cache, whose
    keys include the device assignment on CPU (``jax._src.cache_key`` strips it on GPU only), serves a second
    instance the first one's programs (checked: one program compiled for devices 0,1 and then 2,3 wrote two
    entries; with this, ``demo --hetero``'s prefill-1 loaded its 123 step shapes in 68-139 s, adding one entry,
    where prefill-0 compiled them cold in 703-751 s: docs/benchmarks/demo.md, hetero tenth pass). Elsewhere
    device ids name real devices and are kept."""
    if cpu_platform and config.devices is not None and config.num_processes == 1:
        return config.replace(devices=tuple(range(len(config.devices))))
    return config


class _ProcessStarter:
    def __init__(self, auth_token: str | None, log_dir: Path, compile_cache, cpu_platform: bool = False):
        self.auth_token, self.log_dir = auth_token, log_dir
        self.cpu_platform = cpu_platform
        self.compile_cache = "none" if compile_cache is None else str(compile_cache)
        self._profile_dir = tempfile.TemporaryDirectory(prefix="mooncake-profile-")

    def start(self, config: InstanceConfig, profile_json: str | None) -> ChildInstance:
        args = child_config(config, self.cpu_platform).to_args() + ["--compile-cache", self.compile_cache]
        if profile_json:
            digest = hashlib.blake2b(profile_json.encode(), digest_size=8).hexdigest()
            path = Path(self._profile_dir.name) / f"profile-{digest}.json"
            if not path.exists():  # instances start in parallel: never let one read a half-written file
                partial = path.with_suffix(f".{threading.get_ident()}.tmp")
                partial.write_text(profile_json)
                partial.replace(path)
            args += ["--profile-file", str(path)]
        log_path = self.log_dir / f"{config.instance_id}.log"
        return ChildInstance(args, log_path, auth_token=self.auth_token,
                             niceness=PREFILL_NICENESS if config.role == PREFILL else DECODE_NICENESS)

    @staticmethod
    def profile_of(instance: ChildInstance) -> str:
        return instance.info["profile_json"]
