"""The memory-mapping guard: a process about to run out of the mappings XLA:CPU programs use gets a clear error (the
in-process ``demo --hetero`` used to abort inside LLVM at ~61,000 of the kernel's 65,530)."""

import argparse

import pytest

from mooncake_jax import demo
from mooncake_jax.model import map_budget
from mooncake_jax.model.map_budget import MapBudgetExhausted, check_map_headroom


def test_headroom_arithmetic(tmp_path, monkeypatch):
    """Given readings are always checked; the engines' own reading is taken at most every CHECK_EVERY_S."""
    check_map_headroom(limit=1000, in_use=900)  # 90% in use: the 10% headroom is still there
    with pytest.raises(MapBudgetExhausted, match=r"901 memory mappings of the 1,000 .*vm\.max_map_count"):
        check_map_headroom(limit=1000, in_use=901)
    monkeypatch.setattr(map_budget, "MAX_MAP_COUNT", tmp_path / "absent")  # no /proc to read (not Linux)
    check_map_headroom(in_use=10**9)
    monkeypatch.setattr(map_budget, "MAX_MAP_COUNT", tmp_path / "one")
    (tmp_path / "one").write_text("1")
    monkeypatch.setattr(map_budget, "_next_check", 0.0)
    with pytest.raises(MapBudgetExhausted):
        check_map_headroom()  # read now
    check_map_headroom()  # not read again within CHECK_EVERY_S


def test_readings_of_this_process():
    limit, in_use = map_budget.map_limit(), map_budget.maps_in_use()
    if limit is None:
        pytest.skip("no /proc/sys/vm/max_map_count here")
    with open("/proc/self/maps") as f:
        lines = len(f.readlines())
    assert 0 < in_use and abs(in_use - lines) < 50  # the same count, give or take this test's own allocations
    assert limit >= 1000


def test_demo_says_so_instead_of_crashing(tmp_path, monkeypatch, capsys):
    """With the limit read as just above what the process holds, the first instance's warm-up stops with the error,
    the cluster is taken down and the demo exits 2 with the message: no segfault, no hang."""
    if map_budget.maps_in_use() is None:
        pytest.skip("no /proc/self/maps here")
    limit = tmp_path / "max_map_count"
    limit.write_text(str(map_budget.maps_in_use() + 10))
    monkeypatch.setattr(map_budget, "MAX_MAP_COUNT", limit)
    monkeypatch.setattr(map_budget, "_next_check", 0.0)  # read at the first program, whatever ran before
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.run(parser.parse_args(["--in-process", "--requests", "1", "--prefill", "1"])) == 2
    assert "vm.max_map_count" in capsys.readouterr().err
