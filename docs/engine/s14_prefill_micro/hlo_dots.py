"""Every product of the xla prefill path a library call? Compiles ``paged_attention`` for one sequence (or a batch)
of the ``small`` shape and counts, in the optimized HLO, the fusions holding a dot by kind: ``kCustom`` is a
library (YNNPACK/Eigen) call, ``kLoop``/``kOutput`` with a dot inside is XLA:CPU's naive emitted loop.

    PYTHONPATH=. python docs/engine/s14_prefill_micro/hlo_dots.py --t 2048 --ctx 1536 --b 1
"""
import argparse, re, collections
import numpy as np, jax, jax.numpy as jnp
import mooncake_jax.model.attention as A

p = argparse.ArgumentParser()
p.add_argument("--t", type=int, default=2048)
p.add_argument("--ctx", type=int, default=0)
p.add_argument("--b", type=int, default=1)
p.add_argument("--dtype", default="float32")
a = p.parse_args()
HK, G, D, BS = 4, 3, 64, 16
dt = jnp.dtype(a.dtype)
pages = -(-a.ctx // BS)
width = 0 if pages == 0 else 1 << (pages - 1).bit_length()
rows = a.b * (pages + a.t // BS) + 2
s = lambda *shape, d=dt: jax.ShapeDtypeStruct(shape, d)
batch = A.PagedBatch(s(a.b, width, d=jnp.int32), s(a.b, d=jnp.int32), s(a.b, a.t, d=jnp.int32))
f = jax.jit(lambda *x: A.paged_attention(*x, scale=0.125))
hlo = f.lower(s(a.b, a.t, HK, G, D), s(a.b, a.t, HK, D), s(a.b, a.t, HK, D), s(HK, rows, BS, D),
              s(HK, rows, BS, D), batch).compile().as_text()
comps, cur = {}, None
for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m:
        cur = m.group(1); comps[cur] = []
    elif cur:
        comps[cur].append(line)
kinds = collections.Counter()
for body in comps.values():
    for line in body:
        m = re.search(r"fusion\(.*kind=(k\w+), calls=%?([\w.\-]+)", line)
        if m and any(" dot(" in l for l in comps.get(m.group(2), [])):
            kinds[m.group(1)] += 1
print(f"t {a.t} ctx {a.ctx} b {a.b} {a.dtype}: dot fusions by kind {dict(kinds)}; custom-calls",
      hlo.count("custom-call("), "; dot instructions", hlo.count(" dot("))
