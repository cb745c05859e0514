"""The longest runnable waits of a thread (tid) during the replay, with what ran on its CPU meanwhile."""
import sys, re, collections
pst, tid0, t_from, t_to = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
sw = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch: prev_comm=(.*?) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(.*?) next_pid=(\d+) next_prio=(\d+)")
wk = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_waking: comm=(.*?) pid=(\d+) prio=(\d+) target_cpu=(\d+)")
mg = re.compile(r"\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_migrate_task: comm=(.*?) pid=(\d+) prio=(\d+) orig_cpu=(\d+) dest_cpu=(\d+)")
lines = [l for l in open(pst)]
since = None; cpu_of = None; waits = []
runs = collections.defaultdict(list); cur = {}
for l in lines:
    m = sw.match(l)
    if m:
        t = float(m[4]); cpu = int(m[3])
        if cpu in cur: runs[cpu].append((cur[cpu][0], t, cur[cpu][1], cur[cpu][2]))
        cur[cpu] = (t, int(m[10]), f"{m[9]}:{m[10]}:p{m[11]}")
        if int(m[6]) == tid0 and m[8].startswith("R"): since, cpu_of, kind = t, cpu, f"preempted by {m[9]}:{m[10]}"
        if int(m[10]) == tid0 and since is not None:
            if t_from <= since <= t_to: waits.append((t - since, since, t, cpu_of, cpu, kind))
            since = None
        continue
    m = wk.match(l)
    if m and int(m[6]) == tid0:
        since, cpu_of, kind = float(m[4]), int(m[8]), f"woken by {m[2]}"
        continue
    m = mg.match(l)
    if m and int(m[6]) == tid0 and since is not None:
        cpu_of = int(m[9])
waits.sort(reverse=True)
tot = sum(w[0] for w in waits)
print(f"{len(waits)} waits, total {tot*1e3:.1f} ms; longest:")
kinds = collections.Counter()
for w in waits: kinds[w[5].split(" by ")[0]] += w[0] * 1e3
print("by kind (ms):", dict(kinds))
for w, a, b, c0, c1, kind in waits[:12]:
    occ = collections.Counter()
    for cpu, lst in runs.items():
        for s, e, tid, name in lst:
            if e > a and s < b: occ[f"cpu{cpu} {name}"] += (min(e, b) - max(a, s)) * 1e3
    print(f"  {w*1e3:.2f} ms {kind} queued on cpu{c0} ran on cpu{c1}:", ", ".join(f"{k} {v:.2f}" for k, v in occ.most_common(6)))
