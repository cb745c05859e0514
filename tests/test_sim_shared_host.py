"""The simulator's shared host (``SimConfig.host_cores``): instances as processes on one host's cores, every
service time stretched by (busy instances / cores) while more are busy than there are cores. Worked by hand on the
costs of ``test_accounting``: prefill 1 s + 1 ms per token (a 1,000-token prompt: 2 s alone), decode step 10 ms,
a 1,000-token KV pushed in 1 s."""

import numpy as np
import pytest

from mooncake_jax.conductor.accounting import REAL_INSTANCES
from mooncake_jax.sim import SimConfig, simulate
from mooncake_jax.sim.host import shared_rates
from mooncake_jax.sim.trace import Trace, TraceRequest

from test_accounting import SLOW_LINK


def test_two_prefills_on_one_core_share_it_from_the_moment_both_run():
    """A arrives at 0 s, B at 1 s, each 2 s of work, on two prefill instances (single-token outputs: no decode).
    One core: A runs alone for 1 s (1 s of work left), then both at half speed: A's last second of work takes 2 s
    (ends at 3 s), by when B has done 1 s; alone again, B ends at 4 s. Two cores: each keeps its own (2 s, 3 s)."""
    trace = Trace([TraceRequest(0.0, 1000, 1, (1, 2)), TraceRequest(1.0, 1000, 1, (3, 4))])
    a, b = simulate(trace, prefill=2, decode=1, hardware=SLOW_LINK, host_cores=1).requests
    assert a.prefill_id != b.prefill_id
    assert (a.first_token_at, b.first_token_at) == (pytest.approx(3.0), pytest.approx(4.0))
    a, b = simulate(trace, prefill=2, decode=1, hardware=SLOW_LINK, host_cores=2).requests
    assert (a.first_token_at, b.first_token_at) == (pytest.approx(2.0), pytest.approx(3.0))
    a, b = simulate(trace, prefill=2, decode=1, hardware=SLOW_LINK).requests  # separate machines: the same
    assert (a.first_token_at, b.first_token_at) == (pytest.approx(2.0), pytest.approx(3.0))


def test_a_decode_batch_counts_as_a_busy_process():
    """A: prefill 0-2 s, KV pushed 2-3 s, then 200 decode steps. B and C arrive at 3 s and prefill on the two
    instances. Two cores, three busy (two prefills, A's batch): everything at 2/3 speed from 3 s, so B and C take
    3 s (end at 6 s) and A's steps 15 ms: its 200 steps end at 6 s (5 s on separate machines). B's and C's KV then
    go over the decode instance's link one after the other: first tokens at 7 and 8 s (4 and 5 s after arrival)."""
    trace = Trace([TraceRequest(0.0, 1000, 201, (1, 2)), TraceRequest(3.0, 1000, 2, (3, 4)),
                   TraceRequest(3.0, 1000, 2, (5, 6))])
    alone = simulate(trace, prefill=2, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES).requests
    assert alone[0].finished_at == pytest.approx(5.0)
    a, b, c = simulate(trace, prefill=2, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                       host_cores=2).requests
    assert a.ttft_s == pytest.approx(3.0)
    assert b.prefill_start == c.prefill_start == pytest.approx(3.0)
    assert a.finished_at == pytest.approx(6.0, abs=0.016)  # the change waits for a step boundary
    assert sorted((b.ttft_s, c.ttft_s)) == [pytest.approx(4.0), pytest.approx(5.0)]


