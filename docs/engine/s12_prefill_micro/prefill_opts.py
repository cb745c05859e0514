"""2048-token prefill program compiled with per-program XLA options, alternated in one process (CPU time)."""
import time, sys, numpy as np, jax
import mooncake_jax as mj
from mooncake_jax.model.sequence import SamplingParams
from mooncake_jax.model.steps import forward_step
n = 2048
llm = mj.LLM("small", prefill_chunk_size=n, max_batch=1, num_pages=n // 16 + 64)
eng = llm.engine; stage = eng.runner.stages[0]
prompt = np.random.default_rng(0).integers(0, 32000, n).tolist()
cap = {}
real = type(stage).__call__
def capture(self, inputs, step):
    cap["args"] = self.layout.place_inputs(self.index, (inputs, step.positions, step.batch, step.logits_index, step.sampling)); cap["mode"] = step.mode
    return real(self, inputs, step)
type(stage).__call__ = capture
seq = eng.new_sequence(prompt, SamplingParams(max_new_tokens=1)); eng.admit(seq, cached_pages=[]); eng.prefill(seq); eng.release(seq)
type(stage).__call__ = real
variants = {
    "default": {},
    "ynn_off": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "onednn": {"xla_cpu_use_onednn": True},
}
sel = sys.argv[1].split(",") if len(sys.argv) > 1 else list(variants)
low = forward_step.lower(stage.graphdef, stage.params, stage.kv, *cap["args"], mode=cap["mode"])
comp = {}
for k in sel:
    t = time.perf_counter(); comp[k] = low.compile(compiler_options=variants[k] or None); print(k, "compile", round(time.perf_counter() - t, 1), "s", flush=True)
kv = stage.kv; stage.kv = None
ref = None; times = {k: [] for k in sel}
for r in range(5):
    for k in sel:
        time.sleep(0.2)
        t, c = time.perf_counter(), time.process_time()
        nt, out, kv = comp[k](stage.params, kv, *cap["args"])
        out = np.asarray(out)
        times[k].append((time.perf_counter() - t, time.process_time() - c))
        if ref is None: ref = out
        elif r == 0: print(k, "max abs diff vs first", float(np.abs(out - ref).max()))
for k, ts in times.items():
    print(f"{k}: wall min {min(w for w,_ in ts):.3f} s, median {np.median([w for w,_ in ts]):.3f}, cpu median {np.median([c for _,c in ts]):.3f} s")
print(open("/proc/loadavg").read())
