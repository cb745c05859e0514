"""Trace-replay simulator of a Mooncake cluster, driving the Conductor's own policy on a virtual clock.

- ``simulate(trace="conversation", prefill=8, decode=8, policy="kvcache-centric", admission="none", speed=1.0,
  ...)`` -> ``SimResult`` (``.summary`` dict, per-request records, load over time).
- ``cache_hit_ratio(trace, capacity_blocks, eviction="lru")``: one cache replaying a trace.
- ``load_trace``, ``poisson_trace``, ``synthesize_prompt``: traces in, prompts out (``trace.py``).
- ``mooncake-jax simulate`` (``cli.py``) runs one simulation or one of the paper's experiments
  (``experiments/``), writing JSON and PNG plots.

Modules: ``trace`` (traces), ``cache`` (block caches), ``batch`` (continuous batching in closed form),
``events`` (virtual clock), ``records`` (per-request state, load log), ``metrics`` (figures, ``SimResult``),
``config`` (``SimConfig``), ``hardware`` (instance costs), ``runner`` (shared driver), ``disagg`` (the
disaggregated cluster), ``coupled`` (the vLLM-like baseline), ``simulate`` (the entry point).
Imports numpy (and the Conductor) only; never JAX.
"""

from mooncake_jax.sim.cache import cache_hit_ratio
from mooncake_jax.sim.config import SimConfig
from mooncake_jax.sim.metrics import SimResult
from mooncake_jax.sim.simulate import simulate
from mooncake_jax.sim.trace import Trace, TraceRequest, load_trace, poisson_trace, synthesize_prompt

__all__ = ["SimConfig", "SimResult", "Trace", "TraceRequest", "cache_hit_ratio", "load_trace", "poisson_trace",
           "simulate", "synthesize_prompt"]
