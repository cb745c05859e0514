"""``shard_reader.Helper``, the thread that reads a batch's runs beside the caller (twentieth pass: two bare locks
instead of a ``ThreadPoolExecutor``). Once ``finish`` returns the work is not running and never will (a batch's
outs may be reused at once): taken back if the thread had not woken, else waited for; the helper's failure is raised
by ``finish``, not when the caller's own failure is on its way; the thread serves batch after batch and ends on
``close``, or when its ``Helper`` is dropped unclosed; one caller at a time (review of the twentieth pass); a forked
child that closes or drops a reader inherited with its helper does not hang (review of the twenty-first pass)."""

import gc
import os
import signal
import threading
import time

import numpy as np
import pytest

from mooncake_jax.transfer.pool import page_aligned_empty
from mooncake_jax.transfer.shard_reader import Helper, ShardReader
from mooncake_jax.transfer.stream_copy import address


def test_after_finish_the_work_has_run_once_or_never_and_runs_no_more():
    """Both ways ``finish`` can go are taken: some batches wait until the thread has started their work (waited
    for), the rest finish at once, where the thread, still to wake, mostly loses the race (taken back; with a core
    free it may win 300 times in a row, so the batches go on, up to 5,000, until it has lost once)."""
    helper = Helper()
    ran_after = []
    taken_back = waited_for = 0
    batch = 0
    while batch < 300 or (not taken_back and batch < 5000):  # (a free core may wake the thread first 300 times:
        batch += 1  # seen once in about 30 runs on the 2-vCPU AMD EPYC; more batches until the race is lost once)
        runs = []
        finished, started = threading.Event(), threading.Event()

        def work(runs=runs, finished=finished, started=started):
            runs.append(1)
            started.set()
            if finished.is_set():
                ran_after.append(batch)

        helper.start(work)
        if batch % 3 == 0 and batch <= 300:
            assert started.wait(5)  # the thread woke and took it: finish must wait for it
        helper.finish()
        finished.set()
        assert len(runs) <= 1
        taken_back += not runs
        waited_for += bool(runs)
    time.sleep(0.01)
    assert not ran_after  # no work ran once its finish had returned
    assert waited_for >= 100 and taken_back >= 1  # both paths of finish ran
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


def test_one_caller_at_a_time_a_second_start_before_finish_is_refused():
    helper = Helper()
    done = []
    helper.start(lambda: done.append(1))
    with pytest.raises(RuntimeError, match="one caller at a time"):
        helper.start(lambda: done.append(2))
    helper.finish()
    assert 2 not in done
    helper.start(lambda: done.append(3))  # after finish the next batch is taken
    helper.finish()
    helper.close()
    helper.close()  # (once: a second close does nothing)
    assert not helper._thread.is_alive()


def test_a_helper_dropped_without_close_ends_its_thread():
    helper = Helper()
    helper.start(lambda: None)
    helper.finish()
    thread = helper._thread
    del helper
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


class Always:
    """A ``Pace`` that always answers the helper's way."""

    def helped(self) -> bool:
        return True

    def took(self, helped, seconds, nbytes, warm=True) -> None:
        pass


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the child only drops a reader and exits at once
@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_forked_child_that_closes_or_drops_an_inherited_reader_does_not_hang(tmp_path, how):
    """The child has none of the parent's threads: stopping the inherited helper there (``close``, or the finalizer
    of a dropped reader) once waited for a ``done`` no thread would release, and the child hung for ever. It must
    exit at once; the parent's reader still reads with its helper after."""
    record = 3 << 17
    data = np.random.default_rng(7).integers(0, 256, 8 * record, dtype=np.uint8)
    (tmp_path / "s0").write_bytes(data.tobytes())
    reader = ShardReader(lambda shard: tmp_path / f"s{shard}", Always())

    def read() -> bool:
        staging = page_aligned_empty((8, record), np.uint8)
        got = reader.read_many([(0, j * record, staging[j]) for j in range(8)], [address(row) for row in staging])
        return all(g is not None for g in got) and staging.tobytes() == data.tobytes()

    assert read() and reader._helper is not None
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            if how == "close":
                reader.close()
            else:
                del reader
                gc.collect()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.01)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the child that did {how} to its inherited reader hung (killed after 20 s)")
    assert os.waitstatus_to_exitcode(status) == 0
    try:
        assert read()  # the parent's helper thread still serves
    finally:
        reader.close()
