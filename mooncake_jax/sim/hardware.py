"""Instance costs for the simulator: a built-in datasheet profile, a measured profile file, or costs given as is.

The simulator never has its own cost model: it times prefill, decode steps and transfers with the very
``InstanceCosts`` the Conductor predicts with (``mooncake_jax.conductor.hardware`` / ``profile``). That the
predictions then match the simulated durations exactly is the simulator's idealisation; what it studies is
what the policy does with them, and a measured profile brings real engine behaviour in.
"""

from __future__ import annotations

from pathlib import Path

from mooncake_jax.conductor import HARDWARE, MODEL_SHAPES, InstanceCosts, ModelShape
from mooncake_jax.conductor.profile import load_profile

HardwareSpec = str | Path | InstanceCosts

SIM_MODEL_SHAPES: dict[str, ModelShape] = {
    **MODEL_SHAPES,
    # LLaMA-1 65B: full multi-head attention, so 8x the KV per token of LLaMA-2-70B's grouped-query attention
    # (2.5 MiB vs 320 KiB). With it a decode node holds ~170k tokens instead of ~1.3M, and the decode pool,
    # not only prefill, runs out under load, as in the paper's overload experiments. Simulation only: the
    # engine has no preset for it.
    "llama-65b": ModelShape("llama-65b", 80, 8192, 64, 64, 128, 22016, 32000),
}
"""Model shapes the simulator can cost on built-in hardware: the Conductor's, plus multi-head-attention ones."""


def resolve_costs(spec: HardwareSpec, model: str) -> InstanceCosts:
    """Costs of one instance: ``spec`` names a built-in profile (``8xA800``...), is a profile JSON path written
    by ``mooncake-jax profile`` (its model is the one it was measured with), or is ``InstanceCosts``."""
    if isinstance(spec, InstanceCosts):
        return spec
    name = str(spec)
    if name in HARDWARE:
        if model not in SIM_MODEL_SHAPES:
            raise ValueError(f"unknown model {model!r}; built-in: {sorted(SIM_MODEL_SHAPES)}")
        return HARDWARE[name].costs(SIM_MODEL_SHAPES[model])
    if name.endswith(".json") or Path(name).is_file():
        return load_profile(name)
    raise ValueError(f"unknown hardware {name!r}: not a built-in profile ({sorted(HARDWARE)}) nor a profile file")
