"""Decode step time with and without one malloc arena for every thread (``model/host_memory.py``), each in fresh
processes, alternated: "heap" is a decode instance's setting (the engine's import: large blocks kept on the heap, an
arena per thread), "one_arena" a prefill instance's (``host_memory.share_one_arena`` before JAX starts its threads).
Each process prefills ``--batch`` sequences of ``--context`` tokens and times ``--steps`` decode steps; per process:
wall min / median and process CPU per step (all threads), ms.

    PYTHONPATH=<tree> python benchmarks/decode_arena_ab.py --model tiny --batch 1 --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import alternated_processes, arg_parser, load_average, machine_info, write_json  # noqa: E402

CHILD = r"""
import json, sys, time
mode, model, batch, context, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, sys.argv[6])
if mode == "one_arena":
    from mooncake_jax.model.host_memory import share_one_arena
    share_one_arena()
import numpy as np
from common import prefilled_engine
llm, seqs, _ = prefilled_engine(model, batch, context, steps + 20, None, 0)
for _ in range(10):
    llm.engine.decode(seqs)
wall, c = [], time.process_time()
for _ in range(steps):
    t = time.perf_counter()
    llm.engine.decode(seqs)
    wall.append(time.perf_counter() - t)
cpu = (time.process_time() - c) / steps
print(json.dumps({"wall_min_ms": round(min(wall) * 1e3, 3), "wall_median_ms": round(float(np.median(wall)) * 1e3, 3),
                  "cpu_ms_per_step": round(cpu * 1e3, 3)}))
"""


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3, help="heap / one_arena process pairs, alternated")
    args = p.parse_args()
    res = dict(machine_info(), model=args.model, batch=args.batch, context=args.context, steps=args.steps,
               load_start=load_average())
    res.update(alternated_processes(CHILD, ("heap", "one_arena"), args.rounds,
                                    [args.model, str(args.batch), str(args.context), str(args.steps)]))
    for figure in ("wall_min_ms", "cpu_ms_per_step"):
        best = {mode: min(res[f"{mode}_{r}"][figure] for r in range(args.rounds)) for mode in ("heap", "one_arena")}
        res[f"one_arena_over_heap_{figure}"] = round(best["one_arena"] / best["heap"], 3)
    write_json(res, args.json)


if __name__ == "__main__":
    main()
