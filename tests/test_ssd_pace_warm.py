"""``Pace`` times each way warm (twenty-first pass, issue 15): a batch that is its reader's first to ask, or a batch
with the helper after one without, is told to ``Pace`` as cold; it is not recorded and the next batch
goes the same way, to be timed warm. In the benchmark's fresh-pool 16-token get a lone try of the helper (its thread
idle since its last try, or made anew) cost 110-460 us/MB where the helper's batches in a streak cost 72-90 and the
batches alone 90-100, so a trial that began alone stayed alone. Hand-worked cases with fake clocks: the quiet machine
(the helper faster once warm, slow when cold) now goes to the helper and stays; the loaded machine (the helper slower
even warm) stays alone and tries the helper as seldom as before but in pairs."""

import numpy as np

from mooncake_jax.transfer import shard_reader
from mooncake_jax.transfer.pool import page_aligned_empty
from mooncake_jax.transfer.shard_reader import Pace, ShardReader
from mooncake_jax.transfer.stream_copy import address

RECORD = 3 << 17  # a 16-token block of the ``small`` preset


class Reader:
    """A reader's batches as ``ShardReader.read_many`` tells ``Pace`` of them, timed by a fake clock."""

    def __init__(self, pace: Pace) -> None:
        self.pace, self.last = pace, None

    def drive(self, batches: int, seconds) -> list[str]:
        """``batches`` batches, each taking ``seconds(helped, warm)``; the ways taken, ``H``/``a`` warm, ``c``/``d``
        cold."""
        ways = []
        for _ in range(batches):
            way = self.pace.helped()
            warm = self.last is True if way else self.last is not None
            self.pace.took(way, seconds(way, warm), 1000, warm)
            self.last = way
            ways.append(("H" if way else "a") if warm else ("c" if way else "d"))
        return ways


def drive(pace: Pace, batches: int, seconds) -> list[str]:
    """``batches`` batches of one fresh reader (``Reader.drive``)."""
    return Reader(pace).drive(batches, seconds)


def test_a_cold_batch_is_not_recorded_and_its_way_is_asked_again():
    pace = Pace()
    pace.took(True, 5.0, 1000, warm=False)
    assert pace.helped() is True  # the same way again, whatever the figures say
    pace.took(False, 5.0, 1000, warm=False)
    assert pace.helped() is False
    assert all(len(figures) == 0 for figures in pace._seconds_per_byte.values())
    pace.took(False, 1.0, 1000)
    assert list(pace._seconds_per_byte[False]) == [1.0 / 1000]


def test_quiet_machine_the_helper_cold_slow_warm_fast_is_taken():
    """A free core: the helper's batch 0.8 of the caller alone's once warm, 3x slow when cold (a thread woken after
    idling, or made). Before, every lone try was cold and the helper never won; now its tries are timed warm."""

    def seconds(helped: bool, warm: bool) -> float:
        return (0.8 if warm else 3.0) if helped else (1.0 if warm else 1.5)

    pace = Pace()
    ways = drive(pace, 200, seconds)
    later = ways[100:]
    alone = 100 // pace.explore_every + 1  # its tries of the caller alone, one batch each
    assert later.count("a") <= alone and later.count("H") + later.count("c") >= 100 - alone and "d" not in later
    old = Pace()  # the old way: every batch recorded as it came (tries lone, so cold)
    old_ways = []
    last = None
    for _ in range(200):
        way = old.helped()
        old.took(way, seconds(way, last is way), 1000)
        last = way
        old_ways.append(way)
    assert old_ways[100:].count(True) <= 100 // old.explore_every + 1  # stuck alone: why the change


def test_quiet_machine_a_trial_that_begins_alone_turns_to_the_helper():
    """The benchmark's pattern: the helper way learnt slow once (a loaded spell), then the machine is quiet. A warm
    try of the helper that beats the caller's median clears the helper's old figures and it is taken again within
    one far try and a window."""

    def slow(helped: bool, warm: bool) -> float:
        return 3.0 if helped else 1.0

    def quiet(helped: bool, warm: bool) -> float:
        return (0.8 if warm else 3.0) if helped else 1.0

    reader = Reader(Pace())
    pace = reader.pace
    reader.drive(100, slow)  # the helper far slower: tried every far_explore_every batches
    ways = reader.drive(2 * pace.far_explore_every, quiet)
    first = ways.index("c")
    assert first < pace.far_explore_every and ways[first + 1] == "H"  # a pair: cold, then timed warm
    after = ways[first + 2 + pace.window :]
    assert after.count("a") <= len(after) // pace.explore_every + 1 and "d" not in after


def test_loaded_machine_stays_alone_and_tries_the_helper_in_pairs():
    """No core free: the helper slower than the caller alone even warm (1.3), far slower cold. The caller alone reads
    nearly every batch; the helper's tries come in pairs (cold, warm), once every ``explore_every`` batches."""

    def seconds(helped: bool, warm: bool) -> float:
        return (1.3 if warm else 4.0) if helped else 1.0

    reader = Reader(Pace())
    reader.drive(40, seconds)
    later = reader.drive(4 * reader.pace.explore_every, seconds)
    helped = [w for w in later if w in "Hc"]
    assert len(helped) == 2 * 4 and "".join(later).count("cH") == 4
    assert later.count("a") == len(later) - len(helped)  # a batch alone after the helper's is warm


