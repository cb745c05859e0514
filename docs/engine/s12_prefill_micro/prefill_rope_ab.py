"""(Kept as a record: it needs the reverted rope.MATERIALIZE_ANGLES switch of commit 7632d48 to run.)

The engine's prefill program with and without RoPE's materialized cos/sin tables (``rope.MATERIALIZE_ANGLES``),
compiled side by side in one process from the step the engine runs and alternated on the same inputs, so both see
the same load. Reports wall (min, median) and process CPU time (all threads) per prefill, and the largest
difference between the two variants' logits.

    python benchmarks/prefill_rope_ab.py --tokens 2048 --json out.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, machine_info, write_json  # noqa: E402


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="small")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=6)
    args = p.parse_args()

    import jax

    import mooncake_jax as mj
    from mooncake_jax.model import rope
    from mooncake_jax.model.sequence import SamplingParams
    from mooncake_jax.model.steps import forward_step

    n = args.tokens
    llm = mj.LLM(args.model, prefill_chunk_size=n, max_batch=1, num_pages=n // 16 + 64)
    eng = llm.engine
    stage = eng.runner.stages[0]
    captured = {}
    real = type(stage).__call__

    def capture(self, inputs, step):
        captured["args"] = self.layout.place_inputs(self.index, (inputs, step.positions, step.batch,
                                                                 step.logits_index, step.sampling))
        captured["mode"] = step.mode
        return real(self, inputs, step)

    type(stage).__call__ = capture
    try:
        seq = eng.new_sequence(np.random.default_rng(0).integers(0, eng.cfg.vocab_size, n).tolist(),
                               SamplingParams(max_new_tokens=1))
        eng.admit(seq, cached_pages=[])
        eng.prefill(seq)
        eng.release(seq)
    finally:
        type(stage).__call__ = real
    res = dict(machine_info(), model=args.model, tokens=n, load_start=open("/proc/loadavg").read().split()[0])
    compiled = {}
    for name, flag in (("materialized", True), ("fused", False)):
        rope.MATERIALIZE_ANGLES = flag
        def step(graphdef, params, kv, inputs, positions, batch, logits_index, sampling, mode):
            # a function of its own per variant: jax's trace cache is keyed by the function
            return forward_step.__wrapped__(graphdef, params, kv, inputs, positions, batch, logits_index, sampling,
                                            mode)

        fresh = jax.jit(step, static_argnames=("graphdef", "mode"), donate_argnames=("kv",))
        t = time.perf_counter()
        compiled[name] = fresh.lower(stage.graphdef, stage.params, stage.kv, *captured["args"],
                                     mode=captured["mode"]).compile()
        res[f"{name}_compile_s"] = round(time.perf_counter() - t, 1)
    rope.MATERIALIZE_ANGLES = True
    kv, stage.kv = stage.kv, None
    times, logits = {name: [] for name in compiled}, {}
    try:
        for _ in range(args.repeats):
            for name, fn in compiled.items():
                time.sleep(0.2)
                t, c = time.perf_counter(), time.process_time()
                _, out, kv = fn(stage.params, kv, *captured["args"])
                logits[name] = np.asarray(out)
                times[name].append((time.perf_counter() - t, time.process_time() - c))
    finally:
        stage.kv = kv
    res["load_end"] = open("/proc/loadavg").read().split()[0]
    for name, ts in times.items():
        wall, cpu = [w for w, _ in ts], [c for _, c in ts]
        res[f"{name}_wall_min_s"] = round(min(wall), 4)
        res[f"{name}_wall_median_s"] = round(float(np.median(wall)), 4)
        res[f"{name}_cpu_median_s"] = round(float(np.median(cpu)), 4)
    res["cpu_median_ratio"] = round(res["materialized_cpu_median_s"] / res["fused_cpu_median_s"], 3)
    res["wall_min_ratio"] = round(res["materialized_wall_min_s"] / res["fused_wall_min_s"], 3)
    res["logits_max_abs_diff"] = float(np.abs(logits["materialized"] - logits["fused"]).max())
    write_json(res, args.json)


if __name__ == "__main__":
    main()