def test_the_host_other_processes_take_their_share_of_the_cores():
    """As above on two cores with one other runnable process of the host's (``host_other_busy=1``): A alone is two
    busy on two cores (full speed) until B arrives at 1 s; then three share two cores, 2/3 speed each: A's last
    second of work takes 1.5 s (ends at 2.5 s), by when B has done 1 s; alone again with the other, B's last second
    ends at 3.5 s. With two others A runs at 2/3 from the start (2/3 s of work by 1 s), then at 1/2: its 4/3 s
    left end at 1 + 8/3 s; B has done 4/3 s by then, its 2/3 s left at 2/3 speed end 1 s later."""
    trace = Trace([TraceRequest(0.0, 1000, 1, (1, 2)), TraceRequest(1.0, 1000, 1, (3, 4))])
    a, b = simulate(trace, prefill=2, decode=1, hardware=SLOW_LINK, host_cores=2, host_other_busy=1).requests
    assert (a.first_token_at, b.first_token_at) == (pytest.approx(2.5), pytest.approx(3.5))
    a, b = simulate(trace, prefill=2, decode=1, hardware=SLOW_LINK, host_cores=2, host_other_busy=2.0).requests
    assert (a.first_token_at, b.first_token_at) == (pytest.approx(1 + 8 / 3), pytest.approx(2 + 8 / 3))
    assert shared_rates(2, 2, 1, others=1.0) == (pytest.approx(0.5), pytest.approx(0.5))
    assert shared_rates(2, 1, 0, others=0.5) == (1.0, 1.0)  # 1.5 busy on 2 cores: no one slowed


def test_host_other_busy_is_checked():
    for bad in (-0.5, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="host_other_busy"):
            SimConfig(host_cores=2, host_other_busy=bad)
    with pytest.raises(ValueError, match="host_other_busy needs host_cores"):
        SimConfig(host_other_busy=1.0)


def test_host_cores_is_checked():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="host_cores"):
            SimConfig(host_cores=bad)
    with pytest.raises(ValueError, match="host_cores"):
        SimConfig(architecture="coupled", host_cores=2)


def test_the_profile_reading_takes_the_pairs_engine_and_the_host_cores():
    """Pairs' requests as their instances reported them, by hand (profile: 1 s + 1 ms per token): at 1,000 tokens
    (profile 2 s) the engine took 5.0, 4.9 and 9.0 s (median 5 s: the 9 s one preempted), at 500 (1.5 s) 4 s
    twice: the line through the medians is 1 s + 2x the profile. TTFT less decision, queue and compute: 0.1, 0.2,
    0.3, 0.4, 0.5 s, median 0.3 s. The simulator's inputs: the profile times 2 plus 1 s per request (3 s + 2 ms per
    token), the bursts' time off the engine (the pairs' where none), the pairs' join, the bursts' decode, two cores
    shared; no slowdown read."""
    from test_accounting import _sim_to_real

    bench = _sim_to_real()
    reported = [(1000, 0, 5.0, 0.1), (1000, 0, 4.9, 0.2), (1000, 0, 9.0, 0.3), (500, 0, 4.0, 0.4),
                (500, 0, 4.0, 0.5)]
    pairs = bench.engine_in_pairs(reported, SLOW_LINK)
    assert (pairs["engine_fixed_s"], pairs["engine_scale"]) == (pytest.approx(1.0), pytest.approx(2.0))
    assert pairs["off_engine_s"] == pytest.approx(0.3)
    probed = {**pairs, "prefill_scale": 7.0, "off_engine_s_bursts": 0.04, "decode_scale": 1.5,
              "decode_token_delivery_s": 0.001,
              "decode_join_s": 0.01, "decode_join_s_bursts": 0.02, "decode_join_stall_s": 0.05,
              "shared_host_decode_slowdown": 1.4, "decode_step_spread": [0.5, 1.5]}
    inputs = bench.from_profile(SLOW_LINK, probed, 2)
    assert inputs["prefill_coef"] == pytest.approx([3.0, 0.002, 0.0, 0.0])
    assert inputs["prefill_off_engine_s"] == pytest.approx(0.04)  # the bursts' where read
    decided = bench.from_profile(SLOW_LINK, {**probed, "decided_s_bursts": 0.01}, 2)
    assert decided["prefill_off_engine_s"] == pytest.approx(0.05)  # and their time to the decision before it
    pairs_only = {k: v for k, v in probed.items() if k != "off_engine_s_bursts"}
    assert bench.from_profile(SLOW_LINK, pairs_only, 2)["prefill_off_engine_s"] == pytest.approx(0.3)  # else the pairs'
    assert inputs["decode_join_s"] == inputs["decode_join_stall_s"] == pytest.approx(0.01)  # stall <= join
    # a prefill beside a decode batch is two busy on two cores: no slowdown modelled, the bursts' 1.4 is all residual
    assert inputs["shared_host_decode_slowdown"] == pytest.approx(1.4) and inputs["host_cores"] == 2
    assert bench.engine_in_pairs(reported[:3], SLOW_LINK) == {}  # too few to read


