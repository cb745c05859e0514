"""Where a decode step's time goes: step timing (wall and process CPU time) and, with ``--trace``, a jax.profiler
perfetto trace of a few steps summed per XLA op (names as in the compiled HLO: dump it with
``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`` to map them to instructions).

CPU time (all threads of the process) moves less than wall time on a shared machine, so variants are compared by
it, alternating processes (run this script with one tree's PYTHONPATH, then the other's, and again).

    python benchmarks/decode_profile.py --batches 8,32 [--trace DIR] --json out.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, machine_info, top_ops_ms, write_json  # noqa: E402


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="small")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per batch")
    p.add_argument("--trace", type=Path, default=None, help="also trace 5 steps per batch into this folder")
    args = p.parse_args()

    import jax

    import mooncake_jax as mj
    from mooncake_jax.model.sequence import SamplingParams

    batches = [int(x) for x in args.batches.split(",")]
    ctx = args.context
    llm = mj.LLM(args.model, prefill_chunk_size=512, max_batch=max(batches),
                 num_pages=1 + max(batches) * (ctx // 16 + 8) + 64)
    eng, rng = llm.engine, np.random.default_rng(0)
    res = dict(machine_info(), model=args.model, context=ctx, load_start=open("/proc/loadavg").read().split()[0])
    for b in batches:
        seqs = []
        for _ in range(b):
            s = eng.new_sequence(rng.integers(0, eng.cfg.vocab_size, ctx).tolist(),
                                 SamplingParams(max_new_tokens=args.steps + 16, ignore_eos=True))
            eng.admit(s, cached_pages=[])
            eng.prefill(s)
            seqs.append(s)
        for _ in range(2):
            eng.decode(seqs)
        wall, cpu = [], []
        for _ in range(args.steps):
            t, c = time.perf_counter(), time.process_time()
            eng.decode(seqs)
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        res[f"step_wall_min_ms_b{b}"] = round(min(wall) * 1e3, 2)
        res[f"step_wall_median_ms_b{b}"] = round(float(np.median(wall)) * 1e3, 2)
        res[f"step_cpu_median_ms_b{b}"] = round(float(np.median(cpu)) * 1e3, 2)
        if args.trace is not None:
            out = args.trace / f"b{b}"
            with jax.profiler.trace(str(out), create_perfetto_trace=True):
                for _ in range(5):
                    eng.decode(seqs)
            res[f"top_ops_ms_b{b}"] = top_ops_ms(out, steps=5)
        for s in seqs:
            eng.release(s)
    res["load_end"] = open("/proc/loadavg").read().split()[0]
    write_json(res, args.json)


if __name__ == "__main__":
    main()
