"""Which local devices each instance of a cluster owns.

Instances of one host must not share devices (a TP+CPP prefill instance on devices 0-3, a TP decode instance on
4-7). ``assign_devices`` checks the ranges given (they exist, they do not overlap) and gives the instances without
one the next free devices, before anything starts. An instance process then takes its devices by id
(``instance_devices``); on the CPU platform, where devices are host threads, a process first asks for as many as
its ids need (``reserve_cpu_devices``), so a child of a 1-device parent can still own devices 4-7.
"""

from __future__ import annotations

import os
import re

from .config import InstanceConfig, format_devices


def assign_devices(configs: list[InstanceConfig], available: int) -> list[InstanceConfig]:
    """``configs`` with every instance's devices fixed: explicit ranges checked against the ``available`` device
    ids (0 .. available-1) and each other, the rest given the lowest free ids in order. When no instance asks
    for more than one device or for particular ones, devices stay unassigned (each instance on its process's
    first device, as single-device instances always ran). ValueError naming the instance and the range."""
    explicit = [c for c in configs if c.devices is not None]
    if not explicit and all(c.device_count == 1 for c in configs):
        return list(configs)
    owner: dict[int, InstanceConfig] = {}
    for c in explicit:
        for d in c.devices:
            if d >= available:
                raise ValueError(f"{c.instance_id}: devices {format_devices(c.devices)} include device {d}, which "
                                 f"does not exist; allowed: 0-{available - 1} ({available} devices)")
            if d in owner:
                raise ValueError(f"{c.instance_id}: devices {format_devices(c.devices)} overlap "
                                 f"{owner[d].instance_id}'s {format_devices(owner[d].devices)} (device {d})")
            owner[d] = c
    free = [d for d in range(available) if d not in owner]
    out = []
    for c in configs:
        if c.devices is None:
            if len(free) < c.device_count:
                need = sum(x.device_count for x in configs)
                raise ValueError(f"{c.instance_id} (tensor={c.tensor_parallel},stage={c.pipeline_stages}) needs "
                                 f"{c.device_count} devices but only {len(free)} are left: the cluster's shapes "
                                 f"need {need} devices, {available} exist")
            c = c.replace(devices=tuple(free[: c.device_count]))
            free = free[c.device_count:]
        out.append(c)
    return out


def reserve_cpu_devices(count: int, keep_flagged: bool = False) -> bool:
    """Ask JAX for ``count`` CPU devices (only the CPU platform honours it); with ``keep_flagged``, never fewer than
    XLA's own ``--xla_force_host_platform_device_count`` already gives (JAX's setting overrides that flag): a
    launcher holding instances in its process must not take devices from a program that asked XLA for more. An
    instance process asks for exactly its own. Works only before JAX has started its backends; returns whether
    it did."""
    import jax

    if keep_flagged:
        flagged = re.findall(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
        count = max([count, *(int(n) for n in flagged)])
    try:
        jax.config.update("jax_num_cpu_devices", max(1, count))
        return True
    except RuntimeError:
        return False


def instance_devices(config: InstanceConfig) -> list | None:
    """The JAX devices ``config`` owns (None: the default, the process's first devices). ValueError naming the
    ids when this process does not have them."""
    if config.devices is None:
        return None
    import jax

    local = jax.devices()
    missing = [d for d in config.devices if d >= len(local)]
    if missing:
        raise ValueError(f"{config.instance_id}: devices {format_devices(config.devices)} do not exist here; "
                         f"allowed: 0-{len(local) - 1} ({len(local)} {local[0].platform} devices)")
    return [local[d] for d in config.devices]
