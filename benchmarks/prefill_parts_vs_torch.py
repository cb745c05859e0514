"""The 2,048-token prefill's parts, ours (XLA:CPU) against torch on the same CPU, alternated in one process.

Parts (``small`` shape: d 768, 12 heads of 64, 4 KV heads, FFN 2048, 12 layers, float32):

- ``dense``: every layer's products, chained over 12 layers: q/k/v [T, 768] x [768, 768 | 256 | 256], o [T, 768] x
  [768, 768], gate and up [T, 768] x [768, 2048], down [T, 2048] x [2048, 768] (the activations stand in for the
  real ones; each layer's output feeds the next, so nothing runs ahead);
- ``gateup``: the gate/up product alone, 24 of them (12 layers x 2), the largest share of the prefill;
- ``attention``: 12 layers of causal attention over T tokens; ours is the engine's own path
  (``attention.paged_attention`` without context, as the prefill of one chunk runs it), torch's is
  ``scaled_dot_product_attention(is_causal=True)`` after Hugging Face's ``repeat_kv`` (what LlamaForCausalLM runs
  with ``attn_implementation="sdpa"``).

Each figure is the wall and process CPU time (all threads) of one call, the variants in turn with a 0.2 s pause
before each (torch's and XLA's worker threads stop spinning), ``--rounds`` rounds; medians and minima reported.

    python benchmarks/prefill_parts_vs_torch.py --parts dense,attention --rounds 5 --json out.json
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import (arg_parser, chunk_attention, interleaved, load_average, machine_info,  # noqa: E402
                    write_json)

D, H, KV, HD, F, L = 768, 12, 4, 64, 2048, 12


def dense_weights(rng):
    shapes = [(D, H * HD), (D, KV * HD), (D, KV * HD), (H * HD, D), (D, F), (D, F), (F, D)]
    return [[(rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for s in shapes] for _ in range(L)]


def jax_dense(ws, x):
    import jax
    import jax.numpy as jnp

    @jax.jit
    def run(ws, x):
        for wq, wk, wv, wo, wg, wu, wd in ws:
            q, k, v = x @ wq, x @ wk, x @ wv
            x = x + (q + jnp.tile(k + v, (1, H // KV))) @ wo
            x = x + ((x @ wg) * (x @ wu)) @ wd
        return x
    return lambda: run(ws, x).block_until_ready()


def torch_dense(torch, ws, x):
    ws = [[torch.from_numpy(w) for w in layer] for layer in ws]
    x = torch.from_numpy(x)

    def run():
        y = x
        with torch.inference_mode():
            for wq, wk, wv, wo, wg, wu, wd in ws:
                q, k, v = y @ wq, y @ wk, y @ wv
                y = y + (q + (k + v).repeat(1, H // KV)) @ wo
                y = y + ((y @ wg) * (y @ wu)) @ wd
        return y
    return run


def jax_gateup(ws, x):
    import jax

    @jax.jit
    def run(ws, x):
        acc = x
        for layer in ws:
            acc = acc + (acc @ layer[4])[:, :D] + (acc @ layer[5])[:, :D]
        return acc
    return lambda: run(ws, x).block_until_ready()


def torch_gateup(torch, ws, x):
    ws = [[torch.from_numpy(w) for w in layer] for layer in ws]
    x = torch.from_numpy(x)

    def run():
        with torch.inference_mode():
            acc = x
            for layer in ws:
                acc = acc + (acc @ layer[4])[:, :D] + (acc @ layer[5])[:, :D]
        return acc
    return run


def jax_attention(t, rng, impl: str):
    """12 layers of the engine's own prefill attention (one chunk, no context; ``impl`` as ``ModelConfig.attention``),
    chained through the queries."""
    import jax
    import jax.numpy as jnp

    q = jnp.asarray(rng.standard_normal((1, t, KV, H // KV, HD)), jnp.float32)
    ks = jnp.asarray(rng.standard_normal((L, 1, t, KV, HD)), jnp.float32)
    vs = jnp.asarray(rng.standard_normal((L, 1, t, KV, HD)), jnp.float32)

    @jax.jit
    def run(q, ks, vs):
        for i in range(L):
            q = q + chunk_attention(q, ks[i], vs[i], HD ** -0.5, impl)
        return q
    return run, (q, ks, vs)


def torch_attention(torch, qkv):
    import torch.nn.functional as fn

    q, ks, vs = (torch.from_numpy(np.asarray(a)) for a in qkv)
    t = q.shape[1]
    q = q.reshape(1, t, H, HD).transpose(1, 2)  # [1, H, T, D]: heads grouped by kv head, as ours
    ks = ks.transpose(2, 3)  # [L, 1, KV, T, D]
    vs = vs.transpose(2, 3)

    def repeat_kv(x):  # Hugging Face's: [1, KV, T, D] -> [1, H, T, D]
        return x[:, :, None].expand(1, KV, H // KV, t, HD).reshape(1, H, t, HD)

    def run():
        y = q
        with torch.inference_mode():
            for i in range(L):
                y = y + fn.scaled_dot_product_attention(y, repeat_kv(ks[i]), repeat_kv(vs[i]), is_causal=True)
        return y
    return run


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--parts", default="dense,gateup,attention")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--attention", default="auto", help="ours: ModelConfig.attention (auto, xla, cpu_kernel)")
    args = p.parse_args()
    import torch

    t, rng = args.tokens, np.random.default_rng(0)
    res = dict(machine_info(), tokens=t, attention=args.attention, torch=torch.__version__,
               torch_threads=torch.get_num_threads(), load_start=load_average())
    variants = {}
    parts = args.parts.split(",")
    if "dense" in parts or "gateup" in parts:
        ws = dense_weights(rng)
        x = (rng.standard_normal((t, D)) * 0.1).astype(np.float32)
        if "dense" in parts:
            variants["dense_ours"], variants["dense_torch"] = jax_dense(ws, x), torch_dense(torch, ws, x)
            res["dense_gflop"] = round(2 * t * L * (D * (H + 2 * KV) * HD + H * HD * D + 3 * D * F) / 1e9, 2)
        if "gateup" in parts:
            variants["gateup_ours"], variants["gateup_torch"] = jax_gateup(ws, x), torch_gateup(torch, ws, x)
            res["gateup_gflop"] = round(2 * t * L * 2 * D * F / 1e9, 2)
    if "attention" in parts:
        fn, qkv = jax_attention(t, rng, args.attention)
        variants["attention_ours"] = lambda: fn(*qkv).block_until_ready()
        variants["attention_torch"] = torch_attention(torch, qkv)
        out_ours = np.asarray(fn(*qkv))
        out_torch = variants["attention_torch"]().transpose(1, 2).reshape(out_ours.shape).numpy()
        res["attention_max_abs_diff"] = float(np.abs(out_ours - out_torch).max())
    for name, run in variants.items():  # warm-up (compile)
        t0 = time.perf_counter()
        run()
        res[f"{name}_first_s"] = round(time.perf_counter() - t0, 2)
    timed = interleaved(variants, args.rounds, pause_s=0.2)
    del timed["load_start"]  # (res's, taken before the set-up)
    res.update(timed)
    for part in parts:
        if f"{part}_ours_wall_min_ms" in res:
            for fig in ("wall_min", "wall_median", "cpu_median"):
                ours, torch_ms = res[f"{part}_ours_{fig}_ms"], res[f"{part}_torch_{fig}_ms"]
                res[f"{part}_torch_over_ours_{fig}"] = round(torch_ms / ours, 3)
            if f"{part}_gflop" in res:
                res[f"{part}_ours_gflops"] = round(res[f"{part}_gflop"] / res[f"{part}_ours_wall_min_ms"] * 1e3, 1)
                res[f"{part}_torch_gflops"] = round(res[f"{part}_gflop"] / res[f"{part}_torch_wall_min_ms"] * 1e3, 1)
    write_json(res, args.json)


if __name__ == "__main__":
    main()
