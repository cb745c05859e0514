"""A batch get's SSD records lying end to end in a shard are read a run at a time (issue 15, nineteenth pass): one
``preadv`` into up to ``RUN_BYTES`` of their destinations, then each hashed. Each record's bytes and checksum must
be those of a read of it alone, whatever the run meets: the file's end inside it, a page cache that holds only part
of it (``RWF_NOWAIT`` short), an error; and what cannot be a run (an aliased destination, a large record, a gap, a
second shard) is read alone as before."""

import errno
import os

import numpy as np
import pytest

from mooncake_jax.transfer import BlockPool, BlockSpec, shard_reader
from mooncake_jax.transfer.checksum import checksum
from mooncake_jax.transfer.pool import page_aligned_empty
from mooncake_jax.transfer.shard_reader import (ONE_READ_BYTES, PAGE_BYTES, RUN_BYTES, RUN_RECORDS, _runs,
                                                read_run)

SPEC = BlockSpec((2, 2, 16, 2, 64), np.float32)  # 32 KiB blocks: 48 to a run


@pytest.fixture
def data_file(random_file):
    return random_file(10 * PAGE_BYTES + 300, 7)


def outs_for(sizes: list[int]) -> list[np.ndarray]:
    staging = page_aligned_empty((sum(sizes),), np.uint8)
    return [staging[start : start + n] for start, n in zip(np.cumsum([0] + sizes[:-1]), sizes)]


def test_a_run_is_each_record_read_alone(data_file):
    fd, data = data_file
    sizes = [PAGE_BYTES, 3 * PAGE_BYTES, 1000, 2 * PAGE_BYTES + 7]
    outs = outs_for(sizes)
    got = read_run(fd, outs, PAGE_BYTES)
    start = PAGE_BYTES
    for out, result in zip(outs, got):
        whole = data[start : start + out.size]
        assert result == checksum(whole) and (out == whole).all()
        start += out.size


def test_a_run_cut_short_by_the_files_end_serves_the_records_before_it(data_file):
    fd, data = data_file
    outs = outs_for([4 * PAGE_BYTES] * 3)  # from page 3: the second record runs past the file's end (10 pages)
    got = read_run(fd, outs, 3 * PAGE_BYTES)
    first = data[3 * PAGE_BYTES : 7 * PAGE_BYTES]
    assert got[0] == checksum(first) and (outs[0] == first).all()
    assert got[1] is None and got[2] is None


