"""The suite is hermetic: every cache and temporary folder the code under test writes goes under the session's
temporary folder (``conftest.SESSION_VARIABLES``), never into the user's home, so a run neither depends on what an
earlier one left nor leaves anything behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
UNSET = ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "NUMBA_CACHE_DIR", "MPLCONFIGDIR", "TMPDIR")


@pytest.mark.slow  # a whole pytest session with a cluster: 20-45 s; the suite's hermetic set-up is conftest's
def test_a_cluster_test_run_with_no_cache_folder_set_writes_nothing_into_home(tmp_path):
    """``hermetic_probe.py`` (a cluster with the default compile cache, a plot) in a pytest of its own whose HOME is
    an empty folder and whose environment names no cache, config or temporary folder: without the conftest's
    redirection JAX's cache lands in ``$HOME/.cache/mooncake-jax/xla`` and matplotlib's in ``$HOME/.config``."""
    home, base = tmp_path / "home", tmp_path / "base"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env["HOME"] = str(home)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={base}",
                          "hermetic_probe.py"], cwd=TESTS, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 passed" in run.stdout
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []
    assert any((base / "xdg_cache_home" / "mooncake-jax" / "xla").glob("*-cache"))
