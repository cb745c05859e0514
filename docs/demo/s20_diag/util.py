import sys, re, collections
pst = sys.argv[1]; role = dict(kv.split("=") for kv in sys.argv[2].split(","))
sw = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+)")
cur = {}; run = collections.Counter(); t0 = t1 = None; tid2pid = {}; comm = {}
for line in open(pst):
    m = sw.match(line)
    if not m: continue
    pid, tid, cpu, t = int(m[1]), int(m[2]), int(m[3]), float(m[4])
    tid2pid[tid] = pid; comm[tid] = m[5]
    t0 = t0 or t; t1 = t
    if cpu in cur:
        s, tt = cur[cpu]; run[tt] += t - s
    cur[cpu] = (t, int(m[10]))
per = collections.Counter()
for tid, v in run.items():
    pid = tid2pid.get(tid, -1)
    name = "idle" if tid == 0 else role.get(str(pid), comm.get(tid, "?") + f"[{pid}]")
    per[name + "/" + ("xla" if "XLA" in comm.get(tid, "") else "other")] += v
wall = t1 - t0
print(f"window {wall:.1f} s x 2 cpus")
for k, v in per.most_common(20):
    print(f"{k:40s} {v:7.2f} s  {100*v/wall/2:5.1f}%")
