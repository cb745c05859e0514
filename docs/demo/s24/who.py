"""For the decode engine's longest put gaps, what ran on each CPU while the engine thread was runnable-not-running,
per thread (ms). usage: who.py diagdir sched.txt [k]"""
import sys, re, glob, collections
diag, sched = sys.argv[1:3]; K = int(sys.argv[3]) if len(sys.argv) > 3 else 6
names, T, D = {}, [], []
for f in glob.glob(diag + "/*.log"):
    for l in open(f):
        p = l.split()
        if p[0] == "N": names[int(p[2])] = (int(p[1]), " ".join(p[3:]))
        elif p[0] == "T": T.append((float(p[3]), p[1], int(p[2])))
        elif p[0] == "D": D.append((float(p[1]), float(p[2]), int(p[6])))
eng = collections.Counter(d[2] for d in D).most_common(1)[0][0]
sw = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+) next_prio=(\d+)")
wk = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_waking: comm=(.*?) pid=(\d+)")
runs = []  # (cpu, start, end, tid)
cur = {}; comm = {}; pidof = {}
estate = []  # engine (t, state) R runnable, X running, S sleeping
for line in open(sched):
    m = sw.match(line)
    if m:
        cpu, t = int(m[3]), float(m[4]); prev, nxt = int(m[6]), int(m[10]); comm[nxt] = m[9]; comm[prev] = m[5]
        pidof[int(m[2])] = int(m[1])
        if cpu in cur: runs.append((cpu, cur[cpu][0], t, cur[cpu][1]))
        cur[cpu] = (t, nxt)
        if prev == eng: estate.append((t, "R" if m[8].startswith("R") else "S"))
        if nxt == eng: estate.append((t, "X"))
        continue
    m = wk.match(line)
    if m and int(m[6]) == eng: estate.append((float(m[4]), "R"))
def label(tid):
    if tid == 0: return "idle"
    n = names.get(tid)
    return f"{comm.get(tid,'?')}/{n[1] if n else '-'}[{n[0] if n else '?'}]"
by = collections.defaultdict(list)
for t, r, i in sorted(T): by[r].append((i, t))
gaps = sorted(((t1 - t0, t0, t1) for xs in by.values() for (i0, t0), (i1, t1) in zip(sorted(xs), sorted(xs)[1:]) if i1 >= 2), reverse=True)
# runnable intervals of the engine thread
rint = []; st = None
for t, s in sorted(estate):
    if s == "R" and st is None: st = t
    elif s in "XS" and st is not None: rint.append((st, t)); st = None
tot = collections.Counter()
for g, t0, t1 in gaps[:K]:
    c = collections.Counter(); rw = 0
    for a, b in rint:
        a, b = max(a, t0), min(b, t1)
        if b <= a: continue
        rw += b - a
        for cpu, s, e, tid in runs:
            if tid == eng: continue
            s2, e2 = max(s, a), min(e, b)
            if e2 > s2: c[(cpu, label(tid))] += e2 - s2
    print(f"gap {g*1e3:.2f} ms: engine runnable {rw*1e3:.2f} ms; meanwhile:", ", ".join(f"cpu{k[0]} {k[1]} {v*1e3:.2f}" for k, v in c.most_common(5)))
    tot.update(c)
print("engine tid", eng, label(eng))
print("over these gaps:", ", ".join(f"cpu{k[0]} {k[1]} {v*1e3:.2f}" for k, v in tot.most_common(12)))
