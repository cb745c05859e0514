"""Join T (engine put), F (gateway loop read) and C (client) per token; decompose the longest client gaps."""
import json, sys, glob, numpy as np
trace, logdir = sys.argv[1], sys.argv[2]
T, F, D, W = {}, {}, [], {}
for f in glob.glob(logdir + "/*.log"):
    for l in open(f):
        p = l.split()
        if p[0] == "T": T[(p[1], int(p[2]))] = float(p[3])
        elif p[0] == "F": F[(p[1], int(p[2]))] = (float(p[3]), float(p[4]), float(p[5]))
        elif p[0] == "W": W.setdefault(p[1].removeprefix("cmpl-"), []).append((float(p[2]), float(p[3]), float(p[4])))
        elif p[0] == "D": D.append((float(p[1]), float(p[2]), int(p[3]), float(p[4]), float(p[5])))
D.sort()
t = json.load(open(trace))
rows = []
for r in t:
    if r["status"] != "completed" or not r["times"]: continue
    rid = r["id"].removeprefix("cmpl-"); C = [r["started"] + x for x in r["times"]]
    for i in range(2, len(C)):
        k, kp = (rid, i), (rid, i - 1)
        ws = W.get(rid, [])
        if k in T and k in F and kp in T and kp in F and i < len(ws):
            rows.append((rid, i, C[i] - C[i-1], T[k] - T[kp], F[k][0] - F[kp][0], T[k], F[k][0], C[i], F[k][2] - F[kp][2], ws[i][0], ws[i][2] - ws[i-1][2]))
a = np.array([x[2:] for x in rows])
print("tokens", len(rows))
for n, col in [("client gap", 0), ("put gap", 1), ("feed-read gap", 2)]:
    print(f"{n:14s} p50 {np.percentile(a[:,col],50)*1e3:5.2f} p90 {np.percentile(a[:,col],90)*1e3:5.2f} p99 {np.percentile(a[:,col],99)*1e3:5.2f} ms")
for n, v in [("put->read", a[:,4]-a[:,3]), ("read->client", a[:,5]-a[:,4]), ("read->write", a[:,7]-a[:,4]), ("write->client", a[:,5]-a[:,7])]:
    print(f"{n:14s} p50 {np.percentile(v,50)*1e3:5.2f} p90 {np.percentile(v,90)*1e3:5.2f} p99 {np.percentile(v,99)*1e3:5.2f} max {v.max()*1e3:5.2f} ms")
steps = np.array([d[1]-d[0] for d in D]); print("steps", len(D), "wall p50/p90/p99 ms", np.round(np.percentile(steps,[50,90,99])*1e3,2))
order = np.argsort(-a[:,0])
print("longest client gaps (ms): client | put | read | put->read | read->write | write->client | loop wait between reads | loop wait between writes")
for k in order[:25]:
    x = a[k]
    print(f"{x[0]*1e3:6.2f} {x[1]*1e3:6.2f} {x[2]*1e3:6.2f} {(x[4]-x[3])*1e3:6.2f} {(x[7]-x[4])*1e3:6.2f} {(x[5]-x[7])*1e3:6.2f} {x[6]:6.2f} {x[8]:6.2f}")