def test_the_contention_probe_reads_the_host_other_processes_and_the_profile_divides_them_out():
    """By hand, two cores. A prefill took 1 s alone, 1.5 s beside another, 2 s beside another and a decode batch:
    with one other runnable process of the host's, one alone is two busy (full speed), two prefills three (2/3:
    1.5x), with the decode four (1/2: 2x), so the probe reads one other exactly; no slowdown at all reads none.
    The profile reading with two others (profile 1 s + 1 ms per token; pairs' engine 1 s + 2x the profile, run two
    prefills and two others on two cores: half speed): the engine alone is half that, 0.5 s + 1x the profile (1.5 s
    + 1 ms per token); the decode instance alone ran beside the two others at 2/3 speed, so its step scale 1.5
    reads 1.0, its join 30 ms 20 ms; with no others (the sixth pass's reading) all as probed."""
    from test_accounting import _sim_to_real

    bench = _sim_to_real()
    read = {"contention_compute_s_alone": 1.0, "contention_compute_s_pair": 1.5,
            "contention_compute_s_beside_decode": 2.0}
    host = bench.host_model(2, {})  # equal weights, no streaming
    assert bench.host_other_busy(read, host) == pytest.approx(1.0)
    assert bench.host_other_busy({**read, "contention_compute_s_pair": 1.0,
                                  "contention_compute_s_beside_decode": 1.0}, host) == 0.0
    assert bench.host_other_busy({}, host) == 0.0  # nothing measured
    probed = {"engine_scale": 2.0, "engine_fixed_s": 1.0, "prefill_scale": 7.0, "decode_scale": 1.5,
              "decode_join_s": 0.03, "host_other_busy": 2.0}
    inputs = bench.from_profile(SLOW_LINK, probed, 2)
    assert inputs["prefill_coef"] == pytest.approx([1.5, 0.001, 0.0, 0.0])
    assert (inputs["decode_scale"], inputs["decode_join_s"]) == (pytest.approx(1.0), pytest.approx(0.02))
    assert inputs["host_other_busy"] == 2.0
    alone = bench.from_profile(SLOW_LINK, probed, 2, others=0.0)
    assert alone["prefill_coef"] == pytest.approx([3.0, 0.002, 0.0, 0.0]) and alone["decode_scale"] == 1.5


