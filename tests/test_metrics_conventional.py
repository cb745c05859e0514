"""/metrics by convention: vLLM's series names and buckets under ``mooncake_`` (one inter-token sample per token
gap, waiting until the first token then running, prefix-cache queries and hits in prompt tokens), the series
derived from the backend's figures (KV usage, transfer bytes and seconds, per-instance load), and the Grafana
dashboard in docs/ asking only for series that are exported. Counted by hand against a fake backend."""

import json
import re
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_gateway_support import FakeBackend, call_http, wait_for

from mooncake_jax.gateway import GatewayServer

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"

# vLLM's buckets (vllm/v1/metrics/loggers.py), written out by hand.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_E2E = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
            960.0, 1920.0, 7680.0]


class ClusterLikeBackend(FakeBackend):
    """Reports the figures a cluster's instances report (labelled by instance)."""

    def stats(self):
        return {'instance_engine_kv_usage{instance="d0"}': 0.25, 'instance_engine_kv_usage{instance="p0"}': 0.5,
                'instance_messenger_bytes_sent{instance="p0"}': 4096.0,
                'instance_messenger_bytes_received{instance="d0"}': 4096.0,
                'instance_messenger_busy_s{instance="p0"}': 0.5, 'instance_predicted_queue_s{instance="p0"}': 1.5,
                'instance_engine_running{instance="d0"}': 3.0}


def scrape(port) -> dict:
    status, _, text = call_http(port, "GET", "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def complete(port, body):
    return call_http(port, "POST", "/v1/completions", {"model": "fake-model", **body})


@pytest.fixture
def served():
    backend = ClusterLikeBackend()
    with GatewayServer(backend, grpc_port=None) as gw:
        yield backend, gw


def buckets_of(samples, name):
    return sorted(float(dict(labels)["le"]) for n, labels in samples if n == name + "_bucket"
                  and dict(labels)["le"] != "+Inf")


def test_vllm_names_buckets_and_counts(served):
    backend, gw = served
    before = scrape(gw.http_port)
    assert buckets_of(before, "mooncake_time_to_first_token_seconds") == VLLM_TTFT
    assert buckets_of(before, "mooncake_inter_token_latency_seconds") == VLLM_ITL
    assert buckets_of(before, "mooncake_e2e_request_latency_seconds") == VLLM_E2E
    backend.reply, backend.cached_tokens, backend.token_delay_s = [40, 41, 42, 43, 44], 16, 0.02
    assert complete(gw.http_port, {"prompt": list(range(1, 21)), "max_tokens": 5})[0] == 200
    assert complete(gw.http_port, {"prompt": [1, 5, 6], "max_tokens": 2})[0] == 200
    assert complete(gw.http_port, {"prompt": ""})[0] == 400  # refused: counted as nothing below
    after = scrape(gw.http_port)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert delta("mooncake_time_to_first_token_seconds_count") == 2
    assert delta("mooncake_inter_token_latency_seconds_count") == 4 + 1  # one per gap: 5 tokens, then 2
    gaps = delta("mooncake_inter_token_latency_seconds_sum")
    assert 5 * 0.02 * 0.9 < gaps < 5 * 1.0  # each gap is at least the backend's 20 ms delay
    assert delta("mooncake_inter_token_latency_seconds_bucket", le="0.01") == 0  # none shorter than 20 ms
    assert delta("mooncake_e2e_request_latency_seconds_count") == 2
    assert delta("mooncake_e2e_request_latency_seconds_sum") >= 7 * 0.02
    assert delta("mooncake_prefix_cache_queries_total") == 20 + 3
    assert delta("mooncake_prefix_cache_hits_total") == 16 + 16
    assert delta("mooncake_prompt_tokens_total") == 23 and delta("mooncake_generation_tokens_total") == 7
    assert delta("mooncake_request_success_total", finished_reason="length") == 2
    assert after[("mooncake_num_requests_running", ())] == 0 and after[("mooncake_num_requests_waiting", ())] == 0


def test_waiting_until_the_first_token_then_running(served):
    backend, gw = served
    backend.reply, backend.pause_after = [40, 41, 42], 0  # holds before its first token

    def gauges():
        s = scrape(gw.http_port)
        return s[("mooncake_num_requests_waiting", ())], s[("mooncake_num_requests_running", ())]

    worker = threading.Thread(target=complete, args=(gw.http_port, {"prompt": [1, 5], "max_tokens": 3}))
    worker.start()
    try:
        assert wait_for(lambda: gauges() == (1, 0)), gauges()
        backend.pause_after = 1  # the paused request passes token 0, then holds before token 1
        backend.release.set()
        backend.release = threading.Event()
    finally:
        backend.release.set()
        worker.join(30)
    assert gauges() == (0, 0)
    backend.reset()
    backend.reply, backend.pause_after = [40, 41, 42], 1
    worker = threading.Thread(target=complete, args=(gw.http_port, {"prompt": [1, 5], "max_tokens": 3}))
    worker.start()
    try:
        assert wait_for(lambda: gauges() == (0, 1)), gauges()
    finally:
        backend.release.set()
        worker.join(30)
    assert gauges() == (0, 0)


def test_series_derived_from_the_backend_figures(served):
    _, gw = served
    s = scrape(gw.http_port)
    assert s[("mooncake_kv_cache_usage_perc", (("instance", "d0"),))] == 0.25
    assert s[("mooncake_kv_cache_usage_perc", (("instance", "p0"),))] == 0.5
    assert s[("mooncake_transfer_bytes_total", (("direction", "sent"), ("instance", "p0")))] == 4096
    assert s[("mooncake_transfer_bytes_total", (("direction", "received"), ("instance", "d0")))] == 4096
    assert s[("mooncake_transfer_seconds_total", (("instance", "p0"),))] == 0.5
    assert s[("mooncake_instance_queue_seconds", (("instance", "p0"),))] == 1.5
    assert s[("mooncake_instance_running_requests", (("instance", "d0"),))] == 3


def dashboard_series() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(dashboard["panels"]) >= 8 and all(p["targets"] for p in dashboard["panels"])
    return {name for e in exprs for name in re.findall(r"\bmooncake_[a-z0-9_]+", e)}


def test_the_dashboard_asks_only_for_exported_series(served):
    backend, gw = served
    assert complete(gw.http_port, {"prompt": [1, 5], "max_tokens": 2})[0] == 200
    exported = {name for name, _ in scrape(gw.http_port)}
    used = dashboard_series()
    assert {"mooncake_time_to_first_token_seconds_bucket", "mooncake_inter_token_latency_seconds_bucket",
            "mooncake_kv_cache_usage_perc", "mooncake_transfer_bytes_total"} <= used
    assert used - exported == set()
