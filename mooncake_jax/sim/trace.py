"""Request traces: the Mooncake JSONL format, a Poisson generator, and prompts synthesised from block ids.

A trace line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}`` with one
id per ``block_tokens``-token block of the prompt (512 in the published traces). Ids are prefix-chained, so equal
ids at position i mean equal prefixes up to block i: that is all the simulator needs to know about the prompt.

The trace's block size is a property of the trace, not of an engine: ``synthesize_prompt`` turns ids into real
token ids at a smaller engine block size (``scale``), which is how the real-cluster demo replays a slice of the
trace on a small model while keeping its prefix sharing.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from importlib import resources
from pathlib import Path

import numpy as np

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the published Mooncake traces."""

BUNDLED_TRACES = {"conversation": "conversation_trace.jsonl.gz"}
"""Traces shipped in ``mooncake_jax/sim/data`` (see TRACE_README.md there for source and licence)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival time, prompt and output lengths, and the prompt's block ids."""

    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
        """Tokens in each block of the prompt: full blocks, the last one possibly partial."""
        n = len(self.hash_ids)
        if n == 0:
            return []
        return [block_tokens] * (n - 1) + [self.input_length - block_tokens * (n - 1)]


class Trace(Sequence):
    """An ordered list of ``TraceRequest`` with slicing helpers; arrival times never decrease.

    ``name`` says where it came from (for reports). Slicing by index or with ``first`` / ``window`` returns a
    new ``Trace``; ``with_speed`` compresses the gaps between arrivals.
    """

    def __init__(self, requests: Iterable[TraceRequest], name: str = "trace",
                 block_tokens: int = TRACE_BLOCK_TOKENS):
        self.requests: list[TraceRequest] = list(requests)
        self.name = name
        self.block_tokens = block_tokens
        last = -math.inf
        for i, r in enumerate(self.requests):
            if r.timestamp_s < last:
                raise ValueError(f"{name}: request {i} arrives before request {i - 1}; a trace must be sorted by time")
            last = r.timestamp_s

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def __getitem__(self, item):
        if isinstance(item, slice):
            return Trace(self.requests[item], self.name, self.block_tokens)
        return self.requests[item]

    def __repr__(self) -> str:
        return f"Trace({self.name!r}, {len(self)} requests, {self.duration_s:.0f} s)"

    @property
    def duration_s(self) -> float:
        return self.requests[-1].timestamp_s - self.requests[0].timestamp_s if self.requests else 0.0

    def first(self, n: int) -> "Trace":
        """The first ``n`` requests."""
        if n < 0:
            raise ValueError(f"first must be non-negative, got {n}")
        return self[:n]

    def window(self, start_s: float | None = None, end_s: float | None = None) -> "Trace":
        """Requests arriving in [start_s, end_s) (trace seconds; None leaves that side open)."""
        lo = -math.inf if start_s is None else start_s
        hi = math.inf if end_s is None else end_s
        if lo > hi:
            raise ValueError(f"empty window: start {start_s} after end {end_s}")
        return Trace([r for r in self.requests if lo <= r.timestamp_s < hi], self.name, self.block_tokens)

    def with_speed(self, speed: float) -> "Trace":
        """The same requests arriving ``speed`` times faster (2.0 halves every gap; time 0 stays put)."""
        if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
            raise ValueError(f"speed must be a positive number, got {speed!r}")
        if speed == 1:
            return self
        return Trace([dataclasses.replace(r, timestamp_s=r.timestamp_s / speed) for r in self.requests],
                     f"{self.name}@{speed:g}x", self.block_tokens)


def _parse_line(line: str, where: str, block_tokens: int) -> TraceRequest:
    try:
        row = json.loads(line)
        request = TraceRequest(float(row["timestamp"]) / 1000.0, int(row["input_length"]),
                               int(row["output_length"]), tuple(int(h) for h in row["hash_ids"]))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: not a Mooncake trace line ({type(e).__name__}: {e})") from None
    if request.input_length < 1 or request.output_length < 1:
        raise ValueError(f"{where}: input_length and output_length must be positive")
    if len(request.hash_ids) > -(-request.input_length // block_tokens):
        raise ValueError(f"{where}: {len(request.hash_ids)} hash_ids for {request.input_length} tokens at "
                         f"{block_tokens} tokens per block")
    if request.hash_ids and not (0 <= min(request.hash_ids) and max(request.hash_ids) < 2**64):
        raise ValueError(f"{where}: hash_ids must be unsigned 64-bit integers (0 to 2**64 - 1), got "
                         f"{min(request.hash_ids) if min(request.hash_ids) < 0 else max(request.hash_ids)}")
    return request


@functools.lru_cache(maxsize=4)
def _read(path: str, block_tokens: int) -> tuple[TraceRequest, ...]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return tuple(_parse_line(line, f"{path}:{i + 1}", block_tokens)
                     for i, line in enumerate(f) if line.strip())


def trace_path(source: str | Path) -> Path:
    """The file behind a trace name (``conversation``) or path; ValueError if neither."""
    name = str(source)
    if name in BUNDLED_TRACES:
        return Path(str(resources.files("mooncake_jax.sim") / "data" / BUNDLED_TRACES[name]))
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"unknown trace {name!r}: not a bundled trace ({sorted(BUNDLED_TRACES)}) nor a file")
    return path


