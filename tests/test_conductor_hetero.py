"""The Conductor across hardware types, on hand-worked clusters: each instance's own cost model, each pair's own
link bandwidth, one transfer-time formula, and the hardware kind an instance registers.

Costs: SLOW prefills 1 ms per new token, FAST 0.25 ms; both 250 bytes of KV per token (1,000 bytes per block of
4 tokens) and 100,000 bytes/s of NIC (one block in 10 ms). The request has 42 tokens: 10 full blocks, so at most
40 reusable tokens and never fewer than 2 computed.
"""

import json

import grpc
import numpy as np
import pytest
from test_conductor_support import BLOCK

from mooncake_jax.conductor import (ClusterState, DecodeCost, InstanceCosts, Policy, PolicyConfig, PrefillCost,
                                    Request, instance_costs)
from mooncake_jax.conductor.costs import transfer_seconds

KEYS = list(range(201, 211))


def costs(name, per_token_s, decode_per_request_s=0.01, nic=1e5):
    return InstanceCosts(name, PrefillCost((0.0, per_token_s, 0.0, 0.0)), DecodeCost((0.0, decode_per_request_s, 0.0)),
                         kv_bytes_per_token=250, nic_bytes_per_s=nic, kv_capacity_tokens=10**6, hardware=name)


SLOW, FAST = costs("slow", 1e-3), costs("fast", 0.25e-3)


def hetero(admission="none", decode=(("D", SLOW),), **config):
    cfg = PolicyConfig(block_size=BLOCK, admission=admission, **config)
    state = ClusterState(cfg)
    state.add_instance("A", "prefill", SLOW, 0.0)
    state.add_instance("B", "prefill", FAST, 0.0)
    for name, c in decode:
        state.add_instance(name, "decode", c, 0.0)
    return state, Policy(cfg)


def req(name="r", keys=KEYS, n=42, out=8):
    return Request(name, keys, n, out)


def test_cold_prompt_goes_to_the_faster_instance_by_its_own_model():
    state, policy = hetero()
    d = policy.decide(req(), state.snapshot(), 0.0)
    assert d.prefill == "B" and d.predicted_ttft_s == pytest.approx(42 * 0.25e-3)  # A would take 0.042 s


def test_prediction_includes_the_transfer_over_the_pairs_own_link():
    # A (slow) holds all 10 blocks: 2 tokens at 1 ms = 0.002 s.
    # B (fast) holds none: fetch 10,000 bytes from A, then 2 tokens at 0.25 ms = 0.0005 s.
    state, policy = hetero()
    state.kv_stored("A", KEYS)
    d = policy.decide(req(), state.snapshot(), 0.0)  # default link: slower NIC, 0.1 s + 0.0005 s > 0.002 s
    assert (d.prefill, d.transfer, d.predicted_ttft_s) == ("A", None, pytest.approx(0.002))
    state.set_link("A", "B", 1e7)  # same host: the 10 blocks move in 1 ms; 0.0015 s beats 0.002 s
    d = policy.decide(req(), state.snapshot(), 0.0)
    assert d.prefill == "B" and d.transfer.source == "A"
    assert d.transfer.seconds == pytest.approx(0.001) and d.predicted_ttft_s == pytest.approx(0.0015)


def test_sender_backlog_is_counted_on_the_pairs_link():
    state, policy = hetero()
    state.kv_stored("A", KEYS)
    state.set_link("A", "B", 1e7)
    first = state.schedule(policy, req("r1"), 0.0)
    assert first.prefill == "B" and first.transfer.seconds == pytest.approx(0.001)
    assert state.instances.send_free_at[state.instances.slot("A")] == pytest.approx(0.001)
    # The second fetch waits for the first on A's link: 0.001 + 0.001 s, + 0.0005 s of compute, + B's queue.
    second = policy.decide(req("r2"), state.snapshot(), 0.0)
    assert second.predicted_ttft_s == pytest.approx(min(0.002, 0.002 + first.predicted_ttft_s + 0.0005))


