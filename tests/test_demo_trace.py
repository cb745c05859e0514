"""``mooncake-jax demo --trace F``: each request's client-side token times on the host's monotonic clock, with the
completion's id, so a long token gap can be set beside what the servers did (the eleventh pass's diagnosis)."""

import json
import time

import mooncake_jax as mj
from mooncake_jax import demo
from tiny_profile import PROFILE

FAST = dict(warmup=False, compile_cache=None, profile_json=PROFILE)


def test_send_keeps_the_completion_id_and_its_start_on_the_monotonic_clock():
    items = [{"at": 0.0, "prompt": list(range(1, 41)), "max_tokens": 4},
             {"at": 0.5, "prompt": list(range(1, 9)), "max_tokens": 2}]
    with mj.Cluster.local("tiny", prefill=1, decode=1, **FAST) as cluster:
        gateway = cluster.serve_gateway(grpc_port=None, http_port=0)
        before = time.perf_counter()
        result = demo.send(f"http://127.0.0.1:{gateway.http_port}/v1/completions", items[0])
        after = time.perf_counter()
    assert result["status"] == "completed"
    assert result["id"].startswith("cmpl-") and len(result["id"]) > len("cmpl-")
    assert before <= result["started"] <= result["started"] + result["times"][-1] <= after
    assert len(result["times"]) == 4 and result["times"] == sorted(result["times"])
    refused = {"status": "rejected", "code": 429, "error": "overloaded (ttft_slo): ..."}
    trace = demo.client_trace([result, refused], items)
    assert [t["request"] for t in trace] == [0, 1]
    assert trace[0]["id"] == result["id"] and trace[0]["started"] == result["started"]
    assert trace[0]["times"] == result["times"] and trace[0]["prompt_tokens"] == 40
    assert trace[1] == {"request": 1, "at_s": 0.5, "prompt_tokens": 8, "status": "rejected", "id": None,
                        "started": None, "times": None}
    json.dumps(trace)  # what --trace writes