def load_trace(source: str | Path | Trace = "conversation", first: int | None = None,
               start_s: float | None = None, end_s: float | None = None,
               block_tokens: int = TRACE_BLOCK_TOKENS) -> Trace:
    """A trace by bundled name or JSONL(.gz) path, optionally cut to a time window and then its first requests.

    A ``Trace`` passes through (cut the same way), so every API that takes a trace takes any of the three.
    """
    if isinstance(source, Trace):
        trace = source
    else:
        path = trace_path(source)
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        trace = Trace(_read(str(path), block_tokens), str(source), block_tokens)
    if start_s is not None or end_s is not None:
        trace = trace.window(start_s, end_s)
    if first is not None:
        trace = trace.first(first)
    return trace


# ----------------------------------------------------------------------------------------------- generator

LengthSpec = int | Sequence[int] | Callable[[np.random.Generator, int], Sequence[int]]


def _lengths(spec: LengthSpec, rng: np.random.Generator, n: int, what: str) -> np.ndarray:
    if callable(spec):
        values = np.asarray(spec(rng, n))
    elif isinstance(spec, (int, np.integer)):
        values = np.full(n, int(spec))
    else:
        pool = np.asarray(spec)
        if pool.size == 0:
            raise ValueError(f"{what}: empty list of lengths to sample from")
        values = rng.choice(pool, size=n)
    if values.shape != (n,) or not np.issubdtype(values.dtype, np.number):
        raise ValueError(f"{what}: expected {n} numbers, got shape {values.shape}")
    values = np.rint(values).astype(np.int64)
    if values.min(initial=1) < 1:
        raise ValueError(f"{what}: lengths must be positive")
    return values


def poisson_trace(rate_per_s: float, n_requests: int, input_lengths: LengthSpec, output_lengths: LengthSpec, *,
                  shared_prefix_tokens: int = 0, seed: int = 0,
                  block_tokens: int = TRACE_BLOCK_TOKENS) -> Trace:
    """``n_requests`` Poisson arrivals at ``rate_per_s`` with lengths from the given distributions.

    A length spec is a fixed int, a sequence to resample from (e.g. a real trace's lengths), or
    ``f(rng, n) -> n lengths``. Every prompt starts with the same ``shared_prefix_tokens`` (a system prompt, so
    its full blocks share ids); the rest of each prompt is unique.
    """
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be positive, got {rate_per_s!r}")
    if n_requests < 0 or shared_prefix_tokens < 0:
        raise ValueError("n_requests and shared_prefix_tokens must be non-negative")
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate_per_s, n_requests))
    inputs = _lengths(input_lengths, rng, n_requests, "input_lengths")
    outputs = _lengths(output_lengths, rng, n_requests, "output_lengths")
    shared = shared_prefix_tokens // block_tokens
    next_id = shared
    requests = []
    for t, n_in, n_out in zip(times, inputs, outputs):
        n_blocks = -(-int(n_in) // block_tokens)
        own = max(n_blocks - shared, 0)
        ids = tuple(range(min(shared, n_blocks))) + tuple(range(next_id, next_id + own))
        next_id += own
        requests.append(TraceRequest(float(t), int(n_in), int(n_out), ids))
    return Trace(requests, f"poisson({rate_per_s:g}/s)", block_tokens)


# -------------------------------------------------------------------------------------------------- prompts


def synthesize_prompt(hash_ids: Sequence[int], input_length: int, block_tokens: int, vocab_size: int,
                      scale: int = 1) -> list[int]:
    """Real token ids for a trace prompt: block id h becomes ``block_tokens`` ids drawn from
    ``np.random.default_rng(h)``, so equal ids give equal blocks and trace prefix sharing becomes real prefix
    sharing in an engine. The prompt has ``ceil(input_length / scale)`` tokens (the last block cut short).

    With ``block_tokens=16, scale=32`` a 512-token trace block becomes one 16-token engine block.
    """
    if block_tokens < 1 or vocab_size < 1 or scale < 1 or input_length < 1:
        raise ValueError("block_tokens, vocab_size, scale and input_length must be positive")
    if int(scale) != scale:
        raise ValueError(f"scale must be an integer, got {scale!r}")
    length = -(-int(input_length) // int(scale))
    if len(hash_ids) * block_tokens < length:
        raise ValueError(f"{len(hash_ids)} blocks of {block_tokens} tokens cannot cover a {length}-token prompt")
    if any(h < 0 for h in hash_ids):
        raise ValueError("hash ids must be non-negative")
    n_blocks = -(-length // block_tokens)
    tokens: list[int] = []
    for h in hash_ids[:n_blocks]:
        tokens.extend(np.random.default_rng(int(h)).integers(0, vocab_size, size=block_tokens).tolist())
    return tokens[:length]
