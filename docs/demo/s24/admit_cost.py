"""Time Engine.load_blocks on the tiny engine (CPU, sync dispatch like a decode instance)."""
import time, numpy as np, jax
jax.config.update("jax_cpu_enable_async_dispatch", False)
import mooncake_jax as mj
llm = mj.LLM("tiny")
eng = llm.engine
cfg = eng.cfg
print("block shape", cfg.block_shape(), "bytes/block", np.prod(cfg.block_shape()) * 4, "pages", eng.kv.num_pages if hasattr(eng.kv, "num_pages") else "?")
rng = np.random.default_rng(0)
k = 0
for n in (19, 64, 235):
    ts = []
    for rep in range(12):
        keys = [("x", k + i) for i in range(n)]; k += n
        blocks = rng.standard_normal((n,) + cfg.block_shape()).astype(np.float32)
        t = time.perf_counter(); eng.load_blocks(keys, blocks); eng.block_until_ready(); ts.append(time.perf_counter() - t)
    print(n, "blocks: ms min/median", round(min(ts[2:]) * 1e3, 3), round(np.median(ts[2:]) * 1e3, 3), "MB", round(blocks.nbytes / 1e6, 2))
import cProfile, pstats
keys = [("y", i) for i in range(19)]
blocks = rng.standard_normal((19,) + cfg.block_shape()).astype(np.float32)
pr = cProfile.Profile()
for rep in range(50):
    keys = [("y", rep * 100 + i) for i in range(19)]
    pr.enable(); eng.load_blocks(keys, blocks); pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
