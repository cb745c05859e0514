"""Paged-attention kernels for XLA:CPU, compiled from C++ at first use and called as XLA FFI custom calls.

Why: on CPU the xla implementation's decode attention gathers every context page into a copy, then multiplies it in
small products XLA:CPU runs on one thread (about 40 ms of a 92-96 ms batch-32 step of the ``small`` preset, against
about 21 ms to read the KV once at the measured copy bandwidth; docs/benchmarks/engine.md); its prefill attention
copies every query block's key prefix before each product (XLA:CPU's library dots read no slice in place). The
kernels (``paged_attention.cc``) read the pages in place through the page table, on XLA's intra-op thread pool:
decode reads each sequence's keys and values once; prefill is a flash-attention loop over key blocks with
register-tiled products.

The library is built with the C++ compiler found on ``PATH`` (``c++``, ``g++`` or ``clang++``) against the FFI
headers that ship with jaxlib, for this machine's CPU (``-march=native``), into the user's cache directory
(``~/.cache/mooncake-jax/kernels``, or under ``$XDG_CACHE_HOME``); the file name holds a hash of the source, the
flags, jaxlib's version and the CPU, so a changed source or another machine sharing the home directory builds its
own. ``available()`` says whether it could be built and registered, and why not (``unavailable_reason()``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from ..compile_cache import user_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.cc")
DECODE, PREFILL = "mooncake_paged_decode", "mooncake_paged_prefill"
"""FFI target names (platform ``cpu``) of the two kernels."""
TARGETS = {DECODE: "MooncakePagedDecode", PREFILL: "MooncakePagedPrefill"}
"""Each target's handler symbol in the library."""

FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
COMPILERS = ("c++", "g++", "clang++")
BUILD_TIMEOUT_S = 300


def cache_dir() -> Path:
    return user_cache_dir() / "kernels"


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what ``-march=native`` compiles for), or the platform's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep)))


def library_path() -> Path:
    import jaxlib

    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(),
                 _cpu_identity().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"


def _build(out: Path) -> None:
    compiler = next((c for c in COMPILERS if shutil.which(c)), None)
    if compiler is None:
        raise RuntimeError(f"no C++ compiler on PATH (looked for {', '.join(COMPILERS)})")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes building at once each rename a whole library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def _build_lock(path: Path):
    """An exclusive lock on ``path``'s folder while one process builds (no lock where ``fcntl`` is missing)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@functools.lru_cache(maxsize=1)
def _load() -> str | None:
    """Build (once per source and machine) and register the kernels; None when it worked, else the reason."""
    import ctypes

    try:
        path = library_path()
        if not path.exists():
            with _build_lock(path):  # processes starting together (a local cluster) build it once
                if not path.exists():
                    _build(path)
        lib = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as exc:  # noqa: BLE001 - any failure leaves the kernel unavailable, with the reason kept
        return f"{type(exc).__name__}: {exc}"
    return None


_warned: list[str] = []  # the reason, once it was logged


def available(log_failure: bool = False) -> bool:
    """Whether the kernels are built and registered (building them the first time this is asked); ``log_failure``:
    say why not in a warning (once per process)."""
    reason = _load()
    if reason is not None and log_failure and not _warned:
        _warned.append(reason)
        log.warning("the CPU paged-attention kernels are unavailable, attention runs on the xla "
                    "implementation: %s", reason)
    return reason is None


def unavailable_reason() -> str | None:
    return _load()


CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16))
"""Cache dtypes the kernels read: float32, and bfloat16 as itself or as its stored ``uint16`` bits."""


def reads(cache_dtype) -> bool:
    """Whether the kernels read a cache stored as ``cache_dtype`` (not float16, nor its int16 bits)."""
    return jnp.dtype(cache_dtype) in CACHE_DTYPES


def _call(target: str, out_shape, *operands) -> jax.Array:
    reason = _load()
    if reason is not None:
        raise RuntimeError(f"the CPU paged-attention kernels are unavailable: {reason}")
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32), vmap_method="sequential")(
        *operands)


def _cache(k_pages, v_pages):
    if not reads(k_pages.dtype):
        raise ValueError(f"the CPU paged-attention kernels read a float32 or bfloat16 cache, got {k_pages.dtype}")
    return k_pages, v_pages


def paged_decode(q, k_new, v_new, k_pages, v_pages, page_table, ctx_len) -> jax.Array:
    """Decode attention of one token per sequence: q [B, H, G, D] (scaled), k_new / v_new [B, H, D], pages
    [H, rows, bs, D], page_table [B, P] (int32 rows), ctx_len [B] -> [B, H, G, D] float32 (the new token
    attends its ``ctx_len`` cached tokens and itself)."""
    f32, i32 = jnp.float32, jnp.int32
    return _call(DECODE, q.shape, q.astype(f32), k_new.astype(f32), v_new.astype(f32), *_cache(k_pages, v_pages),
                 page_table.astype(i32), ctx_len.astype(i32))


def paged_prefill(q, k_pages, v_pages, page_table, ctx_len) -> jax.Array:
    """Causal attention of T new tokens per sequence whose K/V are already in their pages: q [B, T, H, G, D]
    (scaled), page_table [B, W] covering ``ctx_len + T`` tokens -> [B, T, H, G, D] float32 (new token i attends
    the ``ctx_len`` cached tokens and new tokens 0..i)."""
    return _call(PREFILL, q.shape, q.astype(jnp.float32), *_cache(k_pages, v_pages), page_table.astype(jnp.int32),
                 ctx_len.astype(jnp.int32))
