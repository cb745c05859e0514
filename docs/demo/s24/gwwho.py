"""For the longest client gaps: from the engine's put (T) to the gateway's SSE write (W) of the token, what ran on
each CPU while the gateway loop thread was runnable-not-running (ms). usage: gwwho.py trace diag sched [k]"""
import sys, re, glob, json, collections
trace, diag, sched = sys.argv[1:4]; K = int(sys.argv[4]) if len(sys.argv) > 4 else 10
names, T, F, W = {}, {}, {}, {}
loop = None
for f in glob.glob(diag + "/*.log"):
    for l in open(f):
        p = l.split()
        if p[0] == "N": names[int(p[2])] = (int(p[1]), " ".join(p[3:]))
        elif p[0] == "T": T[(p[1], int(p[2]))] = float(p[3])
        elif p[0] == "F": F[(p[1], int(p[2]))] = float(p[3]); loop = int(p[6])
        elif p[0] == "W": W.setdefault(p[1].removeprefix("cmpl-"), []).append(float(p[2]))
sw = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+) next_prio=(\d+)")
wk = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_waking: comm=(.*?) pid=(\d+)")
runs = []; cur = {}; comm = {}; pidof = {}; prio = {}; st = []
for line in open(sched):
    m = sw.match(line)
    if m:
        cpu, t = int(m[3]), float(m[4]); prev, nxt = int(m[6]), int(m[10]); comm[nxt] = m[9]; prio[nxt] = int(m[11])
        pidof[int(m[2])] = int(m[1])
        if cpu in cur: runs.append((cpu, cur[cpu][0], t, cur[cpu][1]))
        cur[cpu] = (t, nxt)
        if prev == loop: st.append((t, "R" if m[8].startswith("R") else "S"))
        if nxt == loop: st.append((t, "X"))
        continue
    m = wk.match(line)
    if m and int(m[6]) == loop: st.append((float(m[4]), "R"))
rint = []; s0 = None
for t, s in sorted(st):
    if s == "R" and s0 is None: s0 = t
    elif s in "XS" and s0 is not None: rint.append((s0, t)); s0 = None
def label(tid):
    if tid == 0: return "idle"
    n = names.get(tid)
    return f"{comm.get(tid,'?')}/{n[1] if n else '-'}[{n[0] if n else pidof.get(tid,'?')}]p{prio.get(tid,'?')}"
rows = []
for r in json.load(open(trace)):
    if r["status"] != "completed" or not r["times"]: continue
    rid = r["id"].removeprefix("cmpl-"); C = [r["started"] + x for x in r["times"]]
    for i in range(2, len(C)):
        if (rid, i) in T and i < len(W.get(rid, [])):
            rows.append((C[i] - C[i-1], T[(rid, i)], W[rid][i], C[i]))
rows.sort(reverse=True)
tot = collections.Counter()
for g, t0, t1, c in rows[:K]:
    occ = collections.Counter(); rw = 0
    for a, b in rint:
        a, b = max(a, t0), min(b, t1)
        if b <= a: continue
        rw += b - a
        for cpu, s, e, tid in runs:
            s2, e2 = max(s, a), min(e, b)
            if e2 > s2 and tid != loop: occ[(cpu, label(tid))] += e2 - s2
    print(f"gap {g*1e3:.2f}: put->write {(t1-t0)*1e3:.2f} write->client {(c-t1)*1e3:.2f}; loop runnable {rw*1e3:.2f}:",
          ", ".join(f"cpu{k[0]} {k[1]} {v*1e3:.2f}" for k, v in occ.most_common(4)))
    tot.update(occ)
print("loop", loop, label(loop))
print("all:", "\n  ".join(f"cpu{k[0]} {k[1]} {v*1e3:.2f}" for k, v in tot.most_common(14)))