def test_the_bursts_engine_is_read_with_the_sharing_divided_out():
    """By hand (profile 1 s + 1 ms per token, two cores): A (1,000 tokens, profile 2 s) computed 4 s alone, B (500,
    1.5 s) 3.25 s alone; C and D (1,000 each) computed 6 s side by side while a decode batch was busy (a request
    decoding 19-30 s): three busy on two cores, 2/3 of a core each, so 4 s of work. The work is 1 s + 1.5x the
    profile for all four. With one other process of the host's, C and D had half a core (3 s of work), A and B a
    whole one: the mean share 0.75."""
    from test_accounting import _sim_to_real

    bench = _sim_to_real()
    engine = [(1000, 0, 0.0, 4.0), (500, 0, 10.0, 3.25), (1000, 0, 20.0, 6.0), (1000, 0, 20.0, 6.0)]
    runs = [(19.0, 32, np.array([19.0, 25.0, 30.0]))]
    read = bench.engine_in_bursts(engine, runs, SLOW_LINK, bench.host_model(2, {}, 0.0))
    assert (read["engine_fixed_s_bursts"], read["engine_scale_bursts"]) == (pytest.approx(1.0), pytest.approx(1.5))
    assert read["engine_bursts_requests"] == 4
    one_other = bench.host_model(2, {}, 1.0)
    assert bench.engine_in_bursts(engine, runs, SLOW_LINK, one_other)["engine_bursts_share"] == pytest.approx(0.75)
    assert bench.engine_in_bursts(engine[:3], runs, SLOW_LINK, bench.host_model(2, {}, 0.0)) == {}  # too few
    probed = {"engine_scale": 9.0, "engine_fixed_s": 9.0, "prefill_scale": 9.0, "decode_scale": 1.0,
              "decode_join_s": 0.01, **{k: v for k, v in read.items() if k != "engine_coef_bursts"}}
    assert bench.from_profile(SLOW_LINK, probed, 2)["prefill_coef"] == pytest.approx([2.5, 0.0015, 0.0, 0.0])
    # the polynomial fitted to the same work (two lengths: not pinned down, but through both)
    assert [bench.prefill_seconds(read["engine_coef_bursts"], n, 0) for n in (500, 1000)] == pytest.approx([3.25, 4.0])


def test_the_bursts_polynomial_puts_their_median_request_at_its_own_work():
    """By hand: four 100-token requests alone took 1, 2, 2 and 4 s. Least squares in relative error puts them at
    (1 + 1/2 + 1/2 + 1/4) / (1 + 1/4 + 1/4 + 1/16) = 1.44 s, below three of the four; the polynomial is scaled so
    that the median request's work over it is 1: 2 s."""
    from test_accounting import _sim_to_real

    bench = _sim_to_real()
    engine = [(100, 0, 0.0, 1.0), (100, 0, 10.0, 2.0), (100, 0, 20.0, 2.0), (100, 0, 30.0, 4.0)]
    read = bench.engine_in_bursts(engine, [], SLOW_LINK, bench.host_model(2, {}, 0.0))
    assert bench.prefill_seconds(read["engine_coef_bursts"], 100, 0) == pytest.approx(2.0)


def test_the_bursts_engine_keeps_its_own_shape_over_the_trace_lengths():
    """By hand (two cores, no others): the engine's work grows as 0.5 s + 1 ms per computed token + 1 us per token
    squared + 2 us per computed token and cached token, where the profile (1 s + 1 ms per token) is a line. Alone:
    100 tokens 0.61 s, 500 1.25 s, 1,000 2.5 s, 1,000 with 500 cached 1.75 s, 2,000 6.5 s; two of 1,000 side by side
    beside a busy decode batch (2/3 of a core each) computed 3.75 s each, 2.5 s of work. The polynomial fitted to
    that work is the one it follows, and the profile reading takes it. The profile times one line (the reading
    without it): no line with a positive intercept fits, so the ratio of the sums, 17.61 / 13.1 s = 1.344x the
    profile: the 100-token prompt at 1.48 s (2.4x its 0.61), the 2,000-token one at 4.03 s (not 6.5), as the quiet
    runs of the seventh pass put their median prompts 1.7-1.9x too long."""
    from test_accounting import _sim_to_real

    bench = _sim_to_real()
    engine = [(100, 0, 0.0, 0.61), (500, 0, 10.0, 1.25), (1000, 0, 20.0, 3.75), (1000, 0, 20.0, 3.75),
              (1000, 500, 40.0, 1.75), (2000, 0, 50.0, 6.5), (1000, 0, 60.0, 2.5)]
    runs = [(19.0, 32, np.array([19.0, 25.0, 30.0]))]
    read = bench.engine_in_bursts(engine, runs, SLOW_LINK, bench.host_model(2, {}, 0.0))
    assert read["engine_coef_bursts"] == pytest.approx([0.5, 0.001, 1e-6, 2e-6], rel=1e-6)
    probed = {"prefill_scale": 9.0, "decode_scale": 1.0, "decode_join_s": 0.01, **read}
    inputs = bench.from_profile(SLOW_LINK, probed, 2)
    assert inputs["prefill_coef"] == pytest.approx([0.5, 0.001, 1e-6, 2e-6], rel=1e-6)
    line = bench.from_profile(SLOW_LINK, {k: v for k, v in probed.items() if k != "engine_coef_bursts"}, 2)
    assert (read["engine_fixed_s_bursts"], read["engine_scale_bursts"]) == (0.0, pytest.approx(17.61 / 13.1))
    assert [bench.prefill_seconds(line["prefill_coef"], n, 0) for n in (100, 2000)] == pytest.approx(
        [1.1 * 17.61 / 13.1, 3.0 * 17.61 / 13.1])


