"""Short scheduler slices for the processes a token passes through (the decode instance, the gateway).

On a host whose cores are shared (a local cluster: prefill and decode instances, the gateway and its clients on the
same cores, often beside other work), a token's trip from the decode step to the client is four or five thread
hand-offs (engine thread, the Decode stream's gRPC thread, the gateway's stream reader, its event loop, the
client), and every hand-off is a wake-up that waits in a run queue behind whatever holds the core: a prefill's XLA
threads run for tens of milliseconds at a time. Measured in the demo (tbt12, Intel Xeon (207) 2 cores, load 5-6,
docs/benchmarks/demo.md eleventh pass): the decode engine thread waited 434 ms in run queues inside its 33 slowest
steps (1,103 ms), and the gateway's event loop 542 ms in its 192 late wake-ups.

Linux's EEVDF scheduler (6.6+; a slice per task since 6.12) serves a task with a shorter slice sooner after it wakes
(an earlier virtual deadline; with ``PREEMPT_SHORT`` it preempts the running task) without giving it a larger share
of the CPU: its weight (niceness) is unchanged. So a short slice suits threads that run briefly and often and wait
for nothing but a core: a latency tool, not a priority. ``shorten_slices`` sets it for every thread of this process;
threads created later inherit it. Elsewhere (another OS, a kernel that ignores the field) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import sys
import threading

log = logging.getLogger(__name__)

LATENCY_SLICE_NS = 100_000
"""Slice of the token path's threads: 0.1 ms, the shortest Linux accepts (the default is 0.75 ms times 1 + log2 of
the core count, 1.4 ms on two cores)."""

_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
_SYS_SCHED_GETATTR = {"x86_64": 315, "aarch64": 275}
_ATTR = struct.Struct("IIQiIQQQII")  # struct sched_attr (SCHED_ATTR_SIZE_VER1, 56 bytes)


def _syscalls() -> tuple[int, int] | None:
    machine = os.uname().machine if hasattr(os, "uname") else ""
    if not sys.platform.startswith("linux") or machine not in _SYS_SCHED_SETATTR:
        return None
    return _SYS_SCHED_SETATTR[machine], _SYS_SCHED_GETATTR[machine]


def thread_slice_ns(tid: int = 0) -> int | None:
    """The scheduler slice of thread ``tid`` (0: the calling thread) in ns, or None where it cannot be read."""
    calls = _syscalls()
    if calls is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(_ATTR.size)
    if libc.syscall(calls[1], tid, buf, _ATTR.size, 0) != 0:
        return None
    return _ATTR.unpack(buf.raw)[5]


def _set_slice(libc, setattr_call: int, tid: int, slice_ns: int) -> bool:
    try:
        nice = os.getpriority(os.PRIO_PROCESS, tid)  # sched_setattr sets the niceness too: keep it
    except OSError:
        return False  # the thread ended meanwhile
    attr = _ATTR.pack(_ATTR.size, os.SCHED_OTHER, 0, nice, 0, slice_ns, 0, 0, 0, 0)
    return libc.syscall(setattr_call, tid, ctypes.c_char_p(attr), 0) == 0


def shorten_slices(slice_ns: int = LATENCY_SLICE_NS) -> int:
    """Give every thread of this process (and, by inheritance, the threads it creates from now on) a scheduler slice
    of ``slice_ns``; returns how many threads took it (0 where the platform has no per-task slice). Threads under
    another policy than the normal one (real-time, SCHED_IDLE) are left as they are."""
    if not 100_000 <= slice_ns <= 100_000_000:
        raise ValueError(f"slice_ns must be within Linux's 100,000-100,000,000 ns, got {slice_ns}")
    calls = _syscalls()
    if calls is None:
        return 0
    from .cpus import threads_of

    libc = ctypes.CDLL(None, use_errno=True)
    me = threading.get_native_id()
    tids = [me] + [t for t in threads_of(os.getpid()) if t != me]
    done = 0
    for tid in tids:
        try:
            if os.sched_getscheduler(tid) != os.SCHED_OTHER:
                continue
        except OSError:  # the thread ended meanwhile
            continue
        if _set_slice(libc, calls[0], tid, slice_ns):
            done += 1
    if not done:
        log.warning("could not shorten this process's scheduler slices: %s", os.strerror(ctypes.get_errno()))
    return done
