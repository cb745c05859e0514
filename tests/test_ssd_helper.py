"""``shard_reader.Helper``, the thread that reads a batch's runs beside the caller (twentieth pass: two bare locks
instead of a ``ThreadPoolExecutor``). Once ``finish`` returns the work is not running and never will (a batch's
outs may be reused at once): taken back if the thread had not woken, else waited for; the helper's failure is raised
by ``finish``, not when the caller's own failure is on its way; the thread serves batch after batch and ends on
``close``."""

import threading
import time

import pytest

from mooncake_jax.transfer.shard_reader import Helper


def test_after_finish_the_work_has_run_once_or_never_and_runs_no_more():
    helper = Helper()
    ran_after = []
    taken_back = 0
    for batch in range(300):
        runs = []
        finished = threading.Event()

        def work(runs=runs, finished=finished):
            runs.append(1)
            if finished.is_set():
                ran_after.append(batch)

        helper.start(work)
        if batch % 3 == 0:
            time.sleep(0.0002)  # some batches give the thread time to wake
        helper.finish()
        finished.set()
        assert len(runs) <= 1
        taken_back += not runs
    time.sleep(0.01)
    assert not ran_after  # no work ran once its finish had returned
    helper.close()
    assert not helper._thread.is_alive()


def test_the_helpers_failure_is_raised_by_finish_and_the_thread_serves_the_next_batch():
    helper = Helper()
    started = threading.Event()

    def failing():
        started.set()
        raise ValueError("helper's own failure")

    helper.start(failing)
    started.wait(5)
    with pytest.raises(ValueError, match="helper's own failure"):
        helper.finish()
    done = []
    helper.start(lambda: done.append(1))
    started.clear()
    helper.finish()  # ran or taken back: no stale error either way
    helper.start(lambda: (done.append(2), started.set()))
    started.wait(5)
    helper.finish()
    assert 2 in done
    helper.close()


def test_while_the_callers_failure_is_on_its_way_finish_waits_and_raises_nothing():
    helper = Helper()
    started, release = threading.Event(), threading.Event()
    finished = []

    def slow_failing():
        started.set()
        release.wait(5)
        finished.append(1)
        raise ValueError("helper")

    helper.start(slow_failing)
    started.wait(5)
    threading.Timer(0.05, release.set).start()
    helper.finish(raising=False)
    assert finished == [1]  # waited for: nothing writes into an out once read_many returns
    helper.close()
