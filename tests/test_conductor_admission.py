"""Admission policies on hand-computed timelines, the decode side's late check, t_d tracking, and reports.

Timeline costs: every prefill takes 1 s whatever its length; a decode step takes 10 ms per request in the batch;
TBT SLO 35 ms, so a decode instance takes this request only while at most 2 others decode beside it;
uniform decode time t_d = 5 s. Every request holds 20 KV tokens (16 prompt + 4 output).

Memory timelines (``memory_timeline``): the same, but the TBT SLO is 1 s (never binds) and the decode instance
holds 70 KV tokens, so it takes this request only while at most 2 others (40 tokens) are on it.
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


def memory_timeline(admission, decode=("D",)):
    state, policy = cluster(prefill=("P0", "P1", "P2", "P3"), decode=(), costs=FLAT, admission=admission,
                            tbt_slo_s=1.0, decode_time_s=5.0)
    for name in decode:
        state.add_instance(name, "decode", FLAT, 0.0, kv_capacity_tokens=70)
    return state, policy


def after_three(make, routed_at, decoding_at=None, decide_at=10.0):
    """Every policy's decision for a new request at ``decide_at`` (one or a tuple of times) on the timeline
    ``make`` builds, after three requests routed at ``routed_at`` to P0..P2 (prefills ending 1 s later) that
    begin decoding at ``decoding_at`` when given."""
    outcomes = {}
    for admission in POLICIES:
        state, policy = make(admission)
        for i in range(3):
            d = state.schedule(policy, req(f"a{i}"), routed_at)
            assert d.accepted and d.prefill == f"P{i}" and d.prefill_end_at == routed_at + 1.0
        for i in range(3 if decoding_at is not None else 0):
            state.decode_started(f"a{i}", decoding_at)
        times = decide_at if isinstance(decide_at, tuple) else (decide_at,)
        decisions = [policy.decide(req("new"), state.snapshot(), t) for t in times]
        outcomes[admission] = decisions if isinstance(decide_at, tuple) else decisions[0]
    return outcomes


def test_predictive_accepts_what_early_rejects_because_decode_load_will_have_drained():
    # t=5: three requests are routed (prefills on P0..P2 end at 6); t=6 their decode begins, ending at 6 + t_d = 11.
    # t=10: a new request would finish prefill at 11. Now: 3 decoding -> 40 ms > 35 ms. At 11: all done -> 10 ms.
    outcomes = after_three(timeline, routed_at=5.0, decoding_at=6.0)
    assert outcomes["early"].reason == RejectReason.TBT_SLO
    assert outcomes["early"].predicted_tbt_s == pytest.approx(0.04)
    assert outcomes["predictive"].accepted and outcomes["predictive"].predicted_tbt_s == pytest.approx(0.01)
    assert outcomes["none"].accepted and outcomes["baseline"].accepted
    assert outcomes["predictive"].prefill_end_at == 11.0


def test_predictive_rejects_what_early_accepts_because_prefills_in_flight_arrive_first():
    # t=9.5: three requests routed to P0..P2, their prefills end at 10.5 (their KV reaches D then).
    # t=10: the new request goes to idle P3 and ends at 11. Now D runs nothing -> 10 ms; at 11 it runs those
    # three -> 40 ms > 35 ms.
    outcomes = after_three(timeline, routed_at=9.5)
    assert outcomes["predictive"].prefill == "P3"
    assert outcomes["predictive"].reason == RejectReason.TBT_SLO
    assert outcomes["predictive"].predicted_tbt_s == pytest.approx(0.04)
    assert outcomes["early"].accepted and outcomes["early"].predicted_tbt_s == pytest.approx(0.01)
    # baseline leaves TBT to the decode instance; its estimate still reports the predicted 40 ms
    assert outcomes["baseline"].accepted and outcomes["baseline"].predicted_tbt_s == pytest.approx(0.04)
    assert outcomes["none"].accepted


def test_memory_full_now_but_drained_by_prefill_end_early_rejects_predictive_accepts():
    # t=5: three requests routed (prefills on P0..P2 end at 6); t=6 they begin decoding, 60 of D's 70 tokens,
    # until 6 + t_d = 11. t=10: a new request (20 tokens) would finish prefill at 11.
    # Now: 60 + 20 = 80 > 70. At 11: all three done, 0 + 20 <= 70.
    # At t=9.9 the prefill would end at 10.9, while all three still decode: 80 > 70 for predictive too.
    outcomes = after_three(memory_timeline, routed_at=5.0, decoding_at=6.0, decide_at=(10.0, 9.9))
    (early, early_before), (predictive, predictive_before) = outcomes["early"], outcomes["predictive"]
    assert early.reason == RejectReason.DECODE_CAPACITY
    assert predictive.accepted and predictive.prefill_end_at == 11.0
    assert predictive.decode == "D" and predictive.predicted_tbt_s == pytest.approx(0.01)
    assert predictive_before.reason == RejectReason.DECODE_CAPACITY
    assert early_before.reason == RejectReason.DECODE_CAPACITY
    for admission in ("none", "baseline"):  # the decode instance's own check is left to judge memory
        assert all(d.accepted for d in outcomes[admission])


def test_memory_free_now_but_filled_by_prefills_in_flight_early_accepts_predictive_rejects():
    # t=9.5: three requests routed to P0..P2, their prefills end at 10.5, when their 60 tokens reach D.
    # t=10: the new request goes to idle P3 and ends at 11. Now D holds nothing: 0 + 20 <= 70. At 11: 60 + 20 > 70.
    outcomes = after_three(memory_timeline, routed_at=9.5)
    assert outcomes["early"].accepted and outcomes["early"].decode == "D"
    assert outcomes["early"].predicted_tbt_s == pytest.approx(0.01)  # alone in the batch now
    assert outcomes["predictive"].prefill == "P3" and outcomes["predictive"].prefill_end_at == 11.0
    assert outcomes["predictive"].reason == RejectReason.DECODE_CAPACITY
    assert outcomes["none"].accepted and outcomes["baseline"].accepted


def test_decode_load_is_rejected_only_when_no_decode_instance_can_take_the_request():
    # Among the decode instances that can take the request under its admission view, the one with the least
    # routed load is chosen (so bursts spread); the view decides which can, not the spreading order.
    # D0: three (60 tokens) decoding since 0, predicted to end at 5. D1: one (20) decoding since 4, until 9.
    # t=4.5, prefill ends at 5.5. Routed load left at 5.5: D0 none, D1 20 -> D0 is preferred.
    # early (now): D0 60 + 20 > 70, D1 20 + 20 fits -> D1.  predictive (at 5.5): both fit -> D0.
    picks = {}
    for admission in ("early", "predictive"):
        state, policy = memory_timeline(admission, decode=("D0", "D1"))
        state.heartbeat("D0", 0.0, active={"a": 20, "b": 20, "c": 20})
        state.heartbeat("D1", 4.0, active={"d": 20})
        picks[admission] = policy.decide(req("new"), state.snapshot(), 4.5)
    assert picks["early"].accepted and picks["early"].decode == "D1"
    assert picks["early"].predicted_tbt_s == pytest.approx(0.02)
    assert picks["predictive"].accepted and picks["predictive"].decode == "D0"
    assert picks["predictive"].predicted_tbt_s == pytest.approx(0.01)

    # D0: three (60) decoding since 4, until 9. D1: one (20) decoding since 4, and three more (60) whose prefills
    # end at 6. t=4.5, prefill ends at 5.5: routed load D0 60, D1 80 -> D0 preferred, but at 5.5 only D1 has
    # room (20 + 20); predictive takes D1. Once D1's three arrive earlier (at 5), neither has room.
    state, policy = memory_timeline("predictive", decode=("D0", "D1"))
    state.heartbeat("D0", 4.0, active={"a": 20, "b": 20, "c": 20})
    state.heartbeat("D1", 4.0, active={"d": 20})
    d1 = state.instances.slot("D1")
    for i in range(3):
        state.ledger.add(f"e{i}", d1, 6.0, 20)
    d = policy.decide(req("new"), state.snapshot(), 4.5)
    assert d.accepted and d.decode == "D1" and d.predicted_tbt_s == pytest.approx(0.02)
    for i in range(3):
        state.ledger.set_start(f"e{i}", 5.0, started=False)
    assert policy.decide(req("new"), state.snapshot(), 4.5).reason == RejectReason.DECODE_CAPACITY


def test_a_request_decoding_past_t_d_stays_in_the_prediction_until_reported_finished():
    # Three requests begin decoding at 6 and, at t_d = 5 s, are predicted to end at 11. At t=12 they still run
    # (no finish reported): they are longer than t_d, not gone. A request routed at 12 (prefill ends at 13)
    # would meet all three: 80 > 70 tokens. Counting each request only until start + t_d while shorter ones
    # leave at their reported finish would undercount the decode load by every request's excess over t_d.
    state, policy = memory_timeline("predictive")
    for i in range(3):
        state.schedule(policy, req(f"a{i}"), 5.0)
        state.decode_started(f"a{i}", 6.0)
    assert policy.decide(req("new"), state.snapshot(), 10.9).accepted  # predicted gone by 11.9
    assert policy.decide(req("new"), state.snapshot(), 12.0).reason == RejectReason.DECODE_CAPACITY
    state.finished("a0", 12.1)
    assert policy.decide(req("new"), state.snapshot(), 12.2).accepted  # 40 + 20 <= 70
    # A request whose prefill overran its prediction (routed at 0 to end at 1, never reported done) has not
    # begun decoding, so it has spent none of t_d: at t=8 it counts for the next t_d, not from 1 to 6.
    state, policy = memory_timeline("predictive")
    for i in range(3):
        state.schedule(policy, req(f"b{i}"), 0.0)
    assert policy.decide(req("new"), state.snapshot(), 8.0).reason == RejectReason.DECODE_CAPACITY


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


def test_each_decode_hardware_kind_has_its_own_decode_time():
    """Decode instance F (kind "fast") turns its requests over in 4 s, S (kind "slow") in 36 s; both start from
    t_d = 20 s, smoothing 0.5: F 20 -> 12, S 20 -> 28. Three requests then decode on each since t=1: under F's own
    t_d they are gone at 1 + 12 = 13, under S's at 1 + 28 = 29, so at t=12.5 (prefill ends 13.5) only F can take a
    new request within the TBT SLO; under one cluster-wide t_d (20 -> 12 -> 24) both would still be full (until
    25). A second instance of kind "fast" shares F's figure, also when it registers later."""
    state, policy = cluster(prefill=("P0", "P1", "P2", "P3"), decode=(), costs=FLAT, admission="predictive",
                            tbt_slo_s=0.035, decode_time_init_s=20.0, decode_time_smoothing=0.5)
    state.add_instance("F", "decode", FLAT, 0.0, hardware="fast")
    state.add_instance("S", "decode", FLAT, 0.0, hardware="slow")
    for name, (instance, seconds) in {"f": ("F", 4.0), "s": ("S", 36.0)}.items():
        state.ledger.add(name, state.instances.slot(instance), 1.0, 20, started=True)  # decoding there since 1
        assert state.finished(name, 1.0 + seconds)
    assert state.decode_time_of("F") == pytest.approx(12.0) and state.decode_time_of("S") == pytest.approx(28.0)
    assert state.decode_time_s == pytest.approx(24.0)  # the cluster-wide figure: 20 -> 12 -> 24
    state.add_instance("F2", "decode", FLAT, 0.0, hardware="fast")
    assert state.decode_time_of("F2") == pytest.approx(12.0)
    for instance in ("F", "F2", "S"):
        for i in range(3):
            state.ledger.add(f"{instance}{i}", state.instances.slot(instance), 1.0, 20, started=True)
    d = policy.decide(req("new"), state.snapshot(), 12.5)
    assert d.accepted and d.decode in ("F", "F2") and d.predicted_tbt_s == pytest.approx(0.01)
    assert policy.decide(req("new"), state.snapshot(), 11.0).reason == RejectReason.TBT_SLO  # F full until 13


