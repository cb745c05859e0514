"""Engine speed on an accelerator: a ``llama2-70b``-shaped slice of a few layers, against the device's own limits
measured in the same run.

Figures: the measured dense matmul rate in the model's dtype (square products of random data), the device's copy
bandwidth (``copy_gbps``: bytes of an array that an on-device ``a + 1`` reads, and writes, per second) and read
bandwidth (``read_gbps``: bytes a sum reads per second, nothing written: what a decode step mostly does); prefill
tokens/s and ``prefill_matmul_util`` (model FLOP/s over the measured matmul rate) at each prompt length; decode
tokens/s and ``decode_bw_util`` (bytes a step must read: weights + KV, per second, over the measured read
bandwidth) at each batch size. ``--attention`` picks the attention implementation (``ModelConfig.attention``;
``pallas`` is the kernel path on GPU / TPU, ``auto`` the portable xla one there). Goals (issue 2): prefill >= 0.5 of
the matmul rate, decode >= 0.6 of the copy bandwidth. The JSON file is rewritten after every figure, so a run cut
short still leaves what it measured.

    python benchmarks/engine_device.py --attention pallas --json results/engine_device.json   # GPU / TPU
    python benchmarks/engine_device.py --model small --layers 2 --dtype float32 --prefill 256 --batches 1,4  # CPU smoke
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, best_time, machine_info, top_ops_ms, write_json  # noqa: E402


def device_copy_gbps(nbytes: int, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    x = jnp.ones(nbytes // 2, jnp.bfloat16)
    f = jax.jit(lambda a: a + 1)  # reads and writes every byte once
    dt = best_time(lambda: f(x).block_until_ready(), repeats=repeats)
    return nbytes / dt / 1e9


def device_read_gbps(nbytes: int, repeats: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    x = jnp.ones(nbytes // 2, jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))  # reads every byte once, writes one number
    dt = best_time(lambda: f(x).block_until_ready(), repeats=repeats)
    return nbytes / dt / 1e9


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="llama2-70b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prefill", default="2048,4000")  # llama2-70b: a 4096-token context
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--matmul", type=int, default=8192, help="side of the square matmul for the peak")
    p.add_argument("--copy-mib", type=int, default=2048)
    p.add_argument("--attention", default="auto", help="ModelConfig.attention: auto, xla, pallas or cpu_kernel")
    p.add_argument("--pack-inputs", choices=("auto", "on", "off"), default="auto",
                   help="a step's host arrays as one transfer (Engine pack_inputs; auto: on except on CPU)")
    p.add_argument("--scan-layers", choices=("auto", "on", "off"), default="auto",
                   help="layers under lax.scan (Engine scan_layers; auto: scanned except on CPU)")
    p.add_argument("--trace", type=Path, default=None,
                   help="also trace 5 decode steps per batch into this folder: top_ops_ms_b<B> in the JSON")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from common import matmul_peak_gflops
    from mooncake_jax.model.host_memory import keep_large_blocks_on_heap
    from mooncake_jax.model.attention import resolve_impl
    from mooncake_jax.model.config import PRESETS
    from mooncake_jax.model.engine import Engine
    from mooncake_jax.model.llama import init_model
    from mooncake_jax.model.measure import decode_step_seconds, prefill_seconds

    prefill_lens = [int(x) for x in args.prefill.split(",") if x]  # --prefill "": decode only
    batches = [int(x) for x in args.batches.split(",") if x]
    if jax.default_backend() == "cpu":
        keep_large_blocks_on_heap()  # as the engine does; fresh mmap pages would halve the copy rate
    cfg = PRESETS[args.model].replace(n_layers=args.layers, dtype=args.dtype, block_size=16,
                                      attention=args.attention)
    res = dict(machine_info(), model=f"{args.model} x {args.layers} layers", dtype=args.dtype,
               attention=args.attention, attention_resolved=resolve_impl(args.attention))
    save = lambda: args.json and write_json(res, args.json, echo=False)
    res["matmul_gflops"] = round(matmul_peak_gflops(args.matmul, jnp.dtype(args.dtype)), 1)
    res["copy_gbps"] = round(device_copy_gbps(args.copy_mib << 20), 1)
    res["read_gbps"] = round(device_read_gbps(args.copy_mib << 20), 1)
    save()
    model = init_model(cfg, seed=0)
    pages = 8 + max(prefill_lens + [b * (args.context + 64) for b in batches]) // cfg.block_size
    choice = {"auto": None, "on": True, "off": False}
    engine = Engine(model, num_pages=pages, max_batch=max(batches + [1]),
                    prefill_chunk_size=max(prefill_lens + [args.context]), pack_inputs=choice[args.pack_inputs],
                    scan_layers=choice[args.scan_layers])
    res["pack_inputs"], res["scan_layers"] = engine.runner.stages[0].pack_inputs, engine.runner.scan
    rng = np.random.default_rng(0)
    weight_bytes = (cfg.param_count() - cfg.vocab_size * cfg.d_model) * cfg.param_dtype.itemsize
    for n in tqdm(prefill_lens, desc="prefill"):
        prompt = rng.integers(0, cfg.vocab_size, n).tolist()
        dt = min(prefill_seconds(engine, prompt) for _ in range(3))
        res[f"prefill_{n}_tok_s"] = round(n / dt, 1)
        res[f"prefill_{n}_matmul_util"] = round(cfg.prefill_flops(n) / dt / 1e9 / res["matmul_gflops"], 3)
        save()
    for b in tqdm(batches, desc="decode"):
        dt = decode_step_seconds(engine, rng, b, args.context, steps=8, repeats=2)
        kv = b * (args.context + 16) * cfg.kv_bytes_per_token()
        res[f"decode_b{b}_tok_s"] = round(b / dt, 1)
        res[f"decode_b{b}_bw_util"] = round((weight_bytes + kv) / dt / 1e9 / res["read_gbps"], 3)
        if args.trace is not None:
            import jax.profiler

            folder = args.trace / f"b{b}"
            decode_step_seconds(engine, rng, b, args.context, steps=5, repeats=1,
                                around=lambda: jax.profiler.trace(str(folder), create_perfetto_trace=True))
            res[f"top_ops_ms_b{b}"] = top_ops_ms(folder, steps=5)
        save()
    write_json(res, args.json)


if __name__ == "__main__":
    main()
