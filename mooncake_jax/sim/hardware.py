"""Instance costs for the simulator: a built-in datasheet profile, a measured profile file, or costs given as is.

The simulator never has its own cost model: it times prefill, decode steps and transfers with the very
``InstanceCosts`` the Conductor predicts with (``mooncake_jax.conductor.hardware`` / ``profile``). That the
predictions then match the simulated durations exactly is the simulator's idealisation; what it studies is
what the policy does with them, and a measured profile brings real engine behaviour in.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mooncake_jax.conductor import HARDWARE, MODEL_SHAPES, InstanceCosts, ModelShape
from mooncake_jax.conductor.profile import load_profile

HardwareSpec = str | Path | InstanceCosts
PoolSpec = HardwareSpec | Sequence[HardwareSpec]
"""One spec for every instance of a pool, or one per instance (a mixed pool)."""

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


def parse_pool(text: str) -> str | tuple[str, ...]:
    """A pool's hardware from the command line: ``8xA800``, or one per instance, ``8xH800*4,8xA800*4`` (a name
    with ``*N`` stands for N instances)."""
    items = []
    for part in text.split(","):
        name, _, count = part.strip().partition("*")
        if not name:
            raise ValueError(f"empty hardware name in {text!r}")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ValueError(f"hardware count must be an integer in {part!r}") from None
        if n < 1:
            raise ValueError(f"hardware count must be positive in {part!r}")
        items += [name] * n
    return items[0] if len(items) == 1 and "*" not in text else tuple(items)


def resolve_pool(spec: PoolSpec, count: int, model: str, role: str) -> list[InstanceCosts]:
    """Costs of each of a pool's ``count`` instances: one spec for all, or a sequence with one per instance."""
    if isinstance(spec, (str, Path, InstanceCosts)):
        return [resolve_costs(spec, model)] * count
    specs = list(spec)
    if len(specs) != count:
        raise ValueError(f"{role} pool has {count} instances but {len(specs)} hardware specs were given "
                         f"({', '.join(map(str, specs))}); give one, or one per instance")
    return [resolve_costs(one, model) for one in specs]
