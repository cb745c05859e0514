"""Instances on host cores of their own (instance/cpus.py, InstanceConfig.cpus)."""

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
