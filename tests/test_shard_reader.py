"""The SSD tier reading its records itself: at the offsets a shard's index gives (whatever order its chunks lie
in), hashed as they land, with a bounded set of open files that a deleted shard leaves at once."""

import os
import threading

import numpy as np
import pytest

from mooncake_jax.transfer import BlockPool, BlockSpec, files, shard_reader
from mooncake_jax.transfer.checksum import checksum
from mooncake_jax.transfer.files import DATA_DIR
from mooncake_jax.transfer.frame import record_bytes
from mooncake_jax.transfer.shard_file import NO_CHUNK, chunk_offsets, crc32c, index_bytes
from mooncake_jax.transfer.shard_reader import read_with_checksum

SPEC = BlockSpec((2, 2, 4, 2, 8), np.float32)


def block_of(key: int) -> np.ndarray:
    return np.random.default_rng(key).standard_normal(SPEC.shape).astype(np.float32)


def index_of(entries: list[tuple[int, int]]) -> bytes:
    raw = np.array(entries, np.dtype("<u8")).tobytes()
    return raw + crc32c(raw).to_bytes(4, "little")


def test_chunk_offsets_follow_the_index_in_any_order():
    index = index_of([(900, 10), (NO_CHUNK, NO_CHUNK), (100, 10)])
    assert chunk_offsets(index, 3, 10).tolist() == [900, -1, 100]
    assert chunk_offsets(index, 3, 11) is None  # a chunk of another size: not this array's shard
    damaged = bytearray(index)
    damaged[0] ^= 1
    assert chunk_offsets(bytes(damaged), 3, 10) is None and chunk_offsets(index[:-1], 3, 10) is None


@pytest.mark.parametrize("size", [1000, shard_reader.READ_STEP_BYTES, shard_reader.ONE_READ_BYTES,
                                  shard_reader.ONE_READ_BYTES + 1, 1 << 20, (1 << 20) + 3, 3 << 20])
