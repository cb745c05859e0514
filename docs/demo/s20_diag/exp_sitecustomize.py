"""Scratch experiments only (not the library): EXP_MODE selects a variant."""
import os, sys
mode = os.environ.get("EXP_MODE", "")
if mode:
    try:
        from mooncake_jax.instance import main as M
        _settle = M.settle_serving_process
        def settle(carries_tokens):
            _settle(carries_tokens)
            argv = " ".join(sys.argv)
            if "dswi" in mode and "--role decode" in argv:
                sys.setswitchinterval(float(mode.split("dswi")[1].split(",")[0]) / 1000)
            if "gwnice" in mode and " demo" in argv:
                for t in os.listdir("/proc/self/task"):
                    os.setpriority(os.PRIO_PROCESS, int(t), -5)
            if "gwcpu1" in mode and " demo" in argv:
                for t in os.listdir("/proc/self/task"):
                    os.sched_setaffinity(int(t), {1})
            if "gwswi" in mode and " demo" in argv:
                sys.setswitchinterval(float(mode.split("gwswi")[1].split(",")[0]) / 1000)
        M.settle_serving_process = settle
        if "gwcpu1" in mode:
            import mooncake_jax.demo as D
            _ci = D._count_into
            def _count_into(counter):
                os.sched_setaffinity(0, {0, 1})
                _ci(counter)
            D._count_into = _count_into
        if "gwnice" in mode or "gwswi" in mode:
            import mooncake_jax.demo as D
            D.settle_serving_process = settle
    except Exception as e:
        print("exp patch failed", e, file=sys.stderr)
