import sys, time, os, json
import numpy as np
import jax
import mooncake_jax as mj
from mooncake_jax.model.measure import decode_step_seconds
tp = int(sys.argv[1]); b = int(sys.argv[2]) if len(sys.argv) > 2 else 32
llm = mj.LLM("small", tensor_parallel=tp, prefill_chunk_size=512, max_batch=64,
             num_pages=1 + 64 * (512 // 16 + 8) + 512 // 16 + 8)
rng = np.random.default_rng(0)
t0 = time.process_time(); w0 = time.perf_counter()
dt = decode_step_seconds(llm.engine, rng, b, 512, steps=8, repeats=4)
print(json.dumps(dict(tp=tp, b=b, step_ms=round(dt*1e3, 2), devices=len(jax.devices()))))
