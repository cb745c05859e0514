"""12 layers of 2048-token causal attention (small shape), variants of _one_sequence, alternated, CPU time."""
import time, sys, numpy as np
import jax, jax.numpy as jnp
from mooncake_jax.model import attention as A
T, HK, G, D = 2048, 4, 3, 64
MASKED = A.MASKED
def dot(a, b): return jnp.dot(a, b, preferred_element_type=jnp.float32)

def variant(qb, split_diag=False, ones_col=False, head_major=False):
    def f(q, k, v):
        _, t, hk, g, d = q.shape
        if head_major:
            qh = jnp.transpose(q[0], (1, 0, 2, 3)).reshape(hk, t * g, d)
            kh = jnp.transpose(k[0], (1, 0, 2)); vh = jnp.transpose(v[0], (1, 0, 2))
        heads = []
        for j in range(hk):
            if head_major:
                qj, kj, vj = qh[j], kh[j], vh[j]
            else:
                qj, kj, vj = q[0, :, j].reshape(t * g, d), k[0, :, j], v[0, :, j]
            if ones_col:
                vj1 = jnp.concatenate([vj, jnp.ones((t, 1), vj.dtype)], axis=1)
            blocks = []
            for start in range(0, t, qb):
                end = min(start + qb, t)
                qblk = qj[start * g:end * g]
                rows = start + jnp.arange((end - start) * g) // g
                if split_diag and start > 0:
                    s_off = dot(qblk, kj[:start].T)
                    s_dg = jnp.where(rows[:, None] >= jnp.arange(start, end)[None, :], dot(qblk, kj[start:end].T), MASKED)
                    m = jnp.maximum(s_off.max(-1, keepdims=True), s_dg.max(-1, keepdims=True))
                    e_off, e_dg = jnp.exp(s_off - m), jnp.exp(s_dg - m)
                    if ones_col:
                        o = dot(e_off, vj1[:start]) + dot(e_dg, vj1[start:end])
                        out, den = o[:, :d], o[:, d:]
                    else:
                        out = dot(e_off, vj[:start]) + dot(e_dg, vj[start:end])
                        den = e_off.sum(-1, keepdims=True) + e_dg.sum(-1, keepdims=True)
                else:
                    s = jnp.where(rows[:, None] >= jnp.arange(end)[None, :], dot(qblk, kj[:end].T), MASKED)
                    m = s.max(-1, keepdims=True); e = jnp.exp(s - m)
                    if ones_col:
                        o = dot(e, vj1[:end]); out, den = o[:, :d], o[:, d:]
                    else:
                        out = dot(e, vj[:end]); den = e.sum(-1, keepdims=True)
                blocks.append((out / den).reshape(end - start, g, d))
            heads.append(jnp.concatenate(blocks, 0))
        return jnp.stack(heads, 1)[None]
    return f

def twelve(f):
    def g(q, k, v):
        for _ in range(12):
            o = f(q, k, v); q = q + 1e-3 * o
        return q
    return jax.jit(g)

V = {
  "base128": variant(128),
  "qb64": variant(64),
  "split128": variant(128, split_diag=True),
  "ones128": variant(128, ones_col=True),
  "hm128": variant(128, head_major=True),
  "all128": variant(128, True, True, True),
  "all64": variant(64, True, True, True),
}
sel = sys.argv[1].split(",") if len(sys.argv) > 1 else list(V)
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((1, T, HK, G, D), np.float32) / 8)
k = jnp.asarray(rng.standard_normal((1, T, HK, D), np.float32)); v = jnp.asarray(rng.standard_normal((1, T, HK, D), np.float32))
ref = np.asarray(jax.jit(lambda q, k, v: A._one_sequence(q, k, v, None, None, jnp.zeros((1,), jnp.int32)))(q, k, v))
fns = {}
for name in sel:
    one = np.asarray(jax.jit(V[name])(q, k, v)); print(name, "max abs diff", float(np.abs(one - ref).max()), flush=True)
    t = time.perf_counter(); fns[name] = twelve(V[name]).lower(q, k, v).compile(); print(name, "compile", round(time.perf_counter() - t, 1), flush=True)
times = {n: [] for n in sel}
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 5):
    for name in sel:
        time.sleep(0.1)
        t, c = time.perf_counter(), time.process_time(); fns[name](q, k, v).block_until_ready()
        times[name].append((time.perf_counter() - t, time.process_time() - c))
for name, ts in times.items():
    print(f"{name:10s} wall min {min(w for w,_ in ts)*1e3:6.0f} ms  cpu median {np.median([c for _,c in ts])*1e3:6.0f} ms  cpu min {min(c for _,c in ts)*1e3:6.0f}")
print(open("/proc/loadavg").read())
