"""The simulator's inputs read from what the sim-to-real run measured: the prefill engine in the probes' pairs and
bursts (``engine_in_pairs``, ``engine_in_bursts``), the decode side in the bursts (``decode_in_bursts``), the
replay's own window (``replay_window``), the Conductor's order of decisions (``decided_at``, ``arrival_order``), and
the profile reading from before the replay (``from_profile``, with the host model's variants: ``host_variant``).
Nothing here talks to a cluster."""

from __future__ import annotations

import math

import numpy as np

from mooncake_jax.conductor.accounting import prefill_work_s, reused_tokens
from mooncake_jax.conductor.costs import fit_prefill_poly, prefill_seconds

from .host_fit import (host_model, host_other_busy, host_rates, host_weight_and_others, join_line,
                       pair_length_exponent)

SPREAD_QUANTILES = 20  # quantiles of the steady decode gaps over their regime's mean (``decode_step_spread``)
SHARE_SAMPLES = 40  # points per reported compute interval at which engine_in_bursts reads the host's sharing
SLICE_S = 12.0  # the replay's slices over which the prefill's speed is read again (four of the trace's bursts)


def engine_in_pairs(reported, costs) -> dict:
    """The prefill engine as the pairs' own instances reported it (before the replay, no fit to it): each request's
    ``compute_s`` against the start-up profile's prediction for the tokens it computed, as the line ``compute =
    engine_fixed + engine_scale * profile`` through each prompt length's median (one preempted pair does not move a
    median). The profile times the engine's prefill alone at start-up; served, a prefill also pays a fixed cost on
    the engine loop (the job's hand-off, sampling, copying the new blocks to the host for the store: a short prompt
    ran 5-7x its profiled time in the replays, a long one 2-4x) and the machine's speed now. Two prefills at once
    on two cores (a pair) is one busy process per core: with ``SimConfig.host_cores`` the simulator stretches this
    reading only where more than that run. ``off_engine_s``: the median of TTFT less the decision, queue and
    compute (the prefill RPC, staging, storing and pushing the KV, the reply), the replay window's reading on the
    pairs."""
    if len(reported) < 4:
        return {}
    by_length: dict = {}
    for n, cached, compute, _ in reported:
        by_length.setdefault(n, []).append((prefill_work_s(costs.prefill, n, reused_tokens(n, cached)), compute))
    points = np.array([np.median(np.array(v), axis=0) for _, v in sorted(by_length.items())])
    fixed, scale = 0.0, float(points[:, 1].sum() / points[:, 0].sum())
    if len(points) >= 2:
        (fixed, slope), *_ = np.linalg.lstsq(np.stack([np.ones(len(points)), points[:, 0]], 1), points[:, 1],
                                            rcond=None)
        if slope > 0 and fixed >= 0:
            scale = float(slope)
        else:
            fixed = 0.0
    return {"engine_fixed_s": float(fixed), "engine_scale": scale,
            "off_engine_s": max(0.0, float(np.median([r[3] for r in reported]))),
            "engine_probe_requests": len(reported)}



