"""Short CPU slices for the processes that carry tokens (``instance/sched_slice.py``): every thread of the process
and those it starts later ask for the short slice, and a process can go back to the default. Run in a child
process, so the test runner's own threads keep theirs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mooncake_jax.instance import sched_slice

CHILD = r"""
import json, threading
from mooncake_jax.instance import sched_slice as s
before = s.slice_ns()
seen = {}
ready, go = threading.Event(), threading.Event()
def early():  # started before the call: must be changed too
    ready.set(); go.wait(); seen["early"] = s.slice_ns()
t = threading.Thread(target=early); t.start(); ready.wait()
took = s.prefer_short_slices()
main = s.slice_ns()
later = []
u = threading.Thread(target=lambda: later.append(s.slice_ns())); u.start(); u.join()
go.set(); t.join()
restored = s.restore_default_slices()
print(json.dumps({"before": before, "took": took, "main": main, "early": seen["early"], "later": later[0],
                  "restored": restored, "after": s.slice_ns()}))
"""


def test_every_thread_and_later_ones_ask_for_the_short_slice_and_can_go_back():
    if sched_slice.slice_ns() in (None, 0):
        pytest.skip("this kernel reports no slice for SCHED_OTHER threads (Linux < 6.12, or not Linux)")
    out = json.loads(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True,
                                    timeout=60).stdout)
    assert out["took"] and out["restored"]
    assert out["before"] > sched_slice.SHORT_SLICE_NS  # the default (0.7 ms or more) is longer
    assert out["main"] == out["early"] == out["later"] == sched_slice.SHORT_SLICE_NS
    assert out["after"] == out["before"]


def test_an_unsupported_platform_is_a_log_line_not_an_error(monkeypatch, caplog):
    monkeypatch.setattr(sched_slice, "_syscalls", lambda: None)
    assert sched_slice.slice_ns() is None
    with caplog.at_level("INFO"):
        assert sched_slice.prefer_short_slices() is False
    assert "CPU slices of 0.1 ms unavailable" in caplog.text


def test_a_kernel_that_ignores_the_request_is_a_refusal(monkeypatch, caplog):
    monkeypatch.setattr(sched_slice, "set_slice", lambda tid, ns: None)  # accepted, as Linux < 6.12 does
    monkeypatch.setattr(sched_slice, "slice_ns", lambda tid=0: 0)  # and read back as no slice
    with caplog.at_level("INFO"):
        assert sched_slice.prefer_short_slices() is False
    assert "Linux before 6.12" in caplog.text


def test_a_command_started_by_a_short_slice_process_starts_with_the_default():
    if sched_slice.slice_ns() in (None, 0):
        pytest.skip("this kernel reports no slice for SCHED_OTHER threads (Linux < 6.12, or not Linux)")
    child = ("import subprocess, sys\n"
             "from mooncake_jax.instance import sched_slice as s\n"
             "s.prefer_short_slices()\n"
             "code = 'from mooncake_jax import cli; from mooncake_jax.instance import sched_slice as s; "
             "print(s.slice_ns()); cli._start_with_default_slices(); print(s.slice_ns())'\n"
             "print(subprocess.run([sys.executable, '-c', code], capture_output=True, text=True).stdout)\n")
    inherited, started = map(int, subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                                                 check=True, timeout=60).stdout.split())
    assert inherited == sched_slice.SHORT_SLICE_NS
    assert started == sched_slice.slice_ns() != sched_slice.SHORT_SLICE_NS
