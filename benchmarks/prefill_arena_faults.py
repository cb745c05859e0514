"""Page faults and kernel time of the library's prefill attention (``--layers`` layers chained, ``--tokens`` tokens,
``small`` shape) in two fresh processes: "plain" (JAX first) and "engine" (a prefill instance's allocator settings,
``host_memory.share_one_arena``, applied before JAX starts its threads, so that they hold for XLA's threads).

XLA:CPU takes a call's temporaries as one block on the thread that runs it; in a thread's own arena (heaps of at most
64 MiB) a larger block is mapped afresh and unmapped each call (``model/host_memory.py``). Each process reports
per call: wall, process CPU, kernel time and minor faults (median of ``--calls`` after warm-up).

    PYTHONPATH=<tree> python benchmarks/prefill_arena_faults.py --json out.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import alternated_processes, arg_parser, load_average, machine_info, write_json  # noqa: E402

CHILD = r"""
import json, resource, sys, time
mode, tokens, layers, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, sys.argv[5])
if mode == "engine":
    from mooncake_jax.model.host_memory import share_one_arena
    share_one_arena()  # as a prefill instance does (instance/main.py), before JAX starts its threads
import numpy as np, jax, jax.numpy as jnp
from prefill_attn_variants import variants, KV, G, HD
att = variants()["library"]
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((1, tokens, KV, G, HD)), jnp.float32)
ks = jnp.asarray(rng.standard_normal((layers, 1, tokens, KV, HD)), jnp.float32)
vs = jnp.asarray(rng.standard_normal((layers, 1, tokens, KV, HD)), jnp.float32)
@jax.jit
def chained(q, ks, vs):
    for i in range(layers):
        q = q + att(q * HD ** -0.5, ks[i], vs[i])
    return q
for _ in range(3):
    chained(q, ks, vs).block_until_ready()
rows = []
for _ in range(calls):
    r0, w, c = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.process_time()
    chained(q, ks, vs).block_until_ready()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    rows.append((time.perf_counter() - w, time.process_time() - c, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt))
med = lambda i: float(np.median([r[i] for r in rows]))
print(json.dumps({"wall_median_ms": round(med(0) * 1e3, 1), "wall_min_ms": round(min(r[0] for r in rows) * 1e3, 1),
                  "cpu_median_ms": round(med(1) * 1e3, 1), "sys_median_ms": round(med(2) * 1e3, 1),
                  "minflt_median": int(med(3))}))
"""


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--calls", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2, help="plain/engine process pairs, alternated")
    args = p.parse_args()
    res = dict(machine_info(), tokens=args.tokens, layers=args.layers, calls=args.calls, load_start=load_average())
    res.update(alternated_processes(CHILD, ("plain", "engine"), args.rounds,
                                    [str(args.tokens), str(args.layers), str(args.calls)]))
    write_json(res, args.json)


if __name__ == "__main__":
    main()
