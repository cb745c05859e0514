"""One accounting of an instance (conductor/accounting.py): the rules by hand, and the simulator following them.

Costs (as test_sim_cluster.TOY but with a slow link): prefill 1 s + 1 ms per computed token, decode step 10 ms,
1 byte of KV per token over a 1,000 bytes/s link, so a 1,000-token prompt's KV moves in 1 s.
"""

import numpy as np
import pytest

from mooncake_jax.conductor import DecodeCost, InstanceCosts, PrefillCost
from mooncake_jax.conductor.accounting import (LAYERWISE, REAL_INSTANCES, ReleaseTiming, prefill_work_s,
                                               reused_tokens)
from mooncake_jax.sim import SimConfig, simulate
from mooncake_jax.sim.trace import Trace, TraceRequest

SLOW_LINK = InstanceCosts("slow-link", PrefillCost((1.0, 0.001, 0.0, 0.0)), DecodeCost((0.01, 0.0, 0.0)),
                          kv_bytes_per_token=1.0, nic_bytes_per_s=1000.0, kv_capacity_tokens=10**6)
ONE = Trace([TraceRequest(0.0, 1000, 11, (1, 2))])


def test_cached_prefix_rule():
    assert reused_tokens(1000, 0) == 0
    assert reused_tokens(1000, 512) == 512
    assert reused_tokens(1024, 1024) == 1023  # the last prompt token is always computed
    assert reused_tokens(1, 512) == 0
    assert prefill_work_s(SLOW_LINK.prefill, 1000, 512) == pytest.approx(1.0 + 0.488)
    assert prefill_work_s(SLOW_LINK.prefill, 1024, 4096) == pytest.approx(1.001)


def test_prefill_work_counts_the_padded_chunks_the_engine_computes():
    """Buckets 16/64/256/512 (the instances' default: chunk 512, factor 4): 300 new tokens are computed as 512, 65
    as 256, 1,100 as 512 + 512 + 256 (two whole chunks and a padded tail); 1 ms per computed token."""
    padded = PrefillCost((1.0, 0.001, 0.0, 0.0), chunk_buckets=(16, 64, 256, 512))
    assert [padded.computed_tokens(x) for x in (1, 16, 17, 65, 256, 300, 512, 1100)] == [
        16, 16, 64, 256, 256, 512, 512, 1280]
    assert prefill_work_s(padded, 300, 0) == pytest.approx(1.512)
    assert prefill_work_s(padded, 1000, 512) == pytest.approx(1.512)  # 488 new tokens -> 512
    assert prefill_work_s(padded, 1024, 4096) == pytest.approx(1.016)  # the last token alone: one 16-token chunk
    assert prefill_work_s(SLOW_LINK.prefill, 300, 0) == pytest.approx(1.3)  # no buckets: exactly the new tokens
    with pytest.raises(ValueError, match="ascending"):
        PrefillCost((1.0, 0.0, 0.0, 0.0), chunk_buckets=(64, 16))


def test_profile_carries_the_chunk_buckets():
    from mooncake_jax.conductor.profile import build_profile, costs_from_profile

    points = [(16, 0, 0.01), (64, 0, 0.012), (256, 0, 0.02), (512, 0, 0.04), (384, 128, 0.03)]
    profile = build_profile("p", "tiny", points, [(1, 64, 0.003), (4, 256, 0.004), (16, 2048, 0.008)],
                            kv_bytes_per_token=1, nic_bytes_per_s=1e9, kv_capacity_tokens=10**5,
                            chunk_buckets=(16, 64, 256, 512))
    assert costs_from_profile(profile).prefill.chunk_buckets == (16, 64, 256, 512)
    del profile["prefill"]["chunk_buckets"]  # a profile written before: computes exactly the new tokens
    assert costs_from_profile(profile).prefill.computed_tokens(300) == 300


def test_profile_of_times_that_do_not_grow_with_flops_uses_the_free_fit():
    """A loaded host's calibration can time a long prompt below a short one: no FLOP rate fits, the polynomial does
    (the start-up of an instance used to fail on it)."""
    from mooncake_jax.conductor.profile import build_profile

    flat = [(16, 0, 0.02), (64, 0, 0.01), (256, 0, 0.01), (512, 0, 0.005)]
    profile = build_profile("p", "tiny", flat, [(1, 64, 0.003), (4, 256, 0.004), (16, 2048, 0.008)],
                            kv_bytes_per_token=1, nic_bytes_per_s=1e9, kv_capacity_tokens=10**5, layers=4,
                            d_model=128)
    assert profile["prefill"]["use"] == "poly" and "fast25" not in profile["prefill"]["fits"]


