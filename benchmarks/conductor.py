"""Conductor decision speed: decisions per second and p99 decision latency of kvcache-centric + predictive.

For 16, 64 and 256 prefill instances (as many decode instances, serving LLaMA-2-70B on a mix of hardware: each
instance has its own cost model, cycling through ``HARDWARE_MIX``) and a block index
holding 1e5 or 1e6 blocks, the bundled conversation trace is replayed on its own clock: the first requests warm
the index with the trace's real prefix sharing, random keys held by random instances fill it up to the target
size, then each of the next requests is timed through ``ClusterState.schedule`` (decide + apply: everything the
gRPC service does per request besides the RPC itself). Between requests, and outside the timing, the requests
that the decisions predicted to have started or finished decoding are reported, so the decode ledger holds what
a live cluster would. The machine is shared, so each configuration runs ``--runs`` times and the least
disturbed run (lowest p99) is reported, with the CPU-time rate and p99 that preemption does not inflate.

Where a decision's time goes: ``phases`` (the ``phase_*`` keys) times its parts in this thread's CPU time. At 64 + 64
instances and 1e6 blocks (AMD EPYC, load 3-5, docs/benchmarks/conductor.md, fifth pass), least of repeats: the prefix
match ~1 us, every prefill instance's TTFT ~12 us (one row of features per prefix group, one matrix product), the decode
choice ~17 us (one pass over the ledger for both views, weighted bincounts of the entries' step shares), the rest of
``decide`` ~4 us; ``decide`` once, in sequence, ~45 us (code and data cold after the previous request's apply and
reports, spread over the whole decision), applying it ~14-16 us (~17 new blocks recorded as expected in the index).
Sixth pass (docs/benchmarks/conductor.md): with numba installed the decode choice and the prefill slot's argmin run
compiled (conductor/kernels.py, the same decisions; ``decode_choice_compiled`` says which path ran): decode choice ~3-4
us, prefill TTFT ~9-10, ``decide`` once ~26-27, apply ~15-16; 26,000-28,000 decisions per CPU second at load 7-8.
Seventh pass: the block index as flat hash tables walked by numba (conductor/flat_index.py; ``index_compiled`` says
which index ran, ``--numpy-path`` runs both the policy and the index as without numba): apply ~8-10 us, -18 / -21% CPU a
decision paired, ~30,000-33,000 decisions per CPU second at load 20-24. ``benchmarks/conductor_ab.py`` compares two
source trees on the same decisions in one process. At 128 columns every numpy call costs its fixed ~0.35-2 us, not its
length, so the decision is a fixed number of such calls (``decision_in_numpy_ops`` says how many, in units of the
``numpy_op_us`` measured in the same run). Goal: >= 10,000 decisions/s and p99 <= 1 ms at 64 instances and 1e6 blocks.

    python benchmarks/conductor.py --json /tmp/conductor.json
"""

from __future__ import annotations

import argparse
import gc
import gzip
import heapq
import json
import os
import sys
import time
from importlib import resources
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model, write_json  # noqa: E402

from mooncake_jax.conductor import ClusterState, Policy, PolicyConfig, Request, instance_costs

TRACE_BLOCK = 512
HARDWARE_MIX = ("8xA800", "8xH800", "8xH200")
"""Instance i of each pool uses HARDWARE_MIX[i % 3] (decode pool shifted by one): per-instance cost models."""
GOAL_DECISIONS_PER_S = 10_000
GOAL_P99_MS = 1.0


def load_trace() -> list[dict]:
    """The bundled conversation trace (Mooncake JSONL: timestamp ms, input/output lengths, hash_ids)."""
    path = resources.files("mooncake_jax.sim") / "data" / "conversation_trace.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def as_request(i: int, row: dict) -> Request:
    return Request(f"r{i}", row["hash_ids"], row["input_length"], row["output_length"])


