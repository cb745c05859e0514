import json, sys, glob, numpy as np, collections
trace, logdir, step = sys.argv[1], sys.argv[2], float(sys.argv[3])
G = collections.defaultdict(dict); D = []
for f in glob.glob(logdir + "/*.log"):
    for l in open(f):
        p = l.split()
        if p[0] == "G": G[p[1]][int(p[2])] = float(p[3])
        elif p[0] == "D": D.append((float(p[1]), float(p[2]), int(p[3])))
pg = np.array([b - a for rid, d in G.items() for i, b in d.items() if i - 1 in d for a in [d[i - 1]]])
t = json.load(open(trace))
cg = np.concatenate([np.diff(r["times"]) for r in t if r.get("times") and len(r["times"]) > 1])
for name, g in (("engine put gaps", pg), ("client gaps", cg)):
    print(name, len(g), "p50/p90/p99/p99.5/max over step:", *(round(np.percentile(g, q) / step, 2) for q in (50, 90, 99, 99.5, 100)))
D = np.array(D); d = D[:, 1] - D[:, 0]; between = D[1:, 0] - D[:-1, 1]
print("steps", len(D), "step wall p50/p99 ms", round(np.percentile(d, 50)*1e3, 2), round(np.percentile(d, 99)*1e3, 2),
      "| between steps (when < 20 ms) p50/p90/p99 ms", *(round(np.percentile(between[between < 0.02], q)*1e3, 2) for q in (50, 90, 99)))
