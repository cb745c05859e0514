"""Experiment: prefill processes on core EXP_FLOAT_PREFILL only; a decode process's engine and XLA threads on core
EXP_FLOAT_DECODE only (after start); everything else floats on all cores."""
import os, sys, threading
def role():
    a = sys.argv
    return a[a.index("--role") + 1] if "--role" in a else None
def install():
    r = role()
    if r == "prefill":
        os.sched_setaffinity(0, {int(os.environ["EXP_FLOAT_PREFILL"])})
        print("exp_float: prefill on", os.sched_getaffinity(0), file=sys.stderr)
    elif r == "decode":
        core = {int(os.environ["EXP_FLOAT_DECODE"])}
        from mooncake_jax.instance import server as S
        start0 = S.InstanceServer.start
        def start(self, *a, **k):
            out = start0(self, *a, **k)
            eng = {t.native_id for t in threading.enumerate() if t.name.startswith("engine-")}
            n = 0
            for tid in map(int, os.listdir("/proc/self/task")):
                try:
                    comm = open(f"/proc/self/task/{tid}/comm").read().strip()
                except OSError:
                    continue
                if tid in eng or comm.startswith(("tf_", "XLA")):
                    os.sched_setaffinity(tid, core); n += 1
            print("exp_float: decode compute threads on", core, n, file=sys.stderr)
            return out
        S.InstanceServer.start = start
