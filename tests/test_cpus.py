"""Instances on host cores of their own (instance/cpus.py, InstanceConfig.cpus)."""

import json
import os
import subprocess
import sys

import pytest

from mooncake_jax.instance import cpus
from mooncake_jax.instance.config import InstanceConfig
from mooncake_jax.instance.main import parse_args

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="core pinning is Linux-only")


def test_cpus_round_trip_through_the_one_serializer():
    c = InstanceConfig(role="decode", cpus="1,3-4")
    assert c.cpus == (1, 3, 4)
    assert c.to_dict()["cpus"] == "1,3,4"
    assert InstanceConfig.from_json(c.to_json()) == c
    assert InstanceConfig(role="decode").to_dict()["cpus"] is None
    assert parse_args(["--role", "decode", "--conductor", "127.0.0.1:1", "--cpus", "0-1"]).cpus == (0, 1)


@pytest.mark.parametrize("value, message", [("1-0", "runs backwards"), ("a", "not an id"), ("1,1", "twice"),
                                            ([-1], "non-negative")])
def test_bad_cpus_are_refused_naming_the_value(value, message):
    with pytest.raises(ValueError, match=message) as e:
        InstanceConfig(role="decode", cpus=value)
    assert "cpus" in str(e.value)


@linux_only
def test_a_cluster_cannot_give_away_a_core_that_does_not_exist_or_every_core():
    n = os.cpu_count()
    with pytest.raises(ValueError, match=f"include core {n}, which does not exist"):
        cpus.check([InstanceConfig(role="decode", instance_id="decode-0", cpus=(n,))])
    with pytest.raises(ValueError, match="take every core"):
        cpus.check([InstanceConfig(role="decode", cpus=tuple(range(n)))])
    cpus.check([InstanceConfig(role="prefill"), InstanceConfig(role="decode")])  # nothing pinned: nothing to check


def test_in_process_instances_cannot_have_cores_of_their_own():
    from mooncake_jax.instance.cluster import Cluster

    with pytest.raises(ValueError, match="processes=True"):
        Cluster.local("tiny", prefill=1, decode=1, decode_cpus="0", warmup=False)


@linux_only
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_pin_moves_every_thread_and_keep_off_leaves_the_owned_cores():
    """In a child process (pinning is process-wide): threads started before and after the pin follow it, and a
    launcher keeping off an instance's core runs on the others."""
    code = """
import os, threading
from mooncake_jax.instance import cpus
from mooncake_jax.instance.config import InstanceConfig
seen = {}
ready, go = threading.Event(), threading.Event()
def before():
    ready.set(); go.wait(); seen['before'] = os.sched_getaffinity(0)
t = threading.Thread(target=before); t.start(); ready.wait()
cpus.pin((0,))
go.set(); t.join()
after = threading.Thread(target=lambda: seen.__setitem__('after', os.sched_getaffinity(0))); after.start(); after.join()
print(sorted(seen['before']), sorted(seen['after']), sorted(os.sched_getaffinity(0)))
cpus.pin(tuple(range(os.cpu_count())))
cpus.keep_off([InstanceConfig(role='decode', cpus=(0,))])
print(sorted(os.sched_getaffinity(0)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    first, second = out.stdout.strip().splitlines()
    assert first == "[0] [0] [0]"
    assert second == str(list(range(1, os.cpu_count())))


@linux_only
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_service_threads_leave_the_compute_cores_and_the_engines_stay():
    """In a child process pinned to core 0 from cores 0..n-1: after ``move_service_threads`` the compute thread (by
    id) and a thread named as XLA's pools are (``tf_...``) stay on 0; the main thread and a service thread go to the
    other cores, and a thread the service thread starts afterwards follows it, one the compute thread starts stays."""
    code = """
import ctypes, os, threading
from mooncake_jax.instance import cpus
libc = ctypes.CDLL(None)
mask = {}
go, stop = threading.Event(), threading.Event()
def child(name):
    t = threading.Thread(target=lambda: mask.__setitem__(name, os.sched_getaffinity(0))); t.start(); t.join()
def compute():
    mask['compute_tid'] = threading.get_native_id(); go.wait(); mask['compute'] = os.sched_getaffinity(0)
    child('compute_child'); stop.wait()
def xla():
    libc.prctl(15, b"tf_XLAEigen", 0, 0, 0)  # PR_SET_NAME
    go.wait(); mask['xla'] = os.sched_getaffinity(0); stop.wait()
def service():
    go.wait(); mask['service'] = os.sched_getaffinity(0); child('service_child'); stop.wait()
assert cpus.service_cores(None) is None and cpus.service_cores(tuple(range(os.cpu_count()))) is None
service_cores = cpus.service_cores((0,))
cpus.pin((0,))
threads = [threading.Thread(target=f) for f in (compute, xla, service)]
for t in threads: t.start()
while 'compute_tid' not in mask: pass
assert cpus.move_service_threads(None, {mask['compute_tid']}) == 0 and os.sched_getaffinity(0) == {0}
moved = cpus.move_service_threads(service_cores, {mask['compute_tid']})
go.set()
while len(mask) < 6: pass
stop.set()
for t in threads: t.join()
import json
print(json.dumps({'service_cores': list(service_cores), 'moved': moved, 'main': sorted(os.sched_getaffinity(0)),
                  **{k: sorted(mask[k]) for k in ('compute', 'compute_child', 'xla', 'service', 'service_child')}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    rest = list(range(1, os.cpu_count()))
    assert got.pop("moved") >= 2  # the main thread and the service thread at least
    assert got == {"service_cores": rest, "main": rest, "compute": [0], "compute_child": [0], "xla": [0],
                   "service": rest, "service_child": rest}


@linux_only
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
@pytest.mark.slow  # two instance processes to start: about a minute on 2 cores (-m slow)
def test_a_decode_instance_on_its_own_core_keeps_only_its_compute_there():
    """``Cluster.local(decode_cpus=...)`` as ``demo --decode-cpus 1`` runs it: the decode process serves the greedy
    tokens of a single engine, and on its core runs only the engine thread (one thread named ``python``) and XLA's
    pools; its gRPC and transfer threads are on the launcher's cores."""
    import mooncake_jax as mj

    from tiny_profile import PROFILE

    core = os.cpu_count() - 1
    want = mj.LLM("tiny").generate([[5, 6, 7, 8, 9]], max_new_tokens=4)
    with mj.Cluster.local("tiny", prefill=1, decode=1, processes=True, decode_cpus=str(core), warmup=False,
                          compile_cache=None, profile_json=PROFILE) as cluster:
        assert cluster.generate([[5, 6, 7, 8, 9]], max_new_tokens=4) == want
        pid = cluster.instances["decode-0"].proc.pid
        threads = []  # (name, cores) of each thread of the decode process
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                threads.append((f.read().strip(), os.sched_getaffinity(int(tid))))
    on_core = [name for name, cores in threads if cores == {core}]
    assert [n for n in on_core if not n.startswith(cpus.COMPUTE_THREAD_PREFIXES)] == ["python"]
    elsewhere = [cores for name, cores in threads if cores != {core}]
    assert len(elsewhere) >= 5  # the gRPC poller and handlers, transfer threads, the Conductor link, main
    assert all(core not in cores for cores in elsewhere)
