"""From the finished requests to the figures the paper reports, and the result object ``simulate`` returns.

Definitions (all over the requests of the trace, rejected ones included where it says so):

- TTFT: first token minus arrival, over completed requests. TBT: per request, the mean of its longest 10% of
  token gaps (``mooncake_jax.slo.tbt_of_gaps``); percentiles over completed requests that have at least one gap.
- SLO attainment: completed requests with TTFT <= ``ttft_slo_s`` and TBT <= ``tbt_slo_s``, divided by *all*
  requests (the effective share the cluster served well; rejected requests count against it).
- Cache hit ratio: cached prefix blocks reused / prompt blocks, over prefilled requests (``_tokens``: tokens).
- Prefill compute: seconds of prefill computation spent; wasted: the part spent on requests rejected late.
- Cost: the cluster's cost per hour (each instance's profile) over the run's duration, per completed request and
  per million tokens of completed requests (prompt + generated, and generated only).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from mooncake_jax.sim.records import COMPLETED, REJECTED_EARLY, REJECTED_LATE, SimRequest


def _stat(values: np.ndarray, fn) -> float | None:
    return float(fn(values)) if values.size else None


def summarize(requests: list[SimRequest], *, ttft_slo_s: float, tbt_slo_s: float, block_tokens: int,
              duration_s: float, wall_s: float, cost_per_hour: float) -> dict:
    """The summary dict (``SimResult.summary``); None where a figure has no data (e.g. no request completed)."""
    status = np.array([r.status for r in requests])
    done = [r for r, s in zip(requests, status) if s == COMPLETED]
    ttft = np.array([r.ttft_s for r in done])
    tbt_all = np.array([r.tbt_s for r in done])
    tbt = tbt_all[~np.isnan(tbt_all)]
    met = int(np.count_nonzero((ttft <= ttft_slo_s) & ~(tbt_all > tbt_slo_s))) if done else 0
    prefilled = [r for r in requests if not math.isnan(r.prefill_start)]
    blocks = sum(len(r.keys) for r in prefilled)
    tokens = sum(r.input_tokens for r in prefilled)
    late = [r for r, s in zip(requests, status) if s == REJECTED_LATE]
    n = len(requests)
    hours = duration_s / 3600.0
    served_output = int(sum(r.output_tokens for r in done))
    served_tokens = int(sum(r.input_tokens for r in done)) + served_output
    return {
        "requests": n,
        "completed": len(done),
        "rejected_early": int(np.count_nonzero(status == REJECTED_EARLY)),
        "rejected_late": int(np.count_nonzero(status == REJECTED_LATE)),
        "avg_ttft_s": _stat(ttft, np.mean),
        "p50_ttft_s": _stat(ttft, np.median),
        "p90_ttft_s": _stat(ttft, lambda v: np.percentile(v, 90)),
        "p99_ttft_s": _stat(ttft, lambda v: np.percentile(v, 99)),
        "avg_tbt_s": _stat(tbt, np.mean),
        "p90_tbt_s": _stat(tbt, lambda v: np.percentile(v, 90)),
        "p99_tbt_s": _stat(tbt, lambda v: np.percentile(v, 99)),
        "slo_attainment": met / n if n else None,
        "slo_met": met,
        "ttft_slo_s": ttft_slo_s,
        "tbt_slo_s": tbt_slo_s,
        "cache_hit_ratio": sum(r.prefix_blocks for r in prefilled) / blocks if blocks else None,
        "cache_hit_ratio_tokens": sum(r.prefix_tokens for r in prefilled) / tokens if tokens else None,
        "prefill_compute_s": float(sum(r.prefill_s for r in prefilled)),
        "avg_prefill_s": float(np.mean([r.prefill_s for r in prefilled])) if prefilled else None,
        "wasted_prefill_s": float(sum(r.prefill_s for r in late)),
        "fetched_blocks": int(sum(r.fetched_blocks for r in requests)),
        "sim_duration_s": duration_s,
        "throughput_rps": len(done) / duration_s if duration_s > 0 else None,
        "goodput_rps": met / duration_s if duration_s > 0 else None,
        "wall_s": wall_s,
        "requests_per_wall_s": n / wall_s if wall_s > 0 else None,
        "cluster_cost_per_hour": cost_per_hour,
        "cost_per_request": cost_per_hour * hours / len(done) if done else None,
        "completed_tokens": served_tokens,
        "completed_output_tokens": served_output,
        "cost_per_million_tokens": cost_per_hour * hours / served_tokens * 1e6 if served_tokens else None,
        "cost_per_million_output_tokens": cost_per_hour * hours / served_output * 1e6 if served_output else None,
        "trace_block_tokens": block_tokens,
    }


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    return value


@dataclasses.dataclass
class SimResult:
    """One run: ``summary`` (see ``summarize``), the ``requests`` with their milestones, ``load`` over time
    (``records.LoadLog`` series), and the ``config`` and trace ``name`` it ran with."""

    summary: dict
    requests: list[SimRequest]
    load: dict[str, list[float]]
    config: dict
    trace: str

    def per_request(self) -> dict[str, np.ndarray]:
        """Per-request columns: arrival, ttft_s, tbt_s, prefill_s, prefix_blocks, status."""
        reqs = self.requests
        return {
            "arrival": np.array([r.arrival for r in reqs]),
            "ttft_s": np.array([r.ttft_s for r in reqs]),
            "tbt_s": np.array([r.tbt_s for r in reqs]),
            "prefill_s": np.array([r.prefill_s for r in reqs]),
            "prefix_blocks": np.array([r.prefix_blocks for r in reqs]),
            "status": np.array([r.status for r in reqs]),
        }

    def to_dict(self, load: bool = True) -> dict:
        """The summary's keys at the top level (what ``--json`` promises), plus ``trace``, ``config`` and
        ``load`` (the series over time, unless ``load`` is False)."""
        out = {**self.summary, "trace": self.trace, "config": self.config}
        if load:
            out["load"] = self.load
        return _jsonable(out)

    def write_json(self, path: str | Path, load: bool = True) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(load), indent=1, allow_nan=False) + "\n")


def to_json_text(obj) -> str:
    """JSON for experiment outputs (NaN and inf become null)."""
    return json.dumps(_jsonable(obj), indent=1, allow_nan=False) + "\n"
