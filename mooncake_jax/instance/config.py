"""One instance's configuration: a frozen dataclass tree with one serializer.

``InstanceConfig`` holds what an instance *is* (model, role, shape ``stage x tensor``, chunk size, dtype, block
size, the local devices it owns, its pool tiers, layer-wise prefill, hardware profile) and where it runs (the
Conductor's address, its own host and port). ``to_dict`` / ``from_dict`` is the one serializer: the child process's
command line is ``--config <its JSON>``, and the same JSON goes to the Conductor in the registration message. Every
default lives here (the Cluster, ``serve`` and the instance command take theirs from this class). SLOs are not
here: the Conductor hands out the cluster's at registration.

``validate_for(model_config)`` refuses, before anything starts, a shape that does not divide the model; device
ranges are checked across a cluster's instances in ``devices.py``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from ..addresses import is_loopback, is_wildcard, split
from ..conductor.hardware import HARDWARE
from ..engine.scheduler import DEFAULT_MAX_WAITING
from ..kv_layout import KV_DTYPES, KVLayout
from ..transfer.messenger import DATA_PLANES

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)
MEASURED = ""
"""``hardware`` of an instance whose cost model is measured on its own devices (not a datasheet profile)."""


def parse_ids(value: Any, what: str = "devices") -> tuple[int, ...] | None:
    """``"0-3"``, ``"0,2,4-5"``, ``[0, 1]`` or None as a tuple of ids (device ids, or CPU core ids for ``cpus``);
    ValueError naming ``what`` and the value."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        ids: list[int] = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            lo, sep, hi = part.partition("-")
            try:
                first, last = int(lo), int(hi) if sep else int(lo)
            except ValueError:
                raise ValueError(f"{what} {value!r}: {part!r} is not an id or range like 0-3") from None
            if last < first:
                raise ValueError(f"{what} {value!r}: range {part!r} runs backwards")
            ids.extend(range(first, last + 1))
        value = ids
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    try:
        ids = [int(v) for v in value if not isinstance(v, bool)]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be ids like '0-3' or [0, 1, 2, 3], got {value!r}") from None
    if len(ids) != len(list(value)) or not ids or any(i < 0 for i in ids):
        raise ValueError(f"{what} must be non-negative ids like '0-3', got {value!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} {value!r} names an id twice")
    return tuple(ids)


def parse_devices(value: Any) -> tuple[int, ...] | None:
    """``"0-3"``, ``"0,2,4-5"``, ``[0, 1]`` or None (the process's first devices) as a tuple of device ids."""
    return parse_ids(value, "devices")


def format_devices(ids: tuple[int, ...] | None) -> str:
    if not ids:
        return ""
    if list(ids) == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1:
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def parse_shape(text: str) -> dict[str, int]:
    """``"tensor=2,stage=2"`` as {"tensor_parallel": 2, "pipeline_stages": 2} (either may be left out)."""
    from ..sharding.mesh import MeshSpec

    spec = MeshSpec.parse(text)
    return {"tensor_parallel": spec.tensor, "pipeline_stages": spec.stage}


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """The instance's KV block pool: host DRAM tier (blocks) and, when ``ssd_path`` is set, an SSD tier."""

    dram_blocks: int = 8192
    ssd_path: str | None = None
    ssd_blocks: int | None = None


_LOCAL = {"local": True}  # fields that stay in this process: never on a command line, in JSON or registration


