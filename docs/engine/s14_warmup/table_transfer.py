"""Host cost of a decode step's context table by width: building it (numpy, as Engine._context_table) and putting
it on the device (jax.device_put + block), batch 64, 16 pages held per row, widths 32 .. 2048 (small's
max_pages_per_seq). Median of 200 after 20 warm-up."""
import json, statistics, sys, time
import jax
import numpy as np

def table(rows, width, held):
    t = np.zeros((rows, width), np.int32)
    for r in range(rows):
        t[r, :held] = np.arange(1, held + 1)
    return t

res = {"load_start": open("/proc/loadavg").read().split()[0]}
for width in (32, 64, 256, 2048):
    build, put = [], []
    for i in range(220):
        t0 = time.perf_counter(); t = table(64, width, 16); t1 = time.perf_counter()
        jax.device_put(t).block_until_ready(); t2 = time.perf_counter()
        if i >= 20:
            build.append(t1 - t0); put.append(t2 - t1)
    res[f"b64_w{width}_build_us"] = round(statistics.median(build) * 1e6, 1)
    res[f"b64_w{width}_put_us"] = round(statistics.median(put) * 1e6, 1)
    res[f"b64_w{width}_bytes"] = 64 * width * 4
res["load_end"] = open("/proc/loadavg").read().split()[0]
print(json.dumps(res, indent=1))
if len(sys.argv) > 1:
    open(sys.argv[1], "w").write(json.dumps(res, indent=1) + "\n")
