"""Algorithm 1 on hand-worked clusters: every branch, each strategy, decode choice, load counting, replication.

Costs (test_conductor_support.UNIT): prefill 1 ms per new token, 10 ms per block transferred, decode 10 ms per
request in the batch; block size 4. The request has 42 tokens: 10 full blocks, so at most 40 reusable tokens.
"""

import pytest
from test_conductor_support import UNIT, cluster

from mooncake_jax.conductor import RejectReason, Request, Tier

KEYS = list(range(101, 111))


def req(name="r", keys=KEYS, n=42, out=8):
    return Request(name, keys, n, out)


def busy(state, instance, seconds, now=0.0):
    state.heartbeat(instance, now, queued_s=seconds)


def test_no_prefix_anywhere_picks_least_queue_and_computes_all():
    state, policy = cluster()
    busy(state, "A", 0.5)
    busy(state, "B", 0.2)
    busy(state, "C", 0.3)
    d = policy.decide(req(), state.snapshot(), 0.0)
    assert (d.prefill, d.transfer, d.prefix_blocks) == ("B", None, 0)
    assert d.predicted_ttft_s == pytest.approx(0.2 + 0.042)
    assert d.decode == "D" and d.accepted


def test_transfer_beats_queue_when_prefix_len_is_zero():
    # A holds all 10 blocks but is 1 s busy: 1.0 + 2 new tokens = 1.002 s.
    # B and C hold nothing (ratio infinite): fetch 10 blocks (0.1 s) + 0.002 = 0.102 s; tie -> lower slot, B.
    state, policy = cluster(kvcache_balancing_threshold=1.5)
    state.kv_stored("A", KEYS)
    busy(state, "A", 1.0)
    d = policy.decide(req(), state.snapshot(), 0.0)
    assert d.prefill == "B" and d.prefix_blocks == 10
    assert d.transfer.source == "A" and d.transfer.keys == tuple(KEYS)
    assert d.transfer.n_bytes == 10_000 and d.transfer.seconds == pytest.approx(0.1)
    assert d.predicted_ttft_s == pytest.approx(0.102)
    assert d.prefill_s == pytest.approx(0.002)


def test_queue_beats_cache_transfer():
    state, policy = cluster(kvcache_balancing_threshold=1.5)
    state.kv_stored("A", KEYS)
    busy(state, "A", 0.05)  # 0.052 s on A < 0.102 s by fetching elsewhere
    d = policy.decide(req(), state.snapshot(), 0.0)
    assert (d.prefill, d.transfer, d.prefix_blocks) == ("A", None, 10)
    assert d.predicted_ttft_s == pytest.approx(0.052)


def test_below_threshold_recomputes_above_it_fetches():
    # A: all 10 blocks, 1 s busy. B: first 8 blocks; best/own = 10/8 = 1.25. C: nothing.
    def decide(threshold):
        state, policy = cluster(kvcache_balancing_threshold=threshold)
        state.kv_stored("A", KEYS)
        state.kv_stored("B", KEYS[:8])
        busy(state, "A", 1.0)
        return policy.decide(req(), state.snapshot(), 0.0)

    below = decide(1.5)  # 1.25 <= 1.5: B recomputes 42 - 32 = 10 tokens = 0.010 s (C fetching: 0.102 s)
    assert (below.prefill, below.transfer, below.prefix_blocks) == ("B", None, 8)
    assert below.predicted_ttft_s == pytest.approx(0.010)
    at = decide(1.25)  # the ratio must exceed the threshold: equal recomputes
    assert (at.prefill, at.transfer) == ("B", None)
    above = decide(1.2)  # 1.25 > 1.2: B fetches 2 blocks (0.020 s) and computes 2 tokens: 0.022 s
    assert (above.prefill, above.prefix_blocks) == ("B", 10)
    assert above.transfer.keys == tuple(KEYS[8:]) and above.transfer.seconds == pytest.approx(0.02)
    assert above.predicted_ttft_s == pytest.approx(0.022)


def test_fully_cached_prompt_still_computes_its_last_token():
    state, policy = cluster(prefill=("A",))
    keys = KEYS
    state.kv_stored("A", keys)
    d = policy.decide(req(n=40, keys=keys), state.snapshot(), 0.0)  # 10 full blocks = the whole prompt
    assert d.prefix_blocks == 10 and d.predicted_ttft_s == pytest.approx(0.001)


def test_local_cache_aware_never_transfers_and_load_balance_ignores_cache():
    state, policy_lca = cluster(strategy="local-cache-aware")
    state.kv_stored("A", KEYS)
    busy(state, "A", 1.0)
    busy(state, "C", 0.01)
    d = policy_lca.decide(req(), state.snapshot(), 0.0)
    assert (d.prefill, d.transfer) == ("B", None) and d.predicted_ttft_s == pytest.approx(0.042)

    state, policy_lb = cluster(strategy="load-balance")
    state.kv_stored("A", KEYS)
    busy(state, "A", 0.01)  # A would be fastest (0.012 s), but B and C have less queued work
    busy(state, "B", 0.02)
    d = policy_lb.decide(req(), state.snapshot(), 0.0)
    assert d.prefill == "C" and d.predicted_ttft_s == pytest.approx(0.042)