def test_read_with_checksum_is_the_bytes_and_their_hash(tmp_path, size):
    data = np.random.default_rng(size).integers(0, 256, size + 50, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    out = np.zeros(size, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_with_checksum(fd, out, 50) == checksum(data[50:]) and (out == data[50:]).all()
        assert read_with_checksum(fd, out, 51) is None  # the file ends first
    finally:
        os.close(fd)


def test_a_shard_rewritten_with_its_chunks_reordered_is_read_by_its_index(tmp_path):
    """The shard file rewritten by hand with its chunks in reverse order and an index saying so (as another writer,
    e.g. TensorStore, may lay it out): every block still reads back bit for bit after a restart."""
    keys = [1, 2, 3]
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, [block_of(k) for k in keys])
    path = tmp_path / DATA_DIR / "c.0.0"
    raw = path.read_bytes()
    slots, width = files.slots_per_shard(record_bytes(SPEC)), SPEC.nbytes
    written = chunk_offsets(raw[: index_bytes(slots)], slots, width)  # where the tier put them (page-aligned)
    chunks = [raw[offset : offset + width] for offset in written[: len(keys)]]
    start = index_bytes(slots)  # rewritten right behind the index, reversed
    entries = [(start + (len(keys) - 1 - i) * width, width) for i in range(len(keys))]
    entries += [(NO_CHUNK, NO_CHUNK)] * (slots - len(keys))
    path.write_bytes(index_of(entries) + b"".join(reversed(chunks)))
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        staging = np.zeros((3, *SPEC.shape), SPEC.dtype)
        got = pool.get_many(keys, staging)
        assert all(g is not None and g.tobytes() == block_of(k).tobytes() for g, k in zip(got, keys))
        assert pool.counters()["ssd"].corrupt == 0


def open_files_under(directory) -> int:
    """Descriptors of this process open on files under ``directory`` (others' come and go with other threads)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
        except OSError:  # closed meanwhile
            pass
    return count


def test_open_shard_files_are_bounded_and_a_deleted_shard_is_closed(tmp_path, monkeypatch):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    monkeypatch.setattr(files, "SHARD_BYTES", record_bytes(SPEC))  # one record per shard file
    monkeypatch.setattr(shard_reader, "MAX_OPEN_FILES", 2)
    keys = list(range(1, 7))
    data = tmp_path / DATA_DIR
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, [block_of(k) for k in keys])
        for _ in range(2):  # six shards read twice through two descriptors
            assert all(pool.get(k).tobytes() == block_of(k).tobytes() for k in keys)
        assert open_files_under(data) <= 2 + 1  # and the writer's open shard
        for k in keys:
            pool.remove(k)
        assert not list(data.glob("c.*"))
        assert open_files_under(data) <= 1
    assert open_files_under(tmp_path) == 0


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs preadv2 RWF_NOWAIT")
def test_a_batch_is_asked_for_only_when_a_read_finds_the_page_cache_cold(tmp_path, monkeypatch):
    """Warm reads make no advice call; a read that the page cache cannot serve at once (RWF_NOWAIT short) asks the
    kernel for the batch's runs once, then reads the rest waiting: the bytes are the same either way."""
    keys = list(range(1, 9))
    advised, cold = [], [False]
    real_preadv = os.preadv

    def preadv(fd, buffers, offset, flags=0):
        if flags and cold[0]:
            raise BlockingIOError("not cached")
        return real_preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(shard_reader.os, "preadv", preadv)
    monkeypatch.setattr(shard_reader.os, "posix_fadvise", lambda fd, offset, length, advice: advised.append(
        (offset, length, advice)))
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, [block_of(k) for k in keys])
        staging = np.zeros((8, *SPEC.shape), SPEC.dtype)
        for is_cold in (False, True):
            cold[0] = is_cold
            got = pool.get_many(keys, staging)
            assert all(g.tobytes() == block_of(k).tobytes() for g, k in zip(got, keys))
            start = pool._tiers[0].store._offsets[0][0]
            assert advised == ([(start, 8 * SPEC.nbytes, os.POSIX_FADV_WILLNEED)] if is_cold else [])


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs preadv2 RWF_NOWAIT")
def test_a_cold_batch_over_more_shards_than_open_files_keeps_its_descriptor(tmp_path, monkeypatch):
    """Asking the kernel for a cold batch's runs in more shards than there are cached descriptors must not close
    the descriptor the read is using (every block was dropped as corrupt when the advice went through the cache)."""
    monkeypatch.setattr(files, "SHARD_BYTES", record_bytes(SPEC))  # one record per shard file
    monkeypatch.setattr(shard_reader, "MAX_OPEN_FILES", 2)
    real_preadv = os.preadv

    def preadv(fd, buffers, offset, flags=0):  # the page cache cold: RWF_NOWAIT finds nothing
        if flags:
            raise BlockingIOError("not cached")
        return real_preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(shard_reader.os, "preadv", preadv)
    keys = list(range(1, 9))
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, [block_of(k) for k in keys])
        got = pool.get_many(keys, np.zeros((len(keys), *SPEC.shape), SPEC.dtype))
        assert [g is not None and g.tobytes() == block_of(k).tobytes() for g, k in zip(got, keys)] == [True] * 8
        assert pool.counters()["ssd"].corrupt == 0 and len(pool) == len(keys)


def test_a_process_out_of_descriptors_misses_but_keeps_its_blocks(tmp_path, monkeypatch):
    """EMFILE says nothing of the record: the get is a miss this time, nothing is dropped or counted corrupt, and
    the block is served once descriptors are back (it was deleted as damaged when every OSError read as damage)."""
    import errno

    keys = [1, 2]
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, [block_of(k) for k in keys])
        real_open = shard_reader.os.open

        def out_of_descriptors(*args, **kwargs):
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(shard_reader.os, "open", out_of_descriptors)
        assert pool.get(1) is None and pool.get_record(2) is None
        assert pool.counters()["ssd"].corrupt == 0 and len(pool) == 2
        monkeypatch.setattr(shard_reader.os, "open", real_open)
        assert pool.get(1).tobytes() == block_of(1).tobytes() and pool.get_record(2) is not None


