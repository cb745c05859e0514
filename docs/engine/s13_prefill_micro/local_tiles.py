"""The local (causal, no context) part of a 2048-token prefill's attention, `small` shape, 12 layers chained, in
variants against the library's (``_one_sequence``: 128-token query blocks, each one product over keys [:end]);
alternated rounds, CPU median. The variants live here, not in the library (none won on CPU time):

- ``<n>``: unrolled key tiles of n keys per query block (diagonal tile masked first, then full tiles unmasked,
  online softmax); ``<n>L``: the same with the full tiles in a fori_loop (dynamic slices behind a barrier);
- ``FL<n>``: fully looped flash: per head a scan over query blocks of n tokens, each a fori_loop over the
  n-key tiles below its diagonal tile (program size flat in T).

    PYTHONPATH=. python docs/engine/s13_prefill_micro/local_tiles.py none,FL256,512L [rounds]
"""
import sys, time, numpy as np, jax, jax.numpy as jnp
import mooncake_jax.model.attention as A
from mooncake_jax.model.attention import MASKED, _dot, _first, _update

T, HK, G, D = 2048, 4, 3, 64
LAYERS = 12


def tiled_block(q_blk, k, v, start, end, g, kt, loop):
    rows = start + jnp.arange((end - start) * g) // g
    if start < kt:
        s = jnp.where(rows[:, None] >= jnp.arange(end)[None, :], _dot(q_blk, k[:end].T), MASKED)
        return _first(s, v[:end], _dot)
    diag = (start // kt) * kt
    s = jnp.where(rows[:, None] >= jnp.arange(diag, end)[None, :], _dot(q_blk, k[diag:end].T), MASKED)
    p = _first(s, v[diag:end], _dot)
    if loop:
        def body(i, p):
            kk, vv = jax.lax.optimization_barrier((jax.lax.dynamic_slice_in_dim(k, i * kt, kt),
                                                   jax.lax.dynamic_slice_in_dim(v, i * kt, kt)))
            return _update(p, _dot(q_blk, kk.T), vv, _dot)
        return jax.lax.fori_loop(0, diag // kt, body, p)
    for i in range(diag // kt):
        p = _update(p, _dot(q_blk, k[i * kt:(i + 1) * kt].T), v[i * kt:(i + 1) * kt], _dot)
    return p


def tiled(q, k_new, v_new, kt, loop):
    _, t, hk, g, d = q.shape
    qb = A.query_block_size(t)
    heads = []
    for j in range(hk):
        qj = q[0, :, j].reshape(t * g, d)
        outs = []
        for start in range(0, t, qb):
            end = min(start + qb, t)
            p = tiled_block(qj[start * g: end * g], k_new[0, :, j], v_new[0, :, j], start, end, g, kt, loop)
            outs.append((p.acc / p.l).reshape(end - start, g, d))
        heads.append(jnp.concatenate(outs, axis=0))
    return jnp.stack(heads, axis=1)[None]


def flash(q, k_new, v_new, qb):
    _, t, hk, g, d = q.shape
    nq = t // qb
    rows = jnp.arange(qb * g) // g
    out = []
    for j in range(hk):
        qj = q[0, :, j].reshape(nq, qb * g, d)
        kj, vj = k_new[0, :, j].reshape(nq, qb, d), v_new[0, :, j].reshape(nq, qb, d)

        def q_block(_, i):
            q_blk = qj[i]
            s = jnp.where(rows[:, None] >= jnp.arange(qb)[None, :], _dot(q_blk, kj[i].T), MASKED)

            def tile(c, p):
                kk, vv = jax.lax.optimization_barrier((kj[c], vj[c]))
                return _update(p, _dot(q_blk, kk.T), vv, _dot)
            p = jax.lax.fori_loop(0, i, tile, _first(s, vj[i], _dot))
            return None, p.acc / p.l
        _, o = jax.lax.scan(q_block, None, jnp.arange(nq))
        out.append(o.reshape(t, g, d))
    return jnp.stack(out, axis=1)[None]


def variant(spec):
    empty = A.PagedBatch(jnp.zeros((1, 0), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.zeros((1, T), jnp.int32))
    if spec == "none":
        return lambda q, k, v: A._one_sequence(q, k, v, None, None, empty)
    if spec.startswith("FL"):
        return lambda q, k, v: flash(q, k, v, int(spec[2:]))
    return lambda q, k, v: tiled(q, k, v, int(spec.rstrip("L")), spec.endswith("L"))


def main():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, T, HK, G, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, T, HK, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, T, HK, D)), jnp.float32)
    print("load", open("/proc/loadavg").read().split()[0], flush=True)
    fns, outs = {}, {}
    for spec in sys.argv[1].split(","):
        attend = variant(spec)

        def f(q, k, v, attend=attend):
            for _ in range(LAYERS):
                q = q + 1e-3 * attend(q, k, v).astype(q.dtype)
            return q
        fns[spec] = jax.jit(f)
        t0 = time.perf_counter()
        outs[spec] = np.asarray(fns[spec](q, k, v))
        print(spec, "compile+run", round(time.perf_counter() - t0, 1), "s; max abs diff to the first",
              float(np.abs(outs[spec] - next(iter(outs.values()))).max()), flush=True)
    res, names = {n: [] for n in fns}, list(fns)
    for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 5):
        for n in (names if r % 2 == 0 else names[::-1]):
            time.sleep(0.1)
            w, c = time.perf_counter(), time.process_time()
            fns[n](q, k, v).block_until_ready()
            res[n].append((time.perf_counter() - w, time.process_time() - c))
    base = np.median([c for _, c in res[names[0]]])
    for n, ts in res.items():
        cm = np.median([c for _, c in ts])
        print(f"{n}: wall min {min(w for w, _ in ts) * 1e3:.0f} ms, cpu median {cm * 1e3:.0f} ms (x{cm / base:.3f}),"
              f" cpu min {min(c for _, c in ts) * 1e3:.0f}")
    print("load", open("/proc/loadavg").read())


if __name__ == "__main__":
    main()