def test_release_timing_by_hand():
    assert LAYERWISE.push_start(2.0, 5.0) == 2.0 and LAYERWISE.first_token_at(5.0, 6.0) == 5.0
    assert REAL_INSTANCES.push_start(2.0, 5.0) == 5.0 and REAL_INSTANCES.first_token_at(5.0, 6.0) == 6.0
    with pytest.raises(ValueError, match="kv_push"):
        ReleaseTiming("sometimes", "after-push")
    with pytest.raises(ValueError, match="first_token"):
        ReleaseTiming("layerwise", "never")
    with pytest.raises(ValueError, match="request_overhead_s"):
        SimConfig(request_overhead_s=-1.0)
    with pytest.raises(ValueError, match="decode_join_s"):
        SimConfig(decode_join_s=float("nan"))


def test_simulator_follows_the_release_timing():
    # prefill 1 + 1.000 = 2 s; the 1,000-token KV takes 1 s on the link
    layerwise = simulate(ONE, prefill=1, decode=1, hardware=SLOW_LINK).requests[0]
    assert layerwise.ttft_s == pytest.approx(2.0)  # streamed during the prefill, first token at its end
    assert layerwise.finished_at == pytest.approx(2.0 + 10 * 0.01)
    real = simulate(ONE, prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES).requests[0]
    assert real.ttft_s == pytest.approx(3.0)  # pushed after the prefill (1 s), first token after the push
    assert real.finished_at == pytest.approx(3.0 + 10 * 0.01)
    overhead = simulate(ONE, prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                        request_overhead_s=0.25).requests[0]
    assert overhead.ttft_s == pytest.approx(3.25)
    # the decode instance takes 0.5 s to take the request in: its first token gap (the largest of its 10, so its
    # TBT) is the join plus one step, the first token itself unchanged
    joined = simulate(ONE, prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                      decode_join_s=0.5).requests[0]
    assert joined.ttft_s == pytest.approx(3.0)
    assert joined.finished_at == pytest.approx(3.0 + 0.5 + 10 * 0.01)
    assert joined.tbt_s == pytest.approx(0.5 + 0.01)


def test_a_join_stalls_the_running_batch_by_the_measured_stall():
    """Two 1,000-token requests on one prefill + one decode instance, pushed after the prefill: A's first token at
    3 s (prefill 2 s, push 1 s), B's at 5 s (queued behind A). Each takes 0.5 s to join the batch, the last 0.2 s of
    it loading pages on the engine loop: A decodes 200 steps of 10 ms from 3.5 s, and B's join at 5.5 s stalls it
    0.2 s (one gap of 0.21 s among its longest 20, with its first gap of 0.51 s)."""
    two = Trace([TraceRequest(0.0, 1000, 201, (1, 2)), TraceRequest(0.0, 1000, 11, (3, 4))])
    a, b = simulate(two, prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                    decode_join_s=0.5, decode_join_stall_s=0.2).requests
    assert a.ttft_s == pytest.approx(3.0) and b.ttft_s == pytest.approx(5.0)
    assert a.finished_at == pytest.approx(3.5 + 200 * 0.01 + 0.2)
    assert a.tbt_s == pytest.approx((0.51 + 0.21 + 18 * 0.01) / 20)
    assert b.finished_at - 5.0 == pytest.approx(0.5 + 10 * 0.01, abs=0.011)  # its join, at most a step's wait
    with pytest.raises(ValueError, match="decode_join_stall_s"):
        SimConfig(decode_join_s=0.1, decode_join_stall_s=0.2)


def test_the_decode_instance_takes_requests_in_one_at_a_time():
    """Two 1,000-token requests prefilled side by side on two instances (0-2 s), their KV pushed one after the
    other over the decode instance's link (A's at 3 s, B's at 4 s). Taking each in takes 1.5 s: A joins at 4.5 s,
    B's join waits for A's and ends at 6 s, not 5.5 s."""
    two = Trace([TraceRequest(0.0, 1000, 11, (1, 2)), TraceRequest(0.0, 1000, 11, (3, 4))])
    a, b = simulate(two, prefill=2, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                    decode_join_s=1.5).requests
    assert a.prefill_id != b.prefill_id
    assert (a.ttft_s, b.ttft_s) == (pytest.approx(3.0), pytest.approx(4.0))
    assert a.finished_at == pytest.approx(4.5 + 10 * 0.01)
    assert b.finished_at == pytest.approx(6.0 + 10 * 0.01, abs=0.011)  # joins at the batch's next boundary