def test_read_many_on_two_threads_is_each_read_alone(tmp_path, monkeypatch):
    """A batch read by the caller and the helper thread in turn: every chunk's bytes and digest as a read of it
    alone, a missing or short shard file None for its chunks only, an error that says nothing of the record
    (UNAVAILABLE) handed back for the caller to raise; past MAX_OPEN_FILES shards, the same on one thread."""
    import errno

    data = {shard: np.random.default_rng(shard).integers(0, 256, 4 << 20, dtype=np.uint8) for shard in (0, 1, 2)}
    for shard, raw in data.items():
        (tmp_path / f"s{shard}").write_bytes(raw.tobytes()[: (1 << 20) if shard == 2 else None])  # 2: cut short
    reader = shard_reader.ShardReader(lambda shard: tmp_path / f"s{shard}", shard_reader.Pace())
    wanted = [(0, 0, 3 << 20), (1, 4096, 1 << 20), (9, 0, 100), (0, 3 << 20, 4096), (2, 0, 2 << 20), (1, 0, 5)]
    helper_reads = []
    real = shard_reader.read_with_checksum

    def counted(fd, out, offset, on_cold=None, native=False):
        helper_reads.append(threading.current_thread().name.startswith("ssd-read"))
        return real(fd, out, offset, on_cold, native)

    monkeypatch.setattr(shard_reader, "read_with_checksum", counted)
    for max_open, helped in ((32, True), (32, False), (1, True)):
        monkeypatch.setattr(shard_reader, "MAX_OPEN_FILES", max_open)
        monkeypatch.setattr(reader._pace, "helped", lambda helped=helped: helped)
        reader._repeat = None  # the way forced: not the reader's repeat of its last cold batch (Pace.took)
        helper_reads.clear()
        outs = [np.zeros(size, np.uint8) for _, _, size in wanted]
        got = reader.read_many([(shard, offset, out) for (shard, offset, _), out in zip(wanted, outs)])
        for (shard, offset, size), out, result in zip(wanted, outs, got):
            if shard in (2, 9):  # cut short, missing
                assert result is None
            else:
                whole = data[shard][offset : offset + size]
                assert result == checksum(whole) and (out == whole).all()
        if not helped or max_open == 1:  # (with the helper, how many it takes depends on when it is scheduled)
            assert not any(helper_reads)

    def out_of_memory(fd, out, offset, on_cold=None, native=False):
        if offset == 4096:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real(fd, out, offset, on_cold, native)

    monkeypatch.setattr(shard_reader, "MAX_OPEN_FILES", 32)
    monkeypatch.setattr(shard_reader, "read_with_checksum", out_of_memory)
    for helped in (True, False):  # an UNAVAILABLE error is the record's result either way, never a damaged record
        monkeypatch.setattr(reader._pace, "helped", lambda helped=helped: helped)
        reader._repeat = None  # (as above)
        got = reader.read_many([(0, 0, np.zeros(64, np.uint8)), (1, 4096, np.zeros(64, np.uint8))])
        assert got[0] == checksum(data[0][:64]) and isinstance(got[1], OSError) and got[1].errno == errno.ENOMEM
    reader.close()


def test_a_record_read_ahead_is_read_again_once_it_has_moved(tmp_path):
    """What a batch's prefetch read is handed on only for the same key, the same target and the same place on
    disk: the key written again since (a fresh slot, other bytes) or asked into another buffer is read anew."""
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many([1, 2], [block_of(1), block_of(2)])
        store = pool._tiers[0].store
        outs = [np.zeros(SPEC.nbytes, np.uint8) for _ in range(2)]
        store.prefetch([1, 2], outs)
        assert (outs[0] == block_of(1).reshape(-1).view(np.uint8)).all()  # read already, on prefetch
        store.put_block(1, block_of(7).reshape(-1).view(np.uint8))  # key 1 now lies elsewhere, with other bytes
        store.settle()
        head, digest = store.read_into(1, outs[0])
        assert digest == checksum(block_of(7)) and (outs[0] == block_of(7).reshape(-1).view(np.uint8)).all()
        other = np.zeros(SPEC.nbytes, np.uint8)
        assert store.read_into(2, other)[1] == checksum(block_of(2)) and (other == outs[1]).all()


