"""The Conductor's gRPC service on loopback: fake instances register, report and get scheduled; bad messages
get INVALID_ARGUMENT or NOT_FOUND; a silent instance is drained; a restarted Conductor rebuilds its index."""

import json
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from test_conductor_costs import unit_profile

from mooncake_jax.blocks import block_keys
from mooncake_jax.conductor import PolicyConfig, instance_costs
from mooncake_jax.conductor.service import messages, serve, services
from mooncake_jax.proto import channel_options

BLOCK = 16
PROMPT = list(range(100))  # 6 full blocks of 16 + 4 tokens
KEYS = block_keys(PROMPT, BLOCK)
A800 = instance_costs("8xA800", "llama2-70b")


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def conductor():
    """A running Conductor on a free loopback port with a fake clock, and a stub; stopped afterwards."""
    clock = FakeClock()
    server = serve(PolicyConfig(block_size=BLOCK, admission="early"), port=0, sweep=False, clock=clock,
                   heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0)
    channel = grpc.insecure_channel(server.address, options=channel_options())
    yield server, services.ConductorStub(channel), clock
    channel.close()
    server.stop(0)


def register(stub, instance_id, role, **fields):
    fields.setdefault("hardware", "8xA800")
    fields.setdefault("model", "llama2-70b")
    return stub.Register(messages.RegisterRequest(instance_id=instance_id, role=role,
                                                  address=f"{instance_id}.test:9000", **fields))


def schedule(stub, request_id, tokens=PROMPT, out=16):
    return stub.Schedule(messages.ScheduleRequest(request_id=request_id, block_keys=block_keys(tokens, BLOCK),
                                                  input_tokens=len(tokens), output_tokens=out))


def publish(stub, instance_id, *events):
    batch = messages.KvEventBatch(instance_id=instance_id, events=list(events))
    return stub.PublishKvEvents(iter([batch]))


def stored(keys, tier=messages.DRAM):
    return messages.KvEvent(kind=messages.KvEvent.STORED, tier=tier, block_keys=keys)


def code_of(call):
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_two_instances_schedule_by_prefix_and_dead_one_is_excluded(conductor):
    server, stub, clock = conductor
    reply = register(stub, "p1", messages.PREFILL)
    assert reply.heartbeat_timeout_s == 5.0
    register(stub, "d1", messages.DECODE)
    assert publish(stub, "p1", stored(KEYS[:4])).applied == 1

    first = schedule(stub, "r1")
    assert first.accepted and (first.prefill_id, first.decode_id) == ("p1", "d1")
    assert first.prefill_address == "p1.test:9000" and first.prefix_blocks == 4
    assert first.predicted_ttft_s == pytest.approx(A800.prefill.seconds(100, 64))
    assert not first.HasField("transfer")

    # A second prefill instance joins with the same hardware; p1 is now busy with r1.
    register(stub, "p2", messages.PREFILL)
    second = schedule(stub, "r2", tokens=list(range(500, 600)))
    assert second.prefill_id == "p2"

    # p1 falls silent past the timeout; the others keep beating.
    clock.now += 6.0
    for name in ("p2", "d1"):
        stub.Heartbeat(messages.HeartbeatRequest(instance_id=name, queued_s=0.0))
    assert server.service.sweep() == ["p1"]
    third = schedule(stub, "r3")
    assert third.prefill_id == "p2" and third.prefix_blocks == 0  # p1's blocks are purged with it
    assert [r.decision_seq for r in (first, second, third)] == [1, 2, 3]  # the Conductor's order of decisions
    code, details = code_of(lambda: stub.Heartbeat(messages.HeartbeatRequest(instance_id="p1")))
    assert code == grpc.StatusCode.NOT_FOUND and "register" in details
    listed = stub.ListInstances(messages.ListInstancesRequest())
    assert [i.instance_id for i in listed.instances] == ["d1", "p2"]
    assert listed.instances[0].decoding == 2  # r2 and r3; r1 was still queued on p1 and went with it