def engine_in_bursts(engine, runs, costs, host: dict, prefill_instances: int = 2) -> dict:
    """The prefill engine's speed alone, read from the bursts' reported compute (``bursts``: the replay's regime,
    two prefills beside a decode batch streaming tokens to many clients) with the sharing the simulator would have
    given them divided out: each request's compute is re-timed as the work the simulator's host (``host_rates`` on
    ``host``, ``host_model``: cores, weights, the host's others, the decode batch's streaming) would have done over
    that interval, given the prefills computing then (every burst request's reported compute interval, at most
    ``prefill_instances``) and the decode batch then (the requests between their first and last token); then
    ``work = engine_fixed +
    engine_scale * profile`` (least squares in relative error; the ratio of the sums where that line is not
    increasing or has a negative intercept); and ``engine_coef_bursts``: the start-up calibration's polynomial
    (``fit_prefill_poly``: relative error, coefficients >= 0) fitted to the same work over the tokens each request
    computed, scaled so that the median request's work over it is 1 (least squares in relative error sits below
    noisy times: it put the bursts' median request at 0.66-0.93x its own work in eight of nine recorded runs of the
    seventh and eighth passes, 0.24x in ``s7_3``), which the profile reading takes. Why the polynomial: the
    start-up profile times prompts of at most 512 tokens (prefixes of at most 256), the trace slice's reach 3,770;
    the profile's shape times one scale misses how the engine's time grows beyond them (two quiet runs of the
    seventh pass: no line read, ``engine_fixed_s_bursts`` 0; its fallback, the ratio of the sums, weighed by the
    longest prompts, put the median prompts' engine time at 1.7-1.9x the replay's, their queues' median 34-41 ms
    longer, TTFT p50 29-34% high).
    Why the sharing divided out: the replays' engine ran 1.8-3x what the pairs' line (``engine_in_pairs``: two
    prefills, no decode batch) predicted at every prompt length in the sixth pass's runs
    ``s6_5``-``s6_7``, where sharing the cores between the instances stretches it at most 1.5x; what else a burst
    costs the engine (streaming its tokens to the clients in Python threads on the same cores) is then in this
    reading, as it is in the replay. (Seventh pass: the bursts' median ratio to the profile came within 2-21% of
    the replay's in four runs of six, their longest prompts 1.6-4.6x faster than the replay's,
    ``docs/benchmarks/sim.md``.)"""
    if len(engine) < 4:
        return {}
    prefilling = [(begin, begin + compute) for _, _, begin, compute in engine]
    decoding = [(times[0], times[-1]) for _, _, times in runs if len(times) > 1]
    points = []
    for n, cached, begin, compute in engine:
        if compute <= 0:
            continue
        rates = []
        reused = reused_tokens(n, cached)
        for t in begin + compute * (np.arange(SHARE_SAMPLES) + 0.5) / SHARE_SAMPLES:
            busy = min(prefill_instances, max(1, sum(a <= t < b for a, b in prefilling)))
            rates.append(host_rates(host, busy, sum(a <= t < b for a, b in decoding), n - reused)[0])
        points.append((prefill_work_s(costs.prefill, n, reused), compute * float(np.mean(rates)),
                       float(np.mean(rates)), reused + costs.prefill.computed_tokens(n - reused), reused))
    if len(points) < 4:
        return {}
    p = np.array(points)
    scale, fixed = float(p[:, 1].sum() / p[:, 0].sum()), 0.0
    (f, k), *_ = np.linalg.lstsq(np.stack([1 / p[:, 1], p[:, 0] / p[:, 1]], 1), np.ones(len(p)), rcond=None)
    if k > 0 and f >= 0:
        fixed, scale = float(f), float(k)
    read = {"engine_scale_bursts": scale, "engine_fixed_s_bursts": fixed, "engine_bursts_requests": len(p),
            "engine_bursts_share": float(p[:, 2].mean())}
    try:  # the work's own shape over the trace's lengths, by the start-up calibration's fitter (``engine_coef_bursts``)
        coef = np.array(fit_prefill_poly(p[:, [3, 4, 1]]).coef)
    except ValueError:  # no polynomial to fit: the line alone
        return read
    level = float(np.median(p[:, 1] / prefill_seconds(coef, p[:, 3], p[:, 4])))  # its median request's work, read
    read["engine_coef_bursts"] = [float(c) * level for c in coef]
    return read



