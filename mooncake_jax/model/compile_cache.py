"""JAX's persistent compilation cache, for servers that restart and for cluster processes sharing one machine.

A serving engine compiles one program per step shape; on a CPU each takes about a second. With the cache on disk,
a restarted instance (or a second instance process of the same model) loads them instead of compiling again.
The default folder is the user's cache directory (``$XDG_CACHE_HOME`` or ``~/.cache``) under ``mooncake-jax/xla``.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax


def user_cache_dir() -> Path:
    """This project's folder in the user's cache directory (compiled programs, built kernels)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mooncake-jax"


def default_cache_dir() -> Path:
    return user_cache_dir() / "xla"


def enable_compilation_cache(directory: str | Path | None = None) -> Path:
    """Cache every compiled program (however quick to compile) in ``directory``; returns the folder used."""
    path = Path(directory) if directory is not None else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
