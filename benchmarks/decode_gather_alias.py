"""Does the decode loop's page gather pay 4K aliasing? The gather alone (``attention._page_rows``: one chunk of the
``small`` preset at batch 32, 8 pages of 4 KiB rows per sequence and kv head, 4 MiB) timed into destination buffers
that sit at every offset the allocator hands out relative to the cache pages, modulo 4096.

Why: under the engine's allocator settings (``host_memory.keep_large_blocks_on_heap``) large blocks come from
glibc's heap, not page-aligned, and numpy's memcpy between two such buffers 16 bytes apart modulo a page ran at a
quarter of its speed (loads aliasing earlier stores of the same page offset; docs/benchmarks/engine.md, quiet
figures of the eighteenth session). Every row of the gather is one 4 KiB page, so its source and destination keep
one offset apart modulo 4096 for the whole copy: if some offsets were slow, the step would pay it on every chunk.

Each destination is a donated buffer (written in place, so no page faults: a fresh output would time the kernel's
faulting), one of ``--buffers`` allocated between small blocks of random size so that their offsets spread; the
buffers are cycled for ``--rounds`` rounds. Reports per offset (destination minus source, modulo 4096) the calls,
the min and median time, and over all offsets the spread of the mins and of the medians (on a loaded machine the
min is the figure: an offset that aliased would be slow in every call, its min too).

    python benchmarks/decode_gather_alias.py --json out.json
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, load_average, machine_info, write_json  # noqa: E402


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--buffers", type=int, default=48)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--pages", type=int, default=1400, help="pages in the cache (its size: pages x 16 KiB)")
    args = p.parse_args()

    from mooncake_jax.model.host_memory import keep_large_blocks_on_heap

    keep_large_blocks_on_heap()  # the engine's allocator settings on CPU (a decode process's: an arena per thread)
    import jax
    import jax.numpy as jnp

    from mooncake_jax.model.attention import _page_rows

    h, bs, d, b, chunk = 4, 16, 64, 32, 8  # small preset's kv heads, block, head dim; batch 32, 8-page chunks
    rng = np.random.default_rng(0)
    pages = jnp.asarray(rng.standard_normal((h, args.pages, bs, d), dtype=np.float32))
    table = jnp.asarray((rng.permutation(args.pages - 1)[: b * chunk] + 1).reshape(b, chunk).astype(np.int32))
    gather = jax.jit(lambda dst, p, t: dst.at[:].set(_page_rows(p, t)), donate_argnums=0)
    src = pages.unsafe_buffer_pointer()
    buffers, spacers = [], []
    for i in range(args.buffers):
        buffers.append(jnp.full((h * b * chunk, bs * d), float(i), jnp.float32))
        spacers.append(jnp.zeros((int(rng.integers(1, 1000)),), jnp.float32))  # moves the next buffer's offset
    expected = np.asarray(_page_rows(pages, table))
    times = collections.defaultdict(list)
    load_start = load_average()
    for _ in range(args.rounds):
        for i in range(len(buffers)):
            t = time.perf_counter()
            out = gather(buffers[i], pages, table)
            out.block_until_ready()
            times[(out.unsafe_buffer_pointer() - src) % 4096].append(time.perf_counter() - t)
            buffers[i] = out
    if not np.array_equal(np.asarray(buffers[0]), expected):
        raise SystemExit("the gather into a donated buffer differs from the plain gather")
    nbytes = h * b * chunk * bs * d * 4
    per_offset = {str(off): {"calls": len(ts), "min_ms": round(min(ts) * 1e3, 3),
                             "median_ms": round(float(np.median(ts)) * 1e3, 3),
                             "gbps_read": round(nbytes / float(np.median(ts)) / 1e9, 2)}
                  for off, ts in sorted(times.items())}
    medians = np.array([v["median_ms"] for v in per_offset.values()])
    mins = np.array([v["min_ms"] for v in per_offset.values()])
    res = dict(machine_info(), load_start=load_start, load_end=load_average(), bytes_per_gather=nbytes,
               offsets=len(per_offset), median_of_medians_ms=round(float(np.median(medians)), 3),
               slowest_median_ms=round(float(medians.max()), 3), fastest_median_ms=round(float(medians.min()), 3),
               slowest_over_median=round(float(medians.max() / np.median(medians)), 3),
               slowest_min_ms=round(float(mins.max()), 3), fastest_min_ms=round(float(mins.min()), 3),
               slowest_min_over_median_min=round(float(mins.max() / np.median(mins)), 3), per_offset=per_offset)
    write_json(res, args.json)


if __name__ == "__main__":
    main()
