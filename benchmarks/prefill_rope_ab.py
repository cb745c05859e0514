"""The engine's own prefill program with RoPE's cos/sin table materialised once (``rope._cos_sin``, the library's
form from ``MATERIALISED_TABLE_MIN_TOKENS`` positions on) against the table fused into every rotation (the form
before), compiled from the same captured step in one process and timed alternated.

Captures the step the engine runs for an N-token prefill (``prefill_profile.capture_prefill``), then lowers and
compiles ``forward_step`` once per form (the threshold switched in between, JAX's trace caches cleared), checks
the logits of both, counts the cosine ops of each optimized program, and times the two in turn
(``common.interleaved_programs``, a 0.2 s pause before each call: wall min / median and process CPU time, all threads).

    python benchmarks/prefill_rope_ab.py --tokens 2048 --rounds 9 --json out.json
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, interleaved_programs, load_average, machine_info, write_json  # noqa: E402
from prefill_profile import capture_prefill  # noqa: E402


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="small")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()

    import jax

    import mooncake_jax as mj
    from mooncake_jax.model import rope
    from mooncake_jax.model.steps import forward_step

    n = args.tokens
    eng = mj.LLM(args.model, prefill_chunk_size=n, max_batch=1, num_pages=n // 16 + 64).engine
    prompt = np.random.default_rng(0).integers(0, eng.cfg.vocab_size, n).tolist()
    seen = {}
    stage, _, call_args = capture_prefill(eng, prompt, seen)
    res = dict(machine_info(), model=args.model, tokens=n, load_start=load_average())
    library_min = rope.MATERIALISED_TABLE_MIN_TOKENS
    compiled = {}
    for name, threshold in (("fused_table", 1 << 30), ("table_once", library_min)):
        rope.MATERIALISED_TABLE_MIN_TOKENS = threshold
        jax.clear_caches()
        t = time.perf_counter()
        lowered = forward_step.lower(stage.graphdef, stage.params, stage.kv, *call_args, mode=seen["mode"])
        compiled[name] = lowered.compile()
        res[f"{name}_compile_s"] = round(time.perf_counter() - t, 1)
        res[f"{name}_cosine_ops"] = len(re.findall(r" cosine\(", compiled[name].as_text()))
        print(name, res[f"{name}_compile_s"], "s,", res[f"{name}_cosine_ops"], "cosine ops", flush=True)
    rope.MATERIALISED_TABLE_MIN_TOKENS = library_min
    res.update(interleaved_programs(stage, compiled, call_args, args.rounds, pause_s=0.2))
    write_json(res, args.json)


if __name__ == "__main__":
    main()
