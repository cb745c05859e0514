"""Engine speed on this CPU, set against the machine's own limits measured in the same run.

On the ``small`` preset (about 125M parameters, float32):

- prefill tokens/s at 512 and 2048 tokens, ``prefill_mfu`` = model FLOP/s over the measured matmul peak;
- decode tokens/s at batch 1, 8, 32 and 64 (512-token contexts) beside the roofline of the same step: the bytes it
  must read (every weight but the embedding table, plus each sequence's KV) against the measured memcpy bandwidth,
  and its FLOPs (2 per weight per token, the LM head, attention over the context) against the measured matmul
  rate. ``decode_roofline_ratio_b{B}`` = roofline time / measured step time (1.0 = at the machine's limit) and
  ``decode_bound_b{B}`` names the binding limit ("bandwidth" or "compute"). ``decode_bw_util`` (batch 1) is the
  bandwidth part alone.

Goals (issue 10): decode batch 32 at >= 0.5 of its roofline; prefill_mfu >= 0.5 at 2048 tokens.

    python benchmarks/engine_cpu.py --json results/engine_cpu.json [--attention xla]

``--attention auto`` (the default, as for a user) runs decode and prefill attention through the C++ kernels on CPU
where they build (``attention_resolved`` in the JSON says which ran).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, machine_info, matmul_peak_gflops, memcpy_gbps, write_json  # noqa: E402


def decode_bytes_per_step(cfg, batch: int, context: int) -> float:
    """Weights every step reads (all but the embedding table, of which only ``batch`` rows) plus the KV."""
    weight_bytes = (cfg.param_count() - cfg.vocab_size * cfg.d_model * (not cfg.tie_embeddings)) * 4
    kv_bytes = batch * context * cfg.kv_bytes_per_token("float32")
    return weight_bytes + batch * cfg.d_model * 4 + kv_bytes


def decode_flops_per_step(cfg, batch: int, context: int) -> float:
    """Matmuls (2 FLOPs per weight per token, LM head included) plus attention scores and weighted sums."""
    dense = 2.0 * batch * (cfg.matmul_params_per_token() + cfg.d_model * cfg.vocab_size)
    attn = 2.0 * 2.0 * batch * context * cfg.n_heads * cfg.head_dim * cfg.n_layers
    return dense + attn


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="small")
    p.add_argument("--prefill", default="512,2048", help="prompt lengths for prefill")
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention", default="auto", help="attention implementation (ModelConfig.attention): auto, xla, "
                   "pallas or cpu_kernel")
    args = p.parse_args()

    import mooncake_jax as mj
    from mooncake_jax.model.attention import resolve_impl
    from mooncake_jax.model.measure import decode_step_seconds, prefill_seconds

    prefill_lens = [int(x) for x in args.prefill.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    res = dict(machine_info(), model=args.model, attention=args.attention,
               attention_resolved=resolve_impl(args.attention))
    bar = tqdm(total=2 + len(prefill_lens) + len(batches), desc="engine_cpu", unit="stage")
    res["matmul_peak_gflops"] = round(matmul_peak_gflops(), 1)
    bar.update()
    res["memcpy_gbps"] = round(memcpy_gbps(), 2)
    bar.update()

    llm = mj.LLM(args.model, prefill_chunk_size=max(prefill_lens), max_batch=max(batches), attention=args.attention,
                 num_pages=1 + max(batches) * (args.context // 16 + 8) + max(prefill_lens) // 16 + 8)
    eng, cfg = llm.engine, llm.config
    rng = np.random.default_rng(0)

    for n in prefill_lens:
        prompt = rng.integers(0, cfg.vocab_size, n).tolist()
        dt = min(prefill_seconds(eng, prompt) for _ in range(args.repeats + 1))  # the first run compiles
        res[f"prefill_{n}_tok_s"] = round(n / dt, 1)
        res[f"prefill_{n}_gflops"] = round(cfg.prefill_flops(n) / dt / 1e9, 1)
        res[f"prefill_mfu_{n}"] = round(cfg.prefill_flops(n) / dt / 1e9 / res["matmul_peak_gflops"], 3)
        bar.update()

    for b in batches:
        steps = 8
        dt = decode_step_seconds(eng, rng, b, args.context, steps=steps, repeats=args.repeats)
        ctx = args.context + 1 + (args.repeats + 1) * steps // 2  # the mean context over the timed steps
        bw_s = decode_bytes_per_step(cfg, b, ctx) / (res["memcpy_gbps"] * 1e9)
        flop_s = decode_flops_per_step(cfg, b, ctx) / (res["matmul_peak_gflops"] * 1e9)
        res[f"decode_tok_s_b{b}"] = round(b / dt, 1)
        res[f"decode_step_ms_b{b}"] = round(dt * 1e3, 2)
        res[f"decode_roofline_ms_b{b}"] = round(max(bw_s, flop_s) * 1e3, 2)
        res[f"decode_roofline_ratio_b{b}"] = round(max(bw_s, flop_s) / dt, 3)
        res[f"decode_bound_b{b}"] = "bandwidth" if bw_s >= flop_s else "compute"
        res[f"decode_bw_util_b{b}"] = round(bw_s / dt, 3)
        res[f"decode_mfu_b{b}"] = round(flop_s / dt, 3)
        bar.update()
    bar.close()
    res["prefill_mfu"] = res.get("prefill_mfu_2048")
    res["decode_bw_util"] = res.get("decode_bw_util_b1")
    write_json(res, args.json)


if __name__ == "__main__":
    main()
