"""The suite is hermetic: every cache the code under test writes goes under the session's temporary folder
(``conftest.SESSION_VARIABLES``), never into the user's home, so a run neither depends on what an earlier one left
nor leaves anything behind. A cluster started with the default ``compile_cache`` ("the user's cache directory")
is the case that used to write ``~/.cache/mooncake-jax/xla``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mooncake_jax as mj
from tiny_profile import PROFILE

TESTS = Path(__file__).resolve().parent
THIS = f"{Path(__file__).name}::test_a_cluster_with_the_default_compile_cache_writes_into_the_session_folder"


def test_a_cluster_with_the_default_compile_cache_writes_into_the_session_folder(tmp_path_factory):
    from mooncake_jax.model.compile_cache import default_cache_dir

    session = tmp_path_factory.getbasetemp()
    cache = default_cache_dir()
    assert cache.is_relative_to(session), (cache, session)
    with mj.Cluster.local("tiny", prefill=1, decode=1, warmup=False, profile_json=PROFILE) as cluster:
        assert len(cluster.generate([[3, 1, 4, 1, 5]], max_new_tokens=2)[0]) == 2
    assert any(cache.glob("*-cache")), f"no compiled program in {cache}"  # the cache was on, and there


def test_a_run_with_no_cache_folder_set_writes_nothing_into_home(tmp_path):
    """The test above in a pytest of its own whose HOME is an empty folder and whose environment names no cache
    folder: without the conftest's redirection JAX's cache would land in ``$HOME/.cache/mooncake-jax/xla``."""
    home, base = tmp_path / "home", tmp_path / "base"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "NUMBA_CACHE_DIR", "TMPDIR")}
    env["HOME"] = str(home)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={base}",
                          THIS], cwd=TESTS, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []
    assert any((base / "xdg_cache_home" / "mooncake-jax" / "xla").glob("*-cache"))
