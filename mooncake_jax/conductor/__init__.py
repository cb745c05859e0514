"""The Conductor: global scheduling, hot-block replication and admission for the disaggregated cluster.

The pieces, each in its own module:

- ``costs``: prefill / decode / transfer cost models and their fitting; ``hardware``: datasheet profiles.
- ``index``: the global block index (key -> instances and tier), prefix match for all instances in one walk;
  ``flat_index`` / ``index_kernels``: the same index as flat hash tables walked by numba (the dict index where
  numba cannot compile).
- ``instances``, ``ledger``: per-instance columns and in-flight decode requests, read by the policy.
- ``api``: the policy's contract (``PolicyConfig``, ``Request``, ``Snapshot``, ``Decision``).
- ``policy``: ``Policy.decide(request, snapshot, now)``, pure; ``admission``: the overload policies.
- ``kernels``: the policy's decode choice compiled with numba (the same decisions; a numpy path where it cannot
  compile).
- ``state``: ``ClusterState``, which applies decisions and reports and hands out snapshots.
- ``service``: the gRPC service around one ``ClusterState`` + ``Policy``; ``profile``: ``mooncake-jax profile``.

Importing this package pulls in numpy only (no JAX, no gRPC; numba when a ``Policy`` or a ``ClusterState`` is
made).

Driving it (the simulator does exactly what the gRPC service does)::

    state = ClusterState(PolicyConfig(strategy="kvcache-centric", admission="predictive", block_size=512))
    policy = Policy(state.config)
    state.add_instance("p0", "prefill", instance_costs("8xA800", "llama2-70b"), now)  # ... and decode ones
    decision = state.schedule(policy, Request("r1", hash_ids, input_tokens, output_tokens), now)
    # then, as the cluster runs: state.kv_stored / kv_removed (cache inserts, evictions), state.prefill_done,
    # decode_started, finished, dropped (request milestones), state.heartbeat (measured queues and batches).
"""

from mooncake_jax.conductor.admission import decode_accepts
from mooncake_jax.conductor.api import (Admission, Decision, PolicyConfig, RejectReason, Request, Snapshot, Strategy,
                                        Transfer)
from mooncake_jax.conductor.costs import DecodeCost, Fit, InstanceCosts, PrefillCost
from mooncake_jax.conductor.hardware import HARDWARE, MODEL_SHAPES, HardwareProfile, ModelShape, instance_costs
from mooncake_jax.conductor.index import BlockIndex, Tier
from mooncake_jax.conductor.instances import Role
from mooncake_jax.conductor.policy import Policy
from mooncake_jax.conductor.state import ClusterState

__all__ = [
    "Admission", "BlockIndex", "ClusterState", "Decision", "DecodeCost", "Fit", "HARDWARE", "HardwareProfile",
    "InstanceCosts", "MODEL_SHAPES", "ModelShape", "Policy", "PolicyConfig", "PrefillCost", "RejectReason",
    "Request", "Role", "Snapshot", "Strategy", "Tier", "Transfer", "decode_accepts", "instance_costs",
]
