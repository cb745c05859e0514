"""Short scheduler slices for the token path (``instance/slices.py``): every thread of the process takes the slice,
threads started later inherit it, niceness is kept, and only token-path processes (decode instance, gateway) ask."""

import os
import sys
import threading

import pytest

from mooncake_jax.instance import main as instance_main
from mooncake_jax.instance import slices


def _supported() -> bool:
    return slices.thread_slice_ns() is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-task slices are Linux's")
def test_every_thread_takes_the_slice_and_new_threads_inherit_it():
    if not _supported():
        pytest.skip("this kernel does not report a task's slice")
    release = threading.Event()
    seen = {}

    def idle():
        seen["tid"] = threading.get_native_id()
        release.wait(10)

    before = threading.Thread(target=idle)
    before.start()
    while "tid" not in seen:
        release.wait(0.01)
    nice = os.getpriority(os.PRIO_PROCESS, seen["tid"])
    try:
        assert slices.shorten_slices(200_000) >= 2
        if slices.thread_slice_ns() != 200_000:
            pytest.skip("this kernel keeps no per-task slice for normal threads (before Linux 6.12)")
        assert slices.thread_slice_ns(seen["tid"]) == 200_000  # a thread that existed before
        assert os.getpriority(os.PRIO_PROCESS, seen["tid"]) == nice
        later = []
        t = threading.Thread(target=lambda: later.append(slices.thread_slice_ns()))
        t.start()
        t.join()
        assert later == [200_000]  # inherited from the thread that started it
    finally:
        release.set()
        before.join()
        slices.shorten_slices(slices.LATENCY_SLICE_NS)


@pytest.mark.parametrize("bad", [0, 99_999, 100_000_001])
def test_a_slice_outside_linux_bounds_is_refused(bad):
    with pytest.raises(ValueError, match=f"slice_ns must be within .* got {bad}"):
        slices.shorten_slices(bad)


@pytest.mark.parametrize("token_path, calls", [(True, 1), (False, 0)])
def test_only_the_token_path_shortens_its_slices(monkeypatch, token_path, calls):
    """``settle_serving_process``: a decode instance and the gateway (token_path) shorten their slices; a prefill
    instance keeps the default (its long XLA runs are what the token path waits behind)."""
    called = []
    monkeypatch.setattr(slices, "shorten_slices", lambda *a: called.append(a) or 1)
    monkeypatch.setattr(instance_main.gc, "freeze", lambda: None)
    monkeypatch.setattr(instance_main.gc, "collect", lambda *a: 0)
    interval = sys.getswitchinterval()
    try:
        instance_main.settle_serving_process(token_path=token_path)
    finally:
        sys.setswitchinterval(interval)
    assert len(called) == calls
