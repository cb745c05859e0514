"""A settle writes the open shard's heads file on the caller's thread (beside the writer thread's last data writes,
instead of after them); a failure there is reported as a failed write on the thread is: the call's blocks fail
with the error, nothing of them is held, and later calls store as before."""

import os
import threading

import numpy as np
import pytest

from mooncake_jax.transfer import BlockPool, BlockSpec, shard_writer

SPEC = BlockSpec((2, 2, 4, 2, 8), np.float32)


def block_of(key: int) -> np.ndarray:
    return np.random.default_rng(key).standard_normal(SPEC.shape).astype(np.float32)


def heads_writes(monkeypatch, fail: bool) -> list[str]:
    """Patch the shard writer's writes: record the thread of each heads-file write, and fail the first if asked."""
    real, seen = shard_writer._write_all, []

    def write_all(fd, buffers, offset):
        if "/heads.zarr/" in os.readlink(f"/proc/self/fd/{fd}"):
            seen.append(threading.current_thread().name)
            if fail and len(seen) == 1:
                raise OSError(28, "No space left on device")
        return real(fd, buffers, offset)

    monkeypatch.setattr(shard_writer, "_write_all", write_all)
    return seen


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux's /proc to tell the files apart")
def test_a_settle_writes_the_heads_on_the_callers_thread(tmp_path, monkeypatch):
    seen = heads_writes(monkeypatch, fail=False)
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as pool:
        pool.put_many([1, 2], [block_of(1), block_of(2)])
        assert seen and all(name == threading.current_thread().name for name in seen)
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as reopened:  # the heads were written, and list both
        assert sorted(reopened.keys()) == [1, 2]
        assert all((reopened.get(k) == block_of(k)).all() for k in (1, 2))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux's /proc to tell the files apart")
def test_a_failed_heads_write_at_settle_fails_the_calls_blocks(tmp_path, monkeypatch):
    seen = heads_writes(monkeypatch, fail=True)
    pool = BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path)
    with pytest.raises(OSError, match="No space left"):
        pool.put_many([1, 2], [block_of(1), block_of(2)])
    assert seen == [threading.current_thread().name]
    assert 1 not in pool and 2 not in pool and pool.get(1) is None
    pool.put_many([3, 4], [block_of(3), block_of(4)])  # once the disk has room again
    assert (pool.get(3) == block_of(3)).all() and (pool.get(4) == block_of(4)).all()
    pool.close()
    with BlockPool(SPEC, dram_blocks=0, ssd_path=tmp_path) as reopened:
        assert sorted(reopened.keys()) == [3, 4]
