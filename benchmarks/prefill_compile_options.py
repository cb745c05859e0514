"""The engine's own prefill program compiled with per-compile XLA:CPU options, timed in one process, alternated.

Captures the exact step the engine runs for an N-token prefill (``forward_step`` and its placed inputs), lowers it
once and compiles it once per variant (``lowered.compile(compiler_options=...)``: the options touch that program
only, never the process), checks every variant's logits against the default's, then times the variants in turn
(``common.interleaved_programs``: wall min / median and process CPU time, all threads). Options that XLA does not know fail
at compile and are reported, not timed.

    python benchmarks/prefill_compile_options.py --variants default,ynn_off,ynn_dot --rounds 5 --json out.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, interleaved_programs, load_average, machine_info, write_json  # noqa: E402
from prefill_profile import capture_prefill  # noqa: E402

VARIANTS = {
    "default": {},
    "ynn_off": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "ynn_dot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "ynn_individual_dot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
    "xnn_dot": {"xla_cpu_experimental_ynn_fusion_type": "",
                "xla_cpu_experimental_xnn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "onednn": {"xla_cpu_use_onednn": True},
    # oneDNN dot fusions computed wrong logits here (max abs diff 3.9 on `tiny`, jax 0.10.2, AMD EPYC): the logits
    # check below reports it
    "onednn_dot": {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_use_onednn": True,
                   "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "no_concurrency_sched": {"xla_cpu_enable_concurrency_optimized_scheduler": False},
    "vector_128": {"xla_cpu_prefer_vector_width": 128},
    "fast_min_max": {"xla_cpu_enable_fast_min_max": True},
}
"""Named per-compile option sets (``default``: none)."""


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="small")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--variants", default="default,ynn_off", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")

    import mooncake_jax as mj

    n = args.tokens
    eng = mj.LLM(args.model, prefill_chunk_size=n, max_batch=1, num_pages=n // 16 + 64).engine
    prompt = np.random.default_rng(0).integers(0, eng.cfg.vocab_size, n).tolist()
    stage, lowered, call_args = capture_prefill(eng, prompt)
    res = dict(machine_info(), model=args.model, tokens=n, load_start=load_average(),
               options={k: VARIANTS[k] for k in names})
    compiled = {}
    for name in names:
        t = time.perf_counter()
        try:
            compiled[name] = lowered.compile(compiler_options=VARIANTS[name] or None)
        except Exception as e:  # an option this XLA does not know, or a value it rejects
            res[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(name, "failed:", res[f"{name}_error"], flush=True)
            continue
        res[f"{name}_compile_s"] = round(time.perf_counter() - t, 1)
        print(name, "compiled in", res[f"{name}_compile_s"], "s", flush=True)
    res.update(interleaved_programs(stage, compiled, call_args, args.rounds))
    res["load_end_all"] = load_average()
    write_json(res, args.json)


if __name__ == "__main__":
    main()
