"""A 16-bit float engine's step time on this CPU against float32, beside the same ratio for a bare matmul.

XLA:CPU computes bfloat16 (and float16) matmuls slower than float32 ones (no native 16-bit float units on most x86
CPUs: it converts), so a bfloat16 step cannot be as fast as a float32 one; the limit this benchmark sets beside the
step ratio is the ratio of the step's own dense matmuls (every layer's projections and the LM head, at the step's
batch, chained in one program) in each dtype, measured in the same run. Anything the step ratio has beyond that is
overhead of the 16-bit cache (once: whole-cache copies at the programs' edges, issue 10's bfloat16 pass).

Figures (``tiny`` preset, ``prefill_chunk_size=64``, prompts of ~60 tokens, median of ``--steps`` decode steps
after three warm ones, in each of ``--rounds`` rounds that take every figure back to back; the median over rounds):

- ``decode_step_ms_{dtype}_b{B}`` for float32 and bfloat16 at each batch of ``--batches``;
- ``{dtype}_over_float32_b{B}`` (step ratio) and ``matmul_{dtype}_over_float32_b{B}`` (the limit);
- ``prefill_ms_{dtype}`` and ``layerwise_prefill_ms_{dtype}``: a ``--prefill``-token prompt, plain and layer by
  layer (layer hooks that load nothing and keep every saved layer, as a layer-wise prefill instance does), median
  of three a round, and their ratios to float32.

    python benchmarks/dtype_step.py --json docs/engine/dtype_step.json
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, machine_info, write_json  # noqa: E402

LOOPS = 100  # matmul chains per timed program
DTYPES = ("float32", "bfloat16")  # the engine's model dtypes (config.DTYPES); float16 is a KV-only dtype


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def step_matmuls(cfg, dtype: str, batch: int, loops: int):
    """A call running the decode step's dense matmuls alone (every layer's q/k/v/o, gate/up/down, the LM head) at
    ``batch`` rows, in ``dtype`` with float32 accumulation as the model computes them, ``loops`` times in one program
    (a ``fori_loop``, so dispatch does not hide the arithmetic)."""
    import jax
    import jax.numpy as jnp

    d, f, hq, hk = cfg.d_model, cfg.ffn_dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    rng = np.random.default_rng(0)
    w = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.05, dtype)  # noqa: E731
    layers = [(w(d, hq + 2 * hk), w(hq, d), w(d, 2 * f), w(f, d)) for _ in range(cfg.n_layers)]
    head = w(d, cfg.vocab_size)

    def chain(x, layers, head):
        for qkv, o, gate_up, down in layers:
            a = jnp.dot(x, qkv, preferred_element_type=jnp.float32).astype(x.dtype)
            x = x + jnp.dot(a[:, :hq], o, preferred_element_type=jnp.float32).astype(x.dtype)
            g = jnp.dot(x, gate_up, preferred_element_type=jnp.float32).astype(x.dtype)
            x = x + jnp.dot(g[:, :f] * g[:, f:], down, preferred_element_type=jnp.float32).astype(x.dtype)
        return jnp.dot(x, head, preferred_element_type=jnp.float32)

    @jax.jit
    def looped(x, layers, head):  # each chain's input depends on the last one's output: nothing is hoisted
        body = lambda i, x: x + chain(x, layers, head)[:, :d].astype(x.dtype) * 1e-3  # noqa: E731
        return jax.lax.fori_loop(0, loops, body, x)

    x = w(batch, d)
    return lambda: looped(x, layers, head).block_until_ready()


class KeepLayers:
    """Layer hooks of a layer-wise prefill that loads nothing and holds every layer's saved blocks."""

    def __init__(self):
        self.saved = {}

    def wait_for_layer_load(self, layer):
        return None

    def save_layer(self, layer, new_kv):
        self.saved[layer] = new_kv


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batches", default="2,8")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    import mooncake_jax as mj
    from mooncake_jax.model.sequence import SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    dtypes = args.dtypes.split(",")
    loadavg = lambda: open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else None  # noqa
    res = dict(machine_info(), model=args.model, batches=args.batches, steps=args.steps, rounds=args.rounds,
               prefill_tokens=args.prefill, code=mj.__file__, loadavg_start=loadavg())
    # Every engine is built first and the figures are taken in rounds, the dtypes of one figure back to back in
    # each round: on a shared machine whose load swings, a ratio of two phases minutes apart means little.
    engines = {dtype: mj.LLM(args.model, dtype=dtype, prefill_chunk_size=64).engine for dtype in dtypes}
    timers = {}
    for b in batches:
        for dtype, eng in engines.items():
            seqs = [eng.new_sequence(list(range(1, 60 + 7 * i)), SamplingParams(
                max_new_tokens=(args.rounds + 1) * (args.steps + 3) + 10, ignore_eos=True)) for i in range(b)]
            for s in seqs:
                eng.admit(s, cached_pages=[])
                eng.prefill(s)
            timers[f"decode_step_ms_{dtype}_b{b}"] = (lambda eng=eng, seqs=seqs: eng.decode(seqs), args.steps, 1)
        for dtype, eng in engines.items():
            timers[f"matmul_ms_{dtype}_b{b}"] = (step_matmuls(eng.cfg, dtype, b, LOOPS), 5, LOOPS)
    prompt = np.random.default_rng(1).integers(2, engines[dtypes[0]].cfg.vocab_size, args.prefill).tolist()
    for name, hooks in (("prefill", None), ("layerwise_prefill", KeepLayers)):
        for dtype, eng in engines.items():
            def once(eng=eng, hooks=hooks):
                seq = eng.new_sequence(prompt, SamplingParams(max_new_tokens=1))
                eng.admit(seq, cached_pages=[])
                eng.prefill(seq, hooks=hooks() if hooks else None)
                eng.block_until_ready()
                eng.release(seq)
            timers[f"{name}_ms_{dtype}"] = (once, 3, 1)
    samples = {key: [] for key in timers}
    for r in range(args.rounds):
        for key, (fn, repeats, per_call) in timers.items():
            samples[key].append(median_ms(fn, repeats, warmup=3 if r == 0 else 1) / per_call)
        print(f"round {r + 1}/{args.rounds}, load {loadavg()}", flush=True)
    for key, values in samples.items():
        res[key] = float(np.median(values))
    for dtype in dtypes:
        if dtype == "float32" or "float32" not in dtypes:
            continue
        for b in batches:
            step = res[f"decode_step_ms_{dtype}_b{b}"]
            res[f"{dtype}_over_float32_b{b}"] = step / res[f"decode_step_ms_float32_b{b}"]
            res[f"matmul_{dtype}_over_float32_b{b}"] = res[f"matmul_ms_{dtype}_b{b}"] / res[f"matmul_ms_float32_b{b}"]
        for name in ("prefill", "layerwise_prefill"):
            res[f"{name}_{dtype}_over_float32"] = res[f"{name}_ms_{dtype}"] / res[f"{name}_ms_float32"]
    res["loadavg_end"] = loadavg()
    write_json(res, args.json)


if __name__ == "__main__":
    main()
