"""Wall and CPU time of `small`'s 2048-token single-chunk prefill (the program hf_compare times); argv[1] on/off
sets attention.LOOPED_MIN_TOKENS before anything is traced."""
import sys, time, json
import numpy as np
from mooncake_jax.model import attention as A
A.LOOPED_MIN_TOKENS = 1024 if sys.argv[1] == "on" else 1 << 30
import mooncake_jax as mj
llm = mj.LLM("small", prefill_chunk_size=2048, prefix_caching=False)
prompt = [int(x) for x in np.random.default_rng(0).integers(1, 30000, 2048)]
out = []
for i in range(4):
    t = time.perf_counter(); c = time.process_time()
    llm.generate([prompt], max_new_tokens=1)
    out.append((round(time.perf_counter() - t, 3), round(time.process_time() - c, 3)))
print(sys.argv[1], out, flush=True)