def test_read_many_tells_pace_which_batches_were_warm(tmp_path):
    """Through the reader: its first batch that asks is cold, a batch with the helper after one without cold, any
    other warm; batches that do not ask (one run) change nothing."""
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 16 * RECORD, dtype=np.uint8)
    (tmp_path / "s0").write_bytes(data.tobytes())
    answers = iter([True, True, False, False, False, True])
    told = []

    class Fake:
        def helped(self) -> bool:
            return next(answers)

        def took(self, helped, seconds, nbytes, warm=True):
            told.append((helped, warm))

    reader = ShardReader(lambda shard: tmp_path / f"s{shard}", Fake())
    try:
        for i in range(6):
            if i == 3:  # a batch of one run: asks nothing
                staging = page_aligned_empty((2, RECORD), np.uint8)
                reader.read_many([(0, j * RECORD, staging[j]) for j in range(2)])
            staging = page_aligned_empty((8, RECORD), np.uint8)
            reads = [(0, j * RECORD, staging[j]) for j in range(8)]
            got = reader.read_many(reads, [address(row) for row in staging])
            assert all(out.tobytes() == data[j * RECORD : (j + 1) * RECORD].tobytes() and g is not None
                       for j, ((_, _, out), g) in enumerate(zip(reads, got)))
    finally:
        reader.close()
    assert told == [(True, False), (True, True), (False, True), (False, True), (False, True), (True, False)]


def test_the_real_pace_through_a_reader_asks_again_after_a_cold_batch(tmp_path, monkeypatch):
    """The real ``Pace`` and reader: the first batch of a fresh reader goes some way and records nothing; the
    second goes the same way and is recorded."""
    data = np.random.default_rng(5).integers(0, 256, 8 * RECORD, dtype=np.uint8)
    (tmp_path / "s0").write_bytes(data.tobytes())
    pace = Pace()
    ways = []
    real = Pace.helped
    monkeypatch.setattr(Pace, "helped", lambda self: ways.append(real(self)) or ways[-1])
    reader = ShardReader(lambda shard: tmp_path / f"s{shard}", pace)
    try:
        for _ in range(2):
            staging = page_aligned_empty((8, RECORD), np.uint8)
            reader.read_many([(0, j * RECORD, staging[j]) for j in range(8)], [address(row) for row in staging])
    finally:
        reader.close()
    assert ways[0] == ways[1]
    assert len(pace._seconds_per_byte[ways[0]]) == 1 and len(pace._seconds_per_byte[not ways[0]]) == 0
    assert shard_reader.HELPED_RUN_BYTES < 8 * RECORD


def test_a_closed_readers_helper_thread_serves_the_next_reader(tmp_path, monkeypatch):
    """A pool opened for a few batches does not start a thread each time: a closed reader's ``Helper`` is kept idle
    (up to ``SPARE_HELPERS``) and the next reader's two-thread batches run on its thread, reading the same bytes;
    past ``SPARE_HELPERS`` a closed reader's thread ends."""
    data = np.random.default_rng(9).integers(0, 256, 8 * RECORD, dtype=np.uint8)
    (tmp_path / "s0").write_bytes(data.tobytes())
    monkeypatch.setattr(shard_reader, "_spares", [])

    class Always:
        def helped(self) -> bool:
            return True

        def took(self, helped, seconds, nbytes, warm=True) -> None:
            pass

    def used_reader() -> ShardReader:
        reader = ShardReader(lambda shard: tmp_path / f"s{shard}", Always())
        staging = page_aligned_empty((8, RECORD), np.uint8)
        reads = [(0, j * RECORD, staging[j]) for j in range(8)]
        got = reader.read_many(reads, [address(row) for row in staging])
        assert all(g is not None for g in got) and staging.tobytes() == data.tobytes()
        return reader

    first = used_reader()
    thread = first._helper._thread
    first.close()
    assert thread.is_alive() and shard_reader._spares[0]._thread is thread
    second = used_reader()
    assert second._helper._thread is thread and shard_reader._spares == []
    readers = [used_reader() for _ in range(shard_reader.SPARE_HELPERS + 1)]
    threads = [reader._helper._thread for reader in readers]
    second.close()
    for reader in readers:
        reader.close()
    assert len(shard_reader._spares) == shard_reader.SPARE_HELPERS
    ended = [t for t in threads + [thread] if t not in [h._thread for h in shard_reader._spares]]
    for t in ended:
        t.join(5)
    assert len(ended) == 2 and not any(t.is_alive() for t in ended)
    for helper in shard_reader._spares:
        helper.close()


def test_a_forked_child_keeps_no_spare_helper(monkeypatch):
    """A forked child has none of its parent's threads: the parent's spare helpers are dropped there (a reader in
    the child makes its own), and kept in the parent."""
    import os

    import pytest

    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    monkeypatch.setattr(shard_reader, "_spares", shard_reader._spares)  # (restored as it was)
    helper = shard_reader.spare_helper()
    shard_reader._park(helper)
    assert helper in shard_reader._spares
    pid = os.fork()
    if pid == 0:
        os._exit(0 if not shard_reader._spares else 1)
    assert os.waitpid(pid, 0)[1] == 0 and helper in shard_reader._spares