def test_random_is_deterministic_per_request_and_covers_instances():
    state, policy = cluster(strategy="random")
    state.kv_stored("A", KEYS)
    picks = [policy.decide(req(f"r{i}"), state.snapshot(), 0.0) for i in range(60)]
    assert {d.prefill for d in picks} == {"A", "B", "C"}
    assert all(d.transfer is None for d in picks)
    assert policy.decide(req("r7"), state.snapshot(), 0.0) == picks[7]


def test_transfer_decision_replicates_blocks_and_loads_the_sender():
    state, policy = cluster(kvcache_balancing_threshold=1.5)
    state.kv_stored("A", KEYS)
    busy(state, "A", 1.0)
    first = state.schedule(policy, req("r1"), 0.0)
    assert first.prefill == "B" and first.transfer.source == "A"
    # B now holds the fetched blocks too (expected when r1's prefill ends, 0.102 s); A stays a holder.
    assert all(state.index.holders(k) == [0, 1] for k in KEYS)
    assert state.index.tier(KEYS[0], 1) == Tier.DRAM
    assert state.instances.send_free_at[0] == pytest.approx(0.1)  # A sends for 0.1 s
    assert state.instances.queue_free_at[1] == pytest.approx(0.102)

    # Same prefix again: B (queued 0.102 s, reuses all 10 blocks) beats C fetching from A behind A's 0.1 s of
    # sends (0.1 + 0.1 + 0.002) or from B once the blocks land there (0.102 + 0.1 + 0.002).
    second = state.schedule(policy, req("r2"), 0.0)
    assert (second.prefill, second.transfer, second.prefix_blocks) == ("B", None, 10)
    assert second.predicted_ttft_s == pytest.approx(0.104)


def test_sender_backlog_delays_the_next_fetch():
    state, policy = cluster(kvcache_balancing_threshold=1.5)
    other = list(range(201, 211))
    state.kv_stored("A", KEYS + other)
    busy(state, "A", 1.0)
    state.schedule(policy, req("r1"), 0.0)  # B fetches KEYS from A: A sends until 0.1 s, B busy to 0.102 s
    d = state.schedule(policy, req("r2", keys=other), 0.0)
    # C: A's backlog 0.1 + 0.1 transfer + 0.002 = 0.202; B: same transfer after its 0.102 s queue = 0.304.
    assert d.prefill == "C" and d.transfer.seconds == pytest.approx(0.2)
    assert d.predicted_ttft_s == pytest.approx(0.202)


def test_among_equal_prefixes_the_least_busy_sender_is_the_source():
    state, policy = cluster()
    state.kv_stored("A", KEYS)
    state.kv_stored("B", KEYS)
    for name, backlog in (("A", 0.3), ("B", 0.1)):
        state.heartbeat(name, 0.0, queued_s=1.0, send_backlog_s=backlog)
    d = policy.decide(req(), state.snapshot(), 0.0)
    assert d.prefill == "C" and d.transfer.source == "B"
    assert d.transfer.seconds == pytest.approx(0.1 + 0.1) and d.predicted_ttft_s == pytest.approx(0.202)


def test_fetch_waits_for_blocks_still_being_computed_at_the_source():
    state, policy = cluster(kvcache_balancing_threshold=1.5)
    state.kv_stored("A", KEYS)
    busy(state, "A", 1.0)
    state.schedule(policy, req("r1"), 0.0)  # B will hold KEYS from 0.102 s
    state.remove_instance("A")
    busy(state, "B", 1.0)
    d = policy.decide(req("r2"), state.snapshot(), 0.0)
    # C fetches from B, which can only send once the blocks land (0.102 s): 0.102 + 0.1 + 0.002.
    assert d.prefill == "C" and d.transfer.source == "B"
    assert d.transfer.seconds == pytest.approx(0.202) and d.predicted_ttft_s == pytest.approx(0.204)
    state.kv_stored("B", KEYS)  # B's KV event: the blocks are there now
    d = policy.decide(req("r2"), state.snapshot(), 0.0)
    assert d.transfer.seconds == pytest.approx(0.1)


@pytest.mark.parametrize("admission", ["none", "baseline", "early", "predictive"])
def test_burst_spreads_over_instances_because_routed_load_counts_at_once(admission):
    # early judges admission on the load now, which none of the burst is yet; the choice still counts it
    state, policy = cluster(prefill=("P0", "P1"), decode=("D0", "D1"), admission=admission)
    decisions = [state.schedule(policy, req(f"r{i}", keys=[], n=10), 0.0) for i in range(4)]
    assert [d.prefill for d in decisions] == ["P0", "P1", "P0", "P1"]
    assert [d.decode for d in decisions] == ["D0", "D1", "D0", "D1"]
    assert [d.predicted_ttft_s for d in decisions] == pytest.approx([0.01, 0.01, 0.02, 0.02])


