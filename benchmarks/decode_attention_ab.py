"""Decode attention alone (the ``small`` preset's 12 layers at batch B over 512-token contexts), variants of the xla
decode loop interleaved in one process, so every variant sees the same load.

Each variant is one jitted program running ``attention._decode_xla``'s loop for every layer of a stacked cache laid
out as the engine lays it out (pages handed out by ``PageAllocator`` as the engine's admission does), with the loop's
chunking given by the variant: ``main`` (the module's loop as it stands), ``c<C>`` (C-page chunks up to the longest context, no tail: the
loop reads whole chunks) and ``c<C>t<K>`` (whole C-page chunks, then K-page chunks up to the longest context); a trailing ``s``
(``mains``) reads pages handed out in random order, as an engine's pages are after much reuse, instead of in
order; ``base`` is the ``_decode_xla`` of another ``attention.py`` given by ``--base``
(``decode_step_ab.load_decode``), with its own defaults; ``kernel`` (``kernels``) is the C++ kernel of
``model/cpu_kernel`` (``attention="cpu_kernel"``). Reports per variant the wall min and median and the
process CPU time median per call, and the pages each reads per sequence.

    python benchmarks/decode_attention_ab.py --batch 32 --context 529 --rounds 9 --json out.json
    python benchmarks/decode_attention_ab.py --variants base,main --base /tmp/base_attention.py --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, interleaved, machine_info, write_json  # noqa: E402


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--model", default="small")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=529, help="cached tokens per sequence (engine_cpu's mean)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=3, help="calls per variant per round")
    p.add_argument("--variants", default="c8,main")
    p.add_argument("--base", type=Path, default=None, help="attention.py of the ``base`` variant")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from mooncake_jax.model import attention, cpu_kernel
    from mooncake_jax.model.attention import PagedBatch
    from mooncake_jax.model.config import get_config
    from mooncake_jax.model.host_memory import keep_large_blocks_on_heap

    keep_large_blocks_on_heap()  # as the engine does on CPU: step temporaries reused, not mapped afresh

    cfg = get_config(args.model)
    b, ctx, bs = args.batch, args.context, cfg.block_size
    hk, g, d, n_layers = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    per_seq = -(-(ctx + 1) // bs)
    num_pages = 1 + b * per_seq + 8
    width = -(-cfg.max_seq_len // bs)
    rng = np.random.default_rng(0)

    def layer_tables(pages):
        table = np.zeros((b, width), np.int32)
        table[:, :per_seq] = pages.reshape(b, per_seq)
        return jnp.asarray(np.stack([table + layer * num_pages for layer in range(n_layers)]))

    in_order = layer_tables(np.arange(1, 1 + b * per_seq))  # as a fresh engine hands pages out
    shuffled = layer_tables(rng.permutation(np.arange(1, 1 + b * per_seq)))  # as after much reuse
    kp = jnp.asarray(rng.standard_normal((hk, n_layers * num_pages, bs, d), np.float32))
    vp = jnp.asarray(rng.standard_normal((hk, n_layers * num_pages, bs, d), np.float32))
    q = jnp.asarray(rng.standard_normal((b, 1, hk, g, d), np.float32) * 0.1)
    kn = jnp.asarray(rng.standard_normal((b, 1, hk, d), np.float32))
    vn = jnp.asarray(rng.standard_normal((b, 1, hk, d), np.float32))
    ctx_len = jnp.full((b,), ctx, jnp.int32)

    def kernel_decode(q, kn, vn, kp, vp, batch):
        return cpu_kernel.paged_decode(q[:, 0], kn[:, 0], vn[:, 0], kp, vp, batch.page_table, batch.ctx_len)[:, None]

    def program(name):
        """``main``: the module's loop as it is; ``c<C>``: chunks of C pages, no tail; ``c<C>t<K>``: then K-page
        chunks."""
        if name == "base":
            if args.base is None:
                raise SystemExit("the base variant needs --base")
            from decode_step_ab import load_decode

            decode, options = load_decode(args.base), {}
        elif name == "kernel":
            decode, options = kernel_decode, {}
        else:
            chunk, _, tail = name.removeprefix("c").partition("t")
            chunk = None if name == "main" else int(chunk)
            tail = int(tail) if tail else None if name == "main" else 0
            decode, options = attention._decode_xla, dict(tail_pages=tail, chunk_pages=chunk)

        def run(q, kn, vn, kp, vp, tables, ctx_len):
            out = 0.0
            for layer in range(n_layers):
                batch = PagedBatch(tables[layer], ctx_len, jnp.zeros((b, 1), jnp.int32))
                out = out + decode(q, kn, vn, kp, vp, batch, **options)
            return out

        return jax.jit(run).lower(*operands(name)).compile()

    def operands(name):
        return (q, kn, vn, kp, vp, shuffled if name.endswith("s") else in_order, ctx_len)

    variants = {name: program(name.removesuffix("s")) for name in args.variants.split(",")}
    refs = {}
    for name, f in variants.items():  # check every variant computes the same attention over the same table
        out = np.asarray(f(*operands(name)))
        first, ref = refs.setdefault(name.endswith("s"), (name, out))
        err = float(np.max(np.abs(out - ref)))
        if err > 1e-4:
            raise SystemExit(f"variant {name} differs from {first} by {err}")

    def call(name, f):
        return lambda: f(*operands(name)).block_until_ready()

    res = dict(machine_info(), model=args.model, batch=b, context=ctx, rounds=args.rounds,
               **interleaved({name: call(name, f) for name, f in variants.items()}, args.rounds, calls=args.calls))
    write_json(res, args.json)


if __name__ == "__main__":
    main()