def test_the_cores_are_shared_by_weight_each_process_at_most_one():
    """By hand: two cores, two prefills and a decode busy. Equal weights: each gets 2/3 of a core. A prefill weighing
    a third of a decode (nice +5): the decode's share, 2 * 1 / (1 + 2/3) = 1.2 cores, is more than the one it can
    use, so it keeps one and the two prefills split the other (1/2 each). One core, a prefill and a decode at
    weights 1/3 and 1: 1/4 and 3/4. Linux's weight for 5 nice levels lower: 335/1024 of nice 0's."""
    from mooncake_jax.sim.host import cfs_weight, shared_rates

    assert shared_rates(2, 2, 1) == (pytest.approx(2 / 3), pytest.approx(2 / 3))
    assert shared_rates(2, 2, 1, 1 / 3) == (pytest.approx(0.5), pytest.approx(1.0))
    assert shared_rates(1, 1, 1, 1 / 3) == (pytest.approx(0.25), pytest.approx(0.75))
    assert shared_rates(2, 1, 1, 1 / 3) == (1.0, 1.0) and shared_rates(2, 0, 0) == (1.0, 1.0)
    assert cfs_weight(5) == pytest.approx(335 / 1024, rel=0.01)


def test_a_lower_priority_prefill_leaves_the_decode_its_core():
    """As ``test_a_decode_batch_counts_as_a_busy_process`` with the prefills weighing a third of the decode: the
    decode keeps a whole core (A's 200 steps end at 5 s as on separate machines) and B and C share the other at
    half speed until then (1 s of their 2 s of work done each), then have a core each: both end at 6 s, their KV
    over the link at 7 and 8 s (4 and 5 s after arrival; with equal weights A ended at 6 s instead)."""
    trace = Trace([TraceRequest(0.0, 1000, 201, (1, 2)), TraceRequest(3.0, 1000, 2, (3, 4)),
                   TraceRequest(3.0, 1000, 2, (5, 6))])
    a, b, c = simulate(trace, prefill=2, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES,
                       host_cores=2, host_prefill_weight=1 / 3).requests
    assert a.finished_at == pytest.approx(5.0, abs=0.011)
    assert sorted((b.ttft_s, c.ttft_s)) == [pytest.approx(4.0), pytest.approx(5.0)]
    assert b.prefill_start == c.prefill_start == pytest.approx(3.0)
    with pytest.raises(ValueError, match="host_prefill_weight"):
        SimConfig(host_prefill_weight=0.0)


