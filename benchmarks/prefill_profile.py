"""Where a long prefill's time goes: prefill timing (wall and process CPU time) of the engine's own path, and, with
``--trace``, a jax.profiler perfetto trace of a few prefills summed per XLA op and grouped by what the op is in the
optimized HLO of the prefill program (each op named by its fusion kind and the jax op it came from).

The grouping reads the compiled program's text (``forward_step.lower(...).compile().as_text()`` of the very step
the engine runs), so every traced op name is mapped to its HLO instruction: a fusion's kind and what it computes.
CPU time (all threads of the process) moves less than wall time on a shared machine.

    python benchmarks/prefill_profile.py --tokens 2048 [--trace DIR] --json out.json
"""

from __future__ import annotations

import collections
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, machine_info, trace_events, write_json  # noqa: E402


def capture_prefill(eng, prompt, seen: dict | None = None):
    """(the stage, the lowered ``forward_step``, its placed arguments but params and kv) of the step the engine runs
    for ``prompt``'s prefill (its last chunk's, if several); ``seen`` (if given) receives the step's ``mode``."""
    from mooncake_jax.model.sequence import SamplingParams
    from mooncake_jax.model.steps import forward_step

    stage = eng.runner.stages[0]
    captured = {}
    real = stage.__class__.__call__

    def capture(self, inputs, step):
        captured["args"] = self.layout.place_inputs(self.index, (inputs, step.positions, step.batch,
                                                                 step.logits_index, step.sampling))
        captured["mode"] = step.mode
        return real(self, inputs, step)

    stage.__class__.__call__ = capture
    try:
        seq = eng.new_sequence(prompt, SamplingParams(max_new_tokens=1))
        eng.admit(seq, cached_pages=[])
        eng.prefill(seq)
        eng.release(seq)
    finally:
        stage.__class__.__call__ = real
    lowered = forward_step.lower(stage.graphdef, stage.params, stage.kv, *captured["args"], mode=captured["mode"])
    if seen is not None:
        seen["mode"] = captured["mode"]
    return stage, lowered, captured["args"]


def compiled_prefill_text(eng, prompt) -> str:
    """Optimized HLO of the program the engine runs for ``prompt``'s prefill (its last chunk's, if several)."""
    return capture_prefill(eng, prompt)[1].compile().as_text()


def op_names(hlo: str) -> dict[str, str]:
    """Instruction name -> "<fusion kind> <jax op name>" from the optimized HLO's text (e.g. ``ynn_fusion
    btd,df->btf/dot_general``: a YNNPACK product of the MLP's gate/up einsum; ``ynn_fusion reduce_max``: the
    softmax's max and exp, which YNNPACK fuses; ``add_concatenate_fusion concatenate``: query blocks joined)."""
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"^\s+(?:ROOT )?%?([\w.\-]+) = ", line)
        if not m:
            continue
        op = re.search(r'op_name="([^"]+)"', line)
        out[m.group(1)] = f"{m.group(1).split('.')[0]} " + (op.group(1).split("/", 1)[-1] if op else "?")
    return out


def shares(trace_dir: Path, hlo: str, runs: int) -> dict:
    """Thread-time per op kind (summed over XLA's worker threads, per traced run) from the newest perfetto trace
    under ``trace_dir``: XLA:CPU runs independent ops on both threads at once, so this is CPU time, not wall."""
    names = op_names(hlo)
    events = trace_events(trace_dir)
    ms, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in names:
            ms[names[e["name"]]] += e.get("dur", 0) / runs / 1e3
            count[names[e["name"]]] += 1
    total = sum(ms.values())
    return {"traced_thread_ms_per_prefill": round(total, 1),
            "by_op": {k: {"ms": round(v, 1), "share": round(v / total, 4), "ops": count[k] // runs}
                      for k, v in ms.most_common(30)}}


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="small")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=None, help="prefill_chunk_size (default: --tokens)")
    p.add_argument("--repeats", type=int, default=4, help="timed prefills")
    p.add_argument("--trace", type=Path, default=None, help="also trace 2 prefills into this folder")
    p.add_argument("--hlo", type=Path, default=None, help="write the prefill program's optimized HLO here")
    args = p.parse_args()

    import jax

    import mooncake_jax as mj
    from mooncake_jax.model.measure import prefill_seconds

    n = args.tokens
    llm = mj.LLM(args.model, prefill_chunk_size=args.chunk or n, max_batch=1, num_pages=n // 16 + 64)
    eng, rng = llm.engine, np.random.default_rng(0)
    prompt = rng.integers(0, eng.cfg.vocab_size, n).tolist()
    res = dict(machine_info(), model=args.model, tokens=n, chunk=args.chunk or n,
               load_start=open("/proc/loadavg").read().split()[0])
    t = time.perf_counter()
    prefill_seconds(eng, prompt)
    res["first_prefill_s_with_compile"] = round(time.perf_counter() - t, 2)
    wall, cpu = [], []
    for _ in range(args.repeats):
        c = time.process_time()
        wall.append(prefill_seconds(eng, prompt))
        cpu.append(time.process_time() - c)
    res["prefill_wall_min_s"] = round(min(wall), 4)
    res["prefill_wall_median_s"] = round(float(np.median(wall)), 4)
    res["prefill_cpu_median_s"] = round(float(np.median(cpu)), 4)
    res["prefill_tok_s_best"] = round(n / min(wall), 1)
    if args.trace is not None or args.hlo is not None:
        hlo = compiled_prefill_text(eng, prompt)
        if args.hlo is not None:
            args.hlo.write_text(hlo)
    if args.trace is not None:
        with jax.profiler.trace(str(args.trace), create_perfetto_trace=True):
            for _ in range(2):
                prefill_seconds(eng, prompt)
        res.update(shares(args.trace, hlo, runs=2))
    res["load_end"] = open("/proc/loadavg").read().split()[0]
    write_json(res, args.json)


if __name__ == "__main__":
    main()