def test_restarted_conductor_rebuilds_its_index_from_re_sent_block_lists(conductor):
    server, stub, clock = conductor
    register(stub, "p1", messages.PREFILL)
    register(stub, "p2", messages.PREFILL)
    register(stub, "d1", messages.DECODE)
    publish(stub, "p1", stored(KEYS[:3]), stored(KEYS[3:]))
    assert schedule(stub, "r1").prefix_blocks == 6
    server.stop(0)

    restarted = serve(PolicyConfig(block_size=BLOCK), port=0, sweep=False)
    try:
        with grpc.insecure_channel(restarted.address) as channel:
            stub = services.ConductorStub(channel)
            # The instances learn of the restart from NOT_FOUND, register again and re-send their block lists.
            code, _ = code_of(lambda: stub.Heartbeat(messages.HeartbeatRequest(instance_id="p1")))
            assert code == grpc.StatusCode.NOT_FOUND
            register(stub, "p1", messages.PREFILL, dram_block_keys=KEYS[:5], ssd_block_keys=KEYS[5:])
            register(stub, "p2", messages.PREFILL)
            register(stub, "d1", messages.DECODE)
            publish(stub, "p2", messages.KvEvent(kind=messages.KvEvent.RESET, block_keys=KEYS[:2]))
            reply = schedule(stub, "r2")
            assert (reply.prefill_id, reply.prefix_blocks) == ("p1", 6)
            listed = {i.instance_id: i.blocks for i in stub.ListInstances(messages.ListInstancesRequest()).instances}
            assert listed == {"p1": 6, "p2": 2, "d1": 0}
            assert restarted.service.state.index.tier(KEYS[5], 0).name == "SSD"
    finally:
        restarted.stop(0)


def test_transfer_plan_names_the_source_and_its_address(conductor):
    server, stub, clock = conductor
    register(stub, "p1", messages.PREFILL, dram_block_keys=KEYS)
    register(stub, "p2", messages.PREFILL)
    register(stub, "d1", messages.DECODE)
    stub.Heartbeat(messages.HeartbeatRequest(instance_id="p1", queued_s=10.0))  # p1 busy: fetching wins
    reply = schedule(stub, "r1")
    assert reply.prefill_id == "p2" and reply.transfer.source_id == "p1"
    assert reply.transfer.source_address == "p1.test:9000" and list(reply.transfer.block_keys) == KEYS
    assert reply.transfer.n_bytes == 6 * BLOCK * A800.kv_bytes_per_token
    assert reply.predicted_ttft_s == pytest.approx(
        reply.transfer.n_bytes / A800.nic_bytes_per_s + A800.prefill.seconds(100, 96))


def test_rejection_is_an_answer_with_reason_and_retry_hint(conductor):
    server, stub, clock = conductor
    register(stub, "p1", messages.PREFILL)
    register(stub, "d1", messages.DECODE)
    stub.Heartbeat(messages.HeartbeatRequest(instance_id="p1", queued_s=40.0))
    reply = schedule(stub, "r1")
    assert not reply.accepted and reply.reject_reason == "ttft_slo"
    # over the prefill's budget (the SLO less the KV push to d1, which the first token waits for) by this much
    push = 100 * A800.kv_bytes_per_token / A800.nic_bytes_per_s
    assert reply.retry_after_s == pytest.approx(10.0 + A800.prefill.seconds(100, 0) + push)


def test_request_milestones_and_batch_reports(conductor):
    server, stub, clock = conductor
    register(stub, "p1", messages.PREFILL)
    register(stub, "d1", messages.DECODE)
    schedule(stub, "r1")
    events = messages.RequestEvent
    for kind in (events.PREFILL_DONE, events.DECODE_STARTED):
        stub.ReportRequest(messages.RequestEvent(request_id="r1", kind=kind))
    stub.Heartbeat(messages.HeartbeatRequest(instance_id="d1", reports_batch=True, active=[
        messages.ActiveRequest(request_id="r1", kv_tokens=116), messages.ActiveRequest(request_id="x", kv_tokens=9)]))
    assert stub.ListInstances(messages.ListInstancesRequest()).instances[0].decoding == 2
    clock.now += 8.0
    stub.ReportRequest(messages.RequestEvent(request_id="r1", kind=events.FINISHED))
    listed = stub.ListInstances(messages.ListInstancesRequest())
    assert listed.decode_time_s == pytest.approx(20.0 + 0.1 * (8.0 - 20.0))
    code, _ = code_of(lambda: stub.ReportRequest(messages.RequestEvent(request_id="r1", kind=events.FINISHED)))
    assert code == grpc.StatusCode.NOT_FOUND


