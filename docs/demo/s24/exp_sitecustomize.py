"""Experiments only (twenty-fourth session), each behind its variable: EXP_PREFILL_NICE (the launcher's prefill
niceness), EXP_SPLIT (exp_split.py), EXP_FLOAT_PREFILL / EXP_FLOAT_DECODE (exp_float.py), EXP_PREFILL_IDLE,
EXP_LAUNCHER_NICE. Used as sitecustomize.py on PYTHONPATH (run.sh)."""
import os, sys
if os.environ.get("EXP_PREFILL_NICE") and any("demo" == a for a in sys.argv):
    import mooncake_jax.instance.cluster as c
    c.PREFILL_NICENESS = int(os.environ["EXP_PREFILL_NICE"])
    print("exp: prefill niceness", c.PREFILL_NICENESS, file=sys.stderr)
if os.environ.get("EXP_SPLIT") and "instance" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); import exp_split; exp_split.install()
if os.environ.get("EXP_FLOAT_PREFILL") and "instance" in sys.argv:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); import exp_float; exp_float.install()
if os.environ.get("EXP_PREFILL_IDLE") and "instance" in sys.argv and "prefill" in sys.argv:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); print("exp: prefill SCHED_IDLE", file=sys.stderr)
if os.environ.get("EXP_LAUNCHER_NICE") and any("demo" == a for a in sys.argv):
    os.setpriority(os.PRIO_PROCESS, 0, int(os.environ["EXP_LAUNCHER_NICE"])); print("exp: launcher nice", os.getpriority(os.PRIO_PROCESS, 0), file=sys.stderr)
