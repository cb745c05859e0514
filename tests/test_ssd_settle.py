"""The SSD tier's ``settle`` when nothing changed since the last one (a batch read settles before every record):
it hands nothing to the writer thread, and it still writes out whatever did change."""

import shutil

import numpy as np

from mooncake_jax.transfer import BlockPool, BlockSpec

SPEC = BlockSpec((2, 2, 4, 2, 8), np.float32)


def block_of(key: int) -> np.ndarray:
    return np.random.default_rng(key).standard_normal(SPEC.shape).astype(np.float32)


def keys_in_a_copy(root, copy) -> list[int]:
    """The blocks another pool finds in a copy of the SSD directory taken now (as after a crash)."""
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(root, copy)
    with BlockPool(SPEC, dram_blocks=0, ssd_path=copy) as seen:
        return sorted(seen.keys())


def test_an_idle_settle_hands_nothing_over_and_a_removal_is_still_written(tmp_path, monkeypatch):
    root, copy = tmp_path / "ssd", tmp_path / "copy"
    with BlockPool(SPEC, dram_blocks=0, ssd_path=root) as pool:
        store = pool._tiers[0].store
        pool.put_many([1, 2, 3], [block_of(k) for k in (1, 2, 3)])
        handed = []
        real_submit = store._writer.submit
        monkeypatch.setattr(store._writer, "submit", lambda job: handed.append(job) or real_submit(job))
        assert store.settle() == [] and handed == []  # nothing since the call's own settle
        out = np.zeros((3, *SPEC.shape), np.float32)
        got = pool.get_many([1, 2, 3], out)  # settles before each of its three records
        assert handed == [] and all((g == block_of(k)).all() for g, k in zip(got, (1, 2, 3)))
        assert pool.remove(2)  # a record of the open shard: its head zeroed in memory, written at the next settle
        assert len(handed) == 0
        assert store.settle() == [] and len(handed) == 2  # the open shard's data index and its heads file
        assert keys_in_a_copy(root, copy) == [1, 3]
        assert pool.remove(1) and pool.remove(3)  # the open shard's last records: deleted at the next settle
        data_files = list((root / "data.zarr").glob("c.*"))
        assert len(data_files) == 1
        store.settle()
        assert not data_files[0].exists() and keys_in_a_copy(root, copy) == []
