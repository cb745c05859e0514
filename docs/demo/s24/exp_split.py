"""Experiment: a pinned instance's non-compute threads onto the cores it had before pinning."""
import os, sys, threading
def install():
    before = set(os.sched_getaffinity(0))
    from mooncake_jax.instance import server as S
    start0 = S.InstanceServer.start
    def start(self, *a, **k):
        out = start0(self, *a, **k)
        cpus = set(self.config.cpus or ())
        rest = before - cpus
        if cpus and rest:
            eng = {t.native_id for t in threading.enumerate() if t.name.startswith("engine-")}
            moved = []
            for tid in map(int, os.listdir("/proc/self/task")):
                try:
                    comm = open(f"/proc/self/task/{tid}/comm").read().strip()
                except OSError:
                    continue
                if tid in eng or comm.startswith(("tf_", "XLA", "llvm-worker")):
                    continue
                try:
                    os.sched_setaffinity(tid, rest); moved.append(comm)
                except OSError:
                    pass
            print("exp_split: moved", len(moved), "threads to", sorted(rest), "kept engine", eng, file=sys.stderr)
        return out
    S.InstanceServer.start = start
