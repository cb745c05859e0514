"""Experiment (twenty-first session): decode instance processes under SCHED_RR 1 (every thread inherits it)."""
import os, sys
if "instance" in sys.argv and "--role" in sys.argv and sys.argv[sys.argv.index("--role") + 1] == "decode":
    os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
