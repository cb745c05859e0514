"""Per token: hops engine put (T) -> get (G) -> yield (Y) -> gateway run() out (R) -> pump hand-off (P) -> loop callback (L) -> SSE chunk (Z) -> client (C).
Loop thread's schedstat (run, runqueue-wait) between the loop-thread stamp before P and L."""
import json, sys, glob, bisect, numpy as np
trace, logdir = sys.argv[1], sys.argv[2]
top = int(sys.argv[3]) if len(sys.argv) > 3 else 20
G, Y, R, P, L, Z = {}, {}, {}, {}, {}, {}
loopst = []  # (t, run, wait) of loop-thread stamps
for f in glob.glob(logdir + "/*.log"):
    for l in open(f):
        p = l.split()
        k = p[0]
        if k == "G": G[(p[1], int(p[2]))] = (float(p[3]), float(p[4]))
        elif k == "Y": Y[(p[1], int(p[2]))] = float(p[3])
        elif k == "R": R[(p[1], int(p[2]))] = float(p[3])
        elif k in "PLZ":
            rid = p[1].removeprefix("cmpl-")
            v = (float(p[3]), float(p[4]), float(p[5]))
            {"P": P, "L": L, "Z": Z}[k][(rid, int(p[2]))] = v
            if k in "LZ": loopst.append(v)
loopst.sort()
lt = [x[0] for x in loopst]
t = json.load(open(trace))
rows = []
for r in t:
    if r["status"] != "completed" or not r["times"]: continue
    rid = r["id"].removeprefix("cmpl-"); C = [r["started"] + x for x in r["times"]]
    for i in range(1, len(C)):
        key = (rid, i)
        if all(key in d for d in (G, Y, R, P, L, Z)):
            rows.append((rid, i, G[key][0], G[key][1], Y[key], R[key], P[key][0], L[key][0], Z[key][0], C[i], C[i] - C[i-1], P[key], L[key]))
print("tokens matched", len(rows), "of", sum(len(r["times"]) - 1 for r in t if r["times"]))
a = np.array([x[2:10] for x in rows])
names = ["put->get", "get->yield", "yield->R", "R->P", "P->L", "L->Z", "Z->client", "put->client"]
hops = [a[:, k+1] - a[:, k] for k in range(7)] + [a[:, 7] - a[:, 0]]
for n, h in zip(names, hops):
    print(f"{n:12s} p50 {np.percentile(h,50)*1e3:6.2f} p90 {np.percentile(h,90)*1e3:6.2f} p99 {np.percentile(h,99)*1e3:6.2f} max {h.max()*1e3:6.2f} ms")
idx = {(x[0], x[1]): k for k, x in enumerate(rows)}
order = sorted(range(len(rows)), key=lambda k: -rows[k][10])
print("longest client gaps: gap | put-gap | hops (ms) | loop thread between stamp before P and L: run/wait ms")
for k in order[:top]:
    rid, i = rows[k][0], rows[k][1]
    prev = idx.get((rid, i - 1))
    pg = (a[k, 0] - a[prev, 0]) * 1e3 if prev is not None else float("nan")
    Pt, Lv = rows[k][11][0], rows[k][12]
    j = bisect.bisect_left(lt, Pt) - 1
    lr = lw = float("nan")
    if j >= 0:
        lr, lw = Lv[1] - loopst[j][1], Lv[2] - loopst[j][2]
    print(f"gap {rows[k][10]*1e3:5.1f} pg {pg:5.1f} | " + " ".join(f"{n}={h[k]*1e3:.1f}" for n, h in zip(names, hops)), f"| loop run {lr:.2f} wait {lw:.2f}")