def decode_in_bursts(runs, costs) -> dict:
    """The decode instance in the replay's regime (``bursts``), as the client sees it.

    Every token gap after a request's first (its join) is classed by what happened during it, from the client-side
    token times of all the probe's requests: another request joined (its first decode token ended the gap), else
    someone else's KV was being staged (between its first token and its first decode token: left out, the
    simulator has no such state), else some request was being prefilled (between its submission and its first
    token), else neither. A gap apart from all that is ``scale * profile step(batch, context) + delivery * batch``
    (least squares over those gaps, batch and context as running then):

    - ``decode_scale``: how much slower the engine steps than at start-up (the clock's step is the mean one);
    - ``decode_token_delivery_s``: per request in the batch and step, the time a token takes from the decode
      instance to the client (a gRPC message per token per request, through the gateway's backend, in Python on
      the same two cores): the start-up profile times the engine alone, whose step barely grows with the batch
      (the tiny model), while the gaps the client sees grow by about a millisecond per request;
    - ``shared_host_decode_slowdown``: the mean gap beside a prefill over that model's gap;
    - ``decode_join_stall_s``: the median excess of the join gaps over their regime's gap;
    - ``decode_join_s_bursts``: the median time the decode instance took to take a request in, one after another
      (reported, not simulated: it agrees with the same reading of the replays' own token times, 12-19 ms, but the
      simulator given it queues the replay's joins longer than the real cluster did, TBT p50 40-67% high in three
      of four recorded runs; the pairs' ``decode_join_s`` put it within 4-37%, ``docs/benchmarks/sim.md``);
    - ``decode_step_spread``: quantiles of every steady gap over its regime's mean (how unevenly the OS hands the
      shared cores out, and tokens reaching the client bunched).

    Why not the pairs of ``probe``: their batch (2) and their overlap with prefill (little) gave a slowdown of 1.16
    where the same reading of a replay's own gaps (load 1.8-5.8) gave 1.58, and their one batch size folds the
    per-request delivery into the step's scale (``docs/benchmarks/sim.md``)."""
    runs = [r for r in runs if len(r[2]) > 2]
    prefilling = [(start, times[0]) for start, _, times in runs]
    joining = [(times[0], times[1]) for _, _, times in runs]  # its KV staged, then loaded into pages
    gaps = {"apart": [], "beside": [], "join": []}  # (gap, profile step, batch)
    for start, _, times in runs:
        for k in range(1, len(times) - 1):
            a, b = times[k], times[k + 1]
            mid = (a + b) / 2
            running = [(n, t) for _, n, t in runs if t[1] - 1e-6 <= mid <= t[-1]]
            context = sum(n + int(np.searchsorted(t, mid)) for n, t in running)
            batch = max(1, len(running))
            gap = (b - a, float(costs.decode.step_seconds(batch, context)), batch)
            beside = any(s < b and f > a for s, f in prefilling)
            others = [(s, f) for s, f in joining if f != times[1]]
            if any(a < f <= b + 1e-4 for _, f in others):
                gaps["join"].append(gap + (beside,))
            elif not any(s < b and f > a for s, f in others):
                gaps["beside" if beside else "apart"].append(gap)
    if len(gaps["apart"]) < 2:
        return {}
    apart = np.array(gaps["apart"])
    (scale, delivery), *_ = np.linalg.lstsq(apart[:, 1:3], apart[:, 0], rcond=None)
    if delivery < 0 or scale <= 0:  # no growth with the batch beyond the profile's: the scale alone
        scale, delivery = float(apart[:, 0].sum() / apart[:, 1].sum()), 0.0

    def model(rows) -> np.ndarray:
        rows = np.asarray(rows, float).reshape(-1, 3)
        return scale * rows[:, 1] + delivery * rows[:, 2]

    beside = np.array(gaps["beside"]).reshape(-1, 3)
    slowdown = max(1.0, float(beside[:, 0].mean() / model(beside).mean())) if len(beside) else 1.0
    stalls = [g - (slowdown if by_prefill else 1.0) * float(model((g, step, n))[0])
              for g, step, n, by_prefill in gaps["join"]]
    steady = np.concatenate([apart[:, 0] / model(apart), beside[:, 0] / (slowdown * model(beside))])
    spread = np.quantile(steady, (np.arange(SPREAD_QUANTILES) + 0.5) / SPREAD_QUANTILES)
    # joins one at a time (as the simulator takes them): each ends at the request's first decode token, so a
    # request's join took from its first token (its KV there) or the previous join's end, whichever is later, to
    # that token, less the step that made it
    served, previous = [], -math.inf
    for first, decoded in sorted(joining):
        served.append(decoded - max(first, previous))
        previous = max(previous, decoded)
    step = float(np.median(np.concatenate([apart[:, 0], beside[:, 0]])))
    return {"decode_scale": float(scale), "decode_token_delivery_s": float(delivery),
            "decode_join_s_bursts": max(0.0, float(np.median(served)) - step),
            "shared_host_decode_slowdown": slowdown,
            "decode_join_stall_s": max(0.0, float(np.median(stalls))) if stalls else 0.0,
            "decode_step_spread": [float(f) for f in spread],
            **{f"decode_probe_{k}_gaps": len(v) for k, v in gaps.items()}}



