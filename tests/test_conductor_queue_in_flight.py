"""A prefill instance's heartbeat in the middle of a burst: the Conductor keeps the requests it sent there that have
not arrived yet (``ClusterState.heartbeat`` with the held requests in ``active``; ``conductor/accounting.py``,
"Queue").

Hand-worked on UNIT costs (1 ms per new prompt token, ``test_conductor_support.py``): four requests of 100 tokens
(0.1 s each) at t=0 go P0, P1, P0, P1. At t=0.01 P0 has received only r0 and reports its queue, 0.1 s. The
Conductor's picture of P0 must stay r0 + r2: it drains at 0.01 + 0.1 + 0.1 = 0.21 s. Before the fix the heartbeat
replaced it with 0.11 s, the next request went to P0 with a predicted TTFT of 0.2 s, and it really waited behind
r0 and r2 (0.3 s): the burst's late refusals of the demo ("0.00 s left", docs/benchmarks/demo.md eleventh pass).
"""

import pytest
from test_conductor_support import cluster

from mooncake_jax.conductor import Request
from mooncake_jax.conductor.state import IN_FLIGHT_MAX_S


def req(name, n=100):
    return Request(name, (), n, 8)


def burst(state, policy, now=0.0):
    return [state.schedule(policy, req(f"r{i}"), now).prefill for i in range(4)]


def test_heartbeat_mid_burst_keeps_the_requests_still_on_their_way():
    state, policy = cluster(prefill=("P0", "P1"), decode=("D",))
    assert burst(state, policy) == ["P0", "P1", "P0", "P1"]
    state.heartbeat("P0", 0.01, queued_s=0.1, active={"r0": 100})  # r2 not there yet
    assert state.instances.queue_free_at[state.instances.slot("P0")] == pytest.approx(0.21)
    d = state.schedule(policy, req("r4"), 0.01)
    # P1 drains at 0.2 (r1, r3: no heartbeat), P0 at 0.21: P1, its first token at 0.2 + 0.1
    assert d.prefill == "P1" and d.queue_s == pytest.approx(0.19) and d.predicted_ttft_s == pytest.approx(0.29)


def test_without_the_held_requests_the_report_replaces_the_queue_as_before():
    # an instance that does not name its requests (older instances, the simulator: its requests arrive at once)
    state, policy = cluster(prefill=("P0", "P1"), decode=("D",))
    burst(state, policy)
    state.heartbeat("P0", 0.01, queued_s=0.1)
    assert state.instances.queue_free_at[state.instances.slot("P0")] == pytest.approx(0.11)
    d = state.schedule(policy, req("r4"), 0.01)
    assert d.prefill == "P0" and d.predicted_ttft_s == pytest.approx(0.2)  # what the fix corrects: really 0.3


def test_held_requests_are_not_counted_twice_and_done_ones_not_at_all():
    state, policy = cluster(prefill=("P0", "P1"), decode=("D",))
    burst(state, policy)
    slot = state.instances.slot("P0")
    state.heartbeat("P0", 0.02, queued_s=0.2, active={"r0": 100, "r2": 100})  # both there, both in its 0.2 s
    assert state.instances.queue_free_at[slot] == pytest.approx(0.22)
    assert state.on_the_way_s("P0", 0.02, {"r0": 100}) == pytest.approx(0.1)
    state.prefill_done("r0", 0.1)
    state.heartbeat("P0", 0.1, queued_s=0.0, active={})  # r0 reported done, r2 sent but not there: 0.1 s of it
    assert state.instances.queue_free_at[slot] == pytest.approx(0.2)
    state.dropped("r2")  # its RPC failed: nothing left on the way
    state.heartbeat("P0", 0.11, queued_s=0.0, active={})
    assert state.instances.queue_free_at[slot] == pytest.approx(0.11)


def test_a_decision_that_never_arrives_stops_counting_after_the_bound():
    state, policy = cluster(prefill=("P0", "P1"), decode=("D",))
    burst(state, policy)
    assert state.on_the_way_s("P0", IN_FLIGHT_MAX_S, ()) == pytest.approx(0.2)
    assert state.on_the_way_s("P0", IN_FLIGHT_MAX_S + 0.01, ()) == 0.0
    state.remove_instance("P1")
    assert state.on_the_way_s("P0", 0.0, ()) == pytest.approx(0.2)


def test_a_prefill_instance_naming_its_requests_leaves_the_decode_ledger_alone():
    # the decode instance's ``active`` reconciles its ledger; a prefill instance's names what it holds
    state, policy = cluster(prefill=("P0",), decode=("D",))
    d = state.schedule(policy, req("r0"), 0.0)
    entry = state.ledger.get("r0")
    state.heartbeat("P0", 0.05, queued_s=0.1, active={"r0": 100})
    assert state.ledger.get("r0") == entry and not entry[3]  # still waiting for its prefill, start as predicted
    assert entry[1] == pytest.approx(d.prefill_end_at)