def test_one_kind_of_decode_instance_tracks_the_cluster_wide_decode_time():
    """Instances of one kind pool their samples: the same figure as the cluster-wide one, on every instance."""
    state, policy = cluster(prefill=("P0",), decode=("D0", "D1", "D2"), costs=FLAT, admission="predictive",
                            tbt_slo_s=0.035, decode_time_init_s=20.0, decode_time_smoothing=0.5)
    for i, (instance, seconds) in enumerate((("D0", 4.0), ("D1", 8.0), ("D0", 30.0))):
        state.ledger.add(f"r{i}", state.instances.slot(instance), 0.0, 20, started=True)
        state.finished(f"r{i}", seconds)
    # 20 -> 12 -> 10 -> 20
    assert [state.decode_time_of(d) for d in ("D0", "D1", "D2")] == [pytest.approx(20.0)] * 3
    assert state.decode_time_s == pytest.approx(20.0)


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


def test_a_decode_instance_with_every_batch_slot_taken_is_refused_before_prefill():
    # D has 2 batch slots (its registration's max_batch) and room for 10**6 tokens; two sequences decode on it
    # since t=0, predicted to end at 5 (t_d = 5). At t=1 (prefill ends at 2) early and predictive see both
    # slots taken: refused before any prefill work, retry after the first predicted finish (5 - 1 = 4 s).
    # At t=4.5 (prefill ends at 5.5) predictive sees both done; early (the load now) still refuses.
    # Without max_batch the same load is accepted; none and baseline leave it to the decode instance.
    decisions = {}
    for admission in POLICIES:
        for max_batch in (2, None):
            state, policy = cluster(prefill=("P0",), decode=(), costs=FLAT, admission=admission, tbt_slo_s=1.0,
                                    decode_time_s=5.0)
            state.add_instance("D", "decode", FLAT, 0.0, max_batch=max_batch)
            state.heartbeat("D", 0.0, active={"a": 20, "b": 20})
            decisions[admission, max_batch] = [policy.decide(req("new"), state.snapshot(), t) for t in (1.0, 4.5)]
    for admission in ("early", "predictive"):
        soon = decisions[admission, 2][0]
        assert soon.reason == RejectReason.DECODE_CAPACITY and soon.retry_after_s == pytest.approx(4.0)
    assert decisions["predictive", 2][1].accepted and decisions["predictive", 2][1].decode == "D"
    assert decisions["early", 2][1].reason == RejectReason.DECODE_CAPACITY
    assert all(d.accepted for key, pair in decisions.items() if key[1] is None or key[0] in ("none", "baseline")
               for d in pair)


