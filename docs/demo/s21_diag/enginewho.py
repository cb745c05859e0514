"""For the decode's long steps (D stamps), what ran on the CPUs while the engine thread was runnable; and the same
for the gateway loop thread between F and W of long read->write hops. usage: enginewho.py diagdir ps.txt"""
import sys, re, glob, collections, bisect
diagdir, pst = sys.argv[1:3]
sw = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+) next_prio=(\d+)")
wk = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_waking: comm=(.*?) pid=(\d+) prio=(\d+)")
tid2pid, comm, prio = {}, {}, {}
runs = collections.defaultdict(list); cur = {}
ev = collections.defaultdict(list)
for line in open(pst):
    m = sw.match(line)
    if m:
        pid, tid, cpu, t = int(m[1]), int(m[2]), int(m[3]), float(m[4])
        tid2pid[tid] = pid; nxt = int(m[10]); comm[nxt] = m[9]; comm[int(m[6])] = m[5]; prio[nxt] = int(m[11])
        if cpu in cur:
            s, tt = cur[cpu]; runs[cpu].append((s, t, tt))
        cur[cpu] = (t, nxt)
        ev[int(m[6])].append((t, "R" if m[8].startswith("R") else "S"))
        ev[nxt].append((t, "in"))
        continue
    m = wk.match(line)
    if m:
        ev[int(m[6])].append((float(m[4]), "wake"))
pidname = {}
for f in glob.glob("/proc/[0-9]*/cmdline"):
    pass
def who(tid):
    if tid == 0: return "idle"
    c = comm.get(tid, "?"); p = prio.get(tid, 0)
    return f"{c}[{tid2pid.get(tid,'?')}]p{p}"
def occupants(a, b, out):
    for cpu, lst in runs.items():
        i = bisect.bisect_left(lst, (a - 1.0,))
        for s, e, tid in lst[i:]:
            if s >= b: break
            if e > a: out[who(tid)] += (min(e, b) - max(a, s)) * 1e3
def states(tid, a, b, occ):
    evs = ev[tid]; state = "sleep"; acc = collections.Counter()
    i = bisect.bisect_left(evs, (a,))
    if i > 0:
        e = evs[i-1][1]; state = {"in": "run", "R": "runnable", "S": "sleep", "wake": "runnable"}[e]
    last = a
    for t, e in evs[i:]:
        if t > b: break
        acc[state] += t - last
        if state == "runnable": occupants(last, t, occ)
        last = t; state = {"in": "run", "R": "runnable", "S": "sleep", "wake": "runnable"}[e]
    acc[state] += b - last
    if state == "runnable": occupants(last, b, occ)
    return acc
D = []
F = {}
Wl = collections.defaultdict(list)
for f in glob.glob(diagdir + "/*.log"):
    for l in open(f):
        p = l.split()
        if p[0] == "D" and len(p) > 6: D.append((float(p[1]), float(p[2]), int(p[6])))
for k in ("long steps",):
    D.sort(key=lambda d: -(d[1] - d[0]))
    tot = collections.Counter(); occ = collections.Counter(); n = 0
    for a, b, tid in D[:60]:
        if b - a < 0.003: break
        n += 1
        tot.update(states(tid, a, b, occ))
    print(f"{n} decode steps over 3 ms: engine thread", {k: round(v*1e3, 1) for k, v in tot.items()}, "ms")
    print("  while it was runnable, the CPUs ran:", ", ".join(f"{k} {v:.1f}" for k, v in occ.most_common(14)))
