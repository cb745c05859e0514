"""Prometheus metrics of one gateway, in a registry of its own (several gateways in one process, as in tests,
must not share or collide), rendered by ``GET /metrics``.

Conventional series, named and bucketed as vLLM's (``vllm:<name>`` there, ``mooncake_<name>`` here) so existing
dashboards and alerts carry over: ``time_to_first_token_seconds``, ``inter_token_latency_seconds`` (one sample
per gap between two tokens), ``e2e_request_latency_seconds``, ``prefix_cache_queries`` / ``prefix_cache_hits``
(prompt tokens looked up / found in the KV cache), ``num_requests_running`` / ``num_requests_waiting``,
``prompt_tokens`` / ``generation_tokens``, ``request_success`` by finish reason, and ``kv_cache_usage_perc`` (by
instance, 0..1). They are measured at the gateway, so they include queueing, scheduling and transfer time as a
client sees it; "waiting" is a request accepted but without its first token yet (queued, prefilling, its KV
moving), "running" one that is decoding.

The cluster's own: the paper's TBT (``mooncake_gateway_tbt_seconds``: per request, the mean of its longest 10%
token gaps), requests by front end and outcome, rejections by stage (early: before prefill; late: by the decode
instance), and from the backend's figures per instance: ``mooncake_transfer_bytes`` / ``mooncake_transfer_seconds``
(Messenger), ``mooncake_instance_queue_seconds`` (predicted prefill queue) and
``mooncake_instance_running_requests`` (load). Every figure ``backend.stats()`` reports is also exported raw as
``mooncake_backend_<key>``: keys ending in ``_total`` become counters, the rest gauges; a key may carry labels
the Prometheus way, ``queue_depth{instance="p0"}``. ``docs/grafana-dashboard.json`` plots these series.

prometheus_client earns its place: histogram bucket and ``_sum``/``_count`` series, label escaping, the text
format and its content type, and scrape-time collectors are all its job, and it is what vLLM uses.
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
# vLLM's buckets (vllm/v1/metrics/loggers.py) for the series of the same names.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2.5)

# Series derived from backend.stats() keys: (exported name, counter?, the stat keys it reads (a cluster's,
# labelled by instance; a coupled engine's, unlabelled), labels added, help).
DERIVED = (
    ("mooncake_kv_cache_usage_perc", False, ("instance_engine_kv_usage", "engine_kv_usage"), {},
     "Fraction of the instance's KV cache pages in use (0..1)"),
    ("mooncake_transfer_bytes", True, ("instance_messenger_bytes_sent",), {"direction": "sent"},
     "KV bytes the instance's Messenger moved, by direction"),
    ("mooncake_transfer_bytes", True, ("instance_messenger_bytes_received",), {"direction": "received"},
     "KV bytes the instance's Messenger moved, by direction"),
    ("mooncake_transfer_seconds", True, ("instance_messenger_busy_s",), {},
     "Seconds the instance's Messenger spent moving KV (bytes / seconds: its transfer rate)"),
    ("mooncake_instance_queue_seconds", False, ("instance_predicted_queue_s",), {},
     "Predicted seconds of prefill work queued on the instance (the Conductor's view of its load)"),
    ("mooncake_instance_running_requests", False, ("instance_engine_running", "engine_running"), {},
     "Requests in the instance's running batch"),
)

# Outcomes of a generation request, the label of mooncake_gateway_requests_total.
OUTCOMES = ("length", "stop", "abort", "cancelled", "invalid", "rejected", "unavailable", "error")


class GatewayMetrics:
    def __init__(self, stats: Callable[[], dict[str, float]] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("mooncake_time_to_first_token_seconds", "Arrival at the gateway to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("mooncake_inter_token_latency_seconds", "Each gap between two tokens of a request",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("mooncake_e2e_request_latency_seconds", "Arrival at the gateway to the last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.prefix_cache_queries = Counter("mooncake_prefix_cache_queries",
                                            "Prompt tokens looked up in the KV cache", registry=r)
        self.prefix_cache_hits = Counter("mooncake_prefix_cache_hits",
                                         "Prompt tokens whose KV was found in a cache (not recomputed)", registry=r)
        self.running = Gauge("mooncake_num_requests_running", "Requests decoding (their first token sent)",
                             registry=r)
        self.waiting = Gauge("mooncake_num_requests_waiting",
                             "Requests accepted but without their first token yet (queued, prefilling, KV moving)",
                             registry=r)
        self.prompt_tokens = Counter("mooncake_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("mooncake_generation_tokens", "Tokens generated", registry=r)
        self.success = Counter("mooncake_request_success", "Requests finished, by finish reason",
                               ["finished_reason"], registry=r)
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
        for reason in ("length", "stop", "abort"):
            self.success.labels(reason)
        if stats is not None:
            r.register(_BackendStats(stats))

    def started(self) -> None:
        """A request was accepted by the gateway: waiting until its first token."""
        self.in_flight.inc()
        self.waiting.inc()

    def first_token(self) -> None:
        self.waiting.dec()
        self.running.inc()

    def ended(self, decoding: bool) -> None:
        """A ``started`` request ended, ``decoding`` when it had its first token."""
        self.in_flight.dec()
        (self.running if decoding else self.waiting).dec()

    def finished(self, api: str, outcome: str, *, ttft_s: float | None = None, tbt_s: float | None = None,
                 token_gaps_s=(), e2e_s: float | None = None, prompt_tokens: int = 0, cached_tokens: int = 0,
                 output_tokens: int = 0) -> None:
        """A request ended (or was refused before it started): count it."""
        self.requests.labels(api, outcome).inc()
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tbt_s is not None:
            self.tbt.observe(tbt_s)
        for gap in token_gaps_s:
            self.itl.observe(gap)
        if outcome in ("length", "stop", "abort"):
            self.success.labels(outcome).inc()
            if e2e_s is not None:
                self.e2e.observe(e2e_s)
            self.prefix_cache_queries.inc(prompt_tokens)
            self.prefix_cache_hits.inc(cached_tokens)
            self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
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
        yield from _derived(stats)


def _derived(stats: dict) -> list:
    """The ``DERIVED`` series from one ``stats()`` snapshot (an unlabelled key counts as instance "engine")."""
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for key, value in stats.items():
        parsed = _parse_key(key)
        if parsed is not None and isinstance(value, numbers.Real):
            by_name.setdefault(parsed[0], []).append((parsed[1], float(value)))
    for name, counter, sources, extra, help_text in DERIVED:
        for source in sources:
            for labels, value in by_name.get(source, ()):
                if name not in families:
                    cls = CounterMetricFamily if counter else GaugeMetricFamily
                    families[name] = cls(name, help_text, labels=["instance", *sorted(extra)])
                instance = labels.get("instance", "engine")
                families[name].add_metric([instance, *(extra[k] for k in sorted(extra))], value)
    return list(families.values())


def _parse_key(key: str) -> tuple[str, dict[str, str]] | None:
    m = _KEY.match(str(key))
    if m is None:
        return None
    labels = dict(_LABEL.findall(m.group(2) or ""))
    return m.group(1), labels
