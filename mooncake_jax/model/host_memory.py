"""Host allocator tuning for the CPU backend.

XLA:CPU allocates every step's temporaries (gathered KV pages, attention scores) with the C library's malloc.
glibc serves blocks above 32 MiB with a fresh ``mmap`` and unmaps them on free, so every decode step page-faults
its whole working set again: measured here, a 33 MB gather ran at 2.4 GB/s instead of 17 GB/s. Keeping large
blocks on the heap (no mmap, no trimming) makes the memory of one step reusable by the next, the way a serving
engine wants it. The process keeps its peak heap size in exchange.

One malloc arena for every thread (``share_one_arena``, ``M_ARENA_MAX`` 1) is a separate choice, made by a process
that runs long prefills, before JAX starts its backend's threads. XLA:CPU allocates a step's temporaries as one
block on the thread that runs the step, one of its own; glibc gives such a thread an arena of its own, whose heaps
are at most 64 MiB, so a larger block is mapped afresh and unmapped on free whatever the settings above: the
2,048-token prefill of the ``small`` preset (a 140 MB block) faulted 33,000-35,000 pages and spent ~90 ms in the
kernel per call, none with one arena (docs/benchmarks/engine.md, AMD EPYC prefill, twentieth pass). It is not the
default: every thread then takes the one arena's lock, and its bins hold every thread's blocks, so a step's small
allocations cost more (AMD EPYC, 2 cores, ``benchmarks/decode_arena_ab.py``, fresh processes alternated: the
``tiny`` batch-1 decode step 0.89-1.11 ms against 0.68-0.79 at its fastest and 1.77x the CPU, the ``small`` one
15.4-15.7 against 14.5-15.1 ms; docs/benchmarks/demo.md, "TBT tail, nineteenth session"). A decode step's
temporaries (a few MiB) fit a thread's own heap, so a decode process gains nothing for that cost. Prefill instances
share one arena (``instance/main.py``); a process that does both (``mj.LLM``) keeps an arena per thread; the pool's
processes keep freed buffers their own way (``transfer/host_memory.py``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8


def _mallopt():
    """glibc's ``mallopt``, or None where there is no glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt


@functools.cache
def keep_large_blocks_on_heap() -> bool:
    """Tell glibc malloc to never mmap or trim (once per process; it holds from then on, for every thread); False
    where there is no glibc."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0) == 1) & bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1)


@functools.cache
def share_one_arena() -> bool:
    """Every thread that allocates for the first time from now on takes the main malloc arena (once per process):
    call it before JAX starts its backend's threads, in a process whose steps' temporaries outgrow a thread arena's
    64 MiB heaps (long prefills; see the module docstring for what it costs elsewhere). Also keeps large blocks on
    the heap, which it is useless without. False where there is no glibc."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return keep_large_blocks_on_heap() & bool(mallopt(M_ARENA_MAX, 1) == 1)
