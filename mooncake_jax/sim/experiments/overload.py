"""Experiment 3: overload. Rejections, wasted prefill and load over time under ``baseline``, ``early``,
``predictive`` admission, at 2x the trace's speed and over a 1x-4x sweep (arXiv 2407.00079, Table 3 and the
load-over-time figures).

8 prefill + 8 decode 8xA800 nodes, TTFT SLO 30 s. Three configurations, because which pool runs out decides
what admission can do:

- ``paper``: LLaMA-2-70B, TBT SLO 100 ms. Its grouped-query attention keeps KV at 320 KiB per token, so a decode
  node holds ~1.3M tokens and the decode pool never fills on this trace: only TTFT rejects, and the three
  policies (which differ only in how they judge decode load) must coincide.
- ``mha-capacity``: LLaMA-65B (full multi-head attention, 8x the KV), TBT SLO 100 ms: decode KV memory fills.
- ``mha-tbt``: LLaMA-65B, TBT SLO 50 ms: the TBT limit binds before memory does, which is the case the paper's
  early and predictive rejection are about (its Kimi model's decode was TBT-bound).

Oscillation figures, from load sampled every 2 s and smoothed over 10 s: the spread (standard deviation) of
prefill busyness and decode KV load, and the most negative correlation between them over lags up to +-60 s
(anti-phase shows as a strongly negative value).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from mooncake_jax.sim.experiments.common import MHA_MODEL, PAPER_MODEL, PAPER_NODE, pick, runs, save_figure, write_json

POLICIES = ("baseline", "early", "predictive")
SPEEDS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
CONFIGS = {"paper": (PAPER_MODEL, 0.1), "mha-capacity": (MHA_MODEL, 0.1), "mha-tbt": (MHA_MODEL, 0.05)}
PAPER_TABLE3 = {"baseline": 4183, "early": 3771, "predictive": 3589}
"""Rejected requests in arXiv 2407.00079 Table 3 (its own trace, replayed at 2x; not the conversation trace)."""
SAMPLE_S = 2.0
SMOOTH = 5  # samples: 10 s
FIGURES = ("completed", "rejected_early", "rejected_late", "wasted_prefill_s", "slo_attainment", "goodput_rps",
           "avg_ttft_s", "p90_tbt_s", "peak_decode_kv_fraction")


def _smooth(values) -> np.ndarray:
    return np.convolve(np.asarray(values, float), np.ones(SMOOTH) / SMOOTH, mode="same")


def oscillation(load: dict) -> dict:
    """Spread of both loads and their most negative lagged correlation (see the module docstring)."""
    prefill, decode = _smooth(load["prefill_busy"]), _smooth(load["decode_kv"])
    if len(prefill) < 120:  # under 4 minutes of samples: too short to speak of oscillation
        return {"prefill_busy_std": None, "decode_kv_std": None, "min_lagged_corr": None, "at_lag_s": None}
    keep = slice(30, len(prefill) - 30)  # drop the ramp-up and the drain
    p, d = prefill[keep] - prefill[keep].mean(), decode[keep] - decode[keep].mean()
    best, best_lag = 0.0, 0
    for lag in range(-30, 31):
        a = p[max(lag, 0): len(p) + min(lag, 0)]
        b = d[max(-lag, 0): len(d) - max(lag, 0)]
        if len(a) > 10 and a.std() > 0 and b.std() > 0:
            c = float(np.corrcoef(a, b)[0, 1])
            if c < best:
                best, best_lag = c, lag
    return {"prefill_busy_std": float(p.std()), "decode_kv_std": float(d.std()),
            "min_lagged_corr": best, "at_lag_s": best_lag * SAMPLE_S}


def run(out_dir: Path, first: int | None = None, progress: bool = True) -> dict:
    at_2x: dict = {c: {} for c in CONFIGS}
    sweep: dict = {c: {p: {} for p in POLICIES} for c in CONFIGS}
    loads: dict = {}
    with runs("overload", len(CONFIGS) * len(POLICIES) * len(SPEEDS), first, progress) as sim:
        for config, (model, tbt) in CONFIGS.items():
            for policy in POLICIES:
                for speed in SPEEDS:
                    result = sim.result(prefill=8, decode=8, admission=policy, speed=speed, hardware=PAPER_NODE,
                                        model=model, tbt_slo_s=tbt, sample_interval_s=SAMPLE_S)
                    figures = pick(result.summary, *FIGURES)
                    figures["rejected"] = figures["rejected_early"] + figures["rejected_late"]
                    sweep[config][policy][str(speed)] = figures
                    if speed == 2.0:
                        at_2x[config][policy] = figures | oscillation(result.load)
                        loads[(config, policy)] = result.load
    payload = {"experiment": "overload", "setup": {"first": first, "cluster": "8 prefill + 8 decode",
                                                   "hardware": PAPER_NODE, "ttft_slo_s": 30.0,
                                                   "configs": {c: {"model": m, "tbt_slo_s": t}
                                                               for c, (m, t) in CONFIGS.items()}},
               "at_2x": at_2x, "sweep": sweep, "paper_table3_rejected": PAPER_TABLE3,
               "load_2x": {f"{c}/{p}": {k: [round(v, 4) for v in series] for k, series in load.items()}
                           for (c, p), load in loads.items()}}
    write_json(out_dir, "overload", payload)
    _plot_load(out_dir, loads, at_2x, "mha-tbt")
    _plot_sweep(out_dir, sweep)
    return payload


def _plot_load(out_dir: Path, loads: dict, at_2x: dict, config: str) -> None:
    fig, axes = plt.subplots(len(POLICIES), 1, figsize=(10, 7), sharex=True, sharey=True)
    for ax, policy in zip(axes, POLICIES):
        load = loads[(config, policy)]
        t = np.asarray(load["time_s"])
        ax.plot(t, _smooth(load["prefill_busy"]), label="prefill pool: share of instances busy")
        ax.plot(t, _smooth(load["decode_kv"]), label="decode pool: share of KV capacity held")
        figures = at_2x[config][policy]
        title = f"{policy}: {figures['rejected']} rejected ({figures['rejected_late']} late)"
        if figures["prefill_busy_std"] is not None:
            title += (f"; prefill busy std {figures['prefill_busy_std']:.2f}, most negative lagged correlation "
                      f"{figures['min_lagged_corr']:.2f} at {figures['at_lag_s']:+.0f} s")
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1.05)
        end = min(t[-1], 1500.0)
        ax.set_xlim(max(end - 600.0, 0.0), end)
    axes[0].legend(fontsize=8, loc="lower left")
    axes[-1].set_xlabel("time (s), conversation trace at 2x, LLaMA-65B (MHA), TBT SLO 50 ms, 10 s average")
    fig.suptitle("Load over time under the three admission policies (anti-phase: prefill busy while decode is "
                 "light, and back)", fontsize=10)
    save_figure(fig, out_dir, "overload_load")


def _plot_sweep(out_dir: Path, sweep: dict) -> None:
    fig, axes = plt.subplots(3, len(CONFIGS), figsize=(13, 8.5), sharex=True)
    for col, config in enumerate(CONFIGS):
        for policy, marker in zip(POLICIES, "osd"):
            series = sweep[config][policy]
            speeds = [float(s) for s in series]
            axes[0, col].plot(speeds, [v["rejected"] for v in series.values()], marker + "-", label=policy)
            axes[1, col].plot(speeds, [v["wasted_prefill_s"] for v in series.values()], marker + "-", label=policy)
            axes[2, col].plot(speeds, [v["slo_attainment"] for v in series.values()], marker + "-", label=policy)
        model, tbt = CONFIGS[config]
        axes[0, col].set_title(f"{config}: {model}, TBT SLO {tbt * 1000:.0f} ms", fontsize=10)
        axes[2, col].set_xlabel("trace speed")
    axes[0, 0].set_ylabel("rejected requests")
    axes[1, 0].set_ylabel("prefill seconds wasted\n(late rejections)")
    axes[2, 0].set_ylabel("SLO attainment\n(share of all requests)")
    axes[0, 0].legend(fontsize=8)
    save_figure(fig, out_dir, "overload_sweep")
