"""The streaming copy (non-temporal stores compiled by llvmlite) and the copy-and-hash built on it: every byte lands,
nothing outside the destination is written, the checksum is XXH3-128 of the bytes (checked against xxhash on a
``bytes`` copy), bad arguments are refused before any raw write, and a machine that cannot build the kernel gets
the plain copy with the same bytes and checksum."""

import logging

import numpy as np
import pytest
import xxhash

from mooncake_jax.transfer import BlockPool, BlockSpec, checksum, stream_copy
from mooncake_jax.transfer.checksum import STREAM_CHUNK_BYTES, copy_with_checksum
from mooncake_jax.transfer.stream_copy import address, streaming_copy

GUARD = 200  # bytes either side of a destination that must stay untouched


def digest_of(data: np.ndarray) -> tuple[int, int]:
    value = xxhash.xxh3_128_intdigest(data.tobytes())
    return value >> 64, value & ((1 << 64) - 1)


def test_the_kernel_is_built_here():
    """On the x86-64 and aarch64 hosts this project runs on, llvmlite (numba's) builds the kernel: a silent
    fallback would hide the put's speed, so its absence fails here."""
    assert streaming_copy() is not None


@pytest.mark.parametrize("seed", range(4))
def test_streaming_copy_lands_every_byte_at_any_alignment(seed):
    copy = streaming_copy()
    rng = np.random.default_rng(seed)
    for _ in range(60):
        n = int(rng.choice([0, 1, 63, 64, 65, 127, 128, 129, int(rng.integers(0, 9000))]))
        src_offset, dst_offset = (int(x) for x in rng.integers(0, 64, 2))
        src = rng.integers(0, 256, n + 64, dtype=np.uint8)
        dst = np.full(n + 64 + 2 * GUARD, 0x5A, np.uint8)
        copy(address(dst) + GUARD + dst_offset, address(src) + src_offset, n)
        inside = dst[GUARD + dst_offset : GUARD + dst_offset + n]
        assert np.array_equal(inside, src[src_offset : src_offset + n])
        outside = np.concatenate([dst[: GUARD + dst_offset], dst[GUARD + dst_offset + n :]])
        assert (outside == 0x5A).all()


@pytest.mark.parametrize("size", [0, 1, 1000, STREAM_CHUNK_BYTES - 1, STREAM_CHUNK_BYTES, STREAM_CHUNK_BYTES + 1,
                                  3 * STREAM_CHUNK_BYTES + 4099])
@pytest.mark.parametrize("dst_offset", [0, 1, 40])
def test_copy_with_checksum_streams_bit_exact_with_xxh3_of_the_bytes(size, dst_offset):
    src = np.random.default_rng(size).integers(0, 256, size + 3, dtype=np.uint8)[3:]  # unaligned source too
    buffer = np.full(size + dst_offset + GUARD, 0x77, np.uint8)
    dst = buffer[dst_offset : dst_offset + size]
    assert copy_with_checksum(dst, src) == digest_of(src)
    assert np.array_equal(dst, src)
    assert (buffer[:dst_offset] == 0x77).all() and (buffer[dst_offset + size :] == 0x77).all()
    plain = np.zeros_like(src)
    assert copy_with_checksum(plain, src, stream=False) == digest_of(src) and np.array_equal(plain, src)


def test_copy_with_checksum_refuses_what_would_write_out_of_bounds():
    src = np.arange(4096, dtype=np.uint8)
    with pytest.raises(ValueError, match="4096 bytes .* into 4095 bytes"):
        copy_with_checksum(np.zeros(4095, np.uint8), src)
    with pytest.raises(ValueError, match="float32"):
        copy_with_checksum(np.zeros(1024, np.float32), src)
    with pytest.raises(ValueError, match="C-contiguous"):
        copy_with_checksum(np.zeros(8192, np.uint8)[::2], src)
    read_only = np.zeros(4096, np.uint8)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        copy_with_checksum(read_only, src)
    assert not read_only.any()


def test_without_the_kernel_the_plain_copy_gives_the_same_bytes_and_checksum(monkeypatch, caplog):
    """A machine where the kernel cannot be built: one log line, then ``np.copyto`` (same bytes, same XXH3), and a
    pool works as before."""
    def broken() -> None:
        raise RuntimeError("no code generator here")

    monkeypatch.setattr(stream_copy, "_compile", broken)
    monkeypatch.setattr(stream_copy, "_built", [])
    with caplog.at_level(logging.WARNING):
        assert streaming_copy() is None and streaming_copy() is None
    assert sum("streaming copy unavailable" in r.getMessage() for r in caplog.records) == 1
    src = np.random.default_rng(1).integers(0, 256, 3 * STREAM_CHUNK_BYTES + 5, dtype=np.uint8)
    dst = np.zeros_like(src)
    assert checksum.copy_with_checksum(dst, src) == digest_of(src) and np.array_equal(dst, src)
    spec = BlockSpec((2, 2, 16, 2, 8), np.float32)
    block = np.random.default_rng(2).standard_normal(spec.shape).astype(np.float32)
    with BlockPool(spec, dram_blocks=2) as pool:
        pool.put(5, block)
        assert pool.get(5).tobytes() == block.tobytes()


def test_threads_asking_first_at_once_get_one_kernel(monkeypatch):
    """The kernel is built once, and every thread gets that one, however many threads ask for it first."""
    import threading

    calls = []
    real = stream_copy._compile

    def counted():
        calls.append(1)
        return real()

    monkeypatch.setattr(stream_copy, "_compile", counted)
    monkeypatch.setattr(stream_copy, "_built", [])
    got = []
    threads = [threading.Thread(target=lambda: got.append(streaming_copy())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(got) == 8 and all(copy is got[0] is not None for copy in got)


@pytest.mark.parametrize("shape", [(2, 2, 16, 2, 8), (3, 2, 64, 4, 257)])  # 4 KiB; ~1.5 MiB, several chunks, odd
def test_streamed_puts_and_gets_round_trip_and_catch_a_flipped_bit(shape):
    """Blocks put (streamed into slots) and got back (streamed into the staging buffer above 1 MiB) are
    bit-exact; a bit flipped in a slot after the put is caught by the get's hash of the slot and never served."""
    spec = BlockSpec(shape, np.float32)
    blocks = {key: np.random.default_rng(key).standard_normal(shape).astype(np.float32) for key in (1, 2, 3)}
    with BlockPool(spec, dram_blocks=3) as pool:
        pool.put_many(list(blocks), list(blocks.values()))
        staging = np.zeros((3, *shape), np.float32)
        got = pool.get_many([1, 2, 3], staging)
        assert all(got[i].tobytes() == blocks[k].tobytes() for i, k in enumerate((1, 2, 3)))
        slot = pool._tiers[0].store._slot_of[2]
        slot.data[slot.data.size // 2] ^= 0x10
        assert pool.get(2) is None and pool.stats()["dram"]["corrupt"] == 1
        assert pool.get(3).tobytes() == blocks[3].tobytes()
