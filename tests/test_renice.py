"""``cluster.renice``: a local cluster's instance processes run below (prefill) or above (decode) the launcher's
priority, every thread of them; raising where that is not permitted keeps the launcher's priority, with a log line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from mooncake_jax.instance import cpus
from mooncake_jax.instance.cluster import DECODE_NICENESS, PREFILL_NICENESS, renice

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads listed in /proc: Linux")

CHILD = "import threading, time; threading.Thread(target=time.sleep, args=(60,), daemon=True).start(); time.sleep(60)"


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD])
    deadline = time.monotonic() + 10
    while len(cpus.threads_of(proc.pid)) < 2 and time.monotonic() < deadline:  # its second thread started
        time.sleep(0.01)
    yield proc
    proc.kill()
    proc.wait()


def niceness(tids):
    return {os.getpriority(os.PRIO_PROCESS, tid) for tid in tids}


def test_prefill_runs_below_and_decode_above_the_launcher():
    assert PREFILL_NICENESS > 0 > DECODE_NICENESS


def test_renice_lowers_every_thread(child):
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    renice(child.pid, 3)
    tids = cpus.threads_of(child.pid)
    assert len(tids) >= 2 and niceness(tids) == {mine + 3}


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a priority needs root (or CAP_SYS_NICE)")
def test_renice_raises_every_thread_where_permitted(child):
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    renice(child.pid, -2)
    assert niceness(cpus.threads_of(child.pid)) == {mine - 2}


def test_a_raise_not_permitted_keeps_the_launchers_priority(child, monkeypatch, caplog):
    def refuse(which, who, prio):
        raise PermissionError(1, "Operation not permitted")

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    monkeypatch.setattr(os, "setpriority", refuse)
    with caplog.at_level(logging.INFO, logger="mooncake_jax.instance.cluster"):
        renice(child.pid, -5)
    assert niceness(cpus.threads_of(child.pid)) == {mine}
    assert any("could not raise the priority" in r.message and r.levelno == logging.INFO for r in caplog.records)


DISPATCH_CHILD = r"""
import sys
from mooncake_jax.instance.main import tune_dispatch
tune_dispatch(sys.argv[1])
import jax, jax.numpy as jnp
f = jax.jit(lambda a: (a @ a @ a @ a).sum())
x = jnp.ones((1024, 1024))
f(x).block_until_ready()
ready = []
for _ in range(3):
    y = f(x)
    ready.append(y.is_ready())  # done by the time the call returned: it ran on this thread
    y.block_until_ready()
print(all(ready), any(ready))  # every call done, some call done
"""


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_decode_process_runs_its_programs_on_the_calling_thread(role):
    """``main.tune_dispatch``: a decode instance's XLA:CPU programs have finished when the call returns (no
    executor thread to hand them to); a prefill instance keeps JAX's asynchronous dispatch (a 1,024-square matrix
    product chain is still running when the call returns)."""
    out = subprocess.run([sys.executable, "-c", DISPATCH_CHILD, role], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    every_call_done, some_call_done = out.stdout.split()
    assert every_call_done == ("True" if role == "decode" else "False")
