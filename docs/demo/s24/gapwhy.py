"""For the decode engine's longest put gaps: the D (step) and Q (admission) records inside, with run/wait."""
import sys, glob
logdir = sys.argv[1]
T, D, Q = [], [], []
for f in glob.glob(logdir + "/*.log"):
    for l in open(f):
        p = l.split()
        if p[0] == "T": T.append((float(p[3]), p[1], int(p[2])))
        elif p[0] == "D": D.append((float(p[1]), float(p[2]), int(p[3]), float(p[4]), float(p[5])))
        elif p[0] == "Q": Q.append((float(p[1]), float(p[2]), int(p[3]), float(p[4]), float(p[5])))
T.sort(); D.sort(); Q.sort()
byreq = {}
for t, r, i in T: byreq.setdefault(r, []).append((i, t))
gaps = []
for r, xs in byreq.items():
    xs.sort()
    for (i0, t0), (i1, t1) in zip(xs, xs[1:]):
        if i1 >= 2: gaps.append((t1 - t0, r, i1, t0, t1))
gaps.sort(reverse=True)
for g, r, i, t0, t1 in gaps[:int(sys.argv[2]) if len(sys.argv) > 2 else 8]:
    print(f"gap {g*1e3:.2f} ms req {r[:8]} idx {i}")
    for d in D:
        if d[1] > t0 and d[0] < t1:
            print(f"   D {(d[0]-t0)*1e3:7.2f} +{(d[1]-d[0])*1e3:5.2f} batch {d[2]} run {d[3]:.2f} wait {d[4]:.2f}")
    for q in Q:
        if q[1] > t0 and q[0] < t1:
            print(f"   Q {(q[0]-t0)*1e3:7.2f} +{(q[1]-q[0])*1e3:5.2f} n {q[2]} run {q[3]:.2f} wait {q[4]:.2f}")
