"""Variants of the one-chunk prefill attention (local causal part, no context) against the library's and torch's
SDPA, ``--layers`` layers chained through the queries (``small`` shape: 4 KV heads x 3 queries, head_dim 64),
alternated in one process: wall and process CPU time (all threads) of each call, a 0.2 s pause before each.

Few layers keep the compiles short (the library's 12-layer program compiles in ~2 minutes on 2 cores); every
variant's output is compared with the library's. ``library`` is the xla implementation, ``kernel`` the C++ kernel
(``attention="cpu_kernel"``, what ``auto`` runs on CPU).

    PYTHONPATH=<tree> python benchmarks/prefill_attn_variants.py --layers 2 --rounds 7 --variants library,nomax
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import (arg_parser, chunk_attention, interleaved, load_average, machine_info,  # noqa: E402
                    write_json)

KV, G, HD = 4, 3, 64


def bdot(spec, a, b):
    """A batched product in float32."""
    import jax.numpy as jnp

    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def by_heads(q, k, v):
    """(T, K, G, D, queries [K, T*G, D] with rows (token, group), keys [K, T, D], values [K, T, D]) of one
    sequence's q [1, T, K, G, D], k and v [1, T, K, D]: the layout of the heads-batched variants."""
    import jax.numpy as jnp

    _, t, hk, g, d = q.shape
    return (t, hk, g, d, jnp.transpose(q[0], (1, 0, 2, 3)).reshape(hk, t * g, d),
            jnp.transpose(k[0], (1, 0, 2)), jnp.transpose(v[0], (1, 0, 2)))


def query_blocks(qh, t: int, g: int, qb: int, lo_min: int):
    """The heads-batched variants' query blocks: (start, end, the block's rows of ``qh`` [K, T*G, D], each row's
    token, the first key taken masked: 0, or ``start`` from ``lo_min`` on, the keys before it unmasked)."""
    import jax.numpy as jnp

    for start in range(0, t, qb):
        end = min(start + qb, t)
        yield (start, end, qh[:, start * g: end * g], start + jnp.arange((end - start) * g) // g,
               start if start >= lo_min else 0)


