"""Admission policies on hand-computed timelines, the decode side's late check, t_d tracking, and reports.

Timeline costs: every prefill takes 1 s whatever its length; a decode step takes 10 ms per request in the batch;
TBT SLO 35 ms, so a decode instance takes this request only while at most 2 others decode beside it;
uniform decode time t_d = 5 s.
"""

import pytest
from test_conductor_support import cluster

from mooncake_jax.conductor import DecodeCost, InstanceCosts, PrefillCost, RejectReason, Request, decode_accepts

FLAT = InstanceCosts("flat", PrefillCost((1.0, 0.0, 0.0, 0.0)), DecodeCost((0.0, 0.01, 0.0)),
                     kv_bytes_per_token=1, nic_bytes_per_s=1e9, kv_capacity_tokens=10**6)
POLICIES = ("none", "baseline", "early", "predictive")


def timeline(admission):
    return cluster(prefill=("P0", "P1", "P2", "P3"), decode=("D",), costs=FLAT, admission=admission,
                   tbt_slo_s=0.035, decode_time_s=5.0)


def req(name, n=16):
    return Request(name, [], n, 4)


def test_predictive_accepts_what_early_rejects_because_decode_load_will_have_drained():
    # t=5: three requests are routed (prefills on P0..P2 end at 6); t=6 their decode begins, ending at 6 + t_d = 11.
    # t=10: a new request would finish prefill at 11. Now: 3 decoding -> 40 ms > 35 ms. At 11: all done -> 10 ms.
    outcomes = {}
    for admission in POLICIES:
        state, policy = timeline(admission)
        for i in range(3):
            assert state.schedule(policy, req(f"a{i}"), 5.0).prefill_end_at == 6.0
        for i in range(3):
            state.decode_started(f"a{i}", 6.0)
        outcomes[admission] = policy.decide(req("new"), state.snapshot(), 10.0)
    assert outcomes["early"].reason == RejectReason.TBT_SLO
    assert outcomes["early"].predicted_tbt_s == pytest.approx(0.04)
    assert outcomes["predictive"].accepted and outcomes["predictive"].predicted_tbt_s == pytest.approx(0.01)
    assert outcomes["none"].accepted and outcomes["baseline"].accepted
    assert outcomes["predictive"].prefill_end_at == 11.0


def test_predictive_rejects_what_early_accepts_because_prefills_in_flight_arrive_first():
    # t=9.5: three requests routed to P0..P2, their prefills end at 10.5 (their KV reaches D then).
    # t=10: the new request goes to idle P3 and ends at 11. Now D runs nothing -> 10 ms; at 11 it runs those
    # three -> 40 ms > 35 ms.
    outcomes = {}
    for admission in POLICIES:
        state, policy = timeline(admission)
        for i in range(3):
            state.schedule(policy, req(f"a{i}"), 9.5)
        outcomes[admission] = policy.decide(req("new"), state.snapshot(), 10.0)
    assert outcomes["predictive"].prefill == "P3"
    assert outcomes["predictive"].reason == RejectReason.TBT_SLO
    assert outcomes["predictive"].predicted_tbt_s == pytest.approx(0.04)
    assert outcomes["early"].accepted and outcomes["early"].predicted_tbt_s == pytest.approx(0.01)
    # baseline leaves TBT to the decode instance; its estimate still reports the predicted 40 ms
    assert outcomes["baseline"].accepted and outcomes["baseline"].predicted_tbt_s == pytest.approx(0.04)
    assert outcomes["none"].accepted


def test_ttft_slo_applies_to_every_policy_but_none():
    for admission in POLICIES:
        state, policy = timeline(admission)
        for name in ("P0", "P1", "P2", "P3"):
            state.heartbeat(name, 0.0, queued_s=29.5)  # 29.5 + 1 s > 30 s
        d = policy.decide(req("r"), state.snapshot(), 0.0)
        assert d.accepted is (admission == "none")
        if admission != "none":
            assert d.reason == RejectReason.TTFT_SLO and d.retry_after_s == pytest.approx(0.5)


def test_decode_side_late_check():
    flat = FLAT.decode
    assert decode_accepts(flat, batch=2, context_tokens=0, kv_tokens=10, tbt_slo_s=0.035)  # 30 ms
    assert not decode_accepts(flat, batch=3, context_tokens=0, kv_tokens=10, tbt_slo_s=0.035)  # 40 ms
    assert not decode_accepts(flat, batch=0, context_tokens=95, kv_tokens=10, tbt_slo_s=1.0, kv_capacity_tokens=100)
    assert decode_accepts(flat, batch=0, context_tokens=90, kv_tokens=10, tbt_slo_s=1.0, kv_capacity_tokens=100)


def test_decode_time_tracked_as_moving_average_and_used_by_prediction():
    state, policy = cluster(prefill=("P0", "P1", "P2", "P3"), decode=("D",), costs=FLAT, admission="predictive",
                            tbt_slo_s=0.035, decode_time_init_s=20.0, decode_time_smoothing=0.5)
    assert state.decode_time_s == 20.0
    state.schedule(policy, req("a"), 0.0)
    state.decode_started("a", 1.0)
    assert state.finished("a", 5.0)  # decoded 4 s: 20 + 0.5 * (4 - 20) = 12
    assert state.decode_time_s == pytest.approx(12.0)
    assert not state.finished("a", 6.0)  # already gone: no second sample
    # Three decoding since t=1 finish at 1 + 12 = 13: at t=12.5 a request ending at 13.5 meets none of them.
    for i in range(3):
        state.schedule(policy, req(f"b{i}"), 0.0)
        state.decode_started(f"b{i}", 1.0)
    assert policy.decide(req("late"), state.snapshot(), 12.5).accepted
    assert policy.decide(req("early"), state.snapshot(), 11.0).reason == RejectReason.TBT_SLO


def test_reports_correct_the_predictions():
    state, policy = timeline("predictive")
    d = state.schedule(policy, req("a"), 0.0)
    slot_p, slot_d = state.instances.slot(d.prefill), state.instances.slot("D")
    assert state.instances.queue_free_at[slot_p] == 1.0
    state.heartbeat(d.prefill, 0.5, queued_s=2.0)  # the instance knows better: 2 s left
    assert state.instances.queue_free_at[slot_p] == 2.5
    assert state.ledger.get("a") == (slot_d, 1.0, 20.0, False)
    state.prefill_done("a", 2.5)
    assert state.ledger.get("a")[1] == 2.5
    # D's batch report: "a" runs, "z" (unknown, e.g. routed before a Conductor restart) runs too.
    state.heartbeat("D", 3.0, active={"a": 20, "z": 7})
    assert state.ledger.get("a")[3] and state.ledger.get("z") == (slot_d, 3.0, 7.0, True)
    state.heartbeat("D", 4.0, active={"z": 7})  # "a" ended without a FINISHED report
    assert state.ledger.get("a") is None and len(state.ledger) == 1
    assert state.dropped("z") and not state.dropped("z")
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="queued_s"):
            state.heartbeat("D", 4.0, queued_s=bad)


def test_removing_an_instance_forgets_its_requests():
    state, policy = timeline("none")
    first = state.schedule(policy, req("a"), 0.0)
    state.schedule(policy, req("b"), 0.0)
    assert sorted(state.remove_instance(first.prefill)) == ["a"]  # queued there: will never reach decode
    assert "a" not in state.ledger and "b" in state.ledger
    assert state.remove_instance("D") == ["b"]
    assert len(state.ledger) == 0
    assert state.expire(100.0, timeout_s=5.0) == ["P1", "P2", "P3"]  # silent since t=0
