"""Experiment 4: prefill/decode ratio on 16 nodes, and disaggregated against coupled at equal node count.

Effective request capacity: the highest arrival rate (the conversation trace replayed faster or slower) at which
at least 90% of all requests complete within TTFT 10 s and TBT 100 ms (FAST'25's P/D experiment SLOs), found by
bisection on the speed factor. No admission control, so the figure measures the cluster, not a rejection
policy. The paper finds the best split near 1:1.

Both LLaMA-2-70B (grouped-query attention: decode is cheap, so prefill-heavy splits should win) and LLaMA-65B
(multi-head attention: 8x the KV per token, so decode needs as many nodes as prefill) are swept, since which
split is best follows from the model's prefill/decode cost balance; the coupled baseline (16 vLLM-like nodes,
with and without chunked prefill) is measured the same way for each.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from mooncake_jax.sim.experiments.common import (MHA_MODEL, PAPER_MODEL, PAPER_NODE, capacity_search, runs,
                                                 save_figure, write_json)
from mooncake_jax.sim.trace import load_trace

NODES = 16
PREFILL_SPLITS = (4, 6, 7, 8, 9, 10, 12, 14, 15)
MODELS = (PAPER_MODEL, MHA_MODEL)
SLO = {"ttft_slo_s": 10.0, "tbt_slo_s": 0.1}
TARGET = 0.9
SPEED_RANGE = (0.125, 4.0)
BISECTION_STEPS = 6
PAPER = {"best_ratio": "near 1:1 (FAST'25, TTFT 10 s / TBT 100 ms)"}


def effective_capacity(sim, **cluster) -> dict:
    """Highest speed factor with SLO attainment >= TARGET (bisection in log space), and the runs it took."""
    found = capacity_search(sim, TARGET, SPEED_RANGE, BISECTION_STEPS, **SLO, **cluster)
    del found["summary"]
    return found


def run(out_dir: Path, first: int | None = None, progress: bool = True) -> dict:
    trace = load_trace("conversation", first=first)
    base_rate = len(trace) / max(trace.duration_s, 1e-9)
    per_search = BISECTION_STEPS + 2
    total = len(MODELS) * (len(PREFILL_SPLITS) + 2) * per_search
    results: dict = {m: {"disaggregated": {}, "coupled": {}} for m in MODELS}
    with runs("pd-ratio", total, first, progress) as sim:
        for model in MODELS:
            for prefill in PREFILL_SPLITS:
                found = effective_capacity(sim, prefill=prefill, decode=NODES - prefill, hardware=PAPER_NODE,
                                           model=model)
                found["capacity_rps"] = found["speed"] * base_rate
                results[model]["disaggregated"][f"{prefill}:{NODES - prefill}"] = found
            for chunked in (False, True):
                found = effective_capacity(sim, prefill=NODES, decode=0, architecture="coupled",
                                           chunked_prefill=chunked, hardware=PAPER_NODE, model=model)
                found["capacity_rps"] = found["speed"] * base_rate
                results[model]["coupled"]["chunked" if chunked else "unchunked"] = found
    best = {}
    for model in MODELS:
        split = max(results[model]["disaggregated"].items(), key=lambda kv: kv[1]["capacity_rps"])
        coupled = max(v["capacity_rps"] for v in results[model]["coupled"].values())
        best[model] = {"best_split": split[0], "capacity_rps": split[1]["capacity_rps"],
                       "best_coupled_rps": coupled,
                       "disaggregated_vs_coupled_pct": 100 * (split[1]["capacity_rps"] / coupled - 1)
                       if coupled else None}
    payload = {"experiment": "pd-ratio", "setup": {"first": first, "nodes": NODES, "hardware": PAPER_NODE,
                                                   "slo": SLO, "target_attainment": TARGET,
                                                   "trace_rate_rps": base_rate, "admission": "none"},
               "results": results, "best": best, "paper": PAPER}
    write_json(out_dir, "pd_ratio", payload)
    _plot(out_dir, results)
    return payload


def _plot(out_dir: Path, results: dict) -> None:
    fig, axes = plt.subplots(1, len(MODELS), figsize=(11, 4), sharey=True)
    for ax, model in zip(axes, MODELS):
        splits = list(results[model]["disaggregated"])
        ax.plot(range(len(splits)), [results[model]["disaggregated"][s]["capacity_rps"] for s in splits], "o-",
                label="disaggregated (kvcache-centric)")
        for (name, found), style in zip(results[model]["coupled"].items(), ("--", ":")):
            ax.axhline(found["capacity_rps"], color="gray", ls=style, label=f"coupled, {name} prefill")
        ax.set_xticks(range(len(splits)), splits)
        ax.set_xlabel("prefill : decode nodes (16 x 8xA800)")
        ax.set_title(f"{model} ({'multi-head' if model == MHA_MODEL else 'grouped-query'} attention)", fontsize=10)
    axes[0].set_ylabel("effective request capacity (req/s)\n>= 90% within TTFT 10 s, TBT 100 ms")
    axes[0].legend(fontsize=8)
    save_figure(fig, out_dir, "pd_ratio")
