"""Compile time of the engine's step programs for a ``llama2-70b``-shaped model at 8, 16 and 80 layers.

One prefill program (one sequence, a chunk of ``--chunk`` tokens over ``--ctx-pages`` context pages) and one decode
program (``--batch`` sequences, one token each, ``--ctx-pages`` context pages) of ``steps.forward_step`` for the
whole model as one stage, lowered from ``jax.ShapeDtypeStruct`` inputs (``abstract_model``: no weights, no KV cache
allocated) and compiled. The layers run under one ``lax.scan``, so the goal is 80 layers within 2x of 8 layers
(``compile_ratio_80_over_8 <= 2``). A one-layer program is compiled first and not counted, so the 8-layer figure
carries no one-time start-up cost. Each figure is the fastest of ``--repeats`` compiles (each repeat one more KV
page, so nothing comes from a cache; the least disturbed by other load on a shared machine). The CPU model is from
/proc/cpuinfo. Figures are lower + compile seconds (``lower_s_*`` is the tracing part). ``unrolled_compile_s_*``:
the same programs with the layers unrolled (how the engine runs them on CPU, and how every backend ran them
before the layers were stacked), for comparison.

    python benchmarks/compile.py --json results/compile.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, machine_info, write_json  # noqa: E402


def step_programs(cfg, num_pages: int, chunk: int, ctx_pages: int, batch: int, scan: bool = True):
    """(prefill args, decode args) of ``forward_step`` as abstract values for the whole model as one stage
    (layers scanned, or unrolled as the engine runs them on CPU)."""
    import jax
    from flax import nnx

    from mooncake_jax.model.attention import PagedBatch
    from mooncake_jax.model.kv_cache import kv_shape
    from mooncake_jax.model.llama import Stage, abstract_model
    from mooncake_jax.model.sampling import SamplingInputs

    graphdef, params = nnx.split(Stage(abstract_model(cfg), 0, cfg.n_layers, scan=scan))
    pages = jax.ShapeDtypeStruct(kv_shape(cfg, num_pages, cfg.n_layers), cfg.param_dtype)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)  # noqa: E731

    def args(b, t, logits_index):
        batch = PagedBatch(i32(b, ctx_pages), i32(b), i32(b, t))
        sampling = SamplingInputs(f32(b), f32(b), jax.ShapeDtypeStruct((b,), np.uint32), i32(b))
        return (graphdef, params, (pages, pages), i32(b, t), i32(b, t), batch, logits_index, sampling)

    return args(1, chunk, i32(1)), args(batch, 1, i32(batch))


def compile_seconds(args) -> tuple[float, float]:
    """(lower seconds, lower + compile seconds) of ``forward_step`` on abstract ``args``."""
    from mooncake_jax.model.steps import forward_step

    t0 = time.perf_counter()
    lowered = forward_step.lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t0


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="llama2-70b")
    p.add_argument("--layers", default="8,16,80", help="layer counts to compile (the first and last give the ratio)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens")
    p.add_argument("--ctx-pages", type=int, default=16, help="context pages per sequence (page-table width)")
    p.add_argument("--batch", type=int, default=8, help="decode batch")
    p.add_argument("--num-pages", type=int, default=64, help="KV pages per layer (abstract: nothing allocated)")
    p.add_argument("--repeats", type=int, default=2, help="compiles per figure (the fastest counts)")
    p.add_argument("--unrolled-layers", default="8,16",
                   help="layer counts also compiled unrolled (the engine's CPU form, and the form before scanning) "
                        "for comparison; empty for none (80 unrolled takes minutes)")
    args = p.parse_args()

    from tqdm import tqdm

    from mooncake_jax.model.config import PRESETS

    base = PRESETS[args.model]
    layers = [int(x) for x in args.layers.split(",")]
    res = dict(machine_info(), model=args.model, dtype=base.dtype, chunk=args.chunk,
               ctx_pages=args.ctx_pages, decode_batch=args.batch, num_pages=args.num_pages)
    for warm in step_programs(base.replace(n_layers=1), args.num_pages, args.chunk, args.ctx_pages, args.batch):
        compile_seconds(warm)  # one-time costs (backend start, first lowering) out of the figures
    for n in tqdm(layers, desc="compile"):
        figures = []
        for r in range(args.repeats):
            prefill, decode = step_programs(base.replace(n_layers=n), args.num_pages + r, args.chunk,
                                            args.ctx_pages, args.batch)
            figures.append(compile_seconds(prefill) + compile_seconds(decode))
        lower_p, total_p, lower_d, total_d = (min(f[i] for f in figures) for i in range(4))
        res[f"compile_s_prefill_{n}_layers"] = round(total_p, 3)
        res[f"compile_s_decode_{n}_layers"] = round(total_d, 3)
        res[f"lower_s_prefill_{n}_layers"] = round(lower_p, 3)
        res[f"lower_s_decode_{n}_layers"] = round(lower_d, 3)
        res[f"compile_s_{n}_layers"] = round(total_p + total_d, 3)
    unrolled = [int(x) for x in args.unrolled_layers.split(",") if x]
    for n in tqdm(unrolled, desc="compile unrolled"):
        prefill, decode = step_programs(base.replace(n_layers=n), args.num_pages, args.chunk, args.ctx_pages,
                                        args.batch, scan=False)
        (_, total_p), (_, total_d) = compile_seconds(prefill), compile_seconds(decode)
        res[f"unrolled_compile_s_prefill_{n}_layers"] = round(total_p, 3)
        res[f"unrolled_compile_s_decode_{n}_layers"] = round(total_d, 3)
        res[f"unrolled_compile_s_{n}_layers"] = round(total_p + total_d, 3)
    first, last = layers[0], layers[-1]
    res[f"compile_ratio_{last}_over_{first}"] = round(res[f"compile_s_{last}_layers"] / res[f"compile_s_{first}_layers"], 3)
    write_json(res, args.json)


if __name__ == "__main__":
    main()