def test_links_default_to_the_slower_nic_and_overrides_survive_re_registration():
    state, _ = hetero()
    state.add_instance("C", "prefill", costs("big-nic", 1e-3, nic=1e6), 0.0)
    table = state.instances
    a, c = table.slot("A"), table.slot("C")
    assert table.link(a, c) == table.link(c, a) == 1e5
    state.set_link("C", "E", 5e5, both_ways=False)  # E not registered yet
    state.add_instance("E", "prefill", costs("big-nic", 1e-3, nic=1e6), 1.0)
    e = table.slot("E")
    assert table.link(c, e) == 5e5 and table.link(e, c) == 1e6
    state.add_instance("C", "prefill", costs("big-nic", 1e-3, nic=1e6), 2.0)  # re-registers, maybe another slot
    assert table.link(table.slot("C"), e) == 5e5
    with pytest.raises(ValueError, match="link bandwidth"):
        state.set_link("A", "B", 0.0)


def test_transfer_time_is_one_formula_for_scalars_and_arrays():
    assert transfer_seconds(1e4, 1e5) == pytest.approx(0.1)
    assert transfer_seconds(1e4, 1e5, backlog_s=-3.0) == pytest.approx(0.1)  # a drained backlog is no wait
    assert list(transfer_seconds(1e4, np.array([1e5, 1e6]), [0.5, 0.0])) == pytest.approx([0.6, 0.01])
    with pytest.raises(ValueError, match="bandwidth"):
        transfer_seconds(1.0, 0.0)


@pytest.mark.parametrize("admission", ["early", "predictive"])
def test_admission_judges_each_decode_instance_by_its_own_model(admission):
    # TBT SLO 0.1 s. SLOW_DECODE: 0.05 s per request in the batch, FAST_DECODE: 0.01 s.
    slow_decode, fast_decode = costs("slow-decode", 1e-3, 0.05), costs("fast-decode", 1e-3, 0.01)
    state, policy = hetero(admission, decode=(("DS", slow_decode),), tbt_slo_s=0.1)
    for i in range(2):  # two decoding already: a third makes 3 x 0.05 = 0.15 s > 0.1 s
        state.ledger.add(f"old{i}", state.instances.slot("DS"), 0.0, 100, started=True)
    d = policy.decide(req(), state.snapshot(), 1.0)
    assert d.reason.value == "tbt_slo" and d.predicted_tbt_s == pytest.approx(0.15)
    state.add_instance("DF", "decode", fast_decode, 1.0)
    for i in range(2):
        state.ledger.add(f"old-f{i}", state.instances.slot("DF"), 0.0, 100, started=True)
    d = policy.decide(req(), state.snapshot(), 1.0)
    assert d.accepted and d.decode == "DF" and d.predicted_tbt_s == pytest.approx(0.03)


def test_datasheet_kinds_register_over_grpc_and_are_reported():
    from test_conductor_costs import unit_profile
    from test_conductor_service import register, schedule

    from mooncake_jax.conductor.service import messages, serve, services
    from mooncake_jax.proto import channel_options

    server = serve(PolicyConfig(block_size=16, admission="none"), port=0, sweep=False)
    channel = grpc.insecure_channel(server.address, options=channel_options())
    try:
        stub = services.ConductorStub(channel)
        register(stub, "a800", messages.PREFILL, hardware="8xA800")
        register(stub, "h800", messages.PREFILL, hardware="8xH800")
        register(stub, "v6e", messages.DECODE, hardware="tpu-v6e-8")
        register(stub, "cpu", messages.DECODE, profile_json=json.dumps(unit_profile()[0]), hardware="1xcpu")
        reply = schedule(stub, "r1")
        h800 = instance_costs("8xH800", "llama2-70b")
        assert reply.prefill_id == "h800" and reply.predicted_ttft_s == pytest.approx(h800.prefill.seconds(100, 0))
        kinds = {i.instance_id: i.hardware for i in stub.ListInstances(messages.ListInstancesRequest()).instances}
        assert kinds == {"a800": "8xA800", "h800": "8xH800", "v6e": "tpu-v6e-8", "cpu": "1xcpu"}
        with pytest.raises(grpc.RpcError) as err:
            register(stub, "x", messages.PREFILL, hardware="8xB999")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "8xB999" in err.value.details()
    finally:
        channel.close()
        server.stop(0)