def test_a_streaming_process_takes_what_it_demands_and_no_more():
    """By hand, two cores. Two prefills and a decode at equal weights beside a streaming process that can use half a
    core: its share (2/4) is all it demands, so it keeps 0.5 and the three share 1.5 (1/2 each). At a prefill's
    Linux weight (1/3) the decode's share of what the streaming leaves, 1.5 / (1 + 2/3) = 0.9, fits: the two
    prefills get 0.3 each. One prefill and a decode at equal weights beside a streaming that can use a whole core:
    a third each (2/3 of a core)."""
    assert shared_rates(2, 2, 1, 1.0, 0.0, 0.5) == (pytest.approx(0.5), pytest.approx(0.5))
    assert shared_rates(2, 2, 1, 1 / 3, 0.0, 0.5) == (pytest.approx(0.3), pytest.approx(0.9))
    assert shared_rates(2, 1, 1, 1.0, 0.0, 1.0) == (pytest.approx(2 / 3), pytest.approx(2 / 3))
    assert shared_rates(2, 1, 1, 1.0, 0.0, 0.0) == (1.0, 1.0)  # none: as before
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="streaming"):
            shared_rates(2, 1, 1, 1.0, 0.0, bad)


def test_the_streaming_load_follows_the_tokens_the_decode_emits():
    """By hand (``host.rates_with_streaming``), two cores, equal weights: a decode batch emitting 1,000 tokens a second
    at full speed, each costing 0.5 ms off the instances, demands half a core at full speed, ``0.5 r`` at speed
    ``r``. With two prefills: the streaming keeps ``0.5 r`` and the three share the rest, ``r = (2 - 0.5 r) / 3``:
    r = 4/7, the streaming 2/7 of a core. With one prefill, ``r = (2 - 0.5 r) / 2``: 0.8, the streaming 0.4. With
    no prefill the decode and its streaming fit (1.5 cores): full speed, half a core. No decode: no streaming."""
    from mooncake_jax.sim.host import rates_with_streaming

    assert rates_with_streaming(2, 2, 1, 1.0, 0.0, 1000.0, 0.0005) == (
        pytest.approx(4 / 7), pytest.approx(4 / 7), pytest.approx(2 / 7))
    assert rates_with_streaming(2, 1, 1, 1.0, 0.0, 1000.0, 0.0005) == (
        pytest.approx(0.8), pytest.approx(0.8), pytest.approx(0.4))
    assert rates_with_streaming(2, 0, 1, 1.0, 0.0, 1000.0, 0.0005) == (1.0, pytest.approx(1.0), pytest.approx(0.5))
    assert rates_with_streaming(2, 2, 0, 1.0, 0.0, 1000.0, 0.0005) == (1.0, 1.0, 0.0)


def test_a_decode_batch_streaming_its_tokens_slows_the_prefills_beside_it():
    """A: prefill 0-2 s, KV pushed 2-3 s, then 200 decode steps of 10 ms (100 tokens a second); each token costs 5 ms
    of CPU off the instances (``decode_stream_cpu_s``): half a core at full speed. B (2 s of work, one token)
    arrives at 3.5 s; two cores.

    Equal weights: A's batch and its streaming alone fit (1.5 cores), so its first 50 steps take 0.5 s; then B, A
    and the streaming share: ``r = (2 - 0.5 r) / 2``, 0.8 (``test_the_streaming_load_follows_the_tokens_the_decode_
    emits``): A's 150 steps left take 12.5 ms each, ending at 5.375 s, by when B has done 1.5 s of its work; alone
    (the streaming gone with the batch), its last 0.5 s end at 5.875 s. Without the streaming the two fit on two
    cores: A ends at 5.0 s, B at 5.5 s.

    B at a niced prefill's weight (1/3): the decode keeps its core and the streaming its half core; B gets the half
    core left until A ends at 5.0 s (0.75 s of its work), then its last 1.25 s at full speed: 6.25 s."""
    trace = Trace([TraceRequest(0.0, 1000, 201, (1, 2)), TraceRequest(3.5, 1000, 1, (3, 4))])
    run = dict(prefill=2, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES, host_cores=2)
    a, b = simulate(trace, **run, decode_stream_cpu_s=0.005).requests
    assert a.finished_at == pytest.approx(5.375, abs=0.013)
    assert b.first_token_at == pytest.approx(5.875, abs=0.013)
    a, b = simulate(trace, **run).requests
    assert (a.finished_at, b.first_token_at) == (pytest.approx(5.0, abs=0.011), pytest.approx(5.5, abs=0.011))
    a, b = simulate(trace, **run, decode_stream_cpu_s=0.005, host_prefill_weight=1 / 3).requests
    assert a.finished_at == pytest.approx(5.0, abs=0.011)
    assert b.first_token_at == pytest.approx(6.25, abs=0.011)


