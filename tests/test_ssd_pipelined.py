"""A large SSD record read on two threads (``shard_reader.read_pipelined``): a helper lands it step by step while
the caller hashes what has landed. The same bytes and the same XXH3-128 as the one-thread read, a file cut short
read as None, a read's error raised, nothing written into the buffer after the call, and every damaged record a
counted miss through the pool, whichever way ``Pace`` picks."""

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from test_pool import SPEC, block_of, cancelling_bit_flips, flip, rewrite_record, same_bits, swap_words

from mooncake_jax.transfer import BlockPool, shard_reader
from mooncake_jax.transfer.checksum import checksum
from mooncake_jax.transfer.frame import DATA_OFFSET, PREFIX_BYTES
from mooncake_jax.transfer.shard_reader import read_pipelined, read_with_checksum

STEP = 4096
POOL_STEP = 256  # steps of the pool tests: SPEC's 1 KiB blocks read in four


@pytest.fixture
def small_steps(monkeypatch):
    """Steps of a page, and every record of a page or more read the large way, so small test records take
    several steps (the step boundaries are what can go wrong)."""
    monkeypatch.setattr(shard_reader, "PIPELINE_STEP_BYTES", STEP)
    monkeypatch.setattr(shard_reader, "PIPELINE_BYTES", STEP)


@pytest.mark.parametrize("size", [1, STEP - 1, STEP, STEP + 1, 5 * STEP, 5 * STEP + 123])
def test_pipelined_read_is_the_bytes_and_the_one_thread_hash(tmp_path, small_steps, size):
    data = np.random.default_rng(size).integers(0, 256, size + 77, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    helper = ThreadPoolExecutor(1)
    try:
        out = np.zeros(size, np.uint8)
        digest = read_pipelined(fd, out, 77, helper)
        assert digest == checksum(data[77:]) == read_with_checksum(fd, np.zeros(size, np.uint8), 77)
        assert (out == data[77:]).all()
        assert read_pipelined(fd, np.zeros(size, np.uint8), 78, helper) is None  # the file ends first
        assert read_pipelined(fd, np.zeros(size, np.uint8), size + 1000, helper) is None  # past its end
    finally:
        helper.shutdown()
        os.close(fd)


def test_pipelined_read_raises_a_read_error_and_leaves_the_buffer_alone_after(tmp_path, small_steps, monkeypatch):
    """An ``OSError`` on the helper's third step is raised on the caller's thread; when the call returns, the helper
    has stopped: the steps after the failing one are never written into ``out``."""
    data = np.random.default_rng(1).integers(0, 256, 8 * STEP, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    real = shard_reader._pread
    calls = []

    def failing(fd, chunk, offset, on_cold):
        calls.append(offset)
        if offset == 2 * STEP:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(fd, chunk, offset, on_cold)

    monkeypatch.setattr(shard_reader, "_pread", failing)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    helper = ThreadPoolExecutor(1)
    try:
        out = np.zeros(data.size, np.uint8)
        with pytest.raises(OSError) as raised:
            read_pipelined(fd, out, 0, helper)
        assert raised.value.errno == errno.ENOMEM
        helper.submit(lambda: None).result()  # anything the helper still had queued has run
        assert calls == [0, STEP, 2 * STEP] and not out[2 * STEP :].any()
        assert (out[: 2 * STEP] == data[: 2 * STEP]).all()
    finally:
        helper.shutdown()
        os.close(fd)


def test_a_large_record_goes_the_way_pace_picks_and_teaches_it(tmp_path, small_steps, monkeypatch):
    """``ShardReader.read`` of a record of ``PIPELINE_BYTES`` or more: on the helper when ``Pace`` says so, on the
    caller's thread otherwise, the same digest both ways, each timed into ``Pace``; smaller records as before."""
    data = np.random.default_rng(2).integers(0, 256, 6 * STEP, dtype=np.uint8)
    (tmp_path / "s0").write_bytes(data.tobytes())
    pace = shard_reader.Pace()
    reader = shard_reader.ShardReader(lambda shard: tmp_path / f"s{shard}", pace)
    landed_on = []
    real = shard_reader._pread

    def noting(fd, chunk, offset, on_cold):
        landed_on.append(threading.current_thread().name.startswith("ssd-read"))
        return real(fd, chunk, offset, on_cold)

    monkeypatch.setattr(shard_reader, "_pread", noting)
    taught = []
    monkeypatch.setattr(pace, "took", lambda helped, seconds, nbytes: taught.append((helped, nbytes)))
    try:
        for helped in (True, False):
            monkeypatch.setattr(pace, "helped", lambda helped=helped: helped)
            landed_on.clear()
            out = np.zeros(5 * STEP, np.uint8)
            assert reader.read(0, STEP, out) == checksum(data[STEP:]) and (out == data[STEP:]).all()
            assert landed_on == [helped] * (5 if helped else 1)  # one step on the helper, or one read here
        assert taught == [(True, 5 * STEP), (False, 5 * STEP)]
        assert reader.read(0, 2 * STEP, np.zeros(5 * STEP, np.uint8)) is None  # cut short: a damaged record
        landed_on.clear()
        small = np.zeros(STEP - 1, np.uint8)
        assert reader.read(0, 0, small) == checksum(data[: STEP - 1]) and landed_on == [False]
    finally:
        reader.close()


@pytest.mark.parametrize("helped", [True, False])
@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: flip(raw, len(raw) - 5, 0x01),  # one bit in the last step
        lambda raw: flip(raw, DATA_OFFSET + 2 * POOL_STEP + 7, 0x80),  # one bit in a middle step
        lambda raw: flip(raw, PREFIX_BYTES + 20, 1),  # the key in the frame header
        lambda raw: raw[: len(raw) - 100],  # a write cut short
        lambda raw: raw[: len(raw) // 2] + bytes(len(raw) - len(raw) // 2),  # tail never reached the disk
        lambda raw: raw[:DATA_OFFSET] + raw[DATA_OFFSET + POOL_STEP :] + raw[DATA_OFFSET : DATA_OFFSET + POOL_STEP],  # sectors
        lambda raw: swap_words(raw, DATA_OFFSET + POOL_STEP, DATA_OFFSET + POOL_STEP + 8),
        cancelling_bit_flips,
    ],
    ids=["bit-last-step", "bit-middle-step", "header", "truncated", "zero-tail", "reordered", "swapped-words",
         "cancelling-bits"],
)
def test_a_damaged_large_record_is_a_counted_miss_either_way(tmp_path, monkeypatch, damage, helped):
    """The pool's SSD get of records read the large way (``SPEC``'s 1 KiB blocks in four steps here): a damaged
    record a counted miss, never served, its neighbour served bit for bit."""
    monkeypatch.setattr(shard_reader, "PIPELINE_STEP_BYTES", POOL_STEP)
    monkeypatch.setattr(shard_reader, "PIPELINE_BYTES", 2 * POOL_STEP)
    monkeypatch.setattr(shard_reader.Pace, "helped", lambda self: helped)
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many([2, 1], [block_of(2), block_of(1)])  # 1 in the last slot, so cutting the file spares 2
    rewrite_record(tmp_path, 1, damage)
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        assert pool.get(1) is None and 1 not in pool
        assert pool.counters()["ssd"].corrupt == 1
        assert same_bits(pool.get(2), block_of(2))
