"""Which shapes ``demo --hetero`` should use: the tiny model's bfloat16 prefill (plain and layer-wise) and float32
decode step at 1-way and 2-way tensor parallelism over fake CPU devices, in-process, one JSON line per run.

    PYTHONPATH=. python benchmarks/hetero_shape_probe.py bfloat16 1 prefill   # dtype, tensor, prefill|decode

Used for demo --hetero's tenth pass (docs/benchmarks/demo.md). The engine has 256 KV pages: a bfloat16 prefill's
cost grows with the cache size (the same pass), so compare shapes at one size.
"""
import sys, time, json, os
import jax
jax.config.update("jax_num_cpu_devices", 4)
import numpy as np
from mooncake_jax.llm import build_model
from mooncake_jax.model.engine import Engine
from mooncake_jax.sharding.mesh import MeshSpec
from mooncake_jax.sharding.layout import MeshLayout
from mooncake_jax.model.measure import prefill_seconds, decode_step_seconds
from mooncake_jax.transfer.offload import LayerwisePrefill
from mooncake_jax.model.sequence import SamplingParams
dtype, tp, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = build_model("tiny", dtype=dtype, block_size=16 if dtype == "bfloat16" else 32, seed=0)
layout = MeshLayout(model.cfg, MeshSpec(stage=1, tensor=tp), jax.devices()[:tp]) if tp > 1 else None
eng = Engine(model, num_pages=256, max_batch=16, layout=layout)
rng = np.random.default_rng(0)
out = {"dtype": dtype, "tp": tp, "load": open("/proc/loadavg").read().split()[:3]}
if what == "prefill":
    for n in (64, 256, 512):
        p = rng.integers(0, model.cfg.vocab_size, n).tolist()
        t = time.perf_counter(); prefill_seconds(eng, p); c = time.perf_counter() - t
        out[f"plain_{n}"] = round(min(prefill_seconds(eng, p) for _ in range(3)), 4)
        lw = LayerwisePrefill(eng)
        def one():
            s = eng.new_sequence(p, SamplingParams(max_new_tokens=1)); t = time.perf_counter()
            lw.prefill(s, None); eng.block_until_ready(); d = time.perf_counter() - t; eng.release(s); return d
        one()
        out[f"layerwise_{n}"] = round(min(one() for _ in range(3)), 4)
else:
    for b in (1, 4):
        out[f"decode_b{b}"] = round(decode_step_seconds(eng, rng, b, 256, steps=5, repeats=3), 5)
print(json.dumps(out), flush=True)
