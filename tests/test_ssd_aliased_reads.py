"""The SSD tier never asks the kernel to copy a record to a destination 1-63 bytes past its page-cache source
(modulo a page), where ``rep movsb`` costs 4-8x on the AMD EPYC measured: such a read goes through a bounce
buffer, and lands the same bytes with the same checksum as a direct one (docs/benchmarks/pool.md, eighteenth
pass)."""

import mmap
import os

import numpy as np
import pytest
import xxhash

from mooncake_jax.transfer import BlockPool, BlockSpec, shard_reader
from mooncake_jax.transfer.checksum import split_digest
from mooncake_jax.transfer.shard_reader import PAGE_BYTES, aliased, read_with_checksum

SPEC = BlockSpec((2, 2, 16, 2, 64), np.float32)  # 32 KiB blocks


def at_page_offset(nbytes: int, offset: int) -> tuple[mmap.mmap, np.ndarray]:
    """A zeroed flat uint8 buffer of ``nbytes`` starting ``offset`` bytes into a page (and the mapping it lies in)."""
    mapping = mmap.mmap(-1, nbytes + 2 * PAGE_BYTES)
    buffer = np.frombuffer(mapping, np.uint8)
    return mapping, buffer[offset : offset + nbytes]


@pytest.fixture
def kernel_copies(monkeypatch):
    """Every ``os.preadv`` the reader makes, as ``(destination address, file offset)``."""
    seen: list[tuple[int, int]] = []
    preadv = os.preadv

    def recording(fd, buffers, offset, *flags):
        for buffer in buffers:
            seen.append((np.frombuffer(buffer, np.uint8).ctypes.data, offset))
        return preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(shard_reader.os, "preadv", recording)
    return seen


def test_aliased_is_a_destination_just_past_its_source_modulo_a_page():
    assert [aliased(PAGE_BYTES * 7 + d, PAGE_BYTES * 3) for d in (0, 1, 16, 31, 63, 64, 2048, PAGE_BYTES - 16)] == [
        False, True, True, True, True, False, False, False]
    assert aliased(100 + 16, 100) and not aliased(100, 100 + 16)  # the distance, not either address alone


@pytest.mark.parametrize("size", [1000, shard_reader.ONE_READ_BYTES, shard_reader.READ_STEP_BYTES * 2 + 4100])
@pytest.mark.parametrize("page_offset", [0, 1, 16, 31, 48, 64, 2048])
def test_a_read_at_any_distance_is_the_bytes_and_their_hash_without_an_aliased_kernel_copy(
        tmp_path, kernel_copies, size, page_offset):
    data = np.random.default_rng(size + page_offset).integers(0, 256, PAGE_BYTES + size, dtype=np.uint8)
    path = tmp_path / "shard"
    path.write_bytes(data.tobytes())
    mapping, out = at_page_offset(size, page_offset)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert read_with_checksum(fd, out, PAGE_BYTES) == split_digest(xxhash.xxh3_128_intdigest(data[PAGE_BYTES:]))
        assert (out == data[PAGE_BYTES:]).all()
        assert kernel_copies and not any(aliased(*copy) for copy in kernel_copies)
        assert read_with_checksum(fd, out, PAGE_BYTES + 1) is None  # the file ends first, bounced or not
    finally:
        os.close(fd)
        del out
        mapping.close()


def test_a_batch_get_into_a_staging_buffer_16_bytes_into_a_page(tmp_path, kernel_copies):
    """Where numpy puts a large array (glibc's ``mmap``-ed chunks start 16 bytes into a page): every block comes
    back bit for bit and verified, and no kernel copy lands 1-63 bytes past its source."""
    keys = list(range(1, 9))
    blocks = [np.random.default_rng(k).standard_normal(SPEC.shape).astype(np.float32) for k in keys]
    mapping, flat = at_page_offset(len(keys) * SPEC.nbytes, 16)
    staging = flat.view(np.float32).reshape(len(keys), *SPEC.shape)
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, blocks)
        kernel_copies.clear()
        got = pool.get_many(keys, staging)
        assert all(g is not None and np.array_equal(g, b) for g, b in zip(got, blocks))
        assert pool.counters()["ssd"].corrupt == 0
    assert kernel_copies and not any(aliased(*copy) for copy in kernel_copies)
    del got, staging, flat
    mapping.close()


def test_blocks_a_get_allocates_start_at_a_page_and_are_read_straight_in(tmp_path, kernel_copies):
    """Without ``out`` the pool allocates each block page-aligned, where the kernel copies a record at full speed
    (no bounce): every kernel copy lands in a returned block, page-aligned, and the blocks are bit for bit."""
    keys = list(range(1, 6))
    blocks = [np.random.default_rng(k).standard_normal(SPEC.shape).astype(np.float32) for k in keys]
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many(keys, blocks)
        kernel_copies.clear()
        got = pool.get_many(keys)
    assert all(np.array_equal(g, b) and not g.flags.writeable for g, b in zip(got, blocks))
    starts = {g.ctypes.data for g in got}
    assert all(start % PAGE_BYTES == 0 for start in starts)
    assert {at for at, _ in kernel_copies} == starts  # read straight into them, not through the bounce buffer
