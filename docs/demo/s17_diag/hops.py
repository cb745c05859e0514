"""Per-token hop latencies: engine put (T) -> servicer get (G) -> yield (Y) -> gateway receive (R) -> SSE (S) -> client (C)."""
import json, sys, glob, collections, numpy as np
trace, logdir = sys.argv[1], sys.argv[2]
top = int(sys.argv[3]) if len(sys.argv) > 3 else 15
G, Y, R, S, D = {}, {}, {}, {}, []
for f in glob.glob(logdir + "/*.log"):
    for l in open(f):
        p = l.split()
        if p[0] == "G": G[(p[1], int(p[2]))] = (float(p[3]), float(p[4]))
        elif p[0] == "Y": Y[(p[1], int(p[2]))] = float(p[3])
        elif p[0] == "R": R[(p[1], int(p[2]))] = float(p[3])
        elif p[0] == "S": S[(p[1], int(p[2]))] = float(p[3])
        elif p[0] == "D": D.append((float(p[1]), float(p[2]), int(p[3]), float(p[4]), float(p[5])))
D = np.array(D)
t = json.load(open(trace))
rows = []  # per token (index>=1): put, get, yield, recv, sse, client
for r in t:
    if r["status"] != "completed" or not r["times"]: continue
    rid = r["id"].removeprefix("cmpl-"); C = [r["started"] + x for x in r["times"]]
    for i in range(1, len(C)):
        if (rid, i) in G and (rid, i) in Y and (rid, i) in R and (rid, i) in S:
            tp, tg = G[(rid, i)]
            rows.append((rid, i, tp, tg, Y[(rid, i)], R[(rid, i)], S[(rid, i)], C[i], C[i] - C[i - 1]))
print("tokens matched", len(rows), "of", sum(len(r["times"]) - 1 for r in t if r["times"]))
if not rows: sys.exit()
a = np.array([x[2:] for x in rows])
names = ["put->get", "get->yield", "yield->recv", "recv->sse", "sse->client", "put->client"]
hops = [a[:, 1] - a[:, 0], a[:, 2] - a[:, 1], a[:, 3] - a[:, 2], a[:, 4] - a[:, 3], a[:, 5] - a[:, 4], a[:, 5] - a[:, 0]]
for n, h in zip(names, hops):
    print(f"{n:12s} p50 {np.percentile(h,50)*1e3:6.2f} p90 {np.percentile(h,90)*1e3:6.2f} p99 {np.percentile(h,99)*1e3:6.2f} max {h.max()*1e3:6.2f} ms")
# inter-put gaps vs client gaps
order = sorted(range(len(rows)), key=lambda k: -rows[k][8])
print("longest client gaps: gap | put gap (engine) | hops of this token (ms)")
idx = {(x[0], x[1]): k for k, x in enumerate(rows)}
for k in order[:top]:
    rid, i = rows[k][0], rows[k][1]
    prev = idx.get((rid, i - 1))
    pg = (a[k, 0] - a[prev, 0]) * 1e3 if prev is not None else float("nan")
    ds = D[(D[:, 1] > a[k, 0] - 0.03) & (D[:, 0] < a[k, 5])] if len(D) else []
    print(f"gap {rows[k][8]*1e3:6.1f} put-gap {pg:6.1f} | " + " ".join(f"{n}={h[k]*1e3:.1f}" for n, h in zip(names, hops)),
          f"| steps in window {len(ds)}")