def test_decode_choice_least_tbt_among_instances_with_room():
    state, policy = cluster(prefill=("P",), decode=("D0", "D1"))
    state.heartbeat("D0", 0.0, active={"a": 10, "b": 10})
    state.heartbeat("D1", 0.0, active={"c": 10})
    d = policy.decide(req(), state.snapshot(), 0.0)
    assert d.decode == "D1" and d.predicted_tbt_s == pytest.approx(0.02)  # batch 1 + this one

    state, policy = cluster(prefill=("P",), decode=("D0", "D1"))
    state.add_instance("D1", "decode", UNIT, 0.0, kv_capacity_tokens=55)  # re-register, room for 55 tokens
    state.heartbeat("D0", 0.0, active={"a": 10, "b": 10})
    state.heartbeat("D1", 0.0, active={"c": 10})
    d = policy.decide(req(), state.snapshot(), 0.0)  # needs 42 + 8 = 50 tokens: 10 + 50 > 55 on D1
    assert d.decode == "D0" and d.predicted_tbt_s == pytest.approx(0.03)


def test_rejections_on_ttft_and_tbt_slo():
    state, policy = cluster(prefill=("A",), admission="early", ttft_slo_s=30.0, tbt_slo_s=0.05)
    busy(state, "A", 30.0)
    d = policy.decide(req(), state.snapshot(), 0.0)  # 30 + 0.042 > 30
    assert d.reason == RejectReason.TTFT_SLO and not d.accepted
    assert d.retry_after_s == pytest.approx(0.5)  # the floor: 0.147 s over the budget
    busy(state, "A", 31.0)  # over the prefill's budget, the SLO less the push of its KV to D (42 x 250 B at 1e5 B/s)
    assert policy.decide(req(), state.snapshot(), 0.0).retry_after_s == pytest.approx(1.042 + 0.105)
    busy(state, "A", 29.0)
    assert policy.decide(req(), state.snapshot(), 0.0).accepted

    state.heartbeat("D", 0.0, active={f"x{i}": 1 for i in range(4)})  # 4 running: 0.05 s with this one
    assert policy.decide(req(), state.snapshot(), 0.0).accepted
    state.heartbeat("D", 0.0, active={f"x{i}": 1 for i in range(5)})  # 0.06 s > 0.05 s
    d = policy.decide(req(), state.snapshot(), 0.0)
    assert d.reason == RejectReason.TBT_SLO and d.predicted_tbt_s == pytest.approx(0.06)
    assert d.retry_after_s == pytest.approx(20.0)  # next predicted completion: t_d = 20 s after they began

    state, policy = cluster(prefill=("A",), admission="none")
    busy(state, "A", 100.0)
    assert policy.decide(req(), state.snapshot(), 0.0).accepted  # `none` accepts everything


def test_decode_capacity_rejects_early_but_not_baseline():
    for admission, accepted in (("early", False), ("baseline", True)):
        state, policy = cluster(prefill=("A",), decode=(), admission=admission)
        state.add_instance("D", "decode", UNIT, 0.0, kv_capacity_tokens=49)
        d = policy.decide(req(), state.snapshot(), 0.0)  # needs 50 tokens
        assert d.accepted is accepted
        if not accepted:
            assert d.reason == RejectReason.DECODE_CAPACITY


def test_no_instances_and_bad_requests():
    state, policy = cluster(prefill=(), decode=("D",))
    assert policy.decide(req(), state.snapshot(), 0.0).reason == RejectReason.NO_PREFILL_INSTANCE
    state, policy = cluster(decode=())
    assert policy.decide(req(), state.snapshot(), 0.0).reason == RejectReason.NO_DECODE_INSTANCE
    state, policy = cluster()
    with pytest.raises(ValueError, match="at most 11"):
        policy.decide(req(keys=list(range(12))), state.snapshot(), 0.0)
    with pytest.raises(ValueError, match="input_tokens"):
        Request("r", [], 0, 1)
    with pytest.raises(ValueError, match="64-bit"):
        Request("r", [-1], 4, 1)
    with pytest.raises(ValueError, match="request_id"):
        Request("", [], 4, 1)
    with pytest.raises(ValueError, match="unknown strategy"):
        cluster(strategy="fastest")
    state.schedule(policy, req("dup"), 0.0)
    with pytest.raises(ValueError, match="already in flight"):
        state.schedule(policy, req("dup"), 0.0)


def test_decide_does_not_change_the_snapshot():
    state, policy = cluster()
    state.kv_stored("A", KEYS)
    before = (state.instances.queue_free_at.copy(), len(state.ledger), len(state.index))
    first = policy.decide(req(), state.snapshot(), 0.0)
    assert policy.decide(req(), state.snapshot(), 0.0) == first
    after = (state.instances.queue_free_at, len(state.ledger), len(state.index))
    assert (before[0] == after[0]).all() and before[1:] == after[1:]