class Replay:
    """A cluster state fed by the trace, with decode milestones reported as the decisions predicted them."""

    def __init__(self, n_instances: int, config: PolicyConfig, compiled: bool = True):
        self.state = ClusterState(config, compiled=compiled)
        self.policy = Policy(config, compiled=compiled)
        costs = [instance_costs(hardware, "llama2-70b") for hardware in HARDWARE_MIX]
        for i in range(n_instances):
            self.state.add_instance(f"p{i}", "prefill", costs[i % len(costs)], 0.0)
        for i in range(n_instances):
            self.state.add_instance(f"d{i}", "decode", costs[(i + 1) % len(costs)], 0.0)
        self.milestones: list[tuple[float, int, str, str]] = []  # (time, order, kind, request id)
        self.accepted = self.transfers = 0

    def report_until(self, now: float) -> None:
        state, heap = self.state, self.milestones
        while heap and heap[0][0] <= now:
            when, _, kind, request_id = heapq.heappop(heap)
            if kind == "start":
                state.decode_started(request_id, when)
            else:
                state.finished(request_id, when)

    def schedule(self, request: Request, now: float):
        return self.record(request, self.state.schedule(self.policy, request, now))

    def record(self, request: Request, decision):
        """Count the decision, and put its predicted decode start and end on the milestone heap."""
        if decision.accepted:
            self.accepted += 1
            self.transfers += decision.transfer is not None
            start = decision.prefill_end_at
            heapq.heappush(self.milestones, (start, len(self.milestones), "start", request.request_id))
            end = start + self.state.decode_time_s
            heapq.heappush(self.milestones, (end, len(self.milestones) + 1, "end", request.request_id))
        return decision

    def fill_index(self, target_blocks: int, seed: int = 0) -> None:
        """Random keys (far above the trace's ids) on random prefill instances until the index holds the target."""
        missing = target_blocks - len(self.state.index)
        if missing <= 0:
            return
        rng = np.random.default_rng(seed)
        keys = rng.integers(1 << 40, 1 << 62, missing, dtype=np.int64)
        slots = rng.integers(0, len(self.state.instances) // 2, missing)
        for slot in range(len(self.state.instances) // 2):
            self.state.index.store(slot, keys[slots == slot].tolist())


def warmed_replay(trace: list[dict], n_instances: int, target_blocks: int, warm: int, compiled: bool = True) -> Replay:
    """A replay of ``n_instances`` prefill + decode instances after ``warm`` trace requests, its block index filled
    to ``target_blocks``: the state every timed decision starts from. ``compiled=False``: the numpy path and the
    dict index, as without numba."""
    config = PolicyConfig(strategy="kvcache-centric", admission="predictive", block_size=TRACE_BLOCK,
                          ttft_slo_s=30.0, tbt_slo_s=0.1)
    replay = Replay(n_instances, config, compiled)
    for i in range(warm):
        now = trace[i]["timestamp"] / 1000
        replay.report_until(now)
        replay.schedule(as_request(i, trace[i]), now)
    replay.fill_index(target_blocks)
    return replay


def measure(trace: list[dict], n_instances: int, target_blocks: int, warm: int, timed: int,
            compiled: bool = True) -> dict:
    """One run: warm, fill, then time ``timed`` decisions (wall clock, and CPU time of this thread)."""
    replay = warmed_replay(trace, n_instances, target_blocks, warm, compiled)
    blocks_at_start = len(replay.state.index)
    requests = [(trace[i]["timestamp"] / 1000, as_request(i, trace[i])) for i in range(warm, warm + timed)]
    replay.accepted = replay.transfers = 0
    wall, cpu = np.empty(timed), np.empty(timed)
    gc.collect()
    wall_clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    state, policy = replay.state, replay.policy
    for k, (now, request) in enumerate(requests):
        replay.report_until(now)
        t0, c0 = wall_clock(), cpu_clock()
        decision = state.schedule(policy, request, now)  # what the service does per request, the RPC aside
        cpu[k], wall[k] = cpu_clock() - c0, wall_clock() - t0
        replay.record(request, decision)
    wall, cpu = wall / 1e9, cpu / 1e9
    return {
        "decisions_per_s": timed / wall.sum(),
        "decisions_per_cpu_s": timed / cpu.sum(),  # this thread's CPU time: what preemption does not inflate
        "p50_decision_ms": float(np.percentile(wall, 50) * 1e3),
        "p99_decision_ms": float(np.percentile(wall, 99) * 1e3),
        "p99_decision_cpu_ms": float(np.percentile(cpu, 99) * 1e3),
        "indexed_blocks": blocks_at_start,
        "indexed_blocks_at_end": len(replay.state.index),
        "accepted_fraction": replay.accepted / timed,
        "transfer_fraction": replay.transfers / timed,
    }


def phases(trace: list[dict], n_instances: int, target_blocks: int, warm: int, sample: int = 300,
           compiled: bool = True) -> dict:
    """Where a decision's time goes, in microseconds of this thread's CPU time per request (what other processes'
    load inflates least), on the state reached after warming and filling.

    First ``sample`` requests are scheduled as the timed loop does, deciding and applying each once, both timed
    (``decide_once``, ``apply``: applying records the request's blocks as expected in the 10^6-key index, whose
    cache misses only a live sequence shows). Then, ``Policy.decide`` being pure, each of the next ``sample``
    requests is decided repeatedly (least of 3 repeats of 20) and so are its parts: the prefix match over the block
    index, the prefill choice (TTFT of every prefill instance; the match included, subtracted below), the decode
    choice (decode ledger views, TBT of every decode instance, admission's view); what is left of ``decide`` is
    checks and building the decision."""
    import timeit

    from mooncake_jax.conductor.instances import Role

    replay = warmed_replay(trace, n_instances, target_blocks, warm, compiled)
    state, policy = replay.state, replay.policy
    clock = time.thread_time

    once = {"decide_once": 0.0, "apply": 0.0}
    gc.collect()
    for i in range(warm, warm + sample):
        now, request = trace[i]["timestamp"] / 1000, as_request(i, trace[i])
        replay.report_until(now)
        c0 = time.thread_time_ns()
        decision = policy.decide(request, state.snapshot(), now)
        c1 = time.thread_time_ns()
        state.apply(request, decision, now, fresh=True)
        c2 = time.thread_time_ns()
        replay.record(request, decision)
        once["decide_once"] += (c1 - c0) / 1e3
        once["apply"] += (c2 - c1) / 1e3

    def cpu_us(call) -> float:
        return min(timeit.repeat(call, number=20, repeat=3, timer=clock)) / 20 * 1e6

    pure = dict.fromkeys(("match", "prefill", "decode", "decide"), 0.0)
    for i in range(warm + sample, warm + 2 * sample):
        now, request = trace[i]["timestamp"] / 1000, as_request(i, trace[i])
        replay.report_until(now)
        snapshot = state.snapshot()
        prefill_ok = snapshot.instances.candidates(Role.PREFILL)
        decode_ok = snapshot.instances.candidates(Role.DECODE)
        end = now + policy._choose_prefill(request, snapshot, now, prefill_ok).ttft_s
        pure["match"] += cpu_us(lambda: state.index.match_levels(request.block_keys))
        pure["prefill"] += cpu_us(lambda: policy._choose_prefill(request, snapshot, now, prefill_ok))
        pure["decode"] += cpu_us(lambda: policy._choose_decode(request, snapshot, now, end, decode_ok))
        pure["decide"] += cpu_us(lambda: policy.decide(request, snapshot, now))
    once = {name: value / sample for name, value in once.items()}
    pure = {name: value / sample for name, value in pure.items()}
    return {"phase_match_us": pure["match"], "phase_prefill_ttft_us": pure["prefill"] - pure["match"],
            "phase_decode_us": pure["decode"],
            "phase_decide_rest_us": pure["decide"] - pure["prefill"] - pure["decode"],
            "phase_decide_repeated_us": pure["decide"], "phase_decide_once_us": once["decide_once"],
            "phase_apply_us": once["apply"], "phase_sample_requests": sample}


def numpy_op_us(slots: int = 128) -> float:
    """Fixed cost of one small numpy operation on this machine, now (the unit a decision is made of: the policy
    evaluates every instance in a fixed number of array operations over ``slots`` columns)."""
    x, y = np.random.default_rng(0).random((2, slots))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(20_000):
            np.add(x, y)
        best = min(best, time.perf_counter() - t)
    return best / 20_000 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here as a flat JSON object")
    parser.add_argument("--warm", type=int, default=4000, help="trace requests that warm the index")
    parser.add_argument("--timed", type=int, default=5000, help="trace requests timed per configuration")
    parser.add_argument("--instances", type=lambda t: [int(v) for v in t.split(",")], default=[16, 64, 256],
                        help="prefill (= decode) instance counts, comma-separated (the headline figure needs 64)")
    parser.add_argument("--blocks", type=lambda t: [int(float(v)) for v in t.split(",")], default=[100_000, 1_000_000],
                        help="block index sizes, comma-separated (the headline figure needs 1e6)")
    parser.add_argument("--runs", type=int, default=3,
                        help="runs per configuration; the least disturbed (lowest p99) is reported")
    parser.add_argument("--numpy-path", dest="compiled", action="store_false",
                        help="decide on the numpy path with the dict block index, as where numba is not installed")
    parser.add_argument("--no-phases", dest="phases", action="store_false",
                        help="skip the per-phase breakdown of a decision (64 + 64 instances, the largest index)")
    args = parser.parse_args()
    trace = load_trace()
    if args.warm + args.timed > len(trace):
        parser.error(f"--warm + --timed must be at most the trace's {len(trace)} requests")
    results: dict = {"policy": "kvcache-centric+predictive", "hardware": "+".join(HARDWARE_MIX) + "/llama2-70b",
                     "cpu_model": cpu_model(),
                     # whether the decode choice and the prefill argmin ran compiled (numba: conductor/kernels.py)
                     "decode_choice_compiled": Policy(PolicyConfig(), args.compiled)._decode_kernel is not None,
                     # whether the block index was the compiled flat table (numba: conductor/flat_index.py)
                     "index_compiled": type(ClusterState(compiled=args.compiled).index).__name__ == "FlatBlockIndex",
                     "trace_requests_timed": args.timed, "runs_per_configuration": args.runs,
                     "load_average_at_start": os.getloadavg()[0], "cpus": os.cpu_count(),
                     "goal_decisions_per_s": GOAL_DECISIONS_PER_S, "goal_p99_decision_ms": GOAL_P99_MS}
    for n_instances in args.instances:
        for target in args.blocks:
            runs = [measure(trace, n_instances, target, args.warm, args.timed, args.compiled) for _ in range(args.runs)]
            figures = min(runs, key=lambda run: run["p99_decision_ms"])
            tag = f"p{n_instances}_b{target:.0e}".replace("+0", "")
            for name, value in figures.items():
                results[f"{name}_{tag}"] = value
            print(f"{n_instances:4d} prefill instances, {figures['indexed_blocks']:>9,} blocks: "
                  f"{figures['decisions_per_s']:>9,.0f} decisions/s, p50 {figures['p50_decision_ms']:.3f} ms, "
                  f"p99 {figures['p99_decision_ms']:.3f} ms, accepted {figures['accepted_fraction']:.1%}, "
                  f"with a transfer {figures['transfer_fraction']:.1%}",
                  flush=True)
    if args.phases and 64 in args.instances:
        figures = phases(trace, 64, max(args.blocks), args.warm, compiled=args.compiled)
        results.update({f"{name}_p64": value for name, value in figures.items()})
        print("where a decision's time goes (64 + 64 instances, CPU us): "
              + ", ".join(f"{name[6:-3]} {value:.1f}" for name, value in figures.items() if name.endswith("_us")))
    results["load_average_at_end"] = os.getloadavg()[0]
    results["numpy_op_us"] = numpy_op_us()
    if "decisions_per_s_p64_b1e6" in results:
        results["decision_in_numpy_ops_p64_b1e6"] = 1e6 / results["decisions_per_s_p64_b1e6"] / results["numpy_op_us"]
    results["decisions_per_s"] = results.get("decisions_per_s_p64_b1e6")
    results["p99_decision_ms"] = results.get("p99_decision_ms_p64_b1e6")
    results["meets_goal"] = (results["decisions_per_s"] is not None
                             and bool(results["decisions_per_s"] >= GOAL_DECISIONS_PER_S
                                      and results["p99_decision_ms"] <= GOAL_P99_MS))
    write_json(results, args.json)


if __name__ == "__main__":
    main()
