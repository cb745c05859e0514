"""Variants of the one-chunk prefill attention (local causal part, no context) against the library and torch SDPA,
12 layers chained, `small` shape, alternated in one process (wall and process CPU time).

    PYTHONPATH=<tree> python attn_variants.py ROUNDS OUT.json [variant,...]
"""
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as fn

from mooncake_jax.model.attention import MASKED, PagedBatch, paged_attention

T, KV, G, HD, L = 2048, 4, 3, 64, 12


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def local(q, k, v, qb, split_diag=False, ones_sum=False):
    """q [1, T, KV, G, D] (scaled), k/v [1, T, KV, D] -> [1, T, KV, G, D]: per (kv head, query block) products."""
    _, t, hk, g, d = q.shape
    heads = []
    for j in range(hk):
        qj, kj, vj = q[0, :, j].reshape(t * g, d), k[0, :, j], v[0, :, j]
        if ones_sum:
            vj = jnp.concatenate([vj, jnp.ones((t, 1), vj.dtype)], axis=1)
        outs = []
        for start in range(0, t, qb):
            end = min(start + qb, t)
            q_blk = qj[start * g: end * g]
            rows = start + jnp.arange((end - start) * g) // g
            if split_diag and start > 0:
                s_off = _dot(q_blk, kj[:start].T)
                s_dg = jnp.where(rows[:, None] >= jnp.arange(start, end)[None, :], _dot(q_blk, kj[start:end].T), MASKED)
                m = jnp.maximum(s_off.max(-1, keepdims=True), s_dg.max(-1, keepdims=True))
                e_off, e_dg = jnp.exp(s_off - m), jnp.exp(s_dg - m)
                acc = _dot(e_off, vj[:start]) + _dot(e_dg, vj[start:end])
                l = None if ones_sum else e_off.sum(-1, keepdims=True) + e_dg.sum(-1, keepdims=True)
            else:
                s = jnp.where(rows[:, None] >= jnp.arange(end)[None, :], _dot(q_blk, kj[:end].T), MASKED)
                m = s.max(-1, keepdims=True)
                e = jnp.exp(s - m)
                acc = _dot(e, vj[:end])
                l = None if ones_sum else e.sum(-1, keepdims=True)
            if ones_sum:
                acc, l = acc[:, :d], acc[:, d:]
            outs.append((acc / l).reshape(end - start, g, d))
        heads.append(jnp.concatenate(outs, axis=0))
    return jnp.stack(heads, axis=1)[None]


def chained(att):
    @jax.jit
    def run(q, ks, vs):
        for i in range(L):
            q = q + att(q * HD ** -0.5, ks[i], vs[i])
        return q
    return run


rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((1, T, KV, G, HD)), jnp.float32)
ks = jnp.asarray(rng.standard_normal((L, 1, T, KV, HD)), jnp.float32)
vs = jnp.asarray(rng.standard_normal((L, 1, T, KV, HD)), jnp.float32)
pages = jnp.zeros((KV, 1, 16, HD), jnp.float32)
batch = PagedBatch(jnp.zeros((1, 0), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1, T), jnp.int32))


def lib(q, k, v):
    return paged_attention(q, k, v, pages, pages, batch, 1.0)


ALL = {
    "library": lib,
    "qb256": lambda q, k, v: local(q, k, v, 256),
    "qb64": lambda q, k, v: local(q, k, v, 64),
    "split_diag": lambda q, k, v: local(q, k, v, 128, split_diag=True),
    "ones_sum": lambda q, k, v: local(q, k, v, 128, ones_sum=True),
}
rounds, out_path = int(sys.argv[1]), sys.argv[2]
names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(ALL)
variants = {}
res = {"cpu_model": "AMD EPYC (Zen 3), 2 cores", "load_start": open("/proc/loadavg").read().split()[0]}
ref = None
for name in names:
    f = chained(ALL[name])
    t0 = time.perf_counter()
    out = np.asarray(f(q, ks, vs))
    res[f"{name}_compile_s"] = round(time.perf_counter() - t0, 1)
    ref = out if ref is None else ref
    res[f"{name}_max_abs_diff"] = float(np.abs(out - ref).max())
    variants[name] = (lambda f: lambda: f(q, ks, vs).block_until_ready())(f)
tq = torch.from_numpy(np.asarray(q)).reshape(1, T, KV * G, HD).transpose(1, 2)
tks, tvs = (torch.from_numpy(np.asarray(a)).transpose(2, 3) for a in (ks, vs))


def rep(x):
    return x[:, :, None].expand(1, KV, G, T, HD).reshape(1, KV * G, T, HD)


def torch_run():
    y = tq
    with torch.inference_mode():
        for i in range(L):
            y = y + fn.scaled_dot_product_attention(y, rep(tks[i]), rep(tvs[i]), is_causal=True)
    return y


variants["torch_sdpa"] = torch_run
torch_run()
times = {n: [] for n in variants}
for _ in range(rounds):
    for n, run in variants.items():
        time.sleep(0.2)
        w, c = time.perf_counter(), time.process_time()
        run()
        times[n].append((time.perf_counter() - w, time.process_time() - c))
res["load_end"] = open("/proc/loadavg").read().split()[0]
for n, ts in times.items():
    res[f"{n}_wall_min_ms"] = round(min(w for w, _ in ts) * 1e3, 1)
    res[f"{n}_wall_median_ms"] = round(float(np.median([w for w, _ in ts])) * 1e3, 1)
    res[f"{n}_cpu_median_ms"] = round(float(np.median([c for _, c in ts])) * 1e3, 1)
    res[f"{n}_cpu_ratio"] = round(res[f"{n}_cpu_median_ms"] / res["library_cpu_median_ms"], 3) if "library_cpu_median_ms" in res else None
json.dump(res, open(out_path, "w"), indent=1, sort_keys=True)
print(json.dumps(res, indent=1, sort_keys=True))
