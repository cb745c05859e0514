"""Host allocator tuning for the CPU backend.

XLA:CPU allocates every step's temporaries (gathered KV pages, attention scores) with the C library's malloc.
glibc serves blocks above 32 MiB with a fresh ``mmap`` and unmaps them on free, so every decode step page-faults
its whole working set again: measured here, a 33 MB gather ran at 2.4 GB/s instead of 17 GB/s. Keeping large
blocks on the heap (no mmap, no trimming) makes the memory of one step reusable by the next, the way a serving
engine wants it. The process keeps its peak heap size in exchange.

Every thread allocates from the main arena (``M_ARENA_MAX`` 1). XLA:CPU allocates a step's temporaries as one block
on the thread that runs the step, one of its own; glibc gives such a thread an arena of its own, whose heaps are at
most 64 MiB, so a larger block is mapped afresh and unmapped on free whatever the settings above: the 2,048-token
prefill of the ``small`` preset (a 140 MB block) faulted 33,000-35,000 pages and spent ~90 ms in the kernel per
call, none with one arena (docs/benchmarks/engine.md, AMD EPYC prefill, twentieth pass). A thread keeps the arena
it took at its first allocation, so this must run before JAX starts its backend's threads (``engine`` applies it
when imported). The pool's processes apply the same (``transfer/host_memory.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8


@functools.cache
def keep_large_blocks_on_heap() -> bool:
    """Tell glibc malloc to never mmap or trim, from one arena (once per process); False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_MAX, 0) == 1
    ok &= mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    ok &= mallopt(M_ARENA_MAX, 1) == 1
    return bool(ok)