def test_decode_stream_cpu_s_is_checked():
    for bad in (-0.001, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="decode_stream_cpu_s"):
            SimConfig(host_cores=2, decode_stream_cpu_s=bad)
    with pytest.raises(ValueError, match="decode_stream_cpu_s needs host_cores"):
        SimConfig(decode_stream_cpu_s=0.001)


def test_the_prefills_weight_and_the_host_others_are_read_from_the_contention_probe():
    """By hand, two cores, no streaming. A prefill took 1 s alone, 1 s beside another, 2 s beside another and a decode
    batch. Two prefills on two cores slow nothing, so no others; beside the decode a prefill at half speed is what
    every weight up to 1/2 gives (the decode's share of two cores, 2 / (2w + 1), is a whole core or more: it keeps
    one, the two prefills split the other), so the highest, 1/2. At equal weights (1.5 s beside the decode: 2/3 of a
    core each) the weight is 1. (The eighth pass's run ``s8_8`` read 1.14x and 3.11x, which no number of others
    gives at equal weights: one, the bound, gives 2x and 2x.)"""
    from test_accounting import _sim_to_real

    bench = _sim_to_real()
    read = {"contention_compute_s_alone": 1.0, "contention_compute_s_pair": 1.0,
            "contention_compute_s_beside_decode": 2.0}
    host = bench.host_model(2, {})
    assert bench.host_weight_and_others(read, host, 1 / 3) == (pytest.approx(0.5), 0.0)
    assert bench.host_weight_and_others({**read, "contention_compute_s_beside_decode": 1.5}, host, 1 / 3) == (
        1.0, 0.0)
    assert bench.host_weight_and_others({}, host, 1 / 3) == (1.0, 0.0)  # nothing measured: equal weights


def test_the_profile_reading_keeps_the_decode_slowdown_the_host_sharing_does_not_give():
    """By hand, two cores, equal weights: the bursts' decode steps ran 1.4x (1.8x) slower beside a prefill than
    apart. With one other process of the host's, a decode batch alone is two busy (full speed), beside a prefill
    three (2/3: 1.5x), so the simulator's sharing gives 1.5x itself and nothing is left of 1.4x (1.0), 1.2x of
    1.8x; with no others a prefill beside the batch slows it not at all and all 1.4x is left. Left out
    (``decode_residual`` False): 1."""
    from test_accounting import _sim_to_real

    bench = _sim_to_real()
    probed = {"prefill_scale": 1.0, "decode_scale": 1.0, "decode_join_s": 0.01, "shared_host_decode_slowdown": 1.4}
    assert bench.from_profile(SLOW_LINK, {**probed, "host_other_busy": 1.0}, 2)["shared_host_decode_slowdown"] == 1.0
    assert bench.from_profile(SLOW_LINK, {**probed, "host_other_busy": 1.0, "shared_host_decode_slowdown": 1.8},
                              2)["shared_host_decode_slowdown"] == pytest.approx(1.2)
    assert bench.from_profile(SLOW_LINK, probed, 2)["shared_host_decode_slowdown"] == pytest.approx(1.4)
    assert bench.from_profile(SLOW_LINK, {**probed, "decode_residual": False}, 2)["shared_host_decode_slowdown"] == 1.0