def test_decode_steps_slow_down_while_a_prefill_shares_the_host():
    """A's KV is on the decode instance at 3 s (prefill 2 s, push 1 s); B arrives then and prefills for 2 s on the
    same host. With a shared-host slowdown of 2, A's 10 ms steps take 20 ms until B's prefill ends: 100 steps by
    5 s, the other 100 at 10 ms, done at 6 s instead of 5 s (within one step: the change waits for a boundary)."""
    two = Trace([TraceRequest(0.0, 1000, 201, (1, 2)), TraceRequest(3.0, 1000, 2, (3, 4))])
    alone, _ = simulate(two, prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES).requests
    shared, _ = simulate(two, prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                         shared_host_decode_slowdown=2.0).requests
    assert alone.finished_at == pytest.approx(5.0)
    assert shared.ttft_s == pytest.approx(3.0)
    assert shared.finished_at == pytest.approx(6.0, abs=0.011)
    with pytest.raises(ValueError, match="shared_host_decode_slowdown"):
        SimConfig(shared_host_decode_slowdown=0.5)


def test_conductor_predicts_prefill_work_by_the_same_rule():
    from mooncake_jax.conductor import ClusterState, Policy, PolicyConfig, Request

    cfg = PolicyConfig(block_size=512, admission="none")
    state = ClusterState(cfg)
    state.add_instance("p", "prefill", SLOW_LINK, 0.0)
    state.add_instance("d", "decode", SLOW_LINK, 0.0)
    state.kv_stored("p", [1, 2])
    for n, keys in ((1000, (1, 2)), (1024, (1, 2)), (1500, (1, 2, 3))):
        d = Policy(cfg).decide(Request(f"r{n}", keys, n, 4), state.snapshot(), 0.0)
        assert d.prefill_s == pytest.approx(prefill_work_s(SLOW_LINK.prefill, n, d.prefix_blocks * 512))


def test_decode_step_spread_scales_each_reported_gap_and_keeps_the_clock():
    """One request of 11 tokens, 10 ms steps, joining at once (KV pushed by 3 s). Factors (1, 3) are normalized
    to mean 1 (0.5, 1.5): every one of its 10 gaps is 5 or 15 ms, drawn reproducibly, and its TBT is the mean of
    its two longest; the clock keeps the mean step (finished at 3.1 s as with exact steps). One factor, whatever
    its value, is exact steps."""
    exact = simulate(ONE, prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES).requests[0]
    assert exact.finished_at == pytest.approx(3.1) and exact.tbt_s == pytest.approx(0.01)
    from mooncake_jax.sim.disagg import DisaggregatedSim

    def gaps(spread, seed=0):
        cfg = SimConfig(prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                        decode_step_spread=spread, seed=seed)
        sim = DisaggregatedSim(cfg, ONE)
        req = sim.run().requests[0]
        return req, sim.decode[0].batch.gaps(req)

    req, g = gaps((1, 3))
    assert req.finished_at == pytest.approx(3.1)
    assert len(g) == 10 and all(x == pytest.approx(0.005) or x == pytest.approx(0.015) for x in g)
    assert req.tbt_s == pytest.approx(sum(sorted(g)[-2:]) / 2)
    assert list(gaps((1, 3))[1]) == list(g)  # same seed, same draws
    assert any(list(gaps((1, 3), seed)[1]) != list(g) for seed in (1, 2, 3))
    req, g = gaps((7.0,))
    assert list(g) == pytest.approx([0.01] * 10) and req.tbt_s == pytest.approx(0.01)
    with pytest.raises(ValueError, match="decode_step_spread"):
        SimConfig(decode_step_spread=(1.0, 0.0))


def _sim_to_real():
    import benchmark_script

    return benchmark_script.load("sim_to_real")


