"""The paper's experiments, each one call that writes ``<name>.json`` and PNG plots into an output folder.

- ``scheduling``: FAST'25 Figure 5, average TTFT of the four prefill scheduling strategies.
- ``cache``: hit ratio against capacity; per-node caches against a global pool.
- ``overload``: rejections, wasted prefill and load over time under the three admission policies.
- ``pd-ratio``: effective request capacity over prefill/decode splits, and against the coupled baseline.
- ``hetero``: prefill and decode pools of different hardware: effective request capacity and cost per million
  tokens.

Each module's ``run(out_dir, first=None, progress=True)`` returns what it wrote to its JSON file.
"""

from __future__ import annotations

import importlib
from pathlib import Path

EXPERIMENTS = {
    "scheduling": "mooncake_jax.sim.experiments.scheduling",
    "cache": "mooncake_jax.sim.experiments.cache",
    "overload": "mooncake_jax.sim.experiments.overload",
    "pd-ratio": "mooncake_jax.sim.experiments.pd_ratio",
    "hetero": "mooncake_jax.sim.experiments.hetero",
}


def run_experiment(name: str, out_dir: str | Path = "results/sim", first: int | None = None,
                   progress: bool = True) -> dict:
    """Run one experiment by name (``all`` runs every one and returns their outputs by name)."""
    if name == "all":
        return {n: run_experiment(n, out_dir, first, progress) for n in EXPERIMENTS}
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; choose from {sorted(EXPERIMENTS) + ['all']}")
    if first is not None and first < 1:
        raise ValueError(f"first must be positive, got {first}")
    return importlib.import_module(EXPERIMENTS[name]).run(Path(out_dir), first=first, progress=progress)