def test_a_join_takes_longer_beside_a_bigger_batch():
    """A (1,000 tokens, 200 decode steps of 10 ms) prefills 0-2 s, its KV pushed 2-3 s; B (1,000 tokens, 10 steps)
    arrives at 2.5 s on the other prefill instance: prefill 2.5-4.5 s, KV 4.5-5.5 s. A join takes 0.1 s plus 50 ms
    per request the batch runs when it is booked (``decode_join_per_request_s``): A's, booked at 2 s beside no batch,
    0.1 s (taken in at 3.1 s); B's, booked at 4.5 s beside A, 0.15 s: it waits 0.15 s from its first token (5.5 s)
    to its first decode step (5.65 s, one of A's step boundaries), 0.1 s without the per-request part. Separate
    machines (no host sharing)."""
    trace = Trace([TraceRequest(0.0, 1000, 201, (1, 2)), TraceRequest(2.5, 1000, 11, (3, 4))])
    run = dict(prefill=2, decode=1, hardware=SLOW_LINK, release_timing=REAL_INSTANCES, decode_join_s=0.1)
    a, b = simulate(trace, **run, decode_join_per_request_s=0.05).requests
    assert a.decode_start_at - a.first_token_at == pytest.approx(0.1)
    assert b.first_token_at == pytest.approx(5.5)
    assert b.decode_start_at - b.first_token_at == pytest.approx(0.15, abs=1e-6)
    _, b = simulate(trace, **run).requests
    assert b.decode_start_at - b.first_token_at == pytest.approx(0.1, abs=0.01)
    with pytest.raises(ValueError, match="decode_join_per_request_s"):
        SimConfig(decode_join_per_request_s=-0.01)


def test_the_join_line_is_read_from_the_streaming_probe():
    """By hand: joins of 5, 7, 13 and 21 ms beside batches of 0, 1, 4 and 8 requests lie on 5 ms + 2 ms per request;
    with ``stream_join`` the profile reading takes that line (two cores, no others: the decode alone at full speed;
    the headline keeps the pairs' join). A join read while the decode process had half a core counts half (its CPU
    time). Falling joins give their mean at no growth; one batch size read gives no line."""
    from test_accounting import _sim_to_real

    bench = _sim_to_real()
    joins = {"stream_join_s_b0": 0.005, "stream_join_s_b1": 0.007, "stream_join_s_b4": 0.013,
             "stream_join_s_b8": 0.021}
    assert bench.join_line(joins) == (pytest.approx(0.005), pytest.approx(0.002))
    assert bench.join_line({"stream_join_s_b0": 0.01, "stream_join_s_b4": 0.006}) == (pytest.approx(0.008), 0.0)
    assert bench.join_line({"stream_join_s_b0": 0.01}) is None
    halved = {**joins, "stream_join_s_b8": 0.042, "stream_decode_cores_b8": 0.5}
    assert bench.join_line(halved) == (pytest.approx(0.005), pytest.approx(0.002))
    probed = {"prefill_scale": 1.0, "decode_scale": 1.0, "decode_join_s": 0.03, "stream_join": True, **joins}
    inputs = bench.from_profile(SLOW_LINK, probed, 2)
    assert (inputs["decode_join_s"], inputs["decode_join_per_request_s"]) == (pytest.approx(0.005),
                                                                              pytest.approx(0.002))
    pairs = bench.from_profile(SLOW_LINK, {**probed, "stream_join": False}, 2)
    assert (pairs["decode_join_s"], pairs["decode_join_per_request_s"]) == (pytest.approx(0.03), 0.0)
    # the bursts' join (15 ms, beside two prefills: three busy on two cores, 2/3 speed) is 10 ms of the decode's
    # work alone, which the simulator stretches again where it shares the cores
    bursts = bench.from_profile(SLOW_LINK, {**probed, "stream_join": False, "bursts_join": True,
                                            "decode_join_s_bursts": 0.015}, 2)
    assert bursts["decode_join_s"] == pytest.approx(0.01)
