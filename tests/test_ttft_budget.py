"""One TTFT budget (conductor/accounting.py ``prefill_budget_s``): the Conductor's admission, the prefill instance's
late check and the simulator's admission check a prefill against the TTFT SLO less what follows it.

Costs by hand (as test_accounting.SLOW_LINK): prefill 1 s + 1 ms per computed token; 1 byte of KV per token over a
10,000 bytes/s link, so an n-token prompt's KV is pushed in n / 10,000 s. TTFT SLO 2 s.
"""

import time
from types import SimpleNamespace

import pytest

from mooncake_jax.conductor import (ClusterState, DecodeCost, InstanceCosts, Policy, PolicyConfig, PrefillCost,
                                    Request)
from mooncake_jax.conductor.accounting import (LAYERWISE, REAL_INSTANCES, ReleaseTiming, after_prefill_s,
                                               prefill_budget_s)
from mooncake_jax.sim import simulate
from mooncake_jax.sim.records import COMPLETED, REJECTED_EARLY
from mooncake_jax.sim.trace import Trace, TraceRequest

SLOW_LINK = InstanceCosts("slow-link", PrefillCost((1.0, 0.001, 0.0, 0.0)), DecodeCost((0.01, 0.0, 0.0)),
                          kv_bytes_per_token=1.0, nic_bytes_per_s=10_000.0, kv_capacity_tokens=10**6)
SLO = 2.0
OLD_SHARE_AFTER_PREFILL = 0.1  # the prefill instance's flat share before (instance/prefill.py)


def test_what_follows_the_prefill_by_hand():
    assert after_prefill_s(REAL_INSTANCES, 0.4) == pytest.approx(0.4)  # pushed after, first token after the push
    assert after_prefill_s(REAL_INSTANCES, 0.4, off_engine_s=0.05) == pytest.approx(0.45)
    assert after_prefill_s(LAYERWISE, 0.4, 1.0) == 0.0  # first token at the prefill's end
    assert after_prefill_s(LAYERWISE, 0.4, 1.0, off_engine_s=0.05) == pytest.approx(0.05)
    streamed = ReleaseTiming("layerwise", "after-push")  # streamed during the prefill: what outlasts it
    assert after_prefill_s(streamed, 0.5, 0.2) == pytest.approx(0.3)
    assert after_prefill_s(streamed, 0.5, 0.6) == 0.0
    assert prefill_budget_s(SLO, 0.4) == pytest.approx(1.6)
    with pytest.raises(ValueError, match="push_s, prefill_s and off_engine_s must be non-negative"):
        after_prefill_s(REAL_INSTANCES, -0.1)
    with pytest.raises(ValueError, match="non-negative"):
        Policy(PolicyConfig(), off_engine_s=float("nan"))


def _state(admission: str = "baseline") -> ClusterState:
    state = ClusterState(PolicyConfig(block_size=512, admission=admission, ttft_slo_s=SLO))
    state.add_instance("p", "prefill", SLOW_LINK, 0.0)
    state.add_instance("d", "decode", SLOW_LINK, 0.0)
    return state


def _prefill_service():
    """The prefill instance's late check alone (no engine behind it), with the same costs and SLO."""
    from mooncake_jax.instance.prefill import PrefillService, SlowdownMeter
    from mooncake_jax.instance.rpc import InstanceService

    instance = SimpleNamespace(ttft_slo_s=SLO, costs=SLOW_LINK, config=SimpleNamespace(instance_id="p"))
    service = PrefillService.__new__(PrefillService)
    InstanceService.__init__(service, instance, ("prefill_refused_ttft",))
    service.slowdown = SlowdownMeter()
    return service


def _instance_refuses(service, work_s: float, n_tokens: int) -> bool:
    from mooncake_jax.instance.rpc import LateRejection

    try:
        service._check_deadline(time.perf_counter(), work_s, "on arrival", n_tokens)
    except LateRejection:
        return True
    return False