def test_token_delivery_is_paid_per_request_in_every_decode_step():
    """The sim-to-real probe's per-token delivery (decode instance -> client, per request in the batch) enters the
    decode step's batch term: a 10 ms step scaled x2 is 20 ms, plus 5 ms per request. A and B prefill side by side
    (0-2 s), their KV pushed one after the other over the decode instance's link (A's by 3 s, B's by 4 s): A decodes
    alone from 3 s at 25 ms a step, B joins at 4 s and they step together at 20 + 2*5 = 30 ms."""
    bench = _sim_to_real()
    costs = bench.profiled_costs(SLOW_LINK, {"prefill_scale": 1.0, "decode_scale": 2.0,
                                            "decode_token_delivery_s": 0.005})
    assert costs.decode.coef == pytest.approx((0.02, 0.005, 0.0))
    assert costs.prefill.coef == pytest.approx(SLOW_LINK.prefill.coef)
    two = Trace([TraceRequest(0.0, 1000, 201, (1, 2)), TraceRequest(0.0, 1000, 2, (3, 4))])
    a, b = simulate(two, prefill=2, decode=1, hardware=costs, release_timing=REAL_INSTANCES).requests
    assert (a.ttft_s, b.ttft_s) == (pytest.approx(3.0), pytest.approx(4.0))  # pushes one after the other
    # A: 40 steps of 25 ms alone (3 s -> 4 s), B's one step beside it at 30 ms, then 159 alone at 25 ms
    assert b.finished_at == pytest.approx(4.03)
    assert a.finished_at == pytest.approx(4.0 + 0.03 + 159 * 0.025)


def test_the_probe_reads_scale_delivery_slowdown_and_stall_from_classed_gaps():
    """Client-side token times built by hand from known quantities, read back by ``decode_in_bursts``. The start-up
    profile's step is 1 ms whatever the batch; the cluster's is 2 ms plus 0.5 ms per request in the batch, and 1.5x
    that while a prefill runs. A decodes alone (40 gaps of 2.5 ms), then beside B's prefill (3.75 ms); B's join
    stalls A's gap to 7 ms (2.5 + 4.5); then both decode at 3 ms."""
    bench = _sim_to_real()
    ms = 1e-3
    a = [50 * ms, 60 * ms] + [60 * ms + 2.5 * ms * k for k in range(1, 41)]  # alone, apart: to 160 ms
    a += [a[-1] + 3.75 * ms * k for k in range(1, 13)]  # beside B's prefill (160.1-204.9 ms): to 205 ms
    a += [a[-1] + 2.5 * ms, a[-1] + 2.5 * ms + 7 * ms]  # B's KV staged; B joins at 212.5 ms: A's gap 7 ms
    a += [a[-1] + 3 * ms * k for k in range(1, 21)]  # batch of two
    b = [204.9 * ms, 212.5 * ms] + [212.5 * ms + 3 * ms * k for k in range(1, 22)]  # its last after A's
    runs = [(0.0, 32, np.array(a)), (160.1 * ms, 32, np.array(b))]
    costs = SLOW_LINK.replace(decode=DecodeCost((0.001, 0.0, 0.0)))
    read = bench.decode_in_bursts(runs, costs)
    assert read["decode_scale"] == pytest.approx(2.0)
    assert read["decode_token_delivery_s"] == pytest.approx(0.5 * ms)
    assert read["shared_host_decode_slowdown"] == pytest.approx(1.5)
    assert read["decode_join_stall_s"] == pytest.approx(4.5 * ms)
    assert read["decode_step_spread"] == pytest.approx([1.0] * 20)  # every steady gap exactly its regime's
    # joins one at a time: A's 10 ms, B's 7.6 ms from its KV (204.9 ms); their median less the median gap (3 ms)
    assert read["decode_join_s_bursts"] == pytest.approx(8.8 * ms - 3 * ms)


def test_off_engine_time_delays_the_first_token_but_holds_no_instance():
    """Two 1,000-token requests at 0 s on one prefill instance (2 s of compute each), pushed after the prefill (1 s
    each over the link). Each spends 0.5 s off the engine (RPCs, staging, store): A is released at 2.5 s and its
    first token is at 3.5 s; B computes from 2 s (the engine is free), is released at 4.5 s, its push waits for
    nothing (the link is free from 3.5 s): first token at 5.5 s. The same 0.5 s held on the engine
    (``request_overhead_s``) delays B's start to 2.5 s: its first token at 6 s."""
    two = Trace([TraceRequest(0.0, 1000, 11, (1, 2)), TraceRequest(0.0, 1000, 11, (3, 4))])
    a, b = simulate(two, prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                    prefill_off_engine_s=0.5).requests
    assert (a.ttft_s, b.ttft_s) == (pytest.approx(3.5), pytest.approx(5.5))
    assert b.prefill_start == pytest.approx(2.0)
    held_a, held_b = simulate(two, prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                              request_overhead_s=0.5).requests
    assert (held_a.ttft_s, held_b.ttft_s) == (pytest.approx(3.5), pytest.approx(6.0))
    one = simulate(Trace([TraceRequest(0.0, 1000, 1, (1, 2))]), prefill=1, decode=1, hardware=SLOW_LINK,
                   release_timing=LAYERWISE, prefill_off_engine_s=0.5).requests[0]
    assert one.ttft_s == pytest.approx(2.5)  # no decode: released after its compute and its time off the engine
    with pytest.raises(ValueError, match="prefill_off_engine_s"):
        SimConfig(prefill_off_engine_s=-0.1)