def test_the_conductor_reads_a_decode_instances_batch_slots_from_its_registered_config():
    from types import SimpleNamespace

    from mooncake_jax.conductor.service import _max_batch_of

    def registration(config_json):
        return SimpleNamespace(config_json=config_json)

    assert _max_batch_of(registration('{"role": "decode", "max_batch": 32}')) == 32
    for unknown in ("", "not json", "[1]", '{"max_batch": 0}', '{"max_batch": "many"}', '{"max_batch": true}'):
        assert _max_batch_of(registration(unknown)) is None, unknown
    state, _ = cluster(prefill=(), decode=())
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        state.add_instance("D", "decode", FLAT, 0.0, max_batch=0)


def test_a_prefill_instance_that_reports_it_runs_slower_than_its_model_gets_predictions_scaled():
    # FLAT: every prefill predicted at 1 s. SLO 1.5 s: accepted while P0 runs at its model's speed; once its
    # heartbeat says its recent prefills took 2x the model, the same request is predicted at 2 s and refused,
    # retry after the 0.5 s it is over; a queue reported in real seconds adds to it.
    state, policy = cluster(prefill=("P0",), decode=("D",), costs=FLAT, admission="predictive", ttft_slo_s=1.5,
                            tbt_slo_s=1.0, decode_time_s=5.0)
    d = policy.decide(req("a"), state.snapshot(), 1.0)
    assert d.accepted and d.predicted_ttft_s == pytest.approx(1.0)
    state.heartbeat("P0", 1.0, queued_s=0.0, prefill_slowdown=2.0)
    d = policy.decide(req("a"), state.snapshot(), 1.0)
    assert d.reason == RejectReason.TTFT_SLO and d.predicted_ttft_s == pytest.approx(2.0)
    assert d.retry_after_s == pytest.approx(0.5)
    state.heartbeat("P0", 1.0, queued_s=0.25, prefill_slowdown=0.5)  # faster than its model: 0.25 + 0.5
    assert policy.decide(req("a"), state.snapshot(), 1.0).predicted_ttft_s == pytest.approx(0.75)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="prefill_slowdown must be a finite positive number"):
            state.heartbeat("P0", 1.0, prefill_slowdown=bad)
    state.remove_instance("P0")  # registered again: back to its model until it reports
    state.add_instance("P0", "prefill", FLAT, 2.0)
    assert policy.decide(req("a"), state.snapshot(), 2.0).predicted_ttft_s == pytest.approx(1.0)


