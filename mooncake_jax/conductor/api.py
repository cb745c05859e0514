"""The policy's contract: its configuration, what it reads (a request and a snapshot) and what it returns.

These types are shared by the Conductor's gRPC service and the simulator, which drive the same ``Policy``:

    decision = Policy(config).decide(request, state.snapshot(), now)

``now`` is any monotonic clock in seconds (wall time in the service, virtual time in the simulator); every
time in a snapshot and a decision is on that same clock.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from mooncake_jax.blocks import num_blocks
from mooncake_jax.conductor.index import BlockIndex
from mooncake_jax.conductor.instances import InstanceTable
from mooncake_jax.conductor.ledger import DecodeLedger

_U64 = 1 << 64


class Strategy(str, enum.Enum):
    """How the prefill instance is chosen (decode selection is the same for all, so ablations isolate it)."""

    RANDOM = "random"  # uniform over live prefill instances
    LOAD_BALANCE = "load-balance"  # least queued work
    LOCAL_CACHE_AWARE = "local-cache-aware"  # least queue + prefill time with the instance's own prefix
    KVCACHE_CENTRIC = "kvcache-centric"  # Algorithm 1: also consider fetching the best prefix from elsewhere


class Admission(str, enum.Enum):
    """Overload policy: when a request is rejected before any work is spent on it."""

    NONE = "none"  # accept everything (pure scheduling studies)
    BASELINE = "baseline"  # reject on TTFT here; the decode instance re-checks TBT on arrival (late rejection)
    EARLY = "early"  # also reject here on TBT under the *current* decode load
    PREDICTIVE = "predictive"  # ... under the decode load predicted for when this request's prefill ends


class RejectReason(str, enum.Enum):
    TTFT_SLO = "ttft_slo"
    TBT_SLO = "tbt_slo"
    DECODE_CAPACITY = "decode_capacity"  # no decode instance can hold the request's KV
    NO_PREFILL_INSTANCE = "no_prefill_instance"
    NO_DECODE_INSTANCE = "no_decode_instance"


def _enum(kind: type[enum.Enum], value):
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"unknown {kind.__name__.lower()} {value!r}; choose from "
                         f"{[m.value for m in kind]}") from None


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """Everything that parameterises scheduling and admission (strings are accepted for the two enums).

    ``block_size``: tokens per block key. ``kvcache_balancing_threshold``: an instance fetches the best prefix
    from elsewhere when best_len / own_len exceeds it. ``decode_time_s``: the uniform decode time t_d of the
    predictive policy, or None to track it as a moving average of reported decode durations (starting at
    ``decode_time_init_s``, each new one weighted ``decode_time_smoothing``). ``seed`` drives ``random``.
    """

    strategy: Strategy = Strategy.KVCACHE_CENTRIC
    admission: Admission = Admission.PREDICTIVE
    block_size: int = 512
    kvcache_balancing_threshold: float = 1.0
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    decode_time_s: float | None = None
    decode_time_init_s: float = 20.0
    decode_time_smoothing: float = 0.1
    min_retry_after_s: float = 0.5
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "strategy", _enum(Strategy, self.strategy))
        object.__setattr__(self, "admission", _enum(Admission, self.admission))
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        positive = ("kvcache_balancing_threshold", "ttft_slo_s", "tbt_slo_s", "decode_time_init_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.decode_time_s is not None and not self.decode_time_s > 0:
            raise ValueError(f"decode_time_s must be positive or None, got {self.decode_time_s!r}")
        if not 0 < self.decode_time_smoothing <= 1:
            raise ValueError(f"decode_time_smoothing must be in (0, 1], got {self.decode_time_smoothing!r}")
        if self.min_retry_after_s < 0:
            raise ValueError(f"min_retry_after_s must be non-negative, got {self.min_retry_after_s!r}")


@dataclasses.dataclass(frozen=True)
class Request:
    """A request as the Conductor sees it.

    ``block_keys``: the prompt's block keys (``mooncake_jax.blocks.block_keys``; trace ``hash_ids`` work too),
    at most ceil(input_tokens / block_size) of them. ``output_tokens``: the most tokens it may generate, which
    with ``input_tokens`` is the KV it will hold on its decode instance.
    """

    request_id: str
    block_keys: tuple[int, ...]
    input_tokens: int
    output_tokens: int

    def __post_init__(self):
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        try:
            keys = tuple(int(k) for k in self.block_keys)
        except (TypeError, ValueError):
            raise ValueError(f"request {self.request_id}: block_keys must be integers") from None
        if keys and (min(keys) < 0 or max(keys) >= _U64):
            raise ValueError(f"request {self.request_id}: block keys must be unsigned 64-bit integers")
        object.__setattr__(self, "block_keys", keys)
        if int(self.input_tokens) != self.input_tokens or self.input_tokens < 1:
            raise ValueError(f"request {self.request_id}: input_tokens must be a positive integer, "
                             f"got {self.input_tokens!r}")
        if int(self.output_tokens) != self.output_tokens or self.output_tokens < 0:
            raise ValueError(f"request {self.request_id}: output_tokens must be a non-negative integer, "
                             f"got {self.output_tokens!r}")

    @property
    def kv_tokens(self) -> int:
        """KV tokens it holds at the end of its decode (what a decode instance must have room for)."""
        return self.input_tokens + self.output_tokens


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The cluster as the policy reads it: views into the state's structures, valid until the state changes.

    ``instances``: per-slot columns (queue drain times, cost coefficients, capacities). ``index``: which slots
    hold which blocks. ``ledger``: requests routed to decode instances and when each starts decoding.
    ``decode_time_s``: the uniform decode time t_d in force, cluster-wide; ``decode_times``: each decode
    instance's own (per slot; None: the cluster-wide one for all), what the decode load predictions use.
    """

    instances: InstanceTable
    index: BlockIndex
    ledger: DecodeLedger
    decode_time_s: float
    decode_times: np.ndarray | None = None

    @property
    def decode_time_per_slot(self) -> np.ndarray | float:
        """t_d for the ledger's load views: per decode slot where tracked, else the cluster-wide figure."""
        return self.decode_time_s if self.decode_times is None else self.decode_times


