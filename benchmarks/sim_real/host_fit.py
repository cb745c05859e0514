"""The simulator's shared host fitted to the sim-to-real probes: ``host_model`` (cores, the prefills' weight, the
host's other processes, the CPU a streamed token costs), the speeds it gives (``host_rates``) and the fits of the
contention probe's slowdowns (``host_other_busy``, ``host_weight_and_others``); the decode join's line over the
batch (``join_line``) and the start-up profile as the probes scale it (``profiled_costs``). Pure functions of what
was measured: the tests drive them with hand-worked readings."""

from __future__ import annotations

import math

import numpy as np

from mooncake_jax.conductor.costs import DecodeCost, PrefillCost
from mooncake_jax.sim.host import PAIR_REFERENCE_TOKENS, paired_rate, rates_with_streaming

STREAM_CONTEXT_TOKENS = 64  # each request's KV tokens when reading a batch's step for its streaming (the probes')
CONTENTION_REGIMES = {"pair": (2, 0), "beside_decode": (2, 1)}  # busy (prefills, decoding) beside the lone one's (1, 0)


def host_model(cores: int, probed: dict, others: float | None = None, costs=None) -> dict:
    """The simulator's host as the readings describe it (what ``host_rates`` shares by): ``cores``, the prefill
    processes' weight (``host_prefill_weight``: their CFS weight where the cluster runs them niced, 1 where not
    read), the host's other processes (``others``, default the probed ``host_other_busy``), the CPU a streamed
    token costs off the instances (``stream_cpu_s_per_token``) and, for the tokens a batch streams a second, the
    decode step (``costs``' decode model as ``profiled_costs`` scales it with the probed decode readings; without
    ``costs`` no streaming is counted)."""
    step = None
    if costs is not None and "decode_scale" in probed:
        step = profiled_costs(costs, {"prefill_scale": 1.0, **probed}).decode.step_seconds
    return {"cores": cores, "weight": probed.get("host_prefill_weight", 1.0),
            "others": probed.get("host_other_busy", 0.0) if others is None else others,
            "cpu_per_token": probed.get("stream_cpu_s_per_token", 0.0) if step is not None else 0.0,
            "step": step, "pair_exponent": probed.get("host_pair_exponent", 0.0)}



def host_rates(host: dict, prefills: int, batch: int, tokens: int | None = None) -> tuple[float, float]:
    """(prefill speed, decode speed) the simulator gives ``prefills`` computing beside a decode instance running
    ``batch`` requests (0: idle) on ``host`` (``host_model``): ``host.rates_with_streaming`` with the tokens that
    batch streams a second at its modelled step (each request's context taken as ``STREAM_CONTEXT_TOKENS``); with
    ``tokens`` (the prefill's new tokens), its speed beside another prefill as its length makes it
    (``host.paired_rate``, the host's ``pair_exponent``)."""
    tokens_per_s = 0.0
    if batch and host["cpu_per_token"]:
        tokens_per_s = batch / float(host["step"](batch, batch * STREAM_CONTEXT_TOKENS))
    prefill, decode = rates_with_streaming(host["cores"], prefills, int(batch > 0), host["weight"], host["others"],
                                           tokens_per_s, host["cpu_per_token"])[:2]
    if tokens is not None:
        prefill = paired_rate(prefill, tokens, host.get("pair_exponent", 0.0), prefills)
    return prefill, decode


def pair_length_exponent(read: dict) -> float | None:
    """The exponent of a prefill's slowdown beside another over its length (``SimConfig.host_pair_length_exponent``)
    from the contention probe's pairs and lone prefills at each length (``contention_compute_s_{alone,pair}_{n}``;
    at 512 tokens ``contention_compute_s_{alone,pair}``): the least-squares slope, through 512 tokens, of
    ``log(pair_n / alone_n) - log(pair_512 / alone_512)`` over ``log(n / 512)`` for the lengths above 512 (the
    simulator gives shorter ones the 512-token slowdown, ``host.pair_length_factor``), within -1 to 1. None where
    no longer length was read."""
    ratios = {}
    for key, value in read.items():
        if key.startswith("contention_compute_s_pair_") and value:
            n = int(key.rsplit("_", 1)[1])
            if n <= PAIR_REFERENCE_TOKENS:
                continue
            alone = read.get(f"contention_compute_s_alone_{n}")
            if alone:
                ratios[n] = value / alone
    base_pair, base_alone = read.get("contention_compute_s_pair"), read.get("contention_compute_s_alone")
    if not ratios or not base_pair or not base_alone:
        return None
    x = np.log(np.array(sorted(ratios), float) / PAIR_REFERENCE_TOKENS)
    y = np.log([ratios[n] for n in sorted(ratios)]) - math.log(base_pair / base_alone)
    if not np.any(x):
        return None
    return float(np.clip((x @ y) / (x @ x), -1.0, 1.0))



