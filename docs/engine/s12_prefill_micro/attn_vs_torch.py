"""Attention of one layer at T=2048 (small shape): ours (xla impl, _one_sequence) vs torch SDPA causal (GQA as HF).
Also one layer's dense products at M=2048. Alternated rounds, CPU time + wall."""
import time, numpy as np, sys
import jax, jax.numpy as jnp, torch
from mooncake_jax.model import attention as A
T, HK, G, D = 2048, 4, 3, 64
rng = np.random.default_rng(0)
q = rng.standard_normal((1, T, HK, G, D), np.float32); k = rng.standard_normal((1, T, HK, D), np.float32)
v = rng.standard_normal((1, T, HK, D), np.float32)
LAYERS = 12
def ours_fn(q, k, v):
    outs = []
    for _ in range(LAYERS):  # 12 independent layers' worth (as the model unrolls)
        o = A._one_sequence(q, k, v, None, None, jnp.zeros((1,), jnp.int32))
        outs.append(o); q = q + 1e-3 * o.astype(q.dtype)
    return q
ours = jax.jit(ours_fn)
qj, kj, vj = map(jnp.asarray, (q, k, v))
tq = torch.from_numpy(q.reshape(1, T, HK * G, D)).transpose(1, 2).contiguous()
tk = torch.from_numpy(k).transpose(1, 2).contiguous(); tv = torch.from_numpy(v).transpose(1, 2).contiguous()
def torch_fn():
    x = tq
    with torch.inference_mode():
        for _ in range(LAYERS):
            kk = tk[:, :, None].expand(1, HK, G, T, D).reshape(1, HK * G, T, D)  # HF repeat_kv
            vv = tv[:, :, None].expand(1, HK, G, T, D).reshape(1, HK * G, T, D)
            o = torch.nn.functional.scaled_dot_product_attention(x, kk, vv, is_causal=True)
            x = x + 1e-3 * o
    return x
ours(qj, kj, vj).block_until_ready(); torch_fn()
# check agreement
o1 = np.asarray(jax.jit(lambda q,k,v: A._one_sequence(q,k,v,None,None,jnp.zeros((1,),jnp.int32)))(qj,kj,vj)).reshape(T, HK*G, D)
with torch.inference_mode():
    kk = tk[:, :, None].expand(1, HK, G, T, D).reshape(1, HK*G, T, D); vv = tv[:, :, None].expand(1, HK, G, T, D).reshape(1, HK*G, T, D)
    o2 = torch.nn.functional.scaled_dot_product_attention(tq, kk, vv, is_causal=True, scale=1.0)[0].transpose(0,1).numpy()
print("max abs diff", np.abs(o1 - o2).max())
res = {"ours": [], "torch": []}
for r in range(5):
    for name, fn in (("ours", lambda: ours(qj, kj, vj).block_until_ready()), ("torch", torch_fn)):
        time.sleep(0.2)
        t, c = time.perf_counter(), time.process_time(); fn()
        res[name].append((time.perf_counter() - t, time.process_time() - c))
flops = LAYERS * 2 * 2 * T * T / 2 * D * HK * G
for name, ts in res.items():
    w = min(x for x, _ in ts); cm = np.median([c for _, c in ts])
    print(f"{name}: wall min {w*1e3:.0f} ms ({flops/w/1e9:.0f} GFLOP/s causal), cpu median {cm*1e3:.0f} ms")
print(open('/proc/loadavg').read())
