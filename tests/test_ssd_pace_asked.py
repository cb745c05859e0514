"""Which batches ask ``Pace`` and what they record (review of the twentieth pass, issue 15). ``Pace.helped`` counts
batches to schedule its tries of the slower way, so every answer must be followed by a figure: only a batch that is
more than one run at ``HELPED_RUN_BYTES`` (one the helper could share) asks, and it records its time under the way
it went, whether or not it is one run at ``RUN_BYTES`` (read alone it is cut at ``RUN_BYTES``); a batch spanning more
shard files than stay open asks nothing and records nothing. Before the fix a 2-record 16-token batch asked and
recorded nothing (a freed core was never noticed behind alternating 2- and 16-record batches), and a 3-4 record
batch was recorded only when helped. The ``addresses`` that reach C as pointers are checked; a ``ShardReader``
dropped without ``close`` does not leave its helper thread behind."""

import gc

import numpy as np
import pytest

from mooncake_jax.transfer import shard_reader, xxh3_nogil
from mooncake_jax.transfer.checksum import checksum
from mooncake_jax.transfer.pool import page_aligned_empty
from mooncake_jax.transfer.shard_reader import HELPED_RUN_BYTES, RUN_BYTES, ShardReader
from mooncake_jax.transfer.stream_copy import address

RECORD = 3 << 17  # 384 KiB: a 16-token block of the ``small`` preset, two to a helped run, four to a run alone
assert HELPED_RUN_BYTES == 2 * RECORD and RUN_BYTES == 4 * RECORD


class Asked:
    """A ``Pace`` that answers ``answer`` and writes down what it was asked and told."""

    def __init__(self, answer: bool) -> None:
        self.answer, self.asked, self.told, self.warm = answer, 0, [], []

    def helped(self) -> bool:
        self.asked += 1
        return self.answer

    def took(self, helped: bool, seconds: float, nbytes: int, warm: bool = True) -> None:
        self.told.append((helped, nbytes))
        self.warm.append(warm)


@pytest.fixture
def shards(tmp_path):
    """Three shard files of 16 records each, and their bytes."""
    rng = np.random.default_rng(11)
    data = {}
    for shard in range(3):
        data[shard] = rng.integers(0, 256, 16 * RECORD, dtype=np.uint8)
        (tmp_path / f"s{shard}").write_bytes(data[shard].tobytes())
    return (lambda shard: tmp_path / f"s{shard}"), data


def batch(places):
    """Reads of the records at ``(shard, index)`` places into page-aligned staging rows, and the rows' addresses."""
    staging = page_aligned_empty((len(places), RECORD), np.uint8)
    reads = [(shard, index * RECORD, staging[i]) for i, (shard, index) in enumerate(places)]
    return reads, [address(staging[i]) for i in range(len(places))]


def check(results, reads, data):
    for result, (shard, offset, out) in zip(results, reads):
        expected = data[shard][offset : offset + RECORD]
        assert result == checksum(expected) and (out == expected).all()


@pytest.fixture
def run_sizes(monkeypatch):
    """The records per ``read_run`` call (a run of one is read by ``read_with_checksum``, not counted)."""
    sizes = []
    real = shard_reader.read_run

    def counted(fd, outs, *args, **kwargs):
        sizes.append(len(outs))
        return real(fd, outs, *args, **kwargs)

    monkeypatch.setattr(shard_reader, "read_run", counted)
    return sizes


@pytest.mark.parametrize("answer", [True, False])
@pytest.mark.parametrize("records", [1, 2, 3, 4, 5, 16])
def test_a_batch_asks_pace_only_when_it_could_be_shared_and_then_always_records(shards, run_sizes, answer,
                                                                                 records):
    path_of, data = shards
    pace = Asked(answer)
    reader = ShardReader(path_of, pace)
    try:
        reads, addresses = batch([(0, i) for i in range(records)])
        check(reader.read_many(reads, addresses), reads, data)
    finally:
        reader.close()
    could_help = records > 2  # two 384 KiB records are one helped run
    assert pace.asked == could_help
    assert pace.told == ([(answer, records * RECORD)] if could_help else [])
    assert pace.warm == ([False] if could_help else [])  # a reader's first paced batch is cold
    per_run = 2 if answer and could_help else 4
    full, rest = divmod(records, per_run)
    assert run_sizes == [per_run] * full + ([rest] if rest > 1 else [])  # alone: cut again at RUN_BYTES