@pytest.mark.parametrize("n, conductor_old, instance_old, admitted", [
    (150, True, True, True),    # 1.15 s + 0.015 s push: both admit, before and now
    (850, True, False, True),   # 1.85 s + 0.085 s: within 2 s (the Conductor's old rule), not 1.8 s (the instance's)
    (950, True, False, False),  # 1.95 s + 0.095 s = 2.045 s: admitted on the whole SLO, then refused late
])
def test_the_conductor_and_the_prefill_instance_agree_where_the_old_rules_did_not(n, conductor_old, instance_old,
                                                                                   admitted):
    """Hand-worked: an idle prefill instance, a request of n tokens: predicted prefill 1 + n / 1,000 s, its KV
    pushed in n / 10,000 s. Old rules: the Conductor admitted on prefill <= SLO, the instance refused on prefill >
    90% of the SLO. Now both check prefill <= SLO - push."""
    prefill_s = 1.0 + n / 1000
    assert (prefill_s <= SLO) == conductor_old
    assert (prefill_s <= SLO * (1 - OLD_SHARE_AFTER_PREFILL)) == instance_old
    assert (prefill_s <= SLO - n / 10_000) == admitted  # the budget, by hand
    state = _state()
    decision = state.schedule(Policy(state.config), Request(f"r{n}", (1, 2)[: (n + 511) // 512], n, 8), 0.0)
    assert decision.prefill_s == pytest.approx(prefill_s)
    assert decision.accepted == admitted
    if not admitted:
        assert decision.reason.value == "ttft_slo"
        budget = SLO - n / 10_000
        assert decision.retry_after_s == pytest.approx(max(state.config.min_retry_after_s, prefill_s - budget))
    assert _instance_refuses(_prefill_service(), prefill_s, n) == (not admitted)


def test_the_instance_leaves_its_measured_store_and_push_where_longer_than_the_prediction():
    """0.015 s predicted push for 150 tokens; the recent requests stored and pushed their KV in 0.5 s after their
    prefill: 1.4 s of work no longer fits (2 - 0.5 = 1.5 s, less the time since arrival is > 1.4 s, but 1.6 s
    is not). The staging before the prefill (0.3 s here) has elapsed by the check and is not counted again."""
    service = _prefill_service()
    for _ in range(3):
        service.slowdown.record(1.0, 1.0, overhead_s=0.8, after_s=0.5)
    assert service.slowdown.after_prefill() == pytest.approx(0.5)
    assert service.slowdown.overhead() == pytest.approx(0.8)
    assert not _instance_refuses(service, 1.4, 150)
    assert _instance_refuses(service, 1.6, 150)


def test_the_simulator_and_the_service_give_the_same_decision_on_the_same_state():
    """Two requests far apart on an idle cluster whose instances push the KV after the prefill and release the
    first token after the push (the served cluster): 400 tokens (1.4 s + 0.04 s push: admitted), 950 tokens
    (1.95 s + 0.095 s: over the SLO, rejected early; the whole-SLO rule admitted it). The simulator's admission and
    the gRPC service's Schedule answer alike; the simulator's TTFT of the admitted one is the prefill and the push
    (1.44 s), and under admission none the rejected one's would have been 2.045 s: the budget rejected what would
    have missed the SLO."""
    from mooncake_jax.conductor.service import ConductorService, messages

    trace = Trace([TraceRequest(0.0, 400, 8, (1,)), TraceRequest(100.0, 950, 8, (2, 3))])
    sim = simulate(trace, prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                   admission="baseline", ttft_slo_s=SLO, tbt_slo_s=1.0)
    assert [r.status for r in sim.requests] == [COMPLETED, REJECTED_EARLY]
    assert sim.requests[0].ttft_s == pytest.approx(1.44)
    free = simulate(trace, prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                    admission="none", ttft_slo_s=SLO, tbt_slo_s=1.0)
    assert [r.ttft_s for r in free.requests] == pytest.approx([1.44, 2.045])

    clock = [0.0]
    service = ConductorService(PolicyConfig(block_size=512, admission="baseline", ttft_slo_s=SLO, tbt_slo_s=1.0),
                               clock=lambda: clock[0])
    service.state.add_instance("p", "prefill", SLOW_LINK, 0.0)
    service.state.add_instance("d", "decode", SLOW_LINK, 0.0)
    replies = []
    for request in trace.requests:
        clock[0] = request.timestamp_s
        replies.append(service.Schedule(messages.ScheduleRequest(
            request_id=f"r{request.input_length}", block_keys=list(request.hash_ids),
            input_tokens=request.input_length, output_tokens=request.output_length), None))
    assert [reply.accepted for reply in replies] == [True, False]
    assert replies[1].reject_reason == sim.requests[1].reason == "ttft_slo"


def test_under_the_papers_layerwise_release_the_budget_is_the_whole_slo():
    """First token at the prefill's end: nothing of the TTFT follows the prefill, so the 950-token request (1.95 s)
    is admitted by the simulator, as before this rule (the overload and hetero experiments' default)."""
    trace = Trace([TraceRequest(0.0, 950, 8, (2, 3))])
    sim = simulate(trace, prefill=1, decode=1, hardware=SLOW_LINK, admission="baseline", ttft_slo_s=SLO,
                   tbt_slo_s=1.0)
    assert sim.requests[0].status == COMPLETED and sim.requests[0].ttft_s == pytest.approx(1.95)
