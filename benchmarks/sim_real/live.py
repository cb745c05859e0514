"""What the sim-to-real run measures on the live cluster: the probes before the replay (``probe``: pairs;
``contention``: prefills alone, paired, beside a decode batch; ``stream_load``: the CPU a decode batch's streaming
costs; ``bursts``: the replay's regime), the processes' CPU (``cpu_used``), and the replay itself (``replay``)."""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mooncake_jax.conductor.accounting import prefill_work_s

from .readings import engine_in_pairs

PROBE_PROMPT_TOKENS, PROBE_OUTPUT_TOKENS, PROBES = (64, 256, 512, 1024), 16, 3
BURST, BURST_ROUNDS, BURST_LONG_TOKENS = 8, 6, 200
CONTENTION_TOKENS, CONTENTION_ROUNDS = 512, 5
CONTENTION_LENGTHS, CONTENTION_LENGTH_ROUNDS = (256, 1024, 2048), 3
LONG_BESIDE_SHORT = (2048, 256)  # a long prefill while the other prefill instance runs short ones back to back
STREAM_BATCHES, STREAM_TOKENS, STREAM_WINDOW_S, STREAM_IDLE_S, STREAM_JOINS = (1, 4, 8), 400, 0.5, 1.0, 3


def trace_slice(n: int, vocab_size: int, max_context: int):
    """The first ``n`` trace requests as the demo replays them: (arrival s, prompt token ids, max tokens,
    engine-block ids)."""
    from mooncake_jax.demo import workload

    return [(w["at"], w["prompt"], w["max_tokens"], w["blocks"]) for w in workload(n, vocab_size, max_context)]



def token_times(cluster, prompt, max_tokens: int) -> list[float]:
    """Seconds from submission to each token of one request (the backend's own clock)."""
    return served(cluster, prompt, max_tokens)[0]



def served(cluster, prompt, max_tokens: int):
    """One request's token times (seconds from submission, the backend's clock) and its ``Finished`` (what its
    prefill instance reported; None if the stream ended without it)."""
    from mooncake_jax.gateway.backend import Finished, TokenOut

    times, done = [], None
    for item in cluster.stream(prompt, max_new_tokens=max_tokens):
        if isinstance(item, TokenOut):
            times.append(item.time_s)
        elif isinstance(item, Finished):
            done = item
    return times, done



