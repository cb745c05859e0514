"""``simulate``: one call from a trace and a cluster description to a ``SimResult``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from mooncake_jax.sim.config import SimConfig
from mooncake_jax.sim.metrics import SimResult
from mooncake_jax.sim.trace import Trace, load_trace

_OPTIONS = {f.name for f in dataclasses.fields(SimConfig)} - {"prefill", "decode", "policy", "admission"}


def simulate(trace: str | Path | Trace = "conversation", prefill: int = 8, decode: int = 8,
             policy: str = "kvcache-centric", admission: str = "none", speed: float = 1.0, *,
             first: int | None = None, start_s: float | None = None, end_s: float | None = None,
             progress: bool = False, observer: Callable[[float], None] | None = None, **options) -> SimResult:
    """Replay ``trace`` (bundled name, JSONL path or ``Trace``) through a simulated cluster.

    ``prefill``/``decode``: instance counts; ``policy``: the Conductor's scheduling strategy (``random``,
    ``load-balance``, ``local-cache-aware``, ``kvcache-centric``); ``admission``: ``none``, ``baseline``,
    ``early``, ``predictive``; ``speed``: arrival-rate factor (2.0 halves every gap). ``first`` / ``start_s`` /
    ``end_s`` cut the trace first. ``options``: any other ``SimConfig`` field (``hardware``,
    ``architecture="coupled"``, ``cache_tokens``, ``ttft_slo_s``...). ``progress`` shows a progress bar;
    ``observer`` is called with every event time (for tests).
    """
    unknown = set(options) - _OPTIONS
    if unknown:
        raise ValueError(f"unknown simulate option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}")
    config = SimConfig(prefill=prefill, decode=decode, policy=policy, admission=admission, **options)
    replay = load_trace(trace, first=first, start_s=start_s, end_s=end_s).with_speed(speed)
    if config.architecture == "coupled":
        from mooncake_jax.sim.coupled import CoupledSim as cluster
    else:
        from mooncake_jax.sim.disagg import DisaggregatedSim as cluster
    result = cluster(config, replay, observer=observer, progress=progress).run()
    result.summary["speed"] = speed
    return result
