"""CPU time per thread of one process over the perf sched record (ms), and wake-up counts."""
import sys, re, collections, glob
sched, pid = sys.argv[1], int(sys.argv[2]); diag = sys.argv[3] if len(sys.argv) > 3 else None
names = {}
if diag:
    for f in glob.glob(diag + "/*.log"):
        for l in open(f):
            p = l.split()
            if p[0] == "N": names[int(p[2])] = " ".join(p[3:])
sw = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)")
W = tuple(map(float, open(sys.argv[4]).read().split())) if len(sys.argv) > 4 else (0, 1e18)
cur = {}; cpu_t = collections.Counter(); n = collections.Counter(); comm = {}; pidof = {}
for line in open(sched):
    m = sw.match(line)
    if not m: continue
    cpu, t, prev, nxt = int(m[3]), float(m[4]), int(m[6]), int(m[10])
    pidof[int(m[2])] = int(m[1]); comm[nxt] = m[9]
    if cpu in cur:
        s, tid = cur[cpu]; a, b = max(s, W[0]), min(t, W[1])
        if b > a: cpu_t[tid] += b - a; n[tid] += 1
    cur[cpu] = (t, nxt)
mine = {t for t, p in pidof.items() if p == pid}
tot = sum(cpu_t[t] for t in mine)
print(f"process {pid}: {tot*1e3:.0f} ms CPU")
for t in sorted(mine, key=lambda t: -cpu_t[t])[:15]:
    print(f"  {t} {comm.get(t,'?'):16s} {names.get(t,'-'):32s} {cpu_t[t]*1e3:8.1f} ms  {n[t]} runs")