def test_pace_reads_each_batch_the_way_that_has_been_faster_and_tries_the_other():
    """Both ways taken in turn until each has half a window of batches; then the faster by median seconds per byte,
    the slower one tried every ``explore_every`` batches (so a freed or taken core is noticed), every
    ``far_explore_every`` when it is more than ``far`` times slower; a way that turns slower loses its place; a try
    of the slower way that beats the faster way has its old figures forgotten (the machine changed)."""
    pace = shard_reader.Pace()
    ways = []
    for _ in range(pace.window):
        ways.append(pace.helped())
        pace.took(ways[-1], 1.0 if ways[-1] else 1.5, 1000)  # the helper 1.5 times as fast
    assert ways == [True, False] * (pace.window // 2)
    chosen = []
    for _ in range(2 * pace.explore_every):
        chosen.append(pace.helped())
        pace.took(chosen[-1], 1.0 if chosen[-1] else 1.5, 1000)
    assert chosen.count(False) == 2  # the slower way, tried once every explore_every batches
    for _ in range(3 * pace.window):  # now the helper is the slow way (its core taken)
        way = pace.helped()
        pace.took(way, 5.0 if way else 3.0, 1000)
    assert [pace.helped() for _ in range(pace.explore_every)].count(True) == 1
    for _ in range(pace.far_explore_every):  # and far slower (a loaded machine): tried four times as seldom
        way = pace.helped()
        pace.took(way, 9.0 if way else 3.0, 1000)
    tried = []
    for _ in range(2 * pace.far_explore_every):
        tried.append(pace.helped())
        pace.took(tried[-1], 9.0 if tried[-1] else 3.0, 1000)
    assert tried.count(True) == 2
    freed = []  # the core is freed: the helper's next try beats the caller alone, and the helper is taken again
    for _ in range(2 * pace.far_explore_every):  # at once, not after half a window of tries 64 batches apart
        freed.append(pace.helped())
        pace.took(freed[-1], 1.0 if freed[-1] else 3.0, 1000)
    first = freed.index(True)
    assert first < pace.far_explore_every
    after = freed[first + pace.window // 2 :]
    assert after.count(False) <= len(after) // pace.explore_every + 1


@pytest.mark.parametrize("helped", [True, False])
def test_a_batch_read_ahead_while_its_hits_are_promoted_and_dram_demotes(tmp_path, monkeypatch, helped):
    """A get_many over DRAM and SSD whose SSD hits are promoted one by one, each evicting a DRAM block that is
    demoted to SSD mid-batch (written into the open shard while the batch's records were read ahead): every block
    bit for bit, read either way, a key asked twice in one batch too, and the tier sound afterwards."""
    monkeypatch.setattr(shard_reader.Pace, "helped", lambda self: helped)
    keys = list(range(1, 9))
    with BlockPool(SPEC, dram_blocks=3, ssd_path=tmp_path) as pool:
        pool.put_many(keys, [block_of(k) for k in keys])  # 1-5 demoted to SSD, 6-8 in DRAM
        assert [pool.tier_of(k) for k in keys] == ["ssd"] * 5 + ["dram"] * 3
        asked = [1, 2, 6, 3, 1, 4, 5, 8]
        got = pool.get_many(asked, np.zeros((len(asked), *SPEC.shape), SPEC.dtype))
        assert all(g is not None and g.tobytes() == block_of(k).tobytes() for g, k in zip(got, asked))
        assert pool.counters()["ssd"].corrupt == 0 and len(pool) == len(keys)
        assert all(pool.get(k).tobytes() == block_of(k).tobytes() for k in keys)


def test_each_record_size_has_its_own_pace(tmp_path):
    """Seconds per byte of one record size say nothing of another's (a 3 MiB record is read in 1 MiB steps, a small
    one in one, the pool's per-record work spread over fewer bytes): stores of one size share a ``Pace``, stores of
    another size learn theirs apart, and neither is the one ``Pace`` of a reader not told its size."""
    small, large = BlockSpec((2, 2, 4, 2, 8), np.float32), BlockSpec((2, 2, 64, 2, 8), np.float32)
    with BlockPool(small, dram_blocks=0, ssd_path=tmp_path / "a") as a, \
            BlockPool(small, dram_blocks=0, ssd_path=tmp_path / "b") as b, \
            BlockPool(large, dram_blocks=0, ssd_path=tmp_path / "c") as c:
        paces = [pool._tiers[0].store._reader._pace for pool in (a, b, c)]
    assert paces[0] is paces[1] is shard_reader.pace_for(small.nbytes)
    assert paces[2] is shard_reader.pace_for(large.nbytes) is not paces[0]
    assert shard_reader.PACE not in paces