@dataclasses.dataclass(frozen=True)
class Transfer:
    """A planned transfer: ``source`` sends ``keys`` to the chosen prefill instance, which keeps them."""

    source: str
    keys: tuple[int, ...]
    n_bytes: float
    seconds: float  # predicted, including what the sender still had queued


@dataclasses.dataclass(frozen=True)
class Decision:
    """The policy's answer for one request.

    Accepted (``reason`` None): ``prefill`` and ``decode`` instance ids, the ``transfer`` plan (or None), the
    ``prefix_blocks`` the prefill instance reuses (its own plus fetched), the predicted queue, prefill and TTFT
    times, ``prefill_end_at`` (clock time the first token is predicted) and ``predicted_tbt_s``.
    Rejected: ``reason`` and ``retry_after_s`` (a hint for the client), with the predictions that led to it
    (instance ids are still filled when an instance was chosen before the check failed).
    """

    request_id: str
    reason: RejectReason | None = None
    retry_after_s: float = 0.0
    prefill: str | None = None
    decode: str | None = None
    transfer: Transfer | None = None
    prefix_blocks: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    predicted_ttft_s: float = 0.0
    predicted_tbt_s: float = 0.0
    prefill_end_at: float = 0.0

    @property
    def accepted(self) -> bool:
        return self.reason is None

    @classmethod
    def made(cls, request_id: str, reason: RejectReason | None, retry_after_s: float, prefill: str | None,
             decode: str | None, transfer: Transfer | None, prefix_blocks: int, queue_s: float, prefill_s: float,
             predicted_ttft_s: float, predicted_tbt_s: float, prefill_end_at: float) -> "Decision":
        """The same object as ``Decision(...)`` with every field given, built for the policy's hot path: a frozen
        dataclass's ``__init__`` sets each of its twelve fields through ``object.__setattr__``, which cost about
        as much as a tenth of a whole decision; here they go into the instance's ``__dict__`` in one update."""
        decision = object.__new__(cls)
        decision.__dict__.update(
            request_id=request_id, reason=reason, retry_after_s=retry_after_s, prefill=prefill, decode=decode,
            transfer=transfer, prefix_blocks=prefix_blocks, queue_s=queue_s, prefill_s=prefill_s,
            predicted_ttft_s=predicted_ttft_s, predicted_tbt_s=predicted_tbt_s, prefill_end_at=prefill_end_at)
        return decision


def check_block_count(keys: Sequence[int], input_tokens: int, block_size: int, request_id: str) -> None:
    """A prompt of n tokens has at most ceil(n / block_size) blocks; more keys mean a mismatched block size."""
    most = num_blocks(input_tokens, block_size)
    if len(keys) > most:
        raise ValueError(f"request {request_id}: {len(keys)} block keys for {input_tokens} tokens at block size "
                         f"{block_size} (at most {most})")