def test_slowdown_meter_is_the_recent_median_and_forgets():
    from mooncake_jax.instance.prefill import SlowdownMeter

    now = [0.0]
    meter = SlowdownMeter(window_s=30.0, samples=5, clock=lambda: now[0])
    assert meter.slowdown() == 1.0  # nothing measured: the model's figures
    for measured in (0.2, 0.3, 0.25, 9.0):  # one outlier (a program compiled on first use) among 2x-3x
        meter.record(measured, 0.1)
    meter.record(1.0, 0.0)  # nothing predicted: no ratio
    assert meter.slowdown() == pytest.approx(2.75)  # median of 2, 3, 2.5, 90
    now[0] = 29.0
    meter.record(0.05, 0.1)
    assert meter.slowdown() == pytest.approx(2.5)
    now[0] = 31.0  # the first four are older than the window
    assert meter.slowdown() == pytest.approx(0.5)
    now[0] = 60.0
    assert meter.slowdown() == 1.0


def test_slowdown_meter_weighs_each_prefill_by_its_predicted_seconds():
    """Three tiny prompts 50x over a 1 ms prediction (fixed costs the model leaves out) against two long ones at
    2x: the long ones, which decide whether the TTFT SLO holds, set the scale (an unweighted median would say 50)."""
    from mooncake_jax.instance.prefill import SlowdownMeter

    meter = SlowdownMeter(clock=lambda: 0.0)
    for _ in range(3):
        meter.record(0.05, 0.001)
    for _ in range(2):
        meter.record(0.4, 0.2)
    assert meter.slowdown() == pytest.approx(2.0)
    meter.record(6.0, 0.1)  # 60x, weight 0.1 of 0.503: still 2
    assert meter.slowdown() == pytest.approx(2.0)
    assert meter.overhead() == 0.0  # fixed costs: none recorded
    for overhead in (0.01, 0.03, 0.02):
        meter.record(0.4, 0.2, overhead_s=overhead)
    assert meter.overhead() == pytest.approx(0.02) and meter.slowdown() == pytest.approx(2.0)
