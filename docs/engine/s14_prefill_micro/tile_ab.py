"""Tile size of the looped local part against main's unrolled 128-token query blocks: one chunk of T new tokens,
no context, L layers chained, alternated rounds, CPU median (``LOCAL_TILE_TOKENS`` is read at trace time).

    PYTHONPATH=. python docs/engine/s14_prefill_micro/tile_ab.py --before /work/main/mooncake_jax/model/attention.py \
        --t 512 --tiles 128,256
"""
import argparse, importlib.util, json, time
import numpy as np, jax, jax.numpy as jnp
import mooncake_jax.model.attention as after

p = argparse.ArgumentParser()
p.add_argument("--before", required=True)
p.add_argument("--t", type=int, default=512)
p.add_argument("--tiles", default="128,256")
p.add_argument("--layers", type=int, default=12)
p.add_argument("--rounds", type=int, default=7)
p.add_argument("--json")
a = p.parse_args()
spec = importlib.util.spec_from_file_location("mooncake_jax.model.attention_before", a.before)
before = importlib.util.module_from_spec(spec); spec.loader.exec_module(before)
HK, G, D, BS, T = 4, 3, 64, 16, a.t
rng = np.random.default_rng(0)
mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
q, kn, vn = mk(1, T, HK, G, D), mk(1, T, HK, D), mk(1, T, HK, D)
kp = vp = mk(HK, T // BS + 2, BS, D)
batch = after.PagedBatch(jnp.zeros((1, 0), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1, T), jnp.int32))
res = {"t": T, "layers": a.layers, "load_start": open("/proc/loadavg").read().split()[0]}


def chain(mod, tile=None):
    def f(q, kn, vn, kp, vp, batch):
        for _ in range(a.layers):
            q = q + (1e-3 * mod.paged_attention(q, kn, vn, kp, vp, batch, 1.0)).astype(q.dtype)
        return q
    if tile is not None:
        after.LOCAL_TILE_TOKENS = tile
    compiled = jax.jit(f).lower(q, kn, vn, kp, vp, batch).compile()
    return compiled


fns = {"main": chain(before)}
for tile in [int(x) for x in a.tiles.split(",")]:
    fns[f"tile{tile}"] = chain(after, tile)
ref = np.asarray(fns["main"](q, kn, vn, kp, vp, batch))
for k, f in fns.items():
    res[f"{k}_max_abs_diff"] = float(np.abs(np.asarray(f(q, kn, vn, kp, vp, batch)) - ref).max())
ts = {k: [] for k in fns}
names = list(fns)
for r in range(a.rounds):
    for k in (names if r % 2 == 0 else names[::-1]):
        time.sleep(0.05)
        c = time.process_time()
        fns[k](q, kn, vn, kp, vp, batch).block_until_ready()
        ts[k].append(time.process_time() - c)
for k, v in ts.items():
    res[f"{k}_cpu_median_ms"] = round(float(np.median(v)) * 1e3, 1)
    res[f"{k}_cpu_ratio_over_main"] = round(float(np.median(v)) / float(np.median(ts["main"])), 3)
res["load_end"] = open("/proc/loadavg").read().split()[0]
print(json.dumps(res))
if a.json:
    json.dump(res, open(a.json, "w"), indent=1)
