"""Compile time of prefill attention alone, before (another checkout's attention.py, e.g. main) against after
(this checkout's): L layers chained as the model unrolls them, one chunk of T new tokens over C context tokens in a
power-of-two padded table; lowered from abstract shapes and compiled, alternated rounds, seconds (min / each).

    PYTHONPATH=. python docs/engine/s14_prefill_micro/compile_ab.py --before /work/main/mooncake_jax/model/attention.py \
        --t 2048 --ctx 0 --layers 12 --json out.json
"""
import argparse, importlib.util, json, time
import jax, jax.numpy as jnp
import mooncake_jax.model.attention as after

p = argparse.ArgumentParser()
p.add_argument("--before", required=True)
p.add_argument("--shape", default="small")
p.add_argument("--t", default="2048", help="comma-separated chunk lengths")
p.add_argument("--ctx", default="0", help="comma-separated context lengths")
p.add_argument("--layers", type=int, default=12)
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--json")
a = p.parse_args()
spec = importlib.util.spec_from_file_location("mooncake_jax.model.attention_before", a.before)
before = importlib.util.module_from_spec(spec); spec.loader.exec_module(before)
HK, G, D = {"small": (4, 3, 64), "tiny": (2, 4, 16)}[a.shape]
BS = 16
s = lambda *shape, d=jnp.float32: jax.ShapeDtypeStruct(shape, d)
res = {"shape": a.shape, "layers": a.layers, "before": a.before, "load_start": open("/proc/loadavg").read().split()[0]}
for t in [int(x) for x in a.t.split(",")]:
    for c in [int(x) for x in a.ctx.split(",")]:
        pages = -(-c // BS)
        width = 0 if pages == 0 else 1 << (pages - 1).bit_length()
        rows = width + t // BS + 2
        args = (s(1, t, HK, G, D), s(1, t, HK, D), s(1, t, HK, D), s(HK, rows, BS, D), s(HK, rows, BS, D),
                after.PagedBatch(s(1, width, d=jnp.int32), s(1, d=jnp.int32), s(1, t, d=jnp.int32)))
        times = {"before": [], "after": []}
        for r in range(a.rounds):
            for name, mod in ([("before", before), ("after", after)] if r % 2 == 0 else
                              [("after", after), ("before", before)]):
                def f(q, kn, vn, kp, vp, batch, mod=mod):
                    for _ in range(a.layers):
                        q = q + (1e-3 * mod.paged_attention(q, kn, vn, kp, vp, batch, 1.0)).astype(q.dtype)
                    return q
                t0 = time.perf_counter()
                jax.jit(f).lower(*args).compile()
                times[name].append(round(time.perf_counter() - t0, 2))
        key = f"t{t}_ctx{c}"
        for name, ts in times.items():
            res[f"{key}_{name}_compile_s"] = ts
            res[f"{key}_{name}_compile_s_min"] = min(ts)
        res[f"{key}_compile_ratio_after_over_before"] = round(min(times["after"]) / min(times["before"]), 3)
        print(key, {k: v for k, v in res.items() if k.startswith(key)}, open("/proc/loadavg").read().split()[0],
              flush=True)
res["load_end"] = open("/proc/loadavg").read().split()[0]
if a.json:
    json.dump(res, open(a.json, "w"), indent=1)