def test_the_replay_window_refits_the_prefill_and_reads_the_time_off_the_engine():
    """Replayed requests whose instances reported, by hand: the profile predicts 1 s + 1 ms per computed token; the
    engine took 2 s + 4 ms per computed token (1,000 tokens none cached: 6 s; 500: 4 s; 2,000 with 1,000 cached:
    6 s; 250: 3 s), so the refitted model is (2, 0.004, 0, 0) and predicts those exactly, and the ratio of the
    sums is 19 / 6.75. Their TTFTs hold 10 ms to the Conductor's decision, queues of 0, 1, 0.5 and 0 s and 0.3,
    0.2, 0.4 and 0.5 s off the engine: median 0.35 s. Each decoded three tokens, 20 ms then 5 ms and 5 ms after
    its first: a join of 15 ms. In two 12 s slices (the last request submitted at 12 s), both at the refitted
    model's speed. With three requests, no
    refit: the profile scaled by 16 / 5.5, and in 1 s slices the first two ran at 10 / (3.5 * 16 / 5.5) = 55 / 56
    of that, the third at 6 / (2 * 16 / 5.5) = 33 / 32."""
    bench = _sim_to_real()
    items = [(0.0, [1] * 1000, 1, ()), (0.0, [1] * 500, 1, ()), (1.0, [1] * 2000, 1, ()), (12.0, [1] * 250, 1, ())]
    cached = (0, 0, 1000, 0)
    assert [prefill_work_s(SLOW_LINK.prefill, len(it[1]), c) for it, c in zip(items, cached)] == \
        pytest.approx([2.0, 1.5, 2.0, 1.25])
    gaps = (0.0, 0.02, 0.025, 0.03)
    records = [{"submitted": s, "decided_s": 0.01, "times": [0.01 + q + c + off + g for g in gaps],
                "cached_tokens": k, "queue_s": q, "compute_s": c}
               for s, q, c, off, k in zip((0.002, 0.001, 1.0, 12.0), (0.0, 1.0, 0.5, 0.0), (6.0, 4.0, 6.0, 3.0),
                                          (0.3, 0.2, 0.4, 0.5), cached)]
    read = bench.replay_window(items, records, SLOW_LINK)
    assert read["prefill_coef"] == pytest.approx([2.0, 0.004, 0.0, 0.0], abs=1e-9)
    assert read["prefill_scale"] == pytest.approx(19 / 6.75)
    assert read["prefill_off_engine_s"] == pytest.approx(0.35)
    assert read["prefill_queue_s_p50"] == pytest.approx(0.25)
    assert read["decode_join_s"] == pytest.approx(0.015)
    assert read["prefill_slowdown_steps"] == [(0.0, pytest.approx(1.0)), (12.0, pytest.approx(1.0))]
    profiled = bench.profiled_costs(SLOW_LINK, {**read, "decode_scale": 1.0})
    assert prefill_work_s(profiled.prefill, 2000, 1000) == pytest.approx(6.0)
    three = bench.replay_window(items[:3], records[:3], SLOW_LINK)
    assert "prefill_coef" not in three and three["prefill_scale"] == pytest.approx(16 / 5.5)
    assert bench.profiled_costs(SLOW_LINK, {**three, "decode_scale": 1.0}).prefill.coef == \
        pytest.approx([c * 16 / 5.5 for c in SLOW_LINK.prefill.coef])
    assert bench.replay_window(items[:3], records[:3], SLOW_LINK, slice_s=1.0)["prefill_slowdown_steps"] == \
        [(0.0, pytest.approx(55 / 56)), (1.0, pytest.approx(33 / 32))]
    with pytest.raises(ValueError, match="at least 2"):
        bench.replay_window(items, [records[0], None, None, None], SLOW_LINK)