def test_a_run_the_page_cache_holds_in_part_asks_once_and_reads_the_rest_waiting(data_file, monkeypatch):
    """``RWF_NOWAIT`` lands the first record and half the second: the wanted runs are asked for once, the rest read
    waiting, every record exact."""
    fd, data = data_file
    real = os.preadv
    calls = []

    def preadv(fd, buffers, offset, flags=0):
        calls.append((len(buffers), flags))
        if flags:  # only part cached
            return real(fd, [buffers[0], buffers[1][: buffers[1].size // 2]], offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(shard_reader.os, "preadv", preadv)
    asked = []
    sizes = [PAGE_BYTES, 2 * PAGE_BYTES, PAGE_BYTES]
    outs = outs_for(sizes)
    got = read_run(fd, outs, 0, lambda: asked.append(1))
    assert asked == ([1] if hasattr(os, "RWF_NOWAIT") else [])  # without it, reads never ask the page cache first
    start = 0
    for out, result in zip(outs, got):
        assert result == checksum(data[start : start + out.size]) and (out == data[start : start + out.size]).all()
        start += out.size
    if hasattr(os, "RWF_NOWAIT"):
        assert calls[0] == (3, os.RWF_NOWAIT) and all(flags == 0 for _, flags in calls[1:])


def test_an_error_the_record_says_nothing_of_is_handed_back_and_its_neighbours_are_served(data_file, monkeypatch):
    """The run's ``preadv`` fails (out of memory): each record is read alone; the one whose read fails again has
    the error as its result (for the pool to raise: a miss this time, never a damaged record)."""
    fd, data = data_file
    real = os.preadv

    def preadv(fd, buffers, offset, flags=0):
        if len(buffers) > 1 or offset == PAGE_BYTES:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(fd, buffers, offset, flags) if flags else real(fd, buffers, offset)

    monkeypatch.setattr(shard_reader.os, "preadv", preadv)
    outs = outs_for([PAGE_BYTES, PAGE_BYTES, PAGE_BYTES])
    got = read_run(fd, outs, 0)
    assert isinstance(got[1], OSError) and got[1].errno == errno.ENOMEM
    assert got[0] == checksum(data[:PAGE_BYTES]) and got[2] == checksum(data[2 * PAGE_BYTES : 3 * PAGE_BYTES])


def test_runs_are_cut_where_records_stop_lying_end_to_end():
    n = 64 << 10
    staging = page_aligned_empty((200 * n,), np.uint8)
    row = [staging[i * n : (i + 1) * n] for i in range(200)]
    aliased = staging[16 : 16 + n]  # 16 bytes past a page-aligned source: read alone, through the bounce buffer
    big = page_aligned_empty((ONE_READ_BYTES + 1,), np.uint8)
    reads = [(0, 0, row[0]), (0, n, row[1]), (0, 2 * n, row[2]),  # a run
             (1, 3 * n, row[3]),  # another shard
             (1, 5 * n, row[4]),  # a gap
             (1, 6 * n, aliased), (1, 7 * n, row[5]),  # aliased: alone; the next starts a run
             (1, 8 * n, big), (1, 8 * n + big.size, row[6])]  # too large: alone
    reads += [(2, i * n, row[10 + i]) for i in range(RUN_BYTES // n + 1)]  # one more than a run holds
    runs, addresses = _runs(reads), [shard_reader.writable_address(out) for _, _, out in reads]
    full = RUN_BYTES // n
    assert runs == [(0, 3), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1), (8, 1), (9, full), (9 + full, 1)]
    assert _runs(reads, addresses) == runs
    assert _runs(reads, [a + 16 if i == 1 else a for i, a in enumerate(addresses)])[:2] == [(0, 1), (1, 1)]
    tiny = [(3, i, staging[i : i + 1]) for i in range(RUN_RECORDS + 1)]
    assert _runs(tiny) == [(0, RUN_RECORDS), (RUN_RECORDS, 1)]


def test_a_batch_get_reads_a_run_with_one_call_and_serves_every_block(tmp_path, monkeypatch):
    """16 blocks of 32 KiB written by one call lie end to end: one ``preadv`` for all of them (512 KiB, one run), or
    one per run of four with runs of 128 KiB, on one thread or two, or one per run of two on two threads told runs
    of 64 KiB (``HELPED_RUN_BYTES``); every block bit for bit, the counters those of 16 hits a get."""
    real = os.preadv
    calls = []

    def preadv(fd, buffers, offset, *flags):
        calls.append(len(buffers))
        return real(fd, buffers, offset, *flags)

    keys = list(range(1, 17))
    blocks = [np.random.default_rng(k).standard_normal(SPEC.shape).astype(np.float32) for k in keys]
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, blocks)
        monkeypatch.setattr(shard_reader.os, "preadv", preadv)
        gets = 0
        for run_bytes, helped_run_bytes, runs, helped_runs in ((RUN_BYTES, RUN_BYTES, [16], [16]),
                                                               (4 * SPEC.nbytes, 4 * SPEC.nbytes, [4] * 4, [4] * 4),
                                                               (4 * SPEC.nbytes, 2 * SPEC.nbytes, [4] * 4, [2] * 8)):
            monkeypatch.setattr(shard_reader, "RUN_BYTES", run_bytes)
            monkeypatch.setattr(shard_reader, "HELPED_RUN_BYTES", helped_run_bytes)  # the two-thread way's runs
            for helped in (False, True):
                monkeypatch.setattr(shard_reader.Pace, "helped", lambda self, helped=helped: helped)
                pool._tiers[0].store._reader._repeat = None  # the way forced: no repeat of a cold batch
                calls.clear()
                staging = page_aligned_empty((len(keys), *SPEC.shape), SPEC.dtype)
                got = pool.get_many(keys, staging)
                gets += 1
                assert all(np.array_equal(g, b) for g, b in zip(got, blocks))
                assert sorted(calls) == (helped_runs if helped else runs)
        counters = pool.counters()["ssd"]
        assert counters.hits == gets * len(keys) and counters.misses == 0 and counters.corrupt == 0
        assert counters.bytes_read == gets * len(keys) * pool.record_bytes


@pytest.mark.parametrize("dtype", ["bfloat16", np.float16])
def test_a_batch_get_into_staging_of_a_dtype_ctypes_cannot_view(tmp_path, dtype):
    """Staging of bfloat16 (as a 70B model's blocks): its rows' addresses are found through their bytes."""
    spec = BlockSpec((2, 2, 16, 2, 64), dtype)
    keys = [1, 2, 3]
    raw = [np.random.default_rng(k).integers(0, 1 << 16, spec.nbytes // 2, dtype=np.uint16) for k in keys]
    blocks = [r.view(spec.dtype).reshape(spec.shape) for r in raw]
    with BlockPool(spec, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, blocks)
        staging = page_aligned_empty((len(keys), *spec.shape), spec.dtype)
        got = pool.get_many(keys, staging)
        assert all(g.view(np.uint16).tobytes() == r.tobytes() for g, r in zip(got, raw))


def test_a_batch_gets_hits_are_used_in_key_order_as_the_per_record_way_uses_them(tmp_path):
    """Hits the batch read checked and hits the per-record way reads (heads not known sound) are counted and made
    recent in the order asked, as the per-record way alone does: the SSD tier's eviction order is the same."""
    keys = list(range(1, 9))
    asked = [5, 2, 8, 1, 7, 3, 6, 4]
    blocks = [np.random.default_rng(k).standard_normal(SPEC.shape).astype(np.float32) for k in keys]
    orders, counters = {}, {}
    for way in ("batch", "per-record"):
        with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path / way) as pool:
            pool.put_many(keys, blocks)
            tier = pool._tiers[0]
            for key in (2, 7):  # heads not known sound: read and checked the per-record way
                shard, row, _ = tier.store._location(key)
                tier.store._head_checked[shard][row] = False
            if way == "per-record":
                tier._take_checked = None
            got = pool.get_many(asked, page_aligned_empty((len(asked), *SPEC.shape), SPEC.dtype))
            assert all(np.array_equal(g, blocks[k - 1]) for g, k in zip(got, asked))
            orders[way], counters[way] = list(tier.policy._order), tier.counters
    assert orders["batch"] == orders["per-record"] == asked
    assert counters["batch"] == counters["per-record"]
