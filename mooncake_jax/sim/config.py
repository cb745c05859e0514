"""Everything one simulation run is parameterised by, checked once, in one frozen object.

The Conductor's own settings (strategy, admission, SLOs, thresholds) are passed through to its ``PolicyConfig``
unchanged, so the simulator accepts exactly what the real Conductor accepts and rejects the rest the same way.
"""

from __future__ import annotations

import dataclasses
import math

from mooncake_jax.conductor import PolicyConfig
from mooncake_jax.conductor.accounting import LAYERWISE, ReleaseTiming
from mooncake_jax.sim.cache import EVICTIONS
from mooncake_jax.sim.hardware import HardwareSpec, PoolSpec, resolve_pool

ARCHITECTURES = ("disaggregated", "coupled")
CACHE_MODES = ("per-node", "global")


def _check_non_negative(name: str, value, unit: str = "") -> None:
    """ValueError unless ``value`` is a finite number >= 0 (not a bool); the message names ``name`` and ``unit``."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a non-negative number{unit}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """One simulated cluster and how it is driven.

    Cluster: ``prefill`` and ``decode`` instance counts (a ``coupled`` cluster has ``prefill + decode`` nodes that
    each do both). ``hardware`` is a built-in profile name, a measured profile JSON path, or ``InstanceCosts``;
    ``prefill_hardware`` / ``decode_hardware`` override it per pool (heterogeneous clusters), either one spec for
    the pool or a sequence with one per instance (a mixed pool). ``model`` names the model shape for built-in
    profiles.

    KV cache: ``cache_tokens`` of host DRAM per prefill instance (None: unbounded) with ``eviction`` ``lru`` or
    ``lfu``; ``cache_mode="global"`` pools all of it into one cache every prefill instance reads (fetched over
    its NIC, overlapped with compute layer by layer).

    Conductor (disaggregated only): ``policy`` (scheduling strategy), ``admission``, ``ttft_slo_s``,
    ``tbt_slo_s``, ``kvcache_balancing_threshold``, ``decode_time_s`` (None: tracked), ``seed`` (``random``).

    Coupled baseline (vLLM-like): every node prefills and decodes with continuous batching and a prefix cache in
    the HBM its running requests leave free; requests go to the node with the fewest unfinished ones. Without
    ``chunked_prefill`` a prefill iteration (up to ``prefill_batch_tokens`` new tokens, at least one request)
    stalls the node's decoding; with it, each iteration carries every running decode plus up to
    ``chunk_tokens`` minus that many prompt tokens.

    ``sample_interval_s``: virtual seconds between load samples.

    Instance accounting (``conductor/accounting.py``): ``release_timing`` says when the KV is pushed and the first
    token released (default: streamed layer by layer, first token at the prefill's end; ``REAL_INSTANCES`` for
    what this project's instances do); ``request_overhead_s`` is a fixed time each prefill takes beyond its cost
    model (RPCs, scheduling: measured on a real cluster, 0 for datasheet studies); ``decode_join_s`` is the time a
    decode instance takes from a request's KV arriving to the request joining its batch, one request at a time (the
    decode RPC, staging the KV from its pool, loading it into pages: measured on a real cluster as the first token
    gap's excess over a steady one, 0 for datasheet studies), of which ``decode_join_stall_s`` runs on the instance's
    engine loop and stalls the requests already decoding (loading the KV into pages; at most ``decode_join_s``);
    ``decode_join_per_request_s`` lengthens a join by that much per request the batch runs when the join is booked
    (the decode process streams every running request's tokens on the same interpreter that takes the new one in:
    on a local cluster a join took 5.4 ms beside no batch, 12 ms beside four requests, 24 ms beside eight).
    ``prefill_off_engine_s``: the part of a prefilled request's path to its first token spent off its prefill
    instance's engine (the RPCs to the Conductor and to the instance, staging its prefix from the pool, storing
    and pushing its KV, the reply: measured on a real cluster as TTFT less the instance's reported queue and
    compute): it delays the request's first token and its KV's push but holds no instance (on a real instance those
    run on other threads while the engine computes the next request; ``request_overhead_s`` holds the engine).
    ``prefill_slowdown_steps``: ``(from_s, factor)`` pairs, ``from_s`` increasing: a prefill that starts at or after
    ``from_s`` (and before the next step) takes ``factor`` times its cost model's time (a shared host's speed as
    measured over slices of a replay; empty: 1). The Conductor's predictions keep the cost model's.
    ``shared_host_decode_slowdown``: the instances share one host's cores (a local cluster): while any prefill
    instance computes, decode steps take this factor times the cost model's time (1: separate machines).
    ``decode_step_spread``: measured factors (any scale; normalized to mean 1) of a decode token gap over the mean
    step on a shared host (disaggregated clusters); each reported gap's step part is scaled by one drawn from
    them (seeded by ``seed``), so a request's TBT (its longest gaps) sees the real steps' tail; the clock keeps
    the mean step (empty: exact steps).
    ``host_cores``: the instances share one host with this many cores (a local cluster; None: each instance on its
    own machine, the default). Every busy instance (a prefill instance computing, a decode instance with requests in
    its batch) is one runnable process of at most one core; the cores are shared by weight (``sim/host.py``), a
    prefill process weighing ``host_prefill_weight`` against a decode process's 1 (``host.cfs_weight(n)`` for a
    prefill run ``n`` nice levels lower, as a local cluster does; 1: equal, each at ``cores / busy`` of its speed
    while more are busy than there are cores): a running prefill's remaining work is re-timed at once, a decode
    batch's steps from its next boundary. Cost models are then read as each instance measured alone (``mooncake-jax
    profile``); with ``shared_host_decode_slowdown`` too, both factors apply (disaggregated clusters only).
    ``host_other_busy``: runnable processes on that host besides the busy instances (a mean, any number >= 0; 0:
    the cores are the instances' alone), each weighing as a decode process: the host's other load and the
    instances' own threads off the engine, as a contention probe measures them (a prefill's slowdown as one, two
    and three instances run at once; on a 2-core host shared with other work, two prefills and a decode batch ran
    a prefill 1.2-2x slower than one alone, where the instances alone give at most 1.5x).
    ``decode_stream_cpu_s``: CPU seconds each token a decode instance emits costs on that host off the instances'
    processes (streaming it to its client: the gateway's backend, the client's thread; one process of a decode's
    weight, at most one core; 0: none), so a busy decode batch brings a load proportional to the tokens it streams
    a second (``host.rates_with_streaming``): measured as the CPU time of the processes beside the instances while
    decode batches run alone.
    ``host_pair_length_exponent``: how a prefill's slowdown beside another prefill grows with its length
    (``host.pair_length_factor``): while two or more prefills compute, each runs at the host's shared speed divided
    by ``(computed tokens / 512) ** exponent`` (at most its cost model's speed; 0: every length alike, as before).
    Fitted per host by the contention probe over 256-2,048-token prompts (``benchmarks/sim_real``): on two cores a
    long prefill beside another ran 1.3-1.7x one beside none where 512-token pairs ran 1.13x (twelfth pass).
    """

    prefill: int = 8
    decode: int = 8
    policy: str = "kvcache-centric"
    admission: str = "none"
    architecture: str = "disaggregated"
    hardware: HardwareSpec = "8xA800"
    prefill_hardware: PoolSpec | None = None
    decode_hardware: PoolSpec | None = None
    model: str = "llama2-70b"
    cache_tokens: int | None = 3_000_000
    cache_mode: str = "per-node"
    eviction: str = "lru"
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    kvcache_balancing_threshold: float = 1.0
    decode_time_s: float | None = None
    seed: int = 0
    chunked_prefill: bool = False
    chunk_tokens: int = 512
    prefill_batch_tokens: int = 16384
    sample_interval_s: float = 10.0
    release_timing: ReleaseTiming = LAYERWISE
    request_overhead_s: float = 0.0
    prefill_off_engine_s: float = 0.0
    prefill_slowdown_steps: tuple[tuple[float, float], ...] = ()
    decode_join_s: float = 0.0
    decode_join_stall_s: float = 0.0
    decode_join_per_request_s: float = 0.0
    shared_host_decode_slowdown: float = 1.0
    decode_step_spread: tuple[float, ...] = ()
    host_cores: int | None = None
    host_prefill_weight: float = 1.0
    host_other_busy: float = 0.0
    decode_stream_cpu_s: float = 0.0
    host_pair_length_exponent: float = 0.0

    def __post_init__(self):
        for name in ("prefill", "decode", "chunk_tokens", "prefill_batch_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.architecture!r}; choose from {list(ARCHITECTURES)}")
        if self.architecture == "disaggregated":
            if self.prefill < 1 or self.decode < 1:
                raise ValueError("a disaggregated cluster needs at least one prefill and one decode instance")
            if self.chunked_prefill:
                raise ValueError("chunked_prefill applies to the coupled architecture only")
        else:
            if self.prefill + self.decode < 1:
                raise ValueError("a coupled cluster needs at least one node (prefill + decode)")
            if self.admission != "none":
                raise ValueError("the coupled baseline has no admission control; use admission='none'")
        if self.chunk_tokens < 1 or self.prefill_batch_tokens < 1:
            raise ValueError("chunk_tokens and prefill_batch_tokens must be positive")
        if self.cache_tokens is not None and (not isinstance(self.cache_tokens, int) or self.cache_tokens < 0):
            raise ValueError(f"cache_tokens must be a non-negative integer or None, got {self.cache_tokens!r}")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"unknown cache_mode {self.cache_mode!r}; choose from {list(CACHE_MODES)}")
        if not (isinstance(self.sample_interval_s, (int, float)) and math.isfinite(self.sample_interval_s)
                and self.sample_interval_s > 0):
            raise ValueError(f"sample_interval_s must be positive, got {self.sample_interval_s!r}")
        if not isinstance(self.release_timing, ReleaseTiming):
            raise ValueError(f"release_timing must be a ReleaseTiming, got {self.release_timing!r}")
        if not (math.isfinite(self.request_overhead_s) and self.request_overhead_s >= 0):
            raise ValueError(f"request_overhead_s must be a non-negative number, got {self.request_overhead_s!r}")
        if not (math.isfinite(self.prefill_off_engine_s) and self.prefill_off_engine_s >= 0):
            raise ValueError(f"prefill_off_engine_s must be a non-negative number, got {self.prefill_off_engine_s!r}")
        steps = self.prefill_slowdown_steps
        if not all(len(step) == 2 and math.isfinite(step[0]) and math.isfinite(step[1]) and step[1] > 0
                   for step in steps) or any(a[0] >= b[0] for a, b in zip(steps, steps[1:])):
            raise ValueError(f"prefill_slowdown_steps must be (from_s, factor > 0) pairs with from_s increasing, "
                             f"got {steps!r}")
        if not (math.isfinite(self.decode_join_s) and self.decode_join_s >= 0):
            raise ValueError(f"decode_join_s must be a non-negative number, got {self.decode_join_s!r}")
        _check_non_negative("decode_join_per_request_s", self.decode_join_per_request_s, " of seconds")
        if not (math.isfinite(self.decode_join_stall_s) and 0 <= self.decode_join_stall_s <= self.decode_join_s):
            raise ValueError(f"decode_join_stall_s must be a number between 0 and decode_join_s "
                             f"({self.decode_join_s!r}), got {self.decode_join_stall_s!r}")
        if not (math.isfinite(self.shared_host_decode_slowdown) and self.shared_host_decode_slowdown >= 1):
            raise ValueError(f"shared_host_decode_slowdown must be a number >= 1, got "
                             f"{self.shared_host_decode_slowdown!r}")
        spread = tuple(self.decode_step_spread)
        if not all(isinstance(f, (int, float)) and math.isfinite(f) and f > 0 for f in spread):
            raise ValueError(f"decode_step_spread must be positive numbers, got {self.decode_step_spread!r}")
        object.__setattr__(self, "decode_step_spread", tuple(float(f) for f in spread))  # frozen and hashable
        if self.host_cores is not None:
            if not isinstance(self.host_cores, int) or isinstance(self.host_cores, bool) or self.host_cores < 1:
                raise ValueError(f"host_cores must be a positive integer or None, got {self.host_cores!r}")
            if self.architecture != "disaggregated":
                raise ValueError("host_cores applies to the disaggregated architecture only")
        if not (isinstance(self.host_prefill_weight, (int, float)) and math.isfinite(self.host_prefill_weight)
                and self.host_prefill_weight > 0):
            raise ValueError(f"host_prefill_weight must be a positive number, got {self.host_prefill_weight!r}")
        _check_non_negative("host_other_busy", self.host_other_busy)
        if self.host_other_busy and self.host_cores is None:
            raise ValueError("host_other_busy needs host_cores (the host whose cores the other processes share)")
        if not (isinstance(self.host_pair_length_exponent, (int, float))
                and -2.0 <= self.host_pair_length_exponent <= 2.0):
            raise ValueError(f"host_pair_length_exponent must be a number from -2 to 2, got "
                             f"{self.host_pair_length_exponent!r}")
        if self.host_pair_length_exponent and self.host_cores is None:
            raise ValueError("host_pair_length_exponent needs host_cores (the host whose cores the prefills share)")
        _check_non_negative("decode_stream_cpu_s", self.decode_stream_cpu_s, " of seconds")
        if self.decode_stream_cpu_s and self.host_cores is None:
            raise ValueError("decode_stream_cpu_s needs host_cores (the host whose cores the streaming shares)")
        if self.eviction not in EVICTIONS:
            raise ValueError(f"unknown eviction policy {self.eviction!r}; choose from {list(EVICTIONS)}")
        for name in ("prefill_hardware", "decode_hardware"):
            value = getattr(self, name)
            if isinstance(value, list):
                value = tuple(value)
                object.__setattr__(self, name, value)  # frozen and hashable like the rest
            count = self.prefill if name == "prefill_hardware" else self.decode
            if isinstance(value, tuple) and len(value) != count:
                raise ValueError(f"{name} lists {len(value)} instances' hardware for a pool of {count}; "
                                 f"give one spec, or one per instance")
        self.policy_config()  # unknown policy / admission, bad SLOs: the Conductor's own ValueError

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode

    def policy_config(self, block_size: int = 512) -> PolicyConfig:
        return PolicyConfig(strategy=self.policy, admission=self.admission, block_size=block_size,
                            kvcache_balancing_threshold=self.kvcache_balancing_threshold,
                            ttft_slo_s=self.ttft_slo_s, tbt_slo_s=self.tbt_slo_s, decode_time_s=self.decode_time_s,
                            seed=self.seed)

    def pool_costs(self) -> tuple[list, list]:
        """Each prefill and each decode instance's ``InstanceCosts`` (disaggregated clusters)."""
        return (resolve_pool(self.prefill_hardware or self.hardware, self.prefill, self.model, "prefill"),
                resolve_pool(self.decode_hardware or self.hardware, self.decode, self.model, "decode"))

    def cache_blocks(self, block_tokens: int) -> int | None:
        """One prefill instance's DRAM cache in blocks."""
        return None if self.cache_tokens is None else self.cache_tokens // block_tokens

    def to_dict(self) -> dict:
        def plain(v):
            if isinstance(v, (int, float, str, bool, type(None))):
                return v
            return [plain(x) for x in v] if isinstance(v, tuple) else str(v)

        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
