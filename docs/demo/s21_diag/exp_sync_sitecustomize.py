"""Experiment (twenty-first session): decode instance processes run XLA:CPU programs on the calling thread."""
import os, sys
if "instance" in sys.argv and "--role" in sys.argv and sys.argv[sys.argv.index("--role") + 1] == "decode":
    import jax
    jax.config.update("jax_cpu_enable_async_dispatch", False)