def probe(cluster, costs, vocab_size: int) -> dict:
    """The serving path measured end to end, right before the replay, by requests of fresh prompts (not in the
    trace), sent in concurrent pairs: the start-up profile gives how times grow with tokens and batch; the probe
    gives how fast this shared machine runs them now (``prefill_scale``, ``decode_scale``), the fixed cost of a
    request beyond its prefill (``request_overhead_s``: RPCs, scheduling, pool I/O) and the decode instance's
    time to take a request in (``decode_join_s``: its RPC, staging the KV from its pool, loading it into pages).

    Why pairs: the trace's requests arrive in bursts, so in the replay the two prefill instances mostly compute at
    the same time, and decode steps a batch, all on the host's two cores; a lone probe request has the cores to
    itself (on the quiet host, lone probes made the simulated TTFT half the real one). A pair puts the instances in
    the replay's regime: the Conductor sends the two to the two prefill instances, then both decode together.

    Prefill: TTFT = overhead + scale * predicted prefill, fitted over a few prompt lengths. Decode, from each
    probe's token gaps: the steady step is the median of the gaps after the first (``decode_scale``: over the
    profile's step for the pair's batch; ``decode_in_bursts`` measures it again at the replay's batch sizes, this
    one is its fallback); the first gap is the join plus one step, so its excess over the steady step is
    ``decode_join_s`` (the smaller of a pair's: the other waited for its join). (The TBT statistic of a 16-token
    request, the mean of its longest 10% of gaps, is mostly its first gap: scaling every step by it charged the
    join to every token.)
    """
    rng = np.random.default_rng(12345)
    token_times(cluster, rng.integers(0, vocab_size, 32).tolist(), 4)  # warms connections and queues
    predicted, measured, decode_ratio, join, reported = [], [], [], [], []
    with ThreadPoolExecutor(2) as pool:
        for _ in range(PROBES):
            for n in PROBE_PROMPT_TOKENS:
                prompts = [rng.integers(0, vocab_size, n).tolist() for _ in range(2)]
                pair = list(pool.map(lambda prompt: served(cluster, prompt, PROBE_OUTPUT_TOKENS), prompts))
                excess = []
                for times, done in pair:
                    if done is not None:
                        reported.append((n, done.cached_tokens, done.prefill_compute_s,
                                         times[0] - done.decided_s - done.prefill_queue_s - done.prefill_compute_s))
                    predicted.append(prefill_work_s(costs.prefill, n, 0))
                    measured.append(times[0])
                    gaps = np.diff(times)
                    steady = float(np.median(gaps[1:]))
                    step = np.mean([float(costs.decode.step_seconds(2, 2 * (n + k))) for k in range(2, len(times))])
                    decode_ratio.append(steady / step)
                    excess.append(float(gaps[0]) - steady)
                # the two reach the decode instance together and it takes them in one at a time (as the simulator
                # does): the later one's first gap holds the other's join too, the earlier one's is the join alone
                join.append(min(excess))
    # the line through each prompt length's median TTFT: one pair slowed by the host's other load moves a
    # least-squares fit over all probes (prefill_scale read 0.15 to 5.3 between runs at load 10-25), a median not
    lengths = sorted(set(predicted))
    medians = [float(np.median([m for p, m in zip(predicted, measured) if p == x])) for x in lengths]
    a = np.stack([np.ones(len(lengths)), lengths], axis=1)
    (overhead, scale), *_ = np.linalg.lstsq(a, np.array(medians), rcond=None)
    if scale <= 0:  # no growth with length measured: all overhead
        overhead, scale = float(np.median(np.array(measured) - np.array(predicted))), 1.0
    return {"request_overhead_s": max(0.0, float(overhead)), "prefill_scale": float(scale),
            "decode_scale": max(1e-3, float(np.median(decode_ratio))),
            "decode_join_s": max(0.0, float(np.median(join))), **engine_in_pairs(reported, costs)}



