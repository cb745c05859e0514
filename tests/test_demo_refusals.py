"""``mooncake-jax demo`` keeps each refused request's reason (issue 11 point 6: the plain demo refused one request
in a few runs, and no message said why): the summary's ``refusals`` list and its one printed line, from the
messages the served cluster really sends, early (the Conductor, with its predictions) and late (an instance)."""

import re

import pytest

import mooncake_jax as mj
from mooncake_jax import demo
from mooncake_jax.conductor.accounting import prefill_work_s
from mooncake_jax.conductor.profile import costs_from_profile
from mooncake_jax.instance.backend import conductor_messages, predictions
from tiny_profile import PROFILE

FAST = dict(warmup=False, compile_cache=None, profile_json=PROFILE)
EARLY = ("overloaded (ttft_slo): predicted TTFT 2.731 s (queue 1.200 s + prefill 1.500 s on prefill-0), TBT "
         "0.0040 s on decode-0 (retry after 0.731 s)")
LATE_PREFILL = ("prefill instance prefill-1 is overloaded: prefill instance prefill-1 cannot meet the TTFT SLO of 2 s "
                "(out of the queue: 0.52 s of work, 0.00 s left) (retry after 1 s)")
LATE_DECODE = "decode instance decode-0 rejected the request: no room (retry after 1 s)"


def test_refusals_list_each_reason_and_one_line_counts_them():
    items = [{"at": 0.5 * i, "prompt": [1] * (10 + i)} for i in range(6)]
    results = [{"status": "completed", "times": [0.1]},
               {"status": "rejected", "code": 429, "error": EARLY, "stage": "early", "cause": "ttft_slo"},
               {"status": "rejected", "code": 429, "error": LATE_PREFILL, "stage": "late", "cause": "prefill-1"},
               {"status": "failed", "error": "x"},
               {"status": "rejected", "code": 429, "error": LATE_DECODE, "stage": "late", "cause": "decode-0"},
               {"status": "rejected", "code": 429, "error": "a proxy's 429", "stage": "", "cause": ""}]
    refused = demo.refusals(results, items)
    assert refused == [
        {"request": 1, "at_s": 0.5, "prompt_tokens": 11, "stage": "early", "cause": "ttft_slo", "reason": EARLY},
        {"request": 2, "at_s": 1.0, "prompt_tokens": 12, "stage": "late", "cause": "prefill-1", "reason": LATE_PREFILL},
        {"request": 4, "at_s": 2.0, "prompt_tokens": 14, "stage": "late", "cause": "decode-0", "reason": LATE_DECODE},
        {"request": 5, "at_s": 2.5, "prompt_tokens": 15, "stage": "", "cause": "", "reason": "a proxy's 429"}]
    assert demo.refusal_line(refused) == ("refused 4: early 1 (ttft_slo 1), late 2 (decode-0 1, prefill-1 1), "
                                          "unknown 1 (unknown 1)")
    assert demo.refusal_line(refused[:3]) == "refused 3: early 1 (ttft_slo 1), late 2 (decode-0 1, prefill-1 1)"
    assert demo.refusal_line([]) == "refused 0"


def test_error_fields_read_the_openai_error_body():
    assert demo.error_fields('{"error": {"message": "overloaded (tbt_slo): x", "code": 429, "stage": "early", '
                             '"cause": "tbt_slo"}}') == {"message": "overloaded (tbt_slo): x", "code": 429,
                                                         "stage": "early", "cause": "tbt_slo"}
    assert demo.error_fields("<html>bad gateway</html>") == {"message": "<html>bad gateway</html>"}  # not JSON


def test_the_conductors_refusal_names_its_predictions():
    reply = conductor_messages.ScheduleReply(
        accepted=False, reject_reason="ttft_slo", predicted_ttft_s=2.731, predicted_queue_s=1.2,
        predicted_prefill_s=1.5, prefill_id="prefill-0", decode_id="decode-0", predicted_tbt_s=0.004)
    assert predictions(reply) == ("predicted TTFT 2.731 s (queue 1.200 s + prefill 1.500 s on prefill-0), TBT "
                                  "0.0040 s on decode-0")
    reply.decode_id = ""
    assert predictions(reply).endswith("TBT 0.0040 s (no decode instance had room)")


@pytest.mark.timeout(600)
def test_refusals_through_the_gateway_explain_themselves():
    """A served cluster refusing for real: early with a TTFT SLO nothing meets (the message's predicted prefill is
    the registered profile's cost of that prompt, worked out here from the profile, and its TTFT exceeds the SLO),
    late when the decode instance cannot meet a TBT SLO under admission ``none``."""
    prompt = list(range(1, 41))
    items = [{"at": 0.0, "prompt": prompt, "max_tokens": 3}]
    with mj.Cluster.local("tiny", prefill=1, decode=1, ttft_slo_s=1e-3, **FAST) as cluster:
        gateway = cluster.serve_gateway(grpc_port=None, http_port=0)
        result = demo.send(f"http://127.0.0.1:{gateway.http_port}/v1/completions", items[0])
    [refusal] = demo.refusals([result], items)
    assert (refusal["stage"], refusal["cause"]) == ("early", "ttft_slo")
    assert refusal["reason"].startswith("overloaded (ttft_slo): predicted TTFT ")
    ttft, prefill = (float(x) for x in re.search(r"predicted TTFT ([\d.]+) s \(queue [\d.]+ s \+ prefill ([\d.]+) s "
                                                 r"on prefill-0\)", refusal["reason"]).groups())
    assert prefill == pytest.approx(prefill_work_s(costs_from_profile(PROFILE).prefill, len(prompt), 0), abs=1e-3)
    assert ttft > 1e-3 and ttft >= prefill - 1e-3
    with mj.Cluster.local("tiny", prefill=1, decode=1, admission="none", tbt_slo_s=1e-6, **FAST) as cluster:
        gateway = cluster.serve_gateway(grpc_port=None, http_port=0)
        result = demo.send(f"http://127.0.0.1:{gateway.http_port}/v1/completions", items[0])
    [refusal] = demo.refusals([result], items)
    assert (refusal["stage"], refusal["cause"]) == ("late", "decode-0")
    assert refusal["reason"].startswith("decode instance decode-0 rejected")
    assert demo.refusal_line([refusal]) == "refused 1: late 1 (decode-0 1)"


def test_slowdowns_read_each_prefill_instances_meter():
    stats = {'instance_prefill_slowdown{instance="prefill-1"}': 1.23456, 'cluster_rejected_early_total': 3.0,
             'instance_prefill_slowdown{instance="prefill-0"}': 0.9, 'instance_prefill_queued_s{instance="p"}': 2.0}
    assert demo.slowdowns(stats) == {"prefill-0": 0.9, "prefill-1": 1.235}
