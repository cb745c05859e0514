"""Decode step with and without the stage's output-major decode copy (``ModelConfig.decode_weights``), in one
process on the same sequences, steps interleaved (one of each in turn), so both see the same load.

On a shared 2-core machine a figure taken by one process and compared with another's moves by +-10% between runs;
interleaving steps in one process leaves both variants the same disturbances. Reports wall (min, quartile, median)
and process CPU time (all threads) per step.

    python benchmarks/decode_ab.py --batch 32 --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import decode_ab_parser, interleaved, machine_info, prefilled_engine, write_json  # noqa: E402


def main() -> None:
    p = decode_ab_parser(__doc__)
    args = p.parse_args()

    from flax import nnx

    from mooncake_jax.model.llama import Stage
    from mooncake_jax.model.steps import HashedGraph, plain_arrays

    b, ctx = args.batch, args.context
    variants_count = 2  # decode_copy and canonical, each stepped args.steps + 1 times
    llm, seqs, _ = prefilled_engine(args.model, b, ctx, (args.steps + 1) * variants_count + 2)
    eng = llm.engine
    runner = eng.runner.stages[0]
    if runner.scan or len(eng.runner.stages) != 1:
        raise SystemExit("decode_ab needs the single-stage unrolled (CPU) engine")
    plain = Stage(llm.model, 0, llm.config.n_layers, scan=False)
    plain.decode_layers = plain.decode_lm_head = None  # the same stage without its decode copy
    graphdef, params = nnx.split(plain)
    variants = {"decode_copy": (runner.graphdef, runner.params),
                "canonical": (HashedGraph(graphdef), plain_arrays(runner.layout.place_params(0, params)))}

    def step(g, prm):
        def run():
            runner.graphdef, runner.params = g, prm
            eng.decode(seqs)
        return run

    steps = {name: step(g, prm) for name, (g, prm) in variants.items()}
    for run in steps.values():  # compile each
        run()
    res = dict(machine_info(), model=args.model, batch=b, context=ctx, steps=args.steps,
               **interleaved(steps, args.steps, base="canonical"))
    res["wall_median_ratio"] = res["decode_copy_wall_median_ratio"]
    res["cpu_median_ratio"] = res["decode_copy_cpu_ratio"]
    write_json(res, args.json)


if __name__ == "__main__":
    main()