def replay_window(items, records, costs, slice_s: float = SLICE_S) -> dict:
    """The simulator's inputs measured over the replay itself, from what every request's prefill instance reported
    and the token times its client saw: the same minutes as the real figures they are compared with (a probe run
    before the replay reads the shared host at another minute: the real TTFT p90 moved 0.41-0.67 s over three quiet
    runs of the same code while the probe-calibrated simulation held at 0.33-0.35 s).

    - ``prefill_coef``: the prefill cost model refitted to the engine's reported compute (``compute_s``) of every
      replayed request over the tokens it computed (its cached prefix as the instance reported it, chunks padded to
      their buckets as ``prefill_work_s`` counts them), by the start-up calibration's own fitter
      (``fit_prefill_poly``: relative error, coefficients >= 0). Not the start-up profile times one scale: on a
      loaded host the long prompts ran 8x the profile and the short ones 2-5x (run ``s5_1``), and one scale fitted
      to the engines' total time made every short request of a burst as slow as the longest's share, the queues
      behind them too long (TTFT p50 / p90 56% / 42% high); with fewer than four requests, the profile scaled by
      the ratio of the sums (``prefill_scale``, reported either way);
    - ``prefill_off_engine_s``: the median of each request's TTFT less the Conductor's decision (the simulator's
      arrival, ``arrival_order``) and its reported queue and compute (the prefill RPC, staging its prefix, storing
      and pushing its KV, the reply: off the engine, it holds no instance);
    - ``prefill_slowdown_steps``: the engines' speed over each ``slice_s`` of the replay (by submission time), the
      slice's reported compute over the refitted model's: the model keeps the shape, each slice its own level
      (the host's other load changes by the minute; in run ``s5_2`` a load spike put one 3 s burst at 9.9x);
    - ``decode_join_s``: the median excess of a request's first token gap over its later ones' median;
    - the rest of the decode side as ``decode_in_bursts`` reads it, on the replay's own token times (same classes,
      same fit), the step spread included (read in the same minutes as the real TBT it is compared with);
    - the queue is not fed in: ``prefill_queue_s_p50`` / ``_p90`` are reported beside the simulated queue.
    """
    done = [(it, r) for it, r in zip(items, records) if r is not None]
    if len(done) < 2:
        raise ValueError(f"replay_window needs at least 2 completed requests, got {len(done)}")
    points = []
    for (_, prompt, _, _), r in done:
        reused = reused_tokens(len(prompt), r["cached_tokens"])
        points.append((reused + costs.prefill.computed_tokens(len(prompt) - reused), reused, r["compute_s"]))
    predicted = np.array([float(costs.prefill.seconds(n, p)) for n, p, _ in points])
    compute = np.array([t for _, _, t in points])
    read = {"prefill_scale": float(compute.sum() / predicted.sum()), "request_overhead_s": 0.0}
    measured = [pt for pt in points if pt[2] > 0]
    model = predicted * read["prefill_scale"]
    if len(measured) >= 4:
        read["prefill_coef"] = [float(c) for c in fit_prefill_poly(measured).coef]
        model = np.array([float(prefill_seconds(read["prefill_coef"], n, p)) for n, p, _ in points])
    submitted = np.array([r["submitted"] for _, r in done])
    steps = []
    for k in range(int(submitted.max() // slice_s) + 1):
        in_slice = (submitted >= k * slice_s) & (submitted < (k + 1) * slice_s)
        if in_slice.any() and model[in_slice].sum() > 0:
            steps.append((k * slice_s, float(compute[in_slice].sum() / model[in_slice].sum())))
    read["prefill_slowdown_steps"] = steps
    # the decode instance's join: the first token gap's excess over the request's own steady gaps (the pairs'
    # reading, ``probe``), here over the replay's requests, in its regime (their batches, their prefills beside)
    excess = [float(np.diff(r["times"])[0] - np.median(np.diff(r["times"])[1:])) for _, r in done
              if len(r["times"]) > 2]
    if excess:
        read["decode_join_s"] = max(0.0, float(np.median(excess)))
    off_engine = [r["times"][0] - r.get("decided_s", 0.0) - r["queue_s"] - r["compute_s"] for _, r in done]
    queue = [r["queue_s"] for _, r in done]
    runs = [(r["submitted"], len(it[1]), r["submitted"] + np.array(r["times"])) for it, r in done]
    return {**read, "prefill_off_engine_s": max(0.0, float(np.median(off_engine))),
            "prefill_queue_s_p50": float(np.percentile(queue, 50)),
            "prefill_queue_s_p90": float(np.percentile(queue, 90)),
            **decode_in_bursts(runs, costs)}



def decided_at(items, records, speed: float = 1.0) -> list[float]:
    """When the Conductor decided on each replayed request (seconds from the replay's start: its submission plus
    the time until the backend had the decision; a failed request keeps its time in the replay, trace time over
    ``speed``), in the order the Conductor
    made its decisions (``decision_seq``: a time out of that order, its reply slower to reach its client thread, is
    moved to a nanosecond after the previous decision's): the simulator's arrivals, whose Conductor decides at
    arrival. Within a burst neither the trace's order nor the submissions' nor the replies' is the Conductor's: the
    requests share one trace time, their client threads wake in the order the OS picks, each hashes its prompt's
    blocks before asking, and the replies reach 64 client threads on two loaded cores (run ``s5_5``: by the replies'
    times the burst at 33 s had its short requests decided before its two long ones, while the real instances ran
    the long ones at once and queued all the short ones behind one of them)."""
    at = [r["submitted"] + r.get("decided_s", 0.0) if r is not None else it[0] / speed for it, r in zip(items, records)]
    ranked = sorted((r["decision_seq"], i) for i, r in enumerate(records) if r is not None and r.get("decision_seq"))
    previous = -math.inf
    for _, i in ranked:
        at[i] = previous = max(at[i], previous + 1e-9)
    return at



def arrival_order(items, records, speed: float = 1.0) -> tuple[list[int], dict]:
    """The order of the Conductor's decisions (``decided_at``) and how it differs from the trace's and from the
    submissions'."""
    at = decided_at(items, records, speed)
    order = sorted(range(len(items)), key=lambda i: (at[i], i))
    submitted = sorted(range(len(items)),
                       key=lambda i: (records[i]["submitted"] if records[i] else items[i][0] / speed, i))
    late = [r["submitted"] - it[0] / speed for it, r in zip(items, records) if r is not None]
    decided = [r.get("decided_s", 0.0) for r in records if r is not None]
    return order, {"arrival_order_moved": sum(int(i != k) for k, i in enumerate(order)),
                   "arrival_order_moved_from_submissions": sum(int(i != k) for i, k in zip(order, submitted)),
                   "submission_late_s_p50": float(np.median(late)) if late else 0.0,
                   "submission_late_s_max": float(max(late)) if late else 0.0,
                   "decided_s_p50": float(np.median(decided)) if decided else 0.0,
                   "decided_s_max": float(max(decided)) if decided else 0.0}



def from_profile(costs, probed: dict, cores: int, others: float | None = None) -> dict:
    """The simulator's inputs from what was measured before the replay only:

    - the prefill engine: the bursts' work refitted by the calibration's polynomial (``engine_coef_bursts``, the
      sharing divided out, ``engine_in_bursts``); without it the start-up profile (each instance's engine alone)
      times ``engine_scale`` plus ``engine_fixed_s`` per request, from the bursts' line where read, else the pairs'
      reported engine compute (``engine_in_pairs``);
    - the time off the engine from the bursts' requests (``off_engine_s_bursts``; the pairs' where none), and before
      it their time to the Conductor's decision (``decided_s_bursts``: the simulated requests arrive at the trace's
      times and the simulator's Conductor decides at once, where the gateway hashes the prompt's blocks and asks the
      Conductor, 6-11 ms at the median on a quiet host, 100 ms in a loaded replay, ``s7_1``): replayed
      requests took 30-40 ms at every prompt and output length on the quiet host (``s5_seq_*``), pairs 15-27 ms in
      the sixth pass's less loaded runs and the bursts 37-54 ms: RPCs and copies in Python threads of every process
      on the same cores, for which a burst's requests queue;
    - the pairs' decode join (``probe``: taken in with no prefill beside it; the bursts' joins ran beside two
      prefills, where the simulator stretches the pairs' reading itself) and the bursts' decode (``decode_in_bursts``:
      step scale and per-request delivery from the gaps with no prefill beside them, the stall at a join, the spread);
    - the host's core count, over which the simulator shares the cores between its busy instances
      (``SimConfig.host_cores``) in place of the bursts' measured decode slowdown beside a prefill, every busy
      process weighing the same. (The sixth pass's ``_profile_weighted``, each prefill at its lower priority's
      Linux weight, ~0.33, kept the decode at full speed beside two prefills where the replays' steps ran 1.3-1.7x
      slower beside one; its TBT came out further in most runs, ``docs/benchmarks/sim.md``: dropped.)
    - the host's other runnable processes (``host_other_busy``, from the contention probe: ``contention``), which
      take their share of the cores beside the instances (``SimConfig.host_other_busy``); every reading above is
      then divided by the speed the simulator gives its regime under them (the pairs' engine: two prefills busy;
      the decode step, delivery and join: the decode instance alone), so the simulator's sharing is not counted
      twice (``others=0``: as before).

    Nothing here is read from the replay."""
    host = host_model(cores, probed, others, costs)
    in_pairs = host_rates(host, 2, 0)[0]  # the pairs' engine ran at this share of a core
    decoding_alone = host_rates(host, 0, 2)[1]  # and their decode, a batch of two
    scale = probed.get("engine_scale", probed["prefill_scale"]) * in_pairs
    fixed = probed.get("engine_fixed_s", 0.0) * in_pairs
    if "engine_scale_bursts" in probed:  # the bursts' engine, read with these others' sharing divided out
        scale, fixed = probed["engine_scale_bursts"], probed["engine_fixed_s_bursts"]
    coef = [costs.prefill.coef[0] * scale + fixed] + [c * scale for c in costs.prefill.coef[1:]]
    if "engine_coef_bursts" in probed:  # its own shape over the trace's lengths, fitted to the same work
        coef = list(probed["engine_coef_bursts"])
    join = probed["decode_join_s"] * decoding_alone  # the pairs': no prefill beside (the bursts' ran 3 busy)
    per_request = 0.0
    line = join_line(probed) if probed.get("stream_join", False) else None
    if line is not None:  # the joins beside each batch the streaming probe ran: growing with the batch
        join, per_request = line[0] * decoding_alone, line[1] * decoding_alone
    if probed.get("bursts_join", False) and probed.get("decode_join_s_bursts"):
        # the bursts' joins, one after another beside two prefills: the sharing the simulator gives that divided out
        join = probed["decode_join_s_bursts"] * host_rates(host, 2, 2)[1]
    # the bursts' decode beside a prefill over apart, less what the host's sharing gives it (a prefill beside a batch)
    residual = 1.0
    if probed.get("decode_residual", True):
        residual = max(1.0, probed.get("shared_host_decode_slowdown", 1.0) * host_rates(host, 1, 2)[1]
                       / host_rates(host, 0, 2)[1])
    return {"prefill_coef": coef,
            "prefill_scale": scale, "request_overhead_s": 0.0,
            "prefill_off_engine_s": probed.get("off_engine_s_bursts", probed.get("off_engine_s", 0.0))
            + probed.get("decided_s_bursts", 0.0),
            "decode_scale": probed["decode_scale"] * decoding_alone,
            "decode_token_delivery_s": probed.get("decode_token_delivery_s", 0.0) * decoding_alone,
            "decode_join_s": join, "decode_join_stall_s": min(probed.get("decode_join_stall_s", 0.0), join),
            "decode_join_per_request_s": per_request,
            "shared_host_decode_slowdown": residual,
            "decode_step_spread": list(probed.get("decode_step_spread", ())),
            "host_cores": cores, "host_prefill_weight": host["weight"], "host_other_busy": host["others"],
            "host_pair_length_exponent": host["pair_exponent"],
            "decode_stream_cpu_s": host["cpu_per_token"]}



HOST_VARIANTS = {"_profile_equal_weights": {"host_prefill_weight": 1.0},
                 "_profile_cfs_weight": {"host_prefill_weight": "cfs"},
                 "_profile_no_streaming": {"stream_cpu_s_per_token": 0.0},
                 "_profile_no_residual": {"decode_residual": False},
                 "_profile_join_line": {"stream_join": True},
                 "_profile_bursts_join": {"bursts_join": True},
                 "_profile_no_length": {"host_pair_exponent": 0.0},
                 "_profile_s8_host": {"host_prefill_weight": 1.0, "stream_cpu_s_per_token": 0.0,
                                      "decode_residual": False}}
"""The profile reading with parts of the host model changed (each refitted: others, the bursts' engine): equal
weights for prefill and decode processes; the prefills' CFS weight at nice 5 (not fitted); no streaming load; no
residual decode slowdown beside a prefill (``decode_residual``); the join growing with the batch as the streaming
probe read it (``stream_join``, ``join_line``; the headline keeps the pairs' join); a prefill's slowdown beside
another the same at every length (``_profile_no_length``: the twelfth pass's host); the eighth pass's (equal
weights, no streaming, no residual)."""



def host_variant(probed: dict, costs, burst_engine, burst_runs, cores: int, prefill: int, **changes) -> dict:
    """The probed readings with ``changes`` to the host model (``host_prefill_weight``, ``stream_cpu_s_per_token``),
    the host's others and the bursts' engine read again under it (``host_other_busy``, ``engine_in_bursts``): what
    the profile reading would have been with that host model. A prefill's slowdown beside another over its length
    (``host_pair_exponent``) is fitted here from the contention probe's lengths where the run read them
    (``pair_length_exponent``), so a re-simulated run gets this code's fit."""
    varied = {k: v for k, v in probed.items() if not (k.startswith("engine_") and k.endswith("_bursts"))}
    exponent = pair_length_exponent(varied)  # a prefill's slowdown beside another over its length, where read
    if exponent is not None:
        varied["host_pair_exponent"] = exponent
    varied.update(changes)
    if varied.get("host_prefill_weight") == "cfs":  # the prefills' CFS weight as it is
        varied["host_prefill_weight"] = varied.get("host_prefill_cfs_weight", 1.0)
    if "host_prefill_weight" in changes:  # that weight: the others under it
        varied["host_other_busy"] = host_other_busy(varied, host_model(cores, varied, 0.0, costs))
    else:  # both read from the contention probe, the weight at least the prefills' CFS weight
        varied["host_prefill_weight"], varied["host_other_busy"] = host_weight_and_others(
            varied, host_model(cores, varied, 0.0, costs), varied.get("host_prefill_cfs_weight", 1.0))
    varied.update(engine_in_bursts(burst_engine, burst_runs, costs, host_model(cores, varied, costs=costs), prefill))
    return varied