def test_alternating_small_and_large_batches_record_every_answer(shards):
    """The finding's pattern: 2-record batches between 16-record ones. Every ``helped`` is followed by one
    ``took`` of the way answered, so the real ``Pace``'s schedule of tries is driven by batches it hears of; a
    cold batch (the reader's first, or with the helper after one alone) is followed by one more of its way, unasked
    (twenty-first pass)."""
    path_of, data = shards
    answers = iter([True, False] * 20)
    pace = Asked(True)
    pace.helped = lambda: (setattr(pace, "asked", pace.asked + 1), next(answers))[1]
    reader = ShardReader(path_of, pace)
    try:
        for round_ in range(10):
            small, addresses = batch([(1, 4), (1, 5)])
            check(reader.read_many(small, addresses), small, data)
            large, addresses = batch([(2, i) for i in range(16)])
            check(reader.read_many(large, addresses), large, data)
    finally:
        reader.close()
    ways = [True, True, False, True, True, False, True, True, False, True]  # asked: T, F, T, F, T, F, T
    assert pace.asked == 7
    assert pace.told == [(way, 16 * RECORD) for way in ways]
    assert pace.warm == [False, True, True, False, True, True, False, True, True, False]


@pytest.mark.parametrize("answer", [True, False])
def test_a_batch_over_more_shards_than_stay_open_asks_nothing_and_records_nothing(shards, monkeypatch, run_sizes,
                                                                                 answer):
    path_of, data = shards
    monkeypatch.setattr(shard_reader, "MAX_OPEN_FILES", 2)
    hashed_without_gil = []
    if xxh3_nogil.hash_at is not None:
        real = xxh3_nogil.hash_at
        monkeypatch.setattr(xxh3_nogil, "hash_at", lambda at, n: hashed_without_gil.append(n) or real(at, n))
    pace = Asked(answer)
    reader = ShardReader(path_of, pace)
    try:
        reads, addresses = batch([(shard, i) for shard in range(3) for i in range(4)])
        check(reader.read_many(reads, addresses), reads, data)
        assert reader._helper is None
    finally:
        reader.close()
    assert pace.asked == 0 and pace.told == []
    assert run_sizes == [4, 4, 4]  # RUN_BYTES: one thread's run size
    assert hashed_without_gil == []  # one thread: the package's hash


@pytest.mark.parametrize("wrong", ["count", pytest.param("shifted", marks=pytest.mark.skipif(
    xxh3_nogil.hash_at is None, reason="addresses reach C only where the exports are bound"))])
def test_addresses_that_are_not_the_outs_are_refused_on_the_two_thread_way(shards, wrong):
    path_of, _ = shards
    reader = ShardReader(path_of, Asked(True))
    try:
        reads, addresses = batch([(0, i) for i in range(8)])
        addresses = addresses[:-1] if wrong == "count" else addresses[1:] + addresses[:1]  # each run's first off
        with pytest.raises(ValueError):
            reader.read_many(reads, addresses)
        good, addresses = batch([(0, i) for i in range(8)])
        assert len(reader.read_many(good, addresses)) == 8  # the reader still serves
    finally:
        reader.close()


def test_a_reader_dropped_without_close_ends_its_helper_thread(shards):
    path_of, data = shards
    reader = ShardReader(path_of, Asked(True))
    reads, addresses = batch([(0, i) for i in range(8)])
    reader.want([(0, 0, 8 * RECORD)])  # the batch's closures then hold the reader (its on_cold)
    check(reader.read_many(reads, addresses), reads, data)
    thread = reader._helper._thread
    assert thread.is_alive()
    del reader
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_a_batch_under_one_helped_run_in_all_is_read_alone_unasked_even_in_several_runs(shards, run_sizes):
    """Two 384 KiB records apart in the file: two runs, 768 KiB in all, too small to share: no question, no
    figure, read alone."""
    path_of, data = shards
    pace = Asked(True)
    reader = ShardReader(path_of, pace)
    try:
        reads, addresses = batch([(0, 1), (0, 5)])
        check(reader.read_many(reads, addresses), reads, data)
        assert reader._helper is None
    finally:
        reader.close()
    assert pace.asked == 0 and pace.told == [] and run_sizes == []
