"""Timeline of the engine thread and both CPUs for one long decode step. usage: steptl.py diagdir ps.txt rank"""
import sys, re, glob
diagdir, pst, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
D = []
for f in glob.glob(diagdir + "/*.log"):
    for l in open(f):
        p = l.split()
        if p[0] == "D" and len(p) > 6: D.append((float(p[1]), float(p[2]), int(p[6])))
D.sort(key=lambda d: -(d[1] - d[0]))
a, b, tid = D[rank]
print(f"step {1e3*(b-a):.2f} ms engine tid {tid}")
pat = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\S+): (.*)")
for line in open(pst):
    m = pat.match(line)
    if not m: continue
    t = float(m[4])
    if t < a - 0.0003 or t > b: continue
    ev = m[5]
    if ev == "sched_stat_runtime": continue
    body = m[6]
    body = re.sub(r"prev_prio=\d+ ", "", body)
    body = body.replace("comm=", "").replace("prev_", "").replace("next_", "")
    print(f"{1e3*(t-a):7.3f} cpu{m[3]} {m[2]:>6} {ev[6:]:8s} {body[:150]}")
