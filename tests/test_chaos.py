"""Faults under load, in a cluster of this process (fast) and, marked slow, of processes: a prefill instance that
dies under load fails no request that had not started on it (dropped from the Conductor at once, the request
retried elsewhere); no decode instance is 503 naming it, not overload; a duplicate in-flight id is refused; a
crashed instance process is restarted by the supervisor with the reason logged."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import grpc
import pytest
from test_cluster import FAST, PROFILE, wait_until

import mooncake_jax as mj
from mooncake_jax.gateway.backend import DuplicateRequest, TokenOut, Unavailable
from mooncake_jax.instance.supervise import Supervisor
from reference_model import random_prompts as prompts


def kill_in_process(instance) -> None:
    """Abrupt death of an in-process instance: no goodbye to the Conductor, its port closed."""
    instance.link.stop(deregister=False)
    instance._server.stop(0)


def two_prefills_one_decode():
    """An in-process cluster whose heartbeats would take 60 s to notice a death: only a drop at once (a failed call,
    a failed fetch) keeps these tests fast."""
    return mj.Cluster.local("tiny", prefill=2, decode=1, profile_json=PROFILE, heartbeat_interval_s=1.0,
                            heartbeat_timeout_s=60.0, **FAST)


@pytest.fixture(scope="module")
def cluster():
    with two_prefills_one_decode() as c:
        yield c


def test_killing_one_of_two_prefill_instances_under_load_fails_no_request(cluster):
    c = cluster
    ps = prompts([20] * 12, seed=21)
    expected = c.generate(ps, max_new_tokens=3)  # also compiles what the load runs
    results: dict[int, object] = {}
    done = threading.Semaphore(0)

    def client(indices):
        for i in indices:
            try:
                results[i] = c.run(ps[i], max_new_tokens=3)[0]
            except Exception as e:  # noqa: BLE001 - recorded, asserted below
                results[i] = e
            done.release()

    threads = [threading.Thread(target=client, args=(range(k, len(ps), 3),)) for k in range(3)]
    for t in threads:
        t.start()
    for _ in range(3):
        done.acquire(timeout=60)
    t_kill = time.monotonic()
    kill_in_process(c.instances["prefill-0"])
    for t in threads:
        t.join(120)
    failed = {i: r for i, r in results.items() if isinstance(r, Exception)}
    assert not failed, failed
    assert [results[i] for i in range(len(ps))] == expected
    slots = c.conductor.service.state.instances.slot_of
    # A slow host may drain the load before the kill, and the Conductor keeps prefill-0's last reported queue (the
    # load's) until it would have drained, placing new work on prefill-1 meanwhile: requests until one is routed to
    # the dead instance (an idle tie goes to the first slot), for at most 30 s.
    for p in prompts([20] * 300, seed=22):
        if "prefill-0" not in slots or time.monotonic() - t_kill > 30:
            break
        assert len(c.run(p, max_new_tokens=3)[0]) == 3
    assert "prefill-0" not in slots
    assert time.monotonic() - t_kill < 50  # well before the 60 s heartbeat timeout could have dropped it


def test_no_decode_instance_is_503_naming_it_and_duplicate_ids_are_refused(cluster):
    """Runs after the prefill test (prefill-1 still serves); kills the decode instance."""
    c = cluster
    stream = c.backend.generate(mj.gateway.GenerateRequest(prompt=[1, 5, 9, 4], max_tokens=200, request_id="dup",
                                                           ignore_eos=True))
    assert isinstance(next(stream), TokenOut)
    with pytest.raises(DuplicateRequest, match="already in flight"):
        list(c.backend.generate(mj.gateway.GenerateRequest(prompt=[1, 5], max_tokens=2, request_id="dup")))
    stream.close()
    assert c.backend.health() is None
    kill_in_process(c.instances["decode-0"])
    with pytest.raises(Unavailable) as err:  # the retry finds none; the first try names the dead one
        c.run([1, 5, 9, 4, 7], max_new_tokens=3)
    assert "no decode instance alive" in str(err.value) and "decode instance decode-0 is down" in str(err.value)
    assert c.backend.health() == "no decode instance alive"  # dropped at once, not after 60 s
    with pytest.raises(Unavailable, match="no decode instance alive"):  # 503, not 429 overload
        c.run([1, 5, 9], max_new_tokens=3)


def test_a_transfer_plan_from_a_dead_instance_drops_it_at_once():
    """A prefill told to fetch a prefix from an instance that has died (the Conductor still lists it: its missed
    heartbeats would take 60 s to tell) computes the prefix itself and says the fetch failed; the gateway probes the
    source and has the Conductor drop it, off the request's way. The plan is the Conductor's decision with its
    prefill and its source set here, as cache-aware routing makes it when the dead one held the prefix."""
    from mooncake_jax.conductor.service import messages as conductor_messages

    with two_prefills_one_decode() as c:
        prompt = prompts([40], seed=31)[0]
        want = c.generate([prompt], max_new_tokens=3)
        dead, live = c.instances["prefill-0"], c.instances["prefill-1"]
        kill_in_process(dead)
        stub = c.backend._conductor
        schedule = stub.Schedule

        def planned(request, timeout=None):
            decision = schedule(request, timeout=timeout)
            decision.prefill_id, decision.prefill_address = "prefill-1", live.address
            decision.transfer.CopyFrom(conductor_messages.TransferPlan(
                source_id="prefill-0", source_address=dead.address, block_keys=list(request.block_keys[:2])))
            return decision

        stub.Schedule = planned
        slots = c.conductor.service.state.instances.slot_of
        assert "prefill-0" in slots
        t_kill = time.monotonic()
        assert c.generate([prompt], max_new_tokens=3) == want  # the prefix computed instead: the same tokens
        assert live.service.counts()["prefill_fetch_failures_total"] == 1
        assert wait_until(lambda: "prefill-0" not in slots, 10)
        assert time.monotonic() - t_kill < 30  # long before its heartbeats could have been missed


class _Child:
    """What the supervisor needs of a ChildInstance: a process, a log, an address, stop()."""

    def __init__(self, log_path):
        self.log_path = log_path
        with open(log_path, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", "import sys, time; print('starting up', "
                                          "file=sys.stderr, flush=True); time.sleep(60)"], stderr=log)
        self.address = f"pid {self.proc.pid}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def test_supervisor_restarts_a_crashed_process_with_the_reason_logged(tmp_path, caplog):
    children = {"decode-0": _Child(tmp_path / "decode-0.log")}
    started = []

    def restart(instance_id):
        if len(started) == 0:
            started.append("failed")
            raise RuntimeError("port taken")  # a failed restart is retried after a longer backoff
        child = _Child(tmp_path / f"{instance_id}.log")
        started.append(child)
        return child

    first = children["decode-0"]
    supervisor = Supervisor(children, restart, poll_s=0.05).start()
    try:
        with caplog.at_level(logging.INFO, logger="mooncake_jax.instance.supervise"):
            assert wait_until(lambda: open(first.log_path).read().startswith("starting up"), 10)
            first.proc.kill()
            assert wait_until(lambda: children["decode-0"] is not first, 20)
        assert first.proc.returncode is not None  # reaped: no zombie
        text = caplog.text
        assert "decode-0" in text and "killed by SIGKILL" in text and "starting up" in text  # why, with its log
        assert "did not restart (port taken)" in text and supervisor.restarts == {"decode-0": 1}
    finally:
        supervisor.stop()
        for child in children.values():
            child.stop()


def test_an_instance_that_cannot_start_says_why(tmp_path):
    from mooncake_jax.instance.cluster import ChildInstance

    with pytest.raises(RuntimeError) as err:  # argparse refuses the command line: its message is in the error
        ChildInstance(["--role", "prefill", "--conductor", "127.0.0.1:1", "--max-batch", "many"],
                      tmp_path / "prefill-0.log", timeout_s=120)
    assert "exited with status 2" in str(err.value) and "invalid int value: 'many'" in str(err.value)


def test_conductor_process_flags_carry_its_policy_and_refuse_what_they_cannot():
    """The flags built for the Conductor process give the conductor command's parser the same PolicyConfig."""
    import argparse

    from mooncake_jax.conductor import command
    from mooncake_jax.conductor.api import PolicyConfig
    from mooncake_jax.instance.conductor_process import conductor_args

    config = PolicyConfig(strategy="load-balance", admission="early", block_size=32, kvcache_balancing_threshold=1.5,
                          ttft_slo_s=2.25, tbt_slo_s=0.3, seed=7)
    p = argparse.ArgumentParser()
    command.add_arguments(p)
    a = p.parse_args(conductor_args(config, "::1", 4321, 0.2, 3.0))
    assert a.listen == "[::1]:4321" and (a.heartbeat_interval_s, a.heartbeat_timeout_s) == (0.2, 3.0)
    assert PolicyConfig(strategy=a.policy, admission=a.admission, block_size=a.block_size, seed=a.seed,
                        kvcache_balancing_threshold=a.kvcache_balancing_threshold, ttft_slo_s=a.ttft_slo_s,
                        tbt_slo_s=a.tbt_slo_s) == config
    with pytest.raises(ValueError, match=r"takes no \['decode_time_s'\]"):
        conductor_args(PolicyConfig(decode_time_s=2.0), "127.0.0.1", 0, 0.5, 3.0)


