import sys, re, collections, glob
pst, pid = sys.argv[1], int(sys.argv[2])
diag = sys.argv[3]
sw = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)")
wk = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_waking: comm=(.*?) pid=(\d+)")
run = collections.Counter(); n = collections.Counter(); comm = {}; start = {}; wakes = collections.Counter(); woke = collections.Counter()
tids = set()
for line in open(pst):
    m = sw.match(line)
    if m:
        t = float(m[4]); p, tid = int(m[1]), int(m[2])
        if p == pid: tids.add(tid); comm[tid] = m[5]
        if tid in start: run[tid] += t - start.pop(tid)
        start[int(m[10])] = t; n[int(m[10])] += 1
        continue
    m = wk.match(line)
    if m:
        wakes[int(m[6])] += 1
        if int(m[1]) == pid: woke[(int(m[2]), int(m[6]))] += 1
roles = {}
for f in glob.glob(diag + "/*.log"):
    for l in open(f):
        p = l.split()
        if p[0] == "L": roles[int(p[6])] = "loop"
        elif p[0] == "P": roles.setdefault(int(p[6]), "pump")
print("tid role comm run_ms switch_ins wakes")
for tid in sorted(tids, key=lambda t: -run[t])[:25]:
    print(tid, roles.get(tid, "-"), comm.get(tid), round(run[tid]*1e3, 1), n[tid], wakes[tid])
loop = [t for t, r in roles.items() if r == "loop"]
print("who woke the loop:", [(k[0], roles.get(k[0], comm.get(k[0])), v) for k, v in woke.most_common(60) if k[1] in loop][:12])
