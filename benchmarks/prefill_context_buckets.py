"""A chunked prefill's context padding: the engine pads each chunk's context table to a power of two pages, and
the xla attention computes (and gathers) the whole padded width. This times served prefills (new blocks read out,
as ``instance/calibrate.py`` takes its PREFILL_GRID points) of growing prompts with the engine's buckets and with
exact context widths (``engine.bucket`` swapped in this process only), alternated, so the two see the same load.

With chunks of 512 a 2048-token prompt's last chunk has 96 context pages, padded to 128: it attends over 2,048
positions instead of 1,536.

    python benchmarks/prefill_context_buckets.py --model tiny --chunk 512 --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, machine_info, write_json  # noqa: E402


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--chunk", type=int, default=512, help="prefill_chunk_size (an instance's default: 512)")
    p.add_argument("--prompts", default="512,1024,1536,2048")
    p.add_argument("--bucket-factor", type=int, default=4, help="chunk buckets (InstanceConfig's default: 4)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    import mooncake_jax as mj
    from mooncake_jax.instance.calibrate import served_prefill_seconds
    from mooncake_jax.model import engine as engine_module

    llm = mj.LLM(args.model, prefill_chunk_size=args.chunk, max_batch=8, bucket_factor=args.bucket_factor)
    eng, rng = llm.engine, np.random.default_rng(0)
    pow2 = engine_module.bucket

    def exact(n, cap, minimum=1, factor=2):
        return min(max(n, minimum), cap)

    variants = {"pow2": pow2, "exact": exact}
    res = dict(machine_info(), model=args.model, chunk=args.chunk, load_start=open("/proc/loadavg").read().split()[0])
    times: dict = {}
    try:
        for n in [int(x) for x in args.prompts.split(",")]:
            prompt = rng.integers(0, eng.cfg.vocab_size, n).tolist()
            for fn in variants.values():  # compile
                engine_module.bucket = fn
                served_prefill_seconds(eng, prompt)
            for _ in range(args.repeats):
                for name, fn in variants.items():
                    engine_module.bucket = fn
                    times.setdefault(name, {}).setdefault(n, []).append(served_prefill_seconds(eng, prompt))
    finally:
        engine_module.bucket = pow2
    for name, per_n in times.items():
        for n, ts in per_n.items():
            res[f"{name}_{n}_min_ms"] = round(min(ts) * 1e3, 1)
            res[f"{name}_{n}_median_ms"] = round(float(np.median(ts)) * 1e3, 1)
    ns = sorted(times["pow2"])
    if len(ns) >= 2:
        lo, hi = ns[-1] // 2, ns[-1]
        if lo in times["pow2"]:
            for name in variants:
                res[f"{name}_ratio_{hi}_over_{lo}_median"] = round(
                    float(np.median(times[name][hi]) / np.median(times[name][lo])), 2)
    res["load_end"] = open("/proc/loadavg").read().split()[0]
    write_json(res, args.json)


if __name__ == "__main__":
    main()
