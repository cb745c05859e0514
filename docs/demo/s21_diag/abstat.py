import json, sys, numpy as np
d = json.load(open(sys.argv[1])); t = json.load(open(sys.argv[2]))
gaps = np.concatenate([np.diff(r["times"]) for r in t if r.get("times") and len(r["times"]) > 1])
step = d["decode_step_s"]
print(sys.argv[3], "p99/step", d["tbt_p99_over_step"], "tbt p50/p90/p99 ms", *(round(d[k]*1e3, 1) for k in ("tbt_p50_s", "tbt_p90_s", "tbt_p99_s")),
      "step", round(step*1e3, 2), "b", d["decode_batch_mean"], "| gaps p99/p99.5 over step", round(np.percentile(gaps, 99)/step, 2), round(np.percentile(gaps, 99.5)/step, 2), "slo", d["slo_attainment"], flush=True)
