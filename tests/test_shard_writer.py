"""The SSD tier's data shard files as the tier writes them (buffered from the caller's arrays, or O_DIRECT from
aligned pieces): TensorStore's zarr3 sharding reads them back bit for bit, and checks their index's CRC32C."""

import errno
import os

import numpy as np
import pytest

from mooncake_jax.transfer import BlockPool, BlockSpec, shard_writer
from mooncake_jax.transfer.checksum import checksum
from mooncake_jax.transfer.files import _DATA_CONTEXT, DATA_DIR, open_array
from mooncake_jax.transfer.shard_file import chunk_offsets, crc32c, data_start, encode_index, index_bytes
from mooncake_jax.transfer.shard_writer import ALIGN, ShardWriter


def test_crc32c_is_castagnoli():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    assert crc32c(b"") == 0 and crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros


def test_index_lists_the_filled_slots_and_is_refused_when_damaged():
    index = encode_index(slots=4, start=100, chunk_bytes=10, filled=2)
    assert len(index) == index_bytes(4) == 68
    entries = np.frombuffer(index[:64], "<u8").reshape(4, 2)
    assert entries.tolist() == [[100, 10], [110, 10], [2**64 - 1, 2**64 - 1], [2**64 - 1, 2**64 - 1]]
    assert chunk_offsets(index, 4, 10).tolist() == [100, 110, -1, -1]
    damaged = bytearray(index)
    damaged[3] ^= 1
    assert chunk_offsets(bytes(damaged), 4, 10) is None and chunk_offsets(index[:-1], 4, 10) is None
    assert data_start(4, 4096) == 4096 and data_start(4, 1) == 68


@pytest.mark.parametrize("pages_per_piece", [3, 1], ids=["blocks-per-piece", "pieces-per-block"])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_shard_written_here_reads_back_through_tensorstore(tmp_path, monkeypatch, direct, pages_per_piece):
    """5,000-byte chunks in pieces of 3 pages (several chunks to a piece, straddling them) or of one page (a chunk
    in several pieces), a ring of 2 direct pieces, a last piece cut to the file's exact size; TensorStore reads
    every slot back, the unfilled ones as the fill value."""
    monkeypatch.setattr(shard_writer, "PIECE_BYTES", pages_per_piece * ALIGN)
    monkeypatch.setattr(shard_writer, "HAND_OFF_BYTES", pages_per_piece * ALIGN)  # buffered: handed over mid-shard
    monkeypatch.setattr(shard_writer, "PIECES", 2)
    width, slots, filled = 5000, 8, 5
    array = open_array(tmp_path / DATA_DIR, width, slots, _DATA_CONTEXT)
    chunks = [np.random.default_rng(i).integers(0, 256, width, dtype=np.uint8) for i in range(filled)]
    writer = ShardWriter(tmp_path / DATA_DIR, direct)
    image = writer.open(tmp_path / DATA_DIR / "c.1.0", slots, width)  # the shard of slots 8-15
    digests = [image.append(chunk) for chunk in chunks]
    image.finish().result()
    writer.close()
    assert writer.direct == direct
    size = (tmp_path / DATA_DIR / "c.1.0").stat().st_size
    assert size == data_start(slots, ALIGN) + filled * width  # the data page-aligned in both modes
    got = array[slots : 2 * slots].read().result()
    assert all((got[i] == chunks[i]).all() for i in range(filled)) and not got[filled:].any()
    assert digests == [checksum(chunk) for chunk in chunks]


def test_a_filesystem_refusing_o_direct_gets_the_same_shards_buffered(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(shard_writer.os, "open", no_direct)
    spec = BlockSpec((2, 2, 4, 2, 8), np.float32)
    blocks = [np.full(spec.shape, k, np.float32) for k in range(3)]
    with BlockPool(spec, dram_blocks=0, ssd_path=tmp_path, ssd_direct_io=True) as pool:
        pool.put_many([1, 2, 3], blocks)
        assert pool._tiers[0].store._writer.direct is False and "refuses O_DIRECT" in caplog.text
        assert all((pool.get(k) == blocks[k - 1]).all() for k in (1, 2, 3))


def test_direct_shards_survive_a_restart_and_a_damaged_block_is_a_miss(tmp_path):
    spec = BlockSpec((3, 2, 16, 2, 20), np.float32)  # 15,360 bytes: records not a multiple of a page
    blocks = {k: np.random.default_rng(k).standard_normal(spec.shape).astype(np.float32) for k in range(1, 6)}
    with BlockPool(spec, dram_blocks=0, ssd_path=tmp_path, ssd_direct_io=True) as pool:
        pool.put_many(list(blocks), list(blocks.values()))
    shard = tmp_path / DATA_DIR / "c.0.0"
    with open(shard, "r+b") as file:  # one bit of block 4's data (slot 3), past the aligned index
        file.seek(ALIGN + 3 * spec.nbytes + 77)
        byte = file.read(1)[0]
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte ^ 8]))
    with BlockPool(spec, dram_blocks=0, ssd_path=tmp_path, ssd_direct_io=True) as pool:
        assert sorted(pool.keys()) == [1, 2, 3, 4, 5]
        assert pool.get(4) is None and pool.counters()["ssd"].corrupt == 1
        assert all((pool.get(k) == blocks[k]).all() for k in (1, 2, 3, 5))


def test_a_tier_created_with_another_shard_size_keeps_it(tmp_path, monkeypatch):
    """An SSD directory from a build with smaller shards opens with its own shard size: its blocks read back, new
    ones are stored beside them, and a restart finds them all."""
    from mooncake_jax.transfer import files

    spec = BlockSpec((2, 2, 4, 2, 8), np.float32)
    blocks = {k: np.full(spec.shape, k, np.float32) for k in range(1, 9)}
    monkeypatch.setattr(files, "SHARD_BYTES", 3 * files.record_bytes(spec))
    with BlockPool(spec, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many([1, 2, 3, 4], [blocks[k] for k in (1, 2, 3, 4)])
        assert pool._tiers[0].store.shard_slots == 3
    monkeypatch.undo()
    with BlockPool(spec, dram_blocks=0, ssd_path=tmp_path) as pool:
        assert pool._tiers[0].store.shard_slots == 3
        pool.put_many([5, 6, 7, 8], [blocks[k] for k in (5, 6, 7, 8)])
    with BlockPool(spec, dram_blocks=0, ssd_path=tmp_path) as pool:
        assert sorted(pool.keys()) == list(blocks) and all((pool.get(k) == b).all() for k, b in blocks.items())
    assert files.slots_per_shard(files.record_bytes(spec)) == files.MAX_SHARD_SLOTS  # what a new tier would take


def test_closing_a_pool_closes_its_shard_files(tmp_path):
    """The open shard is written at every call and kept open between them; closing the pool closes its file."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd")
    spec = BlockSpec((2, 2, 4, 2, 8), np.float32)
    before = len(os.listdir("/proc/self/fd"))
    for i in range(5):
        with BlockPool(spec, dram_blocks=0, ssd_path=tmp_path) as pool:
            pool.put(100 + i, np.full(spec.shape, i, np.float32))
            assert pool.get(100 + i) is not None  # a call that writes nothing: the shard is not written again
    assert len(os.listdir("/proc/self/fd")) == before
