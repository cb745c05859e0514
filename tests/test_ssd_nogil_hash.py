"""The SSD tier's two-thread read hashes without the GIL (``xxh3_nogil``: the ``xxhash`` extension's own XXH3-128
exports called through ``ctypes``; issue 15, twentieth pass). Its digests must be the package's, word for word in
the order the frame header stores them, for every length XXH3 treats apart (0-16, 17-128, 129-240, longer, a
partial stripe, a partial block); every read path that takes it (a run, a record alone, an aliased destination
through the bounce buffer; a large record in steps keeps the package's hash) must give the bytes and checksum of
the package's path; a damaged record read this way is never served; and where the exports cannot be bound the reads
fall back to the package with one log line."""

import ctypes
import logging
import os

import numpy as np
import pytest
import xxhash

from mooncake_jax.transfer import BlockPool, BlockSpec, shard_reader, xxh3_nogil
from mooncake_jax.transfer.checksum import checksum, split_digest
from mooncake_jax.transfer.pool import page_aligned_empty
from mooncake_jax.transfer.shard_reader import ONE_READ_BYTES, PAGE_BYTES, READ_STEP_BYTES, read_run, \
    read_with_checksum
from mooncake_jax.transfer.stream_copy import address

LENGTHS = [0, 1, 3, 4, 8, 9, 16, 17, 100, 128, 129, 200, 240, 241, 1023, 1024, 1025, 4096, 65537,
           READ_STEP_BYTES + 5, 393_216]

needs_exports = pytest.mark.skipif(xxh3_nogil.hash_at is None, reason="this xxhash build does not export XXH3-128")


def reference(data: np.ndarray) -> tuple[int, int]:
    """The digest as the frame header stores it, from the package (the record format's definition)."""
    return split_digest(xxhash.xxh3_128_intdigest(data.tobytes()))


@needs_exports
def test_the_exports_give_the_packages_digest_in_the_headers_word_order():
    rng = np.random.default_rng(11)
    for n in LENGTHS:
        data = rng.integers(0, 256, n + 64, dtype=np.uint8)
        for start in (0, 1, 13):  # any alignment of the input
            view = data[start : start + n]
            want = reference(view)
            assert xxh3_nogil.hash_at(address(view), n) == want, n
            assert want == (xxhash.xxh3_128_intdigest(view.tobytes()) >> 64,
                            xxhash.xxh3_128_intdigest(view.tobytes()) & ((1 << 64) - 1))
    ones, zeros = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)  # the words differ, so their order is seen
    assert xxh3_nogil.hash_at(address(ones), ones.size) != xxh3_nogil.hash_at(address(zeros), zeros.size)


@needs_exports
def test_the_calls_release_the_gil():
    """``ctypes`` releases the GIL around a call of a ``CDLL`` function, not of a ``PyDLL`` one (the flag it
    checks): what lets the two threads of ``read_many`` hash at once."""
    library = xxh3_nogil._LIBRARY
    assert not library.oneshot._flags_ & ctypes._FUNCFLAG_PYTHONAPI


@pytest.fixture
def data_file(random_file):
    return random_file(3 * ONE_READ_BYTES + 5000, 13)