def host_other_busy(read: dict, host: dict) -> float:
    """The host's other runnable processes (``SimConfig.host_other_busy``) under which the simulator's sharing
    (``host_rates`` on ``host``: its cores, the prefills' weight, the streaming a decode batch brings) slows a
    prefill as the contention probe measured: the number (0 to ``cores - 1``, in hundredths) whose predicted
    slowdowns of two prefills, and of two beside a decode batch of one request, over one alone are nearest the
    measured ones (least squares in log). 0 where nothing was measured. Past ``cores - 1`` others the lone prefill
    is slowed too and the predicted ratios fall again (four others on two cores: 1.2x and 1.4x), so the smallest
    number that fits is the one in that range."""
    alone = read.get("contention_compute_s_alone")
    measured = {k: read[f"contention_compute_s_{k}"] / alone for k in CONTENTION_REGIMES
                if alone and read.get(f"contention_compute_s_{k}")}
    if not measured:
        return 0.0

    def miss(others: float) -> float:
        at = {**host, "others": others}
        lone = host_rates(at, 1, 0)[0]
        return sum((math.log(ratio) - math.log(lone / host_rates(at, *CONTENTION_REGIMES[k])[0])) ** 2
                   for k, ratio in measured.items())

    top = 100 * max(0, host["cores"] - 1)
    return min(np.arange(0, top + 1) / 100, key=lambda others: (miss(float(others)), others)).item()



def contention_miss(read: dict, host: dict) -> float:
    """How far ``host``'s predicted slowdowns of the contention probe's regimes are from the measured ones (sum of
    squared log ratios; 0 where nothing was measured)."""
    alone = read.get("contention_compute_s_alone")
    lone = host_rates(host, 1, 0)[0]
    return sum((math.log(read[f"contention_compute_s_{k}"] / alone) - math.log(lone / host_rates(host, *n)[0])) ** 2
               for k, n in CONTENTION_REGIMES.items() if alone and read.get(f"contention_compute_s_{k}"))



def host_weight_and_others(read: dict, host: dict, lowest: float) -> tuple[float, float]:
    """The prefill processes' effective weight (``lowest`` to 1 in twentieths) and the host's others
    (``host_other_busy`` under it) that put the contention probe's two slowdowns nearest the measured ones, the
    highest weight among equals (1 where nothing was measured).

    Why fitted and not the prefills' CFS weight (0.33 at nice 5): the two regimes disagree with any one weight. A
    prefill beside a decode batch of one ran 2.3-3.1x slower than alone where two prefills ran 1.0-1.25x (runs
    ``s8_5``, ``s8_8``, ``s8_headline_1``, ``s8_quiet_1``): at equal weights no number of others gives both (the
    others bound, 1, put the decode at half speed beside two prefills and the TBT 42-156% high); at 0.33 the decode
    keeps its core beside them, and the replays' decode steps and joins ran slower beside prefills than alone
    (TBT 15-34% low in four of seven runs). The scheduler's weights are not the whole of it (wake-up latency,
    threads of each process beyond the engine's), so the weight is read as the probe measures it."""
    if not read.get("contention_compute_s_alone"):
        return 1.0, host["others"]
    best = None
    for weight in np.unique(np.r_[lowest, np.arange(math.ceil(lowest * 20), 21) / 20]):
        at = {**host, "weight": float(weight)}
        others = host_other_busy(read, at)
        miss = contention_miss(read, {**at, "others": others})
        if best is None or miss <= best[0] + 1e-12:
            best = (miss, at["weight"], others)
    return best[1], best[2]



def join_line(probed: dict) -> tuple[float, float] | None:
    """The decode instance's time to take a request in against the requests its batch runs, from the streaming
    probe's joins (``stream_join_s_b{n}``, ``stream_load``): ``(at no batch, per request)``, the least-squares line
    through them (per request at least 0; where the line falls, their mean at 0 per request), each join counted at
    the share of a core the decode process had then (``stream_decode_cores_b{n}``: its CPU time, the host's other
    load of that moment taken out; in ``s9_2`` it had 0.4 of a core beside four and eight requests, 0.9 in
    ``s9_1``). None with fewer than two batch sizes read.

    Why: the replays' first token gaps (the join, then a step) grew with the batch the request joined (eighth pass:
    13-14 ms joining no batch, 16-20 ms joining one or two requests), and the probe's joins with it (5.4 ms beside no
    batch, 12 ms beside four, 24 ms beside eight, ``s9_1``): the decode process sends every running request's tokens
    on the interpreter that takes the new one in. The pairs' join (``probe``, a batch of one or two) is one point
    of that line."""
    points = sorted((int(k.rsplit("_b", 1)[1]), v * min(1.0, probed.get(f"stream_decode_cores_b{k.rsplit('_b', 1)[1]}",
                                                                          1.0)))
                    for k, v in probed.items()
                    if k.startswith("stream_join_s_b") and v is not None and math.isfinite(v))
    if len({n for n, _ in points}) < 2:
        return None
    x, y = np.array(points, float).T
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:
        return max(0.0, float(y.mean())), 0.0
    return max(0.0, float(intercept)), float(slope)



def profiled_costs(costs, overheads: dict):
    """The start-up profile as the probes measured the cluster now: prefill scaled (or refitted, ``prefill_coef``)
    and decode scaled, and each token's delivery to the client added per request in the batch to every decode step
    (the step model's batch term)."""
    prefill = overheads.get("prefill_coef") or [c * overheads["prefill_scale"] for c in costs.prefill.coef]
    return costs.replace(prefill=PrefillCost(prefill, costs.prefill.chunk_buckets),
                         decode=DecodeCost(tuple(np.array(costs.decode.coef) * overheads["decode_scale"]
                                                 + (0.0, overheads.get("decode_token_delivery_s", 0.0), 0.0))))