def variants():
    import jax
    import jax.numpy as jnp

    from mooncake_jax.model import attention as at

    def dot(a, b):
        return jnp.dot(a, b, preferred_element_type=jnp.float32)

    def library(q, k, v):
        """The xla implementation (the library's before the C++ kernels; ``kernel``: ``cpu_kernel``)."""
        return chunk_attention(q, k, v, 1.0, impl="xla")

    def tiled(q, k, v, qb=128, kt=None, shift=None, lo_min=512, kt_layout=False):
        """Per (kv head, query block): diagonal keys masked; keys before the block (from lo_min on) in tiles of
        kt keys (None: one tile), online softmax. shift="bound": subtract a per-row upper bound of the scores
        (|q| max|k|, minus 60, at least 0) instead of the running max: no max pass, no rescaling."""
        _, t, hk, g, d = q.shape
        heads = []
        for j in range(hk):
            qj, kj, vj = q[0, :, j].reshape(t * g, d), k[0, :, j], v[0, :, j]
            if kt_layout:  # keys transposed once per head: [D, T], each block's product a plain [R, D] x [D, S]
                kT = jax.lax.optimization_barrier(kj.T)

                def qk(q_blk, a, b):
                    return dot(q_blk, kT[:, a:b])
            else:
                def qk(q_blk, a, b):
                    return dot(q_blk, kj[a:b].T)
            if shift == "bound":
                knorm = jnp.sqrt((kj * kj).sum(-1))
                qnorm = jnp.sqrt((qj * qj).sum(-1, keepdims=True))
            outs = []
            for start in range(0, t, qb):
                end = min(start + qb, t)
                q_blk = qj[start * g: end * g]
                rows = start + jnp.arange((end - start) * g) // g
                lo = start if start >= lo_min else 0
                s = jnp.where(rows[:, None] >= jnp.arange(lo, end)[None, :], qk(q_blk, lo, end), at.MASKED)
                tiles = [] if not lo else [(a, min(a + (kt or lo), lo)) for a in range(0, lo, kt or lo)]
                if shift == "bound":
                    m = jnp.maximum(qnorm[start * g: end * g] * knorm[:end].max() - 60.0, 0.0)
                    e = jnp.exp(s - m)
                    l, acc = e.sum(-1, keepdims=True), dot(e, vj[lo:end])
                    for a, b in tiles:
                        e = jnp.exp(qk(q_blk, a, b) - m)
                        l, acc = l + e.sum(-1, keepdims=True), acc + dot(e, vj[a:b])
                else:
                    p = at._first(s, vj[lo:end], dot)
                    for a, b in tiles:
                        p = at._update(p, qk(q_blk, a, b), vj[a:b], dot)
                    l, acc = p.l, p.acc
                outs.append((acc / l).reshape(end - start, g, d))
            heads.append(jnp.concatenate(outs, axis=0))
        return jnp.stack(heads, axis=1)[None]

    def head_major(q, k, v, qb=128, lo_min=512):
        """The library's per-(head, block) 2-D products and masking, on queries, keys and values transposed once
        to head-major ([K, T*G, D], [K, T, D]): every block's operands are contiguous row ranges, where slicing a
        head out of [T, K, D] copied each block's keys and values (a strided slice) before its products."""
        t, hk, g, d, qh, kh, vh = by_heads(q, k, v)
        one = k[0, 0, 0, 0] * 0 + 1  # a runtime 1 (finite inputs): dividing by it is "expensive"
        kh, vh = kh / one, vh / one  # so XLA materialises each transpose once instead of fusing it into every slice
        heads = []
        for j in range(hk):
            outs = []
            for start, end, q_blk, rows, lo in query_blocks(qh[j:j + 1], t, g, qb, lo_min):
                q_blk = q_blk[0]
                s = jnp.where(rows[:, None] >= jnp.arange(lo, end)[None, :], dot(q_blk, kh[j, lo:end].T), at.MASKED)
                p = at._first(s, vh[j, lo:end], dot)
                if lo:
                    p = at._update(p, dot(q_blk, kh[j, :lo].T), vh[j, :lo], dot)
                outs.append((p.acc / p.l).reshape(end - start, g, d))
            heads.append(jnp.concatenate(outs, axis=0))
        return jnp.stack(heads, axis=1)[None]

    def heads_batched(q, k, v, qb=128, lo_min=512, shift=None, ones=False):
        """As ``tiled`` (one tile), but every product and softmax pass takes the KV heads at once (a batch axis):
        a quarter of the ops."""
        t, hk, g, d, qh, kh, vh = by_heads(q, k, v)
        if ones:  # the softmax sum as one more column of the weighted sum (no sum pass over the weights)
            vh = jnp.concatenate([vh, jnp.ones(vh.shape[:2] + (8,), vh.dtype)], axis=-1)

        if shift == "bound":
            knorm = jnp.sqrt((kh * kh).sum(-1))  # [K, T]
            qnorm = jnp.sqrt((qh * qh).sum(-1, keepdims=True))  # [K, T*G, 1]
        outs = []
        for start, end, q_blk, rows, lo in query_blocks(qh, t, g, qb, lo_min):
            s = bdot("krd,ksd->krs", q_blk, kh[:, lo:end])
            s = jnp.where(rows[:, None] >= jnp.arange(lo, end)[None, :], s, at.MASKED)
            if shift == "bound":
                m = jnp.maximum(qnorm[:, start * g: end * g] * knorm[:, :end].max(-1)[:, None, None] - 60.0, 0.0)
                e = jnp.exp(s - m)
                l, acc = (0 if ones else e.sum(-1, keepdims=True)), bdot("krs,ksd->krd", e, vh[:, lo:end])
                if lo:
                    e = jnp.exp(bdot("krd,ksd->krs", q_blk, kh[:, :lo]) - m)
                    l, acc = l + (0 if ones else e.sum(-1, keepdims=True)), acc + bdot("krs,ksd->krd", e, vh[:, :lo])
                if ones:
                    acc, l = acc[..., :d], acc[..., d:d + 1]
            else:
                def w(e, vals):
                    return bdot("krs,ksd->krd", e, vals)
                p = at._first(s, vh[:, lo:end], w)
                if lo:
                    p = at._update(p, bdot("krd,ksd->krs", q_blk, kh[:, :lo]), vh[:, :lo], w)
                l, acc = p.l, p.acc
            outs.append((acc / l).reshape(hk, end - start, g, d))
        return jnp.transpose(jnp.concatenate(outs, axis=1), (1, 0, 2, 3))[None]

    def keys_left(q, k, v, qb=128, lo_min=512):
        """As ``heads_batched``, with the scores laid out [K, S, R] (keys the left operand of the product, the
        softmax reductions over axis 1, the weighted sum contracting the weights' axis 1)."""
        t, hk, g, d, qh, kh, vh = by_heads(q, k, v)

        outs = []
        for start, end, q_blk, rows, lo in query_blocks(qh, t, g, qb, lo_min):
            s = bdot("ksd,krd->ksr", kh[:, lo:end], q_blk)
            s = jnp.where(jnp.arange(lo, end)[:, None] <= rows[None, :], s, at.MASKED)
            m = s.max(1, keepdims=True)
            if lo:
                s2 = bdot("ksd,krd->ksr", kh[:, :lo], q_blk)
                m = jnp.maximum(m, s2.max(1, keepdims=True))
            e = jnp.exp(s - m)
            l, acc = e.sum(1), bdot("ksr,ksd->krd", e, vh[:, lo:end])
            if lo:
                e = jnp.exp(s2 - m)
                l, acc = l + e.sum(1), acc + bdot("ksr,ksd->krd", e, vh[:, :lo])
            outs.append((acc / l[..., None]).reshape(hk, end - start, g, d))
        return jnp.transpose(jnp.concatenate(outs, axis=1), (1, 0, 2, 3))[None]

    def one_max(q, k, v, qb=128, lo_min=512):
        """As ``heads_batched``, but the diagonal and earlier keys share one max (no rescaling)."""
        t, hk, g, d, qh, kh, vh = by_heads(q, k, v)

        outs = []
        for start, end, q_blk, rows, lo in query_blocks(qh, t, g, qb, lo_min):
            s = bdot("krd,ksd->krs", q_blk, kh[:, lo:end])
            s = jnp.where(rows[:, None] >= jnp.arange(lo, end)[None, :], s, at.MASKED)
            m = s.max(-1, keepdims=True)
            if lo:
                s2 = bdot("krd,ksd->krs", q_blk, kh[:, :lo])
                m = jnp.maximum(m, s2.max(-1, keepdims=True))
            e = jnp.exp(s - m)
            l, acc = e.sum(-1, keepdims=True), bdot("krs,ksd->krd", e, vh[:, lo:end])
            if lo:
                e = jnp.exp(s2 - m)
                l, acc = l + e.sum(-1, keepdims=True), acc + bdot("krs,ksd->krd", e, vh[:, :lo])
            outs.append((acc / l).reshape(hk, end - start, g, d))
        return jnp.transpose(jnp.concatenate(outs, axis=1), (1, 0, 2, 3))[None]

    return {
        "library": library,
        "kernel": lambda q, k, v: chunk_attention(q, k, v, 1.0, impl="cpu_kernel"),
        "hm": head_major,
        "keys_left": keys_left,
        "one_max": one_max,
        "hb": heads_batched,
        "hb_nomax": lambda q, k, v: heads_batched(q, k, v, shift="bound"),
        "hb_nomax_ones": lambda q, k, v: heads_batched(q, k, v, shift="bound", ones=True),
        "hb64_nomax_ones": lambda q, k, v: heads_batched(q, k, v, qb=64, shift="bound", ones=True),
        "hb64": lambda q, k, v: heads_batched(q, k, v, qb=64),
        "hb_all": lambda q, k, v: heads_batched(q, k, v, lo_min=1),
        "hb256": lambda q, k, v: heads_batched(q, k, v, qb=256),
        "split": tiled,
        "nomax": lambda q, k, v: tiled(q, k, v, shift="bound"),
        "kt512": lambda q, k, v: tiled(q, k, v, kt=512),
        "kt512_nomax": lambda q, k, v: tiled(q, k, v, kt=512, shift="bound"),
        "kT": lambda q, k, v: tiled(q, k, v, kt_layout=True),
        "kT_nomax": lambda q, k, v: tiled(q, k, v, kt_layout=True, shift="bound"),
        "qb64": lambda q, k, v: tiled(q, k, v, qb=64),
        "qb256": lambda q, k, v: tiled(q, k, v, qb=256),
        "qb256_nomax": lambda q, k, v: tiled(q, k, v, qb=256, shift="bound"),
    }


