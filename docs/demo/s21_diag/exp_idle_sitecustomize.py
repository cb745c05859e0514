"""Experiment (twenty-first session): prefill instance processes under SCHED_IDLE, so that any waking thread of
another process preempts their compute at once."""
import os, sys
if "instance" in sys.argv and "--role" in sys.argv and sys.argv[sys.argv.index("--role") + 1] == "prefill":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