def contention(cluster, vocab_size: int, rounds: int = CONTENTION_ROUNDS, lengths: bool = True) -> dict:
    """How the prefill engine slows as more of the cluster's processes run at once on this host, before the replay:
    fresh ``CONTENTION_TOKENS``-token prompts (no cached prefix, one output token: no decode), their engine compute
    as their instances reported it, in three regimes per round: one alone, two at once (one per prefill instance),
    and two at once while a long request decodes (both prefill instances and the decode instance busy, as in the
    replay's bursts). Returns each regime's median compute (``contention_compute_s_{alone,pair,beside_decode}``);
    ``host_other_busy`` reads the host's other load from their ratios. With ``lengths``, then the same alone and
    paired at each of ``CONTENTION_LENGTHS`` (``contention_compute_s_{alone,pair}_{n}``: ``pair_length_exponent``
    fits the host's ``host_pair_exponent`` from them), and a 2,048-token prompt while the other prefill instance
    computes 256-token ones back to back (``contention_compute_s_long_beside_short``: whether the long one's
    slowdown is its own length's, whatever the other computes). The two of a pair go to the two instances (the
    Conductor's least predicted TTFT), as the replay's overlapping prefills do.

    Why: equal sharing of the host's cores between the instances alone (``SimConfig.host_cores``) slows a prefill
    at most 1.5x beside another prefill and a decode batch on two cores; the replays' overlapping prefills ran
    1.2-2x their lone ones, and decode steps beside one prefill 1.3-1.7x, where two busy on two cores is no
    slowdown at all: the host's other work, and each process's threads off the engine, take cores too."""
    from mooncake_jax.gateway.backend import Finished

    rng = np.random.default_rng(13579)

    def compute(max_tokens: int = 1, signal=None, tokens: int = CONTENTION_TOKENS) -> float | None:
        prompt = rng.integers(0, vocab_size, tokens if signal is None else 32).tolist()
        tokens, reported = 0, None
        for item in cluster.stream(prompt, max_new_tokens=max_tokens):
            if isinstance(item, Finished):
                reported = item.prefill_compute_s
            else:
                tokens += 1
                if signal is not None and tokens == 2:
                    signal.set()
        if signal is not None:
            signal.set()
        return reported

    read = {"alone": [], "pair": [], "beside_decode": []}
    with ThreadPoolExecutor(3) as pool:
        for _ in range(rounds):
            read["alone"].append(compute())
            read["pair"] += list(pool.map(lambda _: compute(), range(2)))
            decoding = threading.Event()
            long = pool.submit(compute, BURST_LONG_TOKENS, decoding)
            decoding.wait(60)
            read["beside_decode"] += list(pool.map(lambda _: compute(), range(2)))
            long.result()
        for n in CONTENTION_LENGTHS if lengths else ():  # the pairs' slowdown over the prompt's length
            read[f"alone_{n}"], read[f"pair_{n}"] = [], []
            for _ in range(CONTENTION_LENGTH_ROUNDS):
                read[f"alone_{n}"].append(compute(tokens=n))
                read[f"pair_{n}"] += list(pool.map(lambda _: compute(tokens=n), range(2)))
        if lengths:
            long_n, short_n = LONG_BESIDE_SHORT
            read["long_beside_short"] = []
            for _ in range(CONTENTION_LENGTH_ROUNDS):
                done = threading.Event()
                long = pool.submit(lambda: (compute(tokens=long_n), done.set())[0])

                def shorts():
                    while not done.is_set():
                        compute(tokens=short_n)
                short = pool.submit(shorts)
                read["long_beside_short"].append(long.result())
                short.result()
    return {f"contention_compute_s_{k}": float(np.median([t for t in v if t])) for k, v in read.items()
            if any(v)}



def process_ids(cluster) -> dict[str, int]:
    """The cluster's processes by role: ``launcher`` (this one: the gateway's backend and the clients), and where
    they run as processes of their own the ``conductor`` and each instance (by instance id)."""
    pids = {"launcher": os.getpid()}
    conductor = getattr(cluster.conductor, "proc", None)
    if conductor is not None:
        pids["conductor"] = conductor.pid
    for instance_id, instance in cluster.instances.items():
        if getattr(instance, "proc", None) is not None:
            pids[instance_id] = instance.proc.pid
    return pids



def cpu_seconds(pid: int, waited: bool = False) -> float:
    """CPU time process ``pid`` has run, all its threads (Linux ``schedstat``, nanoseconds; 0 where not readable:
    its threads that ended no longer count, so read it over windows in which none end); ``waited``: the time its
    threads were runnable but waited for a core instead."""
    total = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[int(waited)])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9



def cpu_used(pids: dict[str, int]) -> dict[str, float]:
    """Every process's CPU seconds so far (``cpu_seconds``) and, as ``<name>_waited``, its time waiting for a core."""
    return {**{k: cpu_seconds(p) for k, p in pids.items()}, **{f"{k}_waited": cpu_seconds(p, True)
                                                                 for k, p in pids.items()}}