@dataclasses.dataclass(frozen=True)
class InstanceConfig:
    """Everything an instance needs to start."""

    role: str
    model: str = "tiny"
    tensor_parallel: int = 1
    pipeline_stages: int = 1
    prefill_chunk_size: int = 512
    dtype: str | None = None  # None: the model's own
    block_size: int | None = None  # None: the model's own
    devices: tuple[int, ...] | None = None  # local device ids it owns; None: the process's first devices
    cpus: tuple[int, ...] | None = None  # host CPU cores its processes run on (cpus.py); None: the launcher's
    pool: PoolConfig = PoolConfig()
    layerwise: bool = False
    hardware: str = MEASURED  # a built-in datasheet profile name, or MEASURED
    seed: int = 0
    max_batch: int = 32
    num_pages: int | None = None
    bucket_factor: int = 4  # prefill chunk lengths grow 4x: fewer programs to compile per instance
    max_waiting: int = DEFAULT_MAX_WAITING  # requests queued for the engine beyond this: RESOURCE_EXHAUSTED
    # decode: joins started between two steps stop after this many mean step times (at least one; None: all)
    join_budget_steps: float | None = 1.0
    transfer_workers: int = 4  # threads for pool / SSD / Messenger I/O (never on the engine's thread)
    # how block data moves between instances (DATA_PLANES): "auto" takes the socket plane where both ends serve it
    # and TLS is off, else gRPC; "grpc" also serves no socket plane to peers (no second port); gRPC carries control
    data_plane: str = "auto"
    request_timeout_s: float = 120.0
    warmup: bool = True  # compile every step shape of its role before registering
    # where it runs
    conductor_address: str = ""
    instance_id: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    # an instance over several processes (jax.distributed): process 0 serves, the others follow (distributed.py)
    coordinator: str = ""  # HOST:PORT of the instance's JAX coordinator (process 0 listens there)
    num_processes: int = 1
    process_id: int = 0
    coordinator_timeout_s: float = 120.0  # the group must form within this, or every process exits with an error
    advertise: str = ""  # HOST[:PORT] others reach it at if not host:port (NAT, containers); no port: the bound one
    conductor_wait_s: float = 60.0  # a Conductor that does not answer is retried this long, then the start fails
    # this process only
    profile_json: str | None = dataclasses.field(default=None, repr=False, metadata=_LOCAL)
    auth_token: str | None = dataclasses.field(default=None, repr=False, metadata=_LOCAL)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be {PREFILL!r} or {DECODE!r}, got {self.role!r}")
        if isinstance(self.pool, dict):
            object.__setattr__(self, "pool", _build(PoolConfig, self.pool, "pool"))
        object.__setattr__(self, "devices", parse_devices(self.devices))
        object.__setattr__(self, "cpus", parse_ids(self.cpus, "cpus"))
        for name in ("tensor_parallel", "pipeline_stages", "prefill_chunk_size", "max_batch", "transfer_workers",
                     "max_waiting"):
            _positive(name, getattr(self, name))
        for name in ("block_size", "num_pages"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        _positive("pool dram_blocks", self.pool.dram_blocks)
        if self.advertise and (self.advertise.startswith(":") or any(c.isspace() for c in self.advertise)):
            raise ValueError(f"advertise must be HOST or HOST:PORT, got {self.advertise!r}")
        if not (isinstance(self.conductor_wait_s, (int, float)) and self.conductor_wait_s >= 0):
            raise ValueError(f"conductor_wait_s must be a non-negative number of seconds, "
                             f"got {self.conductor_wait_s!r}")
        if self.join_budget_steps is not None and (isinstance(self.join_budget_steps, bool) or not isinstance(
                self.join_budget_steps, (int, float)) or not self.join_budget_steps >= 0):
            raise ValueError(f"join_budget_steps must be a number >= 0 or None, got {self.join_budget_steps!r}")
        if self.bucket_factor < 2:
            raise ValueError(f"bucket_factor must be >= 2, got {self.bucket_factor!r}")
        if self.data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {list(DATA_PLANES)}, got {self.data_plane!r}")
        if self.dtype is not None and self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; allowed: {list(KV_DTYPES)}")
        if self.hardware != MEASURED and self.hardware not in HARDWARE:
            raise ValueError(f"unknown hardware profile {self.hardware!r}; allowed: {sorted(HARDWARE)} "
                             f"(or leave it empty to measure the instance)")
        if self.devices is not None and len(self.devices) != self.device_count:
            raise ValueError(f"{self.role} instance: devices {format_devices(self.devices)} are "
                             f"{len(self.devices)} device(s), its shape tensor={self.tensor_parallel},"
                             f"stage={self.pipeline_stages} needs {self.device_count}")
        self._check_processes()
        if not self.instance_id:
            object.__setattr__(self, "instance_id", f"{self.role}-{uuid.uuid4().hex[:8]}")

    def _check_processes(self) -> None:
        _positive("num_processes", self.num_processes)
        n, i = self.num_processes, self.process_id
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(f"process_id {i!r} is out of range for num_processes={n}; allowed: 0 to {n - 1}")
        if isinstance(self.coordinator_timeout_s, bool) or not isinstance(self.coordinator_timeout_s, (int, float)) \
                or not self.coordinator_timeout_s > 0:
            raise ValueError(f"coordinator_timeout_s must be a positive number, got {self.coordinator_timeout_s!r}")
        if n == 1:
            return
        host, port = split(self.coordinator)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"an instance of {n} processes needs coordinator HOST:PORT, got {self.coordinator!r}")
        if self.devices is not None:
            raise ValueError(f"an instance of {n} processes uses every local device of each process; "
                             f"devices {format_devices(self.devices)} cannot be given")
        if self.layerwise:
            raise ValueError(f"an instance of {n} processes runs each prefill as one SPMD program: layer-wise "
                             f"prefill (hooks between layers) is not available; leave layerwise off")
        if self.device_count % n:
            raise ValueError(f"shape {self.shape} ({self.device_count} devices) cannot be split evenly over "
                             f"{n} processes")
        mine = self.collectives_host
        if mine is not None and is_loopback(mine) and not is_loopback(host):
            raise ValueError(f"process {i} of {n} would take its collectives on {mine}, a loopback address, but "
                             f"its coordinator {self.coordinator} is on another host: give this process --listen "
                             f"or --advertise with an address the other processes reach it at")

    # ---- derived ----------------------------------------------------------------------------------------------
    @property
    def device_count(self) -> int:
        return self.tensor_parallel * self.pipeline_stages

    @property
    def collectives_host(self) -> str | None:
        """The address this process of a multi-process instance takes its group's collectives (gloo on CPU) on:
        the host it is advertised at, else the one it listens on; None for a wildcard (then the machine's hostname,
        which often resolves to a loopback address the other hosts cannot reach)."""
        return self.advertised_host

    @property
    def data_advertise(self) -> str | None:
        """The host this instance's socket data plane names in its offers: the advertised one when ``advertise`` is
        given, else None (the plane's bound host, ``host``)."""
        return self.advertised_host if self.advertise else None

    @property
    def advertised_host(self) -> str | None:
        """The host others reach this instance at: that of ``advertise``, else ``host``; None for a wildcard (its
        socket data plane's offers then name the wildcard, which each peer reads as the host it reached this
        instance at)."""
        host = split(self.advertise)[0] or split(self.host)[0]
        return None if is_wildcard(host) else host

    @property
    def shape(self) -> str:
        return f"tensor={self.tensor_parallel},stage={self.pipeline_stages}"

    def replace(self, **changes) -> "InstanceConfig":
        return dataclasses.replace(self, **changes)

    def engine_key(self) -> tuple:
        """What decides the engine's speed (instances equal in it can share one measured profile)."""
        return (self.model, self.tensor_parallel, self.pipeline_stages, self.prefill_chunk_size, self.dtype,
                self.block_size, self.max_batch, self.num_pages, self.hardware, len(self.cpus or ()))

    def validate_for(self, cfg) -> None:
        """ValueError, naming the value and what is allowed, if this instance's shape does not fit model ``cfg``
        (a ``ModelConfig``): tensor must divide the attention heads and divide, or be a multiple of, the KV heads;
        there cannot be more stages than layers."""
        t, s = self.tensor_parallel, self.pipeline_stages
        if cfg.n_heads % t or (cfg.n_kv_heads % t and t % cfg.n_kv_heads):
            allowed = [d for d in range(1, cfg.n_heads + 1)
                       if cfg.n_heads % d == 0 and (cfg.n_kv_heads % d == 0 or d % cfg.n_kv_heads == 0)]
            raise ValueError(f"{self.role} instance: tensor={t} does not divide {cfg.name}'s {cfg.n_heads} "
                             f"attention heads / {cfg.n_kv_heads} KV heads; allowed: {allowed}")
        if s > cfg.n_layers:
            raise ValueError(f"{self.role} instance: stage={s} is more stages than {cfg.name}'s {cfg.n_layers} "
                             f"layers; allowed: 1 to {cfg.n_layers}")
        if self.num_processes > 1 and cfg.n_layers % s:  # the SPMD pipeline stacks equal stages
            raise ValueError(f"{self.role} instance of {self.num_processes} processes: stage={s} does not divide "
                             f"{cfg.name}'s {cfg.n_layers} layers; allowed: "
                             f"{[d for d in range(1, cfg.n_layers + 1) if cfg.n_layers % d == 0]}")

    def kv_layout(self, cfg) -> KVLayout:
        """The layout of this instance's KV blocks for model ``cfg`` (its own block size and dtype applied)."""
        from ..sharding.layout import split_layers

        return KVLayout(n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                        block_size=self.block_size or cfg.block_size, dtype=self.dtype or cfg.dtype,
                        tensor=self.tensor_parallel,
                        stage_layers=tuple(b - a for a, b in split_layers(cfg.n_layers, self.pipeline_stages)))

    # ---- the serializer ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Every field but the process-local ones (the auth token, the profile text), JSON-ready."""
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("local"):
                continue
            value = getattr(self, f.name)
            if f.name == "pool":
                value = dataclasses.asdict(value)
            elif f.name in ("devices", "cpus"):
                value = format_devices(value) or None
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, fields: dict, **local) -> "InstanceConfig":
        """The config ``to_dict`` wrote (missing fields take their defaults); ``local`` sets the process-local
        fields. ValueError naming any unknown field."""
        if not isinstance(fields, dict):
            raise ValueError(f"an instance config is an object, got {type(fields).__name__}")
        serial = {f.name for f in dataclasses.fields(cls) if not f.metadata.get("local")}
        bad = sorted(set(fields) - serial)
        if bad:
            raise ValueError(f"unknown instance config field(s) {bad}; allowed: {sorted(serial)}")
        return _build(cls, {**fields, **local}, "instance config")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, **local) -> "InstanceConfig":
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"instance config is not JSON ({e}): {text[:200]!r}") from None
        return cls.from_dict(fields, **local)

    def to_args(self) -> list[str]:
        """The child process's command line (``instance/main.py``): the JSON, after the role and id as flags of
        equal value so that ``ps`` shows which instance a process is."""
        return ["--role", self.role, "--instance-id", self.instance_id, "--config", self.to_json()]


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _build(cls, fields: dict, what: str):
    names = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(fields) - names)
    if bad:
        raise ValueError(f"unknown {what} field(s) {bad}; allowed: {sorted(names)}")
    try:
        return cls(**fields)
    except TypeError as e:
        raise ValueError(f"bad {what}: {e}") from None
