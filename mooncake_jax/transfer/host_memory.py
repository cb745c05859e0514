"""Keeping freed buffers in the heap of a pool's process instead of handing them back to the kernel.

Every block the pool moves passes through transient multi-MiB buffers the pool does not control: TensorStore's
encoder copies each chunk it writes into a buffer of its own, gRPC hands each received message over as a fresh
``bytes``, and a sender copies a record into one. glibc serves an allocation over its mmap threshold (128 KiB at
first, rising with frees to at most 32 MiB) with a fresh mapping that it unmaps when freed, and gives the top of the
heap back above its trim threshold, so such a buffer usually lands on pages the kernel must fault in and zero first:
an SSD put of 16-token blocks faulted 152,000 pages per GB written (62% of the pages it wrote), and page faults with
their clear_page were about 15-20% of its CPU (perf). With the mmap threshold at 256 MiB and the trim threshold at
512 MiB the freed buffers are reused: 7,900 faults per GB for 16-token blocks, 85,000 -> 20,000 for 128-token
blocks, 134,000 -> 61,000 for a 70B block of 160 MiB (docs/benchmarks/pool.md). The cost is memory the process keeps
after a burst: at most the trim threshold at the heap's top, which is small beside a pool's own preallocated slabs.

Every thread allocates from one arena (``M_ARENA_MAX`` 1): glibc gives each thread that allocates at once an arena
of its own, in heaps of 64 MiB mapped apart from the main heap, and unmaps such a heap when it empties, whatever the
trim threshold. A received message the DRAM tier keeps (``slots.py``) was allocated by gRPC's receiving thread and is
freed when the pool lets its last record go: when a pool let many go at once (a fetch's sink emptied between rounds),
their heaps were unmapped and the next messages landed on fresh pages, 118,000-177,000 faults per GB fetched and 1.39-
1.42 CPU s/GB at the client against 130-540 faults and 0.89-1.01 s/GB with one arena (issue 15 ninth pass). Python
allocates under its GIL anyway, so one arena's lock costs little.

The settings are process-wide and glibc's (``mallopt``); elsewhere they are skipped. ``BlockPool`` applies them
once, as early as it can: an arena already made stays in use by its threads.
"""

from __future__ import annotations

import ctypes
import threading

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 256 << 20
"""Allocations below this come from the heap (and are reused when freed): a 70B block of 160 MiB included."""
FALLBACK_MMAP_THRESHOLD_BYTES = 32 << 20
"""What a glibc that refuses the above takes (older ones cap the threshold at half their 64 MiB heap size)."""
TRIM_THRESHOLD_BYTES = 512 << 20
"""Free memory at the heap's top kept for reuse, up to this much."""

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_buffers() -> bool:
    """Make this process's allocator keep and reuse freed buffers (once per process); True if it is glibc's and
    took the setting, False where there is no ``mallopt``."""
    global _applied
    with _lock:
        if _applied is None:
            try:
                mallopt = ctypes.CDLL(None).mallopt
            except (OSError, AttributeError):  # not glibc: its allocator keeps its own policy
                _applied = False
            else:
                mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
                mapped = any(mallopt(M_MMAP_THRESHOLD, limit)
                             for limit in (MMAP_THRESHOLD_BYTES, FALLBACK_MMAP_THRESHOLD_BYTES))
                one_arena = bool(mallopt(M_ARENA_MAX, 1))
                _applied = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and mapped and one_arena
        return _applied
