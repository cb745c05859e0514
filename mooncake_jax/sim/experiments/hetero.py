"""Experiment 5: heterogeneous prefill and decode pools: effective request capacity and cost per million tokens.

Mooncake's disaggregation lets the prefill pool (compute-bound) and the decode pool (memory-bandwidth-bound) run
on different hardware. Each configuration below serves the conversation trace with the Conductor's
kvcache-centric policy, no admission control; its *effective request capacity* is the highest arrival rate (the
trace replayed faster or slower, bisection on the speed factor) at which at least 90% of all requests complete
within TTFT 10 s and TBT 100 ms (the P/D-ratio experiment's SLOs). Its cost per million tokens is the cluster's
hourly cost (each instance's profile: ``mooncake_jax.conductor.hardware.HARDWARE``, prices marked assumed there
or quoted from the vendor's list) over the run at that rate, per million tokens of completed requests (prompt +
generated; generated only beside it).

Two models: LLaMA-2-70B (the paper's; 138 GB of bf16 weights, so a tpu-v5e-8 with 128 GB of HBM cannot hold it
and that configuration is reported as not fitting) and LLaMA-2-7B, which every profile holds. Every figure comes
from datasheet cost models, so the comparison between configurations is the claim, not the absolute rates.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from mooncake_jax.sim.experiments.common import capacity_search, runs, save_figure, write_json
from mooncake_jax.sim.trace import load_trace

SLO = {"ttft_slo_s": 10.0, "tbt_slo_s": 0.1}
TARGET = 0.9
SPEED_RANGE = (0.125, 64.0)
BISECTION_STEPS = 7
MODELS = {"llama2-70b": (8, 8), "llama2-7b": (4, 4)}
"""Model -> (prefill, decode) instances."""


def configurations(prefill: int, decode: int) -> dict[str, dict]:
    """Name -> the simulate() options of each cluster (pools of ``prefill`` and ``decode`` instances)."""
    half = prefill // 2
    return {
        "all 8xA800": {"prefill_hardware": "8xA800", "decode_hardware": "8xA800"},
        "8xH800 prefill + 8xA800 decode": {"prefill_hardware": "8xH800", "decode_hardware": "8xA800"},
        "all 8xH800": {"prefill_hardware": "8xH800", "decode_hardware": "8xH800"},
        f"mixed prefill ({half} 8xH800 + {prefill - half} 8xA800) + 8xA800 decode": {
            "prefill_hardware": ("8xH800",) * half + ("8xA800",) * (prefill - half), "decode_hardware": "8xA800"},
        "tpu-v5e-8 prefill + tpu-v6e-8 decode": {"prefill_hardware": "tpu-v5e-8", "decode_hardware": "tpu-v6e-8"},
        "all tpu-v6e-8": {"prefill_hardware": "tpu-v6e-8", "decode_hardware": "tpu-v6e-8"},
    }


COST_FIGURES = ("cluster_cost_per_hour", "cost_per_million_tokens", "cost_per_million_output_tokens",
                "slo_attainment", "p90_ttft_s", "p90_tbt_s", "completed")


def run(out_dir: Path, first: int | None = None, progress: bool = True) -> dict:
    trace = load_trace("conversation", first=first)
    base_rate = len(trace) / max(trace.duration_s, 1e-9)
    per_search = BISECTION_STEPS + 2
    total = sum(len(configurations(*pools)) for pools in MODELS.values()) * per_search
    results: dict = {}
    with runs("hetero", total, first, progress) as sim:
        for model, (prefill, decode) in MODELS.items():
            results[model] = {}
            for name, hardware in configurations(prefill, decode).items():
                try:
                    found = capacity_search(sim, TARGET, SPEED_RANGE, BISECTION_STEPS, prefill=prefill,
                                            decode=decode, model=model, **SLO, **hardware)
                except ValueError as e:  # the model does not fit the hardware: say so, keep going
                    results[model][name] = {"fits": False, "reason": str(e), "hardware": _plain(hardware)}
                    continue
                at = found.pop("summary")
                results[model][name] = {
                    "fits": True, "hardware": _plain(hardware), "capacity_rps": found["speed"] * base_rate,
                    **found, **{k: at.get(k) for k in COST_FIGURES},
                    "capacity_rps_per_dollar_hour": found["speed"] * base_rate / at["cluster_cost_per_hour"]}
    payload = {"experiment": "hetero",
               "setup": {"first": first, "pools": {m: {"prefill": p, "decode": d} for m, (p, d) in MODELS.items()},
                         "slo": SLO, "target_attainment": TARGET, "trace_rate_rps": base_rate,
                         "policy": "kvcache-centric", "admission": "none", "speed_range": SPEED_RANGE,
                         "prices": "cost per hour of each profile in mooncake_jax/conductor/hardware.py (GPU "
                                   "prices assumed, TPU prices the Cloud TPU list price per chip-hour)"},
               "results": results}
    write_json(out_dir, "hetero", payload)
    _plot(out_dir, results)
    return payload


def _plain(hardware: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in hardware.items()}


def _plot(out_dir: Path, results: dict) -> None:
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 3.6 * len(results)), squeeze=False)
    for row, (model, configs) in zip(axes, results.items()):
        names = list(configs)
        labels = [n.replace(" + ", "\n+ ").replace(" (", "\n(") for n in names]
        y = np.arange(len(names))
        capacity = [configs[n].get("capacity_rps", 0.0) for n in names]
        cost = [configs[n].get("cost_per_million_tokens") or 0.0 for n in names]
        row[0].barh(y, capacity, color="tab:blue")
        row[1].barh(y, cost, color="tab:orange")
        for i, n in enumerate(names):
            if configs[n].get("saturated"):
                row[0].text(capacity[i], i, " >= (end of the searched range)", va="center", fontsize=7)
            if not configs[n]["fits"]:
                for ax in row:
                    ax.text(0, i, "  model does not fit", va="center", fontsize=8, color="gray")
        row[0].set_yticks(y, labels, fontsize=7)
        row[1].set_yticks(y, [""] * len(names))
        row[0].invert_yaxis()
        row[1].invert_yaxis()
        row[0].set_xlabel("effective request capacity (req/s)\n>= 90% within TTFT 10 s, TBT 100 ms")
        row[1].set_xlabel("cost per million tokens at that rate ($, prompt + generated)")
        row[0].set_title(f"{model}", fontsize=10, loc="left")
    save_figure(fig, out_dir, "hetero")
