"""A hand-made cost profile of the ``tiny`` preset for tests that start clusters: given to the instances, it spares
each distinct engine the calibration it would otherwise run at start (seconds per engine, on 2 cores)."""

import json

from mooncake_jax.conductor.profile import build_profile

PROFILE = json.dumps(build_profile(
    "tiny@test", "tiny", [(16, 0, 0.01), (64, 0, 0.012), (256, 0, 0.02), (256, 128, 0.015), (512, 0, 0.04)],
    [(1, 64, 0.003), (4, 256, 0.004), (16, 2048, 0.008)], kv_bytes_per_token=16384, nic_bytes_per_s=5e8,
    kv_capacity_tokens=100000))
