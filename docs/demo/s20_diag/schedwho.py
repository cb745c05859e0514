"""For the longest client gaps, what ran on the CPUs while the token's threads waited in the run queue.
usage: schedwho.py trace.json diagdir perf_sched.txt roles(pid=name,...) [top]"""
import sys, re, bisect, collections, json, glob
sys.argv += [""] * 0
trace, diagdir, pst, roles = sys.argv[1:5]
top = int(sys.argv[5]) if len(sys.argv) > 5 else 10
role = dict(kv.split("=") for kv in roles.split(","))
sw = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+) next_prio=(\d+)")
wk = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_waking: comm=(.*?) pid=(\d+) prio=(\d+)")
tid2pid, comm = {}, {}
runs = collections.defaultdict(list)  # cpu -> [(start, end, tid)]
cur = {}
wak = collections.defaultdict(list)
ins = collections.defaultdict(list)
for line in open(pst):
    m = sw.match(line)
    if m:
        pid, tid, cpu, t = int(m[1]), int(m[2]), int(m[3]), float(m[4])
        tid2pid[tid] = pid
        nxt = int(m[10]); comm[nxt] = m[9]; comm[int(m[6])] = m[5]
        if cpu in cur:
            s, tt = cur[cpu]; runs[cpu].append((s, t, tt))
        cur[cpu] = (t, nxt); ins[nxt].append(t)
        continue
    m = wk.match(line)
    if m:
        wak[int(m[6])].append(float(m[4]))
# pid of threads only seen as next: assume learned later when they switch out
def who(tid):
    pid = tid2pid.get(tid)
    return role.get(str(pid), f"{comm.get(tid,'?')}[{pid}]") + ("/" + comm.get(tid, "?") if tid else "/idle")
def occupants(a, b):
    out = collections.Counter()
    for cpu, lst in runs.items():
        for s, e, tid in lst:
            if e > a and s < b:
                out[who(tid) if tid else "idle"] += (min(e, b) - max(a, s)) * 1e3
    return out
def waited(tid, t):
    """(waking time, switch-in time) for the run of tid that covers time t."""
    i = bisect.bisect_right(ins[tid], t) - 1
    if i < 0: return None
    sin = ins[tid][i]
    j = bisect.bisect_right(wak[tid], sin) - 1
    return (wak[tid][j] if j >= 0 else None, sin)
# tokens
st = collections.defaultdict(dict)
for f in glob.glob(diagdir + "/*.log"):
    for l in open(f):
        p = l.split()
        if p[0] in "PL":
            st[(p[1].removeprefix("cmpl-"), int(p[2]))][p[0]] = (float(p[3]), int(p[6]))
        elif p[0] in "GYRZ":
            rid = p[1].removeprefix("cmpl-"); k = int(p[2])
            st[(rid, k)][p[0]] = float(p[3] if p[0] != "G" else p[4])
t = json.load(open(trace))
gaps = []
for r in t:
    if r["status"] != "completed" or not r["times"]: continue
    rid = r["id"].removeprefix("cmpl-"); C = [r["started"] + x for x in r["times"]]
    for i in range(1, len(C)):
        gaps.append((C[i] - C[i-1], rid, i, C[i]))
gaps.sort(reverse=True)
total = collections.Counter()
for g, rid, i, c in gaps[:top]:
    s = st.get((rid, i), {})
    print(f"gap {g*1e3:.1f} ms  {rid[:8]} token {i}")
    if "L" in s:
        lt, ltid = s["L"]
        w = waited(ltid, lt)
        if w and w[0]:
            occ = occupants(w[0], w[1]); total.update(occ)
            print(f"   loop thread runnable {1e3*(w[1]-w[0]):.2f} ms before running (P->L {1e3*(lt-s['P'][0]):.2f}); on the CPUs meanwhile:",
                  ", ".join(f"{k} {v:.1f}" for k, v in occ.most_common(6)))
print("all windows:", ", ".join(f"{k} {v:.1f}" for k, v in total.most_common(12)))
# timeline of one thread in a window: wakings (by whom) and switches
ev = collections.defaultdict(list)
for line in open(pst):
    m = sw.match(line)
    if m:
        t = float(m[4]); prev, nxt = int(m[6]), int(m[10])
        ev[prev].append((t, f"out({m[8]})"))
        ev[nxt].append((t, "in"))
        continue
    m = wk.match(line)
    if m:
        ev[int(m[6])].append((float(m[4]), f"woken by {who(int(m[2]))}:{m[2]}"))
def timeline(tid, a, b):
    return [(round((t - a) * 1e3, 2), e) for t, e in ev[tid] if a - 0.0005 <= t <= b]
print("\nloop-thread timelines in P..L (ms from P):")
for g, rid, i, c in gaps[:top]:
    s = st.get((rid, i), {})
    if "L" in s and "P" in s and s["L"][0] - s["P"][0] > 0.002:
        print(f"gap {g*1e3:.1f} P->L {1e3*(s['L'][0]-s['P'][0]):.2f}:", timeline(s["L"][1], s["P"][0], s["L"][0]))
print("\nP->L windows of the top gaps: loop running / runnable / sleeping ms; CPU occupants while runnable")
occ_all = collections.Counter(); tot = collections.Counter()
for g, rid, i, c in gaps[:top]:
    s = st.get((rid, i), {})
    if not ("L" in s and "P" in s): continue
    a, b, tid = s["P"][0], s["L"][0], s["L"][1]
    evs = sorted(e for e in ev[tid])
    # state at a: find last event before a
    state = "sleep"
    for t, e in evs:
        if t > a: break
        state = "run" if e == "in" else ("runnable" if e.startswith("woken") or e == "out(R)" else "sleep")
    last = a; acc = collections.Counter(); occ = collections.Counter()
    for t, e in evs:
        if t <= a: continue
        if t > b: break
        acc[state] += t - last
        if state == "runnable": occ.update(occupants(last, t))
        last = t
        state = "run" if e == "in" else ("runnable" if e.startswith("woken") or e == "out(R)" else "sleep")
    acc[state] += b - last
    if state == "runnable": occ.update(occupants(last, b))
    tot.update(acc); occ_all.update(occ)
    print(f"gap {g*1e3:.1f} P->L {1e3*(b-a):.2f}: " + " ".join(f"{k} {v*1e3:.2f}" for k, v in acc.items()) + " | " + ", ".join(f"{k} {v:.1f}" for k, v in occ.most_common(4)))
print("total:", {k: round(v*1e3, 1) for k, v in tot.items()}, "occupants:", ", ".join(f"{k} {v:.1f}" for k, v in occ_all.most_common(8)))