@needs_exports
@pytest.mark.parametrize("n", [1000, PAGE_BYTES, ONE_READ_BYTES, ONE_READ_BYTES + 1, 2 * ONE_READ_BYTES + 999])
@pytest.mark.parametrize("page_offset", [0, 16, 2048])  # 16: aliased, through the bounce buffer
def test_a_record_read_alone_hashed_without_the_gil_is_the_packages_read(data_file, monkeypatch, n, page_offset):
    """Up to ``ONE_READ_BYTES`` (read at once) the record is hashed by the export; a larger one, read in steps, by
    the package (cheaper there)."""
    fd, data = data_file
    calls = []
    real = xxh3_nogil.hash_at
    monkeypatch.setattr(xxh3_nogil, "hash_at", lambda at, size: calls.append(size) or real(at, size))
    for offset in (0, PAGE_BYTES):
        outs = {}
        for native in (False, True):
            calls.clear()
            out = page_aligned_empty((n,), np.uint8, page_offset)
            got = read_with_checksum(fd, out, offset, native=native)
            assert got == checksum(data[offset : offset + n]) and (out == data[offset : offset + n]).all()
            assert calls == ([n] if native and n <= ONE_READ_BYTES else [])
            outs[native] = got
        assert outs[True] == outs[False]
    short = page_aligned_empty((n,), np.uint8, page_offset)  # the file ends inside it: None, as the package's
    assert read_with_checksum(fd, short, data.size - n // 2, native=True) is None


@needs_exports
def test_a_run_hashed_without_the_gil_is_the_packages_run(data_file):
    fd, data = data_file
    sizes = [PAGE_BYTES, 3 * PAGE_BYTES, 1000, 2 * PAGE_BYTES + 7]
    staging = page_aligned_empty((sum(sizes),), np.uint8)
    outs = [staging[start : start + n] for start, n in zip(np.cumsum([0] + sizes[:-1]), sizes)]
    addresses = [address(out) for out in outs]
    calls = []
    real = xxh3_nogil.hash_at

    def counted(at, n):
        calls.append(n)
        return real(at, n)

    xxh3_nogil.hash_at, saved = counted, xxh3_nogil.hash_at
    try:
        got = read_run(fd, outs, PAGE_BYTES, addresses=addresses)
    finally:
        xxh3_nogil.hash_at = saved
    assert calls == sizes
    start = PAGE_BYTES
    for out, result in zip(outs, got):
        assert result == checksum(data[start : start + out.size]) and (out == data[start : start + out.size]).all()
        start += out.size
    assert got == read_run(fd, outs, PAGE_BYTES)  # the package's path: the same digests


SPEC = BlockSpec((2, 2, 16, 2, 64), np.float32)  # 32 KiB blocks


def blocks_for(keys):
    return [np.random.default_rng(k).standard_normal(SPEC.shape).astype(np.float32) for k in keys]


@needs_exports
@pytest.mark.parametrize("helped", [False, True])
def test_only_the_two_thread_way_hashes_without_the_gil_and_serves_every_block(tmp_path, monkeypatch, helped):
    keys = list(range(1, 17))
    blocks = blocks_for(keys)
    calls = []
    real = xxh3_nogil.hash_at
    monkeypatch.setattr(xxh3_nogil, "hash_at", lambda at, n: calls.append(n) or real(at, n))
    monkeypatch.setattr(shard_reader, "HELPED_RUN_BYTES", 4 * SPEC.nbytes)  # four runs: the helper has some to take
    monkeypatch.setattr(shard_reader.Pace, "helped", lambda self: helped)
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, blocks)
        staging = page_aligned_empty((len(keys), *SPEC.shape), SPEC.dtype)
        got = pool.get_many(keys, staging)
        assert all(np.array_equal(g, b) for g, b in zip(got, blocks))
        assert len(calls) == (len(keys) if helped else 0)
        assert pool.counters()["ssd"].hits == len(keys)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_exports), False])
def test_a_damaged_record_read_by_two_threads_is_never_served(tmp_path, monkeypatch, native):
    """One byte of one record's data flipped on disk: that block is a miss (counted corrupt), every other block is
    served, with the hash without the GIL (every record hashed by it: counted) and with the package's (the
    fallback)."""
    keys = list(range(1, 17))
    blocks = blocks_for(keys)
    monkeypatch.setattr(shard_reader, "HELPED_RUN_BYTES", 4 * SPEC.nbytes)
    monkeypatch.setattr(shard_reader.Pace, "helped", lambda self: True)
    calls = []
    if native:
        real = xxh3_nogil.hash_at
        monkeypatch.setattr(xxh3_nogil, "hash_at", lambda at, n: calls.append(n) or real(at, n))
    else:
        monkeypatch.setattr(xxh3_nogil, "hash_at", None)
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, blocks)
        store = pool._tiers[0].store
        store.settle()
        staging = page_aligned_empty((len(keys), *SPEC.shape), SPEC.dtype)
        shard, row = divmod(store._slot_of[keys[6]], store.shard_slots)
        offset = store._offsets[shard][row]
        path = store._reader._path_of(shard)
        with open(path, "r+b") as file:
            file.seek(offset + 100)
            byte = file.read(1)
            file.seek(offset + 100)
            file.write(bytes([byte[0] ^ 0x10]))
        got = pool.get_many(keys, staging)
        assert got[6] is None
        assert all(np.array_equal(g, b) for i, (g, b) in enumerate(zip(got, blocks)) if i != 6)
        assert pool.counters()["ssd"].corrupt == 1
        assert len(calls) == (len(keys) if native else 0)


def test_without_the_exports_the_binding_says_so_once_and_is_none(monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise OSError("no such library")

    monkeypatch.setattr(xxh3_nogil.ctypes, "CDLL", refuse)
    with caplog.at_level(logging.INFO, logger=xxh3_nogil.__name__):
        assert xxh3_nogil._bind() is None
    said = [r for r in caplog.records if "without the GIL unavailable" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO]  # expected where the export cannot exist: no WARNING


def test_a_binding_that_disagrees_with_the_package_is_not_used(monkeypatch, caplog):
    """An export that hashes differently (another version's algorithm) would fail every record: refused at
    binding, the package used instead."""
    real = xxh3_nogil._Library.__init__

    def wrong(self, lib):
        real(self, lib)
        oneshot = self.oneshot

        def off_by_one(at, n):
            digest = oneshot(at, n)
            digest.low64 ^= 1
            return digest

        self.oneshot = off_by_one

    monkeypatch.setattr(xxh3_nogil._Library, "__init__", wrong)
    with caplog.at_level(logging.WARNING, logger=xxh3_nogil.__name__):
        bound = xxh3_nogil._bind()
    assert bound is None or xxh3_nogil.hash_at is None  # refused (or never bound on this build)
    if xxh3_nogil._LIBRARY is not None:
        assert [r.levelno for r in caplog.records if "disagrees" in r.getMessage()] == [logging.WARNING]