def test_bad_messages_get_invalid_argument_or_not_found(conductor):
    server, stub, clock = conductor
    invalid, missing = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: register(stub, "p1", messages.ROLE_UNSPECIFIED))[0] == invalid
    assert code_of(lambda: register(stub, "", messages.PREFILL))[0] == invalid
    assert code_of(lambda: register(stub, "p1", messages.PREFILL, hardware="abacus"))[0] == invalid
    assert code_of(lambda: register(stub, "p1", messages.PREFILL, hardware="", model=""))[0] == invalid
    code, details = code_of(lambda: register(stub, "p1", messages.PREFILL, profile_json="{nope"))
    assert code == invalid and "JSON" in details
    # a good measured profile registers fine
    register(stub, "p1", messages.PREFILL, profile_json=json.dumps(unit_profile()[0]))
    register(stub, "d1", messages.DECODE)

    assert code_of(lambda: schedule(stub, ""))[0] == invalid
    assert code_of(lambda: schedule(stub, "r", tokens=[]))[0] == invalid
    too_many = messages.ScheduleRequest(request_id="r", block_keys=list(range(10)), input_tokens=32, output_tokens=1)
    code, details = code_of(lambda: stub.Schedule(too_many))
    assert code == invalid and "at most 2" in details
    schedule(stub, "dup")
    assert code_of(lambda: schedule(stub, "dup"))[0] == grpc.StatusCode.ALREADY_EXISTS  # in flight: 409 upstream
    assert code_of(lambda: stub.Heartbeat(messages.HeartbeatRequest(instance_id="ghost")))[0] == missing
    assert code_of(lambda: stub.Heartbeat(messages.HeartbeatRequest(instance_id="p1", queued_s=-2)))[0] == invalid
    assert code_of(lambda: publish(stub, "ghost", stored([1])))[0] == missing
    assert code_of(lambda: stub.Deregister(messages.DeregisterRequest(instance_id="ghost")))[0] == missing
    # after all that the service still schedules
    assert schedule(stub, "ok").accepted


def test_concurrent_callers_each_see_the_load_of_the_ones_before(conductor):
    server, stub, clock = conductor
    for name in ("p1", "p2"):
        register(stub, name, messages.PREFILL)
    register(stub, "d1", messages.DECODE)
    replies, barrier = [], threading.Barrier(20)

    def call(i):
        barrier.wait()
        replies.append(schedule(stub, f"r{i}", tokens=list(range(i * 1000, i * 1000 + 100))))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    chosen = [r.prefill_id for r in replies]
    assert chosen.count("p1") == chosen.count("p2") == 10
    # each prefill instance's queue holds exactly its 10 requests, one after another
    ttfts = sorted(r.predicted_ttft_s for r in replies if r.prefill_id == "p1")
    assert ttfts == pytest.approx([(k + 1) * A800.prefill.seconds(100, 0) for k in range(10)])


def test_health_and_reflection(conductor):
    server, stub, clock = conductor
    with grpc.insecure_channel(server.address) as channel:
        request = health_pb2.HealthCheckRequest(service="mooncake.v1.Conductor")
        assert health_pb2_grpc.HealthStub(channel).Check(request).status == health_pb2.HealthCheckResponse.SERVING
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "mooncake.v1.Conductor" in database.get_services()


def test_sweeper_thread_drains_silent_instances_on_the_real_clock():
    server = serve(PolicyConfig(block_size=BLOCK), port=0, heartbeat_interval_s=0.05, heartbeat_timeout_s=0.2)
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = services.ConductorStub(channel)
            register(stub, "p1", messages.PREFILL)
            register(stub, "d1", messages.DECODE)
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline:
                stub.Heartbeat(messages.HeartbeatRequest(instance_id="d1"))  # only d1 keeps beating
                names = [i.instance_id for i in stub.ListInstances(messages.ListInstancesRequest()).instances]
                if names == ["d1"]:
                    break
                time.sleep(0.05)
            assert names == ["d1"]
            assert schedule(stub, "r1").reject_reason == "no_prefill_instance"
    finally:
        server.stop(0)