def test_the_simulator_takes_a_burst_in_the_order_it_reached_the_gateway():
    """Two 1,000-token requests of one burst (both at 0 s in the trace) on one prefill instance; the first reached
    the gateway 1 ms before the second but the Conductor decided on the second first (at 1 + 2 ms against 0.5 + 3
    ms). Taken in the Conductor's order, the second is prefilled first (first token 3 s after it arrived, pushed
    after its 2 s prefill) and the first queues behind it (5 s after 3.5 ms); in trace order, the other way
    round."""
    bench = _sim_to_real()
    items = [(0.0, [1] * 1000, 11, (1, 2)), (0.0, [2] * 1000, 11, (3, 4))]
    records = [{"submitted": 0.0005, "decided_s": 0.003}, {"submitted": 0.001, "decided_s": 0.002}]
    assert bench.decided_at(items, records) == pytest.approx([0.0035, 0.003])
    assert bench.decided_at(items, [None, records[1]]) == pytest.approx([0.0, 0.003])  # failed: its trace time
    # at speed 2 a failed request arrives at half its trace time (items[0] is at trace time 0: use a later one)
    later = [(0.01, *items[0][1:]), items[1]]
    assert bench.decided_at(later, [None, records[1]], speed=2.0)[0] == pytest.approx(0.005)
    # the Conductor's own order: the first decided first, its reply later to reach its thread (4 ms against 3 ms)
    ranked = [{"submitted": 0.0005, "decided_s": 0.0035, "decision_seq": 7},
              {"submitted": 0.001, "decided_s": 0.002, "decision_seq": 8}]
    assert bench.decided_at(items, ranked) == [pytest.approx(0.004), pytest.approx(0.004 + 1e-9, abs=1e-12)]
    assert bench.arrival_order(items, ranked)[0] == [0, 1]
    order, figures = bench.arrival_order(items, records)
    assert order == [1, 0] and figures["arrival_order_moved"] == 2
    assert figures["arrival_order_moved_from_submissions"] == 2
    overheads = {"prefill_scale": 1.0, "decode_scale": 1.0, "request_overhead_s": 0.0}
    slo = {"ttft_slo_s": 30.0, "tbt_slo_s": 1.0}
    _, measured = bench.simulated(items, SLOW_LINK, overheads, 1, 1, 1.0, 10**6, slo, arrivals=[0.0035, 0.003])
    assert (measured[0].ttft_s, measured[1].ttft_s) == (pytest.approx(5.0 - 0.0005), pytest.approx(3.0))
    _, traced = bench.simulated(items, SLOW_LINK, overheads, 1, 1, 1.0, 10**6, slo)
    assert (traced[0].ttft_s, traced[1].ttft_s) == (pytest.approx(3.0), pytest.approx(5.0))


def test_a_push_after_the_prefill_takes_the_link_when_the_prefill_ends():
    """A (3,000 tokens: 4 s of prefill, its KV 3 s on the link) starts at 0 s on one instance; B (500 tokens: 1.5 s,
    0.5 s of KV) arrives at 0.1 s and goes to the other. Pushed after the prefill, B's KV takes the decode
    instance's link at 1.6 s, first token at 2.1 s (2.0 s after it arrived); A's from 4 s, first token at 7 s. (A
    push booked when its prefill starts would hold the link for 4-7 s and put B's first token at 7.5 s.)"""
    two = Trace([TraceRequest(0.0, 3000, 11, (1, 2)), TraceRequest(0.1, 500, 11, (3,))])
    a, b = simulate(two, prefill=2, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES).requests
    assert a.prefill_id != b.prefill_id
    assert (a.ttft_s, b.ttft_s) == (pytest.approx(7.0), pytest.approx(2.0))


def test_a_prefill_takes_the_measured_slowdown_of_the_slice_it_starts_in():
    """A 1,000-token request (2 s of prefill by the model, its KV 1 s on the link) starting at 0 s where the host
    ran prefills at 1.5x: 3 s, first token at 4 s; another at 10 s, where they ran at 0.5x: 1 s, first token 2 s
    after it arrived."""
    two = Trace([TraceRequest(0.0, 1000, 11, (1, 2)), TraceRequest(10.0, 1000, 11, (3, 4))])
    a, b = simulate(two, prefill=1, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                    prefill_slowdown_steps=((0.0, 1.5), (5.0, 0.5))).requests
    assert (a.prefill_s, b.prefill_s) == (pytest.approx(3.0), pytest.approx(1.0))
    assert (a.ttft_s, b.ttft_s) == (pytest.approx(4.0), pytest.approx(2.0))
    for bad in (((1.0, 1.0), (0.5, 2.0)), ((0.0, 0.0),), ((0.0,),)):
        with pytest.raises(ValueError, match="prefill_slowdown_steps"):
            SimConfig(prefill_slowdown_steps=bad)
