"""Engine speed on this CPU, set against the machine's own limits measured in the same run.

On the ``small`` preset (about 100M parameters, float32): prefill tokens/s at 512 and 2048 tokens with
``prefill_mfu`` = model FLOP/s over the measured matmul peak; decode tokens/s at batch 1, 8 and 32 with
``decode_bw_util`` = bytes a step must read (weights + KV) per second over the measured memcpy bandwidth.
Goals (issue 2): prefill_mfu >= 0.5 at 2048 tokens; decode_bw_util >= 0.5 at batch 1.

    python benchmarks/engine_cpu.py --json results/engine_cpu.json
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


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="small")
    p.add_argument("--prefill", default="512,2048", help="prompt lengths for prefill")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import mooncake_jax as mj
    from mooncake_jax.model.measure import decode_step_seconds, prefill_seconds

    prefill_lens = [int(x) for x in args.prefill.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    res = dict(machine_info(), model=args.model)
    bar = tqdm(total=2 + len(prefill_lens) + len(batches), desc="engine_cpu", unit="stage")
    res["matmul_peak_gflops"] = round(matmul_peak_gflops(), 1)
    bar.update()
    res["memcpy_gbps"] = round(memcpy_gbps(), 2)
    bar.update()

    llm = mj.LLM(args.model, prefill_chunk_size=max(prefill_lens), max_batch=max(batches),
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
        res[f"decode_b{b}_tok_s"] = round(b / dt, 1)
        res[f"decode_b{b}_step_ms"] = round(dt * 1e3, 2)
        res[f"decode_bw_util_b{b}"] = round(decode_bytes_per_step(cfg, b, ctx) / dt / 1e9 / res["memcpy_gbps"], 3)
        bar.update()
    bar.close()
    res["prefill_mfu"] = res.get("prefill_mfu_2048")
    res["decode_bw_util"] = res.get("decode_bw_util_b1")
    write_json(res, args.json)


if __name__ == "__main__":
    main()
