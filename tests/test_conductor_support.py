"""Shared builders for the Conductor tests: cost models simple enough to work decisions out by hand.

UNIT costs: prefill 1 ms per new token (nothing else), decode step 10 ms per request in the batch, 250 bytes of
KV per token (1,000 bytes per block of 4 tokens) and 100,000 bytes/s of NIC, so one block moves in 10 ms.
"""

from mooncake_jax.conductor import ClusterState, DecodeCost, InstanceCosts, Policy, PolicyConfig, PrefillCost

BLOCK = 4

UNIT = InstanceCosts("unit", PrefillCost((0.0, 1e-3, 0.0, 0.0)), DecodeCost((0.0, 0.01, 0.0)),
                     kv_bytes_per_token=250, nic_bytes_per_s=1e5, kv_capacity_tokens=10**6)


def cluster(prefill=("A", "B", "C"), decode=("D",), costs=UNIT, **config):
    """A state with the given instances registered at t=0, and a policy over the same config."""
    cfg = PolicyConfig(block_size=BLOCK, **({"admission": "none"} | config))
    state = ClusterState(cfg)
    for name in prefill:
        state.add_instance(name, "prefill", costs, 0.0)
    for name in decode:
        state.add_instance(name, "decode", costs, 0.0)
    return state, Policy(cfg)
