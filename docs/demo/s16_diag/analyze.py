import json, sys, glob, numpy as np
trace, logdir = sys.argv[1], sys.argv[2]
t = json.load(open(trace))
# decode log = the one with D lines
logs = {}
for f in glob.glob(logdir + "/*.log"):
    lines = [l.split() for l in open(f)]
    logs[f] = lines
dec = max(logs, key=lambda f: sum(1 for l in logs[f] if l[0] == "D"))
D = [(float(l[1]), float(l[2]), int(l[3]), float(l[4]), float(l[5]), float(l[6])) for l in logs[dec] if l[0] == "D"]
Q = [(float(l[1]), float(l[2]), int(l[3]), float(l[4]), float(l[5])) for l in logs[dec] if l[0] == "Q"]
D = np.array(D); Q = np.array(Q) if Q else np.zeros((0, 5))
print("decode steps", len(D), "median ms", np.median(D[:, 1] - D[:, 0]) * 1e3, "p99", np.percentile(D[:, 1] - D[:, 0], 99) * 1e3)
ev = []
for r in t:
    if r['status'] != 'completed' or not r['times'] or len(r['times']) < 2: continue
    ts = np.array(r['times']) + r['started']
    for i, g in enumerate(np.diff(ts)):
        ev.append((g, ts[i], ts[i + 1], r['request'], i))
ev.sort(reverse=True)
t0 = D[0, 0]
for g, a, b, req, i in ev[:int(sys.argv[3]) if len(sys.argv) > 3 else 15]:
    # steps whose end falls in (a - 0.03, b]
    ds = D[(D[:, 1] > a - 0.02) & (D[:, 0] < b)]
    qs = Q[(Q[:, 1] > a - 0.02) & (Q[:, 0] < b)]
    desc = " ".join(f"D[{(d[0]-a)*1e3:+.1f},{(d[1]-d[0])*1e3:.1f}ms b{int(d[2])} run{d[3]:.1f} wait{d[4]:.1f}]" for d in ds)
    descq = " ".join(f"Q[{(q[0]-a)*1e3:+.1f},{(q[1]-q[0])*1e3:.1f}ms n{int(q[2])} run{q[3]:.1f} wait{q[4]:.1f}]" for q in qs)
    print(f"gap {g*1e3:5.1f}ms req{req} #{i} at {a-t0:7.3f}: {desc} {descq}")
