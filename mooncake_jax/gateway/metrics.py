"""Prometheus metrics of one gateway, in a registry of its own (several gateways in one process, as in tests,
must not share or collide), rendered by ``GET /metrics``.

The gateway's own series (TTFT, TBT, requests by outcome, rejections by stage, tokens) are measured at the
gateway, so they include queueing, scheduling and transfer time as a client sees it. The backend's figures
(queue depths, cache hits, transfer bytes, ...) are read from ``backend.stats()`` at every scrape and exported
as ``mooncake_backend_<key>``: keys ending in ``_total`` become counters, the rest gauges; a key may carry labels
the Prometheus way, ``queue_depth{instance="p0"}``.
"""

from __future__ import annotations

import logging
import numbers
import re
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2.5)

# Outcomes of a generation request, the label of mooncake_gateway_requests_total.
OUTCOMES = ("length", "stop", "abort", "cancelled", "invalid", "rejected", "unavailable", "error")


class GatewayMetrics:
    def __init__(self, stats: Callable[[], dict[str, float]] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("mooncake_gateway_ttft_seconds", "Arrival at the gateway to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tbt = Histogram("mooncake_gateway_tbt_seconds",
                             "Per request: mean of the longest 10% of the gaps between tokens (the paper's TBT)",
                             buckets=TBT_BUCKETS, registry=r)
        self.requests = Counter("mooncake_gateway_requests", "Generation requests by front end and outcome",
                                ["api", "outcome"], registry=r)
        self.rejections = Counter("mooncake_gateway_rejections", "Requests refused for overload, by stage "
                                  "(early: before prefill; late: by the decode instance)", ["stage"], registry=r)
        self.tokens = Counter("mooncake_gateway_tokens", "Tokens by kind (prompt, cached prompt, output)",
                              ["kind"], registry=r)
        self.in_flight = Gauge("mooncake_gateway_requests_in_flight", "Generation requests being served",
                               registry=r)
        for api in ("grpc", "http"):
            for outcome in OUTCOMES:
                self.requests.labels(api, outcome)
        for stage in ("early", "late"):
            self.rejections.labels(stage)
        for kind in ("prompt", "cached", "output"):
            self.tokens.labels(kind)
        if stats is not None:
            r.register(_BackendStats(stats))

    def finished(self, api: str, outcome: str, *, ttft_s: float | None = None, tbt_s: float | None = None,
                 prompt_tokens: int = 0, cached_tokens: int = 0, output_tokens: int = 0) -> None:
        self.requests.labels(api, outcome).inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tbt_s is not None:
            self.tbt.observe(tbt_s)
        self.tokens.labels("prompt").inc(prompt_tokens)
        self.tokens.labels("cached").inc(cached_tokens)
        self.tokens.labels("output").inc(output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


_KEY = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?$")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"([^"]*)"\s*,?')


class _BackendStats:
    """A collector over ``backend.stats()``; a failing or malformed stats call costs its series, not /metrics."""

    def __init__(self, stats: Callable[[], dict[str, float]]):
        self._stats = stats

    def describe(self):
        return []  # the names are only known at scrape time

    def collect(self):
        try:
            stats = dict(self._stats())
        except Exception:  # noqa: BLE001 - the backend's problem must not break the scrape
            log.exception("backend.stats() failed")
            return
        families: dict[str, tuple[GaugeMetricFamily | CounterMetricFamily, list[str]]] = {}
        for key, value in sorted(stats.items()):
            parsed = _parse_key(key)
            if parsed is None:
                log.warning("backend stat %r is not a metric name; skipped", key)
                continue
            name, labels = parsed
            counter = name.endswith("_total")
            base = "mooncake_backend_" + (name[: -len("_total")] if counter else name)
            if base not in families:
                cls = CounterMetricFamily if counter else GaugeMetricFamily
                families[base] = cls(base, f"backend.stats() {name}", labels=sorted(labels)), sorted(labels)
            family, names = families[base]
            if sorted(labels) != names or not isinstance(value, numbers.Real):
                log.warning("backend stat %r = %r: not a number, or labels unlike its family's; skipped", key, value)
                continue
            family.add_metric([labels[k] for k in names], float(value))
        yield from (family for family, _ in families.values())


def _parse_key(key: str) -> tuple[str, dict[str, str]] | None:
    m = _KEY.match(str(key))
    if m is None:
        return None
    labels = dict(_LABEL.findall(m.group(2) or ""))
    return m.group(1), labels