_YNN = "xla_cpu_experimental_ynn_fusion_type"
OPTIONS = {  # per-compile XLA:CPU options, as ``variant@key``
    "dot": {_YNN: "LIBRARY_FUSION_TYPE_DOT"},
    "dot_elt": {_YNN: "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE"},
    "dot_elt_red": {_YNN: "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE"},
    "idot_elt_red": {_YNN: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE"},
    "dot_red": {_YNN: "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE"},
}


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--variants", default="library,nomax")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--engine-allocator", action="store_true",
                   help="a prefill instance's allocator settings first (host_memory.share_one_arena), so that they "
                        "hold for XLA's threads")
    args = p.parse_args()
    if args.engine_allocator:
        from mooncake_jax.model.host_memory import share_one_arena

        share_one_arena()  # before JAX starts its threads (model/host_memory.py)
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as fn

    t, n_layers = args.tokens, args.layers
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, t, KV, G, HD)), jnp.float32)
    ks = jnp.asarray(rng.standard_normal((n_layers, 1, t, KV, HD)), jnp.float32)
    vs = jnp.asarray(rng.standard_normal((n_layers, 1, t, KV, HD)), jnp.float32)
    res = dict(machine_info(), tokens=t, layers=n_layers, torch_threads=torch.get_num_threads(),
               engine_allocator=args.engine_allocator, load_start=load_average())
    table = variants()
    runs, ref = {}, None
    for name in args.variants.split(","):
        att = table[name.split("@")[0]]
        options = OPTIONS[name.split("@")[1]] if "@" in name else {}

        @jax.jit
        def chained(q, ks, vs, att=att):
            for i in range(n_layers):
                q = q + att(q * HD ** -0.5, ks[i], vs[i])
            return q

        t0 = time.perf_counter()
        chained = chained.lower(q, ks, vs).compile(compiler_options=options)
        out = np.asarray(chained(q, ks, vs))
        res[f"{name}_compile_s"] = round(time.perf_counter() - t0, 1)
        ref = out if ref is None else ref
        res[f"{name}_max_abs_diff"] = float(np.abs(out - ref).max())
        runs[name] = (lambda f: lambda: f(q, ks, vs).block_until_ready())(chained)
    if not args.no_torch:
        tq = torch.from_numpy(np.asarray(q)).reshape(1, t, KV * G, HD).transpose(1, 2)
        tks, tvs = (torch.from_numpy(np.asarray(a)).transpose(2, 3) for a in (ks, vs))

        def rep(x):  # Hugging Face's repeat_kv
            return x[:, :, None].expand(1, KV, G, t, HD).reshape(1, KV * G, t, HD)

        def torch_sdpa():
            y = tq
            with torch.inference_mode():
                for i in range(n_layers):
                    y = y + fn.scaled_dot_product_attention(y, rep(tks[i]), rep(tvs[i]), is_causal=True)
            return y

        out = torch_sdpa().transpose(1, 2).reshape(ref.shape).numpy()
        res["torch_sdpa_max_abs_diff"] = float(np.abs(out - ref).max())
        runs["torch_sdpa"] = torch_sdpa
    timed = interleaved(runs, args.rounds, pause_s=0.2)
    del timed["load_start"]  # (res's, taken before the set-up)
    res.update(timed)
    write_json(res, args.json)


if __name__ == "__main__":
    main()
