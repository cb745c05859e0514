"""Experiment 2: KVCache hit ratio against capacity, and per-node caches against one global pool.

Part 1 replays the conversation trace against one block cache of growing capacity (the facts measured on the
trace, in ../shared/traces/README.md, beside it). Part 2 runs the cluster (8 prefill + 8 decode, 8xA800,
LLaMA-2-70B) with per-node DRAM caches of a few sizes, three ways:

- ``local-blind``: each prefill node reuses only its own cache and requests go to the least loaded node
  (``load-balance``), as behind a cache-unaware load balancer;
- ``local``: each prefill node reuses only its own cache, but requests go where their prefix is
  (``local-cache-aware`` scheduling, no transfers);
- ``mooncake``: the same per-node caches, but the Conductor fetches a longer prefix from another node
  (``kvcache-centric``), which makes them one distributed pool with hot blocks replicated;
- ``global``: one pool of the summed capacity that every node reads (the upper bound the pool aims at).

The paper (FAST'25) reports the global cache raising the hit rate by up to 136% and cutting prefill time by up
to 48% against local caches.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from mooncake_jax.sim.cache import cache_hit_ratio
from mooncake_jax.sim.experiments.common import PAPER_MODEL, PAPER_NODE, pick, runs, save_figure, write_json
from mooncake_jax.sim.trace import load_trace

CAPACITIES_BLOCKS = (500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, None)
README_FACTS = {1_000: 0.045, 10_000: 0.212, 50_000: 0.355, 100_000: 0.364, None: 0.366}
README_TOKENS_UNBOUNDED = 0.374
NODE_CACHE_TOKENS = (250_000, 1_000_000, 3_000_000, 10_000_000)
MODES = {"local-blind": ("load-balance", "per-node"), "local": ("local-cache-aware", "per-node"),
         "mooncake": ("kvcache-centric", "per-node"),
         "global": ("local-cache-aware", "global")}
PAPER = {"hit_rate_gain_pct_up_to": 136, "prefill_time_cut_pct_up_to": 48}
FIGURES = ("cache_hit_ratio", "cache_hit_ratio_tokens", "avg_prefill_s", "avg_ttft_s", "fetched_blocks")


def run(out_dir: Path, first: int | None = None, progress: bool = True) -> dict:
    trace = load_trace("conversation", first=first)
    curve = {"lru": {}, "lfu": {}, "lru_tokens": {}}
    for capacity in CAPACITIES_BLOCKS:
        key = "unbounded" if capacity is None else str(capacity)
        curve["lru"][key] = cache_hit_ratio(trace, capacity, "lru")
        curve["lfu"][key] = cache_hit_ratio(trace, capacity, "lfu")
        curve["lru_tokens"][key] = cache_hit_ratio(trace, capacity, "lru", weight="tokens")
    facts = {("unbounded" if c is None else str(c)): {"ours": curve["lru"]["unbounded" if c is None else str(c)],
                                                     "readme": v} for c, v in README_FACTS.items()}
    facts["unbounded_tokens"] = {"ours": curve["lru_tokens"]["unbounded"], "readme": README_TOKENS_UNBOUNDED}

    cluster: dict[str, dict[str, dict]] = {mode: {} for mode in MODES}
    with runs("cache", len(MODES) * len(NODE_CACHE_TOKENS), first, progress) as sim:
        for tokens in NODE_CACHE_TOKENS:
            for mode, (policy, cache_mode) in MODES.items():
                summary = sim(prefill=8, decode=8, policy=policy, cache_mode=cache_mode, cache_tokens=tokens,
                              hardware=PAPER_NODE, model=PAPER_MODEL)
                cluster[mode][str(tokens)] = pick(summary, *FIGURES)
    gains = {tokens: {f"{better}_vs_{base}_{figure}": _gain(cluster[better][tokens], cluster[base][tokens], figure)
                      for better in ("global", "mooncake") for base in ("local", "local-blind")
                      for figure in ("hit_gain_pct", "prefill_cut_pct")}
             for tokens in map(str, NODE_CACHE_TOKENS)}
    payload = {"experiment": "cache", "setup": {"first": first, "cluster": "8 prefill + 8 decode",
                                                "hardware": PAPER_NODE, "model": PAPER_MODEL, "modes": MODES},
               "hit_ratio_vs_capacity_blocks": curve, "readme_facts": facts, "cluster": cluster,
               "gains": gains, "paper": PAPER}
    write_json(out_dir, "cache", payload)
    _plot(out_dir, curve, cluster)
    return payload


def _gain(better: dict, base: dict, figure: str) -> float:
    """Hit ratio gained (%) or average prefill compute cut (%) by ``better`` over ``base``."""
    if figure == "hit_gain_pct":
        return 100 * (better["cache_hit_ratio"] / base["cache_hit_ratio"] - 1)
    return 100 * (1 - better["avg_prefill_s"] / base["avg_prefill_s"])


def _plot(out_dir: Path, curve: dict, cluster: dict) -> None:
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.2))
    caps = [c for c in CAPACITIES_BLOCKS if c is not None]
    for name, style in (("lru", "o-"), ("lfu", "s--"), ("lru_tokens", "^:")):
        left.plot(caps, [curve[name][str(c)] for c in caps], style, label=name.replace("_", ", by "), ms=4)
    left.plot(list(c for c in README_FACTS if c), [v for c, v in README_FACTS.items() if c], "kx", ms=9,
              label="README facts (LRU)")
    left.axhline(curve["lru"]["unbounded"], color="gray", lw=0.8, ls="--", label="unbounded")
    left.set_xscale("log")
    left.set_xlabel("cache capacity (512-token blocks)")
    left.set_ylabel("hit ratio")
    left.set_title("One cache replaying the conversation trace", fontsize=10)
    left.legend(fontsize=8)
    x = [t / 1e6 for t in NODE_CACHE_TOKENS]
    for mode, marker in (("local-blind", "v"), ("local", "o"), ("mooncake", "s"), ("global", "^")):
        middle.plot(x, [cluster[mode][str(t)]["cache_hit_ratio"] for t in NODE_CACHE_TOKENS], marker + "-",
                    label=mode)
        right.plot(x, [cluster[mode][str(t)]["avg_prefill_s"] for t in NODE_CACHE_TOKENS], marker + "-",
                   label=mode)
    for ax, what in ((middle, "cache hit ratio (blocks)"), (right, "average prefill compute (s)")):
        ax.set_xscale("log")
        ax.set_xlabel("DRAM cache per prefill node (M tokens)")
        ax.set_ylabel(what)
        ax.set_title(f"8 prefill nodes: {what.split(' (')[0]}", fontsize=10)
        ax.legend(fontsize=8)
    save_figure(fig, out_dir, "cache")
