"""Instance costs for the simulator: a built-in datasheet profile, a measured profile file, or costs given as is.

The simulator never has its own cost model: it times prefill, decode steps and transfers with the very
``InstanceCosts`` the Conductor predicts with (``mooncake_jax.conductor.hardware`` / ``profile``). That the
predictions then match the simulated durations exactly is the simulator's idealisation; what it studies is
what the policy does with them, and a measured profile brings real engine behaviour in.
"""

from __future__ import annotations

from pathlib import Path

from mooncake_jax.conductor import HARDWARE, MODEL_SHAPES, InstanceCosts, instance_costs
from mooncake_jax.conductor.profile import load_profile

HardwareSpec = str | Path | InstanceCosts


def resolve_costs(spec: HardwareSpec, model: str) -> InstanceCosts:
    """Costs of one instance: ``spec`` names a built-in profile (``8xA800``...), is a profile JSON path written
    by ``mooncake-jax profile`` (its model is the one it was measured with), or is ``InstanceCosts``."""
    if isinstance(spec, InstanceCosts):
        return spec
    name = str(spec)
    if name in HARDWARE:
        if model not in MODEL_SHAPES:
            raise ValueError(f"unknown model {model!r}; built-in: {sorted(MODEL_SHAPES)}")
        return instance_costs(name, model)
    if name.endswith(".json") or Path(name).is_file():
        return load_profile(name)
    raise ValueError(f"unknown hardware {name!r}: not a built-in profile ({sorted(HARDWARE)}) nor a profile file")