def test_the_supervised_conductor_process_comes_back_on_its_address_with_the_block_lists(tmp_path):
    """No model (fast): the Conductor process a local cluster runs, SIGKILLed, is restarted by its supervisor on the
    port it first bound, and an instance's link registers again there with its block list. The shared token reaches
    it on its standard input (not its command line), and calls without it are refused."""
    from mooncake_jax.conductor.api import PolicyConfig
    from mooncake_jax.instance.backend import conductor_messages, conductor_services
    from mooncake_jax.instance.cluster import ChildInstance
    from mooncake_jax.instance.conductor_link import ConductorLink
    from mooncake_jax.instance.conductor_process import ConductorLauncher
    from mooncake_jax.proto.auth import open_channel

    launcher = ConductorLauncher(PolicyConfig(block_size=16), "127.0.0.1", 0.2, 5.0, lambda args: ChildInstance(
        args, tmp_path / "conductor.log", timeout_s=60, auth_token="s3cret", command="conductor"))
    children = {"conductor": launcher.start()}
    first = children["conductor"]
    supervisor = Supervisor(children, lambda _: launcher.start(), poll_s=0.05, what="Conductor").start()
    assert b"s3cret" not in open(f"/proc/{first.proc.pid}/cmdline", "rb").read()
    link = ConductorLink(first.address, "prefill-a", "prefill", "10.0.0.1:1", "", 1000, load=lambda: {},
                         block_lists=lambda: ([7, 8, 9], []), hardware="8xA800", model="llama2-70b",
                         auth_token="s3cret").start()
    channel = open_channel(first.address, "s3cret")
    listing = conductor_services.ConductorStub(channel).ListInstances

    def indexed():
        try:
            reply = listing(conductor_messages.ListInstancesRequest(), timeout=2)
        except grpc.RpcError:
            return None
        return [i.instance_id for i in reply.instances], reply.indexed_blocks

    try:
        assert indexed() == (["prefill-a"], 3)
        with open_channel(first.address) as plain, pytest.raises(grpc.RpcError) as err:
            conductor_services.ConductorStub(plain).ListInstances(conductor_messages.ListInstancesRequest(),
                                                                  timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        first.kill()
        assert indexed() is None  # nobody there while it restarts
        assert wait_until(lambda: indexed() == (["prefill-a"], 3), 30)  # back, and the link registered again
        again = children["conductor"]
        assert again is not first and again.address == first.address and supervisor.restarts == {"conductor": 1}
        assert "Conductor serving on" in (tmp_path / "conductor.log").read_text()
    finally:
        link.stop(deregister=False)
        channel.close()
        supervisor.stop()
        for child in children.values():
            child.stop()
    assert children["conductor"].proc.returncode is not None


@pytest.mark.slow
def test_a_killed_conductor_process_comes_back_on_its_address_and_the_cluster_serves_again():
    """Instances in this process (fast), the Conductor in its own, supervised: SIGKILLed, requests fail with a
    status while it is away (never hang), it is restarted on the same port, the instances re-register, and the
    same gateway backend serves the same tokens again."""
    with mj.Cluster.local("tiny", prefill=1, decode=1, profile_json=PROFILE, conductor_process=True,
                          heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0, **FAST) as c:
        p = prompts([10], seed=31)[0]  # under one block: no prefix cached, so no other prefill shape to compile
        expected = c.run(p, max_new_tokens=3)[0]
        first = c.conductor
        address, pid = first.address, first.proc.pid
        assert not hasattr(first, "service")  # a process, not an object of this one
        first.kill()
        t = time.monotonic()
        with pytest.raises(Unavailable, match="Conductor"):  # restarting takes >= 0.5 s of backoff
            c.run(p, max_new_tokens=3)
        assert time.monotonic() - t < 15
        assert wait_until(lambda: c.conductor is not first and c.backend.health() is None, 60)
        assert c.conductor.address == address and c.conductor.proc.pid != pid
        assert c.conductor_supervisor.restarts == {"conductor": 1}
        assert c.run(p, max_new_tokens=3)[0] == expected
    assert c.conductor.proc.poll() is not None  # closed with the cluster: no orphan


def test_a_prefill_instance_refuses_a_request_it_can_no_longer_serve_within_the_ttft_slo():
    """The check of last resort (instance/prefill.py): work predicted by the cost model, scaled by the measured
    slowdown, against what is left of the prefill's budget (the SLO less the KV push, ``accounting``) ->
    RESOURCE_EXHAUSTED (a 429). No cost model here: no push predicted, the budget is the whole SLO."""
    from types import SimpleNamespace

    from mooncake_jax.instance.prefill import PrefillService, SlowdownMeter
    from mooncake_jax.instance.rpc import InstanceService, LateRejection

    instance = SimpleNamespace(ttft_slo_s=2.0, costs=None, config=SimpleNamespace(instance_id="prefill-0"))
    service = PrefillService.__new__(PrefillService)  # only the check: no engine behind it
    InstanceService.__init__(service, instance, ("prefill_refused_ttft",))
    service.slowdown = SlowdownMeter()
    now = time.perf_counter()
    service._check_deadline(now, 1.9, "on arrival")  # 1.9 s of work, 2.0 s left (the old 10% share refused it)
    service.slowdown.record(0.2, 0.1)  # it runs 2x slower than its model: 2.0 s > 2.0 s less the time since
    with pytest.raises(LateRejection, match=r"prefill-0 cannot meet the TTFT SLO of 2 s \(on arrival: 2.00 s of "
                                            r"work, 1\.9\d s left of 2.00 s before the KV push\)"):
        service._check_deadline(now - 0.05, 1.0, "on arrival")
    service._check_deadline(now - 1.7, 0.1, "out of the queue")  # waited 1.7 s: 0.2 s of work in 0.3 s left
    with pytest.raises(LateRejection, match=r"out of the queue: 0.40 s of work, 0\.[23]\d s left"):  # (a slow host)
        service._check_deadline(now - 1.7, 0.2, "out of the queue")
    assert service.counts()["prefill_refused_ttft_total"] == 2
    instance.ttft_slo_s = None  # not registered yet: no SLO to hold it to
    service._check_deadline(now - 100, 5.0, "on arrival")


def test_only_a_cluster_that_admits_lets_its_prefill_instances_refuse_on_the_ttft_slo():
    """Admission ``none`` (pure scheduling studies) accepts everything: the Conductor says so at registration and
    the prefill instance's last-resort check then has no SLO to refuse on."""
    from types import SimpleNamespace

    from mooncake_jax.conductor.api import PolicyConfig
    from mooncake_jax.conductor.service import ConductorService, messages
    from mooncake_jax.instance.server import InstanceServer

    for admission, admits in (("none", False), ("baseline", True), ("predictive", True)):
        service = ConductorService(PolicyConfig(block_size=16, admission=admission, ttft_slo_s=2.0))
        reply = service.Register(messages.RegisterRequest(instance_id="p0", role=messages.PREFILL, address="p0:1",
                                                          hardware="8xA800", model="llama2-70b"), None)
        assert reply.admits is admits and reply.ttft_slo_s == 2.0
        link = SimpleNamespace(ttft_slo_s=reply.ttft_slo_s, admits=reply.admits)
        assert InstanceServer.ttft_slo_s.fget(SimpleNamespace(link=link)) == (2.0 if admits else None)
