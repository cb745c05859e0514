"""``mooncake-jax simulate``: one simulation with a summary table (``--json`` writes it), or one of the paper's
experiments (``--experiment``), which writes JSON and PNG plots into ``--out``."""

from __future__ import annotations

import argparse
import sys

from mooncake_jax.sim.experiments import EXPERIMENTS

_SHOWN = ("requests", "completed", "rejected_early", "rejected_late", "avg_ttft_s", "p90_ttft_s", "p90_tbt_s",
          "slo_attainment", "cache_hit_ratio", "cache_hit_ratio_tokens", "avg_prefill_s", "wasted_prefill_s",
          "throughput_rps", "cost_per_request", "cost_per_million_tokens", "sim_duration_s", "wall_s",
          "requests_per_wall_s")


def _cache_tokens(text: str) -> int | None:
    if text.lower() in ("none", "unbounded"):
        return None
    return int(float(text))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("examples:  mooncake-jax simulate --policy local-cache-aware --json out.json\n"
                     "           mooncake-jax simulate --architecture coupled --chunked-prefill --first 2000\n"
                     "           mooncake-jax simulate --experiment scheduling --out results/sim\n"
                     f"experiments: {', '.join(EXPERIMENTS)}, all (each writes <out>/<name>.json and PNG plots)")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    g = parser.add_argument_group("trace")
    g.add_argument("--trace", default="conversation", help="bundled trace name or Mooncake JSONL(.gz) path")
    g.add_argument("--first", type=int, default=None, help="only the first N requests")
    g.add_argument("--start-s", type=float, default=None, help="only requests arriving at or after (trace s)")
    g.add_argument("--end-s", type=float, default=None, help="only requests arriving before (trace s)")
    g.add_argument("--speed", type=float, default=1.0, help="arrival-rate factor (2.0 halves every gap)")
    g = parser.add_argument_group("cluster")
    g.add_argument("--prefill", type=int, default=8, help="prefill instances (coupled: nodes = prefill + decode)")
    g.add_argument("--decode", type=int, default=8, help="decode instances")
    g.add_argument("--architecture", default="disaggregated", choices=["disaggregated", "coupled"])
    g.add_argument("--chunked-prefill", action="store_true", help="coupled baseline with chunked prefill")
    g.add_argument("--chunk-tokens", type=int, default=512, help="coupled: tokens per chunked iteration")
    g.add_argument("--hardware", default="8xA800",
                   help="built-in profile (8xA800, 8xH800, 8xH200, tpu-v5e-8, tpu-v6e-8) or profile JSON path")
    g.add_argument("--prefill-hardware", default=None,
                   help="prefill pool's hardware (heterogeneous cluster); one per instance for a mixed pool: "
                        "8xH800*4,8xA800*4")
    g.add_argument("--decode-hardware", default=None, help="decode pool's hardware, as --prefill-hardware")
    g.add_argument("--model", default="llama2-70b", help="model shape for built-in hardware profiles")
    g.add_argument("--cache-tokens", type=_cache_tokens, default=3_000_000,
                   help="DRAM KV cache per prefill node in tokens ('none': unbounded)")
    g.add_argument("--cache-mode", default="per-node", choices=["per-node", "global"])
    g.add_argument("--eviction", default="lru", choices=["lru", "lfu"])
    g = parser.add_argument_group("Conductor")
    g.add_argument("--policy", default="kvcache-centric",
                   help="random | load-balance | local-cache-aware | kvcache-centric")
    g.add_argument("--admission", default="none", help="none | baseline | early | predictive")
    g.add_argument("--ttft-slo", type=float, default=30.0, help="TTFT SLO (s)")
    g.add_argument("--tbt-slo", type=float, default=0.1, help="TBT SLO (s)")
    g.add_argument("--threshold", type=float, default=1.0, help="kvcache balancing threshold")
    g = parser.add_argument_group("output")
    g.add_argument("--json", default=None, metavar="FILE", help="write the summary (and load over time) as JSON")
    g.add_argument("--experiment", default=None, choices=[*EXPERIMENTS, "all"],
                   help="run one of the paper's experiments instead of a single simulation")
    g.add_argument("--out", default="results/sim", help="experiment output folder")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    progress = not args.no_progress
    try:
        if args.experiment:
            from mooncake_jax.sim.experiments import run_experiment

            run_experiment(args.experiment, args.out, first=args.first, progress=progress)
            print(f"wrote {args.experiment} results to {args.out}/")
            return 0
        from mooncake_jax.sim.hardware import parse_pool
        from mooncake_jax.sim.simulate import simulate

        result = simulate(args.trace, args.prefill, args.decode, args.policy, args.admission, args.speed,
                          first=args.first, start_s=args.start_s, end_s=args.end_s, progress=progress,
                          architecture=args.architecture, chunked_prefill=args.chunked_prefill,
                          chunk_tokens=args.chunk_tokens, hardware=args.hardware,
                          prefill_hardware=args.prefill_hardware and parse_pool(args.prefill_hardware),
                          decode_hardware=args.decode_hardware and parse_pool(args.decode_hardware),
                          model=args.model, cache_tokens=args.cache_tokens, cache_mode=args.cache_mode,
                          eviction=args.eviction, ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                          kvcache_balancing_threshold=args.threshold)
    except ValueError as e:
        print(f"mooncake-jax simulate: {e}", file=sys.stderr)
        return 2
    for key in _SHOWN:
        value = result.summary.get(key)
        print(f"{key:<24} {value:.4g}" if isinstance(value, float) else f"{key:<24} {value}")
    if args.json:
        result.write_json(args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="mooncake-jax simulate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