def stream_load(cluster, vocab_size: int, batches=STREAM_BATCHES) -> dict:
    """What a decode batch costs the host off the instances' processes, before the replay: decode batches of
    ``batches`` requests (fresh 32-token prompts, ``STREAM_TOKENS`` output tokens each, nothing prefilling once all
    have joined), and over a window in which all decode, the CPU time of every process of the cluster beside the
    instances (the launcher: the gateway's backend and the clients' threads; the Conductor) and of the decode
    instance, and the tokens the clients received. ``stream_cpu_s_per_token``: the CPU beside the instances per token
    received (their sum over every window over the tokens' sum, each process's idle rate, read first, taken off).
    ``stream_decode_cores_b{n}``, ``stream_beside_cores_b{n}``, ``stream_tokens_per_s_b{n}``,
    ``stream_decode_waited_b{n}`` (the decode process's time waiting for a core, per second): per batch, for the
    record; and after each window (and before the first batch, ``b0``), ``STREAM_JOINS`` short requests joining the
    running batch one after another (``join``: how the decode instance's time to take a request in grows with the
    batch it streams for). {} where the instances do not run as processes of their own (their CPU is the
    launcher's then).

    Why: a prefill beside a decode batch of one request ran 2.7-3.1x slower than alone in every quiet run of the
    seventh and eighth passes, more than any constant number of other processes gives on two cores; the load that
    comes with a decode batch is its tokens' way to the clients, which grows with the tokens it streams."""
    from mooncake_jax.gateway.backend import TokenOut

    pids = process_ids(cluster)
    decode_ids = [c.instance_id for c in cluster.configs if c.role == "decode" and c.instance_id in pids]
    beside = [k for k in pids if k in ("launcher", "conductor")]
    if not decode_ids or len(pids) < 3:
        return {}
    rng = np.random.default_rng(97531)

    def snapshot() -> tuple[float, dict]:
        return time.perf_counter(), cpu_used(pids)

    t0, c0 = snapshot()
    time.sleep(STREAM_IDLE_S)
    t1, c1 = snapshot()
    idle = {k: (c1[k] - c0[k]) / (t1 - t0) for k in pids}
    read = {f"stream_idle_cores_{k}": v for k, v in idle.items()}
    cpu, tokens = 0.0, 0

    def join(n: int, ended: threading.Event | None = None) -> None:
        """Requests joining a batch of ``n`` (one after another, while it still runs): their first token gap
        (``stream_join_gap_s_b{n}``) and its excess over their later gaps (``stream_join_s_b{n}``), medians."""
        gaps = []
        for _ in range(STREAM_JOINS):
            if ended is not None and ended.is_set():
                break
            times = np.diff(token_times(cluster, rng.integers(0, vocab_size, 32).tolist(), 6))
            if len(times) > 2:
                gaps.append((times[0], times[0] - float(np.median(times[1:]))))
        if gaps:
            read[f"stream_join_gap_s_b{n}"], read[f"stream_join_s_b{n}"] = map(float, np.median(gaps, axis=0))

    join(0)
    with ThreadPoolExecutor(max(batches)) as pool:
        for n in batches:
            received, joined, ended = [], [threading.Event() for _ in range(n)], threading.Event()

            def run(signal):
                count = 0
                for item in cluster.stream(rng.integers(0, vocab_size, 32).tolist(), max_new_tokens=STREAM_TOKENS):
                    if isinstance(item, TokenOut):
                        received.append(time.perf_counter())
                        count += 1
                        if count == 2:
                            signal.set()
                signal.set()
                ended.set()

            futures = [pool.submit(run, e) for e in joined]
            for e in joined:
                e.wait(60)
            start, before = snapshot()
            ended.wait(STREAM_WINDOW_S)  # the window ends when the first of the batch does, at the latest
            end, after = snapshot()
            join(n, ended)
            [f.result() for f in futures]
            wall = end - start
            count = sum(start <= t < end for t in received)
            used = {k: (after[k] - before[k]) / wall - idle[k] for k in pids}
            if count == 0:
                continue
            cpu += sum(used[k] for k in beside) * wall
            tokens += count
            read[f"stream_beside_cores_b{n}"] = sum(used[k] for k in beside)
            read[f"stream_decode_cores_b{n}"] = sum(used[k] for k in decode_ids)
            read[f"stream_tokens_per_s_b{n}"] = count / wall
            read[f"stream_decode_waited_b{n}"] = sum(after[f"{k}_waited"] - before[f"{k}_waited"]
                                                     for k in decode_ids) / wall
    if tokens:
        read["stream_cpu_s_per_token"] = max(0.0, cpu / tokens)
    return read



