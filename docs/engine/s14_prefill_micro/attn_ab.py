"""Prefill attention alone, before (another checkout's attention.py, e.g. main) against after (this checkout's):
one chunk of T new tokens over a cached context of C tokens held in a power-of-two padded page table (as the
engine pads it), L layers' worth chained (as the model unrolls), alternated rounds, wall min and CPU median.

    python docs/engine/s13_prefill_micro/attn_ab.py --before /work/main/mooncake_jax/model/attention.py \
        --shape small --t 512 --ctx 0,512,1024,1536 --layers 12
"""
import argparse, importlib.util, json, sys, time
import numpy as np, jax, jax.numpy as jnp
import mooncake_jax.model.attention as after

p = argparse.ArgumentParser()
p.add_argument("--before", required=True)
p.add_argument("--shape", default="small")
p.add_argument("--t", type=int, default=512)
p.add_argument("--ctx", default="0,512,1024,1536")
p.add_argument("--layers", type=int, default=12)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--dtype", default="float32")
p.add_argument("--json")
a = p.parse_args()
spec = importlib.util.spec_from_file_location("mooncake_jax.model.attention_before", a.before)
before = importlib.util.module_from_spec(spec); spec.loader.exec_module(before)
HK, G, D = {"small": (4, 3, 64), "tiny": (2, 4, 16)}[a.shape]
BS, T, dt = 16, a.t, jnp.dtype(a.dtype)
rng = np.random.default_rng(0)
mk = lambda *s: jnp.asarray(rng.standard_normal(s), dt)
res = {"shape": a.shape, "t": T, "layers": a.layers, "dtype": a.dtype, "before": a.before,
       "load_start": open("/proc/loadavg").read().split()[0]}
print("devices", jax.devices(), "load", res["load_start"], flush=True)
for c in [int(x) for x in a.ctx.split(",")]:
    pages = -(-c // BS)
    width = 0 if pages == 0 else 1 << (pages - 1).bit_length()
    rows = pages + T // BS + 2
    q, kn, vn = mk(1, T, HK, G, D), mk(1, T, HK, D), mk(1, T, HK, D)
    kp, vp = mk(HK, rows, BS, D), mk(HK, rows, BS, D)
    table = jnp.asarray(np.r_[np.arange(1, pages + 1), np.zeros(width - pages)].astype(np.int32)[None])
    batch = after.PagedBatch(table, jnp.array([c], jnp.int32), jnp.zeros((1, T), jnp.int32))
    def chain(mod):
        def f(q, kn, vn, kp, vp, batch):
            for _ in range(a.layers):
                o = mod.paged_attention(q, kn, vn, kp, vp, batch, 1.0)
                q = q + (1e-3 * o).astype(q.dtype)
            return q
        return jax.jit(f)
    fns = {"before": chain(before), "after": chain(after)}
    t0 = time.perf_counter()
    outs = {k: np.asarray(f(q, kn, vn, kp, vp, batch), np.float64) for k, f in fns.items()}
    res[f"ctx{c}_compile_both_s"] = round(time.perf_counter() - t0, 1)
    res[f"ctx{c}_max_abs_diff"] = float(np.abs(outs["before"] - outs["after"]).max())
    ts = {k: [] for k in fns}
    for r in range(a.rounds):
        for k, f in (fns.items() if r % 2 == 0 else reversed(fns.items())):
            time.sleep(0.1)
            w, cpu = time.perf_counter(), time.process_time()
            f(q, kn, vn, kp, vp, batch).block_until_ready()
            ts[k].append((time.perf_counter() - w, time.process_time() - cpu))
    for k, v in ts.items():
        res[f"ctx{c}_{k}_wall_min_ms"] = round(min(x for x, _ in v) * 1e3, 1)
        res[f"ctx{c}_{k}_cpu_median_ms"] = round(float(np.median([y for _, y in v])) * 1e3, 1)
    res[f"ctx{c}_cpu_median_ratio_after_over_before"] = round(res[f"ctx{c}_after_cpu_median_ms"] / res[f"ctx{c}_before_cpu_median_ms"], 3)
    res[f"ctx{c}_wall_min_ratio_after_over_before"] = round(res[f"ctx{c}_after_wall_min_ms"] / res[f"ctx{c}_before_wall_min_ms"], 3)
    print(c, width, {k: v for k, v in res.items() if k.startswith(f"ctx{c}_")}, open("/proc/loadavg").read().split()[0], flush=True)
res["load_end"] = open("/proc/loadavg").read().split()[0]
if a.json:
    json.dump(res, open(a.json, "w"), indent=1)
