"""``Pace`` times each way warm (twenty-first pass, issue 15): a batch that is its reader's first paced one, or a batch
with the helper after one without, is told to ``Pace`` as cold; it is not recorded and the reader's next paced batch
goes the same way, unasked, to be timed warm. In the benchmark's fresh-pool 16-token get a lone try of the helper
(its thread idle since its last try, or made anew) cost 110-460 us/MB where the helper's batches in a streak cost
72-90 and the batches alone 90-100, so a trial that began alone stayed alone. Hand-worked cases with fake clocks: the
quiet machine (the helper faster once warm, slow when cold) now goes to the helper and stays; the loaded machine (the
helper slower even warm) stays alone and tries the helper as seldom as before but in pairs."""

import numpy as np

from mooncake_jax.transfer import shard_reader
from mooncake_jax.transfer.pool import page_aligned_empty
from mooncake_jax.transfer.shard_reader import Pace, ShardReader
from mooncake_jax.transfer.stream_copy import address

RECORD = 3 << 17  # a 16-token block of the ``small`` preset


class Reader:
    """A reader's batches as ``ShardReader.read_many`` tells ``Pace`` of them, timed by a fake clock (the reader's
    rule restated: ``test_read_many_tells_pace_which_batches_were_warm`` holds the real reader to it)."""

    def __init__(self, pace: Pace) -> None:
        self.pace, self.last, self.repeat = pace, None, None

    def drive(self, batches: int, seconds) -> list[str]:
        """``batches`` batches, each taking ``seconds(helped, warm)``; the ways taken, ``H``/``a`` warm, ``c``/``d``
        cold."""
        ways = []
        for _ in range(batches):
            if self.repeat is not None:
                way, self.repeat = self.repeat, None
            else:
                way = self.pace.helped()
            warm = self.last is True if way else self.last is not None
            self.pace.took(way, seconds(way, warm), 1000, warm)
            self.repeat = None if warm else way
            self.last = way
            ways.append(("H" if way else "a") if warm else ("c" if way else "d"))
        return ways


def drive(pace: Pace, batches: int, seconds) -> list[str]:
    """``batches`` batches of one fresh reader (``Reader.drive``)."""
    return Reader(pace).drive(batches, seconds)


def test_a_cold_batch_is_not_recorded():
    pace = Pace()
    pace.took(True, 5.0, 1000, warm=False)
    pace.took(False, 5.0, 1000, warm=False)
    assert all(len(figures) == 0 for figures in pace._seconds_per_byte.values())
    pace.took(False, 1.0, 1000)
    assert list(pace._seconds_per_byte[False]) == [1.0 / 1000]


def test_one_readers_cold_batch_does_not_decide_anothers_way():
    """``Pace`` is shared by every reader of a record size (``pace_for``): a cold batch of one reader leaves the
    next answer to the figures (the repeat is the reader's), here the caller alone, far faster."""
    pace = Pace()
    for _ in range(pace.window):
        pace.took(True, 3.0, 1000)
        pace.took(False, 1.0, 1000)
    pace.took(True, 5.0, 1000, warm=False)  # another reader's cold try of the helper
    assert pace.helped() is False


def test_quiet_machine_the_helper_cold_slow_warm_fast_is_taken():
    """A free core: the helper's batch 0.8 of the caller alone's once warm, 3x slow when cold (a thread woken after
    idling, or made). Before, every batch was recorded as it came, so every lone try of the helper was cold (3.0
    against 1.0) and the helper, tried every ``far_explore_every`` batches, never won; now its tries are timed
    warm."""

    def seconds(helped: bool, warm: bool) -> float:
        return (0.8 if warm else 3.0) if helped else (1.0 if warm else 1.5)

    pace = Pace()
    ways = drive(pace, 200, seconds)
    later = ways[100:]
    alone = 100 // pace.explore_every + 1  # its tries of the caller alone, one batch each
    assert later.count("a") <= alone and later.count("H") + later.count("c") >= 100 - alone and "d" not in later


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
    nearly every batch; the helper's tries come in pairs (cold, warm), once every ``explore_every`` asks."""

    def seconds(helped: bool, warm: bool) -> float:
        return (1.3 if warm else 4.0) if helped else 1.0

    reader = Reader(Pace())
    reader.drive(40, seconds)
    later = reader.drive(4 * (reader.pace.explore_every + 1), seconds)  # (a pair is one ask: Pace counts asks)
    helped = [w for w in later if w in "Hc"]
    assert len(helped) == 2 * 4 and "".join(later).count("cH") == 4
    assert later.count("a") == len(later) - len(helped)  # a batch alone after the helper's is warm


def test_read_many_tells_pace_which_batches_were_warm(tmp_path):
    """Through the reader: its first batch that asks is cold, a batch with the helper after one without cold, any
    other warm; batches that do not ask (one run) change nothing."""
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 16 * RECORD, dtype=np.uint8)
    (tmp_path / "s0").write_bytes(data.tobytes())
    answers = iter([True, False, False, False, True])  # (the second batch repeats the first's way, unasked)
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
    assert next(answers, None) is None  # asked five times


def test_the_real_pace_through_a_reader_repeats_a_cold_batch(tmp_path, monkeypatch):
    """The real ``Pace`` and reader: the first batch of a fresh reader goes the way ``Pace`` answers and records
    nothing; the second goes the same way unasked and is recorded."""
    data = np.random.default_rng(5).integers(0, 256, 8 * RECORD, dtype=np.uint8)
    (tmp_path / "s0").write_bytes(data.tobytes())
    pace = Pace()
    ways, went = [], []
    real, real_took = Pace.helped, Pace.took
    monkeypatch.setattr(Pace, "helped", lambda self: ways.append(real(self)) or ways[-1])
    monkeypatch.setattr(Pace, "took", lambda self, helped, *args: went.append(helped) or real_took(self, helped, *args))
    reader = ShardReader(lambda shard: tmp_path / f"s{shard}", pace)
    try:
        for _ in range(2):
            staging = page_aligned_empty((8, RECORD), np.uint8)
            reader.read_many([(0, j * RECORD, staging[j]) for j in range(8)], [address(row) for row in staging])
    finally:
        reader.close()
    assert len(ways) == 1 and went == [ways[0], ways[0]]
    assert len(pace._seconds_per_byte[ways[0]]) == 1 and len(pace._seconds_per_byte[not ways[0]]) == 0
    assert shard_reader.HELPED_RUN_BYTES < 8 * RECORD