def bursts(cluster, items, vocab_size: int) -> tuple[list[tuple[float, int, np.ndarray]], list[float], list[tuple],
                                                     list[float]]:
    """The replay's regime, by fresh prompts (not the trace's) shaped like the slice's: a long request decodes while
    a burst of ``BURST`` requests arrives at once (prompt and output lengths drawn from the slice's decoding
    requests), as the trace's bursts do; so the decode batch reaches the sizes the replay reaches, the two prefill
    instances compute side by side and beside it on the same cores, and the burst's requests join it one after
    another. ``BURST_ROUNDS`` rounds; per request (submitted, prompt tokens, token times), one clock; and each
    request's time off its prefill engine (TTFT less the decision, queue and compute its instance reported: the
    burst's RPCs, staging and pushes contend on the same cores as the replay's do); and each request's engine
    compute as its instance reported it (prompt tokens, cached tokens, when its compute started on the runs' clock
    (submission, decision and queue), compute seconds: ``engine_in_bursts``)."""
    from mooncake_jax.gateway.backend import Finished, TokenOut

    rng = np.random.default_rng(24680)
    decoding = [it for it in items if it[2] > 1]
    runs, off_engine, engine, decided = [], [], [], []
    for _ in range(BURST_ROUNDS):
        started = threading.Event()

        def run(prompt, max_tokens, signal=None):
            start, times = time.perf_counter(), []
            for item in cluster.stream(prompt, max_new_tokens=max_tokens):
                if isinstance(item, TokenOut):
                    times.append(start + item.time_s)
                    if signal is not None and len(times) == 2:
                        signal.set()
                elif isinstance(item, Finished) and times:
                    off_engine.append(times[0] - start - item.decided_s - item.prefill_queue_s
                                      - item.prefill_compute_s)
                    engine.append((len(prompt), item.cached_tokens, start + item.decided_s + item.prefill_queue_s,
                                   item.prefill_compute_s))
                    decided.append(item.decided_s)
            if signal is not None:
                signal.set()
            return start, len(prompt), np.array(times)

        picks = [decoding[i] for i in rng.integers(0, len(decoding), BURST)]
        with ThreadPoolExecutor(BURST + 1) as pool:
            futures = [pool.submit(run, rng.integers(0, vocab_size, 32).tolist(), BURST_LONG_TOKENS, started)]
            started.wait(60)
            futures += [pool.submit(run, rng.integers(0, vocab_size, len(prompt)).tolist(), max_tokens)
                        for _, prompt, max_tokens, _ in picks]
            runs += [f.result() for f in futures]
    return runs, off_engine, engine, decided



def replay(cluster, items, speed: float) -> list[dict | None]:
    """Every request at its arrival time; for each (None when it failed): ``submitted`` (seconds from the replay's
    start to its submission to the gateway's backend: the thread's actual wake-up, not the trace's time),
    ``decided_s`` (from submission to the Conductor's decision, as the backend got it), ``decision_seq`` (its
    place in the Conductor's order of decisions), ``times`` (its token times, seconds from
    submission) and what its prefill instance reported: ``cached_tokens``, ``queue_s`` (waiting for the engine)
    and ``compute_s`` (the engine's prefill)."""
    from mooncake_jax.gateway.backend import Finished, TokenOut

    results: list = [None] * len(items)
    start = time.perf_counter()

    def one(i: int) -> None:
        at, prompt, max_tokens, _ = items[i]
        delay = at / speed - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)
        submitted, times, done = time.perf_counter() - start, [], None
        try:
            for item in cluster.stream(prompt, max_new_tokens=max_tokens):
                if isinstance(item, TokenOut):
                    times.append(item.time_s)
                elif isinstance(item, Finished):
                    done = item
        except Exception as e:  # noqa: BLE001  (reported, not fatal: the comparison skips it)
            print(f"request {i} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return
        if times and done is not None:
            results[i] = {"submitted": submitted, "decided_s": done.decided_s, "decision_seq": done.decision_seq,
                          "times": times,
                          "cached_tokens": done.cached_tokens, "queue_s": done.prefill_queue_s,
                          "compute_s": done.prefill_compute_s}

    with ThreadPoolExecutor(64) as pool:
        list(pool.map(one, range(len(items))))
    return results
