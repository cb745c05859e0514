"""A local cluster's instances as ``InstanceConfig`` s: from per-role options (``--prefill-shape tensor=2,stage=2
--decode-dtype float32``) or from a cluster file, checked as a whole before anything starts.

A cluster file is JSON::

    {"model": "tiny",
     "instances": [{"role": "prefill", "tensor_parallel": 2, "pipeline_stages": 2, "dtype": "bfloat16",
                    "layerwise": true, "devices": "0-3"},
                   {"role": "decode", "tensor_parallel": 4, "dtype": "float32", "block_size": 32}]}

each instance an ``InstanceConfig`` (its fields, defaults for the rest; ``count`` repeats one). Checked: every
instance serves the cluster's model, its shape divides the model, device ranges exist and do not overlap, hardware
profiles are known, and the prefill instances share one block size (the Conductor's prefix index) and one KV
dtype (transfer plans copy blocks between their pools unchanged; their TP, stages and hardware may differ).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..model.config import get_config
from .config import DECODE, PREFILL, ROLES, InstanceConfig, parse_shape
from .devices import assign_devices

POOL_OPTIONS = {"pool_dram_blocks": "dram_blocks", "pool_ssd_path": "ssd_path", "pool_ssd_blocks": "ssd_blocks"}
"""Flat option names (``Cluster.local(pool_dram_blocks=...)``, ``--pool-dram-blocks``) of the pool's fields."""

CLUSTER_FIELDS = ("role_index", "instance_id", "conductor_address", "role")
"""Fields the cluster sets itself on every instance."""


def instance_fields() -> list[str]:
    """Option names ``Cluster.local`` passes to every instance (config fields and flat pool names)."""
    names = [f.name for f in dataclasses.fields(InstanceConfig)
             if f.name not in ("pool", "role", "instance_id", "conductor_address", "model", "auth_token",
                               "profile_json")]
    return names + list(POOL_OPTIONS)


def _fields_from_options(options: dict) -> dict:
    allowed = instance_fields()
    bad = sorted(set(options) - set(allowed))
    if bad:
        raise ValueError(f"unknown instance option(s) {bad}; allowed: {sorted(allowed)}")
    fields = {k: v for k, v in options.items() if k not in POOL_OPTIONS and v is not None}
    pool = {POOL_OPTIONS[k]: v for k, v in options.items() if k in POOL_OPTIONS and v is not None}
    if pool:
        fields["pool"] = pool
    return fields


def role_configs(model: str, prefill: int, decode: int, *, options: dict | None = None,
                 per_role: dict[str, dict] | None = None) -> list[InstanceConfig]:
    """``prefill`` + ``decode`` instances of ``model``: ``options`` for all (``layerwise`` applies to prefill
    instances only), ``per_role[role]`` for one role (``shape`` as ``"tensor=2,stage=2"``, ``dtype``,
    ``block_size``, ``devices`` (for all of that role's instances: only with one of them), ...)."""
    for name, value in (("prefill", prefill), ("decode", decode)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"a cluster needs at least one {name} instance, got {value!r}")
    common = _fields_from_options(dict(options or {}))
    configs = []
    for role, count in ((PREFILL, prefill), (DECODE, decode)):
        fields = dict(common, model=model)
        if role == DECODE:
            fields.pop("layerwise", None)
        extra = {k: v for k, v in (per_role or {}).get(role, {}).items() if v is not None}
        if "shape" in extra:
            try:
                extra.update(parse_shape(extra.pop("shape")))
            except ValueError as e:
                raise ValueError(f"--{role}-shape: {e}") from None
        if "devices" in extra and count > 1:
            raise ValueError(f"{role} devices {extra['devices']!r} given for {count} {role} instances: give each "
                             f"its own in a cluster file, or leave devices out to have them assigned")
        fields.update(_fields_from_options(extra))
        configs += [InstanceConfig(role=role, instance_id=f"{role}-{i}", **fields) for i in range(count)]
    return configs


def file_configs(path: str | Path, model: str | None = None) -> tuple[str, list[InstanceConfig]]:
    """(model, instance configs) of a cluster file. ValueError naming what is wrong."""
    try:
        spec = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read cluster file {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"cluster file {path} is not JSON: {e}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("instances"), list) or not spec["instances"]:
        raise ValueError(f"cluster file {path}: expected {{\"model\": ..., \"instances\": [{{\"role\": ...}}, ...]}}")
    bad = sorted(set(spec) - {"model", "instances"})
    if bad:
        raise ValueError(f"cluster file {path}: unknown key(s) {bad}; allowed: ['instances', 'model']")
    model = spec.get("model") or model or "tiny"
    configs, counts = [], {role: 0 for role in ROLES}
    for n, entry in enumerate(spec["instances"]):
        if not isinstance(entry, dict):
            raise ValueError(f"cluster file {path}: instance {n} is not an object")
        entry = dict(entry)
        count = entry.pop("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"cluster file {path}: instance {n}: count must be a positive integer, got {count!r}")
        entry.setdefault("model", model)
        if "shape" in entry:
            entry.update(parse_shape(entry.pop("shape")))
        role = entry.get("role")
        if role not in ROLES:
            raise ValueError(f"cluster file {path}: instance {n}: role must be one of {list(ROLES)}, got {role!r}")
        if count > 1 and entry.get("devices") is not None:
            raise ValueError(f"cluster file {path}: instance {n}: devices given for count={count} instances")
        for _ in range(count):
            try:
                configs.append(InstanceConfig.from_dict(
                    {**entry, "instance_id": entry.get("instance_id") or f"{role}-{counts[role]}"}))
            except ValueError as e:
                raise ValueError(f"cluster file {path}: instance {n}: {e}") from None
            counts[role] += 1
    return model, configs


def check_cluster(model: str, configs: list[InstanceConfig], available_devices: int) -> list[InstanceConfig]:
    """The configs checked as one cluster and with devices assigned; ValueError naming the value and what is
    allowed. Returns them (devices fixed)."""
    roles = {c.role for c in configs}
    for role in ROLES:
        if role not in roles:
            raise ValueError(f"a cluster needs at least one {role} instance")
    ids = [c.instance_id for c in configs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"instance ids repeat: {sorted(i for i in ids if ids.count(i) > 1)}")
    base = get_config(model)
    for c in configs:
        if c.model != model:
            raise ValueError(f"{c.instance_id}: model {c.model!r} is not the cluster's model {model!r}; every "
                             f"instance serves the cluster's model (they exchange its KV)")
        c.validate_for(base)
    prefill_blocks = {c.block_size or base.block_size for c in configs if c.role == PREFILL}
    if len(prefill_blocks) > 1:
        raise ValueError(f"prefill instances have block sizes {sorted(prefill_blocks)}; they must share one (the "
                         f"Conductor's prefix index keys blocks of one size); decode instances may differ")
    prefill_dtypes = {c.dtype or base.dtype for c in configs if c.role == PREFILL}
    if len(prefill_dtypes) > 1:
        raise ValueError(f"prefill instances have dtypes {sorted(prefill_dtypes)}; they must share one (transfer "
                         f"plans copy blocks between prefill pools unchanged); decode instances may differ")
    return assign_devices(configs, available_devices)


def cluster_block_size(model: str, configs: list[InstanceConfig]) -> int:
    """The block size of the Conductor's prefix index: the prefill instances'."""
    base = get_config(model)
    return next(c.block_size or base.block_size for c in configs if c.role == PREFILL)
