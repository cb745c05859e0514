"""mooncake-jax: KVCache-centric disaggregated LLM serving (the Mooncake design) in JAX.

Public names are imported lazily so that ``import mooncake_jax`` stays cheap for tools that only need the
Conductor or the simulator:

- ``LLM``: a local engine over one model (``mj.LLM("tiny").generate(...)``).
- ``Cluster``: a local disaggregated cluster (``mj.Cluster.local(model="tiny", prefill=2, decode=1)``).
- ``sim``: the trace-replay simulator (``mj.sim.simulate(...)``, ``mj.sim.cache_hit_ratio(...)``).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("mooncake_jax.llm", "LLM"),
    "Cluster": ("mooncake_jax.instance.cluster", "Cluster"),
    "sim": ("mooncake_jax.sim", None),
    "blocks": ("mooncake_jax.blocks", None),
}

__all__ = ["LLM", "Cluster", "sim", "blocks", "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mooncake_jax' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
