"""Conductor decision time, two source trees in one process: which is faster, on the same decisions.

On a shared 2-core host, ``benchmarks/conductor.py`` run once per tree measures the load of the minute as much as
the code: its decision rates moved by 30-50% between alternating runs of the same tree. Here both trees are
imported side by side (each tree's ``mooncake_jax`` and ``benchmarks/conductor.py``), warmed and filled the same
way (64 + 64 instances, 10^6 blocks), then fed the same trace requests in interleaved batches of 100 (the tree
going first alternates), so both see the same load; every decision's CPU time (this thread's: ``schedule`` =
decide + apply) is recorded, and the two trees' decisions are compared (same instances, transfer and outcome,
predicted times to 1e-9 relative).

    git archive <commit> | tar -x -C /tmp/before
    python benchmarks/conductor_ab.py /tmp/before . --json /tmp/ab.json
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_model, write_json  # noqa: E402


def load_tree(root: Path):
    """``benchmarks/conductor.py`` of the tree at ``root``, with that tree's ``mooncake_jax`` (modules of a tree
    loaded before stay alive through the objects that use them)."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("mooncake_jax", "conductor", "common")]:
        del sys.modules[name]
    sys.path[:0] = [str(root), str(root / "benchmarks")]
    try:
        return importlib.import_module("conductor")
    finally:
        del sys.path[:2]


def same(x, y) -> bool:
    """Two trees' decisions agree (their enums are distinct classes: compared by value)."""
    def close(a, b):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a))
    return (getattr(x.reason, "value", None) == getattr(y.reason, "value", None) and x.prefill == y.prefill
            and x.decode == y.decode and (x.transfer is None) == (y.transfer is None)
            and close(x.predicted_ttft_s, y.predicted_ttft_s) and close(x.predicted_tbt_s, y.predicted_tbt_s)
            and close(x.prefill_end_at, y.prefill_end_at))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path, help="root of the first tree (e.g. a git archive of the old commit)")
    parser.add_argument("after", type=Path, help="root of the second tree")
    parser.add_argument("--requests", type=int, default=5000, help="trace requests timed (after 4,000 warming)")
    parser.add_argument("--json", type=Path, help="write the results here as a flat JSON object")
    args = parser.parse_args()
    load_avg_start = os.getloadavg()[0]
    trees = {"before": load_tree(args.before.resolve()), "after": load_tree(args.after.resolve())}
    trace = trees["before"].load_trace()
    warm = 4000
    replays = {tag: bench.warmed_replay(trace, 64, 1_000_000, warm) for tag, bench in trees.items()}
    cpu_ns: dict[str, list[int]] = {tag: [] for tag in trees}
    identical = 0
    gc.collect()
    clock = time.thread_time_ns
    for first in range(warm, warm + args.requests, 100):
        batch = range(first, min(first + 100, warm + args.requests))
        order = ("before", "after") if (first // 100) % 2 == 0 else ("after", "before")
        decisions = {}
        for tag in order:
            bench, replay = trees[tag], replays[tag]
            decisions[tag] = []
            for i in batch:
                now, request = trace[i]["timestamp"] / 1000, bench.as_request(i, trace[i])
                replay.report_until(now)
                c0 = clock()
                decision = replay.state.schedule(replay.policy, request, now)
                cpu_ns[tag].append(clock() - c0)
                replay.record(request, decision)
                decisions[tag].append(decision)
        identical += sum(same(x, y) for x, y in zip(decisions["before"], decisions["after"]))
    results = {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "instances": 64, "indexed_blocks": 1_000_000,
               "requests": args.requests, "identical_decisions": identical,
               "load_average_at_start": load_avg_start, "load_average_at_end": os.getloadavg()[0]}
    for tag, samples in cpu_ns.items():
        us = np.array(samples) / 1e3
        results[f"{tag}_mean_cpu_us"] = float(us.mean())
        results[f"{tag}_median_cpu_us"] = float(np.median(us))
        results[f"{tag}_decisions_per_cpu_s"] = float(1e6 / us.mean())
    results["median_change"] = results["after_median_cpu_us"] / results["before_median_cpu_us"] - 1
    # each request is decided by both trees a few milliseconds apart: the median of the per-request ratios is less
    # moved by the load than the ratio of the two medians
    ratios = np.array(cpu_ns["after"]) / np.array(cpu_ns["before"])
    results["paired_median_change"] = float(np.median(ratios) - 1)
    write_json(results, args.json)


if __name__ == "__main__":
    main()
